"""The derived signals' records: what ``core/signals.derive`` returns per service
(:class:`ServiceSignals`), per engine and per GPU, read by the alert rules, the diagnosis and
the policy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vllm_guardian.core.allocator import AllocatorGpuSignals
from vllm_guardian.core.capacity import (
    CapacityEstimate,
)
from vllm_guardian.core.forecast import (
    Forecast,
)
from vllm_guardian.model import (
    Cause,
    HealthState,
    LogEventKind,
)

QUANTILES = (0.5, 0.99)


LATENCY_HISTOGRAMS = {
    "ttft": "time_to_first_token",
    "e2e": "e2e_request_latency",
    "queue": "request_queue_time",
}


@dataclass(frozen=True)
class EngineSignals:
    model_name: str
    engine: str
    kv_cache_usage_ratio: float | None
    requests_running: float | None
    requests_waiting: float | None
    preemptions_per_second: float | None
    generation_tokens_per_second: float | None


@dataclass(frozen=True)
class ServiceGpuSignals:
    gpu: int
    service_memory_bytes: int | None
    other_memory_bytes: int | None
    budget_bytes: int | None  # gpu_memory_utilization × total: what vLLM planned to use
    free_bytes: int | None
    total_bytes: int | None


@dataclass(frozen=True)
class LatencyQuantile:
    metric: str  # ttft | e2e | queue
    quantile: float
    seconds: float


class OperatorHold(StrEnum):
    """What an operator did that stops vLLM's engine on purpose (never a hang, never restarted)."""

    ASLEEP = "asleep"  # POST /sleep: vllm:engine_sleep_state{sleep_state="awake"} 0
    PAUSED = "paused"  # POST /pause: GET /is_paused answers true


@dataclass(frozen=True)
class ServiceSignals:
    service: str
    health_state: HealthState | None
    vllm_up: bool | None  # /health answered 200
    metrics_up: bool  # /metrics was scraped this tick
    stats_enabled: bool | None  # False: --disable-log-stats, no vllm:* series
    kv_cache_usage_ratio: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    requests_swapped: float | None = None
    preemptions_per_second: float | None = None
    prompt_tokens_per_second: float | None = None
    generation_tokens_per_second: float | None = None
    request_failures_per_second: float | None = None
    # Requests vLLM itself answered 503 at its queue limits (vllm:admission_rejections_total,
    # --max-num-queued-reqs/-tokens), per second over the rate window; None: not exported.
    admission_rejections_per_second: float | None = None
    prefix_cache_hit_ratio: float | None = None
    # Requests in the engine and no progress (core/progress.py), for this long.
    stall_seconds: float | None = None
    stalled: bool | None = None
    # Requests the gate forwarded with no answer while the engine reported nothing in it, for
    # this long (core/progress.py, unreached_seconds): the engine core's input is lost.
    # ``input_hung`` past ``stall_seconds``. None without a gate.
    unreached_seconds: float | None = None
    input_hung: bool | None = None
    # An operator holds the server: "asleep" (/sleep) or "paused" (/pause); None: neither, or
    # unknown. Nothing is judged stalled or hung meanwhile. ``held_waiting_seconds``: how long
    # requests have waited through it (0: none wait).
    held_by_operator: OperatorHold | None = None
    held_seconds: float | None = None  # held for this long, as far back as the history sees
    held_waiting_seconds: float | None = None
    counter_reset: bool = False  # vLLM restarted within the rate window
    kv_cache_capacity_tokens: int | None = None
    # Where the pool's size was read: "cache_config_info" (/metrics), "vLLM log" (each engine's
    # start-up line, where /metrics has no cache_config_info: vLLM's Rust frontend); None with
    # the size: unknown.
    kv_cache_capacity_source: str | None = None
    gpu_memory_utilization_ratio: float | None = None
    latency: tuple[LatencyQuantile, ...] = ()
    engines: tuple[EngineSignals, ...] = ()
    gpus: tuple[ServiceGpuSignals, ...] = ()
    memory_budget_bytes: int | None = None
    service_memory_bytes: int | None = None
    memory_over_budget_bytes: int | None = None
    other_processes_memory_bytes: int | None = None
    # services[].gpu_memory_by_device: memory attributed by device, not by process (a pod)
    gpu_memory_by_device: bool = False
    headroom_bytes: int | None = None  # least free memory among the service's GPUs
    headroom_slope_bytes_per_second: float | None = None
    log_events: tuple[tuple[LogEventKind, int], ...] = ()  # cumulative since the guardian started
    # Matched log events within the rate window, by kind (counter increase, restarts handled).
    recent_log_events: tuple[tuple[LogEventKind, int], ...] = ()
    # XID events on the service's GPUs within the rate window: (gpu, xid, count).
    recent_xid_events: tuple[tuple[int, int, int], ...] = ()
    # The exhaustion forecast (core/forecast.py) of the service's most urgent GPU: seconds until
    # its free-memory floor reaches zero (None: no significant trend), and the bound to act on.
    seconds_to_headroom_exhaustion: float | None = None
    headroom_exhaustion_latest_seconds: float | None = None
    # Who takes the memory (None: the forecast alerts only), and the same forecast per cause so
    # rules can carry the cause: at most one of these is set.
    forecast_cause: Cause | None = None
    seconds_to_exhaustion_allocator_fragmentation: float | None = None
    seconds_to_exhaustion_gpu_memory_overcommit: float | None = None
    seconds_to_exhaustion_prefill_burst: float | None = None
    forecasts: tuple[Forecast, ...] = ()  # one per GPU with a trend
    # torch's caching allocator, from the in-vLLM plugin (core/allocator.py); None: no plugin.
    allocator: tuple[AllocatorGpuSignals, ...] = ()
    allocator_reserved_bytes: int | None = None
    allocator_allocated_bytes: int | None = None
    allocator_unallocated_bytes: int | None = None  # reserved − allocated
    allocator_fragmentation_ratio: float | None = None  # inactive-split / reserved, worst GPU
    allocator_retries_per_second: float | None = None
    allocator_recent_ooms: int | None = None  # num_ooms increase within the rate window
    # Over capacity? (core/capacity.py, over signals.capacity_window_seconds): demand ÷ what it
    # serves at saturation, and the replicas that would carry it; None when not measurable.
    capacity: CapacityEstimate | None = None
    capacity_demand_ratio: float | None = None
    capacity_replicas_needed: int | None = None

    def recent_log_count(self, kind: LogEventKind) -> int:
        return dict(self.recent_log_events).get(kind, 0)


@dataclass(frozen=True)
class Signals:
    time_seconds: float
    services: tuple[ServiceSignals, ...]

    def service(self, name: str) -> ServiceSignals | None:
        for s in self.services:
            if s.service == name:
                return s
        return None
