"""A twin scenario end to end on virtual time: the guardian's decisions in a fraction of a second.

What runs, in this process, on ONE fake clock (no sockets, no threads, no sleeps):

* the vLLM twin: a :class:`~vllm_guardian.sim.server.Twin` whose clock is the fake one (its
  engine, scenario faults, memory model, ``/metrics`` text, GPU reading, log lines, drain on
  SIGTERM and watchdog exit are the twin's own code; only the HTTP server is left out). Its
  command line is the demo's twin command plus the guardian's flags file, parsed by the twin's
  own flag parser, so a relaunch really starts an engine with the flags the action wrote;
* a process manager like ``actuators/procmgr.Supervisor``: ``Restart=always`` after 1 s, and a
  restart call that sends SIGTERM, waits for the drain and the exit, then starts a new twin
  (which loads its model in simulated time before it listens);
* the scenario's seeded open-loop load (``sim/load.plan_requests``, the arrival model
  ``sim load`` uses), each request submitted at its own arrival time, its outcome counted as
  the load generator would (ok, HTTP error, stream error, incomplete, connection error,
  timeout after 30 s);
* the guardian's sources at their parsing boundary: the twin's exposition text through
  ``parse_vllm_metrics``, ``/health`` through ``classify_status``, the unit found by its port
  (the main pid, its command line), the twin's log lines through the log source's classifier
  (``EventCounter``), the GPU through the state file's writer and reader (``gpu_state_format``:
  ``build_state``, ``parse_state_file``, stale after three intervals as in the daemon);
* each tick, the daemon's ``assemble`` and the pure ``core/step.step`` with the demo's config
  (``demo.demo_config``: its rules, policy and windows), and the effects applied: the bundle and
  flags calls answer on the next tick, the restart call when the old twin has exited.

Time: the guardian's clock runs from ``T0``; the twin's simulated clock runs ``speed`` times
faster from its own start, exactly as ``--sim-speed`` does against wall time in ``run_demo``.
So a case here is the same experiment as the real-process demo with the same options, minus
the scheduling noise of a busy machine.

Left out, on purpose: the allocator source (the twin has no in-vLLM plugin, so the real source
reports "no plugin data"), the admission gate's holding and queueing (the demo has none; a
case with ``gate=True`` has its status only: every request forwarded at once, and which have
had no answer yet) and alert delivery (what the step delivers and what it inhibits is recorded
instead).

Why in ``tests/`` and not in the package: the twin stands in for vLLM and must not depend on the
guardian (this harness imports both), and nothing the product ships runs it.
"""

from __future__ import annotations

import io
import json
import signal
from asyncio import Queue, QueueEmpty
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.actuators.alerts import load_rules
from vllm_guardian.actuators.bundle import BundleWriter
from vllm_guardian.config import Config
from vllm_guardian.core import policy
from vllm_guardian.core.driver import Driver
from vllm_guardian.formats.gpu_state_format import (
    StateDevice,
    StateFileError,
    StateXid,
    build_state,
    parse_state_file,
)
from vllm_guardian.gate.progress import GIVEN_UP_MIN_SECONDS
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import (
    Action,
    ActionResult,
    GateObservation,
    HealthProbe,
    HealthState,
    Op,
    OpRequest,
    OpResult,
    Reading,
    Snapshot,
    SourceKind,
    SourceStatus,
    UnitState,
)
from vllm_guardian.shell.daemon import assemble
from vllm_guardian.sim.engine import EnginePhase, RequestDelta
from vllm_guardian.sim.exposition import HttpStats, make_registry
from vllm_guardian.sim.flags import FlagError, parse_serve_args
from vllm_guardian.sim.load import OutcomeKind, PlannedRequest, plan_requests
from vllm_guardian.sim.profiling import EngineConfig
from vllm_guardian.sim.scenarios import SCENARIOS
from vllm_guardian.sim.server import ApiError, Lifecycle, Twin
from vllm_guardian.sim.vllm_log import LogWriter
from vllm_guardian.sources.health import classify_status
from vllm_guardian.sources.logs import EventCounter
from vllm_guardian.sources.nvml import STALE_AFTER_INTERVALS
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics
from vllm_guardian.tools.demo import DemoOptions, demo_config

