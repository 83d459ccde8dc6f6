"""Acting before the crash: the exhaustion forecast (``core/forecast.py``).

A separate stage of ``core/policy.decide``: it runs only when the ladder took no action this
tick, and every action it takes goes through the same guard rails (cooldown, backoff, restart
budget, dry-run, the audit with the forecast that triggered it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.acting import Ctx, gate_dry_run
from vllm_guardian.core.breaker import budget_spent, recent_restarts
from vllm_guardian.core.diagnosis import (
    Evidence,
    Finding,
)
from vllm_guardian.core.forecast import Forecast
from vllm_guardian.core.levers import (
    Baseline,
    Lever,
)
from vllm_guardian.core.policy_state import (
    DecisionKind,
    FrontDoorHolder,
    ServiceState,
    Withheld,
)
from vllm_guardian.core.rungs import (
    can_step_down,
    default_baseline,
    lever_value,
    service_flags,
    set_rung,
)
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import (
    ActionKind,
    Cause,
)


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

    Budget, cooldown and backoff are checked by the caller (:func:`preempt`), like every rung;
    the one exception: a forecast whose bound comes before the cooldown ends is acted on (the
    forecast reads only the current process, so it cannot be a lagging counter).
    """
    f = urgent_forecast(sig, p)
    if f is None or f.cause is None or sig is None:
        return None
    if f.cause is Cause.ALLOCATOR_FRAGMENTATION:
        return _fragmentation_plan(f, sig, s, now, p, base)
    if f.cause is Cause.GPU_MEMORY_OVERCOMMIT:
        return _neighbour_plan(f, s, now, p, base, gpu_total_bytes)
    if f.cause is Cause.PREFILL_BURST:
        return _prefill_plan(f, s, p, base)
    return None


def _fragmentation_plan(
    f: Forecast,
    sig: ServiceSignals,
    s: ServiceState,
    now: float,
    p: PolicyConfig,
    base: Baseline | None,
) -> PreemptiveAction:
    """Fragmentation: drain and restart at a quiet moment, or relaunch with expandable
    segments when it came back soon after the last drain (:func:`preemptive_action`)."""
    assert f.cause is not None
    what = f.describe()
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


def _neighbour_plan(
    f: Forecast,
    s: ServiceState,
    now: float,
    p: PolicyConfig,
    base: Baseline | None,
    gpu_total_bytes: int,
) -> PreemptiveAction:
    """Another process growing on the GPU: page, and relaunch with a lower
    --gpu-memory-utilization once it persists or the card runs out first
    (:func:`preemptive_action`)."""
    assert f.cause is not None
    what = f.describe()
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


def _prefill_plan(
    f: Forecast, s: ServiceState, p: PolicyConfig, base: Baseline | None
) -> PreemptiveAction:
    """A prefill burst: relaunch one rung down on --max-num-batched-tokens (at the floor: alert
    only)."""
    assert f.cause is not None
    what = f.describe()
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


def preempt(
    ctx: Ctx,
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
    base = s.levels.baseline or (
        default_baseline(sig, cmdline, gpu_total) if sig is not None else None
    )
    plan = preemptive_action(sig, s, now, p, base, gpu_total)
    if plan is None:
        if s.front_door.holder is FrontDoorHolder.FORECAST:
            s = replace(s, front_door=s.front_door.opened())
            ctx.decide(
                s, DecisionKind.UNGATE, "the exhaustion forecast cleared", dry_run=gate_dry_run(p)
            )
        return s
    finding = Finding(
        plan.cause, 1.0, (Evidence(plan.cause, "forecast:" + plan.cause.value, plan.reason),)
    )
    if plan.gate and s.front_door.open:
        reason = f"forecast: {plan.reason}"
        s = replace(
            s,
            front_door=s.front_door.closed(FrontDoorHolder.FORECAST, reason, now),
        )
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
    held = _withheld(ctx, s, plan, f, finding)
    if held is not None:
        return held
    restarts = recent_restarts(s, now, p)
    if s.levels.baseline is None and base is not None:
        s = replace(s, levels=replace(s.levels, baseline=base))
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
        s = set_rung(s, plan.lever, s.rung(plan.lever) + plan.rungs)
    flags, env = service_flags(s, base, p) if base is not None else (s.levels.operator_flags, ())
    return ctx.act(s, plan.kind, finding, "pre-emptive: " + plan.reason, flags, env)


def _withheld(
    ctx: Ctx, s: ServiceState, plan: PreemptiveAction, f: Forecast, finding: Finding
) -> ServiceState | None:
    """The guard rails a pre-emptive action meets (cooldown, backoff, budget): the note of why
    nothing is done, or None to act."""
    p = ctx.settings.policy
    now = ctx.now
    # The cooldown keeps lagging counters from triggering a second action; the forecast cannot
    # lag (it reads only the current process), so when even its bound comes before the cooldown
    # ends, waiting means the OOM: act, still within the budget.
    if now < s.hold_off.cooldown_until and f.seconds_latest >= s.hold_off.cooldown_until - now:
        return ctx.note(
            s,
            Withheld.COOLDOWN,
            f"{plan.cause.value}: forecast, in cooldown until {s.hold_off.cooldown_until:.0f}",
            finding,
        )
    if now < s.hold_off.backoff_until:
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"{plan.cause.value}: forecast, backing off until {s.hold_off.backoff_until:.0f}",
            finding,
        )
    if budget_spent(recent_restarts(s, now, p), p):
        # A forecast is not a crash: no latch, the alerts stand and the ladder acts on an OOM.
        return ctx.note(
            s,
            Withheld.BUDGET_SPENT,
            f"{plan.cause.value}: forecast, but the restart budget is spent: alert only",
            finding,
        )
    return None
