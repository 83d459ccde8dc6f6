"""The shell around the pure core: the tick, the loop, threads, signals, sd_notify.

One tick:

1. **collect** every source in parallel, each under its own timeout; a source that fails or
   hangs becomes a down :class:`SourceStatus`, never an exception;
2. assemble the :class:`Snapshot` and append it to the bounded history (the tick driver's
   window, ``core/driver.py``, when the guardian heals);
3. **derive** signals (pure, ``core/signals.py``; inside ``step`` when the guardian heals);
4. **decide** and **act**: ``Healing.run`` hands the snapshot to the tick driver, which runs
   the pure ``core/step.step`` (signals, alerts, policy, readiness), and applies its effects
   in one place (``healing.py``);
5. **publish** to ``/metrics`` and ``/ready``;
6. **record** one flight-recorder line;
7. ``sd_notify`` ``WATCHDOG=1`` and a readable ``STATUS=`` line.

``READY=1`` is sent after the first full tick, ``STOPPING=1`` on SIGTERM; SIGHUP reloads the
config and a bad new config keeps the old one, saying why.

On SIGTERM (not SIGINT) with vLLM under the guardian's own process backend (a pod's entrypoint), stopping
the guardian stops vLLM: the front door closes first and the requests in flight finish (at most
``policy.drain_timeout_seconds``) before vLLM gets its SIGTERM (:meth:`Guardian.drain_before_stop`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from vllm_guardian import __version__
from vllm_guardian.config import Config, ConfigInvalid, load_config
from vllm_guardian.core import policy
from vllm_guardian.core.allocator import attribute as attribute_allocator
from vllm_guardian.core.driver import history_span_seconds, remember
from vllm_guardian.core.signals import ServiceSignals, Signals, derive
from vllm_guardian.formats.recorder import FlightRecorder, to_jsonable
from vllm_guardian.lowio.clock import Clock, SteadyClock, SystemClock, reached_late
from vllm_guardian.lowio.control import ControlServer
from vllm_guardian.lowio.redact import redact_text
from vllm_guardian.model import (
    AllocatorReading,
    GateObservation,
    GateState,
    GpuReading,
    HealthProbe,
    LogReading,
    OpResult,
    Reading,
    ServiceSnapshot,
    Snapshot,
    SourceStatus,
    UnitState,
    VllmScrape,
)
from vllm_guardian.shell.container import ConfigWatch, container_mode
from vllm_guardian.shell.exposition import ExpositionServer, GuardianCollector, Published
from vllm_guardian.shell.healing import Healing
from vllm_guardian.sources.base import Collector
from vllm_guardian.sources.registry import build_collectors

log = logging.getLogger("vllm_guardian")

GIB = 1024**3


class Notifier(Protocol):
    def notify(self, state: str) -> None: ...


class SdNotifier:
    """sd_notify through the sdnotify library; silent without NOTIFY_SOCKET."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._impl: Any = None
        if self.enabled:
            import sdnotify  # noqa: PLC0415  # only under systemd

            self._impl = sdnotify.SystemdNotifier()
        usec = os.environ.get("WATCHDOG_USEC")
        wpid = os.environ.get("WATCHDOG_PID")
        self.watchdog = bool(usec and usec.isdigit() and int(usec) > 0) and (
            not wpid or wpid == str(os.getpid())
        )

    def notify(self, state: str) -> None:
        if self._impl is not None:
            self._impl.notify(state)


@dataclass
class _SourceSlot:
    collector: Collector
    future: Future[Reading] | None = None
    started_monotonic: float = 0.0


@dataclass
class TickResult:
    snapshot: Snapshot
    signals: Signals
    decisions: list[Mapping[str, Any]] = field(default_factory=list)
    duration_seconds: float = 0.0


def _sources_unchanged(old: Config, new: Config) -> bool:
    """The collectors built from ``new`` would be those built from ``old``: the factory
    (``sources.registry.build_collectors``) reads the services, ``sources`` and the interval."""
    return (
        old.services == new.services
        and old.sources == new.sources
        and old.interval_seconds == new.interval_seconds
    )


