"""The loadtest's shell: send the load step by step, watch the server, stop before harm.

Each step runs closed loop (``concurrency`` requests in flight at all times) or open loop
(Poisson arrivals at ``rate_per_second``, at most ``max_in_flight``), with the twin's load
generator's request sender (``sim/load.send_one``) and request plans (``plan_requests``).
While it runs, the guardian's own sources are sampled into ``Snapshot``s (vLLM ``/metrics``,
``/health``, the GPU source, the log or journal) and the pure core derives rates and latency
quantiles from them (``core/signals.derive``), so a loadtest reads the server exactly as the
daemon does.

Stops before harm: at once on an OOM or engine-death log line, a server that stops answering
``/health``, GPU headroom under the floor, or errors piling up; at the end of a step for the
p99 SLOs, the error ratio and the preemption rate; and before a step whose forecast headroom
(the trend of the previous steps) falls under the floor. It never retries a failed request and
never starts another step after a broken one. Ctrl-C (``KeyboardInterrupt``) stops the load at
once: worker threads are daemons and are not waited for; what was measured is returned.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import requests

from vllm_guardian.config import (
    HealthSourceConfig,
    LogsSourceConfig,
    NvmlSourceConfig,
    ServiceConfig,
    SignalsConfig,
    VllmMetricsSourceConfig,
)
from vllm_guardian.core.budget import LaunchFlags, parse_launch_flags
from vllm_guardian.core.signals import ServiceSignals, derive
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.model import (
    GpuReading,
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    LogReading,
    Reading,
    ServiceSnapshot,
    Snapshot,
    UnitState,
    VllmScrape,
)
from vllm_guardian.sim.load import (
    OutcomeKind,
    PlannedRequest,
    RequestOutcome,
    plan_requests,
    send_one,
)
from vllm_guardian.sim.scenarios import LoadProfile
from vllm_guardian.sources.base import Collector
from vllm_guardian.sources.health import HealthCollector
from vllm_guardian.sources.logs import LogsCollector
from vllm_guardian.sources.nvml import NvmlCollector
from vllm_guardian.sources.unit import (
    descendants,
    listening_inodes,
    port_of,
    read_cmdline,
    read_parents,
    socket_owners,
    topmost,
)
from vllm_guardian.sources.vllm_metrics import VllmMetricsCollector

from .profile import FilePrompt, LoadSpec, Profile, StepSpec
from .results import StepResult, summarize

SERVICE = "loadtest"
PROC = Path("/proc")
# Memory errors and engine death in the log: the server is going down, stop at once.
FATAL_LOG_EVENTS = frozenset(
    {
        LogEventKind.CUDA_OOM,
        LogEventKind.NON_TORCH_OOM,
        LogEventKind.ENGINE_FATAL,
        LogEventKind.ENGINE_DEAD,
        LogEventKind.WORKER_DIED,
        LogEventKind.GPU_HARDWARE_ERROR,
    }
)
OOM_LOG_EVENTS = frozenset({LogEventKind.CUDA_OOM, LogEventKind.NON_TORCH_OOM})
# /health answers that mean the server is dying or gone (not merely slow under load).
DEAD_HEALTH = frozenset({HealthState.ENGINE_DEAD, HealthState.REFUSED})
# Errors needed before the error ratio can stop a step early: one timeout is not a storm.
MIN_ERRORS_TO_STOP = 3
SYNTHETIC_BATCH = 64
# Open loop: at most this many arrivals are planned per step (the plan holds the prompts).
MAX_PLANNED_PER_STEP = 20_000


class Limit(StrEnum):
    P99_TTFT = "p99_ttft"
    P99_E2E = "p99_e2e"
    ERROR_RATIO = "error_ratio"
    PREEMPTION_RATE = "preemption_rate"
    GPU_HEADROOM = "gpu_headroom"
    HEADROOM_FORECAST = "headroom_forecast"
    OOM = "oom"
    SERVER_DOWN = "server_down"


@dataclass(frozen=True)
class Violation:
    limit: Limit
    message: str


class Unreachable(Exception):
    """The server did not answer before any load was sent."""


# --- requests --------------------------------------------------------------------------------


class RequestSource:
    """Hands out the next request to send, thread-safe: synthetic prompts from the twin's
    ``plan_requests`` in seeded batches, or the prompts file in order, cycled."""

    def __init__(self, load: LoadSpec, prompts: Sequence[FilePrompt] | None, seed: int) -> None:
        self._load = load
        self._prompts = tuple(prompts) if prompts else None
        self._rng = random.Random(seed)  # noqa: S311 (reproducible traffic, not security)
        self._seed = seed
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self._batch: list[PlannedRequest] = []
        self._batches = 0

    def load_profile(self, rate_per_second: float = 1.0) -> LoadProfile:
        ld = self._load
        return LoadProfile(
            rate_per_second=rate_per_second,
            prompt_tokens_min=ld.prompt_tokens_min,
            prompt_tokens_max=ld.prompt_tokens_max,
            output_tokens_min=ld.output_tokens_min,
            output_tokens_max=ld.output_tokens_max,
            shared_prefix_ratio=ld.shared_prefix_ratio,
        )

    def next(self) -> PlannedRequest:
        with self._lock:
            serial = next(self._serial)
            if self._prompts is not None:
                fp = self._prompts[serial % len(self._prompts)]
                max_tokens = fp.max_tokens or self._rng.randint(
                    self._load.output_tokens_min, self._load.output_tokens_max
                )
                return PlannedRequest(serial, 0.0, fp.prompt, fp.tokens, max_tokens)
            if not self._batch:
                self._batches += 1
                plan = plan_requests(
                    self.load_profile(),
                    self._seed * 1_000_003 + self._batches,
                    SYNTHETIC_BATCH,
                    math.inf,
                )
                self._batch = list(reversed(plan))
            return self.renumbered(self._batch.pop(), serial)

    @staticmethod
    def renumbered(p: PlannedRequest, serial: int) -> PlannedRequest:
        """A batch's request under a run-wide number: ``plan_requests`` names each prompt's own
        words after its index, so two batches would otherwise send the same prompts (and a
        prefix cache would turn the load into cache hits)."""
        return replace(p, index=serial, prompt=p.prompt.replace(f"r{p.index}w", f"r{serial}w"))

    def open_loop_plan(
        self, rate_per_second: float, duration_seconds: float
    ) -> list[PlannedRequest]:
        """Poisson arrivals for one open-loop step (seconds after the step starts)."""
        with self._lock:
            self._batches += 1
            seed = self._seed * 1_000_003 + self._batches
        plan = plan_requests(
            self.load_profile(rate_per_second), seed, MAX_PLANNED_PER_STEP, duration_seconds
        )
        out = []
        for p in plan:
            nxt = self.next() if self._prompts is not None else None
            serial = nxt.index if nxt is not None else next(self._serial)
            base = nxt if nxt is not None else self.renumbered(p, serial)
            out.append(replace(base, at_seconds=p.at_seconds))
        return out


# --- one step's record -----------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one step has measured so far (mutable while it runs; workers append outcomes)."""

    spec: StepSpec
    started_monotonic: float
    outcomes: list[RequestOutcome] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    samples: list[ServiceSignals] = field(default_factory=list)
    dropped: int = 0  # open loop: arrivals over max_in_flight
    in_flight: int = 0
    ended_monotonic: float | None = None
    violations: list[Violation] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: RequestOutcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)
            self.in_flight -= 1

    def counts(self) -> tuple[int, int]:
        """(finished, errors) so far."""
        with self.lock:
            done = [o for o in self.outcomes if o.kind is not OutcomeKind.NOT_SENT]
            return len(done), sum(1 for o in done if o.kind is not OutcomeKind.OK)


