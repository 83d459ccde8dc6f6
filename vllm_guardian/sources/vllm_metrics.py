"""Source: vLLM's ``/metrics``, across vLLM versions, reduced to what the guardian uses.

Where it sits: first stage of the tick (collect). The collector GETs ``<url>/metrics`` with a
timeout and a body-size cap; :func:`parse_vllm_metrics` (pure) turns the body into a
:class:`VllmScrape` with one :class:`EngineMetrics` per ``(model_name, engine)``. Rates and
quantiles are *not* computed here: they need history, which the pure core keeps
(``core/signals.py``). The collector keeps one :class:`VllmParser` per server: once the
server's series settle, a scrape is read from its values alone (the parser's plan), with the
same result as a full parse (tests/test_vllm_metrics_plan.py).

Version tolerance (vLLM deprecates a metric in one release, hides it in the next and removes it
in the one after): KV usage is ``vllm:kv_cache_usage_perc`` (V1 ≥ 0.9.2) or
``vllm:gpu_cache_usage_perc`` (V0, V1 ≤ 0.11); prefix-cache counters exist in three
generations; ``vllm:num_requests_swapped`` only in V0; V0 has no ``engine`` label;
``vllm:cache_config_info`` changes its label set every release and is parsed dynamically.
"""

from __future__ import annotations

import itertools
import math
import operator
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from vllm_guardian.config import ServiceConfig, VllmMetricsSourceConfig
from vllm_guardian.formats import promtext
from vllm_guardian.lowio import httpget
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
# Per engine, one series per sleep_state (awake, weights_offloaded, discard_all); only "awake"
# is read: 0 is asleep (vllm/v1/metrics/loggers.py, record_sleep_state).
_SLEEP_STATE = "vllm:engine_sleep_state"
_START_TIME = "process_start_time_seconds"
# The 503s of vLLM's own queue limits, by reason; model_name and no engine label (0.32+).
_ADMISSION = "vllm:admission_rejections_total"
# Must lie in [0, 1]. (V0 exports the hit-rate gauge as -1 with prefix caching off: that is
# rejected by the negative check, which reads as "unknown", as it should.)
_RATIOS = {"kv_cache_usage_ratio", "prefix_cache_hit_ratio"}

WANTED: frozenset[str] = frozenset(
    [*_SCALARS, _SUCCESS, _CACHE_INFO, _START_TIME, _SLEEP_STATE, _ADMISSION]
    + [f"{h}{suffix}" for h in _HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
)


@dataclass
class _EngineAcc:
    """One engine's samples as read; each value with its position among the scrape's wanted
    samples (-1 when unknown), from which the parser's plan is made."""

    model_name: str
    engine: str
    # field → (priority, value, position)
    scalars: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    finished: float = 0.0
    failed: float = 0.0
    saw_success: bool = False
    reasons: set[str | None] = field(default_factory=set)
    success_at: list[tuple[int, bool]] = field(default_factory=list)  # (position, failed)
    buckets: dict[str, dict[float, tuple[float, int]]] = field(default_factory=dict)
    sums: dict[str, tuple[float, int]] = field(default_factory=dict)
    counts: dict[str, tuple[float, int]] = field(default_factory=dict)
    cache: CacheConfig | None = None
    awake: tuple[float, int] | None = None  # sleep_state="awake": (value, position)


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
    _SLEEP_STATE: ("sleep", ""),
    _ADMISSION: ("admission", ""),
}


_LabelInfo = tuple[str, str, float | None, str | None]  # model_name, engine, le, finished_reason


