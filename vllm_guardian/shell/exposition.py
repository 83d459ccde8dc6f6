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

import math
import platform
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vllm_guardian import __version__
from vllm_guardian.core.signals import ServiceSignals, Signals
from vllm_guardian.formats import metric_catalogue as catalogue
from vllm_guardian.formats import ready_format
from vllm_guardian.lowio.boundedhttp import BoundedHTTPServer, Limits
from vllm_guardian.model import AlertState, GateObservation, GateState, HealthState, Snapshot
from vllm_guardian.shell.healing import HealingView


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
        ticks_total = catalogue.counter("ticks")
        ticks_total.add_metric([], ticks)
        yield ticks_total
        ready = catalogue.gauge("ready")
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
    info = catalogue.gauge("build_info")
    info.add_metric([__version__, platform.python_version()], 1.0)
    yield info


def _tick_families(pub: Published) -> Iterator[Metric]:
    dur = catalogue.gauge("tick_duration_seconds")
    dur.add_metric([], pub.tick_duration_seconds)
    yield dur
    ts = catalogue.gauge("last_tick_timestamp_seconds")
    ts.add_metric([], pub.snapshot.time_seconds)
    yield ts


def _source_families(snap: Snapshot) -> Iterator[Metric]:
    up = catalogue.gauge("source_up")
    dur = catalogue.gauge("source_duration_seconds")
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

    def add(self, name: str, values: Sequence[str], value: float | None) -> None:
        """One sample of the catalogue's gauge ``name`` (its help and labels are there)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return  # missing stays absent: never a zero that means "unknown"
        fam = self._fams.get(name)
        if fam is None:
            fam = self._fams[name] = catalogue.gauge(name)
        fam.add_metric(list(values), float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(list(self._fams.values()))


_SERVICE_GAUGES: tuple[tuple[str, str], ...] = (  # (metric, the signal's field)
    ("kv_cache_usage_ratio", "kv_cache_usage_ratio"),
    ("requests_waiting", "requests_waiting"),
    ("requests_running", "requests_running"),
    ("requests_swapped", "requests_swapped"),
    ("preemptions_per_second", "preemptions_per_second"),
    ("prompt_tokens_per_second", "prompt_tokens_per_second"),
    ("generation_tokens_per_second", "generation_tokens_per_second"),
    ("request_failures_per_second", "request_failures_per_second"),
    ("admission_rejections_per_second", "admission_rejections_per_second"),
    ("prefix_cache_hit_ratio", "prefix_cache_hit_ratio"),
    ("engine_stall_seconds", "stall_seconds"),
    ("kv_cache_capacity_tokens", "kv_cache_capacity_tokens"),
    ("vllm_gpu_memory_utilization_ratio", "gpu_memory_utilization_ratio"),
    ("memory_budget_bytes", "memory_budget_bytes"),
    ("service_memory_bytes", "service_memory_bytes"),
    ("memory_over_budget_bytes", "memory_over_budget_bytes"),
    ("other_processes_memory_bytes", "other_processes_memory_bytes"),
    ("gpu_headroom_bytes", "headroom_bytes"),
    ("gpu_headroom_slope_bytes_per_second", "headroom_slope_bytes_per_second"),
    ("capacity_demand_ratio", "capacity_demand_ratio"),
    ("capacity_replicas_needed", "capacity_replicas_needed"),
)


def _bool(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


def _service_families(snap: Snapshot, signals: Signals) -> Iterator[Metric]:
    f = _Families()
    for sig in signals.services:
        svc = sig.service
        ss = snap.service(svc)
        f.add("vllm_health", [svc], _bool(sig.vllm_up))
        if ss is not None and ss.health is not None:
            f.add("vllm_health_latency_seconds", [svc], ss.health.latency_seconds)
            for state in HealthState:
                f.add(
                    "vllm_health_state",
                    [svc, state.value],
                    1.0 if ss.health.state is state else 0.0,
                )
            if ss.health.deep is not None:
                f.add("vllm_deep_probe_ok", [svc], _bool(ss.health.deep.ok))
        f.add("vllm_stats_enabled", [svc], _bool(sig.stats_enabled))
        _service_gauges(f, sig)
        if ss is not None and ss.vllm is not None:
            f.add("vllm_scrape_bytes", [svc], ss.vllm.body_bytes)
            f.add("vllm_scrape_malformed_lines", [svc], ss.vllm.malformed_lines)
            f.add("vllm_scrape_engines_dropped", [svc], ss.vllm.engines_dropped)
            f.add("vllm_scrape_rejected_values", [svc], ss.vllm.rejected_values)
        if ss is not None and ss.unit is not None:
            u = ss.unit
            f.add("unit_info", [svc, u.unit or "", u.active_state or "", u.sub_state or ""], 1.0)
            f.add("unit_restarts", [svc], u.n_restarts)
            f.add("unit_main_pid", [svc], u.main_pid)
        if ss is not None and ss.gate is not None:
            _gate_gauges(f, svc, ss.gate)
    yield from f
    if any(s.log_events for s in signals.services):
        logs = catalogue.counter("log_events")
        for sig in signals.services:
            for kind, count in sig.log_events:
                logs.add_metric([sig.service, kind.value], count)
        yield logs


def _gate_gauges(f: _Families, svc: str, g: GateObservation) -> None:
    """The gate as the guardian reads it (its GET /gate/status). Named apart from the gate's own
    ``vllm_guardian_gate_in_flight``/``_queue_depth`` (job vllm-gate) so a sum never counts both."""
    f.add("gate_up", [svc], _bool(g.reachable))
    f.add("gate_reported_in_flight", [svc], g.in_flight)
    f.add("gate_reported_queued", [svc], g.queued)


def _service_gauges(f: _Families, sig: ServiceSignals) -> None:
    svc = sig.service
    for name, attr in _SERVICE_GAUGES:
        f.add(name, [svc], getattr(sig, attr))
    for lq in sig.latency:
        f.add("request_latency_seconds", [svc, lq.metric, f"{100 * lq.quantile:g}"], lq.seconds)
    for e in sig.engines:
        values = [svc, e.model_name, e.engine]
        f.add("engine_kv_cache_usage_ratio", values, e.kv_cache_usage_ratio)
        f.add("engine_requests_waiting", values, e.requests_waiting)
        f.add("engine_requests_running", values, e.requests_running)
        f.add("engine_preemptions_per_second", values, e.preemptions_per_second)
    for g in sig.gpus:
        f.add("service_gpu_memory_bytes", [svc, str(g.gpu)], g.service_memory_bytes)
        f.add("other_gpu_memory_bytes", [svc, str(g.gpu)], g.other_memory_bytes)
    for fc in sig.forecasts:
        # Absent when there is no significant trend (core/forecast.py): never a sentinel.
        f.add("headroom_exhaustion_seconds", [svc, str(fc.gpu)], fc.seconds)
        f.add("headroom_exhaustion_latest_seconds", [svc, str(fc.gpu)], fc.seconds_latest)
        f.add(
            "headroom_exhaustion_cause",
            [svc, str(fc.gpu), fc.cause.value if fc.cause else "none"],
            1.0,
        )
        if fc.neighbour is not None:
            n = fc.neighbour
            f.add(
                "headroom_exhaustion_neighbour_info",
                [svc, str(fc.gpu), str(n.pid), n.name or "", n.cgroup or ""],
                1.0,
            )


_ALLOCATOR_GAUGES: tuple[tuple[str, str], ...] = (  # (metric, the signal's field)
    ("allocator_reserved_bytes", "reserved_bytes"),
    ("allocator_allocated_bytes", "allocated_bytes"),
    ("allocator_unallocated_bytes", "unallocated_bytes"),
    ("allocator_inactive_split_bytes", "inactive_split_bytes"),
    ("allocator_fragmentation_ratio", "fragmentation_ratio"),
    ("allocator_retries_per_second", "retries_per_second"),
    ("allocator_recent_ooms", "recent_ooms"),
    ("allocator_processes", "processes"),
)


def _allocator_families(signals: Signals) -> Iterator[Metric]:
    """torch's allocator per service and GPU, from the in-vLLM plugin (absent without it)."""
    f = _Families()
    retries = catalogue.counter("allocator_alloc_retries")
    ooms = catalogue.counter("allocator_ooms")
    for sig in signals.services:
        for a in sig.allocator:
            values = [sig.service, str(a.gpu)]
            for name, attr in _ALLOCATOR_GAUGES:
                f.add(name, values, getattr(a, attr))
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
            f.add("gpu_info", [str(d.index), d.uuid or "", d.name or ""], 1.0)
            f.add("gpu_up", g, _bool(d.error is None))
            f.add("gpu_memory_total_bytes", g, d.memory_total_bytes)
            f.add("gpu_memory_used_bytes", g, d.memory_used_bytes)
            f.add("gpu_memory_free_bytes", g, d.memory_free_bytes)
            f.add("gpu_utilization_ratio", g, d.utilization_ratio)
            f.add("gpu_temperature_celsius", g, d.temperature_celsius)
            f.add("gpu_power_watts", g, d.power_watts)
            f.add("gpu_processes", g, None if d.processes is None else len(d.processes))
            f.add("gpu_remapped_rows_pending", g, _bool(d.remapped_rows_pending))
            f.add("gpu_remapped_rows_failed", g, _bool(d.remapped_rows_failed))
            f.add("gpu_retired_pages_pending", g, _bool(d.retired_pages_pending))
    yield from f
    xid = catalogue.counter("gpu_xid_events")
    for (gpu, code), n in sorted(xids.items()):
        xid.add_metric([str(gpu), str(code)], n)
    yield xid


