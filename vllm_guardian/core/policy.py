"""The self-healing policy: ``decide(state, alerts, snapshot, signals, now, settings)``. Pure.

Where it sits: after alert evaluation, before the actuators. It returns the next state, the
actions to execute and a decision record for every choice it made (the audit log). Action
results come back as observations (``Snapshot.action_results``) on a later tick; the policy
never assumes success.

The ladder per service, least disruptive first (docs/capacity.md has why KV pressure stops at
the gate):

1. alert (done by alerting);
2. gate ``/ready/<service>`` above the KV high watermark, open below the low one;
3. drain + restart for a dead or hung engine, and for fragmentation;
4. relaunch with one rung more conservative on the lever that matches the cause, after
   ``pressure_events_to_relaunch`` episodes of that cause in the window, or at once after an
   OOM crash;
5. step back up one rung after ``stable_for_seconds`` without pressure, never above the
   operator's baseline; a cause that returns soon after a step up pins the rung;
6. stop and escalate: restart budget spent, repeated early failures, a hardware fault or a
   model that does not fit latch a breaker that only ``vllm-guardian resume`` clears.

Guard rails: a destructive action needs an actionable finding (``core/diagnosis.py``),
nothing happens within the cooldown of the last action (except a crash of the instance it
made ready, within ``early_failure_seconds``: an early failure) or the backoff of a failed one,
at most one action per service is in flight, and in dry-run everything is decided and recorded
but the actions are marked ``dry_run`` for the executor to skip.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

from vllm_guardian.config import Config, PolicyConfig
from vllm_guardian.core import phases
from vllm_guardian.core.budget import parse_launch_flags
from vllm_guardian.core.causes import Pressure, cause_spec
from vllm_guardian.core.diagnosis import (
    CORROBORATION_SECONDS,
    RESET_CLASS_XIDS,
    Evidence,
    Finding,
    Structure,
    actionable,
    corroborated,
    evidence_from_alerts,
    evidence_from_logs,
    rank,
    structural_failures,
)
from vllm_guardian.core.forecast import Forecast
from vllm_guardian.core.levers import (
    LEVERS,
    LOW_CAP_COSTS,
    Baseline,
    Lever,
    Step,
    lever_of_flag,
    lever_spec,
    mean_context_tokens,
    median,
    recompute_share,
)
from vllm_guardian.core.signals import ServiceSignals, Signals
from vllm_guardian.model import (
    Action,
    ActionKind,
    ActionResult,
    Alert,
    Cause,
    GpuDevice,
    HealthState,
    Op,
    OpRequest,
    OpResult,
    Snapshot,
    UnitState,
)

GIB = 1024**3


@dataclass(frozen=True)
class LogItem:
    """One log line's evidence, held until an action consumes it or it ages out."""

    cause: Cause
    name: str
    sentence: str
    seen_at: float
    agreed: tuple[str, ...] = ()  # the structural failures that agreed with it; () not yet

    def evidence(self) -> Evidence:
        return Evidence(self.cause, self.name, self.sentence, unambiguous=True)


@dataclass(frozen=True)
class Levels:
    """What a relaunch changes in the state before it restarts anything: the rungs and what
    pins them, the operator's flags and baseline. Kept while its wait for a fleet permit lasts,
    and restored when the wait ends without one: vLLM still runs with these."""

    rungs: tuple[tuple[Lever, int], ...] = ()
    last_step_up: tuple[tuple[Lever, float], ...] = ()
    pinned_until: tuple[tuple[Lever, float], ...] = ()
    operator_flags: tuple[tuple[str, str], ...] = ()
    baseline: Baseline | None = None


@dataclass(frozen=True)
class ServiceState:
    service: str
    gate_open: bool = True
    gate_reason: str = "open"
    gate_closed_at: float | None = None
    paused: bool = False
    breaker_latched: bool = False
    breaker_reason: str | None = None
    action: phases.ActionProgress | None = None  # the restart or relaunch under way
    cooldown_until: float = 0.0
    backoff_until: float = 0.0
    backoff_seconds: float = 0.0
    # The backoff follows a wait for a fleet permit that restarted nothing: it holds voluntary
    # actions only (a crash is acted on at once).
    backoff_voluntary_only: bool = False
    restarts: tuple[float, ...] = ()  # guardian restarts/relaunches, for the budget
    early_failures: int = 0
    ready_since: float | None = None  # when our last action left the service ready
    started_seconds: float | None = None  # when the current vLLM process started (as seen)
    main_pid: int | None = None
    rungs: tuple[tuple[Lever, int], ...] = ()
    last_step_up: tuple[tuple[Lever, float], ...] = ()
    pinned_until: tuple[tuple[Lever, float], ...] = ()
    episodes: tuple[tuple[Cause, float], ...] = ()  # pressure episodes: (cause, start)
    active_causes: tuple[Cause, ...] = ()
    last_pressure_seconds: float | None = None
    baseline: Baseline | None = None
    last_note: str = ""  # the last "nothing done because ..." decision, to log it once
    # Instant evidence (log lines) not yet acted on, each with the structural signals that
    # agreed with it (core/diagnosis.corroborated): only those count. (A state file saved before
    # this field has `pending` instead, plain tuples: ignored on load, as nothing agreed then.)
    log_items: tuple[LogItem, ...] = ()
    # The structural failures seen last (core/diagnosis.structural_failures) and when.
    structural: tuple[str, ...] = ()
    structural_at: float | None = None
    watch_since: float | None = None  # the guardian's first look at this service
    # Since when the exhaustion forecast has named its current cause (preemptive_action).
    forecast_since: float | None = None
    # Pre-emptive actions taken: (cause, time), for "came back soon after the last one".
    forecast_actions: tuple[tuple[Cause, float], ...] = ()
    seen_up: bool = False  # /health has answered 200 at least once since then
    down_since: float | None = None  # when /health stopped answering 200
    # vLLM's running count while concurrency_overcommit is active, (time, running), within the
    # pressure window: its median is what the pool hosts (a single reading is noise: 1-7 and
    # 3-28 in the measured runs).
    running_samples: tuple[tuple[float, float], ...] = ()
    # Flags an operator set with `vllm-guardian relaunch --set` (whitelisted, validated by the
    # shell before they get here); `--reset` clears them and every rung.
    operator_flags: tuple[tuple[str, str], ...] = ()
    # The levels before the action waiting for a fleet permit changed them (None: no wait).
    levels_before: Levels | None = None

    def rung(self, lever: Lever) -> int:
        return dict(self.rungs).get(lever, 0)

    @property
    def in_flight(self) -> int | None:
        """The id of the action under way, if any."""
        return self.action.action_id if self.action is not None else None


@dataclass(frozen=True)
class PolicyState:
    services: tuple[ServiceState, ...] = ()
    next_action_id: int = 1

    def service(self, name: str) -> ServiceState:
        for s in self.services:
            if s.service == name:
                return s
        return ServiceState(name)


@dataclass(frozen=True)
class PolicySettings:
    policy: PolicyConfig
    services: tuple[str, ...]
    rule_signals: Mapping[str, str] = field(default_factory=dict)  # alertname → signal
    # fleet.permit: lease — a voluntary action first waits this long at most for a fleet
    # permit (core/phases.py AWAITING_PERMIT); None: no permit (one host, the default).
    permit_timeout_seconds: float | None = None
    # A permit held is renewed this often while its action lasts (a third of the Lease's
    # duration); None: never.
    permit_renew_seconds: float | None = None
    # The command the guardian starts each service with (the process backend, a pod): the
    # operator's own flags, read before the process's /proc command line, which may show
    # nothing (the process just exited) or the guardian's flags on top.
    commands: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def commands_of(cfg: Config) -> dict[str, tuple[str, ...]]:
    """:attr:`PolicySettings.commands` from the config: the services the guardian starts."""
    if cfg.policy.backend != "process":
        return {}
    return {s.name: tuple(s.command) for s in cfg.services if s.command}


class DecisionKind(StrEnum):
    GATE = "gate"  # the front door closes (KV pressure)
    UNGATE = "ungate"
    ACTION = "action"  # an action starts (or, in dry-run, would)
    PHASE = "phase"  # an action under way moves to its next phase
    RESULT = "result"  # an action ended
    SUPPRESSED = "suppressed"  # evidence seen, nothing done, and why
    LATCH = "latch"  # the breaker latched: a person must `resume`
    STEP_UP = "step_up"
    PAUSE = "pause"
    RESUME = "resume"
    OPERATOR = "operator"  # an operator command, accepted or refused


class Withheld(StrEnum):
    """Why evidence was seen and nothing was done (a SUPPRESSED decision), for code to read:
    the reason text says the same with its figures, for a person."""

    BREAKER_LATCHED = "breaker_latched"  # a person must `resume` first
    EVIDENCE_SHORT = "evidence_short"  # findings, none strong enough to act on yet
    COOLDOWN = "cooldown"  # too soon after the last action
    BACKOFF = "backoff"  # too soon after a failed action
    EPISODES = "episodes"  # fewer episodes than the cause needs before a relaunch
    GATED_ONLY = "gated_only"  # KV pressure: gated and alerted; a relaunch's conditions fail
    AT_FLOOR = "at_floor"  # the lever is already as low as a relaunch would set it
    PINNED = "pinned"  # every lowered lever is pinned: no step up yet
    BUDGET_SPENT = "budget_spent"  # the restart budget is spent (no latch: nothing crashed)
    FORECAST_WAIT = "forecast_wait"  # a forecast whose plan waits (a quiet moment, growth) or pages
    UNCORROBORATED_LOG = "uncorroborated_log"  # a log line alone, held for a signal to agree
    DAEMONIZED = "daemonized"  # the process backend's command left it: restarting cannot help


