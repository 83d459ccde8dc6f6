"""Cause classification, shared by the policy and ``vllm-guardian diagnose``. Pure.

Where it sits: after alert evaluation. Every firing alert is evidence for the cause its rule
names; OOM log lines are classified from their own numbers (how much was asked for, how much
PyTorch held reserved but unallocated) together with the signals at that moment. Evidence is
then grouped by cause and ranked.

Two rules are enforced here rather than left to callers:

* ``prefix_cache_waste`` is never a verdict (a low hit rate is measured to be harmless); it is
  dropped from the ranking.
* A destructive action needs either one unambiguous piece of evidence (an OOM line, a dead
  engine, a reset-class XID) or two independent ones (:func:`actionable`).
* A log line is never evidence on its own: it counts only while a structural signal agrees
  (:func:`corroborated`, used by the policy and by :func:`classify`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from vllm_guardian.allocator_format import AllocatorStats
from vllm_guardian.core.alerting import Rule
from vllm_guardian.core.budget import MIN_DEPLOY_UTILIZATION, KvBudget
from vllm_guardian.core.causes import cause_spec
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import Alert, AlertState, Cause, HealthState, LogEvent, LogEventKind

GIB = 1024**3

# Signals whose firing alone is proof, not a hint: one of them can justify a destructive action.
UNAMBIGUOUS_SIGNALS = frozenset(
    {"vllm_up", "stalled", "input_hung", "xid_reset_class", "log_events.cuda_oom", "log_events.engine_dead",
     "log_events.engine_fatal", "log_events.worker_died", "log_events.non_torch_oom",
     "log_events.no_kv_cache_memory", "log_events.max_seq_len_exceeds_kv",
     "log_events.free_memory_below_utilization", "policy.unit_exited"}
)  # fmt: skip

# Log lines that say *why* an engine died; the death then joins their cause.
_OOM_NAMES = frozenset({"log:cuda_oom", "log:non_torch_oom", "log:gpu_hardware_error"})
_DEATH_KINDS = frozenset(
    {
        LogEventKind.ENGINE_DEAD,
        LogEventKind.ENGINE_FATAL,
        LogEventKind.WORKER_DIED,
        LogEventKind.EXECUTE_TIMEOUT,
    }
)


def _specificity(cause: Cause) -> int:
    """When two causes have equal weight, the more specific one names the lever."""
    return cause_spec(cause).specificity


@dataclass(frozen=True)
class Evidence:
    cause: Cause
    name: str  # the alert or log signature it comes from
    sentence: str  # quotes the numbers
    unambiguous: bool = False
    weight: float = 1.0


@dataclass(frozen=True)
class Finding:
    cause: Cause
    confidence: float  # 0..1
    evidence: tuple[Evidence, ...]

    @property
    def independent(self) -> int:
        return len({e.name for e in self.evidence})


def evidence_from_alerts(
    alerts: Iterable[Alert], rule_signals: Mapping[str, str]
) -> list[Evidence]:
    """Firing alerts (not pending, not stale-only) as evidence for their rule's cause."""
    out = []
    for a in alerts:
        if a.state is not AlertState.FIRING or a.cause is None:
            continue
        signal = rule_signals.get(a.name, "")
        out.append(
            Evidence(
                cause=a.cause,
                name=a.name,
                sentence=a.summary or a.name,
                unambiguous=signal in UNAMBIGUOUS_SIGNALS and not a.stale,
            )
        )
    return out


# --- a log line needs a structural signal ---------------------------------------------------
#
# A log line is text, and a request shapes some of vLLM's text: the API server logs a request's
# `model` at ERROR, and even the engine's own lines can quote a request id or a grammar. The
# logs source reads only the engine's lines (sources/logs.py); this is the second half: no log
# line alone restarts, relaunches, latches or names a cause. It counts only while something no
# request can write says vLLM failed too.

# How far apart a log line and the structural signal that agrees with it may be. An engine that
# dies of an OOM answers /health 503 within a second and its server exits within seconds; a
# journal read late, or a supervisor that has the server up again by the next tick, are inside.
CORROBORATION_SECONDS = 60.0
# Unit states that mean vLLM's process is not running as it should (exited, failed, being
# restarted by its supervisor).
_PROCESS_DOWN = frozenset({"inactive", "failed", "activating", "deactivating"})


