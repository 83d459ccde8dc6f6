"""Derived signals: what the alert rules and the policy read, computed from snapshot history.

Where it sits: the first pure stage of the tick, right after collection. Input: the recent
snapshots (oldest first, the current one last), the service settings and the signal windows.
Output: one :class:`ServiceSignals` per service. No I/O, no clock: time comes from the
snapshots themselves.

Semantics worth knowing:

* Counter rates follow Prometheus ``rate()``: increases summed pairwise over the window, a
  decrease (or a changed ``process_start_time_seconds``) is a restart and counts from zero.
* Histogram quantiles follow ``histogram_quantile()`` over bucket deltas in the window.
* Across data-parallel engines, counts and rates add up; KV usage is the capacity-weighted
  mean when every engine's capacity is known, else the maximum (the conservative reading).
* GPU processes belong to a service when their pid is the unit's main pid or a descendant,
  or when they run in the unit's cgroup; everything else on the service's GPUs is "other".
* Missing data is ``None`` all the way through: a signal never turns blindness into zero.

This module keeps :func:`derive` and :func:`derive_service` and re-exports the public names;
the records are in ``core/signal_records.py``, the series math in ``core/series.py``, the
engines' part in ``core/engine_signals.py`` and the GPUs' in ``core/gpu_signals.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.allocator import allocator_fields
from vllm_guardian.core.capacity import (
    CapacitySample,
    CapacitySettings,
    estimate,
)
from vllm_guardian.core.engine_signals import (
    engine_fields,
    operator_hold,
    scrape_of,
    unreached_seconds_of,
)
from vllm_guardian.core.gpu_signals import belongs_to, gpu_fields, in_budget
from vllm_guardian.core.series import (
    first_from,
    histogram_quantile,
    increase,
    rate,
    slope,
    window_of,
)
from vllm_guardian.core.signal_records import (
    LATENCY_HISTOGRAMS,
    QUANTILES,
    EngineSignals,
    LatencyQuantile,
    OperatorHold,
    ServiceGpuSignals,
    ServiceSignals,
    Signals,
)
from vllm_guardian.model import (
    HealthState,
    LogEventKind,
    ServiceSnapshot,
    Snapshot,
)

__all__ = [
    "LATENCY_HISTOGRAMS",
    "QUANTILES",
    "EngineSignals",
    "LatencyQuantile",
    "OperatorHold",
    "ServiceGpuSignals",
    "ServiceSignals",
    "Signals",
    "belongs_to",
    "capacity_samples",
    "derive",
    "derive_service",
    "histogram_quantile",
    "in_budget",
    "increase",
    "rate",
    "slope",
]


def derive_service(
    history: Sequence[Snapshot], svc: ServiceConfig, cfg: SignalsConfig
) -> ServiceSignals:
    now_snap = history[-1]
    cur: ServiceSnapshot = now_snap.service(svc.name) or ServiceSnapshot(svc.name)
    health = cur.health.state if cur.health is not None else None
    scrape = cur.vllm
    base = ServiceSignals(
        service=svc.name,
        health_state=health,
        # Elastic EP scaling: neither up nor down (VllmEngineDead must not restart it).
        vllm_up=None if health in (None, HealthState.SCALING) else health is HealthState.UP,
        metrics_up=scrape is not None,
        stats_enabled=None if scrape is None else scrape.stats_enabled,
        log_events=cur.logs.counts if cur.logs is not None else (),
    )
    fields: dict[str, object] = {}
    rate_win = window_of(history, cfg.rate_window_seconds)
    utilization: float | None = None
    if scrape is not None and scrape.engines:
        utilization = engine_fields(history, rate_win, svc, cfg, cur, scrape, fields)
    unreached = unreached_seconds_of(history, svc.name)
    held, held_for, held_waiting = operator_hold(history, svc.name)
    fields.update(
        unreached_seconds=unreached,
        input_hung=None if unreached is None else unreached >= cfg.stall_seconds,
        held_by_operator=held,
        held_seconds=held_for,
        held_waiting_seconds=held_waiting,
    )
    fields["recent_log_events"] = _recent_log_events(history, cfg.rate_window_seconds, svc.name)
    cap = estimate(
        capacity_samples(window_of(history, cfg.capacity_window_seconds), svc.name),
        CapacitySettings(window_seconds=cfg.capacity_window_seconds),
    )
    fields.update(
        capacity=cap,
        capacity_demand_ratio=cap.demand_ratio,
        capacity_replicas_needed=cap.replicas_needed,
    )
    fields.update(allocator_fields(history, svc.name, cfg.rate_window_seconds))
    if now_snap.gpus is not None:
        fields.update(gpu_fields(history, rate_win, svc, cfg, cur, now_snap.gpus, utilization))
    return replace(base, **fields)  # type: ignore[arg-type]


def capacity_samples(window: Sequence[Snapshot], service: str) -> list[CapacitySample]:
    """What the capacity estimate reads from each snapshot: vLLM's counters and gauges summed
    over its engines (a snapshot without a scrape says so). Each snapshot's sample is computed
    once and kept in its memo: the window is read whole on every tick."""
    out = []
    key = ("capacity_sample", service)
    for snap in window:
        memo = snap.memo
        sample = memo.get(key)
        if sample is None:
            sample = memo[key] = _capacity_sample(snap, service)
        out.append(sample)
    return out


def _capacity_sample(snap: Snapshot, service: str) -> CapacitySample:
    scrape = scrape_of(snap, service)
    if scrape is None:
        return CapacitySample(snap.time_seconds, scraped=False)
    sums = scrape.sums
    svc = snap.service(service)
    gate = svc.gate if svc is not None and svc.gate is not None and svc.gate.reachable else None
    return CapacitySample(
        snap.time_seconds,
        scraped=True,
        stats_enabled=scrape.stats_enabled,
        process_start_seconds=scrape.process_start_time_seconds,
        finished_total=sums.finished_total,
        failed_total=sums.failed_total,
        prompt_tokens_total=sums.prompt_tokens_total,
        generation_tokens_total=sums.generation_tokens_total,
        running=sums.running,
        waiting=sums.waiting,
        kv_usage_ratio=sums.kv_usage_ratio,
        gate_queued=None if gate is None or gate.queued is None else float(gate.queued),
        gate_rejected_total=(
            None if gate is None or gate.rejected_total is None else gate.rejected_total
        ),
        gate_arrived_total=(
            None if gate is None or gate.arrived_total is None else float(gate.arrived_total)
        ),
        admission_rejected_total=scrape.admission_rejections_total,
    )


def _recent_log_events(
    history: Sequence[Snapshot], window_seconds: float, service: str
) -> tuple[tuple[LogEventKind, int], ...]:
    """Log events counted within the window, by kind.

    Each snapshot's new events are its cumulative count minus the previous snapshot's (a drop
    means the guardian restarted its counting). Before the first snapshot there were none: the
    guardian follows the journal from its own start.

    Only the window is read, and the last counts before it (the history is in time order, as
    :func:`window_of` says); a snapshot whose counts equal the previous ones adds nothing (every
    kind's difference is zero), so it is passed over with one comparison.
    """
    key = ("log_counts", service)

    def counts_of(snap: Snapshot) -> dict[LogEventKind, int] | None:
        memo = snap.memo
        if key in memo:
            return memo[key]  # type: ignore[no-any-return]
        svc = snap.service(service)
        counts = memo[key] = None if svc is None or svc.logs is None else dict(svc.logs.counts)
        return counts

    start = first_from(history, history[-1].time_seconds - window_seconds - 1e-9)
    first = next((i for i in range(start, len(history)) if counts_of(history[i]) is not None), None)
    if first is None:
        return ()  # no counts within the window (no journal followed): nothing counted
    prev: dict[LogEventKind, int] = {}
    for i in range(start - 1, -1, -1):
        before = counts_of(history[i])
        if before is not None:
            prev = before
            break
    out: dict[LogEventKind, int] = {}
    for i in range(first, len(history)):
        counts = counts_of(history[i])
        if counts is None:
            continue
        if counts != prev:
            for kind, count in counts.items():
                before_count = prev.get(kind, 0)
                new = count - before_count if count >= before_count else count
                if new > 0:
                    out[kind] = out.get(kind, 0) + new
        prev = counts
    return tuple(sorted(out.items()))


def derive(
    history: Sequence[Snapshot], services: Sequence[ServiceConfig], cfg: SignalsConfig
) -> Signals:
    """All services' signals for the newest snapshot in ``history`` (oldest first)."""
    if not history:
        raise ValueError("derive() needs at least the current snapshot")
    return Signals(
        history[-1].time_seconds, tuple(derive_service(history, s, cfg) for s in services)
    )
