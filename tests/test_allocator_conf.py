"""The expandable_segments lever sets what torch reads, and never silently loses to the operator's.

torch parses one of ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF``, and which one wins
when both are set depends on its version: torch 2.13 (vLLM 0.32's build) parses
``PYTORCH_CUDA_ALLOC_CONF`` (measured below), c10/core/AllocatorConfig.cpp at other commits
``PYTORCH_ALLOC_CONF`` first, torch before 2.9 knows only ``PYTORCH_CUDA_ALLOC_CONF``. So the
lever writes both names, each the operator's own setting with the lever's key merged in.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.policy import Lever, default_baseline, flags_for

ON = "expandable_segments:True"


def test_the_lever_sets_both_names_torch_reads() -> None:
    _, env = flags_for({Lever.EXPANDABLE_SEGMENTS: 1}, default_baseline(None, ()), PolicyConfig())
    assert dict(env) == {"PYTORCH_ALLOC_CONF": ON, "PYTORCH_CUDA_ALLOC_CONF": ON}
    flagsfile.validate((), env)  # the flags file takes both


MERGES = [
    # what the operator's environment holds → what vLLM starts with (both names)
    ({}, ON),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, f"max_split_size_mb:512,{ON}"),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, f"max_split_size_mb:512,{ON}"),
    # both set (torch reads one, by version): each name keeps its own, with the lever's key
    (
        {
            "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6",
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
        },
        (f"garbage_collection_threshold:0.6,{ON}", f"max_split_size_mb:512,{ON}"),
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
    inherited: dict[str, str], expected: str | tuple[str, str]
) -> None:
    guardian = (("PYTORCH_ALLOC_CONF", ON), ("PYTORCH_CUDA_ALLOC_CONF", ON))
    env = flagsfile.merged_env(inherited, guardian)
    both = expected if isinstance(expected, tuple) else (expected, expected)
    assert (env["PYTORCH_ALLOC_CONF"], env["PYTORCH_CUDA_ALLOC_CONF"]) == both


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


VLLM_PYTHON = Path("/var/cache/vllm-guardian-ci/vllm-0.32.0/bin/python")


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM 0.32's venv (torch 2.13) is not here")
@pytest.mark.parametrize(
    ("env", "parsed"),
    [
        # torch 2.13 parses PYTORCH_CUDA_ALLOC_CONF when set, PYTORCH_ALLOC_CONF only without it
        (
            {
                "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6",
            },
            "garbage_collection_threshold:0.6",
        ),
        # what the lever leaves: the operator's setting and the lever's key, whichever is read
        (
            flagsfile.merged_env(
                {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"},
                (("PYTORCH_ALLOC_CONF", ON), ("PYTORCH_CUDA_ALLOC_CONF", ON)),
            ),
            f"garbage_collection_threshold:0.6,{ON}",
        ),
    ],
)
def test_what_torch_2_13_parses(env: dict[str, str], parsed: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    out = subprocess.run(
        [str(VLLM_PYTHON), "-W", "ignore", "-c",
         "import torch; print(torch._C._accelerator_getAllocatorSettings())"],
        env={**clean, **{k: v for k, v in env.items() if k.endswith("ALLOC_CONF")}},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == parsed, out.stderr[-2000:]
