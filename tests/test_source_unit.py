"""The unit source: systemctl parsing, /proc parsing, and real processes found by unit or port.

Real subprocesses throughout: a fake ``systemctl`` written as a shell script, real children
that listen on 127.0.0.1. Every process a test starts is killed by the test (process groups).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import wait_for
from vllm_guardian.config import ServiceConfig, UnitSourceConfig
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.lowio.procfs import process_age_seconds
from vllm_guardian.model import (
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    SourceKind,
    UnitState,
)
from vllm_guardian.shell.daemon import unit_may_have_changed
from vllm_guardian.sources.unit import (
    SHOW_PROPERTIES,
    UnitCollector,
    descendants,
    parse_cmdline,
    parse_proc_net_tcp,
    parse_proc_stat,
    parse_systemctl_show,
    port_of,
    read_listening_rows,
    topmost,
    unit_state_from_show,
)

# What `systemctl show vllm.service --property=...` prints for a running unit (systemd 252
# prints properties in its own order, not the order asked for).
SHOW_RUNNING = """\
MainPID={pid}
ExecMainStatus=0
Result=success
NRestarts=3
ControlGroup=/system.slice/vllm.service
LoadState=loaded
ActiveState=active
SubState=running
ActiveEnterTimestampMonotonic=52889123456
"""

SHOW_FAILED = """\
MainPID=0
ExecMainStatus=1
Result=exit-code
NRestarts=5
ControlGroup=
LoadState=loaded
ActiveState=failed
SubState=failed
ActiveEnterTimestampMonotonic=0
"""

SHOW_NOT_FOUND = """\
MainPID=0
ExecMainStatus=0
Result=success
NRestarts=0
ControlGroup=
LoadState=not-found
ActiveState=inactive
SubState=dead
ActiveEnterTimestampMonotonic=0
"""

PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0000000000000000 100 0 0 10 0
   1: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12346 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F40 0100007F:D3C2 01 00000000:00000000 00:00000000 00000000  1000        0 12399 1 0000000000000000 20 4 30 10 -1
   3: garbage
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0
"""


def test_parse_systemctl_show() -> None:
    props = parse_systemctl_show(SHOW_RUNNING.format(pid=4321) + "Environment=A=B C=D\n\nnoise\n")
    assert props["MainPID"] == "4321"
    assert props["ControlGroup"] == "/system.slice/vllm.service"
    assert props["Environment"] == "A=B C=D"  # values keep their '='
    assert "noise" not in props
    assert parse_systemctl_show("") == {}


def test_unit_state_from_running_show() -> None:
    state = unit_state_from_show(
        "vllm.service", parse_systemctl_show(SHOW_RUNNING.format(pid=4321))
    )
    assert state == UnitState(
        unit="vllm.service",
        active_state="active",
        sub_state="running",
        result="success",
        main_pid=4321,
        n_restarts=3,
        exec_main_status=0,
        active_enter_monotonic_seconds=52889.123456,
        control_group="/system.slice/vllm.service",
        cmdline=None,
    )


def test_unit_state_from_failed_show() -> None:
    state = unit_state_from_show("vllm.service", parse_systemctl_show(SHOW_FAILED))
    assert state.main_pid is None  # MainPID=0: no process
    assert state.active_enter_monotonic_seconds is None  # 0: never entered active
    assert state.control_group is None
    assert (state.active_state, state.sub_state, state.result) == ("failed", "failed", "exit-code")
    assert (state.n_restarts, state.exec_main_status) == (5, 1)


def test_unit_state_tolerates_missing_and_odd_values() -> None:
    state = unit_state_from_show("u.service", {"ActiveState": "active", "NRestarts": "[not set]"})
    assert state.n_restarts is None
    assert state.main_pid is None
    assert state.exec_main_status is None


