"""The diagnosis report: its data, the versioned ``--json`` form and the 80-column text form.

The JSON schema is documented in docs/bundle.md ("The report"). ``schema_version`` changes
only when a field is removed or changes meaning; new fields may appear in any version.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from vllm_guardian.lowio.redact import redact_text
from vllm_guardian.model import Cause

SCHEMA = "vllm-guardian/diagnose"
SCHEMA_VERSION = 1
# A report into a pipe or a file; a terminal gets its own width (diagnose/cli.text_width).
WIDTH = 80
GIB = 1024**3


@dataclass(frozen=True)
class CauseReport:
    id: Cause
    confidence: float
    actionable: bool  # enough for a destructive action (core/diagnosis.actionable)
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class GpuProcessReport:
    pid: int
    name: str | None
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpuReport:
    index: int
    name: str | None
    memory_total_bytes: int | None
    vllm_bytes: int | None
    others: tuple[GpuProcessReport, ...]
    free_bytes: int | None
    budget_bytes: int | None  # gpu_memory_utilization × total: vLLM's planned share


@dataclass(frozen=True)
class FlagChange:
    flag: str
    old: str | None
    new: str  # "" for a switch
    reason: str
    guardian_may_set: bool  # on the guardian's whitelist (actuators/flags.py)


@dataclass(frozen=True)
class EnvChange:
    name: str
    old: str | None
    new: str
    reason: str


@dataclass(frozen=True)
class Recommendation:
    summary: str
    flags: tuple[FlagChange, ...] = ()
    env: tuple[EnvChange, ...] = ()
    actions: tuple[str, ...] = ()  # what to do besides flags (drain, restart, reset the GPU)
    command_line: str | None = None
    env_file: str | None = None


@dataclass(frozen=True)
class Report:
    mode: str  # live | bundle | plan
    origin: str
    service: str
    created: str | None
    verdict: Cause
    causes: tuple[CauseReport, ...]
    notes: tuple[str, ...]
    signals: dict[str, Any]
    kv_budget: dict[str, Any] | None
    vllm_sizing: dict[str, Any] | None
    gpus: tuple[GpuReport, ...]
    recommendation: Recommendation
    problems: tuple[str, ...] = field(default=())

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict is Cause.HEALTHY else 1


def _clean(value: Any) -> Any:
    """JSON-safe: no NaN/Inf, floats rounded so golden files stay readable."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def to_json(r: Report) -> dict[str, Any]:
    top = r.causes[0].confidence if r.causes else None
    doc: dict[str, Any] = _clean(
        {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "mode": r.mode,
            "origin": redact_text(r.origin),  # a URL may carry user:password
            "service": r.service,
            "created": r.created,
            "verdict": r.verdict.value,
            "confidence": top,
            "causes": [
                {
                    "id": c.id.value,
                    "confidence": c.confidence,
                    "actionable": c.actionable,
                    "evidence": list(c.evidence),
                }
                for c in r.causes
            ],
            "notes": list(r.notes),
            "signals": r.signals,
            "kv_budget": r.kv_budget,
            "vllm_sizing": r.vllm_sizing,
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "memory_total_bytes": g.memory_total_bytes,
                    "vllm_bytes": g.vllm_bytes,
                    "other_processes": [
                        {"pid": p.pid, "name": p.name, "used_memory_bytes": p.used_memory_bytes}
                        for p in g.others
                    ],
                    "free_bytes": g.free_bytes,
                    "budget_bytes": g.budget_bytes,
                }
                for g in r.gpus
            ],
            "recommendation": {
                "summary": r.recommendation.summary,
                "flags": [
                    {
                        "flag": f.flag,
                        "old": f.old,
                        "new": f.new,
                        "reason": f.reason,
                        "guardian_may_set": f.guardian_may_set,
                    }
                    for f in r.recommendation.flags
                ],
                "env": [
                    {"name": e.name, "old": e.old, "new": e.new, "reason": e.reason}
                    for e in r.recommendation.env
                ],
                "actions": list(r.recommendation.actions),
                "command_line": r.recommendation.command_line,
                "env_file": r.recommendation.env_file,
            },
            "problems": [redact_text(p) for p in r.problems],
            "exit_code": r.exit_code,
        }
    )
    return doc


# --- text ------------------------------------------------------------------------------------


def gib(v: float | None, digits: int = 1) -> str:
    return "?" if v is None else f"{v / GIB:.{digits}f} GiB"


@dataclass(frozen=True)
class _Para:
    """Text to fill to the width: ``first`` before its first line, ``indent`` before the rest."""

    text: str
    indent: str
    first: str


@dataclass(frozen=True)
class _Verbatim:
    """A line to paste (a line of the environment file): never wrapped."""

    text: str


# A report line: a paragraph, a verbatim line, or a plain line (wrapped under its own indent).
_Line = _Para | _Verbatim | str


def _wrap(text: str, indent: str = "  ", first: str | None = None) -> list[_Line]:
    return [_Para(text, indent, first if first is not None else indent)]


