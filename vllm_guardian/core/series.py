"""Generic series math over snapshot history, Prometheus semantics: counter rates and increases
(a reset counts from zero), histogram quantiles, a least-squares slope, the window of
snapshots a signal reads, and sums that stay None when nothing is known."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from vllm_guardian.model import (
    Snapshot,
)

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


def sum_opt(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def sum_int(values: Sequence[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


def window_of(history: Sequence[Snapshot], seconds: float) -> Sequence[Snapshot]:
    """The snapshots from ``seconds`` before the newest on (the whole history when it is
    shorter). Found by bisection: a history is in time order (the daemon's steady clock; replay
    drops a record that goes backwards; :func:`vllm_guardian.core.step.trim` relies on it too),
    and the first snapshot at or after the cut is the one a scan from the oldest would find."""
    start = first_from(history, history[-1].time_seconds - seconds - 1e-9)
    return history[start:] if start < len(history) else history


def first_from(history: Sequence[Snapshot], cut: float) -> int:
    """The index of the first snapshot at or after ``cut`` (``len(history)``: none is)."""
    lo, hi = 0, len(history)
    while lo < hi:
        mid = (lo + hi) // 2
        if history[mid].time_seconds >= cut:
            hi = mid
        else:
            lo = mid + 1
    return lo
