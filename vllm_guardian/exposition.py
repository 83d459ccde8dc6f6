"""The guardian's own HTTP endpoint: ``/metrics``, ``/healthz`` and ``/ready/<service>``.

Where it sits: after collect and derive, the tick *publishes* the snapshot and its signals
here; scrapes read the last published state and never wait on a tick. The registry is a
private ``CollectorRegistry`` (no global state), with :class:`GuardianCollector` rendering
families on demand from the published data. Binds to loopback unless configured otherwise.

``/ready/<service>`` is the admission gate a load balancer polls: 200 while the service takes
new work, 503 while the guardian holds it back (the policy sets it; the foundation leaves it
open). ``/healthz`` is the guardian's own liveness: 200 while ticks are recent.
"""

from __future__ import annotations

import json
import math
import platform
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vllm_guardian import __version__
from vllm_guardian.boundedhttp import BoundedHTTPServer, Limits
from vllm_guardian.core.signals import ServiceSignals, Signals
from vllm_guardian.healing import HealingView
from vllm_guardian.model import AlertState, GateObservation, GateState, HealthState, Snapshot

NS = "vllm_guardian"


@dataclass(frozen=True)
class Published:
    snapshot: Snapshot
    signals: Signals
    tick_duration_seconds: float
    healing: HealingView | None = None


class GuardianCollector:
    """A prometheus_client custom collector over the last published tick."""

    def __init__(self, services: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._published: Published | None = None
        self._services = tuple(services)
        self._ticks = 0
        self._xid_counts: dict[tuple[int, int], int] = {}
        self._gates: dict[str, GateState] = {s: GateState(True, "open") for s in services}
        self._last_tick_monotonic: float | None = None

    # --- written by the tick ------------------------------------------------------------------

    def publish(self, published: Published, monotonic_now: float) -> None:
        with self._lock:
            self._published = published
            self._ticks += 1
            self._last_tick_monotonic = monotonic_now
            gpus = published.snapshot.gpus
            for ev in gpus.xid_events if gpus is not None else ():
                key = (ev.gpu_index, ev.xid)
                self._xid_counts[key] = self._xid_counts.get(key, 0) + 1

    def set_services(self, services: Sequence[str]) -> None:
        with self._lock:
            self._services = tuple(services)
            self._gates = {s: self._gates.get(s, GateState(True, "open")) for s in services}

    def set_gate(self, service: str, gate: GateState) -> None:
        with self._lock:
            self._gates[service] = gate

    # --- read by HTTP handlers ----------------------------------------------------------------

    def gate(self, service: str) -> GateState | None:
        with self._lock:
            return self._gates.get(service)

    def last_tick_monotonic(self) -> float | None:
        with self._lock:
            return self._last_tick_monotonic

    def published(self) -> Published | None:
        with self._lock:
            return self._published

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on what was observed; skip describe-time collection

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            pub = self._published
            ticks = self._ticks
            xids = dict(self._xid_counts)
            gates = dict(self._gates)
        yield from _build_info()
        ticks_total = CounterMetricFamily(
            f"{NS}_ticks", "Ticks completed since the guardian started."
        )
        ticks_total.add_metric([], ticks)
        yield ticks_total
        ready = GaugeMetricFamily(
            f"{NS}_ready",
            "1 when /ready/<service> answers 200 (admits new work), 0 when gated.",
            labels=["service"],
        )
        for svc, g in sorted(gates.items()):
            ready.add_metric([svc], 1.0 if g.ready else 0.0)
        yield ready
        if pub is None:
            return
        yield from _tick_families(pub)
        yield from _source_families(pub.snapshot)
        yield from _service_families(pub.snapshot, pub.signals)
        yield from _allocator_families(pub.signals)
        yield from _gpu_families(pub.snapshot, xids)
        if pub.healing is not None:
            yield from _healing_families(pub.healing, pub.snapshot.time_seconds)


def _build_info() -> Iterator[Metric]:
    info = GaugeMetricFamily(
        f"{NS}_build_info",
        "The guardian's version and Python, always 1.",
        labels=["version", "python_version"],
    )
    info.add_metric([__version__, platform.python_version()], 1.0)
    yield info


def _tick_families(pub: Published) -> Iterator[Metric]:
    dur = GaugeMetricFamily(
        f"{NS}_tick_duration_seconds", "Wall time of the last tick (collect to publish)."
    )
    dur.add_metric([], pub.tick_duration_seconds)
    yield dur
    ts = GaugeMetricFamily(
        f"{NS}_last_tick_timestamp_seconds", "Unix time of the last completed tick."
    )
    ts.add_metric([], pub.snapshot.time_seconds)
    yield ts


def _source_families(snap: Snapshot) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        f"{NS}_source_up",
        "1 when the source observed this tick, 0 when it could not (see the guardian's log for why).",
        labels=["service", "source"],
    )
    dur = GaugeMetricFamily(
        f"{NS}_source_duration_seconds",
        "How long the source took this tick.",
        labels=["service", "source"],
    )
    for st in snap.sources:
        labels = [st.service or "", st.source.value]
        up.add_metric(labels, 1.0 if st.up else 0.0)
        dur.add_metric(labels, st.duration_seconds)
    yield up
    yield dur


