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
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.allocator import AllocatorGpuSignals, allocator_fields, physical_gpu
from vllm_guardian.core.budget import parse_startup_sizing
from vllm_guardian.core.capacity import (
    CapacityEstimate,
    CapacitySample,
    CapacitySettings,
    estimate,
)
from vllm_guardian.core.forecast import (
    Forecast,
    ForecastSettings,
    MemorySample,
    Neighbour,
    forecast,
)
from vllm_guardian.core.progress import ProgressReading, quiet_seconds, unreached_seconds
from vllm_guardian.model import (
    Cause,
    EngineMetrics,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthState,
    Histogram,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    UnitState,
    VllmScrape,
    kv_usage_ratio,
)

QUANTILES = (0.5, 0.99)
LATENCY_HISTOGRAMS = {
    "ttft": "time_to_first_token",
    "e2e": "e2e_request_latency",
    "queue": "request_queue_time",
}


@dataclass(frozen=True)
class EngineSignals:
    model_name: str
    engine: str
    kv_cache_usage_ratio: float | None
    requests_running: float | None
    requests_waiting: float | None
    preemptions_per_second: float | None
    generation_tokens_per_second: float | None


@dataclass(frozen=True)
class ServiceGpuSignals:
    gpu: int
    service_memory_bytes: int | None
    other_memory_bytes: int | None
    budget_bytes: int | None  # gpu_memory_utilization × total: what vLLM planned to use
    free_bytes: int | None
    total_bytes: int | None


@dataclass(frozen=True)
class LatencyQuantile:
    metric: str  # ttft | e2e | queue
    quantile: float
    seconds: float


class OperatorHold(StrEnum):
    """What an operator did that stops vLLM's engine on purpose (never a hang, never restarted)."""

    ASLEEP = "asleep"  # POST /sleep: vllm:engine_sleep_state{sleep_state="awake"} 0
    PAUSED = "paused"  # POST /pause: GET /is_paused answers true


@dataclass(frozen=True)
class ServiceSignals:
    service: str
    health_state: HealthState | None
    vllm_up: bool | None  # /health answered 200
    metrics_up: bool  # /metrics was scraped this tick
    stats_enabled: bool | None  # False: --disable-log-stats, no vllm:* series
    kv_cache_usage_ratio: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    requests_swapped: float | None = None
    preemptions_per_second: float | None = None
    prompt_tokens_per_second: float | None = None
    generation_tokens_per_second: float | None = None
    request_failures_per_second: float | None = None
    # Requests vLLM itself answered 503 at its queue limits (vllm:admission_rejections_total,
    # --max-num-queued-reqs/-tokens), per second over the rate window; None: not exported.
    admission_rejections_per_second: float | None = None
    prefix_cache_hit_ratio: float | None = None
    # Requests in the engine and no progress (core/progress.py), for this long.
    stall_seconds: float | None = None
    stalled: bool | None = None
    # Requests the gate forwarded with no answer while the engine reported nothing in it, for
    # this long (core/progress.py, unreached_seconds): the engine core's input is lost.
    # ``input_hung`` past ``stall_seconds``. None without a gate.
    unreached_seconds: float | None = None
    input_hung: bool | None = None
    # An operator holds the server: "asleep" (/sleep) or "paused" (/pause); None: neither, or
    # unknown. Nothing is judged stalled or hung meanwhile. ``held_waiting_seconds``: how long
    # requests have waited through it (0: none wait).
    held_by_operator: OperatorHold | None = None
    held_seconds: float | None = None  # held for this long, as far back as the history sees
    held_waiting_seconds: float | None = None
    counter_reset: bool = False  # vLLM restarted within the rate window
    kv_cache_capacity_tokens: int | None = None
    # Where the pool's size was read: "cache_config_info" (/metrics), "vLLM log" (each engine's
    # start-up line, where /metrics has no cache_config_info: vLLM's Rust frontend); None with
    # the size: unknown.
    kv_cache_capacity_source: str | None = None
    gpu_memory_utilization_ratio: float | None = None
    latency: tuple[LatencyQuantile, ...] = ()
    engines: tuple[EngineSignals, ...] = ()
    gpus: tuple[ServiceGpuSignals, ...] = ()
    memory_budget_bytes: int | None = None
    service_memory_bytes: int | None = None
    memory_over_budget_bytes: int | None = None
    other_processes_memory_bytes: int | None = None
    # services[].gpu_memory_by_device: memory attributed by device, not by process (a pod)
    gpu_memory_by_device: bool = False
    headroom_bytes: int | None = None  # least free memory among the service's GPUs
    headroom_slope_bytes_per_second: float | None = None
    log_events: tuple[tuple[LogEventKind, int], ...] = ()  # cumulative since the guardian started
    # Matched log events within the rate window, by kind (counter increase, restarts handled).
    recent_log_events: tuple[tuple[LogEventKind, int], ...] = ()
    # XID events on the service's GPUs within the rate window: (gpu, xid, count).
    recent_xid_events: tuple[tuple[int, int, int], ...] = ()
    # The exhaustion forecast (core/forecast.py) of the service's most urgent GPU: seconds until
    # its free-memory floor reaches zero (None: no significant trend), and the bound to act on.
    seconds_to_headroom_exhaustion: float | None = None
    headroom_exhaustion_latest_seconds: float | None = None
    # Who takes the memory (None: the forecast alerts only), and the same forecast per cause so
    # rules can carry the cause: at most one of these is set.
    forecast_cause: Cause | None = None
    seconds_to_exhaustion_allocator_fragmentation: float | None = None
    seconds_to_exhaustion_gpu_memory_overcommit: float | None = None
    seconds_to_exhaustion_prefill_burst: float | None = None
    forecasts: tuple[Forecast, ...] = ()  # one per GPU with a trend
    # torch's caching allocator, from the in-vLLM plugin (core/allocator.py); None: no plugin.
    allocator: tuple[AllocatorGpuSignals, ...] = ()
    allocator_reserved_bytes: int | None = None
    allocator_allocated_bytes: int | None = None
    allocator_unallocated_bytes: int | None = None  # reserved − allocated
    allocator_fragmentation_ratio: float | None = None  # inactive-split / reserved, worst GPU
    allocator_retries_per_second: float | None = None
    allocator_recent_ooms: int | None = None  # num_ooms increase within the rate window
    # Over capacity? (core/capacity.py, over signals.capacity_window_seconds): demand ÷ what it
    # serves at saturation, and the replicas that would carry it; None when not measurable.
    capacity: CapacityEstimate | None = None
    capacity_demand_ratio: float | None = None
    capacity_replicas_needed: int | None = None

    def recent_log_count(self, kind: LogEventKind) -> int:
        return dict(self.recent_log_events).get(kind, 0)


