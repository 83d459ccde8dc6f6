"""The admission gate in front of the vLLM twin: byte-for-byte pass-through, a KV burst held
at the gate against the same seeded burst sent straight to the server, and a guardian-driven
restart under load through the gate with no request lost. 127.0.0.1 only; every process and
gate started here is stopped here."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import requests

pytest.importorskip("aiohttp")

from tests.test_gate_support import GateThread
from vllm_guardian.daemon import Guardian
from vllm_guardian.demo import DemoOptions, demo_config, free_port
from vllm_guardian.sim.load import LoadResult, OutcomeKind, plan_requests, run_load
from vllm_guardian.sim.scenarios import LoadProfile

pytestmark = pytest.mark.slow


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered 200")


@contextlib.contextmanager
def twin(*args: str, speed: float = 20) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_guardian.sim", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--served-model-name", "demo", "--sim-speed", f"{speed:g}", "--enforce-eager",
         *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def normalise(body: bytes) -> bytes:
    """The twin's per-request ids and timestamps; everything else must be equal."""
    body = re.sub(rb'"id": "(chatcmpl|cmpl|modelperm)-[0-9a-f]+"', b'"id": "X"', body)
    return re.sub(rb'"created": \d+', b'"created": 0', body)


def test_byte_for_byte_through_the_gate():
    with twin("--sim-model", "tiny") as url:
        g = GateThread(url)
        try:
            cases = [
                ("/v1/completions", {"model": "demo", "prompt": "a b c d", "max_tokens": 12, "ignore_eos": True}),
                ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 9, "ignore_eos": True}),
                ("/v1/completions", {"model": "demo", "prompt": "x " * 5000, "max_tokens": 4}),  # vLLM's 400
                ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 4}),  # vLLM's 404
            ]  # fmt: skip
            for path, body in cases:
                for stream in (False, True):
                    payload = {**body, "stream": stream}
                    direct = requests.post(url + path, json=payload, timeout=20)
                    through = requests.post(g.url + path, json=payload, timeout=20)
                    assert through.status_code == direct.status_code, (path, payload)
                    assert normalise(through.content) == normalise(direct.content), (path, stream)
                    for h in ("content-type", "content-length"):
                        assert through.headers.get(h) == direct.headers.get(h), (path, h)
            for path in ("/v1/models", "/version", "/health", "/nope"):
                d, t = requests.get(url + path, timeout=5), requests.get(g.url + path, timeout=5)
                assert (t.status_code, normalise(t.content)) == (
                    d.status_code,
                    normalise(d.content),
                )
        finally:
            g.stop()