@dataclass(frozen=True)
class Decision:
    """One line of the audit log: what was decided, why, on what evidence. Code reads the
    fields (``what``, ``action_kind``, ``phase``, ``ok``, ``withheld``, ``cause``), never
    ``reason``, which is written for a person."""

    time_seconds: float
    service: str
    what: DecisionKind
    reason: str
    cause: Cause | None = None
    evidence: tuple[str, ...] = ()
    action_id: int | None = None
    dry_run: bool = False
    phase: phases.Phase | None = None  # for PHASE decisions: the phase entered
    # The kind of the action this decision starts, moves or ends (None: no action, or one this
    # guardian run no longer knows).
    action_kind: ActionKind | None = None
    withheld: Withheld | None = None  # for SUPPRESSED decisions: why nothing was done
    # An action ended (its RESULT, or the LATCH of one that failed for good): did it work.
    ok: bool | None = None


@dataclass(frozen=True)
class PolicyOutput:
    state: PolicyState
    actions: tuple[Action, ...]  # actions started this tick (escalations included)
    decisions: tuple[Decision, ...]
    ops: tuple[OpRequest, ...] = ()  # blocking actuator calls to start
    results: tuple[ActionResult, ...] = ()  # actions that ended this tick


# --- flags -----------------------------------------------------------------------------------


def default_baseline(
    signals: ServiceSignals | None, cmdline: Sequence[str] | None, gpu_total_bytes: int = 0
) -> Baseline:
    """The operator's values, one per lever with a value: from the command line when set
    there, else what vLLM reports it runs with, else vLLM's default for the card's memory size
    (each lever's row in ``core/levers.py`` says where to look and holds the defaults)."""
    total = max((g.total_bytes or 0 for g in signals.gpus), default=0) if signals else 0
    total = total or gpu_total_bytes
    # The one launch-flag reader (core/budget.py), with argparse's semantics as vLLM has them:
    # the last occurrence wins and ``8k`` is 8000.
    flags = parse_launch_flags(cmdline or ())
    values: dict[str, Any] = {
        spec.baseline_field: spec.operator_value(flags, signals, total)
        for spec in LEVERS.values()
        if spec.baseline_field is not None
    }
    return Baseline(**values)


def lever_value(lever: Lever, rung: int, base: Baseline, p: PolicyConfig) -> str | None:
    """The flag value at ``rung`` (0 = the operator's baseline: no guardian flag)."""
    if rung <= 0:
        return None
    spec = lever_spec(lever)
    if spec.step is Step.SWITCH:  # on: its variable's value, or a flag that takes none
        return spec.env[1] if spec.env is not None else ""
    return spec.text(spec.lowered(spec.base_value(base), rung, p))


def nearest_seqs_rung(
    target: float, below: float, base: Baseline, p: PolicyConfig
) -> tuple[int, int] | None:
    """The max_num_seqs rung whose value is nearest ``target`` while staying under ``below``
    (what the pool admits anyway: a cap at or above it changes nothing, so the relaunch would
    be a pure restart). ``(rung, value)``; None when no rung under ``below`` lies within 15 %
    of the target (a cap below what the pool hosts costs throughput: docs/capacity.md)."""
    best: tuple[int, int] | None = None
    rung = 1
    while True:
        value = int(lever_value(Lever.MAX_NUM_SEQS, rung, base, p) or base.max_num_seqs)
        if value < below and (best is None or abs(value - target) < abs(best[1] - target)):
            best = (rung, value)
        if value <= p.max_num_seqs_floor or value < 0.5 * target or rung > 64:
            break
        rung += 1
    if best is None or abs(best[1] - target) > 0.15 * target:
        return None
    return best


def can_step_down(lever: Lever, rung: int, base: Baseline, p: PolicyConfig) -> bool:
    """Whether one more rung changes anything (floors reached, or a switch already on)."""
    spec = lever_spec(lever)
    if spec.step is Step.SWITCH:
        return rung == 0
    now = lever_value(lever, rung, base, p)
    nxt = lever_value(lever, rung + 1, base, p)
    if now is None:
        return nxt is not None and float(nxt) < spec.base_value(base)
    return nxt is not None and float(nxt) < float(now)


