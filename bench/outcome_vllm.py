"""The outcome benchmark on a real vLLM: the twin benchmark's load, operators and measures, with
faults that run through vLLM's own failure paths.

Run (one seed, every scenario and operator, about an hour on a quiet 2-core host)::

    .venv/bin/python bench/outcome_vllm.py --seeds 7 --out bench/results

``--quick`` is one scenario (``prefill_oom``) under ``unguarded`` and ``guardian+gate``, one
seed, a short window. The server is vLLM 0.32's CPU build serving the real-vLLM tier's tiny
random-weight model (``scripts/vllm-setup``; docs/vllm-tier.md), ``--enforce-eager``, a small
KV pool. The faults (``tests/vllm_tier/faults``, a test-only vLLM plugin):

* **prefill_oom** — every model step that schedules more than 512 tokens raises torch's
  ``OutOfMemoryError`` with CUDA's text from the real model runner (the activations of a
  batched prefill that do not fit), at ``--max-num-batched-tokens 1024``. vLLM's worker logs
  the traceback, its engine core dies, the server exits 0. A restart with the same flags meets
  the next burst; a relaunch at ``--max-num-batched-tokens 512`` or less is cured.
* **engine_death** — the engine core process is SIGKILLed 45 s into the load.
* **engine_hang** — 45 s into the load the engine core's step blocks for good: no token comes,
  ``/health`` still answers 200.
* **steady** — the same load, no fault (the control).

* **overload** — no fault: about twice what the server completes with its KV pool full, for
  five minutes (the over-capacity alert's window and its two minutes).

Operators: ``unguarded`` (a supervisor that restarts vLLM like ``Restart=always``),
``unguarded-on-failure`` (``Restart=on-failure``: vLLM's exit 0 after an engine death leaves it
down), ``sidecar`` (the runbook's threshold loop), ``guardian+gate`` (the deployed form: the
armed guardian, ``vllm-guardian run`` in a process of its own, supervising vLLM, and
``vllm-guardian gate`` in front, the load through the gate).
The guardian runs its shipped rules and policy, armed, with three settings for this host, each
an operator's knob: no NVML (no GPU), the metrics and health scrapes' timeouts at 8 s (a busy
2-core host answers in 1-2 s), and ``max_num_batched_tokens_floor`` 256 (the tiny model's
steps are a few hundred tokens, not the thousands of a GPU's). Real time: no speed-up.

Per run the twin benchmark's measures (bench/outcome.py: failed split in flight / during an
outage / other, time to detect and to recover, downtime, goodput, latency), the vLLM cold
start measured in the same run (the physical limit of recovery), the OOMs vLLM logged, the
operator's actions and the final flags. Each run is appended to ``outcome-vllm.runs.jsonl`` in
``--out`` as it ends, with its command and commit (a later run of the same scenario, operator
and seed replaces it), and the report is written from that file: ``outcome-vllm.{md,json,svg}``
(``-quick`` suffixed for ``--quick``), each real cell beside the twin's (``--twin``).
``--report-only`` writes the report again without running anything.
"""

from __future__ import annotations

import argparse
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
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import outcome as twin  # noqa: E402

from tests.vllm_tier import support  # noqa: E402
from vllm_guardian.actuators import flags as flagsfile  # noqa: E402
from vllm_guardian.actuators.procmgr import Supervisor  # noqa: E402
from vllm_guardian.config import parse_config  # noqa: E402
from vllm_guardian.formats.vllm_log_format import match_line  # noqa: E402
from vllm_guardian.lowio.procfs import parse_pid_file  # noqa: E402
from vllm_guardian.model import LogEventKind  # noqa: E402
from vllm_guardian.sim.load import PlannedRequest, plan_requests, run_load  # noqa: E402
from vllm_guardian.sim.scenarios import LoadProfile  # noqa: E402
from vllm_guardian.tools.demo import free_port  # noqa: E402

OPERATORS = ("unguarded", "unguarded-on-failure", "sidecar", "guardian+gate")
QUICK_OPERATORS = ("unguarded", "guardian+gate")
MODEL = "bench"
BUDGET_TOKENS = 512
BASE_FLAGS = (
    "--max-model-len", "2048", "--num-gpu-blocks-override", "64", "--max-num-seqs", "16",
    "--max-num-batched-tokens", "1024", "--shutdown-timeout", "10",
)  # fmt: skip
FAULT_AT_SECONDS = 45.0
OVERLOAD_RATE = 4.0
# The load client's bound on each request. The twin's client waits 30 s of real time at 4x
# speed: 120 s on the engine's clock, on which its restarts, drains and holds run. The same
# budget here, where the engine's clock is real time: 120 s (a real vLLM's restart takes
# 25-45 s on this host; at 30 s a client gives up on requests the gate still holds).
REQUEST_TIMEOUT_SECONDS = 120.0
# The tiny model on two cores serves a few requests a second; this load keeps it busy, not
# saturated, so the steady control fails nothing. Bursts of long prompts every 30 s: the
# prefill whose step is over the budget in prefill_oom.
LOAD = LoadProfile(
    rate_per_second=1.0,
    prompt_tokens_min=10,
    prompt_tokens_max=60,
    output_tokens_min=16,
    output_tokens_max=48,
    burst_size=3,
    burst_interval_seconds=30.0,
    burst_start_seconds=20.0,
    burst_prompt_tokens_min=100,
    burst_prompt_tokens_max=160,
)


