"""The tick and the daemon shell: parallel collection under timeouts, sd_notify, reload, control."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from tests.conftest import read_fixture
from vllm_guardian.config import parse_config
from vllm_guardian.core.driver import history_span_seconds
from vllm_guardian.formats.recorder import read_records, snapshot_from_record
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.lowio.control import request
from vllm_guardian.model import HealthProbe, HealthState, Reading, SourceKind
from vllm_guardian.shell.daemon import Guardian, SdNotifier, assemble
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

CONFIG = """
state_dir: {recorder}.state
runtime_dir: {recorder}.run
services:
  - name: vllm
    url: http://127.0.0.1:9
recorder:
  path: {recorder}
"""


class Recorded:
    """Records notify() calls like a systemd notify socket would."""

    watchdog = True

    def __init__(self) -> None:
        self.messages: list[str] = []

    def notify(self, state: str) -> None:
        self.messages.append(state)


class Source:
    """A collector at the boundary: returns what the test says, or blocks, or raises."""

    def __init__(
        self,
        kind: SourceKind,
        service: str | None,
        reading=None,
        *,
        block: threading.Event | None = None,
        raises: bool = False,
        timeout: float = 0.2,
    ) -> None:
        self.kind = kind
        self.service = service
        self.timeout_seconds = timeout
        self.reading = reading
        self.block = block
        self.raises = raises
        self.calls = 0
        self.closed = False

    def collect(self) -> Reading:
        self.calls += 1
        if self.block is not None:
            self.block.wait(10)
        if self.raises:
            raise RuntimeError("boom")
        return self.reading or Reading(self.kind, self.service, None, "nothing scripted")

    def close(self) -> None:
        self.closed = True


def make(
    tmp_path: Path, *sources: Source, clock: FakeClock | None = None
) -> tuple[Guardian, Recorded]:
    cfg = parse_config(CONFIG.format(recorder=tmp_path / "flight.jsonl"))
    note = Recorded()
    g = Guardian(cfg, clock=clock or FakeClock(), collectors=list(sources), notifier=note)
    return g, note


def metrics_reading(name: str = "metrics-pressure-07.prom") -> Reading:
    return Reading(SourceKind.VLLM_METRICS, "vllm", parse_vllm_metrics(read_fixture(name)))


def test_tick_assembles_the_snapshot_and_derives_signals(tmp_path):
    health = Reading(SourceKind.HEALTH, "vllm", HealthProbe(HealthState.UP, 200, 0.01))
    g, note = make(
        tmp_path,
        Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading()),
        Source(SourceKind.HEALTH, "vllm", health),
    )
    r = g.tick()
    svc = r.snapshot.service("vllm")
    assert svc is not None and svc.vllm is not None and svc.health is not None
    sig = r.signals.services[0]
    assert (sig.requests_waiting, sig.requests_running, sig.vllm_up) == (27.0, 5.0, True)
    assert all(s.up for s in r.snapshot.sources)
    assert note.messages[0].startswith("READY=1\nSTATUS=vllm: up kv=90% run=5 wait=27")
    assert note.messages[0].endswith("WATCHDOG=1")
    g.tick()
    assert not note.messages[1].startswith("READY=1")  # READY once, after the first full tick
    g.close()


def test_a_failing_or_raising_source_is_down_not_fatal(tmp_path):
    g, _ = make(
        tmp_path,
        Source(SourceKind.VLLM_METRICS, "vllm", raises=True),
        Source(SourceKind.NVML, None),
    )
    r = g.tick()
    down = {s.source: s for s in r.snapshot.sources}
    assert not down[SourceKind.VLLM_METRICS].up and "internal error" in (
        down[SourceKind.VLLM_METRICS].error or ""
    )
    assert not down[SourceKind.NVML].up
    assert r.signals.services[0].kv_cache_usage_ratio is None  # blind is unknown, not zero
    g.close()


def test_a_hung_source_times_out_and_is_not_called_again_while_hung(tmp_path):
    release = threading.Event()
    hung = Source(SourceKind.UNIT, "vllm", block=release, timeout=0.1)
    g, _ = make(tmp_path, hung, Source(SourceKind.HEALTH, "vllm"))
    first = {s.source: s for s in g.tick().snapshot.sources}
    assert "no result within 0.1s" in (first[SourceKind.UNIT].error or "")
    second = {s.source: s for s in g.tick().snapshot.sources}
    assert "still busy" in (second[SourceKind.UNIT].error or "")
    assert hung.calls == 1
    release.set()
    g.close()


def test_history_is_bounded_by_the_longest_window(tmp_path):
    clock = FakeClock()
    g, _ = make(tmp_path, Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading()), clock=clock)
    for _ in range(400):
        g.tick()
        clock.advance(2)
    span = history_span_seconds(g.cfg)
    assert g.history[-1].time_seconds - g.history[0].time_seconds <= span
    assert len(g.history) <= span / 2 + 1
    g.close()


def test_flight_recorder_round_trips_the_snapshot(tmp_path):
    g, _ = make(tmp_path, Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading()))
    r = g.tick()
    recs = list(read_records(tmp_path / "flight.jsonl"))
    assert len(recs) == 1 and isinstance(recs[0], dict)
    assert snapshot_from_record(recs[0]) == r.snapshot
    assert recs[0]["signals"]["services"][0]["requests_waiting"] == 27.0
    g.close()


def test_unwritable_recorder_does_not_stop_the_tick(tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")  # fails even for root
    cfg = parse_config(CONFIG.format(recorder=tmp_path / "file" / "sub" / "f.jsonl"))
    g = Guardian(
        cfg,
        clock=FakeClock(),
        collectors=[Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading())],
        notifier=Recorded(),
    )
    r = g.tick()
    assert r.signals.services[0].requests_waiting == 27.0
    assert g.recorder is not None and "cannot write flight record" in (g.recorder.error or "")
    g.close()


def test_reload_keeps_the_old_config_when_the_new_one_is_bad(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(recorder=tmp_path / "f.jsonl"))
    built: list[str] = []

    def factory(cfg, clock):
        built.extend(s.name for s in cfg.services)
        return []

    g = Guardian(
        parse_config(path.read_text()),
        clock=FakeClock(),
        config_path=str(path),
        notifier=Recorded(),
        collector_factory=factory,
    )
    path.write_text("services: []\ninterval_seconds: -1\n")
    assert g.reload() is False
    assert [s.name for s in g.cfg.services] == ["vllm"]
    path.write_text("services:\n  - name: a\n  - name: b\n    url: http://127.0.0.1:8001\n")
    assert g.reload() is True
    assert [s.name for s in g.cfg.services] == ["a", "b"]
    assert built[-2:] == ["a", "b"]
    g.close()


def test_sd_notify_through_a_real_datagram_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "10000000")
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        notifier = SdNotifier()
        assert notifier.watchdog
        cfg = parse_config(CONFIG.format(recorder=tmp_path / "f.jsonl"))
        g = Guardian(
            cfg,
            clock=FakeClock(),
            collectors=[Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading())],
            notifier=notifier,
        )
        g.tick()
        g.tick()
        first, second = srv.recv(4096).decode(), srv.recv(4096).decode()
        g.close()
    assert first.startswith("READY=1\nSTATUS=vllm:") and first.endswith("WATCHDOG=1")
    assert second.startswith("STATUS=") and "READY=1" not in second


def test_watchdog_pings_only_for_our_pid(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert SdNotifier().watchdog is False


def test_control_socket_status_and_permissions(tmp_path):
    from vllm_guardian.lowio.control import ControlServer

    g, _ = make(tmp_path, Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading()))
    g.tick()
    server = ControlServer(tmp_path / "run" / "control.sock", g.handle_control)
    server.start()
    try:
        mode = stat.S_IMODE(os.stat(tmp_path / "run" / "control.sock").st_mode)
        assert mode == 0o600
        st = request(tmp_path / "run" / "control.sock", {"cmd": "status"})
        assert st["ok"] and st["signals"]["services"][0]["requests_waiting"] == 27.0
        from vllm_guardian.tools.cli import render_status

        # One tick is not a window: the status says there is no estimate, and why.
        assert (
            "  capacity: no estimate (too_little_data): 0s of the 120s window observed in 1 "
            "scrape(s) (80 % of the window and 3 scrapes needed)" in render_status(st).splitlines()
        ), render_status(st)
        bad = request(tmp_path / "run" / "control.sock", {"cmd": "format-disk"})
        assert not bad["ok"] and "unknown command" in bad["error"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(tmp_path / "run" / "control.sock"))
            s.sendall(b"not json\n")
            assert "bad request" in json.loads(s.recv(4096))["error"]
    finally:
        server.stop()
        g.close()


def test_assemble_ignores_readings_for_unknown_services():
    r = Reading(SourceKind.HEALTH, "ghost", HealthProbe(HealthState.UP, 200, 0.0))
    snap = assemble(1.0, ["vllm"], [r], [])
    assert snap.service("vllm") is not None and snap.service("vllm").health is None  # type: ignore[union-attr]


class SteppingClock(FakeClock):
    """A wall clock that NTP steps; monotonic time goes on smoothly."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0.0

    def time(self) -> float:
        return super().time() + self.step


