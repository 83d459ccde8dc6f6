"""Signals computed from what each snapshot keeps in its memo (core/signals.py: the counters
and the per-snapshot samples) are the signals computed afresh: the daemon derives every tick
over a history whose older snapshots were read before, and whatever changed between two
scrapes must show exactly as it would in a history read for the first time."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_guardian.config import ServiceConfig, SignalsConfig
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
    assert sig._latency(window, "vllm", keys) == _latency_by_dicts(first, last, restarted)
