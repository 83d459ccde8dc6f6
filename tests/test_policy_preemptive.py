"""Acting before the crash: the policy's reading of the exhaustion forecast, as a specification.

``preemptive_action`` is pure: forecast + service signals + state → the intended action and its
reason. ``decide`` then applies it on the ladder's guard rails (cooldown, budget, dry-run,
audit); those rows drive ``decide`` tick by tick with the Run harness of test_policy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.test_policy import BASE, RULE_SIGNALS
from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.forecast import Forecast, Neighbour
from vllm_guardian.core.policy import (
    Levels,
    Lever,
    PolicySettings,
    PolicyState,
    ServiceState,
    Withheld,
    decide,
    default_baseline,
    initial_state,
    preemptive_action,
)
from vllm_guardian.core.signals import ServiceGpuSignals, ServiceSignals, Signals
from vllm_guardian.model import (
    ActionKind,
    Cause,
    GpuDevice,
    GpuReading,
    HealthState,
    Op,
    OpResult,
    ServiceSnapshot,
    Snapshot,
    UnitState,
)

GIB = 1024**3
MIB = 1024**2
TOTAL = 80 * GIB
P = replace(
    BASE, forecast_horizon_seconds=600, drain_timeout_seconds=60, neighbour_persist_seconds=60
)
# vLLM's defaults (every lever's row fills its field) with 8192 batched tokens.
BASELINE = replace(default_baseline(None, ()), max_num_batched_tokens=8192)
NB = Neighbour(4242, 6 * GIB, "python3 train.py", "/user.slice/user-1000.slice/job.scope")


def fc(
    cause: Cause | None,
    seconds: float = 200.0,
    latest: float | None = None,
    slope: float = -20.0 * MIB,
    neighbour: Neighbour | None = None,
) -> Forecast:
    return Forecast(0, seconds, latest if latest is not None else seconds * 1.5,
                    -slope * seconds, slope, 12, 110.0, cause, "test", neighbour)  # fmt: skip


def signals(
    *forecasts: Forecast, waiting: float | None = 0, running: float | None = 1
) -> ServiceSignals:
    return ServiceSignals(
        "vllm", HealthState.UP, True, True, True,
        requests_waiting=waiting, requests_running=running, gpu_memory_utilization_ratio=0.92,
        gpus=(ServiceGpuSignals(0, 70 * GIB, 0, int(0.92 * TOTAL), 8 * GIB, TOTAL),),
        forecasts=forecasts,
    )  # fmt: skip


S0 = ServiceState("vllm")
PERSISTED = replace(S0, forecast_since=0.0)

# name, signals, state, now → (kind, lever, rungs, gate, critical, wait) or None
CASES = [
    ("no forecast: nothing", signals(), S0, 100.0, None),
    ("no cause: the forecast alerts only", signals(fc(None)), S0, 100.0, None),
    ("bound beyond the horizon: not yet", signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 500, 900)), S0, 100.0, None),
    ("fragmentation at a quiet moment: drain and restart",
     signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 400, 500), waiting=0, running=1), S0, 100.0,
     (ActionKind.RESTART, None, 0, False, False, False)),
    ("fragmentation while busy, time enough: wait for a quiet moment",
     signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 400, 500), waiting=3, running=40), S0, 100.0,
     (None, None, 0, False, False, True)),
    ("fragmentation while busy, no time left to wait: act now",
     signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 100, 150), waiting=3, running=40), S0, 100.0,
     (ActionKind.RESTART, None, 0, False, False, False)),
    ("fragmentation with the queue unknown is not quiet",
     signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 400, 500), waiting=None, running=None), S0, 100.0,
     (None, None, 0, False, False, True)),
    # Holding requests frees nothing another process takes: the front door stays open (the
    # neighbour alert pages) until the relaunch, which holds them only for its own length.
    ("a new neighbour, time to see if it persists: page, no gate, no restart yet",
     signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 200, neighbour=NB)), S0, 100.0,
     (None, None, 0, False, False, True)),
    ("a new neighbour that exhausts the card before it could persist: relaunch now",
     signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 30, slope=-100.0 * MIB, neighbour=NB)), S0, 100.0,
     (ActionKind.RELAUNCH, Lever.GPU_MEMORY_UTILIZATION, 5, True, True, False)),
    ("a persistent neighbour at the floor: page only, the front door stays open",
     signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 200, neighbour=NB)),
     replace(PERSISTED, levels=Levels(rungs=((Lever.GPU_MEMORY_UTILIZATION, 5),))), 100.0,
     (None, None, 0, False, False, True)),
    ("a persistent neighbour: relaunch with a lower utilization, enough rungs for the horizon",
     signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 200, slope=-10.0 * MIB, neighbour=NB)), PERSISTED, 100.0,
     (ActionKind.RELAUNCH, Lever.GPU_MEMORY_UTILIZATION, 1, True, True, False)),
    ("a fast neighbour: down to the floor at most",
     signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 60, slope=-200.0 * MIB, neighbour=NB)), PERSISTED, 100.0,
     (ActionKind.RELAUNCH, Lever.GPU_MEMORY_UTILIZATION, 5, True, True, False)),
    ("prefill peaks growing: one rung down on batched tokens",
     signals(fc(Cause.PREFILL_BURST, 200)), S0, 100.0,
     (ActionKind.RELAUNCH, Lever.MAX_NUM_BATCHED_TOKENS, 1, False, False, False)),
    ("prefill at the floor: alert only",
     signals(fc(Cause.PREFILL_BURST, 200)), replace(S0, levels=Levels(rungs=((Lever.MAX_NUM_BATCHED_TOKENS, 2),))), 100.0,
     (None, None, 0, False, False, True)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "sig", "state", "now", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_preemptive_action(name, sig, state, now, expected) -> None:  # type: ignore[no-untyped-def]
    got = preemptive_action(sig, state, now, P, BASELINE, TOTAL)
    if expected is None:
        assert got is None, got
        return
    assert got is not None
    assert (got.kind, got.lever, got.rungs, got.gate, got.critical, got.wait) == expected, (
        got.reason
    )
    assert "GPU 0: free-memory floor" in got.reason  # the forecast is quoted


def test_the_neighbour_is_named_in_the_reason() -> None:
    got = preemptive_action(
        signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, neighbour=NB)), S0, 0.0, P, BASELINE, TOTAL
    )
    assert got is not None
    assert "pid 4242 (python3 train.py, cgroup /user.slice/user-1000.slice/job.scope)" in got.reason


# --- on the ladder: decide() tick by tick --------------------------------------------------------


class Ticks:
    """decide() tick by tick, with the executor's calls answered as in test_policy's Run: the
    quick ones (bundle, flags file) at once, the restart on the next tick; a drain finds
    nothing in flight."""

    def __init__(self, cfg: PolicyConfig = P) -> None:
        self.cfg = cfg
        self.state: PolicyState = initial_state(["vllm"])
        self.pending: list = []  # type: ignore[type-arg]  # restart calls awaiting their result
        self.last_t = 0.0
        self.actions: list = []  # type: ignore[type-arg]
        self.decisions: list = []  # type: ignore[type-arg]

    def tick(self, t: float, sig: ServiceSignals) -> None:
        results = tuple(
            OpResult(o.action_id, o.service, o.op, True, False, "done", self.last_t)
            for o in self.pending
        )
        self.pending = []
        out = self._step(t, sig, results)
        for _ in range(3):  # the quick calls answer at once: the same tick goes on
            quick = [o for o in out.ops if o.op is not Op.RESTART]
            self.pending += [o for o in out.ops if o.op is Op.RESTART]
            if not quick:
                break
            out = self._step(
                t,
                sig,
                tuple(
                    OpResult(o.action_id, o.service, o.op, True, False, "done", t) for o in quick
                ),
            )
        self.last_t = t

    def _step(self, t: float, sig: ServiceSignals, results: tuple[OpResult, ...]):  # type: ignore[no-untyped-def]
        if self.state.service("vllm").action is not None:
            sig = replace(sig, requests_running=0, requests_waiting=0)  # the drain ends at once
        cmd = (
            "vllm",
            "serve",
            "m",
            "--gpu-memory-utilization",
            "0.92",
            "--max-num-batched-tokens",
            "8192",
        )
        unit = UnitState(
            "vllm.service", "active", "running", "success", 100, 0, 0, None, None, cmd, (100,)
        )
        gpus = GpuReading((GpuDevice(0, "GPU-0", "H100", TOTAL, 72 * GIB, 8 * GIB, processes=()),))
        snap = Snapshot(t, (ServiceSnapshot("vllm", unit=unit),), gpus, (), (), results)
        out = decide(
            self.state,
            [],
            snap,
            Signals(t, (sig,)),
            t,
            PolicySettings(self.cfg, ("vllm",), RULE_SIGNALS),
        )
        self.state = out.state
        self.actions += out.actions
        self.decisions += out.decisions
        return out


def test_fragmentation_forecast_restarts_once_then_cooldown_then_budget() -> None:
    run = Ticks(replace(P, cooldown_seconds=100, restart_budget=2))
    frag = signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 300, 400))
    for t in range(0, 400, 2):
        run.tick(float(t), frag)
    kinds = [(a.kind, a.cause) for a in run.actions]
    # A drain first; the creep comes back: expandable segments; then the budget is spent.
    assert kinds == [(ActionKind.RESTART, Cause.ALLOCATOR_FRAGMENTATION),
                     (ActionKind.RELAUNCH, Cause.ALLOCATOR_FRAGMENTATION)], kinds  # fmt: skip
    first, second = run.actions
    assert first.reason.startswith("pre-emptive: drain and restart before the OOM")
    assert "free-memory floor" in first.reason  # the audit carries the forecast
    assert second.id > first.id
    withheld = {d.withheld for d in run.decisions if d.what == "suppressed"}
    assert {Withheld.COOLDOWN, Withheld.BUDGET_SPENT} <= withheld, withheld
    assert not run.state.service("vllm").breaker_latched  # a forecast never latches


def test_a_neighbour_is_not_gated_around_while_its_forecast_stands() -> None:
    # Measured (bench/outcome.py, noisy_neighbour, guardian+gate): the front door held closed
    # for the persistence wait, then through the relaunch, outlasted the held requests' wait
    # and turned 158 of 985 requests into 503s; an idle vLLM frees nothing the neighbour takes.
    run = Ticks(replace(P, neighbour_persist_seconds=100))  # the card lasts 200 s: time to wait
    nb = signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 200, neighbour=NB))
    for t in range(0, 20, 2):
        run.tick(float(t), replace(nb, kv_cache_usage_ratio=0.1))
    s = run.state.service("vllm")
    assert s.front_door.open
    assert [d for d in run.decisions if d.what == "gate"] == []
    assert run.actions == []
    notes = [d for d in run.decisions if d.withheld is Withheld.FORECAST_WAIT]
    # Waiting, and the person reads who grows and that the front door stays open.
    assert any("pid 4242" in d.reason and "front door stays open" in d.reason for d in notes), notes


def test_persistent_neighbour_relaunches_with_lower_utilization() -> None:
    run = Ticks()
    nb = signals(fc(Cause.GPU_MEMORY_OVERCOMMIT, 200, slope=-10.0 * MIB, neighbour=NB))
    for t in range(0, 80, 2):
        run.tick(float(t), nb)
    (a,) = run.actions
    assert a.kind is ActionKind.RELAUNCH and a.cause is Cause.GPU_MEMORY_OVERCOMMIT
    assert ("--gpu-memory-utilization", "0.87") in a.flags
    assert a.reason.startswith("pre-emptive: pid 4242")


def test_dry_run_decides_the_same_and_marks_it() -> None:
    run = Ticks(replace(P, dry_run=True))
    run.tick(0.0, signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 300, 400)))
    (a,) = run.actions
    assert a.dry_run and a.kind is ActionKind.RESTART


@pytest.mark.parametrize("name", ["steady", "prefix_cache_waste"])
def test_no_forecast_no_action(name: str) -> None:
    # What the healthy scenarios produce: no trend, so no forecast; nothing is done.
    run = Ticks()
    for t in range(0, 1800, 2):
        run.tick(float(t), signals(waiting=0, running=3))
    assert run.actions == [] and [d for d in run.decisions if d.what == "gate"] == []


def test_fragmentation_back_soon_after_a_drain_earns_expandable_segments() -> None:
    s = replace(S0, forecast_actions=((Cause.ALLOCATOR_FRAGMENTATION, 50.0),))
    got = preemptive_action(
        signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 100, 150)), s, 130.0, P, BASELINE, TOTAL
    )
    assert got is not None and (got.kind, got.lever) == (
        ActionKind.RELAUNCH,
        Lever.EXPANDABLE_SEGMENTS,
    )
    # Long after the last drain, a drain and restart is enough again.
    s = replace(S0, forecast_actions=((Cause.ALLOCATOR_FRAGMENTATION, 50.0),))
    got = preemptive_action(
        signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 100, 150)), s, 50.0 + 7200, P, BASELINE, TOTAL
    )
    assert got is not None and got.kind is ActionKind.RESTART


COOLDOWN = [
    # name, forecast (seconds, latest), expected: acted on within the cooldown?
    ("the bound comes before the cooldown ends: waiting means the OOM", (60.0, 80.0), True),
    ("the bound is after the cooldown: wait for it", (300.0, 450.0), False),
]


@pytest.mark.parametrize(("name", "times", "acts"), COOLDOWN, ids=[c[0] for c in COOLDOWN])
def test_cooldown_yields_only_to_a_forecast_that_ends_before_it(
    name: str, times: tuple[float, float], acts: bool
) -> None:
    run = Ticks(replace(P, cooldown_seconds=300))
    run.tick(0.0, signals(fc(Cause.ALLOCATOR_FRAGMENTATION, 100, 150)))  # the first drain
    run.tick(2.0, signals())  # its result: ok, the cooldown starts
    run.tick(4.0, signals(fc(Cause.ALLOCATOR_FRAGMENTATION, *times)))
    kinds = [a.kind for a in run.actions]
    assert kinds == ([ActionKind.RESTART, ActionKind.RELAUNCH] if acts else [ActionKind.RESTART]), (
        kinds
    )
    if acts:
        assert dict(run.actions[1].env) == dict.fromkeys(
            ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True"
        )
