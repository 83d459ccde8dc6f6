"""The outcome benchmark: what happens to users' requests under five operators, on the vLLM twin.

Run (the full matrix, about three hours on a quiet 2-core host)::

    .venv/bin/python bench/outcome.py --seeds 7,8,9

``--quick`` is a CI smoke run (three scenarios, one seed, short windows) that asserts nothing
numeric; ``--scenarios``, ``--operators``, ``--seeds``, ``--duration`` narrow a run.

For each failure scenario, the ``kv_thrash`` overload and two healthy controls (``steady``,
``prefix_cache_waste``), the same seeded load (mixed: half the requests stream) runs against
the twin under:

* **unguarded** — a supervisor that restarts vLLM like systemd ``Restart=always``;
* **unguarded-on-failure** — ``Restart=on-failure``, the common unit setting: vLLM's exit 0 after
  an engine death leaves it down;
* **sidecar** — the runbook's threshold loop: poll ``/metrics`` every 30 s, count an event when
  KV usage > 0.95 or waiting > 2 × running, and after 3 events in 5 minutes wait up to 60 s for
  running requests to reach 0, then restart with the same flags (under ``Restart=always``);
* **guardian** — vllm-guardian with its shipped rules and policy defaults, armed
  (``dry_run: false``), supervising vLLM; the load goes straight to vLLM;
* **guardian+gate** — the deployed form: the same guardian with the service's ``gate:`` section,
  and ``vllm-guardian gate -c CONFIG --service vllm`` in front of vLLM (as its unit runs it),
  following the guardian's ``/ready``; the load goes to the gate.

The twin runs ``--speed`` times faster than real time, so every operator's clock (the sidecar's
intervals, the guardian's tick, windows, ``for`` durations, cooldowns, timeouts, the gate's
waits) is divided by the same factor. The twin's one-off faults (hang, death) sit on the run's
timeline (``--sim-timeline-file``): a restarted vLLM does not meet them again; memory-driven
OOMs recur while their cause persists. Every request sent gets its whole 30 s time bound.

Per run: sent, failed (HTTP, stream or connection error, timeout), failed split into *in flight
at a fault* / *arrived during an outage* (fault → serving again) / *other* (after recovery, or
with no fault at all), time to detect (first fault → the operator's first action or vLLM's restart), time to
recover (first fault → the first request sent after it that succeeds), downtime (``/health``
not 200 after first ready), goodput (tokens/s of successful requests), p50/p99 latency, p50/p99
TTFT of successful streams, OOM crashes, actions, final flags, alerts fired, and for
``guardian+gate`` what the gate did with what the upstream cut, read from its ``/metrics`` at
the end of the run: its ``continuations_total`` by outcome (continued, fallback, completed,
refused, failed) and ``retried_total`` (unary requests and streams with no text yet, sent
again whole). Each cell
(scenario × operator) runs once per seed: the report gives the median and min–max, and the
host's worst load average before and after the cell's runs (``busy`` when it exceeds the core
count). ``--jobs N`` runs N runs at a time, each in its own process; the report says how many.

Writes ``outcome.md``, ``outcome.json`` and ``outcome.svg`` (failed % per cell, bars at the
median, whiskers min–max) to ``--out`` (default ``bench/results``; ``-quick`` suffixed for
``--quick``). Verdicts per scenario are printed and written, never asserted.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_guardian.actuators import audit  # noqa: E402
from vllm_guardian.actuators import flags as flagsfile  # noqa: E402
from vllm_guardian.actuators.alerts import default_rules_text  # noqa: E402
from vllm_guardian.actuators.procmgr import Supervisor  # noqa: E402
from vllm_guardian.config import GateConfig, PolicyConfig, SignalsConfig, parse_config  # noqa: E402
from vllm_guardian.core.alert_rules import parse_rules  # noqa: E402
from vllm_guardian.core.policy import DecisionKind  # noqa: E402
from vllm_guardian.shell.daemon import Guardian  # noqa: E402
from vllm_guardian.sim.load import (  # noqa: E402
    OutcomeKind,
    PlannedRequest,
    RequestOutcome,
    plan_requests,
    run_load,
)
from vllm_guardian.sim.scenarios import SCENARIOS  # noqa: E402
from vllm_guardian.sim.timeline import read_timeline  # noqa: E402
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics  # noqa: E402
from vllm_guardian.tools.demo import free_port  # noqa: E402

FAILURES = (
    "prefill_burst",
    "fragmentation_creep",
    "noisy_neighbour",
    "exit_zero_death",
    "engine_hang",
)
OVERLOAD = ("kv_thrash",)
CONTROLS = ("steady", "prefix_cache_waste")
ALL = (*FAILURES, *OVERLOAD, *CONTROLS)
QUICK = ("prefill_burst", "exit_zero_death", "steady")
OPERATORS = ("unguarded", "unguarded-on-failure", "sidecar", "guardian", "guardian+gate")
SEEDS = (7, 8, 9)
STREAM_SHARE = 0.5
REQUEST_TIMEOUT_SECONDS = 30.0
OVER_CAPACITY_ALERT = "VllmOverCapacity"
# The twin dates a fault by its engine clock, which runs up to one step (milliseconds) ahead
# of the wall clock: a request failed by the fault can end that much "before" it.
FAULT_SLACK_SECONDS = 0.1
FAILED = {OutcomeKind.HTTP_ERROR, OutcomeKind.STREAM_ERROR, OutcomeKind.INCOMPLETE,
          OutcomeKind.CONNECTION_ERROR, OutcomeKind.TIMEOUT, OutcomeKind.ABORTED}  # fmt: skip


@dataclasses.dataclass
class Run:
    """One run: one scenario, one operator, one seed."""

    scenario: str
    operator: str
    seed: int
    sent: int = 0
    failed: int = 0
    failed_in_flight: int = 0
    failed_during_outage: int = 0
    failed_other: int = 0
    faults: int = 0
    oom_crashes: int = 0
    time_to_detect_seconds: float | None = None
    time_to_recover_seconds: float | None = None
    downtime_seconds: float = 0.0
    goodput_tokens_per_second: float = 0.0
    p50_latency_seconds: float | None = None
    p99_latency_seconds: float | None = None
    p50_ttft_seconds: float | None = None
    p99_ttft_seconds: float | None = None
    actions: list[str] = dataclasses.field(default_factory=list)  # the operator's decisions
    restarts: int = 0  # times vLLM was started again (by an action or by its supervisor)
    alerts_fired: list[str] = dataclasses.field(default_factory=list)
    final_flags: str = ""
    wall_seconds: float = 0.0
    # The gate's vllm_guardian_gate_continuations_total by "outcome/reason" and its
    # retried_total at the end of the run; None without a gate, or when its /metrics could not
    # be read.
    continuations: dict[str, float] | None = None
    gate_retried: float | None = None

    def _continuations(self, outcome: str) -> float | None:
        if self.continuations is None:
            return None
        return sum(v for k, v in self.continuations.items() if k.split("/", 1)[0] == outcome)

    @property
    def continued(self) -> float | None:
        return self._continuations("continued")

    @property
    def continued_on_fallback(self) -> float | None:
        return self._continuations("fallback")

    @property
    def continuation_completed(self) -> float | None:
        return self._continuations("completed")

    @property
    def continuation_refused(self) -> float | None:
        return self._continuations("refused")

    @property
    def continuation_failed(self) -> float | None:
        return self._continuations("failed")

    @property
    def failed_pct(self) -> float:
        return 100.0 * self.failed / self.sent if self.sent else 0.0


# --- the operators ------------------------------------------------------------------------------


def twin_command(
    scenario: str, port: int, speed: float, seed: int, workdir: Path, fault_every: float | None
) -> list[str]:
    every = [] if fault_every is None else ["--sim-fault-every", f"{fault_every:g}"]
    return [
        sys.executable, "-m", "vllm_guardian.sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "bench", "--shutdown-timeout", "10", "--sim-scenario", scenario,
        "--sim-speed", f"{speed:g}", "--sim-seed", str(seed),
        "--sim-gpu-state-file", str(workdir / "gpu.json"),
        "--sim-gpu-state-interval-seconds", f"{max(0.25, 1.0 / speed):g}",
        "--sim-timeline-file", str(workdir / "timeline.json"), *every,
    ]  # fmt: skip


class _Watcher:
    """A thread that runs ``_run`` from ``with`` until the block ends (``_stop`` set)."""

    join_seconds = 5.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=self.join_seconds)


class StartWatch(_Watcher):
    """Notes when a supervisor starts vLLM again (its ``starts`` count grows), every 0.1 s."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.restarts_unix_seconds: list[float] = []
        super().__init__()

    def _run(self) -> None:
        seen = self.sup.starts
        while not self._stop.wait(0.1):
            now = self.sup.starts
            self.restarts_unix_seconds += [time.time()] * max(0, now - max(seen, 1))
            seen = max(seen, now)


