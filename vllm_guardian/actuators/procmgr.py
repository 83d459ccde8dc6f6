"""Actuator: a small process manager, the restart backend for hosts without systemd (and the demo).

Where it sits: the act stage's restart backend when ``policy.backend: process``. It runs
``services[].command`` with the guardian's flags file applied the way the systemd drop-in
applies it (``$VLLM_GUARDIAN_ARGS`` appended to the argument list, the file's other variables in
the environment), restarts it when it exits for any reason — vLLM sometimes exits 0 after its
engine dies, so this is ``Restart=always`` — and restarts it on request: SIGTERM to the process
group (vLLM drains for ``--shutdown-timeout``), SIGKILL after the stop timeout, start again.

The command is an argument list, never a shell. Output goes to a log file that the logs source
follows (``services[].log_file``).

vLLM runs in its own session (setsid), so it outlives a guardian killed with SIGKILL. Each start
writes a pid file (``<state_dir>/<service>.pid``: the pid and the process's start time from
``/proc/PID/stat``); the next guardian adopts the process it names when one with that pid *and*
that start time is still running (a reused pid is never mistaken for it) and supervises it by
polling, instead of starting a second copy that could not bind the port.

A command that daemonizes (forks a child that calls setsid or double-forks, then exits 0) leaves
that child outside its process group, where the group kill after an exit cannot reach it. Every
process started carries :data:`SUPERVISED_ENV` in its environment; when the command exits and a
process carrying this supervisor's mark still runs outside the command's group, the command
daemonized. A command that clears its environment (``env -i``) loses the mark; when the
supervisor knows the service's port, a process listening on it that started after the command
did, outside the command's process group, is the command's escapee too (a server that held the
port before the command started is not: that command's quick exits go on under the backoff). A
daemon that clears its environment and serves no port of the service's is not told apart
from a command that exits: it is restarted under the quick-exit backoff. Either way the
supervisor says so (the log at ERROR, and ``on_daemonized``, which the daemon writes to the
audit log) and stops supervising: it starts nothing on top of the escaped server,
which keeps serving, and leaves it to the operator. Killing it instead (systemd's
KillMode=control-group) would take down a server that is answering requests and restart a
command that daemonizes again at once: an outage every restart, not a fix. vLLM itself never
daemonizes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.lowio.clock import Clock, SystemClock
from vllm_guardian.lowio.procfs import is_weight_cache_command, parse_pid_file
from vllm_guardian.lowio.redact import redact_argv

log = logging.getLogger("vllm_guardian.procmgr")

_POLL_SECONDS = 0.2  # how often an adopted process (not our child: no wait()) is looked at
# In the environment of every process a supervisor starts (inherited by whatever it forks):
# "<service>:<the guardian's pid>". A process that carries it and outlived the command is one
# the command left behind.
SUPERVISED_ENV = "VLLM_GUARDIAN_SUPERVISED"


@dataclass(frozen=True)
class Daemonized:
    """A process the command started that still runs after the command exited."""

    pid: int
    ports: tuple[int, ...]  # the TCP ports it listens on, lowest first


def _stat_fields(proc_root: Path, pid: int) -> list[str] | None:
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # from field 3 (state) on


_MAX_ANCESTORS = 64  # a deeper chain does not occur; the bound stops a /proc that loops


def is_weight_cache(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` is vLLM's weight-cache launcher (``vllm preload``) or one of its
    descendants (the daemons holding the weights are its ``spawn`` children, untitled). A
    command that starts it beside ``vllm serve`` puts it in the command's process group and
    environment: it must outlive every restart (that is what makes the restart fast)."""
    for _ in range(_MAX_ANCESTORS):
        try:
            cmdline = (proc_root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return False
        if is_weight_cache_command(cmdline.decode("utf-8", errors="replace")):
            return True
        fields = _stat_fields(proc_root, pid)
        if fields is None or len(fields) < 2 or fields[1] in ("0", "1", str(pid)):
            return False
        pid = int(fields[1])
    return False


def signal_group(pgid: int, sig: int, proc_root: Path = Path("/proc")) -> None:
    """``killpg(pgid, sig)``, except that vLLM's weight-cache daemon (:func:`is_weight_cache`)
    in the group is spared: each other member is signalled by itself then. Raises
    ProcessLookupError, as killpg does, when the group is empty."""
    members: list[int] = []
    with contextlib.suppress(OSError):
        for name in os.listdir(proc_root):
            if name.isdigit():
                fields = _stat_fields(proc_root, int(name))
                if fields is not None and len(fields) > 2 and fields[2] == str(pgid):
                    members.append(int(name))
    spared = {m for m in members if is_weight_cache(m, proc_root)}
    if not spared:
        os.killpg(pgid, sig)
        return
    log.info("process group %d: sparing vLLM's weight-cache daemon %s", pgid, sorted(spared))
    for m in members:
        if m not in spared:
            with contextlib.suppress(ProcessLookupError):
                os.kill(m, sig)


def marked_processes(mark: str, outside_pgid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Running processes whose environment carries ``SUPERVISED_ENV=mark``, except those in
    process group ``outside_pgid`` (the command's, being killed) and vLLM's weight-cache daemon
    (:func:`is_weight_cache`: it runs beside the server on purpose), lowest pid first."""
    needle = f"{SUPERVISED_ENV}={mark}".encode()
    me = os.getpid()
    found: list[int] = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            environ = (proc_root / name / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle not in environ.split(b"\0"):
            continue
        fields = _stat_fields(proc_root, int(name))
        if fields is None or len(fields) < 3 or fields[0] in ("Z", "X"):
            continue
        if fields[2] != str(outside_pgid) and not is_weight_cache(int(name), proc_root):
            found.append(int(name))
    return sorted(found)


def _listening_inodes(proc_root: Path, port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` in this network namespace."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc_root / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def port_escapees(
    port: int, outside_pgid: int, since_ticks: int, proc_root: Path = Path("/proc")
) -> list[int]:
    """Processes listening on ``port`` that started at or after ``since_ticks`` (the command's
    start, /proc/PID/stat field 22) and are not in process group ``outside_pgid`` (the
    command's, being killed), lowest pid first: what a command that daemonized with its
    environment cleared left serving."""
    inodes = _listening_inodes(proc_root, port)
    found: list[int] = []
    if not inodes:
        return found
    me = os.getpid()
    try:
        names = os.listdir(proc_root)
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        fds = proc_root / name / "fd"
        try:
            targets = {os.readlink(fds / fd) for fd in os.listdir(fds)}
        except OSError:  # gone, or not ours to read
            continue
        if not any(t[8:-1] in inodes for t in targets if t.startswith("socket:[")):
            continue
        fields = _stat_fields(proc_root, int(name))
        if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
            continue
        if fields[2] != str(outside_pgid) and int(fields[19]) >= since_ticks:
            found.append(int(name))
    return sorted(found)


def listening_ports(pid: int, proc_root: Path = Path("/proc")) -> tuple[int, ...]:
    """The TCP ports ``pid`` listens on (its sockets in its network namespace's tables)."""
    fd_dir = proc_root / str(pid) / "fd"
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(fd_dir / fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc_root / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return tuple(sorted(ports))


def next_restart_delay(
    ran_seconds: float,
    previous_seconds: float | None,
    initial_seconds: float,
    max_seconds: float,
    stable_seconds: float,
) -> float:
    """The wait before starting a command again after it exited, having run ``ran_seconds``.

    A run shorter than ``stable_seconds`` (a command that fails at once: a bad flag, a port in
    use, a missing model) doubles the previous wait, up to ``max_seconds``; a run that lasted
    that long starts over at ``initial_seconds``. A fixed wait restarted a command that exits
    at once about once a second, forever (systemd's RestartSteps/RestartMaxDelaySec)."""
    if previous_seconds is None or ran_seconds >= stable_seconds:
        return initial_seconds
    return min(max_seconds, max(initial_seconds, 2 * previous_seconds))


def process_start_ticks(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None if no such
    process or a zombie. With the pid it names one process for the life of the machine."""
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # comm (field 2) is in parentheses and may hold spaces or ')': split after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


class Adopted:
    """A process a previous guardian started and left running: the part of Popen's interface
    the supervisor uses, by polling /proc (only a parent may wait() for a process)."""

    def __init__(self, pid: int, start_ticks: int) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and process_start_ticks(self.pid) != self.start_ticks:
            self.returncode = -1  # gone; its exit status went to whoever reaped it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(_POLL_SECONDS)
        return -1

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that now names another process
            os.kill(self.pid, sig)


class Supervisor:
    """Runs one command, keeps it running, restarts it on demand. Thread-safe."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        flags_path: Path,
        log_path: Path | None = None,
        restart_delay_seconds: float = 1.0,
        stop_timeout_seconds: float = 60.0,
        extra_env: Mapping[str, str] | None = None,
        exit_timeout_seconds: float = 30.0,
        pid_path: Path | None = None,
        restart_on_clean_exit: bool = True,
        tee_stdout: bool = False,
        restart_delay_max_seconds: float = 60.0,
        stable_seconds: float = 120.0,
        clock: Clock | None = None,
        on_daemonized: Callable[[str], None] | None = None,
        port: int | None = None,
    ) -> None:
        """``restart_on_clean_exit=False`` is systemd's ``Restart=on-failure``: an exit with
        status 0 (vLLM's after an engine death) ends supervision until ``start``/``restart``.
        A command that exits within ``stable_seconds`` of its start waits twice as long as the
        last time before the next start (from ``restart_delay_seconds`` up to
        ``restart_delay_max_seconds``: :func:`next_restart_delay`), measured on ``clock``.
        ``on_daemonized`` is told, once, when the command daemonized (the module docstring);
        ``port``, the service's, finds a daemon whose environment lost the supervisor's mark.
        ``stop_timeout_seconds`` bounds a stop that drains (SIGTERM, then SIGKILL);
        ``exit_timeout_seconds`` one with nothing to drain (a restart with ``drain=False``)."""
        self.name = name
        self.command = tuple(command)
        self.flags_path = flags_path
        self.log_path = log_path
        self.restart_delay_seconds = restart_delay_seconds
        self.restart_delay_max_seconds = max(restart_delay_max_seconds, restart_delay_seconds)
        self.stable_seconds = stable_seconds
        self._clock: Clock = clock or SystemClock()
        self._delay: float | None = None  # the last wait before a start; None: none yet
        self._started_monotonic = 0.0  # when the process supervised now started (or was adopted)
        self.delays: list[float] = []  # each wait before a start again, oldest first
        self.stop_timeout_seconds = stop_timeout_seconds
        self.exit_timeout_seconds = min(exit_timeout_seconds, stop_timeout_seconds)
        self.extra_env = dict(extra_env or {})
        # Beside the flags file (the state directory) unless told otherwise.
        self.pid_path = pid_path if pid_path is not None else flags_path.with_suffix(".pid")
        self.restart_on_clean_exit = restart_on_clean_exit
        # Container mode: the child's output also goes to our stdout (`kubectl logs`).
        self.tee_stdout = tee_stdout
        self._lock = threading.Lock()
        self._closed = False  # stop() was called: nothing is started again
        self._proc: subprocess.Popen[bytes] | Adopted | None = None
        self._adopt_checked = False
        self.adopted: int | None = None  # the pid adopted at start, if any
        self._want_running = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.starts = 0
        self.exits: list[int] = []  # exit codes seen, oldest first
        self.on_daemonized = on_daemonized
        self._mark = f"{name}:{os.getpid()}"
        self.port = port
        self._start_ticks: int | None = None  # the supervised process's start (its pid file)
        self.daemonized: Daemonized | None = None  # set once: supervision ended, see the module

    # --- what a restart reads ----------------------------------------------------------------

    def argv_and_env(self) -> tuple[list[str], dict[str, str]]:
        inherited = {**os.environ, **self.extra_env, SUPERVISED_ENV: self._mark}
        env = inherited
        argv = list(self.command)
        try:
            content = flagsfile.read(self.flags_path)
        except (flagsfile.FlagsRejected, OSError, ValueError) as e:  # never stops supervision
            log.error(
                "%s: flags file %s rejected, starting without it: %s", self.name, self.flags_path, e
            )
            content = None
        if content is not None:
            argv += content.argv
            env = flagsfile.merged_env(inherited, content.env)
        return argv, env

    @property
    def wants_running(self) -> bool:
        """False once stopped, or after a clean exit under ``restart_on_clean_exit=False``."""
        with self._lock:
            return self._want_running

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._want_running = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"supervise-{self.name}", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _spawn(self) -> None:
        argv, env = self.argv_and_env()
        if self.tee_stdout:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            threading.Thread(
                target=self._tee, args=(proc,), name=f"tee-{self.name}", daemon=True
            ).start()
        else:
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()  # type: ignore[union-attr]
        with self._lock:
            closed = self._closed
            if not closed:
                self._proc = proc
                self.starts += 1
                self._started_monotonic = self._clock.monotonic()
        if closed:  # stop() came while this process was being started
            self._terminate(proc, 10.0)
            raise OSError("the guardian is stopping")
        self._write_pid(proc.pid)
        log.info("%s: started pid %d: %s", self.name, proc.pid, shlex.join(redact_argv(argv)))

    # --- the pid file: what a restarted guardian adopts ---------------------------------------

    def _write_pid(self, pid: int) -> None:
        ticks = process_start_ticks(pid)
        with self._lock:
            self._start_ticks = ticks
        if ticks is None:
            return
        try:
            self.pid_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.pid_path.with_name(f".{self.pid_path.name}.{os.getpid()}")
            tmp.write_text(f"{pid} {ticks}\n")
            os.replace(tmp, self.pid_path)
        except OSError as e:
            log.error("%s: cannot write %s: %s (a restarted guardian could not adopt pid %d)",
                      self.name, self.pid_path, e.strerror or e, pid)  # fmt: skip

    def _clear_pid(self, pid: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            if int(self.pid_path.read_text().split()[0]) == pid:
                self.pid_path.unlink()

    def _adoptable(self) -> Adopted | None:
        """The process the pid file names, if that very process is still running."""
        try:
            text = self.pid_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            log.warning("%s: pid file %s unreadable (%s): ignored", self.name, self.pid_path, e)
            return None
        named = parse_pid_file(text)
        if named is None:
            log.warning("%s: pid file %s is not 'PID START': ignored", self.name, self.pid_path)
            return None
        pid, ticks = named
        if pid <= 1 or process_start_ticks(pid) != ticks:
            return None  # gone, or the pid now names another process
        return Adopted(pid, ticks)

    def _adopt(self) -> bool:
        """Once, before the first start: take over a running process a previous guardian left."""
        if self._adopt_checked:
            return False
        self._adopt_checked = True
        orphan = self._adoptable()
        if orphan is None:
            return False
        with self._lock:
            self._proc = orphan
            self.adopted = orphan.pid
            self._start_ticks = orphan.start_ticks
            self._started_monotonic = self._clock.monotonic()  # how long it ran before: unknown
        log.warning(
            "%s: adopting pid %d, started by a previous guardian and still running "
            "(not starting a second copy)", self.name, orphan.pid,
        )  # fmt: skip
        return True

    def _tee(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy the child's output to the log file and to our stdout until it closes. A write
        error on either side drops that side, never the child's output pipe (it would block)."""
        assert proc.stdout is not None
        log_file = None
        if self.log_path is not None:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                log_file = open(self.log_path, "ab")  # noqa: SIM115
            except OSError as e:
                log.error("%s: cannot open %s: %s", self.name, self.log_path, e)
        stdout = getattr(sys.stdout, "buffer", None)
        fd = proc.stdout.fileno()
        with proc.stdout:
            for chunk in iter(lambda: os.read(fd, 65536), b""):
                for sink in (log_file, stdout):
                    if sink is None:
                        continue
                    try:
                        sink.write(chunk)
                        sink.flush()
                    except (OSError, ValueError):
                        if sink is log_file:
                            log_file = None
                        else:
                            stdout = None
        if log_file is not None:
            log_file.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                want = self._want_running
                proc = self._proc
            if not want:
                return
            if proc is None and self._adopt():
                continue
            if proc is None:
                try:
                    self._spawn()
                except OSError as e:
                    log.error("%s: cannot start %s: %s", self.name, self.command[0], e)
                    self._wake.wait(max(self.restart_delay_seconds, 5.0))
                    self._wake.clear()
                continue
            code = proc.wait()
            # The leader is gone; anything left in its group is an orphan still holding GPU
            # memory that the next start needs (systemd does the same when a unit's main exits).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal_group(proc.pid, signal.SIGKILL)
            escaped = marked_processes(self._mark, proc.pid)
            with self._lock:
                since = self._start_ticks if self._proc is proc else None
            if not escaped and self.port is not None and since is not None:
                escaped = port_escapees(self.port, proc.pid, since)
            notice: str | None = None
            with self._lock:
                if self._proc is proc:
                    self._proc = None
                    self.exits.append(code)
                    if code == 0 and not self.restart_on_clean_exit:
                        self._want_running = False
                    if escaped and self._want_running:
                        self._want_running = False
                        self.daemonized = Daemonized(escaped[0], listening_ports(escaped[0]))
                        notice = self._daemonized_notice(self.daemonized)
                want = self._want_running
            self._clear_pid(proc.pid)
            if notice is not None:
                log.error("%s", notice)
                if self.on_daemonized is not None:
                    try:
                        self.on_daemonized(notice)
                    except Exception:  # the notice is best-effort; supervision already ended
                        log.exception("%s: reporting the daemonized command failed", self.name)
                return
            if want:
                ran = self._clock.monotonic() - self._started_monotonic
                self._delay = next_restart_delay(
                    ran, self._delay, self.restart_delay_seconds,
                    self.restart_delay_max_seconds, self.stable_seconds,
                )  # fmt: skip
                self.delays.append(self._delay)
                log.warning(
                    "%s: exited with status %d after %.1fs; restarting in %.1fs%s",
                    self.name, code, ran, self._delay,
                    " (it exits soon after each start: waiting longer each time)"
                    if ran < self.stable_seconds and self._delay > self.restart_delay_seconds
                    else "",
                )  # fmt: skip
                self._pause(self._delay)

    def _daemonized_notice(self, d: Daemonized) -> str:
        where = f"still serves port {', '.join(map(str, d.ports))}" if d.ports else "still runs"
        return (
            f"{self.name}: the command daemonized: pid {d.pid} {where}; vllm-guardian supervises "
            "the process it starts, run vLLM in the foreground. Not restarting it (a second "
            f"server would start on top of pid {d.pid}): stop pid {d.pid}, fix "
            "services[].command, then restart the guardian"
        )

    def _pause(self, seconds: float) -> None:
        """Wait before the next start; stop() ends the wait at once."""
        self._wake.clear()
        with self._lock:
            want = self._want_running
        if want:
            self._wake.wait(seconds)

    def _terminate(self, proc: subprocess.Popen[bytes] | Adopted, timeout: float) -> None:
        # SIGTERM to the leader only, like systemd's KillMode=mixed: vLLM's API server drains
        # (--shutdown-timeout) and stops its own workers; a worker that got SIGTERM directly
        # would die at once and abort the in-flight requests the drain is for.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s: still running %.0fs after SIGTERM; SIGKILL", self.name, timeout)
            with contextlib.suppress(ProcessLookupError):
                signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # Workers in the group that outlived the leader hold GPU memory: end them too.
        with contextlib.suppress(ProcessLookupError):
            signal_group(proc.pid, signal.SIGKILL)

    def restart(
        self, timeout_seconds: float | None = None, drain: bool = True
    ) -> tuple[bool, bool, str]:
        """Stop (drain via SIGTERM) and start again. Returns (ok, terminal, detail).

        ``timeout_seconds`` bounds the whole call (the executor passes the action's drain plus
        ready timeouts); the stop within it is bounded by the stop timeout as a stop is: SIGTERM,
        at most ``stop_timeout_seconds``, SIGKILL to the process group, then the start. A vLLM
        that ignored SIGTERM was otherwise waited on for the whole call's timeout. With
        ``drain=False`` (a hung or dead engine: nothing in flight can finish) the stop waits
        only ``exit_timeout_seconds``: a hung vLLM's API server, SIGTERMed, waits for its
        clients' open connections to the hung requests (120 s on the real engine)."""
        with self._lock:
            unknown = self._proc is None
            daemonized = self.daemonized
        if daemonized is not None:
            return False, True, self._daemonized_notice(daemonized)
        if unknown:
            self._adopt()  # an orphan still serving is the one to stop, never a second copy
        with self._lock:
            proc = self._proc
            self._want_running = False
        if proc is not None and proc.poll() is None:
            stop = self.stop_timeout_seconds if drain else self.exit_timeout_seconds
            self._terminate(proc, stop if timeout_seconds is None else min(stop, timeout_seconds))
        if self._thread is not None:
            self._thread.join(timeout=self.restart_delay_seconds + 15)
            self._thread = None
        with self._lock:
            self._proc = None
            self._adopt_checked = True  # what is running now is ours
            self._delay = None  # asked for: a fresh start, and a fresh backoff after it
            if self._closed:
                # stop() came while this restart drained the old process: starting a new one
                # now would leave it running after the guardian is gone.
                return False, False, "the guardian is stopping: not started again"
        try:
            self._spawn()
        except OSError as e:
            return False, True, f"cannot start {self.command[0]}: {e}"
        self.start()
        return True, False, f"restarted as pid {self.pid}"

    def stop(self, timeout_seconds: float = 30.0) -> None:
        with self._lock:
            self._closed = True
            self._want_running = False
            proc = self._proc
        self._wake.set()
        if proc is not None and proc.poll() is None:
            self._terminate(proc, timeout_seconds)
        if self._thread is not None:
            self._thread.join(timeout=self.restart_delay_seconds + 15)
            self._thread = None
        if proc is not None:
            self._clear_pid(proc.pid)
