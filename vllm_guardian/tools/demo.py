"""``vllm-guardian demo``: the guardian against the built-in vLLM twin, live, on a laptop.

It starts, all on 127.0.0.1 and inside one temporary directory:

* the vLLM twin (``vllm_guardian/sim``) under the guardian's own process manager, which applies
  the same flags file the systemd set-up uses and restarts it like ``Restart=always``;
* a bounded load for the chosen scenario (the twin's load generator);
* the guardian itself (in this process), reading the twin's simulated GPU through its
  ``file`` GPU backend, with the policy armed (``dry_run: false``) and cooldowns scaled for a
  short demo;
* the admission gate in front of the twin, as deployed: ``vllm-guardian gate -c CONFIG
  --service vllm``, a process of its own run from the service's ``gate:`` section, following
  the guardian's ``/ready/vllm``. The load is sent to the gate, which holds requests while the
  twin restarts instead of letting them fail (``--no-gate``: the load goes to the twin directly).

In a terminal it repaints a status screen once a second; into a pipe or a file it prints event
lines instead (what changed, and a status line now and then; ``demo_view``), every line filled
to the terminal's width or 80 columns. It ends with a summary: incidents (alerts), the
causes named, the actions taken and how they ended, requests served and failed, and what the
gate held and retried. Ctrl-C stops everything; no process is left behind. ``run_demo`` is also
what the end-to-end tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from vllm_guardian.actuators import audit
from vllm_guardian.config import Config, PolicyConfig, SignalsConfig, parse_config
from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.formats import incident_svg
from vllm_guardian.model import ActionKind, AlertState, Cause
from vllm_guardian.shell.daemon import Guardian
from vllm_guardian.sim.load import REQUEST_TIMEOUT_SECONDS, OutcomeKind
from vllm_guardian.tools.demo_view import (
    AlertShown,
    EventLog,
    Frame,
    decisions_from,
    fill_all,
    screen,
    text_width,
)

GIB = 1024**3
SCENARIOS = (
    "prefill_burst", "kv_thrash", "fragmentation_creep", "noisy_neighbour", "engine_hang",
    "exit_zero_death", "xid_fault", "prefix_cache_waste", "steady",
)  # fmt: skip
# Requests the demo's client holds open at once. vLLM can only count the demand it is sent: with
# the load generator's default 64, kv_thrash is a closed loop of 64 and vLLM sees itself at
# exactly capacity (demand 1.0x) while the rest of the open-loop plan waits inside the client.
LOAD_IN_FLIGHT = {"kv_thrash": 512}
# Shorter `for` times than production so a demo (or a test) sees a whole incident in minutes;
# same rule names, signals and thresholds as the shipped rules.
DEMO_RULES = """
rules:
  - name: VllmKvCacheSaturated
    signal: kv_cache_usage_ratio
    op: ">="
    threshold: 0.90
    unit: ratio
    for_seconds: 3
    keep_firing_for_seconds: 2
    severity: warning
    cause: concurrency_overcommit
    summary: "{service}: KV cache {value} full (>= {threshold})"
    runbook: "#kv-cache-saturated"
  - name: VllmPreemptionRateHigh
    signal: preemptions_per_second
    op: ">"
    threshold: 0.5
    unit: per_second
    for_seconds: 3
    keep_firing_for_seconds: 2
    severity: warning
    cause: concurrency_overcommit
    summary: "{service}: {value} preemptions (> {threshold})"
    runbook: "#preemption-rate-high"
  - name: VllmOverCapacity
    signal: capacity_demand_ratio
    op: ">"
    threshold: 1.2
    unit: multiple
    for_seconds: 3
    keep_firing_for_seconds: 5
    severity: warning
    cause: concurrency_overcommit
    summary: "{service}: over capacity: demand is {value} what it serves at saturation (> {threshold}); {replicas_needed} replica(s) needed: add replicas or shed at the gate"
    runbook: "#over-capacity"
  - name: VllmEngineDead
    signal: vllm_up
    op: "=="
    threshold: 0
    unit: bool
    for_seconds: 5
    keep_firing_for_seconds: 0
    severity: critical
    cause: engine_dead
    summary: "{service}: /health does not answer 200"
    runbook: "#engine-dead"
