"""The expandable_segments lever sets what torch reads, and never silently loses to the operator's.

torch (c10/core/AllocatorConfig.cpp, ``AcceleratorAllocatorConfig::instance``; 2.13 here) parses
``PYTORCH_ALLOC_CONF`` when it is set and then stops: ``PYTORCH_CUDA_ALLOC_CONF`` is read only
when ``PYTORCH_ALLOC_CONF`` is absent (older torch reads only ``PYTORCH_CUDA_ALLOC_CONF``), and
``expandable_segments`` lives in that config. So the lever writes both names, and the value
it writes is the operator's own setting with the lever's key merged in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.policy import Baseline, Lever, flags_for

ON = "expandable_segments:True"


def test_the_lever_sets_both_names_torch_reads() -> None:
    _, env = flags_for({Lever.EXPANDABLE_SEGMENTS: 1}, Baseline(256, 8192, 0.9), PolicyConfig())
    assert dict(env) == {"PYTORCH_ALLOC_CONF": ON, "PYTORCH_CUDA_ALLOC_CONF": ON}
    flagsfile.validate((), env)  # the flags file takes both


MERGES = [
    # what the operator's environment holds → what vLLM starts with (both names)
    ({}, ON),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, f"max_split_size_mb:512,{ON}"),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, f"max_split_size_mb:512,{ON}"),
    # torch reads PYTORCH_ALLOC_CONF and never the other: the operator's effective value wins
    (
        {
            "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6",
            "PYTORCH_CUDA_ALLOC_CONF": "x:1",
        },
        f"garbage_collection_threshold:0.6,{ON}",
    ),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, ON),  # the lever's key replaced
    (
        {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:4], max_split_size_mb:256"},
        f"roundup_power2_divisions:[256:1,>:4],max_split_size_mb:256,{ON}",
    ),
    ({"PYTORCH_ALLOC_CONF": ""}, ON),
]


@pytest.mark.parametrize(("inherited", "expected"), MERGES)
def test_the_operators_setting_is_merged_not_replaced(
    inherited: dict[str, str], expected: str
) -> None:
    guardian = (("PYTORCH_ALLOC_CONF", ON), ("PYTORCH_CUDA_ALLOC_CONF", ON))
    env = flagsfile.merged_env(inherited, guardian)
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == expected


def test_other_variables_pass_through() -> None:
    assert flagsfile.merged_env({"HOME": "/h"}, ()) == {"HOME": "/h"}


def test_a_supervised_vllm_starts_with_the_merged_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = tmp_path / "vllm.env"
    flagsfile.write(path, flagsfile.validate((), (("PYTORCH_ALLOC_CONF", ON),)))
    sup = Supervisor(name="vllm", command=["true"], flags_path=path)
    _, env = sup.argv_and_env()
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"]
    assert env["PYTORCH_ALLOC_CONF"] == f"max_split_size_mb:512,{ON}"
