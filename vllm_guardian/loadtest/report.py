"""The loadtest's output: the live progress line, the readable report, JSON and the PNG chart.

The chart needs matplotlib (the optional extra ``vllm-guardian[loadtest]``); it is imported
only when a chart is asked for, and its absence is a message, not an error.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_guardian.core.signals import ServiceSignals

from .recommend import Verdict
from .results import StepResult
from .runner import RunState, StepRecord

GIB = 1024**3


def _f(v: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if v is None else pattern.format(v)


def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v / GIB:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


Column = tuple[str, Callable[[StepResult], str]]
COLUMNS: tuple[Column, ...] = (
    ("step", lambda r: f"{r.index} {r.label}"),
    ("reqs", lambda r: str(r.requests)),
    ("errs", lambda r: str(r.errors)),
    ("tok/s", lambda r: _f(r.output_tokens_per_second, "{:.0f}")),
    ("ttft p50/p99 ms", lambda r: f"{_ms(r.ttft_p50_seconds)}/{_ms(r.ttft_p99_seconds)}"),
    ("e2e p50/p99 ms", lambda r: f"{_ms(r.e2e_p50_seconds)}/{_ms(r.e2e_p99_seconds)}"),
    ("KV peak", lambda r: _f(r.kv_usage_peak_ratio, "{:.0%}")),
    ("wait max", lambda r: _f(r.requests_waiting_peak, "{:.0f}")),
    ("preempt/s", lambda r: _f(r.preemptions_per_second)),
    ("GPU used GiB", lambda r: _gib(r.gpu_memory_used_peak_bytes)),
    ("free min GiB", lambda r: _gib(r.gpu_headroom_min_bytes)),
    ("result", lambda r: "held" if r.held else ("BROKE" if r.violations else "cut short")),
)


def table(results: Sequence[StepResult]) -> list[str]:
    rows = [[name for name, _ in COLUMNS]] + [[fn(r) for _, fn in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    out = []
    for n, row in enumerate(rows):
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def render(state: RunState, verdict: Verdict) -> str:
    p = state.profile
    ld = p.load
    shape = (
        f"ramp {', '.join(str(c) for c in ld.ramp)}"
        if ld.ramp
        else (f"{ld.rate_per_second:g} req/s" if ld.rate_per_second else f"c={ld.concurrency or 1}")
    )
    prompts = (
        f"prompts from {ld.prompts_file}"
        if ld.prompts_file
        else f"prompts {ld.prompt_tokens_min}-{ld.prompt_tokens_max} tokens"
    )
    lines = [
        f"vllm-guardian loadtest: {state.url} model {state.server.model}",
        f"  load: {shape}, {ld.step_seconds:g} s per step, {prompts}, output "
        f"{ld.output_tokens_min}-{ld.output_tokens_max} tokens, shared prefix "
        f"{ld.shared_prefix_ratio:.0%}, {'streaming' if ld.stream else 'not streaming'}",
        "",
    ]
    if state.results:
        lines += table(state.results)
        for r in state.results:
            for _, message in r.violations:
                lines.append(f"  step {r.index} {r.label}: {message}")
        lines.append("")
    lines.append(verdict.summary)
    best = next((r for r in state.results if r.index == verdict.best_step), None)
    lines.append(
        f"highest step that held every limit: {best.index} {best.label}"
        if best is not None
        else "no step held every limit"
    )
    if verdict.knee_step is not None:
        knee = next(r for r in state.results if r.index == verdict.knee_step)
        lines.append(f"knee (KV pool saturated, preemptions began): step {knee.index} {knee.label}")
    if state.results:
        lines += ["", "recommendation:"]
        for rec in verdict.recommendations:
            value = f" {rec.value}" if rec.value is not None else ""
            lines.append(f"  {rec.action.value:5} {rec.flag}{value}: {rec.reason}")
    if state.source_errors:
        lines += ["", "not watched (source down at the end):"]
        lines += [f"  {k}: {v}" for k, v in sorted(state.source_errors.items())]
    return "\n".join(lines)


def to_json(state: RunState, verdict: Verdict) -> str:
    def plain(x: Any) -> Any:
        return (
            dataclasses.asdict(x) if dataclasses.is_dataclass(x) and not isinstance(x, type) else x
        )

    doc = {
        "url": state.url,
        "model": state.server.model,
        "server_flags": plain(state.server.flags),
        "profile": plain(state.profile),
        "steps": [{**plain(r), "held": r.held} for r in state.results],
        "verdict": plain(verdict),
        "stop_reason": state.stop_reason,
        "interrupted": state.interrupted,
        "sources_down": state.source_errors,
    }
    return json.dumps(doc, indent=2, sort_keys=True, default=str)


def write_chart(results: Sequence[StepResult], path: Path) -> str | None:
    """Throughput and p99 against concurrency, with the KV peak and GPU headroom curves.
    Returns a message when no chart could be made (matplotlib missing, nothing to plot)."""
    pts = [r for r in results if r.concurrency is not None or r.rate_per_second is not None]
    if not pts:
        return "no chart: no step finished"
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return (
            "no chart: matplotlib is not installed (pip install 'vllm-guardian[loadtest]'); "
            "the table above has the same figures"
        )
    matplotlib.use("Agg")  # files only: never open a window
    plt = importlib.import_module("matplotlib.pyplot")
    x = [float(r.concurrency if r.concurrency is not None else r.rate_per_second or 0) for r in pts]
    xlabel = "concurrency" if pts[0].concurrency is not None else "requests/s"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(x, [r.output_tokens_per_second or 0 for r in pts], "o-", label="output tokens/s")
    top.set_ylabel("tokens/s")
    lat = top.twinx()
    lat.plot(x, [r.e2e_p99_seconds for r in pts], "s--", color="tab:red", label="e2e p99 (s)")
    lat.plot(x, [r.ttft_p99_seconds for r in pts], "^--", color="tab:orange", label="TTFT p99 (s)")
    lat.set_ylabel("seconds")
    top.legend(loc="upper left")
    lat.legend(loc="lower right")
    bottom.plot(x, [r.kv_usage_peak_ratio for r in pts], "o-", label="KV usage peak")
    bottom.set_ylabel("KV usage")
    bottom.set_ylim(0, 1.05)
    gpu = bottom.twinx()
    gpu.plot(
        x,
        [
            (r.gpu_headroom_min_bytes or 0) / GIB if r.gpu_headroom_min_bytes is not None else None
            for r in pts
        ],
        "s--",
        color="tab:green",
        label="GPU headroom min (GiB)",
    )
    gpu.set_ylabel("GiB free")
    bottom.set_xlabel(xlabel)
    bottom.legend(loc="upper left")
    gpu.legend(loc="lower right")
    if xlabel == "concurrency" and len(x) > 1 and x[-1] / max(x[0], 1) >= 8:
        bottom.set_xscale("log", base=2)
    fig.suptitle("vllm-guardian loadtest")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


class LiveDisplay:
    """One status line per sample: rewritten in place on a terminal, a line a second in a log."""

    def __init__(self, out: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.out = out
        self.quiet = quiet
        self.tty = out.isatty()
        self._last_line_monotonic = 0.0

    def __call__(self, state: RunState, record: StepRecord, sig: ServiceSignals | None) -> None:
        if self.quiet:
            return
        import time  # noqa: PLC0415 - only the display needs the clock

        now = time.monotonic()
        if not self.tty and now - self._last_line_monotonic < 1.0:
            return
        self._last_line_monotonic = now
        finished, errors = record.counts()
        steps = len(state.profile.steps())
        s = sig
        line = (
            f"step {record.spec.index}/{steps} {record.spec.label} "
            f"{now - record.started_monotonic:5.1f}/{record.spec.duration_seconds:g}s "
            f"done {finished} err {errors} in-flight {record.in_flight} | "
            f"KV {_f(s.kv_cache_usage_ratio if s else None, '{:.0%}')} "
            f"wait {_f(s.requests_waiting if s else None, '{:.0f}')} "
            f"preempt/s {_f(s.preemptions_per_second if s else None)} "
            f"gen tok/s {_f(s.generation_tokens_per_second if s else None, '{:.0f}')} "
            f"free {_gib(s.headroom_bytes if s else None)} GiB"
        )
        if self.tty:
            self.out.write("\r\x1b[K" + line)
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.out.write("\n")
            self.out.flush()