"""


# The exhaustion forecast and what the policy does with it, at the shipped defaults divided by
# the twin's speed (as bench/outcome.py does for every key): a trend lives on the twin's clock (a
# neighbour grows 0.1 GiB per simulated second). Left at their wall-clock defaults, a twin at 4x
# needed 160 simulated seconds of trend before any forecast, while its neighbour exhausts the
# card in about 66: the demo never showed the pre-emptive relaunch a deployed guardian makes, only
# the OOM after it (and the relaunch loop that followed; docs/benchmarks.md, "The demo").
FORECAST_SIGNALS = (
    "forecast_window_seconds", "forecast_interval_seconds", "forecast_min_span_seconds",
    "forecast_max_gap_seconds",
)  # fmt: skip
FORECAST_POLICY = ("forecast_horizon_seconds", "neighbour_persist_seconds")


def on_twin_clock(defaults: object, names: Sequence[str], speed: float) -> dict[str, float]:
    """``names`` of a config section's shipped ``defaults``, divided by the twin's ``speed``."""
    return {name: float(getattr(defaults, name)) / speed for name in names}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DemoOptions:
    scenario: str = "prefill_burst"
    speed: float = 4.0
    duration_seconds: float = 120.0
    workdir: Path | None = None
    interval_seconds: float = 0.5
    cooldown_seconds: float = 15.0
    extra_twin_args: Sequence[str] = ()
    quiet: bool = False
    # Run the admission gate in front of the twin and send the load to it (the deployed form).
    gate: bool = True
    # Policy keys to override (tests use them to shorten stable periods, for instance).
    policy: dict[str, Any] = field(default_factory=dict)
    # One timeline for every twin process of the demo: a one-off fault (a hang, an engine
    # death) strikes once at its time on the demo's clock, a restarted twin does not meet it
    # again, and a neighbour does not vanish with a restart (docs/twin.md). False: every process
    # meets its scenario from its own start (the virtual-time scenarios' default).
    timeline: bool = True


@dataclass
class DemoReport:
    scenario: str
    workdir: Path
    alerts_fired: list[str] = field(default_factory=list)
    # Alerts that fired only while the guardian held them back (name: why), never notified.
    alerts_held: dict[str, str] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)
    actions: list[Decision] = field(default_factory=list)  # the ACTION decisions
    decisions: list[Decision] = field(default_factory=list)  # the whole audit log
    requests: dict[str, int] = field(default_factory=dict)
    twin_starts: int = 0
    twin_exits: list[int] = field(default_factory=list)
    gated: bool = False  # the guardian closed /ready/vllm for KV pressure at least once
    # The gate's last GET /gate/status (None: ran without a gate, or it did not answer).
    gate: dict[str, Any] | None = None
    gate_url: str | None = None
    # The over-capacity alert's summary each time it fired, and the last capacity estimate.
    over_capacity: list[str] = field(default_factory=list)
    capacity: str = ""
    picture: Path | None = None  # the incident picture (incident.svg), when it was drawn
    picture_error: str | None = None


# The demo's wait without a processed token before the guardian restarts a stalled engine (the
# shipped 30 s is long to watch); the gate's progress watch holds new requests after a third.
DEMO_STALL_SECONDS = 8.0


def demo_config(
    opts: DemoOptions,
    workdir: Path,
    vllm_port: int,
    guardian_port: int,
    gate_port: int | None = None,
) -> Config:
    """The demo's config, validated; written to ``workdir/config.yaml`` (the gate reads it)."""
    gpu_state = workdir / "gpu-state.json"
    twin = [
        sys.executable, "-m", "vllm_guardian.sim", "serve",
        "--host", "127.0.0.1", "--port", str(vllm_port), "--served-model-name", "demo",
        "--shutdown-timeout", "10", "--sim-scenario", opts.scenario, "--sim-speed", f"{opts.speed:g}",
        "--sim-gpu-state-file", str(gpu_state), "--sim-gpu-state-interval-seconds", "0.5",
        *(("--sim-timeline-file", str(workdir / "timeline.json")) if opts.timeline else ()),
        *opts.extra_twin_args,
    ]  # fmt: skip
    (workdir / "demo-rules.yaml").write_text(DEMO_RULES)
    text = json.dumps(
        {
            "interval_seconds": opts.interval_seconds,
            "listen": f"127.0.0.1:{guardian_port}",
            "runtime_dir": str(workdir / "run"),
            "state_dir": str(workdir / "state"),
            "recorder": {"path": str(workdir / "state" / "flight.jsonl")},
            "services": [
                {"name": "vllm", "url": f"http://127.0.0.1:{vllm_port}", "command": twin,
                 "log_file": str(workdir / "vllm.log"),
                 **({"gate": {"listen": f"127.0.0.1:{gate_port}",
                              # The progress watch holds new requests after a third of the
                              # guardian's stall wait, as the shipped defaults do (10 of 30 s).
                              "stall_hold_seconds": DEMO_STALL_SECONDS / 3,
                              # One process: the twin, the guardian and the load share the
                              # cores, and a tiny model's stream needs no second gate worker.
                              "workers": 1}}
                    if gate_port else {})}
            ],
            "sources": {
                "nvml": {"backend": "file", "state_file": str(gpu_state)},
                # The twin publishes allocator stats as the in-vLLM plugin does, where the
                # guardian tells the process it starts to (<directory>/<service>).
                "allocator": {"directory": str(workdir / "allocator")},
                "unit": {"enabled": True},
                "logs": {"enabled": True},
            },
            "signals": {"rate_window_seconds": 10, "quantile_window_seconds": 20, "slope_window_seconds": 20,
                        "stall_seconds": DEMO_STALL_SECONDS, "capacity_window_seconds": 20,
                        **on_twin_clock(SignalsConfig(), FORECAST_SIGNALS, opts.speed)},
            "alerting": {"rules_file": str(workdir / "demo-rules.yaml")},
            "policy": {
                "dry_run": False, "backend": "process", "cooldown_seconds": opts.cooldown_seconds,
                "startup_grace_seconds": 30, "drain_timeout_seconds": 10, "ready_timeout_seconds": 60,
                "vram_release_timeout_seconds": 10, "backoff_initial_seconds": 5,
                "pressure_events_to_relaunch": 2, "pressure_window_seconds": 600,
                "early_failure_seconds": 5, "stable_for_seconds": 3600,
                **on_twin_clock(PolicyConfig(), FORECAST_POLICY, opts.speed),
                **opts.policy,
            },
        }
    )  # fmt: skip
    # JSON is YAML: the same validator as a hand-written config.
    path = workdir / "config.yaml"
    path.write_text(text + "\n")
    return parse_config(text, str(path))