class _Families:
    """Gauge families keyed by name, created on first use, yielded in creation order."""

    def __init__(self) -> None:
        self._fams: dict[str, GaugeMetricFamily] = {}

    def add(
        self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float | None
    ) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return  # missing stays absent: never a zero that means "unknown"
        fam = self._fams.get(name)
        if fam is None:
            fam = self._fams[name] = GaugeMetricFamily(f"{NS}_{name}", doc, labels=list(labels))
        fam.add_metric(list(values), float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(list(self._fams.values()))


_SERVICE_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "kv_cache_usage_ratio",
        "kv_cache_usage_ratio",
        "Share of vLLM's KV block pool in use (0..1), all engines.",
    ),
    ("requests_waiting", "requests_waiting", "Requests queued in vLLM, not yet scheduled."),
    ("requests_running", "requests_running", "Requests in vLLM's running batch."),
    ("requests_swapped", "requests_swapped", "Requests swapped to CPU (vLLM V0 only)."),
    (
        "preemptions_per_second",
        "preemptions_per_second",
        "vLLM preemptions per second (KV pool ran out).",
    ),
    (
        "prompt_tokens_per_second",
        "prompt_tokens_per_second",
        "Prefill tokens processed per second.",
    ),
    (
        "generation_tokens_per_second",
        "generation_tokens_per_second",
        "Tokens generated per second.",
    ),
    (
        "request_failures_per_second",
        "request_failures_per_second",
        "Requests finished with reason abort or error, per second.",
    ),
    (
        "admission_rejections_per_second",
        "admission_rejections_per_second",
        "Requests vLLM itself answered 503 at its queue limits (--max-num-queued-reqs/-tokens), "
        "per second.",
    ),
    (
        "prefix_cache_hit_ratio",
        "prefix_cache_hit_ratio",
        "Prefix-cache hit ratio over the rate window (tokens).",
    ),
    (
        "engine_stall_seconds",
        "stall_seconds",
        "How long requests have been in the engine with no progress (tokens, KV usage, preemptions).",
    ),
    (
        "kv_cache_capacity_tokens",
        "kv_cache_capacity_tokens",
        "Tokens vLLM's KV block pool holds, all engines.",
    ),
    (
        "vllm_gpu_memory_utilization_ratio",
        "gpu_memory_utilization_ratio",
        "vLLM's --gpu-memory-utilization as it reports it.",
    ),
    (
        "memory_budget_bytes",
        "memory_budget_bytes",
        "GPU memory vLLM planned to use: gpu_memory_utilization × total, over its GPUs.",
    ),
    (
        "service_memory_bytes",
        "service_memory_bytes",
        "GPU memory held by the service's processes, all its GPUs.",
    ),
    (
        "memory_over_budget_bytes",
        "memory_over_budget_bytes",
        "GPU memory the service holds beyond its budget.",
    ),
    (
        "other_processes_memory_bytes",
        "other_processes_memory_bytes",
        "GPU memory held by other processes on the service's GPUs.",
    ),
    ("gpu_headroom_bytes", "headroom_bytes", "Least free memory among the service's GPUs."),
    (
        "gpu_headroom_slope_bytes_per_second",
        "headroom_slope_bytes_per_second",
        "Trend of the free-memory headroom (negative: falling).",
    ),
    (
        "capacity_demand_ratio",
        "capacity_demand_ratio",
        "Requests arriving ÷ requests served while saturated, over signals.capacity_window_seconds "
        "(> 1: over capacity). Absent when not measurable (not saturated, idle, restarted, no stats).",
    ),
    (
        "capacity_replicas_needed",
        "capacity_replicas_needed",
        "Replicas of this service that would serve the demand (absent without an estimate).",
    ),
)