class HealthWatch(_Watcher):
    """Polls /health; downtime counts from the first 200 on."""

    def __init__(self, url: str, period: float) -> None:
        self.url = url + "/health"
        self.period = period
        self.down = 0.0
        self._up_once = False
        super().__init__()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                ok = requests.get(self.url, timeout=self.period).status_code == 200
            except requests.RequestException:
                ok = False
            now = time.monotonic()
            if ok:
                self._up_once = True
            elif self._up_once:
                self.down += now - last
            last = now
            self._stop.wait(self.period)


class Sidecar(_Watcher):
    """The runbook's threshold sidecar, with its clock divided by the twin's speed."""

    join_seconds = 30.0  # a restart it started finishes first

    def __init__(self, url: str, sup: Supervisor, speed: float) -> None:
        self.url = url
        self.sup = sup
        self.poll = 30.0 / speed
        self.window = 300.0 / speed
        self.wait = 60.0 / speed
        self.events: collections.deque[float] = collections.deque()
        self.actions: list[tuple[float, str]] = []
        super().__init__()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            text = requests.get(self.url + "/metrics", timeout=5).text
        except requests.RequestException:
            return None
        engines = parse_vllm_metrics(text).engines
        if not engines:
            return None
        kv = max(e.kv_cache_usage_ratio or 0.0 for e in engines)
        return (
            kv,
            sum(e.requests_waiting or 0 for e in engines),
            sum(e.requests_running or 0 for e in engines),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            s = self._sample()
            now = time.monotonic()
            if s is not None and (s[0] > 0.95 or s[1] > 2 * s[2]):
                self.events.append(now)
            while self.events and now - self.events[0] > self.window:
                self.events.popleft()
            if len(self.events) >= 3:
                self.actions.append((time.time(), "restart (same flags)"))
                deadline = time.monotonic() + self.wait
                while time.monotonic() < deadline and not self._stop.is_set():
                    s = self._sample()
                    if s is None or s[2] <= 0:
                        break
                    time.sleep(0.2)
                self.sup.restart()
                self.events.clear()


class AlertLog(_Watcher):
    """Reads the guardian's /metrics every 0.25 s and remembers which alerts fired."""

    def __init__(self, url: str) -> None:
        self.url = url + "/metrics"
        self.fired: set[str] = set()
        super().__init__()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                text = requests.get(self.url, timeout=2).text
            except requests.RequestException:
                continue
            for line in text.splitlines():
                if line.startswith("vllm_guardian_alert{") and 'alertstate="firing"' in line:
                    name = line.split('alertname="', 1)[1].split('"', 1)[0]
                    self.fired.add(name)


def _scale_fields(obj: Any, speed: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name.endswith("_seconds"):
            lo = f.metadata.get("min")
            v = max(lo if lo is not None else 0.0, v / speed)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = _scale_fields(v, speed)  # a nested section (policy.concurrency_relaunch)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def guardian_config(
    workdir: Path,
    url: str,
    port: int,
    command: list[str],
    speed: float,
    gate_port: int | None = None,
) -> Any:
    """The shipped defaults, armed, every time constant divided by the twin's speed; with
    ``gate_port``, the service's ``gate:`` section too (the gate reads the same file)."""
    rules = parse_rules(default_rules_text(), "defaults")
    scaled = [
        {k: v for k, v in dataclasses.asdict(r).items() if k != "optional" or v}
        | {"for_seconds": r.for_seconds / speed, "keep_firing_for_seconds": r.keep_firing_for_seconds / speed,
           "severity": r.severity.value, "cause": r.cause.value if r.cause else None}
        for r in rules
    ]  # fmt: skip
    for r in scaled:
        if r["cause"] is None:
            del r["cause"]
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"rules": scaled}, sort_keys=False))
    policy = _scale_fields(PolicyConfig(), speed) | {"dry_run": False, "backend": "process"}
    cfg = {
        "interval_seconds": max(0.1, 2.0 / speed),
        "listen": f"127.0.0.1:{port}",
        "runtime_dir": str(workdir / "run"),
        "state_dir": str(workdir / "state"),
        "recorder": {"path": None},
        "services": [
            {"name": "vllm", "url": url, "command": command, "log_file": str(workdir / "vllm.log")}
            | ({} if gate_port is None else {"gate": gate_section(gate_port, speed)})
        ],
        # The twin publishes allocator stats as the in-vLLM plugin does, where the guardian's
        # process backend tells it to (<directory>/<service>): fragmentation gets its cause.
        "sources": {
            "nvml": {"backend": "file", "state_file": str(workdir / "gpu.json")},
            "allocator": {"directory": str(workdir / "allocator")},
        },
        "signals": _scale_fields(SignalsConfig(), speed),
        "alerting": {"default_rules": False, "rules_file": str(workdir / "rules.yaml")},
        "policy": policy,
    }
    path = workdir / "config.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML: `vllm-guardian gate -c` reads it
    return parse_config(path.read_text(), str(path))


