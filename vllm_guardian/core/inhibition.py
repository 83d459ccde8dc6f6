"""Inhibition: the "vLLM is down" alerts say nothing while the guardian itself keeps vLLM down.

Where it sits: the last pure stage of ``core/step.step``, after alert evaluation and the
policy's decision. A restart or relaunch loads the model for minutes, and ``VllmEngineDead``
(``vllm_up == 0`` for 60 s, critical) would page someone for what the guardian did on purpose
and is watching. As Alertmanager's inhibit rules do, evaluation goes on untouched (the alert
table, status, the exposition and the policy see every alert, with why it is inhibited); only
the notifications to the sinks (log, webhooks, Alertmanager) are held back.

A service's *window* is open while vLLM is down because of the guardian:

* an action of its own is in a phase that takes vLLM down (restarting, awaiting VRAM, awaiting
  ready after the guardian's restart call, not after vLLM's supervisor restarted a crash), and
  that phase's deadline has not passed;
* or the guardian's process backend (``policy.backend: process``) started vLLM when this
  guardian run began, vLLM has not answered ``/health`` 200 since, and
  ``policy.startup_grace_seconds`` have not passed.

Which alerts are inhibited is chosen by what the rule reads, never by its name
(:func:`inhibitable`): a signal that says vLLM is not serving (``vllm_up``, ``metrics_up``,
``source_up.vllm_metrics``, ``source_up.health``) or the cause ``engine_dead``. And only an alert
that became active inside the window: one that was active before (a dead engine the guardian
then restarts; a snapshot is taken before the tick decides, so what it shows on the tick of the
restart call is "before") is never hidden, nor is one the sinks were already told about.

When the window closes:

* because the action failed or a deadline passed (or the start-up grace ran out), an inhibited
  alert that is still active is delivered at once, in its current state (no second ``for``);
* because vLLM came back (the action succeeded, the first start finished), an inhibited alert
  still held by its ``keep_firing_for`` resolves without a word: it described the restart.

No I/O, no clock: ``now`` is an argument and the result is data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from vllm_guardian.config import PolicyConfig, ServiceConfig
from vllm_guardian.core.alert_rules import Rule
from vllm_guardian.core.alerting import AlertKey, Transition
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.policy import PolicyState
from vllm_guardian.model import ActionResult, Alert, AlertState, Cause

# Signals that read "vLLM is not serving": each one is false through every model load.
DOWN_SIGNALS = frozenset({"vllm_up", "metrics_up", "source_up.vllm_metrics", "source_up.health"})
# The phases in which the guardian itself has taken vLLM down (core/phases.py).
DOWN_PHASES = frozenset({Phase.RESTARTING, Phase.AWAITING_VRAM, Phase.AWAITING_READY})
STARTUP_REASON = "start-up: the guardian started vLLM"


def inhibitable(rule: Rule) -> bool:
    """Whether a planned restart inhibits this rule's notifications: by signal and cause."""
    return rule.signal in DOWN_SIGNALS or rule.cause is Cause.ENGINE_DEAD


@dataclass(frozen=True)
class Window:
    """vLLM of ``service`` is down because of the guardian, since ``since_seconds``."""

    service: str
    reason: str  # e.g. "action 3 awaiting_ready"; shown as the alerts' inhibited_by
    since_seconds: float
    # vLLM was not already down when the window began (the Prometheus rules' series,
    # vllm_guardian_vllm_down_expected, is exported only then: a dead engine still pages there).
    planned: bool = True
    # An action's window opens with its restart call, decided after that tick's snapshot was
    # taken: what the snapshot showed then predates the call. A start-up window covers its
    # first tick (the process backend started vLLM before it).
    opens_after: bool = False

    def covers(self, active_since_seconds: float) -> bool:
        """Whether an alert active since then became active inside this window."""
        if self.opens_after:
            return active_since_seconds > self.since_seconds
        return active_since_seconds >= self.since_seconds


