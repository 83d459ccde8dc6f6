"""Source: vLLM's ``/metrics``, across vLLM versions, reduced to what the guardian uses.

Where it sits: first stage of the tick (collect). The collector GETs ``<url>/metrics`` with a
timeout and a body-size cap; :func:`parse_vllm_metrics` (pure) turns the body into a
:class:`VllmScrape` with one :class:`EngineMetrics` per ``(model_name, engine)``. Rates and
quantiles are *not* computed here: they need history, which the pure core keeps
(``core/signals.py``).

Version tolerance (reference: vllm-surface.md §1.5): KV usage is ``vllm:kv_cache_usage_perc``
(V1 ≥ 0.9.2) or ``vllm:gpu_cache_usage_perc`` (V0, V1 ≤ 0.11); prefix-cache counters exist in
three generations; ``vllm:num_requests_swapped`` only in V0; V0 has no ``engine`` label;
``vllm:cache_config_info`` changes its label set every release and is parsed dynamically.
"""

from __future__ import annotations

import itertools
import math
import typing
from dataclasses import dataclass, field, replace

from vllm_guardian import httpget, promtext
from vllm_guardian.config import ServiceConfig, VllmMetricsSourceConfig
from vllm_guardian.model import (
    CacheConfig,
    EngineMetrics,
    Histogram,
    Reading,
    SourceKind,
    VllmScrape,
)
from vllm_guardian.sources.base import failed

# Gauges and counters: exposed sample name → EngineMetrics field, in fallback order (the
# first name present wins for a field).
_SCALARS: dict[str, str] = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:num_requests_swapped": "requests_swapped",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hit_rate": "prefix_cache_hit_ratio",
}
_PRIORITY = {name: i for i, name in enumerate(_SCALARS)}
_HISTOGRAMS: dict[str, str] = {
    "vllm:time_to_first_token_seconds": "time_to_first_token",
    "vllm:e2e_request_latency_seconds": "e2e_request_latency",
    "vllm:request_queue_time_seconds": "request_queue_time",
}
_SUCCESS = "vllm:request_success_total"
_CACHE_INFO = "vllm:cache_config_info"
_START_TIME = "process_start_time_seconds"
# Must lie in [0, 1]. (V0 exports the hit-rate gauge as -1 with prefix caching off: that is
# rejected by the negative check, which reads as "unknown", as it should.)
_RATIOS = {"kv_cache_usage_ratio", "prefix_cache_hit_ratio"}

