"""`vllm-guardian status --watch`: the running guardian's status, live, fitted to the terminal.

The loop is driven with a fake fetch and sleep (no clock); the command itself runs once as a
real process, stopped with SIGINT as Ctrl-C stops it.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.lowio.control import ControlError
from vllm_guardian.tools.cli import render_status
from vllm_guardian.tools.status_watch import CLEAR, EXIT_INTERRUPTED, watch

LONG_REASON = (
    "relaunch: pre-emptive: pid 4194301 (command unknown, cgroup unknown) exhausts the GPU in "
    "~6s, before it has grown past 5.96 GiB in use; bundle "
    "/var/lib/vllm-guardian/bundles/vllm-20261126T143707Z-1-relaunch"
)
STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "time": 1_795_700_000.0,
    "signals": {
        "services": [{"service": "vllm", "health_state": "up", "kv_cache_usage_ratio": 0.5}]
    },
    "recent_decisions": [
        {
            "time_seconds": 1_795_700_000.0,
            "service": "vllm",
            "what": "action",
            "reason": LONG_REASON,
        }
    ],
    "sources": [{"source": "health", "service": "vllm", "up": True}],
}


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def no_sleep(seconds: float) -> None:
    pass


@pytest.mark.parametrize(("out", "clears"), [(Terminal(), 3), (Pipe(), 0)], ids=["tty", "pipe"])
def test_each_refresh_is_a_repainted_screen_in_a_terminal_and_a_block_in_a_pipe(
    out: io.StringIO, clears: int
) -> None:
    code = watch(lambda: STATUS, render_status, out, 2.0, (ControlError,), no_sleep, refreshes=3)
    text = out.getvalue()
    assert code == 0
    assert text.count(CLEAR) == clears
    assert text.count("vllm-guardian status — ") == 3
    assert text.count("service vllm: health=up") == 3


@pytest.mark.parametrize("columns", [50, 80, 132])
def test_lines_fit_the_terminal_without_cutting_a_word(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    out = Terminal()
    watch(lambda: STATUS, render_status, out, 2.0, (ControlError,), no_sleep, refreshes=1)
    lines = out.getvalue().replace(CLEAR, "").splitlines()
    assert all(len(line) <= columns or len(line.split()) == 1 for line in lines), lines
    assert set(LONG_REASON.split()) <= set(" ".join(lines).split())


def test_a_guardian_that_does_not_answer_is_shown_and_asked_again() -> None:
    answers: list[dict[str, Any] | Exception] = [
        ControlError("nothing listens on /run/vllm-guardian/control.sock"),
        STATUS,
    ]

    def fetch() -> dict[str, Any]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    out = Pipe()
    assert watch(fetch, render_status, out, 2.0, (ControlError,), no_sleep, refreshes=2) == 0
    text = out.getvalue()
    assert text.index("no answer: nothing listens") < text.index("service vllm: health=up")


def test_ctrl_c_exits_130() -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    out = Pipe()
    assert watch(lambda: STATUS, render_status, out, 2.0, (ControlError,), interrupted) == (
        EXIT_INTERRUPTED
    )


def test_the_command_stops_on_sigint_with_130_and_no_traceback(tmp_path: Path) -> None:
    """As a person runs it: no daemon yet (it says so and keeps asking), then Ctrl-C.

    From a terminal, SIGINT has its default disposition; a CI job started in the background
    inherits it ignored (this test then waited 60 s for an exit that never came), so the child
    gets the terminal's disposition back through env(1)."""
    proc = subprocess.Popen(
        ["env", "--default-signal=INT",
         sys.executable, "-m", "vllm_guardian", "status", "--watch", "--interval", "0.2",
         "--socket", str(tmp_path / "control.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        # The first refresh, read whole: the loop is running and says why there is no status.
        seen = [proc.stdout.readline() for _ in range(3)]
        assert seen[0].startswith("vllm-guardian status"), seen
        assert seen[2].startswith("no answer: no control socket"), seen
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    assert "Traceback" not in err, err