# An overload: about twice what the server completes with its KV pool full (longer answers,
# more often), no fault. No restart or flag cures it; the guardian must not act, and its
# over-capacity alert (two minutes over its two-minute window) must fire: a longer window.
# The load's prompt lengths are words: the tiny model's tokenizer makes ~7.5 tokens of each
# (60 words: 411 tokens), so a request stays within --max-model-len (2048) and under the KV
# pool (1,024 tokens) alone: 10-30 words (75-225 tokens) and 200-400 tokens out. A first
# calibration with 100-300 words and 400-800 out was refused (HTTP 400, over the context) for
# 47 of 510 requests and served 722 tokens/s at 1.6 a second; 4 a second asks ~1,200.
OVERLOAD_LOAD = dataclasses.replace(
    LOAD,
    rate_per_second=OVERLOAD_RATE,
    prompt_tokens_min=10,
    prompt_tokens_max=30,
    output_tokens_min=200,
    output_tokens_max=400,
    burst_size=0,
)
OVERLOAD_DURATION_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    twin: str  # the twin benchmark's scenario for the same failure (bench/outcome.py)
    oom_budget: bool = False  # the plugin's activation budget is armed
    kill_engine_at: float | None = None
    hang_engine_at: float | None = None
    load: LoadProfile = LOAD
    min_duration_seconds: float = 0.0  # the window the scenario needs, whatever --duration says
    flags: tuple[str, ...] = ()  # values of BASE_FLAGS this scenario's server runs with instead


def serve_flags(scenario: Scenario) -> tuple[str, ...]:
    """BASE_FLAGS with the scenario's own values in place (a flag it names must be there)."""
    out = list(BASE_FLAGS)
    for name, value in zip(scenario.flags[::2], scenario.flags[1::2], strict=True):
        out[out.index(name) + 1] = value
    return tuple(out)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("prefill_oom", "prefill_burst", oom_budget=True),
        Scenario("engine_death", "exit_zero_death", kill_engine_at=FAULT_AT_SECONDS),
        Scenario("engine_hang", "engine_hang", hang_engine_at=FAULT_AT_SECONDS),
        Scenario(
            "overload",
            "kv_thrash",
            load=OVERLOAD_LOAD,
            min_duration_seconds=OVERLOAD_DURATION_SECONDS,
        ),
        Scenario("steady", "steady"),
    )
}
FAULTS = ("prefill_oom", "engine_death", "engine_hang")


@dataclasses.dataclass
class RealRun(twin.Run):
    cold_start_seconds: float | None = None  # this run's first vLLM start to /health 200
    logged_ooms: int = 0  # CUDA OOMs the guardian's matcher found in vLLM's log
    named_causes: list[str] = dataclasses.field(default_factory=list)
    load_average: tuple[float, float] = (0.0, 0.0)  # before, after
    deaths_after_last_action: int = 0  # /health drops after the operator's last action
    request_timeout_seconds: float = 30.0  # the load client's bound (30: before it was set)
    failed_kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # how each failed
    # The same, with the client's error (an exception's name, or the answer's first words).
    failed_errors: dict[str, int] = dataclasses.field(default_factory=dict)
    # The gate's own account, read from its /metrics before it stops (guardian+gate only):
    # "name{label=value}" -> value for its rejections, upstream errors, retries, stale
    # connections and closed client connections.
    gate_counters: dict[str, float] = dataclasses.field(default_factory=dict)
    # CPU seconds (user + system) each party used over the load window: vLLM (its API server
    # and every process below it), the guardian, the gate, the load client (this process). On
    # a 2-core host they share the cores with vLLM's CPU engine; on a GPU host they would not.
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


def process_cpu_seconds(pid: int | None, *, tree: bool = False) -> float | None:
    """User + system CPU seconds of ``pid`` (with ``tree``, and of every live process below
    it), from /proc; None when it is not there."""
    if pid is None:
        return None
    pids = [pid, *(p for p, _ in support.descendants(pid))] if tree else [pid]
    total, seen = 0.0, False
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        seen = True
    return total if seen else None


def cpu_reading(parties: dict[str, tuple[int | None, bool]]) -> dict[str, float | None]:
    """Each party's CPU seconds now: name -> (pid, with the processes below it)."""
    out = {name: process_cpu_seconds(pid, tree=tree) for name, (pid, tree) in parties.items()}
    t = os.times()
    out["load_client"] = t.user + t.system
    return out


def fault_env(scenario: Scenario, workdir: Path) -> dict[str, str]:
    env = {}
    if scenario.oom_budget:
        env["VLLM_GUARDIAN_FAULT_OOM_ABOVE_TOKENS"] = str(BUDGET_TOKENS)
    if scenario.hang_engine_at is not None:
        env["VLLM_GUARDIAN_FAULT_HANG_FILE"] = str(workdir / "hang")
    return env