T0 = 1_800_000_000.0
# The twin's main loop, the load's arrivals and the guardian's ticks interleave on this grain
# (guardian seconds); the twin ticks every 5 ms of wall time, finer than anything asserted here.
STEP_SECONDS = 0.05
RESTART_DELAY_SECONDS = 1.0  # procmgr.Supervisor's Restart=always delay
REQUEST_TIMEOUT_SECONDS = 30.0  # sim/load.run_load's per-request bound
LOAD_SEED = 0  # `sim load`'s default
FIRST_PID = 4100
SERVICE = "vllm"


@dataclass(frozen=True)
class Case:
    """One experiment: the options ``run_demo`` takes, minus the real processes."""

    name: str
    scenario: str
    speed: float
    duration_seconds: float
    twin_args: tuple[str, ...] = ()
    policy: tuple[tuple[str, Any], ...] = ()
    # True: the twin's processes share a timeline file (--sim-timeline-file), so the scenario's
    # one-off faults keep their place on the run's clock across restarts (the demo does not).
    timeline: bool = False
    # True: a gate stands in front of the twin, and the guardian reads its status each tick:
    # the requests it sent and not finished, and which of them have had no answer yet (the
    # load's own requests: the gate forwards each at once).
    gate: bool = False
    # The load's per-request timeout (guardian seconds): a client gives up, the twin never
    # notices. With a gate, a request given up before any answer still counts as unanswered.
    client_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS
    # True: the bundle step writes the real incident bundle (actuators/bundle.BundleWriter, the
    # twin's exposition as its scrape) under the run's directory, for diagnose to read.
    bundles: bool = True


@dataclass
class Run:
    """Everything one case produced, typed."""

    case: Case
    decisions: list[policy.Decision] = field(default_factory=list)
    actions: dict[int, Action] = field(default_factory=dict)
    results: list[ActionResult] = field(default_factory=list)
    # (t, alert, new state, why it was not delivered: None when it was)
    alerts: list[tuple[float, str, str, str | None]] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    twin_starts: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)  # (t, argv)
    twin_exits: list[tuple[float, int]] = field(default_factory=list)  # (t, status)
    engines: list[EngineConfig] = field(default_factory=list)  # each twin that parsed its flags
    snapshots: list[Snapshot] = field(default_factory=list)  # every tick's, as recorded
    # The incident bundles the guardian's bundle step wrote (Case.bundles): (action id, path).
    bundles: list[tuple[int, Path]] = field(default_factory=list)
    config: Config | None = None
    ticks: int = 0

    def of(self, what: policy.DecisionKind) -> list[policy.Decision]:
        return [d for d in self.decisions if d.what is what]

    def started(self, kind: str | None = None) -> list[Action]:
        """Actions in the order they started (escalations included)."""
        return [a for a in self.actions.values() if kind is None or a.kind.value == kind]

    @property
    def alerts_fired(self) -> list[str]:
        out: list[str] = []
        for _, name, state, _ in self.alerts:
            if state == "firing" and name not in out:
                out.append(name)
        return out

    def golden_rows(self) -> list[dict[str, Any]]:
        """The typed decision log: no wording, only what was decided, when, why (the cause;
        for nothing done, what withheld it), on which action, with which flags; plus the alerts that fired and resolved, and why a
        change was not delivered to the sinks (inhibited: vLLM down because of the guardian)."""
        rows: list[dict[str, Any]] = []
        for t, name, state, inhibited_by in self.alerts:
            change: dict[str, Any] = {"t": t, "alert": name, "state": state}
            if inhibited_by is not None:
                change["inhibited_by"] = inhibited_by
            rows.append(change)
        for d in self.decisions:
            a = self.actions.get(d.action_id) if d.action_id is not None else None
            row: dict[str, Any] = {
                "t": round(d.time_seconds - T0, 3),
                "what": d.what.value,
                "phase": d.phase.value if d.phase is not None else None,
                "cause": d.cause.value if d.cause is not None else None,
                "action": d.action_kind.value if d.action_kind is not None else None,
            }
            if d.what is policy.DecisionKind.SUPPRESSED:
                row["withheld"] = d.withheld.value if d.withheld is not None else None
            if d.what is policy.DecisionKind.ACTION and a is not None:
                row["flags"] = [list(f) for f in a.flags]
                row["env"] = [list(e) for e in a.env]
            if d.what is policy.DecisionKind.RESULT:
                row["ok"] = d.ok
            rows.append(row)
        rows.sort(key=lambda r: r["t"])  # stable: alert transitions before that tick's decisions
        return rows

    def golden_text(self) -> str:
        head = {
            "case": self.case.name,
            "twin_exits": [code for _, code in self.twin_exits],
            "twin_starts": len(self.twin_starts),
        }
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in [head, *self.golden_rows()])

    def explain(self) -> str:
        """What a failing assertion prints: the decisions with their reasons, and the world."""
        lines = [
            f"{d.time_seconds - T0:7.2f} {d.what.value:<10} "
            f"{d.phase.value + ': ' if d.phase else ''}{d.reason}"
            for d in self.decisions
        ]
        lines.append(f"alerts fired: {self.alerts_fired}")
        lines.append(f"twin exits: {self.twin_exits}  starts: {len(self.twin_starts)}")
        lines.append(f"requests: {dict(self.requests)}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- the twin


class _StartTime:
    """The twin's ``process_start_time_seconds``: its (virtual) start, as a new process has."""

    def __init__(self, unix_seconds: float) -> None:
        self.unix_seconds = unix_seconds

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=self.unix_seconds,
        )


