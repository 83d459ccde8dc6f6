"""What the tests share for waiting on a real process, socket or thread.

One wait: a condition polled with a generous bound (the machine may be two busy cores), and on
timeout what was asked for and, where the caller says how to see it, what was seen instead. A
test that passes or fails by the clock is a defect; this waits for a condition instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T],
    what: str,
    timeout_seconds: float = 60.0,
    seen: Callable[[], object] | None = None,
    every_seconds: float = 0.05,
) -> T:
    """Poll ``check()`` until it returns something true, and return that. An ``OSError`` (a
    refused connection, a file not written yet; ``requests``' errors are ``OSError``\\ s) counts
    as "not yet". After ``timeout_seconds``, fail naming ``what`` and ``seen()``."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            got = check()
        except OSError as e:
            got, error = None, e  # type: ignore[assignment]
        else:
            error = None
        if got:
            return got
        if time.monotonic() >= deadline:
            saw = f"; seen: {seen()!r}" if seen is not None else ""
            why = f"; last error: {error!r}" if error is not None else ""
            raise AssertionError(
                f"timed out after {timeout_seconds:g} s waiting for {what}{saw}{why}"
            )
        time.sleep(every_seconds)


def run_quick_bench(script: str) -> str:
    """``bench/SCRIPT --quick`` in a subprocess, the repository on its path: its output (stdout
    then stderr), once it has exited 0 (else the output is the assertion's message)."""
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, str(root / "bench" / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    return out
