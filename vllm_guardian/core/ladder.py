"""The ladder on findings, least disruptive first: drain and restart, relaunch one rung down on
the cause's lever, step back up once stable, escalate what restarting cannot help.

Runs in ``core/policy.decide`` after the evidence is tracked; the guard rails it shares with the
pre-emptive stage (restart budget, latch) are in ``core/breaker.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.acting import Ctx, disrupting, supersede
from vllm_guardian.core.breaker import budget_spent, early_failures, latch, recent_restarts
from vllm_guardian.core.causes import Pressure, cause_spec
from vllm_guardian.core.diagnosis import (
    Finding,
    actionable,
)
from vllm_guardian.core.levers import (
    LOW_CAP_COSTS,
    Baseline,
    Lever,
    mean_context_tokens,
    median,
    recompute_share,
)
from vllm_guardian.core.policy_state import DecisionKind, ServiceState, Withheld
from vllm_guardian.core.rungs import (
    can_step_down,
    default_baseline,
    lever_value,
    nearest_seqs_rung,
    service_flags,
    set_rung,
    set_time,
)
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import (
    ActionKind,
    Cause,
)


def _concurrency_relaunch(
    s: ServiceState, sig: ServiceSignals | None, base: Baseline, p: PolicyConfig
) -> tuple[int, str] | str:
    """Whether KV thrash may relaunch with a lower --max-num-seqs: ``(rung, what held)``, or
    the reason it may not. Every condition is the measured one (docs/capacity.md): enabled by the
    operator; a cap at ≈ target × the median running count over the episodes; strictly under
    what the pool admits anyway (the peak running count seen); a recompute share above the
    threshold."""
    c = p.concurrency_relaunch
    head = "concurrency_overcommit: gated and alerted, no relaunch"
    if not c.enabled:
        return (
            f"{head}: KV thrash is a capacity problem (policy.concurrency_relaunch.enabled is "
            "false); add replicas or shed at the gate"
        )
    samples = [r for _, r in s.running_samples]
    if len(samples) < c.min_running_samples:
        return f"{head}: fewer than {c.min_running_samples} running-count samples under pressure"
    med = median(samples) or 0.0
    peak = max(samples)
    target = c.target_hosted_ratio * med
    picked = nearest_seqs_rung(target, peak, base, p)
    if picked is None:
        return (
            f"{head}: no --max-num-seqs rung within 15 % of {target:.0f} "
            f"({c.target_hosted_ratio:g}x the median running {med:.0f}) lies under the peak "
            f"{peak:.0f} the pool admits anyway; {LOW_CAP_COSTS}"
        )
    rung, value = picked
    share = None
    if sig is not None:
        tokens = [sig.prompt_tokens_per_second, sig.generation_tokens_per_second]
        sig_tokens = sum(t for t in tokens if t is not None) if any(tokens) else None
        ctx_tokens = mean_context_tokens(
            sig.kv_cache_usage_ratio, sig.kv_cache_capacity_tokens, sig.requests_running
        )
        share = recompute_share(sig.preemptions_per_second, ctx_tokens, sig_tokens)
    if share is None:
        return f"{head}: recompute share unknown (preemptions/s, KV pool size or tokens/s missing)"
    if share < c.min_recompute_share_ratio:
        # No figure in the text: a "nothing done" line is logged once per distinct reason.
        return (
            f"{head}: estimated recompute share below {c.min_recompute_share_ratio:g}; a "
            "restart costs more than recompute"
        )
    return rung, (
        f"cap {value} = {value / med if med else 0:.2f}x the median running {med:.0f} over "
        f"{len(samples)} samples, under the peak {peak:.0f} the pool admits; recompute share "
        f"{share:.2f} >= {c.min_recompute_share_ratio:g}"
    )


def _early_crash(s: ServiceState, top: Finding, now: float, p: PolicyConfig) -> bool:
    """The instance our last action made ready crashed within ``early_failure_seconds``.

    The cooldown keeps lagging counters from triggering a second action; a crash of the new
    instance is not one: an unambiguous log line (CUDA OOM, engine death, start-up refused for
    memory) read after it became ready, or its unit exited. Alerts do not count here: their
    ``for`` and ``keep_firing_for`` blur which instance they describe. Waiting out
    the cooldown would leave vLLM down while its supervisor restarts it with the same flags
    (measured: 64 of 1,866 requests timed out in the noisy_neighbour demo behind a 15 s
    cooldown; the shipped one is 600 s). So it is acted on at once; the early-failure limit
    latches the breaker when that does not help, and the restart budget still applies.
    """
    if s.ready_since is None or now - s.ready_since > p.early_failure_seconds:
        return False
    if not cause_spec(top.cause).crashes:
        return False
    ready = s.ready_since
    fresh = {x.name for x in s.log_items if x.seen_at > ready and x.agreed}
    return any(e.name in fresh or e.name == "unit:exited" for e in top.evidence)


def _crash(top: Finding) -> bool:
    return cause_spec(top.cause).crashes and any(e.unambiguous for e in top.evidence)


def urgent_finding(top: Finding) -> bool:
    """Acted on without a fleet permit: a crash or a dead engine (the replica is already down),
    or a cause that escalates (nothing is restarted)."""
    spec = cause_spec(top.cause)
    return _crash(top) or spec.already_down or spec.escalation is not None


def held_back(s: ServiceState, top: Finding, now: float, p: PolicyConfig) -> bool:
    """The cooldown or the backoff holds ``top`` back (as :func:`act_on_findings` decides below)."""
    if cause_spec(top.cause).escalation is not None:
        return False
    if now < s.hold_off.cooldown_until and not _early_crash(s, top, now, p):
        return True
    return now < s.hold_off.backoff_until and not (
        s.hold_off.backoff_voluntary_only and urgent_finding(top)
    )


def _episodes(s: ServiceState, cause: Cause) -> int:
    return sum(1 for c, _ in s.episodes if c is cause)


def act_on_findings(
    ctx: Ctx,
    s: ServiceState,
    findings: Sequence[Finding],
    sig: ServiceSignals | None,
    cmdline: Sequence[str] | None = None,
    gpu_total_bytes: int = 0,
) -> ServiceState:
    """The ladder on this tick's ranked findings: escalate, restart, relaunch one rung down, or
    note why nothing is done; with no finding, perhaps step back up."""
    p = ctx.settings.policy
    now = ctx.now
    if s.breaker_latched:
        return ctx.note(
            s,
            Withheld.BREAKER_LATCHED,
            f"breaker latched ({s.breaker_reason}): waiting for `vllm-guardian resume`",
        )
    if disrupting(s):
        return s
    top = next((f for f in findings if actionable(f)), None)
    if s.action is not None:
        # Waiting for a fleet permit (the replica still serves): only what cannot wait for a
        # permit (a crash: the replica is already down; a fault that escalates) ends the wait,
        # and only when it is to be acted on now.
        if top is None or not urgent_finding(top) or held_back(s, top, now, p):
            return s
        s = supersede(ctx, s, top)
    if top is None:
        if findings:
            return ctx.note(
                s,
                Withheld.EVIDENCE_SHORT,
                f"{findings[0].cause.value}: evidence not yet enough to act",
                findings[0],
            )
        return _maybe_step_up(ctx, s, sig)
    spec = cause_spec(top.cause)
    if spec.escalation is not None:
        return latch(ctx, s, spec.escalation, top)
    if now < s.hold_off.cooldown_until and not _early_crash(s, top, now, p):
        return ctx.note(
            s,
            Withheld.COOLDOWN,
            f"{top.cause.value}: in cooldown until {s.hold_off.cooldown_until:.0f} after the last action",
            top,
        )
    if now < s.hold_off.backoff_until and not (
        s.hold_off.backoff_voluntary_only and urgent_finding(top)
    ):
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"{top.cause.value}: backing off after a failed action until {s.hold_off.backoff_until:.0f}",
            top,
        )
    base = s.levels.baseline or default_baseline(sig, cmdline, gpu_total_bytes)
    if s.levels.baseline is None:
        s = replace(
            s, levels=replace(s.levels, baseline=base)
        )  # rungs are relative to it: stepping up must use the same
    step = _may_step_down(ctx, s, top, sig, base)
    if isinstance(step, ServiceState):
        return step
    return _disrupt(ctx, s, top, sig, base, step)


def _may_step_down(
    ctx: Ctx, s: ServiceState, top: Finding, sig: ServiceSignals | None, base: Baseline
) -> bool | ServiceState:
    """Whether the cause's lever goes one rung down, or (a ServiceState) the note of why
    nothing is done: a lever is earned by enough episodes of its cause, or at once by a crash."""
    p = ctx.settings.policy
    spec = cause_spec(top.cause)
    lever = spec.lever
    episodes = _episodes(s, top.cause)
    needed = (
        p.pressure_events_to_relaunch if spec.episodes_to_step is None else spec.episodes_to_step
    )
    step = lever is not None and can_step_down(lever, s.rung(lever), base, p)
    if spec.restart_first:
        # Drain + restart clears it (or is all there is); only a repeat earns the lever.
        return step and episodes >= needed
    if spec.pressure is Pressure.KV_CACHE:
        # KV pressure never crashes: the gate and the over-capacity alert handle it; a relaunch
        # only where the operator enabled it and every measured condition holds.
        seqs = _concurrency_relaunch(s, sig, base, p)
        if isinstance(seqs, str):
            return ctx.note(s, Withheld.GATED_ONLY, seqs, top)
        if seqs[0] <= s.rung(Lever.MAX_NUM_SEQS):
            return ctx.note(
                s,
                Withheld.AT_FLOOR,
                f"{top.cause.value}: gated and alerted, no relaunch: --max-num-seqs is "
                "already at or below 1.0x what the pool hosts",
                top,
            )
        if not (step and episodes >= needed):
            return ctx.note(
                s,
                Withheld.EPISODES,
                f"{top.cause.value}: gated; {episodes} episode(s) of {needed} before a relaunch",
                top,
            )
    elif not _crash(top) and not (step and episodes >= needed):
        return ctx.note(
            s,
            Withheld.EPISODES,
            f"{top.cause.value}: {episodes} episode(s) of {needed} before a relaunch",
            top,
        )
    return step


def _disrupt(
    ctx: Ctx,
    s: ServiceState,
    top: Finding,
    sig: ServiceSignals | None,
    base: Baseline,
    step: bool,
) -> ServiceState:
    """Past the guard rails (the budget, repeated early failures: either latches), restart, or
    relaunch with the cause's lever one rung down when ``step``."""
    p = ctx.settings.policy
    now = ctx.now
    crash = _crash(top)
    restarts = recent_restarts(s, now, p)
    early = early_failures(s, now, p, crash)
    s = replace(s, restarts=restarts, early_failures=early)
    if budget_spent(restarts, p):
        return latch(
            ctx,
            s,
            f"restart budget spent: {len(restarts)} restarts in {p.restart_budget_window_seconds:.0f}s",
            top,
        )
    if early >= p.early_failure_limit:
        return latch(
            ctx,
            s,
            f"{early} failures within {p.early_failure_seconds:.0f}s of becoming ready: restarting does not help",
            top,
        )
    s = replace(s, restarts=(*restarts, now), last_note="")
    spec = cause_spec(top.cause)
    if spec.lever is not None and step:
        return _relaunch_down(ctx, s, top, sig, base, spec.lever, crash)
    flags, env = service_flags(s, base, p)
    reason = (
        f"{top.cause.value}: drain and restart with the same flags; " + top.evidence[0].sentence
    )
    voluntary = not crash and not spec.already_down
    return ctx.act(s, ActionKind.RESTART, top, reason, flags, env, voluntary=voluntary)


