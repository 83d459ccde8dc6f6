"""The unit source: the vLLM service's process as systemd and /proc show it.

Collected once per tick per service, in parallel with the other sources. It answers "is the
service's process there, which one is it, how was it started and what else belongs to it":

* with ``services[].unit`` set, ``systemctl show`` gives the unit's states, result, restart
  count and main PID;
* without a unit (vLLM started by hand, or by the guardian's own process manager in the
  demo), the main PID is the process that listens on the service URL's port, found through
  ``/proc/net/tcp{,6}`` and the ``socket:[inode]`` links under ``/proc/<pid>/fd``.

Either way the main process's command line (secrets redacted) and its descendants come from
/proc. The policy uses them to attribute GPU memory to the service and to see the flags the
running vLLM was really started with. Parsers are pure functions over text so tests can feed
them captured output; an unreadable /proc entry (a process that exits mid-scan, another
user's process) is skipped, never fatal.

**What is read when.** All of this changes at a restart, not from one tick to the next, and a
full read is the expensive part of a tick (a ``systemctl show`` fork, or a walk over every
process's fds and ``stat``). So a full read is kept and, while it still describes the same
process, reused: each tick checks only that the main PID is alive with the start time it had
(one ``stat`` read), that the known descendants still run with theirs, and, without a unit,
that the main PID still holds the listening socket's inode on the same fd (one ``readlink``). The full
read is done again at once when any of these fails, when the last read found no main process
or a unit not ``active``/``running`` (down, starting, stopping, failed: read every tick), when
the daemon calls :meth:`UnitCollector.invalidate` (the service's health changed or its log
showed an event), and otherwise every ``sources.unit.refresh_seconds`` (30 s).

The staleness this allows, and why no decision depends on it: between full reads, with the main
process alive and unchanged, a reused reading can miss (a) a ``systemctl reload`` or a stop in
progress (``reloading``/``deactivating`` with the same main PID), (b) a worker started since the
read, (c) a restart counter or result changed without a new main process. (a) matters to the
policy only while health is refused (the start-up grace reads ``activating``/``reloading``), and
a health change invalidates the reading, so the next tick reads afresh; a stop ends with the main
process gone, which is seen at once. (b) does not move GPU attribution: NVML's processes carry
their ancestors and cgroup, and the main PID, which is always checked, is an ancestor of every
worker. (c) only changes with a new main process (``NRestarts``, ``Result``, ``ExecMainStatus``,
``ActiveEnterTimestampMonotonic`` are set when the old one exits or a new one starts). Every
reading is at most ``refresh_seconds`` old in any case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from vllm_guardian.config import ServiceConfig, UnitSourceConfig
from vllm_guardian.lowio.clock import Clock, SystemClock
from vllm_guardian.lowio.procfs import (
    parse_pid_file,
    parse_start_ticks,
    parse_stat,
    process_age_seconds,
)
from vllm_guardian.lowio.redact import redact_argv
from vllm_guardian.model import Reading, SourceKind, UnitState
from vllm_guardian.sources.base import failed

if TYPE_CHECKING:
    from vllm_guardian.sources.base import Collector

SHOW_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "MainPID",
    "NRestarts",
    "ExecMainStatus",
    "ActiveEnterTimestampMonotonic",
    "ControlGroup",
)

# Scanning /proc takes milliseconds; this margin lets systemctl use its whole timeout and
# still have collect() return its own, specific error before the daemon calls it hung.
_PROC_SCAN_MARGIN_SECONDS = 1.0
_TCP_LISTEN = 0x0A
_STDERR_KEEP_CHARS = 300


# --- pure parsers ----------------------------------------------------------------------------


def parse_systemctl_show(text: str) -> dict[str, str]:
    """``Key=Value`` lines → dict. Values may contain '='; lines without one are ignored."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and not key.startswith(" "):
            out[key.strip()] = value.strip()
    return out


def _int_or_none(value: str | None) -> int | None:
    if value is None or value == "" or value.startswith("["):  # "[not set]"
        return None
    try:
        return int(value)
    except ValueError:
        return None