class Driver:
    """Sends one step's load on daemon threads until ``stop`` is set."""

    def __init__(
        self,
        url: str,
        model: str,
        load: LoadSpec,
        source: RequestSource,
        record: StepRecord,
        error_ratio_limit: float = 1.0,
    ) -> None:
        self.url = url
        self.model = model
        self.load = load
        self.source = source
        self.record = record
        self.error_ratio_limit = error_ratio_limit
        self.stop = threading.Event()

    def start(self) -> None:
        spec = self.record.spec
        if spec.concurrency is not None:
            for i in range(spec.concurrency):
                threading.Thread(
                    target=self._worker, name=f"loadtest-{spec.index}-{i}", daemon=True
                ).start()
        else:
            assert spec.rate_per_second is not None
            plan = self.source.open_loop_plan(spec.rate_per_second, spec.duration_seconds)
            threading.Thread(
                target=self._dispatch, args=(plan,), name=f"loadtest-{spec.index}", daemon=True
            ).start()

    def _send(self, p: PlannedRequest) -> None:
        scheduled = time.monotonic() - self.record.started_monotonic
        out = send_one(
            self.url, p, self.model, self.load.stream, self.load.request_timeout_seconds, scheduled
        )
        self.record.add(out)
        # Never retry into a dying server: the workers stop themselves as soon as errors pile
        # up, without waiting for the watcher's next sample.
        finished, errors = self.record.counts()
        if errors >= MIN_ERRORS_TO_STOP and errors / max(1, finished) > self.error_ratio_limit:
            self.stop.set()

    def _worker(self) -> None:
        while not self.stop.is_set():
            p = self.source.next()
            with self.record.lock:
                self.record.in_flight += 1
            self._send(p)

    def _dispatch(self, plan: list[PlannedRequest]) -> None:
        start = self.record.started_monotonic
        for p in plan:
            if self.stop.wait(max(0.0, start + p.at_seconds - time.monotonic())):
                return
            with self.record.lock:
                if self.record.in_flight >= self.load.max_in_flight:
                    self.record.dropped += 1
                    continue
                self.record.in_flight += 1
            threading.Thread(target=self._send, args=(p,), daemon=True).start()


