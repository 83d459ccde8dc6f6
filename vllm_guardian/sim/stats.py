"""The engine's counters, gauges and histograms, with vLLM 0.32's bucket boundaries.

These are the values ``vllm/v1/metrics/loggers.py`` feeds from each engine step and each
finished request; ``exposition`` renders them. Pure data holders: no clock, no I/O.
"""

from __future__ import annotations

import bisect

from vllm_guardian.sim.scheduler import FinishReason

TTFT_BUCKETS_SECONDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_SECONDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_SECONDS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
NUM_PREEMPTIONS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, … up to ``max_value``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class Histogram:
    """A cumulative Prometheus histogram (``observe`` may record n equal values at once)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs ending with +Inf."""
        out = []
        running = 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


# Names without the ``vllm:`` prefix, in the order the real server registers them.
REQUEST_TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
)


class EngineStats:
    """Everything ``vllm:*`` exports about one engine."""

    def __init__(self, max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)
        self.num_requests_running = 0
        self.num_requests_waiting = 0
        self.kv_cache_usage_ratio = 0.0
        self.prompt_tokens = 0
        self.prompt_tokens_local_compute = 0
        self.prompt_tokens_local_cache_hit = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.request_success: dict[FinishReason, int] = dict.fromkeys(FinishReason, 0)
        self.histograms: dict[str, Histogram] = {
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
            "iteration_tokens_total": Histogram(ITERATION_TOKENS_BUCKETS),
            "request_max_num_generation_tokens": Histogram(tokens),
            "request_params_n": Histogram(PARAMS_N_BUCKETS),
            "request_params_max_tokens": Histogram(tokens),
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS_SECONDS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS_SECONDS),
            "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS_SECONDS),
            "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS_SECONDS),
            "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS_SECONDS),
            "request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS_SECONDS),
            "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS_SECONDS),
            "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS_SECONDS),
            "request_num_preemptions": Histogram(NUM_PREEMPTIONS_BUCKETS),
            "request_prefill_kv_computed_tokens": Histogram(tokens),
        }

    def hist(self, name: str) -> Histogram:
        return self.histograms[name]