def test_parse_proc_net_tcp() -> None:
    socks = parse_proc_net_tcp(PROC_NET_TCP)
    assert [(s.local_address, s.local_port, s.listening, s.inode) for s in socks] == [
        ("127.0.0.1", 8000, True, 12345),
        ("0.0.0.0", 8001, True, 12346),
        ("127.0.0.1", 8000, False, 12399),  # an established connection, not the listener
    ]
    (v6,) = parse_proc_net_tcp(PROC_NET_TCP6)
    assert (v6.local_address, v6.local_port, v6.listening, v6.inode) == ("::1", 8000, True, 4242)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5708 (cat) R 5704 5704 2217 0 -1", (5708, 5704)),
        ("42 (VLLM::Worker) S 41 41 1 0", (42, 41)),
        ("43 (a) b (c) S 7 7 1", (43, 7)),  # ')' and spaces inside the name
        ("44 (x", None),
        ("", None),
        ("nope (x) S y", None),
    ],
)
def test_parse_proc_stat(text: str, expected: tuple[int, int] | None) -> None:
    assert parse_proc_stat(text) == expected


def test_parse_cmdline() -> None:
    assert parse_cmdline(b"vllm\0serve\0m\0") == ("vllm", "serve", "m")
    assert parse_cmdline(b"") is None
    assert parse_cmdline(b"a\0b\xff\0") == ("a", "b\ufffd")


def test_descendants_and_topmost() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(10, parents) == (10, 11, 12, 13)
    assert descendants(99, parents) == (99,)
    assert topmost({11, 12, 13}, parents) == 11
    assert topmost({21, 13}, parents) == 13  # unrelated: lowest pid


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("http://127.0.0.1:8000", 8000),
        ("http://h", 80),
        ("https://h/", 443),
        ("http://[::1]:9/", 9),
    ],
)
def test_port_of(url: str, port: int) -> None:
    assert port_of(url) == port


# --- a fake /proc tree: unreadable entries are skipped -----------------------------------------


def _fake_proc(root: Path) -> Path:
    proc = root / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(PROC_NET_TCP)
    for pid, ppid, name in [(100, 1, "vllm"), (101, 100, "VLLM::EngineCore"), (102, 101, "w x)")]:
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} 1 0\n")
        (d / "cmdline").write_bytes(f"{name}\0--api-key\0sekret\0".encode())
    os.symlink("socket:[12345]", proc / "100" / "fd" / "7")
    os.symlink("/dev/null", proc / "100" / "fd" / "0")
    os.symlink("socket:[12345]", proc / "101" / "fd" / "7")  # inherited by the child
    # A process that exited mid-scan (dangling), one whose stat is unreadable, one whose fd
    # dir is not a directory: all must be skipped.
    os.symlink(root / "gone", proc / "200")
    (proc / "201" / "stat").mkdir(parents=True)
    (proc / "202").mkdir()
    (proc / "202" / "fd").write_text("")
    (proc / "self").mkdir()
    return proc


def test_by_port_on_fake_proc(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path)
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8000")
    reading = UnitCollector(svc, UnitSourceConfig(), proc_root=proc).collect()
    assert reading.error is None
    state = reading.payload
    assert isinstance(state, UnitState)
    assert state.unit is None
    assert state.active_state is None
    assert state.main_pid == 100  # the parent, not the child that inherited the socket
    assert state.pids == (100, 101, 102)
    assert state.cmdline == ("vllm", "--api-key", "***")


def test_by_port_nothing_listening_is_an_observation(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path)
    svc = ServiceConfig(name="a", url="http://127.0.0.1:9999")
    reading = UnitCollector(svc, UnitSourceConfig(), proc_root=proc).collect()
    assert reading.error is None
    assert isinstance(reading.payload, UnitState)
    assert reading.payload.main_pid is None
    assert reading.payload.pids == ()


def test_by_port_listener_not_visible(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path)
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8001")  # inode 12346: nobody holds it
    reading = UnitCollector(svc, UnitSourceConfig(), proc_root=proc).collect()
    assert reading.payload is None
    assert reading.error is not None
    assert "8001" in reading.error
    assert reading.hint is not None
    assert "root" in reading.hint


def test_by_port_without_proc(tmp_path: Path) -> None:
    reading = UnitCollector(
        ServiceConfig(name="a"), UnitSourceConfig(), proc_root=tmp_path / "none"
    ).collect()
    assert reading.payload is None
    assert reading.source is SourceKind.UNIT
    assert reading.service == "a"
    assert reading.hint is not None


# --- real processes ---------------------------------------------------------------------------

CHILD = r"""
import socket, subprocess, sys, time
listen = sys.argv[1] == "listen"
s = None
port = 0
if listen:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(port, g.pid, flush=True)
time.sleep(120)
"""