WANTED: frozenset[str] = frozenset(
    [*_SCALARS, _SUCCESS, _CACHE_INFO, _START_TIME]
    + [f"{h}{suffix}" for h in _HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
)


@dataclass
class _EngineAcc:
    model_name: str
    engine: str
    scalars: dict[str, tuple[int, float]] = field(default_factory=dict)  # field → (priority, v)
    finished: float = 0.0
    failed: float = 0.0
    saw_success: bool = False
    reasons: set[str | None] = field(default_factory=set)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    cache: CacheConfig | None = None


def _float_label(labels: dict[str, str], key: str) -> float | None:
    """A label holding a Python str() of a number; "None", empty, garbage and ±inf are None."""
    raw = labels.get(key)
    if raw is None or raw in ("None", ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = _float_label(labels, key)
    if value is None or value < 0 or value != int(value):
        return None
    return int(value)


def parse_cache_config(labels: dict[str, str]) -> CacheConfig:
    """``vllm:cache_config_info`` labels (all CacheConfig fields, stringified) → CacheConfig."""
    prefix = labels.get("enable_prefix_caching")
    return CacheConfig(
        num_gpu_blocks=_int_label(labels, "num_gpu_blocks"),
        block_size=_int_label(labels, "block_size"),
        gpu_memory_utilization_ratio=_float_label(labels, "gpu_memory_utilization"),
        kv_cache_memory_bytes=_int_label(labels, "kv_cache_memory_bytes"),
        kv_cache_size_tokens=_int_label(labels, "kv_cache_size_tokens"),
        enable_prefix_caching=None if prefix not in ("True", "False") else prefix == "True",
        labels=tuple(sorted((k, v) for k, v in labels.items() if k != "engine")),
    )


_KIND: dict[str, tuple[str, str]] = {
    **{name: ("scalar", target) for name, target in _SCALARS.items()},
    **{f"{base}_bucket": ("bucket", h) for base, h in _HISTOGRAMS.items()},
    **{f"{base}_sum": ("sum", h) for base, h in _HISTOGRAMS.items()},
    **{f"{base}_count": ("count", h) for base, h in _HISTOGRAMS.items()},
    _SUCCESS: ("success", ""),
    _CACHE_INFO: ("cache", ""),
    _START_TIME: ("start", ""),
}


_LabelInfo = tuple[str, str, float | None, str | None]  # model_name, engine, le, finished_reason


class VllmParser:
    """Parses vLLM expositions; keep one per server: it caches label sets between scrapes."""

    def __init__(self) -> None:
        self.text_parser = promtext.Parser(WANTED, ("vllm:",), annotate=_label_info)


def _label_info(labels: promtext.Labels) -> _LabelInfo:
    d = dict(labels)
    return (
        d.get("model_name", ""),
        d.get("engine", ""),
        _parse_le(d.get("le")),
        d.get("finished_reason"),
    )


def make_parser() -> VllmParser:
    return VllmParser()


# vLLM runs one engine per data-parallel rank; no deployment has hundreds behind one API
# server. Past this many, a body is read for the first ones only and the rest are counted
# (a hostile or broken /metrics with 16,000 engines cost 212 s before).
MAX_ENGINES = 256


def parse_vllm_metrics(
    text: str, body_bytes: int | None = None, parser: VllmParser | None = None
) -> VllmScrape:
    """Reduce a /metrics body to a VllmScrape. Pure: bad lines and values are counted."""
    result = (parser or VllmParser()).text_parser.parse(text)
    engines: dict[tuple[str, str], _EngineAcc] = {}
    dropped: set[tuple[str, str]] = set()  # engines past MAX_ENGINES
    duplicates = 0
    rejected = 0
    start_time: float | None = None
    cache_by_engine: dict[str, CacheConfig] = {}
    isfinite = math.isfinite
    for s in result.samples:
        kind, arg = _KIND[s.name]
        value = s.value
        if kind == "start":
            if start_time is not None:
                duplicates += 1
            elif isfinite(value) and value > 0:
                start_time = value
            else:
                rejected += 1
            continue
        if kind == "cache":
            # It carries every CacheConfig field and `engine`, but no model_name.
            labels = dict(s.labels)
            engine_label = labels.get("engine", "")
            if engine_label in cache_by_engine:
                duplicates += 1
            else:
                cache_by_engine[engine_label] = parse_cache_config(labels)
            continue
        if not isfinite(value) or value < 0:
            rejected += 1
            continue
        model_name, engine, le, reason = typing.cast(_LabelInfo, s.note)
        key = (model_name, engine)
        acc = engines.get(key)
        if acc is None:
            if len(engines) >= MAX_ENGINES:
                dropped.add(key)
                continue
            acc = engines[key] = _EngineAcc(model_name, engine)
        # Duplicate series (same name and labels twice) keep the first value and are counted.
        if kind == "bucket":
            if le is None:
                rejected += 1
                continue
            buckets = acc.buckets.setdefault(arg, {})
            if le in buckets:
                duplicates += 1
            else:
                buckets[le] = value
        elif kind == "scalar":
            if arg in _RATIOS and value > 1.0:
                rejected += 1
                continue
            prio = _PRIORITY[s.name]
            held = acc.scalars.get(arg)
            if held is not None and held[0] == prio:
                duplicates += 1
            elif held is None or prio < held[0]:
                acc.scalars[arg] = (prio, value)
        elif kind in ("sum", "count"):
            target = acc.sums if kind == "sum" else acc.counts
            if arg in target:
                duplicates += 1
            else:
                target[arg] = value
        else:  # success
            if reason in acc.reasons:
                duplicates += 1
                continue
            acc.reasons.add(reason)
            acc.saw_success = True
            acc.finished += value
            if reason in ("abort", "error"):
                acc.failed += value
    for acc in engines.values():
        acc.cache = cache_by_engine.get(acc.engine)
    out = tuple(_finish(acc) for acc in engines.values())
    return VllmScrape(
        engines=tuple(sorted(out, key=lambda e: (e.model_name, _engine_order(e.engine)))),
        stats_enabled="vllm:" in result.prefixes_seen,
        process_start_time_seconds=start_time,
        body_bytes=len(text.encode()) if body_bytes is None else body_bytes,
        malformed_lines=result.malformed_lines,
        rejected_values=rejected,
        duplicate_series=duplicates,
        engines_dropped=len(dropped),
    )


def _parse_le(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        le = float(raw)
    except ValueError:
        return None
    return None if math.isnan(le) else le


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


def _histogram(acc: _EngineAcc, name: str) -> Histogram | None:
    buckets = acc.buckets.get(name)
    if not buckets or math.inf not in buckets:
        return None
    ordered = tuple(sorted(buckets.items()))
    # Cumulative counts must not decrease with le; a body that says otherwise is corrupt.
    if any(b[1] < a[1] for a, b in itertools.pairwise(ordered)):
        return None
    return Histogram(ordered, acc.sums.get(name), acc.counts.get(name))


def _finish(acc: _EngineAcc) -> EngineMetrics:
    values = {k: v for k, (_, v) in acc.scalars.items()}
    em = EngineMetrics(model_name=acc.model_name, engine=acc.engine, cache_config=acc.cache)
    return replace(
        em,
        **values,  # type: ignore[arg-type]  # keys are EngineMetrics float fields (_SCALARS)
        requests_finished_total=acc.finished if acc.saw_success else None,
        requests_failed_total=acc.failed if acc.saw_success else None,
        time_to_first_token=_histogram(acc, "time_to_first_token"),
        e2e_request_latency=_histogram(acc, "e2e_request_latency"),
        request_queue_time=_histogram(acc, "request_queue_time"),
    )


class VllmMetricsCollector:
    """GET <url>/metrics → Reading(VllmScrape). Never raises."""

    kind = SourceKind.VLLM_METRICS

    def __init__(self, service: ServiceConfig, cfg: VllmMetricsSourceConfig) -> None:
        self.service: str | None = service.name
        self.timeout_seconds = cfg.timeout_seconds
        self._url = service.url.rstrip("/") + "/metrics"
        self._max_body_bytes = cfg.max_body_bytes
        self._parser = make_parser()
        self._cancel = httpget.Cancel()

    def collect(self) -> Reading:
        try:
            body = self._fetch()
        except _FetchError as e:
            return failed(self.kind, self.service, e.error, e.hint)
        text = body.decode("utf-8", errors="replace")
        scrape = parse_vllm_metrics(text, len(body), self._parser)
        if not scrape.engines and not scrape.stats_enabled:
            if scrape.malformed_lines and _looks_like_html(text):
                return failed(
                    self.kind,
                    self.service,
                    f"{self._url} returned HTML, not a Prometheus exposition",
                    "is services[].url pointing at vLLM itself (not a proxy or UI)?",
                )
            # Not a failure to scrape: the server answered, it just exports no engine stats.
            return Reading(
                self.kind,
                self.service,
                scrape,
                error="no vllm:* series in /metrics",
                hint="vLLM was started with --disable-log-stats, or this is not a vLLM server; "
                "the guardian cannot see KV usage or queues without them",
            )
        if scrape.engines_dropped:
            # Read, but not whole: the reading stands and the hint says what was left out.
            return Reading(
                self.kind,
                self.service,
                scrape,
                hint=f"{scrape.engines_dropped} engine(s) past the first {MAX_ENGINES} were not "
                "read (vllm_guardian_vllm_scrape_engines_dropped)",
            )
        return Reading(self.kind, self.service, scrape)

    def _fetch(self) -> bytes:
        try:
            resp = httpget.fetch(
                self._url,
                cancel=self._cancel,
                # a little under the tick's wait, so that this source's own error is what shows
                deadline_seconds=0.9 * self.timeout_seconds,
                max_body_bytes=self._max_body_bytes,
                headers={"Accept": "text/plain;version=0.0.4"},
            )
        except httpget.HttpGetError as e:
            raise _FetchError(*self._describe(e)) from None
        if resp.status != 200:
            raise _FetchError(f"GET {self._url}: HTTP {resp.status}", None)
        return resp.body

    def interrupt(self) -> None:
        """Shutting down: end the fetch in progress now (SIGTERM never waits on vLLM)."""
        self._cancel.cut()

    def close(self) -> None:
        self._cancel.cut()  # one connection per fetch: nothing else is held

    def _describe(self, e: httpget.HttpGetError) -> tuple[str, str | None]:
        url, timeout_seconds = self._url, self.timeout_seconds
        if e.failure is httpget.Failure.REFUSED:
            return (
                f"GET {url}: connection refused",
                "vLLM is not listening: still loading the model, or not running",
            )
        if e.failure in (httpget.Failure.DEADLINE, httpget.Failure.CONNECT_TIMEOUT):
            return (
                f"GET {url}: no answer within {timeout_seconds:g}s",
                "the API server is hung, overloaded, or sends its answer too slowly",
            )
        if e.failure is httpget.Failure.TOO_LARGE:
            return (
                f"GET {url}: body exceeds {self._max_body_bytes} bytes",
                "raise sources.vllm_metrics.max_body_bytes if this server is legitimately that large",
            )
        return f"GET {url}: {e.detail}", None


class _FetchError(Exception):
    def __init__(self, error: str, hint: str | None) -> None:
        super().__init__(error)
        self.error = error
        self.hint = hint


def _looks_like_html(text: str) -> bool:
    head = text.lstrip()[:200].lower()
    return head.startswith(("<!doctype html", "<html")) or "<html" in head