def preemptions(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


def p99(result: LoadResult) -> float:
    lat = sorted(o.latency_seconds for o in result.outcomes if o.latency_seconds is not None)
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


@pytest.mark.skip(
    reason="open bug: through the gate preemptions drop to 0 (direct: 17-20), but 1-3 of 30 "
    "requests get no answer for 60 s (request timeout); not yet known whether they sit in the "
    "queue or in a connection the twin never accepted"
)
def test_kv_burst_is_held_at_the_gate():
    """30 requests in 3 s into an 8k-token pool (~16k tokens of work): straight in, vLLM
    preempts and recomputes; through the gate (KV-need admission) they wait their turn instead.
    (Arrivals are spread over seconds: the twin's HTTP server has a 5-deep listen backlog.)"""
    profile = LoadProfile(
        rate_per_second=10, prompt_tokens_min=100, prompt_tokens_max=200,
        output_tokens_min=300, output_tokens_max=500,
    )  # fmt: skip
    plan = plan_requests(profile, seed=7, max_requests=30, duration_seconds=10)
    speed = 5.0
    kv = ("--kv-cache-memory-bytes", str(1024**3), "--no-enable-prefix-caching")
    figures = {}
    with twin(*kv, speed=speed) as url:
        g = GateThread(url)  # the default release rate: 50/s, 8 at once
        try:
            for name, target in (("direct", url), ("gate", g.url)):
                before = preemptions(url)
                result = run_load(
                    target, plan, model="demo", speed=speed, max_duration_seconds=60,
                    request_timeout_seconds=60,
                )  # fmt: skip
                failed = len(result.outcomes) - result.count(OutcomeKind.OK)
                figures[name] = (preemptions(url) - before, p99(result), failed)
        finally:
            g.stop()
    print("preemptions, p99 s, failed:", figures)
    assert figures["direct"][0] >= 10, figures  # the burst really thrashes when sent straight
    assert figures["gate"][0] <= figures["direct"][0] / 4, figures
    assert figures["gate"][2] == 0 and figures["direct"][2] == 0, figures


@pytest.mark.skip(
    reason="unfinished: engine_hang hangs every new instance again 30 simulated s after it is "
    "ready, so requests sent late in the window are caught by the second hang; needs a one-shot "
    "restart trigger"
)
def test_restart_under_load_through_the_gate_loses_nothing(tmp_path: Path):
    """The twin's engine hangs; the guardian drains and restarts it while a bounded load runs
    through the gate. Requests in the hung engine got no byte: retried once on the new
    instance; requests arriving meanwhile are held and sent to it. None fails."""
    opts = DemoOptions(
        "engine_hang", speed=4, workdir=tmp_path, quiet=True,
        policy={"drain_timeout_seconds": 2, "startup_grace_seconds": 10},
    )  # fmt: skip
    vllm_port, guardian_port = free_port(), free_port()
    cfg = demo_config(opts, tmp_path, vllm_port, guardian_port)
    cfg = replace(cfg, signals=replace(cfg.signals, stall_seconds=3))
    guardian = Guardian(cfg)
    loop = threading.Thread(target=guardian.run, kwargs={"install_signals": False}, daemon=True)
    loop.start()
    g: GateThread | None = None
    try:
        wait_http(f"http://127.0.0.1:{vllm_port}/health", timeout=60)
        g = GateThread(
            f"http://127.0.0.1:{vllm_port}", guardian=f"http://127.0.0.1:{guardian_port}",
            max_wait_seconds=60, kv_admission=False,
        )  # fmt: skip
        profile = LoadProfile(
            rate_per_second=6.0, prompt_tokens_min=50, prompt_tokens_max=100,
            output_tokens_min=20, output_tokens_max=60,
        )  # fmt: skip
        # The engine hangs 30 simulated s (7.5 s) after it is ready; the load runs until the
        # restart has succeeded (the new instance would hang again 7.5 s after its start).
        plan = plan_requests(profile, seed=3, max_requests=400, duration_seconds=900)
        stop = threading.Event()
        out: list[LoadResult] = []
        runner = threading.Thread(
            target=lambda: out.append(run_load(
                g.url, plan, model="demo", speed=4, stream=False, max_duration_seconds=90,
                request_timeout_seconds=75, stop=stop,
            )),
            daemon=True,
        )  # fmt: skip
        runner.start()
        audit = tmp_path / "state" / "audit.jsonl"
        deadline = time.monotonic() + 80
        while time.monotonic() < deadline and "restart succeeded" not in (
            audit.read_text() if audit.exists() else ""
        ):
            time.sleep(0.2)
        stop.set()
        runner.join(timeout=90)
        assert "restart succeeded" in audit.read_text(), audit.read_text()[-2000:]
        result = out[0]
        sent = [o for o in result.outcomes if o.kind is not OutcomeKind.NOT_SENT]
        kinds = {k.value: result.count(k) for k in OutcomeKind if result.count(k)}
        print("outcomes:", kinds, "gate:", g.gate.proxy.status() if g.gate.proxy else None)
        assert len(sent) >= 20, kinds
        assert all(o.kind is OutcomeKind.OK for o in sent), kinds
        text = requests.get(f"{g.url}/metrics", timeout=5).text
        held = float(re.search(r"vllm_guardian_gate_held_total\S* (\S+)", text).group(1))  # type: ignore[union-attr]
        assert held > 0  # some requests really waited for the new instance
    finally:
        if g is not None:
            g.stop()
        guardian.request_stop()
        loop.join(timeout=60)