# --- watching --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerInfo:
    model: str
    pid: int | None  # the local process listening on the URL's port, when there is one
    flags: LaunchFlags  # from --server-args, else the local process's command line


def preflight(url: str, model: str | None, timeout_seconds: float = 5.0) -> str:
    """The model to load (``--model`` or the server's first), or Unreachable with why."""
    base = url.rstrip("/")
    try:
        resp = requests.get(f"{base}/v1/models", timeout=timeout_seconds)
    except requests.RequestException as e:
        raise Unreachable(
            f"{base} does not answer ({type(e).__name__}): is the server up, and is this its "
            "URL? (vLLM refuses connections while it loads the model)"
        ) from None
    if resp.status_code != 200:
        raise Unreachable(f"{base}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]!r}")
    try:
        names = [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise Unreachable(f"{base}/v1/models is not an OpenAI model list: is this vLLM?") from None
    if model is not None:
        if names and model not in names:
            raise Unreachable(f"the server serves {', '.join(names)}, not {model!r}")
        return model
    if not names:
        raise Unreachable(f"{base}/v1/models lists no model")
    return names[0]


def local_server(url: str, proc_root: Path = PROC) -> tuple[int | None, tuple[str, ...] | None]:
    """The local process listening on the URL's port and its command line (None: not here)."""
    inodes = listening_inodes(proc_root, port_of(url))
    owners = socket_owners(proc_root, inodes)
    if not owners:
        return None, None
    pid = topmost(owners, read_parents(proc_root))
    return pid, read_cmdline(proc_root, pid)


def server_info(url: str, model: str, server_args: Sequence[str] | None) -> ServerInfo:
    pid, cmdline = local_server(url)
    argv = list(server_args) if server_args is not None else list(cmdline or ())
    return ServerInfo(model, pid, parse_launch_flags(argv))


class Watcher:
    """The guardian's sources for one server, sampled into Snapshots."""

    def __init__(self, url: str, profile: Profile, pid: int | None) -> None:
        w = profile.watch
        clock = SystemClock()
        self.service = ServiceConfig(
            name=SERVICE, url=url, gpus=w.gpus, unit=w.unit, log_file=w.log_file
        )
        self._pid = pid
        self.collectors: list[Collector] = [
            VllmMetricsCollector(self.service, VllmMetricsSourceConfig()),
            HealthCollector(self.service, HealthSourceConfig(), clock),
        ]
        self.gpu: NvmlCollector | None = None
        if w.gpu_backend != "none":
            # The file backend calls a file stale after three intervals; the twin rewrites it
            # every second, so a fast sampling rate must not make it look stale.
            self.gpu = NvmlCollector(
                NvmlSourceConfig(backend=w.gpu_backend, state_file=w.gpu_state_file),
                clock,
                interval_seconds=max(2.0, w.interval_seconds),
            )
        self.logs: LogsCollector | None = None
        if w.log_file or w.unit:
            self.logs = LogsCollector(self.service, LogsSourceConfig(), clock)
        self.errors: dict[str, str] = {}  # source → last error, for the report
        self._gpu_indices: tuple[int, ...] | None = w.gpus

    def _unit(self) -> UnitState | None:
        if self._pid is None:
            return None
        pids = (self._pid, *descendants(self._pid, read_parents(PROC)))
        return UnitState(None, None, None, None, self._pid, None, None, None, None, None, pids)

    def sample(self) -> Snapshot:
        readings: list[Reading] = [c.collect() for c in self.collectors]
        gpu = self.gpu.collect() if self.gpu is not None else None
        logs = self.logs.collect() if self.logs is not None else None
        vllm: VllmScrape | None = None
        health: HealthProbe | None = None
        for r in [*readings, *(x for x in (gpu, logs) if x is not None)]:
            if r.error:
                self.errors[str(r.source)] = r.error + (f" ({r.hint})" if r.hint else "")
            else:
                self.errors.pop(str(r.source), None)
            if isinstance(r.payload, VllmScrape):
                vllm = r.payload
            elif isinstance(r.payload, HealthProbe):
                health = r.payload
        gpus = gpu.payload if gpu is not None and isinstance(gpu.payload, GpuReading) else None
        log_reading = (
            logs.payload if logs is not None and isinstance(logs.payload, LogReading) else None
        )
        if gpus is not None and self._gpu_indices is None and self._pid is None:
            # No pid to attribute by: the server's GPUs are every GPU the source sees.
            self._gpu_indices = tuple(d.index for d in gpus.devices)
            self.service = replace(self.service, gpus=self._gpu_indices)
        svc = ServiceSnapshot(
            SERVICE, vllm=vllm, health=health, unit=self._unit(), logs=log_reading
        )
        # The steady clock, as the daemon stamps its snapshots: the signals find their windows
        # by bisection, which needs times in order (a wall clock stepped back by NTP is not).
        return Snapshot(time.monotonic(), (svc,), gpus)

    def close(self) -> None:
        for c in [*self.collectors, *(x for x in (self.gpu, self.logs) if x is not None)]:
            c.close()


def signals_over(
    history: Sequence[Snapshot], service: ServiceConfig, window_seconds: float
) -> ServiceSignals:
    """The core's signals for the newest snapshot, rates and quantiles over the window."""
    w = max(2.0, window_seconds)
    cfg = SignalsConfig(rate_window_seconds=w, quantile_window_seconds=w, slope_window_seconds=w)
    sig = derive(history, [service], cfg).service(service.name)
    assert sig is not None
    return sig


# --- the run ---------------------------------------------------------------------------------


@dataclass
class RunState:
    """Everything the run has measured, handed to the report even when it was cut short."""

    url: str
    server: ServerInfo
    profile: Profile
    records: list[StepRecord] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)
    baseline: Snapshot | None = None
    stop_reason: str | None = None  # why the run ended before the profile's end
    interrupted: bool = False
    source_errors: dict[str, str] = field(default_factory=dict)
    started_unix: float = field(default_factory=time.time)


