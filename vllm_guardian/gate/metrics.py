"""The gate's own ``vllm_guardian_gate_*`` series, in a private registry (no global state).

Served on the gate's ``/metrics`` (``--metrics-path`` moves it where vLLM's own ``/metrics``
should pass through instead). Every series carries the ``service`` label the gate was started
with, so one Prometheus job can scrape several gates beside the guardian's series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from vllm_guardian.gate.continuation import Cut, Failure, Outcome, Refusal
from vllm_guardian.gate.looplag import LAG_BUCKETS

NS = "vllm_guardian_gate"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Queue waits span milliseconds (a release-rate slot) to minutes (a restart).
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The gate's own time per request: tens of microseconds when all is well.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
# Every (outcome, reason) the gate can count, present from the start.
CONTINUATION_LABELS = (
    [
        (o.value, c.value)
        for o in (Outcome.CONTINUED, Outcome.FALLBACK, Outcome.COMPLETED)
        for c in Cut
    ]
    + [(Outcome.REFUSED.value, r.value) for r in Refusal]
    + [(Outcome.FAILED.value, f.value) for f in Failure]
)


class _ProcessCpu:
    """``vllm_guardian_gate_cpu_seconds_total``: this process's CPU clock, read at scrape."""

    def __init__(self, service: str, cpu_clock: Callable[[], float]) -> None:
        self._service, self._cpu = service, cpu_clock

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            f"{NS}_cpu_seconds",
            "CPU time this gate process used (user and system), summed over its workers. One "
            "gate process relays on one core: rate() over vllm_guardian_gate_processes is the "
            "share of its core each keeps busy, and at 1 its streams stall (docs/gate.md, "
            '"More than one core").',
            labels=["service"],
        )
        family.add_metric([self._service], self._cpu())
        yield family