def flags_for(
    rungs: Mapping[Lever, int], base: Baseline, p: PolicyConfig
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The complete guardian-owned flags and environment for these rungs."""
    flags: list[tuple[str, str]] = []
    env: list[tuple[str, str]] = []
    for lever in Lever:
        value = lever_value(lever, rungs.get(lever, 0), base, p)
        if value is None:
            continue
        spec = lever_spec(lever)
        if spec.env is not None:
            # Whoever starts vLLM merges these into the operator's own setting
            # (actuators/flags.merged_env).
            env.append((spec.env[0], value))
            env.extend((name, value) for name in spec.env_also)
        if spec.flag is not None:
            flags.append((spec.flag, value))
        flags.extend(spec.companions)
    return tuple(flags), tuple(env)


def _flags(
    s: ServiceState, base: Baseline, p: PolicyConfig
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The rungs' flags with the operator's own on top; a lever the policy has lowered since
    (rung > 0) is the rung's value, computed from a baseline that took the operator's value."""
    flags, env = flags_for(dict(s.rungs), base, p)
    mine = {f for f, _ in flags}
    merged = tuple((f, v) for f, v in s.operator_flags if f not in mine) + flags
    return merged, env


# --- decide ----------------------------------------------------------------------------------


def _set(
    pairs: tuple[tuple[Lever, float], ...], lever: Lever, value: float
) -> tuple[tuple[Lever, float], ...]:
    d = dict(pairs)
    d[lever] = value
    return tuple(sorted(d.items()))


def _levels(s: ServiceState) -> Levels:
    return Levels(s.rungs, s.last_step_up, s.pinned_until, s.operator_flags, s.baseline)


def _restore_levels(s: ServiceState) -> ServiceState:
    """A wait for a permit ended without one: the levels vLLM still runs with, back."""
    b = s.levels_before
    if b is None:
        return s
    return replace(
        s,
        rungs=b.rungs,
        last_step_up=b.last_step_up,
        pinned_until=b.pinned_until,
        operator_flags=b.operator_flags,
        baseline=b.baseline,
        levels_before=None,
    )


def _set_rung(s: ServiceState, lever: Lever, rung: int) -> ServiceState:
    d = dict(s.rungs)
    if rung > 0:
        d[lever] = rung
    else:
        d.pop(lever, None)
    return replace(s, rungs=tuple(sorted(d.items())))


class _Ctx:
    """Accumulates what one decide() call produces."""

    def __init__(self, state: PolicyState, now: float, settings: PolicySettings) -> None:
        self.next_id = state.next_action_id
        self.now = now
        self.settings = settings
        self.actions: list[Action] = []
        self.decisions: list[Decision] = []
        self.ops: list[OpRequest] = []
        self.results: list[ActionResult] = []

    def decide(self, s: ServiceState, what: DecisionKind, reason: str, **kw: object) -> None:
        self.decisions.append(Decision(self.now, s.service, what, reason, **kw))  # type: ignore[arg-type]

    def act(
        self,
        s: ServiceState,
        kind: ActionKind,
        finding: Finding | None,
        reason: str,
        flags: tuple[tuple[str, str], ...] = (),
        env: tuple[tuple[str, str], ...] = (),
        operator: str | None = None,
        voluntary: bool = False,
        before: Levels | None = None,
    ) -> ServiceState:
        """``voluntary``: nothing has crashed (the replica serves), or an operator asked; with a
        fleet permit configured, such an action waits for one first (docs/kubernetes.md,
        "One disruption budget"). ``before``: the levels before this action changed them, restored if that
        wait ends without a permit."""
        p = self.settings.policy
        # An operator's explicit command acts although the policy is in dry-run.
        dry = operator is None and (p.dry_run or kind.value in p.dry_run_actions)
        evidence = tuple(e.name for e in finding.evidence) if finding else ()
        cause = finding.cause if finding else None
        action = Action(self.next_id, s.service, kind, cause, reason, evidence, dry, flags, env)
        self.actions.append(action)
        self.decide(
            s,
            DecisionKind.ACTION,
            f"{kind.value}: {reason}" + (f" (asked by {operator})" if operator else ""),
            cause=cause,
            evidence=evidence,
            action_id=self.next_id,
            dry_run=dry,
            action_kind=kind,
        )
        self.next_id += 1
        s = replace(s, log_items=())  # the evidence is acted upon: it must not trigger again
        if kind is ActionKind.ESCALATE:
            return s
        if dry:
            what = f"dry-run: would {kind.value}" + (
                f" with {describe_flags(flags, env) or 'the operator baseline'}"
                if kind is ActionKind.RELAUNCH
                else ""
            )
            return _finish(self, s, action.id, kind, phases.Outcome(True, False, what), True)
        permit = self.settings.permit_timeout_seconds if voluntary else None
        progress, ops = phases.start(
            action.id, s.service, kind, cause, reason, flags, env,
            s.main_pid, self.now, p, operator, permit,
        )  # fmt: skip
        self.ops.extend(ops)
        if progress.phase is phases.Phase.AWAITING_PERMIT:
            self.decide(
                s,
                DecisionKind.PHASE,
                f"voluntary {kind.value}: waiting for a fleet permit (at most {permit:.0f}s); "
                "front door stays open",
                action_id=action.id,
                phase=progress.phase,
                action_kind=kind,
            )
            return replace(s, action=progress, levels_before=before or _levels(s))
        self.decide(
            s,
            DecisionKind.PHASE,
            "front door closed; capturing the incident bundle"
            + (" and writing the flags file" if kind is ActionKind.RELAUNCH else ""),
            action_id=action.id,
            phase=progress.phase,
            action_kind=kind,
        )
        return replace(s, action=progress, gate_open=False, gate_reason=f"{kind.value} in progress")

    def note(
        self, s: ServiceState, why: Withheld, reason: str, finding: Finding | None = None
    ) -> ServiceState:
        """A 'nothing done, because' decision, logged once until the reason changes."""
        if reason == s.last_note:
            return s
        evidence = tuple(e.name for e in finding.evidence) if finding else ()
        self.decide(
            s,
            DecisionKind.SUPPRESSED,
            reason,
            cause=finding.cause if finding else None,
            evidence=evidence,
            withheld=why,
        )
        return replace(s, last_note=reason)


def decide(
    state: PolicyState,
    alerts: Sequence[Alert],
    snapshot: Snapshot,
    signals: Signals,
    now: float,
    settings: PolicySettings,
) -> PolicyOutput:
    ctx = _Ctx(state, now, settings)
    out = []
    for name in settings.services:
        s = state.service(name)
        sig = signals.service(name)
        pid_before = s.main_pid
        s = _track_process(s, snapshot, name, now)
        restarted = pid_before is not None and s.main_pid != pid_before
        s = _advance(ctx, s, snapshot, sig)
        if s.paused:
            out.append(
                s
                if s.gate_open
                else replace(s, gate_open=True, gate_reason="paused: gate held open")
            )
            continue
        s = _gate(ctx, s, sig)
        svc_snap = snapshot.service(name)
        logs = svc_snap.logs.recent if svc_snap is not None and svc_snap.logs is not None else ()
        unit = svc_snap.unit if svc_snap is not None else None
        # Instant evidence (log lines) is kept until an action consumes it or it ages out, so
        # an OOM seen during a cooldown still counts once the cooldown ends.
        instant = evidence_from_logs(logs, sig)
        if s.action is not None and _disrupting(s):
            # Our own restart makes vLLM log its engine's death: that is not a new incident.
            # Nor is the instance being replaced dying, before our restart, of the cause the
            # action handles (a pre-emptive relaunch's forecast coming true during its drain):
            # remembered, it restarted the healthy new instance after the cooldown.
            replaced = s.action.cause if s.action.phase in phases.BEFORE_RESTART else None
            instant = [e for e in instant if e.cause not in (Cause.ENGINE_DEAD, replaced)]
        s = _remember(ctx, s, instant, _structure(s, sig, unit, restarted), settings.policy)
        continuous = evidence_from_alerts(
            [
                a
                for a in alerts
                if a.service == name
                and not _instant(settings.rule_signals.get(a.name, ""))
                # An alert held firing (keep_firing_for) whose condition was last true before
                # our last action made vLLM ready again describes the instance we replaced.
                and not (s.ready_since is not None and a.last_true_seconds < s.ready_since)
            ],
            settings.rule_signals,
        )
        if (
            unit is not None
            and unit.unit is not None
            and unit.active_state in ("inactive", "failed")
        ):
            continuous.append(
                Evidence(Cause.ENGINE_DEAD, "unit:exited",
                         f"{unit.unit} is {unit.active_state} (result {unit.result}, status {unit.exec_main_status}) "
                         "and systemd is not restarting it", unambiguous=True)
            )  # fmt: skip
        pending = [x.evidence() for x in s.log_items if x.agreed]
        evidence = _filter_startup(s, sig, unit, now, settings.policy, continuous + pending)
        findings = rank(evidence)
        s = _track_episodes(s, findings, now, settings.policy)
        s = _track_running(s, sig, now, settings.policy)
        cmdline = settings.commands.get(name) or (unit.cmdline if unit is not None else None)
        gpu_total = (
            max((d.memory_total_bytes or 0 for d in snapshot.gpus.devices), default=0)
            if snapshot.gpus
            else 0
        )
        s = _capture_baseline(s, sig, cmdline, gpu_total)
        acted = len(ctx.actions)
        s = _act(ctx, s, findings, sig, cmdline, gpu_total)
        if len(ctx.actions) == acted:
            s = _preempt(ctx, s, sig, cmdline, gpu_total)
        out.append(s)
    return PolicyOutput(
        PolicyState(tuple(out), ctx.next_id),
        tuple(ctx.actions),
        tuple(ctx.decisions),
        tuple(ctx.ops),
        tuple(ctx.results),
    )


def seen(snapshot: Snapshot, sig: ServiceSignals | None, name: str) -> phases.Seen:
    """What the phases of an action read of this tick: requests in flight, health, pids."""
    svc = snapshot.service(name)
    pids: frozenset[int] | None = None
    if snapshot.gpus is not None:
        pids = frozenset(p.pid for d in snapshot.gpus.devices for p in d.processes or ())
    in_flight: float | None = None
    source = ""
    gate = svc.gate if svc is not None else None
    if gate is not None and gate.reachable and gate.in_flight is not None:
        # The front door's own count of what it sent to vLLM and has not finished: exact,
        # where vLLM's gauges lag a scrape and count clients that bypass the gate.
        in_flight, source = float(gate.in_flight), "gate"
    elif sig is not None and sig.requests_running is not None:
        # No gate, or one that does not answer (never a reason to block an action): vLLM's
        # own running + waiting.
        in_flight = sig.requests_running + (sig.requests_waiting or 0)
        source = "vllm" if gate is None else "vllm (the gate did not answer)"
    health = sig.health_state if sig is not None else None
    by_device = bool(sig is not None and sig.gpu_memory_by_device)
    device_pids: tuple[tuple[int, tuple[int, ...] | None], ...] | None = None
    if sig is not None and by_device and snapshot.gpus is not None:
        # The service's GPUs (with gpus auto in a pod: every GPU it sees) and who holds them.
        devices = {d.index: d for d in snapshot.gpus.devices}
        device_pids = tuple((g.gpu, _host_pids(devices.get(g.gpu))) for g in sig.gpus)
    return phases.Seen(
        time_seconds=snapshot.time_seconds,
        in_flight=in_flight,
        in_flight_from=source,
        health_up=None if health is None else health is HealthState.UP,
        listening=None if health is None else health is not HealthState.REFUSED,
        main_pid=svc.unit.main_pid if svc is not None and svc.unit is not None else None,
        gpu_pids=pids,
        metrics_up=bool(sig is not None and sig.metrics_up),
        # Requests lost before the engine (input_hung) finish no more than a hung engine's.
        stalled=bool(sig is not None and (sig.stalled or sig.input_hung)),
        engine_dead=health is HealthState.ENGINE_DEAD,
        by_device=by_device,
        device_pids=device_pids,
        main_started_seconds=(
            svc.unit.main_started_seconds if svc is not None and svc.unit is not None else None
        ),
    )


def _host_pids(device: GpuDevice | None) -> tuple[int, ...] | None:
    """The pids holding memory on a device (None: gone, unreadable, or not listed), but vLLM's
    weight-cache daemon's, which keeps the weights across the restart on purpose."""
    if device is None or device.error is not None or device.processes is None:
        return None
    return tuple(sorted({p.pid for p in device.processes if not p.weight_cache}))


def _advance(
    ctx: _Ctx, s: ServiceState, snapshot: Snapshot, sig: ServiceSignals | None
) -> ServiceState:
    """Move the action under way on by one tick (core/phases.py); record each phase change.
    What the phases read of the tick is gathered only while an action is under way."""
    results = [r for r in snapshot.op_results if r.service == s.service]
    _release_stray_grants(ctx, s, results)
    if s.action is None:
        return s
    action = s.action
    adv = phases.advance(
        action, s.service, seen(snapshot, sig, s.service), results,
        ctx.now, ctx.settings.policy, ctx.settings.permit_renew_seconds,
    )  # fmt: skip
    ctx.ops.extend(adv.ops)
    for m in adv.moves:
        ctx.decide(
            s, DecisionKind.PHASE, m.why,
            action_id=action.action_id, phase=m.phase, action_kind=action.kind,
        )  # fmt: skip
    if adv.outcome is None:
        if (
            action.phase is phases.Phase.AWAITING_PERMIT
            and adv.progress is not None
            and adv.progress.phase is not phases.Phase.AWAITING_PERMIT
        ):  # the permit is granted: from here on the action holds the front door
            s = replace(
                s,
                gate_open=False,
                gate_reason=f"{action.kind.value} in progress",
                levels_before=None,
            )
        return replace(s, action=adv.progress)
    detail = adv.outcome.detail
    if action.kind is ActionKind.RELAUNCH and adv.outcome.ok:
        detail = f"flags now: {describe_flags(action.flags, action.env) or 'the operator baseline'}; {detail}"
    if action.phase is not phases.Phase.AWAITING_PERMIT:
        return _finish(
            ctx, replace(s, action=None), action.action_id, action.kind,
            replace(adv.outcome, detail=detail), False,
        )  # fmt: skip
    # The wait for a permit ended without one: nothing was restarted, so no budget slot is
    # spent, and the backoff holds voluntary actions only.
    s = _finish(
        ctx, _restore_levels(_give_back_slot(replace(s, action=None), action)),
        action.action_id, action.kind, replace(adv.outcome, detail=detail), False,
    )  # fmt: skip
    return s if s.breaker_latched else replace(s, backoff_voluntary_only=True)


def _give_back_slot(s: ServiceState, action: phases.ActionProgress) -> ServiceState:
    """The restart-budget slot an action took when it began (at its start time), given back
    because it ended without disrupting anything. An operator's action took none."""
    if action.operator is not None or action.started_seconds not in s.restarts:
        return s
    kept = list(s.restarts)
    kept.remove(action.started_seconds)
    return replace(s, restarts=tuple(kept))


def _release_stray_grants(ctx: _Ctx, s: ServiceState, results: Sequence[OpResult]) -> None:
    """A permit granted (or renewed) for an action that is no longer waiting for it (its wait
    was superseded by a crash, or it ended while a renewal ran) is given back at once, unless
    the action under way holds or awaits a permit itself (it releases everything when it ends,
    and would find this Lease as its own)."""
    a = s.action
    if a is not None and (a.permit_held or a.phase is phases.Phase.AWAITING_PERMIT):
        return
    for r in results:
        if r.op is not Op.PERMIT or not r.ok or (a is not None and r.action_id == a.action_id):
            continue
        ctx.ops.append(phases.release(r.action_id, s.service, "a permit no action waits for"))
        ctx.decide(
            s,
            DecisionKind.PHASE,
            f"fleet permit granted after action {r.action_id} stopped waiting for it: given "
            f"back ({r.detail})",
            action_id=r.action_id,
            phase=phases.Phase.AWAITING_PERMIT,
        )


def _supersede(ctx: _Ctx, s: ServiceState, top: Finding) -> ServiceState:
    """A crash while an action waits for a fleet permit: the wait ends (nothing was disrupted:
    no backoff, its budget slot given back) and the crash is acted on now, without a permit."""
    a = s.action
    assert a is not None
    adv = phases.supersede(a, s.service, f"{top.cause.value}: {top.evidence[0].sentence}")
    assert adv.outcome is not None
    ctx.ops.extend(adv.ops)
    s = _restore_levels(_give_back_slot(replace(s, action=None), a))
    ctx.results.append(
        ActionResult(
            a.action_id, s.service, a.kind, False, False, adv.outcome.detail, ctx.now, False
        )
    )
    then = (
        "escalating instead"
        if cause_spec(top.cause).escalation is not None
        else "acting on it now, without a permit (the replica is already down)"
    )
    ctx.decide(
        s,
        DecisionKind.RESULT,
        f"{a.kind.value} {adv.outcome.detail}; {then}",
        cause=top.cause,
        evidence=tuple(e.name for e in top.evidence),
        action_id=a.action_id,
        action_kind=a.kind,
        ok=False,
    )
    return s


def _finish(
    ctx: _Ctx,
    s: ServiceState,
    action_id: int,
    kind: ActionKind,
    outcome: phases.Outcome,
    dry_run: bool,
) -> ServiceState:
    """An action ended: success opens the front door and starts the cooldown; a failure backs
    off (doubling) or, when retrying cannot help, latches the breaker."""
    p = ctx.settings.policy
    ctx.results.append(
        ActionResult(
            action_id, s.service, kind, outcome.ok, outcome.terminal, outcome.detail, ctx.now,
            dry_run,
        )
    )  # fmt: skip
    s = replace(s, action=None)
    if outcome.ok:
        s = replace(
            s,
            ready_since=ctx.now,
            cooldown_until=ctx.now + p.cooldown_seconds,
            backoff_seconds=0.0,
            backoff_until=0.0,
            backoff_voluntary_only=False,
            gate_open=True,
            gate_reason="open",
        )
        ctx.decide(
            s,
            DecisionKind.RESULT,
            f"{kind.value} succeeded: {outcome.detail}",
            action_id=action_id,
            dry_run=dry_run,
            action_kind=kind,
            ok=True,
        )
    elif outcome.terminal:
        s = replace(
            s,
            breaker_latched=True,
            breaker_reason=f"{kind.value} failed for good: {outcome.detail}",
            gate_open=True,
            gate_reason="open",
        )
        ctx.decide(
            s, DecisionKind.LATCH, s.breaker_reason or "",
            action_id=action_id, action_kind=kind, ok=False,
        )  # fmt: skip
    else:
        backoff = min(p.backoff_max_seconds, max(p.backoff_initial_seconds, 2 * s.backoff_seconds))
        s = replace(
            s,
            backoff_seconds=backoff,
            backoff_until=ctx.now + backoff,
            backoff_voluntary_only=False,
            gate_open=True,
            gate_reason="open",
        )
        ctx.decide(
            s,
            DecisionKind.RESULT,
            f"{kind.value} failed ({outcome.detail}); next try in {backoff:.0f}s",
            action_id=action_id,
            action_kind=kind,
            ok=False,
        )
    return s


def describe_flags(flags: Sequence[tuple[str, str]], env: Sequence[tuple[str, str]]) -> str:
    parts = [f"{f} {v}".strip() for f, v in flags] + [f"{k}={v}" for k, v in env]
    return " ".join(parts)


def _track_process(s: ServiceState, snapshot: Snapshot, name: str, now: float) -> ServiceState:
    svc = snapshot.service(name)
    pid = svc.unit.main_pid if svc is not None and svc.unit is not None else None
    if s.watch_since is None:
        s = replace(s, watch_since=now)
    if pid is not None and pid != s.main_pid:
        s = replace(s, main_pid=pid, started_seconds=now)
    state = svc.health.state if svc is not None and svc.health is not None else None
    if state is HealthState.UP:
        if not s.seen_up or s.down_since is not None:
            s = replace(s, seen_up=True, down_since=None)
    elif state is not None and s.seen_up and s.down_since is None:
        s = replace(s, down_since=now)
    return s


def gate_dry_run(p: PolicyConfig) -> bool:
    return p.dry_run or "gate" in p.dry_run_actions


def _disrupting(s: ServiceState) -> bool:
    """An action of ours is under way past its wait for a fleet permit: it holds the front door
    and the failures seen may be its own doing."""
    return s.action is not None and s.action.phase is not phases.Phase.AWAITING_PERMIT


def _gate(ctx: _Ctx, s: ServiceState, sig: ServiceSignals | None) -> ServiceState:
    if _disrupting(s):
        return s  # the action holds the front door closed until it ends
    if not s.gate_open and s.gate_reason.startswith(FORECAST_GATE):
        return s  # held by the exhaustion forecast (_preempt opens it)
    p = ctx.settings.policy
    kv = sig.kv_cache_usage_ratio if sig is not None else None
    if kv is None:
        return s  # missing data holds the gate where it is
    if s.gate_open and kv >= p.kv_high_watermark_ratio:
        reason = f"KV cache usage {kv:.0%} at or above the high watermark {p.kv_high_watermark_ratio:.0%}"
        s = replace(s, gate_open=False, gate_reason=reason, gate_closed_at=ctx.now)
        ctx.decide(
            s,
            DecisionKind.GATE,
            reason,
            cause=Cause.CONCURRENCY_OVERCOMMIT,
            evidence=("kv_cache_usage_ratio",),
            dry_run=gate_dry_run(p),
        )
    elif (
        not s.gate_open
        and kv < p.kv_low_watermark_ratio
        and ctx.now - (s.gate_closed_at if s.gate_closed_at is not None else -math.inf)
        >= p.gate_min_closed_seconds
    ):
        reason = f"KV cache usage {kv:.0%} below the low watermark {p.kv_low_watermark_ratio:.0%}"
        s = replace(s, gate_open=True, gate_reason="open")
        ctx.decide(
            s,
            DecisionKind.UNGATE,
            reason,
            evidence=("kv_cache_usage_ratio",),
            dry_run=gate_dry_run(p),
        )
    return s


def _capture_baseline(
    s: ServiceState, sig: ServiceSignals | None, cmdline: Sequence[str] | None, gpu_total: int
) -> ServiceState:
    """Record the operator's baseline once, while the guardian owns no flag and vLLM is up
    (so its reported gpu_memory_utilization and the GPU's size are known, not guessed)."""
    if s.baseline is not None or s.rungs or sig is None or not gpu_total:
        return s
    if (
        sig.gpu_memory_utilization_ratio is None
        and parse_launch_flags(cmdline or ()).gpu_memory_utilization_ratio is None
    ):
        return s
    return replace(s, baseline=default_baseline(sig, cmdline, gpu_total))


def _instant(signal: str) -> bool:
    """Alerts on log events only make an event visible for a while; the policy reads the
    events themselves (once), so those alerts are not evidence again and again."""
    return signal.startswith("log_events.")


def _structure(
    s: ServiceState, sig: ServiceSignals | None, unit: UnitState | None, restarted: bool
) -> Structure:
    """This tick's structural view of the service. Nothing while an action of ours is under
    way: the failures it causes (the stop, the restart) agree with no log line. (An action
    waiting for a fleet permit has done nothing yet: what fails meanwhile is news.)"""
    if _disrupting(s):
        return Structure()
    return Structure(
        health=sig.health_state if sig is not None else None,
        unit_active_state=unit.active_state if unit is not None and unit.unit else None,
        process_restarted=restarted,
        stalled=bool(sig is not None and (sig.stalled or sig.input_hung)),
        reset_class_xid=sig is not None
        and any(x in RESET_CLASS_XIDS for _, x, _ in sig.recent_xid_events),
    )


def _remember(
    ctx: _Ctx, s: ServiceState, new: Sequence[Evidence], structure: Structure, p: PolicyConfig
) -> ServiceState:
    """Hold this tick's log evidence, and let the structural signals agree with what is held.

    A log item counts (``agreed``) once :func:`corroborated` keeps it: a structural failure seen
    within :data:`CORROBORATION_SECONDS` of the line, before it or after it."""
    now = ctx.now
    failing = structural_failures(structure)
    if failing:
        s = replace(s, structural=failing, structural_at=now)
    recent = (
        s.structural
        if s.structural_at is not None and now - s.structural_at <= CORROBORATION_SECONDS
        else ()
    )
    kept = tuple(x for x in s.log_items if now - x.seen_at <= p.pressure_window_seconds)
    held = []
    items = []
    for x in (*kept, *(LogItem(e.cause, e.name, e.sentence, now) for e in new)):
        if not x.agreed and now - x.seen_at <= CORROBORATION_SECONDS:
            if corroborated([x.evidence()], recent):
                x = replace(x, agreed=recent)
            elif x.seen_at == now:
                held.append(x.name)
        items.append(x)
    if held:
        ctx.decide(
            s,
            DecisionKind.SUPPRESSED,
            f"vLLM's log says {', '.join(sorted(set(held)))}, but /health, its processes and "
            "the GPUs show no failure: a log line alone is not acted on (a request's text can "
            f"reach the log); held {CORROBORATION_SECONDS:.0f} s for one to agree",
            withheld=Withheld.UNCORROBORATED_LOG,
        )
    pending = tuple(items)
    return s if pending == s.log_items else replace(s, log_items=pending)


def _filter_startup(
    s: ServiceState,
    sig: ServiceSignals | None,
    unit: UnitState | None,
    now: float,
    p: PolicyConfig,
    evidence: list[Evidence],
) -> list[Evidence]:
    """vLLM refuses connections for minutes while it loads: that is starting, not dead.

    The grace runs from the latest of: the guardian's first look (if vLLM was never seen up),
    a new main pid, and the moment vLLM went down (a supervisor with Restart=always brings it
    back). Log lines and an exited unit are never filtered.
    """
    refused = sig is None or sig.health_state in (HealthState.REFUSED, None)
    if not refused:
        return evidence
    starts = [t for t in (s.started_seconds, s.down_since) if t is not None]
    if not s.seen_up and s.watch_since is not None:
        starts.append(s.watch_since)
    activating = unit is not None and unit.active_state in ("activating", "reloading")
    starting = activating or (bool(starts) and now - max(starts) < p.startup_grace_seconds)
    if not starting:
        return evidence
    return [
        e
        for e in evidence
        if not (e.cause is Cause.ENGINE_DEAD and not e.name.startswith(("log:", "unit:")))
    ]


def _track_episodes(
    s: ServiceState, findings: Sequence[Finding], now: float, p: PolicyConfig
) -> ServiceState:
    """An episode begins when a cause's evidence appears; pressure that persists for a whole
    cooldown without relief (the gate did not help) counts as a further episode."""
    causes = tuple(sorted({f.cause for f in findings}))
    started = {c: max((t for cc, t in s.episodes if cc is c), default=None) for c in causes}
    new = [
        c
        for c in causes
        if c not in s.active_causes
        or (started[c] is not None and now - started[c] >= max(p.cooldown_seconds, 1.0))  # type: ignore[operator]
    ]
    episodes = tuple((c, t) for c, t in s.episodes if now - t <= p.pressure_window_seconds)
    episodes += tuple((c, now) for c in new)
    return replace(
        s,
        active_causes=causes,
        episodes=episodes,
        last_pressure_seconds=now if causes else s.last_pressure_seconds,
    )


def _track_running(
    s: ServiceState, sig: ServiceSignals | None, now: float, p: PolicyConfig
) -> ServiceState:
    """Keep vLLM's running count while KV thrash is active (within the pressure window)."""
    kept = tuple(x for x in s.running_samples if now - x[0] <= p.pressure_window_seconds)
    running = sig.requests_running if sig is not None else None
    if Cause.CONCURRENCY_OVERCOMMIT in s.active_causes and running is not None:
        kept = (*kept, (now, running))[-1024:]
    return s if kept == s.running_samples else replace(s, running_samples=kept)


def _concurrency_relaunch(
    s: ServiceState, sig: ServiceSignals | None, base: Baseline, p: PolicyConfig
) -> tuple[int, str] | str:
    """Whether KV thrash may relaunch with a lower --max-num-seqs: ``(rung, what held)``, or
    the reason it may not. Every condition is the measured one (docs/capacity.md): enabled by the
    operator; a cap at ≈ target × the median running count over the episodes; strictly under
    what the pool admits anyway (the peak running count seen); a recompute share above the
    threshold."""
    c = p.concurrency_relaunch
    head = "concurrency_overcommit: gated and alerted, no relaunch"
    if not c.enabled:
        return (
            f"{head}: KV thrash is a capacity problem (policy.concurrency_relaunch.enabled is "
            "false); add replicas or shed at the gate"
        )
    samples = [r for _, r in s.running_samples]
    if len(samples) < c.min_running_samples:
        return f"{head}: fewer than {c.min_running_samples} running-count samples under pressure"
    med = median(samples) or 0.0
    peak = max(samples)
    target = c.target_hosted_ratio * med
    picked = nearest_seqs_rung(target, peak, base, p)
    if picked is None:
        return (
            f"{head}: no --max-num-seqs rung within 15 % of {target:.0f} "
            f"({c.target_hosted_ratio:g}x the median running {med:.0f}) lies under the peak "
            f"{peak:.0f} the pool admits anyway; {LOW_CAP_COSTS}"
        )
    rung, value = picked
    share = None
    if sig is not None:
        tokens = [sig.prompt_tokens_per_second, sig.generation_tokens_per_second]
        sig_tokens = sum(t for t in tokens if t is not None) if any(tokens) else None
        ctx_tokens = mean_context_tokens(
            sig.kv_cache_usage_ratio, sig.kv_cache_capacity_tokens, sig.requests_running
        )
        share = recompute_share(sig.preemptions_per_second, ctx_tokens, sig_tokens)
    if share is None:
        return f"{head}: recompute share unknown (preemptions/s, KV pool size or tokens/s missing)"
    if share < c.min_recompute_share_ratio:
        # No figure in the text: a "nothing done" line is logged once per distinct reason.
        return (
            f"{head}: estimated recompute share below {c.min_recompute_share_ratio:g}; a "
            "restart costs more than recompute"
        )
    return rung, (
        f"cap {value} = {value / med if med else 0:.2f}x the median running {med:.0f} over "
        f"{len(samples)} samples, under the peak {peak:.0f} the pool admits; recompute share "
        f"{share:.2f} >= {c.min_recompute_share_ratio:g}"
    )


def _early_crash(s: ServiceState, top: Finding, now: float, p: PolicyConfig) -> bool:
    """The instance our last action made ready crashed within ``early_failure_seconds``.

    The cooldown keeps lagging counters from triggering a second action; a crash of the new
    instance is not one: an unambiguous log line (CUDA OOM, engine death, start-up refused for
    memory) read after it became ready, or its unit exited. Alerts do not count here: their
    ``for`` and ``keep_firing_for`` blur which instance they describe. Waiting out
    the cooldown would leave vLLM down while its supervisor restarts it with the same flags
    (measured: 64 of 1,866 requests timed out in the noisy_neighbour demo behind a 15 s
    cooldown; the shipped one is 600 s). So it is acted on at once; the early-failure limit
    latches the breaker when that does not help, and the restart budget still applies.
    """
    if s.ready_since is None or now - s.ready_since > p.early_failure_seconds:
        return False
    if not cause_spec(top.cause).crashes:
        return False
    ready = s.ready_since
    fresh = {x.name for x in s.log_items if x.seen_at > ready and x.agreed}
    return any(e.name in fresh or e.name == "unit:exited" for e in top.evidence)


def _crash(top: Finding) -> bool:
    return cause_spec(top.cause).crashes and any(e.unambiguous for e in top.evidence)


def _urgent(top: Finding) -> bool:
    """Acted on without a fleet permit: a crash or a dead engine (the replica is already down),
    or a cause that escalates (nothing is restarted)."""
    spec = cause_spec(top.cause)
    return _crash(top) or spec.already_down or spec.escalation is not None


def _held(s: ServiceState, top: Finding, now: float, p: PolicyConfig) -> bool:
    """The cooldown or the backoff holds ``top`` back (as :func:`_act` decides below)."""
    if cause_spec(top.cause).escalation is not None:
        return False
    if now < s.cooldown_until and not _early_crash(s, top, now, p):
        return True
    return now < s.backoff_until and not (s.backoff_voluntary_only and _urgent(top))


def _episodes(s: ServiceState, cause: Cause) -> int:
    return sum(1 for c, _ in s.episodes if c is cause)


def _act(
    ctx: _Ctx,
    s: ServiceState,
    findings: Sequence[Finding],
    sig: ServiceSignals | None,
    cmdline: Sequence[str] | None = None,
    gpu_total_bytes: int = 0,
) -> ServiceState:
    p = ctx.settings.policy
    now = ctx.now
    if s.breaker_latched:
        return ctx.note(
            s,
            Withheld.BREAKER_LATCHED,
            f"breaker latched ({s.breaker_reason}): waiting for `vllm-guardian resume`",
        )
    if _disrupting(s):
        return s
    top = next((f for f in findings if actionable(f)), None)
    if s.action is not None:
        # Waiting for a fleet permit (the replica still serves): only what cannot wait for a
        # permit (a crash: the replica is already down; a fault that escalates) ends the wait,
        # and only when it is to be acted on now.
        if top is None or not _urgent(top) or _held(s, top, now, p):
            return s
        s = _supersede(ctx, s, top)
    if top is None:
        if findings:
            return ctx.note(
                s,
                Withheld.EVIDENCE_SHORT,
                f"{findings[0].cause.value}: evidence not yet enough to act",
                findings[0],
            )
        return _maybe_step_up(ctx, s, sig)
    spec = cause_spec(top.cause)
    if spec.escalation is not None:
        reason = spec.escalation
        s = replace(s, breaker_latched=True, breaker_reason=reason)
        ctx.decide(
            s,
            DecisionKind.LATCH,
            reason,
            cause=top.cause,
            evidence=tuple(e.name for e in top.evidence),
        )
        return ctx.act(s, ActionKind.ESCALATE, top, reason)
    if now < s.cooldown_until and not _early_crash(s, top, now, p):
        return ctx.note(
            s,
            Withheld.COOLDOWN,
            f"{top.cause.value}: in cooldown until {s.cooldown_until:.0f} after the last action",
            top,
        )
    if now < s.backoff_until and not (s.backoff_voluntary_only and _urgent(top)):
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"{top.cause.value}: backing off after a failed action until {s.backoff_until:.0f}",
            top,
        )

    crash = _crash(top)
    lever = spec.lever
    episodes = _episodes(s, top.cause)
    needed = (
        p.pressure_events_to_relaunch if spec.episodes_to_step is None else spec.episodes_to_step
    )
    base = s.baseline or default_baseline(sig, cmdline, gpu_total_bytes)
    if s.baseline is None:
        s = replace(s, baseline=base)  # rungs are relative to it: stepping up must use the same
    step = lever is not None and can_step_down(lever, s.rung(lever), base, p)
    if spec.restart_first:
        # Drain + restart clears it (or is all there is); only a repeat earns the lever.
        step = step and episodes >= needed
    elif spec.pressure is Pressure.KV_CACHE:
        # KV pressure never crashes: the gate and the over-capacity alert handle it; a relaunch
        # only where the operator enabled it and every measured condition holds.
        seqs = _concurrency_relaunch(s, sig, base, p)
        if isinstance(seqs, str):
            return ctx.note(s, Withheld.GATED_ONLY, seqs, top)
        if seqs[0] <= s.rung(Lever.MAX_NUM_SEQS):
            return ctx.note(
                s,
                Withheld.AT_FLOOR,
                f"{top.cause.value}: gated and alerted, no relaunch: --max-num-seqs is "
                "already at or below 1.0x what the pool hosts",
                top,
            )
        if not (step and episodes >= needed):
            return ctx.note(
                s,
                Withheld.EPISODES,
                f"{top.cause.value}: gated; {episodes} episode(s) of {needed} before a relaunch",
                top,
            )
    elif not crash and not (step and episodes >= needed):
        return ctx.note(
            s,
            Withheld.EPISODES,
            f"{top.cause.value}: {episodes} episode(s) of {needed} before a relaunch",
            top,
        )

    # Guard rails before anything disruptive: the budget and repeated early failures.
    restarts = tuple(t for t in s.restarts if now - t < p.restart_budget_window_seconds)
    early = s.early_failures
    if s.ready_since is not None and crash:
        early = early + 1 if now - s.ready_since <= p.early_failure_seconds else 0
    s = replace(s, restarts=restarts, early_failures=early)
    if len(restarts) >= p.restart_budget:
        reason = f"restart budget spent: {len(restarts)} restarts in {p.restart_budget_window_seconds:.0f}s"
        s = replace(s, breaker_latched=True, breaker_reason=reason)
        ctx.decide(
            s,
            DecisionKind.LATCH,
            reason,
            cause=top.cause,
            evidence=tuple(e.name for e in top.evidence),
        )
        return ctx.act(s, ActionKind.ESCALATE, top, reason)
    if early >= p.early_failure_limit:
        reason = f"{early} failures within {p.early_failure_seconds:.0f}s of becoming ready: restarting does not help"
        s = replace(s, breaker_latched=True, breaker_reason=reason)
        ctx.decide(
            s,
            DecisionKind.LATCH,
            reason,
            cause=top.cause,
            evidence=tuple(e.name for e in top.evidence),
        )
        return ctx.act(s, ActionKind.ESCALATE, top, reason)

    s = replace(s, restarts=(*restarts, now), last_note="")
    levels = _levels(s)
    if lever is not None and step:
        before = s.rung(lever)
        rung = before + 1
        why = ""
        if lever is Lever.MAX_NUM_SEQS:
            seqs = _concurrency_relaunch(s, sig, base, p)
            if isinstance(seqs, tuple):
                rung, why = seqs[0], f" ({seqs[1]})"
        s = _set_rung(s, lever, rung)
        last_up = dict(s.last_step_up).get(lever)
        if last_up is not None and now - last_up <= p.pin_seconds:
            s = replace(s, pinned_until=_set(s.pinned_until, lever, now + p.pin_seconds))
        flags, env = _flags(s, base, p)
        value = lever_value(lever, rung, base, p)
        how = "one rung" if rung == before + 1 else f"{rung - before} rungs"
        reason = (
            f"{top.cause.value}: {lever.value} {how} down to {value} (rung {rung}){why}; "
            + top.evidence[0].sentence
        )
        return ctx.act(
            s, ActionKind.RELAUNCH, top, reason, flags, env, voluntary=not crash, before=levels
        )
    flags, env = _flags(s, base, p)
    reason = (
        f"{top.cause.value}: drain and restart with the same flags; " + top.evidence[0].sentence
    )
    voluntary = not crash and not spec.already_down
    return ctx.act(s, ActionKind.RESTART, top, reason, flags, env, voluntary=voluntary)


