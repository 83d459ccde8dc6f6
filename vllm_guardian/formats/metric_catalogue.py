"""The guardian's own metrics, as data: one row per family its ``/metrics`` exports.

Where it sits: ``exposition.py`` renders every family from a row here (:func:`gauge`,
:func:`counter`), so a name, its help and its labels are written once; ``docs/metrics.md`` is
checked against this table by ``tests/test_docs_reference.py``. Adding a metric is a row here
and the line in ``exposition.py`` that gives it a value. The gate's own metrics live with the
gate (``gate/metrics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

NS = "vllm_guardian"


class MetricType(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"


GAUGE = MetricType.GAUGE
COUNTER = MetricType.COUNTER


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the namespace, and for a counter without ``_total``
    type: MetricType
    help: str
    labels: tuple[str, ...]

    @property
    def full_name(self) -> str:
        """The name as scraped: ``vllm_guardian_…``, a counter's with ``_total``."""
        return f"{NS}_{self.name}" + ("_total" if self.type is MetricType.COUNTER else "")


CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("ticks", COUNTER, "Ticks completed since the guardian started.", ()),
    MetricSpec(
        "ready",
        GAUGE,
        "1 when /ready/<service> answers 200 (admits new work), 0 when gated.",
        ("service",),
    ),
    MetricSpec(
        "build_info",
        GAUGE,
        "The guardian's version and Python, always 1.",
        ("version", "python_version"),
    ),
    MetricSpec(
        "tick_duration_seconds", GAUGE, "Wall time of the last tick (collect to publish).", ()
    ),
    MetricSpec("last_tick_timestamp_seconds", GAUGE, "Unix time of the last completed tick.", ()),
    MetricSpec(
        "source_up",
        GAUGE,
        "1 when the source observed this tick, 0 when it could not (see the guardian's log for why).",
        ("service", "source"),
    ),
    MetricSpec(
        "source_duration_seconds",
        GAUGE,
        "How long the source took this tick.",
        ("service", "source"),
    ),
    MetricSpec(
        "kv_cache_usage_ratio",
        GAUGE,
        "Share of vLLM's KV block pool in use (0..1), all engines.",
        ("service",),
    ),
    MetricSpec(
        "requests_waiting", GAUGE, "Requests queued in vLLM, not yet scheduled.", ("service",)
    ),
    MetricSpec("requests_running", GAUGE, "Requests in vLLM's running batch.", ("service",)),
    MetricSpec("requests_swapped", GAUGE, "Requests swapped to CPU (vLLM V0 only).", ("service",)),
    MetricSpec(
        "preemptions_per_second",
        GAUGE,
        "vLLM preemptions per second (KV pool ran out).",
        ("service",),
    ),
    MetricSpec(
        "prompt_tokens_per_second", GAUGE, "Prefill tokens processed per second.", ("service",)
    ),
    MetricSpec("generation_tokens_per_second", GAUGE, "Tokens generated per second.", ("service",)),
    MetricSpec(
        "request_failures_per_second",
        GAUGE,
        "Requests finished with reason abort or error, per second.",
        ("service",),
    ),
    MetricSpec(
        "admission_rejections_per_second",
        GAUGE,
        "Requests vLLM itself answered 503 at its queue limits (--max-num-queued-reqs/-tokens), "
        "per second.",
        ("service",),
    ),
    MetricSpec(
        "prefix_cache_hit_ratio",
        GAUGE,
        "Prefix-cache hit ratio over the rate window (tokens).",
        ("service",),
    ),
    MetricSpec(
        "engine_stall_seconds",
        GAUGE,
        "How long requests have been in the engine with no progress (tokens, KV usage, preemptions).",
        ("service",),
    ),
    MetricSpec(
        "kv_cache_capacity_tokens",
        GAUGE,
        "Tokens vLLM's KV block pool holds, all engines.",
        ("service",),
    ),
    MetricSpec(
        "vllm_gpu_memory_utilization_ratio",
        GAUGE,
        "vLLM's --gpu-memory-utilization as it reports it.",
        ("service",),
    ),
    MetricSpec(
        "memory_budget_bytes",
        GAUGE,
        "GPU memory vLLM planned to use: gpu_memory_utilization × total, over its GPUs.",
        ("service",),
    ),
    MetricSpec(
        "service_memory_bytes",
        GAUGE,
        "GPU memory held by the service's processes, all its GPUs.",
        ("service",),
    ),
    MetricSpec(
        "memory_over_budget_bytes",
        GAUGE,
        "GPU memory the service holds beyond its budget.",
        ("service",),
    ),
    MetricSpec(
        "other_processes_memory_bytes",
        GAUGE,
        "GPU memory held by other processes on the service's GPUs.",
        ("service",),
    ),
    MetricSpec(
        "gpu_headroom_bytes", GAUGE, "Least free memory among the service's GPUs.", ("service",)
    ),
    MetricSpec(
        "gpu_headroom_slope_bytes_per_second",
        GAUGE,
        "Trend of the free-memory headroom (negative: falling).",
        ("service",),
    ),
    MetricSpec(
        "capacity_demand_ratio",
        GAUGE,
        "Requests arriving ÷ requests served while saturated, over signals.capacity_window_seconds (> 1: over capacity). Absent when not measurable (not saturated, idle, restarted, no stats).",
        ("service",),
    ),
    MetricSpec(
        "capacity_replicas_needed",
        GAUGE,
        "Replicas of this service that would serve the demand (absent without an estimate).",
        ("service",),
    ),
    MetricSpec("vllm_health", GAUGE, "1 when vLLM's /health answers 200, else 0.", ("service",)),
    MetricSpec(
        "vllm_health_latency_seconds", GAUGE, "Latency of the last /health probe.", ("service",)
    ),
    MetricSpec(
        "vllm_health_state",
        GAUGE,
        "The last /health outcome (1 for the current state).",
        ("service", "state"),
    ),
    MetricSpec(
        "vllm_deep_probe_ok", GAUGE, "1 when the last 1-token completion succeeded.", ("service",)
    ),
    MetricSpec(
        "vllm_stats_enabled",
        GAUGE,
        "1 when /metrics carries vllm:* series, 0 when vLLM runs with --disable-log-stats.",
        ("service",),
    ),
    MetricSpec("vllm_scrape_bytes", GAUGE, "Size of the last vLLM /metrics body.", ("service",)),
    MetricSpec(
        "vllm_scrape_malformed_lines",
        GAUGE,
        "Lines of the last vLLM /metrics body the parser skipped as malformed.",
        ("service",),
    ),
    MetricSpec(
        "vllm_scrape_engines_dropped",
        GAUGE,
        "Engines of the last vLLM /metrics body past the parser's cap, not read.",
        ("service",),
    ),
    MetricSpec(
        "vllm_scrape_rejected_values",
        GAUGE,
        "Values of the last scrape rejected as impossible (NaN, negative, ratio > 1).",
        ("service",),
    ),
    MetricSpec(
        "unit_info",
        GAUGE,
        "The service's systemd unit and its state, always 1.",
        ("service", "unit", "active_state", "sub_state"),
    ),
    MetricSpec("unit_restarts", GAUGE, "systemd's NRestarts for the unit.", ("service",)),
    MetricSpec("unit_main_pid", GAUGE, "The service's main process id.", ("service",)),
    MetricSpec(
        "log_events",
        COUNTER,
        "vLLM log lines matching a memory-failure or engine-death signature, by kind.",
        ("service", "kind"),
    ),
    MetricSpec(
        "gate_up",
        GAUGE,
        "1 when the service's admission gate answered its status this tick, 0 when not.",
        ("service",),
    ),
    MetricSpec(
        "gate_reported_in_flight",
        GAUGE,
        "Requests the gate has admitted to vLLM and not finished, as it reported them.",
        ("service",),
    ),
    MetricSpec(
        "gate_reported_queued",
        GAUGE,
        "Requests the gate holds in its queue, as it reported them.",
        ("service",),
    ),
    MetricSpec(
        "request_latency_seconds",
        GAUGE,
        "Latency percentiles from vLLM's histograms over the quantile window (ttft, e2e, queue).",
        ("service", "metric", "percentile"),
    ),
    MetricSpec(
        "engine_kv_cache_usage_ratio",
        GAUGE,
        "KV pool usage per engine.",
        ("service", "model_name", "engine"),
    ),
    MetricSpec(
        "engine_requests_waiting",
        GAUGE,
        "Waiting requests per engine.",
        ("service", "model_name", "engine"),
    ),
    MetricSpec(
        "engine_requests_running",
        GAUGE,
        "Running requests per engine.",
        ("service", "model_name", "engine"),
    ),
    MetricSpec(
        "engine_preemptions_per_second",
        GAUGE,
        "Preemptions per second per engine.",
        ("service", "model_name", "engine"),
    ),
    MetricSpec(
        "service_gpu_memory_bytes",
        GAUGE,
        "GPU memory held by the service's processes on this GPU.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "other_gpu_memory_bytes",
        GAUGE,
        "GPU memory held by processes that are not the service's, on the service's GPU.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "headroom_exhaustion_seconds",
        GAUGE,
        "Forecast seconds until this GPU's free-memory floor reaches zero (Theil-Sen trend).",
        ("service", "gpu"),
    ),
    MetricSpec(
        "headroom_exhaustion_latest_seconds",
        GAUGE,
        "The forecast's confidence bound: the latest the free memory is expected to run out.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "headroom_exhaustion_cause",
        GAUGE,
        "1 for the cause the exhaustion forecast names (none: it alerts only).",
        ("service", "gpu", "cause"),
    ),
    MetricSpec(
        "headroom_exhaustion_neighbour_info",
        GAUGE,
        "The other process whose growth the forecast blames (empty: not known).",
        ("service", "gpu", "pid", "command", "cgroup"),
    ),
    MetricSpec(
        "allocator_reserved_bytes",
        GAUGE,
        "Memory torch's caching allocator reserved.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_allocated_bytes",
        GAUGE,
        "Memory torch handed out to tensors.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_unallocated_bytes",
        GAUGE,
        "Reserved minus allocated: cached by torch, not in use.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_inactive_split_bytes",
        GAUGE,
        "Free fragments of split blocks: reserved, unusable for larger blocks, not releasable.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_fragmentation_ratio",
        GAUGE,
        "Inactive-split bytes over reserved bytes (0..1).",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_retries_per_second",
        GAUGE,
        "cudaMalloc retries after flushing the cache, per second over the rate window.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_recent_ooms",
        GAUGE,
        "Allocator out-of-memory errors within the rate window.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_processes",
        GAUGE,
        "vLLM processes publishing allocator stats.",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_alloc_retries",
        COUNTER,
        "cudaMalloc retries of the current processes (resets when vLLM restarts).",
        ("service", "gpu"),
    ),
    MetricSpec(
        "allocator_ooms",
        COUNTER,
        "Allocator out-of-memory errors of the current processes (resets when vLLM restarts).",
        ("service", "gpu"),
    ),
    MetricSpec("gpu_info", GAUGE, "The GPU's identity, always 1.", ("gpu", "uuid", "name")),
    MetricSpec(
        "gpu_up", GAUGE, "1 when the GPU answered NVML queries, 0 when not (e.g. lost).", ("gpu",)
    ),
    MetricSpec("gpu_memory_total_bytes", GAUGE, "Total GPU memory.", ("gpu",)),
    MetricSpec("gpu_memory_used_bytes", GAUGE, "Used GPU memory, all processes.", ("gpu",)),
    MetricSpec("gpu_memory_free_bytes", GAUGE, "Free GPU memory.", ("gpu",)),
    MetricSpec("gpu_utilization_ratio", GAUGE, "GPU compute utilization (0..1).", ("gpu",)),
    MetricSpec("gpu_temperature_celsius", GAUGE, "GPU temperature.", ("gpu",)),
    MetricSpec("gpu_power_watts", GAUGE, "GPU power draw.", ("gpu",)),
    MetricSpec("gpu_processes", GAUGE, "Processes holding memory on the GPU.", ("gpu",)),
    MetricSpec(
        "gpu_remapped_rows_pending",
        GAUGE,
        "1 when row remapping is pending (needs a GPU reset).",
        ("gpu",),
    ),
    MetricSpec(
        "gpu_remapped_rows_failed",
        GAUGE,
        "1 when a row remapping failed (hardware fault).",
        ("gpu",),
    ),
    MetricSpec("gpu_retired_pages_pending", GAUGE, "1 when retired pages await a reset.", ("gpu",)),
    MetricSpec(
        "gpu_xid_events",
        COUNTER,
        "XID errors reported by the driver since the guardian started.",
        ("gpu", "xid"),
    ),
    MetricSpec(
        "alert",
        GAUGE,
        "1 for each pending or firing guardian alert, like Prometheus's ALERTS.",
        ("service", "alertname", "severity", "alertstate"),
    ),
    MetricSpec(
        "alert_stale",
        GAUGE,
        "1 when an alert's signal is missing and its state is held.",
        ("service", "alertname"),
    ),
    MetricSpec(
        "alert_inhibited",
        GAUGE,
        "1 for each pending or firing guardian alert whose notifications are held: vLLM is down because of the guardian's own restart or first start (inhibited_by says which).",
        ("service", "alertname", "severity", "alertstate", "inhibited_by"),
    ),
    MetricSpec(
        "action_in_progress",
        GAUGE,
        "1 for the restart or relaunch under way, with its kind and current phase.",
        ("service", "action", "phase"),
    ),
    MetricSpec(
        "vllm_down_expected",
        GAUGE,
        "1 while vLLM is down because of the guardian (its restart under way, within the phase's deadline, or the first start it made) and was serving or starting when that began: the vLLM-down alerts are inhibited. The shipped Prometheus rules use it.",
        ("service",),
    ),
    MetricSpec(
        "breaker_latched",
        GAUGE,
        "1 when the circuit breaker is latched (needs `vllm-guardian resume`).",
        ("service",),
    ),
    MetricSpec(
        "paused",
        GAUGE,
        "1 while an operator has paused the guardian for this service.",
        ("service",),
    ),
    MetricSpec(
        "action_in_flight", GAUGE, "1 while a restart or relaunch is running.", ("service",)
    ),
    MetricSpec(
        "restart_budget_remaining",
        GAUGE,
        "Guardian restarts left in the budget window.",
        ("service",),
    ),
    MetricSpec(
        "dry_run",
        GAUGE,
        "1 when the guardian decides but does not act (policy.dry_run).",
        ("service",),
    ),
    MetricSpec(
        "policy_rung",
        GAUGE,
        "How many rungs below the operator's baseline a lever is.",
        ("service", "lever"),
    ),
    MetricSpec(
        "cooldown_remaining_seconds",
        GAUGE,
        "Seconds until the guardian may act again.",
        ("service",),
    ),
    MetricSpec(
        "actions",
        COUNTER,
        "Actions finished, by kind and result (dry-run ones included, marked).",
        ("service", "action", "result", "dry_run"),
    ),
    MetricSpec("http_connections", GAUGE, "Connections open on the guardian's HTTP endpoint.", ()),
    MetricSpec(
        "http_connections_closed",
        COUNTER,
        "Connections the endpoint closed itself: a request head not sent in time or an exchange past its deadline (timeout), closed to make room at the cap (evicted), refused with every slot answering (over_cap).",
        ("reason",),
    ),
    MetricSpec("http_accept_errors", COUNTER, "accept() failures on the endpoint (EMFILE …).", ()),
)

_BY_NAME = {m.name: m for m in CATALOGUE}


def spec(name: str) -> MetricSpec:
    """The row of ``name``; a name without a row is a programming error (a test renders every
    family)."""
    return _BY_NAME[name]


def gauge(name: str) -> GaugeMetricFamily:
    m = spec(name)
    assert m.type is MetricType.GAUGE, name
    return GaugeMetricFamily(f"{NS}_{m.name}", m.help, labels=list(m.labels))


def counter(name: str) -> CounterMetricFamily:
    m = spec(name)
    assert m.type is MetricType.COUNTER, name
    return CounterMetricFamily(f"{NS}_{m.name}", m.help, labels=list(m.labels))
