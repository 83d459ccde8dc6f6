"""What ``vllm-guardian demo`` prints: a screen repainted in a terminal, event lines in a pipe.

The demo's loop (``demo.run_demo``) reads the guardian once a second into a :class:`Frame`, plain
data, and hands it here. In a terminal the whole screen is repainted (:func:`screen`); into a
pipe or a file a repainted screen is a wall of repeated text (2,118 lines for two minutes), so
:class:`EventLog` prints only what changed: vLLM's health, the alerts, the front door, each new
decision (a run of identical ones collapsed with a count) and, every
:data:`STATUS_EVERY_SECONDS`, one status line. Every line is filled to the width given
(:func:`text_width`: the terminal's, or 80 columns into a pipe) at spaces: a word, a number with
its unit or a path is never cut.

No clock and no I/O here: times come in the frame.
"""

from __future__ import annotations

import re
import shutil
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from vllm_guardian.core import policy

WIDTH = 80  # into a pipe or a file, as every tool
# A status line in the event log this often (seconds of the run): a pipe still shows the load
# going on between events.
STATUS_EVERY_SECONDS = 15.0
DECISIONS_SHOWN = 8


def text_width(out: TextIO) -> int:
    """The terminal's width (COLUMNS first) when ``out`` is one, else 80; never under 40."""
    isatty = getattr(out, "isatty", None)
    if isatty is None or not isatty():
        return WIDTH
    return max(40, shutil.get_terminal_size((WIDTH, 24)).columns)