class VllmParser:
    """Parses vLLM expositions; keep one per server: it caches label sets between scrapes,
    and the plan of the last body's shape (below).

    A server repeats the same series every scrape; only values move. So once two scrapes in a
    row have the same shape (:class:`promtext.Scan`: the same sample lines in the same
    families, values aside), the parser keeps a *plan* for it: where each engine's fields,
    histogram buckets and counters sit among the sample values. A scrape of that shape then
    costs the C-level split of the lines, one float() per wanted value and the objects built
    from them. The plan is made by the same code as a full parse and checked against one
    before it is kept; any value the full parse would treat specially (not finite, negative,
    a ratio over 1, a bad process start time, a timestamp, a ``_`` in a number) sends the
    scrape to the full parse, as does any change of shape (a series appears or disappears, an
    engine joins). ``fast_scrapes`` counts the scrapes read through the plan. A server no plan
    fits (after FULL_PARSES_BEFORE_PAUSE full parses in a row) is scanned for one again only
    after SCANS_SKIPPED_IN_A_PAUSE more scrapes, so that it costs a full parse and no more.
    """

    def __init__(self) -> None:
        self.text_parser = promtext.Parser(WANTED, ("vllm:",), annotate=_label_info)
        self.plan: _Plan | None = None
        self.fast_scrapes = 0
        self.scans = 0  # bodies scanned for their shape
        self._last_shape: tuple[object, ...] | None = None
        self._tried: tuple[object, ...] | None = None
        self._full_in_a_row = 0
        self._scans_to_skip = 0


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


# After this many full parses in a row, the next SCANS_SKIPPED_IN_A_PAUSE bodies are parsed
# without looking for a plan (VllmParser).
FULL_PARSES_BEFORE_PAUSE = 8
SCANS_SKIPPED_IN_A_PAUSE = 32

# vLLM runs one engine per data-parallel rank; no deployment has hundreds behind one API
# server. Past this many, a body is read for the first ones only and the rest are counted
# (a hostile or broken /metrics with 16,000 engines cost 212 s before).
MAX_ENGINES = 256


def parse_vllm_metrics(
    text: str, body_bytes: int | None = None, parser: VllmParser | None = None
) -> VllmScrape:
    """Reduce a /metrics body to a VllmScrape. Pure: bad lines and values are counted.

    With a ``parser`` kept between scrapes, a body of the last plan's shape is read through
    the plan (:class:`VllmParser`); the result is the same as a full parse's."""
    if parser is None:
        return _full_parse(text, body_bytes, VllmParser())
    scan: promtext.Scan | None = None
    if parser._scans_to_skip:
        parser._scans_to_skip -= 1
    else:
        parser.scans += 1
        scan = parser.text_parser.scan(text)
    size = len(text.encode()) if body_bytes is None else body_bytes
    if scan is not None and parser.plan is not None and scan.shape == parser.plan.shape:
        fast = parser.plan.apply(scan, size)
        if fast is not None:
            parser.fast_scrapes += 1
            parser._full_in_a_row = 0
            return fast
    scrape = _full_parse(text, size, parser)
    if scan is not None:
        parser._full_in_a_row += 1  # scanned, and read in full all the same
    if parser._full_in_a_row >= FULL_PARSES_BEFORE_PAUSE:
        # A server no plan fits (its shape changes every scrape, or it always exports a value
        # only the full parse reads, as V0's hit-rate gauge at -1): scan it rarely, not on
        # every scrape for nothing.
        parser._full_in_a_row = 0
        parser._scans_to_skip = SCANS_SKIPPED_IN_A_PAUSE
    if (
        scan is not None
        and scan.shape == parser._last_shape  # the second scrape of this shape in a row
        and scan.shape != parser._tried
        and (parser.plan is None or parser.plan.shape != scan.shape)
        and not scrape.rejected_values  # a value the plan cannot read: try again later
    ):
        parser._tried = scan.shape  # one try per shape: a plan that fails its check stays off
        parser.plan = _make_plan(scan, scrape, parser.text_parser)
    parser._last_shape = None if scan is None else scan.shape
    return scrape


@dataclass
class _Accumulated:
    engines: dict[tuple[str, str], _EngineAcc] = field(default_factory=dict)
    dropped: set[tuple[str, str]] = field(default_factory=set)  # engines past MAX_ENGINES
    duplicates: int = 0
    rejected: int = 0
    start_time: float | None = None
    start_at: int = -1
    checked: list[int] = field(default_factory=list)  # positions that must be finite, >= 0
    ratios: list[int] = field(default_factory=list)  # positions that must be <= 1
    # vllm:admission_rejections_total: (model_name, reason) → (value, position)
    admission: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)