def guardian_config(
    workdir: Path, command: list[str], vllm_port: int, guardian_port: int, gate_port: int
) -> Any:
    """Shipped rules and policy, armed, with the three host settings the module docstring
    names; the service's ``gate:`` section at its defaults (the gate reads the same file)."""
    cfg = {
        "listen": f"127.0.0.1:{guardian_port}",
        "runtime_dir": str(workdir / "run"),
        "state_dir": str(workdir / "state"),
        "recorder": {"path": str(workdir / "state" / "flight.jsonl")},
        "services": [
            {
                "name": "vllm",
                "url": f"http://127.0.0.1:{vllm_port}",
                "command": command,
                "log_file": str(workdir / "vllm.log"),
                "gate": twin.gate_section(gate_port, 1.0),
            }
        ],
        "sources": {
            "vllm_metrics": {"timeout_seconds": 8},
            "health": {"timeout_seconds": 8},
            "nvml": {"enabled": False},
            "allocator": {"directory": str(workdir / "allocator")},
        },
        "policy": {
            "dry_run": False,
            "backend": "process",
            "max_num_batched_tokens_floor": 256,
        },
    }
    path = workdir / "config.yaml"
    path.write_text(json.dumps(cfg, indent=1))
    return parse_config(path.read_text(), str(path))


def guardian_command(workdir: Path) -> list[str]:
    """The deployed form: ``vllm-guardian run -c CONFIG`` (as its unit runs it)."""
    return [sys.executable, "-m", "vllm_guardian", "run", "-c", str(workdir / "config.yaml")]


def stop_guardian(guardian: subprocess.Popen[bytes]) -> None:
    """SIGINT: the guardian stops its loop and the vLLM it runs, without the drain a SIGTERM
    starts (the load has ended); SIGKILL if it has not exited within 120 s."""
    twin.stop_process(guardian, signal.SIGINT, 120, 10)


def vllm_pid(pid_file: Path) -> int | None:
    """The vLLM API server's pid from the guardian's supervisor's pid file, or None."""
    try:
        parsed = parse_pid_file(pid_file.read_text())
    except OSError:
        return None
    return parsed[0] if parsed is not None else None