@dataclass(frozen=True)
class Structure:
    """What no request can write: vLLM's /health, its processes and the GPUs, at one moment."""

    health: HealthState | None = None
    unit_active_state: str | None = None
    process_restarted: bool = False  # the main process was replaced since the last look
    stalled: bool = False  # requests in the engine and no progress (core/progress.py) for a while
    reset_class_xid: bool = False  # NVML: an XID that needs a GPU reset, on its GPUs


def structural_failures(st: Structure) -> tuple[str, ...]:
    """The structural signals that show vLLM failing, by name (empty: none does)."""
    out = []
    if st.health is HealthState.ENGINE_DEAD:
        out.append("health:engine_dead")
    elif st.health is HealthState.REFUSED:
        out.append("health:refused")
    if st.unit_active_state in _PROCESS_DOWN:
        out.append(f"unit:{st.unit_active_state}")
    if st.process_restarted:
        out.append("process:restarted")
    if st.stalled:
        out.append("stalled")
    if st.reset_class_xid:
        out.append("nvml:xid_reset_class")
    return tuple(out)


def from_log(e: Evidence) -> bool:
    """Evidence read from vLLM's log (a request can shape log text)."""
    return e.name.startswith("log:")


def corroborated(evidence: Iterable[Evidence], structural: Sequence[str]) -> list[Evidence]:
    """The rule: log-derived evidence counts only while a structural signal agrees.

    ``structural`` names the structural failures seen with it (:func:`structural_failures`);
    with none, every log item is dropped and the rest is kept as it is. The policy applies it to
    each log item within :data:`CORROBORATION_SECONDS` of a structural failure, ``diagnose`` to
    what it observed at once."""
    items = list(evidence)
    return items if structural else [e for e in items if not from_log(e)]


def _detail(event: LogEvent, key: str) -> int | None:
    raw = dict(event.details).get(key)
    try:
        return int(float(raw)) if raw is not None else None
    except ValueError:
        return None


def classify_oom(event: LogEvent, signals: ServiceSignals | None) -> Evidence:
    """Name the cause of one CUDA OOM line from its numbers and the signals at the time.

    * "reserved by PyTorch but unallocated" at least as large as the failed request (and at
      least 1 GiB): the memory exists but is fragmented → allocator_fragmentation;
    * another process holds ≥ 1 GiB on the service's GPUs → gpu_memory_overcommit;
    * a single request of ≥ 1 GiB: a large batched prefill's activations → prefill_burst;
    * otherwise a runtime OOM with no other evidence → gpu_memory_overcommit.
    """
    tried = _detail(event, "tried_bytes")
    unalloc = _detail(event, "reserved_unallocated_bytes")
    others = signals.other_processes_memory_bytes if signals is not None else None

    def gib(v: int | None) -> str:
        return "?" if v is None else f"{v / GIB:.2f} GiB"

    if unalloc is not None and unalloc >= GIB and (tried is None or unalloc >= tried):
        return Evidence(
            Cause.ALLOCATOR_FRAGMENTATION,
            "log:cuda_oom",
            f"CUDA OOM asking for {gib(tried)} while {gib(unalloc)} sat reserved but unallocated: fragmentation",
            unambiguous=True,
        )
    if others is not None and others >= GIB:
        return Evidence(
            Cause.GPU_MEMORY_OVERCOMMIT,
            "log:cuda_oom",
            f"CUDA OOM asking for {gib(tried)} while other processes held {gib(others)} on the service's GPUs",
            unambiguous=True,
        )
    if tried is not None and tried >= GIB:
        return Evidence(
            Cause.PREFILL_BURST,
            "log:cuda_oom",
            f"CUDA OOM asking for {gib(tried)} in one allocation: a large batched prefill's activations",
            unambiguous=True,
        )
    return Evidence(
        Cause.GPU_MEMORY_OVERCOMMIT,
        "log:cuda_oom",
        f"CUDA OOM asking for {gib(tried)} with no other evidence: the reservation leaves too little headroom",
        unambiguous=True,
    )


