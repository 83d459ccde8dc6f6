"""The incident picture: one SVG of an incident's timeline, from what the guardian recorded.

Where it sits: after the fact, never in the tick. The incident bundle draws it when it is
captured and again when the action ends (``actuators/bundle.py``, ``incident.svg``); the demo
draws it from its flight record at the end of a run (``demo.py``). Both give the same input:
flight-record snapshots and decisions as JSON (``recorder.to_jsonable``), so one reader serves
the recorder's files, a bundle's ``flight.jsonl`` and the live daemon's memory.

What it shows, one band each on a shared time axis: requests served and failed per second
(from vLLM's finished and failed counters), requests held at the front door (the gate's queue),
KV-cache usage, free GPU memory, the alerts while they fired (those the guardian held back from
the sinks during its own restarts are left out: they were not incidents), and each phase of the
guardian's actions (preparing, draining, restarting, awaiting VRAM, awaiting ready).

Plain SVG written here (no plotting library in the daemon); the output depends only on the
input, so a recording always gives the same bytes (a golden file checks it).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from vllm_guardian.formats.recorder import read_records

# (seconds since the timeline's start, value); a NaN value is a tick without a reading (vLLM
# down, a counter reset): the line breaks there instead of bridging the gap.
Point = tuple[float, float]
GAP_VALUE = math.nan

# At most this many points per series: a line a pixel or two apart is all the width shows.
MAX_POINTS = 480
GIB = 1024**3


@dataclass(frozen=True)
class Span:
    """Something that lasted: an alert while it fired, a phase of an action. ``end_seconds``
    None: still going when the record ends. Times are seconds since the timeline's start."""

    label: str
    start_seconds: float
    end_seconds: float | None
    detail: str = ""


