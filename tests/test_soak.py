"""scripts/soak, interrupted: pytest's teardown runs, and nothing the run started outlives it.

A tiny pytest file stands in for the suite: its test starts a sleeper in a session of its own
(as the guardian starts vLLM, and the fleet test its guardians), which its teardown never
stops, and a fixture that records that its teardown ran. The soak is interrupted once the
sleeper exists, as a developer's Ctrl-C (SIGINT to the soak's process group) or a CI runner's
SIGTERM (to the soak alone) would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

DUMMY = """
import subprocess
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def records_its_teardown():
    yield
    (HERE / "teardown-ran").write_text("yes")


def test_starts_a_sleeper_in_its_own_session(records_its_teardown):
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (HERE / "sleeper.pid").write_text(str(sleeper.pid))
    threading.Event().wait()  # until the soak interrupts this run
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def carrying(variable: str) -> list[int]:
    """Live processes whose environment holds ``variable`` (NAME=value)."""
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


@pytest.fixture
def dummy(tmp_path: Path) -> Iterator[Path]:
    """The stand-in suite; every process of its soak carries TMPDIR=<this directory>."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_dummy.py").write_text(DUMMY)
    yield tmp_path
    for pid in carrying(f"TMPDIR={tmp_path}"):  # the soak failed at its job: clean up anyway
        os.kill(pid, signal.SIGKILL)


# What the soak inherits: SIGINT at its default, as from a terminal, or ignored, as by any job a
# non-interactive shell starts in the background (``nohup … &``, many CI runners). Both are set
# here with env(1), never left to whatever this pytest inherited: bash cannot trap a signal that
# was ignored when it started, and Python raises no KeyboardInterrupt for one.
INHERITED = {"SIGINT default": "--default-signal=INT", "SIGINT ignored": "--ignore-signal=INT"}


@pytest.mark.timeout(300)  # above the test's own bounds (60 + 90 + 30 s), which speak first
@pytest.mark.parametrize("inherited", list(INHERITED))
@pytest.mark.parametrize(
    ("how", "status"),
    [("ctrl-c", 130), ("sigterm", 143)],
)
def test_an_interrupted_soak_leaves_no_process_behind(
    dummy: Path, how: str, status: int, inherited: str
) -> None:
    log = dummy / "soak.out"
    env = {**os.environ, "SOAK_HOGS": "0", "SOAK_PYTHON": sys.executable,
           "SOAK_GRACE_SECONDS": "30", "TMPDIR": str(dummy)}  # fmt: skip
    with log.open("wb") as out:
        soak = subprocess.Popen(
            ["env", INHERITED[inherited], str(REPO / "scripts" / "soak"), "1",
             str(dummy / "test_dummy.py")],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip  # env(1) execs: soak.pid is the soak's

    def seen() -> str:
        runs = sorted(dummy.glob("soak.*/run*.log"))
        return f"soak: {log.read_text()}\n" + "".join(f"{r}: {r.read_text()}" for r in runs)

    try:
        pid_file = dummy / "sleeper.pid"
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and soak.poll() is None:
            assert time.monotonic() < deadline, f"no sleeper after 60 s\n{seen()}"
            time.sleep(0.05)
        assert soak.poll() is None, f"the soak ended before its run started a sleeper\n{seen()}"
        sleeper = int(pid_file.read_text())
        assert alive(sleeper)

        if how == "ctrl-c":  # the terminal signals the soak's whole process group
            os.killpg(soak.pid, signal.SIGINT)
        else:
            soak.send_signal(signal.SIGTERM)
        code = soak.wait(timeout=90)  # the soak gives pytest's teardown up to 30 s

        mine = f"TMPDIR={dummy}"  # the soak's pytest, the sleeper, anything else of the run
        deadline = time.monotonic() + 30
        while (left := carrying(mine)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"{left} outlived the soak (the sleeper: {sleeper})\n{seen()}"
        assert code == status, seen()
        assert (dummy / "teardown-ran").exists(), f"pytest's teardown did not run\n{seen()}"
        assert f"killed {sleeper}: sleep 600" in log.read_text(), seen()
    finally:
        if soak.poll() is None:
            soak.terminate()
            try:
                soak.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(soak.pid, signal.SIGKILL)
                soak.wait()


LEAKY = """
import subprocess
from pathlib import Path


def test_leaves_a_sleeper_behind():
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (Path(__file__).parent / "sleeper.pid").write_text(str(sleeper.pid))
"""


def test_a_run_that_leaves_a_process_behind_is_named_and_swept(dummy: Path) -> None:
    (dummy / "test_dummy.py").write_text(LEAKY)
    env = {**os.environ, "SOAK_HOGS": "0", "SOAK_PYTHON": sys.executable, "TMPDIR": str(dummy)}
    soak = subprocess.run(
        [str(REPO / "scripts" / "soak"), "1", str(dummy / "test_dummy.py")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    out = soak.stdout + soak.stderr
    assert soak.returncode == 0, out  # the test passed; a leak is reported, not a failure
    sleeper = int((dummy / "sleeper.pid").read_text())
    assert "run 1 left processes behind" in out, out
    assert f"killed {sleeper}: sleep 600" in out, out
    deadline = time.monotonic() + 30
    while alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(sleeper), out
