"""Live mode against the vLLM twin: for every twin scenario, `diagnose --url` names its cause.

Each scenario runs in its own twin subprocess (127.0.0.1, a free port, --sim-speed 10), driven
by the twin's load generator (bounded in requests and time), then `vllm-guardian diagnose` runs
as a subprocess without a config, with the twin's log file and GPU state file. Nothing waits a
fixed time: each scenario waits for the condition its diagnosis needs, read from the twin itself
(its simulated clock and faults at GET /sim/clock, its /metrics), with a generous bound, and a
timeout says what it saw. The scenarios run in parallel threads, no more at once than the cores
allow; every process started is stopped in a finally.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from vllm_guardian.sim.scenarios import SCENARIOS

REPO = Path(__file__).resolve().parents[1]
SPEED = 10.0
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


@dataclass(frozen=True)
class Plan:
    wait: str  # "exit": until the twin exits; "ready": until `ready(clock, metrics)` holds
    seconds: float  # a generous upper bound in real seconds; a timeout fails, saying what it saw


def _metric(text: str, name: str) -> float:
    """The sum of a family's samples in the twin's exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"vllm:{name}"):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _loaded(clock: dict[str, Any], metrics: str) -> bool:
    return int(clock.get("requests_finished", 0)) >= 20


def _thrashing(clock: dict[str, Any], metrics: str) -> bool:
    return (
        _metric(metrics, "kv_cache_usage_perc") >= 0.9
        and _metric(metrics, "num_preemptions_total") >= 5
        and _metric(metrics, "num_requests_waiting") > 0
    )


def _hung(clock: dict[str, Any], metrics: str) -> bool:
    # The hang has struck with requests inside, and 20 simulated seconds went by without a
    # token: what a diagnosis sees as a stall.
    hang = [f for f in clock.get("faults", []) if f.get("kind") == "hang"]
    inside = _metric(metrics, "num_requests_running") + _metric(metrics, "num_requests_waiting")
    return bool(hang) and inside > 0 and float(clock.get("scenario_seconds", 0)) >= 50


READY = {"steady": _loaded, "prefix_cache_waste": _loaded, "kv_thrash": _thrashing,
         "engine_hang": _hung}  # fmt: skip
PLANS = {
    "steady": Plan("ready", 120.0),
    "prefix_cache_waste": Plan("ready", 120.0),
    "kv_thrash": Plan("ready", 120.0),
    "engine_hang": Plan("ready", 120.0),  # hangs at 30 s simulated
    "prefill_burst": Plan("exit", 120.0),
    "fragmentation_creep": Plan("exit", 180.0),
    "noisy_neighbour": Plan("exit", 120.0),
    "exit_zero_death": Plan("exit", 120.0),
    "startup_overcommit": Plan("exit", 120.0),
    "xid_fault": Plan("exit", 120.0),
}


# Twin scenarios not run live, and why (each adds a twin and up to a minute to CI).
NOT_LIVE = {
    # --url reads vLLM alone: requests that never reach the engine are seen only by whoever
    # sent them (the gate's unanswered requests); vLLM itself reads as an idle, healthy server.
    # The guardian with a gate restarts it, and diagnose on its bundle names it
    # (tests/test_scenarios_vt.py).
    "engine_input_hang": "a blind spot of --url: only the gate sees it",
    # Need vLLM's development routes; never restarted, asserted on virtual time
    # (tests/test_scenarios_vt.py), and diagnose's "paused, since when" there too.
    "operator_pause": "asserted on virtual time",
    "operator_sleep": "asserted on virtual time",
}


def _twin_view(url: str) -> tuple[dict[str, Any], str]:
    try:
        clock = requests.get(f"{url}/sim/clock", timeout=5).json()
        metrics = requests.get(f"{url}/metrics", timeout=5).text
    except (requests.RequestException, ValueError):
        return {}, ""
    return clock, metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)  # the twin reads it first, as torch does
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=1.0).status_code == 200
    except requests.RequestException:
        return False