def classify_startup_oom(event: LogEvent, signals: ServiceSignals | None) -> Evidence:
    """An OOM while the engine started: does the model fit the card at all?

    If what PyTorch already held plus what it asked for exceeds the whole card, no flag saves
    it (model_does_not_fit). Otherwise the reservation collided with something (another tenant,
    a too-high gpu_memory_utilization for the profile run): gpu_memory_overcommit.
    """
    tried = _detail(event, "tried_bytes")
    held = _detail(event, "allocated_bytes")
    total = _detail(event, "total_bytes")
    others = signals.other_processes_memory_bytes if signals is not None else None
    crowded = others is not None and others >= GIB
    if (
        tried is not None
        and held is not None
        and total is not None
        and held + tried > total
        and not crowded
    ):
        return Evidence(
            Cause.MODEL_DOES_NOT_FIT,
            "log:cuda_oom",
            f"at start-up PyTorch held {held / GIB:.1f} GiB and asked for {tried / GIB:.1f} GiB more on a "
            f"{total / GIB:.0f} GiB GPU: the model does not fit at this precision and parallelism",
            unambiguous=True,
        )
    return Evidence(
        Cause.GPU_MEMORY_OVERCOMMIT,
        "log:cuda_oom",
        "CUDA OOM while the engine started: the reservation collides with what is on the card",
        unambiguous=True,
    )


# vLLM's header in front of a log line, left out where a sentence quotes the line.
_HEADER = re.compile(r"^(?:\([^\s()]+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d\S* \S+ )?")


def _quote(ev: LogEvent) -> str:
    return _HEADER.sub("", ev.message, count=1)[:200]


def evidence_from_logs(
    events: Iterable[LogEvent], signals: ServiceSignals | None
) -> list[Evidence]:
    """The evidence of this tick's log events, one per event that names a cause."""
    out = []
    events = list(events)
    # An OOM logged with "EngineCore failed to start" happened while loading weights or
    # profiling, not under traffic: the batch and the allocator are not the suspects.
    startup = any(ev.kind is LogEventKind.STARTUP_FAILED for ev in events)
    for ev in events:
        if ev.kind is LogEventKind.CUDA_OOM and startup:
            out.append(classify_startup_oom(ev, signals))
        elif ev.kind is LogEventKind.CUDA_OOM:
            out.append(classify_oom(ev, signals))
        else:
            found = _memory_log_evidence(ev) or _failure_log_evidence(ev)
            if found is not None:
                out.append(found)
    return out


def _memory_log_evidence(ev: LogEvent) -> Evidence | None:
    """A log event that says the memory does not suffice (but a CUDA OOM: classified above)."""
    if ev.kind is LogEventKind.NO_KV_CACHE_MEMORY:
        return Evidence(
            Cause.MODEL_DOES_NOT_FIT,
            "log:no_kv_cache_memory",
            "weights and activations leave no room for a KV cache at this gpu_memory_utilization "
            "(a lower one only makes it worse): raise it, lower max_num_batched_tokens, or use a "
            "smaller or quantized model",
            unambiguous=True,
        )
    if ev.kind is LogEventKind.EXTERNAL_WEIGHTS_EXCEED_BUDGET:
        held = _detail(ev, "external_weights_bytes")
        budget = _detail(ev, "requested_bytes")
        util = dict(ev.details).get("gpu_memory_utilization", "its")
        return Evidence(
            Cause.MODEL_DOES_NOT_FIT,
            f"log:{ev.kind.value}",
            f"the weights vLLM's weight-cache daemon (vllm preload) holds, "
            f"{_gib_text(held)}, exceed the whole budget at gpu_memory_utilization "
            f"{util} ({_gib_text(budget)}) they are subtracted from: raise --gpu-memory-utilization "
            "(the weights are on the card already), or cache a smaller or quantized model",
            unambiguous=True,
        )
    if ev.kind is LogEventKind.FREE_MEMORY_BELOW_UTILIZATION:
        return Evidence(
            Cause.GPU_MEMORY_OVERCOMMIT, f"log:{ev.kind.value}", _quote(ev), unambiguous=True
        )
    if ev.kind is LogEventKind.NON_TORCH_OOM:
        return Evidence(
            Cause.GPU_MEMORY_OVERCOMMIT,
            "log:non_torch_oom",
            "a CUDA allocation outside PyTorch failed (cuBLAS/NCCL workspace): too little headroom",
            unambiguous=True,
        )
    if ev.kind is LogEventKind.MAX_SEQ_LEN_EXCEEDS_KV:
        return Evidence(
            Cause.KV_CACHE_BLOWOUT, f"log:{ev.kind.value}", _quote(ev), unambiguous=True
        )
    return None