class PidFileWatch(twin._Watcher):
    """Notes when the guardian starts vLLM again (the pid in its pid file changes), every 0.1 s:
    the guardian's own process holds the supervisor's count."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.restarts_unix_seconds: list[float] = []
        self.pid: int | None = None  # the last pid seen
        super().__init__()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            pid = vllm_pid(self.path)
            if pid is None or pid == self.pid:
                continue
            if self.pid is not None:
                self.restarts_unix_seconds.append(time.time())
            self.pid = pid


def plan(scenario: Scenario, seed: int, duration: float) -> list[PlannedRequest]:
    out = plan_requests(scenario.load, seed, 100_000, duration)
    rng = random.Random(f"stream-{seed}")
    return [dataclasses.replace(p, stream=rng.random() < twin.STREAM_SHARE) for p in out]


def engine_core_pid(api_pid: int) -> int | None:
    for pid, name in support.descendants(api_pid):
        if "EngineCore" in name:
            return pid
    return None


class Faults(twin._Watcher):
    """Fires the scenario's one-off fault on the load's clock; records when (Unix seconds)."""

    join_seconds = 10.0

    def __init__(self, scenario: Scenario, workdir: Path, api_pid: Any, load_start: float):
        self.scenario = scenario
        self.workdir = workdir
        self.api_pid = api_pid  # a callable: the current vLLM API server's pid
        self.load_start = load_start
        self.times: list[float] = []
        self.notes: list[str] = []
        super().__init__()

    def _run(self) -> None:
        s = self.scenario
        at = s.kill_engine_at if s.kill_engine_at is not None else s.hang_engine_at
        if at is None:
            return
        if self._stop.wait(max(0.0, self.load_start + at - time.time())):
            return
        pid = self.api_pid()
        core = engine_core_pid(pid) if pid else None
        if core is None:
            self.notes.append(f"no EngineCore under pid {pid} at {at:g} s")
            return
        if s.hang_engine_at is not None:
            # This engine core hangs, not the one a restart brings: a one-off fault, which
            # a restart cures (the twin's hang sits on its timeline the same way).
            (self.workdir / "hang").write_text(str(core))
            self.times.append(time.time())
            return
        os.kill(core, signal.SIGKILL)
        self.times.append(time.time())


class DownWatch(twin._Watcher):
    """/health every 0.25 s: when it went from 200 to anything else (Unix seconds)."""

    def __init__(self, url: str) -> None:
        self.url = url + "/health"
        self.downs: list[float] = []
        super().__init__()

    def _run(self) -> None:
        up = False
        while not self._stop.wait(0.25):
            try:
                ok = requests.get(self.url, timeout=2).status_code == 200
            except requests.RequestException:
                ok = False
            if up and not ok:
                self.downs.append(time.time())
            up = ok


def _load_average() -> float:
    return os.getloadavg()[0]


def on_cpus(command: list[str], cpus: str | None) -> list[str]:
    """``command`` run on ``cpus`` only (``taskset -c``; every process it starts inherits
    them), or as it is (None). For every operator alike: on this host the CPU engine under
    overload starves every other process for seconds at a time (the gate, the guardian, the
    load client: bench/results/outcome-vllm-overload-calibration), which a GPU host, whose
    engine is not on the CPUs, does not."""
    return command if cpus is None else ["/usr/bin/taskset", "-c", cpus, *command]


def run_one(
    scenario_name: str, operator: str, seed: int, duration: float, venv: Path, model: Path,
    keep: bool, request_timeout: float = REQUEST_TIMEOUT_SECONDS,
    overload_rate: float | None = None, overload_max_num_seqs: int | None = None,
    vllm_cpus: str | None = None,
) -> RealRun:  # fmt: skip
    scenario = SCENARIOS[scenario_name]
    if overload_rate is not None and scenario.load is OVERLOAD_LOAD:
        # A calibration knob: the server's capacity depends on the host (docs/benchmarks.md).
        scenario = dataclasses.replace(
            scenario, load=dataclasses.replace(OVERLOAD_LOAD, rate_per_second=overload_rate)
        )
    if overload_max_num_seqs is not None and scenario_name == "overload":
        scenario = dataclasses.replace(
            scenario, flags=("--max-num-seqs", str(overload_max_num_seqs))
        )
    duration = max(duration, scenario.min_duration_seconds)
    run = RealRun(scenario_name, operator, seed, request_timeout_seconds=request_timeout)
    load_before = _load_average()
    started = time.monotonic()
    prefix = f"outcome-vllm-{scenario_name}-{operator}-{seed}-"
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix=prefix) if keep else stack.enter_context(
            tempfile.TemporaryDirectory(prefix=prefix))  # fmt: skip
        workdir = Path(tmp)
        run_id = uuid.uuid4().hex
        census = support.Census(run_id).start()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = support.vllm_env(run_id, workdir, faults=fault_env(scenario, workdir))
        if vllm_cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_cpus  # inference inside the allowed set
        command = on_cpus(support.serve_command(venv, model, port, env, serve_flags(scenario)),
                          vllm_cpus)  # fmt: skip
        command[command.index("--served-model-name") + 1] = MODEL
        guardian: subprocess.Popen[bytes] | None = None
        pid_file: Path | None = None  # the guardian's supervisor's (vLLM's pid and start)
        sup: Supervisor | None = None
        gate: subprocess.Popen[bytes] | None = None
        alert_log: twin.AlertLog | None = None
        starts: twin.StartWatch | PidFileWatch | None = None
        sidecar: twin.Sidecar | None = None
        faults: Faults | None = None
        downs = DownWatch(url)
        actions: list[tuple[float, str]] = []
        outcomes: list[Any] = []
        load_url = url
        load_start = time.time()
        t0 = time.monotonic()
        try:
            if operator == "guardian+gate":
                gport, gate_port = free_port(), free_port()
                cfg = guardian_config(workdir, command, port, gport, gate_port)
                # Its own process, as deployed: in the benchmark's, the load client's Python
                # took the guardian's share of the GIL on a busy host (its sources timed out).
                with (workdir / "guardian.log").open("wb") as log:
                    guardian = subprocess.Popen(
                        guardian_command(workdir), stdout=log, stderr=subprocess.STDOUT,
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                    )  # fmt: skip
                alert_log = twin.AlertLog(f"http://127.0.0.1:{gport}").__enter__()
                pid_file = Path(cfg.state_dir) / "vllm.pid"
                starts = PidFileWatch(pid_file).__enter__()
                with (workdir / "gate.log").open("wb") as log:
                    gate = subprocess.Popen(
                        twin.gate_command(workdir), stdout=log, stderr=subprocess.STDOUT,
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                    )  # fmt: skip
                load_url = f"http://127.0.0.1:{gate_port}"
            else:
                sup = Supervisor(
                    "vllm", command, workdir / "vllm.env", workdir / "vllm.log",
                    stop_timeout_seconds=30,
                    restart_on_clean_exit=operator != "unguarded-on-failure",
                )  # fmt: skip
                sup.start()
                starts = twin.StartWatch(sup).__enter__()
                if operator == "sidecar":
                    sidecar = twin.Sidecar(url, sup, 1.0).__enter__()
            twin.wait_healthy(url, 600)
            run.cold_start_seconds = time.monotonic() - t0
            twin.wait_healthy(load_url, 120)
            with twin.HealthWatch(url, 0.25) as health, downs:
                load_start = time.time()

                def api_pid() -> int | None:
                    if pid_file is not None:
                        return vllm_pid(pid_file)
                    return sup.pid if sup is not None else None

                faults = Faults(scenario, workdir, api_pid, load_start).__enter__()

                def parties() -> dict[str, tuple[int | None, bool]]:
                    out = {"vllm": (api_pid(), True)}
                    if guardian is not None:
                        out["guardian"] = (guardian.pid, False)
                    if gate is not None:
                        out["gate"] = (gate.pid, True)
                    return out

                cpu_before = cpu_reading(parties())
                result = run_load(
                    load_url, plan(scenario, seed, duration), model=MODEL, stream=False,
                    max_duration_seconds=duration, max_in_flight=256,
                    request_timeout_seconds=request_timeout,
                )  # fmt: skip
                outcomes = list(result.outcomes)
                cpu_after = cpu_reading(parties())
                run.cpu_seconds = {
                    name: round(after - before, 1)
                    for name, after in cpu_after.items()
                    if after is not None and (before := cpu_before.get(name)) is not None
                    and after >= before  # a restarted process counts from its start: not given
                }  # fmt: skip
                faults.__exit__()
            run.downtime_seconds = health.down
        finally:
            if sidecar is not None:
                sidecar.__exit__()
                actions += sidecar.actions
            if gate is not None:
                # One read of the gate's /metrics for both accounts.
                if (text := twin.gate_metrics_text(load_url)) is not None:
                    run.gate_counters = gate_counters(text)
                    run.continuations, run.gate_retried = twin.gate_counts(text)
                twin.stop_gate(gate)
            if guardian is not None:
                stop_guardian(guardian)
                for t, reason, cause in twin.audited_actions(workdir):
                    actions.append((t, reason))
                    if cause:
                        run.named_causes.append(str(cause))
                content = flagsfile.read(workdir / "state" / "vllm.env")
                run.final_flags = " ".join(content.argv) if content else ""
            if alert_log is not None:
                alert_log.__exit__()
                run.alerts_fired = sorted(alert_log.fired)
            restarts: list[float] = []
            if starts is not None:
                starts.__exit__()
                restarts = starts.restarts_unix_seconds
            if sup is not None and guardian is None:
                sup.stop()
            support.sweep(run_id, census)
            census.stop()
            log_text = (workdir / "vllm.log").read_text(errors="replace") if (
                workdir / "vllm.log").exists() else ""  # fmt: skip
            run.logged_ooms = sum(
                1
                for line in log_text.splitlines()
                if (m := match_line(line)) is not None
                and m[0] is LogEventKind.CUDA_OOM
                and line.startswith("(Worker")
            )
    # The faults: what the scenario fired, else when /health dropped (an OOM's death).
    fault_times = faults.times if faults is not None and faults.times else downs.downs
    actions.sort()
    run.actions = [a for _, a in actions]
    run.restarts = len(restarts)
    run.oom_crashes = len(downs.downs) if scenario.oom_budget else 0
    last_action = max((t for t, _ in actions), default=None)
    if last_action is not None:
        # The action's own stop is not a death: count drops a restart's length after it.
        run.deaths_after_last_action = sum(1 for t in downs.downs if t > last_action + 5.0)
    twin.measure(run, outcomes, load_start, duration, fault_times,
                 sorted([*(t for t, _ in actions), *restarts]))  # fmt: skip
    for o in outcomes:
        if o.kind in twin.FAILED:
            key = (
                o.kind.value if o.http_status in (None, 200) else f"{o.kind.value} {o.http_status}"
            )
            run.failed_kinds[key] = run.failed_kinds.get(key, 0) + 1
            error = f"{key}: {(o.error or '').strip()[:80]}"
            run.failed_errors[error] = run.failed_errors.get(error, 0) + 1
    run.wall_seconds = time.monotonic() - started
    run.load_average = (load_before, _load_average())
    return run


# The gate's counters a run records (gate_counters): what it refused, why it held, how late it was.
GATE_COUNTERS = (
    "vllm_guardian_gate_rejected_total",
    "vllm_guardian_gate_upstream_errors_total",
    "vllm_guardian_gate_retried_total",
    "vllm_guardian_gate_upstream_stale_connections_total",
    "vllm_guardian_gate_upstream_connect_timeouts_total",
    "vllm_guardian_gate_connections_closed_total",
    # How late its loop ran: the buckets say how many wake-ups were late by more than each bound.
    "vllm_guardian_gate_loop_lag_seconds_bucket",
    "vllm_guardian_gate_loop_lag_seconds_count",
    "vllm_guardian_gate_loop_lag_seconds_sum",
)


def gate_counters(metrics_text: str) -> dict[str, float]:
    """The non-zero samples of :data:`GATE_COUNTERS` in a gate's ``/metrics``, keyed
    ``name{label=value,...}`` (the ``service`` label left out)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for sample in fam.samples:
            if sample.name not in GATE_COUNTERS or not sample.value:
                continue
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "service"
            )
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def runs_file(out: Path, quick: bool) -> Path:
    return out / f"outcome-vllm{'-quick' if quick else ''}.runs.jsonl"