def unit_state_from_show(unit: str, props: Mapping[str, str]) -> UnitState:
    """The systemd part of a :class:`UnitState` (no cmdline, no pids yet)."""
    main_pid = _int_or_none(props.get("MainPID"))
    enter_us = _int_or_none(props.get("ActiveEnterTimestampMonotonic"))
    return UnitState(
        unit=unit,
        active_state=props.get("ActiveState") or None,
        sub_state=props.get("SubState") or None,
        result=props.get("Result") or None,
        main_pid=main_pid if main_pid else None,  # 0: no main process
        n_restarts=_int_or_none(props.get("NRestarts")),
        exec_main_status=_int_or_none(props.get("ExecMainStatus")),
        # 0 means "never entered active"; systemd reports microseconds of CLOCK_MONOTONIC.
        active_enter_monotonic_seconds=enter_us / 1e6 if enter_us else None,
        control_group=props.get("ControlGroup") or None,
        cmdline=None,
    )


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp or tcp6."""

    local_address: str
    local_port: int
    state: int
    inode: int

    @property
    def listening(self) -> bool:
        return self.state == _TCP_LISTEN


def _decode_proc_address(hex_addr: str) -> str:
    """The kernel prints each 32-bit word of the address in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def parse_proc_net_tcp(text: str, port: int | None = None) -> tuple[TcpSocket, ...]:
    """Parse /proc/net/tcp or /proc/net/tcp6; malformed rows are skipped. With ``port``, only
    that local port's rows (the others are skipped before they are decoded: a busy server has
    thousands of connections)."""
    out: list[TcpSocket] = []
    want = None if port is None else f":{port:04X} "
    for line in text.splitlines()[1:]:  # the first line is the header
        if want is not None and want not in line:
            continue
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            addr_hex, port_hex = fields[1].split(":")
            out.append(
                TcpSocket(
                    local_address=_decode_proc_address(addr_hex),
                    local_port=int(port_hex, 16),
                    state=int(fields[3], 16),
                    inode=int(fields[9]),
                )
            )
        except ValueError:
            continue
    return tuple(out)


parse_proc_stat = parse_stat  # procfs.py, shared with the NVML and allocator sources


def parse_cmdline(raw: bytes) -> tuple[str, ...] | None:
    """NUL-separated argv → tuple; None for an empty one (kernel thread, zombie)."""
    if not raw:
        return None
    parts = raw.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    return tuple(p.decode("utf-8", errors="replace") for p in parts) or None


def descendants(root: int, parents: Mapping[int, int]) -> tuple[int, ...]:
    """``root`` followed by all its descendants (sorted), from a pid → ppid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    seen = {root}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return (root, *sorted(seen - {root}))


def port_of(url: str) -> int:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80


# --- /proc readers (skip what cannot be read) ------------------------------------------------


def _pid_dirs(proc_root: Path) -> Iterable[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return ()
    return (int(n) for n in names if n.isdigit())


def read_parents(proc_root: Path) -> dict[int, int]:
    parents: dict[int, int] = {}
    root = str(proc_root)  # plain strings: a Path per process costs more than the read
    for pid in _pid_dirs(proc_root):
        try:
            with open(f"{root}/{pid}/stat", "rb") as fh:
                text = fh.read().decode("utf-8", errors="replace")
        except OSError:  # exited since listdir, or not ours to read
            continue
        parsed = parse_proc_stat(text)
        if parsed is not None:
            parents[parsed[0]] = parsed[1]
    return parents


def read_cmdline(proc_root: Path, pid: int) -> tuple[str, ...] | None:
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    argv = parse_cmdline(raw)
    return redact_argv(argv) if argv is not None else None


def read_listening_rows(path: Path) -> str:
    """The header and the listening rows of /proc/net/tcp{,6}, read only as far as they go.

    The kernel lists listening sockets first (``tcp_seq_start``: the listening hash, then the
    established one), so reading stops at the first row in another state: on a server with
    thousands of connections the rest is never generated (reading the whole file took seconds
    on a busy host)."""
    out: list[str] = []
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh):
            fields = line.split(None, 4)
            if n > 0 and len(fields) >= 4 and fields[3] != "0A":
                break
            out.append(line)
    return "".join(out)


def listening_inodes(proc_root: Path, port: int) -> set[int]:
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            text = read_listening_rows(proc_root / "net" / name)
        except OSError:  # tcp6 is absent where IPv6 is disabled
            continue
        inodes.update(
            s.inode for s in parse_proc_net_tcp(text, port) if s.listening and s.local_port == port
        )
    inodes.discard(0)
    return inodes


def socket_fd(proc_root: Path, pid: int, inodes: set[int]) -> tuple[str, int] | None:
    """(fd, inode) of the first of ``pid``'s fds that is one of the socket inodes, or None."""
    fd_dir = proc_root / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    targets = {f"socket:[{i}]": i for i in inodes}
    for fd in fds:
        try:
            inode = targets.get(os.readlink(fd_dir / fd))
        except OSError:
            continue
        if inode is not None:
            return fd, inode
    return None