def _failure_log_evidence(ev: LogEvent) -> Evidence | None:
    """A log event that says the GPU or the engine failed."""
    if ev.kind is LogEventKind.GPU_HARDWARE_ERROR:
        return Evidence(
            Cause.GPU_HARDWARE_FAULT, "log:gpu_hardware_error", _quote(ev), unambiguous=True
        )
    if ev.kind is LogEventKind.WATCHDOG_DUMP:
        # Hang evidence, not proof: a watchdog timeout shorter than the engine's idle feed
        # (5 s) also fires while idle, and the engine may recover. The stall signal or the
        # gate corroborates it.
        return Evidence(
            Cause.ENGINE_DEAD,
            f"log:{ev.kind.value}",
            "vLLM's hang watchdog saw no progress for its timeout and dumped every "
            f"thread's stack to {dict(ev.details).get('dump_file', 'its dump file')}",
        )
    if ev.kind in _DEATH_KINDS:
        return Evidence(Cause.ENGINE_DEAD, f"log:{ev.kind.value}", _quote(ev), unambiguous=True)
    return None


def evidence_from_allocator(
    records: Iterable[AllocatorStats],
    fragmented_ratio: float = 0.30,
    min_reserved_bytes: int = GIB,
) -> list[Evidence]:
    """The in-vLLM plugin's records (live, or the ``allocator/*.json`` files of a bundle read
    with ``allocator_format.decode``) as evidence for ``allocator_fragmentation``.

    * inactive-split / reserved above ``fragmented_ratio`` (the VllmAllocatorFragmented
      threshold) on a GPU where at least ``min_reserved_bytes`` is reserved;
    * any cudaMalloc retries: the cache had to be flushed to satisfy an allocation;
    * allocator OOMs while fragmented.

    Each is one independent item, so fragmentation with retries is actionable; none of them
    alone is unambiguous (a snapshot of counters says what the cache looks like, not that it
    caused a failure).
    """
    recs = list(records)

    def gib(v: int) -> str:
        return f"{v / GIB:.2f} GiB"

    out: list[Evidence] = []
    fragmented = [
        r
        for r in recs
        if r.reserved_bytes >= min_reserved_bytes
        and (r.fragmentation_ratio or 0.0) > fragmented_ratio
    ]
    if fragmented:
        w = max(fragmented, key=lambda r: r.fragmentation_ratio or 0.0)
        out.append(
            Evidence(
                Cause.ALLOCATOR_FRAGMENTATION,
                "allocator:fragmented",
                f"pid {w.pid} GPU {w.device}: {w.fragmentation_ratio or 0.0:.0%} of the "
                f"{gib(w.reserved_bytes)} torch reserved is stranded in split blocks "
                f"({gib(w.unallocated_bytes)} reserved but unallocated, "
                f"PYTORCH_CUDA_ALLOC_CONF={w.alloc_conf or 'unset'})",
            )
        )
    retries = sum(r.alloc_retries for r in recs)
    if retries > 0:
        out.append(
            Evidence(
                Cause.ALLOCATOR_FRAGMENTATION,
                "allocator:retries",
                f"{retries} cudaMalloc retries in {len({r.pid for r in recs if r.alloc_retries})} "
                "process(es): the cache was flushed to satisfy allocations",
            )
        )
    ooms = sum(r.ooms for r in fragmented)
    if ooms > 0:
        out.append(
            Evidence(
                Cause.ALLOCATOR_FRAGMENTATION,
                "allocator:ooms",
                f"{ooms} allocator OOMs in process(es) whose cache is fragmented",
            )
        )
    return out


def rank(evidence: Sequence[Evidence]) -> tuple[Finding, ...]:
    """Group evidence by cause, most convincing first. ``prefix_cache_waste`` never ranks.

    A dead engine is *what* happened; a memory failure logged alongside is *why*. When an OOM
    line is among the evidence, the engine-death evidence joins the OOM's cause instead of
    competing with it, so the lever that fixes the cause is the one chosen.
    """
    by_cause: dict[Cause, list[Evidence]] = {}
    root = [e for e in evidence if e.name in _OOM_NAMES]
    oom = min(root, key=lambda e: _specificity(e.cause)).cause if root else None
    for e in evidence:
        if not cause_spec(e.cause).verdict:
            continue
        cause = oom if (oom is not None and e.cause is Cause.ENGINE_DEAD) else e.cause
        by_cause.setdefault(cause, []).append(e)
    findings = []
    for cause, items in by_cause.items():
        miss = 1.0
        for e in items:
            miss *= 1.0 - (0.9 if e.unambiguous else 0.5) * min(e.weight, 1.0)
        own_first = sorted(items, key=lambda e: (e.cause is not cause, not e.unambiguous))
        findings.append(Finding(cause, round(1.0 - miss, 4), tuple(own_first)))
    findings.sort(key=lambda f: (-f.confidence, _specificity(f.cause)))
    return tuple(findings)


