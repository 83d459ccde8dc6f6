"""`vllm-guardian demo`, stopped with Ctrl-C as a person stops it: everything it started goes.

The demo runs in a process group of its own, as a terminal's foreground job does, and Ctrl-C
is SIGINT to that whole group (the demo, its load generator and its gate all get it). Once the
twin serves, the test sends it; then the demo must print its summary, exit 130 as shells
expect of a program stopped by SIGINT, and leave no process behind: the twin, which the
guardian's process manager starts in a session of its own, included. Every process of the run
carries a marker in its environment, inherited from the demo's, and /proc finds it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def carrying(variable: str) -> list[int]:
    needle = variable.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_ctrl_c_stops_everything_prints_the_summary_and_exits_130(tmp_path: Path) -> None:
    mark = f"VLLM_GUARDIAN_DEMO_TEST={uuid.uuid4().hex}"
    name, value = mark.split("=")
    workdir = tmp_path / "demo"
    log = tmp_path / "demo.out"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            ["env", "--default-signal=INT", sys.executable, "-m", "vllm_guardian", "demo",
             "--scenario", "steady", "--duration", "300", "--workdir", str(workdir)],
            env={**os.environ, name: value}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        # Interrupted once the twin serves: its pid file is written when it is started, and
        # the guardian's audit or the load's outcomes show the run under way.
        deadline = time.monotonic() + 180
        while not (workdir / "outcomes.jsonl").exists() or not (
            (workdir / "outcomes.jsonl").stat().st_size
        ):
            assert demo.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no request served in 180 s\n{log.read_text()}"
            time.sleep(0.2)
        started = carrying(mark)
        assert len(started) >= 3, started  # the demo, the twin, the load (and the gate)
        os.killpg(demo.pid, signal.SIGINT)
        code = demo.wait(timeout=150)
        deadline = time.monotonic() + 30
        while (left := carrying(mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        shown = log.read_text()
        assert not left, f"left running after Ctrl-C: {left}\n{shown}"
        assert "Requests:" in shown, shown
        assert code == 130, f"exit {code}\n{shown}"
    finally:
        for pid in carrying(mark):
            os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
            demo.wait()