class _Output:
    """The demo's live output: the screen repainted in a terminal, event lines into a pipe."""

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.out = out
        self.quiet = quiet
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.events = EventLog()

    def show(self, f: Frame) -> None:
        if self.quiet:
            return
        width = text_width(self.out)
        if self.tty:
            self.out.write("\x1b[H\x1b[2J" + "\n".join(screen(f, width)) + "\n")
        else:
            lines = self.events.lines(f, width)
            self.out.write("".join(line + "\n" for line in lines))
        self.out.flush()

    def close(self) -> None:
        """The count of a run of identical decisions the event log has not told yet."""
        if not self.quiet and not self.tty:
            lines = fill_all(self.events.close(), text_width(self.out))
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()


def _bar(done: float, width: int = 30) -> str:
    n = int(max(0.0, min(1.0, done)) * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def _fmt(v: float | None, pattern: str) -> str:
    return "?" if v is None else pattern.format(v)


def _count_outcomes(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError), path.open() as fh:
        for line in fh:
            try:
                kind = str(json.loads(line).get("kind", "?"))
            except json.JSONDecodeError:
                continue
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def frame(g: Guardian, opts: DemoOptions, elapsed: float, workdir: Path) -> Frame:
    """The guardian's latest tick, the audit log and the outcomes so far, as the demo shows them."""
    title = (
        f"vllm-guardian demo — scenario {opts.scenario} (twin at {opts.speed:g}× speed)   "
        f"{_bar(elapsed / opts.duration_seconds)} {elapsed:4.0f}/{opts.duration_seconds:.0f}s   "
        "Ctrl-C stops"
    )
    now = time.time()
    last = g.last
    if last is None:
        return Frame(title, now, elapsed)
    sig = last.signals.services[0]
    health = sig.health_state.value if sig.health_state else "?"
    status = [
        f"vLLM   health {health:<11} KV {_fmt(sig.kv_cache_usage_ratio and 100 * sig.kv_cache_usage_ratio, '{:3.0f}%')}"
        f"  running {_fmt(sig.requests_running, '{:.0f}')}  waiting {_fmt(sig.requests_waiting, '{:.0f}')}"
        f"  preempt/s {_fmt(sig.preemptions_per_second, '{:.1f}')}  tok/s {_fmt(sig.generation_tokens_per_second, '{:.0f}')}",
        f"GPU    vLLM {_fmt(sig.service_memory_bytes and sig.service_memory_bytes / GIB, '{:.1f}')} GiB"
        f"  budget {_fmt(sig.memory_budget_bytes and sig.memory_budget_bytes / GIB, '{:.1f}')} GiB"
        f"  others {_fmt(sig.other_processes_memory_bytes and sig.other_processes_memory_bytes / GIB, '{:.1f}')} GiB"
        f"  free {_fmt(sig.headroom_bytes and sig.headroom_bytes / GIB, '{:.1f}')} GiB",
    ]  # fmt: skip
    if sig.capacity is not None:
        status.append("Load   " + sig.capacity.line())
    ready = "?"
    alerts: tuple[AlertShown, ...] = ()
    if g.healing is not None:
        view = g.healing.view()
        s = view.state.service("vllm")
        gate = g.exposition.gate("vllm")
        ready = f"{'200' if gate and gate.ready else '503'} ({gate.reason if gate else '?'})"
        flags = " ".join(f"{lv.value}-rung{r}" for lv, r in s.levels.rungs) or "operator baseline"
        status.append(
            f"Guard  /ready {ready}  flags: {flags}  breaker: {'LATCHED' if s.breaker_latched else 'ok'}"
            + (f"  ACTION: {s.action.kind.value} {s.action.phase.value}" if s.action else "")
        )
        alerts = tuple(
            AlertShown(a.name, a.state.value, a.inhibited_by)
            for a in view.alerts
            if a.state is not AlertState.INACTIVE
        )
    gate_state: str | None = None
    gate_line: str | None = None
    ss = last.snapshot.service("vllm")
    if ss is not None and ss.gate is not None:
        gs = ss.gate
        if gs.reachable:
            gate_state = "open" if gs.open else f"HOLDING ({gs.reason})"
            gate_line = (
                f"Gate   {gate_state}  in flight {gs.in_flight}  queued {gs.queued}"
                f"  held {gs.held_total}  retried {gs.retried_total}  refused {gs.rejected_total}"
            )
        else:
            gate_state = "not reachable"
            gate_line = f"Gate   not reachable: {gs.error}"
    return Frame(
        title, now, elapsed, started=True, health=health, status=tuple(status), ready=ready,
        alerts=alerts, gate=gate_state, gate_line=gate_line,
        decisions=decisions_from(audit.read(workdir / "state" / "audit.jsonl")),
        requests=_count_outcomes(workdir / "outcomes.jsonl"),
    )  # fmt: skip


def _get_json(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (our loopback URL)
            doc = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _start_gate(workdir: Path, gate_url: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``vllm-guardian gate -c CONFIG --service vllm``, as its unit runs it; back once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_guardian", "gate", "-c", str(workdir / "config.yaml"),
         "--service", "vllm"],
        stdout=log, stderr=subprocess.STDOUT, env=_child_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if _get_json(f"{gate_url}/gate/status", timeout=1.0) is not None:
            return proc
        time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"the gate did not start (see {workdir / 'gate.log'})")


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def run_demo(
    opts: DemoOptions, out: TextIO = sys.stdout, stop: threading.Event | None = None
) -> DemoReport:
    """Run one demo (or end-to-end test) to its end and report what happened."""
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="vllm-guardian-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    vllm_port, guardian_port = free_port(), free_port()
    gate_port = free_port() if opts.gate else None
    cfg = demo_config(opts, workdir, vllm_port, guardian_port, gate_port)
    gate_url = f"http://127.0.0.1:{gate_port}" if gate_port else None
    guardian = Guardian(cfg)
    stop = stop or threading.Event()
    loop = threading.Thread(
        target=guardian.run, kwargs={"install_signals": False}, name="guardian", daemon=True
    )
    output = _Output(out, opts.quiet)
    load: subprocess.Popen[bytes] | None = None
    gate: subprocess.Popen[bytes] | None = None
    gate_status: dict[str, Any] | None = None
    load_log = (workdir / "load.log").open("wb")
    gate_log = (workdir / "gate.log").open("wb")
    # Detached after the guardian's loop has stopped (the finally below).
    detach_log = None if opts.quiet else _log_to(workdir / "guardian.log")
    try:
        loop.start()
        if gate_url is not None:
            gate = _start_gate(workdir, gate_url, gate_log)
        start = time.monotonic()
        load = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian.sim", "load",
             "--url", gate_url or f"http://127.0.0.1:{vllm_port}",
             "--model", "demo", "--scenario", opts.scenario, "--speed", f"{opts.speed:g}",
             "--max-requests", "100000", "--max-duration-seconds", f"{opts.duration_seconds:g}",
             "--max-in-flight", str(LOAD_IN_FLIGHT.get(opts.scenario, 64)),
             "--outcomes", str(workdir / "outcomes.jsonl")],
            stdout=subprocess.DEVNULL, stderr=load_log, env=_child_env(),
        )  # fmt: skip
        while not stop.is_set():
            elapsed = time.monotonic() - start
            if elapsed >= opts.duration_seconds:
                break
            output.show(frame(guardian, opts, elapsed, workdir))
            stop.wait(1.0)
    finally:
        output.close()
        _stop(load)
        load_log.close()
        if gate_url is not None:
            gate_status = _get_json(f"{gate_url}/gate/status")
        _stop(gate, timeout=30)
        gate_log.close()
        guardian.request_stop()
        loop.join(timeout=60)
        if detach_log is not None:
            detach_log()
    report = _report(guardian, opts, workdir)
    report.gate, report.gate_url = gate_status, gate_url
    return report


