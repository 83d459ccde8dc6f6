"""The engines' signals (part of ``core/signals.derive_service``): counter rates per engine,
latency quantiles, KV usage and capacity, and the progress readings (stalled, requests that
never reached the scheduler, an operator's hold)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.budget import parse_startup_sizing
from vllm_guardian.core.progress import ProgressReading, quiet_seconds, unreached_seconds
from vllm_guardian.core.series import histogram_quantile, rate, sum_int, sum_opt, window_of
from vllm_guardian.core.signal_records import (
    LATENCY_HISTOGRAMS,
    QUANTILES,
    EngineSignals,
    LatencyQuantile,
    OperatorHold,
)
from vllm_guardian.model import (
    EngineMetrics,
    Histogram,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    VllmScrape,
    kv_usage_ratio,
)


def scrape_of(snap: Snapshot, name: str) -> VllmScrape | None:
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
    scrape = scrape_of(snap, service)
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
    first_scrape = next((s for snap in window if (s := scrape_of(snap, service)) is not None), None)
    last_scrape = scrape_of(window[-1], service)
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


def unreached_seconds_of(history: Sequence[Snapshot], service: str) -> float | None:
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


def operator_hold(
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


def _kv_capacity(caps: Sequence[int | None], logs: LogReading | None) -> dict[str, object]:
    """The KV pool's size in tokens and where it was read (:class:`ServiceSignals`). /metrics'
    cache_config_info first; where no engine has it, the engines' own start-up lines, one per
    engine (more or fewer lines than engines: which is which is unknown, and so is the pool)."""
    total = sum_int(caps)
    if total is not None:
        return {"kv_cache_capacity_tokens": total, "kv_cache_capacity_source": "cache_config_info"}
    unknown: dict[str, object] = {"kv_cache_capacity_tokens": None}
    if any(c is not None for c in caps) or logs is None or not logs.engine_kv_sizing:
        return unknown
    if len(logs.engine_kv_sizing) != len(caps):
        return unknown
    sizes = [parse_startup_sizing((m,)).kv_cache_size_tokens for _, m in logs.engine_kv_sizing]
    logged = sum_int(sizes)
    if logged is None:
        return unknown
    return {"kv_cache_capacity_tokens": logged, "kv_cache_capacity_source": "vLLM log"}


_kv_usage = kv_usage_ratio  # model.py: also summed once per scrape (VllmScrape.sums)


def engine_fields(
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
    hits = sum_opt([rates[k][2] for k in keys])
    queries = sum_opt([rates[k][3] for k in keys])
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
        if (s := scrape_of(snap, svc.name)) is not None and s.process_start_time_seconds is not None
    }
    stall = _stall_seconds(history, svc.name)
    fields.update(
        kv_cache_usage_ratio=_kv_usage(engines),
        requests_running=sum_opt([e.requests_running for e in engines]),
        requests_waiting=sum_opt([e.requests_waiting for e in engines]),
        requests_swapped=sum_opt([e.requests_swapped for e in engines]),
        preemptions_per_second=sum_opt([p.preemptions_per_second for p in per_engine]),
        generation_tokens_per_second=sum_opt([p.generation_tokens_per_second for p in per_engine]),
        prompt_tokens_per_second=sum_opt([rates[k][4] for k in keys]),
        request_failures_per_second=sum_opt([rates[k][5] for k in keys]),
        admission_rejections_per_second=rate(
            [
                (snap.time_seconds, total, s.process_start_time_seconds)
                for snap in rate_win
                if (s := scrape_of(snap, svc.name)) is not None
                and (total := s.admission_rejections_total) is not None
            ]
        ),
        prefix_cache_hit_ratio=prefix_ratio,
        stall_seconds=stall,
        stalled=None if stall is None else stall >= cfg.stall_seconds,
        counter_reset=len(starts) > 1,
        **_kv_capacity(caps, cur.logs),
        gpu_memory_utilization_ratio=utilization,
        latency=_latency(window_of(history, cfg.quantile_window_seconds), svc.name, keys),
        engines=tuple(per_engine),
    )
    return utilization
