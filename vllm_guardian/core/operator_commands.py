"""Operator commands from the control socket: pause, resume (which clears a latched breaker),
and ``vllm-guardian restart|relaunch SERVICE`` through the same phases as the policy's own
actions.

Called between ticks, on the state the last tick left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.core.acting import Ctx
from vllm_guardian.core.levers import (
    lever_of_flag,
    lever_spec,
)
from vllm_guardian.core.policy_state import (
    Decision,
    DecisionKind,
    PolicyOutput,
    PolicySettings,
    PolicyState,
)
from vllm_guardian.core.rungs import describe_flags, service_flags, set_rung
from vllm_guardian.model import (
    ActionKind,
)


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
    ctx = Ctx(state, now, settings)
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
    levels = s.levels
    if reset:
        s = replace(
            s,
            levels=replace(s.levels, operator_flags=(), rungs=(), pinned_until=(), baseline=None),
        )
    if sets:
        by_flag = dict(s.levels.operator_flags)
        by_flag.update(sets)
        s = replace(s, levels=replace(s.levels, operator_flags=tuple(sorted(by_flag.items()))))
        for flag, value in sets:
            lever = lever_of_flag(flag)
            if lever is None:
                continue
            s = set_rung(s, lever, 0)
            b = s.levels.baseline
            spec = lever_spec(lever)
            if b is None or spec.baseline_field is None:
                continue  # captured from the running command line once vLLM is back
            s = replace(s, levels=replace(s.levels, baseline=spec.rebased(b, value)))
    if s.breaker_latched and force:
        ctx.decide(
            s, DecisionKind.OPERATOR, f"--force by {who}: acting although the breaker is latched"
        )
    flags, env = (
        service_flags(s, s.levels.baseline, p)
        if s.levels.baseline is not None
        else (s.levels.operator_flags, ())
    )
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
