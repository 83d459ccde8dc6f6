"""The guardian's vocabulary: what one tick observes, as frozen dataclasses.

Every source returns one of the payload types below inside a :class:`Reading`; the daemon
assembles them into a :class:`Snapshot`, which is the only input the pure core sees.
Missing values are ``None``, never NaN or a sentinel. Units are in the field names.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vllm_guardian.formats.allocator_format import AllocatorStats


class SourceKind(StrEnum):
    """The sources a tick collects. One module each under ``vllm_guardian/sources``."""

    VLLM_METRICS = "vllm_metrics"
    HEALTH = "health"
    NVML = "nvml"
    UNIT = "unit"
    LOGS = "logs"
    ALLOCATOR = "allocator"
    GATE = "gate"


@dataclass(frozen=True)
class SourceStatus:
    """How one collector fared this tick: a source that is down is an observation."""

    source: SourceKind
    service: str | None
    up: bool
    duration_seconds: float
    error: str | None = None
    hint: str | None = None


# --- vLLM /metrics ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative bucket counts by upper bound (``+Inf`` last)."""

    buckets: tuple[tuple[float, float], ...]
    sum: float | None
    count: float | None


@dataclass(frozen=True)
class CacheConfig:
    """The parts of ``vllm:cache_config_info`` the guardian uses; its labels change per version."""

    num_gpu_blocks: int | None
    block_size: int | None
    gpu_memory_utilization_ratio: float | None
    kv_cache_memory_bytes: int | None
    kv_cache_size_tokens: int | None
    enable_prefix_caching: bool | None
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def capacity_tokens(self) -> int | None:
        if self.kv_cache_size_tokens is not None:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks is not None and self.block_size is not None:
            return self.num_gpu_blocks * self.block_size
        return None


@dataclass(frozen=True)
class EngineMetrics:
    """One vLLM engine's series (V1: one per data-parallel ``engine`` label; V0: ``engine=""``)."""

    model_name: str
    engine: str
    requests_running: float | None = None
    requests_waiting: float | None = None
    requests_swapped: float | None = None
    kv_cache_usage_ratio: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    prefix_cache_hit_ratio: float | None = None  # V0 gauge only; V1 derives it from counters
    requests_finished_total: float | None = None
    requests_failed_total: float | None = None  # finished_reason abort|error
    time_to_first_token: Histogram | None = None
    e2e_request_latency: Histogram | None = None
    request_queue_time: Histogram | None = None
    cache_config: CacheConfig | None = None
    # vllm:engine_sleep_state{sleep_state="awake"} (0.11+): True when an operator put the engine
    # to sleep (/sleep: awake 0, weights_offloaded or discard_all 1), None when not exported.
    asleep: bool | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.engine)


