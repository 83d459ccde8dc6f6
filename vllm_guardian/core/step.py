"""One tick's whole decision: ``step(state, history, now, settings) → (state, effects)``. Pure.

Where it sits: between collecting and acting. Every runner of the tick (the daemon, ``replay``,
the virtual-time harness, the inhibition tests, ``bench/forecast.py``) hands its snapshots to
one ``core/driver.Driver``, which keeps the history window and calls :func:`step`. In order:

1. derive the signals from the history window (``core/signals.py``);
2. evaluate the alert rules (``core/alerting.py``) with the policy's own figures of the previous
   tick (budget left, breaker) as extra signals;
3. decide (``core/policy.py``): gate changes, new actions, the phases of the action under way
   (``core/phases.py``); the policy reads every alert, inhibited or not;
4. inhibit (``core/inhibition.py``): the vLLM-down alerts of a service the guardian itself keeps
   down (its restart under way, the first start its process backend made) are marked, and their
   transitions held back from the sinks;
5. say what ``/ready/<service>`` answers.

Everything the shell must do comes back as :class:`Effects`: alert transitions to deliver
(queued, never waited on) and those held back, blocking actuator calls to start, escalations to page, decisions to
audit, results to count, readiness to publish. The shell applies them in one place
(``healing.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import alert_rules, alerting, inhibition, policy
from vllm_guardian.core.signals import Signals, derive
from vllm_guardian.model import (
    Action,
    ActionKind,
    ActionResult,
    Alert,
    CommandKind,
    GateState,
    HealthState,
    OperatorCommand,
    OpRequest,
    Snapshot,
)


@dataclass(frozen=True)
class TickState:
    """What one tick hands to the next: the policy's state and the alert table, and what the
    inhibition remembers of this guardian run (none of it is persisted: a new run starts over)."""

    policy: policy.PolicyState
    alerts: Mapping[alerting.AlertKey, Alert] = field(default_factory=lambda: MappingProxyType({}))
    run_since_seconds: float | None = None  # this run's first tick
    served: frozenset[str] = frozenset()  # services whose vLLM answered 200 during this run
    settled: frozenset[alerting.AlertKey] = frozenset()  # inhibited alerts left to resolve quietly


@dataclass(frozen=True)
class StepSettings:
    rules: tuple[alert_rules.Rule, ...]
    policy: policy.PolicySettings
    services: tuple[ServiceConfig, ...]
    signals: SignalsConfig


@dataclass(frozen=True)
class Effects:
    signals: Signals
    transitions: tuple[alerting.Transition, ...]  # alert changes to deliver to the sinks
    alerts: tuple[Alert, ...]  # pending and firing, sorted (inhibited_by set where held)
    actions: tuple[Action, ...]  # actions started this tick (escalations: page a person)
    ops: tuple[OpRequest, ...]  # blocking actuator calls to start
    decisions: tuple[policy.Decision, ...]  # for the audit log and the flight record
    results: tuple[ActionResult, ...]  # actions that ended this tick
    gates: tuple[tuple[str, GateState], ...]  # what /ready/<service> answers
    # Alert changes held back from the sinks (each alert's inhibited_by says why).
    inhibited: tuple[alerting.Transition, ...] = ()
    # Firing alerts the sinks may announce and re-send: the firing ``alerts`` less the inhibited.
    notifying: tuple[Alert, ...] = ()
    # Services whose vLLM is down because of the guardian (core/inhibition.py), by service.
    windows: tuple[inhibition.Window, ...] = ()


def settings_for(
    rules: Sequence[alert_rules.Rule],
    policy_settings: policy.PolicySettings,
    services: Sequence[ServiceConfig],
    signals: SignalsConfig,
) -> StepSettings:
    return StepSettings(tuple(rules), policy_settings, tuple(services), signals)


def initial(services: Sequence[str], previous: policy.PolicyState | None = None) -> TickState:
    return TickState(policy.initial_state(services, previous))


def step(
    state: TickState, history: Sequence[Snapshot], now: float, settings: StepSettings
) -> tuple[TickState, Effects]:
    snapshot = history[-1]
    signals = derive(history, settings.services, settings.signals)
    p = settings.policy.policy
    values = alerting.signal_values(
        signals, snapshot, policy.published_signals(state.policy, now, p)
    )
    evaluated, transitions = alerting.evaluate(settings.rules, state.alerts, values, now)
    firing = alerting.firing(evaluated)
    out = policy.decide(state.policy, list(firing), snapshot, signals, now, settings.policy)
    run_since = state.run_since_seconds if state.run_since_seconds is not None else now
    up = frozenset(s.service for s in signals.services if s.vllm_up)
    served = state.served | up
    windows = inhibition.windows(out.state, settings.services, p, run_since, served, now)
    held = inhibition.apply(
        settings.rules, state.alerts, evaluated, transitions, windows, state.settled,
        inhibition.ended_well(out.results, served - state.served), now,
    )  # fmt: skip
    current = alerting.sort_alerts(held.alerts.values())
    firing = alerting.firing(current)
    effects = Effects(
        signals=signals,
        transitions=held.deliver,
        alerts=current,
        actions=out.actions,
        ops=out.ops,
        decisions=out.decisions,
        results=out.results,
        gates=gate_states(out.state, signals, policy.gate_dry_run(p)),
        inhibited=held.held,
        notifying=tuple(a for a in firing if a.inhibited_by is None),
        windows=tuple(windows[k] for k in sorted(windows)),
    )
    new = TickState(out.state, MappingProxyType(held.alerts), run_since, served, held.settled)
    return new, effects


def command(
    state: TickState, cmd: OperatorCommand, settings: StepSettings
) -> tuple[TickState, policy.PolicyOutput]:
    """An operator's command between two ticks, at ``cmd.time_seconds``: pause, resume, or an
    action (restart, relaunch) with the same phases as the policy's own, refused while another
    runs. Applied when it comes, not at the next tick: the front door closes with the command
    (that tick may wait on the bundle's capture). The driver keeps the command for the next
    snapshot, where replay finds it and applies it again at the same point."""
    p, now = state.policy, cmd.time_seconds
    if cmd.kind in (CommandKind.PAUSE, CommandKind.RESUME):
        change = policy.pause if cmd.kind is CommandKind.PAUSE else policy.resume
        new, decisions = change(p, cmd.service, now)
        out = policy.PolicyOutput(new, (), decisions)
    else:
        if cmd.service is None:
            raise ValueError(f"{cmd.kind.value} needs a service")
        kind = ActionKind.RESTART if cmd.kind is CommandKind.RESTART else ActionKind.RELAUNCH
        out = policy.operator_action(
            p, cmd.service, kind, cmd.flags, cmd.reset, cmd.who, cmd.force, now, settings.policy
        )
    return replace(state, policy=out.state), out


# What /health says that closes /ready: vLLM answered (or refused) that it is not serving.
NOT_SERVING = frozenset(
    {HealthState.ENGINE_DEAD, HealthState.ERROR, HealthState.REFUSED, HealthState.SCALING}
)


def gate_states(
    state: policy.PolicyState, signals: Signals, dry_run: bool
) -> tuple[tuple[str, GateState], ...]:
    """/ready/<service>: closed when the policy closes it (unless dry-run) or vLLM says it is
    not serving (refused, a dead engine, an error, scaling). A ``/health`` that timed out is
    not one: a busy API server answers late while it serves, and the gate's own poll judges
    silence with a grace (gate/follower.py); a silence that lasts is the hang detection's."""
    out = []
    for s in state.services:
        sig = signals.service(s.service)
        if sig is not None and sig.health_state in NOT_SERVING:
            gate = GateState(False, f"vLLM is not up ({sig.health_state})")
        elif not s.front_door.open and (not dry_run or s.action is not None):
            # An action under way is real (an operator's command acts in dry-run too): its
            # drain needs the front door really closed.
            gate = GateState(False, s.front_door.reason)
        elif not s.front_door.open:
            gate = GateState(True, f"dry-run: would answer 503 ({s.front_door.reason})")
        else:
            gate = GateState(True, "open")
        out.append((s.service, gate))
    return tuple(out)