def _log_to(path: Path) -> Callable[[], None]:
    """The in-process guardian's log lines go to ``path`` for the run, not to the terminal: long
    journal-style lines (an alert's every label, a decision's evidence) between the screen's or
    the event log's lines said the same again, unwrapped. Returns what undoes it."""
    root = logging.getLogger()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)

    def detach() -> None:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()

    return detach


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class FlightAlerts:
    fired: list[str]  # in the order they first fired, as the sinks were told
    held: dict[str, str]  # fired only while held back (why), never told: not incidents
    over_capacity: list[str]  # the over-capacity alert's summary each time it was told


def alerts_in_flight(records: Iterable[Mapping[str, Any]]) -> FlightAlerts:
    """The alerts that fired, from the flight record's transitions. The record keeps the ones
    the guardian held back from the sinks too (``inhibited_by``: vLLM down for the guardian's
    own start or restart, core/inhibition.py): ``VllmEngineDead`` fires through every model
    load and is not an incident unless it was told."""
    fired: list[str] = []
    held: dict[str, str] = {}
    over: list[str] = []
    for record in records:
        for d in record.get("decisions", []) if isinstance(record, Mapping) else ():
            t = d.get("transition") if isinstance(d, Mapping) else None
            if not isinstance(t, Mapping) or t.get("current") != "firing":
                continue
            alert = t.get("alert", {})
            name = str(alert.get("name", "?"))
            if alert.get("inhibited_by"):
                held.setdefault(name, str(alert["inhibited_by"]))
                continue
            if name not in fired:
                fired.append(name)
            if name == "VllmOverCapacity":
                over.append(str(alert.get("summary", "")))
    return FlightAlerts(fired, {k: v for k, v in held.items() if k not in fired}, over)


