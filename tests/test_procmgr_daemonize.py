"""A command that daemonizes (double fork, setsid, the parent exits 0) under the process
backend: the supervisor sees its command exit while the process it started still serves. It
says so, in the log and through its notice, and starts nothing on top of it.

Real processes: a tiny Python command that daemonizes a child listening on a port."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_guardian.actuators import audit as auditlog
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.core.policy import DecisionKind, Withheld

DAEMONIZING = textwrap.dedent(
    """
    import os, socket, sys, time
    marks = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # the daemon: its own session, orphaned, listening
            srv = socket.socket()
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("127.0.0.1", port))
            srv.listen()
            with open(marks, "a") as fh:
                fh.write(f"{os.getpid()} {srv.getsockname()[1]}\\n")
            time.sleep(120)
        os._exit(0)
    os.wait()
    time.sleep(0.3)  # the daemon has written its mark and listens before the command exits
    sys.exit(0)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def marks(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "marks"
    yield path
    if path.exists():  # never leave a daemon behind
        for line in path.read_text().splitlines():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


def test_a_daemonizing_command_is_not_restarted_on_top_of_its_daemon(
    tmp_path: Path, marks: Path
) -> None:
    script = tmp_path / "daemonize.py"
    script.write_text(DAEMONIZING)
    notices: list[str] = []
    sup = Supervisor(
        "svc",
        [sys.executable, str(script), str(marks)],
        tmp_path / "svc.env",
        tmp_path / "svc.log",
        restart_delay_seconds=0.01,  # many restart opportunities while the daemon serves
        on_daemonized=notices.append,
    )
    sup.start()
    try:
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while sup.wants_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup._thread is not None
        sup._thread.join(timeout=10)
        assert not sup._thread.is_alive()  # supervision ended: nothing will start again
        rows = [line.split() for line in marks.read_text().splitlines()]
        # One start, no restart decision, one daemon: no pile-up.
        assert (sup.starts, sup.exits, sup.delays, len(rows)) == (1, [0], [], 1)
        pid, port = int(rows[0][0]), int(rows[0][1])
        assert _alive(pid)  # left to the operator: it serves
        assert sup.daemonized is not None
        assert (sup.daemonized.pid, sup.daemonized.ports) == (pid, (port,))
        assert notices == [
            f"svc: the command daemonized: pid {pid} still serves port {port}; vllm-guardian "
            "supervises the process it starts, run vLLM in the foreground. Not restarting it "
            f"(a second server would start on top of pid {pid}): stop pid {pid}, fix "
            "services[].command, then restart the guardian"
        ]
        ok, terminal, detail = sup.restart(timeout_seconds=5)
        assert (ok, terminal) == (False, True) and "daemonized" in detail
        assert sup.starts == 1 and len(marks.read_text().splitlines()) == 1
    finally:
        sup.stop(5)


def test_the_guardian_audits_a_daemonizing_command_with_the_reason(
    tmp_path: Path, marks: Path
) -> None:
    """The guardian's own process backend (healing.py builds the supervisor): when its command
    daemonizes, the audit log gets one record saying so, with the pid, the port and the fix,
    so a person reading the audit learns why vLLM is no longer supervised."""
    import json

    from vllm_guardian.config import parse_config
    from vllm_guardian.lowio.clock import SystemClock
    from vllm_guardian.shell.healing import Healing

    script = tmp_path / "daemonize.py"
    script.write_text(DAEMONIZING)
    state = tmp_path / "state"
    text = json.dumps(
        {
            "state_dir": str(state),
            "runtime_dir": str(tmp_path / "run"),
            "sources": {"allocator": {"enabled": False}},
            "services": [
                {
                    "name": "vllm",
                    "url": "http://127.0.0.1:1",
                    "command": [sys.executable, str(script), str(marks)],
                    "log_file": str(tmp_path / "vllm.log"),
                }
            ],
            "policy": {"backend": "process"},
        }
    )
    healing = Healing(parse_config(text, "test.yaml"), SystemClock())
    audit = state / "audit.jsonl"
    sup = healing.supervisors["vllm"]
    healing.start()
    try:
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while sup.daemonized is None or not audit.exists():
            assert time.monotonic() < deadline, (
                f"no daemonized record within 60s: starts {sup.starts}, exits {sup.exits}, "
                f"audit {audit.read_text() if audit.exists() else '(none)'}"
            )
            time.sleep(0.05)
        records = auditlog.read(audit)
        pid, port = (int(f) for f in marks.read_text().split())
        assert len(records) == 1, records
        (record,) = records
        assert (record.service, record.what, record.withheld) == (
            "vllm", DecisionKind.SUPPRESSED, Withheld.DAEMONIZED,
        ), record  # fmt: skip
        # What a person reads: the pid, the port and the fix.
        assert f"the command daemonized: pid {pid} still serves port {port}" in record.reason
        assert "fix services[].command" in record.reason
    finally:
        healing.close()


def test_a_daemonizing_command_that_clears_its_environment_is_found_by_its_port(
    tmp_path: Path, marks: Path
) -> None:
    """``env -i`` before the command: the daemon no longer carries the supervisor's mark. It
    still serves the service's port, and it started after the command did, outside the
    command's process group: that is the command's escapee, and it is not started again on
    top of it (where a second copy could not bind the port and would exit, again and again)."""
    from vllm_guardian.tools.demo import free_port

    port = free_port()
    script = tmp_path / "daemonize.py"
    script.write_text(DAEMONIZING)
    notices: list[str] = []
    sup = Supervisor(
        "svc",
        ["env", "-i", sys.executable, str(script), str(marks), str(port)],
        tmp_path / "svc.env",
        tmp_path / "svc.log",
        restart_delay_seconds=0.01,
        on_daemonized=notices.append,
        port=port,
    )
    sup.start()
    try:
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while sup.wants_running and sup.starts < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup._thread is not None
        sup._thread.join(timeout=10)
        rows = [line.split() for line in marks.read_text().splitlines()]
        assert (sup.starts, sup.exits, sup.delays) == (1, [0], []), (sup.starts, rows)
        pid = int(rows[0][0])
        assert _alive(pid)
        assert sup.daemonized is not None
        assert (sup.daemonized.pid, sup.daemonized.ports) == (pid, (port,))
        assert len(notices) == 1 and f"pid {pid} still serves port {port}" in notices[0]
    finally:
        sup.stop(5)


def test_a_server_already_on_the_port_before_the_command_started_is_not_its_escapee(
    tmp_path: Path,
) -> None:
    """Something else holds the port (started before the command): the command that exits at
    once is an ordinary quick exit, restarted under the backoff, never named a daemon."""
    import socket as socketlib

    srv = socketlib.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    sup = Supervisor(
        "svc",
        [sys.executable, "-c", "import sys; sys.exit(1)"],
        tmp_path / "svc.env",
        tmp_path / "svc.log",
        restart_delay_seconds=0.01,
        port=port,
    )
    sup.start()
    try:
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while sup.starts < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup.starts >= 2 and sup.daemonized is None, (sup.starts, sup.daemonized)
    finally:
        sup.stop(5)
        srv.close()