Progress = Callable[[RunState, StepRecord, ServiceSignals | None], None]


def log_violation(events: Sequence[LogEvent]) -> Violation | None:
    """The stop a log read calls for, naming its cause: an OOM line when there is one (vLLM
    logs ``EngineCore encountered a fatal error`` before the OOM that caused it, often in the
    same read), else the first engine-death line; None when nothing fatal was logged."""
    fatal = [e for e in events if e.kind in FATAL_LOG_EVENTS]
    if not fatal:
        return None
    oom = [e for e in fatal if e.kind in OOM_LOG_EVENTS]
    first = (oom or fatal)[0]
    return Violation(Limit.OOM if oom else Limit.SERVER_DOWN, f"log: {first.message[:200]}")


def _instant_violations(
    sig: ServiceSignals, snap: Snapshot, record: StepRecord, profile: Profile
) -> list[Violation]:
    out: list[Violation] = []
    svc = snap.service(SERVICE)
    if v := log_violation(svc.logs.recent if svc is not None and svc.logs is not None else ()):
        out.append(v)
    if sig.health_state in DEAD_HEALTH:
        out.append(
            Violation(Limit.SERVER_DOWN, f"/health: {sig.health_state} (the server is dying)")
        )
    floor = profile.limits.gpu_headroom_floor_bytes
    if sig.headroom_bytes is not None and sig.headroom_bytes < floor:
        out.append(
            Violation(
                Limit.GPU_HEADROOM,
                f"GPU headroom {sig.headroom_bytes / 2**30:.2f} GiB under the floor "
                f"{floor / 2**30:.2f} GiB",
            )
        )
    finished, errors = record.counts()
    if errors >= MIN_ERRORS_TO_STOP and errors / max(1, finished) > profile.limits.error_ratio:
        what = "from the start" if errors == finished else f"{errors} of {finished}"
        out.append(
            Violation(
                Limit.ERROR_RATIO,
                f"requests fail {what} (limit {profile.limits.error_ratio:.0%}); not retrying",
            )
        )
    return out


