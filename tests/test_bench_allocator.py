"""bench/allocator.py runs and reports both arms and their ratio (a small run, not a figure)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_allocator_bench_reports_both_arms() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "allocator.py"), "--stale", "3", "--collects", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "3 stale files + 1 live" in out, out
    assert re.search(r"fresh \(every file read\): \d+\.\d{3} ms", out), out
    assert re.search(r"kept verdicts: +\d+\.\d{3} ms", out), out
    assert re.search(r"fresh / kept: \d+\.\dx", out), out