def _relaunch_down(
    ctx: Ctx,
    s: ServiceState,
    top: Finding,
    sig: ServiceSignals | None,
    base: Baseline,
    lever: Lever,
    crash: bool,
) -> ServiceState:
    """Relaunch with ``lever`` one rung down (max_num_seqs: to the rung the pool's running
    count calls for); a lever stepped up shortly before is pinned there."""
    p = ctx.settings.policy
    now = ctx.now
    levels = s.levels
    before = s.rung(lever)
    rung = before + 1
    why = ""
    if lever is Lever.MAX_NUM_SEQS:
        seqs = _concurrency_relaunch(s, sig, base, p)
        if isinstance(seqs, tuple):
            rung, why = seqs[0], f" ({seqs[1]})"
    s = set_rung(s, lever, rung)
    last_up = dict(s.levels.last_step_up).get(lever)
    if last_up is not None and now - last_up <= p.pin_seconds:
        pinned = set_time(s.levels.pinned_until, lever, now + p.pin_seconds)
        s = replace(s, levels=replace(s.levels, pinned_until=pinned))
    flags, env = service_flags(s, base, p)
    value = lever_value(lever, rung, base, p)
    how = "one rung" if rung == before + 1 else f"{rung - before} rungs"
    reason = (
        f"{top.cause.value}: {lever.value} {how} down to {value} (rung {rung}){why}; "
        + top.evidence[0].sentence
    )
    return ctx.act(
        s, ActionKind.RELAUNCH, top, reason, flags, env, voluntary=not crash, before=levels
    )


