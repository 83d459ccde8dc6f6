"""One step's figures, from what the client measured and what the core derived.

Client side (what users see): requests, errors, output tokens/s, TTFT and end-to-end latency
p50/p99 from each request's outcome. Server side (``core/signals.derive`` over the step's
snapshots, windows as long as the step): preemptions/s, generation tokens/s, vLLM's own TTFT
and e2e p99 from its histograms, KV usage peak, queue peak, GPU memory peak and the least
headroom. The limits a step must hold are checked here, at the end of the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.sim.load import OutcomeKind, RequestOutcome

from .profile import Limits, StepSpec


@dataclass(frozen=True)
class StepResult:
    index: int
    label: str
    concurrency: int | None
    rate_per_second: float | None
    duration_seconds: float
    requests: int  # finished (ok or failed)
    errors: int
    dropped: int  # open loop: arrivals over max_in_flight
    error_ratio: float | None
    prompt_tokens_mean: float | None
    request_tokens_max: int | None  # prompt + output of the longest finished request
    output_tokens_per_second: float | None  # client side
    generation_tokens_per_second: float | None  # server side
    ttft_p50_seconds: float | None
    ttft_p99_seconds: float | None
    e2e_p50_seconds: float | None
    e2e_p99_seconds: float | None
    server_ttft_p99_seconds: float | None  # vLLM's histogram (the twin's are simulated s)
    server_e2e_p99_seconds: float | None
    kv_usage_peak_ratio: float | None
    kv_capacity_tokens: int | None
    requests_running_peak: float | None
    requests_waiting_peak: float | None
    preemptions: float | None
    preemptions_per_second: float | None
    gpu_memory_used_peak_bytes: int | None
    gpu_memory_total_bytes: int | None
    gpu_headroom_min_bytes: int | None
    gpu_memory_utilization_ratio: float | None
    violations: tuple[tuple[str, str], ...]  # (limit, message)
    complete: bool  # ran its whole duration
    # The highest headroom reading of the step: with min, the swing one step's activations make
    # (a reading mid-prefill holds them, one between steps does not).
    gpu_headroom_max_bytes: int | None = None

    @property
    def held(self) -> bool:
        return not self.violations and self.complete


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (p99 of 50 values is the largest: no interpolation optimism)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _max(values: Sequence[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _min_int(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _gpu_used(sig: ServiceSignals) -> int | None:
    """Memory in use on the server's GPUs (total − free), None when any figure is missing."""
    if not sig.gpus:
        return None
    used = 0
    for g in sig.gpus:
        if g.total_bytes is None or g.free_bytes is None:
            return None
        used += g.total_bytes - g.free_bytes
    return used


def _server_p99(sig: ServiceSignals | None, metric: str) -> float | None:
    if sig is None:
        return None
    for lq in sig.latency:
        if lq.metric == metric and lq.quantile == 0.99:
            return lq.seconds
    return None