def windows(
    state: PolicyState,
    services: Sequence[ServiceConfig],
    p: PolicyConfig,
    run_since_seconds: float,
    served: frozenset[str],
    now: float,
) -> dict[str, Window]:
    """The open windows, by service, after this tick's decision (``state``). ``served``: the
    services whose vLLM answered /health 200 since this guardian run began."""
    out: dict[str, Window] = {}
    for svc in services:
        s = state.service(svc.name)
        a = s.action
        found: list[Window] = []
        if (
            a is not None
            and a.phase in DOWN_PHASES
            and a.stopped_seconds is not None
            and now < a.deadline
        ):
            was_up = s.down_since is None or s.down_since > a.stopped_seconds
            reason = f"action {a.action_id} {a.phase.value}"
            found.append(Window(svc.name, reason, a.stopped_seconds, was_up, opens_after=True))
        if (
            p.backend == "process"
            and svc.command
            and svc.name not in served
            and now - run_since_seconds < p.startup_grace_seconds
        ):
            found.append(Window(svc.name, STARTUP_REASON, run_since_seconds))
        if found:  # both: the first start's window began first and covers more
            out[svc.name] = min(found, key=lambda w: w.since_seconds)
    return out


@dataclass(frozen=True)
class Inhibited:
    alerts: dict[AlertKey, Alert]  # the alert table, with inhibited_by set where held
    deliver: tuple[Transition, ...]  # what the sinks are told
    held: tuple[Transition, ...]  # what they are not (each alert's inhibited_by says why)
    settled: frozenset[AlertKey]  # held alerts whose window ended well: they resolve unannounced


def apply(
    rules: Sequence[Rule],
    previous: Mapping[AlertKey, Alert],
    alerts: Mapping[AlertKey, Alert],
    transitions: Sequence[Transition],
    open_windows: Mapping[str, Window],
    settled: frozenset[AlertKey],
    ended_well: frozenset[str],
    now: float,
) -> Inhibited:
    """Mark each alert inhibited or not and split the transitions. ``previous``: last tick's
    table (its ``inhibited_by`` is what the sinks were not told); ``ended_well``: services whose
    window closed this tick because vLLM came back."""
    can = {r.name for r in rules if inhibitable(r)}
    table: dict[AlertKey, Alert] = {}
    lifted: dict[AlertKey, Alert] = {}
    still_settled: set[AlertKey] = set()
    for key, a in alerts.items():
        w = open_windows.get(a.service or "")
        covers = a.name in can and w is not None and w.covers(a.active_since_seconds)
        held: str | None
        if key not in previous:
            held = w.reason if covers and w is not None else None
        elif a.inhibited_by is None:
            held = None  # the sinks know this alert: never hidden
        elif covers and w is not None:
            held = w.reason
        elif key in settled or (a.service or "") in ended_well:
            held = a.inhibited_by
            still_settled.add(key)
        else:
            held = None
        new = a if held == a.inhibited_by else replace(a, inhibited_by=held)
        table[key] = new
        if held is None and a.inhibited_by is not None:
            lifted[key] = new
    deliver: list[Transition] = []
    quiet: list[Transition] = []
    for t in transitions:
        key = t.alert.key
        if t.current is AlertState.INACTIVE:
            (quiet if t.alert.inhibited_by is not None else deliver).append(t)
        elif key in lifted:
            continue  # announced below, as the sinks see it: new
        else:
            a = table[key]
            (quiet if a.inhibited_by is not None else deliver).append(replace(t, alert=a))
    for a in lifted.values():
        deliver.append(Transition(a, AlertState.INACTIVE, a.state, resolved=False))
    return Inhibited(table, tuple(deliver), tuple(quiet), frozenset(still_settled))


def ended_well(results: Sequence[ActionResult], newly_served: frozenset[str]) -> frozenset[str]:
    """Services whose window closed this tick because vLLM came back: an action of theirs
    succeeded, or vLLM answered /health 200 for the first time in this run."""
    return frozenset(r.service for r in results if r.ok) | newly_served