@dataclass
class Child:
    pid: int
    port: int
    grandchild: int
    started: float = 0.0  # time.time() just before it was started


def _start_child(mode: str) -> tuple[subprocess.Popen[str], Child]:
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, "--api-key", "sekret", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    port, grandchild = proc.stdout.readline().split()
    return proc, Child(proc.pid, int(port), int(grandchild), started)


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def listening_child() -> Iterator[Child]:
    proc, child = _start_child("listen")
    try:
        yield child
    finally:
        _stop(proc)


@pytest.fixture
def plain_child() -> Iterator[Child]:
    proc, child = _start_child("plain")
    try:
        yield child
    finally:
        _stop(proc)


def test_real_child_found_by_port(listening_child: Child) -> None:
    svc = ServiceConfig(name="a", url=f"http://127.0.0.1:{listening_child.port}")
    collector = UnitCollector(svc, UnitSourceConfig())
    reading = collector.collect()
    assert reading.error is None
    state = reading.payload
    assert isinstance(state, UnitState)
    assert state.main_pid == listening_child.pid
    assert state.pids[0] == listening_child.pid
    assert listening_child.grandchild in state.pids
    assert state.cmdline is not None
    assert "sekret" not in " ".join(state.cmdline)
    assert state.cmdline[-4:] == ("--api-key", "***", "--port", "0")
    # The second tick takes the cached-pid fast path and finds the same answer.
    again = collector.collect().payload
    assert isinstance(again, UnitState)
    assert again.main_pid == listening_child.pid
    collector.close()
    collector.close()


def test_the_main_process_start_is_read_from_proc_in_the_sources_clock(
    listening_child: Child,
) -> None:
    """A relaunch trusts a restart only from a process started after its flags were written
    (core/phases.runs_old_flags): the unit source dates the main process. The child was
    started just before the fixture returned; its start, in the wall clock the snapshot
    uses, lies between then and now (one clock tick of /proc's resolution either way)."""
    svc = ServiceConfig(name="a", url=f"http://127.0.0.1:{listening_child.port}")
    reading = UnitCollector(svc, UnitSourceConfig()).collect()
    state = reading.payload
    assert isinstance(state, UnitState)
    assert state.main_started_seconds is not None
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert listening_child.started - 2 * tick <= state.main_started_seconds <= time.time() + tick


@pytest.mark.parametrize(
    ("ticks", "boottime", "hz", "age"),
    [
        (1000, 110.0, 100, 100.0),  # started 10 s after boot, 110 s since boot now
        (1000, 10.0, 100, 0.0),
        (2000, 10.0, 100, None),  # in the future: another boot's text
        (1000, 110.0, 0, None),
    ],
)
def test_process_age_from_stat(ticks: int, boottime: float, hz: int, age: float | None) -> None:
    text = f"42 (vllm serve) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {ticks} 0 0\n"
    assert process_age_seconds(text, boottime, hz) == age


def test_real_port_closed_after_child_exits() -> None:
    proc, child = _start_child("listen")
    svc = ServiceConfig(name="a", url=f"http://127.0.0.1:{child.port}")
    collector = UnitCollector(svc, UnitSourceConfig())
    first = collector.collect().payload
    assert isinstance(first, UnitState)
    assert first.main_pid == child.pid
    _stop(proc)
    after = collector.collect().payload
    assert isinstance(after, UnitState)
    assert after.main_pid is None


