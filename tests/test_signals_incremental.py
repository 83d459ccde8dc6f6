"""Signals computed from what each snapshot keeps in its memo (core/signals.py: the counters
and the per-snapshot samples) are the signals computed afresh: the daemon derives every tick
over a history whose older snapshots were read before, and whatever changed between two
scrapes must show exactly as it would in a history read for the first time."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import engine_signals, series
from vllm_guardian.core import signals as sig
from vllm_guardian.model import (
    EngineMetrics,
    GpuDevice,
    GpuReading,
    HealthProbe,
    HealthState,
    Histogram,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    VllmScrape,
)

SVC = ServiceConfig(name="vllm")
CFG = SignalsConfig(
    rate_window_seconds=10, quantile_window_seconds=10, slope_window_seconds=20, stall_seconds=6,
    capacity_window_seconds=20,
)  # fmt: skip
INF = float("inf")


def engine(name: str, t: float, scale: float = 1.0, **kw: object) -> EngineMetrics:
    """An engine under load at time t: every counter moves, the histograms fill."""
    n = t * scale
    fields: dict[str, object] = {
        "requests_running": 3.0,
        "requests_waiting": 1.0,
        "kv_cache_usage_ratio": 0.5,
        "preemptions_total": n // 3,
        "prompt_tokens_total": 100 * n,
        "generation_tokens_total": 37 * n + 0.5,
        "prefix_cache_queries_total": 50 * n,
        "prefix_cache_hits_total": 20 * n,
        "requests_finished_total": 2 * n,
        "requests_failed_total": n // 4,
        "time_to_first_token": Histogram(((0.1, n), (1.0, 2 * n), (INF, 2 * n)), n, 2 * n),
        "e2e_request_latency": Histogram(((1.0, n), (INF, 2 * n)), 3 * n, 2 * n),
    }
    fields.update(kw)
    return EngineMetrics("m", name, **fields)  # type: ignore[arg-type]


def snap(
    t: float, *engines: EngineMetrics, start: float | None = 1.0, ooms: int | None = None
) -> Snapshot:
    scrape = VllmScrape(engines, True, start, 1) if engines else None
    logs = None if ooms is None else LogReading(((LogEventKind.CUDA_OOM, ooms),), (), 0)
    health = HealthProbe(HealthState.UP, 200, 0.01)
    return Snapshot(t, (ServiceSnapshot("vllm", vllm=scrape, health=health, logs=logs),), None)


def steady(t: float) -> Snapshot:
    return snap(t, engine("0", t), engine("1", t, 2.0))


# name → the history, one snapshot per 2 s tick
HISTORIES: dict[str, list[Snapshot]] = {
    "steady load on two engines": [steady(t) for t in range(0, 40, 2)],
    "an engine joins": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("0", t), engine("1", t, 2.0), engine("2", t)) for t in range(20, 40, 2)],
    "an engine leaves": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("0", t)) for t in range(20, 40, 2)],
    "an engine leaves and comes back": [steady(t) for t in range(0, 12, 2)]
    + [snap(t, engine("0", t)) for t in range(12, 18, 2)]
    + [steady(t) for t in range(18, 40, 2)],
    "a scrape is missing": [steady(t) for t in range(0, 14, 2)]
    + [snap(14)]
    + [steady(t) for t in range(16, 40, 2)],
    "counters reset (a restart: a new start time)": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("0", t - 20), engine("1", t - 20, 2.0), start=2.0) for t in range(20, 40, 2)],
    "counters go down without a new start time": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("0", t - 19), engine("1", t - 19)) for t in range(20, 40, 2)],
    "a counter disappears then returns": [steady(t) for t in range(0, 12, 2)]
    + [snap(t, engine("0", t, preemptions_total=None), engine("1", t)) for t in range(12, 20, 2)]
    + [steady(t) for t in range(20, 40, 2)],
    "log events arrive, the count restarts, the journal goes away": [
        snap(t, engine("0", t), ooms=c)
        for t, c in zip(
            range(0, 40, 2), [0, 0, 1, 1, 3, 3, 3, 0, 1, 1, None, None, 2] + [2] * 7, strict=True
        )
    ],
    "histogram bounds change": [steady(t) for t in range(0, 20, 2)]
    + [
        snap(t, engine("0", t, e2e_request_latency=Histogram(((0.5, t), (INF, t)), t, t)))
        for t in range(20, 40, 2)
    ],
}


GIB = 1024**3
SVC_GPUS = ServiceConfig(name="vllm", gpus=(0, 1))


def on_gpus(t: float, *free_gib: float | None) -> Snapshot:
    """``steady(t)`` with GPUs 0.. holding ``free_gib`` free (None: not read)."""
    devices = tuple(
        GpuDevice(i, f"GPU-{i}", "H100", 80 * GIB, None, None if f is None else int(f * GIB))
        for i, f in enumerate(free_gib)
    )
    return dataclasses.replace(steady(t), gpus=GpuReading(devices))


# name → a history over the GPUs of SVC_GPUS
GPU_HISTORIES: dict[str, list[Snapshot]] = {
    "headroom falls, a GPU is not read, a GPU goes away": [
        on_gpus(t, 40 - t / 2, 30.0) for t in range(0, 20, 2)
    ]
    + [on_gpus(20, 30.0, None), on_gpus(22, 29.0)]
    + [on_gpus(t, 40 - t, 20 + t / 4) for t in range(24, 40, 2)],
}


def fresh(history: list[Snapshot]) -> list[Snapshot]:
    """The same snapshots as new objects: nothing kept in a memo."""
    return [dataclasses.replace(s) for s in history]


@pytest.mark.parametrize("name", list(HISTORIES))
def test_every_tick_over_a_kept_history_matches_a_fresh_one(name: str) -> None:
    history = HISTORIES[name]
    for i in range(1, len(history) + 1):
        kept = sig.derive(history[:i], [SVC], CFG)  # memos filled by the ticks before
        assert kept == sig.derive(fresh(history[:i]), [SVC], CFG), f"tick {i - 1} ({name})"


@pytest.mark.parametrize("name", list(GPU_HISTORIES))
def test_gpu_signals_over_a_kept_history_match_a_fresh_one(name: str) -> None:
    history = GPU_HISTORIES[name]
    for i in range(1, len(history) + 1):
        kept = sig.derive(history[:i], [SVC_GPUS], CFG)
        assert kept == sig.derive(fresh(history[:i]), [SVC_GPUS], CFG), f"tick {i - 1} ({name})"
    assert kept.services[0].headroom_slope_bytes_per_second is not None


def test_a_snapshot_read_in_two_histories_gives_each_its_own_signals() -> None:
    """The memo holds what one snapshot says, never what its neighbours in one history said:
    the same snapshots in another history (every other tick) read as that history."""
    history = HISTORIES["an engine leaves and comes back"]
    for i in range(1, len(history) + 1):
        sig.derive(history[:i], [SVC], CFG)
    sparse = history[::2]
    assert sig.derive(sparse, [SVC], CFG) == sig.derive(fresh(sparse), [SVC], CFG)


def test_rates_follow_the_counters() -> None:
    """Not only equal to a fresh read: right (the steady history's rates, by hand)."""
    s = sig.derive(HISTORIES["steady load on two engines"], [SVC], CFG).services[0]
    assert s.prompt_tokens_per_second == pytest.approx(100 + 200)
    assert s.generation_tokens_per_second == pytest.approx(37 + 74)
    assert s.prefix_cache_hit_ratio == pytest.approx(20 / 50)


def _latency_by_dicts(
    first: VllmScrape, last: VllmScrape, restarted: bool
) -> tuple[sig.LatencyQuantile, ...]:
    """The latency quantiles as the signals computed them before the column-wise sums: a dict
    of bucket deltas per engine, summed by bound (the specification the fast way must meet)."""
    out = []
    first_by = {e.key: e for e in first.engines}
    for metric, attr in sig.LATENCY_HISTOGRAMS.items():
        summed: dict[float, float] = {}
        for e in last.engines:
            f = first_by.get(e.key)
            cur_h, prev_h = getattr(e, attr), getattr(f, attr) if f else None
            if cur_h is None:
                continue
            cur = dict(cur_h.buckets)
            if prev_h is None or restarted or (prev_h.count or 0) > (cur_h.count or 0):
                delta = cur
            else:
                prev = dict(prev_h.buckets)
                delta = {le: max(0.0, c - prev.get(le, 0.0)) for le, c in cur.items()}
            for le, c in delta.items():
                summed[le] = summed.get(le, 0.0) + c
        for q in sig.QUANTILES:
            v = sig.histogram_quantile(q, sorted(summed.items()))
            if v is not None:
                out.append(sig.LatencyQuantile(metric, q, v))
    return tuple(out)


def _h(*counts: float, bounds: tuple[float, ...] = (0.1, 0.5, 1.0, INF)) -> Histogram:
    return Histogram(tuple(zip(bounds, counts, strict=True)), None, counts[-1])


LATENCY_CASES = {
    "same bounds everywhere": (
        [_h(1, 2, 3, 4), _h(0, 1, 1, 2)],
        [_h(2, 5, 9, 9.5), _h(1, 1, 3, 7)],
    ),
    "an engine's counts go down (reset)": (
        [_h(5, 6, 7, 8), _h(1, 1, 1, 1)],
        [_h(1, 2, 3, 4), _h(2, 2, 3, 3)],
    ),
    "a bucket goes down while the count goes up": ([_h(3, 3, 3, 3)], [_h(1, 4, 4, 4)]),
    "an engine has other bounds": (
        [_h(1, 2, 3, 4), _h(1, 1, bounds=(2.0, INF))],
        [_h(2, 3, 4, 5), _h(1, 3, bounds=(2.0, INF))],
    ),
    "bounds change between the two scrapes": ([_h(1, 2, 3, 4)], [_h(1, 5, bounds=(0.3, INF))]),
    "no buckets": ([Histogram((), None, None)], [Histogram((), None, None)]),
    "the first scrape has no histogram": ([None], [_h(2, 3, 4, 5)]),
}


@pytest.mark.parametrize("restarted", [False, True])
@pytest.mark.parametrize("name", list(LATENCY_CASES))
def test_latency_sums_by_column_as_by_dict(name: str, restarted: bool) -> None:
    firsts, lasts = LATENCY_CASES[name]

    def scrape(hs: list[Histogram | None], start: float) -> VllmScrape:
        engines = tuple(
            EngineMetrics("m", str(i), time_to_first_token=h, e2e_request_latency=h)
            for i, h in enumerate(hs)
        )
        return VllmScrape(engines, True, start, 1)

    first, last = scrape(firsts, 1.0), scrape(lasts, 2.0 if restarted else 1.0)
    window = [
        Snapshot(t, (ServiceSnapshot("vllm", vllm=s),), None)
        for t, s in ((0.0, first), (2.0, last))
    ]
    keys = [e.key for e in last.engines]
    assert engine_signals._latency(window, "vllm", keys) == _latency_by_dicts(
        first, last, restarted
    )


# --- the rates, windows and log counts against the plain readings they replace ---------------


def _engine_rates_point_by_point(
    window: list[Snapshot], keys: list[tuple[str, str]]
) -> dict[tuple[str, str], tuple[float | None, ...]]:
    """Each engine's rates as the signals read them before each snapshot kept its increases:
    for one engine and field, a series of the window's scrapes that have both, and
    ``rate()`` over it (the specification the kept increases must meet, to the last bit)."""
    out = {}
    for key in keys:
        values = []
        for field in engine_signals._RATE_FIELDS:
            points: list[series.Point] = []
            for s in window:
                scrape = s.services[0].vllm
                e = next((e for e in scrape.engines if e.key == key), None) if scrape else None
                v = getattr(e, field) if e is not None else None
                if scrape is not None and v is not None:
                    points.append((s.time_seconds, v, scrape.process_start_time_seconds))
            values.append(sig.rate(points))
        out[key] = tuple(values)
    return out


def _window_by_scan(history: list[Snapshot], seconds: float) -> list[Snapshot]:
    now = history[-1].time_seconds
    start = next((i for i, s in enumerate(history) if s.time_seconds >= now - seconds - 1e-9), 0)
    return history[start:]


def _recent_log_events_by_scan(
    history: list[Snapshot], seconds: float
) -> tuple[tuple[LogEventKind, int], ...]:
    """Every snapshot of the history walked, the window's counted (the specification)."""
    now = history[-1].time_seconds
    out: dict[LogEventKind, int] = {}
    prev: dict[LogEventKind, int] = {}
    for s in history:
        logs = s.services[0].logs
        if logs is None:
            continue
        counts = dict(logs.counts)
        if s.time_seconds >= now - seconds - 1e-9:
            for kind, count in counts.items():
                before = prev.get(kind, 0)
                new = count - before if count >= before else count
                if new > 0:
                    out[kind] = out.get(kind, 0) + new
        prev = counts
    return tuple(sorted(out.items()))


def _logs(t: float, **counts: int) -> Snapshot:
    reading = LogReading(tuple((LogEventKind(k), n) for k, n in counts.items()), (), 0)
    return dataclasses.replace(steady(t), services=(ServiceSnapshot("vllm", logs=reading),))


RATE_HISTORIES: dict[str, list[Snapshot]] = {
    **HISTORIES,
    "the engines listed in another order": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("1", t, 2.0), engine("0", t)) for t in range(20, 40, 2)],
    "two scrapes at the same time (no span)": [steady(0), steady(0)],
    "a fractional counter that rounds": [
        snap(t / 10, engine("0", t / 10, 0.1 + t / 7)) for t in range(0, 60, 3)
    ],
    "a restart with counters that only go up": [steady(t) for t in range(0, 20, 2)]
    + [snap(t, engine("0", t + 5), engine("1", t + 5, 2.0), start=9.0) for t in range(20, 40, 2)],
}
LOG_HISTORIES: dict[str, list[Snapshot]] = {
    "events, then a restart of the counting back to the same count": [
        _logs(t, cuda_oom=c)
        for t, c in zip(range(0, 40, 2), [0, 1, 3, 3, 0, 3] + [3] * 14, strict=True)
    ],
    "a kind appears, another disappears": [_logs(t, cuda_oom=1) for t in range(0, 10, 2)]
    + [_logs(t, engine_dead=t) for t in range(10, 40, 2)],
    "no journal before the window, then counts": [
        dataclasses.replace(_logs(t), services=(ServiceSnapshot("vllm"),)) for t in range(0, 30, 2)
    ]
    + [_logs(t, cuda_oom=t // 4) for t in range(30, 40, 2)],
    "the journal goes away inside the window": [_logs(t, cuda_oom=t) for t in range(0, 30, 2)]
    + [
        dataclasses.replace(_logs(t), services=(ServiceSnapshot("vllm"),)) for t in range(30, 40, 2)
    ],
}


@pytest.mark.parametrize("name", list(RATE_HISTORIES))
def test_engine_rates_equal_the_point_by_point_rates(name: str) -> None:
    """Exactly, not approximately: the same increases added in the same order (a last-bit
    difference could move a threshold's decision)."""
    history = RATE_HISTORIES[name]
    for i in range(1, len(history) + 1):
        window = _window_by_scan(history[:i], CFG.rate_window_seconds)
        scrape = window[-1].services[0].vllm
        keys = [e.key for e in scrape.engines] if scrape is not None else [("m", "0")]
        got = engine_signals._engine_rates(window, "vllm", keys)
        assert got == _engine_rates_point_by_point(window, keys), f"tick {i - 1} ({name})"


def test_a_steady_window_reads_the_kept_increases() -> None:
    """The kept increases are used where they apply (else the test above proves nothing
    about them), and not where an engine comes or goes."""
    history = RATE_HISTORIES["steady load on two engines"]
    keys = [e.key for e in history[-1].services[0].vllm.engines]  # type: ignore[union-attr]
    assert engine_signals._kept_rates(history[-6:], "vllm", keys) is not None
    joined = RATE_HISTORIES["an engine joins"][6:14]
    keys = [e.key for e in joined[-1].services[0].vllm.engines]  # type: ignore[union-attr]
    assert engine_signals._kept_rates(joined, "vllm", keys) is None


@pytest.mark.parametrize("seconds", [0.0, 1.0, 3.0, 10.0, 100.0, -5.0])
@pytest.mark.parametrize("name", list(RATE_HISTORIES))
def test_a_window_is_the_scan_from_the_oldest(name: str, seconds: float) -> None:
    history = RATE_HISTORIES[name]
    for i in range(1, len(history) + 1):
        assert list(series.window_of(history[:i], seconds)) == _window_by_scan(history[:i], seconds)


@pytest.mark.parametrize("seconds", [0.0, 4.0, 10.0, 100.0, -5.0])
@pytest.mark.parametrize("name", list(LOG_HISTORIES) + list(HISTORIES))
def test_recent_log_events_equal_a_walk_of_the_whole_history(name: str, seconds: float) -> None:
    history = LOG_HISTORIES.get(name) or HISTORIES[name]
    for i in range(1, len(history) + 1):
        got = sig._recent_log_events(history[:i], seconds, "vllm")
        assert got == _recent_log_events_by_scan(history[:i], seconds), f"tick {i - 1} ({name})"