def _bool(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


def _service_families(snap: Snapshot, signals: Signals) -> Iterator[Metric]:
    f = _Families()
    for sig in signals.services:
        svc = sig.service
        ss = snap.service(svc)
        f.add(
            "vllm_health",
            "1 when vLLM's /health answers 200, else 0.",
            ["service"],
            [svc],
            _bool(sig.vllm_up),
        )
        if ss is not None and ss.health is not None:
            f.add(
                "vllm_health_latency_seconds",
                "Latency of the last /health probe.",
                ["service"],
                [svc],
                ss.health.latency_seconds,
            )
            for state in HealthState:
                f.add(
                    "vllm_health_state",
                    "The last /health outcome (1 for the current state).",
                    ["service", "state"],
                    [svc, state.value],
                    1.0 if ss.health.state is state else 0.0,
                )
            if ss.health.deep is not None:
                f.add(
                    "vllm_deep_probe_ok",
                    "1 when the last 1-token completion succeeded.",
                    ["service"],
                    [svc],
                    _bool(ss.health.deep.ok),
                )
        f.add(
            "vllm_stats_enabled",
            "1 when /metrics carries vllm:* series, 0 when vLLM runs with --disable-log-stats.",
            ["service"],
            [svc],
            _bool(sig.stats_enabled),
        )
        _service_gauges(f, sig)
        if ss is not None and ss.vllm is not None:
            f.add(
                "vllm_scrape_bytes",
                "Size of the last vLLM /metrics body.",
                ["service"],
                [svc],
                ss.vllm.body_bytes,
            )
            f.add(
                "vllm_scrape_malformed_lines",
                "Lines of the last vLLM /metrics body the parser skipped as malformed.",
                ["service"],
                [svc],
                ss.vllm.malformed_lines,
            )
            f.add(
                "vllm_scrape_engines_dropped",
                "Engines of the last vLLM /metrics body past the parser's cap, not read.",
                ["service"],
                [svc],
                ss.vllm.engines_dropped,
            )
            f.add(
                "vllm_scrape_rejected_values",
                "Values of the last scrape rejected as impossible (NaN, negative, ratio > 1).",
                ["service"],
                [svc],
                ss.vllm.rejected_values,
            )
        if ss is not None and ss.unit is not None:
            u = ss.unit
            f.add(
                "unit_info",
                "The service's systemd unit and its state, always 1.",
                ["service", "unit", "active_state", "sub_state"],
                [svc, u.unit or "", u.active_state or "", u.sub_state or ""],
                1.0,
            )
            f.add(
                "unit_restarts",
                "systemd's NRestarts for the unit.",
                ["service"],
                [svc],
                u.n_restarts,
            )
            f.add("unit_main_pid", "The service's main process id.", ["service"], [svc], u.main_pid)
        if ss is not None and ss.gate is not None:
            _gate_gauges(f, svc, ss.gate)
    yield from f
    if any(s.log_events for s in signals.services):
        logs = CounterMetricFamily(
            f"{NS}_log_events",
            "vLLM log lines matching a memory-failure or engine-death signature, by kind.",
            labels=["service", "kind"],
        )
        for sig in signals.services:
            for kind, count in sig.log_events:
                logs.add_metric([sig.service, kind.value], count)
        yield logs


def _gate_gauges(f: _Families, svc: str, g: GateObservation) -> None:
    """The gate as the guardian reads it (its GET /gate/status). Named apart from the gate's own
    ``vllm_guardian_gate_in_flight``/``_queue_depth`` (job vllm-gate) so a sum never counts both."""
    f.add(
        "gate_up",
        "1 when the service's admission gate answered its status this tick, 0 when not.",
        ["service"],
        [svc],
        _bool(g.reachable),
    )
    f.add(
        "gate_reported_in_flight",
        "Requests the gate has admitted to vLLM and not finished, as it reported them.",
        ["service"],
        [svc],
        g.in_flight,
    )
    f.add(
        "gate_reported_queued",
        "Requests the gate holds in its queue, as it reported them.",
        ["service"],
        [svc],
        g.queued,
    )


def _service_gauges(f: _Families, sig: ServiceSignals) -> None:
    svc = sig.service
    for name, attr, doc in _SERVICE_GAUGES:
        f.add(name, doc, ["service"], [svc], getattr(sig, attr))
    for lq in sig.latency:
        f.add(
            "request_latency_seconds",
            # Not a summary, so the label is `percentile` ("50", "99"): promtool reserves `quantile`.
            "Latency percentiles from vLLM's histograms over the quantile window (ttft, e2e, queue).",
            ["service", "metric", "percentile"],
            [svc, lq.metric, f"{100 * lq.quantile:g}"],
            lq.seconds,
        )
    for e in sig.engines:
        labels = ["service", "model_name", "engine"]
        values = [svc, e.model_name, e.engine]
        f.add(
            "engine_kv_cache_usage_ratio",
            "KV pool usage per engine.",
            labels,
            values,
            e.kv_cache_usage_ratio,
        )
        f.add(
            "engine_requests_waiting",
            "Waiting requests per engine.",
            labels,
            values,
            e.requests_waiting,
        )
        f.add(
            "engine_requests_running",
            "Running requests per engine.",
            labels,
            values,
            e.requests_running,
        )
        f.add(
            "engine_preemptions_per_second",
            "Preemptions per second per engine.",
            labels,
            values,
            e.preemptions_per_second,
        )
    for g in sig.gpus:
        f.add(
            "service_gpu_memory_bytes",
            "GPU memory held by the service's processes on this GPU.",
            ["service", "gpu"],
            [svc, str(g.gpu)],
            g.service_memory_bytes,
        )
        f.add(
            "other_gpu_memory_bytes",
            "GPU memory held by processes that are not the service's, on the service's GPU.",
            ["service", "gpu"],
            [svc, str(g.gpu)],
            g.other_memory_bytes,
        )
    for fc in sig.forecasts:
        # Absent when there is no significant trend (core/forecast.py): never a sentinel.
        f.add(
            "headroom_exhaustion_seconds",
            "Forecast seconds until this GPU's free-memory floor reaches zero (Theil-Sen trend).",
            ["service", "gpu"],
            [svc, str(fc.gpu)],
            fc.seconds,
        )
        f.add(
            "headroom_exhaustion_latest_seconds",
            "The forecast's confidence bound: the latest the free memory is expected to run out.",
            ["service", "gpu"],
            [svc, str(fc.gpu)],
            fc.seconds_latest,
        )
        f.add(
            "headroom_exhaustion_cause",
            "1 for the cause the exhaustion forecast names (none: it alerts only).",
            ["service", "gpu", "cause"],
            [svc, str(fc.gpu), fc.cause.value if fc.cause else "none"],
            1.0,
        )
        if fc.neighbour is not None:
            n = fc.neighbour
            f.add(
                "headroom_exhaustion_neighbour_info",
                "The other process whose growth the forecast blames (empty: not known).",
                ["service", "gpu", "pid", "command", "cgroup"],
                [svc, str(fc.gpu), str(n.pid), n.name or "", n.cgroup or ""],
                1.0,
            )


_ALLOCATOR_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("allocator_reserved_bytes", "reserved_bytes", "Memory torch's caching allocator reserved."),
    ("allocator_allocated_bytes", "allocated_bytes", "Memory torch handed out to tensors."),
    (
        "allocator_unallocated_bytes",
        "unallocated_bytes",
        "Reserved minus allocated: cached by torch, not in use.",
    ),
    (
        "allocator_inactive_split_bytes",
        "inactive_split_bytes",
        "Free fragments of split blocks: reserved, unusable for larger blocks, not releasable.",
    ),
    (
        "allocator_fragmentation_ratio",
        "fragmentation_ratio",
        "Inactive-split bytes over reserved bytes (0..1).",
    ),
    (
        "allocator_retries_per_second",
        "retries_per_second",
        "cudaMalloc retries after flushing the cache, per second over the rate window.",
    ),
    (
        "allocator_recent_ooms",
        "recent_ooms",
        "Allocator out-of-memory errors within the rate window.",
    ),
    ("allocator_processes", "processes", "vLLM processes publishing allocator stats."),
)