def verdict(findings: Sequence[Finding]) -> Cause:
    return findings[0].cause if findings else Cause.HEALTHY


def actionable(finding: Finding) -> bool:
    """Enough to justify a destructive action: one unambiguous item or two independent ones."""
    return any(e.unambiguous for e in finding.evidence) or finding.independent >= 2


# --- classifying everything `diagnose` observed (live or from a bundle) ---------------------
#
# The policy classifies from alerts that have held for their `for_seconds`; a diagnosis has a
# few seconds of scrapes plus the journal, so it reads the signals directly, with thresholds
# taken from the default rules (vllm_guardian/defaults/rules.yaml) where one exists.

# XIDs that need a GPU reset (the same set as the VllmGpuResetRequired rule).
RESET_CLASS_XIDS = frozenset({48, 79, 95, 119})
_XID_NAMES = {
    13: "graphics engine exception (an application fault)",
    31: "GPU memory page fault (an application fault)",
    43: "GPU stopped processing (an application fault)",
    48: "double-bit ECC error",
    63: "ECC page retirement / row remapping event",
    64: "ECC page retirement / row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
}
LOW_PREFIX_HIT_RATIO = 0.3  # a note only (a low hit rate is harmless), no rule reads it


@dataclass(frozen=True)
class Thresholds:
    """The numbers a diagnosis reads its instant signals against. They come from the same rule
    set the daemon evaluates (:func:`thresholds_from_rules`: the shipped rules with the
    operator's ``rules_file`` on top), read in an instant mode: a diagnosis has seconds of
    scrapes, so a rule's ``for_seconds`` is not waited for (the report says so). The defaults
    are the shipped rules' own values, for callers without a rule set."""

    kv_full_ratio: float = 0.90  # VllmKvCacheSaturated (and the gate's high watermark)
    preemptions_per_second: float = 0.5  # VllmPreemptionRateHigh
    waiting_long: float = 100.0  # VllmWaitingQueueLong
    other_processes_bytes: float = 256 * 1024**2  # VllmGpuSharedWithOtherProcess
    over_budget_bytes: float = GIB  # VllmGpuMemoryOverBudget
    headroom_low_bytes: float = GIB  # VllmGpuHeadroomLow
    source: str = "the shipped rules"


# Which rule's threshold each number is: (signal the rule reads, the field above).
_RULE_THRESHOLDS = (
    ("kv_cache_usage_ratio", "kv_full_ratio"),
    ("preemptions_per_second", "preemptions_per_second"),
    ("requests_waiting", "waiting_long"),
    ("other_processes_memory_bytes", "other_processes_bytes"),
    ("memory_over_budget_bytes", "over_budget_bytes"),
    ("headroom_bytes", "headroom_low_bytes"),
)


def thresholds_from_rules(rules: Sequence[Rule], source: str) -> Thresholds:
    """The instant thresholds of this rule set; a signal without a rule keeps the shipped value
    (the lowest threshold wins where several rules read one signal, as the first to fire)."""
    values: dict[str, float] = {}
    for signal, name in _RULE_THRESHOLDS:
        found = [r.threshold for r in rules if r.signal == signal]
        if found:
            values[name] = max(found) if signal == "headroom_bytes" else min(found)
    return replace(Thresholds(), source=source, **values)


_OOM_PROCESS = re.compile(r"Process (\d+) has ([\d.]+) (GiB|MiB|KiB) memory in use")
_UNIT_BYTES = {"GiB": GIB, "MiB": 1024**2, "KiB": 1024}