def gate_section(port: int, speed: float) -> dict[str, Any]:
    """The service's ``gate:`` defaults, its clock divided by the twin's speed."""
    return _scale_fields(GateConfig(), speed) | {
        "listen": f"127.0.0.1:{port}",
        "release_rate_per_second": GateConfig().release_rate_per_second * speed,
        "retry_after_seconds": 1,
        # Not divided: 0.1 s already notices a restart before the guardian's next tick, and
        # 40 polls a second would cost the shared cores more than they tell.
        "poll_interval_seconds": GateConfig().poll_interval_seconds,
        # One gate process, as in the runs already reported: the twin's load fits one core, and
        # the twin, the guardian and the clients share the machine's.
        "workers": 1,
    }


def gate_command(workdir: Path) -> list[str]:
    """The deployed form: ``vllm-guardian gate -c CONFIG --service vllm`` (as its unit runs it)."""
    return [sys.executable, "-m", "vllm_guardian", "gate", "-c", str(workdir / "config.yaml"),
            "--service", "vllm"]  # fmt: skip


def stop_process(
    proc: subprocess.Popen[bytes], sig: int, wait_seconds: float, kill_wait_seconds: float
) -> None:
    """Send ``sig``; SIGKILL the process if it has not exited within ``wait_seconds``."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=wait_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=kill_wait_seconds)


def stop_gate(gate: subprocess.Popen[bytes]) -> None:
    """SIGTERM the gate's process; SIGKILL it if it has not exited within 15 s."""
    stop_process(gate, signal.SIGTERM, 15, 5)


def gate_counts(metrics_text: str) -> tuple[dict[str, float], float | None]:
    """The gate's ``continuations_total`` by "outcome/reason" (every series it exports, the
    zeros included) and its ``retried_total``, from its ``/metrics``."""
    counts: dict[str, float] = {}
    retried: float | None = None
    for fam in text_string_to_metric_families(metrics_text):
        for sample in fam.samples:
            if sample.name == "vllm_guardian_gate_continuations_total":
                key = f"{sample.labels['outcome']}/{sample.labels['reason']}"
                counts[key] = counts.get(key, 0.0) + sample.value
            elif sample.name == "vllm_guardian_gate_retried_total":
                retried = (retried or 0.0) + sample.value
    return counts, retried


def gate_metrics_text(url: str) -> str | None:
    """The ``/metrics`` exposition of the gate at ``url``; None when it does not answer."""
    try:
        r = requests.get(url + GateConfig().metrics_path, timeout=10)
        r.raise_for_status()
    except requests.RequestException:
        return None
    return r.text


def read_gate_counts(url: str) -> tuple[dict[str, float] | None, float | None]:
    """:func:`gate_counts` of the gate at ``url``; (None, None) when it does not answer."""
    text = gate_metrics_text(url)
    return (None, None) if text is None else gate_counts(text)


def audited_actions(workdir: Path) -> list[tuple[float, str, str | None]]:
    """The guardian's actions from its audit log: (time, the reason's first clause as the
    results table shows it, cause)."""
    return [
        (d.time_seconds, d.reason.split(";")[0], d.cause.value if d.cause else None)
        for d in audit.read(workdir / "state" / "audit.jsonl")
        if d.what is DecisionKind.ACTION
    ]