def kv_gated(decisions: Sequence[Decision]) -> bool:
    """The guardian closed /ready for KV pressure at least once (not for a forecast's relaunch)."""
    return any(
        d.what is DecisionKind.GATE and d.cause is Cause.CONCURRENCY_OVERCOMMIT for d in decisions
    )


def _report(g: Guardian, opts: DemoOptions, workdir: Path) -> DemoReport:
    report = DemoReport(opts.scenario, workdir)
    decisions = audit.read(workdir / "state" / "audit.jsonl")
    report.decisions = decisions
    report.actions = [d for d in decisions if d.what is DecisionKind.ACTION]
    report.causes = sorted(
        {
            d.cause.value
            for d in decisions
            if d.cause is not None and d.what in (DecisionKind.ACTION, DecisionKind.LATCH)
        }
    )
    report.gated = kv_gated(decisions)
    records: list[Mapping[str, Any]] = []
    for path in sorted((workdir / "state").glob("flight.jsonl*")):
        with contextlib.suppress(OSError), path.open() as fh:
            for line in fh:
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
    seen = alerts_in_flight(records)
    report.alerts_fired, report.alerts_held = seen.fired, seen.held
    report.over_capacity = seen.over_capacity
    report.requests = _count_outcomes(workdir / "outcomes.jsonl")
    report.picture, report.picture_error = draw_picture(workdir)
    if g.last is not None and g.last.signals.services:
        cap = g.last.signals.services[0].capacity
        report.capacity = cap.line() if cap is not None else ""
    if g.healing is not None and "vllm" in g.healing.supervisors:
        sup = g.healing.supervisors["vllm"]
        report.twin_starts, report.twin_exits = sup.starts, list(sup.exits)
    return report