class _Registry(CollectorRegistry):
    """A registry that also finds one collector by its metric's name: the status document
    reads seven counters every time it is asked, and collecting the whole registry for each
    (~270 samples) cost more than the rest of the status together."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.by_name: dict[str, Collector] = {}

    def register(self, collector: Collector) -> None:
        super().register(collector)
        # As the registry itself names them (auto_describe): describe(), else one collect().
        describe = getattr(collector, "describe", None)
        for family in describe() if describe is not None else collector.collect():
            self.by_name[family.name] = collector


class GateMetrics:
    def __init__(self, service: str, cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.registry = _Registry()
        r, s = self.registry, [service]
        self.registry.register(_ProcessCpu(service, cpu_clock))
        Gauge(
            f"{NS}_processes",
            "Gate processes serving the listen port: 1, or its workers (summed over them).",
            ["service"],
            registry=r,
        ).labels(*s).set(1)
        self._open = Gauge(
            f"{NS}_open",
            "1 while the gate admits new requests, 0 while it holds them.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.queue_depth = Gauge(
            f"{NS}_queue_depth", "Requests waiting in the gate's queue.", ["service"], registry=r
        ).labels(*s)
        self.queued_tokens = Gauge(
            f"{NS}_queued_tokens",
            "Estimated prompt tokens of the requests waiting in the queue.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.in_flight = Gauge(
            f"{NS}_in_flight",
            "Admitted requests not finished yet (forwarded or being retried).",
            ["service"],
            registry=r,
        ).labels(*s)
        self.kv_committed_tokens = Gauge(
            f"{NS}_kv_committed_tokens",
            "Estimated KV need (prompt + max output tokens) of the admitted requests in flight.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.kv_capacity_tokens = Gauge(
            f"{NS}_kv_capacity_tokens",
            "vLLM's KV pool size in tokens as the gate last read it (0: unknown).",
            ["service"],
            registry=r,
        ).labels(*s)
        self.wait_seconds = Histogram(
            f"{NS}_wait_seconds",
            "Time a held request spent in the queue (admitted or not).",
            ["service"],
            buckets=WAIT_BUCKETS,
            registry=r,
        ).labels(*s)
        self.overhead_seconds = Histogram(
            f"{NS}_overhead_seconds",
            "The gate's own time per request, queue wait and upstream time excluded.",
            ["service"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        ).labels(*s)
        self.loop_lag_seconds = Histogram(
            f"{NS}_loop_lag_seconds",
            "How much later than asked the gate's event loop woke (every 0.1 s): while it is "
            "late, the gate answers nothing (gate/looplag.py).",
            ["service"],
            buckets=LAG_BUCKETS,
            registry=r,
        ).labels(*s)
        self.arrived = Counter(
            f"{NS}_arrived",
            "Requests that cost vLLM work (POSTs) received from clients, each counted once as it "
            "arrives, before any hold or refusal: the demand at the front door.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.admitted = Counter(
            f"{NS}_admitted", "Requests admitted to the upstream.", ["service"], registry=r
        ).labels(*s)
        self.held = Counter(
            f"{NS}_held",
            "Requests that had to wait in the queue (the gate was closed or busy).",
            ["service"],
            registry=r,
        ).labels(*s)
        self._rejected = Counter(
            f"{NS}_rejected",
            "Requests answered by the gate itself (503, 429, 413, 408 or 400), by reason.",
            ["service", "reason"],
            registry=r,
        )
        self.retried = Counter(
            f"{NS}_retried",
            "Requests sent again after the upstream failed before sending a byte.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.upstream_errors = Counter(
            f"{NS}_upstream_errors",
            "Exchanges the upstream broke (refused, reset, cut mid-stream, or answered 200 with "
            "finish_reason abort before a byte reached the client: aborted), by phase.",
            ["service", "phase"],
            registry=r,
        )
        self.stale_connections = Counter(
            f"{NS}_upstream_stale_connections",
            "Requests sent again on a new connection because vLLM closed the kept connection "
            "they went out on before answering (its keep-alive timer raced them): not a failure.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.connect_timeouts = Counter(
            f"{NS}_upstream_connect_timeouts",
            "Connects to vLLM that timed out (its listen queue full: a busy server accepts "
            "late): the request waited its turn again, first in line, and the gate stayed open. "
            "Not counted as an upstream error.",
            ["service"],
            registry=r,
        ).labels(*s)
        self.client_disconnects = Counter(
            f"{NS}_client_disconnects",
            "Clients that went away before their answer was complete, by phase.",
            ["service", "phase"],
            registry=r,
        )
        self.body_bytes = Gauge(
            f"{NS}_body_bytes",
            "Bytes of request bodies the gate holds now (being read, queued or being sent), "
            "within its body budget.",
            ["service"],
            registry=r,
        ).labels(*s)
        self._continuations = Counter(
            f"{NS}_continuations",
            "Streamed completions and chat completions the upstream cut, by what the gate did "
            "(outcome: continued, fallback (continued on the fallback replica), completed, "
            "refused, failed) and why (reason).",
            ["service", "outcome", "reason"],
            registry=r,
        )
        self._fallbacks = Counter(
            f"{NS}_fallbacks",
            "Held completions and chat completions offered to the fallback replica (its "
            "fallback_url) after fallback_after_seconds, by result: sent (it answered, not "
            "5xx) or refused (refused, broken or 5xx: the request waited on for this server). "
            'Continuations it took: continuations_total{outcome="fallback"}.',
            ["service", "result"],
            registry=r,
        )
        self.connections = Gauge(
            f"{NS}_connections", "Client connections open now.", ["service"], registry=r
        ).labels(*s)
        self._connections_closed = Counter(
            f"{NS}_connections_closed",
            "Client connections the gate closed itself: idle past the deadline (idle_timeout), "
            "its client reading nothing of its answer as long (send_timeout), closed to make "
            "room at the cap (evicted), or refused with every slot busy (over_cap).",
            ["service", "reason"],
            registry=r,
        )
        self._malformed = Counter(
            f"{NS}_malformed_requests",
            "Requests the gate could not parse and answered 400 itself, by where the fault was: "
            "the request head (llhttp refused it, or it was too long), or the body's framing or "
            "coding (body).",
            ["service", "phase"],
            registry=r,
        )
        self._service = service
        for phase in ("head", "body"):
            self._malformed.labels(service, phase)
        for reason in ("idle_timeout", "send_timeout", "evicted", "over_cap"):
            self._connections_closed.labels(service, reason)
        # Every known label value from the start, so rate() sees a 0 before the first event.
        for reason in ("queue_full", "queued_tokens_full", "per_key_limit", "wait_timeout",
                       "too_large", "too_deep", "shutdown", "body_timeout", "body_too_slow",
                       "body_budget"):  # fmt: skip
            self._rejected.labels(service, reason)
        for phase in ("connect", "before_first_byte", "aborted", "streaming"):
            self.upstream_errors.labels(service, phase)
        for phase in ("queued", "streaming"):
            self.client_disconnects.labels(service, phase)
        for outcome, reason in CONTINUATION_LABELS:
            self._continuations.labels(service, outcome, reason)
        for result in ("sent", "refused"):
            self._fallbacks.labels(service, result)

    class _Bound:
        def __init__(self, family: Counter, service: str) -> None:
            self._family, self._service = family, service

        def labels(self, value: str) -> Counter:
            return self._family.labels(self._service, value)

    @property
    def rejected(self) -> GateMetrics._Bound:
        return GateMetrics._Bound(self._rejected, self._service)

    def upstream_error(self, phase: str) -> None:
        self.upstream_errors.labels(self._service, phase).inc()

    def client_disconnect(self, phase: str) -> None:
        self.client_disconnects.labels(self._service, phase).inc()

    def malformed(self, phase: str) -> None:
        self._malformed.labels(self._service, phase).inc()

    def continuation(self, outcome: str, reason: str) -> None:
        self._continuations.labels(self._service, outcome, reason).inc()

    def fallback(self, result: str) -> None:
        self._fallbacks.labels(self._service, result).inc()

    def connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(self._service, reason).inc()

    def set_open(self, open_: bool) -> None:
        self._open.set(1.0 if open_ else 0.0)

    def total(self, name: str) -> int:
        """A counter's value summed over its labels, e.g. ``total("held")``."""
        value = 0.0
        for family in self._collect(f"{NS}_{name}"):
            value += sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("service") == self._service
            )
        return int(value)

    def continuations(self, outcome: str) -> int:
        """``continuations_total`` for one outcome, summed over its reasons."""
        value = 0.0
        for family in self._collect(f"{NS}_continuations"):
            value += sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total")
                and s.labels.get("service") == self._service
                and s.labels.get("outcome") == outcome
            )
        return int(value)

    def _collect(self, name: str) -> Iterable[Metric]:
        """The families of the collector named ``name`` (none when there is no such one)."""
        collector = self.registry.by_name.get(name)
        return () if collector is None else collector.collect()

    def render(self) -> bytes:
        return generate_latest(self.registry)