def read_runs(path: Path) -> list[tuple[RealRun, dict[str, Any]]]:
    """Every run the file holds, each with its invocation (command, commit); a run appended
    later for the same scenario, operator and seed replaces the earlier one."""
    by: dict[tuple[str, str, int], tuple[RealRun, dict[str, Any]]] = {}
    fields = {f.name for f in dataclasses.fields(RealRun)}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            r = RealRun(**{k: v for k, v in d["run"].items() if k in fields})
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{n}: not a run record: {exc}") from exc
        r.load_average = tuple(r.load_average)  # type: ignore[assignment]
        by[(r.scenario, r.operator, r.seed)] = (r, d["invocation"])
    return list(by.values())


def cells_of(runs: Sequence[RealRun]) -> list[twin.Cell]:
    """The runs as the twin benchmark's cells (its measures, verdict and chart), named by the
    twin's scenario for the same failure, in the matrix's order."""
    out = []
    for name, sc in SCENARIOS.items():
        for op in OPERATORS:
            rs = sorted((r for r in runs if r.scenario == name and r.operator == op),
                        key=lambda r: r.seed)  # fmt: skip
            if not rs:
                continue
            before = max(r.load_average[0] for r in rs)
            after = max(r.load_average[1] for r in rs)
            # Never flagged busy: a real vLLM's own threads hold this host's load average at
            # 2-6 while it serves, so the twin's test (above the core count) says nothing here.
            out.append(twin.Cell(sc.twin, op, list(rs), (before, 0.0, 0.0), (after, 0.0, 0.0),
                                 False))  # fmt: skip
    return out