@dataclass(frozen=True)
class Observations:
    """What a diagnosis saw of one service, already reduced (no I/O happens here)."""

    signals: ServiceSignals | None
    scrapes: int = 0  # /metrics scrapes that answered
    observed_seconds: float = 0.0  # from the first scrape to the last
    log_events: tuple[LogEvent, ...] = ()  # from the journal, oldest first
    health_status_code: int | None = None
    unit_active_state: str | None = None
    unit_result: str | None = None
    exec_main_status: int | None = None
    n_restarts: int | None = None
    xid_events: tuple[tuple[int, int], ...] = ()  # (gpu, xid)
    # Evidence computed elsewhere from the same observation (e.g. the allocator plugin's records).
    extra_evidence: tuple[Evidence, ...] = ()
    budget: KvBudget | None = None
    model_fits: bool | None = None  # None: no model config to tell
    p95_request_tokens: float | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)


@dataclass(frozen=True)
class Classification:
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]  # what was looked at and found harmless, or could not be seen

    @property
    def verdict(self) -> Cause:
        return verdict(self.findings)


def _gib_text(v: float | None) -> str:
    return "?" if v is None else f"{v / GIB:.1f} GiB"


def oom_other_processes_bytes(event: LogEvent) -> int:
    """Memory of the other processes an OOM message names ("Process N has X GiB memory in use")."""
    return sum(
        int(float(m.group(2)) * _UNIT_BYTES[m.group(3)])
        for m in _OOM_PROCESS.finditer(event.message)
    )


def dedupe_events(events: Iterable[LogEvent]) -> tuple[LogEvent, ...]:
    """One event per incident: vLLM prints an OOM in the worker and again in EngineCore, and an
    EngineDeadError per request. The key is the kind and, for OOMs, the size asked for."""
    seen: set[tuple[LogEventKind, str | None]] = set()
    out = []
    for ev in events:
        tried = dict(ev.details).get("tried_bytes") if ev.kind is LogEventKind.CUDA_OOM else None
        if (ev.kind, tried) not in seen:
            seen.add((ev.kind, tried))
            out.append(ev)
    return tuple(out)


def evidence_from_signals(
    sig: ServiceSignals, observed_seconds: float, th: Thresholds | None = None
) -> tuple[list[Evidence], list[str]]:
    """Instant readings of the derived signals as evidence, and notes on what is harmless."""
    th = th or Thresholds()
    ev: list[Evidence] = []
    notes: list[str] = []
    _kv_readings(sig, observed_seconds, th, ev, notes)
    if sig.stalled:
        ev.append(
            Evidence(
                Cause.ENGINE_DEAD,
                "stalled",
                f"{(sig.requests_waiting or 0) + (sig.requests_running or 0):.0f} requests in the "
                f"engine and no progress for {sig.stall_seconds or 0:.0f} s (no token counted, "
                "no KV block taken or freed, no preemption): hung",
                unambiguous=True,
            )
        )
    if sig.input_hung:
        ev.append(
            Evidence(
                Cause.ENGINE_INPUT_HANG,
                "input_hung",
                f"a request sent to vLLM has had no answer for {sig.unreached_seconds or 0:.0f} s "
                "and the engine reported nothing running or waiting all that time: the requests "
                "never reached its scheduler",
                unambiguous=True,
            )
        )
    others = sig.other_processes_memory_bytes
    if others is not None and others > th.other_processes_bytes:
        ev.append(
            Evidence(
                Cause.GPU_MEMORY_OVERCOMMIT,
                "gpu:other_processes",
                f"other processes hold {_gib_text(others)} on the service's GPUs, memory "
                "vLLM's reservation planned with",
            )
        )
    over = sig.memory_over_budget_bytes
    if over is not None and over > th.over_budget_bytes:
        ev.append(
            Evidence(
                Cause.ALLOCATOR_FRAGMENTATION,
                "gpu:over_budget",
                f"vLLM holds {_gib_text(over)} beyond its gpu_memory_utilization budget "
                f"({_gib_text(sig.memory_budget_bytes)}): memory grew after start-up",
            )
        )
    if sig.headroom_bytes is not None and sig.headroom_bytes < th.headroom_low_bytes:
        notes.append(
            f"only {_gib_text(sig.headroom_bytes)} free on the service's GPUs: "
            "the next large allocation may OOM"
        )
    hit = sig.prefix_cache_hit_ratio
    if hit is not None and hit < LOW_PREFIX_HIT_RATIO:
        notes.append(
            f"prefix-cache hit rate {100 * hit:.0f} %: harmless (unused cached blocks are evicted "
            "on demand; measured on vLLM 0.32), not a reason to disable it"
        )
    return ev, notes