def _allocator_families(signals: Signals) -> Iterator[Metric]:
    """torch's allocator per service and GPU, from the in-vLLM plugin (absent without it)."""
    f = _Families()
    retries = CounterMetricFamily(
        f"{NS}_allocator_alloc_retries",
        "cudaMalloc retries of the current processes (resets when vLLM restarts).",
        labels=["service", "gpu"],
    )
    ooms = CounterMetricFamily(
        f"{NS}_allocator_ooms",
        "Allocator out-of-memory errors of the current processes (resets when vLLM restarts).",
        labels=["service", "gpu"],
    )
    for sig in signals.services:
        for a in sig.allocator:
            values = [sig.service, str(a.gpu)]
            for name, attr, doc in _ALLOCATOR_GAUGES:
                f.add(name, doc, ["service", "gpu"], values, getattr(a, attr))
            retries.add_metric(values, a.alloc_retries)
            ooms.add_metric(values, a.ooms)
    yield from f
    if retries.samples:
        yield retries
        yield ooms


def _gpu_families(snap: Snapshot, xids: dict[tuple[int, int], int]) -> Iterator[Metric]:
    f = _Families()
    if snap.gpus is not None:
        for d in snap.gpus.devices:
            g = [str(d.index)]
            f.add(
                "gpu_info",
                "The GPU's identity, always 1.",
                ["gpu", "uuid", "name"],
                [str(d.index), d.uuid or "", d.name or ""],
                1.0,
            )
            f.add(
                "gpu_up",
                "1 when the GPU answered NVML queries, 0 when not (e.g. lost).",
                ["gpu"],
                g,
                _bool(d.error is None),
            )
            f.add("gpu_memory_total_bytes", "Total GPU memory.", ["gpu"], g, d.memory_total_bytes)
            f.add(
                "gpu_memory_used_bytes",
                "Used GPU memory, all processes.",
                ["gpu"],
                g,
                d.memory_used_bytes,
            )
            f.add("gpu_memory_free_bytes", "Free GPU memory.", ["gpu"], g, d.memory_free_bytes)
            f.add(
                "gpu_utilization_ratio",
                "GPU compute utilization (0..1).",
                ["gpu"],
                g,
                d.utilization_ratio,
            )
            f.add("gpu_temperature_celsius", "GPU temperature.", ["gpu"], g, d.temperature_celsius)
            f.add("gpu_power_watts", "GPU power draw.", ["gpu"], g, d.power_watts)
            f.add(
                "gpu_processes",
                "Processes holding memory on the GPU.",
                ["gpu"],
                g,
                None if d.processes is None else len(d.processes),
            )
            f.add(
                "gpu_remapped_rows_pending",
                "1 when row remapping is pending (needs a GPU reset).",
                ["gpu"],
                g,
                _bool(d.remapped_rows_pending),
            )
            f.add(
                "gpu_remapped_rows_failed",
                "1 when a row remapping failed (hardware fault).",
                ["gpu"],
                g,
                _bool(d.remapped_rows_failed),
            )
            f.add(
                "gpu_retired_pages_pending",
                "1 when retired pages await a reset.",
                ["gpu"],
                g,
                _bool(d.retired_pages_pending),
            )
    yield from f
    xid = CounterMetricFamily(
        f"{NS}_gpu_xid_events",
        "XID errors reported by the driver since the guardian started.",
        labels=["gpu", "xid"],
    )
    for (gpu, code), n in sorted(xids.items()):
        xid.add_metric([str(gpu), str(code)], n)
    yield xid