def _maybe_step_up(ctx: _Ctx, s: ServiceState, sig: ServiceSignals | None) -> ServiceState:
    p = ctx.settings.policy
    now = ctx.now
    base = s.baseline
    if not s.rungs or base is None:
        return s
    quiet_since = max(t for t in (s.last_pressure_seconds, s.ready_since, 0.0) if t is not None)
    if now - quiet_since < p.stable_for_seconds or now < s.cooldown_until:
        return s
    if now < s.backoff_until:  # after a failed step up (or a wait for a permit that gave none)
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"stable, but backing off after a failed action until {s.backoff_until:.0f}",
        )
    pinned = dict(s.pinned_until)
    candidates = [lv for lv, r in s.rungs if r > 0 and pinned.get(lv, -math.inf) <= now]
    if not candidates:
        return ctx.note(s, Withheld.PINNED, "stable, but every lowered lever is pinned")
    restarts = tuple(t for t in s.restarts if now - t < p.restart_budget_window_seconds)
    if len(restarts) >= p.restart_budget:
        return ctx.note(
            s,
            Withheld.BUDGET_SPENT,
            "stable, but stepping up needs a restart and the budget is spent",
        )
    lever = candidates[0]
    rung = s.rung(lever) - 1
    levels = _levels(s)
    s = _set_rung(s, lever, rung)
    s = replace(
        s, last_step_up=_set(s.last_step_up, lever, now), restarts=(*restarts, now), last_note=""
    )
    flags, env = _flags(s, base, p)
    value = lever_value(lever, rung, base, p) or "the operator's baseline"
    reason = f"stable for {now - quiet_since:.0f}s: {lever.value} one rung up to {value}"
    ctx.decide(s, DecisionKind.STEP_UP, reason)
    return ctx.act(s, ActionKind.RELAUNCH, None, reason, flags, env, voluntary=True, before=levels)