def _lay_out(lines: list[_Line], width: int) -> list[str]:
    """Fill every line to ``width`` at spaces. A word longer than the width (a path, a URL) goes
    whole on a line of its own: cut, it could not be pasted."""
    out: list[str] = []
    for item in lines:
        if isinstance(item, _Verbatim):
            out.append(item.text)
            continue
        if isinstance(item, str):
            lead = item[: len(item) - len(item.lstrip())]
            item = _Para(item.strip(), lead + "    ", lead)
        out += textwrap.wrap(
            item.text,
            width,
            initial_indent=item.first,
            subsequent_indent=item.indent,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [item.first.rstrip()]
    return out


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    return "?" if v is None else fmt.format(v)


def render_text(r: Report, verbose: bool = False, width: int = WIDTH) -> str:
    """The report for a terminal: verdict and fix first, filled to ``width`` columns (the
    terminal's, or 80 into a pipe) without cutting a word, one screen when it can."""
    out: list[_Line] = []
    command = "plan" if r.mode == "plan" else "diagnose"
    head = f"vllm-guardian {command}: {r.service}  ({r.mode}: {redact_text(r.origin)})"
    out += _wrap(head, "  ", "")
    conf = f" ({r.causes[0].confidence:.0%})" if r.causes else ""
    out.append(f"VERDICT: {r.verdict.value}{conf}")
    for c in r.causes:
        out.append(f"  {c.id.value}  {c.confidence:.0%}{'' if c.actionable else '  (weak)'}")
        shown = c.evidence if verbose else c.evidence[:3]
        for e in shown:
            out += _wrap(e, "      ", "    - ")
        if len(c.evidence) > len(shown):
            out.append(f"    … {len(c.evidence) - len(shown)} more (--verbose)")
    for n in r.notes:
        out += _wrap(n, "    ", "  note: ")
    rec = r.recommendation
    out.append("FIX")
    out += _wrap(rec.summary, "  ")
    for f in rec.flags:
        old = f.old if f.old is not None else "(default)"
        arrow = f"{f.flag} {old} -> {f.new or 'on'}"
        out += _wrap(f"{arrow}: {f.reason}", "      ", "  ")
    for env in rec.env:
        out += _wrap(f"{env.name}={env.new}: {env.reason}", "      ", "  ")
    for a in rec.actions:
        out += _wrap(a, "    ", "  * ")
    if rec.command_line:
        out.append("  command line:")
        out += _wrap(rec.command_line, "      ", "    ")
    if rec.env_file:
        out.append("  guardian environment file:")
        out += [
            _Verbatim("    " + line)
            for line in rec.env_file.splitlines()
            if not line.startswith("#")
        ]
    out += _render_budget(r.kv_budget)
    out += _render_gpus(r.gpus)
    s = r.signals
    if s.get("metrics_up"):
        kv = s.get("kv_cache_usage_ratio")
        out.append("VLLM")
        out.append(
            f"  KV {_num(None if kv is None else 100 * kv, '{:.0f}')} %  running "
            f"{_num(s.get('requests_running'))}  waiting {_num(s.get('requests_waiting'))}  "
            f"preempt/s {_num(s.get('preemptions_per_second'), '{:.2f}')}  "
            f"tok/s {_num(s.get('generation_tokens_per_second'), '{:.0f}')}"
            + (
                f"  503/s {_num(s.get('admission_rejections_per_second'), '{:.2f}')}"
                if s.get("admission_rejections_per_second")
                else ""
            )
        )
    if s.get("headroom_exhaustion"):
        out.append("FORECAST (GPU memory exhaustion)")
        for line in s["headroom_exhaustion"]:
            out += _wrap(str(line), "    ", "  ")
    if r.problems:
        out.append("PROBLEMS (partial report)")
        for p in map(redact_text, r.problems if verbose else r.problems[:5]):
            out += _wrap(p, "    ", "  - ")
        if not verbose and len(r.problems) > 5:
            out.append(f"  … {len(r.problems) - 5} more (--verbose)")
    return "\n".join(_lay_out(out, width)) + "\n"


def _render_budget(b: dict[str, Any] | None) -> list[_Line]:
    if not b:
        return []
    out: list[_Line] = ["KV BUDGET" + (f" ({b['model']})" if b.get("model") else "")]
    if b.get("kv_bytes_per_token") is not None:
        out.append(
            f"  {b['kv_bytes_per_token']:,} B/token (TP {b.get('tensor_parallel_size', 1)}, "
            f"{b.get('kv_cache_dtype', 'auto')})  weights {gib(b.get('weights_bytes_per_gpu'))}/GPU"
        )
    if b.get("unknown"):
        return [*out, *_wrap(f"pool unknown: {b['unknown']}", "    ", "  ")]
    pool = b.get("kv_pool_bytes")
    out.append(
        f"  pool {gib(pool)} = {_num(b.get('pool_tokens'))} tokens, "
        f"{_num(b.get('pool_blocks'))} blocks of {_num(b.get('block_size'))}"
        + (f" [{b['kv_pool_source']}]" if b.get("kv_pool_source") else "")
    )
    mml = b.get("max_model_len")
    line = f"  max concurrency {_num(b.get('max_concurrency_at_max_model_len'), '{:.2f}')}x at max_model_len {_num(mml)}"
    if b.get("max_concurrency_at_p95") is not None:
        line += f", {b['max_concurrency_at_p95']:.1f}x at p95 {b['p95_request_tokens']:,.0f}"
    out += _wrap(line, "    ", "")
    fits = b.get("largest_max_model_len") or {}
    if fits:
        parts = [f"{v:,} for {k}" for k, v in fits.items()]
        out += _wrap("largest max_model_len: " + ", ".join(parts), "    ", "  ")
    if b.get("check"):
        out += _wrap(str(b["check"]), "    ", "  ")
    return out


def _render_gpus(gpus: tuple[GpuReport, ...]) -> list[_Line]:
    if not gpus:
        return []
    out: list[_Line] = ["GPU MEMORY"]
    for g in gpus:
        others = sum(p.used_memory_bytes or 0 for p in g.others)
        out.append(
            f"  GPU {g.index} {g.name or ''}: vLLM {gib(g.vllm_bytes)}, others {gib(others)}, "
            f"free {gib(g.free_bytes)} of {gib(g.memory_total_bytes, 0)}; budget {gib(g.budget_bytes)}"
        )
        for p in g.others:
            out.append(f"    pid {p.pid} {p.name or '?'}: {gib(p.used_memory_bytes)}")
    return out