def fill(line: str, width: int, indent: str = "    ") -> list[str]:
    """``line`` filled to ``width`` at spaces; its continuation lines keep its own leading
    spaces plus ``indent``. A word longer than a line (a path, a URL) stands whole on its own."""
    lead = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(
        line.strip(),
        width,
        initial_indent=lead,
        subsequent_indent=lead + indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [""]


def fill_all(lines: Iterable[str], width: int) -> list[str]:
    return [out for line in lines for out in fill(line, width)]


@dataclass(frozen=True)
class AlertShown:
    name: str
    state: str  # "pending" or "firing"
    # Why the sinks are not told (the guardian's own restart or first start), or None.
    held_by: str | None = None

    def label(self) -> str:
        held = f", held: {self.held_by}" if self.held_by else ""
        return f"{self.name}[{self.state}{held}]"


NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Decision:
    """One line of the guardian's audit log."""

    time_seconds: float
    what: str
    reason: str

    def same_as(self, other: Decision) -> bool:
        """The same decision again, its numbers aside: a "suppressed" note is logged anew each
        time its countdown or rate moves ("exhausted in ~34 s", "~33 s", ...)."""
        return self.what == other.what and NUMBER.sub("#", self.reason) == NUMBER.sub(
            "#", other.reason
        )


@dataclass(frozen=True)
class Run:
    """Consecutive decisions that are the same but for their numbers, shown once with a count
    (and the latest numbers)."""

    first: Decision
    count: int
    last: Decision


def collapse(decisions: Sequence[Decision]) -> list[Run]:
    runs: list[Run] = []
    for d in decisions:
        if runs and runs[-1].last.same_as(d):
            runs[-1] = Run(runs[-1].first, runs[-1].count + 1, d)
        else:
            runs.append(Run(d, 1, d))
    return runs


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def decision_line(run: Run) -> str:
    again = f" (x{run.count} until {clock(run.last.time_seconds)})" if run.count > 1 else ""
    return f"  {clock(run.first.time_seconds)} {run.first.what:<10} {run.last.reason}{again}"


@dataclass(frozen=True)
class Frame:
    """The demo at one moment, read from the guardian after its latest tick."""

    title: str  # the header: scenario, progress, how to stop
    time_seconds: float  # the wall clock when read
    elapsed_seconds: float
    started: bool = False  # the guardian has ticked at least once
    health: str = "?"
    status: tuple[str, ...] = ()  # the "vLLM ...", "GPU ...", "Load ...", "Guard ..." lines
    ready: str = "?"  # /ready/vllm: "200 (open)" or "503 (why)"
    alerts: tuple[AlertShown, ...] = ()  # the active ones
    gate: str | None = None  # "open", "HOLDING (why)", "not reachable"; None: no gate
    gate_line: str | None = None
    decisions: tuple[Decision, ...] = ()  # the whole audit log so far
    requests: Mapping[str, int] = field(default_factory=dict)


def requests_line(counts: Mapping[str, int]) -> str:
    return "Requests " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none yet")


def screen(f: Frame, width: int) -> list[str]:
    """The whole screen, for a terminal: status, alerts, gate, the last decisions, requests."""
    lines = [f.title, ""]
    if not f.started:
        return fill_all([*lines, "starting the twin and the guardian…"], width)
    lines += list(f.status)
    lines += ["", "Alerts " + (", ".join(a.label() for a in f.alerts) or "none")]
    if f.gate_line is not None:
        lines.append(f.gate_line)
    lines += ["", "Decisions (newest last):"]
    lines += [decision_line(r) for r in collapse(f.decisions)[-DECISIONS_SHOWN:]]
    lines += ["", requests_line(f.requests)]
    return fill_all(lines, width)


@dataclass
class EventLog:
    """Event lines for a pipe: each call prints what changed since the last frame."""

    alerts: dict[str, AlertShown] = field(default_factory=dict)
    health: str | None = None
    ready: str | None = None
    gate: str | None = None
    decisions_seen: int = 0
    run: Run | None = None  # the last decision printed, and how often it has come since
    printed_run_count: int = 1
    next_status_seconds: float = STATUS_EVERY_SECONDS
    started: bool = False

    def lines(self, f: Frame, width: int) -> list[str]:
        out: list[str] = []
        stamp = f"{clock(f.time_seconds)} +{f.elapsed_seconds:.0f}s"
        if not self.started:
            out.append(f.title)
            self.started = True
        if not f.started:
            return fill_all(out, width)

        def event(text: str, at: str = stamp) -> None:
            out.append(f"{at} {text}")

        # The decisions first: each was logged at a tick before this frame was read, with its
        # own time; what follows carries the frame's.
        for d in f.decisions[self.decisions_seen :]:
            out += self._decision(d)
        self.decisions_seen = len(f.decisions)
        if f.health != self.health:
            event(f"vLLM health {f.health}" + (f" (was {self.health})" if self.health else ""))
            self.health = f.health
        if f.ready != self.ready:
            event(f"/ready/vllm {f.ready}")
            self.ready = f.ready
        now = {a.name: a for a in f.alerts}
        for name, a in now.items():
            before = self.alerts.get(name)
            if before is None or (before.state, before.held_by) != (a.state, a.held_by):
                held = f" (not notified, held: {a.held_by})" if a.held_by else ""
                event(f"alert {name} {a.state}{held}")
        for name in self.alerts.keys() - now.keys():
            event(f"alert {name} resolved")
        self.alerts = now
        if f.gate != self.gate and f.gate is not None:
            event(f"gate {f.gate}")
            self.gate = f.gate
        if f.elapsed_seconds >= self.next_status_seconds:
            event(" ".join(f.status[:1]) + " | " + requests_line(f.requests))
            self.next_status_seconds = f.elapsed_seconds + STATUS_EVERY_SECONDS
        return fill_all(out, width)

    def _decision(self, d: Decision) -> list[str]:
        r = self.run
        if r is not None and r.last.same_as(d):
            self.run = Run(r.first, r.count + 1, d)
            return []
        out = self.close()
        self.run, self.printed_run_count = Run(d, 1, d), 1
        return [*out, f"{clock(d.time_seconds)} decision {d.what}: {d.reason}"]

    def close(self) -> list[str]:
        """The count of a run of identical decisions not yet told (at a new one, or the end)."""
        r = self.run
        if r is None or r.count == self.printed_run_count:
            return []
        self.printed_run_count = r.count
        return [f"{clock(r.last.time_seconds)} decision (the same again, {r.count} in all)"]


def decisions_from(audit: Sequence[policy.Decision]) -> tuple[Decision, ...]:
    return tuple(Decision(d.time_seconds, d.what.value, d.reason) for d in audit)
