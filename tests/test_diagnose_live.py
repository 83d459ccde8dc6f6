"""Live mode against the vLLM twin: for every twin scenario, `diagnose --url` names its cause.

Each scenario runs in its own twin subprocess (127.0.0.1, a free port, --sim-speed 10), driven
by the twin's load generator (bounded in requests and time), then `vllm-guardian diagnose` runs
as a subprocess without a config, with the twin's log file and GPU state file. The scenarios run
in parallel threads (the slowest, fragmentation_creep, needs ~100 simulated seconds); every
process started is stopped in a finally.
"""

from __future__ import annotations

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
    wait: str  # "exit": until the twin exits; "run": run the load this long first
    seconds: float  # real seconds, upper bound


# What to wait for before diagnosing (real seconds at SPEED 10; simulated times in docs/twin.md).
PLANS = {
    "steady": Plan("run", 3.0),
    "prefix_cache_waste": Plan("run", 3.0),
    "kv_thrash": Plan("run", 6.0),
    "engine_hang": Plan("run", 6.0),  # hangs at 30 s simulated
    "prefill_burst": Plan("exit", 15.0),
    "fragmentation_creep": Plan("exit", 40.0),
    "noisy_neighbour": Plan("exit", 20.0),
    "exit_zero_death": Plan("exit", 15.0),
    "startup_overcommit": Plan("exit", 15.0),
    "xid_fault": Plan("exit", 15.0),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and twin.poll() is None and not _healthy(url):
            time.sleep(0.1)
        if twin.poll() is None:
            load = subprocess.Popen(
                [sys.executable, "-m", "vllm_guardian.sim", "load", "--url", url, "--model", MODEL,
                 "--scenario", name, "--speed", str(SPEED), "--max-requests", "3000",
                 "--max-duration-seconds", str(plan.seconds + 10)],
                cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(load)
            end = time.monotonic() + plan.seconds
            while time.monotonic() < end:
                if plan.wait == "exit" and twin.poll() is not None:
                    break
                time.sleep(0.1)
        else:
            end = time.monotonic() + plan.seconds
            while time.monotonic() < end and twin.poll() is None:
                time.sleep(0.1)
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "vllm_guardian.cli", "diagnose", "--url", url,
             "--log-file", str(log), "--gpu-state-file", str(state), "--interval", "2.5",
             "--json", "-q"],
            cwd=REPO, env=_env(), capture_output=True, timeout=30, check=False,
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
    with ThreadPoolExecutor(max_workers=len(PLANS)) as pool:
        futures = {name: pool.submit(run_scenario, name, tmp) for name in PLANS}
        return {name: f.result() for name, f in futures.items()}


def test_every_twin_scenario_has_a_plan() -> None:
    assert set(PLANS) == set(SCENARIOS)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_live_verdict_names_the_scenarios_cause(name: str, live_reports: dict[str, Any]) -> None:
    result = live_reports[name]
    report = result["report"]
    expected = SCENARIOS[name].expected_cause
    assert report.get("verdict") == expected, json.dumps(report, indent=1)[:4000]
    assert result["rc"] == (0 if expected == "healthy" else 1)
    assert report["schema_version"] == 1
    assert result["seconds"] < 15  # the bound for a live diagnosis
    if expected != "healthy":
        top = report["causes"][0]
        assert top["id"] == expected and top["evidence"]