class VirtualTwin(Twin):
    """The twin without its HTTP server, on the fake clock: ``sim_now`` is
    ``(clock − start) × speed``, the log goes to a buffer the log source reads."""

    def __init__(self, argv: tuple[str, ...], env: dict[str, str], pid: int, clock: FakeClock):
        self.argv = argv
        self.clock = clock
        self.sink = io.StringIO()
        super().__init__(
            parse_serve_args(argv[argv.index("serve") + 1 :], env), LogWriter(pid, self.sink)
        )
        self.pid = pid
        self.started_at = clock.time()
        self.wall0 = self.started_at
        if self.epoch is not None:  # the run's epoch (--sim-epoch, the timeline file): the
            # scenario's zero on this engine's clock, as Twin.__init__ computes it from wall time
            self.engine.scenario_zero = (self.epoch - self.started_at) * self.opts.speed
        self.http_stats = HttpStats(self.started_at)
        self.registry = make_registry(self._metric_families, [_StartTime(self.started_at)])
        self.requests: dict[str, tuple[PlannedRequest, Queue[RequestDelta], float]] = {}

    def sim_now(self) -> float:
        return (self.clock.time() - self.started_at) * self.opts.speed

    def wall_of(self, sim_seconds: float) -> float:
        return self.started_at + sim_seconds / self.opts.speed

    @property
    def listening(self) -> bool:
        return self.lifecycle in (Lifecycle.SERVING, Lifecycle.DRAINING)

    def take_lines(self) -> list[str]:
        text = self.sink.getvalue()
        self.sink.seek(0)
        self.sink.truncate()
        return text.splitlines()

    def run_once(self) -> int | None:
        """One pass of ``Twin.run``'s loop; the exit status once the process ends."""
        self.tick()
        e = self.engine
        if len(e.faults) != self._faults_written:
            self.write_timeline()
        if e.phase is EnginePhase.FAILED_STARTUP:
            return 1
        if self.lifecycle is Lifecycle.STARTING and e.phase is not EnginePhase.STARTING:
            self.lifecycle = Lifecycle.SERVING  # Twin._start_serving, minus the socket
            self.ready_wall = self.clock.time()
            self.write_timeline()
        if self.signal_received is not None:
            code = self._shutdown()
            if code is not None:
                return code
        if e.exit_due():
            self._watchdog_exit()
            forced = self.opts.scenario.forced_exit_code
            return forced if forced is not None else self.opts.exit_code
        return None


# ------------------------------------------------------------------------------- the run