def wait_healthy(url: str, limit_seconds: float = 180.0) -> None:
    deadline = time.monotonic() + limit_seconds
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not healthy within {limit_seconds:.0f} s")


def mixed_plan(scenario: str, seed: int, duration_sim_seconds: float) -> list[PlannedRequest]:
    """The scenario's seeded arrivals; a seeded half of them stream."""
    plan = plan_requests(SCENARIOS[scenario].load, seed, 100_000, duration_sim_seconds)
    rng = random.Random(f"stream-{seed}")
    return [dataclasses.replace(p, stream=rng.random() < STREAM_SHARE) for p in plan]


# --- one run ------------------------------------------------------------------------------------


def run_one(
    scenario: str,
    operator: str,
    seed: int,
    speed: float,
    duration: float,
    keep: bool = False,
    fault_every: float | None = None,
) -> Run:
    run = Run(scenario, operator, seed)
    started = time.monotonic()
    prefix = f"outcome-{scenario}-{operator}-{seed}-"
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix=prefix) if keep else stack.enter_context(
            tempfile.TemporaryDirectory(prefix=prefix))  # fmt: skip
        workdir = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = twin_command(scenario, port, speed, seed, workdir, fault_every)
        guardian: Guardian | None = None
        alert_log: AlertLog | None = None
        loop: threading.Thread | None = None
        sup: Supervisor | None = None
        starts: StartWatch | None = None
        gate: subprocess.Popen[bytes] | None = None
        sidecar: Sidecar | None = None
        load_url = url
        outcomes: list[RequestOutcome] = []
        load_start = time.time()
        try:
            if operator.startswith("guardian"):
                gport = free_port()
                gate_port = free_port() if operator == "guardian+gate" else None
                guardian = Guardian(guardian_config(workdir, url, gport, command, speed, gate_port))
                alert_log = AlertLog(f"http://127.0.0.1:{gport}").__enter__()
                if guardian.healing is not None and "vllm" in guardian.healing.supervisors:
                    starts = StartWatch(guardian.healing.supervisors["vllm"]).__enter__()
                loop = threading.Thread(
                    target=guardian.run, kwargs={"install_signals": False}, daemon=True
                )
                loop.start()
                if gate_port is not None:
                    with (workdir / "gate.log").open("wb") as log:
                        gate = subprocess.Popen(
                            gate_command(workdir),
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                        )  # fmt: skip
                    load_url = f"http://127.0.0.1:{gate_port}"
            else:
                sup = Supervisor(
                    "vllm", command, workdir / "vllm.env", workdir / "vllm.log",
                    stop_timeout_seconds=15, restart_on_clean_exit=operator != "unguarded-on-failure",
                )  # fmt: skip
                sup.start()
                starts = StartWatch(sup).__enter__()
                if operator == "sidecar":
                    sidecar = Sidecar(url, sup, speed)
                    sidecar.__enter__()
            with HealthWatch(url, 0.25) as watch:
                # The load begins when vLLM is ready (and the gate answers), for every operator.
                wait_healthy(url)
                wait_healthy(load_url)
                plan = mixed_plan(scenario, seed, duration * speed)
                load_start = time.time()
                result = run_load(
                    load_url, plan, model="bench", speed=speed, stream=False,
                    max_duration_seconds=duration, max_in_flight=2048,
                    request_timeout_seconds=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
                outcomes = list(result.outcomes)
                if keep:  # every request's outcome beside the run's logs, for a post-mortem
                    (workdir / "requests.jsonl").write_text(
                        "".join(o.to_json() + "\n" for o in outcomes)
                    )
            run.downtime_seconds = watch.down
        finally:
            actions: list[tuple[float, str]] = []
            if sidecar is not None:
                sidecar.__exit__()
                actions += sidecar.actions
            if gate is not None:
                # Before it stops: its counters live in its process.
                run.continuations, run.gate_retried = read_gate_counts(load_url)
                stop_gate(gate)
            if guardian is not None and loop is not None:
                guardian.request_stop()
                loop.join(timeout=60)
                actions += [(t, reason) for t, reason, _ in audited_actions(workdir)]
                content = flagsfile.read(workdir / "state" / "vllm.env")
                run.final_flags = (
                    " ".join([*content.argv, *(f"{k}={v}" for k, v in content.env)])
                    if content
                    else ""
                )
            if alert_log is not None:
                alert_log.__exit__()
                run.alerts_fired = sorted(alert_log.fired)
            restarts: list[float] = []
            if starts is not None:
                starts.__exit__()
                restarts = starts.restarts_unix_seconds
            if sup is not None:
                sup.stop()
            timeline = read_timeline(workdir / "timeline.json")
    actions.sort()
    run.actions = [a for _, a in actions]
    run.restarts = len(restarts)
    measure(run, outcomes, load_start, duration, [f.unix_seconds for f in timeline.faults],
            sorted([*(t for t, _ in actions), *restarts]))  # fmt: skip
    run.oom_crashes = sum(1 for f in timeline.faults if f.kind == "oom")
    run.wall_seconds = time.monotonic() - started
    return run


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    run: Run,
    outcomes: Sequence[RequestOutcome],
    load_start: float,
    duration: float,
    faults: Sequence[float],
    action_times: Sequence[float],
) -> None:
    """Fill ``run``'s request measures; ``faults`` and ``action_times`` are Unix seconds."""
    sent = [o for o in outcomes if o.kind is not OutcomeKind.NOT_SENT]
    ok = [o for o in sent if o.kind is OutcomeKind.OK]
    failed = [o for o in sent if o.kind in FAILED]
    run.sent, run.failed = len(sent), len(failed)
    run.goodput_tokens_per_second = sum(o.completion_tokens for o in ok) / duration
    lat = [o.latency_seconds for o in ok if o.latency_seconds is not None]
    ttft = [o.ttft_seconds for o in ok if o.ttft_seconds is not None]
    run.p50_latency_seconds, run.p99_latency_seconds = percentile(lat, 0.5), percentile(lat, 0.99)
    run.p50_ttft_seconds, run.p99_ttft_seconds = percentile(ttft, 0.5), percentile(ttft, 0.99)
    faults = sorted(faults)
    run.faults = len(faults)

    def sent_at(o: RequestOutcome) -> float:
        return load_start + o.scheduled_seconds

    def ended_at(o: RequestOutcome) -> float:
        if o.ended_seconds is not None:
            return load_start + o.ended_seconds
        return sent_at(o) + (o.latency_seconds or 0.0)

    # An outage runs from a fault to the end of the first success among requests sent after it.
    outages: list[tuple[float, float]] = []
    for f in faults:
        served = [ended_at(o) for o in ok if sent_at(o) >= f]
        outages.append((f, min(served) if served else float("inf")))
    if faults:
        first, back = outages[0]
        run.time_to_recover_seconds = back - first if back != float("inf") else None
        acted = [t for t in action_times if t >= first]
        run.time_to_detect_seconds = min(acted) - first if acted else None
    for o in failed:
        s, e = sent_at(o), ended_at(o)
        if any(f <= s < r for f, r in outages):
            run.failed_during_outage += 1
        elif any(s < f <= e + FAULT_SLACK_SECONDS for f in faults):
            run.failed_in_flight += 1
        else:
            run.failed_other += 1


