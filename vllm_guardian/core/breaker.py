"""The guard rails every disruptive rung shares: the restart budget (restarts within
``restart_budget_window_seconds``), repeated early failures, and the breaker's latch, which only
``vllm-guardian resume`` clears (``core/operator_commands.py``).

Read by the ladder (``core/ladder.py``) and the pre-emptive stage (``core/preemptive.py``)
before they start an action, and by the next tick's alert rules (:func:`published_signals`).
"""

from __future__ import annotations

from dataclasses import replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.acting import Ctx
from vllm_guardian.core.diagnosis import Finding
from vllm_guardian.core.policy_state import DecisionKind, PolicyState, ServiceState
from vllm_guardian.model import ActionKind


def recent_restarts(s: ServiceState, now: float, p: PolicyConfig) -> tuple[float, ...]:
    """The guardian's restarts and relaunches that still count against the budget: those
    within the window (the one place the window is computed)."""
    return tuple(t for t in s.restarts if now - t < p.restart_budget_window_seconds)


def budget_spent(restarts: tuple[float, ...], p: PolicyConfig) -> bool:
    """Whether another restart would exceed the budget (``restarts`` from :func:`recent_restarts`)."""
    return len(restarts) >= p.restart_budget


def early_failures(s: ServiceState, now: float, p: PolicyConfig, crash: bool) -> int:
    """The count of crashes within ``early_failure_seconds`` of our last action making vLLM
    ready, with this finding counted: a crash later than that starts the count again."""
    if s.ready_since is None or not crash:
        return s.early_failures
    return s.early_failures + 1 if now - s.ready_since <= p.early_failure_seconds else 0


def latch(ctx: Ctx, s: ServiceState, reason: str, top: Finding) -> ServiceState:
    """Latch the breaker on ``top`` and escalate: from here on only a person acts (the one
    place a latch on a finding is written)."""
    s = replace(s, breaker_latched=True, breaker_reason=reason)
    ctx.decide(
        s,
        DecisionKind.LATCH,
        reason,
        cause=top.cause,
        evidence=tuple(e.name for e in top.evidence),
    )
    return ctx.act(s, ActionKind.ESCALATE, top, reason)


def published_signals(
    state: PolicyState, now: float, p: PolicyConfig
) -> dict[tuple[str, str], float | None]:
    """The policy's own figures, as signals the next tick's alert rules can read."""
    out: dict[tuple[str, str], float | None] = {}
    for s in state.services:
        recent = recent_restarts(s, now, p)
        out[(s.service, "policy.restart_budget_remaining")] = float(
            max(0, p.restart_budget - len(recent))
        )
        out[(s.service, "policy.breaker_latched")] = 1.0 if s.breaker_latched else 0.0
        out[(s.service, "policy.paused")] = 1.0 if s.paused else 0.0
    return out
