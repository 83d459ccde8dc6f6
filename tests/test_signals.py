"""Derived signals, table-driven over snapshot series with explicit times (no clock)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.expositions import captured_series
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.model import (
    CacheConfig,
    Cause,
    EngineMetrics,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthProbe,
    HealthState,
    Histogram,
    ServiceSnapshot,
    Snapshot,
    UnitState,
    VllmScrape,
)
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

GIB = 1024**3
SVC = ServiceConfig(name="vllm")
CFG = SignalsConfig(
    rate_window_seconds=10, quantile_window_seconds=10, slope_window_seconds=20, stall_seconds=6,
    forecast_window_seconds=300,
)  # fmt: skip


def engine(engine: str = "0", **kw: object) -> EngineMetrics:
    return EngineMetrics(model_name="m", engine=engine, **kw)  # type: ignore[arg-type]


def snap(
    t: float,
    *engines: EngineMetrics,
    start: float | None = 1.0,
    gpus: GpuReading | None = None,
    unit: UnitState | None = None,
    health: HealthState | None = HealthState.UP,
) -> Snapshot:
    scrape = (
        VllmScrape(
            engines=engines, stats_enabled=True, process_start_time_seconds=start, body_bytes=1
        )
        if engines
        else None
    )
    probe = HealthProbe(health, 200, 0.01) if health else None
    return Snapshot(t, (ServiceSnapshot("vllm", vllm=scrape, health=probe, unit=unit),), gpus)


def derive(*history: Snapshot, svc: ServiceConfig = SVC) -> sig.ServiceSignals:
    return sig.derive(list(history), [svc], CFG).services[0]


# --- rates -----------------------------------------------------------------------------------

RATES = [
    # name, points (t, value, process start), expected rate
    ("steady", [(0, 0, 1), (2, 10, 1), (4, 20, 1)], 5.0),
    ("reset to lower value counts from zero", [(0, 100, 1), (2, 110, 1), (4, 4, 1)], (10 + 4) / 4),
    ("restart seen through start time", [(0, 5, 1), (2, 9, 2)], 9 / 2),
    ("one point has no rate", [(0, 5, 1)], None),
    ("no time passed", [(3, 5, 1), (3, 6, 1)], None),
]


@pytest.mark.parametrize(("name", "points", "expected"), RATES, ids=[r[0] for r in RATES])
def test_rate(name, points, expected):
    got = sig.rate([(float(t), float(v), float(s)) for t, v, s in points])
    assert got == (pytest.approx(expected) if expected is not None else None)


QUANTILES = [
    # q, cumulative buckets, expected (Prometheus histogram_quantile)
    (0.5, [(1.0, 0), (2.0, 10), (math.inf, 10)], 1.5),
    (0.99, [(0.1, 50), (1.0, 100), (math.inf, 100)], 0.1 + 0.9 * (99 - 50) / 50),
    (0.5, [(1.0, 0), (math.inf, 10)], 1.0),  # lands in +Inf: the last finite bound
    (0.5, [(1.0, 0), (math.inf, 0)], None),  # no observations
    (0.5, [(1.0, 4)], None),  # no +Inf bucket: not a histogram
]


@pytest.mark.parametrize(("q", "buckets", "expected"), QUANTILES)
def test_histogram_quantile(q, buckets, expected):
    got = sig.histogram_quantile(q, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_preemption_and_token_rates_over_the_window():
    h = [
        snap(t, engine(preemptions_total=p, generation_tokens_total=g, requests_waiting=1.0))
        for t, p, g in [(0, 0, 0), (2, 4, 100), (4, 8, 200), (12, 20, 500), (14, 24, 600)]
    ]
    s = derive(*h)
    # window is 10 s: points at t=4, 12, 14
    assert s.preemptions_per_second == pytest.approx((24 - 8) / 10)
    assert s.generation_tokens_per_second == pytest.approx((600 - 200) / 10)
    assert s.counter_reset is False


def test_counter_reset_on_vllm_restart_is_flagged_not_negative():
    h = [
        snap(0, engine(preemptions_total=50.0), start=1.0),
        snap(2, engine(preemptions_total=3.0), start=2.0),
    ]
    s = derive(*h)
    assert s.preemptions_per_second == pytest.approx(1.5)
    assert s.counter_reset is True


def test_prefix_hit_ratio_from_counter_rates_across_engines():
    h = [
        snap(
            0,
            engine("0", prefix_cache_queries_total=0.0, prefix_cache_hits_total=0.0),
            engine("1", prefix_cache_queries_total=0.0, prefix_cache_hits_total=0.0),
        ),
        snap(
            2,
            engine("0", prefix_cache_queries_total=100.0, prefix_cache_hits_total=50.0),
            engine("1", prefix_cache_queries_total=300.0, prefix_cache_hits_total=30.0),
        ),
    ]
    assert derive(*h).prefix_cache_hit_ratio == pytest.approx(80 / 400)


def test_latency_quantiles_from_bucket_deltas():
    def hist(c1: float, c2: float) -> Histogram:
        return Histogram(((0.5, c1), (1.0, c2), (math.inf, c2)), None, c2)

    h = [
        snap(0, engine(time_to_first_token=hist(100, 100))),
        snap(2, engine(time_to_first_token=hist(100, 110))),
    ]
    lat = {(x.metric, x.quantile): x.seconds for x in derive(*h).latency}
    # Only the 10 new observations count, all between 0.5 and 1.0 s.
    assert lat[("ttft", 0.5)] == pytest.approx(0.75)


# --- aggregation and stall -------------------------------------------------------------------


def cc(blocks: int) -> CacheConfig:
    return CacheConfig(blocks, 16, 0.9, None, None, True)


def test_kv_usage_is_capacity_weighted_when_capacities_are_known():
    s = derive(
        snap(
            0,
            engine("0", kv_cache_usage_ratio=0.25, cache_config=cc(1000)),
            engine("1", kv_cache_usage_ratio=0.75, cache_config=cc(3000)),
        )
    )
    assert s.kv_cache_usage_ratio == pytest.approx((0.25 * 1000 + 0.75 * 3000) / 4000)
    assert s.kv_cache_capacity_tokens == 4000 * 16


def test_kv_usage_is_the_max_when_a_capacity_is_unknown():
    s = derive(
        snap(0, engine("0", kv_cache_usage_ratio=0.25), engine("1", kv_cache_usage_ratio=0.75))
    )
    assert s.kv_cache_usage_ratio == 0.75
    assert s.kv_cache_capacity_tokens is None


STALLS = [
    # name, series of (t, waiting, generated), expected stall seconds, stalled?
    ("progressing", [(0, 5, 10), (2, 5, 20), (4, 5, 30)], 0.0, False),
    ("waiting but frozen", [(0, 5, 10), (2, 5, 10), (4, 5, 10), (6, 5, 10)], 6.0, True),
    ("froze recently", [(0, 5, 10), (2, 5, 20), (4, 5, 20)], 2.0, False),
    ("idle is not stalled", [(0, 0, 10), (2, 0, 10), (4, 0, 10)], 0.0, False),
]


@pytest.mark.parametrize(
    ("name", "series", "seconds", "stalled"), STALLS, ids=[s[0] for s in STALLS]
)
def test_stall_signature(name, series, seconds, stalled):
    h = [
        snap(t, engine(requests_waiting=float(w), generation_tokens_total=float(g)))
        for t, w, g in series
    ]
    s = derive(*h)
    assert (s.stall_seconds, s.stalled) == (seconds, stalled)


# The engine at work with flat token counters (vLLM V1 counts a prompt's tokens when its whole
# prefill has finished), and a frozen one: (t, the engine's fields) per snapshot.
_BUSY = {
    "requests_running": 4.0,
    "requests_waiting": 6.0,
    "generation_tokens_total": 50.0,
    "prompt_tokens_total": 900.0,
    "kv_cache_usage_ratio": 0.98,
    "preemptions_total": 10.0,
}
STALLS_BY_FIELD = [
    ("thrash: preemptions rise, token counters flat",
     [(t, {**_BUSY, "preemptions_total": 10.0 + 3 * t}) for t in (0, 2, 4, 6)], 0.0, False),
    ("a long prefill: KV usage rises, token counters flat",
     [(t, {**_BUSY, "kv_cache_usage_ratio": 0.1 + 0.1 * t}) for t in (0, 2, 4, 6)], 0.0, False),
    ("frozen: nothing moves", [(t, _BUSY) for t in (0, 2, 4, 6)], 6.0, True),
    ("frozen after the last preemption",
     [(0, _BUSY), (2, {**_BUSY, "preemptions_total": 11.0}), (4, {**_BUSY, "preemptions_total": 11.0}),
      (6, {**_BUSY, "preemptions_total": 11.0})], 4.0, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "series", "seconds", "stalled"), STALLS_BY_FIELD, ids=[s[0] for s in STALLS_BY_FIELD]
)
def test_stall_is_no_progress_of_any_kind(name, series, seconds, stalled):
    s = derive(*[snap(t, engine(**fields)) for t, fields in series])
    assert (s.stall_seconds, s.stalled) == (seconds, stalled)


CAPTURED_STALLS = [
    # the real vLLM 0.32 series, with the stall wait at 10 s: stalled ever?, longest stall
    ("long_prefill", False, 0.0),  # one 20,480-token prompt alone: 15.5 s of prefill
    ("hang", True, 11.5),  # EngineCore stopped (SIGSTOP) for 12 s mid-prefill
]


@pytest.mark.parametrize(
    ("series", "ever", "longest"), CAPTURED_STALLS, ids=[c[0] for c in CAPTURED_STALLS]
)
def test_stall_over_the_captured_series(series, ever, longest):
    cfg = replace(CFG, stall_seconds=10)
    history: list[Snapshot] = []
    seen = []
    for r in captured_series(series):
        scrape = parse_vllm_metrics(r.text, len(r.text))
        probe = HealthProbe(HealthState.UP, 200, 0.01)
        history.append(
            Snapshot(r.t_seconds, (ServiceSnapshot("vllm", vllm=scrape, health=probe),), None)
        )
        seen.append(sig.derive(history, [SVC], cfg).services[0])
    assert any(s.stalled for s in seen) is ever
    assert max(s.stall_seconds or 0.0 for s in seen) == pytest.approx(longest, abs=0.5)


def test_a_gap_in_observation_does_not_extend_a_stall():
    h = [
        snap(0, engine(requests_waiting=5.0, generation_tokens_total=1.0)),
        snap(2),
        snap(4, engine(requests_waiting=5.0, generation_tokens_total=1.0)),
    ]
    assert derive(*h).stall_seconds == 0.0


def test_missing_scrape_is_unknown_not_zero():
    s = derive(snap(0, health=HealthState.REFUSED))
    assert s.metrics_up is False and s.vllm_up is False
    assert s.kv_cache_usage_ratio is None and s.requests_waiting is None and s.stall_seconds is None


# --- GPU attribution -------------------------------------------------------------------------

UNIT = UnitState(
    "vllm.service",
    "active",
    "running",
    "success",
    100,
    0,
    None,
    None,
    "/system.slice/vllm.service",
    None,
    pids=(100, 101),
)


def gpu(index: int, free_gib: float, *procs: GpuProcess, total_gib: float = 80) -> GpuDevice:
    used = total_gib - free_gib
    return GpuDevice(
        index,
        f"GPU-{index}",
        "H100",
        int(total_gib * GIB),
        int(used * GIB),
        int(free_gib * GIB),
        processes=procs,
    )


def p(
    pid: int, gib: float, cgroup: str | None = None, ancestors: tuple[int, ...] = ()
) -> GpuProcess:
    return GpuProcess(pid, int(gib * GIB), cgroup=cgroup, ancestors=ancestors)


ATTRIBUTION = [
    # name, process, belongs to the service?
    ("main pid", p(100, 1), True),
    ("descendant listed by the unit source", p(101, 1), True),
    ("child found through its ancestors", p(555, 1, ancestors=(101, 100, 1)), True),
    ("same cgroup", p(777, 1, cgroup="/system.slice/vllm.service"), True),
    ("sub-cgroup", p(778, 1, cgroup="/system.slice/vllm.service/worker"), True),
    (
        "a sibling unit whose name extends ours",
        p(779, 1, cgroup="/system.slice/vllm.service2"),
        False,
    ),
    ("another tenant", p(900, 1, cgroup="/user.slice", ancestors=(1,)), False),
]


@pytest.mark.parametrize(("name", "proc", "mine"), ATTRIBUTION, ids=[a[0] for a in ATTRIBUTION])
def test_process_attribution(name, proc, mine):
    assert sig.belongs_to(proc, UNIT) is mine


def test_budget_over_budget_and_other_tenants():
    gpus = GpuReading((gpu(0, 4, p(100, 70), p(900, 5)), gpu(1, 79, p(900, 1))))
    s = derive(snap(0, engine(cache_config=cc(100)), gpus=gpus, unit=UNIT))
    assert [g.gpu for g in s.gpus] == [0]  # auto: where the service's processes are
    assert s.memory_budget_bytes == int(0.9 * 80 * GIB)
    assert s.service_memory_bytes == 70 * GIB
    assert s.memory_over_budget_bytes == 0
    assert s.other_processes_memory_bytes == 5 * GIB
    assert s.headroom_bytes == 4 * GIB


def test_memory_beyond_budget():
    gpus = GpuReading((gpu(0, 1, p(100, 75)),))
    s = derive(snap(0, engine(cache_config=cc(100)), gpus=gpus, unit=UNIT))
    assert s.memory_over_budget_bytes == 75 * GIB - int(0.9 * 80 * GIB)


def test_explicit_gpu_list_and_headroom_slope():
    svc = ServiceConfig(name="vllm", gpus=(0, 1))
    h = [
        snap(t, engine(), gpus=GpuReading((gpu(0, 10 - t * 0.5), gpu(1, 40))), unit=UNIT)
        for t in (0, 2, 4, 6)
    ]
    s = derive(*h, svc=svc)
    assert s.headroom_bytes == int(7 * GIB)
    assert s.headroom_slope_bytes_per_second == pytest.approx(-0.5 * GIB, rel=1e-6)


def test_no_gpu_source_means_no_memory_signals():
    s = derive(snap(0, engine()))
    assert s.gpus == () and s.headroom_bytes is None and s.memory_budget_bytes is None


# --- recent events ---------------------------------------------------------------------------


def logs_snap(t: float, oom: int) -> Snapshot:
    from vllm_guardian.model import LogEventKind, LogReading

    reading = LogReading(((LogEventKind.CUDA_OOM, oom),), (), 0)
    return Snapshot(t, (ServiceSnapshot("vllm", logs=reading),), None)


RECENT = [
    # name, series of (t, cumulative oom count), expected recent count (window 10 s)
    ("first reading counts: the journal is followed from the guardian's start", [(0, 1)], 1),
    ("an old event falls out of the window", [(0, 1), (5, 1), (20, 1)], 0),
    ("new events in the window", [(0, 1), (15, 1), (18, 3)], 2),
    ("counter restart (guardian restarted) counts the new value", [(0, 5), (15, 1)], 1),
]


@pytest.mark.parametrize(("name", "series", "expected"), RECENT, ids=[r[0] for r in RECENT])
def test_recent_log_events(name, series, expected):
    from vllm_guardian.model import LogEventKind

    s = derive(*[logs_snap(t, n) for t, n in series])
    assert s.recent_log_count(LogEventKind.CUDA_OOM) == expected


def test_recent_xids_on_the_service_gpus_and_time_to_exhaustion():
    from vllm_guardian.model import XidEvent

    def g(free: float, xids: tuple[XidEvent, ...] = ()) -> GpuReading:
        return GpuReading((gpu(0, free, p(100, 60)), gpu(1, 70)), None, xids)

    h = [
        snap(0, engine(), gpus=g(10, (XidEvent(1, 79, 0),)), unit=UNIT),
        snap(2, engine(), gpus=g(9, (XidEvent(0, 79, 2),)), unit=UNIT),
        snap(4, engine(), gpus=g(8), unit=UNIT),
    ]
    s = derive(*h)
    assert s.recent_xid_events == ((0, 79, 1),)  # GPU 1 is not the service's
    # Three readings over 4 s are not a trend: the forecast needs floors over a span.
    assert s.seconds_to_headroom_exhaustion is None


# --- the exhaustion forecast from snapshots --------------------------------------------------


def _neighbour_series(
    seconds: float, start: float = 1.0, t0: float = 0.0, rate_gib: float = 0.05
) -> list[Snapshot]:
    """2 s ticks: vLLM (pid 100) holds 66 GiB; pid 900 grows ``rate_gib``/s from 1 GiB."""
    out = []
    t = 0.0
    while t <= seconds:
        other = 1 + rate_gib * t
        procs = (p(100, 66), GpuProcess(900, int(other * GIB), "python3", "/user.slice/job"))
        out.append(
            snap(t0 + t, engine(cache_config=cc(100)), start=start, unit=UNIT,
                 gpus=GpuReading((gpu(0, 80 - 66 - other, *procs),)))
        )  # fmt: skip
        t += 2.0
    return out


def test_forecast_names_the_growing_neighbour():
    s = derive(*_neighbour_series(120))
    # 13 GiB free at t=0, falling 0.05 GiB/s: 0 at t=260, i.e. ~140 s after the newest tick.
    assert s.seconds_to_headroom_exhaustion == pytest.approx(140, abs=10)
    assert s.forecast_cause is Cause.GPU_MEMORY_OVERCOMMIT
    assert s.seconds_to_exhaustion_gpu_memory_overcommit == s.seconds_to_headroom_exhaustion
    assert s.seconds_to_exhaustion_allocator_fragmentation is None
    (f,) = s.forecasts
    assert f.neighbour is not None and (f.neighbour.pid, f.neighbour.name) == (900, "python3")
    assert s.headroom_exhaustion_latest_seconds is not None
    assert s.headroom_exhaustion_latest_seconds >= s.seconds_to_headroom_exhaustion


def test_forecast_resets_when_vllm_restarts():
    before = _neighbour_series(120, start=1.0)
    after = _neighbour_series(20, start=2.0, t0=130.0)
    assert derive(*before, *after).seconds_to_headroom_exhaustion is None


def test_forecast_is_absent_while_vllm_is_not_ready():
    h = _neighbour_series(120)
    h[-1] = Snapshot(h[-1].time_seconds, (ServiceSnapshot("vllm", unit=UNIT),), h[-1].gpus)
    assert derive(*h).seconds_to_headroom_exhaustion is None


def test_running_requests_with_no_token_processed_is_a_stall_and_prefill_is_progress():
    frozen = [
        snap(
            t,
            engine(
                requests_running=8.0,
                requests_waiting=0.0,
                generation_tokens_total=50.0,
                prompt_tokens_total=900.0,
            ),
        )
        for t in (0, 2, 4, 6)
    ]
    assert derive(*frozen).stalled is True
    prefill = [
        snap(
            t,
            engine(
                requests_running=1.0,
                requests_waiting=3.0,
                generation_tokens_total=50.0,
                prompt_tokens_total=900.0 + 4000 * t,
            ),
        )
        for t in (0, 2, 4, 6)
    ]
    assert derive(*prefill).stall_seconds == 0.0


def test_per_engine_work_is_linear_in_the_engines() -> None:
    """The latency quantiles looked each engine up by scanning the engine list
    (8,000 engines made a tick take 22 s). Counted, not timed: engine-key lookups per derive()
    grow in proportion to the engines, not with their square."""
    from vllm_guardian.model import EngineMetrics

    def lookups(n: int) -> int:
        engines = tuple(EngineMetrics("m", str(i), requests_running=1.0) for i in range(n))
        history = [
            Snapshot(t, (ServiceSnapshot("vllm", vllm=VllmScrape(engines, True, 1.0, 1)),), None)
            for t in (0.0, 2.0, 4.0)
        ]
        count = 0
        original = EngineMetrics.key

        def counting(self: EngineMetrics) -> tuple[str, str]:
            nonlocal count
            count += 1
            return original.fget(self)  # type: ignore[attr-defined,no-any-return]

        EngineMetrics.key = property(counting)  # type: ignore[assignment,method-assign]
        try:
            sig.derive(history, [ServiceConfig(name="vllm")], SignalsConfig())
        finally:
            EngineMetrics.key = original  # type: ignore[method-assign]
        return count

    small, large = lookups(100), lookups(400)
    assert large <= 5 * small, f"100 engines: {small} lookups; 400 engines: {large}"
