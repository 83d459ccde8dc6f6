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

Where each part lives (this module keeps ``decide`` and re-exports the public names):

* ``core/policy_state.py``: the records (``ServiceState``, ``Decision``, ``PolicyOutput``, ...);
* ``core/tracking.py``: what one tick shows, kept in the state (process, evidence, episodes)
  and the front door under KV pressure;
* ``core/ladder.py``: the ladder on findings (restart, relaunch one rung down, step up);
* ``core/breaker.py``: the restart budget and the latch, shared by every rung;
* ``core/preemptive.py``: acting before the crash on the exhaustion forecast;
* ``core/acting.py``: starting an action, moving it through its phases, ending it;
* ``core/rungs.py``: the flags each lever's rung stands for;
* ``core/operator_commands.py``: pause, resume, and an operator's restart or relaunch;
* ``core/saved_state.py``: the state a restarted guardian starts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.core import phases
from vllm_guardian.core.acting import Ctx, advance_action, disrupting, gate_dry_run, seen
from vllm_guardian.core.breaker import published_signals
from vllm_guardian.core.diagnosis import (
    Evidence,
    evidence_from_alerts,
    evidence_from_logs,
    rank,
)
from vllm_guardian.core.ladder import act_on_findings
from vllm_guardian.core.levers import Baseline, Lever
from vllm_guardian.core.operator_commands import operator_action, pause, resume
from vllm_guardian.core.policy_state import (
    Decision,
    DecisionKind,
    FrontDoor,
    FrontDoorHolder,
    HoldOff,
    Levels,
    LogItem,
    PolicyOutput,
    PolicySettings,
    PolicyState,
    ServiceState,
    Withheld,
    commands_of,
)
from vllm_guardian.core.preemptive import (
    PreemptiveAction,
    preempt,
    preemptive_action,
    urgent_forecast,
)
from vllm_guardian.core.rungs import (
    can_step_down,
    default_baseline,
    describe_flags,
    flags_for,
    lever_value,
    nearest_seqs_rung,
)
from vllm_guardian.core.saved_state import bound_saved_times, initial_state
from vllm_guardian.core.signals import ServiceSignals, Signals
from vllm_guardian.core.tracking import (
    capture_baseline,
    filter_startup,
    gate_on_kv,
    instant_signal,
    remember,
    structure_of,
    track_episodes,
    track_process,
    track_running,
)
from vllm_guardian.model import Alert, Cause, ServiceSnapshot, Snapshot, UnitState

__all__ = [
    "Baseline",
    "Decision",
    "DecisionKind",
    "FrontDoor",
    "FrontDoorHolder",
    "HoldOff",
    "Levels",
    "Lever",
    "LogItem",
    "PolicyOutput",
    "PolicySettings",
    "PolicyState",
    "PreemptiveAction",
    "ServiceState",
    "Withheld",
    "bound_saved_times",
    "can_step_down",
    "commands_of",
    "decide",
    "default_baseline",
    "describe_flags",
    "flags_for",
    "gate_dry_run",
    "initial_state",
    "lever_value",
    "nearest_seqs_rung",
    "operator_action",
    "pause",
    "preemptive_action",
    "published_signals",
    "resume",
    "seen",
    "urgent_forecast",
]


def decide(
    state: PolicyState,
    alerts: Sequence[Alert],
    snapshot: Snapshot,
    signals: Signals,
    now: float,
    settings: PolicySettings,
) -> PolicyOutput:
    """One tick of the policy, service by service: the next state, the actions to start, the
    decisions to audit (after alert evaluation, before the actuators)."""
    ctx = Ctx(state, now, settings)
    out = [
        _decide_service(ctx, state.service(name), alerts, snapshot, signals.service(name))
        for name in settings.services
    ]
    return PolicyOutput(
        PolicyState(tuple(out), ctx.next_id),
        tuple(ctx.actions),
        tuple(ctx.decisions),
        tuple(ctx.ops),
        tuple(ctx.results),
    )