@dataclass(frozen=True)
class Signals:
    time_seconds: float
    services: tuple[ServiceSignals, ...]

    def service(self, name: str) -> ServiceSignals | None:
        for s in self.services:
            if s.service == name:
                return s
        return None


# --- generic series math ---------------------------------------------------------------------


Point = tuple[float, float, float | None]  # (time, value, process start time)


def rate(points: Sequence[Point]) -> float | None:
    """Per-second increase of a counter, Prometheus-style (resets count from zero)."""
    if len(points) < 2:
        return None
    span = points[-1][0] - points[0][0]
    if span <= 0:
        return None
    return increase(points) / span


def increase(points: Sequence[Point]) -> float:
    total = 0.0
    for (_, prev, prev_start), (_, cur, cur_start) in itertools.pairwise(points):
        restarted = prev_start is not None and cur_start is not None and cur_start != prev_start
        total += cur if (cur < prev or restarted) else cur - prev
    return total


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (le, count) buckets, +Inf last."""
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le if len(buckets) > 1 else None
            if le <= 0:
                return le
            span = count - prev_count
            if span <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / span
        prev_le, prev_count = le, count
    return None


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope (value per second), like PromQL deriv(). Needs 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    if den <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / den


# --- per-service derivation ------------------------------------------------------------------


def _window(history: Sequence[Snapshot], seconds: float) -> Sequence[Snapshot]:
    """The snapshots from ``seconds`` before the newest on (the whole history when it is
    shorter). Found by bisection: a history is in time order (the daemon's steady clock; replay
    drops a record that goes backwards; :func:`vllm_guardian.core.step.trim` relies on it too),
    and the first snapshot at or after the cut is the one a scan from the oldest would find."""
    start = _first_from(history, history[-1].time_seconds - seconds - 1e-9)
    return history[start:] if start < len(history) else history


def _first_from(history: Sequence[Snapshot], cut: float) -> int:
    """The index of the first snapshot at or after ``cut`` (``len(history)``: none is)."""
    lo, hi = 0, len(history)
    while lo < hi:
        mid = (lo + hi) // 2
        if history[mid].time_seconds >= cut:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _scrape(snap: Snapshot, name: str) -> VllmScrape | None:
    svc = snap.service(name)
    return svc.vllm if svc is not None else None


# The counters whose rates the signals read, in the order _engine_rates returns them.
_RATE_FIELDS = (
    "preemptions_total",
    "generation_tokens_total",
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "prompt_tokens_total",
    "requests_failed_total",
)
_Counters = tuple[float, float | None, dict[tuple[str, str], tuple[float | None, ...]]]


def _counters(snap: Snapshot, service: str) -> _Counters | None:
    """A snapshot's (time, process start, each engine's _RATE_FIELDS) for the service; None
    without a scrape. Computed once per snapshot (its memo): every tick reads the window."""
    key = ("counters", service)
    memo = snap.memo
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    scrape = _scrape(snap, service)
    out: _Counters | None = None
    if scrape is not None:
        out = (
            snap.time_seconds,
            scrape.process_start_time_seconds,
            {e.key: tuple([getattr(e, f) for f in _RATE_FIELDS]) for e in scrape.engines},
        )
    memo[key] = out
    return out


_Steps = tuple[tuple[tuple[str, str], ...], tuple[float | None, ...]]


def _steps(snap: Snapshot, row: _Counters, before: _Counters, service: str) -> _Steps:
    """Each engine's increase of each of _RATE_FIELDS from the row ``before`` to ``snap``'s
    ``row``, counted as :func:`increase` counts one pair of points (a decrease or a new process
    start counts from zero): (the row's engines in order, the increases flat in that order, None
    where either row lacks the value). Kept in ``snap``'s memo with the row it was taken against:
    the same snapshot in another history, after another row, is counted afresh."""
    key = ("rate_steps", service)
    memo = snap.memo
    kept = memo.get(key)
    if kept is not None and kept[0] is before:
        return kept[1]  # type: ignore[no-any-return]
    _, prev_start, prev_by = before
    _, cur_start, cur_by = row
    restarted = prev_start is not None and cur_start is not None and cur_start != prev_start
    flat: list[float | None] = []
    absent = (None,) * len(_RATE_FIELDS)
    for engine_key, cur in cur_by.items():
        prev = prev_by.get(engine_key, absent)
        for c, p in zip(cur, prev, strict=True):
            if c is None or p is None:
                flat.append(None)
            else:
                flat.append(c if (c < p or restarted) else c - p)
    steps: _Steps = (tuple(cur_by), tuple(flat))
    memo[key] = (before, steps)
    return steps


def _kept_rates(
    window: Sequence[Snapshot], service: str, keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], tuple[float | None, ...]] | None:
    """:func:`_engine_rates` from the increases each snapshot keeps (:func:`_steps`), when every
    scrape in the window has the engines of ``keys``, in that order, each with every value (the
    steady state): each series is then every scrape of the window, and its increase the same
    sum of the same steps, added in the same order, as :func:`increase` adds them. None
    otherwise (an engine came or went, a value is missing): the caller reads point by point."""
    pairs = [(snap, c) for snap in window if (c := _counters(snap, service)) is not None]
    if len(pairs) < 2:
        return None
    order = tuple(keys)
    width = len(_RATE_FIELDS)
    acc: list[float] = [0.0] * (len(order) * width)
    for (_, before), (snap, row) in itertools.pairwise(pairs):
        row_order, flat = _steps(snap, row, before, service)
        if row_order != order or None in flat:
            return None
        acc = list(map(operator.add, acc, flat))  # no None: checked above
    span = pairs[-1][1][0] - pairs[0][1][0]
    if span <= 0:
        return dict.fromkeys(order, (None,) * width)
    return {
        k: tuple([v / span for v in acc[i * width : (i + 1) * width]]) for i, k in enumerate(order)
    }


def _engine_rates(
    window: Sequence[Snapshot], service: str, keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], tuple[float | None, ...]]:
    """Each engine's rate of each of _RATE_FIELDS over the window: for one engine and field,
    the points are the window's scrapes that have the engine and a value for the field."""
    kept = _kept_rates(window, service, keys)
    if kept is not None:
        return kept
    rows = [c for snap in window if (c := _counters(snap, service)) is not None]
    out: dict[tuple[str, str], tuple[float | None, ...]] = {}
    for key in keys:
        series = [(t, start, v) for t, start, by in rows if (v := by.get(key)) is not None]
        out[key] = tuple(
            [
                rate([(t, x, start) for t, start, v in series if (x := v[i]) is not None])
                for i in range(len(_RATE_FIELDS))
            ]
        )
    return out