def _fake_systemctl(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "systemctl"
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/args"\n{body}\n')
    path.chmod(0o755)
    return path


def test_fake_systemctl_with_real_main_pid(tmp_path: Path, plain_child: Child) -> None:
    out = tmp_path / "show.txt"
    out.write_text(SHOW_RUNNING.format(pid=plain_child.pid))
    systemctl = _fake_systemctl(tmp_path, f'cat "{out}"')
    svc = ServiceConfig(name="a", unit="vllm.service")
    reading = UnitCollector(svc, UnitSourceConfig(systemctl=str(systemctl))).collect()
    assert reading.error is None, reading
    state = reading.payload
    assert isinstance(state, UnitState)
    assert (state.unit, state.active_state, state.sub_state) == (
        "vllm.service",
        "active",
        "running",
    )
    assert state.n_restarts == 3
    assert state.main_pid == plain_child.pid
    assert state.pids == (plain_child.pid, plain_child.grandchild)
    assert state.cmdline is not None
    assert "sekret" not in state.cmdline
    assert "***" in state.cmdline
    args = (tmp_path / "args").read_text().splitlines()
    assert args == [
        "show",
        "--property=" + ",".join(SHOW_PROPERTIES),
        "--no-pager",
        "--",  # a unit name is never read as an option
        "vllm.service",
    ]


def test_fake_systemctl_failed_unit(tmp_path: Path) -> None:
    out = tmp_path / "show.txt"
    out.write_text(SHOW_FAILED)
    systemctl = _fake_systemctl(tmp_path, f'cat "{out}"')
    reading = UnitCollector(
        ServiceConfig(name="a", unit="vllm.service"), UnitSourceConfig(systemctl=str(systemctl))
    ).collect()
    assert isinstance(reading.payload, UnitState)
    assert reading.payload.main_pid is None
    assert reading.payload.cmdline is None
    assert reading.payload.pids == ()
    assert reading.payload.result == "exit-code"


def test_fake_systemctl_unit_not_found(tmp_path: Path) -> None:
    out = tmp_path / "show.txt"
    out.write_text(SHOW_NOT_FOUND)
    systemctl = _fake_systemctl(tmp_path, f'cat "{out}"')
    reading = UnitCollector(
        ServiceConfig(name="a", unit="nope.service"), UnitSourceConfig(systemctl=str(systemctl))
    ).collect()
    assert reading.payload is None
    assert reading.hint == "unit nope.service not found: check services[].unit"


def test_systemctl_exits_nonzero(tmp_path: Path) -> None:
    systemctl = _fake_systemctl(
        tmp_path,
        'echo "System has not been booted with systemd as init system (PID 1). Can\'t operate." >&2\n'
        'echo "Failed to connect to bus: Host is down" >&2\nexit 1',
    )
    reading = UnitCollector(
        ServiceConfig(name="a", unit="vllm.service"), UnitSourceConfig(systemctl=str(systemctl))
    ).collect()
    assert reading.payload is None
    assert reading.error is not None
    assert "status 1" in reading.error
    assert "not been booted with systemd" in reading.error
    assert reading.hint is not None


def test_systemctl_missing(tmp_path: Path) -> None:
    cfg = UnitSourceConfig(systemctl=str(tmp_path / "no-such-systemctl"))
    reading = UnitCollector(ServiceConfig(name="a", unit="vllm.service"), cfg).collect()
    assert reading.payload is None
    assert reading.error is not None
    assert "not found" in reading.error
    assert reading.hint is not None
    assert "sources.unit.systemctl" in reading.hint


def test_systemctl_not_executable(tmp_path: Path) -> None:
    path = tmp_path / "systemctl"
    path.write_text("not a program")
    path.chmod(0o644)
    reading = UnitCollector(
        ServiceConfig(name="a", unit="vllm.service"), UnitSourceConfig(systemctl=str(path))
    ).collect()
    assert reading.payload is None
    assert reading.hint is not None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return parse_proc_stat(stat) is not None and stat.rpartition(")")[2].split()[0] != "Z"


def test_hung_systemctl_times_out_and_is_killed_with_its_children(tmp_path: Path) -> None:
    # Not `exec sleep`: the shell keeps a child that holds the pipes, which is what makes a
    # plain subprocess.run(timeout=...) hang after killing only the shell. The child writes
    # `ended` if it ever finishes its sleep: a collect that waited for the pipes to close would
    # return only after that (a condition, not a measure of how long collect() took).
    ended = tmp_path / "ended"
    systemctl = _fake_systemctl(
        tmp_path, f'(sleep 60; echo > "{ended}") &\necho $! > "{tmp_path}/sleeper"\nwait'
    )
    cfg = UnitSourceConfig(systemctl=str(systemctl), timeout_seconds=0.5)
    collector = UnitCollector(ServiceConfig(name="a", unit="vllm.service"), cfg)
    assert collector.timeout_seconds > cfg.timeout_seconds
    t0 = time.monotonic()
    reading = collector.collect()
    print(f"collect() took {time.monotonic() - t0:.2f} s: {reading.error}")
    assert reading.payload is None
    assert reading.error is not None
    assert "timed out" in reading.error
    assert not ended.exists(), "collect() waited for systemctl's child to finish"
    sleeper = int((tmp_path / "sleeper").read_text())
    wait_for(lambda: not _alive(sleeper), f"systemctl's child {sleeper} killed")
    assert not ended.exists(), "systemctl's child finished instead of being killed"


def test_collect_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_guardian.sources.unit as unit_mod

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("surprise")

    monkeypatch.setattr(unit_mod, "listening_inodes", boom)
    proc = _fake_proc(tmp_path)
    reading = UnitCollector(ServiceConfig(name="a"), UnitSourceConfig(), proc_root=proc).collect()
    assert reading.payload is None
    assert reading.error is not None
    assert "surprise" in reading.error


def test_socket_is_really_listening_on_loopback(listening_child: Child) -> None:
    # Sanity check of the fixture itself: the child accepts connections on 127.0.0.1.
    with socket.create_connection(("127.0.0.1", listening_child.port), timeout=2):
        pass


# --- what is read when: the kept full read (module docstring of sources/unit.py) -------------

REFRESH_SECONDS = 30.0


def _settled_proc(root: Path) -> Path:
    """A fake /proc with full stat lines (start times), vLLM (100) listening on 8000 via fd 7."""
    proc = root / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(PROC_NET_TCP)
    for pid, ppid in [(100, 1), (101, 100), (102, 101)]:
        _write_stat(proc, pid, ppid, start_ticks=5000 + pid)
        (proc / str(pid) / "cmdline").write_bytes(b"vllm\0serve\0")
    os.symlink("socket:[12345]", proc / "100" / "fd" / "7")
    return proc


def _write_stat(proc: Path, pid: int, ppid: int, start_ticks: int) -> None:
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True, exist_ok=True)
    fields = ["S", str(ppid), *["0"] * 17, str(start_ticks), "0", "0"]  # starttime: field 22
    (d / "stat").write_text(f"{pid} (vllm x) {' '.join(fields)}\n")