def forecast_headroom(records: Sequence[StepResult], next_concurrency: int) -> float | None:
    """Headroom at the next step, extrapolated linearly in concurrency from the last two
    steps' minimum headroom; None when it is not falling or not known.

    A step's minimum is a sampled low point of a sawtooth (each engine step holds its
    activations while it runs), so a fall between two steps smaller than the swing within the
    last step is sampling, not a trend: no forecast then (core/forecast.py reads floors the
    same way)."""
    pts = [
        (r.concurrency, r.gpu_headroom_min_bytes, r.gpu_headroom_max_bytes)
        for r in records
        if r.concurrency is not None and r.gpu_headroom_min_bytes is not None
    ]
    if len(pts) < 2:
        return None
    (c0, h0, _), (c1, h1, top1) = pts[-2], pts[-1]
    if c1 <= c0 or h1 >= h0:
        return None
    swing = (top1 - h1) if top1 is not None else 0
    if h0 - h1 <= swing:
        return None
    return h1 + (h1 - h0) / (c1 - c0) * (next_concurrency - c1)


def run_loadtest(
    url: str,
    profile: Profile,
    server: ServerInfo,
    prompts: Sequence[FilePrompt] | None = None,
    progress: Progress | None = None,
) -> RunState:
    """Run every step of ``profile`` against ``url``; returns what was measured, also when a
    limit, an error or Ctrl-C ended it early (``stop_reason``, ``interrupted``)."""
    state = RunState(url, server, profile)
    source = RequestSource(profile.load, prompts, profile.load.seed)
    watcher = Watcher(url, profile, server.pid)
    interval = profile.watch.interval_seconds
    driver: Driver | None = None
    try:
        state.baseline = watcher.sample()
        prev_last = state.baseline
        for spec in profile.steps():
            if spec.concurrency is not None:
                f = forecast_headroom(state.results, spec.concurrency)
                floor = profile.limits.gpu_headroom_floor_bytes
                if f is not None and f < floor:
                    state.stop_reason = (
                        f"{Limit.HEADROOM_FORECAST}: step {spec.label} not run: the headroom "
                        f"trend of the last steps reaches {max(0.0, f) / 2**30:.2f} GiB there, "
                        f"under the floor {floor / 2**30:.2f} GiB"
                    )
                    break
            record = StepRecord(spec, time.monotonic())
            record.snapshots.append(prev_last)
            state.records.append(record)
            driver = Driver(
                url, server.model, profile.load, source, record, profile.limits.error_ratio
            )
            driver.start()
            end = record.started_monotonic + spec.duration_seconds
            stop = False
            while True:
                snap = watcher.sample()
                record.snapshots.append(snap)
                sig = signals_over(record.snapshots[-8:], watcher.service, 5 * interval)
                record.samples.append(sig)
                record.violations.extend(_instant_violations(sig, snap, record, profile))
                if progress is not None:
                    progress(state, record, sig)
                if record.violations:
                    stop = True
                    break
                now = time.monotonic()
                if now >= end:
                    break
                driver.stop.wait(min(interval, end - now))
            driver.stop.set()
            if stop:
                _last_look(record, watcher, profile)
            else:
                stop = _drain(record, watcher, profile, progress, state)
            record.ended_monotonic = time.monotonic()
            prev_last = record.snapshots[-1]
            state.results.append(finish_step(record, watcher.service, profile, complete=not stop))
            if stop or not state.results[-1].held:
                state.stop_reason = "; ".join(m for _, m in state.results[-1].violations) or None
                break
    except KeyboardInterrupt:
        state.interrupted = True
        state.stop_reason = "interrupted (Ctrl-C): the load was stopped at once"
        if driver is not None:
            driver.stop.set()
        if state.records and state.records[-1].ended_monotonic is None:
            last = state.records[-1]
            last.ended_monotonic = time.monotonic()
            state.results.append(finish_step(last, watcher.service, profile, complete=False))
    finally:
        state.source_errors = dict(watcher.errors)
        watcher.close()
    return state


