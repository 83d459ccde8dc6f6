"""The GPU check's verdicts and its report: pure functions of what the steps measured.

Where it sits: :mod:`vllm_guardian.gpucheck.steps` measures on the card and hands each step's
numbers (the ``*Measured`` records) to its ``judge_*`` function here; :func:`render_markdown`
and :func:`to_json` write what ``scripts/gpu-check`` leaves in its output directory. No I/O, no
clock, no torch: CI tests every verdict from numbers, so the check's logic is right the first
time it meets a card.

Every threshold below is a named constant with the reason for its value, and every verdict
carries the numbers it was reached from.
"""

from __future__ import annotations

import enum
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_guardian.formats.allocator_format import STATS_KEYS, AllocatorStats
from vllm_guardian.model import Cause, LogEventKind

SCHEMA = "vllm-guardian.gpu-check/1"
GIB = 1 << 30
MIB = 1 << 20

# A CUDA context with cuBLAS/cuDNN not loaded costs a few hundred MiB on Hopper with lazy
# module loading; NVML counts it in the process's memory. More than this above what the
# process holds means the attribution is wrong, not the context.
CONTEXT_OVERHEAD_MAX_BYTES = 2 * GIB
# NVML's total and CUDA's total are read from the same driver; 1 % covers the driver's own
# reservation that one reports and the other does not.
TOTALS_AGREE_RATIO = 0.01
# torch prints sizes with two decimals of the largest unit (GiB here): 0.005 GiB ≈ 5 MiB of
# rounding, so a parse within 16 MiB (or 0.5 %) is exact for all we use it for.
SIZE_PARSE_SLACK_BYTES = 16 * MIB
SIZE_PARSE_SLACK_RATIO = 0.005
# A forecast is useful when it says "in about N s" within a quarter of the time actually left
# at the moment it spoke; the policy acts on ``seconds_latest``, its bound.
FORECAST_ERROR_RATIO = 0.25
# The NVML source runs once per tick (2 s by default): a tenth of a tick for its p99 leaves the
# tick for everything else.
COST_SHARE_OF_TICK = 0.1


