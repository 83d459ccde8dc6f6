"""Device-memory exhaustion forecast: when a GPU's free memory reaches zero, and who takes it.

Where it sits: pure, called by ``core/signals`` once per tick and per GPU of a service, from
samples the signals stage builds out of the snapshot history; its result becomes
``ServiceSignals.seconds_to_headroom_exhaustion`` and the forecast fields the alert rules, the
exposition and the policy's :func:`~vllm_guardian.core.policy.preemptive_action` read.

How it reads the series, each step for a reason an SRE would ask about:

1. **One generation.** Only samples of the newest vLLM process (its start time, or pid) count,
   and only while it was ready: a restart frees the memory and resets the allocator's
   counters, and a model loading its weights is a steep fall that is not a leak.
2. **No gaps, nothing stale.** A missing reading (source down, file stale) is not zero: the
   series ends at the last gap longer than ``max_gap_seconds`` and the forecast uses only what
   follows; no forecast at all when the newest sample is older than ``max_gap_seconds``.
3. **The floor, not the samples.** Each NVML sample holds the activations of the step in
   flight: a sawtooth of tens of MiB to GiBs under load. The least free memory per
   ``interval_seconds`` (complete intervals only) is what the next large step must fit in, and
   its trend is what matters; one step's activations are not a trend.
4. **A robust trend.** Theil–Sen: the median of the pairwise slopes of the floors. It ignores
   up to ~29 % of outlying intervals (one burst, one quiet minute), needs no noise model and
   no tuning, and gives a distribution-free confidence interval from the same pairwise slopes
   (Sen 1968, Kendall's-tau variance). Least squares (PromQL ``deriv()``) lets one outlier
   tilt the line, which is how a negative control once "ran out of memory in 2 s"; a quantile
   regression would also work but needs an LP solver for little gain on a few dozen points.
5. **Only a significant trend** (:func:`significant`). A forecast exists only after at least
   ``min_intervals`` floors spanning ``min_span_seconds``, when the whole confidence interval
   of the slope is below zero, the fall over the window stands out of the floors' scatter,
   the recent half still falls (a one-time step is not a trend), and the fall over the window
   exceeds the largest swing within one interval (the activation sawtooth's amplitude). The time to exhaustion is the fitted line's level now divided by
   the slope; the bound is the same with the interval's shallowest slope (the *latest* the
   card can be expected to run out: when even that is within the horizon, act).

The cause (:func:`culprit`): the component whose growth explains most of the fall of the floor
over the window: another process on the GPU (``gpu_memory_overcommit``, naming it), the
allocator's stranded bytes while reserved ≫ allocated (``allocator_fragmentation``), or vLLM's
own process growing without stranded bytes: its activation peaks growing with the batch
(``prefill_burst``). Without allocator statistics vLLM's own growth cannot be split between
fragmentation and activations, so no cause is named: the forecast then alerts only.

No I/O, no clock: the time is the newest sample's, and every threshold is an argument.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_guardian.model import Cause

# Two-sided normal quantiles for the slope's confidence interval.
_Z = {0.8: 1.2816, 0.9: 1.6449, 0.95: 1.9600, 0.99: 2.5758}


@dataclass(frozen=True)
class ForecastSettings:
    # Floors over 10 s: five 2 s ticks, so one step's activations never make the floor alone.
    interval_seconds: float = 10.0
    # Five floors over at least 40 s before anything is said: a trend, not a burst.
    min_intervals: int = 5
    min_span_seconds: float = 40.0
    # A reading missing for longer than this breaks the series (and an older newest sample
    # means no forecast): three intervals.
    max_gap_seconds: float = 30.0
    # Two-sided confidence of the slope interval (0.8, 0.9, 0.95 or 0.99): 0.95 because the
    # test runs every tick, and a forecast that comes and goes is one nobody trusts.
    confidence: float = 0.95
    # The fall over the window must be this many times the floors' scatter around the line.
    noise_multiple: float = 3.0
    # The interval's shallowest slope must be at least this share of the estimate: a forecast
    # whose bound is more than 4× later than itself says too little to act or page on.
    precision_ratio: float = 0.25
    # A cause explains the fall when its growth is at least this share of it.
    culprit_share_ratio: float = 0.5
    # reserved ≫ allocated: stranded bytes at least this share of the reservation, or more than
    # min_stranded_bytes, before fragmentation is named.
    stranded_share_ratio: float = 0.05
    min_stranded_bytes: int = 1 << 30


@dataclass(frozen=True)
class Neighbour:
    """Another process on the GPU (what NVML and /proc say about it)."""

    pid: int
    used_memory_bytes: int | None
    name: str | None = None
    cgroup: str | None = None


@dataclass(frozen=True)
class MemorySample:
    """One GPU of one service at one tick; ``None``: that part was not observed."""

    time_seconds: float
    free_bytes: int | None
    ready: bool  # vLLM answered /health: not loading, not dead
    generation: float | None  # vLLM's process start time (or pid): a change is a restart
    service_bytes: int | None = None  # vLLM's processes on this GPU (NVML)
    other_bytes: int | None = None  # every other process on this GPU
    reserved_bytes: int | None = None  # torch's caching allocator (plugin); None: no plugin
    allocated_bytes: int | None = None
    budget_bytes: int | None = None  # gpu_memory_utilization × total
    neighbours: tuple[Neighbour, ...] = ()

    @property
    def stranded_bytes(self) -> int | None:
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return max(0, self.reserved_bytes - self.allocated_bytes)


@dataclass(frozen=True)
class Trend:
    slope_per_second: float  # Theil–Sen
    slope_low_per_second: float  # confidence interval of the slope
    slope_high_per_second: float
    level_now: float  # the fitted line at the newest time


@dataclass(frozen=True)
class Forecast:
    gpu: int
    seconds: float  # time to exhaustion on the fitted trend
    seconds_latest: float  # with the shallowest slope of the interval: the bound to act on
    floor_bytes: float  # the fitted floor now
    slope_bytes_per_second: float
    intervals: int
    span_seconds: float
    cause: Cause | None  # None: the forecast alerts only
    evidence: str  # one line: what grew, by how much
    neighbour: Neighbour | None = None  # for gpu_memory_overcommit: the process growing

    def describe(self) -> str:
        who = self.cause.value if self.cause else "no named cause"
        return (
            f"GPU {self.gpu}: free-memory floor {self.floor_bytes / 2**30:.2f} GiB falling "
            f"{-self.slope_bytes_per_second / 2**20:.1f} MiB/s: exhausted in ~{self.seconds:.0f} s "
            f"(by {self.seconds_latest:.0f} s at the latest; {self.intervals} floors over "
            f"{self.span_seconds:.0f} s); {who}: {self.evidence}"
        )


# --- the trend ------------------------------------------------------------------------------


def theil_sen(points: Sequence[tuple[float, float]], confidence: float = 0.95) -> Trend | None:
    """Median pairwise slope with Sen's distribution-free interval; None under 3 points.

    Quadratic in the points, and read every tick over floors that change once an interval:
    the last results are kept by their points (a pure function's memo)."""
    return _theil_sen(tuple(points), confidence)


@functools.lru_cache(maxsize=256)
def _theil_sen(points: tuple[tuple[float, float], ...], confidence: float) -> Trend | None:
    n = len(points)
    if n < 3:
        return None
    slopes = sorted(
        (points[j][1] - points[i][1]) / (points[j][0] - points[i][0])
        for i in range(n)
        for j in range(i + 1, n)
        if points[j][0] != points[i][0]
    )
    if not slopes:
        return None
    m = len(slopes)
    mid = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
    z = _Z.get(confidence, 1.6449)
    c = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    lo_i = max(0, math.floor((m - c) / 2))
    hi_i = min(m - 1, math.ceil((m + c) / 2))
    intercepts = sorted(v - mid * t for t, v in points)
    k = len(intercepts)
    b = intercepts[k // 2] if k % 2 else (intercepts[k // 2 - 1] + intercepts[k // 2]) / 2
    t_now = points[-1][0]
    return Trend(mid, slopes[lo_i], slopes[hi_i], b + mid * t_now)


def floors(
    samples: Sequence[MemorySample], interval_seconds: float, attr: str = "free_bytes"
) -> list[tuple[float, float]]:
    """(interval mid-time, least value) per complete interval; ``attr`` of each sample."""
    return _per_interval(samples, interval_seconds, attr, min)


def peaks(
    samples: Sequence[MemorySample], interval_seconds: float, attr: str
) -> list[tuple[float, float]]:
    """(interval mid-time, largest value) per complete interval."""
    return _per_interval(samples, interval_seconds, attr, max)


def _per_interval(
    samples: Sequence[MemorySample],
    interval_seconds: float,
    attr: str,
    pick: Callable[[list[float]], float],
) -> list[tuple[float, float]]:
    if not samples:
        return []
    last_t = samples[-1].time_seconds
    buckets: dict[int, list[float]] = {}
    floor = math.floor
    for t, v in map(operator.attrgetter("time_seconds", attr), samples):
        if v is None:
            continue
        b = floor(t / interval_seconds)
        values = buckets.get(b)
        if values is None:
            buckets[b] = [float(v)]
        else:
            values.append(float(v))
    out = []
    for b in sorted(buckets):
        end = (b + 1) * interval_seconds
        if end > last_t + 1e-9:
            continue  # the interval in progress: its floor is not known yet
        out.append(((b + 0.5) * interval_seconds, pick(buckets[b])))
    return out


# --- the series -----------------------------------------------------------------------------


def usable(samples: Sequence[MemorySample], max_gap_seconds: float) -> list[MemorySample]:
    """The newest unbroken run: same generation, ready, observed, no gap over the limit."""
    out: list[MemorySample] = []
    for s in reversed(samples):
        if not s.ready or s.free_bytes is None:
            break
        if out:
            newer = out[-1]
            if newer.generation != s.generation:
                break
            if newer.time_seconds - s.time_seconds > max_gap_seconds:
                break
        out.append(s)
    out.reverse()
    return out


def forecast(
    gpu: int, samples: Sequence[MemorySample], now_seconds: float, cfg: ForecastSettings
) -> Forecast | None:
    """Time until the free-memory floor of ``gpu`` reaches zero; None: no trend to speak of.

    ``samples`` are oldest first and ``now_seconds`` is the tick's time: a newest sample older
    than ``max_gap_seconds`` is stale and gives no forecast.
    """
    if not samples or now_seconds - samples[-1].time_seconds > cfg.max_gap_seconds:
        return None
    run = usable(samples, cfg.max_gap_seconds)
    pts = floors(run, cfg.interval_seconds)
    if len(pts) < max(3, cfg.min_intervals):
        return None
    span = pts[-1][0] - pts[0][0]
    if span < cfg.min_span_seconds:
        return None
    trend = theil_sen(pts, cfg.confidence)
    if trend is None or not significant(pts, trend, span, cfg):
        return None
    # One step's activations are not a trend: the fall over the window must exceed the
    # largest swing of the free memory within one interval (the sawtooth's amplitude). The
    # run's first interval is left out of it: it holds the process's start (a reading taken
    # while the pool was still being reserved swung 57 GiB and vetoed the twin's neighbour
    # forecast for the whole window); its floor still counts in the trend.
    tops = dict(peaks(run, cfg.interval_seconds, "free_bytes"))
    swing = max(tops[t] - v for t, v in pts[1:])
    if -trend.slope_per_second * span < swing:
        return None
    level = max(0.0, trend.level_now)
    # The fitted level is at the newest interval's middle; count from now.
    ahead = now_seconds - pts[-1][0]
    seconds = max(0.0, level / -trend.slope_per_second - ahead)
    latest = max(0.0, level / -trend.slope_high_per_second - ahead)
    cause, evidence, neighbour = culprit(run, trend, cfg)
    return Forecast(
        gpu=gpu,
        seconds=seconds,
        seconds_latest=latest,
        floor_bytes=level,
        slope_bytes_per_second=trend.slope_per_second,
        intervals=len(pts),
        span_seconds=span,
        cause=cause,
        evidence=evidence,
        neighbour=neighbour,
    )


def significant(
    pts: Sequence[tuple[float, float]], trend: Trend, span: float, cfg: ForecastSettings
) -> bool:
    """A fall that is real and ongoing, not noise or a one-time step:

    * the slope's whole confidence interval is below zero, its shallow end at least
      ``precision_ratio`` of the estimate (the bound is not many times later than the forecast);
    * the fall over the window is at least ``noise_multiple`` × the floors' scatter around the
      line (1.4826 × the median absolute residual: σ for normal noise, robust to bursts);
    * the recent half of the window still falls, at least a quarter of the overall slope: the
      fall is ongoing. (A level that stepped down once and stayed fails the first test: half of
      its pairwise slopes are zero, so the interval reaches zero.)
    """
    slope = trend.slope_per_second
    if slope >= 0 or trend.slope_high_per_second > cfg.precision_ratio * slope:
        return False
    t_end = pts[-1][0]
    residuals = sorted(abs(v - (trend.level_now + slope * (t - t_end))) for t, v in pts)
    noise = 1.4826 * residuals[len(residuals) // 2]
    if -slope * span < cfg.noise_multiple * noise:
        return False
    mid = (pts[0][0] + pts[-1][0]) / 2
    recent = theil_sen([p for p in pts if p[0] >= mid], cfg.confidence)
    return recent is not None and recent.slope_per_second <= 0.25 * slope


# --- the cause ------------------------------------------------------------------------------


def _growth(run: Sequence[MemorySample], attr: str, cfg: ForecastSettings) -> float | None:
    """Theil–Sen slope of the per-interval peak of ``attr`` (bytes/s); None: not observed."""
    pts = peaks(run, cfg.interval_seconds, attr)
    if len(pts) < 3:
        return None
    trend = theil_sen(pts, cfg.confidence)
    return trend.slope_per_second if trend is not None else None


def _mib(v: float) -> str:
    return f"{v / 2**20:.1f} MiB/s"


def culprit(
    run: Sequence[MemorySample], trend: Trend, cfg: ForecastSettings
) -> tuple[Cause | None, str, Neighbour | None]:
    """Who takes the memory the floor loses (see the module docstring)."""
    fall = -trend.slope_per_second
    other = _growth(run, "other_bytes", cfg)
    service = _growth(run, "service_bytes", cfg)
    stranded = _growth(run, "stranded_bytes", cfg)
    need = cfg.culprit_share_ratio * fall
    parts = [f"floor -{_mib(fall)}"]
    if other is not None:
        parts.append(f"other processes +{_mib(other)}")
    if service is not None:
        parts.append(f"vLLM +{_mib(service)}")
    if stranded is not None:
        parts.append(f"allocator reserved-allocated +{_mib(stranded)}")
    evidence = ", ".join(parts)
    newest = run[-1]
    if other is not None and other >= need and (service is None or other >= service):
        return Cause.GPU_MEMORY_OVERCOMMIT, evidence, _grower(run)
    if stranded is not None and stranded >= need:
        s_now = newest.stranded_bytes or 0
        reserved = newest.reserved_bytes or 0
        if s_now >= cfg.min_stranded_bytes or s_now >= cfg.stranded_share_ratio * reserved:
            over = (
                newest.service_bytes is not None
                and newest.budget_bytes is not None
                and newest.service_bytes > newest.budget_bytes
            )
            where = "beyond its budget" if over else "within its budget"
            return (
                Cause.ALLOCATOR_FRAGMENTATION,
                f"{evidence}; {s_now / 2**30:.2f} GiB stranded, vLLM {where}",
                None,
            )
    if (
        service is not None
        and service >= need
        and stranded is not None
        and stranded < cfg.culprit_share_ratio * service
    ):
        return Cause.PREFILL_BURST, f"{evidence}; activation peaks growing", None
    return None, evidence, None


def _grower(run: Sequence[MemorySample]) -> Neighbour | None:
    """The other process that grew most between the first and the newest sample."""
    first = {n.pid: n.used_memory_bytes or 0 for n in run[0].neighbours}
    best: Neighbour | None = None
    best_growth = -1
    for n in run[-1].neighbours:
        growth = (n.used_memory_bytes or 0) - first.get(n.pid, 0)
        if growth > best_growth:
            best, best_growth = n, growth
    return best
