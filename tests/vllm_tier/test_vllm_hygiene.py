"""The `vllm` tier's process hygiene: a renamed vLLM child is found and stopped.

vLLM's EngineCore and Worker rename themselves with setproctitle, which overwrites the memory
/proc/<pid>/environ shows, so the run's marker vanishes from them. Stand-ins made the same way
(the vLLM venv's Python and its setproctitle, in a session of their own like every vLLM the
tier starts): a child renamed under a living parent, and one left to PID 1 by a parent that
exited. The census must find and kill both; the marker alone finds neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.support import wait_for
from tests.vllm_tier import support

pytestmark = pytest.mark.vllm

CHILD = textwrap.dedent(
    """
    import sys, time, setproctitle
    setproctitle.setproctitle("VLLM::EngineCore")
    open(sys.argv[1], "w").close()
    time.sleep(600)
    """
)
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    while not os.path.exists(sys.argv[3]):  # the census has seen this session
        time.sleep(0.05)
    if sys.argv[4] == "exit":
        os._exit(0)  # the child goes to PID 1, as a Worker does when EngineCore dies
    time.sleep(600)
    """
)


@pytest.mark.parametrize("parent", ["lives", "exit"])
def test_the_census_finds_and_kills_a_renamed_child(tmp_path: Path, parent: str) -> None:
    venv = support.vllm_venv_or_skip()
    run_id = uuid.uuid4().hex
    ready, seen = tmp_path / "ready", tmp_path / "seen"
    env = {support.MARKER: run_id, "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-c", PARENT, CHILD, str(ready), str(seen), parent],
        env=env,
        start_new_session=True,
    )
    with support.Census(run_id) as census:
        try:
            wait_for(
                ready.exists, "the child renamed itself", 60, every_seconds=support.POLL_SECONDS
            )
            wait_for(
                lambda: proc.pid in census.sessions,
                "the census saw the session",
                30,
                every_seconds=support.POLL_SECONDS,
            )
            seen.touch()
            if parent == "exit":
                proc.wait(timeout=30)
            renamed = [p for p, cmd in _in_session(proc.pid) if cmd.startswith("VLLM::")]
            assert len(renamed) == 1, _in_session(proc.pid)
            assert renamed[0] not in support.marked(run_id)  # the rename hid the marker
            assert renamed[0] in census.members()
        finally:
            swept = support.sweep(run_id, census)
            left = support.leftovers(run_id, census=census)
            proc.wait(timeout=30)
    assert not left, left
    assert any("VLLM::EngineCore" in line for line in swept), swept


def _in_session(sid: int) -> list[tuple[int, str]]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and support.session_id_of(p.name) == sid:
            out.append((int(p.name), " ".join(support.cmdline(int(p.name)))))
    return out


def test_a_marked_helper_in_this_session_never_makes_it_a_target() -> None:
    """A process the test runs with the marker but without a session of its own (a short
    helper) shares pytest's session, and with it scripts/test and CI's runner: the census
    must never record that session, or the sweep kills the runner (it did, in a rehearsal)."""
    run_id = uuid.uuid4().hex
    helper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={support.MARKER: run_id, "PATH": "/usr/bin:/bin"},
    )
    try:
        with support.Census(run_id) as census:
            wait_for(
                lambda: helper.pid in support.marked(run_id),
                "the helper runs",
                30,
                every_seconds=support.POLL_SECONDS,
            )
            census.look()
            assert os.getsid(0) not in census.sessions, census.sessions
            assert census.members() == [helper.pid]  # the helper itself, by its marker
    finally:
        helper.kill()
        helper.wait(timeout=30)


@pytest.mark.parametrize("depth", [1, 40])
def test_vllms_ipc_sockets_get_a_directory_their_names_fit_in(tmp_path: Path, depth: int) -> None:
    """In the test's directory when vLLM's socket names fit under the 107-byte limit there,
    else in a short one of its own."""
    workdir = tmp_path.joinpath(*["d"] * depth)
    workdir.mkdir(parents=True)
    rpc = Path(support.vllm_env("run", workdir)["VLLM_RPC_BASE_PATH"])
    assert rpc.is_dir(), rpc
    assert len(str(rpc / str(uuid.uuid4()))) <= support.SOCKET_PATH_MAX, rpc
    assert rpc.is_relative_to(workdir) == (depth == 1), (rpc, workdir)
    if depth != 1:
        rpc.rmdir()