def _accumulate(samples: Iterable[tuple[promtext.Sample, int]]) -> _Accumulated:
    """The wanted samples, each with its position (or -1), gathered per engine."""
    out = _Accumulated()
    engines = out.engines
    cache_by_engine: dict[str, CacheConfig] = {}
    isfinite = math.isfinite
    for s, at in samples:
        kind, arg = _KIND[s.name]
        value = s.value
        if kind == "start":
            if out.start_time is not None:
                out.duplicates += 1
            elif isfinite(value) and value > 0:
                out.start_time = value
                out.start_at = at
            else:
                out.rejected += 1
            continue
        if kind == "admission":
            labels = dict(s.labels)
            key_ = (labels.get("model_name", ""), labels.get("reason", ""))
            out.checked.append(at)
            if not isfinite(value) or value < 0:
                out.rejected += 1
            elif key_ in out.admission:
                out.duplicates += 1
            else:
                out.admission[key_] = (value, at)
            continue
        if kind == "cache":
            # It carries every CacheConfig field and `engine`, but no model_name.
            labels = dict(s.labels)
            engine_label = labels.get("engine", "")
            if engine_label in cache_by_engine:
                out.duplicates += 1
            else:
                cache_by_engine[engine_label] = parse_cache_config(labels)
            continue
        out.checked.append(at)
        if not isfinite(value) or value < 0:
            out.rejected += 1
            continue
        model_name, engine, le, reason = typing.cast(_LabelInfo, s.note)
        key = (model_name, engine)
        acc = engines.get(key)
        if acc is None:
            if len(engines) >= MAX_ENGINES:
                out.dropped.add(key)
                continue
            acc = engines[key] = _EngineAcc(model_name, engine)
        # Duplicate series (same name and labels twice) keep the first value and are counted.
        if kind == "bucket":
            if le is None:
                out.rejected += 1
                continue
            buckets = acc.buckets.setdefault(arg, {})
            if le in buckets:
                out.duplicates += 1
            else:
                buckets[le] = (value, at)
        elif kind == "scalar":
            if arg in _RATIOS:
                out.ratios.append(at)
                if value > 1.0:
                    out.rejected += 1
                    continue
            prio = _PRIORITY[s.name]
            held = acc.scalars.get(arg)
            if held is not None and held[0] == prio:
                out.duplicates += 1
            elif held is None or prio < held[0]:
                acc.scalars[arg] = (prio, value, at)
        elif kind == "sleep":
            if dict(s.labels).get("sleep_state") != "awake":
                continue  # the level (weights_offloaded, discard_all): awake alone says asleep
            if acc.awake is not None:
                out.duplicates += 1
            else:
                acc.awake = (value, at)
        elif kind in ("sum", "count"):
            target = acc.sums if kind == "sum" else acc.counts
            if arg in target:
                out.duplicates += 1
            else:
                target[arg] = (value, at)
        else:  # success
            if reason in acc.reasons:
                out.duplicates += 1
                continue
            acc.reasons.add(reason)
            acc.saw_success = True
            acc.finished += value
            failure = reason in ("abort", "error")
            if failure:
                acc.failed += value
            acc.success_at.append((at, failure))
    for acc in engines.values():
        acc.cache = cache_by_engine.get(acc.engine)
    return out


def _admission(
    found: Iterable[tuple[tuple[str, str], float]],
) -> tuple[tuple[str, float], ...] | None:
    """Admission rejections by reason, summed over models; None when none was exported."""
    by_reason: dict[str, float] = {}
    for (_, reason), value in found:
        by_reason[reason] = by_reason.get(reason, 0.0) + value
    return tuple(sorted(by_reason.items())) if by_reason else None


def _engines_in_order(acc: _Accumulated) -> list[_EngineAcc]:
    return sorted(acc.engines.values(), key=lambda e: (e.model_name, _engine_order(e.engine)))


