"""A test's timeout never ends the run: it strikes in a test's own phases, never in pytest's.

pytest-timeout's alarm covers a test's whole protocol, pytest's own work between the phases
included. Where it strikes while pytest makes a report (formatting a failure near the limit on
a busy machine) the exception escapes pytest's machinery and the session ends with an
INTERNALERROR: every test after it never runs. ``tests/timeouts.py`` defers such a strike
until the test's next phase. A real pytest runs a stand-in file: its first test fails, and
making that failure's report (pytest parses the test file's source for each traceback entry;
this file is 400,000 lines long) outlasts the test's 1 s timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

STAND_IN = """
import time


def test_hangs():
    time.sleep(60)


def test_fails_and_its_report_outlasts_the_timeout():
    assert PADDING is None


def test_after_it():
    pass


PADDING = 0
""" + "".join(f"PADDING += {i}\n" for i in range(400_000))


def test_a_timeout_striking_while_pytest_reports_does_not_end_the_run(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\n")
    (tmp_path / "test_stand_in.py").write_text(STAND_IN)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.timeouts", "-p", "no:cacheprovider",
         "-rA", "test_stand_in.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "INTERNALERROR" not in out, out
    assert "PASSED test_stand_in.py::test_after_it" in out, out
    assert "FAILED test_stand_in.py::test_fails_and_its_report_outlasts_the_timeout" in out, out
    # A test that outlasts its timeout in its own code is still stopped, and reported so.
    assert "FAILED test_stand_in.py::test_hangs - Failed: Timeout" in out, out
    assert run.returncode == 1, out