def published_signals(
    state: PolicyState, now: float, p: PolicyConfig
) -> dict[tuple[str, str], float | None]:
    """The policy's own figures, as signals the next tick's alert rules can read."""
    out: dict[tuple[str, str], float | None] = {}
    for s in state.services:
        recent = [t for t in s.restarts if now - t < p.restart_budget_window_seconds]
        out[(s.service, "policy.restart_budget_remaining")] = float(
            max(0, p.restart_budget - len(recent))
        )
        out[(s.service, "policy.breaker_latched")] = 1.0 if s.breaker_latched else 0.0
        out[(s.service, "policy.paused")] = 1.0 if s.paused else 0.0
    return out


# --- operator control (the control socket) ---------------------------------------------------


def pause(
    state: PolicyState, service: str | None, now: float
) -> tuple[PolicyState, tuple[Decision, ...]]:
    return _set_paused(state, service, True, now)


def resume(
    state: PolicyState, service: str | None, now: float
) -> tuple[PolicyState, tuple[Decision, ...]]:
    """Unpause and clear a latched breaker: the one way a person says 'go on'."""
    new, decisions = _set_paused(state, service, False, now)
    out = []
    for s in new.services:
        if service in (None, s.service) and s.breaker_latched:
            decisions += (
                Decision(
                    now,
                    s.service,
                    DecisionKind.RESUME,
                    f"breaker cleared by an operator (was: {s.breaker_reason})",
                ),
            )
            s = replace(
                s,
                breaker_latched=False,
                breaker_reason=None,
                early_failures=0,
                restarts=(),
                last_note="",
            )
        out.append(s)
    return replace(new, services=tuple(out)), decisions