def _sum_opt(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _histogram_delta(
    first: Histogram | None, last: Histogram | None, restarted: bool
) -> dict[float, float]:
    if last is None:
        return {}
    if first is None or restarted or (first.count or 0) > (last.count or 0):
        return dict(last.buckets)
    if len(first.buckets) == len(last.buckets) and all(
        a[0] == b[0] for a, b in zip(first.buckets, last.buckets, strict=True)
    ):
        # The same bounds (the common case): bucket by bucket, without a dict each.
        return {
            le: max(0.0, c - p) for (le, c), (_, p) in zip(last.buckets, first.buckets, strict=True)
        }
    cur = dict(last.buckets)
    prev = dict(first.buckets)
    return {le: max(0.0, c - prev.get(le, 0.0)) for le, c in cur.items()}


def _delta_columns(
    first_by: dict[tuple[str, str], EngineMetrics],
    last_by: dict[tuple[str, str], EngineMetrics],
    keys: Sequence[tuple[str, str]],
    attr: str,
    restarted: bool,
) -> tuple[tuple[float, ...], list[Sequence[float]]] | None:
    """:func:`_histogram_delta` of every engine as rows over one tuple of bounds; None when
    the engines' bounds differ (or repeat), which only the dict-per-engine way reads."""
    bounds: tuple[float, ...] | None = None
    rows: list[Sequence[float]] = []
    for key in keys:
        e = last_by.get(key)
        last: Histogram | None = getattr(e, attr) if e else None
        if last is None or not last.buckets:
            continue  # no delta: nothing to add
        last_bounds, last_counts = zip(*last.buckets, strict=True)
        if bounds is None:
            if len(set(last_bounds)) != len(last_bounds):
                return None
            bounds = last_bounds
        elif last_bounds != bounds:
            return None
        f = first_by.get(key)
        first: Histogram | None = getattr(f, attr) if f else None
        if first is None or restarted or (first.count or 0) > (last.count or 0):
            rows.append(last_counts)
            continue
        if not first.buckets:
            return None
        first_bounds, first_counts = zip(*first.buckets, strict=True)
        if first_bounds != bounds:
            return None
        rows.append(
            list(map(max, itertools.repeat(0.0), map(operator.sub, last_counts, first_counts)))
        )
    return ((), []) if bounds is None else (bounds, rows)


def _latency(
    window: Sequence[Snapshot], service: str, keys: Sequence[tuple[str, str]]
) -> tuple[LatencyQuantile, ...]:
    first_scrape = next((s for snap in window if (s := _scrape(snap, service)) is not None), None)
    last_scrape = _scrape(window[-1], service)
    if first_scrape is None or last_scrape is None or first_scrape is last_scrape:
        return ()
    restarted = (
        first_scrape.process_start_time_seconds is not None
        and last_scrape.process_start_time_seconds is not None
        and first_scrape.process_start_time_seconds != last_scrape.process_start_time_seconds
    )
    out: list[LatencyQuantile] = []
    # One index per scrape, not a scan of the engine list per engine (quadratic: 8,000 engines
    # made a tick take 22 s).
    first_by = {e.key: e for e in first_scrape.engines}
    last_by = {e.key: e for e in last_scrape.engines}
    for metric, attr in LATENCY_HISTOGRAMS.items():
        columns = _delta_columns(first_by, last_by, keys, attr, restarted)
        if columns is not None:
            # Every engine's buckets have the same bounds (the common case): the same sums,
            # added in the same order, a column at a time.
            bounds, rows = columns
            acc = [0.0] * len(bounds)
            for row in rows:
                acc = list(map(operator.add, acc, row))
            buckets = sorted(zip(bounds, acc, strict=True))
        else:
            summed: dict[float, float] = {}
            for key in keys:
                f, last = first_by.get(key), last_by.get(key)
                delta = _histogram_delta(
                    getattr(f, attr) if f else None,
                    getattr(last, attr) if last else None,
                    restarted,
                )
                for le, c in delta.items():
                    summed[le] = summed.get(le, 0.0) + c
            buckets = sorted(summed.items())
        for q in QUANTILES:
            v = histogram_quantile(q, buckets)
            if v is not None:
                out.append(LatencyQuantile(metric, q, v))
    return tuple(out)


def _progress_reading(snap: Snapshot, service: str) -> ProgressReading | None:
    """The snapshot's reading of the engine's progress (core/progress.py), once per snapshot
    (its memo): a stall is read back through the history on every tick."""
    key = ("progress", service)
    memo = snap.memo
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    svc = snap.service(service)
    scrape = svc.vllm if svc is not None else None
    paused = svc.health.paused if svc is not None and svc.health is not None else None
    reading = memo[key] = None if scrape is None else ProgressReading.of(scrape, paused)
    return reading


def _stall_seconds(history: Sequence[Snapshot], service: str) -> float | None:
    """How long requests have been in the engine (waiting or running) while the engine made no
    progress (:func:`vllm_guardian.core.progress.moved`): the hang `/health` does not see (0
    when not stalled, None when unknown). A gap in observation ends what can be vouched for."""
    return quiet_seconds(
        (snap.time_seconds, _progress_reading(snap, service)) for snap in reversed(history)
    )


def _unreached_seconds(history: Sequence[Snapshot], service: str) -> float | None:
    """How long requests the gate forwarded have had no answer while the engine reported
    nothing in it (:func:`vllm_guardian.core.progress.unreached_seconds`): the hang that looks
    idle. None without a gate that says (none configured, unreachable, an older gate)."""
    svc = history[-1].service(service)
    gate = svc.gate if svc is not None else None
    if gate is None or not gate.reachable:
        return None
    return unreached_seconds(
        gate.oldest_unanswered_seconds,
        ((snap.time_seconds, _progress_reading(snap, service)) for snap in reversed(history)),
    )


def _operator_hold(
    history: Sequence[Snapshot], service: str
) -> tuple[OperatorHold | None, float | None, float | None]:
    """Whether an operator holds the server asleep (``vllm:engine_sleep_state``) or paused
    (``/is_paused``) now, since when, and for how long requests have waited through it: the
    hold or None; the seconds back to the first snapshot of the run of held snapshots; and the
    seconds back to the first of those with requests waiting all along (in the engine, or held
    or unanswered at the gate), 0 when none wait now."""
    state = _held_state(history[-1], service)
    if state is None:
        return None, None, None
    now = history[-1].time_seconds
    held_since = waiting_since = now
    waiting = True
    for snap in reversed(history):
        if _held_state(snap, service) is None:
            break
        held_since = snap.time_seconds
        waiting = waiting and _requests_wait(snap, service)
        if waiting:
            waiting_since = snap.time_seconds
    if not _requests_wait(history[-1], service):
        return state, now - held_since, 0.0
    return state, now - held_since, now - waiting_since


def _held_state(snap: Snapshot, service: str) -> OperatorHold | None:
    svc = snap.service(service)
    if svc is None:
        return None
    if svc.vllm is not None and any(e.asleep for e in svc.vllm.engines):
        return OperatorHold.ASLEEP
    if svc.health is not None and svc.health.paused:
        return OperatorHold.PAUSED
    return None


def _requests_wait(snap: Snapshot, service: str) -> bool:
    svc = snap.service(service)
    if svc is None:
        return False
    inside = svc.vllm is not None and any(
        (e.requests_running or 0.0) + (e.requests_waiting or 0.0) > 0 for e in svc.vllm.engines
    )
    gate = svc.gate
    at_gate = (
        gate is not None
        and gate.reachable
        and ((gate.queued or 0) > 0 or (gate.unanswered or 0) > 0)
    )
    return inside or at_gate


def belongs_to(proc: GpuProcess, unit: UnitState | None) -> bool:
    if unit is None:
        return False
    pids = set(unit.pids)
    if unit.main_pid is not None:
        pids.add(unit.main_pid)
    if proc.pid in pids or any(a in pids for a in proc.ancestors):
        return True
    cg = unit.control_group
    if cg and cg != "/" and proc.cgroup:
        return proc.cgroup == cg or proc.cgroup.startswith(cg.rstrip("/") + "/")
    return False


def in_budget(proc: GpuProcess, unit: UnitState | None) -> bool:
    """Whether ``proc``'s GPU memory counts as the service's: its own processes, and vLLM's
    weight-cache daemon (``vllm preload``), whose weights vLLM subtracts from the budget of an
    engine started with ``--load-format ipc_cache``: never a hostile neighbour. Which GPUs are
    the service's is still told by its own processes only (:func:`belongs_to`)."""
    return proc.weight_cache or belongs_to(proc, unit)


def _service_gpus(
    devices: Sequence[GpuDevice], svc: ServiceConfig, unit: UnitState | None
) -> list[GpuDevice]:
    if svc.gpus is not None:
        wanted = set(svc.gpus)
        return [d for d in devices if d.index in wanted]
    if svc.gpu_memory_by_device:  # a pod: every GPU it sees is its own
        return list(devices)
    return [d for d in devices if d.processes and any(belongs_to(p, unit) for p in d.processes)]


def _gpu_signals(
    devices: Sequence[GpuDevice],
    unit: UnitState | None,
    utilization: float | None,
    by_device: bool = False,
) -> tuple[ServiceGpuSignals, ...]:
    out = []
    for d in devices:
        mine: int | None = None
        other: int | None = None
        if by_device:
            # NVML's pids are the host's (services[].gpu_memory_by_device): the device's
            # memory in use is the service's, nobody else's.
            mine, other = d.memory_used_bytes, 0
        elif d.processes is not None:
            mine_sum = other_sum = 0
            unknown = False
            for p in d.processes:
                if p.used_memory_bytes is None:
                    unknown = True
                    continue
                if in_budget(p, unit):
                    mine_sum += p.used_memory_bytes
                else:
                    other_sum += p.used_memory_bytes
            mine = None if unknown and mine_sum == 0 else mine_sum
            other = other_sum
        budget = (
            int(utilization * d.memory_total_bytes)
            if utilization is not None and d.memory_total_bytes is not None
            else None
        )
        out.append(
            ServiceGpuSignals(
                d.index, mine, other, budget, d.memory_free_bytes, d.memory_total_bytes
            )
        )
    return tuple(out)


def _kv_capacity(caps: Sequence[int | None], logs: LogReading | None) -> dict[str, object]:
    """The KV pool's size in tokens and where it was read (:class:`ServiceSignals`). /metrics'
    cache_config_info first; where no engine has it, the engines' own start-up lines, one per
    engine (more or fewer lines than engines: which is which is unknown, and so is the pool)."""
    total = _sum_int(caps)
    if total is not None:
        return {"kv_cache_capacity_tokens": total, "kv_cache_capacity_source": "cache_config_info"}
    unknown: dict[str, object] = {"kv_cache_capacity_tokens": None}
    if any(c is not None for c in caps) or logs is None or not logs.engine_kv_sizing:
        return unknown
    if len(logs.engine_kv_sizing) != len(caps):
        return unknown
    sizes = [parse_startup_sizing((m,)).kv_cache_size_tokens for _, m in logs.engine_kv_sizing]
    logged = _sum_int(sizes)
    if logged is None:
        return unknown
    return {"kv_cache_capacity_tokens": logged, "kv_cache_capacity_source": "vLLM log"}


def _sum_int(values: Sequence[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


def _kept_headroom(snap: Snapshot, indices: set[int], frozen: frozenset[int]) -> int | None:
    """:func:`_headroom`, computed once per snapshot and set of GPUs (``frozen``: the same
    indices, as the memo's key): the slope's window is read whole on every tick."""
    key = ("headroom", frozen)
    memo = snap.memo
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    h = memo[key] = _headroom(snap, indices)
    return h


def _headroom(snap: Snapshot, indices: set[int]) -> int | None:
    if snap.gpus is None or not indices:
        return None
    free = [d.memory_free_bytes for d in snap.gpus.devices if d.index in indices]
    if not free or any(f is None for f in free):
        return None
    return min(f for f in free if f is not None)


_kv_usage = kv_usage_ratio  # model.py: also summed once per scrape (VllmScrape.sums)


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
    rate_win = _window(history, cfg.rate_window_seconds)
    utilization: float | None = None
    if scrape is not None and scrape.engines:
        utilization = _engine_fields(history, rate_win, svc, cfg, cur, scrape, fields)
    unreached = _unreached_seconds(history, svc.name)
    held, held_for, held_waiting = _operator_hold(history, svc.name)
    fields.update(
        unreached_seconds=unreached,
        input_hung=None if unreached is None else unreached >= cfg.stall_seconds,
        held_by_operator=held,
        held_seconds=held_for,
        held_waiting_seconds=held_waiting,
    )
    fields["recent_log_events"] = _recent_log_events(history, cfg.rate_window_seconds, svc.name)
    cap = estimate(
        capacity_samples(_window(history, cfg.capacity_window_seconds), svc.name),
        CapacitySettings(window_seconds=cfg.capacity_window_seconds),
    )
    fields.update(
        capacity=cap,
        capacity_demand_ratio=cap.demand_ratio,
        capacity_replicas_needed=cap.replicas_needed,
    )
    fields.update(allocator_fields(history, svc.name, cfg.rate_window_seconds))
    if now_snap.gpus is not None:
        fields.update(_gpu_fields(history, rate_win, svc, cfg, cur, now_snap.gpus, utilization))
    return replace(base, **fields)  # type: ignore[arg-type]


def _engine_fields(
    history: Sequence[Snapshot],
    rate_win: Sequence[Snapshot],
    svc: ServiceConfig,
    cfg: SignalsConfig,
    cur: ServiceSnapshot,
    scrape: VllmScrape,
    fields: dict[str, object],
) -> float | None:
    """The engines' signals (part of :func:`derive_service`), into ``fields``; returns the
    gpu_memory_utilization vLLM reports it runs with (None: not reported)."""
    engines = scrape.engines
    keys = [e.key for e in engines]
    rates = _engine_rates(rate_win, svc.name, keys)  # in the order of _RATE_FIELDS
    per_engine = []
    for e in engines:
        r = rates[e.key]
        per_engine.append(
            EngineSignals(
                e.model_name,
                e.engine,
                e.kv_cache_usage_ratio,
                e.requests_running,
                e.requests_waiting,
                r[0],
                r[1],
            )
        )
    hits = _sum_opt([rates[k][2] for k in keys])
    queries = _sum_opt([rates[k][3] for k in keys])
    if queries:
        prefix_ratio: float | None = (hits or 0.0) / queries
    else:
        v0 = [e.prefix_cache_hit_ratio for e in engines if e.prefix_cache_hit_ratio is not None]
        prefix_ratio = sum(v0) / len(v0) if v0 else None
    caps = [e.cache_config.capacity_tokens if e.cache_config else None for e in engines]
    utils = [
        e.cache_config.gpu_memory_utilization_ratio
        for e in engines
        if e.cache_config and e.cache_config.gpu_memory_utilization_ratio is not None
    ]
    utilization = max(utils) if utils else None
    starts = {
        s.process_start_time_seconds
        for snap in rate_win
        if (s := _scrape(snap, svc.name)) is not None and s.process_start_time_seconds is not None
    }
    stall = _stall_seconds(history, svc.name)
    fields.update(
        kv_cache_usage_ratio=_kv_usage(engines),
        requests_running=_sum_opt([e.requests_running for e in engines]),
        requests_waiting=_sum_opt([e.requests_waiting for e in engines]),
        requests_swapped=_sum_opt([e.requests_swapped for e in engines]),
        preemptions_per_second=_sum_opt([p.preemptions_per_second for p in per_engine]),
        generation_tokens_per_second=_sum_opt([p.generation_tokens_per_second for p in per_engine]),
        prompt_tokens_per_second=_sum_opt([rates[k][4] for k in keys]),
        request_failures_per_second=_sum_opt([rates[k][5] for k in keys]),
        admission_rejections_per_second=rate(
            [
                (snap.time_seconds, total, s.process_start_time_seconds)
                for snap in rate_win
                if (s := _scrape(snap, svc.name)) is not None
                and (total := s.admission_rejections_total) is not None
            ]
        ),
        prefix_cache_hit_ratio=prefix_ratio,
        stall_seconds=stall,
        stalled=None if stall is None else stall >= cfg.stall_seconds,
        counter_reset=len(starts) > 1,
        **_kv_capacity(caps, cur.logs),
        gpu_memory_utilization_ratio=utilization,
        latency=_latency(_window(history, cfg.quantile_window_seconds), svc.name, keys),
        engines=tuple(per_engine),
    )
    return utilization


def _gpu_fields(
    history: Sequence[Snapshot],
    rate_win: Sequence[Snapshot],
    svc: ServiceConfig,
    cfg: SignalsConfig,
    cur: ServiceSnapshot,
    gpus_seen: GpuReading,
    utilization: float | None,
) -> dict[str, object]:
    """The service's GPUs' signals (part of :func:`derive_service`): memory, headroom, XIDs
    and the exhaustion forecast."""
    fields: dict[str, object] = {}
    devices = _service_gpus(gpus_seen.devices, svc, cur.unit)
    gpus = _gpu_signals(devices, cur.unit, utilization, svc.gpu_memory_by_device)
    indices = {d.index for d in devices}
    service_mem = _sum_int([g.service_memory_bytes for g in gpus]) if gpus else None
    budget = _sum_int([g.budget_bytes for g in gpus]) if gpus else None
    frozen = frozenset(indices)
    slope_points = [
        (snap.time_seconds, float(h))
        for snap in _window(history, cfg.slope_window_seconds)
        if (h := _kept_headroom(snap, indices, frozen)) is not None
    ]
    fields.update(
        gpus=gpus,
        gpu_memory_by_device=svc.gpu_memory_by_device,
        memory_budget_bytes=budget,
        service_memory_bytes=service_mem,
        memory_over_budget_bytes=(
            max(0, service_mem - budget) if service_mem is not None and budget is not None else None
        ),
        other_processes_memory_bytes=_sum_int([g.other_memory_bytes for g in gpus])
        if gpus
        else None,
        headroom_bytes=_headroom(history[-1], indices),
        headroom_slope_bytes_per_second=slope(slope_points),
        recent_xid_events=_recent_xids(rate_win, indices),
    )
    fields.update(_forecast_fields(history, svc, cfg, sorted(indices), utilization))
    return fields


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
    scrape = _scrape(snap, service)
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
        admission_rejected_total=scrape.admission_rejections_total,
    )


def forecast_settings(cfg: SignalsConfig) -> ForecastSettings:
    return ForecastSettings(
        interval_seconds=cfg.forecast_interval_seconds,
        min_intervals=cfg.forecast_min_intervals,
        min_span_seconds=cfg.forecast_min_span_seconds,
        max_gap_seconds=cfg.forecast_max_gap_seconds,
    )


def _memory_columns(
    history: Sequence[Snapshot], service: str, gpus: Sequence[int], utilization: float | None
) -> dict[int, list[MemorySample]]:
    """Each GPU of a service, per snapshot, as the forecast reads it (None: not observed), in
    one pass over the snapshots: each snapshot keeps its row (one sample per GPU) in its memo,
    computed once (the window is read whole on every tick), and the rows are turned into
    columns."""
    order = tuple(gpus)
    key = ("memory_samples", service, utilization, order)
    rows = []
    for snap in history:
        memo = snap.memo
        row = memo.get(key)
        if row is None:
            row = memo[key] = tuple(
                [_memory_sample(snap, service, gpu, utilization) for gpu in order]
            )
        rows.append(row)
    if not rows:
        return {gpu: [] for gpu in order}
    columns = zip(*rows, strict=True)
    return {gpu: list(column) for gpu, column in zip(order, columns, strict=True)}


def _memory_sample(
    snap: Snapshot, service: str, gpu: int, utilization: float | None
) -> MemorySample:
    svc = snap.service(service) or ServiceSnapshot(service)
    unit = svc.unit
    ready = svc.health is not None and svc.health.state is HealthState.UP
    generation: float | None = None
    if svc.vllm is not None and svc.vllm.process_start_time_seconds is not None:
        generation = svc.vllm.process_start_time_seconds
    elif unit is not None and unit.main_pid is not None:
        generation = float(unit.main_pid)
    dev = next((d for d in snap.gpus.devices if d.index == gpu), None) if snap.gpus else None
    free = dev.memory_free_bytes if dev is not None else None
    mine: int | None = None
    other: int | None = None
    neighbours: tuple[Neighbour, ...] = ()
    if dev is not None and dev.processes is not None:
        procs = [p for p in dev.processes if p.used_memory_bytes is not None]
        mine = sum(p.used_memory_bytes or 0 for p in procs if in_budget(p, unit))
        others = [p for p in procs if not in_budget(p, unit)]
        other = sum(p.used_memory_bytes or 0 for p in others)
        neighbours = tuple(Neighbour(p.pid, p.used_memory_bytes, p.name, p.cgroup) for p in others)
    reserved: int | None = None
    allocated: int | None = None
    if svc.allocator is not None and svc.allocator.processes:
        recs = [
            r
            for proc in svc.allocator.processes
            for r in proc.devices
            if physical_gpu(r, snap.gpus) == gpu
        ]
        if recs:
            reserved = sum(r.reserved_bytes for r in recs)
            allocated = sum(r.allocated_bytes for r in recs)
    budget = (
        int(utilization * dev.memory_total_bytes)
        if utilization is not None and dev is not None and dev.memory_total_bytes is not None
        else None
    )
    return MemorySample(
        time_seconds=snap.time_seconds,
        free_bytes=free,
        ready=ready,
        generation=generation,
        service_bytes=mine,
        other_bytes=other,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        budget_bytes=budget,
        neighbours=neighbours,
    )


_CAUSE_FIELDS = {
    Cause.ALLOCATOR_FRAGMENTATION: "seconds_to_exhaustion_allocator_fragmentation",
    Cause.GPU_MEMORY_OVERCOMMIT: "seconds_to_exhaustion_gpu_memory_overcommit",
    Cause.PREFILL_BURST: "seconds_to_exhaustion_prefill_burst",
}


def _forecast_fields(
    history: Sequence[Snapshot],
    svc: ServiceConfig,
    cfg: SignalsConfig,
    gpus: Sequence[int],
    utilization: float | None,
) -> dict[str, object]:
    window = _window(history, cfg.forecast_window_seconds)
    settings = forecast_settings(cfg)
    now = history[-1].time_seconds
    columns = _memory_columns(window, svc.name, gpus, utilization)
    found = [f for gpu in gpus if (f := forecast(gpu, columns[gpu], now, settings)) is not None]
    if not found:
        return {}
    worst = min(found, key=lambda f: f.seconds)
    fields: dict[str, object] = {
        "forecasts": tuple(found),
        "seconds_to_headroom_exhaustion": worst.seconds,
        "headroom_exhaustion_latest_seconds": worst.seconds_latest,
        "forecast_cause": worst.cause,
    }
    if worst.cause in _CAUSE_FIELDS:
        fields[_CAUSE_FIELDS[worst.cause]] = worst.seconds
    return fields


def _recent_log_events(
    history: Sequence[Snapshot], window_seconds: float, service: str
) -> tuple[tuple[LogEventKind, int], ...]:
    """Log events counted within the window, by kind.

    Each snapshot's new events are its cumulative count minus the previous snapshot's (a drop
    means the guardian restarted its counting). Before the first snapshot there were none: the
    guardian follows the journal from its own start.

    Only the window is read, and the last counts before it (the history is in time order, as
    :func:`_window` says); a snapshot whose counts equal the previous ones adds nothing (every
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

    start = _first_from(history, history[-1].time_seconds - window_seconds - 1e-9)
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


def _recent_xids(window: Sequence[Snapshot], gpus: set[int]) -> tuple[tuple[int, int, int], ...]:
    counts: dict[tuple[int, int], int] = {}
    for snap in window:
        for ev in snap.gpus.xid_events if snap.gpus is not None else ():
            if not gpus or ev.gpu_index in gpus:
                counts[(ev.gpu_index, ev.xid)] = counts.get((ev.gpu_index, ev.xid), 0) + 1
    return tuple(sorted((g, x, n) for (g, x), n in counts.items()))


def derive(
    history: Sequence[Snapshot], services: Sequence[ServiceConfig], cfg: SignalsConfig
) -> Signals:
    """All services' signals for the newest snapshot in ``history`` (oldest first)."""
    if not history:
        raise ValueError("derive() needs at least the current snapshot")
    return Signals(
        history[-1].time_seconds, tuple(derive_service(history, s, cfg) for s in services)
    )