def _kv_readings(
    sig: ServiceSignals,
    observed_seconds: float,
    th: Thresholds,
    ev: list[Evidence],
    notes: list[str],
) -> None:
    """The KV pool's readings (part of :func:`evidence_from_signals`): a full pool that
    thrashes is evidence, one that queues is a note."""
    kv = sig.kv_cache_usage_ratio
    waiting = sig.requests_waiting
    pre = sig.preemptions_per_second
    span = f"{observed_seconds:.0f} s" if observed_seconds else "one scrape"
    full = kv is not None and kv >= th.kv_full_ratio
    if full and pre is not None and pre > th.preemptions_per_second:
        assert kv is not None
        ev.append(
            Evidence(
                Cause.CONCURRENCY_OVERCOMMIT,
                "kv:preemption_thrash",
                f"KV pool {100 * kv:.0f} % full and {pre:.2f} preemptions/s over {span}: "
                "the pool cannot host the sequences admitted",
            )
        )
        # A queue behind a thrashing pool is a second, independent reading of the same cause.
        if waiting is not None and waiting > 0:
            long = f" (> {th.waiting_long:.0f}: not draining)" if waiting > th.waiting_long else ""
            ev.append(
                Evidence(
                    Cause.CONCURRENCY_OVERCOMMIT,
                    "kv:queue",
                    f"{waiting:.0f} requests waiting{long} while running ones are preempted",
                )
            )
    elif full:
        assert kv is not None
        notes.append(
            f"KV pool {100 * kv:.0f} % full with {waiting or 0:.0f} waiting but "
            + ("no preemption" if pre is not None else "no preemption rate yet (one scrape)")
            + ": healthy queueing, admission is doing its job"
        )


def evidence_from_xids(xids: Sequence[tuple[int, int]]) -> tuple[list[Evidence], list[str]]:
    """Reset-class XIDs are unambiguous hardware faults; others are notes (application faults)."""
    ev: list[Evidence] = []
    notes: list[str] = []
    counts: dict[tuple[int, int], int] = {}
    for key in xids:
        counts[key] = counts.get(key, 0) + 1
    for (gpu, xid), n in sorted(counts.items()):
        what = _XID_NAMES.get(xid, "see NVIDIA's XID catalogue")
        times = f" ×{n}" if n > 1 else ""
        if xid in RESET_CLASS_XIDS:
            ev.append(
                Evidence(
                    Cause.GPU_HARDWARE_FAULT,
                    f"xid:{gpu}:{xid}",
                    f"GPU {gpu} reported XID {xid}{times} ({what}): it needs a GPU reset, "
                    "restarting vLLM would crash-loop",
                    unambiguous=True,
                )
            )
        else:
            notes.append(
                f"GPU {gpu} reported XID {xid}{times} ({what}): not a reset-class hardware fault"
            )
    return ev, notes


def evidence_from_budget(
    budget: KvBudget | None, model_fits: bool | None, p95_request_tokens: float | None
) -> tuple[list[Evidence], list[str]]:
    """The KV budget as evidence: a model that cannot fit, a max_model_len the pool cannot hold."""
    ev: list[Evidence] = []
    notes: list[str] = []
    b = budget
    if b is None:
        return ev, notes
    if model_fits is False:
        ev.append(
            Evidence(
                Cause.MODEL_DOES_NOT_FIT,
                "budget:model_does_not_fit",
                f"{b.model}: {_gib_text(b.weights_bytes_per_gpu)} of weights per GPU "
                f"(TP {b.tensor_parallel_size}) plus minimal activations and KV exceed "
                f"{MIN_DEPLOY_UTILIZATION:.0%} of the {_gib_text(b.gpu_memory_total_bytes)} card: "
                "no memory flag saves it",
                unambiguous=True,
            )
        )
        return ev, notes
    if b.kv_pool_bytes <= 0 or not b.fits_one_request:
        ev.append(
            Evidence(
                Cause.KV_CACHE_BLOWOUT,
                "budget:max_model_len_exceeds_pool",
                f"max_model_len {b.max_model_len:,} needs "
                f"{_gib_text(b.max_model_len * b.kv_bytes_per_token)} of KV but the pool "
                f"({b.kv_pool_source}) holds {b.pool_tokens:,} tokens "
                f"({_gib_text(max(0, b.kv_pool_bytes))}): vLLM refuses to start",
                unambiguous=b.kv_pool_source != "estimated",
            )
        )
    elif b.max_concurrency_at_max_model_len < 2:
        p95 = p95_request_tokens
        if p95 is not None and p95 * 4 <= b.max_model_len:
            ev.append(
                Evidence(
                    Cause.KV_CACHE_BLOWOUT,
                    "budget:few_max_length_sequences",
                    f"the pool holds {b.max_concurrency_at_max_model_len:.2f} sequences of "
                    f"max_model_len {b.max_model_len:,} while requests are {p95:,.0f} tokens "
                    "at p95",
                    weight=0.5,
                )
            )
        else:
            notes.append(
                f"the pool holds only {b.max_concurrency_at_max_model_len:.2f} sequences of "
                f"max_model_len {b.max_model_len:,}"
            )
    return ev, notes