def gaps(runs: Sequence[RealRun]) -> list[str]:
    """The matrix's cells (scenario × operator) that no run filled, and those with fewer seeds
    than the fullest: said under the invocations, so a reader never takes a gap for a zero."""
    seeds: dict[tuple[str, str], set[int]] = {}
    for r in runs:
        seeds.setdefault((r.scenario, r.operator), set()).add(r.seed)
    most = max((len(v) for v in seeds.values()), default=0)
    missing = [f"{s}/{o}" for s in SCENARIOS for o in OPERATORS if (s, o) not in seeds]
    fewer = [
        f"{s}/{o} ({len(seeds[s, o])} of {most})"
        for s in SCENARIOS
        for o in OPERATORS
        if (s, o) in seeds and len(seeds[s, o]) < most
    ]
    out = []
    if missing:
        out.append(f"- Not run: {', '.join(missing)}.")
    if fewer:
        out.append(f"- Fewer seeds than the others: {', '.join(fewer)}.")
    return ["", *out] if out else []


def real_name(twin_name: str) -> str:
    return next(n for n, s in SCENARIOS.items() if s.twin == twin_name)


def real_checks(runs: Sequence[RealRun]) -> list[str]:
    """What the real engine adds to the twin's verdict: prefill_oom's cause named from vLLM's
    own log, no OOM death after the relaunch, the unguarded server dying again and again."""
    lines = []
    g = [r for r in runs if r.scenario == "prefill_oom" and r.operator == "guardian+gate"]
    u = [r for r in runs if r.scenario == "prefill_oom" and r.operator == "unguarded"]
    if g:
        named = all("prefill_burst" in r.named_causes for r in g)
        after = [r.deaths_after_last_action for r in g]
        lines.append(
            f"- prefill_oom, real engine: guardian named prefill_burst from vLLM's log in "
            f"{sum('prefill_burst' in r.named_causes for r in g)} of {len(g)} runs "
            f"{'✓' if named else '✗'}; OOM deaths after its last relaunch {after} "
            f"{'✓' if all(a == 0 for a in after) else '✗'}"
            + (f"; unguarded died {[r.oom_crashes for r in u]} times "
               f"{'✓' if all(r.oom_crashes >= 2 for r in u) else '✗'}" if u else "")
        )  # fmt: skip
    return lines


def _mm(runs: Sequence[Any], name: str, fmt: str = "{:.1f}") -> str:
    vals = [v for r in runs if (v := getattr(r, name)) is not None]
    if not vals:
        return "–"
    med, lo, hi = statistics.median(vals), min(vals), max(vals)
    if lo == hi:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def batched(flags: str) -> str:
    """The run's last ``--max-num-batched-tokens`` (what a relaunch set), or —."""
    words = flags.split()
    values = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--max-num-batched-tokens"]
    return f"--max-num-batched-tokens {values[-1]}" if values else "—"