class Verdict(enum.StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    FAIL = "fail"  # the premise does not hold on this card: the note says what differed
    NOT_APPLICABLE = "n/a"  # this card or host cannot show it (said why)
    ERROR = "error"  # the step could not run to a verdict (its error is kept)


@dataclass(frozen=True)
class StepResult:
    name: str
    verdict: Verdict
    summary: str  # one line for the table
    numbers: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    seconds: float | None = None  # how long the step ran (filled by the runner)

    def failed(self) -> bool:
        return self.verdict in (Verdict.FAIL, Verdict.ERROR)


def errored(name: str, error: str, numbers: Mapping[str, Any] | None = None) -> StepResult:
    return StepResult(name, Verdict.ERROR, error, dict(numbers or {}))


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


# --- NVML source ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmlMeasured:
    nvml_total_bytes: int | None
    nvml_used_before_bytes: int | None
    nvml_used_during_bytes: int | None
    torch_total_bytes: int
    held_bytes: int
    child_pid: int
    pid_visible: bool  # the child's pid is in NVML's process list for the card
    process_used_bytes: int | None  # what NVML attributes to it
    ancestors_include_parent: bool | None  # /proc attribution reached the check's own pid
    process_name: str | None
    other_pids: tuple[int, ...] = ()  # pids NVML listed that are not the child (a namespace?)


def judge_nvml(m: NvmlMeasured, parent_pid: int) -> StepResult:
    numbers = asdict(m) | {"parent_pid": parent_pid}
    notes: list[str] = []
    if m.nvml_total_bytes is None:
        return StepResult("nvml_source", Verdict.FAIL, "NVML gave no total memory", numbers)
    gap = abs(m.nvml_total_bytes - m.torch_total_bytes)
    numbers["totals_gap_bytes"] = gap
    ok_total = gap <= TOTALS_AGREE_RATIO * m.torch_total_bytes
    if not ok_total:
        notes.append(f"NVML total {_gib(m.nvml_total_bytes)} vs CUDA's {_gib(m.torch_total_bytes)}")
    delta = (
        m.nvml_used_during_bytes - m.nvml_used_before_bytes
        if m.nvml_used_during_bytes is not None and m.nvml_used_before_bytes is not None
        else None
    )
    numbers["device_used_delta_bytes"] = delta
    if m.pid_visible:
        used = m.process_used_bytes
        ok = used is not None and m.held_bytes <= used <= m.held_bytes + CONTEXT_OVERHEAD_MAX_BYTES
        if used is not None:
            numbers["context_overhead_bytes"] = used - m.held_bytes
        if m.ancestors_include_parent is False:
            ok = False
            notes.append("/proc attribution did not reach the check's pid from the child's")
        how = f"pid {m.child_pid} seen holding {_gib(used)} (held {_gib(m.held_bytes)})"
    else:
        ok = (
            delta is not None and m.held_bytes <= delta <= m.held_bytes + CONTEXT_OVERHEAD_MAX_BYTES
        )
        how = (
            f"per-process pids not visible (NVML listed {list(m.other_pids) or 'none'}): by "
            f"device, used grew {_gib(delta)} for {_gib(m.held_bytes)} held"
        )
        notes.append(
            "NVML's pids are not this namespace's: set services[].gpu_memory_by_device: true "
            "(the guardian then attributes the whole card to the service)"
        )
    verdict = Verdict.PASS if ok and ok_total else Verdict.FAIL
    return StepResult("nvml_source", verdict, how, numbers, tuple(notes))


# --- the allocator plugin ---------------------------------------------------------------------


@dataclass(frozen=True)
class FragmentRun:
    """One run of the fragmenting workload under one allocator setting."""

    label: str  # "default", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
    alloc_conf: str | None
    stats: Mapping[str, int]  # torch.cuda.memory_stats() in the process, right after publishing
    record: AllocatorStats | None  # what the guardian's allocator source read from the plugin
    source_error: str | None
    expandable_in_use: bool | None
    during: Mapping[str, int]  # stats at the end of the burst
    after: Mapping[str, int]  # after most of it was freed
    big_request_bytes: int
    big_request_grew_reserved_bytes: int

    @property
    def peak_overhead_bytes(self) -> int:
        """Reserved beyond what was ever allocated at the peak: what the cache needed on top."""
        return max(
            0,
            self.during["reserved_bytes.all.peak"] - self.during["allocated_bytes.all.peak"],
        )

    @property
    def stranded_after_bytes(self) -> int:
        return max(
            0,
            self.after["reserved_bytes.all.current"] - self.after["allocated_bytes.all.current"],
        )


def plugin_mismatches(run: FragmentRun) -> list[str]:
    """Fields where the plugin's record (as the guardian read it) differs from torch's own."""
    if run.record is None:
        return [f"the guardian's allocator source read no record ({run.source_error})"]
    out = []
    for key, name in STATS_KEYS.items():
        mine = getattr(run.record, name)
        theirs = run.stats.get(key)
        if mine != theirs:
            out.append(f"{name}: plugin {mine}, torch {theirs}")
    if run.alloc_conf is not None and run.record.alloc_conf != run.alloc_conf:
        out.append(f"alloc_conf: plugin {run.record.alloc_conf!r}, process {run.alloc_conf!r}")
    return out


def judge_plugin(runs: Sequence[FragmentRun]) -> StepResult:
    numbers: dict[str, Any] = {}
    notes: list[str] = []
    for r in runs:
        bad = plugin_mismatches(r)
        numbers[r.label] = {
            "mismatches": bad,
            "reserved_bytes": r.stats.get("reserved_bytes.all.current"),
            "inactive_split_bytes": r.stats.get("inactive_split_bytes.all.current"),
            "alloc_retries": r.stats.get("num_alloc_retries"),
            "segments": r.stats.get("segment.all.current"),
        }
        notes += [f"{r.label}: {b}" for b in bad]
    if not runs:
        return StepResult("allocator_plugin", Verdict.ERROR, "no workload run finished", numbers)
    if notes:
        return StepResult(
            "allocator_plugin",
            Verdict.FAIL,
            f"the plugin's figures differ from torch's in {len(notes)} place(s)",
            numbers,
            tuple(notes),
        )
    return StepResult(
        "allocator_plugin",
        Verdict.PASS,
        f"{len(runs)} runs: every published field equals torch.cuda.memory_stats() "
        f"({len(STATS_KEYS)} fields, read back through the guardian's allocator source)",
        numbers,
    )


def judge_expandable(runs: Sequence[FragmentRun]) -> StepResult:
    """The fragmentation lever's premise: with expandable segments the same workload strands
    less (the cache needs less on top of what it hands out)."""
    by = {r.label: r for r in runs}
    base = by.get("default")
    if base is None:
        return StepResult("expandable_segments", Verdict.ERROR, "the default run did not finish")
    numbers: dict[str, Any] = {}
    notes: list[str] = []
    for r in runs:
        numbers[r.label] = {
            "alloc_conf": r.alloc_conf,
            "expandable_in_use": r.expandable_in_use,
            "peak_overhead_bytes": r.peak_overhead_bytes,
            "reserved_peak_bytes": r.during["reserved_bytes.all.peak"],
            "allocated_peak_bytes": r.during["allocated_bytes.all.peak"],
            "inactive_split_peak_bytes": r.during["inactive_split_bytes.all.peak"],
            "stranded_after_bytes": r.stranded_after_bytes,
            "big_request_bytes": r.big_request_bytes,
            "big_request_grew_reserved_bytes": r.big_request_grew_reserved_bytes,
        }
    others = [r for r in runs if r.label != "default"]
    if not others:
        return StepResult(
            "expandable_segments", Verdict.ERROR, "no expandable-segments run finished", numbers
        )
    ok = True
    parts = []
    for r in others:
        if r.expandable_in_use is False:
            ok = False
            notes.append(f"{r.label}={r.alloc_conf!r} did not make segments expandable")
        ratio = (
            r.peak_overhead_bytes / base.peak_overhead_bytes
            if base.peak_overhead_bytes > 0
            else None
        )
        numbers[r.label]["peak_overhead_vs_default_ratio"] = ratio
        if r.peak_overhead_bytes >= base.peak_overhead_bytes:
            ok = False
            notes.append(
                f"{r.label}: the cache needed {_gib(r.peak_overhead_bytes)} on top at the peak, "
                f"not less than the default's {_gib(base.peak_overhead_bytes)}"
            )
        parts.append(
            f"{r.label}: {_gib(r.peak_overhead_bytes)}"
            + (f" ({ratio:.2f}×)" if ratio is not None else "")
        )
    summary = (
        f"reserved beyond allocated at the peak: default {_gib(base.peak_overhead_bytes)}; "
        + "; ".join(parts)
    )
    return StepResult(
        "expandable_segments", Verdict.PASS if ok else Verdict.FAIL, summary, numbers, tuple(notes)
    )


def judge_precedence(both_set_expandable: bool | None, which: str) -> StepResult:
    """Which of PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF torch obeys when both are set
    (``which`` says how they were set); informative, so never a failure."""
    if both_set_expandable is None:
        return StepResult(
            "alloc_conf_precedence",
            Verdict.NOT_APPLICABLE,
            "torch's snapshot does not say whether segments are expandable",
        )
    winner = "PYTORCH_ALLOC_CONF" if both_set_expandable else "PYTORCH_CUDA_ALLOC_CONF"
    return StepResult(
        "alloc_conf_precedence",
        Verdict.PASS,
        f"with both set ({which}), torch obeyed {winner}",
        {"expandable_in_use": both_set_expandable, "winner": winner, "setting": which},
    )


# --- a real CUDA OOM through the log matcher --------------------------------------------------


@dataclass(frozen=True)
class OomMeasured:
    exception_type: str
    message: str
    requested_bytes: int
    total_bytes: int
    # per way of logging it ("traceback as the engine core prints it", ...): the kind and
    # details the guardian's matcher gave the first line it matched, or None
    matches: Mapping[str, tuple[LogEventKind, Mapping[str, str]] | None]


def _close(parsed: str | None, truth: int) -> bool:
    if parsed is None:
        return False
    slack = max(SIZE_PARSE_SLACK_BYTES, SIZE_PARSE_SLACK_RATIO * truth)
    return abs(int(parsed) - truth) <= slack


def judge_oom(m: OomMeasured) -> StepResult:
    numbers: dict[str, Any] = {
        "exception_type": m.exception_type,
        "message": m.message,
        "requested_bytes": m.requested_bytes,
        "total_bytes": m.total_bytes,
        "matches": {
            k: (None if v is None else {"kind": v[0].value, **dict(v[1])})
            for k, v in m.matches.items()
        },
    }
    notes = []
    for way, found in m.matches.items():
        if found is None:
            notes.append(f"{way}: no line matched")
            continue
        kind, details = found
        if kind is not LogEventKind.CUDA_OOM:
            notes.append(f"{way}: matched as {kind.value}, not cuda_oom")
            continue
        if not _close(details.get("tried_bytes"), m.requested_bytes):
            notes.append(
                f"{way}: tried_bytes {details.get('tried_bytes')} vs {m.requested_bytes} asked"
            )
        if not _close(details.get("total_bytes"), m.total_bytes):
            notes.append(
                f"{way}: total_bytes {details.get('total_bytes')} vs {m.total_bytes} on the card"
            )
    if not m.matches:
        return StepResult("cuda_oom", Verdict.ERROR, "nothing was matched", numbers)
    verdict = Verdict.FAIL if notes else Verdict.PASS
    summary = (
        f"{m.exception_type} for {_gib(m.requested_bytes)}: named cuda_oom with its sizes in "
        f"{len(m.matches)} of {len(m.matches)} ways vLLM logs it"
        if not notes
        else f"{len(notes)} problem(s) matching torch's OOM text"
    )
    return StepResult("cuda_oom", verdict, summary, numbers, tuple(notes))


# --- a neighbour growing: the exhaustion forecast ---------------------------------------------


@dataclass(frozen=True)
class ForecastPoint:
    time_seconds: float  # monotonic, when the forecast was made
    seconds: float  # predicted time to exhaustion
    seconds_latest: float
    cause: Cause | None
    neighbour_pid: int | None


@dataclass(frozen=True)
class ForecastMeasured:
    start_seconds: float  # monotonic, when the neighbour started growing
    exhausted_seconds: float | None  # monotonic, when its allocation failed; None: it never did
    rate_bytes_per_second: float
    grower_pid: int
    pid_visible: bool
    samples: int
    points: tuple[ForecastPoint, ...]


def judge_forecast(m: ForecastMeasured) -> StepResult:
    numbers: dict[str, Any] = {
        "rate_mib_per_second": m.rate_bytes_per_second / MIB,
        "samples": m.samples,
        "grower_pid": m.grower_pid,
        "exhausted_after_seconds": (
            None if m.exhausted_seconds is None else m.exhausted_seconds - m.start_seconds
        ),
        "forecasts": [
            {
                "at_seconds": p.time_seconds - m.start_seconds,
                "predicted_seconds": p.seconds,
                "latest_seconds": p.seconds_latest,
                "actual_seconds": (
                    None if m.exhausted_seconds is None else m.exhausted_seconds - p.time_seconds
                ),
                "cause": None if p.cause is None else p.cause.value,
                "neighbour_pid": p.neighbour_pid,
            }
            for p in m.points
        ],
    }
    if m.exhausted_seconds is None:
        return StepResult(
            "neighbour_forecast",
            Verdict.ERROR,
            "the neighbour never ran the card out within the step's bound",
            numbers,
        )
    before = [p for p in m.points if p.time_seconds < m.exhausted_seconds]
    if not before:
        return StepResult(
            "neighbour_forecast",
            Verdict.FAIL,
            f"no forecast before the card ran out after "
            f"{m.exhausted_seconds - m.start_seconds:.0f} s ({m.samples} samples)",
            numbers,
        )
    first = before[0]
    actual = m.exhausted_seconds - first.time_seconds
    error = abs(first.seconds - actual)
    numbers |= {
        "first_lead_seconds": actual,
        "first_error_ratio": error / actual if actual else None,
    }
    notes = []
    ok = error <= FORECAST_ERROR_RATIO * actual
    if not ok:
        notes.append(
            f"first forecast said {first.seconds:.0f} s, the card ran out in {actual:.0f} s"
        )
    if m.pid_visible:
        if first.cause is not Cause.GPU_MEMORY_OVERCOMMIT or first.neighbour_pid != m.grower_pid:
            ok = False
            notes.append(
                f"cause {first.cause} / pid {first.neighbour_pid}, expected "
                f"gpu_memory_overcommit naming pid {m.grower_pid}"
            )
    else:
        notes.append("pids not visible: the forecast cannot name the neighbour here")
    summary = (
        f"first forecast {actual:.0f} s ahead: said {first.seconds:.0f} s (bound "
        f"{first.seconds_latest:.0f} s), {first.cause.value if first.cause else 'no cause'}"
    )
    return StepResult(
        "neighbour_forecast", Verdict.PASS if ok else Verdict.FAIL, summary, numbers, tuple(notes)
    )


# --- VRAM release after SIGKILL ---------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseMeasured:
    held_bytes: int
    seconds_to_free: float | None  # until NVML's used fell back to the baseline; None: never
    seconds_pid_gone: float | None  # until the pid left NVML's process list
    bound_seconds: float  # how long the step waited
    timeout_seconds: float  # the guardian's vram_release_timeout_seconds default


def judge_release(m: ReleaseMeasured) -> StepResult:
    numbers = asdict(m)
    if m.seconds_to_free is None:
        return StepResult(
            "vram_release",
            Verdict.FAIL,
            f"{_gib(m.held_bytes)} not free {m.bound_seconds:.0f} s after SIGKILL",
            numbers,
        )
    ok = m.seconds_to_free <= m.timeout_seconds
    return StepResult(
        "vram_release",
        Verdict.PASS if ok else Verdict.FAIL,
        f"{_gib(m.held_bytes)} free {m.seconds_to_free:.2f} s after SIGKILL (the guardian "
        f"waits up to {m.timeout_seconds:.0f} s)",
        numbers,
    )


# --- cost per tick ----------------------------------------------------------------------------


def judge_cost(durations_seconds: Sequence[float], interval_seconds: float) -> StepResult:
    if len(durations_seconds) < 10:
        return StepResult("nvml_cost", Verdict.ERROR, "fewer than 10 collects finished")
    xs = sorted(durations_seconds)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    median = statistics.median(xs)
    numbers = {
        "collects": len(xs),
        "median_ms": median * 1e3,
        "p99_ms": p99 * 1e3,
        "max_ms": xs[-1] * 1e3,
        "interval_seconds": interval_seconds,
        "p99_share_of_tick": p99 / interval_seconds,
    }
    ok = p99 <= COST_SHARE_OF_TICK * interval_seconds
    return StepResult(
        "nvml_cost",
        Verdict.PASS if ok else Verdict.FAIL,
        f"collect: median {median * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms "
        f"({p99 / interval_seconds:.1%} of a {interval_seconds:g} s tick)",
        numbers,
    )


# --- the report -------------------------------------------------------------------------------


def overall(steps: Sequence[StepResult]) -> Verdict:
    if any(s.failed() for s in steps):
        return Verdict.FAIL
    return Verdict.PASS


def exit_code(steps: Sequence[StepResult]) -> int:
    """0: every step that applies passed; 1: one failed or could not run."""
    return 1 if overall(steps) is Verdict.FAIL else 0


def to_json(host: Mapping[str, Any], steps: Sequence[StepResult], meta: Mapping[str, Any]) -> str:
    doc = {
        "schema": SCHEMA,
        **meta,
        "host": dict(host),
        "verdict": overall(steps).value,
        "steps": [
            {
                "name": s.name,
                "verdict": s.verdict.value,
                "summary": s.summary,
                "seconds": s.seconds,
                "notes": list(s.notes),
                "numbers": s.numbers,
            }
            for s in steps
        ],
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(
    host: Mapping[str, Any], steps: Sequence[StepResult], meta: Mapping[str, Any]
) -> str:
    lines = [
        "# vllm-guardian GPU check",
        "",
        f"Verdict: **{overall(steps).value}**"
        + (f" · {meta['command']}" if meta.get("command") else ""),
        "",
        "| | |",
        "|---|---|",
    ]
    for key in (
        "card",
        "uuid",
        "driver",
        "cuda_driver",
        "torch",
        "torch_cuda",
        "capability",
        "memory_total_bytes",
        "started",
        "commit",
    ):
        value = host.get(key, meta.get(key))
        if value is None:
            continue
        shown = _gib(value) if key.endswith("_bytes") and isinstance(value, int) else str(value)
        lines.append(f"| {key} | {_cell(shown)} |")
    lines += ["", "| step | verdict | seconds | what was seen |", "|---|---|---|---|"]
    for s in steps:
        secs = "" if s.seconds is None else f"{s.seconds:.1f}"
        lines.append(f"| {s.name} | {s.verdict.value} | {secs} | {_cell(s.summary)} |")
    for s in steps:
        if not s.notes:
            continue
        lines += ["", f"**{s.name}**:"]
        lines += [f"- {_cell(n)}" for n in s.notes]
    lines += ["", "The numbers behind each verdict are in gpu-check.json."]
    return "\n".join(lines) + "\n"