def _set_paused(
    state: PolicyState, service: str | None, paused: bool, now: float
) -> tuple[PolicyState, tuple[Decision, ...]]:
    out = []
    decisions: list[Decision] = []
    for s in state.services:
        if service in (None, s.service) and s.paused != paused:
            s = replace(s, paused=paused, last_note="")
            decisions.append(
                Decision(
                    now,
                    s.service,
                    DecisionKind.PAUSE if paused else DecisionKind.RESUME,
                    "maintenance: observe and alert only" if paused else "acting again",
                )
            )
        out.append(s)
    return replace(state, services=tuple(out)), tuple(decisions)


def initial_state(
    services: Sequence[str], previous: PolicyState | None = None, restarted: bool = True
) -> PolicyState:
    """State for these services, keeping what a previous run knew. An action that was under
    way is kept, marked orphaned: the next tick finds out what became of it (core/phases.py)
    instead of deciding it again, and it has already counted against the budget."""
    prev = previous or PolicyState()
    out = []
    for name in services:
        s = prev.service(name)
        if s.action is not None and previous is not None and restarted:
            s = replace(s, action=replace(s.action, orphaned=True))
        out.append(s)
    return PolicyState(tuple(out), prev.next_action_id)


_K = TypeVar("_K")


class _Bounded:
    """Bounds the times of a saved state against this guardian's clock, noting what moved."""

    def __init__(self, now: float, service: str) -> None:
        self.now = now
        self.service = service
        self.notes: list[str] = []

    def at_most(self, what: str, t: float, seconds: float = 0.0) -> float:
        """``t``, or now + ``seconds`` when it lies past that."""
        limit = self.now + seconds
        if t <= limit:
            return t
        self.notes.append(f"{self.service}: {what} {t - self.now:.0f}s ahead, now {seconds:.0f}s")
        return limit

    def maybe(self, what: str, t: float | None) -> float | None:
        return None if t is None else self.at_most(what, t)

    def keyed(
        self, what: str, pairs: tuple[tuple[_K, float], ...], seconds: float = 0.0
    ) -> tuple[tuple[_K, float], ...]:
        return tuple((k, self.at_most(f"{what}[{k}]", t, seconds)) for k, t in pairs)