def _rm_pid(proc: Path, pid: int) -> None:
    for f in (proc / str(pid) / "fd").iterdir():
        f.unlink()
    (proc / str(pid) / "fd").rmdir()
    for f in (proc / str(pid)).iterdir():
        f.unlink()
    (proc / str(pid)).rmdir()


def _pid_reused(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    _write_stat(proc, 100, 1, start_ticks=999_999)  # same pid, another process


def _main_exited_child_took_socket(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    _rm_pid(proc, 100)
    os.symlink("socket:[12345]", proc / "101" / "fd" / "3")
    _write_stat(proc, 101, 1, start_ticks=5101)  # reparented to init


def _socket_replaced(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    # The same fd number now names another listening socket (closed and bound again).
    (proc / "100" / "fd" / "7").unlink()
    os.symlink("socket:[55555]", proc / "100" / "fd" / "7")
    (proc / "net" / "tcp").write_text(PROC_NET_TCP.replace(" 12345 ", " 55555 "))


def _worker_exited(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    _rm_pid(proc, 102)


def _worker_pid_reused(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    _write_stat(proc, 102, 1, start_ticks=999_999)  # the worker exited; another process has 102


def _refresh_due(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    clock.advance(REFRESH_SECONDS)


def _invalidated(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    c.invalidate()


def _a_tick_passes(proc: Path, clock: FakeClock, c: UnitCollector) -> None:
    clock.advance(REFRESH_SECONDS - 1)


CHANGES = {
    # change between two ticks: (full read on the second tick?, main pid, pids it then reports)
    "nothing changed, refresh not due": (_a_tick_passes, False, 100, (100, 101, 102)),
    "refresh due": (_refresh_due, True, 100, (100, 101, 102)),
    "invalidated (health changed, log event)": (_invalidated, True, 100, (100, 101, 102)),
    "main pid reused by another process": (_pid_reused, True, 100, (100, 101, 102)),
    "main exited, its child holds the socket": (
        _main_exited_child_took_socket, True, 101, (101, 102),
    ),
    "main listens on another socket": (_socket_replaced, True, 100, (100, 101, 102)),
    "a known worker exited": (_worker_exited, True, 100, (100, 101)),
    "a known worker's pid reused by another process": (_worker_pid_reused, True, 100, (100, 101)),
}  # fmt: skip


@pytest.mark.parametrize("name", CHANGES)
def test_by_port_full_read_only_when_something_changed(tmp_path: Path, name: str) -> None:
    change, full, main_pid, pids = CHANGES[name]
    proc = _settled_proc(tmp_path)
    clock = FakeClock()
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8000")
    c = UnitCollector(svc, UnitSourceConfig(refresh_seconds=REFRESH_SECONDS), proc, clock)
    first = c.collect().payload
    assert isinstance(first, UnitState)
    assert (first.main_pid, first.pids, c.full_reads) == (100, (100, 101, 102), 1)
    change(proc, clock, c)
    second = c.collect().payload
    assert isinstance(second, UnitState)
    assert (c.full_reads == 2, second.main_pid, second.pids) == (full, main_pid, pids)


def test_by_port_refresh_zero_reads_every_tick(tmp_path: Path) -> None:
    proc = _settled_proc(tmp_path)
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8000")
    c = UnitCollector(svc, UnitSourceConfig(refresh_seconds=0), proc, FakeClock())
    for _ in range(3):
        c.collect()
    assert c.full_reads == 3


def test_by_port_nothing_listening_is_read_every_tick(tmp_path: Path) -> None:
    # vLLM down or still starting: the moment it listens must be seen on that tick.
    proc = _settled_proc(tmp_path)
    (proc / "net" / "tcp").write_text(PROC_NET_TCP.replace(":1F40 ", ":1F42 "))
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8000")
    c = UnitCollector(svc, UnitSourceConfig(), proc, FakeClock())
    assert isinstance(c.collect().payload, UnitState)
    (proc / "net" / "tcp").write_text(PROC_NET_TCP)
    now = c.collect().payload
    assert isinstance(now, UnitState)
    assert (now.main_pid, c.full_reads) == (100, 2)


UNIT_STATES = {
    # what systemctl show says: (kept, so the next tick does not fork systemctl?)
    "active running": ("active", "running", "100", True),
    "activating": ("activating", "start", "100", False),
    "reloading": ("reloading", "reload", "100", False),
    "deactivating": ("deactivating", "stop-sigterm", "100", False),
    "failed, no main process": ("failed", "failed", "0", False),
}


@pytest.mark.parametrize("name", UNIT_STATES)
def test_unit_kept_only_while_active_running(tmp_path: Path, name: str) -> None:
    active, sub, pid, kept = UNIT_STATES[name]
    proc = _settled_proc(tmp_path)
    show = tmp_path / "show.txt"
    show.write_text(
        SHOW_RUNNING.format(pid=pid)
        .replace("ActiveState=active", f"ActiveState={active}")
        .replace("SubState=running", f"SubState={sub}")
    )
    calls = tmp_path / "calls"
    systemctl = _fake_systemctl(tmp_path, f'echo x >> "{calls}"\ncat "{show}"')
    clock = FakeClock()
    c = UnitCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        UnitSourceConfig(systemctl=str(systemctl)),
        proc,
        clock,
    )
    first, second = c.collect().payload, c.collect().payload
    assert first == second
    assert isinstance(first, UnitState)
    assert first.active_state == active
    assert len(calls.read_text().splitlines()) == (1 if kept else 2)


def test_unit_new_main_pid_is_read_at_once(tmp_path: Path) -> None:
    # systemd restarted vLLM between two ticks: the old main pid is gone, the next tick forks
    # systemctl again and reports the new one, without waiting for the refresh.
    proc = _settled_proc(tmp_path)
    _write_stat(proc, 300, 1, start_ticks=9000)
    show = tmp_path / "show.txt"
    show.write_text(SHOW_RUNNING.format(pid=100))
    systemctl = _fake_systemctl(tmp_path, f'cat "{show}"')
    c = UnitCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        UnitSourceConfig(systemctl=str(systemctl)),
        proc,
        FakeClock(),
    )
    first = c.collect().payload
    assert isinstance(first, UnitState)
    assert first.main_pid == 100
    _rm_pid(proc, 100)
    show.write_text(SHOW_RUNNING.format(pid=300).replace("NRestarts=3", "NRestarts=4"))
    second = c.collect().payload
    assert isinstance(second, UnitState)
    assert (second.main_pid, second.n_restarts, second.pids, c.full_reads) == (300, 4, (300,), 2)


def _snap(health: HealthState | None, log_events: int = 0) -> Snapshot:
    logs = LogReading(
        (), tuple(LogEvent(LogEventKind.CUDA_OOM, 0.0, "x") for _ in range(log_events)), log_events
    )
    probe = HealthProbe(health, 200, 0.01) if health is not None else None
    return Snapshot(1.0, (ServiceSnapshot("a", health=probe, logs=logs),), None)


INVALIDATE = {
    # (previous tick, this tick) → read the unit afresh next tick?
    "first tick": (None, _snap(HealthState.UP), True),
    "health steady up": (_snap(HealthState.UP), _snap(HealthState.UP), False),
    "health went down": (_snap(HealthState.UP), _snap(HealthState.REFUSED), True),
    "health came back": (_snap(HealthState.REFUSED), _snap(HealthState.UP), True),
    "health steady refused": (_snap(HealthState.REFUSED), _snap(HealthState.REFUSED), False),
    "a log event": (_snap(HealthState.UP), _snap(HealthState.UP, log_events=1), True),
}


@pytest.mark.parametrize("name", INVALIDATE)
def test_daemon_invalidates_the_unit_when_health_or_logs_say_so(name: str) -> None:
    previous, now, expected = INVALIDATE[name]
    assert unit_may_have_changed(previous, now, "a") is expected
    assert unit_may_have_changed(previous, now, "other-service") is False


def test_only_the_listening_rows_are_read(tmp_path: Path) -> None:
    # The kernel lists listening sockets first; the established ones after them (thousands on
    # a busy server) are not read, so a listener row placed after them is not seen.
    rows = PROC_NET_TCP.splitlines()
    established = rows[3]
    late_listener = rows[2].replace(":1F41 ", ":1F42 ")
    path = tmp_path / "tcp"
    path.write_text("\n".join([*rows[:3], *[established] * 5000, late_listener]) + "\n")
    text = read_listening_rows(path)
    assert text.splitlines() == rows[:3]
    assert [s.local_port for s in parse_proc_net_tcp(text)] == [8000, 8001]


# --- the process backend: vLLM that the guardian's supervisor started, still loading ----------

NOT_LISTENING = PROC_NET_TCP.replace(" 0A ", " 07 ")  # the port's socket closed: nothing listens

PID_FILES: dict[str, tuple[str | None, int | None]] = {
    # what <state_dir>/<service>.pid holds: (its text, the main pid the source then reports)
    "no pid file (not started by the guardian)": (None, None),
    "the process the supervisor started, loading": ("100 5100\n", 100),
    "that pid, now another process (start time differs)": ("100 4242\n", None),
    "a pid that no longer runs": ("4321 5100\n", None),
    "not 'PID START'": ("garbage\n", None),
}


@pytest.mark.parametrize("name", PID_FILES)
def test_by_port_sees_the_process_its_supervisor_started_before_it_listens(
    tmp_path: Path, name: str
) -> None:
    """vLLM listens only once loaded (minutes on a real model). Without a unit, the port is how
    the source finds it, so a vLLM the process backend restarted was invisible while loading:
    the policy, waiting for the supervisor's restart, saw nobody restart it, killed the loading
    process and started another. The supervisor's pid file (pid and start time) names it."""
    text, main = PID_FILES[name]
    proc = _settled_proc(tmp_path)
    (proc / "net" / "tcp").write_text(NOT_LISTENING)
    pid_file = tmp_path / "state" / "a.pid"
    if text is not None:
        pid_file.parent.mkdir()
        pid_file.write_text(text)
    svc = ServiceConfig(name="a", url="http://127.0.0.1:8000")
    c = UnitCollector(svc, UnitSourceConfig(), proc, FakeClock(), pid_file=pid_file)
    for _ in range(2):  # read afresh every tick while nothing listens
        reading = c.collect()
        assert reading.error is None, reading.error
        state = reading.payload
        assert isinstance(state, UnitState)
        assert state.main_pid == main
        assert state.pids == ((100, 101, 102) if main else ())
    assert c.full_reads == 2