def test_a_wall_clock_step_moves_no_window(tmp_path):
    clock = SteppingClock()
    g, _ = make(tmp_path, Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading()), clock=clock)
    first = g.tick().snapshot.time_seconds
    clock.advance(2)
    clock.step = -3600.0  # an NTP step back by an hour
    second = g.tick().snapshot.time_seconds
    clock.advance(2)
    clock.step = +7200.0
    third = g.tick().snapshot.time_seconds
    assert (second - first, third - second) == (2.0, 2.0)
    rec = [r for r in read_records(tmp_path / "flight.jsonl") if isinstance(r, dict)][-1]
    assert rec["wall_time"] - rec["time"] == 7200.0  # the record keeps the host's clock too
    g.close()


class Kept:
    """A collector that says whether it was closed (a real logs source loses the events it has
    not handed to a tick, and its journal position, when it is closed and rebuilt)."""

    kind = SourceKind.LOGS
    timeout_seconds = 1.0

    def __init__(self, service: str) -> None:
        self.service = service
        self.closed = False

    def collect(self) -> Reading:
        return Reading(source=self.kind, service=self.service, payload=None, error="test")

    def close(self) -> None:
        self.closed = True


def test_a_reload_that_leaves_the_sources_alone_keeps_the_collectors(tmp_path):
    """Reloading for an alert rule or a healing threshold must not rebuild the sources: the
    logs source would drop the events not yet counted (an OOM line in the last second) and
    restart its journal. A change to what the sources read rebuilds them."""
    path = tmp_path / "c.yaml"
    base = CONFIG.format(recorder=tmp_path / "f.jsonl")
    path.write_text(base)
    built: list[Kept] = []

    def factory(cfg, clock):
        made = [Kept(s.name) for s in cfg.services]
        built.extend(made)
        return made

    g = Guardian(
        parse_config(path.read_text()),
        clock=FakeClock(),
        config_path=str(path),
        notifier=Recorded(),
        collector_factory=factory,
    )
    first = built[0]
    path.write_text(base + "signals:\n  rate_window_seconds: 45\n")
    assert g.reload() is True
    assert g.cfg.signals.rate_window_seconds == 45
    assert len(built) == 1 and not first.closed, "an unrelated change rebuilt the sources"
    path.write_text(
        base
        + "signals:\n  rate_window_seconds: 45\nsources:\n  vllm_metrics:\n    timeout_seconds: 3\n"
    )
    assert g.reload() is True
    assert len(built) == 2 and first.closed and not built[1].closed
    g.close()
    assert built[1].closed