def bound_saved_times(
    state: PolicyState, now: float, settings: PolicySettings
) -> tuple[PolicyState, tuple[str, ...]]:
    """A saved state read by a guardian whose clock reads ``now``: every deadline bounded by
    now plus the configured duration that set it, and the time of everything that already
    happened by now. A state saved while the clock ran ahead (a day, until NTP stepped it back)
    would otherwise hold the cooldown, the backoff and the pins for that long beyond their
    durations, and count its restarts and episodes for that much longer. Returns the state
    and one note per time that moved (none for a state saved on a sound clock)."""
    p = settings.policy
    notes: list[str] = []
    out: list[ServiceState] = []
    for s in state.services:
        b = _Bounded(now, s.service)
        backoff = min(max(s.backoff_seconds, 0.0), p.backoff_max_seconds)
        action = s.action
        if action is not None:
            limit = phases.phase_limit_seconds(action.phase, p, settings.permit_timeout_seconds)
            action = replace(
                action,
                phase_since=b.at_most("action.phase_since", action.phase_since),
                deadline=b.at_most(f"action.deadline ({action.phase})", action.deadline, limit),
                started_seconds=b.at_most("action.started_seconds", action.started_seconds),
                ready_after=b.at_most("action.ready_after", action.ready_after),
                stopped_seconds=b.maybe("action.stopped_seconds", action.stopped_seconds),
                permit_retry_at=b.at_most(
                    "action.permit_retry_at", action.permit_retry_at, phases.PERMIT_RETRY_SECONDS
                ),
                permit_renew_at=None
                if action.permit_renew_at is None
                else b.at_most(
                    "action.permit_renew_at",
                    action.permit_renew_at,
                    settings.permit_renew_seconds or 0.0,
                ),
            )
        levels = s.levels_before
        if levels is not None:
            levels = replace(
                levels,
                last_step_up=b.keyed("levels_before.last_step_up", levels.last_step_up),
                pinned_until=b.keyed(
                    "levels_before.pinned_until", levels.pinned_until, p.pin_seconds
                ),
            )
        out.append(
            replace(
                s,
                action=action,
                levels_before=levels,
                gate_closed_at=b.maybe("gate_closed_at", s.gate_closed_at),
                cooldown_until=b.at_most("cooldown_until", s.cooldown_until, p.cooldown_seconds),
                backoff_until=b.at_most("backoff_until", s.backoff_until, backoff),
                backoff_seconds=backoff,
                restarts=tuple(b.at_most("restarts", t) for t in s.restarts),
                ready_since=b.maybe("ready_since", s.ready_since),
                started_seconds=b.maybe("started_seconds", s.started_seconds),
                last_step_up=b.keyed("last_step_up", s.last_step_up),
                pinned_until=b.keyed("pinned_until", s.pinned_until, p.pin_seconds),
                episodes=b.keyed("episodes", s.episodes),
                last_pressure_seconds=b.maybe("last_pressure_seconds", s.last_pressure_seconds),
                log_items=tuple(
                    replace(x, seen_at=b.at_most(f"log_items[{x.name}]", x.seen_at))
                    for x in s.log_items
                ),
                watch_since=b.maybe("watch_since", s.watch_since),
                forecast_since=b.maybe("forecast_since", s.forecast_since),
                forecast_actions=b.keyed("forecast_actions", s.forecast_actions),
                down_since=b.maybe("down_since", s.down_since),
                running_samples=tuple(
                    (b.at_most("running_samples", t), n) for t, n in s.running_samples
                ),
            )
        )
        notes.extend(b.notes)
    return replace(state, services=tuple(out)), tuple(notes)


# --- operator commands: restart and relaunch through the same phases --------------------------


def operator_action(
    state: PolicyState,
    service: str,
    kind: ActionKind,
    sets: Sequence[tuple[str, str]],
    reset: bool,
    who: str,
    force: bool,
    now: float,
    settings: PolicySettings,
) -> PolicyOutput:
    """`vllm-guardian restart|relaunch SERVICE`: the same drain and phases as the policy's own
    actions, acting although the policy is in dry-run (the operator asked explicitly), refused
    while another action runs, and while the breaker is latched unless ``force``. ``sets`` are
    whitelisted flags (the shell validated them); a lever flag also becomes that lever's
    baseline, so the policy's later rungs count down from the operator's value."""
    ctx = _Ctx(state, now, settings)
    s = state.service(service)
    p = settings.policy
    refusal = None
    if s.action is not None:
        refusal = (
            f"action {s.action.action_id} ({s.action.kind.value}) is under way, in "
            f"{s.action.phase.value}: wait for it to end"
        )
    elif s.breaker_latched and not force:
        refusal = f"the breaker is latched ({s.breaker_reason}): `resume` first, or --force"
    if refusal is not None:
        ctx.decide(s, DecisionKind.OPERATOR, f"{kind.value} asked by {who} refused: {refusal}")
        return PolicyOutput(state, (), tuple(ctx.decisions))
    levels = _levels(s)
    if reset:
        s = replace(s, operator_flags=(), rungs=(), pinned_until=(), baseline=None)
    if sets:
        by_flag = dict(s.operator_flags)
        by_flag.update(sets)
        s = replace(s, operator_flags=tuple(sorted(by_flag.items())))
        for flag, value in sets:
            lever = lever_of_flag(flag)
            if lever is None:
                continue
            s = _set_rung(s, lever, 0)
            b = s.baseline
            spec = lever_spec(lever)
            if b is None or spec.baseline_field is None:
                continue  # captured from the running command line once vLLM is back
            s = replace(s, baseline=spec.rebased(b, value))
    if s.breaker_latched and force:
        ctx.decide(
            s, DecisionKind.OPERATOR, f"--force by {who}: acting although the breaker is latched"
        )
    flags, env = _flags(s, s.baseline, p) if s.baseline is not None else (s.operator_flags, ())
    what = (
        "reset to the operator's base flags"
        if reset
        else ("with " + describe_flags(sets, ()) if sets else "with the current flags")
    )
    reason = f"operator {kind.value} {what}"
    # Not counted against the restart budget: the budget stops the guardian from restart-looping
    # on its own; a person's explicit restarts are theirs to make (and audited).
    s = replace(s, last_note="")
    # An operator's restart is a voluntary disruption too: in a fleet it waits for a permit,
    # as `kubectl drain` waits for the PodDisruptionBudget.
    s = ctx.act(s, kind, None, reason, flags, env, operator=who, voluntary=True, before=levels)
    services = tuple(s if x.service == service else x for x in state.services)
    return PolicyOutput(
        PolicyState(services, ctx.next_id), tuple(ctx.actions), tuple(ctx.decisions),
        tuple(ctx.ops), tuple(ctx.results),
    )  # fmt: skip


# --- acting before the crash: the exhaustion forecast ------------------------------------------
#
# A separate stage of decide(): it runs only when the ladder above took no action this tick, and
# every action it takes goes through the same guard rails (cooldown, backoff, restart budget,
# dry-run, the audit with the forecast that triggered it).

FORECAST_GATE = "forecast:"  # gate_reason prefix of a gate the exhaustion forecast holds


@dataclass(frozen=True)
class PreemptiveAction:
    """What the policy intends about an exhaustion forecast, and why (pure data, audited)."""

    cause: Cause
    reason: str  # quotes the forecast
    kind: ActionKind | None = None  # RESTART or RELAUNCH; None: gate and/or wait only
    lever: Lever | None = None  # for RELAUNCH
    rungs: int = 0  # how many rungs down the lever goes
    gate: bool = False  # close the front door to new work while the forecast stands
    critical: bool = False  # page: nothing vLLM does frees what another process takes
    wait: bool = False  # planned: waiting for a quiet moment inside the horizon


def urgent_forecast(sig: ServiceSignals | None, p: PolicyConfig) -> Forecast | None:
    """The most urgent forecast that names a cause and whose bound is within the horizon."""
    if sig is None:
        return None
    named = [
        f
        for f in sig.forecasts
        if f.cause is not None and f.seconds_latest <= p.forecast_horizon_seconds
    ]
    return min(named, key=lambda f: f.seconds, default=None)


def _utilization_rungs(
    f: Forecast, base: Baseline, rung: int, total_bytes: int, p: PolicyConfig
) -> int:
    """Rungs down --gpu-memory-utilization so that the trend, continued over the horizon,
    stays clear of the card's end; never below the floor (at least one rung)."""
    need = max(0.0, -f.slope_bytes_per_second * p.forecast_horizon_seconds - f.floor_bytes)
    step = p.gpu_memory_utilization_step_ratio * total_bytes
    wanted = max(1, math.ceil(need / step)) if step > 0 else 1
    n = 0
    while n < wanted and can_step_down(Lever.GPU_MEMORY_UTILIZATION, rung + n, base, p):
        n += 1
    return n


