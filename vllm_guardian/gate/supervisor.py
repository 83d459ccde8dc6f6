"""The gate's parent process when it runs several workers (``workers`` > 1).

Where it sits: ``vllm-guardian gate`` with more than one worker runs this instead of one gate.
It holds the listen port (a socket bound with ``SO_REUSEPORT`` and never listening, so the port
stays this gate's while workers come and go), starts N worker processes (``vllm-guardian gate
... --worker-of I/N --control-dir DIR``: each binds the port itself and runs one gate on its
share of the limits, gate/workers.py), and then, in a loop:

* sends systemd ``READY=1`` once a worker answers on its control socket (the port serves from
  then on), ``WATCHDOG=1`` and a ``STATUS=`` line of the workers' sum while it runs;
* reads each worker's status every second; a worker that exits, or that has not answered for
  ``WORKER_WEDGED_SECONDS`` (its loop is wedged: killed; unless the kernel's account says it
  waited for a CPU most of that time and had almost none, :func:`judge_silence`: starved by
  the host, it is left alone and a warning says so), is started again after a backoff
  (0.5 s doubling to 30 s, back to 0.5 s once one ran 30 s), and what it had in flight or held
  at its last reading is logged and counted as lost (``worker_lost_requests_total`` in the
  status), never silently;
* SIGTERM or SIGINT: every worker gets SIGTERM and drains as a single gate does (queued
  requests 503, in-flight ones ``shutdown_timeout`` to finish); the parent exits 0 once all
  have;
* SIGHUP: the workers are replaced one at a time (a reload: each new worker reads the config
  afresh); an old worker is told to retire only once its successor answers, so the port never
  goes unserved: it stops taking connections, keeps the requests it holds until they are
  released (or refused at their ``max_wait``), then stops as on SIGTERM.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from vllm_guardian.gate.workers import PARENT_FILE, merge_status, worker_socket
from vllm_guardian.lowio.procfs import parse_schedstat

log = logging.getLogger("vllm_guardian.gate")

POLL_SECONDS = 1.0
# A worker whose control socket has not answered this long is wedged (the single gate's
# WatchdogSec=10s): killed and started again. A new worker gets STARTUP_SECONDS first: on a
# starved host (the tests' two busy cores) starting one took over 30 s, and killing it then
# only starts the same work again.
WORKER_WEDGED_SECONDS = 10.0
STARTUP_SECONDS = 90.0
# A silent worker that was runnable and waiting for a CPU at least this share of its silence
# was starved by the host, not wedged: another in its place would wait the same.
STARVED_SHARE = 0.5
# ...unless it ran this much CPU meanwhile: a loop answers its status with milliseconds of CPU,
# so one that had seconds of it and did not answer is stuck on the loop (spinning), however
# long it also waited.
RAN_WEDGED_SECONDS = 2.0
# A starved worker's warning is repeated this often while it lasts.
STARVED_LOG_SECONDS = 60.0
BACKOFF_FIRST_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 30.0
# Past this long a worker's next death starts the backoff again from the first step.
BACKOFF_RESET_SECONDS = 30.0
# Workers still running this long after the SIGTERM past their own shutdown timeout: killed.
STOP_GRACE_SECONDS = 10.0


# What a reload sends an old worker: stop taking connections, keep what it holds until it is
# released (Gate.retire), then stop as on SIGTERM.
RETIRE_SIGNAL = signal.SIGUSR1


class CannotListen(Exception):
    """The listen address cannot be bound (in use, not this host's)."""


class Silence(enum.Enum):
    """Why a worker has not answered its control socket for longer than it may."""

    WEDGED = "wedged"  # asleep or on a CPU the whole time: its loop is stuck (killed)
    STARVED = "starved"  # runnable, waiting for a CPU the host gave to others (left alone)


def judge_silence(
    silent_seconds: float,
    limit_seconds: float,
    waited_seconds: float | None,
    ran_seconds: float | None = None,
) -> Silence | None:
    """A worker silent for ``silent_seconds``, of which it spent ``waited_seconds`` runnable and
    waiting for a CPU and ``ran_seconds`` on one (None: no account of it): None while within
    ``limit_seconds``. A CPU quota that throttles it counts as waiting (another worker would be
    throttled the same)."""
    if silent_seconds <= limit_seconds:
        return None
    if (
        waited_seconds is not None
        and waited_seconds >= STARVED_SHARE * silent_seconds
        and (ran_seconds or 0.0) < RAN_WEDGED_SECONDS
    ):
        return Silence.STARVED
    return Silence.WEDGED


def read_schedstat(pid: int) -> tuple[int, int] | None:
    """The kernel's account of ``pid``'s main thread (the worker's loop): nanoseconds on a CPU
    and waiting for one, since it started; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return parse_schedstat(f.read())
    except OSError:
        return None


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    last_answer: float | None = None
    # In flight + queued at its last reading: what is lost if it dies now.
    holding: int = 0
    doc: dict[str, Any] | None = None
    # The kernel's account (on a CPU, waiting for one; ns) at its last answer (at its start,
    # where both are 0, before the first).
    sched_at_answer: tuple[int, int] = (0, 0)
    starved_said: float | None = None  # when its starvation was last logged


@dataclass
class _Slot:
    index: int
    worker: _Worker | None = None
    backoff_seconds: float = BACKOFF_FIRST_SECONDS
    start_at: float = 0.0
    successor: _Worker | None = None  # a reload's new worker, until it answers


@dataclass
class _Counts:
    restarts_total: int = 0
    lost_requests_total: int = 0
    pids: list[int] = field(default_factory=list)
    # In flight + queued per worker pid at the parent's last reading (what a death would lose).
    holding: dict[str, int] = field(default_factory=dict)


def read_worker(path: Path, timeout_seconds: float) -> dict[str, Any] | None:
    """A worker's status from its control socket (blocking, bounded); None without one."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_seconds)
            s.connect(str(path))
            s.sendall(b"status\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        doc = json.loads(b"".join(chunks))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def hold_port(host: str, port: int) -> socket.socket:
    """The port, bound with SO_REUSEPORT and not listening: the workers' sockets join it, and
    nobody else's can while the gate runs. Raises CannotListen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class Supervisor:
    """The parent: see the module's docstring. ``notify`` is sd_notify (a no-op off systemd);
    ``status_line`` shapes the STATUS= line from the merged status."""

    def __init__(
        self,
        argv: Sequence[str],
        workers: int,
        host: str,
        port: int,
        *,
        shutdown_timeout_seconds: float,
        notify: Callable[[str], None],
        watchdog_seconds: float | None,
        status_line: Callable[[Mapping[str, object]], str],
        schedstat: Callable[[int], tuple[int, int] | None] = read_schedstat,
    ) -> None:
        self.argv = list(argv)
        self.schedstat = schedstat
        self.n = workers
        self.host, self.port = host, port
        self.shutdown_timeout_seconds = shutdown_timeout_seconds
        self.notify = notify
        self.watchdog_seconds = watchdog_seconds
        self.status_line = status_line
        self.control_dir = Path(tempfile.mkdtemp(prefix="vllm-guardian-gate-"))
        self.slots = [_Slot(i) for i in range(workers)]
        self.retiring: list[_Worker] = []
        self.counts = _Counts()
        self._stop = False
        self._reload = False
        self._reload_queue: list[int] = []  # slots a reload has yet to replace

    # --- processes ---------------------------------------------------------------------------

    def _spawn(self, index: int) -> _Worker:
        listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        # -P: not the working directory first on the path (-m would put it there), so a
        # worker runs the parent's code even when started from a checkout of another version.
        cmd = [
            sys.executable, "-P", "-m", "vllm_guardian.gate", *self.argv, "--listen", listen,
            "--workers", str(self.n), "--worker-of", f"{index}/{self.n}/{os.getpid()}",
            "--control-dir", str(self.control_dir),
        ]  # fmt: skip
        # systemd's notify socket is the parent's (NotifyAccess=main): workers report here.
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}  # fmt: skip
        proc = subprocess.Popen(cmd, env=env)
        log.info("gate: worker %d of %d started (pid %d)", index + 1, self.n, proc.pid)
        return _Worker(index, proc, time.monotonic())

    def _read(self, w: _Worker, now: float) -> None:
        doc = read_worker(worker_socket(self.control_dir, w.proc.pid), POLL_SECONDS)
        if doc is not None:
            w.last_answer, w.doc = now, doc
            w.holding = int(doc.get("in_flight") or 0) + int(doc.get("queue_depth") or 0)
            w.sched_at_answer = self.schedstat(w.proc.pid) or w.sched_at_answer
            w.starved_said = None

    def _silence(self, w: _Worker, now: float) -> tuple[Silence | None, float, str]:
        """Whether ``w`` has been silent too long, and why (:func:`judge_silence`); how long,
        and what the kernel says it did meanwhile (for the log)."""
        since = w.started if w.last_answer is None else w.last_answer
        limit = STARTUP_SECONDS if w.last_answer is None else WORKER_WEDGED_SECONDS
        silent = now - since
        if silent <= limit:
            return None, silent, ""
        account = self.schedstat(w.proc.pid)
        if account is None:
            return judge_silence(silent, limit, None), silent, ""
        ran, waited = ((a - b) / 1e9 for a, b in zip(account, w.sched_at_answer, strict=True))
        said = f"it waited for a CPU {waited:.0f} s of them and ran {ran:.1f} s"
        return judge_silence(silent, limit, waited, ran), silent, said

    def _write_parent(self) -> None:
        self.counts.pids = [s.worker.proc.pid for s in self.slots if s.worker is not None]
        tmp = self.control_dir / (PARENT_FILE + ".tmp")
        tmp.write_text(json.dumps(self.counts.__dict__))
        tmp.replace(self.control_dir / PARENT_FILE)

    def _on_death(self, slot: _Slot, w: _Worker, now: float) -> None:
        code = w.proc.returncode
        self.counts.restarts_total += 1
        self.counts.lost_requests_total += w.holding
        log.warning(
            "gate: worker %d (pid %d) ended (%s); %d requests it had in flight or held at its "
            "last reading are lost; started again in %.1f s",
            slot.index + 1, w.proc.pid,
            f"signal {-code}" if code is not None and code < 0 else f"exit {code}",
            w.holding, slot.backoff_seconds,
        )  # fmt: skip
        with contextlib.suppress(FileNotFoundError):
            worker_socket(self.control_dir, w.proc.pid).unlink()
        lived = now - w.started
        if lived >= BACKOFF_RESET_SECONDS:
            slot.backoff_seconds = BACKOFF_FIRST_SECONDS
        slot.start_at = now + slot.backoff_seconds
        slot.backoff_seconds = min(2 * slot.backoff_seconds, BACKOFF_MAX_SECONDS)
        slot.worker = None
        self._write_parent()

    # --- the loop ------------------------------------------------------------------------------

    def _signals(self) -> None:
        def stop(_sig: int, _frame: FrameType | None) -> None:
            self._stop = True

        def reload(_sig: int, _frame: FrameType | None) -> None:
            self._reload = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, reload)

    def _merged(self) -> dict[str, object] | None:
        docs = [s.worker.doc for s in self.slots if s.worker is not None and s.worker.doc]
        docs += [w.doc for w in self.retiring if w.doc]
        return merge_status(docs, self.n, self.counts.__dict__) if docs else None

    def run(self) -> int:
        """Until SIGTERM/SIGINT; exit 0 once every worker has drained."""
        self._signals()
        for slot in self.slots:
            slot.worker = self._spawn(slot.index)
        self._write_parent()
        ready = False
        next_poll = next_beat = 0.0
        beat = min(self.watchdog_seconds / 3, 5.0) if self.watchdog_seconds else 5.0
        try:
            while not self._stop:
                now = time.monotonic()
                if self._reload:
                    self._reload = False
                    self._begin_reload()
                self._tend(now)
                if now >= next_poll:
                    next_poll = now + POLL_SECONDS
                    self._poll(now)
                    # The port serves once one worker listens (the kernel hands connections
                    # only to listening sockets): ready then, not when the last one is up.
                    answering = sum(
                        s.worker is not None and s.worker.last_answer is not None
                        for s in self.slots
                    )
                    if not ready and answering:
                        ready = True
                        log.info(
                            "gate: %d of %d workers on %s:%d",
                            answering, self.n, self.host, self.port,
                        )  # fmt: skip
                        self.notify("READY=1")
                if ready and now >= next_beat:
                    next_beat = now + beat
                    merged = self._merged()
                    msgs = [f"STATUS={self.status_line(merged or {})}"]
                    if self.watchdog_seconds:
                        msgs.append("WATCHDOG=1")
                    self.notify("\n".join(msgs))
                time.sleep(0.05)
        finally:
            self.notify("STOPPING=1")
            self._stop_all()
            shutil.rmtree(self.control_dir, ignore_errors=True)
        return 0

    def _tend(self, now: float) -> None:
        """Deaths, restarts due, a reload's next step, retired workers that ended."""
        for slot in self.slots:
            w = slot.worker
            if w is not None and w.proc.poll() is not None:
                self._on_death(slot, w, now)
            if slot.worker is None and now >= slot.start_at:
                slot.worker = self._spawn(slot.index)
                self._write_parent()
            s = slot.successor
            if s is not None and s.proc.poll() is not None:
                log.warning("gate: a reload's worker %d ended before it served", slot.index + 1)
                slot.successor = None
                self._next_reload_step()
            elif s is not None and s.last_answer is not None:
                old, slot.worker, slot.successor = slot.worker, s, None
                if old is not None:
                    old.proc.send_signal(RETIRE_SIGNAL)
                    self.retiring.append(old)
                self._write_parent()
                self._next_reload_step()
        for w in self.retiring:
            code = w.proc.poll()
            if code is not None and code != 0:
                # A retiring worker's held requests were to be released, not cut: count them.
                self.counts.lost_requests_total += w.holding
                log.warning(
                    "gate: retiring worker pid %d ended (%s); %d requests it had in flight or "
                    "held at its last reading are lost",
                    w.proc.pid, f"signal {-code}" if code < 0 else f"exit {code}", w.holding,
                )  # fmt: skip
                self._write_parent()
        self.retiring = [w for w in self.retiring if w.proc.poll() is None]

    def _poll(self, now: float) -> None:
        workers = [s.worker for s in self.slots if s.worker is not None]
        workers += [s.successor for s in self.slots if s.successor is not None]
        for w in workers + self.retiring:
            self._read(w, now)
        holding = {str(w.proc.pid): w.holding for w in workers}
        if holding != self.counts.holding:
            self.counts.holding = holding
            self._write_parent()
        for w in workers + self.retiring:
            if w.proc.poll() is not None:
                continue
            verdict, silent, said = self._silence(w, now)
            if verdict is Silence.WEDGED:
                log.warning(
                    "gate: worker %d (pid %d) has not answered for %.0f s: killed%s",
                    w.index + 1, w.proc.pid, silent, f" ({said})" if said else "",
                )  # fmt: skip
                w.proc.kill()
            elif verdict is Silence.STARVED and (
                w.starved_said is None or now - w.starved_said >= STARVED_LOG_SECONDS
            ):
                w.starved_said = now
                log.warning(
                    "gate: worker %d (pid %d) has not answered for %.0f s; %s: starved by "
                    "the host (its CPUs go to other processes), not killed (another would "
                    "wait the same); see docs/runbook.md, \"Gate stalled\"",
                    w.index + 1, w.proc.pid, silent, said,
                )  # fmt: skip

    def _begin_reload(self) -> None:
        if any(s.successor is not None for s in self.slots):
            return  # one reload at a time: the one under way reads the config as it is now
        log.info("gate: SIGHUP: replacing the %d workers one at a time", self.n)
        self._reload_queue = list(range(self.n))
        self._next_reload_step()

    def _next_reload_step(self) -> None:
        if self._reload_queue:
            i = self._reload_queue.pop(0)
            self.slots[i].successor = self._spawn(i)

    def _stop_all(self) -> None:
        procs = [s.worker.proc for s in self.slots if s.worker is not None]
        procs += [s.successor.proc for s in self.slots if s.successor is not None]
        procs += [w.proc for w in self.retiring]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.shutdown_timeout_seconds + STOP_GRACE_SECONDS
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gate: worker pid %d did not stop in time: killed", p.pid)
                p.kill()
                p.wait()
