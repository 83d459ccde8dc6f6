"""The incident picture (``incident_svg.py``): one SVG of an incident's timeline, at the end of
the demo and in every incident bundle.

One fixed recording (a minute of ticks: load, a KV alert, a relaunch with its phases, vLLM's
counters reset by the restart, an alert the guardian held back during its own restart) goes
through the real flight recorder and is drawn; the bytes must match the golden file, and the
document must parse and carry each series and annotation. The bundle draws it at capture and
again when the action ends, and an error drawing it never costs the bundle.

Regenerate the golden file after a deliberate change: UPDATE_GOLDEN=1 pytest this file.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.actuators.bundle import PICTURE, PICTURE_ERROR, BundleWriter
from vllm_guardian.config import ServiceConfig
from vllm_guardian.core import phases
from vllm_guardian.core.alerting import Transition
from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.formats import incident_svg
from vllm_guardian.formats.recorder import FlightRecorder, to_jsonable
from vllm_guardian.model import (
    Action,
    ActionKind,
    Alert,
    AlertState,
    Cause,
    EngineMetrics,
    GateObservation,
    GpuDevice,
    GpuReading,
    ServiceSnapshot,
    Severity,
    Snapshot,
    VllmScrape,
)
from vllm_guardian.tools.demo import DemoReport, draw_picture, summary

GOLDEN = Path(__file__).parent / "golden" / "incident.svg"
SVG = "{http://www.w3.org/2000/svg}"
T0 = 1795306000.0  # 2026-11-22 00:06:40 UTC
GIB = 2**30

# The recording, one row per second: (finished, failed, held, kv usage, free GiB).
# vLLM's counters restart from 0 with the relaunched instance at +30 s.
ROWS = [
    *((10.0 * i, 0.0, 0, 0.5 + 0.02 * i, 6.0) for i in range(20)),  # load builds
    *((200.0 + 5 * i, 2.0 * i, 4 + i, 0.95, 2.0) for i in range(10)),  # the KV alert fires
    *((3.0 * i, 0.0, 12 - i, 0.1 + 0.01 * i, 7.5) for i in range(30)),  # relaunched, recovers
]
# (second, phase) of the relaunch; it ends at +40 s.
PHASES = [
    (25, phases.Phase.PREPARING),
    (26, phases.Phase.DRAINING),
    (28, phases.Phase.RESTARTING),
    (30, phases.Phase.AWAITING_VRAM),
    (31, phases.Phase.AWAITING_READY),
]


def _snapshot(i: int, row: tuple[float, float, int, float, float]) -> Snapshot:
    finished, failed, held, kv, free_gib = row
    engine = EngineMetrics(
        "m", "0", kv_cache_usage_ratio=kv, requests_finished_total=finished,
        requests_failed_total=failed,
    )  # fmt: skip
    return Snapshot(
        T0 + i,
        (
            ServiceSnapshot(
                "vllm",
                vllm=VllmScrape((engine,), True, None, 0),
                gate=GateObservation(True, in_flight=3, queued=held),
            ),
        ),
        GpuReading(
            (
                GpuDevice(
                    0,
                    "GPU-0",
                    "H100",
                    80 * GIB,
                    80 * GIB - int(free_gib * GIB),
                    int(free_gib * GIB),
                ),
            )
        ),
    )


def _alert(name: str, state: AlertState, since: float, last: float, held: str | None) -> Alert:
    return Alert(
        name, "vllm", (), state, Severity.CRITICAL, Cause.CONCURRENCY_OVERCOMMIT, 0.95, since,
        since if state is AlertState.FIRING else None, last, inhibited_by=held,
    )  # fmt: skip


def _events(i: int) -> list[dict[str, Any]]:
    """The tick's decisions and alert transitions, as the daemon records them."""
    t = T0 + i
    out: list[Any] = []
    if i == 20:
        a = _alert("VllmKvCacheNearlyFull", AlertState.FIRING, t, t, None)
        out.append({"transition": Transition(a, AlertState.PENDING, AlertState.FIRING, False)})
    if i == 45:
        a = _alert("VllmKvCacheNearlyFull", AlertState.INACTIVE, T0 + 20, T0 + 29, None)
        out.append({"transition": Transition(a, AlertState.FIRING, AlertState.INACTIVE, True)})
    if i == 29:  # vLLM down for the guardian's own restart: held back, not an incident
        a = _alert("VllmEngineDead", AlertState.FIRING, t, t, "action 1 restarting")
        out.append({"transition": Transition(a, AlertState.PENDING, AlertState.FIRING, False)})
    if i == 25:
        out.append(Decision(t, "vllm", DecisionKind.ACTION, "relaunch", action_id=1))
    out += [
        Decision(t, "vllm", DecisionKind.PHASE, p.value, action_id=1, phase=p)
        for s, p in PHASES
        if s == i
    ]
    if i == 40:
        out.append(Decision(t, "vllm", DecisionKind.RESULT, "relaunch succeeded", action_id=1))
    return [to_jsonable(e) for e in out]


def _record(path: Path) -> None:
    rec = FlightRecorder(path, max_bytes=64 * 2**20, backups=1)
    for i, row in enumerate(ROWS):
        assert rec.write({"time": T0 + i, "snapshot": _snapshot(i, row), "decisions": _events(i)})