def preemptive_action(
    sig: ServiceSignals | None,
    s: ServiceState,
    now: float,
    p: PolicyConfig,
    base: Baseline | None,
    gpu_total_bytes: int = 0,
) -> PreemptiveAction | None:
    """The action an exhaustion forecast calls for, before the crash (None: nothing to do).

    Only a forecast whose bound (the latest the card is expected to run out) is within
    ``policy.forecast_horizon_seconds`` and that names a cause is acted on; without a cause
    the forecast alerts only (the shipped rule does that).

    * ``allocator_fragmentation``: drain and restart at the next quiet moment inside the
      horizon (the queue empty, at most ``preemptive_quiet_running`` in flight), or at once
      when the time left is no more than two drain timeouts (a drain and a restart must fit);
      when it comes back within ``pressure_window_seconds`` of the last one, relaunch with
      ``expandable_segments:True`` instead (the creep itself slows down).
    * ``gpu_memory_overcommit``: the neighbour alert pages with its pid, command and cgroup;
      once the forecast has stood ``neighbour_persist_seconds``, or at once when the card runs
      out before that wait would end, relaunch with a lower ``--gpu-memory-utilization``
      (enough rungs for the trend over the horizon). The front door stays open until then:
      holding requests frees nothing another process takes, and a hold for the whole wait plus
      the relaunch outlasts what a held request may wait (measured: 158 of 985 requests got
      503 in the outcome bench's noisy_neighbour). At the floor: page only.
    * ``prefill_burst``: relaunch one rung down on ``--max-num-batched-tokens``.

    Budget, cooldown and backoff are checked by the caller (:func:`_preempt`), like every rung;
    the one exception: a forecast whose bound comes before the cooldown ends is acted on (the
    forecast reads only the current process, so it cannot be a lagging counter).
    """
    f = urgent_forecast(sig, p)
    if f is None or f.cause is None or sig is None:
        return None
    what = f.describe()
    if f.cause is Cause.ALLOCATOR_FRAGMENTATION:
        waiting = sig.requests_waiting
        running = sig.requests_running
        quiet = waiting == 0 and running is not None and running <= p.preemptive_quiet_running
        urgent = f.seconds <= 2 * p.drain_timeout_seconds
        if quiet or urgent:
            when = "a quiet moment" if quiet else "no time left to wait for a quiet moment"
            last = max((t for c, t in s.forecast_actions if c is f.cause), default=None)
            rung = s.rung(Lever.EXPANDABLE_SEGMENTS)
            if (
                last is not None
                and now - last <= p.pressure_window_seconds
                and base is not None
                and can_step_down(Lever.EXPANDABLE_SEGMENTS, rung, base, p)
            ):
                # A drain and restart cleared it and it came back: slow the creep itself.
                return PreemptiveAction(
                    f.cause,
                    f"fragmentation is back {now - last:.0f}s after the last drain: relaunch "
                    f"with expandable_segments:True in PYTORCH_ALLOC_CONF and "
                    f"PYTORCH_CUDA_ALLOC_CONF ({when}); {what}",
                    ActionKind.RELAUNCH,
                    Lever.EXPANDABLE_SEGMENTS,
                    1,
                )
            return PreemptiveAction(
                f.cause, f"drain and restart before the OOM ({when}); {what}", ActionKind.RESTART
            )
        return PreemptiveAction(
            f.cause,
            f"drain and restart planned at the next quiet moment (waiting {waiting}, running "
            f"{running}); {what}",
            wait=True,
        )
    if f.cause is Cause.GPU_MEMORY_OVERCOMMIT:
        n = f.neighbour
        who = (
            f"pid {n.pid} ({n.name or 'command unknown'}, cgroup {n.cgroup or 'unknown'})"
            if n is not None
            else "an unidentified process"
        )
        since = s.forecast_since if s.forecast_since is not None else now
        waited = now - since
        persistent = waited >= p.neighbour_persist_seconds
        # The card runs out before the persistence wait would end: waiting means the OOM.
        sooner = f.seconds <= p.neighbour_persist_seconds - waited
        if (persistent or sooner) and base is not None and gpu_total_bytes > 0:
            rung = s.rung(Lever.GPU_MEMORY_UTILIZATION)
            k = _utilization_rungs(f, base, rung, gpu_total_bytes, p)
            if k > 0:
                value = lever_value(Lever.GPU_MEMORY_UTILIZATION, rung + k, base, p)
                why = (
                    f"keeps growing on the GPU for {waited:.0f}s"
                    if persistent
                    else f"exhausts the GPU in ~{f.seconds:.0f}s, before it has grown for "
                    f"{p.neighbour_persist_seconds:.0f}s"
                )
                return PreemptiveAction(
                    f.cause,
                    f"{who} {why}: relaunch with --gpu-memory-utilization {value} "
                    f"({k} rung(s)); {what}",
                    ActionKind.RELAUNCH,
                    Lever.GPU_MEMORY_UTILIZATION,
                    k,
                    gate=True,
                    critical=True,
                )
            return PreemptiveAction(
                f.cause,
                f"{who} is growing on the GPU and --gpu-memory-utilization is at its floor: "
                f"page only, the front door stays open; {what}",
                wait=True,
            )
        return PreemptiveAction(
            f.cause,
            f"{who} is growing on the GPU: page; the front door stays open until a relaunch "
            f"(after {p.neighbour_persist_seconds:.0f}s of growth, or sooner if the GPU runs "
            f"out first); {what}",
            wait=True,
        )
    if f.cause is Cause.PREFILL_BURST:
        rung = s.rung(Lever.MAX_NUM_BATCHED_TOKENS)
        if base is not None and can_step_down(Lever.MAX_NUM_BATCHED_TOKENS, rung, base, p):
            value = lever_value(Lever.MAX_NUM_BATCHED_TOKENS, rung + 1, base, p)
            return PreemptiveAction(
                f.cause,
                f"relaunch with --max-num-batched-tokens {value} before the OOM; {what}",
                ActionKind.RELAUNCH,
                Lever.MAX_NUM_BATCHED_TOKENS,
                1,
            )
        return PreemptiveAction(
            f.cause, f"--max-num-batched-tokens is at its floor: alert only; {what}", wait=True
        )
    return None


def _preempt(
    ctx: _Ctx,
    s: ServiceState,
    sig: ServiceSignals | None,
    cmdline: Sequence[str] | None,
    gpu_total: int,
) -> ServiceState:
    """Apply :func:`preemptive_action` on the ladder's guard rails (see its docstring)."""
    p = ctx.settings.policy
    now = ctx.now
    f = urgent_forecast(sig, p)
    since = s.forecast_since if f is not None and s.forecast_since is not None else None
    s = replace(s, forecast_since=since if since is not None else (now if f else None))
    if s.breaker_latched or s.in_flight is not None:
        return s
    base = s.baseline or (default_baseline(sig, cmdline, gpu_total) if sig is not None else None)
    plan = preemptive_action(sig, s, now, p, base, gpu_total)
    if plan is None:
        if not s.gate_open and s.gate_reason.startswith(FORECAST_GATE):
            s = replace(s, gate_open=True, gate_reason="open")
            ctx.decide(
                s, DecisionKind.UNGATE, "the exhaustion forecast cleared", dry_run=gate_dry_run(p)
            )
        return s
    finding = Finding(
        plan.cause, 1.0, (Evidence(plan.cause, "forecast:" + plan.cause.value, plan.reason),)
    )
    if plan.gate and s.gate_open:
        reason = f"{FORECAST_GATE} {plan.reason}"
        s = replace(s, gate_open=False, gate_reason=reason, gate_closed_at=now)
        ctx.decide(
            s,
            DecisionKind.GATE,
            ("CRITICAL: " if plan.critical else "") + reason,
            cause=plan.cause,
            evidence=("forecast",),
            dry_run=gate_dry_run(p),
        )
    if plan.kind is None:
        return ctx.note(s, Withheld.FORECAST_WAIT, f"{plan.cause.value}: {plan.reason}", finding)
    assert f is not None  # a plan comes from a forecast
    # The cooldown keeps lagging counters from triggering a second action; the forecast cannot
    # lag (it reads only the current process), so when even its bound comes before the cooldown
    # ends, waiting means the OOM: act, still within the budget.
    if now < s.cooldown_until and f.seconds_latest >= s.cooldown_until - now:
        return ctx.note(
            s,
            Withheld.COOLDOWN,
            f"{plan.cause.value}: forecast, in cooldown until {s.cooldown_until:.0f}",
            finding,
        )
    if now < s.backoff_until:
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"{plan.cause.value}: forecast, backing off until {s.backoff_until:.0f}",
            finding,
        )
    restarts = tuple(t for t in s.restarts if now - t < p.restart_budget_window_seconds)
    if len(restarts) >= p.restart_budget:
        # A forecast is not a crash: no latch, the alerts stand and the ladder acts on an OOM.
        return ctx.note(
            s,
            Withheld.BUDGET_SPENT,
            f"{plan.cause.value}: forecast, but the restart budget is spent: alert only",
            finding,
        )
    if s.baseline is None and base is not None:
        s = replace(s, baseline=base)
    s = replace(
        s,
        restarts=(*restarts, now),
        last_note="",
        forecast_actions=(
            *(x for x in s.forecast_actions if now - x[1] <= p.pressure_window_seconds),
            (plan.cause, now),
        ),
    )
    if plan.kind is ActionKind.RELAUNCH and plan.lever is not None and base is not None:
        s = _set_rung(s, plan.lever, s.rung(plan.lever) + plan.rungs)
    flags, env = _flags(s, base, p) if base is not None else (s.operator_flags, ())
    return ctx.act(s, plan.kind, finding, "pre-emptive: " + plan.reason, flags, env)
