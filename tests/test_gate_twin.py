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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import wait_for
from tests.test_gate_support import GateThread
from vllm_guardian.shell.daemon import Guardian
from vllm_guardian.sim.load import LoadResult, OutcomeKind, plan_requests, run_load
from vllm_guardian.sim.scenarios import LoadProfile
from vllm_guardian.tools.demo import DemoOptions, _start_gate, demo_config, free_port

pytestmark = pytest.mark.slow


def wait_http(url: str, timeout: float = 120.0) -> None:
    # A refused or failed request (requests' errors are OSErrors) counts as "not yet".
    wait_for(
        lambda: requests.get(url, timeout=1).status_code == 200, f"{url} to answer 200", timeout
    )


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
    body = re.sub(rb'"id": ?"(chatcmpl|cmpl|modelperm)-[0-9a-f]+"', b'"id": "X"', body)
    return re.sub(rb'"created": ?\d+', b'"created": 0', body)


def test_byte_for_byte_through_the_gate() -> None:
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


@pytest.mark.timeout(300)  # the twin's start (≤ 120 s) and two bursts on a busy machine
def test_kv_burst_is_held_at_the_gate() -> None:
    """30 requests in 3 s into a 4k-token pool (~16k tokens of work): straight in, vLLM
    preempts and recomputes; through the gate (KV-need admission) they wait their turn instead:
    fewer preemptions, no failure, every token delivered. Holding costs queueing time, so the
    gate's p99 is higher than direct (both printed); it must stay far from the time bounds.

    How many preemptions the direct burst causes depends on how close together the twin sees
    the requests arrive, in simulated time: a client thread that is late by d seconds spreads
    them by d × speed. With the 8k-token pool this test had, the plan's spread of 2.2 simulated
    s gave 19 preemptions, 4.4 s (the client under half a second late at speed 5) 13, and 6.6 s
    9, under the bar of 10: on a busy machine the precondition failed. With 4k tokens, spreads
    of 2.2, 6.6, 11 and 17.6 simulated s (the plan's arrival times stretched 1-8x) gave 34, 29,
    15 and 32 (one run of the test itself with the machine's load average above 500: 11)."""
    profile = LoadProfile(
        rate_per_second=10, prompt_tokens_min=100, prompt_tokens_max=200,
        output_tokens_min=300, output_tokens_max=500,
    )  # fmt: skip
    plan = plan_requests(profile, seed=7, max_requests=30, duration_seconds=10)
    wanted = {p.index: p.max_tokens for p in plan}
    speed = 5.0
    kv = ("--kv-cache-memory-bytes", str(512 * 1024**2), "--max-model-len", "2048",
          "--no-enable-prefix-caching")  # fmt: skip
    figures = {}
    with twin(*kv, speed=speed) as url:
        # KV-need admission on (off by default), the default release rate: 50/s, 8 at once.
        g = GateThread(url, kv_admission=True)
        try:
            for name, target in (("direct", url), ("gate", g.url)):
                before = preemptions(url)
                result = run_load(
                    target, plan, model="demo", speed=speed, max_duration_seconds=60,
                    request_timeout_seconds=60,
                )  # fmt: skip
                failed = len(result.outcomes) - result.count(OutcomeKind.OK)
                # ignore_eos and room in max_model_len: every request gets all its tokens (a
                # twin that dropped the deltas of steps run inside submit() lost some).
                short = [o.index for o in result.outcomes
                         if o.kind is OutcomeKind.OK and o.completion_tokens != wanted[o.index]]  # fmt: skip
                figures[name] = (preemptions(url) - before, round(p99(result), 2), failed, short)
        finally:
            g.stop()
    print("preemptions, p99 s, failed, short answers:", figures)
    assert figures["direct"][0] >= 10, figures  # the burst really thrashes when sent straight
    assert figures["gate"][0] <= figures["direct"][0] / 4, figures
    assert figures["gate"][2] == 0 and figures["direct"][2] == 0, figures
    assert figures["gate"][3] == [] and figures["direct"][3] == [], figures
    # Measured on a 2-core box: direct ~2.0 s, gate ~3.0 s. The bound only catches requests
    # that sit in the queue (the bug this test once had read as p99 ~ 61 s).
    assert figures["gate"][1] <= 4 * figures["direct"][1] + 5, figures