def _holds_socket(proc_root: Path, pid: int, inodes: set[int]) -> bool:
    return socket_fd(proc_root, pid, inodes) is not None


def read_start_ticks(proc_root: Path, pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it is gone."""
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return parse_start_ticks(text)


def socket_owners(proc_root: Path, inodes: set[int], hint_pid: int | None = None) -> set[int]:
    """Pids holding one of the socket inodes. ``hint_pid`` (last tick's answer) is tried first
    so the steady state costs one process's fds instead of a walk over every process."""
    if not inodes:
        return set()
    if hint_pid is not None and _holds_socket(proc_root, hint_pid, inodes):
        return {hint_pid}
    return {pid for pid in _pid_dirs(proc_root) if _holds_socket(proc_root, pid, inodes)}


def topmost(pids: set[int], parents: Mapping[int, int]) -> int:
    """The pid none of whose ancestors is also in ``pids``: with several API server processes
    sharing one inherited socket, the parent is the service's main process."""

    def has_ancestor_in_set(pid: int) -> bool:
        seen: set[int] = set()
        cur = parents.get(pid)
        while cur is not None and cur not in seen and cur > 0:
            if cur in pids:
                return True
            seen.add(cur)
            cur = parents.get(cur)
        return False

    tops = [p for p in pids if not has_ancestor_in_set(p)]
    return min(tops or pids)


# --- the collector ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kept:
    """A full read, kept while it still describes the same process (module docstring)."""

    state: UnitState  # main_pid is set
    start_ticks: int  # the main process's start time: a reused pid has another
    descendant_start_ticks: tuple[int | None, ...]  # the same for state.pids[1:]
    read_monotonic_seconds: float
    listener: tuple[str, int] | None  # without a unit: (fd, inode) of the listening socket


class UnitCollector:
    """Collector for one service's unit (or, without a unit, its listening process)."""

    kind = SourceKind.UNIT

    def __init__(
        self,
        service: ServiceConfig,
        cfg: UnitSourceConfig,
        proc_root: Path = Path("/proc"),
        clock: Clock | None = None,
        pid_file: Path | None = None,
    ) -> None:
        """``pid_file``: the guardian's own supervisor's (process backend), naming the vLLM it
        started as ``PID START_TICKS``; without a unit it is how a vLLM that does not listen
        yet (loading) is seen."""
        self.service: str | None = service.name
        self._pid_file = pid_file
        self._unit = service.unit
        self._url = service.url
        self._cfg = cfg
        self._proc_root = proc_root
        self._clock: Clock = clock or SystemClock()
        self._booted: float | None = None  # the boot's moment in this clock (see _started)
        self.timeout_seconds = cfg.timeout_seconds + _PROC_SCAN_MARGIN_SECONDS
        self._last_listener: int | None = None
        self._kept: _Kept | None = None
        self.full_reads = 0  # how many collects read everything (tests, bench)

    def collect(self) -> Reading:
        try:
            kept = self._kept
            if kept is not None and self._still_valid(kept):
                return self._reading(kept.state)
            self._kept = None
            self.full_reads += 1
            if self._unit is not None:
                return self._collect_unit(self._unit)
            return self._collect_by_port()
        except Exception as e:  # a source that is down is an observation, never an exception
            self._kept = None
            return failed(self.kind, self.service, f"unit source failed: {type(e).__name__}: {e}")

    def invalidate(self) -> None:
        """Read everything afresh at the next collect: the daemon calls this when the service's
        health changed or its log showed an event (a restart may be under way)."""
        self._kept = None

    def close(self) -> None:
        """Nothing to release: every systemctl call is waited for inside collect()."""

    # -- the kept reading

    def _still_valid(self, kept: _Kept) -> bool:
        """The cheap per-tick check that the kept full read still describes the process."""
        age = self._clock.monotonic() - kept.read_monotonic_seconds
        if not 0 <= age < self._cfg.refresh_seconds:
            return False
        main = kept.state.main_pid
        assert main is not None
        if read_start_ticks(self._proc_root, main) != kept.start_ticks:
            return False  # exited, or the pid was reused
        if kept.listener is not None:
            fd, inode = kept.listener
            try:
                if os.readlink(self._proc_root / str(main) / "fd" / fd) != f"socket:[{inode}]":
                    return False
            except OSError:
                return False
        # Each known descendant by its start time too: a pid the kernel handed to another
        # process (32k pids by default) must not stay listed as vLLM's until the refresh.
        return all(
            read_start_ticks(self._proc_root, p) == t
            for p, t in zip(kept.state.pids[1:], kept.descendant_start_ticks, strict=True)
        )

    def _keep(self, state: UnitState, listener: tuple[str, int] | None) -> None:
        """Keep a full read that found a settled process: a main process and, with a unit,
        ``active``/``running``. Anything else (down, starting, stopping) is read every tick."""
        if state.main_pid is None:
            return
        if self._unit is not None and (state.active_state, state.sub_state) != (
            "active",
            "running",
        ):
            return
        if self._unit is None and listener is None:
            return
        start = read_start_ticks(self._proc_root, state.main_pid)
        if start is None:
            return
        descendants = tuple(read_start_ticks(self._proc_root, p) for p in state.pids[1:])
        if None in descendants:
            return  # one exited since the read: read again next tick
        self._kept = _Kept(state, start, descendants, self._clock.monotonic(), listener)

    # -- with a unit

    def _collect_unit(self, unit: str) -> Reading:
        argv = [
            self._cfg.systemctl,
            "show",
            "--property=" + ",".join(SHOW_PROPERTIES),
            "--no-pager",
            "--",  # the unit name is never read as an option
            unit,
        ]
        result = _run(argv, self._cfg.timeout_seconds)
        if isinstance(result, _RunFailure):
            return failed(self.kind, self.service, result.error, result.hint)
        rc, stdout, stderr = result
        if rc != 0:
            detail = stderr.strip().splitlines()[0][:_STDERR_KEEP_CHARS] if stderr.strip() else ""
            return failed(
                self.kind,
                self.service,
                f"systemctl show {unit} exited with status {rc}: {detail}".rstrip(": "),
                hint="the guardian reads unit state from the system manager; it must run on "
                "the host (or in the container) where the vLLM unit runs, with systemd as PID 1",
            )
        props = parse_systemctl_show(stdout)
        if props.get("LoadState") == "not-found":
            return failed(
                self.kind,
                self.service,
                f"unit {unit} not found",
                hint=f"unit {unit} not found: check services[].unit",
            )
        if "ActiveState" not in props:
            return failed(self.kind, self.service, f"systemctl show {unit} printed no ActiveState")
        state = self._with_processes(unit_state_from_show(unit, props))
        self._keep(state, None)
        return self._reading(state)

    # -- without a unit

    def _collect_by_port(self) -> Reading:
        port = port_of(self._url)
        if not (self._proc_root / "net" / "tcp").exists():
            return failed(
                self.kind,
                self.service,
                f"cannot read {self._proc_root / 'net' / 'tcp'}",
                hint="without services[].unit the guardian finds vLLM by its listening port in "
                "/proc; set services[].unit where /proc is not available",
            )
        inodes = listening_inodes(self._proc_root, port)
        empty = UnitState(
            unit=None,
            active_state=None,
            sub_state=None,
            result=None,
            main_pid=None,
            n_restarts=None,
            exec_main_status=None,
            active_enter_monotonic_seconds=None,
            control_group=None,
            cmdline=None,
        )
        if not inodes:
            # Nothing listens: vLLM is down, or still starting (it listens only once ready).
            # One the guardian's supervisor started is seen by its pid file meanwhile, as
            # systemd's MainPID shows a unit's process from its start.
            self._last_listener = None
            started = self._started_by_supervisor()
            if started is None:
                return self._reading(empty)
            return self._reading(self._with_processes(dataclasses.replace(empty, main_pid=started)))
        owners = socket_owners(self._proc_root, inodes, self._last_listener)
        if not owners:
            return failed(
                self.kind,
                self.service,
                f"port {port} is listening but no visible process owns the socket",
                hint="the guardian cannot see other users' file descriptors: run it as root or "
                "as vLLM's user, or set services[].unit",
            )
        parents = read_parents(self._proc_root)
        main_pid = topmost(owners, parents)
        self._last_listener = main_pid
        state = self._with_processes(dataclasses.replace(empty, main_pid=main_pid), parents)
        self._keep(state, socket_fd(self._proc_root, main_pid, inodes))
        return self._reading(state)

    def _started_by_supervisor(self) -> int | None:
        """The pid the supervisor's pid file names, if that very process (pid and start time)
        still runs; None without a file, or when it is unreadable, stale or malformed."""
        if self._pid_file is None:
            return None
        try:
            named = parse_pid_file(self._pid_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            return None
        if named is None:
            return None
        pid, ticks = named
        if pid <= 1 or read_start_ticks(self._proc_root, pid) != ticks:
            return None
        return pid

    # -- shared

    def _with_processes(
        self, state: UnitState, parents: Mapping[int, int] | None = None
    ) -> UnitState:
        if state.main_pid is None:
            return state
        if parents is None:
            parents = read_parents(self._proc_root)
        cmdline = read_cmdline(self._proc_root, state.main_pid)
        pids = (
            descendants(state.main_pid, parents) if state.main_pid in parents else (state.main_pid,)
        )
        return dataclasses.replace(
            state, cmdline=cmdline, pids=pids, main_started_seconds=self._started(state.main_pid)
        )

    def _started(self, pid: int) -> float | None:
        """When ``pid`` started, in this source's clock: its start in ticks since boot (/proc)
        on the boot's moment in this clock. The boot's moment is taken once and kept while
        it stays within a second, so a process's start is the same number on every tick (a
        snapshot that changes every tick would be recorded every tick)."""
        try:
            text = (self._proc_root / str(pid) / "stat").read_text()
        except OSError:
            return None  # gone, or another pid namespace
        boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
        booted = self._clock.time() - boot_now
        if self._booted is None or abs(booted - self._booted) > 1.0:  # first, or a clock step
            self._booted = booted
        age = process_age_seconds(text, boot_now, os.sysconf("SC_CLK_TCK"))
        return None if age is None else round(self._booted + boot_now - age, 3)

    def _reading(self, state: UnitState) -> Reading:
        return Reading(source=self.kind, service=self.service, payload=state)


@dataclass(frozen=True)
class _RunFailure:
    error: str
    hint: str


def _run(argv: list[str], timeout_seconds: float) -> tuple[int, str, str] | _RunFailure:
    """Run a command (never through a shell) with a hard deadline.

    It gets its own process group so a timeout kills whatever it started too; ``subprocess.run``
    would kill only the direct child and could then block on a grandchild holding the pipes.
    """
    tool = argv[0]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "LC_ALL": "C", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"},
        )
    except FileNotFoundError:
        return _RunFailure(
            f"{tool} not found",
            f"{tool!r} is not installed or not on PATH: set sources.unit.systemctl to its "
            "full path, or remove services[].unit to find vLLM by its port",
        )
    except OSError as e:
        return _RunFailure(
            f"cannot run {tool}: {e.strerror or e}",
            f"check that {tool!r} is executable by the guardian's user",
        )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return _RunFailure(
            f"{tool} show timed out after {timeout_seconds:g}s",
            "systemd (PID 1) is busy or hung; raise sources.unit.timeout_seconds if this "
            "host is slow but healthy",
        )
    return (
        proc.returncode,
        stdout.decode("utf-8", errors="replace"),
        stderr.decode("utf-8", errors="replace"),
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=1.0)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait()


if TYPE_CHECKING:

    def _is_collector(c: UnitCollector) -> Collector:
        return c