def _unit_evidence(obs: Observations) -> list[Evidence]:
    ev: list[Evidence] = []
    if obs.health_status_code in (500, 503):
        ev.append(
            Evidence(
                Cause.ENGINE_DEAD,
                "health:engine_dead",
                f"GET /health answered {obs.health_status_code}: the engine is dead",
                unambiguous=True,
            )
        )
    state = obs.unit_active_state
    down = ("failed", "inactive", "activating", "deactivating")
    if state in down and obs.health_status_code != 200:
        restarts = f", {obs.n_restarts} restart(s)" if obs.n_restarts else ""
        status = f", exit status {obs.exec_main_status}" if obs.exec_main_status is not None else ""
        ev.append(
            Evidence(
                Cause.ENGINE_DEAD,
                "unit:not_running",
                f"the unit is {state} (result {obs.unit_result or '?'}{status}{restarts}) "
                "and vLLM does not answer",
            )
        )
    return ev


def classify(obs: Observations) -> Classification:
    """Every cause with evidence, ranked, and notes. The verdict is never prefix_cache_waste."""
    notes: list[str] = []
    sig = obs.signals
    events = dedupe_events(obs.log_events)
    # Another tenant named in an OOM message counts like one NVML shows.
    named = max((oom_other_processes_bytes(e) for e in events), default=0)
    log_sig = sig
    if named and (sig is None or (sig.other_processes_memory_bytes or 0) < named):
        base = sig or ServiceSignals("", None, None, False, None)
        log_sig = replace(base, other_processes_memory_bytes=named)
    evidence = evidence_from_logs(events, log_sig)
    if obs.model_fits is False:
        # Every memory failure of a model that cannot fit is that, whatever its line says.
        evidence = [
            replace(
                e,
                cause=Cause.MODEL_DOES_NOT_FIT,
                sentence=f"{e.sentence.split(':')[0]}: the model does not fit the card",
            )
            if cause_spec(e.cause).explained_by_misfit
            else e
            for e in evidence
        ]
    if sig is not None:
        more, n = evidence_from_signals(sig, obs.observed_seconds, obs.thresholds)
        evidence += more
        notes += n
    more, n = evidence_from_xids(obs.xid_events)
    evidence += more
    notes += n
    more, n = evidence_from_budget(obs.budget, obs.model_fits, obs.p95_request_tokens)
    evidence += more
    notes += n
    evidence += _unit_evidence(obs)
    evidence += obs.extra_evidence
    health = sig.health_state if sig is not None else None
    if obs.health_status_code in (500, 503):
        health = HealthState.ENGINE_DEAD
    structure = Structure(
        health=health,
        unit_active_state=obs.unit_active_state,
        stalled=bool(sig is not None and (sig.stalled or sig.input_hung)),
        reset_class_xid=any(x in RESET_CLASS_XIDS for _, x in obs.xid_events),
    )
    kept = corroborated(evidence, structural_failures(structure))
    held = sorted({e.name for e in evidence if e not in kept})
    if held:
        notes.append(
            f"vLLM's log says {', '.join(held)}, but /health, the unit and the GPUs show no "
            "failure: log lines alone name no cause (a request's text can reach the log)"
        )
    evidence = kept
    if (
        obs.unit_active_state in ("inactive", "failed")
        and obs.exec_main_status == 0
        and any(e.cause is Cause.ENGINE_DEAD for e in evidence)
    ):
        notes.append(
            "vLLM exited with status 0 after its engine died: Restart=on-failure never fires; "
            "use Restart=always (or let the guardian restart it)"
        )
    if sig is not None and not sig.metrics_up:
        notes.append("no /metrics scrape: KV and queue signals unknown")
    return Classification(rank(evidence), tuple(notes))
