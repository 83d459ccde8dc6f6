"""Classifying everything ``vllm-guardian diagnose`` observed, live or from a bundle. Pure.

The policy classifies from alerts that have held for their ``for_seconds``; a diagnosis has a
few seconds of scrapes plus the journal, so it reads the signals directly, with thresholds
taken from the default rules (vllm_guardian/defaults/rules.yaml) where one exists. The log
lines' evidence, their corroboration and the ranking are ``core/diagnosis.py``'s, shared with
the policy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from vllm_guardian.core.alert_rules import Rule
from vllm_guardian.core.alerting import RESET_CLASS_XIDS
from vllm_guardian.core.budget import MIN_DEPLOY_UTILIZATION, KvBudget
from vllm_guardian.core.causes import cause_spec
from vllm_guardian.core.diagnosis import (
    GIB,
    Evidence,
    Finding,
    Structure,
    corroborated,
    evidence_from_logs,
    gib_text,
    rank,
    structural_failures,
    verdict,
)
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import Cause, HealthState, LogEvent, LogEventKind

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
                f"other processes hold {gib_text(others)} on the service's GPUs, memory "
                "vLLM's reservation planned with",
            )
        )
    over = sig.memory_over_budget_bytes
    if over is not None and over > th.over_budget_bytes:
        ev.append(
            Evidence(
                Cause.ALLOCATOR_FRAGMENTATION,
                "gpu:over_budget",
                f"vLLM holds {gib_text(over)} beyond its gpu_memory_utilization budget "
                f"({gib_text(sig.memory_budget_bytes)}): memory grew after start-up",
            )
        )
    if sig.headroom_bytes is not None and sig.headroom_bytes < th.headroom_low_bytes:
        notes.append(
            f"only {gib_text(sig.headroom_bytes)} free on the service's GPUs: "
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
                f"{b.model}: {gib_text(b.weights_bytes_per_gpu)} of weights per GPU "
                f"(TP {b.tensor_parallel_size}) plus minimal activations and KV exceed "
                f"{MIN_DEPLOY_UTILIZATION:.0%} of the {gib_text(b.gpu_memory_total_bytes)} card: "
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
                f"{gib_text(b.max_model_len * b.kv_bytes_per_token)} of KV but the pool "
                f"({b.kv_pool_source}) holds {b.pool_tokens:,} tokens "
                f"({gib_text(max(0, b.kv_pool_bytes))}): vLLM refuses to start",
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