@dataclass(frozen=True)
class Timeline:
    service: str
    start_unix_seconds: float
    duration_seconds: float
    served_per_second: tuple[Point, ...]
    failed_per_second: tuple[Point, ...]
    held: tuple[Point, ...]
    kv_usage_ratio: tuple[Point, ...]
    gpu_free_bytes: tuple[Point, ...]
    alerts: tuple[Span, ...]
    phases: tuple[Span, ...]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _service(snapshot: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for s in snapshot.get("services") or ():
        if isinstance(s, Mapping) and s.get("name") == name:
            return s
    return None


def _engine_sum(svc: Mapping[str, Any], key: str) -> float | None:
    vllm = svc.get("vllm")
    if not isinstance(vllm, Mapping):
        return None
    values = [_num(e.get(key)) for e in vllm.get("engines") or () if isinstance(e, Mapping)]
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _engine_max(svc: Mapping[str, Any], key: str) -> float | None:
    vllm = svc.get("vllm")
    if not isinstance(vllm, Mapping):
        return None
    values = [_num(e.get(key)) for e in vllm.get("engines") or () if isinstance(e, Mapping)]
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _gpu_free(snapshot: Mapping[str, Any]) -> float | None:
    gpus = snapshot.get("gpus")
    if not isinstance(gpus, Mapping):
        return None
    total = 0.0
    seen = False
    for d in gpus.get("devices") or ():
        if not isinstance(d, Mapping):
            continue
        free = _num(d.get("memory_free_bytes"))
        if free is None:
            t, u = _num(d.get("memory_total_bytes")), _num(d.get("memory_used_bytes"))
            free = t - u if t is not None and u is not None else None
        if free is not None:
            total += free
            seen = True
    return total if seen else None


def _rate(prev: tuple[float, float | None] | None, now: tuple[float, float | None]) -> float | None:
    """Per second between two counter readings; None across a reset or a gap in the counter."""
    if prev is None or prev[1] is None or now[1] is None or now[0] <= prev[0]:
        return None
    d = now[1] - prev[1]
    return d / (now[0] - prev[0]) if d >= 0 else None


def _thin(points: list[Point]) -> tuple[Point, ...]:
    """At most about MAX_POINTS readings, every gap kept; runs of gaps count as one."""
    step = max(1, math.ceil(len(points) / MAX_POINTS))
    out: list[Point] = []
    for i, (t, v) in enumerate(points):
        if math.isnan(v):
            if out and not math.isnan(out[-1][1]):
                out.append((t, v))
        elif i % step == 0:
            out.append((t, v))
    while out and math.isnan(out[-1][1]):
        out.pop()
    return tuple(out)


def timeline(
    snapshots: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    service: str,
    end_unix_seconds: float | None = None,
) -> Timeline:
    """The timeline of ``service`` from flight-record snapshots (oldest first) and the records'
    decisions and alert transitions (``events``, oldest first, as the flight record holds them).
    The axis runs from the first snapshot to ``end_unix_seconds`` (default: the last snapshot or
    event); what ended before it is left out, what began before it starts at its left edge."""
    snaps = [s for s in snapshots if _num(s.get("time_seconds")) is not None]
    evs = [e for e in events if isinstance(e, Mapping)]
    times = [float(s["time_seconds"]) for s in snaps] + [
        t for e in evs if (t := _event_time(e)) is not None
    ]
    # The axis starts at the first snapshot: older events only say what was already going on.
    start = float(snaps[0]["time_seconds"]) if snaps else min(times, default=0.0)
    end = end_unix_seconds if end_unix_seconds is not None else max(times, default=start)
    served: list[Point] = []
    failed: list[Point] = []
    held: list[Point] = []
    kv: list[Point] = []
    free: list[Point] = []
    prev_fin: tuple[float, float | None] | None = None
    prev_fail: tuple[float, float | None] | None = None
    for snap in snaps:
        t = float(snap["time_seconds"])
        x = t - start
        svc = _service(snap, service)
        if svc is not None:
            fin = (t, _engine_sum(svc, "requests_finished_total"))
            fail = (t, _engine_sum(svc, "requests_failed_total"))
            r_fin, r_fail = _rate(prev_fin, fin), _rate(prev_fail, fail)
            served.append((x, GAP_VALUE if r_fin is None else max(0.0, r_fin - (r_fail or 0.0))))
            failed.append((x, GAP_VALUE if r_fail is None else r_fail))
            prev_fin, prev_fail = fin, fail
            gate = svc.get("gate")
            q = _num(gate.get("queued")) if isinstance(gate, Mapping) else None
            held.append((x, GAP_VALUE if q is None else q))
            k = _engine_max(svc, "kv_cache_usage_ratio")
            kv.append((x, GAP_VALUE if k is None else k))
        g = _gpu_free(snap)
        free.append((x, GAP_VALUE if g is None else g))
    alerts, phases = (
        tuple(s for s in spans if s.end_seconds is None or s.end_seconds >= 0)
        for spans in _spans(evs, service, start)
    )
    return Timeline(
        service=service,
        start_unix_seconds=start,
        duration_seconds=max(0.0, end - start),
        served_per_second=_thin(served),
        failed_per_second=_thin(failed),
        held=_thin(held),
        kv_usage_ratio=_thin(kv),
        gpu_free_bytes=_thin(free),
        alerts=alerts,
        phases=phases,
    )


def from_flight(path: Path, service: str) -> Timeline:
    """The timeline of a flight recorder's file (its rotated files first), as ``replay`` reads
    it: damaged lines are skipped."""
    records = [r for r in read_records(path) if isinstance(r, dict)]
    return timeline(
        [r["snapshot"] for r in records if isinstance(r.get("snapshot"), Mapping)],
        [d for r in records for d in r.get("decisions") or () if isinstance(d, Mapping)],
        service,
    )


def _event_time(e: Mapping[str, Any]) -> float | None:
    t = e.get("transition")
    if isinstance(t, Mapping):
        alert = t.get("alert")
        if not isinstance(alert, Mapping):
            return None
        return _num(alert.get("firing_since_seconds")) or _num(alert.get("last_true_seconds"))
    return _num(e.get("time_seconds"))


def _spans(
    events: Sequence[Mapping[str, Any]], service: str, start: float
) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
    alerts: list[Span] = []
    firing: dict[tuple[str, str], float] = {}
    phases: list[Span] = []
    open_phase: dict[int, tuple[str, float, str]] = {}
    for e in events:
        t = e.get("transition")
        if isinstance(t, Mapping):
            alert = t.get("alert")
            if not isinstance(alert, Mapping) or alert.get("service") not in (service, None):
                continue
            if alert.get("inhibited_by"):
                continue  # held back during the guardian's own restart: not an incident
            key = (str(alert.get("name", "?")), repr(alert.get("labels")))
            if t.get("current") == "firing" and key not in firing:
                since = _num(alert.get("firing_since_seconds"))
                if since is not None:
                    firing[key] = since
            elif t.get("current") != "firing" and key in firing:
                began = firing.pop(key)
                ended = _num(alert.get("last_true_seconds")) or began
                alerts.append(Span(key[0], began - start, max(began, ended) - start))
            continue
        if e.get("service") != service or _num(e.get("time_seconds")) is None:
            continue
        now = float(e["time_seconds"])
        aid = e.get("action_id")
        if not isinstance(aid, int) or isinstance(aid, bool):
            continue
        what = e.get("what")
        if what in ("phase", "result") and aid in open_phase:
            label, began, detail = open_phase.pop(aid)
            phases.append(Span(label, began - start, now - start, detail))
        if what == "phase" and isinstance(e.get("phase"), str):
            open_phase[aid] = (str(e["phase"]), now, f"action #{aid}")
    for key, began in firing.items():
        alerts.append(Span(key[0], began - start, None))
    for label, began, detail in open_phase.values():
        phases.append(Span(label, began - start, None, detail))
    alerts.sort(key=lambda s: (s.start_seconds, s.label))
    phases.sort(
        key=lambda s: s.start_seconds
    )  # stable: phases entered in one tick keep their order
    return tuple(alerts), tuple(phases)


# --- drawing --------------------------------------------------------------------------------

WIDTH = 960
LEFT = 230  # room for the scales and the alerts' names
TITLE = 20  # the row above each band: its name and legend
RIGHT = 20
PLOT = WIDTH - LEFT - RIGHT
BAND = 70  # height of a value band
LANE = 16  # height of one alert or phase lane
GAP = 14

# Colour-blind-safe (Okabe-Ito), and each series also named in its band's legend.
COLOURS = {
    "served": "#009E73",
    "failed": "#D55E00",
    "held": "#E69F00",
    "kv": "#0072B2",
    "gpu": "#CC79A7",
    "alert": "#D55E00",
    "phase": "#56B4E9",
}


def _f(v: float) -> str:
    """Coordinates with one decimal: the same input, the same bytes."""
    s = f"{v:.1f}"
    return "0.0" if s == "-0.0" else s


def _label(v: float, unit: str) -> str:
    if unit == "%":
        return f"{v * 100:.0f} %"
    if unit == "GiB":
        return f"{v / GIB:.1f} GiB"
    return f"{v:.3g}"


def _has_data(points: Sequence[Point]) -> bool:
    return any(not math.isnan(v) for _, v in points)


def _polyline(
    points: Sequence[Point],
    x: Callable[[float], float],
    y: Callable[[float], float],
    colour: str,
    sid: str,
) -> str:
    parts: list[str] = []
    move = True
    for t, v in points:
        if math.isnan(v):
            move = True
            continue
        parts.append(f"{'M' if move else 'L'}{_f(x(t))},{_f(y(v))}")
        move = False
    return (
        f'<path id="series-{sid}" class="series" fill="none" stroke="{colour}" '
        f'stroke-width="1.5" d="{" ".join(parts)}"/>'
    )


def render(tl: Timeline) -> str:
    """The SVG document of ``tl`` (a string; the caller writes it)."""
    span = tl.duration_seconds or 1.0

    def x(t: float) -> float:
        return LEFT + PLOT * min(max(t, 0.0), span) / span

    body: list[str] = []
    top = 34
    # Each action's whole span, shaded behind the value bands: what the guardian did lines up
    # with what clients saw.
    actions: dict[str, tuple[float, float]] = {}
    for p in tl.phases:
        end = p.end_seconds if p.end_seconds is not None else span
        a, b = actions.get(p.detail, (p.start_seconds, end))
        actions[p.detail] = (min(a, p.start_seconds), max(b, end))
    bands: list[tuple[str, str, list[tuple[str, str, Sequence[Point]]], float | None]] = [
        (
            "requests / s",
            "",
            [
                ("served", "served", tl.served_per_second),
                ("failed", "failed", tl.failed_per_second),
            ],
            None,
        ),
        ("held at the front door", "", [("held", "held", tl.held)], None),
        ("KV-cache usage", "%", [("busiest engine", "kv", tl.kv_usage_ratio)], 1.0),
        ("free GPU memory", "GiB", [("all GPUs", "gpu", tl.gpu_free_bytes)], None),
    ]
    for title, unit, series, fixed_max in bands:
        values = [v for _, _, pts in series for _, v in pts if not math.isnan(v)]
        high = fixed_max if fixed_max is not None else max(values, default=0.0)
        high = high if high > 0 else 1.0
        y1 = top + TITLE
        y0 = y1 + BAND

        def y(v: float, y0: float = y0, y1: float = y1, high: float = high) -> float:
            return y0 - (y0 - y1) * min(max(v, 0.0), high) / high

        body.append(f'<g class="band" id="band-{series[0][1]}">')
        legend = "".join(
            f'<tspan dx="14" fill="{COLOURS[sid]}">— {name}{"" if _has_data(pts) else " (no data)"}</tspan>'
            for name, sid, pts in series
        )
        body.append(
            f'<text x="8" y="{top + 14}"><tspan class="title">{escape(title)}</tspan>{legend}</text>'
        )
        body.append(f'<rect x="{LEFT}" y="{y1}" width="{PLOT}" height="{BAND}" class="frame"/>')
        for a, b in actions.values():
            body.append(
                f'<rect class="shade" x="{_f(x(a))}" y="{y1}" width="{_f(max(1.0, x(b) - x(a)))}" '
                f'height="{BAND}"/>'
            )
        body.append(f'<text x="{LEFT - 6}" y="{y1 + 10}" class="scale">{_label(high, unit)}</text>')
        body.append(f'<text x="{LEFT - 6}" y="{y0}" class="scale">{_label(0.0, unit)}</text>')
        for _, sid, pts in series:
            if _has_data(pts):
                body.append(_polyline(pts, x, y, COLOURS[sid], sid))
        body.append("</g>")
        top = y0 + GAP
    for kind, spans, colour in (
        ("alert", tl.alerts, COLOURS["alert"]),
        ("phase", tl.phases, COLOURS["phase"]),
    ):
        title = "alerts firing" if kind == "alert" else "the guardian's actions, phase by phase"
        body.append(f'<g class="lanes" id="lanes-{kind}">')
        note = "" if spans else '<tspan dx="14" class="none">none</tspan>'
        body.append(f'<text x="8" y="{top + 14}"><tspan class="title">{title}</tspan>{note}</text>')
        top += TITLE
        # One lane per distinct label: a phase entered twice stays on its row.
        rows = list(dict.fromkeys(s.label for s in spans))
        for s in spans:
            row = rows.index(s.label)
            yy = top + row * (LANE + 2)
            x0 = x(s.start_seconds)
            x1 = x(s.end_seconds if s.end_seconds is not None else span)
            until = "still going" if s.end_seconds is None else f"+{s.end_seconds:.0f} s"
            tip = f"{s.label} {s.detail}".strip() + f": +{s.start_seconds:.0f} s to {until}"
            body.append(
                f'<rect class="{kind}" x="{_f(x0)}" y="{yy}" width="{_f(max(2.0, x1 - x0))}" '
                f'height="{LANE}" fill="{colour}"><title>{escape(tip)}</title></rect>'
            )
        for row, label in enumerate(rows):
            yy = top + row * (LANE + 2)
            body.append(f'<text x="{LEFT - 6}" y="{yy + 12}" class="scale">{escape(label)}</text>')
        top += len(rows) * (LANE + 2) + GAP
        body.append("</g>")
    # The time axis: ticks at round seconds, labelled from the start.
    step = next(
        (s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600) if span / s <= 10), 7200
    )
    axis = [f'<g class="axis"><line x1="{LEFT}" y1="{top}" x2="{LEFT + PLOT}" y2="{top}"/>']
    t = 0.0
    while t <= span + 1e-9:
        axis.append(
            f'<line x1="{_f(x(t))}" y1="{top}" x2="{_f(x(t))}" y2="{top + 4}"/>'
            f'<text x="{_f(x(t))}" y="{top + 16}" class="tick">+{t:.0f} s</text>'
        )
        t += step
    axis.append("</g>")
    body.extend(axis)
    height = top + 30
    began = dt.datetime.fromtimestamp(tl.start_unix_seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    heading = f"{tl.service}: incident timeline from {began} UTC, {tl.duration_seconds:.0f} s"
    return "\n".join(
        [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
            "<style>.title{font-weight:bold}.scale{text-anchor:end;fill:#555}"
            ".tick{text-anchor:middle;fill:#555}.none{fill:#888}"
            ".frame{fill:none;stroke:#ccc}.shade{fill:#56B4E9;fill-opacity:0.15}"
            ".axis line{stroke:#555}</style>",
            f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
            f'<text x="8" y="22" font-size="14" class="title">{escape(heading)}</text>',
            *body,
            "</svg>",
            "",
        ]
    )