def summarize(
    spec: StepSpec,
    outcomes: Sequence[RequestOutcome],
    samples: Sequence[ServiceSignals],
    whole: ServiceSignals | None,
    duration_seconds: float,
    dropped: int,
    instant: Sequence[tuple[str, str]],
    complete: bool,
    limits: Limits,
) -> StepResult:
    """``samples``: the signals at each sample; ``whole``: derived over the whole step."""
    done = [o for o in outcomes if o.kind is not OutcomeKind.NOT_SENT]
    ok = [o for o in done if o.kind is OutcomeKind.OK]
    errors = len(done) - len(ok)
    ttfts = [o.ttft_seconds for o in ok if o.ttft_seconds is not None]
    e2es = [o.latency_seconds for o in ok if o.latency_seconds is not None]
    dur = max(duration_seconds, 1e-9)
    used = [_gpu_used(s) for s in samples]
    totals = [
        sum(g.total_bytes for g in s.gpus if g.total_bytes is not None) for s in samples if s.gpus
    ]
    preempt_rate = whole.preemptions_per_second if whole is not None else None
    result = StepResult(
        index=spec.index,
        label=spec.label,
        concurrency=spec.concurrency,
        rate_per_second=spec.rate_per_second,
        duration_seconds=round(duration_seconds, 3),
        requests=len(done),
        errors=errors,
        dropped=dropped,
        error_ratio=errors / len(done) if done else None,
        prompt_tokens_mean=sum(o.prompt_tokens for o in ok) / len(ok) if ok else None,
        request_tokens_max=max((o.prompt_tokens + o.completion_tokens for o in ok), default=None),
        output_tokens_per_second=sum(o.completion_tokens for o in ok) / dur if done else None,
        generation_tokens_per_second=whole.generation_tokens_per_second if whole else None,
        ttft_p50_seconds=quantile(ttfts, 0.5),
        ttft_p99_seconds=quantile(ttfts, 0.99),
        e2e_p50_seconds=quantile(e2es, 0.5),
        e2e_p99_seconds=quantile(e2es, 0.99),
        server_ttft_p99_seconds=_server_p99(whole, "ttft"),
        server_e2e_p99_seconds=_server_p99(whole, "e2e"),
        kv_usage_peak_ratio=_max([s.kv_cache_usage_ratio for s in samples]),
        kv_capacity_tokens=next(
            (s.kv_cache_capacity_tokens for s in reversed(samples) if s.kv_cache_capacity_tokens),
            None,
        ),
        requests_running_peak=_max([s.requests_running for s in samples]),
        requests_waiting_peak=_max([s.requests_waiting for s in samples]),
        preemptions=preempt_rate * dur if preempt_rate is not None else None,
        preemptions_per_second=preempt_rate,
        gpu_memory_used_peak_bytes=int(m) if (m := _max(used)) is not None else None,
        gpu_memory_total_bytes=max(totals) if totals else None,
        gpu_headroom_min_bytes=_min_int([s.headroom_bytes for s in samples]),
        gpu_headroom_max_bytes=(
            int(hi) if (hi := _max([s.headroom_bytes for s in samples])) is not None else None
        ),
        gpu_memory_utilization_ratio=next(
            (
                s.gpu_memory_utilization_ratio
                for s in samples
                if s.gpu_memory_utilization_ratio is not None
            ),
            None,
        ),
        violations=tuple(instant),
        complete=complete,
    )
    return check_limits(result, limits)


def check_limits(r: StepResult, limits: Limits) -> StepResult:
    """The end-of-step limits, added to the violations already seen during the step."""
    found = list(r.violations)
    seen = {k for k, _ in found}

    def add(limit: str, message: str) -> None:
        if limit not in seen:
            seen.add(limit)
            found.append((limit, message))

    slo_ttft, slo_e2e = limits.p99_ttft_seconds, limits.p99_e2e_seconds
    if slo_ttft is not None and r.ttft_p99_seconds is not None and r.ttft_p99_seconds > slo_ttft:
        add("p99_ttft", f"TTFT p99 {r.ttft_p99_seconds:.3f} s over the SLO {slo_ttft:g} s")
    if slo_e2e is not None and r.e2e_p99_seconds is not None and r.e2e_p99_seconds > slo_e2e:
        add("p99_e2e", f"e2e p99 {r.e2e_p99_seconds:.3f} s over the SLO {slo_e2e:g} s")
    if r.error_ratio is not None and r.error_ratio > limits.error_ratio:
        add(
            "error_ratio",
            f"{r.errors} of {r.requests} requests failed ({r.error_ratio:.1%}, limit "
            f"{limits.error_ratio:.0%})",
        )
    if r.requests == 0 and r.complete:
        add("error_ratio", "no request finished in the step")
    if (
        r.preemptions_per_second is not None
        and r.preemptions_per_second > limits.preemptions_per_second
    ):
        add(
            "preemption_rate",
            f"{r.preemptions_per_second:.2f} preemptions/s (limit "
            f"{limits.preemptions_per_second:g}/s): the KV pool is saturated",
        )
    floor = limits.gpu_headroom_floor_bytes
    if r.gpu_headroom_min_bytes is not None and r.gpu_headroom_min_bytes < floor:
        add(
            "gpu_headroom",
            f"GPU headroom {r.gpu_headroom_min_bytes / 2**30:.2f} GiB under the floor "
            f"{floor / 2**30:.2f} GiB",
        )
    return replace(r, violations=tuple(found))