def _healing_families(view: HealingView, now: float) -> Iterator[Metric]:
    alert = GaugeMetricFamily(
        f"{NS}_alert",
        "1 for each pending or firing guardian alert, like Prometheus's ALERTS.",
        labels=["service", "alertname", "severity", "alertstate"],
    )
    stale = GaugeMetricFamily(
        f"{NS}_alert_stale",
        "1 when an alert's signal is missing and its state is held.",
        labels=["service", "alertname"],
    )
    inhibited = GaugeMetricFamily(
        f"{NS}_alert_inhibited",
        "1 for each pending or firing guardian alert whose notifications are held: vLLM is down "
        "because of the guardian's own restart or first start (inhibited_by says which).",
        labels=["service", "alertname", "severity", "alertstate", "inhibited_by"],
    )
    for a in view.alerts:
        if a.state is AlertState.INACTIVE:
            continue
        alert.add_metric([a.service or "", a.name, a.severity.value, a.state.value], 1.0)
        if a.stale:
            stale.add_metric([a.service or "", a.name], 1.0)
        if a.inhibited_by is not None:
            inhibited.add_metric(
                [a.service or "", a.name, a.severity.value, a.state.value, a.inhibited_by], 1.0
            )
    yield alert
    yield stale
    yield inhibited
    in_progress = GaugeMetricFamily(
        f"{NS}_action_in_progress",
        "1 for the restart or relaunch under way, with its kind and current phase.",
        labels=["service", "action", "phase"],
    )
    for s in view.state.services:
        if s.action is not None:
            in_progress.add_metric([s.service, s.action.kind.value, s.action.phase.value], 1.0)
    yield in_progress
    planned = {w.service for w in view.windows if w.planned}
    expected = GaugeMetricFamily(
        f"{NS}_vllm_down_expected",
        "1 while vLLM is down because of the guardian (its restart under way, within the "
        "phase's deadline, or the first start it made) and was serving or starting when that "
        "began: the vLLM-down alerts are inhibited. The shipped Prometheus rules use it.",
        labels=["service"],
    )
    for s in view.state.services:
        expected.add_metric([s.service], 1.0 if s.service in planned else 0.0)
    yield expected
    f = _Families()
    p = view.state
    for s in p.services:
        svc = [s.service]
        f.add(
            "breaker_latched",
            "1 when the circuit breaker is latched (needs `vllm-guardian resume`).",
            ["service"],
            svc,
            _bool(s.breaker_latched),
        )
        f.add(
            "paused",
            "1 while an operator has paused the guardian for this service.",
            ["service"],
            svc,
            _bool(s.paused),
        )
        f.add(
            "action_in_flight",
            "1 while a restart or relaunch is running.",
            ["service"],
            svc,
            _bool(s.in_flight is not None),
        )
        recent = [t for t in s.restarts if now - t < view.budget_window_seconds]
        f.add(
            "restart_budget_remaining",
            "Guardian restarts left in the budget window.",
            ["service"],
            svc,
            max(0, view.budget - len(recent)),
        )
        f.add(
            "dry_run",
            "1 when the guardian decides but does not act (policy.dry_run).",
            ["service"],
            svc,
            _bool(view.dry_run),
        )
        for lever, rung in s.rungs:
            f.add(
                "policy_rung",
                "How many rungs below the operator's baseline a lever is.",
                ["service", "lever"],
                [s.service, lever.value],
                rung,
            )
        cooldown = max(0.0, s.cooldown_until - now)
        f.add(
            "cooldown_remaining_seconds",
            "Seconds until the guardian may act again.",
            ["service"],
            svc,
            cooldown,
        )
    yield from f
    actions = CounterMetricFamily(
        f"{NS}_actions",
        "Actions finished, by kind and result (dry-run ones included, marked).",
        labels=["service", "action", "result", "dry_run"],
    )
    for (service, action, result, dry), n in view.actions_total:
        actions.add_metric([service, action, result, "true" if dry else "false"], n)
    yield actions


