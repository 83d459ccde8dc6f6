"""The simulated vLLM engine: start-up, scheduling steps, memory, scenario events, death.

``SimEngine`` is the deterministic core of the twin. It never reads a clock: the caller
moves it forward with ``advance(until_seconds)`` (simulated seconds since the process
started) and it answers with per-request token deltas and log events. One engine step
schedules a batch (``scheduler``), checks the card (``memory``), takes
``ModelSpec.step_seconds`` simulated seconds (a fixed cost, plus costs per token, per
prefill-like token and per sequence), then commits tokens and stats.
One-off faults (hang, death, XID) come from ``scenarios.fault_schedule`` on the scenario's
clock, whose zero is given (``scenario_zero_seconds``, on the engine's clock) or is this
engine's readiness; faults due before this engine was ready are not replayed. Every fault,
OOMs included, is kept in ``faults``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from vllm_guardian.formats.allocator_format import AllocatorStats
from vllm_guardian.sim.memory import (
    MemoryBreakdown,
    MemoryModel,
    alloc_retry_needed,
    step_activation_bytes,
)
from vllm_guardian.sim.modelspec import ModelSpec
from vllm_guardian.sim.profiling import (
    GIB,
    EngineConfig,
    StartupFailure,
    StartupPlan,
    non_torch_bytes,
    oom_message,
    profile_startup,
)
from vllm_guardian.sim.scenarios import FaultKind, Scenario, fault_schedule
from vllm_guardian.sim.scheduler import (
    FinishReason,
    ScheduledChunk,
    Scheduler,
    SimRequest,
    prompt_block_hashes,
)
from vllm_guardian.sim.stats import EngineStats

VLLM_VERSION = "0.32.0"
# The API server's watchdog looks for a dead engine every 5 s, then exits (vLLM's
# launcher.py, watchdog_loop).
WATCHDOG_INTERVAL_SECONDS = 5.0
# LoggingStatLogger prints one line every VLLM_LOG_STATS_INTERVAL (10 s).
LOG_STATS_INTERVAL_SECONDS = 10.0
# Start-up phases (simulated seconds): API-server imports, weight loading at disk speed,
# the profile run, CUDA-graph capture (skipped with --enforce-eager).
STARTUP_IMPORT_SECONDS = 8.0
WEIGHT_LOAD_BYTES_PER_SECOND = 2.0 * GIB
PROFILE_RUN_SECONDS = 3.0
GRAPH_CAPTURE_SECONDS = 10.0
API_ROUTES_SECONDS = 2.0
# Mean natural completion length when the client does not set ignore_eos.
MEAN_NATURAL_OUTPUT_TOKENS = 300.0

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class EnginePhase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    HUNG = "hung"
    DEAD = "dead"
    FAILED_STARTUP = "failed_startup"


class Proc(enum.Enum):
    """The vLLM process a log line claims to come from (its ``(Name pid=N)`` prefix)."""

    API_SERVER = "APIServer"
    ENGINE_CORE = "EngineCore_DP0"
    NONE = ""  # unprefixed lines: tracebacks


@dataclass(frozen=True)
class LogEvent:
    sim_seconds: float
    proc: Proc
    level: str  # INFO, WARNING, ERROR, or "" for a raw traceback line
    fileinfo: str
    message: str


@dataclass(frozen=True)
class RequestDelta:
    """What happened to one request during ``advance``: new tokens, and how it ended."""

    request_id: str
    new_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True)
class XidEvent:
    seq: int
    xid: int
    sim_seconds: float


@dataclass(frozen=True)
class FaultRecord:
    kind: FaultKind
    sim_seconds: float  # on the engine's clock


@dataclass(frozen=True)
class DeathRecord:
    sim_seconds: float
    exception: str
    message: str
    exit_at_seconds: float


class SimEngine:
    """One vLLM engine (API server + EngineCore + worker) on one simulated GPU."""

    def __init__(
        self,
        model: ModelSpec,
        cfg: EngineConfig,
        scenario: Scenario,
        gpu_total_bytes: int,
        seed: int = 0,
        scenario_zero_seconds: float | None = None,
        fault_every_seconds: float | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.scenario = scenario
        self.gpu_total_bytes = gpu_total_bytes
        self.rng = random.Random(seed)  # noqa: S311 (a seeded simulation, not security)
        self.now = 0.0
        self.phase = EnginePhase.STARTING
        self.ready_at: float | None = None
        self.plan: StartupPlan | None = None
        self.startup_failure: StartupFailure | None = None
        self.scheduler: Scheduler | None = None
        self.memory: MemoryModel | None = None
        self.stats = EngineStats(cfg.max_model_len)
        self.death: DeathRecord | None = None
        self.xid_events: list[XidEvent] = []
        self.busy_seconds = 0.0
        self.last_activation_bytes = 0
        # What an NVML sample or the allocator plugin would catch: the activations of the step
        # in flight (the last one run while the engine is busy; 0 once it idles).
        self.sampled_activation_bytes = 0
        # torch's caching-allocator counters for the life of the process (the plugin's file).
        self.alloc_retries = 0
        self.alloc_ooms = 0
        self.allocated_peak_bytes = 0
        self.reserved_peak_bytes = 0
        self._requests: dict[str, SimRequest] = {}
        self._logs: list[LogEvent] = []
        self._profile_result: StartupPlan | StartupFailure | None = None
        self.seed = seed
        self.fault_every_seconds = fault_every_seconds
        # The scenario's zero on this engine's clock; None until known (at readiness).
        self.scenario_zero: float | None = scenario_zero_seconds
        self.faults: list[FaultRecord] = []
        # The engine core's input thread is gone (FaultKind.INPUT_HANG): accepted requests are
        # the API server's alone, the scheduler never sees them.
        self.input_lost = False
        # An operator paused the scheduler (/pause?mode=keep): no step; adds wait here.
        self.paused = False
        self._held_adds: list[SimRequest] = []
        # Asleep at this level (vLLM's /sleep, which pauses the scheduler first); None: awake.
        self.sleep_level: int | None = None
        self._schedule: Iterator[tuple[float, FaultKind]] | None = None
        self._next_fault: tuple[float, FaultKind] | None = None
        self._next_log_at = LOG_STATS_INTERVAL_SECONDS
        self._last_log_counts = (0, 0)
        weights_seconds = model.weights_bytes / WEIGHT_LOAD_BYTES_PER_SECOND
        self.weights_loaded_at = STARTUP_IMPORT_SECONDS + weights_seconds
        self.profiled_at = self.weights_loaded_at + PROFILE_RUN_SECONDS
        graphs = 0.0 if cfg.enforce_eager else GRAPH_CAPTURE_SECONDS
        self.startup_seconds = self.profiled_at + graphs + API_ROUTES_SECONDS
        self._log(
            Proc.API_SERVER, "INFO", "api_utils.py:347", f"vLLM API server version {VLLM_VERSION}"
        )
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "core.py:133",
            f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model='{cfg.model_path}', "
            f"max_seq_len={cfg.max_model_len}, tensor_parallel_size={model.tensor_parallel_size}, "
            f"enforce_eager={cfg.enforce_eager}, served_model_name={cfg.served_model_name}, "
            f"enable_prefix_caching={cfg.enable_prefix_caching}, "
            f"enable_chunked_prefill={cfg.enable_chunked_prefill}",
        )

    # ----------------------------------------------------------------- public surface

    @property
    def accepting(self) -> bool:
        return self.phase in (EnginePhase.READY, EnginePhase.HUNG)

    def take_logs(self) -> list[LogEvent]:
        out, self._logs = self._logs, []
        return out

    def exit_due(self) -> bool:
        return self.death is not None and self.now >= self.death.exit_at_seconds

    def add_request(
        self,
        request_id: str,
        prompt_words: Sequence[str],
        max_tokens: int,
        ignore_eos: bool = True,
    ) -> None:
        """Queue a validated request (the server already checked lengths)."""
        assert self.scheduler is not None
        stop_at = None
        if not ignore_eos:
            stop_at = 1 + int(self.rng.expovariate(1.0 / MEAN_NATURAL_OUTPUT_TOKENS))
        hashes = (
            prompt_block_hashes(prompt_words, self.cfg.block_size)
            if self.cfg.enable_prefix_caching
            else []
        )
        req = SimRequest(request_id, self.now, len(prompt_words), max_tokens, hashes, stop_at)
        self._requests[request_id] = req
        if self.input_lost:
            return  # sent to the engine core's input socket; nobody reads it
        if self.paused:
            self._held_adds.append(req)  # vLLM queues adds while paused
            return
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req in self._held_adds:
            self._held_adds.remove(req)
        if req is not None and self.scheduler is not None:
            self.scheduler.remove(req)
            self.stats.request_success[FinishReason.ABORT] += 1

    def abort_all(self) -> list[RequestDelta]:
        out = [RequestDelta(rid, 0, FinishReason.ABORT) for rid in list(self._requests)]
        for rid in list(self._requests):
            self.abort_request(rid)
        self._refresh_gauges()
        return out

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def memory_breakdown(self) -> MemoryBreakdown | None:
        if self.memory is None:
            return None
        return self.memory.breakdown(self.last_activation_bytes, self.other_bytes(self.now))

    def sampled_breakdown(self) -> MemoryBreakdown | None:
        """The card as a sample taken now sees it: with the activations of the step in flight."""
        if self.memory is None:
            return None
        return self.memory.breakdown(self.sampled_activation_bytes, self.other_bytes(self.now))

    def allocator_stats(
        self, pid: int, unix_seconds: float, interval_seconds: float, alloc_conf: str | None
    ) -> AllocatorStats | None:
        """torch.cuda.memory_stats() of the engine's process as the plugin publishes it.

        allocated = weights + CUDA graphs + KV pool + the step's activations; reserved adds the
        stranded split blocks (fragmentation), which are also its inactive-split bytes.
        None before the engine holds memory (the plugin publishes once CUDA is up).
        """
        mem = self.sampled_breakdown()
        if mem is None:
            return None
        allocated = mem.torch_allocated_bytes
        reserved = mem.torch_reserved_bytes
        block = 2 * 1024 * 1024  # the caching allocator's large-segment granularity
        return AllocatorStats(
            pid=pid,
            device=0,
            time_seconds=unix_seconds,
            interval_seconds=interval_seconds,
            allocated_bytes=allocated,
            allocated_peak_bytes=max(self.allocated_peak_bytes, allocated),
            reserved_bytes=reserved,
            reserved_peak_bytes=max(self.reserved_peak_bytes, reserved),
            active_bytes=allocated,
            active_peak_bytes=max(self.allocated_peak_bytes, allocated),
            inactive_split_bytes=mem.fragmentation_bytes,
            inactive_split_peak_bytes=mem.fragmentation_bytes,
            alloc_retries=self.alloc_retries,
            ooms=self.alloc_ooms,
            segments=max(1, reserved // block),
            alloc_conf=alloc_conf,
            process_name="VLLM::EngineCore",
        )

    def startup_process_bytes(self) -> int:
        """What the process holds before it is ready: context, then weights as they load."""
        if self.now < STARTUP_IMPORT_SECONDS:
            return 0
        load = min(
            1.0,
            (self.now - STARTUP_IMPORT_SECONDS)
            / max(1e-9, self.weights_loaded_at - STARTUP_IMPORT_SECONDS),
        )
        return non_torch_bytes(self.model) + int(self.model.weights_bytes * load)

    def other_bytes(self, t: float) -> int:
        """Memory other processes hold at simulated time t (this engine's clock).

        The neighbour is another process: on the run's clock when the run has one (a timeline
        or epoch gave ``scenario_zero``), so a restart of vLLM meets it as grown as it is, from
        the start-up profile on; without one, counted from this process's readiness.
        """
        nb = self.scenario.neighbour
        if nb is None:
            return 0
        if nb.start_seconds is None:
            return nb.initial_bytes
        zero = self.scenario_zero if self.scenario_zero is not None else self.ready_at
        if zero is None or t < zero + nb.start_seconds:
            return 0
        grown = nb.initial_bytes + nb.growth_bytes_per_second * (t - zero - nb.start_seconds)
        return int(min(float(nb.max_bytes or nb.initial_bytes), grown))

    def advance(self, until_seconds: float) -> list[RequestDelta]:
        """Run the engine up to ``until_seconds`` (simulated); steps are atomic."""
        deltas: dict[str, RequestDelta] = {}
        while True:
            if self.phase is EnginePhase.STARTING:
                if not self._advance_startup(until_seconds):
                    break
                continue
            if self.phase in (EnginePhase.DEAD, EnginePhase.FAILED_STARTUP):
                self.now = max(self.now, until_seconds)
                break
            self._scenario_events()
            if self.death is not None:
                self._fail_all(deltas)
                continue
            self._periodic_log()
            if self.now >= until_seconds:
                break
            assert self.scheduler is not None
            idle = not self.scheduler.running and not self.scheduler.waiting
            if idle or self.phase is EnginePhase.HUNG or self.paused:
                if idle:
                    self.sampled_activation_bytes = 0
                self.now = max(self.now, min(until_seconds, self._next_event_time()))
                continue
            self._step(deltas)
        return list(deltas.values())

    # ----------------------------------------------------------------- start-up

    def _profile(self) -> StartupPlan | StartupFailure:
        if self._profile_result is None:
            other = self.other_bytes(0.0)
            self._profile_result = profile_startup(
                self.model, self.cfg, self.gpu_total_bytes, other
            )
        return self._profile_result

    def _advance_startup(self, until_seconds: float) -> bool:
        """Move through start-up; True when it ended (ready or failed) before ``until``."""
        if until_seconds < self.profiled_at:
            self.now = max(self.now, until_seconds)
            return False
        if isinstance(self._profile(), StartupFailure) or until_seconds >= self.startup_seconds:
            self._finish_startup()
            return True
        self.now = max(self.now, until_seconds)
        return False

    def _finish_startup(self) -> None:
        result = self._profile()
        if isinstance(result, StartupFailure):
            self.now = max(self.now, self.profiled_at)
            self.startup_failure = result
            self.phase = EnginePhase.FAILED_STARTUP
            self._log(Proc.ENGINE_CORE, "ERROR", "core.py:1067", "EngineCore failed to start.")
            self._traceback(
                ("vllm/v1/engine/core.py", 1058, "run_engine_core"),
                ("vllm/v1/worker/gpu_worker.py", 302, "determine_available_memory"),
                f"{result.exception}: {result.message}",
            )
            self._log(
                Proc.API_SERVER,
                "ERROR",
                "api_server.py:1512",
                "Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {'EngineCore_DP0': 1}",
            )
            self._raw(
                "RuntimeError: Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {'EngineCore_DP0': 1}"
            )
            return
        plan = result
        self.plan = plan
        self.now = max(self.now, self.startup_seconds)
        self.ready_at = self.now
        self.scheduler = Scheduler(self.cfg, plan.num_gpu_blocks)
        self.memory = MemoryModel(
            self.model, plan, self.cfg.expandable_segments, self.scenario.fragmentation_creep_factor
        )
        self.phase = EnginePhase.READY
        self._next_log_at = self.now + LOG_STATS_INTERVAL_SECONDS
        if self.scenario_zero is None:
            self.scenario_zero = self.ready_at
        self._schedule = fault_schedule(self.scenario, self.seed, self.fault_every_seconds)
        # Faults due before this engine was ready struck an earlier process (or nobody).
        self._next_fault = next(self._schedule, None)
        while self._next_fault is not None and (
            self.scenario_zero + self._next_fault[0] < self.ready_at
        ):
            self._next_fault = next(self._schedule, None)
        w = self.weights_loaded_at - STARTUP_IMPORT_SECONDS
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "gpu_model_runner.py:2602",
            f"Model loading took {plan.weights_bytes / GIB:.4f} GiB memory and {w:.6f} seconds",
        )
        if not self.cfg.enforce_eager:
            self._log(
                Proc.ENGINE_CORE,
                "INFO",
                "gpu_worker.py:436",
                f"Estimated CUDA graph memory: {plan.cudagraph_bytes / GIB:.2f} GiB total",
            )
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "gpu_worker.py:451",
            f"Available KV cache memory: {plan.kv_cache_bytes / GIB:.2f} GiB",
        )
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "kv_cache_utils.py:2327",
            f"GPU KV cache size: {plan.kv_cache_size_tokens:,} tokens, Maximum concurrency for "
            f"{self.cfg.max_model_len:,} tokens per request: {plan.max_concurrency:.2f}x",
        )
        if not self.cfg.enforce_eager:
            self._log(
                Proc.ENGINE_CORE,
                "INFO",
                "gpu_model_runner.py:3480",
                f"Graph capturing finished in {GRAPH_CAPTURE_SECONDS:.0f} secs, took "
                f"{plan.cudagraph_bytes / GIB:.2f} GiB",
            )
        kv_hint = plan.kv_cache_bytes
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "gpu_worker.py:470",
            f"Free memory on device ({(plan.total_bytes - self.other_bytes(0.0)) / GIB:.2f}/"
            f"{plan.total_bytes / GIB:.2f} GiB) on startup. Desired GPU memory utilization is "
            f"({self.cfg.gpu_memory_utilization}, {plan.requested_bytes / GIB:.2f} GiB). Actual "
            f"usage is {(plan.weights_bytes + plan.non_torch_bytes) / GIB:.2f} GiB for consumed "
            f"memory (weights + non-torch), {plan.activation_peak_bytes / GIB:.2f} GiB for peak "
            f"activation, and {plan.cudagraph_bytes / GIB:.2f} GiB for CUDAGraph memory. Replace "
            f"gpu_memory_utilization config with `--kv-cache-memory={kv_hint}` to fit into "
            "requested memory, or `--kv-cache-memory=<larger value>` to fully utilize gpu memory.",
        )
        self._log(
            Proc.ENGINE_CORE,
            "INFO",
            "core.py:402",
            f"init engine (profile, create kv cache, warmup model) took "
            f"{self.startup_seconds - self.weights_loaded_at:.2f} s",
        )

    # ----------------------------------------------------------------- scenario events

    @property
    def scenario_seconds(self) -> float | None:
        """Simulated seconds since the scenario's zero (None before it is known)."""
        return None if self.scenario_zero is None else self.now - self.scenario_zero

    def _event_times(self) -> list[float]:
        if self.scenario_zero is None or self._next_fault is None or self.ready_at is None:
            return []
        return [self.scenario_zero + self._next_fault[0]]

    def _next_event_time(self) -> float:
        return min([*self._event_times(), self._next_log_at])

    def _scenario_events(self) -> None:
        if self.ready_at is None or self.scenario_zero is None or self._schedule is None:
            return
        while (
            self._next_fault is not None
            and self.death is None
            and self.now >= self.scenario_zero + self._next_fault[0]
        ):
            kind = self._next_fault[1]
            self._next_fault = next(self._schedule, None)
            self._fault(kind)

    def _fault(self, kind: FaultKind) -> None:
        if kind is FaultKind.HANG:
            if self.phase is not EnginePhase.HUNG:
                self.faults.append(FaultRecord(kind, self.now))
            # No log line: a hung engine says nothing; the stats logger keeps printing zeros.
            self.phase = EnginePhase.HUNG
        elif kind is FaultKind.INPUT_HANG:
            self.faults.append(FaultRecord(kind, self.now))
            # No log line: the issues' reports show none; the engine finishes what it holds and
            # then reports an idle server.
            self.input_lost = True
        elif kind is FaultKind.PAUSE:
            self.pause()
        elif kind is FaultKind.RESUME:
            self.resume()
        elif kind is FaultKind.SLEEP:
            self.sleep(self.scenario.sleep_level)
        elif kind is FaultKind.WAKE:
            self.wake_up()
        elif kind is FaultKind.DEATH:
            self.faults.append(FaultRecord(kind, self.now))
            self._die(
                "SystemExit",
                "EngineCore process was killed (signal 9)",
                worker_lines=False,
            )
        elif kind is FaultKind.XID:
            self.faults.append(FaultRecord(kind, self.now))
            self.xid_events.append(XidEvent(len(self.xid_events) + 1, self.scenario.xid, self.now))
            self._die(
                "RuntimeError",
                "CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be "
                "asynchronously reported at some other API call, so the stacktrace below might "
                "be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1",
            )

    def pause(self) -> None:
        """vLLM's ``POST /pause?mode=keep``: the scheduler stops stepping, its requests stay in
        it; new ones queue before it. vLLM's scheduler logs the state it sets."""
        if not self.paused:
            self.faults.append(FaultRecord(FaultKind.PAUSE, self.now))
            # vllm/v1/core/sched/scheduler.py (0.32), set_pause_state
            self._log(
                Proc.ENGINE_CORE, "INFO", "scheduler.py:2756", "setting pause state to PAUSED_ALL"
            )
        self.paused = True

    def resume(self) -> None:
        """``POST /resume``: the scheduler steps again and takes the queued adds."""
        if self.paused:
            self.faults.append(FaultRecord(FaultKind.RESUME, self.now))
            self._log(
                Proc.ENGINE_CORE, "INFO", "scheduler.py:2756", "setting pause state to UNPAUSED"
            )
        self.paused = False
        if self.scheduler is not None:
            for req in self._held_adds:
                self.scheduler.add(req)
        self._held_adds = []

    def sleep(self, level: int) -> None:
        """vLLM's ``POST /sleep?level=N&mode=keep``: the scheduler paused first (its requests
        stay), then the weights offloaded (level 1) or discarded (2); level 0 only pauses."""
        self.pause()
        if self.sleep_level is None:
            self.faults.append(FaultRecord(FaultKind.SLEEP, self.now))
        self.sleep_level = level

    def wake_up(self) -> None:
        """``POST /wake_up``, then ``/resume`` (vLLM keeps the scheduler paused until then)."""
        if self.sleep_level is not None:
            self.faults.append(FaultRecord(FaultKind.WAKE, self.now))
        self.sleep_level = None
        self.resume()

    # ----------------------------------------------------------------- the step

    def _step(self, deltas: dict[str, RequestDelta]) -> None:
        assert self.scheduler is not None
        assert self.memory is not None
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions_total
        if not sched.chunks:
            # Everything waiting needs blocks that running requests hold: time still passes.
            self.now += self.model.step_base_seconds
            self._refresh_gauges()
            return
        act = step_activation_bytes(self.model, sched.chunks)
        mem = self.memory.breakdown(act, self.other_bytes(self.now))
        if mem.over_bytes > 0:
            self.last_activation_bytes = act
            self.alloc_ooms += 1
            self._oom(mem, act)
            self._fail_all(deltas)
            return
        self.last_activation_bytes = act
        self.sampled_activation_bytes = act
        if alloc_retry_needed(mem, self.memory.plan.activation_peak_bytes):
            self.alloc_retries += 1
        self.allocated_peak_bytes = max(self.allocated_peak_bytes, mem.torch_allocated_bytes)
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, mem.torch_reserved_bytes)
        duration = self.model.step_seconds(
            sched.num_tokens,
            sum(c.num_new_tokens for c in sched.chunks if c.num_new_tokens > 1),
            len(sched.chunks),
        )
        self.now += duration
        self.busy_seconds += duration
        self.stats.hist("iteration_tokens_total").observe(sched.num_tokens)
        decode_itl = 0
        for chunk in sched.chunks:
            self._commit(chunk, duration, deltas)
            if chunk.num_new_tokens == 1 and chunk.request.num_output > 1:
                decode_itl += 1
        if decode_itl:
            self.stats.hist("inter_token_latency_seconds").observe(duration, decode_itl)
        self.last_activation_bytes = 0
        self._refresh_gauges()

    def _commit(
        self, chunk: ScheduledChunk, duration: float, deltas: dict[str, RequestDelta]
    ) -> None:
        assert self.scheduler is not None
        assert self.memory is not None
        req = chunk.request
        if req.first_scheduled_seconds is None:
            req.first_scheduled_seconds = self.now - duration
        sampled = self.scheduler.commit(chunk)
        if not sampled:
            return
        req.num_output += 1
        self.stats.generation_tokens += 1
        if req.first_token_seconds is None:
            req.first_token_seconds = self.now
            self.stats.hist("time_to_first_token_seconds").observe(self.now - req.arrival_seconds)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.prompt_tokens_local_cache_hit += req.cached_prompt_tokens
            self.stats.prompt_tokens_local_compute += req.prompt_len - req.cached_prompt_tokens
        req.last_token_seconds = self.now
        reason: FinishReason | None = None
        if req.stop_at is not None and req.num_output >= req.stop_at:
            reason = FinishReason.STOP
        elif req.num_output >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            reason = FinishReason.LENGTH
        prev = deltas.get(req.request_id)
        new_tokens = 1 + (prev.new_tokens if prev else 0)
        deltas[req.request_id] = RequestDelta(req.request_id, new_tokens, reason)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: SimRequest, reason: FinishReason) -> None:
        assert self.scheduler is not None
        assert self.memory is not None
        self.scheduler.remove(req)
        self._requests.pop(req.request_id, None)
        self.memory.on_request_finished(req.prompt_len)
        st = self.stats
        st.request_success[reason] += 1
        first_sched = req.first_scheduled_seconds or req.arrival_seconds
        first_tok = req.first_token_seconds or self.now
        st.hist("e2e_request_latency_seconds").observe(self.now - req.arrival_seconds)
        st.hist("request_queue_time_seconds").observe(first_sched - req.arrival_seconds)
        st.hist("request_inference_time_seconds").observe(self.now - first_sched)
        st.hist("request_prefill_time_seconds").observe(first_tok - first_sched)
        st.hist("request_decode_time_seconds").observe(self.now - first_tok)
        st.hist("request_prompt_tokens").observe(req.prompt_len)
        st.hist("request_generation_tokens").observe(req.num_output)
        st.hist("request_max_num_generation_tokens").observe(req.max_tokens)
        st.hist("request_params_n").observe(1)
        st.hist("request_params_max_tokens").observe(req.max_tokens)
        st.hist("request_num_preemptions").observe(req.num_preemptions)
        st.hist("request_prefill_kv_computed_tokens").observe(
            req.prompt_len - req.cached_prompt_tokens
        )
        if req.num_output > 1:
            tpot = (self.now - first_tok) / (req.num_output - 1)
            st.hist("request_time_per_output_token_seconds").observe(tpot)

    def _refresh_gauges(self) -> None:
        sch = self.scheduler
        if sch is None:
            return
        self.stats.num_requests_running = len(sch.running)
        self.stats.num_requests_waiting = len(sch.waiting)
        self.stats.kv_cache_usage_ratio = sch.pool.usage_ratio()
        self.stats.prefix_cache_queries = sch.prefix_queries_tokens
        self.stats.prefix_cache_hits = sch.prefix_hits_tokens
        self.stats.num_preemptions = sch.num_preemptions_total

    # ----------------------------------------------------------------- death

    def _oom(self, mem: MemoryBreakdown, act: int) -> None:
        others: tuple[tuple[int, int], ...] = ()
        nb = self.scenario.neighbour
        if nb is not None and mem.other_processes_bytes > 0:
            others = ((nb.pid, mem.other_processes_bytes),)
        free_before = mem.total_bytes - (mem.used_bytes - act)
        msg = oom_message(
            tried_bytes=act,
            total_bytes=mem.total_bytes,
            free_bytes=free_before,
            process_bytes=mem.process_bytes - act,
            allocated_bytes=mem.torch_allocated_bytes - act,
            reserved_unallocated_bytes=mem.fragmentation_bytes,
            other_processes=others,
        )
        self.faults.append(FaultRecord(FaultKind.OOM, self.now))
        self._die("torch.OutOfMemoryError", msg)

    def _die(self, exception: str, message: str, worker_lines: bool = True) -> None:
        running = len(self.scheduler.running) if self.scheduler else 0
        waiting = len(self.scheduler.waiting) if self.scheduler else 0
        if worker_lines:
            self._log(
                Proc.ENGINE_CORE,
                "ERROR",
                "dump_input.py:72",
                f"Dumping input data for V1 LLM engine (v{VLLM_VERSION}) with config: "
                f"model='{self.cfg.model_path}', max_seq_len={self.cfg.max_model_len}, ",
            )
            self._log(
                Proc.ENGINE_CORE,
                "ERROR",
                "dump_input.py:82",
                f"Dumping scheduler stats: SchedulerStats(num_running_reqs={running}, "
                f"num_waiting_reqs={waiting}, kv_cache_usage={self.stats.kv_cache_usage_ratio})",
            )
            self._log(
                Proc.ENGINE_CORE, "ERROR", "core.py:1007", "EngineCore encountered a fatal error."
            )
            self._traceback(
                ("vllm/v1/engine/core.py", 998, "run_engine_core"),
                ("vllm/v1/worker/gpu_model_runner.py", 2431, "execute_model"),
                f"{exception}: {message}",
            )
        else:
            self._log(
                Proc.API_SERVER,
                "WARNING",
                "core_client.py:1032",
                "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
            )
        self._log(Proc.API_SERVER, "ERROR", "async_llm.py:580", "AsyncLLM output_handler failed.")
        self._traceback(
            ("vllm/v1/engine/async_llm.py", 536, "output_handler"),
            ("vllm/v1/engine/core_client.py", 880, "get_output_async"),
            f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}",
        )
        # The watchdog notices at its next 5 s tick and stops the server.
        exit_at = self.now + WATCHDOG_INTERVAL_SECONDS - (self.now % WATCHDOG_INTERVAL_SECONDS)
        self.death = DeathRecord(self.now, exception, message, exit_at)
        self.phase = EnginePhase.DEAD

    def _fail_all(self, deltas: dict[str, RequestDelta]) -> None:
        for rid in list(self._requests):
            prev = deltas.get(rid)
            deltas[rid] = RequestDelta(
                rid, prev.new_tokens if prev else 0, None, ENGINE_DEAD_MESSAGE
            )
        self._requests.clear()

    def dead_deltas(self) -> list[RequestDelta]:
        """Deltas for requests still open when the engine died outside a step."""
        deltas: dict[str, RequestDelta] = {}
        self._fail_all(deltas)
        return list(deltas.values())

    # ----------------------------------------------------------------- logging

    def _periodic_log(self) -> None:
        while self.phase in (EnginePhase.READY, EnginePhase.HUNG) and self.now >= self._next_log_at:
            st = self.stats
            prompt, gen = st.prompt_tokens, st.generation_tokens
            dp = (prompt - self._last_log_counts[0]) / LOG_STATS_INTERVAL_SECONDS
            dg = (gen - self._last_log_counts[1]) / LOG_STATS_INTERVAL_SECONDS
            self._last_log_counts = (prompt, gen)
            hit = (
                100.0 * st.prefix_cache_hits / st.prefix_cache_queries
                if st.prefix_cache_queries
                else 0.0
            )
            busy = st.num_requests_running or st.num_requests_waiting or dp or dg
            if busy:
                self._logs.append(
                    LogEvent(
                        self._next_log_at,
                        Proc.API_SERVER,
                        "INFO",
                        "loggers.py:335",
                        f"Engine 000: Avg prompt throughput: {dp:.1f} tokens/s, Avg generation "
                        f"throughput: {dg:.1f} tokens/s, Running: {st.num_requests_running} reqs, "
                        f"Waiting: {st.num_requests_waiting} reqs, Preemptions: {st.num_preemptions}, "
                        f"GPU KV cache usage: {100.0 * st.kv_cache_usage_ratio:.1f}%, "
                        f"Prefix cache hit rate: {hit:.1f}%",
                    )
                )
            self._next_log_at += LOG_STATS_INTERVAL_SECONDS

    def _log(self, proc: Proc, level: str, fileinfo: str, message: str) -> None:
        self._logs.append(LogEvent(self.now, proc, level, fileinfo, message))

    def _raw(self, line: str) -> None:
        self._logs.append(LogEvent(self.now, Proc.NONE, "", "", line))

    def _traceback(self, *frames_and_last: tuple[str, int, str] | str) -> None:
        """The traceback of the record just logged (``logger.exception``): vLLM's
        NewLineFormatter repeats that record's header on every line of it."""
        head = self._logs[-1]

        def line(text: str) -> None:
            self._log(head.proc, head.level, head.fileinfo, text)

        line("Traceback (most recent call last):")
        for item in frames_and_last:
            if isinstance(item, str):
                for text in item.split("\n"):
                    line(text)
            else:
                path, line_no, func = item
                line(
                    f'  File "/usr/local/lib/python3.12/dist-packages/{path}", line {line_no}, in {func}'
                )