def _healing_families(view: HealingView, now: float) -> Iterator[Metric]:
    alert = catalogue.gauge("alert")
    stale = catalogue.gauge("alert_stale")
    inhibited = catalogue.gauge("alert_inhibited")
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
    in_progress = catalogue.gauge("action_in_progress")
    for s in view.state.services:
        if s.action is not None:
            in_progress.add_metric([s.service, s.action.kind.value, s.action.phase.value], 1.0)
    yield in_progress
    planned = {w.service for w in view.windows if w.planned}
    expected = catalogue.gauge("vllm_down_expected")
    for s in view.state.services:
        expected.add_metric([s.service], 1.0 if s.service in planned else 0.0)
    yield expected
    f = _Families()
    p = view.state
    for s in p.services:
        svc = [s.service]
        f.add("breaker_latched", svc, _bool(s.breaker_latched))
        f.add("paused", svc, _bool(s.paused))
        f.add("action_in_flight", svc, _bool(s.in_flight is not None))
        recent = [t for t in s.restarts if now - t < view.budget_window_seconds]
        f.add("restart_budget_remaining", svc, max(0, view.budget - len(recent)))
        f.add("dry_run", svc, _bool(view.dry_run))
        for lever, rung in s.levels.rungs:
            f.add("policy_rung", [s.service, lever.value], rung)
        cooldown = max(0.0, s.hold_off.cooldown_until - now)
        f.add("cooldown_remaining_seconds", svc, cooldown)
    yield from f
    actions = catalogue.counter("actions")
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
                return 404, ready_format.encode_unknown(name), ready_format.CONTENT_TYPE
            if self.collector.last_tick_monotonic() is None:
                # Nothing observed yet: not ready (a pod's readiness probe must not pass
                # before the guardian has seen vLLM serve).
                answer = ready_format.ReadyAnswer(name, False, "starting: no tick yet")
            else:
                answer = ready_format.ReadyAnswer(
                    name, gate.ready, gate.reason, gate.restart_in_progress
                )
            return answer.status, ready_format.encode(answer), ready_format.CONTENT_TYPE
        if path == "/":
            links = b"<html><body><a href='/metrics'>/metrics</a> <a href='/healthz'>/healthz</a></body></html>"
            return 200, links, "text/html"
        return 404, b"not found\n", "text/plain"


class _ListenerCollector:
    """What the endpoint's own defences did (boundedhttp): open connections, and the ones it
    closed itself, by reason."""

    def __init__(self, http: BoundedHTTPServer) -> None:
        self._http = http

    def collect(self) -> Iterator[Metric]:
        h = self._http
        open_now = catalogue.gauge("http_connections")
        open_now.add_metric([], h.open_connections())
        yield open_now
        closed = catalogue.counter("http_connections_closed")
        closed.add_metric(["timeout"], h.timed_out_total)
        closed.add_metric(["evicted"], h.evicted_total)
        closed.add_metric(["over_cap"], h.refused_total)
        yield closed
        errors = catalogue.counter("http_accept_errors")
        errors.add_metric([], h.accept_errors_total)
        yield errors
