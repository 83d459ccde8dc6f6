"""The guardian's one launch-flag reader (core/budget.parse_launch_flags) against vLLM's own.

vLLM 0.32's argument parser (``EngineArgs.add_cli_args`` on its ``FlexibleArgumentParser``)
reads each command line of the table in vLLM's venv; the guardian's reader must agree on every
memory flag the policy and ``diagnose`` use: the last occurrence wins, ``8k`` is 8000 and ``8K``
8192, ``--flag=value`` and ``--flag value`` alike.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm_tier import support
from vllm_guardian.core.budget import parse_launch_flags

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ARGVS = [
    ["--max-num-batched-tokens", "8k", "--max-num-seqs", "64", "--max-num-seqs", "32"],
    ["--max-num-batched-tokens=16K", "--gpu-memory-utilization=0.8"],
    [
        "--gpu-memory-utilization",
        "0.95",
        "--gpu-memory-utilization",
        "0.7",
        "--max-model-len",
        "4k",
    ],
    ["--max-num-seqs=128", "--max-model-len=32768", "--max-num-batched-tokens", "2048"],
    ["--kv-cache-memory-bytes", "2G", "--max-num-seqs", "8"],
]
FIELDS = {
    # LaunchFlags field → vLLM's attribute
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization_ratio": "gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
}
VLLM_SIDE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[1]):
    a = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *argv])
    out.append({k: getattr(a, k, None) for k in json.loads(sys.argv[2])})
print(json.dumps(out))
"""


def test_the_guardian_reads_launch_flags_as_vllm_does() -> None:
    venv = support.vllm_venv_or_skip()
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", VLLM_SIDE, json.dumps(ARGVS),
         json.dumps(sorted(set(FIELDS.values())))],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for argv, vllm_reads in zip(ARGVS, theirs, strict=True):
        ours = parse_launch_flags(["vllm", "serve", "m", *argv])
        for field, attr in FIELDS.items():
            want = vllm_reads[attr]
            got = getattr(ours, field)
            if want is None or (
                attr == "gpu_memory_utilization" and "--gpu-memory" not in str(argv)
            ):
                continue  # vLLM's default, which the guardian leaves unset (None)
            assert got == want, f"{argv}: {field} guardian {got!r}, vLLM {want!r}"