def twin_cells(path: Path) -> dict[tuple[str, str], twin.Cell]:
    """The twin benchmark's report (bench/results/outcome.json), by (twin scenario, operator)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for c in d.get("cells", []):
        runs = [twin.Run(**{k: v for k, v in r.items() if k != "failed_pct"}) for r in c["runs"]]
        out[(c["scenario"], c["operator"])] = twin.Cell(
            c["scenario"], c["operator"], runs, tuple(c["load_before"]), tuple(c["load_after"]),
            c["busy"], c.get("commit") or d.get("commit"))  # fmt: skip
    return out


def markdown(
    pairs: Sequence[tuple[RealRun, dict[str, Any]]], twins: dict[tuple[str, str], twin.Cell],
    twin_source: str,
) -> str:  # fmt: skip
    runs = [r for r, _ in pairs]
    cells = cells_of(runs)
    by = {(c.scenario, c.operator): c for c in cells}
    invocations: dict[tuple[str, str], list[str]] = {}
    for r, inv in pairs:
        key = (" ".join(inv.get("command", [])), str(inv.get("commit")))
        invocations.setdefault(key, []).append(f"{r.scenario}/{r.operator}/{r.seed}")
    lines = [
        "# Outcome on a real vLLM (0.32, CPU build, the tier's tiny model)",
        "",
        "The faults run through vLLM's own code (bench/outcome_vllm.py's docstring: a test-only "
        "plugin raises torch's CUDA OOM in the model runner, SIGKILLs or blocks the engine core; "
        "`overload` is real KV thrash at about twice what the server completes). Real time, no "
        "speed-up; one run at a time on this 2-core host.",
        "",
        "The load client's bound per request: "
        + ", ".join(f"{t:g} s" for t in sorted({r.request_timeout_seconds for r in runs}))
        + " (a request held longer than that by the gate counts as failed: the client left).",
        "",
        "Runs, each from one invocation (command, commit):",
        "",
    ]
    for (cmd, commit), names in invocations.items():
        lines.append(f"- `.venv/bin/python bench/outcome_vllm.py {cmd}` at {commit}: "
                     f"{len(names)} runs ({', '.join(names)})")  # fmt: skip
    lines += gaps(runs)
    lines += ["", "## The goal, per scenario (medians over the seeds)", ""]
    for sc in SCENARIOS.values():
        v = twin.verdict(sc.twin, by)
        if v is not None:
            lines.append(v.replace(f"- {sc.twin}:", f"- {sc.name}:", 1))
    lines += real_checks(runs)
    lines += [
        "",
        "## Real engine",
        "",
        "Each value: median over the seeds (min–max). *Split*: failed in flight at a fault / "
        "arrived during an outage / other. *Detect*: the fault → the operator's first action or "
        "vLLM's restart; *recover*: the fault → the first success among requests sent after it. "
        "*Cold start*: this run's first vLLM start to `/health` 200, the physical limit of "
        "recovery. *Failed* counts every request not answered whole: an HTTP error, a cut or "
        "errored stream, a timeout, a refused connection, or vLLM's 200 with finish_reason "
        '"abort".',
        "",
        "| scenario | operator | seeds | sent | failed % | split | detect s | recover s "
        "| cold start s | down s | goodput tok/s | p99 TTFT s | OOMs logged | restarts | actions "
        "| final flags | alerts | load before → after |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for c in cells:
        rs: list[RealRun] = c.runs  # type: ignore[assignment]
        split = "/".join(
            twin._f(c.median(m), "{:.0f}")
            for m in ("failed_in_flight", "failed_during_outage", "failed_other")
        )
        acts = sorted({a for r in rs for a in r.actions})
        alerts = sorted({a for r in rs for a in r.alerts_fired})
        lines.append(
            f"| {real_name(c.scenario)} | {c.operator} | {','.join(str(r.seed) for r in rs)} "
            f"| {_mm(rs, 'sent', '{:.0f}')} | {_mm(rs, 'failed_pct')} | {split} "
            f"| {_mm(rs, 'time_to_detect_seconds')} | {_mm(rs, 'time_to_recover_seconds')} "
            f"| {_mm(rs, 'cold_start_seconds')} | {_mm(rs, 'downtime_seconds')} "
            f"| {_mm(rs, 'goodput_tokens_per_second', '{:.0f}')} | {_mm(rs, 'p99_ttft_seconds')} "
            f"| {_mm(rs, 'logged_ooms', '{:.0f}')} | {_mm(rs, 'restarts', '{:.0f}')} "
            f"| {'; '.join(acts) or '—'} | {', '.join(sorted({batched(r.final_flags) for r in rs}))} "
            f"| {', '.join(alerts) or '—'} "
            f"| {c.load_before[0]:.1f} → {c.load_after[0]:.1f}{' **busy**' if c.busy else ''} |"
        )
    lines += [
        "",
        f"## Beside the twin (bench/results/outcome.md{twin_source})",
        "",
        "The twin's cell for the same failure and operator: its scenario is the real one's "
        "stand-in (`prefill_oom` ↔ `prefill_burst`, `engine_death` ↔ `exit_zero_death`, "
        "`overload` ↔ `kv_thrash`). Real | twin, medians (the twin's seeds 7, 8, 9 at 4× speed: "
        "its times are wall seconds, a quarter of the engine's clock; its restart takes ~10 s "
        "of wall time where a real vLLM's cold start takes 25-45 s here).",
        "",
        "| scenario | operator | failed % real \\| twin | split real \\| twin "
        "| detect s real \\| twin | recover s real \\| twin | restarts real \\| twin |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        t = twins.get((c.scenario, c.operator))

        def both(m: str, fmt: str = "{:.1f}", c: twin.Cell = c, t: twin.Cell | None = t) -> str:
            return f"{twin._f(c.median(m), fmt)} \\| {twin._f(t.median(m), fmt) if t else '–'}"

        def split(cell: twin.Cell | None) -> str:
            if cell is None:
                return "–"
            return "/".join(twin._f(cell.median(m), "{:.0f}") for m in
                            ("failed_in_flight", "failed_during_outage", "failed_other"))  # fmt: skip

        lines.append(
            f"| {real_name(c.scenario)} ↔ {c.scenario} | {c.operator} | {both('failed_pct')} "
            f"| {split(c)} \\| {split(t)} | {both('time_to_detect_seconds')} "
            f"| {both('time_to_recover_seconds')} | {both('restarts', '{:.0f}')} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| scenario | operator | seed | sent | failed | in flight | outage | other | detect s "
        "| recover s | cold start s | downtime s | OOMs logged | deaths after the last action "
        "| restarts | actions | final flags | how they failed | load before→after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        f = twin._f
        lines.append(
            f"| {r.scenario} | {r.operator} | {r.seed} | {r.sent} | {r.failed} "
            f"({r.failed_pct:.1f} %) | {r.failed_in_flight} | {r.failed_during_outage} | "
            f"{r.failed_other} | {f(r.time_to_detect_seconds)} | {f(r.time_to_recover_seconds)} | "
            f"{f(r.cold_start_seconds)} | {r.downtime_seconds:.1f} | {r.logged_ooms} | "
            f"{r.deaths_after_last_action} | {r.restarts} | {'; '.join(r.actions) or '—'} "
            f"| {batched(r.final_flags)} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(r.failed_kinds.items())) or '—'} "
            f"| {r.load_average[0]:.1f}→{r.load_average[1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def chart(runs: Sequence[RealRun]) -> str:
    """The twin benchmark's chart (failed % per scenario and operator), the real names on it."""
    svg = twin.chart_svg(cells_of(runs))
    for name, sc in SCENARIOS.items():
        svg = svg.replace(f">{sc.twin}<", f">{name}<")
    return svg.replace("Failed requests (%)", "Failed requests (%) on a real vLLM")


