"""Times in the saved policy state are not trusted across a clock step.

A guardian whose clock ran a day ahead saves a state whose cooldown, backoff, pins and action
deadlines lie a day in the future (and whose past events, restarts and pressure episodes, lie
in that future too). The next guardian, on a correct clock, would back off for a day while
vLLM is dead. When the state is loaded, every deadline is bounded by now plus the duration
that set it, and every time of something that already happened by now.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_guardian.config import PolicyConfig, parse_config
from vllm_guardian.core.phases import (
    PERMIT_RETRY_SECONDS,
    ActionProgress,
    Phase,
    phase_limit_seconds,
)
from vllm_guardian.core.policy import (
    FrontDoor,
    FrontDoorHolder,
    HoldOff,
    Levels,
    Lever,
    LogItem,
    PolicyState,
    ServiceState,
)
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import ActionKind, Cause
from vllm_guardian.shell.healing import Healing
from vllm_guardian.shell.statefile import load_state, save_state

DAY = 86400.0
FLEET_WAIT_SECONDS = 300.0


def _saved(at: float, phase: Phase = Phase.DRAINING) -> ServiceState:
    """Every time field of a service's state, as a guardian whose clock read ``at`` saves it
    (each deadline the configured duration after ``at``: within its bound on that clock)."""
    p = PolicyConfig()
    return ServiceState(
        "vllm",
        front_door=FrontDoor(FrontDoorHolder.ACTION, "restart in progress", at),
        hold_off=HoldOff(
            cooldown_until=at + p.cooldown_seconds,
            backoff_until=at + p.backoff_max_seconds,
            backoff_seconds=p.backoff_max_seconds,
        ),
        restarts=(at - 10, at),
        ready_since=at,
        started_seconds=at,
        levels=Levels(
            rungs=((Lever.MAX_NUM_SEQS, 1),),
            last_step_up=((Lever.MAX_NUM_SEQS, at),),
            pinned_until=((Lever.MAX_NUM_SEQS, at + p.pin_seconds),),
        ),
        episodes=((Cause.CONCURRENCY_OVERCOMMIT, at),),
        last_pressure_seconds=at,
        log_items=(LogItem(Cause.ENGINE_DEAD, "EngineDeadError", "the engine died", at),),
        watch_since=at,
        forecast_since=at,
        forecast_actions=((Cause.PREFILL_BURST, at),),
        down_since=at,
        running_samples=((at, 12.0),),
        action=ActionProgress(
            action_id=3,
            kind=ActionKind.RESTART,
            cause=Cause.ENGINE_DEAD,
            reason="engine dead",
            phase=phase,
            phase_since=at,
            deadline=at + phase_limit_seconds(phase, p, FLEET_WAIT_SECONDS),
            started_seconds=at,
            ready_after=at,
            stopped_seconds=at,
            permit_retry_at=at + PERMIT_RETRY_SECONDS,
        ),
    )


def _load(tmp_path: Path, saved: ServiceState, clock: FakeClock) -> ServiceState:
    state_dir = tmp_path / "state"
    state_dir.mkdir(exist_ok=True)
    save_state(state_dir / "policy-state.json", PolicyState((saved,), 4))
    text = json.dumps(
        {
            "state_dir": str(state_dir),
            "runtime_dir": str(tmp_path / "run"),
            "services": [{"name": "vllm", "url": "http://127.0.0.1:1"}],
            "fleet": {
                "permit": "lease",
                "model": "m",
                "pdb": "p",
                "wait_timeout_seconds": FLEET_WAIT_SECONDS,
            },
        }
    )
    healing = Healing(parse_config(text, "test.yaml"), clock, backends={})
    try:
        return healing.state.service("vllm")
    finally:
        healing.close()


def _second(pairs: Iterable[tuple[object, float]]) -> list[float]:
    return [t for _, t in pairs]


Times = Callable[[ServiceState], list[float]]
Bound = Callable[[PolicyConfig], float]
# (what, its times in the loaded state, how far past now each may lie)
BOUNDS: list[tuple[str, Times, Bound]] = [
    ("cooldown_until", lambda s: [s.hold_off.cooldown_until], lambda p: p.cooldown_seconds),
    ("backoff_until", lambda s: [s.hold_off.backoff_until], lambda p: p.backoff_max_seconds),
    ("pinned_until", lambda s: _second(s.levels.pinned_until), lambda p: p.pin_seconds),
    ("action.deadline (draining)", lambda s: [s.action.deadline] if s.action else [],
     lambda p: p.drain_timeout_seconds),
    ("action.permit_retry_at", lambda s: [s.action.permit_retry_at] if s.action else [],
     lambda p: PERMIT_RETRY_SECONDS),
    ("gate_closed_at", lambda s: [s.front_door.closed_at or 0.0], lambda p: 0.0),
    ("restarts", lambda s: list(s.restarts), lambda p: 0.0),
    ("ready_since", lambda s: [s.ready_since or 0.0], lambda p: 0.0),
    ("started_seconds", lambda s: [s.started_seconds or 0.0], lambda p: 0.0),
    ("last_step_up", lambda s: _second(s.levels.last_step_up), lambda p: 0.0),
    ("episodes", lambda s: _second(s.episodes), lambda p: 0.0),
    ("last_pressure_seconds", lambda s: [s.last_pressure_seconds or 0.0], lambda p: 0.0),
    ("log_items", lambda s: [x.seen_at for x in s.log_items], lambda p: 0.0),
    ("watch_since", lambda s: [s.watch_since or 0.0], lambda p: 0.0),
    ("forecast_since", lambda s: [s.forecast_since or 0.0], lambda p: 0.0),
    ("forecast_actions", lambda s: _second(s.forecast_actions), lambda p: 0.0),
    ("down_since", lambda s: [s.down_since or 0.0], lambda p: 0.0),
    ("running_samples", lambda s: [t for t, _ in s.running_samples], lambda p: 0.0),
    ("action.phase_since", lambda s: [s.action.phase_since] if s.action else [], lambda p: 0.0),
    ("action.started_seconds", lambda s: [s.action.started_seconds] if s.action else [],
     lambda p: 0.0),
    ("action.ready_after", lambda s: [s.action.ready_after] if s.action else [], lambda p: 0.0),
    ("action.stopped_seconds", lambda s: [s.action.stopped_seconds or 0.0] if s.action else [],
     lambda p: 0.0),
]  # fmt: skip


@pytest.mark.parametrize(("what", "times", "bound"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_a_state_saved_a_day_ahead_is_bounded_by_now_plus_each_duration(
    tmp_path: Path, what: str, times: Times, bound: Bound, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    now = clock.time()
    caplog.set_level(logging.WARNING)
    loaded = _load(tmp_path, _saved(now + DAY), clock)
    seen = times(loaded)
    print(what, [t - now for t in seen], "seconds after now")
    assert seen, f"{what} was lost on load"
    limit = now + bound(PolicyConfig())
    assert all(t <= limit for t in seen), f"{what} lies past now + {limit - now:.0f}s"
    assert "ahead" in caplog.text  # said once, with what was bounded


# A saved action's deadline is bounded by its own phase's limit.
PHASE_LIMITS: list[tuple[Phase, Bound]] = [
    (Phase.AWAITING_PERMIT, lambda p: FLEET_WAIT_SECONDS),
    (Phase.PREPARING, lambda p: p.bundle_timeout_seconds + 10.0),
    (Phase.AWAITING_SELF_RESTART, lambda p: p.vram_release_timeout_seconds),
    (Phase.DRAINING, lambda p: p.drain_timeout_seconds),
    (Phase.RESTARTING, lambda p: p.drain_timeout_seconds + p.ready_timeout_seconds + 60.0),
    (Phase.AWAITING_VRAM, lambda p: p.vram_release_timeout_seconds),
    (Phase.AWAITING_READY, lambda p: p.ready_timeout_seconds),
]


@pytest.mark.parametrize(("phase", "bound"), PHASE_LIMITS, ids=[p.value for p, _ in PHASE_LIMITS])
def test_a_saved_action_deadline_is_bounded_by_its_phase(
    tmp_path: Path, phase: Phase, bound: Bound
) -> None:
    clock = FakeClock()
    now = clock.time()
    loaded = _load(tmp_path, _saved(now + DAY, phase), clock)
    assert loaded.action is not None
    print(phase.value, loaded.action.deadline - now, "seconds after now")
    assert loaded.action.deadline <= now + bound(PolicyConfig())


def test_a_state_saved_on_a_sound_clock_loads_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    now = clock.time()
    caplog.set_level(logging.WARNING)
    saved = _saved(now - 5.0)
    loaded = _load(tmp_path, saved, clock)
    assert loaded.action is not None
    assert loaded == replace(saved, action=loaded.action)
    assert replace(loaded.action, orphaned=False) == saved.action  # orphaned: a new guardian
    assert "ahead" not in caplog.text


# A state saved before the front door was a record saved it flat, without who closed it.
# (its gate_open, gate_reason, whether an action was under way and in what phase, the holder
# it loads with)
OLD_DOORS: list[tuple[bool, str, Phase | None, FrontDoorHolder | None]] = [
    (True, "open", None, None),
    (True, "paused: gate held open", Phase.DRAINING, None),
    (False, "forecast: pid 7 is growing on the GPU", None, FrontDoorHolder.FORECAST),
    (False, "restart in progress", Phase.DRAINING, FrontDoorHolder.ACTION),
    (False, "KV cache usage 95% at or above the high watermark 90%", None,
     FrontDoorHolder.KV_PRESSURE),
    (False, "KV cache usage 95% at or above the high watermark 90%", Phase.AWAITING_PERMIT,
     FrontDoorHolder.KV_PRESSURE),
]  # fmt: skip


@pytest.mark.parametrize(("is_open", "reason", "phase", "holder"), OLD_DOORS)
def test_a_state_saved_with_a_flat_front_door_names_who_holds_it(
    tmp_path: Path, is_open: bool, reason: str, phase: Phase | None, holder: FrontDoorHolder | None
) -> None:
    saved = _saved(1000.0)
    saved = replace(saved, action=replace(saved.action, phase=phase) if phase else None)
    service = to_jsonable(saved)
    del service["front_door"]
    service.update(gate_open=is_open, gate_reason=reason, gate_closed_at=990.0)
    path = tmp_path / "policy-state.json"
    path.write_text(json.dumps({"format": 1, "state": {"services": [service]}}))
    state = load_state(path)
    assert state is not None
    door = state.service("vllm").front_door
    assert door == FrontDoor(holder, reason, 990.0)
    assert door.open is is_open