def finish_step(
    record: StepRecord, service: ServiceConfig, profile: Profile, complete: bool
) -> StepResult:
    end = record.ended_monotonic or time.monotonic()
    duration = end - record.started_monotonic
    snaps = record.snapshots
    whole = signals_over(snaps, service, snaps[-1].time_seconds - snaps[0].time_seconds + 0.01)
    with record.lock:
        outcomes = list(record.outcomes)
    return summarize(
        record.spec,
        outcomes,
        record.samples,
        whole,
        duration,
        record.dropped,
        [(str(v.limit), v.message) for v in record.violations],
        complete,
        profile.limits,
    )


def _last_look(record: StepRecord, watcher: Watcher, profile: Profile) -> None:
    """A dying server logs why a moment after it stops answering: look once more, so the
    report names an OOM rather than only its symptoms."""
    if watcher.logs is None or any(v.limit is Limit.OOM for v in record.violations):
        return
    time.sleep(min(1.0, 2 * profile.watch.interval_seconds))
    snap = watcher.sample()
    record.snapshots.append(snap)
    svc = snap.service(SERVICE)
    for e in svc.logs.recent if svc is not None and svc.logs is not None else ():
        if e.kind in OOM_LOG_EVENTS:
            record.violations.insert(0, Violation(Limit.OOM, f"log: {e.message[:200]}"))
            return


def _drain(
    record: StepRecord,
    watcher: Watcher,
    profile: Profile,
    progress: Progress | None,
    state: RunState,
) -> bool:
    """Wait for the step's in-flight requests (bounded), still watching. True: stop the run."""
    deadline = time.monotonic() + min(
        profile.load.request_timeout_seconds, record.spec.duration_seconds
    )
    while time.monotonic() < deadline:
        with record.lock:
            if record.in_flight <= 0:
                return False
        time.sleep(min(profile.watch.interval_seconds, 0.2))
        snap = watcher.sample()
        record.snapshots.append(snap)
        sig = signals_over(
            record.snapshots[-8:], watcher.service, 5 * profile.watch.interval_seconds
        )
        record.samples.append(sig)
        record.violations.extend(_instant_violations(sig, snap, record, profile))
        if progress is not None:
            progress(state, record, sig)
        if record.violations:
            return True
    return False