def write_report(out: Path, quick: bool, twin_json: Path) -> str:
    pairs = read_runs(runs_file(out, quick))
    suffix = "-quick" if quick else ""
    twins = twin_cells(twin_json)
    md = markdown(pairs, twins, "" if twins else ": not found")
    (out / f"outcome-vllm{suffix}.md").write_text(md)
    (out / f"outcome-vllm{suffix}.svg").write_text(chart([r for r, _ in pairs]))
    (out / f"outcome-vllm{suffix}.json").write_text(json.dumps(
        {"runs": [dataclasses.asdict(r) | {"failed_pct": r.failed_pct, "invocation": inv}
                  for r, inv in pairs]}, indent=1, default=str))  # fmt: skip
    return md


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scenarios", default=None, help="default: all (--quick: prefill_oom)")
    p.add_argument("--operators", default=None,
                   help="default: all (--quick: unguarded,guardian+gate)")  # fmt: skip
    p.add_argument("--seeds", default="7")
    p.add_argument("--duration", type=float, default=180.0, help="load window, seconds")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--keep", action="store_true", help="keep each run's directory and logs")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_SECONDS,
                   help="the load client's bound per request, seconds")  # fmt: skip
    p.add_argument("--overload-rate", type=float, default=None,
                   help=f"overload's requests a second (default {OVERLOAD_RATE})")  # fmt: skip
    p.add_argument("--overload-max-num-seqs", type=int, default=None,
                   help="overload's --max-num-seqs (a calibration knob)")  # fmt: skip
    p.add_argument("--vllm-cpus", default=None,
                   help="run every vLLM process on these CPUs only (taskset -c LIST), every "
                   "operator alike")  # fmt: skip
    p.add_argument("--report-only", action="store_true",
                   help="write the report from the runs already in OUT's runs file")  # fmt: skip
    p.add_argument("--twin", type=Path, default=ROOT / "bench" / "results" / "outcome.json",
                   help="the twin benchmark's report to put beside")  # fmt: skip
    args = p.parse_args(argv)
    if args.scenarios is None:
        args.scenarios = "prefill_oom" if args.quick else ",".join(SCENARIOS)
    if args.operators is None:
        args.operators = ",".join(QUICK_OPERATORS if args.quick else OPERATORS)
    for name, known in (("scenarios", SCENARIOS), ("operators", OPERATORS)):
        unknown = set(getattr(args, name).split(",")) - set(known)
        if unknown:
            p.error(f"--{name}: unknown {sorted(unknown)}; known: {', '.join(known)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        # The commit the run starts from (a later checkout of the tree must not rename it).
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
        invocation = {"command": argv, "commit": commit}
        venv = support.vllm_venv_or_skip()
        model = Path(tempfile.mkdtemp(prefix="outcome-vllm-model-"))
        support.build_model(venv, model)
        lock = support.host_lock()
        try:
            for scenario in args.scenarios.split(","):
                for operator in args.operators.split(","):
                    for seed in (int(s) for s in args.seeds.split(",")):
                        r = run_one(scenario, operator, seed, args.duration, venv, model,
                                    args.keep, args.request_timeout,
                                    args.overload_rate,
                                    args.overload_max_num_seqs, args.vllm_cpus)  # fmt: skip
                        record = {"run": dataclasses.asdict(r), "invocation": invocation}
                        # Appended as it ends: a long run stopped early keeps what it measured.
                        with runs_file(args.out, args.quick).open("a") as f:
                            f.write(json.dumps(record, default=str) + "\n")
                        print(json.dumps(dataclasses.asdict(r), default=str), flush=True)
        finally:
            lock.close()
    print(write_report(args.out, args.quick, args.twin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