def test_five_operator_restarts_under_load_through_the_gate_lose_nothing(tmp_path: Path) -> None:
    """A guardian supervises the twin; steady mixed load (streaming and unary, ~8 req/s) runs
    through the gate, which follows /ready/vllm; an operator runs `vllm-guardian restart vllm`
    five times in a row (the real CLI over the control socket: close the front door, drain,
    restart, wait for ready, open). Requests that arrive meanwhile are held and sent to the new
    instance: none fails, each answer is whole, and vLLM saw each request once plus the gate's
    retries, which happen only before a first byte (nothing that had started streaming was
    replayed)."""
    speed = 8.0
    opts = DemoOptions(
        "steady", speed=speed, workdir=tmp_path, quiet=True,
        extra_twin_args=("--sim-model", "tiny", "--enforce-eager"),
        policy={"drain_timeout_seconds": 5, "startup_grace_seconds": 10},
    )  # fmt: skip
    vllm_port, guardian_port, gate_port = free_port(), free_port(), free_port()
    # The deployed form: the service's gate: section, the gate run from it as its unit runs it.
    cfg = demo_config(opts, tmp_path, vllm_port, guardian_port, gate_port)
    gate_url = f"http://127.0.0.1:{gate_port}"
    guardian = Guardian(cfg)
    loop = threading.Thread(target=guardian.run, kwargs={"install_signals": False}, daemon=True)
    loop.start()
    gate: subprocess.Popen[bytes] | None = None
    gate_log = (tmp_path / "gate.log").open("wb")
    restarts = 5
    try:
        wait_http(f"http://127.0.0.1:{vllm_port}/health", timeout=60)
        wait_http(f"http://127.0.0.1:{guardian_port}/ready/vllm", timeout=30)
        gate = _start_gate(tmp_path, gate_url, gate_log)

        def gate_status() -> dict[str, Any]:
            got: dict[str, Any] = requests.get(f"{gate_url}/gate/status", timeout=5).json()
            return got

        profile = LoadProfile(
            rate_per_second=0.5, prompt_tokens_min=20, prompt_tokens_max=60,
            output_tokens_min=20, output_tokens_max=60,
        )  # fmt: skip
        # Arrivals over 800 simulated s (100 s at speed 8), 4 req/s of each kind: the five
        # restarts fall inside them; the load stops by itself when the restarts are done.
        loads = {
            "stream": plan_requests(profile, seed=3, max_requests=400, duration_seconds=800),
            "unary": plan_requests(profile, seed=4, max_requests=400, duration_seconds=800),
        }
        out: dict[str, LoadResult] = {}
        stop = threading.Event()

        def drive(kind: str) -> None:
            out[kind] = run_load(
                gate_url, loads[kind], model="demo", speed=speed, stream=kind == "stream",
                max_duration_seconds=100, request_timeout_seconds=120, stop=stop,
            )  # fmt: skip

        runners = [threading.Thread(target=drive, args=(k,), daemon=True) for k in loads]
        for r in runners:
            r.start()
        sup = guardian.healing.supervisors["vllm"] if guardian.healing else None
        assert sup is not None
        wait_for(lambda: gate_status()["admitted_total"] >= 20, "the load flowing through the gate",
                 timeout_seconds=60, seen=gate_status)  # fmt: skip
        first_pid = sup.pid
        socket = str(tmp_path / "run" / "control.sock")
        lines: list[str] = []
        for i in range(restarts):
            proc = subprocess.run(
                [sys.executable, "-m", "vllm_guardian", "restart", "vllm", "--socket", socket,
                 "--timeout-seconds", "120"],
                capture_output=True, text=True, timeout=180, check=False,
            )  # fmt: skip
            lines.append(proc.stdout)
            assert proc.returncode == 0, f"restart {i + 1}: {proc.stdout}{proc.stderr}"
            assert "restart succeeded" in proc.stdout and "draining" in proc.stdout, proc.stdout
            # The drain counted what the gate itself had in flight, not vLLM's gauges.
            assert "in flight per gate" in proc.stdout, proc.stdout
        stop.set()
        for r in runners:
            r.join(timeout=150)
        assert sup.starts == 1 + restarts and sup.pid != first_pid, sup.starts
        sent = {k: [o for o in res.outcomes if o.kind is not OutcomeKind.NOT_SENT]
                for k, res in out.items()}  # fmt: skip
        kinds = {k: {x.value: res.count(x) for x in OutcomeKind if res.count(x)}
                 for k, res in out.items()}  # fmt: skip
        status = gate_status()
        text = requests.get(f"{gate_url}/metrics", timeout=5).text

        def metric(name: str) -> float:
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(f"vllm_guardian_gate_{name}{{")
            )

        held, retried = metric("held_total"), metric("retried_total")
        longest = status["longest_wait_seconds"] if status else None
        print(f"outcomes: {kinds} held: {held:.0f} longest hold: {longest} s retried: {retried}")
        print("last restart as the operator saw it:\n" + lines[-1])
        for k, plan in loads.items():
            assert len(sent[k]) >= 40, kinds  # the load really ran through the restarts
            assert all(o.kind is OutcomeKind.OK for o in sent[k]), kinds
            wanted = {p.index: p.max_tokens for p in plan}
            assert [o.index for o in sent[k] if o.completion_tokens != wanted[o.index]] == []
        assert held > 0  # some requests really waited for a new instance
        streaming_errors = [
            line for line in text.splitlines()
            if line.startswith("vllm_guardian_gate_upstream_errors_total{")
            and 'phase="streaming"' in line
        ]  # fmt: skip
        assert all(line.endswith(" 0.0") for line in streaming_errors), streaming_errors
        log_text = (tmp_path / "vllm.log").read_text(errors="replace")
        posts = log_text.count('"POST /v1/completions HTTP/1.1"')
        total = sum(len(v) for v in sent.values())
        # Every request reached vLLM once, plus at most the gate's retries: a retry whose first
        # attempt was refused or reset never reached vLLM's log, one that got the drain's 500
        # did, and which happens depends on timing. More than that would be a replay.
        assert total <= posts <= total + retried, (posts, total, retried)
        assert status is not None and status["in_flight"] == 0 and status["queue_depth"] == 0
    finally:
        if gate is not None:
            gate.terminate()
            try:
                gate.wait(timeout=30)
            except subprocess.TimeoutExpired:
                gate.kill()
                gate.wait(timeout=10)
        gate_log.close()
        guardian.request_stop()
        loop.join(timeout=60)
    assert not loop.is_alive()