def _sum_present(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def kv_usage_ratio(engines: Sequence[EngineMetrics]) -> float | None:
    """The KV pool's usage over all engines: weighted by each engine's blocks where every
    engine reports them, else the fullest engine's."""
    usages = [
        (e.kv_cache_usage_ratio, e.cache_config.num_gpu_blocks if e.cache_config else None)
        for e in engines
    ]
    present = [(u, b) for u, b in usages if u is not None]
    if not present:
        return None
    if all(b for _, b in present):
        total = sum(b for _, b in present if b)
        return sum(u * b for u, b in present if b) / total
    return max(u for u, _ in present)


@dataclass(frozen=True)
class EngineSums:
    """A scrape's counters and gauges summed over its engines (None: no engine reports it)."""

    finished_total: float | None
    failed_total: float | None
    prompt_tokens_total: float | None
    generation_tokens_total: float | None
    running: float | None
    waiting: float | None
    kv_usage_ratio: float | None


@dataclass(frozen=True)
class VllmScrape:
    """What one GET /metrics gave, reduced to the series the guardian uses."""

    engines: tuple[EngineMetrics, ...]
    stats_enabled: bool  # False: no vllm:* series at all (--disable-log-stats)
    process_start_time_seconds: float | None
    body_bytes: int
    malformed_lines: int = 0
    rejected_values: int = 0  # NaN/Inf where a finite value is required
    duplicate_series: int = 0
    engines_dropped: int = 0  # engines past the parser's cap (sources/vllm_metrics.MAX_ENGINES)
    # vllm:admission_rejections_total (0.32+: the 503s of --max-num-queued-reqs/-tokens) by
    # reason, summed over models (it has no engine label); None: the series is not exported.
    admission_rejections: tuple[tuple[str, float], ...] | None = None

    @property
    def admission_rejections_total(self) -> float | None:
        r = self.admission_rejections
        return None if r is None else sum(v for _, v in r)

    @functools.cached_property
    def sums(self) -> EngineSums:
        """Summed once per scrape, not once per tick that reads it: the capacity estimate reads
        every scrape of its window (two minutes of snapshots) on every tick. Not a field: not
        recorded, compared or hashed."""
        e = self.engines
        return EngineSums(
            finished_total=_sum_present(x.requests_finished_total for x in e),
            failed_total=_sum_present(x.requests_failed_total for x in e),
            prompt_tokens_total=_sum_present(x.prompt_tokens_total for x in e),
            generation_tokens_total=_sum_present(x.generation_tokens_total for x in e),
            running=_sum_present(x.requests_running for x in e),
            waiting=_sum_present(x.requests_waiting for x in e),
            kv_usage_ratio=kv_usage_ratio(e) if e else None,
        )


# --- /health ---------------------------------------------------------------------------------


class HealthState(StrEnum):
    UP = "up"
    ENGINE_DEAD = "engine_dead"  # 503 (>= 0.11) or 500 (older)
    # 503 with the body of vLLM's elastic EP ScalingMiddleware: every request is refused while
    # the data-parallel size changes. Not serving, and not dead: never restarted for it.
    SCALING = "scaling"
    ERROR = "error"  # another status code
    REFUSED = "refused"  # nothing listening: starting up or gone
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class DeepProbe:
    """A real 1-token completion: proves the engine generates, not only that HTTP answers."""

    ok: bool
    latency_seconds: float | None
    status_code: int | None
    error: str | None = None


@dataclass(frozen=True)
class HealthProbe:
    state: HealthState
    status_code: int | None
    latency_seconds: float | None
    error: str | None = None
    deep: DeepProbe | None = None
    # vLLM's GET /is_paused (served with VLLM_SERVER_DEV_MODE=1, beside /pause and /resume): an
    # operator froze its scheduler. None: not asked, not served (404: no /pause either), or no
    # answer; /metrics does not show a pause.
    paused: bool | None = None


# --- GPUs (NVML) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU; ``cgroup`` and ``ancestors`` let the core attribute it."""

    pid: int
    used_memory_bytes: int | None
    name: str | None = None
    cgroup: str | None = None
    ancestors: tuple[int, ...] = ()
    # vLLM's weight-cache daemon (``vllm preload``, or a child of it): it holds a model's
    # weights for engines started with ``--load-format ipc_cache``, inside their budget, and
    # outlives their restarts on purpose.
    weight_cache: bool = False


@dataclass(frozen=True)
class XidEvent:
    gpu_index: int
    xid: int
    time_seconds: float


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: the driver would not say
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    retired_pages_pending: bool | None = None
    error: str | None = None  # e.g. "GPU is lost": the device is listed but unreadable


@dataclass(frozen=True)
class GpuReading:
    devices: tuple[GpuDevice, ...]
    driver_version: str | None = None
    xid_events: tuple[XidEvent, ...] = ()  # new since the previous reading


# --- the systemd unit and its process -------------------------------------------------------


@dataclass(frozen=True)
class UnitState:
    """The service's process as systemd (or, without a unit, the listening socket) shows it."""

    unit: str | None
    active_state: str | None
    sub_state: str | None
    result: str | None
    main_pid: int | None
    n_restarts: int | None
    exec_main_status: int | None
    active_enter_monotonic_seconds: float | None
    control_group: str | None
    cmdline: tuple[str, ...] | None  # secrets redacted
    pids: tuple[int, ...] = ()  # main pid and its descendants
    # When the main process started, in the snapshot's clock (from its /proc start time);
    # None: unknown. A relaunch's flags reach only a process started after they were written.
    main_started_seconds: float | None = None


# --- logs ------------------------------------------------------------------------------------


class LogEventKind(StrEnum):
    """vLLM log signatures the guardian counts (the lines each matches: ``vllm_log_format.py``)."""

    CUDA_OOM = "cuda_oom"
    NON_TORCH_OOM = "non_torch_oom"
    NO_KV_CACHE_MEMORY = "no_kv_cache_memory"
    MAX_SEQ_LEN_EXCEEDS_KV = "max_seq_len_exceeds_kv"
    FREE_MEMORY_BELOW_UTILIZATION = "free_memory_below_utilization"
    # --load-format ipc_cache: the weights vLLM's weight-cache daemon (vllm preload) holds
    # exceed the whole gpu_memory_utilization budget they are subtracted from.
    EXTERNAL_WEIGHTS_EXCEED_BUDGET = "external_weights_exceed_budget"
    MEMORY_PROFILING_ERROR = "memory_profiling_error"
    STARTUP_FAILED = "startup_failed"
    ENGINE_FATAL = "engine_fatal"
    ENGINE_DEAD = "engine_dead"
    WORKER_DIED = "worker_died"
    EXECUTE_TIMEOUT = "execute_timeout"
    PREEMPTION = "preemption"
    # vLLM's hang watchdog (0.33's --watchdog-config) dumped every thread's stack: nothing fed
    # it for its timeout. Logged at INFO; the only signature read at that level.
    WATCHDOG_DUMP = "watchdog_dump"
    GPU_HARDWARE_ERROR = (
        "gpu_hardware_error"  # uncorrectable ECC, fallen off the bus: needs a reset
    )


@dataclass(frozen=True)
class LogEvent:
    kind: LogEventKind
    time_seconds: float
    message: str  # the matched line, truncated and redacted
    details: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LogReading:
    counts: tuple[tuple[LogEventKind, int], ...]  # cumulative since the guardian started
    recent: tuple[LogEvent, ...]  # new since the previous reading
    lines_total: int
    # Of lines_total, those dropped by their first characters before any regex: no vLLM header
    # of the engine at WARNING or above can start them (access logs, INFO lines).
    lines_skipped: int = 0
    # Each engine process's latest start-up line about its KV pool ("GPU KV cache size: N
    # tokens, …"), by process name: the pool's size where /metrics does not say it.
    engine_kv_sizing: tuple[tuple[str, str], ...] = ()

    def count(self, kind: LogEventKind) -> int:
        return dict(self.counts).get(kind, 0)


# --- torch's allocator, from the in-vLLM plugin -----------------------------------------------


@dataclass(frozen=True)
class AllocatorProcess:
    """One live vLLM process's allocator files (one record per device it allocates on), with
    what ties it to a service: the same pid/ancestors/cgroup test as GPU processes."""

    pid: int
    devices: tuple[AllocatorStats, ...]
    cgroup: str | None = None
    ancestors: tuple[int, ...] = ()


@dataclass(frozen=True)
class AllocatorReading:
    """The plugin's directory: live processes (host-wide from the source, one service's after
    the daemon attributes them), and the files left out this tick."""

    processes: tuple[AllocatorProcess, ...]
    stale_files: int = 0  # process gone or not updated within stale_seconds
    unparsable_files: int = 0


# --- the admission gate in front of a service -------------------------------------------------


@dataclass(frozen=True)
class GateObservation:
    """The gate's own account of the requests it holds and forwards (its ``GET /gate/status``).

    ``in_flight`` is what the gate has admitted to vLLM and not finished (the number a drain
    waits on), ``queued`` what it holds back. Unreachable (down, wedged, not started) is an
    observation too: ``reachable`` false, the numbers ``None`` and ``error`` saying why; a drain
    must then not wait on it.
    """

    reachable: bool
    in_flight: int | None = None
    queued: int | None = None
    open: bool | None = None  # admits new requests now; False: holding them
    reason: str | None = None  # why it holds ("guardian: draining", "vLLM /health answers 503")
    upstream_healthy: bool | None = None  # vLLM's /health as the gate last saw it
    guardian_ready: bool | None = None  # our /ready/<service> as the gate last saw it
    oldest_wait_seconds: float | None = None  # the head of the queue, now
    # Counters since the gate started. arrived: requests that cost vLLM work, each once as it
    # came (the demand at the front door, held and refused ones included; core/capacity.py).
    arrived_total: int | None = None
    held_total: int | None = None
    retried_total: int | None = None
    rejected_total: int | None = None
    # Requests forwarded to vLLM that have had no byte of their answer's body yet, and the age
    # of the oldest: with the engine reporting nothing in it, requests that never reached its
    # scheduler (core/engine_signals.py, ``unreached_seconds``). None: a gate that does not say.
    unanswered: int | None = None
    oldest_unanswered_seconds: float | None = None
    # The largest delay of the gate's event loop in its last minute (gate/looplag.py): a gate
    # answering late (or not at all) because it was late itself, not because vLLM was.
    loop_lag_max_seconds: float | None = None
    # The share of its last minute the gate's process spent on a CPU (with workers, the
    # busiest's): near 1 its streams stall for want of a core (gate/looplag.py).
    cpu_busy_share: float | None = None
    error: str | None = None


# --- one tick --------------------------------------------------------------------------------


Payload = (
    VllmScrape | HealthProbe | GpuReading | UnitState | LogReading | AllocatorReading
    | GateObservation
)  # fmt: skip


@dataclass(frozen=True)
class Reading:
    """What a collector returns: a payload when it could observe, else why not."""

    source: SourceKind
    service: str | None
    payload: Payload | None
    error: str | None = None
    hint: str | None = None


@dataclass(frozen=True)
class ServiceSnapshot:
    name: str
    vllm: VllmScrape | None = None
    health: HealthProbe | None = None
    unit: UnitState | None = None
    logs: LogReading | None = None
    allocator: AllocatorReading | None = None  # this service's processes; None: no plugin data
    gate: GateObservation | None = None  # None: no gate configured for this service


@dataclass(frozen=True)
class Snapshot:
    """Everything one tick observed. ``time_seconds`` is Unix time from the guardian's clock."""

    time_seconds: float
    services: tuple[ServiceSnapshot, ...]
    gpus: GpuReading | None
    sources: tuple[SourceStatus, ...] = field(default=())
    # Read by nothing since actions became phases of the core (kept so older flight records
    # still load): an action's end is now decided by the policy from ``op_results``.
    action_results: tuple[ActionResult, ...] = field(default=())
    # Actuator calls that finished since the previous tick (the restart's blocking steps).
    op_results: tuple[OpResult, ...] = field(default=())
    # Operator commands the guardian took since the previous tick, in order: applied when they
    # came (core/driver.py), kept here so the flight record shows them and replay applies them
    # again at the same point.
    commands: tuple[OperatorCommand, ...] = field(default=())

    def service(self, name: str) -> ServiceSnapshot | None:
        for s in self.services:
            if s.name == name:
                return s
        return None

    @functools.cached_property
    def memo(self) -> dict[Hashable, Any]:
        """Values the core derives from this snapshot alone, kept with it so that a window
        read on every tick (the forecast's five minutes) computes each once. Not a field: not
        recorded, compared or hashed; a replaced snapshot starts empty."""
        return {}


# --- alerts and causes -----------------------------------------------------------------------


class Cause(StrEnum):
    """What broke: the vocabulary shared by alerts, the policy and diagnose.

    What each one means and what the guardian does about it: docs/healing.md, "How it heals".
    """

    GPU_MEMORY_OVERCOMMIT = "gpu_memory_overcommit"
    KV_CACHE_BLOWOUT = "kv_cache_blowout"
    CONCURRENCY_OVERCOMMIT = "concurrency_overcommit"
    PREFILL_BURST = "prefill_burst"
    ALLOCATOR_FRAGMENTATION = "allocator_fragmentation"
    PREFIX_CACHE_WASTE = "prefix_cache_waste"  # only to say "no": a low hit rate is harmless
    MODEL_DOES_NOT_FIT = "model_does_not_fit"
    ENGINE_DEAD = "engine_dead"
    # Requests sent to vLLM never reach its scheduler (the engine core's input thread died or
    # blocks): /health 200, the engine idle by its metrics, the answers never start.
    ENGINE_INPUT_HANG = "engine_input_hang"
    GPU_HARDWARE_FAULT = "gpu_hardware_fault"
    HEALTHY = "healthy"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AlertState(StrEnum):
    """Prometheus semantics: inactive → pending (condition true, `for` not yet met) → firing."""

    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"


@dataclass(frozen=True)
class Alert:
    """One rule's state for one service (or GPU). Kept while pending or firing."""

    name: str
    service: str | None
    labels: tuple[tuple[str, str], ...]  # extra identity, e.g. (("gpu", "0"),)
    state: AlertState
    severity: Severity
    cause: Cause | None
    value: float | None  # the last value the condition saw
    active_since_seconds: float  # when the condition became true (pending began)
    firing_since_seconds: float | None
    last_true_seconds: (
        float  # last evaluation where the condition held (keep_firing_for counts from here)
    )
    stale: bool = False  # the signal is missing: state held, not resolved
    summary: str = ""
    runbook: str = ""
    # Why its notifications are held (core/inhibition.py), e.g. "action 3 awaiting_ready":
    # evaluated and shown as usual, not delivered to the sinks. None: delivered.
    inhibited_by: str | None = None

    @property
    def key(self) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
        return (self.name, self.service, self.labels)


# --- actions ---------------------------------------------------------------------------------


class ActionKind(StrEnum):
    """What the policy can ask the actuators to do."""

    RESTART = "restart"  # drain (gate, wait) + restart with the current flags + wait ready + ungate
    RELAUNCH = "relaunch"  # write new flags, then as RESTART
    ESCALATE = "escalate"  # latch the breaker and page a person; nothing executed on the host


@dataclass(frozen=True)
class Action:
    id: int
    service: str
    kind: ActionKind
    cause: Cause | None
    reason: str  # one sentence a person can read in the audit log
    evidence: tuple[str, ...]  # the firing alerts / log events it rests on
    dry_run: bool
    flags: tuple[tuple[str, str], ...] = ()  # the complete guardian-owned flags after the action
    env: tuple[tuple[str, str], ...] = ()  # the complete guardian-owned environment after it


@dataclass(frozen=True)
class ActionResult:
    """How an action ended, observed by the next tick. The policy never assumes success."""

    action_id: int
    service: str
    kind: ActionKind
    ok: bool
    terminal: bool  # a failure retrying cannot fix (unknown unit, bad flags)
    detail: str
    finished_seconds: float
    dry_run: bool = False


class Op(StrEnum):
    """The blocking calls an action is made of; everything between them is a phase of the
    core that waits on observations (core/phases.py)."""

    BUNDLE = "bundle"  # capture the incident bundle (time-boxed)
    WRITE_FLAGS = "write_flags"  # write the guardian-owned flags file (validated)
    RESTART = "restart"  # systemctl restart / the process manager's restart
    PERMIT = "permit"  # one try for a fleet permit (fleet.permit: lease; actuators/k8s_permit.py)
    RELEASE_PERMIT = "release_permit"  # give the fleet permit back when the action ends


@dataclass(frozen=True)
class OpRequest:
    """An effect of a tick: start one blocking actuator call for an action."""

    action_id: int
    service: str
    op: Op
    flags: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout_seconds: float = 0.0
    reason: str = ""  # the action's reason, for the bundle's manifest
    cause: Cause | None = None
    # RESTART: False when nothing in flight can finish (a hung or dead engine): the stop
    # waits only for vLLM's exit, not for a drain.
    drain: bool = True


class CommandKind(StrEnum):
    """An operator's command on the control socket that changes the policy state."""

    PAUSE = "pause"
    RESUME = "resume"
    RESTART = "restart"
    RELAUNCH = "relaunch"


@dataclass(frozen=True)
class OperatorCommand:
    """One operator command as the policy takes it (its flags already validated by the shell):
    the input of ``core/step.command``."""

    time_seconds: float
    kind: CommandKind
    service: str | None  # None: every service (pause and resume only)
    flags: tuple[tuple[str, str], ...] = ()  # relaunch: the flags to set
    reset: bool = False  # relaunch: back to the operator's baseline
    who: str = "an operator"
    force: bool = False  # act although the breaker is latched or the service paused


@dataclass(frozen=True)
class OpResult:
    """How one actuator call ended: an observation of the next tick, never assumed."""

    action_id: int
    service: str
    op: Op
    ok: bool
    terminal: bool  # retrying cannot help (bad flags, unknown unit)
    detail: str
    finished_seconds: float


@dataclass(frozen=True)
class GateState:
    """What /ready/<service> answers: 200 when ready, 503 with the reason when not; whether
    a restart or relaunch is in progress (the gate waits longer for it: ready_format.py)."""

    ready: bool
    reason: str
    restart_in_progress: bool = False