def make_registry(collector: GuardianCollector, process_metrics: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


class ExpositionServer:
    """/metrics, /healthz and /ready/<service> over a :class:`BoundedHTTPServer`."""

    def __init__(
        self,
        collector: GuardianCollector,
        host: str,
        port: int,
        stale_after_seconds: float,
        monotonic: Any,
        limits: Limits | None = None,
    ) -> None:
        self.collector = collector
        self.registry = make_registry(collector)
        self._stale_after = stale_after_seconds
        self._monotonic = monotonic
        self.http = BoundedHTTPServer(
            host,
            port,
            self.respond,
            limits or Limits(),
            server_version=f"vllm-guardian/{__version__}",
        )
        self.registry.register(_ListenerCollector(self.http))

    @property
    def address(self) -> tuple[str, int]:
        return self.http.address

    def start(self) -> None:
        self.http.start()

    def stop(self) -> None:
        self.http.stop()

    def healthz(self) -> tuple[int, str]:
        last = self.collector.last_tick_monotonic()
        if last is None:
            return 503, "starting: no tick completed yet\n"
        age = self._monotonic() - last
        if age > self._stale_after:
            return 503, f"stale: last tick {age:.1f}s ago\n"
        return 200, f"ok: last tick {age:.1f}s ago\n"

    def respond(self, method: str, target: str) -> tuple[int, bytes, str]:
        path = target.split("?", 1)[0]
        if path in ("/metrics", "/metrics/"):
            return 200, generate_latest(self.registry), CONTENT_TYPE_LATEST
        if path == "/healthz":
            code, text = self.healthz()
            return code, text.encode(), "text/plain; charset=utf-8"
        if path.startswith("/ready/"):
            name = path[len("/ready/") :]
            gate = self.collector.gate(name)
            if gate is None:
                return 404, json.dumps({"error": f"unknown service {name!r}"}).encode(), JSON
            if self.collector.last_tick_monotonic() is None:
                # Nothing observed yet: not ready (a pod's readiness probe must not pass
                # before the guardian has seen vLLM serve).
                body = json.dumps(
                    {"service": name, "ready": False, "reason": "starting: no tick yet"}
                )
                return 503, body.encode(), JSON
            body = json.dumps({"service": name, "ready": gate.ready, "reason": gate.reason})
            return (200 if gate.ready else 503), body.encode(), JSON
        if path == "/":
            links = b"<html><body><a href='/metrics'>/metrics</a> <a href='/healthz'>/healthz</a></body></html>"
            return 200, links, "text/html"
        return 404, b"not found\n", "text/plain"


JSON = "application/json"


class _ListenerCollector:
    """What the endpoint's own defences did (boundedhttp): open connections, and the ones it
    closed itself, by reason."""

    def __init__(self, http: BoundedHTTPServer) -> None:
        self._http = http

    def collect(self) -> Iterator[Metric]:
        h = self._http
        open_now = GaugeMetricFamily(
            f"{NS}_http_connections", "Connections open on the guardian's HTTP endpoint."
        )
        open_now.add_metric([], h.open_connections())
        yield open_now
        closed = CounterMetricFamily(
            f"{NS}_http_connections_closed",
            "Connections the endpoint closed itself: a request head not sent in time or an "
            "exchange past its deadline (timeout), closed to make room at the cap (evicted), "
            "refused with every slot answering (over_cap).",
            labels=["reason"],
        )
        closed.add_metric(["timeout"], h.timed_out_total)
        closed.add_metric(["evicted"], h.evicted_total)
        closed.add_metric(["over_cap"], h.refused_total)
        yield closed
        errors = CounterMetricFamily(
            f"{NS}_http_accept_errors", "accept() failures on the endpoint (EMFILE …)."
        )
        errors.add_metric([], h.accept_errors_total)
        yield errors