class Guardian:
    def __init__(
        self,
        cfg: Config,
        clock: Clock | None = None,
        collectors: Sequence[Collector] | None = None,
        notifier: Notifier | None = None,
        config_path: str | None = None,
        collector_factory: Callable[[Config, Clock], Sequence[Collector]] = build_collectors,
        healing: Healing | bool | None = True,
    ) -> None:
        self.cfg = cfg
        # Steady Unix time for the tick, the policy and the actuators (clock.SteadyClock).
        self.wall: Clock = clock or SystemClock()
        self.clock: Clock = SteadyClock(self.wall)
        self.config_path = config_path
        self._factory = collector_factory
        self._slots = [
            _SourceSlot(c)
            for c in (collectors if collectors is not None else collector_factory(cfg, self.clock))
        ]
        self._pool = ThreadPoolExecutor(
            max_workers=max(4, 2 * len(self._slots)), thread_name_prefix="collect"
        )
        self.history: collections.deque[Snapshot] = collections.deque()
        self.exposition = GuardianCollector([s.name for s in cfg.services])
        self.notifier: Notifier = notifier or SdNotifier()
        self.recorder = (
            FlightRecorder(cfg.recorder.path, cfg.recorder.max_bytes, cfg.recorder.backups)
            if cfg.recorder.path
            else None
        )
        self._source_up: dict[tuple[str, str | None], bool] = {}
        self._recorder_error: str | None = None
        self.last: TickResult | None = None
        self._stop = threading.Event()
        # A second SIGTERM (or one with nothing to drain): stop now, cut the fetches under way.
        self._hurry = threading.Event()
        self._drained_seconds = 0.0  # how long drain_before_stop held vLLM before its stop
        self._reload = threading.Event()
        self._lock = threading.Lock()
        self.ready_sent = False
        # The decide-and-act half; False leaves the guardian observing only (tests, `replay`).
        self.healing: Healing | None = (
            Healing(cfg, self.clock, self.history) if healing is True else healing or None
        )

    # --- the tick -----------------------------------------------------------------------------

    def tick(self) -> TickResult:
        start = self.clock.monotonic()
        now = self.clock.time()
        readings, statuses = self._collect()
        results = self.healing.take_results() if self.healing is not None else ()
        snapshot = assemble(now, [s.name for s in self.cfg.services], readings, statuses, results)
        self._invalidate_units(self.history[-1] if self.history else None, snapshot)
        if self.healing is None:  # observing only; else the tick driver appends it
            remember(self.history, snapshot, history_span_seconds(self.cfg))
        decisions: list[Mapping[str, Any]] = []
        tick_ok = True  # the watchdog is pinged only when the tick did its work
        signals: Signals | None = None
        if self.healing is not None:
            try:
                # The snapshot as stepped: with the operator commands taken since the last tick.
                snapshot, signals, records = self.healing.run(snapshot, now)
                decisions.extend(records)
                for name, gate in self.healing.gates().items():
                    self.exposition.set_gate(name, gate)
                tick_ok = self.healing.persist_error() is None
            except Exception:  # a policy bug must not stop observation
                tick_ok = False
                log.exception("the decide-and-act stage failed; observation continues")
        if signals is None:
            signals = derive(list(self.history), self.cfg.services, self.cfg.signals)
        duration = self.clock.monotonic() - start
        view = self.healing.view() if self.healing is not None else None
        self.exposition.publish(
            Published(snapshot, signals, duration, view), self.clock.monotonic()
        )
        result = TickResult(snapshot, signals, decisions, duration)
        with self._lock:
            self.last = result
        self._record(result)
        self._log_transitions(statuses)
        if self.notifier is not None:
            msgs = [f"STATUS={status_line(signals, snapshot)}"]
            if getattr(self.notifier, "watchdog", False) and tick_ok:
                msgs.append("WATCHDOG=1")
            if not self.ready_sent:
                msgs.insert(0, "READY=1")
                self.ready_sent = True
            self.notifier.notify("\n".join(msgs))
        return result

    def _collect(self) -> tuple[list[Reading], list[SourceStatus]]:
        fresh: set[int] = set()
        for i, slot in enumerate(self._slots):
            if slot.future is None or slot.future.done():
                slot.started_monotonic = self.clock.monotonic()
                slot.future = self._pool.submit(_safe_collect, slot.collector)
                fresh.add(i)
        readings: list[Reading] = []
        statuses: list[SourceStatus] = []
        for i, slot in enumerate(self._slots):
            c = slot.collector
            assert slot.future is not None
            remaining = c.timeout_seconds - (self.clock.monotonic() - slot.started_monotonic)
            try:
                reading = slot.future.result(timeout=max(0.0, remaining)) if i in fresh else None
            except FutureTimeout:
                reading = None
                due = slot.started_monotonic + c.timeout_seconds
                if reached_late(self.clock.monotonic(), due):
                    # Seen late: the guardian was not running when the time was up (the host's
                    # CPUs taken), and the answer may be in, its fetch given its time once more
                    # (lowio/httpget.py): looked for once more, not reported as no result.
                    with contextlib.suppress(FutureTimeout):
                        reading = slot.future.result(timeout=c.timeout_seconds)
            duration = self.clock.monotonic() - slot.started_monotonic
            if reading is None:
                # A collector still running from an earlier tick is not started again: one hung
                # NVML call must not pile up a thread per tick.
                why = (
                    f"no result within {c.timeout_seconds:g}s"
                    if i in fresh
                    else f"still busy from an earlier tick ({duration:.0f}s): hung"
                )
                reading = Reading(
                    c.kind, c.service, None, why, "the source is slow or hung; values are missing"
                )
                duration = min(duration, c.timeout_seconds) if i in fresh else duration
            readings.append(reading)
            statuses.append(
                SourceStatus(
                    source=c.kind,
                    service=c.service,
                    up=reading.payload is not None and reading.error is None,
                    duration_seconds=round(duration, 6),
                    error=reading.error,
                    hint=reading.hint,
                )
            )
        return readings, statuses

    def _invalidate_units(self, previous: Snapshot | None, snapshot: Snapshot) -> None:
        """The unit source reuses its last full read while the process is unchanged
        (sources/unit.py); a health change or a log event may mean a restart is under way, so
        the next tick reads the unit afresh."""
        for slot in self._slots:
            invalidate = getattr(slot.collector, "invalidate", None)
            if invalidate is not None and unit_may_have_changed(
                previous, snapshot, slot.collector.service
            ):
                invalidate()

    def _record(self, result: TickResult) -> None:
        if self.recorder is None:
            return
        ok = self.recorder.write(
            {
                "time": result.snapshot.time_seconds,
                "wall_time": self.wall.time(),  # the host's clock, which may have stepped
                "version": __version__,
                "snapshot": result.snapshot,
                "signals": result.signals,
                "decisions": list(result.decisions),
                "tick_duration_seconds": result.duration_seconds,
            }
        )
        if not ok and self.recorder.error != self._recorder_error:
            log.error(
                "flight recorder: %s (recording paused, guarding continues)", self.recorder.error
            )
        elif ok and self._recorder_error:
            log.info("flight recorder: writing again to %s", self.recorder.path)
        self._recorder_error = self.recorder.error

    def _log_transitions(self, statuses: Sequence[SourceStatus]) -> None:
        for st in statuses:
            key = (st.source.value, st.service)
            before = self._source_up.get(key)
            self._source_up[key] = st.up
            where = f"{st.source.value}" + (f" [{st.service}]" if st.service else "")
            if not st.up and before is not False:
                log.warning(
                    "source %s down: %s%s",
                    where,
                    st.error,
                    f" (hint: {st.hint})" if st.hint else "",
                )
            elif st.up and before is False:
                log.info("source %s up again", where)

    # --- lifecycle ----------------------------------------------------------------------------

    def request_stop(self, drain: bool = False) -> None:
        """Stop the loop. ``drain`` (SIGTERM: a pod's termination, ``systemctl stop``) when the
        guardian stops vLLM with itself: the loop then drains first (:meth:`drain_before_stop`),
        its sources still reading. Otherwise (SIGINT, an operator at a terminal; the demo), and
        on a second signal, the fetches under way are cut at once."""
        again = self._stop.is_set()
        self._stop.set()
        if again or not drain or not self._stops_vllm():
            self._hurry.set()
            self._interrupt_sources()

    def _stops_vllm(self) -> bool:
        return self.healing is not None and bool(self.healing.supervisors)

    def _interrupt_sources(self) -> None:
        for slot in self._slots:  # shutting down never waits on a source's fetch
            interrupt = getattr(slot.collector, "interrupt", None)
            if interrupt is not None:
                interrupt()

    def request_reload(self) -> None:
        self._reload.set()

    def reload(self) -> bool:
        """Re-read the config file; keep the old config if the new one is invalid.

        Never raises: SIGHUP after any edit must not end the daemon."""
        try:
            return self._reload_from_file()
        except Exception:
            log.exception("reload failed; the guardian keeps running")
            return False

    def _reload_from_file(self) -> bool:
        if not self.config_path:
            return False
        try:
            new = load_config(self.config_path)
        except ConfigInvalid as e:
            log.error("reload refused, keeping the running config:\n%s", e)
            return False
        for key in ("listen", "runtime_dir"):  # bound once at start-up
            if getattr(new, key) != getattr(self.cfg, key):
                log.warning(
                    "%s changes need a restart: still %r (the file now says %r)",
                    key,
                    getattr(self.cfg, key),
                    getattr(new, key),
                )
                new = dataclasses.replace(new, **{key: getattr(self.cfg, key)})
        if self.healing is not None:
            try:
                self.healing.reload(new)
            except ConfigInvalid as e:
                log.error("reload refused, keeping the running config:\n%s", e)
                return False
        old_cfg, old_slots = self.cfg, self._slots
        self.cfg = new
        if _sources_unchanged(old_cfg, new):
            # Kept, with any collect in flight: a rebuilt logs source would drop the events it
            # has not handed to a tick yet and restart its journal.
            log.info("config reload: what the sources read is unchanged; they keep running")
        else:
            self._slots = [_SourceSlot(c) for c in self._factory(new, self.clock)]
            self._pool._max_workers = max(self._pool._max_workers, 2 * len(self._slots))
            for slot in old_slots:
                _safe_close(slot.collector)
        self.exposition.set_services([s.name for s in new.services])
        if new.recorder.path:
            self.recorder = FlightRecorder(
                new.recorder.path, new.recorder.max_bytes, new.recorder.backups
            )
        else:
            self.recorder = None
        log.info("config reloaded from %s: %d service(s)", self.config_path, len(new.services))
        return True

    def drain_before_stop(self) -> None:
        """Before a stop takes down the vLLM this guardian runs: close the front door and let
        what is in flight finish. Called by :meth:`run` once the loop has ended on SIGTERM.

        ``/ready/<service>`` answers 503 from now on, so the gate (which follows it) holds new
        requests instead of sending them to a vLLM about to stop, and the kubelet takes the pod
        out of its endpoints. The sources go on reading, once an interval: the requests in
        flight are counted as the drain phase of an action counts them (the gate's own count
        when it answers, else vLLM's running + waiting: ``policy.seen``), and the wait ends when
        none is left, when the engine cannot finish them (hung, dead, not listening), after
        ``policy.drain_timeout_seconds`` (the Helm chart's grace period is longer), or at a
        second signal. Nothing to do when vLLM is not the guardian's to stop (systemd)."""
        if self.healing is None or self._hurry.is_set():
            return
        names = [n for n in self.healing.supervisors if self.cfg.service(n) is not None]
        if not names:
            return
        timeout = self.cfg.policy.drain_timeout_seconds
        reason = f"the guardian is stopping: draining (at most {timeout:.0f}s) before vLLM stops"
        for name in names:
            self.exposition.set_gate(name, GateState(False, reason))
        log.info("stopping: front door closed; draining %s", ", ".join(names))
        start = self.clock.monotonic()
        while True:
            left = self._in_flight(names)
            waited = self._drained_seconds = self.clock.monotonic() - start
            if not left:
                log.info("stopping: drained in %.1fs; stopping vLLM", waited)
                return
            counts = ", ".join(f"{n}: {c:.0f} per {src}" for n, (c, src) in sorted(left.items()))
            if self._hurry.is_set() or waited >= timeout:
                log.warning(
                    "stopping: %s after %.0fs with requests in flight (%s); stopping vLLM",
                    "a second signal" if self._hurry.is_set() else "drain timeout",
                    waited,
                    counts,
                )
                return
            self._hurry.wait(min(self.cfg.interval_seconds, timeout - waited))

    def _in_flight(self, names: Sequence[str]) -> dict[str, tuple[float, str]]:
        """One collection without the policy: the services among ``names`` that still have
        requests in flight an engine can finish, with whose count. Published, so ``/healthz``
        and ``/metrics`` stay current through the drain."""
        start = self.clock.monotonic()
        readings, statuses = self._collect()
        snapshot = assemble(
            self.clock.time(), [s.name for s in self.cfg.services], readings, statuses, ()
        )
        remember(self.history, snapshot, history_span_seconds(self.cfg))
        signals = derive(list(self.history), self.cfg.services, self.cfg.signals)
        view = self.healing.view() if self.healing is not None else None
        self.exposition.publish(
            Published(snapshot, signals, self.clock.monotonic() - start, view),
            self.clock.monotonic(),
        )
        left: dict[str, tuple[float, str]] = {}
        for name in names:
            seen = policy.seen(snapshot, signals.service(name), name)
            if seen.stalled or seen.engine_dead or seen.listening is False:
                continue  # nothing in it can finish: waiting would only delay the stop
            if seen.in_flight:
                left[name] = (seen.in_flight, seen.in_flight_from)
        return left

    def close(self) -> None:
        if self.healing is not None:
            self.healing.close(self._drained_seconds)
        for slot in self._slots:
            _safe_close(slot.collector)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def status(self) -> dict[str, Any]:
        with self._lock:
            last = self.last
        if last is None:
            return {"ok": True, "version": __version__, "ticks": 0, "services": []}
        body: dict[str, Any] = to_jsonable(
            {
                "time": last.snapshot.time_seconds,
                "signals": last.signals,
                "sources": last.snapshot.sources,
            }
        )
        body.update(ok=True, version=__version__, tick_duration_seconds=last.duration_seconds)
        if self.healing is not None:
            view = self.healing.view()
            body["policy"] = to_jsonable(view.state)
            body["alerts"] = to_jsonable(view.alerts)
            body["dry_run"] = view.dry_run
            body["restart_budget"] = view.budget
            body["restart_budget_window_seconds"] = view.budget_window_seconds
            body["recent_decisions"] = to_jsonable(list(self.healing.recent))
            body["gates"] = {name: to_jsonable(g) for name, g in self.healing.gates().items()}
        if last.snapshot.gpus is not None:
            body["gpus"] = to_jsonable(last.snapshot.gpus.devices)
        return body

    def handle_control(self, req: Mapping[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        if cmd == "status":
            return self.status()
        if cmd in ("pause", "resume", "restart", "relaunch", "action"):
            if self.healing is None:
                return {"ok": False, "error": "this guardian only observes"}
            service = req.get("service")
            extra = {k: req[k] for k in ("sets", "reset", "force", "who", "action_id") if k in req}
            return self.healing.control(str(cmd), str(service) if service else None, **extra)
        if cmd == "recent_ticks":  # vllm-guardian diagnose: the flight recorder's recent past
            from vllm_guardian.diagnose.gather import recent_ticks  # noqa: PLC0415

            service = req.get("service")
            return recent_ticks(list(self.history), str(service) if service else None)
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def run(self, install_signals: bool = True) -> int:
        """The main loop; returns the process exit code. ``install_signals=False`` when run
        from a thread (the demo): only the main thread may own signal handlers."""
        host, port = self.cfg.listen_address
        server = ExpositionServer(
            self.exposition,
            host,
            port,
            stale_after_seconds=3 * self.cfg.interval_seconds + 10,
            monotonic=self.clock.monotonic,
        )
        server.start()
        log.info("vllm-guardian %s: serving /metrics on http://%s:%d", __version__, *server.address)
        control = ControlServer(Path(self.cfg.runtime_dir) / "control.sock", self.handle_control)
        try:
            control.start()
        except OSError as e:
            log.error(
                "control socket %s unavailable: %s (status/pause will not work)", control.path, e
            )
            control = None  # type: ignore[assignment]
        if install_signals:
            _install_signals(self)
        if self.healing is not None:
            self.healing.start()
        try:
            next_at = self.clock.monotonic()
            # Container mode: a ConfigMap update reloads the config as SIGHUP does.
            watch = (
                ConfigWatch(self.config_path)
                if self.config_path and container_mode(os.environ)
                else None
            )
            while not self._stop.is_set():
                if watch is not None and watch.changed():
                    log.info("%s changed: reloading", self.config_path)
                    self._reload.set()
                if self._reload.is_set():
                    self._reload.clear()
                    self.notifier.notify("RELOADING=1")
                    self.reload()
                    self.notifier.notify("READY=1")
                self.tick()
                next_at += self.cfg.interval_seconds
                now = self.clock.monotonic()
                if next_at < now:  # a slow tick: skip missed slots rather than burst
                    next_at = now + self.cfg.interval_seconds
                self._stop.wait(max(0.0, next_at - now))
        finally:
            self.notifier.notify("STOPPING=1")
            log.info("stopping")
            if self._stop.is_set():  # asked to stop (not a crash of the loop)
                self.drain_before_stop()
            self._interrupt_sources()
            server.stop()
            if control is not None:
                control.stop()
            self.close()
        return 0


def _install_signals(g: Guardian) -> None:
    def on_term(signum: int, frame: FrameType | None) -> None:
        g.request_stop(drain=signum == signal.SIGTERM)

    def on_hup(signum: int, frame: FrameType | None) -> None:
        g.request_reload()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)


def _safe_collect(c: Collector) -> Reading:
    try:
        reading = c.collect()
    except Exception as e:  # the contract says collectors do not raise; this keeps it true
        log.exception("collector %s raised", c.kind.value)
        reading = Reading(
            c.kind,
            c.service,
            None,
            f"internal error: {type(e).__name__}: {e}",
            "a guardian bug: please report it",
        )
    # A source's error names what it fetched (GET http://user:password@…/metrics); it reaches
    # the log, `status` and every flight record, so secrets go here, once for every source.
    if reading.error or reading.hint:
        reading = dataclasses.replace(
            reading,
            error=redact_text(reading.error) if reading.error else reading.error,
            hint=redact_text(reading.hint) if reading.hint else reading.hint,
        )
    return reading


def _safe_close(c: Collector) -> None:
    try:
        c.close()
    except Exception:
        log.exception("closing collector %s failed", c.kind.value)


def unit_may_have_changed(
    previous: Snapshot | None, snapshot: Snapshot, service: str | None
) -> bool:
    """Whether this tick saw a sign that ``service``'s process may have changed: its health
    state differs from the previous tick's, or its log showed an event."""
    now = next((s for s in snapshot.services if s.name == service), None)
    if now is None:
        return False
    if now.logs is not None and now.logs.recent:
        return True
    before = next((s for s in previous.services if s.name == service), None) if previous else None
    state_now = now.health.state if now.health is not None else None
    state_before = before.health.state if before is not None and before.health else None
    return before is None or state_now != state_before


def assemble(
    now: float,
    services: Sequence[str],
    readings: Sequence[Reading],
    statuses: Sequence[SourceStatus],
    op_results: Sequence[OpResult] = (),
) -> Snapshot:
    """Put each reading's payload where it belongs in the Snapshot."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in services}
    gpus: GpuReading | None = None
    allocator: AllocatorReading | None = None
    for r in readings:
        p = r.payload
        if p is None:
            continue
        if isinstance(p, GpuReading):
            gpus = p
            continue
        if isinstance(p, AllocatorReading):  # host-wide: split by service below
            allocator = p
            continue
        if r.service not in parts:
            continue
        slot = parts[r.service]
        if isinstance(p, VllmScrape):
            slot["vllm"] = p
        elif isinstance(p, HealthProbe):
            slot["health"] = p
        elif isinstance(p, UnitState):
            slot["unit"] = p
        elif isinstance(p, LogReading):
            slot["logs"] = p
        elif isinstance(p, GateObservation):
            slot["gate"] = p
    if allocator is not None:
        for slot in parts.values():
            slot["allocator"] = attribute_allocator(allocator, slot.get("unit"))
    return Snapshot(
        time_seconds=now,
        services=tuple(ServiceSnapshot(name, **parts[name]) for name in services),
        gpus=gpus,
        sources=tuple(statuses),
        op_results=tuple(op_results),
    )


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "?" if v is None else fmt.format(v)


def service_line(sig: ServiceSignals) -> str:
    health = sig.health_state.value if sig.health_state is not None else "?"
    parts = [
        f"{sig.service}: {health}",
        f"kv={_pct(sig.kv_cache_usage_ratio)}",
        f"run={_num(sig.requests_running)}",
        f"wait={_num(sig.requests_waiting)}",
        f"preempt/s={_num(sig.preemptions_per_second, '{:.1f}')}",
    ]
    if sig.headroom_bytes is not None:
        parts.append(f"free={sig.headroom_bytes / GIB:.1f}GiB")
    if sig.stalled:
        parts.append(f"STALLED {sig.stall_seconds:.0f}s")
    return " ".join(parts)


def status_line(signals: Signals, snapshot: Snapshot) -> str:
    down = [
        f"{s.source.value}" + (f"[{s.service}]" if s.service else "")
        for s in snapshot.sources
        if not s.up
    ]
    text = "; ".join(service_line(s) for s in signals.services)
    if down:
        text += " | down: " + ",".join(down)
    return text[:400]
