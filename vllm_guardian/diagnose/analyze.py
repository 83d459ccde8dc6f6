"""A bundle in, a report out: the bundle's files become snapshots, the pure core does the rest.

Steps: scrapes → :class:`VllmScrape` (``sources/vllm_metrics.parse_vllm_metrics``);
``health.json``, ``unit.json``, ``gpus.json`` → the last snapshot's health, unit and GPUs; the
daemon's flight records (when present) become the earlier history; ``core/signals.derive``
computes rates and percentiles from consecutive snapshots; journal lines → log events
(``vllm_log_format.match_line``) and vLLM's sizing lines (``core/budget``); the model's
``config.json`` and the flags → the KV budget; all of it → ``core/observations.classify``; the
verdict → ``recommend``. Bad inputs become ``problems``, never exceptions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from vllm_guardian.config import PolicyConfig, ServiceConfig, SignalsConfig
from vllm_guardian.core import diagnosis, observations
from vllm_guardian.core.alerting import RESET_CLASS_XIDS
from vllm_guardian.core.budget import (
    Deployment,
    KvBudget,
    LaunchFlags,
    ModelConfigError,
    ModelShape,
    StartupSizing,
    compute_budget,
    model_fits,
    model_shape,
    parse_launch_flags,
    parse_startup_sizing,
)
from vllm_guardian.core.capacity import CapacityEstimate, CapacityState
from vllm_guardian.core.levers import sequences_hosted
from vllm_guardian.core.signals import (
    OperatorHold,
    ServiceSignals,
    derive_service,
    histogram_quantile,
)
from vllm_guardian.diagnose.bundle import Bundle
from vllm_guardian.diagnose.recommend import Context, recommend
from vllm_guardian.diagnose.report import CauseReport, GpuProcessReport, GpuReport, Report
from vllm_guardian.formats import promtext
from vllm_guardian.formats.allocator_format import AllocatorStats, FormatError, decode
from vllm_guardian.formats.recorder import snapshot_from_record
from vllm_guardian.formats.vllm_log_format import display_line, engine_message, match_line
from vllm_guardian.model import (
    CacheConfig,
    Cause,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    ServiceSnapshot,
    Snapshot,
    UnitState,
    VllmScrape,
    XidEvent,
)
from vllm_guardian.sources.health import SCALING_ERROR_PREFIX, classify_status
from vllm_guardian.sources.logs import MESSAGE_MAX_CHARS
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

_REQUEST_HISTOGRAMS = ("vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket")
# Without a scrape span the stall test needs at least this much observation.
_MIN_STALL_SECONDS = 2.0


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) else None


def health_probe(doc: dict[str, Any] | None) -> HealthProbe | None:
    if doc is None:
        return None
    code = _int(doc.get("status_code"))
    err = _str(doc.get("error"))
    latency = _float(doc.get("latency_seconds"))
    if code == 503 and err is not None and SCALING_ERROR_PREFIX in err:
        state = HealthState.SCALING  # the guardian's probe read elastic EP's scaling 503
    elif code is not None:
        state = classify_status(code)
    elif err and "timed out" in err.lower():
        state = HealthState.TIMEOUT
    else:
        state = HealthState.REFUSED
    return HealthProbe(state, code, latency, err)


def _gpu_devices(
    gpus: list[dict[str, Any]], problems: list[str]
) -> tuple[list[GpuDevice], set[int], list[XidEvent]]:
    devices: list[GpuDevice] = []
    service_pids: set[int] = set()
    xids: list[XidEvent] = []
    for n, g in enumerate(gpus):
        index = _int(g.get("index"))
        if index is None:
            problems.append(f"gpus.json[{n}]: no integer index, ignored")
            continue
        total = _int(g.get("memory_total_bytes"))
        used = _int(g.get("memory_used_bytes"))
        procs: list[GpuProcess] | None = None
        raw_procs = g.get("processes")
        if isinstance(raw_procs, list):
            procs = []
            for p in raw_procs:
                pid = _int(p.get("pid")) if isinstance(p, dict) else None
                if pid is None:
                    problems.append(f"gpus.json[{n}].processes: an entry without a pid, ignored")
                    continue
                assert isinstance(p, dict)
                procs.append(
                    GpuProcess(
                        pid,
                        _int(p.get("used_memory_bytes")),
                        _str(p.get("name")),
                        weight_cache=p.get("weight_cache") is True,
                    )
                )
                if p.get("service") is True:
                    service_pids.add(pid)
        raw_xids = g.get("xid_events")
        for x in raw_xids if isinstance(raw_xids, list) else ():
            xid = _int(x.get("xid")) if isinstance(x, dict) else None
            if xid is not None and isinstance(x, dict):
                xids.append(XidEvent(index, xid, _float(x.get("unix_time")) or 0.0))
        free = _int(g.get("memory_free_bytes"))
        if free is None and total is not None and used is not None:
            free = max(0, total - used)
        devices.append(
            GpuDevice(
                index=index,
                uuid=_str(g.get("uuid")),
                name=_str(g.get("name")),
                memory_total_bytes=total,
                memory_used_bytes=used,
                memory_free_bytes=free,
                processes=tuple(procs) if procs is not None else None,
            )
        )
    return devices, service_pids, xids


def _unit_state(
    doc: dict[str, Any] | None, cmdline: tuple[str, ...] | None, pids: set[int]
) -> UnitState:
    d = doc or {}
    return UnitState(
        unit=_str(d.get("Id")) or _str(d.get("unit")),
        active_state=_str(d.get("ActiveState")),
        sub_state=_str(d.get("SubState")),
        result=_str(d.get("Result")),
        main_pid=_int(d.get("MainPID")) or None,
        n_restarts=_int(d.get("NRestarts")),
        exec_main_status=_int(d.get("ExecMainStatus")),
        active_enter_monotonic_seconds=None,
        control_group=None,
        cmdline=cmdline,
        pids=tuple(sorted(pids)),
    )


def request_tokens_p95(scrapes: Sequence[tuple[float, str]]) -> float | None:
    """p95 of prompt + generated tokens per finished request (the two histograms' p95s added:
    an upper bound of the sum's p95), over the scrapes' span, else over the server's life."""

    def buckets(body: str) -> dict[str, dict[float, float]]:
        out: dict[str, dict[float, float]] = {}
        for s in promtext.parse(body, _REQUEST_HISTOGRAMS).samples:
            le_raw = dict(s.labels).get("le")
            try:
                le = float(le_raw) if le_raw is not None else None
            except ValueError:
                le = None
            if le is None or not math.isfinite(s.value):
                continue
            fam = out.setdefault(s.name, {})
            fam[le] = fam.get(le, 0.0) + s.value
        return out

    if not scrapes:
        return None
    last = buckets(scrapes[-1][1])
    first = buckets(scrapes[0][1]) if len(scrapes) > 1 else {}
    total = 0.0
    for name in _REQUEST_HISTOGRAMS:
        cur = last.get(name)
        if not cur:
            return None
        prev = first.get(name, {})
        delta = {le: c - prev.get(le, 0.0) for le, c in cur.items()}
        use = delta if delta.get(math.inf, 0.0) > 0 and all(v >= 0 for v in delta.values()) else cur
        q = histogram_quantile(0.95, sorted(use.items()))
        if q is None:
            return None
        total += q
    return total


def log_events(lines: Sequence[str], time_seconds: float) -> tuple[LogEvent, ...]:
    out = []
    for line in lines:
        m = match_line(line)
        if m is not None:
            out.append(LogEvent(m[0], time_seconds, display_line(line)[:MESSAGE_MAX_CHARS], m[1]))
    return tuple(out)


def _allocator(
    docs: Sequence[tuple[str, dict[str, Any]]], problems: list[str]
) -> tuple[AllocatorStats, ...]:
    """The plugin's records (allocator_format), the newest per process and GPU."""
    out: dict[tuple[int, int], AllocatorStats] = {}
    for name, doc in docs:
        try:
            rec = decode(json.dumps(doc).encode())
        except FormatError as e:
            problems.append(f"allocator/{name}: {e}")
            continue
        out[(rec.pid, rec.device)] = rec
    return tuple(out.values())


def _allocator_evidence(records: Sequence[AllocatorStats]) -> tuple[diagnosis.Evidence, ...]:
    return tuple(diagnosis.evidence_from_allocator(records)) if records else ()


def _service_gpus(devices: Sequence[GpuDevice], pids: set[int]) -> tuple[int, ...] | None:
    mine = tuple(
        d.index for d in devices if d.processes and any(p.pid in pids for p in d.processes)
    )
    # vLLM down: none of its processes hold memory; every GPU in the bundle is its card then.
    return mine or (tuple(d.index for d in devices) if devices else None)


def _flight_history(b: Bundle, problems: list[str]) -> list[Snapshot]:
    out: list[Snapshot] = []
    bad = 0
    for rec in b.flight:
        try:
            out.append(snapshot_from_record(rec))
        except (ValueError, TypeError, KeyError):
            bad += 1
    if bad:
        problems.append(f"flight.jsonl: {bad} record(s) that are not snapshots, skipped")
    return sorted(out, key=lambda s: s.time_seconds)


@dataclasses.dataclass(frozen=True)
class _Budget:
    budget: KvBudget | None
    fits: bool | None
    view: dict[str, Any] | None
    model: ModelShape | None


def _budget(
    b: Bundle,
    flags: LaunchFlags,
    cache: CacheConfig | None,
    sizing: StartupSizing,
    total: int | None,
    max_model_len: int | None,
    p95: float | None,
    problems: list[str],
) -> _Budget:
    model: ModelShape | None = None
    if b.model_config is not None:
        index_total = None
        meta = (b.safetensors_index or {}).get("metadata")
        if isinstance(meta, dict):
            index_total = _int(meta.get("total_size"))
        try:
            model = model_shape(b.model_config, index_total, name=flags.model)
        except ModelConfigError as e:
            problems.append(f"model_config.json: {e}; no KV budget from the model")
    view: dict[str, Any] = {}
    budget: KvBudget | None = None
    fits: bool | None = None
    if model is not None and total is not None:
        d = Deployment(
            gpu_memory_total_bytes=total,
            gpu_memory_utilization_ratio=flags.gpu_memory_utilization_ratio
            or (cache.gpu_memory_utilization_ratio if cache else None),
            tensor_parallel_size=flags.tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_seqs=flags.max_num_seqs,
            max_num_batched_tokens=flags.max_num_batched_tokens,
            kv_cache_dtype=flags.kv_cache_dtype,
            kv_cache_memory_bytes=flags.kv_cache_memory_bytes,
            block_size=flags.block_size or (cache.block_size if cache else None),
            enforce_eager=flags.enforce_eager,
        )
        estimate = compute_budget(model, d)
        per_token = estimate.kv_bytes_per_token
        reported_tokens = cache.capacity_tokens if cache else None
        if reported_tokens is not None:
            budget = compute_budget(
                model,
                d,
                kv_pool_bytes=reported_tokens * per_token,
                kv_pool_source="cache_config_info",
            )
        elif sizing.available_kv_cache_bytes is not None:
            budget = compute_budget(
                model, d, kv_pool_bytes=sizing.available_kv_cache_bytes, kv_pool_source="vLLM log"
            )
        else:
            budget = estimate
        fits = model_fits(model, total, estimate.tensor_parallel_size)
        view = dataclasses.asdict(budget)
        if budget is not estimate:
            view["estimated_pool_tokens"] = estimate.pool_tokens
            diff = (
                (estimate.pool_tokens - budget.pool_tokens) / budget.pool_tokens
                if budget.pool_tokens
                else None
            )
            if diff is not None:
                view["check"] = (
                    f"estimate from config and flags: {estimate.pool_tokens:,} tokens, "
                    f"{diff:+.0%} vs {budget.kv_pool_source}"
                )
        view["largest_max_model_len"] = {
            "1 sequence": budget.largest_max_model_len(1),
            f"{budget.max_num_seqs} sequences": budget.largest_max_model_len(budget.max_num_seqs),
        }
        view["p95_request_tokens"] = p95
        view["max_concurrency_at_p95"] = budget.max_concurrency_at(p95) if p95 else None
        view["model_fits"] = fits
    elif cache is not None and cache.capacity_tokens is not None:
        # No model config: what the server reports is the budget.
        tokens = cache.capacity_tokens
        view = _reported_pool(flags.model, "cache_config_info", tokens, max_model_len, p95)
        view.update(
            kv_pool_bytes=cache.kv_cache_memory_bytes,
            pool_blocks=cache.num_gpu_blocks,
            block_size=cache.block_size,
            gpu_memory_utilization_ratio=cache.gpu_memory_utilization_ratio,
        )
        overridden = dict(cache.labels).get("num_gpu_blocks_override", "None") != "None"
        if cache.kv_cache_memory_bytes and tokens and not overridden:
            view["kv_bytes_per_token"] = cache.kv_cache_memory_bytes // tokens
    elif sizing.kv_cache_size_tokens is not None:
        # No vllm:cache_config_info (vLLM's Rust frontend exports none): the engine's own
        # start-up line, "GPU KV cache size: N tokens", is the pool.
        view = _reported_pool(
            flags.model, "vLLM log", sizing.kv_cache_size_tokens, max_model_len, p95
        )
    elif model is None and b.scrapes:
        # vLLM answered /metrics, and nothing says how large its pool is: unknown, never a
        # default's guess. (No scrape at all: nothing to say about a pool.)
        view = _reported_pool(flags.model, None, None, max_model_len, p95)
        view["unknown"] = (
            "no vllm:cache_config_info in /metrics (vLLM's Rust frontend has none), no "
            "'GPU KV cache size' line from the engine in the log, and no model config "
            "(model_config.json) to estimate it from"
        )
    return _Budget(budget, fits, view or None, model)


def _reported_pool(
    model: str | None,
    source: str | None,
    tokens: int | None,
    max_model_len: int | None,
    p95: float | None,
) -> dict[str, Any]:
    """The KV budget as the server reported its pool (``source`` says where from), without a
    model config to compute one; every figure None where ``tokens`` is."""
    return {
        "model": model,
        "kv_pool_source": source,
        "kv_pool_bytes": None,
        "pool_tokens": tokens,
        "pool_blocks": None,
        "block_size": None,
        "gpu_memory_utilization_ratio": None,
        "max_model_len": max_model_len,
        "max_concurrency_at_max_model_len": round(tokens / max_model_len, 2)
        if tokens and max_model_len
        else None,
        "p95_request_tokens": p95,
        "max_concurrency_at_p95": round(tokens / p95, 2) if tokens and p95 else None,
        "largest_max_model_len": {"1 sequence": tokens} if tokens else {},
    }


def analyze(
    b: Bundle,
    mode: str = "bundle",
    thresholds: observations.Thresholds | None = None,
    policy: PolicyConfig | None = None,
    signals: SignalsConfig | None = None,
) -> Report:
    """The report for one bundle. ``thresholds`` come from the rule set the daemon evaluates
    (the shipped rules and the config's ``rules_file``), read in instant mode; ``policy`` is
    the config's ``policy:`` (the levers' steps and floors), the shipped one without it;
    ``signals`` the config's ``signals:``, the windows the daemon judged its flight record
    with (the stall's wait), the shipped ones without it."""
    th = thresholds or observations.Thresholds()
    problems = list(b.problems)
    service = b.service
    now = b.created_seconds
    parsed: list[tuple[float, VllmScrape]] = []
    for t, body in b.scrapes:
        scrape = parse_vllm_metrics(body)
        if scrape.malformed_lines:
            problems.append(
                f"metrics/{t:.0f}.prom: {scrape.malformed_lines} malformed line(s) skipped"
            )
        if not scrape.engines and not scrape.stats_enabled:
            problems.append(
                f"metrics/{t:.0f}.prom: no vllm:* series (--disable-log-stats? not vLLM?)"
            )
        parsed.append((t, scrape))
    if now is None:
        now = parsed[-1][0] if parsed else 0.0
    devices, service_pids, xids = _gpu_devices(b.gpus or [], problems)
    unit_doc = b.unit
    main_pid = _int((unit_doc or {}).get("MainPID"))
    if main_pid:
        service_pids.add(main_pid)
    unit = _unit_state(unit_doc, b.cmdline, service_pids)
    health = health_probe(b.health)
    flight = _flight_history(b, problems)
    first_own = parsed[0][0] if parsed else now
    history = [s for s in flight if s.time_seconds < first_own and s.service(service) is not None]
    gpus = GpuReading(tuple(devices), xid_events=tuple(xids)) if b.gpus is not None else None
    own: list[Snapshot] = [
        Snapshot(t, (ServiceSnapshot(service, vllm=scrape),), None) for t, scrape in parsed
    ]
    if not own:
        own = [Snapshot(now, (ServiceSnapshot(service),), None)]
    last = own[-1]
    last_svc = last.services[0]
    own[-1] = dataclasses.replace(
        last,
        services=(dataclasses.replace(last_svc, health=health, unit=unit),),
        gpus=gpus,
    )
    history += own
    times = [
        s.time_seconds
        for s in history
        if (x := s.service(service)) is not None and x.vllm is not None
    ]
    span = (times[-1] - times[0]) if len(times) > 1 else 0.0
    window = max(span, 1.0) + 1.0
    cfg = SignalsConfig(
        rate_window_seconds=window,
        quantile_window_seconds=window,
        slope_window_seconds=window,
        stall_seconds=max(_MIN_STALL_SECONDS, min(30.0, span)) if len(times) > 1 else 1e9,
        capacity_window_seconds=window,
    )
    svc_cfg = ServiceConfig(name=service, gpus=_service_gpus(devices, service_pids))
    sig: ServiceSignals = derive_service(history, svc_cfg, cfg)
    sig = _with_forecast(sig, flight, svc_cfg)
    sig = _with_daemon_judgement(sig, flight, svc_cfg, signals or SignalsConfig())
    flags = parse_launch_flags(b.cmdline or ())
    for bad in flags.unknown_values:
        problems.append(f"cmdline.txt: cannot read {bad}")
    # Sizing read from the engine's own lines only: a request's text elsewhere in the log could
    # spell "Available KV cache memory: 0.01 GiB" (vllm_log_format.py says who wrote a line).
    sizing = parse_startup_sizing(m for line in b.journal if (m := engine_message(line)))
    events = log_events(b.journal, now)
    scrape_last = parsed[-1][1] if parsed else None
    cache = next(
        (e.cache_config for e in (scrape_last.engines if scrape_last else ()) if e.cache_config),
        None,
    )
    max_model_len = (
        flags.max_model_len or _models_max_len(b.models) or sizing.max_concurrency_request_tokens
    )
    p95 = request_tokens_p95(b.scrapes)
    svc_devices = [d for d in devices if svc_cfg.gpus is None or d.index in svc_cfg.gpus]
    total = svc_devices[0].memory_total_bytes if svc_devices else None
    if total is None:
        total = _total_from_events(events)
    bud = _budget(b, flags, cache, sizing, total, max_model_len, p95, problems)
    allocator = _allocator(b.allocator, problems)
    obs = observations.Observations(
        signals=sig,
        scrapes=len(times),
        observed_seconds=span,
        log_events=events,
        # Elastic EP's scaling 503 is no dead engine's: no status code to judge by.
        health_status_code=(
            health.status_code
            if health is not None and health.state is not HealthState.SCALING
            else None
        ),
        unit_active_state=unit.active_state,
        unit_result=unit.result,
        exec_main_status=unit.exec_main_status,
        n_restarts=unit.n_restarts,
        xid_events=tuple((x.gpu_index, x.xid) for x in xids),
        extra_evidence=_allocator_evidence(allocator),
        thresholds=th,
        budget=bud.budget,
        model_fits=bud.fits,
        p95_request_tokens=p95,
    )
    result = _agree_with_action(observations.classify(obs), b.action, problems)
    sleeping = [e.engine for e in (scrape_last.engines if scrape_last else ()) if e.asleep]
    if sleeping:
        # An operator's /sleep, not a fault: progress is not judged while an engine sleeps.
        result = dataclasses.replace(
            result,
            notes=(
                *result.notes,
                f"engine {', '.join(sleeping) or '(unnamed)'} asleep at the last scrape "
                "(vllm:engine_sleep_state awake 0: put to sleep through /sleep); requests in "
                "it wait until /wake_up, and no stall is judged, nor a restart earned, meanwhile",
            ),
        )
    if health is not None and health.state is HealthState.SCALING:
        result = dataclasses.replace(
            result,
            notes=(
                *result.notes,
                "/health answered 503 with vLLM's elastic EP scaling message: the data-parallel "
                "size was changing (every request refused meanwhile), not a dead engine; one "
                "that stays so is a scale that failed: POST /is_scaling_elastic_ep, then "
                "restart it by hand",
            ),
        )
    rejected = sig.admission_rejections_per_second
    if rejected:
        # vLLM's own queue limits answered 503: demand it did not serve (the capacity estimate
        # counts it so); a sign of over capacity, not a fault of the engine.
        result = dataclasses.replace(
            result,
            notes=(
                *result.notes,
                f"vLLM turned away {rejected:.1f} requests/s with HTTP 503 at its own queue "
                "limit (vllm:admission_rejections_total; --max-num-queued-reqs / "
                "--max-num-queued-tokens): demand it did not serve, counted as such in the "
                "capacity estimate",
            ),
        )
    if sig.held_by_operator is OperatorHold.PAUSED:
        waited = sig.held_waiting_seconds or 0.0
        result = dataclasses.replace(
            result,
            notes=(
                *result.notes,
                f"vLLM paused for {sig.held_seconds or 0:.0f} s at the daemon's last tick "
                "(GET /is_paused true: an operator's POST /pause; the guardian never pauses it, "
                "and /metrics does not show a pause; vLLM's access log has the POST /pause line "
                "and its client)"
                + (f"; requests have waited {waited:.0f} s through it" if waited else "")
                + ": they wait until /resume, and no stall or input hang is judged, nor a "
                "restart earned, meanwhile",
            ),
        )
    elif sig.held_by_operator is OperatorHold.ASLEEP and not sleeping and sig.held_seconds:
        result = dataclasses.replace(
            result,
            notes=(
                *result.notes,
                f"vLLM asleep for {sig.held_seconds:.0f} s at the daemon's last tick "
                "(vllm:engine_sleep_state awake 0: an operator's POST /sleep); no stall is "
                "judged, nor a restart earned, meanwhile",
            ),
        )
    verdict = result.verdict
    causes = tuple(
        CauseReport(
            f.cause, f.confidence, diagnosis.actionable(f), tuple(e.sentence for e in f.evidence)
        )
        for f in result.findings
    )
    free_line = next(
        (e for e in events if e.kind is LogEventKind.FREE_MEMORY_BELOW_UTILIZATION), None
    )
    free_bytes = _detail_int(free_line, "free_bytes") if free_line else None
    ctx = Context(
        verdict=verdict,
        flags=flags,
        cmdline=b.cmdline,
        budget=bud.budget,
        model=bud.model,
        sizing=sizing,
        gpu_total_bytes=total or (_detail_int(free_line, "total_bytes") if free_line else None),
        gpu_free_bytes=free_bytes,
        other_processes_bytes=sig.other_processes_memory_bytes,
        reported_utilization=cache.gpu_memory_utilization_ratio if cache else None,
        running_requests=sig.requests_running,
        pool_tokens=cache.capacity_tokens if cache else None,
        p95_request_tokens=p95,
        capacity=sig.capacity,
        hardware_gpus=tuple(sorted({x.gpu_index for x in xids if x.xid in RESET_CLASS_XIDS})),
        policy=policy or PolicyConfig(),
    )
    rec = recommend(ctx)
    util = sig.gpu_memory_utilization_ratio or flags.gpu_memory_utilization_ratio
    gpu_reports = tuple(
        GpuReport(
            index=d.index,
            name=d.name,
            memory_total_bytes=d.memory_total_bytes,
            # vLLM's weight-cache daemon holds the engine's weights inside its budget.
            vllm_bytes=sum(
                p.used_memory_bytes or 0
                for p in d.processes or ()
                if p.pid in service_pids or p.weight_cache
            ),
            others=tuple(
                GpuProcessReport(p.pid, p.name, p.used_memory_bytes)
                for p in d.processes or ()
                if p.pid not in service_pids and not p.weight_cache
            ),
            free_bytes=d.memory_free_bytes,
            budget_bytes=int(util * d.memory_total_bytes)
            if util and d.memory_total_bytes
            else None,
        )
        for d in devices
    )
    return Report(
        mode=mode,
        origin=b.origin,
        service=service,
        created=b.created,
        verdict=verdict,
        causes=causes,
        notes=(
            *result.notes,
            f"thresholds from {th.source}, read instantly (a rule's for_seconds is "
            "not waited for in a diagnosis)",
            *(
                (f"the incident's timeline as a picture: {b.picture} (open it in a browser)",)
                if b.picture
                else ()
            ),
        ),
        signals=_signals_view(sig, len(times), span),
        kv_budget=bud.view,
        vllm_sizing=None if sizing.empty else dataclasses.asdict(sizing),
        gpus=gpu_reports,
        recommendation=rec,
        problems=tuple(problems),
    )


def _agree_with_action(
    result: observations.Classification, action: dict[str, Any] | None, problems: list[str]
) -> observations.Classification:
    """A bundle the guardian saved when it acted (``action.json``) is read in agreement with
    that action: its cause leads the findings, with the guardian's reason as evidence.

    The guardian decided over its whole window (alerts held for their ``for``, the engine's
    progress over many ticks); the bundle holds a few scrapes taken as it acted, which may no
    longer show it (a hung engine's last scrape can look idle). A report that read "healthy"
    beside an action.json that said "the engine is hung" would send the on-call engineer the
    wrong way. What the scrapes show besides stays listed after it."""
    if action is None:
        return result
    try:
        cause = Cause(str(action.get("cause")))
    except ValueError:
        if action.get("cause") is not None:
            problems.append(f"action.json: unknown cause {action.get('cause')!r}")
        return result
    kind = str(action.get("kind") or "action")
    alerts = ", ".join(str(a) for a in action.get("evidence") or ()) or "no alert named"
    said = diagnosis.Evidence(
        cause,
        "guardian action",
        f"the guardian acted on it ({kind}{' in dry-run' if action.get('dry_run') else ''}; "
        f"{alerts}): {action.get('reason') or 'no reason recorded'}",
        unambiguous=True,
    )
    same = next((f for f in result.findings if f.cause is cause), None)
    lead = (
        dataclasses.replace(same, evidence=(said, *same.evidence), confidence=1.0)
        if same is not None
        else diagnosis.Finding(cause, 1.0, (said,))
    )
    notes = result.notes
    if same is None:
        notes = (
            *notes,
            f"this bundle's own scrapes do not show {cause.value}: the guardian saw it over "
            "its window before it acted (its flight.jsonl and audit log hold that view)",
        )
    rest = tuple(f for f in result.findings if f.cause is not cause)
    return dataclasses.replace(result, findings=(lead, *rest), notes=notes)


def _with_forecast(
    sig: ServiceSignals, flight: Sequence[Snapshot], svc_cfg: ServiceConfig
) -> ServiceSignals:
    """The exhaustion forecast as of the daemon's last tick: its ticks are the dense series a
    forecast needs (the diagnosis's own two scrapes are not). None without flight records."""
    ticks = [s for s in flight if s.service(svc_cfg.name) is not None]
    if not ticks:
        return sig
    f = derive_service(ticks, svc_cfg, SignalsConfig())
    return dataclasses.replace(
        sig,
        forecasts=f.forecasts,
        seconds_to_headroom_exhaustion=f.seconds_to_headroom_exhaustion,
        headroom_exhaustion_latest_seconds=f.headroom_exhaustion_latest_seconds,
        forecast_cause=f.forecast_cause,
    )


def _with_daemon_judgement(
    sig: ServiceSignals, flight: Sequence[Snapshot], svc_cfg: ServiceConfig, cfg: SignalsConfig
) -> ServiceSignals:
    """A hang as the daemon judged it at its last tick, from its flight record with its own
    windows (``cfg``: the config's ``signals:``). A hang is a wait over many ticks: the bundle's
    own scrape, taken as the guardian acted, is one more frozen (or idle-looking) reading and
    cannot show it alone; the flight record can, as it did to the daemon. Only adds: what the
    bundle's scrapes show stays."""
    ticks = [s for s in flight if s.service(svc_cfg.name) is not None]
    if not ticks:
        return sig
    d = derive_service(ticks, svc_cfg, cfg)
    out = sig
    if d.stalled and not sig.stalled:
        out = dataclasses.replace(out, stalled=True, stall_seconds=d.stall_seconds)
    if d.input_hung and not sig.input_hung:
        out = dataclasses.replace(out, input_hung=True, unreached_seconds=d.unreached_seconds)
    if d.held_by_operator is not None and sig.held_by_operator is None:
        out = dataclasses.replace(
            out,
            held_by_operator=d.held_by_operator,
            held_seconds=d.held_seconds,
            held_waiting_seconds=d.held_waiting_seconds,
        )
    return out


def _models_max_len(models: dict[str, Any] | None) -> int | None:
    data = (models or {}).get("data")
    if isinstance(data, list):
        for m in data:
            if isinstance(m, dict) and _int(m.get("max_model_len")):
                return _int(m.get("max_model_len"))
    return None


def _detail_int(ev: LogEvent | None, key: str) -> int | None:
    if ev is None:
        return None
    raw = dict(ev.details).get(key)
    try:
        return int(float(raw)) if raw is not None else None
    except ValueError:
        return None


def _total_from_events(events: Sequence[LogEvent]) -> int | None:
    for ev in events:
        v = _detail_int(ev, "total_bytes")
        if v:
            return v
    return None


def _signals_view(sig: ServiceSignals, scrapes: int, span: float) -> dict[str, Any]:
    return {
        "scrapes": scrapes,
        "observed_seconds": span,
        "health_state": sig.health_state.value if sig.health_state else None,
        "metrics_up": sig.metrics_up,
        "kv_cache_usage_ratio": sig.kv_cache_usage_ratio,
        "requests_running": sig.requests_running,
        "requests_waiting": sig.requests_waiting,
        "preemptions_per_second": sig.preemptions_per_second,
        "generation_tokens_per_second": sig.generation_tokens_per_second,
        "prefix_cache_hit_ratio": sig.prefix_cache_hit_ratio,
        "stall_seconds": sig.stall_seconds,
        "service_memory_bytes": sig.service_memory_bytes,
        "other_processes_memory_bytes": sig.other_processes_memory_bytes,
        "headroom_bytes": sig.headroom_bytes,
        "kv_cache_capacity_tokens": sig.kv_cache_capacity_tokens,
        "gpu_memory_utilization_ratio": sig.gpu_memory_utilization_ratio,
        # The exhaustion forecast (core/forecast.py), from the daemon's recent ticks: absent
        # without a significant trend (a live diagnosis of a host without the daemon has none).
        "headroom_exhaustion_seconds": sig.seconds_to_headroom_exhaustion,
        "headroom_exhaustion_latest_seconds": sig.headroom_exhaustion_latest_seconds,
        "headroom_exhaustion_cause": sig.forecast_cause.value if sig.forecast_cause else None,
        "headroom_exhaustion": [f.describe() for f in sig.forecasts],
        # Only where vLLM turned requests away (0.32's --max-num-queued-reqs/-tokens).
        **(
            {"admission_rejections_per_second": sig.admission_rejections_per_second}
            if sig.admission_rejections_per_second
            else {}
        ),
    }


def plan_report(
    model: ModelShape,
    d: Deployment,
    request_tokens: float | None = None,
    concurrency: int | None = None,
    origin: str = "",
) -> Report:
    """``vllm-guardian plan``: the budget of a deployment before it exists, and its verdict."""
    budget = compute_budget(model, d)
    fits = model_fits(model, d.gpu_memory_total_bytes, budget.tensor_parallel_size)
    obs = observations.Observations(
        signals=None, budget=budget, model_fits=fits, p95_request_tokens=request_tokens
    )
    result = observations.classify(obs)
    notes = [n for n in result.notes if not n.startswith("no /metrics")]
    findings = list(result.findings)
    if request_tokens and fits and budget.fits_one_request:
        hosts = sequences_hosted(budget.pool_tokens, request_tokens) or 0
        if budget.max_num_seqs > 2 * hosts:
            ev = diagnosis.Evidence(
                Cause.CONCURRENCY_OVERCOMMIT,
                "plan:max_num_seqs",
                f"max_num_seqs {budget.max_num_seqs} but the pool hosts {hosts} sequences of "
                f"{request_tokens:,.0f} tokens: under full load it preempts",
                weight=0.5,
            )
            findings = list(diagnosis.rank([*(e for f in findings for e in f.evidence), ev]))
    view = dataclasses.asdict(budget)
    view["largest_max_model_len"] = {"1 sequence": budget.largest_max_model_len(1)}
    if concurrency:
        view["largest_max_model_len"][f"{concurrency} sequences"] = budget.largest_max_model_len(
            concurrency
        )
    view["p95_request_tokens"] = request_tokens
    view["max_concurrency_at_p95"] = (
        budget.max_concurrency_at(request_tokens) if request_tokens else None
    )
    view["model_fits"] = fits
    verdict = diagnosis.verdict(findings)
    flags = LaunchFlags(
        model=model.name,
        gpu_memory_utilization_ratio=d.gpu_memory_utilization_ratio,
        max_model_len=d.max_model_len,
        max_num_seqs=d.max_num_seqs,
        max_num_batched_tokens=d.max_num_batched_tokens,
        tensor_parallel_size=d.tensor_parallel_size,
        kv_cache_dtype=d.kv_cache_dtype,
        enforce_eager=d.enforce_eager,
    )
    rec = recommend(
        Context(
            verdict=verdict,
            flags=flags,
            cmdline=None,
            budget=budget,
            model=model,
            gpu_total_bytes=d.gpu_memory_total_bytes,
            pool_tokens=budget.pool_tokens,
            p95_request_tokens=request_tokens,
            capacity=CapacityEstimate(
                CapacityState.NO_DATA,
                "a plan has no traffic; size replicas by the sequences one pool hosts",
            ),
            planned_concurrency=concurrency,
        )
    )
    return Report(
        mode="plan",
        origin=origin,
        service=model.name,
        created=None,
        verdict=verdict,
        causes=tuple(
            CauseReport(
                f.cause,
                f.confidence,
                diagnosis.actionable(f),
                tuple(e.sentence for e in f.evidence),
            )
            for f in findings
        ),
        notes=tuple(notes),
        signals={},
        kv_budget=view,
        vllm_sizing=None,
        gpus=(),
        recommendation=rec,
    )