def _full_parse(text: str, body_bytes: int | None, parser: VllmParser) -> VllmScrape:
    result = parser.text_parser.parse(text)
    acc = _accumulate(zip(result.samples, itertools.repeat(-1)))
    return VllmScrape(
        engines=tuple(_finish(e) for e in _engines_in_order(acc)),
        stats_enabled="vllm:" in result.prefixes_seen,
        process_start_time_seconds=acc.start_time,
        body_bytes=len(text.encode()) if body_bytes is None else body_bytes,
        malformed_lines=result.malformed_lines,
        rejected_values=acc.rejected,
        duplicate_series=acc.duplicates,
        engines_dropped=len(acc.dropped),
        admission_rejections=_admission((k, v) for k, (v, _) in acc.admission.items()),
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
    ordered = tuple(sorted((le, v) for le, (v, _) in buckets.items()))
    # Cumulative counts must not decrease with le; a body that says otherwise is corrupt.
    if any(b[1] < a[1] for a, b in itertools.pairwise(ordered)):
        return None
    s = acc.sums.get(name)
    c = acc.counts.get(name)
    return Histogram(ordered, None if s is None else s[0], None if c is None else c[0])


def _finish(acc: _EngineAcc) -> EngineMetrics:
    values = {k: v for k, (_, v, _) in acc.scalars.items()}
    em = EngineMetrics(model_name=acc.model_name, engine=acc.engine, cache_config=acc.cache)
    return replace(
        em,
        asleep=None if acc.awake is None else acc.awake[0] == 0,
        **values,  # type: ignore[arg-type]  # keys are EngineMetrics float fields (_SCALARS)
        requests_finished_total=acc.finished if acc.saw_success else None,
        requests_failed_total=acc.failed if acc.saw_success else None,
        time_to_first_token=_histogram(acc, "time_to_first_token"),
        e2e_request_latency=_histogram(acc, "e2e_request_latency"),
        request_queue_time=_histogram(acc, "request_queue_time"),
    )


# --- the plan: a shape's scrapes read from their values alone --------------------------------

# (field, bucket bounds in order, their positions, the sum's position, the count's; -1: none)
_HistogramPlan = tuple[str, tuple[float, ...], tuple[int, ...], int, int]


@dataclass(frozen=True)
class _EnginePlan:
    model_name: str
    engine: str
    cache: CacheConfig | None
    scalars: tuple[tuple[str, int], ...]  # field → position
    success: tuple[tuple[int, bool], ...] | None  # None: no vllm:request_success_total
    histograms: tuple[_HistogramPlan, ...]
    absent: tuple[str, ...]  # histogram fields the shape cannot fill (no buckets, no +Inf)
    awake_at: int = -1  # vllm:engine_sleep_state{sleep_state="awake"} (-1: none)

    def build(self, values: list[float]) -> EngineMetrics:
        kw: dict[str, typing.Any] = {f: values[i] for f, i in self.scalars}
        kw["asleep"] = None if self.awake_at < 0 else values[self.awake_at] == 0
        if self.success is not None:
            finished = failed = 0.0
            for i, failure in self.success:
                v = values[i]
                finished += v
                if failure:
                    failed += v
            kw["requests_finished_total"] = finished
            kw["requests_failed_total"] = failed
        for name, les, at, sum_at, count_at in self.histograms:
            counts = [values[i] for i in at]
            # Cumulative counts must not decrease with le (as _histogram).
            if all(map(operator.le, counts, counts[1:])):
                kw[name] = Histogram(
                    tuple(zip(les, counts, strict=True)),
                    values[sum_at] if sum_at >= 0 else None,
                    values[count_at] if count_at >= 0 else None,
                )
            else:
                kw[name] = None
        for name in self.absent:
            kw[name] = None
        return EngineMetrics(self.model_name, self.engine, cache_config=self.cache, **kw)


@dataclass(frozen=True)
class _Plan:
    shape: tuple[object, ...]
    wanted_at: tuple[int, ...]  # the wanted samples' positions among the scan's lines
    checked: tuple[int, ...]  # positions among the wanted samples that must be finite, >= 0
    ratios: tuple[int, ...]  # positions that must be <= 1
    start_at: int  # process_start_time_seconds (-1: none)
    engines: tuple[_EnginePlan, ...]  # in the scrape's order
    admission_at: tuple[tuple[tuple[str, str], int], ...]  # (model_name, reason) → position
    stats_enabled: bool
    malformed_lines: int
    duplicate_series: int
    engines_dropped: int

    def apply(self, scan: promtext.Scan, body_bytes: int) -> VllmScrape | None:
        """The scrape of a body of this shape; None where only a full parse can say."""
        raws = [scan.raw_values[i] for i in self.wanted_at]
        if "_" in "".join(raws):  # float() reads 1_000; the exposition format does not
            return None
        try:
            values = list(map(float, raws))
        except ValueError:
            return None
        checked = [values[i] for i in self.checked]
        if checked and (not all(map(math.isfinite, checked)) or min(checked) < 0):
            return None
        if any(values[i] > 1.0 for i in self.ratios):
            return None
        start: float | None = None
        if self.start_at >= 0:
            start = values[self.start_at]
            if not (math.isfinite(start) and start > 0):
                return None
        return VllmScrape(
            engines=tuple(e.build(values) for e in self.engines),
            stats_enabled=self.stats_enabled,
            process_start_time_seconds=start,
            body_bytes=body_bytes,
            malformed_lines=self.malformed_lines,
            rejected_values=0,
            duplicate_series=self.duplicate_series,
            engines_dropped=self.engines_dropped,
            admission_rejections=_admission((k, values[i]) for k, i in self.admission_at),
        )


def _make_plan(
    scan: promtext.Scan, scrape: VllmScrape, text_parser: promtext.Parser
) -> _Plan | None:
    """The plan for ``scan``'s shape, or None where its values need a full parse's judgement
    (a rejected value) or where the plan does not reproduce ``scrape`` (the full parse of
    the same body) exactly."""
    samples: list[tuple[promtext.Sample, int]] = []
    wanted_at: list[int] = []
    for i, head in enumerate(scan.heads):
        split = text_parser.split_head(head)
        if split is None:
            return None
        name, body = split
        if name not in WANTED:
            continue
        entry = text_parser.label_set(body)
        raw = scan.raw_values[i]
        if entry is None or "_" in raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            return None
        samples.append((promtext.Sample(name, entry[0], value, entry[1]), len(wanted_at)))
        wanted_at.append(i)
    acc = _accumulate(samples)
    if acc.rejected:
        return None
    engines = []
    for e in _engines_in_order(acc):
        histograms: list[_HistogramPlan] = []
        absent: list[str] = []
        for name in _HISTOGRAMS.values():
            buckets = e.buckets.get(name)
            if not buckets or math.inf not in buckets:
                absent.append(name)
                continue
            ordered = sorted(buckets.items())
            s, c = e.sums.get(name), e.counts.get(name)
            histograms.append(
                (
                    name,
                    tuple(le for le, _ in ordered),
                    tuple(at for _, (_, at) in ordered),
                    -1 if s is None else s[1],
                    -1 if c is None else c[1],
                )
            )
        engines.append(
            _EnginePlan(
                e.model_name,
                e.engine,
                e.cache,
                tuple((f, at) for f, (_, _, at) in e.scalars.items()),
                tuple(e.success_at) if e.saw_success else None,
                tuple(histograms),
                tuple(absent),
                -1 if e.awake is None else e.awake[1],
            )
        )
    plan = _Plan(
        shape=scan.shape,
        wanted_at=tuple(wanted_at),
        checked=tuple(acc.checked),
        ratios=tuple(acc.ratios),
        start_at=acc.start_at,
        engines=tuple(engines),
        admission_at=tuple((k, at) for k, (_, at) in acc.admission.items()),
        stats_enabled=scrape.stats_enabled,
        malformed_lines=scrape.malformed_lines,
        duplicate_series=acc.duplicates,
        engines_dropped=len(acc.dropped),
    )
    # Made by the same code as the full parse, and held to it: the plan must read this very
    # body exactly as the full parse did, or it is not kept.
    return plan if plan.apply(scan, scrape.body_bytes) == scrape else None


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
        # One connection kept between scrapes (httpget.KeepAlive: a restarted vLLM's closed
        # connection is dropped or retried once afresh; a hung one is bounded as ever).
        self._keep_alive = httpget.KeepAlive()

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
                keep_alive=self._keep_alive,
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
        self._keep_alive.close()

    def close(self) -> None:
        self._cancel.cut()
        self._keep_alive.close()  # the connection kept between scrapes

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