def run_scenario(name: str, tmp: Path) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"{name}.log"
    state = tmp / f"{name}-gpu.json"
    plan = PLANS[name]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("wb") as err:
            twin = subprocess.Popen(
                [sys.executable, "-m", "vllm_guardian.sim", "serve", "--host", "127.0.0.1",
                 "--port", str(port), "--sim-scenario", name, "--sim-speed", str(SPEED),
                 "--sim-gpu-state-file", str(state)],
                cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        procs.append(twin)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and twin.poll() is None and not _healthy(url):
            time.sleep(0.1)
        if twin.poll() is None:
            load = subprocess.Popen(
                [sys.executable, "-m", "vllm_guardian.sim", "load", "--url", url, "--model", MODEL,
                 "--scenario", name, "--speed", str(SPEED), "--max-requests", "3000",
                 "--max-duration-seconds", str(plan.seconds + 30)],
                cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(load)
            end = time.monotonic() + plan.seconds
            seen: tuple[dict[str, Any], str] = ({}, "")
            while True:
                if plan.wait == "exit" and twin.poll() is not None:
                    break
                if plan.wait == "ready":
                    seen = _twin_view(url)
                    if READY[name](*seen):
                        break
                if time.monotonic() >= end:
                    what = "the twin's exit" if plan.wait == "exit" else READY[name].__name__
                    return {"report": {"timeout": f"no {what} within {plan.seconds:.0f}s",
                                       "clock": seen[0]}, "rc": None, "seconds": 0.0}  # fmt: skip
                time.sleep(0.2)
        else:
            end = time.monotonic() + plan.seconds
            while time.monotonic() < end and twin.poll() is None:
                time.sleep(0.1)
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "vllm_guardian.tools.cli", "diagnose", "--url", url,
             "--log-file", str(log), "--gpu-state-file", str(state), "--interval", "2.5",
             "--json", "-q"],
            cwd=REPO, env=_env(), capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        took = time.monotonic() - t0
        report = json.loads(out.stdout) if out.stdout.strip() else {"stderr": out.stderr.decode()}
        return {"report": report, "rc": out.returncode, "seconds": took}
    finally:
        for p in reversed(procs):
            _stop(p)


@pytest.fixture(scope="module")
def live_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("live")
    # Ten twins at once on two cores starve each other: no more at once than the cores allow.
    # The cores this process may run on (its affinity, which a container or taskset narrows),
    # not the host's count.
    with ThreadPoolExecutor(max_workers=max(2, len(os.sched_getaffinity(0)))) as pool:
        futures = {name: pool.submit(run_scenario, name, tmp) for name in PLANS}
        return {name: f.result() for name, f in futures.items()}


def test_every_twin_scenario_has_a_plan() -> None:
    assert set(PLANS) | set(NOT_LIVE) == set(SCENARIOS)
    assert not set(PLANS) & set(NOT_LIVE)


@pytest.mark.slow
@pytest.mark.alone  # its twins run as many at once as the cores allow: not beside a worker
@pytest.mark.timeout(1200)  # the first one runs the module fixture: every scenario
@pytest.mark.parametrize("name", sorted(PLANS))
def test_live_verdict_names_the_scenarios_cause(name: str, live_reports: dict[str, Any]) -> None:
    result = live_reports[name]
    report = result["report"]
    expected = SCENARIOS[name].expected_cause
    assert report.get("verdict") == expected, json.dumps(report, indent=1)[:4000]
    assert result["rc"] == (0 if expected == "healthy" else 1)
    assert report["schema_version"] == 1
    # How long a live diagnosis takes is a benchmark figure, not a test: printed only.
    print(f"{name}: diagnose took {result['seconds']:.1f}s")
    if expected != "healthy":
        top = report["causes"][0]
        assert top["id"] == expected and top["evidence"]