def _status_with_restarts(window_seconds: float | None, ago_seconds: list[float]) -> dict:  # type: ignore[type-arg]
    now = 1_795_700_000.0
    st = {
        "time": now,
        "signals": {"services": [{"service": "vllm"}]},
        "policy": {"services": [{"service": "vllm", "restarts": [now - a for a in ago_seconds]}]},
        "restart_budget": 3,
    }
    if window_seconds is not None:
        st["restart_budget_window_seconds"] = window_seconds
    return st


@pytest.mark.parametrize(
    ("window_seconds", "ago_seconds", "line"),
    [
        (600.0, [30, 500, 700, 3000], "  restarts in the last 10 min: 2 of 3"),
        (3600.0, [30, 500, 700, 3000, 4000], "  restarts in the last 1 h: 4 of 3"),
        (7200.0, [30, 4000, 7000, 8000], "  restarts in the last 2 h: 3 of 3"),
        (86400.0, [30, 80000], "  restarts in the last 24 h: 2 of 3"),
        (90.0, [30, 100], "  restarts in the last 90 s: 1 of 3"),
        # A guardian from before the window was in its status: the default window, said so.
        (None, [30, 3000, 4000], "  restarts in the last 1 h (the default window): 2 of 3"),
    ],
)
def test_status_counts_restarts_in_the_configured_budget_window(
    window_seconds: float | None, ago_seconds: list[float], line: str
) -> None:
    from vllm_guardian.tools.cli import render_status

    text = render_status(_status_with_restarts(window_seconds, ago_seconds))
    assert line in text.splitlines(), text


def test_status_says_the_restart_budget_window_from_the_config(tmp_path):
    cfg = parse_config(
        CONFIG.format(recorder=tmp_path / "flight.jsonl")
        + "policy:\n  restart_budget: 5\n  restart_budget_window_seconds: 1800\n"
    )
    g = Guardian(
        cfg,
        clock=FakeClock(),
        collectors=[Source(SourceKind.VLLM_METRICS, "vllm", metrics_reading())],
        notifier=Recorded(),
    )
    try:
        g.tick()
        st = g.status()
    finally:
        g.close()
    assert (st["restart_budget"], st["restart_budget_window_seconds"]) == (5, 1800.0), st


def test_a_reading_that_came_while_the_guardian_was_not_running_is_taken(tmp_path):
    # The guardian kept off the CPUs past a source's time (the clock jumps while the source
    # collects): the reading is there, or a moment away, when the tick looks again; it is taken,
    # not reported as "no result" (the fetch under it gives itself its time once more alike).
    clock = FakeClock()
    health = Reading(SourceKind.HEALTH, "vllm", HealthProbe(HealthState.UP, 200, 0.01))

    class Starved(Source):
        def collect(self) -> Reading:
            clock.advance(10.0)
            threading.Event().wait(0.05)  # the answer's last bytes
            return super().collect()

    g, _ = make(tmp_path, Starved(SourceKind.HEALTH, "vllm", health, timeout=2.0), clock=clock)
    status = g.tick().snapshot.sources[0]
    assert status.up, status
    g.close()
