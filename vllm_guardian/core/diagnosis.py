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
  (:func:`corroborated`, used by the policy and by ``core/observations.classify``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm_guardian.core.causes import cause_spec
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.formats.allocator_format import AllocatorStats
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
            f"{gib_text(held)}, exceed the whole budget at gpu_memory_utilization "
            f"{util} ({gib_text(budget)}) they are subtracted from: raise --gpu-memory-utilization "
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


def gib_text(v: float | None) -> str:
    return "?" if v is None else f"{v / GIB:.1f} GiB"