def _maybe_step_up(ctx: Ctx, s: ServiceState, sig: ServiceSignals | None) -> ServiceState:
    p = ctx.settings.policy
    now = ctx.now
    base = s.levels.baseline
    if not s.levels.rungs or base is None:
        return s
    quiet_since = max(t for t in (s.last_pressure_seconds, s.ready_since, 0.0) if t is not None)
    if now - quiet_since < p.stable_for_seconds or now < s.hold_off.cooldown_until:
        return s
    if (
        now < s.hold_off.backoff_until
    ):  # after a failed step up (or a wait for a permit that gave none)
        return ctx.note(
            s,
            Withheld.BACKOFF,
            f"stable, but backing off after a failed action until {s.hold_off.backoff_until:.0f}",
        )
    pinned = dict(s.levels.pinned_until)
    candidates = [lv for lv, r in s.levels.rungs if r > 0 and pinned.get(lv, -math.inf) <= now]
    if not candidates:
        return ctx.note(s, Withheld.PINNED, "stable, but every lowered lever is pinned")
    restarts = recent_restarts(s, now, p)
    if budget_spent(restarts, p):
        return ctx.note(
            s,
            Withheld.BUDGET_SPENT,
            "stable, but stepping up needs a restart and the budget is spent",
        )
    lever = candidates[0]
    rung = s.rung(lever) - 1
    levels = s.levels
    s = set_rung(s, lever, rung)
    s = replace(
        s,
        levels=replace(s.levels, last_step_up=set_time(s.levels.last_step_up, lever, now)),
        restarts=(*restarts, now),
        last_note="",
    )
    flags, env = service_flags(s, base, p)
    value = lever_value(lever, rung, base, p) or "the operator's baseline"
    reason = f"stable for {now - quiet_since:.0f}s: {lever.value} one rung up to {value}"
    ctx.decide(s, DecisionKind.STEP_UP, reason)
    return ctx.act(s, ActionKind.RELAUNCH, None, reason, flags, env, voluntary=True, before=levels)
