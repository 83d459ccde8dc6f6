"""Is the service over capacity, by how much, and how many replicas would carry the load? Pure.

Where it sits: inside signal derivation (``core/signals.py`` calls :func:`estimate` on the
snapshot history each tick), so the figures reach the alert rules (``VllmOverCapacity``), the
exposition (``vllm_guardian_capacity_demand_ratio`` / ``_replicas_needed``), ``status`` and
``diagnose`` the same way every other signal does. No I/O, no clock: time comes from the
snapshots.

**How.** Over the last ``window_seconds`` (default 120 s: many finished requests and several of
vLLM's stat updates, short enough to follow a shift in load) it reads only vLLM's own series:

* *served*: requests that finished without abort or error per second
  (``vllm:request_success_total`` minus its ``abort``/``error`` reasons), and prompt +
  generation tokens per second (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``);
* *arrivals*: every request that left the engine (finished, aborted or failed) plus the growth
  of the requests in the engine (``num_requests_running + num_requests_waiting``; the least-
  squares slope over the window times its span, so one noisy reading cannot swing it); with
  the guardian's admission gate in front (``sources.gate``), also the growth of the gate's
  queue and the requests it turned away: demand held at the front door is demand; and when
  the gate counts its arrivals (``arrived_total``), at least that many: vLLM counts only what
  reached its engine, and a request abandoned in a busy API server's backlog never does;
* *demand ratio* = arrivals ÷ served (> 1: work arrives faster than it is served; a request
  abandoned in the queue is demand the service did not meet); demand tokens/s = served
  tokens/s × the ratio (arriving requests are assumed to be like the served ones);
* *replicas needed* = ⌈ratio × replicas ÷ (1 + tolerance)⌉: a ratio within the estimate's
  own noise (10 %) above a whole number does not buy one more replica; the gate sheds that.

Saturation is read from the queue, not from KV usage: a full pool with an empty queue is vLLM
packing its pool (healthy), and a queue behind a pool that is not full is a server at its
``--max-num-seqs`` or compute limit, which is saturation too. The mean KV usage over the window
is kept beside the estimate to say which limit it was.

This is the saturation analysis of llm-d's Workload Variant Autoscaler (KV usage, queue depth
and token throughput to a desired replica count), reduced to what one vLLM's ``/metrics`` says:
no router, no per-variant profile. The served rate *is* the capacity only while the server is
saturated, so that is checked first.

**When it refuses** (the state says which; never a number from too little data):

* ``no_stats``: ``--disable-log-stats`` (no ``vllm:*`` series) or no request counters;
* ``restarted``: ``process_start_time_seconds`` changed or a counter went down in the window:
  counters reset at a restart, and the minutes after one are not steady state;
* ``too_little_data``: less than ``min_span_ratio`` of the window observed (the guardian just
  started, scrapes failed), or fewer than ``min_finished`` requests served in it;
* ``idle``: nothing arrived and nothing is in the engine;
* ``not_saturated``: requests waited (in vLLM or at the gate) in fewer than
  ``saturated_share_ratio`` of the samples, and the requests in the engine did not grow over
  the window (by at least ``MIN_BACKLOG_GROWTH_REQUESTS`` and a tenth of those served). A
  server that keeps up serves what arrives, so its capacity cannot be read from it; bursts
  shorter than the window land here too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# A backlog inside the engine that grew by at least this many requests over the window (and a
# tenth of those served) is saturation even without a queue: a few requests of noise are not.
MIN_BACKLOG_GROWTH_REQUESTS = 5.0


class CapacityState(StrEnum):
    ESTIMATED = "estimated"
    NO_DATA = "no_data"
    NO_STATS = "no_stats"
    RESTARTED = "restarted"
    TOO_LITTLE_DATA = "too_little_data"
    IDLE = "idle"
    NOT_SATURATED = "not_saturated"


@dataclass(frozen=True)
class CapacitySample:
    """One scrape of one service, reduced to what the estimate reads (summed over engines)."""

    time_seconds: float
    scraped: bool  # /metrics answered
    stats_enabled: bool | None = None
    process_start_seconds: float | None = None
    finished_total: float | None = None  # every finished_reason, aborts included
    failed_total: float | None = None  # finished_reason abort|error
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage_ratio: float | None = None
    # The admission gate in front of vLLM, when there is one and it answered: requests it holds
    # and requests it turned away (counter since it started). Demand vLLM never sees.
    gate_queued: float | None = None
    gate_rejected_total: float | None = None
    # ...and every request that cost vLLM work as it arrived (counter since it started): the
    # demand itself, where vLLM sees only what reached its engine (below, *arrivals*).
    gate_arrived_total: float | None = None
    # vllm:admission_rejections_total: requests vLLM itself answered 503 at its queue limits
    # (--max-num-queued-reqs/-tokens). Demand it turned away, like the gate's.
    admission_rejected_total: float | None = None


@dataclass(frozen=True)
class CapacitySettings:
    window_seconds: float = 120.0
    min_span_ratio: float = 0.8  # of the window actually observed
    saturated_share_ratio: float = 0.9  # of the samples with requests waiting
    min_finished: int = 10  # requests served in the window
    replicas: int = 1  # the replicas behind this figure (one vLLM service)
    replica_tolerance_ratio: float = 0.1


@dataclass(frozen=True)
class CapacityEstimate:
    state: CapacityState
    reason: str
    span_seconds: float = 0.0
    saturated_share_ratio: float | None = None
    served_requests_per_second: float | None = None
    arrivals_per_second: float | None = None
    served_tokens_per_second: float | None = None
    demand_tokens_per_second: float | None = None
    demand_ratio: float | None = None
    replicas_needed: int | None = None
    kv_usage_mean_ratio: float | None = None  # context: was the KV pool the limit?

    def line(self) -> str:
        """One line for `status`, the demo and diagnose."""
        if self.demand_ratio is None:
            return f"capacity: no estimate ({self.state.value}): {self.reason}"
        kv = (
            f", KV {100 * self.kv_usage_mean_ratio:.0f} %"
            if self.kv_usage_mean_ratio is not None
            else ""
        )
        return (
            f"capacity: demand {self.demand_ratio:.2f}x what it serves at saturation{kv} "
            f"({_num(self.demand_tokens_per_second)} vs {_num(self.served_tokens_per_second)} "
            f"tokens/s, {self.arrivals_per_second or 0:.2f} vs "
            f"{self.served_requests_per_second or 0:.2f} req/s over {self.span_seconds:.0f}s): "
            f"{self.replicas_needed} replica(s) needed"
        )


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:,.0f}"


def _slope(points: Sequence[tuple[float, float]]) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    if den <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in points) / den


def _increase(values: Sequence[float | None]) -> float:
    """A counter's increase over the known values (a drop is a restart: counts from zero)."""
    known = [v for v in values if v is not None]
    return sum(b if b < a else b - a for a, b in itertools.pairwise(known))