@pytest.fixture
def drawn(tmp_path: Path) -> str:
    _record(tmp_path / "flight.jsonl")
    return incident_svg.render(incident_svg.from_flight(tmp_path / "flight.jsonl", "vllm"))


def test_a_fixed_recording_draws_the_same_bytes(drawn: str) -> None:
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(drawn)
    assert GOLDEN.exists(), "no golden picture: run with UPDATE_GOLDEN=1"
    assert drawn == GOLDEN.read_text(), "the picture changed: UPDATE_GOLDEN=1 if deliberate"


def test_the_picture_holds_every_series_and_annotation(drawn: str) -> None:
    root = ET.fromstring(drawn.encode())
    assert root.tag == f"{SVG}svg"
    lines = {p.get("id"): p.get("d", "") for p in root.iter(f"{SVG}path")}
    assert set(lines) == {f"series-{s}" for s in ("served", "failed", "held", "kv", "gpu")}
    for sid, d in lines.items():
        assert len(d.split()) >= 50, (sid, d)  # a point a tick, less the first
    # The restart's counter reset is a gap in the rates, not a line drawn across it.
    assert lines["series-served"].count("M") == lines["series-failed"].count("M") == 2
    tips = {
        r.get("class"): [] for r in root.iter(f"{SVG}rect") if r.get("class") in ("alert", "phase")
    }
    for r in root.iter(f"{SVG}rect"):
        if r.get("class") in tips:
            tips[r.get("class")].append(r.findtext(f"{SVG}title"))
    assert tips["alert"] == ["VllmKvCacheNearlyFull: +20 s to +29 s"]  # VllmEngineDead held back
    assert tips["phase"] == [
        "preparing action #1: +25 s to +26 s",
        "draining action #1: +26 s to +28 s",
        "restarting action #1: +28 s to +30 s",
        "awaiting_vram action #1: +30 s to +31 s",
        "awaiting_ready action #1: +31 s to +40 s",
    ]
    heading = root.findtext(f"{SVG}text") or ""
    assert heading == "vllm: incident timeline from 2026-11-22 00:06:40 UTC, 59 s"


def test_a_counter_reset_is_no_rate_and_nothing_is_negative() -> None:
    snaps = [to_jsonable(_snapshot(i, row)) for i, row in enumerate(ROWS)]
    tl = incident_svg.timeline(snaps, [], "vllm")
    assert all(v >= 0 or math.isnan(v) for _, v in (*tl.served_per_second, *tl.failed_per_second))
    at_restart = [v for t, v in tl.served_per_second if t == 30.0]
    assert len(at_restart) == 1 and math.isnan(at_restart[0])  # no rate: a gap
    assert tl.served_per_second[0] == (1.0, 10.0)
    assert (tl.alerts, tl.phases) == ((), ())


def _writer(tmp_path: Path, history: list[Snapshot], events: Any) -> BundleWriter:
    svc = ServiceConfig(name="vllm", url="http://127.0.0.1:9")  # nothing listens: no scrape
    return BundleWriter(tmp_path / "bundles", lambda name: (svc, history), 1.0, events=events)


ACTION = Action(1, "vllm", ActionKind.RELAUNCH, Cause.CONCURRENCY_OVERCOMMIT, "KV", (), False)


def test_the_bundle_draws_it_at_capture_and_again_with_every_phase_at_the_end(
    tmp_path: Path,
) -> None:
    history = [_snapshot(i, row) for i, row in enumerate(ROWS[:26])]
    events = [e for i in range(26) for e in _events(i)]
    writer = _writer(tmp_path, history, lambda: events)
    path = writer.capture(ACTION)
    first = (path / PICTURE).read_text()
    assert "preparing action #1: +25 s to still going" in first
    history += [_snapshot(i, row) for i, row in enumerate(ROWS) if i >= 26]
    events += [e for i in range(26, len(ROWS)) for e in _events(i)]
    drawing = writer.redraw(path, "vllm")  # off the tick: in a thread of its own
    assert drawing is not None
    drawing.join(timeout=60)
    assert not drawing.is_alive(), "the picture was not drawn again within 60 s"
    assert "awaiting_ready action #1: +31 s to +40 s" in (path / PICTURE).read_text()
    notes = analyze(read_bundle(path), "bundle").notes
    assert f"the incident's timeline as a picture: {path / PICTURE} (open it in a browser)" in notes


def test_an_error_drawing_never_costs_the_bundle(tmp_path: Path) -> None:
    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("no events today")

    path = _writer(tmp_path, [_snapshot(0, ROWS[0])], broken).capture(ACTION)
    assert (path / "manifest.json").exists() and (path / "flight.jsonl").exists()
    assert not (path / PICTURE).exists()
    assert "no events today" in (path / PICTURE_ERROR).read_text()


def test_the_demo_draws_it_from_its_flight_record_and_names_it(tmp_path: Path) -> None:
    _record(tmp_path / "state" / "flight.jsonl")
    picture, error = draw_picture(tmp_path)
    assert (picture, error) == (tmp_path / "incident.svg", None)
    ET.fromstring((tmp_path / "incident.svg").read_bytes())
    report = DemoReport("kv_pressure", tmp_path, picture=picture)
    assert f"Incident picture (open it in a browser): {picture}" in summary(report)
