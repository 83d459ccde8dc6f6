"""What one tick shows, kept in the service's state before the ladder reads it: the process and
its health, the front door under KV pressure, log evidence held until a structural signal
agrees, the start-up grace, pressure episodes and the running count under KV thrash, and the
operator's baseline.

Runs in ``core/policy.decide`` after the action under way moved on and before the ladder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.acting import Ctx, disrupting, gate_dry_run
from vllm_guardian.core.alerting import RESET_CLASS_XIDS
from vllm_guardian.core.budget import parse_launch_flags
from vllm_guardian.core.diagnosis import (
    CORROBORATION_SECONDS,
    Evidence,
    Finding,
    Structure,
    corroborated,
    structural_failures,
)
from vllm_guardian.core.policy_state import (
    DecisionKind,
    FrontDoorHolder,
    LogItem,
    ServiceState,
    Withheld,
)
from vllm_guardian.core.rungs import default_baseline
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import (
    Cause,
    HealthState,
    Snapshot,
    UnitState,
)


def track_process(s: ServiceState, snapshot: Snapshot, name: str, now: float) -> ServiceState:
    svc = snapshot.service(name)
    pid = svc.unit.main_pid if svc is not None and svc.unit is not None else None
    if s.watch_since is None:
        s = replace(s, watch_since=now)
    if pid is not None and pid != s.main_pid:
        s = replace(s, main_pid=pid, started_seconds=now)
    state = svc.health.state if svc is not None and svc.health is not None else None
    if state is HealthState.UP:
        if not s.seen_up or s.down_since is not None:
            s = replace(s, seen_up=True, down_since=None)
    elif state is not None and s.seen_up and s.down_since is None:
        s = replace(s, down_since=now)
    return s


def gate_on_kv(ctx: Ctx, s: ServiceState, sig: ServiceSignals | None) -> ServiceState:
    if disrupting(s):
        return s  # the action holds the front door closed until it ends
    if s.front_door.holder is FrontDoorHolder.FORECAST:
        return s  # held by the exhaustion forecast (preempt opens it)
    p = ctx.settings.policy
    kv = sig.kv_cache_usage_ratio if sig is not None else None
    if kv is None:
        return s  # missing data holds the gate where it is
    if s.front_door.open and kv >= p.kv_high_watermark_ratio:
        reason = f"KV cache usage {kv:.0%} at or above the high watermark {p.kv_high_watermark_ratio:.0%}"
        s = replace(
            s,
            front_door=s.front_door.closed(FrontDoorHolder.KV_PRESSURE, reason, ctx.now),
        )
        ctx.decide(
            s,
            DecisionKind.GATE,
            reason,
            cause=Cause.CONCURRENCY_OVERCOMMIT,
            evidence=("kv_cache_usage_ratio",),
            dry_run=gate_dry_run(p),
        )
    elif (
        not s.front_door.open
        and kv < p.kv_low_watermark_ratio
        and ctx.now - (s.front_door.closed_at if s.front_door.closed_at is not None else -math.inf)
        >= p.gate_min_closed_seconds
    ):
        reason = f"KV cache usage {kv:.0%} below the low watermark {p.kv_low_watermark_ratio:.0%}"
        s = replace(s, front_door=s.front_door.opened())
        ctx.decide(
            s,
            DecisionKind.UNGATE,
            reason,
            evidence=("kv_cache_usage_ratio",),
            dry_run=gate_dry_run(p),
        )
    return s


def capture_baseline(
    s: ServiceState, sig: ServiceSignals | None, cmdline: Sequence[str] | None, gpu_total: int
) -> ServiceState:
    """Record the operator's baseline once, while the guardian owns no flag and vLLM is up
    (so its reported gpu_memory_utilization and the GPU's size are known, not guessed)."""
    if s.levels.baseline is not None or s.levels.rungs or sig is None or not gpu_total:
        return s
    if (
        sig.gpu_memory_utilization_ratio is None
        and parse_launch_flags(cmdline or ()).gpu_memory_utilization_ratio is None
    ):
        return s
    return replace(s, levels=replace(s.levels, baseline=default_baseline(sig, cmdline, gpu_total)))


def instant_signal(signal: str) -> bool:
    """Alerts on log events only make an event visible for a while; the policy reads the
    events themselves (once), so those alerts are not evidence again and again."""
    return signal.startswith("log_events.")


def structure_of(
    s: ServiceState, sig: ServiceSignals | None, unit: UnitState | None, restarted: bool
) -> Structure:
    """This tick's structural view of the service. Nothing while an action of ours is under
    way: the failures it causes (the stop, the restart) agree with no log line. (An action
    waiting for a fleet permit has done nothing yet: what fails meanwhile is news.)"""
    if disrupting(s):
        return Structure()
    return Structure(
        health=sig.health_state if sig is not None else None,
        unit_active_state=unit.active_state if unit is not None and unit.unit else None,
        process_restarted=restarted,
        stalled=bool(sig is not None and (sig.stalled or sig.input_hung)),
        reset_class_xid=sig is not None
        and any(x in RESET_CLASS_XIDS for _, x, _ in sig.recent_xid_events),
    )


def remember(
    ctx: Ctx, s: ServiceState, new: Sequence[Evidence], structure: Structure, p: PolicyConfig
) -> ServiceState:
    """Hold this tick's log evidence, and let the structural signals agree with what is held.

    A log item counts (``agreed``) once :func:`corroborated` keeps it: a structural failure seen
    within :data:`CORROBORATION_SECONDS` of the line, before it or after it."""
    now = ctx.now
    failing = structural_failures(structure)
    if failing:
        s = replace(s, structural=failing, structural_at=now)
    recent = (
        s.structural
        if s.structural_at is not None and now - s.structural_at <= CORROBORATION_SECONDS
        else ()
    )
    kept = tuple(x for x in s.log_items if now - x.seen_at <= p.pressure_window_seconds)
    held = []
    items = []
    for x in (*kept, *(LogItem(e.cause, e.name, e.sentence, now) for e in new)):
        if not x.agreed and now - x.seen_at <= CORROBORATION_SECONDS:
            if corroborated([x.evidence()], recent):
                x = replace(x, agreed=recent)
            elif x.seen_at == now:
                held.append(x.name)
        items.append(x)
    if held:
        ctx.decide(
            s,
            DecisionKind.SUPPRESSED,
            f"vLLM's log says {', '.join(sorted(set(held)))}, but /health, its processes and "
            "the GPUs show no failure: a log line alone is not acted on (a request's text can "
            f"reach the log); held {CORROBORATION_SECONDS:.0f} s for one to agree",
            withheld=Withheld.UNCORROBORATED_LOG,
        )
    pending = tuple(items)
    return s if pending == s.log_items else replace(s, log_items=pending)


def filter_startup(
    s: ServiceState,
    sig: ServiceSignals | None,
    unit: UnitState | None,
    now: float,
    p: PolicyConfig,
    evidence: list[Evidence],
) -> list[Evidence]:
    """vLLM refuses connections for minutes while it loads: that is starting, not dead.

    The grace runs from the latest of: the guardian's first look (if vLLM was never seen up),
    a new main pid, and the moment vLLM went down (a supervisor with Restart=always brings it
    back). Log lines and an exited unit are never filtered.
    """
    refused = sig is None or sig.health_state in (HealthState.REFUSED, None)
    if not refused:
        return evidence
    starts = [t for t in (s.started_seconds, s.down_since) if t is not None]
    if not s.seen_up and s.watch_since is not None:
        starts.append(s.watch_since)
    activating = unit is not None and unit.active_state in ("activating", "reloading")
    starting = activating or (bool(starts) and now - max(starts) < p.startup_grace_seconds)
    if not starting:
        return evidence
    return [
        e
        for e in evidence
        if not (e.cause is Cause.ENGINE_DEAD and not e.name.startswith(("log:", "unit:")))
    ]


def track_episodes(
    s: ServiceState, findings: Sequence[Finding], now: float, p: PolicyConfig
) -> ServiceState:
    """An episode begins when a cause's evidence appears; pressure that persists for a whole
    cooldown without relief (the gate did not help) counts as a further episode."""
    causes = tuple(sorted({f.cause for f in findings}))
    started = {c: max((t for cc, t in s.episodes if cc is c), default=None) for c in causes}
    new = [
        c
        for c in causes
        if c not in s.active_causes
        or (started[c] is not None and now - started[c] >= max(p.cooldown_seconds, 1.0))  # type: ignore[operator]
    ]
    episodes = tuple((c, t) for c, t in s.episodes if now - t <= p.pressure_window_seconds)
    episodes += tuple((c, now) for c in new)
    return replace(
        s,
        active_causes=causes,
        episodes=episodes,
        last_pressure_seconds=now if causes else s.last_pressure_seconds,
    )


def track_running(
    s: ServiceState, sig: ServiceSignals | None, now: float, p: PolicyConfig
) -> ServiceState:
    """Keep vLLM's running count while KV thrash is active (within the pressure window)."""
    kept = tuple(x for x in s.running_samples if now - x[0] <= p.pressure_window_seconds)
    running = sig.requests_running if sig is not None else None
    if Cause.CONCURRENCY_OVERCOMMIT in s.active_causes and running is not None:
        kept = (*kept, (now, running))[-1024:]
    return s if kept == s.running_samples else replace(s, running_samples=kept)