def _delta(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None else last - first


def estimate(
    samples: Sequence[CapacitySample], settings: CapacitySettings | None = None
) -> CapacityEstimate:
    """The estimate over ``samples`` (oldest first; the caller passes the window's samples)."""
    st = settings or CapacitySettings()
    scraped = [s for s in samples if s.scraped]
    counted = [
        s
        for s in scraped
        if s.finished_total is not None and s.running is not None and s.waiting is not None
    ]
    refused = _unreadable(scraped, counted)
    if refused is not None:
        return refused
    first, last = counted[0], counted[-1]
    span = last.time_seconds - first.time_seconds
    if span < st.min_span_ratio * st.window_seconds or len(counted) < 3:
        return CapacityEstimate(
            CapacityState.TOO_LITTLE_DATA,
            f"{span:.0f}s of the {st.window_seconds:.0f}s window observed in {len(counted)} "
            "scrape(s) (80 % of the window and 3 scrapes needed)",
            span,
        )
    finished = _delta(first.finished_total, last.finished_total) or 0.0
    failed = _delta(first.failed_total, last.failed_total) or 0.0
    served = finished - failed
    in_engine = [
        (s.time_seconds, (s.running or 0.0) + (s.waiting or 0.0) + (s.gate_queued or 0.0))
        for s in counted
    ]
    turned_away = _increase([s.gate_rejected_total for s in counted]) + _increase(
        [s.admission_rejected_total for s in counted]
    )
    if finished <= 0 and turned_away <= 0 and all(v <= 0 for _, v in in_engine):
        return CapacityEstimate(CapacityState.IDLE, "idle: no request arrived or ran", span)
    waited = sum(
        1 for s in counted if (s.waiting or 0.0) >= 1.0 or (s.gate_queued or 0.0) >= 1.0
    ) / len(counted)
    growth = _slope(in_engine) * span
    # A backlog growing inside the engine is saturation too: vLLM V1 admits into `running` up to
    # --max-num-seqs, so an overloaded server with room for sequences shows a running count that
    # keeps climbing rather than a queue (on the real vLLM tier at 2.3x demand, requests waited
    # in only 11 % of the samples while running grew all window).
    backlog_growing = growth >= max(MIN_BACKLOG_GROWTH_REQUESTS, 0.1 * max(finished, 0.0))
    if waited < st.saturated_share_ratio and not backlog_growing:
        return CapacityEstimate(
            CapacityState.NOT_SATURATED,
            f"requests waited in only {waited:.0%} of the window "
            f"({st.saturated_share_ratio:.0%} needed): a server that keeps up with what arrives "
            "cannot tell its capacity",
            span,
            waited,
        )
    if served < st.min_finished:
        return CapacityEstimate(
            CapacityState.TOO_LITTLE_DATA,
            f"saturated, but only {served:.0f} requests served in {span:.0f}s "
            f"({st.min_finished} needed): capacity not measurable from this data",
            span,
            waited,
        )
    return _estimated(counted, st, span, waited, growth, finished, served, turned_away)


def _unreadable(
    scraped: Sequence[CapacitySample], counted: Sequence[CapacitySample]
) -> CapacityEstimate | None:
    """Why the window's scrapes cannot give an estimate at all (no data, no stats, a restart),
    or None."""
    if not scraped:
        return CapacityEstimate(CapacityState.NO_DATA, "no /metrics scrape in the window")
    if any(s.stats_enabled is False for s in scraped):
        return CapacityEstimate(
            CapacityState.NO_STATS, "vLLM runs with --disable-log-stats: no vllm:* series"
        )
    if not counted or counted[-1] is not scraped[-1]:
        return CapacityEstimate(
            CapacityState.NO_STATS,
            "vLLM exports no request_success_total / num_requests_running / waiting",
        )
    starts = {s.process_start_seconds for s in scraped if s.process_start_seconds is not None}
    counters = ("finished_total", "failed_total", "prompt_tokens_total", "generation_tokens_total")
    went_down = any(
        (a := getattr(p, c)) is not None and (b := getattr(q, c)) is not None and b < a
        for p, q in itertools.pairwise(counted)
        for c in counters
    )
    if len(starts) > 1 or went_down:
        return CapacityEstimate(
            CapacityState.RESTARTED,
            "vLLM restarted within the window (its counters reset): no estimate until a whole "
            "window has passed since",
        )
    return None


def _gate_arrivals(
    counted: Sequence[CapacitySample], st: CapacitySettings, span: float
) -> float | None:
    """The requests the gate counted arriving over the window's span, or None when its status
    was read over too little of it. A busy host makes the gate's source miss some ticks (its
    own deadline): the count over the readings it has, scaled to the span."""
    known = [(s.time_seconds, s.gate_arrived_total) for s in counted]
    known = [(t, v) for t, v in known if v is not None]
    if len(known) < 2:
        return None
    covered = known[-1][0] - known[0][0]
    if covered <= 0 or covered < st.min_span_ratio * span:
        return None
    return _increase([v for _, v in known]) * span / covered


def _estimated(
    counted: Sequence[CapacitySample],
    st: CapacitySettings,
    span: float,
    waited: float,
    growth: float,
    finished: float,
    served: float,
    turned_away: float,
) -> CapacityEstimate:
    """The estimate of a saturated window: what arrived against what was served."""
    first, last = counted[0], counted[-1]
    arrivals = finished + growth + turned_away
    # The gate counts each request as it arrives; vLLM's counters miss what never reached its
    # engine (a busy API server's backlog, requests abandoned there by their clients' timeouts:
    # on the real CPU vLLM at ~2x demand they read 0.9-1.8x, where the gate counted about two
    # arrivals a second against under one served). The larger of the two: clients that bypass
    # the gate are still in vLLM's count.
    gate_arrivals = _gate_arrivals(counted, st, span)
    if gate_arrivals is not None:
        arrivals = max(arrivals, gate_arrivals)
    ratio = max(0.0, arrivals / served)
    tokens = [
        _delta(first.prompt_tokens_total, last.prompt_tokens_total),
        _delta(first.generation_tokens_total, last.generation_tokens_total),
    ]
    served_tokens = (
        sum(t for t in tokens if t is not None) / span
        if any(t is not None for t in tokens)
        else None
    )
    replicas = max(1, math.ceil(ratio * st.replicas / (1.0 + st.replica_tolerance_ratio)))
    usages = [s.kv_usage_ratio for s in counted if s.kv_usage_ratio is not None]
    return CapacityEstimate(
        CapacityState.ESTIMATED,
        f"saturated (requests waited in {waited:.0%} of the window)"
        if waited >= st.saturated_share_ratio
        else f"saturated (the requests in the engine grew by {growth:.0f} over the window)",
        span,
        waited,
        served / span,
        arrivals / span,
        served_tokens,
        served_tokens * ratio if served_tokens is not None else None,
        ratio,
        replicas,
        sum(usages) / len(usages) if usages else None,
    )
