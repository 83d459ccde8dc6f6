"""vLLM 0.32's ``/metrics``, written with prometheus_client as vLLM writes it.

Same families, types, HELP texts, label names, ``_created`` samples (which prometheus_client's
text format puts, as for vLLM, in separate ``*_created`` gauge families after each counter or
histogram), ``vllm:cache_config_info`` labels and histogram buckets as the real captures in
``tests/fixtures/vllm/``. One registry per twin (:func:`make_registry`, never the global one):
prometheus_client's gc, platform and process collectors give ``python_*``/``process_*``; a
:class:`TwinCollector` reads ``vllm:*`` (from the engine's stats) and ``http_*`` (from the
server's :class:`HttpStats`) at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vllm_guardian.sim.profiling import EngineConfig, StartupPlan
from vllm_guardian.sim.scheduler import FinishReason
from vllm_guardian.sim.stats import Histogram

Labels = tuple[tuple[str, str], ...]


def _names(rows: list[Labels]) -> list[str]:
    """The label names of a family's rows (every row of a family has the same names)."""
    return [k for k, _ in rows[0]] if rows else []


def counter(
    name: str, help_text: str, rows: Iterable[tuple[Labels, float]], created: float
) -> CounterMetricFamily:
    """``name_total`` per row, each with its ``name_created``, as vLLM's Counter has."""
    rows = list(rows)
    fam = CounterMetricFamily(name, help_text, labels=_names([lab for lab, _ in rows]))
    for lab, value in rows:
        fam.add_metric([v for _, v in lab], value, created=created)
    return fam


def gauge(name: str, help_text: str, rows: Iterable[tuple[Labels, float]]) -> GaugeMetricFamily:
    rows = list(rows)
    fam = GaugeMetricFamily(name, help_text, labels=_names([lab for lab, _ in rows]))
    for lab, value in rows:
        fam.add_metric([v for _, v in lab], value)
    return fam


def histogram(
    name: str, help_text: str, rows: Iterable[tuple[Labels, Histogram, float]]
) -> HistogramMetricFamily:
    """Buckets, count and sum per row, then its ``_created`` (the family class takes no
    created time, vLLM's Histogram has one: added as the sample prometheus_client's own
    Histogram yields)."""
    rows = list(rows)
    fam = HistogramMetricFamily(name, help_text, labels=_names([lab for lab, _, _ in rows]))
    for lab, h, created in rows:
        values = [v for _, v in lab]
        # ``le`` as prometheus_client's own Histogram writes it (floatToGoString has no types).
        buckets = [
            (floatToGoString(bound), float(n))  # type: ignore[no-untyped-call]
            for bound, n in h.cumulative()
        ]
        fam.add_metric(values, buckets, h.sum)
        fam.add_sample(f"{name}_created", dict(lab), created)
    return fam


def summary(
    name: str, help_text: str, rows: Iterable[tuple[Labels, int, float, float]]
) -> SummaryMetricFamily:
    """Count and sum per row, then its ``_created`` (as for :func:`histogram`)."""
    rows = list(rows)
    fam = SummaryMetricFamily(name, help_text, labels=_names([lab for lab, _, _, _ in rows]))
    for lab, count, total, created in rows:
        fam.add_metric([v for _, v in lab], count, total)
        fam.add_sample(f"{name}_created", dict(lab), created)
    return fam


# ---------------------------------------------------------------------- vllm:*

_HELP = {
    "estimated_flops_per_gpu": "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
    "estimated_read_bytes_per_gpu": "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
    "estimated_write_bytes_per_gpu": "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    "engine_sleep_state": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
    "external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
    "mm_cache_queries": "Multi-modal cache queries, in terms of number of queried items.",
    "mm_cache_hits": "Multi-modal cache hits, in terms of number of cached items.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "prompt_tokens_by_source": "Number of prompt tokens by source.",
    "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "prompt_tokens_cached_by_source": "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
    "generation_tokens": "Number of generation tokens processed.",
    "request_success": "Count of successfully processed requests.",
    "admission_rejections": "Number of admission attempts rejected by a queue limit, by reason.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
}  # fmt: skip

# Histograms in registration order (loggers.py), all labelled {engine, model_name}.
_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "request_max_num_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_num_preemptions",
    "request_prefill_kv_computed_tokens",
)


