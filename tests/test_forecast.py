"""The exhaustion forecast on recorded series: when it speaks, what it says, and when it is silent.

Each series is 2 s ticks of one GPU of one service (``MemorySample``), written out as the
sources would have seen them: activation sawtooth on top of the trend, allocator stranded
bytes, other processes, a restart, a gap. The expected forecast is computed from the series'
own construction (a known line), never copied from an output.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from vllm_guardian.core.forecast import (
    ForecastSettings,
    MemorySample,
    Neighbour,
    forecast,
    theil_sen,
)
from vllm_guardian.model import Cause

GIB = 1 << 30
MIB = 1 << 20
CFG = ForecastSettings()
BUDGET = 73 * GIB
BASE_SERVICE = 66 * GIB  # weights + KV + graphs, without activations


@dataclass(frozen=True)
class World:
    """What is on the card at time t (bytes): the parts that make up a sample."""

    stranded: Callable[[float], float] = lambda t: 0.0
    other: Callable[[float], float] = lambda t: 0.0
    activation_peak: Callable[[float], float] = lambda t: 200.0 * MIB  # largest step's size
    plugin: bool = True
    total: int = 80 * GIB
    prefill_heavy: bool = False  # every step is a large prefill (80-100 % of the peak)


def record(
    world: World,
    seconds: float,
    seed: int = 0,
    start: float = 1000.0,
    generation: float = 1.0,
    neighbour_pid: int = 4_194_301,
) -> list[MemorySample]:
    """2 s ticks; each catches a random step: decode (tiny) or a prefill up to the peak."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    while t <= seconds:
        if world.prefill_heavy:
            act = rng.uniform(0.8, 1.0) * world.activation_peak(t)
        else:
            act = rng.choice([4 * MIB, 8 * MIB, rng.uniform(0, 1) * world.activation_peak(t)])
        stranded = int(world.stranded(t))
        other = int(world.other(t))
        service = BASE_SERVICE + int(act) + stranded
        allocated = BASE_SERVICE - 512 * MIB + int(act)
        out.append(
            MemorySample(
                time_seconds=start + t,
                free_bytes=world.total - service - other,
                ready=True,
                generation=generation,
                service_bytes=service,
                other_bytes=other,
                reserved_bytes=allocated + stranded if world.plugin else None,
                allocated_bytes=allocated if world.plugin else None,
                budget_bytes=BUDGET,
                neighbours=(Neighbour(neighbour_pid, other, "python3", "/user.slice/job-7"),)
                if other
                else (),
            )
        )
        t += 2.0
    return out


def free_at_zero(world: World) -> float:
    return float(80 * GIB - BASE_SERVICE - world.stranded(0) - world.other(0))


CREEP = World(stranded=lambda t: 30.0 * MIB * t)  # 8 GiB free at 30 MiB/s: ~4.7 min
NEIGHBOUR = World(other=lambda t: GIB + 20.0 * MIB * t)
# Batches of long prompts that keep growing: even the floor carries a large prefill.
PREFILL = World(activation_peak=lambda t: 200.0 * MIB + 25.0 * MIB * t, prefill_heavy=True)


def restart(samples: list[MemorySample], at_seconds: float) -> list[MemorySample]:
    """A restart at ``at_seconds`` after the start: a new process, its memory and counters anew."""
    t0 = samples[0].time_seconds
    out = [s for s in samples if s.time_seconds - t0 < at_seconds]
    fresh = record(World(), 40.0, start=t0 + at_seconds + 30, generation=2.0)
    return out + fresh


def gap(samples: list[MemorySample], start: float, seconds: float) -> list[MemorySample]:
    t0 = samples[0].time_seconds
    return [s for s in samples if not start <= s.time_seconds - t0 < start + seconds]


def blind_tail(samples: list[MemorySample], seconds: float) -> list[MemorySample]:
    """The GPU source went down for the last ``seconds``: the readings are None, not zero."""
    t_end = samples[-1].time_seconds
    return [
        s if s.time_seconds <= t_end - seconds else replace(s, free_bytes=None) for s in samples
    ]


def not_ready_tail(samples: list[MemorySample], seconds: float) -> list[MemorySample]:
    t_end = samples[-1].time_seconds
    return [s if s.time_seconds <= t_end - seconds else replace(s, ready=False) for s in samples]


def settling(samples: list[MemorySample], reserving_bytes: float) -> list[MemorySample]:
    """The run's first reading was taken while the process was still reserving its pool
    (``reserving_bytes`` not yet taken), as a GPU reading a moment older than /health's 200."""
    first = samples[0]
    assert first.free_bytes is not None and first.service_bytes is not None
    early = replace(
        first,
        free_bytes=first.free_bytes + int(reserving_bytes),
        service_bytes=first.service_bytes - int(reserving_bytes),
    )
    return [early, *samples[1:]]


@dataclass(frozen=True)
class Case:
    name: str
    samples: list[MemorySample]
    cause: Cause | str | None  # "none": no forecast at all
    seconds: float | None = None  # expected time to exhaustion (from the construction)
    now_offset: float = 0.0  # the tick's time after the newest sample


def seconds_left(world_rate_bytes_per_s: float, start_free: float, elapsed: float) -> float:
    return (start_free - world_rate_bytes_per_s * elapsed) / world_rate_bytes_per_s


