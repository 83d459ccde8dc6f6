"""The `vllm` tier: the real-engine outcome benchmark's harness runs end to end (its ``--quick``
form, shortened: the steady control under the deployed guardian and gate).

The full matrix is a benchmark (bench/outcome_vllm.py, about two hours), not a test; this proves
the harness still starts vLLM under the guardian, puts the gate in front, sends the seeded load
through it, and writes its report: the guardian takes no action on a healthy server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_tier import support

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_outcome_bench_runs_the_steady_control_through_the_gate(tmp_path: Path) -> None:
    support.vllm_venv_or_skip()
    cmd = [sys.executable, str(ROOT / "bench" / "outcome_vllm.py"), "--quick",
           "--scenarios", "steady", "--operators", "guardian+gate", "--duration", "30",
           "--out", str(tmp_path)]  # fmt: skip
    # The bench takes the host's vLLM lock itself; its own bound on vLLM's start is 600 s.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840, check=False)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    (line,) = (tmp_path / "outcome-vllm-quick.runs.jsonl").read_text().splitlines()
    run = json.loads(line)["run"]
    print("\nreal-engine outcome bench, steady through the gate:", json.dumps(run, indent=1))
    assert (run["scenario"], run["operator"]) == ("steady", "guardian+gate"), run
    assert run["sent"] > 0 and run["cold_start_seconds"] is not None, run
    assert run["actions"] == [] and run["restarts"] == 0, run  # a healthy server: no action
    md = (tmp_path / "outcome-vllm-quick.md").read_text()
    assert "| steady | guardian+gate | 7 |" in md, md