class VirtualWorld:
    """The twin under its process manager, the load, the guardian's sources and its step."""

    def __init__(self, case: Case, workdir: Path) -> None:
        self.case = case
        workdir.mkdir(parents=True, exist_ok=True)
        opts = DemoOptions(
            case.scenario,
            case.speed,
            case.duration_seconds,
            workdir,
            extra_twin_args=case.twin_args,
            quiet=True,
            timeline=case.timeline,
            policy=dict(case.policy),
        )
        # Ports are never opened: nothing here listens or connects.
        self.cfg: Config = demo_config(opts, workdir, 9, 9)
        svc = self.cfg.service(SERVICE)
        assert svc is not None and svc.command
        self.command = tuple(svc.command)
        # The daemon's tick driver: its settings, window and state, built from the config.
        self.driver = Driver.for_config(self.cfg, load_rules(self.cfg.alerting))
        self.clock = FakeClock(T0)
        self.run = Run(case, config=self.cfg)
        self.flags: flagsfile.FlagsContent | None = None
        self.twin: VirtualTwin | None = None
        self.next_pid = FIRST_PID
        self.respawn_at: float | None = T0
        self.restart_op: OpRequest | None = None  # a restart call waiting for the old exit
        self.kill_at: float | None = None
        self.results: list[OpResult] = []
        self.logs = EventCounter(self.cfg.sources.logs.recent_events)
        self.xids: tuple[StateXid, ...] = ()  # the GPU's error history outlives each twin
        self.gpu_doc: dict[str, Any] | None = None
        self.gpu_written_at = -1e18
        self.xids_written = 0
        self.xid_seq: dict[str, int] = {}
        self.inflight: dict[int, tuple[VirtualTwin, str, Queue[RequestDelta], float]] = {}
        self.answered: set[int] = set()  # in flight, and a byte of the answer came
        # The gate's earliest request given up before any answer, at least GIVEN_UP_MIN_SECONDS
        # after its send (gate/progress.py's Unanswered): kept until an answer's first byte,
        # or the engine's restart.
        self.given_up_at: float | None = None
        svc_cfg = self.cfg.service(SERVICE)
        self.bundle_writer = BundleWriter(
            workdir / "bundles",
            lambda _: (svc_cfg, list(self.driver.history)),
            timeout_seconds=5.0,
            read_metrics=self._scrape_for_bundle,
        )
        profile = SCENARIOS[case.scenario].load
        self.plan = deque(
            plan_requests(profile, LOAD_SEED, 100_000, case.duration_seconds * case.speed)
        )

    @property
    def now(self) -> float:
        return self.clock.time()

    def _to(self, t: float) -> None:
        if t > self.now:
            self.clock.advance(t - self.now)

    # --- the process manager ----------------------------------------------------------------

    def _spawn(self) -> str:
        argv = self.command + (self.flags.argv if self.flags else ())
        env = dict(self.flags.env) if self.flags else {}
        pid, self.next_pid = self.next_pid, self.next_pid + 1
        self.run.twin_starts.append((round(self.now - T0, 3), argv))
        try:
            self.twin = VirtualTwin(argv, env, pid, self.clock)
        except (FlagError, ValueError) as e:  # cli.serve: a ValueError traceback, status 1
            for line in ("Traceback (most recent call last):", f"ValueError: {e}"):
                self.logs.feed(line, self.now)
            self._exited(1)
            return f"started pid {pid}, which failed at once"
        self.twin.previous_xids = self.xids
        self.xids_written = 0
        self.run.engines.append(self.twin.opts.engine)
        return f"restarted as pid {pid}"

    def _exited(self, code: int) -> None:
        twin = self.twin
        self.run.twin_exits.append((round(self.now - T0, 3), code))
        if twin is not None:
            self._write_gpu(force=True, process_gone=True)
            self.given_up_at = None  # the gate sees /health fail: a new engine
            for i, (owner, _, _, _) in list(self.inflight.items()):
                if owner is twin:  # the connection ends with the process
                    del self.inflight[i]
                    self.answered.discard(i)
                    self.run.requests[OutcomeKind.INCOMPLETE.value] += 1
        self.twin = None
        self.kill_at = None
        if self.restart_op is not None:
            req, self.restart_op = self.restart_op, None
            self.results.append(
                OpResult(req.action_id, req.service, req.op, True, False, self._spawn(), self.now)
            )
        else:
            self.respawn_at = self.now + RESTART_DELAY_SECONDS

    def _restart(self, req: OpRequest) -> None:
        """Supervisor.restart: SIGTERM (vLLM drains), wait for the exit, start again."""
        self.respawn_at = None
        if self.twin is None:
            self.results.append(
                OpResult(req.action_id, req.service, req.op, True, False, self._spawn(), self.now)
            )
            return
        self.restart_op = req
        self.twin.signal_received = signal.SIGTERM
        self.kill_at = self.now + req.timeout_seconds  # then SIGKILL, as Supervisor._terminate

    def _apply(self, req: OpRequest) -> None:
        if req.op is Op.RESTART:
            self._restart(req)
            return
        ok, terminal, detail = True, False, "bundle captured (virtual)"
        if req.op is Op.BUNDLE and self.case.bundles:
            path = self.bundle_writer.capture(self.run.actions[req.action_id])
            self.run.bundles.append((req.action_id, path))
            detail = f"written to {path}"
        if req.op is Op.WRITE_FLAGS:
            try:
                self.flags = flagsfile.validate(req.flags, req.env)
                detail = "flags file written"
            except flagsfile.FlagsRejected as e:
                ok, terminal, detail = False, True, f"flags rejected: {e}"
        self.results.append(
            OpResult(req.action_id, req.service, req.op, ok, terminal, detail, self.now)
        )

    def _scrape_for_bundle(self, _svc: object) -> bytes | None:
        twin = self.twin
        return twin.metrics_text().encode() if twin is not None and twin.listening else None

    # --- the GPU state file ----------------------------------------------------------------

    def _write_gpu(self, force: bool = False, process_gone: bool = False) -> None:
        twin = self.twin
        if twin is None:
            return
        new_xid = len(twin.engine.xid_events) != self.xids_written
        interval = twin.opts.gpu_state_interval_seconds
        if not force and not new_xid and self.now - self.gpu_written_at < interval:
            return
        reading = twin.gpu_reading()
        self.xids_written = len(twin.engine.xid_events)
        self.xids = reading.xid_events
        if process_gone:
            reading = StateDevice(
                reading.total_bytes,
                tuple(p for p in reading.processes if p.pid != twin.pid),
                0.0,
                reading.xid_events,
            )
        self.gpu_doc = build_state(reading, self.now)
        self.gpu_written_at = self.now

    # --- the load --------------------------------------------------------------------------

    def _send(self, p: PlannedRequest) -> None:
        twin = self.twin
        if twin is None or not twin.listening:
            self.run.requests[OutcomeKind.CONNECTION_ERROR.value] += 1
            return
        body = {"model": "demo", "prompt": p.prompt, "max_tokens": p.max_tokens, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            rid, _, q = twin.submit(body, chat=False)
        except ApiError:
            self.run.requests[OutcomeKind.HTTP_ERROR.value] += 1
            return
        self.inflight[p.index] = (twin, rid, q, self.now)

    def _collect_outcomes(self) -> None:
        for i, (_, _, q, sent) in list(self.inflight.items()):
            kind: OutcomeKind | None = None
            while kind is None:
                try:
                    d = q.get_nowait()
                except QueueEmpty:
                    break
                self.answered.add(i)
                self.given_up_at = None  # the engine's input works
                if d.request_id == "":  # the twin cut the stream (drain timed out)
                    kind = OutcomeKind.INCOMPLETE
                elif d.error is not None:
                    kind = OutcomeKind.STREAM_ERROR
                elif d.finish_reason is not None:
                    kind = OutcomeKind.OK
            if kind is None and self.now - sent >= self.case.client_timeout_seconds:
                kind = OutcomeKind.TIMEOUT  # the client gives up; the twin never notices
                if i not in self.answered and self.now - sent >= GIVEN_UP_MIN_SECONDS:
                    kept = self.given_up_at
                    self.given_up_at = sent if kept is None else min(kept, sent)
            if kind is not None:
                del self.inflight[i]
                self.answered.discard(i)
                self.run.requests[kind.value] += 1

    # --- the guardian's sources, at their parsing boundary ----------------------------------

    def _readings(self) -> list[Reading]:
        twin = self.twin
        listening = twin is not None and twin.listening
        out: list[Reading] = []
        if twin is not None and listening:
            out.append(Reading(SourceKind.VLLM_METRICS, SERVICE,
                               parse_vllm_metrics(twin.metrics_text())))  # fmt: skip
            code = 503 if twin.engine.death is not None else 200
            # /is_paused where the twin serves vLLM's development routes, as the source asks.
            paused = twin.engine.paused if twin.opts.dev_mode and code == 200 else None
            out.append(Reading(SourceKind.HEALTH, SERVICE,
                               HealthProbe(classify_status(code), code, 0.001, paused=paused)))  # fmt: skip
        else:
            out.append(Reading(SourceKind.VLLM_METRICS, SERVICE, None,
                               "GET /metrics: connection refused",
                               "vLLM is not listening: still loading the model, or not running"))  # fmt: skip
            out.append(Reading(SourceKind.HEALTH, SERVICE,
                               HealthProbe(HealthState.REFUSED, None, None, "connection refused")))  # fmt: skip
        # The unit found by its listening port (the demo's services have no systemd unit).
        pid = twin.pid if twin is not None and listening else None
        unit = UnitState(None, None, None, None, pid, None, None, None, None,
                         twin.argv if twin is not None and pid else None,
                         (pid,) if pid else ())  # fmt: skip
        out.append(Reading(SourceKind.UNIT, SERVICE, unit))
        out.append(Reading(SourceKind.LOGS, SERVICE, self.logs.take()))
        if self.case.gate:
            out.append(Reading(SourceKind.GATE, SERVICE, self._gate()))
        out.append(self._nvml())
        return out

    def _gate(self) -> GateObservation:
        """The gate's status: what it sent and has not finished, and the oldest of those with
        no answer yet (gate/proxy.py's unanswered), the earliest given up on included."""
        waiting = [sent for i, (_, _, _, sent) in self.inflight.items() if i not in self.answered]
        oldest = min([*waiting, self.given_up_at] if self.given_up_at is not None else waiting,
                     default=None)  # fmt: skip
        return GateObservation(
            True,
            in_flight=len(self.inflight),
            queued=0,
            open=True,
            unanswered=len(waiting),
            oldest_unanswered_seconds=round(self.now - oldest, 3) if oldest is not None else 0.0,
        )

    def _nvml(self) -> Reading:
        if self.gpu_doc is None:
            return Reading(SourceKind.NVML, None, None, "GPU state file does not exist")
        parsed = parse_state_file(
            json.dumps(self.gpu_doc),
            self.now,
            max_age_seconds=STALE_AFTER_INTERVALS * self.cfg.interval_seconds,
            last_xid_seq=self.xid_seq,
        )
        if isinstance(parsed, StateFileError):
            return Reading(SourceKind.NVML, None, None, parsed.error, parsed.hint)
        self.xid_seq = dict(parsed.xid_seq)
        return Reading(SourceKind.NVML, None, parsed.reading)

    # --- one guardian tick -----------------------------------------------------------------

    def tick(self) -> None:
        now = self.now
        readings = self._readings()
        statuses = [
            SourceStatus(r.source, r.service, r.payload is not None and r.error is None, 0.001,
                         r.error, r.hint)
            for r in readings
        ]  # fmt: skip
        results, self.results = self.results, []
        snap = assemble(now, [SERVICE], readings, statuses, results)
        self.run.snapshots.append(snap)
        fx = self.driver.tick(snap, now)
        t = round(now - T0, 3)
        for tr in fx.transitions:
            self.run.alerts.append((t, tr.alert.name, tr.current.value, None))
        for tr in fx.inhibited:
            self.run.alerts.append((t, tr.alert.name, tr.current.value, tr.alert.inhibited_by))
        for a in fx.actions:
            self.run.actions[a.id] = a
        self.run.decisions.extend(fx.decisions)
        self.run.results.extend(fx.results)
        for req in fx.ops:
            self._apply(req)
        self.run.ticks += 1

    # --- the clock ---------------------------------------------------------------------------

    def go(self) -> Run:
        every = round(self.cfg.interval_seconds / STEP_SECONDS)
        steps = round(self.case.duration_seconds / STEP_SECONDS)
        for k in range(1, steps + 1):
            t = T0 + k * STEP_SECONDS
            while self.plan and T0 + self.plan[0].at_seconds / self.case.speed <= t:
                p = self.plan.popleft()
                self._to(T0 + p.at_seconds / self.case.speed)
                self._send(p)
            self._to(t)
            if self.respawn_at is not None and self.now >= self.respawn_at:
                self.respawn_at = None
                self._spawn()
            if self.twin is not None:
                code = self.twin.run_once()
                lines = self.twin.take_lines() if self.twin is not None else []
                for line in lines:
                    self.logs.feed(line, self.now)
                if code is None and self.kill_at is not None and self.now >= self.kill_at:
                    code = -signal.SIGKILL
                if code is not None:
                    self._exited(code)
                else:
                    self._write_gpu()
            if k % every == 0:
                self._collect_outcomes()  # the load's bookkeeping: no decision reads it
                self.tick()
        return self.run


def run_case(case: Case, workdir: Path) -> Run:
    return VirtualWorld(case, workdir).go()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.virtual_time SCENARIO [--speed S] [--duration D]``: one case's
    decisions with their reasons, for reading a golden diff."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m tests.virtual_time")
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=45.0)
    ap.add_argument("--policy", action="append", default=[], metavar="KEY=NUMBER")
    ap.add_argument("twin_args", nargs="*", help="extra twin flags (after --)")
    ns = ap.parse_args(argv)
    policy_keys = tuple((k, float(v)) for k, v in (p.split("=", 1) for p in ns.policy))
    case = Case(ns.scenario, ns.scenario, ns.speed, ns.duration, tuple(ns.twin_args), policy_keys)
    with tempfile.TemporaryDirectory() as d:
        print(run_case(case, Path(d)).explain())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