# --- cells, verdicts, report --------------------------------------------------------------------

MEASURES = ("failed_pct", "failed", "failed_in_flight", "failed_during_outage", "failed_other",
            "time_to_detect_seconds", "time_to_recover_seconds", "downtime_seconds",
            "goodput_tokens_per_second", "p50_latency_seconds", "p99_latency_seconds",
            "p50_ttft_seconds", "p99_ttft_seconds", "oom_crashes", "restarts", "sent",
            "continued", "continued_on_fallback", "continuation_completed",
            "continuation_refused", "continuation_failed", "gate_retried")  # fmt: skip
# The report's continuation column, in its order: what the gate did with the streams the
# upstream cut, and the requests it sent again whole.
CONTINUATION_COLUMN = ("continued", "continuation_completed", "continuation_refused",
                       "continuation_failed", "gate_retried")  # fmt: skip


@dataclasses.dataclass
class Cell:
    scenario: str
    operator: str
    runs: list[Run]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    busy: bool
    commit: str | None = None  # the code measured (None: this run's)

    def stat(self, name: str) -> tuple[float, float, float] | None:
        """(median, min, max) over the seeds; None when no run has the measure."""
        vals = [v for r in self.runs if (v := getattr(r, name)) is not None]
        if not vals:
            return None
        return statistics.median(vals), min(vals), max(vals)

    def median(self, name: str) -> float | None:
        s = self.stat(name)
        return None if s is None else s[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "operator": self.operator,
            "load_before": self.load_before, "load_after": self.load_after, "busy": self.busy,
            "stats": {m: self.stat(m) for m in MEASURES},
            "runs": [dataclasses.asdict(r) | {"failed_pct": r.failed_pct} for r in self.runs],
        }  # fmt: skip


def disruptive(cell: Cell) -> list[str]:
    return sorted({a for r in cell.runs for a in r.actions})


def verdict(scenario: str, cells: dict[tuple[str, str], Cell]) -> str | None:
    """The outcome goal (kv_thrash judged as an overload), on medians. Printed, never asserted."""
    g, u, c = (cells.get((scenario, op)) for op in ("guardian+gate", "unguarded", "sidecar"))
    if g is None or u is None:
        return None
    gf, uf = g.median("failed") or 0.0, u.median("failed") or 0.0
    gg, ug = (
        g.median("goodput_tokens_per_second") or 0.0,
        u.median("goodput_tokens_per_second") or 0.0,
    )
    acts = disruptive(g)
    if scenario in CONTROLS:
        checks = {
            "no action": not acts,
            f"failed {gf:g} ≤ unguarded {uf:g}": gf <= uf,
            f"goodput {gg:.0f} ≥ 95 % of unguarded {ug:.0f}": gg >= 0.95 * ug,
        }
    elif scenario in OVERLOAD:
        gt, ut = g.median("p99_ttft_seconds"), u.median("p99_ttft_seconds")
        alert = all(OVER_CAPACITY_ALERT in r.alerts_fired for r in g.runs)
        checks = {
            "no disruptive action": not acts,
            f"failed {gf:g} ≤ unguarded {uf:g}": gf <= uf,
            f"goodput {gg:.0f} ≥ unguarded {ug:.0f}": gg >= ug,
            f"p99 TTFT {_f(gt)} ≤ unguarded {_f(ut)}": gt is not None
            and ut is not None
            and gt <= ut,
            f"{OVER_CAPACITY_ALERT} fired"
            + (
                ""
                if OVER_CAPACITY_ALERT in default_rules_text()
                else " (no such rule in this build)"
            ): alert,
        }
    else:
        cf = c.median("failed") or 0.0 if c is not None else None
        checks = {f"failed {gf:g} ≤ 10 % of unguarded {uf:g}": gf <= 0.10 * uf}
        if cf is not None:
            checks[f"≤ 25 % of sidecar {cf:g}"] = gf <= 0.25 * cf
    met = all(checks.values())
    parts = [f"{k} {'✓' if v else '✗'}" for k, v in checks.items()]
    tail = ""
    if not met and scenario in FAILURES:
        tail = (f" — guardian+gate's failures: {_f(g.median('failed_in_flight'))} in flight at the "
                f"fault, {_f(g.median('failed_during_outage'))} during the outage (detect "
                f"{_f(g.median('time_to_detect_seconds'))} s, recover "
                f"{_f(g.median('time_to_recover_seconds'))} s), {_f(g.median('failed_other'))} other")  # fmt: skip
    return f"- {scenario}: {'met' if met else 'MISSED'} — {'; '.join(parts)}{tail}"


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _mm(cell: Cell, name: str, fmt: str = "{:.1f}") -> str:
    s = cell.stat(name)
    if s is None:
        return "–"
    med, lo, hi = s
    if len(cell.runs) == 1 or lo == hi:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def partial_note(cells: Sequence[Cell], args: argparse.Namespace) -> list[str]:
    """A warning line when this is not the full matrix (every scenario, operator, ≥ 3 seeds)."""
    missing = [s for s in ALL if not any(c.scenario == s for c in cells)]
    ops = [o for o in OPERATORS if not any(c.operator == o for c in cells)]
    if not missing and not ops and len(args.seeds) >= 3:
        return []
    what = []
    if missing:
        what.append(f"scenarios left out: {', '.join(missing)}")
    if ops:
        what.append(f"operators left out: {', '.join(ops)}")
    if len(args.seeds) < 3:
        what.append(f"{len(args.seeds)} seed(s), not 3")
    return [f"**Partial run, not the benchmark's result** ({'; '.join(what)}).", ""]