def draw_picture(workdir: Path) -> tuple[Path | None, str | None]:
    """The run's incident picture from its flight record, as ``workdir/incident.svg``; or why
    it could not be drawn (the summary says so, and the rest of the summary stands)."""
    out = workdir / "incident.svg"
    try:
        tl = incident_svg.from_flight(workdir / "state" / "flight.jsonl", "vllm")
        out.write_text(incident_svg.render(tl))
    except Exception as e:  # a picture never costs the summary
        return None, f"{type(e).__name__}: {e}"
    return out, None


def summary(report: DemoReport) -> list[str]:
    lines = ["", f"Summary — scenario {report.scenario}", ""]
    lines.append("Incidents (alerts that fired): " + (", ".join(report.alerts_fired) or "none"))
    if report.alerts_held:
        lines.append(
            "Not incidents (fired while the guardian itself kept vLLM down, never notified): "
            + ", ".join(f"{k} ({v})" for k, v in report.alerts_held.items())
        )
    lines.append("Causes named: " + (", ".join(report.causes) or "none (nothing to act on)"))
    lines.append(f"Guardian closed /ready/vllm for KV pressure: {'yes' if report.gated else 'no'}")
    if report.over_capacity:
        lines.append(f"Over capacity (first alert): {report.over_capacity[0]}")
    if report.capacity:
        lines.append(f"At the end, {report.capacity}")
    lines.append("Actions:")
    results = {d.action_id: d for d in report.decisions if d.what is DecisionKind.RESULT}
    for a in report.actions:
        r = results.get(a.action_id)
        outcome = (
            r.reason
            if r
            else (
                "escalated to a person" if a.action_kind is ActionKind.ESCALATE else "no result yet"
            )
        )
        lines.append(f"  #{a.action_id} {a.reason}")
        lines.append(f"      → {outcome}")
    if not report.actions:
        lines.append("  none")
    served = report.requests.get("ok", 0)
    failed = sum(v for k, v in report.requests.items() if k != "ok")
    lines.append(
        f"Requests: {served} served, {failed} failed ({', '.join(f'{k} {v}' for k, v in sorted(report.requests.items()))})"
    )
    g = report.gate
    if report.gate_url is None:
        lines.append("Front door: none (--no-gate): the load went to vLLM directly")
    elif g is None:
        lines.append(f"Front door: the gate at {report.gate_url} did not answer at the end")
    else:
        lines.append(
            f"Front door (gate at {report.gate_url}): held {g.get('held_total')} requests "
            f"(longest wait {g.get('longest_wait_seconds')} s), retried {g.get('retried_total')} "
            f"on the next instance, refused {g.get('rejected_total')}; continued {g.get('continued_total')} "
            f"cut streams ({g.get('continuations_failed_total')} continuations failed); "
            f"failed above: {failed}"
        )
        timeouts = report.requests.get(OutcomeKind.TIMEOUT.value, 0)
        wait = g.get("longest_wait_seconds")
        if timeouts and isinstance(wait, int | float) and wait >= REQUEST_TIMEOUT_SECONDS:
            # Not the gate's failure to serve: this load's client stops waiting first.
            lines.append(
                f"  The {timeouts} timeouts gave up while held: the gate held requests up to "
                f"{wait:g} s while vLLM came back, and this demo's client waits "
                f"{REQUEST_TIMEOUT_SECONDS:g} s for an answer (OpenAI's SDKs wait 600 s)"
            )
    lines.append(f"vLLM twin starts: {report.twin_starts}; exit codes seen: {report.twin_exits}")
    if report.picture is not None:
        lines.append(f"Incident picture (open it in a browser): {report.picture}")
    elif report.picture_error is not None:
        lines.append(f"Incident picture: not drawn ({report.picture_error})")
    lines.append(
        f"Everything it wrote: {report.workdir} (guardian.log, audit.jsonl, flight.jsonl, "
        "bundles/, vllm.log, incident.svg)"
    )
    return lines


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-guardian demo",
        description="The guardian and its gate against the built-in vLLM twin, live: an "
        "incident from the first symptom to the recovery in about two minutes, then a summary "
        "of the requests served, failed, held and retried.",
    )
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="prefill_burst",
        help="the failure to show (default prefill_burst)",
    )
    ap.add_argument(
        "--speed", type=float, default=4.0, help="the twin's simulated seconds per real second"
    )
    ap.add_argument("--duration", type=float, default=120.0, help="seconds to run (default 120)")
    ap.add_argument(
        "--workdir", type=Path, help="keep everything here (default: a temporary directory)"
    )
    ap.add_argument(
        "--no-gate",
        action="store_true",
        help="no admission gate: send the load to the twin directly (what clients see without it)",
    )
    args = ap.parse_args(argv)
    opts = DemoOptions(
        args.scenario, args.speed, args.duration, args.workdir, gate=not args.no_gate
    )
    stop = threading.Event()
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        # Ctrl-C (SIGINT to the terminal's whole job) or SIGTERM: the run ends and cleans up;
        # never a KeyboardInterrupt, which could cut the clean-up short (and, raised inside
        # Thread.join on Python 3.11, made the next join return at once while the run went on:
        # the demo exited 0 with no summary and left its twin running).
        if not stopped_by:
            out.write("\nstopping: the load, the gate, the guardian and the vLLM twin…\n")
        stopped_by.append(signum)
        stop.set()

    result: list[DemoReport] = []
    worker = threading.Thread(target=lambda: result.append(run_demo(opts, out, stop)), daemon=True)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.start()
        while worker.is_alive():
            worker.join(timeout=0.5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if result:
        out.write("\n".join(fill_all(summary(result[0]), text_width(out))) + "\n")
    # As shells expect of a program a signal stopped: 130 after Ctrl-C, 143 after SIGTERM.
    return 128 + stopped_by[0] if stopped_by else 0
