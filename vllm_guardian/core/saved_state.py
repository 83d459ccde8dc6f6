"""The state a guardian starts from: the services it watches with what a previous run knew
(:func:`initial_state`), a saved state's times bounded by this clock
(:func:`bound_saved_times`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from vllm_guardian.core import phases
from vllm_guardian.core.policy_state import (
    Levels,
    PolicySettings,
    PolicyState,
    ServiceState,
)


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
        backoff = min(max(s.hold_off.backoff_seconds, 0.0), p.backoff_max_seconds)
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
        out.append(
            replace(
                s,
                action=action,
                levels=_bounded_levels(b, "", s.levels, p.pin_seconds),
                levels_before=None
                if s.levels_before is None
                else _bounded_levels(b, "levels_before.", s.levels_before, p.pin_seconds),
                front_door=replace(
                    s.front_door, closed_at=b.maybe("gate_closed_at", s.front_door.closed_at)
                ),
                hold_off=replace(
                    s.hold_off,
                    cooldown_until=b.at_most(
                        "cooldown_until", s.hold_off.cooldown_until, p.cooldown_seconds
                    ),
                    backoff_until=b.at_most("backoff_until", s.hold_off.backoff_until, backoff),
                    backoff_seconds=backoff,
                ),
                restarts=tuple(b.at_most("restarts", t) for t in s.restarts),
                ready_since=b.maybe("ready_since", s.ready_since),
                started_seconds=b.maybe("started_seconds", s.started_seconds),
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


def _bounded_levels(b: _Bounded, what: str, levels: Levels, pin_seconds: float) -> Levels:
    """The levels' times bounded: a step up happened by now; a pin lasts its duration."""
    return replace(
        levels,
        last_step_up=b.keyed(f"{what}last_step_up", levels.last_step_up),
        pinned_until=b.keyed(f"{what}pinned_until", levels.pinned_until, pin_seconds),
    )