def _commit() -> str:
    """The code measured: the commit, ``+dirty`` when the tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _name(c: Cell) -> str:
    return f"{c.scenario}/{c.operator}"


def merge_cells(
    path: Path, fresh: list[Cell], args: argparse.Namespace, this: dict[str, Any]
) -> tuple[list[Cell], list[dict[str, Any]]]:
    """The earlier report's cells with the ones run now in their place, in the matrix's order,
    and the runs (command, commit) each cell's numbers come from, this one (``this``) last."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--merge {path}: {exc}") from exc
    for key, now in (("speed", args.speed), ("duration_seconds", args.duration),
                     ("seeds", args.seeds), ("fault_every", args.fault_every)):  # fmt: skip
        if old.get(key) != now:
            raise SystemExit(f"--merge {path}: its {key} is {old.get(key)!r}, this run's {now!r}")
    by: dict[tuple[str, str], Cell] = {}
    for d in old["cells"]:
        runs = [Run(**{k: v for k, v in r.items() if k != "failed_pct"}) for r in d["runs"]]
        cell = Cell(d["scenario"], d["operator"], runs, tuple(d["load_before"]),
                    tuple(d["load_after"]), d["busy"], d.get("commit") or old.get("commit"))  # fmt: skip
        by[(cell.scenario, cell.operator)] = cell
    sources: list[dict[str, Any]] = old.get("sources") or [
        {"command": old.get("command"), "commit": old.get("commit"),
         "wall_seconds": old.get("wall_seconds"), "cells": [_name(c) for c in by.values()]}
    ]  # fmt: skip
    for c in fresh:
        by[(c.scenario, c.operator)] = c
    cells = [by[(s, o)] for s in ALL for o in OPERATORS if (s, o) in by]
    now = {_name(c) for c in fresh}
    kept = [s | {"cells": [n for n in s["cells"] if n not in now]} for s in sources]
    return cells, [s for s in kept if s["cells"]] + [this]


def markdown(cells: list[Cell], args: argparse.Namespace, wall_seconds: float) -> str:
    lines = [
        "# Outcome benchmark",
        "",
        f"`{args.command}` — seeds {', '.join(map(str, args.seeds))}, twin speed {args.speed:g}×, "
        f"{args.duration:g} s of load per run (= {args.duration * args.speed:g} simulated seconds), "
        f"{int(STREAM_SHARE * 100)} % of requests streaming"
        + (
            f", a fault every {args.fault_every:g} simulated s on average"
            if args.fault_every
            else ""
        )
        + f"; {len(cells)} cells, "
        f"wall time {wall_seconds / 60:.0f} min on {os.cpu_count()} cores, "
        f"{args.jobs} run{'s' if args.jobs > 1 else ''} at a time; commit {args.commit}.",
        "",
        *(
            [
                f"**Assembled from {len(args.sources)} runs** (`--merge`; each cell's numbers "
                "come from one run; the wall time above is the last one's):",
                "",
                *(
                    f"- `{s['command']}` (commit {s['commit'] or 'not recorded'}"
                    + (f", {s['wall_seconds'] / 60:.0f} min" if s.get("wall_seconds") else "")
                    + f"): {len(s['cells'])} cells: {', '.join(s['cells'])}"
                    for s in args.sources
                ),
                "",
            ]
            if len(getattr(args, "sources", [])) > 1
            else []
        ),
        *partial_note(cells, args),
        "Each value: median over the seeds (min–max). *Split*: failed in flight at a fault / "
        "arrived during an outage / other. *Detect*: first fault → the operator's first action or vLLM's restart; "
        "*recover*: first fault → the first success among requests sent after it. "
        "*Continuations* (the gate's, per run): cut streams continued / completed by the gate "
        "(cut after their last token) / refused / failed, and requests sent again whole (–: "
        "no gate).",
        "",
        "| scenario | operator | sent | failed % | split | detect s | recover s | down s | goodput tok/s "
        "| p50 / p99 s | TTFT p50 / p99 s | OOMs | restarts | continuations | actions | final flags | load avg before → after |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---:|---:|---|---|---|---|",
    ]
    for c in cells:
        split = "/".join(_f(c.median(m), "{:.0f}") for m in
                         ("failed_in_flight", "failed_during_outage", "failed_other"))  # fmt: skip
        acts = "; ".join(f"{a} ×{n}" for a, n in collections.Counter(a for r in c.runs for a in r.actions).items()) or "–"  # fmt: skip
        flags = sorted({r.final_flags for r in c.runs if r.final_flags}) or ["–"]
        load = f"{c.load_before[0]:.1f} → {c.load_after[0]:.1f}{' **busy**' if c.busy else ''}"
        cont = (
            "–"
            if c.stat(CONTINUATION_COLUMN[0]) is None
            else " / ".join(_mm(c, m, "{:.0f}") for m in CONTINUATION_COLUMN)
        )
        lines.append(
            f"| {c.scenario} | {c.operator} | {_mm(c, 'sent', '{:.0f}')} | {_mm(c, 'failed_pct')} | {split} "
            f"| {_mm(c, 'time_to_detect_seconds')} | {_mm(c, 'time_to_recover_seconds')} "
            f"| {_mm(c, 'downtime_seconds')} | {_mm(c, 'goodput_tokens_per_second', '{:.0f}')} "
            f"| {_f(c.median('p50_latency_seconds'), '{:.2f}')} / {_f(c.median('p99_latency_seconds'), '{:.2f}')} "
            f"| {_f(c.median('p50_ttft_seconds'), '{:.2f}')} / {_f(c.median('p99_ttft_seconds'), '{:.2f}')} "
            f"| {_mm(c, 'oom_crashes', '{:.0f}')} | {_mm(c, 'restarts', '{:.0f}')} | {cont} | {acts} | {' / '.join(flags)} | {load} |"
        )  # fmt: skip
    lines += [
        "",
        "Goal, judged on `guardian+gate` medians: in every failure scenario failed ≤ 10 % of "
        "`unguarded` and ≤ 25 % of `sidecar`; in `steady` and `prefix_cache_waste` no action, failed "
        "≤ `unguarded`, goodput ≥ 95 % of it; `kv_thrash` is an overload (docs/capacity.md): no "
        f"disruptive action, failed ≤ unguarded, goodput ≥ unguarded, p99 TTFT ≤ unguarded, "
        f"`{OVER_CAPACITY_ALERT}` fired.",
        "",
    ]
    by = {(c.scenario, c.operator): c for c in cells}
    for s in [s for s in ALL if any(c.scenario == s for c in cells)]:
        v = verdict(s, by)
        if v is not None:
            lines.append(v)
    return "\n".join(lines) + "\n"


