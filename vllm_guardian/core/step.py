"""One tick's whole decision: ``step(state, history, now, settings) → (state, effects)``. Pure.

Where it sits: between collecting and acting. The daemon collects a snapshot, appends it to its
history and calls :func:`step`; ``replay`` feeds recorded snapshots to the same function; so do
the tests and ``bench/tick.py``. In order:

1. derive the signals from the history window (``core/signals.py``);
2. evaluate the alert rules (``core/alerting.py``) with the policy's own figures of the previous
   tick (budget left, breaker) as extra signals;
3. decide (``core/policy.py``): gate changes, new actions, the phases of the action under way
   (``core/phases.py``);
4. say what ``/ready/<service>`` answers.

Everything the shell must do comes back as :class:`Effects`: alert transitions to deliver
(queued, never waited on), blocking actuator calls to start, escalations to page, decisions to
audit, results to count, readiness to publish. The shell applies them in one place
(``healing.py``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import alerting, policy
from vllm_guardian.core.signals import Signals, derive
from vllm_guardian.model import Action, ActionResult, Alert, GateState, OpRequest, Snapshot


@dataclass(frozen=True)
class TickState:
    """What one tick hands to the next: the policy's state and the alert table."""

    policy: policy.PolicyState
    alerts: Mapping[alerting.AlertKey, Alert] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class StepSettings:
    rules: tuple[alerting.Rule, ...]
    policy: policy.PolicySettings
    services: tuple[ServiceConfig, ...]
    signals: SignalsConfig


@dataclass(frozen=True)
class Effects:
    signals: Signals
    transitions: tuple[alerting.Transition, ...]  # alert changes to deliver to the sinks
    firing: tuple[Alert, ...]
    alerts: tuple[Alert, ...]  # pending and firing, sorted
    actions: tuple[Action, ...]  # actions started this tick (escalations: page a person)
    ops: tuple[OpRequest, ...]  # blocking actuator calls to start
    decisions: tuple[policy.Decision, ...]  # for the audit log and the flight record
    results: tuple[ActionResult, ...]  # actions that ended this tick
    gates: tuple[tuple[str, GateState], ...]  # what /ready/<service> answers


def settings_for(
    rules: Sequence[alerting.Rule],
    policy_settings: policy.PolicySettings,
    services: Sequence[ServiceConfig],
    signals: SignalsConfig,
) -> StepSettings:
    return StepSettings(tuple(rules), policy_settings, tuple(services), signals)


def initial(services: Sequence[str], previous: policy.PolicyState | None = None) -> TickState:
    return TickState(policy.initial_state(services, previous))


def trim(history: collections.deque[Snapshot], span_seconds: float) -> None:
    """Keep the window the signals need (and at least the newest snapshot)."""
    now = history[-1].time_seconds
    while len(history) > 1 and history[0].time_seconds < now - span_seconds:
        history.popleft()


def step(
    state: TickState, history: Sequence[Snapshot], now: float, settings: StepSettings
) -> tuple[TickState, Effects]:
    snapshot = history[-1]
    signals = derive(history, settings.services, settings.signals)
    p = settings.policy.policy
    values = alerting.signal_values(
        signals, snapshot, policy.published_signals(state.policy, now, p)
    )
    alerts, transitions = alerting.evaluate(settings.rules, state.alerts, values, now)
    current = alerting.sort_alerts(alerts.values())
    firing = alerting.firing(current)
    out = policy.decide(state.policy, list(firing), snapshot, signals, now, settings.policy)
    effects = Effects(
        signals=signals,
        transitions=transitions,
        firing=firing,
        alerts=current,
        actions=out.actions,
        ops=out.ops,
        decisions=out.decisions,
        results=out.results,
        gates=gate_states(out.state, signals, policy.gate_dry_run(p)),
    )
    return TickState(out.state, MappingProxyType(alerts)), effects


def gate_states(
    state: policy.PolicyState, signals: Signals, dry_run: bool
) -> tuple[tuple[str, GateState], ...]:
    """/ready/<service>: closed when the policy closes it (unless dry-run) or vLLM is not up."""
    out = []
    for s in state.services:
        sig = signals.service(s.service)
        if sig is not None and sig.vllm_up is False:
            gate = GateState(False, f"vLLM is not up ({sig.health_state})")
        elif not s.gate_open and (not dry_run or s.action is not None):
            # An action under way is real (an operator's command acts in dry-run too): its
            # drain needs the front door really closed.
            gate = GateState(False, s.gate_reason)
        elif not s.gate_open:
            gate = GateState(True, f"dry-run: would answer 503 ({s.gate_reason})")
        else:
            gate = GateState(True, "open")
        out.append((s.service, gate))
    return tuple(out)