def _decide_service(
    ctx: Ctx,
    s: ServiceState,
    alerts: Sequence[Alert],
    snapshot: Snapshot,
    sig: ServiceSignals | None,
) -> ServiceState:
    """One service's tick, in order: track the process, move the action under way on, the
    front door on KV pressure, the evidence, the ladder, and (when the ladder took no action)
    the exhaustion forecast."""
    name, now, settings = s.service, ctx.now, ctx.settings
    pid_before = s.main_pid
    s = track_process(s, snapshot, name, now)
    restarted = pid_before is not None and s.main_pid != pid_before
    s = advance_action(ctx, s, snapshot, sig)
    if s.paused:
        if s.front_door.open:
            return s
        return replace(s, front_door=s.front_door.opened("paused: gate held open"))
    s = gate_on_kv(ctx, s, sig)
    svc_snap = snapshot.service(name)
    unit = svc_snap.unit if svc_snap is not None else None
    instant = _instant_evidence(s, svc_snap, sig)
    s = remember(ctx, s, instant, structure_of(s, sig, unit, restarted), settings.policy)
    continuous = _continuous_evidence(s, alerts, unit, settings)
    pending = [x.evidence() for x in s.log_items if x.agreed]
    evidence = filter_startup(s, sig, unit, now, settings.policy, continuous + pending)
    findings = rank(evidence)
    s = track_episodes(s, findings, now, settings.policy)
    s = track_running(s, sig, now, settings.policy)
    cmdline = settings.commands.get(name) or (unit.cmdline if unit is not None else None)
    gpu_total = (
        max((d.memory_total_bytes or 0 for d in snapshot.gpus.devices), default=0)
        if snapshot.gpus
        else 0
    )
    s = capture_baseline(s, sig, cmdline, gpu_total)
    acted = len(ctx.actions)
    s = act_on_findings(ctx, s, findings, sig, cmdline, gpu_total)
    if len(ctx.actions) == acted:
        s = preempt(ctx, s, sig, cmdline, gpu_total)
    return s


def _instant_evidence(
    s: ServiceState, svc_snap: ServiceSnapshot | None, sig: ServiceSignals | None
) -> list[Evidence]:
    """This tick's log lines as evidence, less what our own action under way explains."""
    logs = svc_snap.logs.recent if svc_snap is not None and svc_snap.logs is not None else ()
    # Instant evidence (log lines) is kept until an action consumes it or it ages out, so
    # an OOM seen during a cooldown still counts once the cooldown ends.
    instant = evidence_from_logs(logs, sig)
    if s.action is not None and disrupting(s):
        # Our own restart makes vLLM log its engine's death: that is not a new incident.
        # Nor is the instance being replaced dying, before our restart, of the cause the
        # action handles (a pre-emptive relaunch's forecast coming true during its drain):
        # remembered, it restarted the healthy new instance after the cooldown.
        replaced = s.action.cause if s.action.phase in phases.BEFORE_RESTART else None
        instant = [e for e in instant if e.cause not in (Cause.ENGINE_DEAD, replaced)]
    return instant


def _continuous_evidence(
    s: ServiceState, alerts: Sequence[Alert], unit: UnitState | None, settings: PolicySettings
) -> list[Evidence]:
    """The firing alerts of this service that describe the running instance, and an exited
    unit that systemd does not restart."""
    continuous = evidence_from_alerts(
        [
            a
            for a in alerts
            if a.service == s.service
            and not instant_signal(settings.rule_signals.get(a.name, ""))
            # An alert held firing (keep_firing_for) whose condition was last true before
            # our last action made vLLM ready again describes the instance we replaced.
            and not (s.ready_since is not None and a.last_true_seconds < s.ready_since)
        ],
        settings.rule_signals,
    )
    if unit is not None and unit.unit is not None and unit.active_state in ("inactive", "failed"):
        continuous.append(
            Evidence(Cause.ENGINE_DEAD, "unit:exited",
                     f"{unit.unit} is {unit.active_state} (result {unit.result}, status {unit.exec_main_status}) "
                     "and systemd is not restarting it", unambiguous=True)
        )  # fmt: skip
    return continuous