# Floors subtract the interval's largest activation (≤ 200 MiB); the line runs ≤ 200 MiB low.
CASES = [
    Case("steady creep of stranded allocator blocks", record(CREEP, 120), Cause.ALLOCATOR_FRAGMENTATION,
         seconds_left(30.0 * MIB, free_at_zero(CREEP), 120)),
    Case("a neighbour growing", record(NEIGHBOUR, 120), Cause.GPU_MEMORY_OVERCOMMIT,
         seconds_left(20.0 * MIB, free_at_zero(NEIGHBOUR), 120)),
    # The neighbour demo's twin: its first ready reading still had 57 GiB free; as the largest
    # swing within an interval it vetoed every forecast for the whole window (5 min deployed).
    Case("a neighbour growing, the run's first reading taken mid-reservation",
         settling(record(NEIGHBOUR, 120), 57 * GIB), Cause.GPU_MEMORY_OVERCOMMIT,
         seconds_left(20.0 * MIB, free_at_zero(NEIGHBOUR), 120)),
    Case("activation peaks growing with the batch", record(PREFILL, 120), Cause.PREFILL_BURST, None),
    Case("creep without the allocator plugin: when, but not who",
         record(replace(CREEP, plugin=False), 120), None, seconds_left(30.0 * MIB, free_at_zero(CREEP), 120)),
    Case("activation sawtooth, no trend", record(World(activation_peak=lambda t: 3.0 * GIB), 600), "none"),
    Case("flat and quiet", record(World(), 600), "none"),
    Case("a step change: a neighbour takes 3 GiB once and stays",
         record(World(other=lambda t: 3.0 * GIB if t >= 60 else 0.0), 120), "none"),
    Case("a step change near the end is not a trend yet",
         record(World(other=lambda t: 3.0 * GIB if t >= 100 else 0.0), 120), "none"),
    Case("too short: 30 s of creep", record(CREEP, 30), "none"),
    Case("a gap leaves too little after it", gap(record(CREEP, 120), 40, 50), "none"),
    Case("a short gap is bridged", gap(record(CREEP, 120), 40, 20), Cause.ALLOCATOR_FRAGMENTATION,
         seconds_left(30.0 * MIB, free_at_zero(CREEP), 120)),
    Case("stale: the newest reading is a minute old", record(CREEP, 120), "none", now_offset=60.0),
    Case("blind: the GPU source is down now", blind_tail(record(CREEP, 120), 4), "none"),
    Case("not ready (restarting or dead): no forecast", not_ready_tail(record(CREEP, 120), 4), "none"),
    Case("a restart resets the series and the allocator counters", restart(record(CREEP, 120), 100), "none"),
    Case("a creep resumes after the restart: only the new process counts",
         record(CREEP, 120, start=5000.0, generation=2.0)[:] , Cause.ALLOCATOR_FRAGMENTATION,
         seconds_left(30.0 * MIB, free_at_zero(CREEP), 120)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forecast_on_recorded_series(case: Case) -> None:
    now = case.samples[-1].time_seconds + case.now_offset
    f = forecast(0, case.samples, now, CFG)
    if case.cause == "none":
        assert f is None, f.describe() if f else ""
        return
    assert f is not None, "expected a forecast"
    assert f.cause == case.cause, f.describe()
    assert f.seconds <= f.seconds_latest
    if case.seconds is not None:
        # Within 10 % plus the activation floor's offset (≤ 200 MiB at the creep's rate).
        slack = 0.1 * case.seconds + 200 * MIB / (-f.slope_bytes_per_second)
        assert abs(f.seconds - case.seconds) <= slack, f.describe()


def test_the_neighbour_is_named() -> None:
    f = forecast(0, record(NEIGHBOUR, 120, neighbour_pid=777), 1120.0, CFG)
    assert f is not None and f.neighbour is not None
    assert (f.neighbour.pid, f.neighbour.name, f.neighbour.cgroup) == (
        777,
        "python3",
        "/user.slice/job-7",
    )


@pytest.mark.parametrize("seed", range(20))
def test_no_false_trend_from_sawtooth_over_many_seeds(seed: int) -> None:
    # Prefill peaks of up to 4 GiB on a flat card, 30 minutes, checked at every tick.
    samples = record(World(activation_peak=lambda t: 4.0 * GIB), 1800, seed=seed)
    for i in range(10, len(samples), 5):
        window = [s for s in samples[: i + 1] if s.time_seconds >= samples[i].time_seconds - 300]
        f = forecast(0, window, samples[i].time_seconds, CFG)
        assert f is None, f.describe()


THEIL_SEN = [
    ("a line", [(0, 10), (1, 8), (2, 6), (3, 4)], -2.0),
    ("one outlier does not tilt it", [(0, 10), (1, 9), (2, 8), (3, -50), (4, 6), (5, 5)], -1.0),
    ("flat", [(0, 5), (1, 5), (2, 5)], 0.0),
]


@pytest.mark.parametrize(("name", "points", "slope"), THEIL_SEN, ids=[t[0] for t in THEIL_SEN])
def test_theil_sen(name: str, points: list[tuple[float, float]], slope: float) -> None:
    trend = theil_sen(points)
    assert trend is not None
    assert trend.slope_per_second == pytest.approx(slope)
    assert trend.slope_low_per_second <= trend.slope_per_second <= trend.slope_high_per_second