def cache_config_labels(cfg: EngineConfig, plan: StartupPlan, user_block_size: bool) -> Labels:
    """``CacheConfig.metrics_info()`` of vLLM 0.32: every field, stringified with str()."""
    values = {
        "_block_size_resolved": "True",
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(cfg.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(plan.max_concurrency),
        "kv_cache_memory_bytes": str(cfg.kv_cache_memory_bytes),
        "kv_cache_size_tokens": str(plan.kv_cache_size_tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(plan.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": str(user_block_size),
    }
    return tuple(sorted(values.items()))


@dataclass(frozen=True)
class VllmView:
    """What the API server's PrometheusStatLogger knows about the engine."""

    model_name: str
    running: int
    waiting: int
    kv_cache_usage_ratio: float
    counters: dict[str, float]
    request_success: dict[FinishReason, int]
    histograms: dict[str, Histogram]
    cache_labels: Labels
    created_unix_seconds: float
    admission_rejections: dict[str, int] = field(default_factory=dict)
    sleep_level: int | None = None  # None: awake; else the level of vLLM's /sleep


def vllm_families(v: VllmView) -> list[Metric]:
    lab: Labels = (("engine", "0"), ("model_name", v.model_name))
    c = v.counters
    t0 = v.created_unix_seconds

    def ctr(name: str, value: float) -> Metric:
        return counter(f"vllm:{name}", _HELP[name], [(lab, value)], t0)

    def g(name: str, value: float) -> Metric:
        return gauge(f"vllm:{name}", _HELP[name], [(lab, value)])

    fams: list[Metric] = [
        ctr("estimated_flops_per_gpu", 0.0),
        ctr("estimated_read_bytes_per_gpu", 0.0),
        ctr("estimated_write_bytes_per_gpu", 0.0),
        g("num_requests_running", v.running),
        g("num_requests_waiting", v.waiting),
        gauge(
            "vllm:num_requests_waiting_by_reason",
            _HELP["num_requests_waiting_by_reason"],
            [((*lab, ("reason", "capacity")), v.waiting), ((*lab, ("reason", "deferred")), 0.0)],
        ),
        gauge(
            "vllm:engine_sleep_state",
            _HELP["engine_sleep_state"],
            [
                # vLLM's record_sleep_state: awake 1 when awake; asleep, awake 0 and the
                # level's own state 1 (level 0, a pause only: all three 0).
                ((*lab, ("sleep_state", state)), 1.0 if on else 0.0)
                for state, on in (
                    ("awake", v.sleep_level is None),
                    ("weights_offloaded", v.sleep_level == 1),
                    ("discard_all", v.sleep_level == 2),
                )
            ],
        ),
        g("kv_cache_usage_perc", v.kv_cache_usage_ratio),
        ctr("prefix_cache_queries", c["prefix_cache_queries"]),
        ctr("prefix_cache_hits", c["prefix_cache_hits"]),
        ctr("external_prefix_cache_queries", 0.0),
        ctr("external_prefix_cache_hits", 0.0),
        ctr("mm_cache_queries", 0.0),
        ctr("mm_cache_hits", 0.0),
        ctr("num_preemptions", c["num_preemptions"]),
        ctr("prompt_tokens", c["prompt_tokens"]),
        counter(
            "vllm:prompt_tokens_by_source",
            _HELP["prompt_tokens_by_source"],
            [
                ((*lab, ("source", "local_compute")), c["prompt_tokens_local_compute"]),
                ((*lab, ("source", "local_cache_hit")), c["prompt_tokens_local_cache_hit"]),
                ((*lab, ("source", "external_kv_transfer")), 0.0),
            ],
            t0,
        ),
        ctr("prompt_tokens_cached", c["prompt_tokens_local_cache_hit"]),
        counter(
            "vllm:prompt_tokens_cached_by_source",
            _HELP["prompt_tokens_cached_by_source"],
            [
                (
                    (*lab, ("source", src)),
                    c["prompt_tokens_local_cache_hit"] if src == "device" else 0.0,
                )
                for src in ("device", "host", "p2p", "disk", "external_unspecified")
            ],
            t0,
        ),
        ctr("generation_tokens", c["generation_tokens"]),
        counter(
            "vllm:request_success",
            _HELP["request_success"],
            [((*lab, ("finished_reason", r.value)), v.request_success[r]) for r in FinishReason],
            t0,
        ),
        counter(
            "vllm:admission_rejections",
            _HELP["admission_rejections"],
            [
                ((("model_name", v.model_name), ("reason", r)), v.admission_rejections.get(r, 0))
                for r in ("max_num_queued_reqs", "max_num_queued_tokens")
            ],
            t0,
        ),
    ]
    fams.extend(
        histogram(f"vllm:{name}", _HELP[name], [(lab, v.histograms[name], t0)])
        for name in _HISTOGRAMS
    )
    fams.append(
        gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [(v.cache_labels, 1.0)],
        )
    )
    return fams


# ---------------------------------------------------------------------- http_* and runtime

# prometheus_fastapi_instrumentator's defaults.
HTTP_DURATION_BUCKETS_SECONDS = (0.1, 0.5, 1.0)
HTTP_HIGHR_BUCKETS_SECONDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5,
    5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
# The instrumentator does not count these handlers (vLLM's instrumentator/metrics.py).
HTTP_EXCLUDED_HANDLERS = frozenset(
    {"/metrics", "/health", "/load", "/ping", "/version", "/server_info"}
)


@dataclass
class _HandlerStats:
    created: float
    req_count: int = 0
    req_bytes: float = 0.0
    resp_count: int = 0
    resp_bytes: float = 0.0


@dataclass
class HttpStats:
    """The instrumentator's counters; the server calls ``observe`` under its own lock."""

    created_unix_seconds: float
    requests: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)
    handlers: dict[str, _HandlerStats] = field(default_factory=dict)
    durations: dict[tuple[str, str], tuple[Histogram, float]] = field(default_factory=dict)
    highr: Histogram = field(default_factory=lambda: Histogram(HTTP_HIGHR_BUCKETS_SECONDS))

    def observe(
        self,
        handler: str,
        method: str,
        status: int,
        request_bytes: int,
        response_bytes: int,
        duration_seconds: float,
        now_unix_seconds: float,
    ) -> None:
        if handler in HTTP_EXCLUDED_HANDLERS:
            return
        key = (handler, method, f"{status // 100}xx")
        count, created = self.requests.get(key, (0, now_unix_seconds))
        self.requests[key] = (count + 1, created)
        hs = self.handlers.setdefault(handler, _HandlerStats(now_unix_seconds))
        hs.req_count += 1
        hs.req_bytes += request_bytes
        hs.resp_count += 1
        hs.resp_bytes += response_bytes
        hist, hcreated = self.durations.get(
            (handler, method), (Histogram(HTTP_DURATION_BUCKETS_SECONDS), now_unix_seconds)
        )
        hist.observe(duration_seconds)
        self.durations[(handler, method)] = (hist, hcreated)
        self.highr.observe(duration_seconds)

    def families(self) -> list[Metric]:
        """The instrumentator's families, in its registration order. Read under the lock that
        ``observe`` runs under."""
        size_help = "Content length of incoming requests by handler. Only value of header is respected. Otherwise ignored. No percentile calculated. "
        resp_help = "Content length of outgoing responses by handler. Only value of header is respected. Otherwise ignored. No percentile calculated. "
        requests = CounterMetricFamily(
            "http_requests",
            "Total number of requests by method, status and handler.",
            labels=["handler", "method", "status"],
        )
        for (h, m, st), (n, t) in self.requests.items():
            requests.add_metric([h, m, st], n, created=t)
        return [
            requests,
            summary("http_request_size_bytes", size_help,
                    [((("handler", h),), s.req_count, s.req_bytes, s.created) for h, s in self.handlers.items()]),
            summary("http_response_size_bytes", resp_help,
                    [((("handler", h),), s.resp_count, s.resp_bytes, s.created) for h, s in self.handlers.items()]),
            histogram(
                "http_request_duration_highr_seconds",
                "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
                [((), self.highr, self.created_unix_seconds)],
            ),
            histogram(
                "http_request_duration_seconds",
                "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
                [((("handler", h), ("method", m)), hist, t) for (h, m), (hist, t) in self.durations.items()],
            ),
        ]  # fmt: skip


class TwinCollector:
    """``vllm:*`` and ``http_*`` at each scrape, from ``read``: the server's callable that takes
    its lock and returns the families (a prometheus_client custom collector)."""

    def __init__(self, read: Callable[[], list[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return self._read()


def make_registry(
    read: Callable[[], list[Metric]], runtime: Iterable[Collector] | None = None
) -> CollectorRegistry:
    """The twin's page: a private registry (never the global one) with, in vLLM's order, the
    runtime's collectors (None: prometheus_client's gc, platform and process collectors, as
    vLLM has; the virtual-time harness passes its own, on its fake clock), then ``vllm:*``
    (absent with --disable-log-stats) and ``http_*`` from ``read``."""
    registry = CollectorRegistry()
    if runtime is None:
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        ProcessCollector(registry=registry)
    else:
        for collector in runtime:
            registry.register(collector)
    registry.register(TwinCollector(read))
    return registry


def render_metrics(registry: CollectorRegistry) -> str:
    """The whole page, in prometheus_client's text format."""
    return generate_latest(registry).decode("utf-8")