COLOURS = ("#8c8c8c", "#c9a227", "#d1603d", "#3b7dd8", "#2a9d5b")


def chart_svg(cells: list[Cell]) -> str:
    """Failed % per scenario and operator: bars at the median, whiskers min–max."""
    scenarios = [s for s in ALL if any(c.scenario == s for c in cells)]
    ops = [o for o in OPERATORS if any(c.operator == o for c in cells)]
    by = {(c.scenario, c.operator): c for c in cells}
    w, h, left, top, bottom = 120 * len(scenarios) + 80, 420, 60, 40, 90
    plot_h = h - top - bottom
    highs = [st[2] for c in cells if (st := c.stat("failed_pct")) is not None]
    top_val = min(100.0, max([5.0, *highs]) * 1.1)

    def y(v: float) -> float:
        return top + plot_h * (1 - v / top_val)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">Failed requests (%) per scenario and operator — median, whiskers min–max</text>']  # fmt: skip
    for i in range(6):
        v = top_val * i / 5
        out.append(
            f'<line x1="{left}" x2="{w - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
        )
        out.append(f'<text x="{left - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    group = 120
    bw = (group - 20) / max(1, len(ops))
    for si, s in enumerate(scenarios):
        x0 = left + 10 + si * group
        out.append(
            f'<text x="{x0 + group / 2 - 10}" y="{h - bottom + 16}" text-anchor="middle">{s}</text>'
        )
        for oi, op in enumerate(ops):
            c = by.get((s, op))
            st = c.stat("failed_pct") if c else None
            if st is None:
                continue
            med, lo, hi = st
            x = x0 + oi * bw
            out.append(f'<rect x="{x:.1f}" y="{y(med):.1f}" width="{bw - 2:.1f}" height="{y(0) - y(med):.1f}" fill="{COLOURS[OPERATORS.index(op)]}"/>')  # fmt: skip
            cx = x + (bw - 2) / 2
            out.append(
                f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(lo):.1f}" y2="{y(hi):.1f}" stroke="black"/>'
            )
            for v in (lo, hi):
                out.append(f'<line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="black"/>')  # fmt: skip
    for oi, op in enumerate(ops):
        x = left + oi * 150
        out.append(
            f'<rect x="{x}" y="{h - 40}" width="12" height="12" fill="{COLOURS[OPERATORS.index(op)]}"/>'
        )
        out.append(f'<text x="{x + 16}" y="{h - 30}">{op}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- main ---------------------------------------------------------------------------------------


def _names(
    text: str | None, allowed: Sequence[str], default: Sequence[str], what: str
) -> list[str]:
    if not text:
        return list(default)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (known: {', '.join(allowed)})")
    return names


LoadAvg = tuple[float, float, float]


def _run_job(
    scenario: str,
    operator: str,
    seed: int,
    speed: float,
    duration: float,
    keep: bool,
    fault_every: float | None,
) -> tuple[Run, LoadAvg, LoadAvg]:
    """One run with the host's load average just before and just after it."""
    before = os.getloadavg()
    r = run_one(scenario, operator, seed, speed, duration, keep, fault_every)
    return r, before, os.getloadavg()


def _run_job_process(
    scenario: str,
    operator: str,
    seed: int,
    speed: float,
    duration: float,
    keep: bool,
    fault_every: float | None,
) -> tuple[Run, LoadAvg, LoadAvg]:
    """:func:`_run_job` in a process of its own (``outcome.py --one``), its result in a file."""
    job = [scenario, operator, seed, speed, duration, keep, fault_every]
    with tempfile.TemporaryDirectory(prefix="outcome-job-") as tmp:
        out = Path(tmp) / "run.json"
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job), "--one-out", str(out)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            check=False, timeout=1800,
        )  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{scenario}/{operator}/{seed}: the run's process exited {proc.returncode}:\n"
                f"{proc.stderr[-4000:]}"
            )
        d, before, after = json.loads(out.read_text())
    return Run(**d), tuple(before), tuple(after)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true",
                    help=f"CI smoke: {', '.join(QUICK)}, one seed, 20 s runs; asserts nothing numeric")  # fmt: skip
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument(
        "--duration", type=float, default=None, help="real seconds of load per run (60)"
    )
    ap.add_argument("--scenarios", default=None, help="comma-separated subset")
    ap.add_argument("--operators", default=None, help="comma-separated subset")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (7,8,9)")
    ap.add_argument(
        "--fault-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a flaky deployment: the twin's --sim-fault-every (mean simulated seconds between "
        "seeded recurrences of the scenario's fault, an engine death where it has none)",
    )
    ap.add_argument(
        "--jobs", type=int, default=1,
        help="runs at a time, each in its own process (default 1; the report says how many)",
    )  # fmt: skip
    ap.add_argument(
        "--merge", type=Path, default=None, metavar="OUTCOME.json",
        help="an earlier run's outcome.json (same speed, duration, seeds): its cells not run "
        "now are kept, the ones run now replace theirs; the report says which came from where",
    )  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep each run's directory (logs, audit)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one run, for --jobs
    ap.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        r, before, after = _run_job(*json.loads(args.one))
        args.one_out.write_text(json.dumps([dataclasses.asdict(r), before, after]))
        return 0
    args.command = " ".join(
        [".venv/bin/python bench/outcome.py", *(sys.argv[1:] if argv is None else argv)]
    )
    scenarios = _names(args.scenarios, ALL, QUICK if args.quick else ALL, "scenario")
    operators = _names(args.operators, OPERATORS, OPERATORS, "operator")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (
            [SEEDS[0]] if args.quick else list(SEEDS))  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"--seeds: {exc}") from exc
    args.duration = args.duration or (20.0 if args.quick else 60.0)
    if args.jobs < 1:
        raise SystemExit(f"--jobs: {args.jobs}: at least 1")
    cores = os.cpu_count() or 1
    jobs = [(s, op, seed) for s in scenarios for op in operators for seed in args.seeds]
    done: dict[tuple[str, str, int], tuple[Run, LoadAvg, LoadAvg]] = {}
    t0 = time.monotonic()

    def report(key: tuple[str, str, int], out: tuple[Run, LoadAvg, LoadAvg]) -> None:
        done[key] = out
        r, before, after = out
        print(f"{r.scenario:<20} {r.operator:<21} seed {r.seed:<3} sent {r.sent:5d} failed {r.failed:5d} "
              f"({r.failed_pct:5.1f} %: {r.failed_in_flight}/{r.failed_during_outage}/{r.failed_other}) "
              f"detect {_f(r.time_to_detect_seconds)} recover {_f(r.time_to_recover_seconds)} "
              f"down {r.downtime_seconds:5.1f}s goodput {r.goodput_tokens_per_second:6.0f} "
              f"OOMs {r.oom_crashes} restarts {r.restarts} actions {len(r.actions)} [{r.wall_seconds:.0f}s] "
              f"load {before[0]:.2f} → {after[0]:.2f}{'  BUSY HOST' if max(before[0], after[0]) > cores else ''}",
              flush=True)  # fmt: skip

    run_args = (args.speed, args.duration, args.keep, args.fault_every)
    if args.jobs == 1:
        for key in jobs:
            report(key, _run_job(*key, *run_args))
    else:
        # Each run in a fresh process of this script (``--one``): runs share no threads, ports
        # or state; ``jobs`` of them at a time, in the matrix's order.
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(_run_job_process, *key, *run_args): key for key in jobs}
            for fut in concurrent.futures.as_completed(futures):
                report(futures[fut], fut.result())
    cells: list[Cell] = []
    for s in scenarios:
        for op in operators:
            outs = [done[(s, op, seed)] for seed in args.seeds]
            # The worst load average seen around any of the cell's runs.
            before = max((b for _, b, _ in outs), key=lambda x: x[0])
            after = max((a for _, _, a in outs), key=lambda x: x[0])
            busy = max(before[0], after[0]) > cores
            cells.append(Cell(s, op, [r for r, _, _ in outs], before, after, busy))
    wall = time.monotonic() - t0
    args.commit = _commit()
    this = {"command": args.command, "commit": args.commit, "wall_seconds": wall,
            "cells": [_name(c) for c in cells]}  # fmt: skip
    args.sources = [this]
    if args.merge is not None:
        cells, args.sources = merge_cells(args.merge, cells, args, this)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    md = markdown(cells, args, wall)
    (args.out / f"outcome{suffix}.md").write_text(md)
    doc = {"command": args.command, "commit": args.commit, "seeds": args.seeds, "speed": args.speed,
           "jobs": args.jobs, "duration_seconds": args.duration, "fault_every": args.fault_every,
           "wall_seconds": wall, "cores": cores, "sources": args.sources,
           "cells": [c.to_json() | {"commit": c.commit or args.commit} for c in cells]}  # fmt: skip
    (args.out / f"outcome{suffix}.json").write_text(json.dumps(doc, indent=1))
    (args.out / f"outcome{suffix}.svg").write_text(chart_svg(cells))
    print(md)
    print(f"wall time {wall:.0f} s; written to {args.out}/outcome{suffix}.{{md,json,svg}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
