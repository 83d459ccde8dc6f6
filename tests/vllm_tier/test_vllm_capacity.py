"""The `vllm` tier: the twin's step cost and the over-capacity estimate on a real vLLM.

One real vLLM 0.32 at a time (CPU build, the tiny random Llama), on 127.0.0.1, started by the
test and stopped (and swept by its marker) by it:

1. **Twin vs real, with and without a low cap.** Shape A of the KV-thrash measurement
   (``docs/capacity.md``; a 16-block pool, 96 closed-loop requests of 200 prompt tokens and
   128-256 output tokens, 24 clients, ``ignore_eos``) on a fresh server uncapped and with
   ``--max-num-seqs 2`` (0.4x the 5 the pool hosts), and the same seeded load on the twin.
   Compared: preemptions (±12: the real runs spread 64-75 uncapped) and the throughput ratio
   capped ÷ uncapped, the real one from each run's own schedule under the real engine's fitted
   step cost: both must show the loss (below 0.85; its size is checked against the study,
   deterministically, in tests/sim/test_step_cost.py); wall clock varied 0.43-0.53 between two
   runs on this shared 2-core VM, so it only has to show a loss.
2. **The over-capacity estimate under overload.** On the uncapped server, after its closed
   loop measured what it serves, an open-loop load at twice that rate (every request sent at
   its time; the client holds them all, and what is still in flight when the window ends is
   not waited for): the guardian's
   estimate over a 45 s window, from vLLM's own /metrics sampled once a second, is within
   ±25 % of the true demand ratio over the span the estimate observed (its first to its last
   scrape): the requests the load generator started in that span ÷ the requests vLLM completed
   in it (its success counter between the same two scrapes), and ``replicas_needed`` is what
   that ratio implies (±25 %), whenever vLLM's own queue held
   requests in >= 95 % of the samples (the estimate must then measure). Not exactly 2: hundreds
   of open connections slow the API server on this 2-core VM, so twice the closed loop's rate
   was 4.35x what the server then served (one run, 06:20 UTC 2026-11-24: estimated 4.58x, 5
   replicas), and 1.33x in a CI run, where vLLM queued in only 80 % of the samples (the API
   server held arrivals before the engine saw them) and the estimate refused, saying so.
   On the server capped at 2 the same happened at 1.5x (vLLM queued in none of the samples,
   beside a CPU hog): the cap moves the bottleneck to the API server, whose per-step output
   work is on the same shared core.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sim.helpers import closed_loop, shape_a_outputs
from tests.support import wait_for
from tests.vllm_tier import support
from vllm_guardian.core.capacity import CapacitySettings, CapacityState, estimate
from vllm_guardian.core.signals import capacity_samples
from vllm_guardian.model import ServiceSnapshot, Snapshot
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics
from vllm_guardian.tools.demo import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SHAPE_A_FLAGS = ("--max-model-len", "1024", "--num-gpu-blocks-override", "16")
REQUESTS, CLIENTS, PROMPT_TOKENS = 96, 24, 200
STARVED_BELOW = 3.0  # sequences per engine step, uncapped: below, the load did not reach vLLM
STARVED_RETRIES = 3  # closed loops run again when one did not reach vLLM (~30 s each)
REPORT: dict[str, object] = {}


@dataclass
class Server:
    url: str
    run_id: str


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    return support.vllm_venv_or_skip()


@pytest.fixture(scope="module")
def tiny_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    support.build_model(vllm_venv, out)
    return out


@pytest.fixture(scope="module")
def lock() -> Iterator[None]:
    fh = support.host_lock()  # one real server on this host at a time
    try:
        yield
    finally:
        fh.close()
        print(f"\nvllm capacity tier: {REPORT}")


@contextlib.contextmanager
def serve(venv: Path, model: Path, workdir: Path, *flags: str) -> Iterator[Server]:
    run_id = uuid.uuid4().hex
    port = free_port()
    env = support.vllm_env(run_id, workdir)
    cmd = support.serve_command(venv, model, port, env, (*SHAPE_A_FLAGS, *flags))
    log = (workdir / f"vllm-{port}.log").open("wb")
    census = support.Census(run_id).start()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", run_id)
    started = time.monotonic()
    phases = REPORT.setdefault("phases", [])  # each server's start and stop, in seconds
    assert isinstance(phases, list)
    try:
        wait_for(
            lambda: support.healthy(server.url),
            "vLLM /health 200",
            300,
            every_seconds=support.POLL_SECONDS,
        )
        phases.append({"serve": flags, "up_s": round(time.monotonic() - started, 1)})
        # The engine behind the API server and the clients, as on a GPU host where its step
        # is not on their cores (support.lower_engine_priority). Beside a CPU hog, without it:
        # 1.0-2.6 sequences a step in all six closed loops of two CI rehearsals; with it, 5.0
        # (3,732 steps, 65 preemptions; /tmp probe, 2026-11-24 22:27 UTC).
        reniced = support.lower_engine_priority(proc.pid)
        assert any("EngineCore" in p for p in reniced), f"no EngineCore below vLLM: {reniced}"
        REPORT.setdefault("reniced", []).append(reniced)  # type: ignore[attr-defined]
        yield server
    finally:
        stopping = time.monotonic()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        support.sweep(run_id, census)
        left = support.leftovers(run_id, census=census)
        census.stop()
        phases.append({"stop": flags, "stop_s": round(time.monotonic() - stopping, 1)})
        assert not left, f"vLLM processes left behind: {left}"


def metrics(url: str) -> str:
    return str(support.session().get(url + "/metrics", timeout=10).text)


def counter(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def run_closed_loop(url: str) -> dict[str, float]:
    """Shape A's closed loop to completion: generated tokens/s (wall), requests/s, preemptions."""
    outputs = shape_a_outputs()
    before = metrics(url)
    start = time.monotonic()

    def one(i: int) -> support.StreamResult:
        prompt = support.prompt_ids(PROMPT_TOKENS, 100_000 + i)
        return support.stream_completion(url, prompt, outputs[i], stream=False, timeout=600)

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    seconds = time.monotonic() - start
    after = metrics(url)
    failed = [r.error for r in results if not r.done]
    assert not failed, failed[:3]
    delta = {
        name: counter(after, name) - counter(before, name)
        for name in (
            "vllm:num_preemptions_total",
            "vllm:iteration_tokens_total_count",
            "vllm:iteration_tokens_total_sum",
        )
    }
    preemptions = delta["vllm:num_preemptions_total"]
    # The run's engine time under the step-cost model fitted to the real engine (shape A:
    # 2.67 ms + 135 µs per prefill-like token + 0.67 ms per sequence in a step), from its own
    # schedule: steps and forwarded tokens from vLLM's iteration histogram; sequence-steps =
    # one per decoded token (every output token but the first of each request) plus one
    # prefill chunk per request and per resumption after a preemption. Free of wall-clock noise.
    decode = sum(outputs) - REQUESTS
    sequence_steps = decode + REQUESTS + preemptions
    prefill_like = delta["vllm:iteration_tokens_total_sum"] - decode
    modelled = (
        2.67e-3 * delta["vllm:iteration_tokens_total_count"]
        + 135e-6 * prefill_like
        + 0.67e-3 * sequence_steps
    )
    return {
        "seconds": seconds,
        "tokens_per_second": sum(outputs) / seconds,
        "requests_per_second": REQUESTS / seconds,
        "preemptions": preemptions,
        "steps": delta["vllm:iteration_tokens_total_count"],
        "modelled_seconds": modelled,
        # How many of the 24 clients' requests the engine ran at once, on average: ~5 uncapped
        # (the pool hosts 5), < 2 at cap 2.
        "sequences_per_step": sequence_steps / max(1.0, delta["vllm:iteration_tokens_total_count"]),
    }


def apart(fn: Callable[..., dict[str, Any]], *args: object) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process. The load's client threads must not share pytest's
    GIL: after the suite's other tests, threads they leave in this process (and the GIL's
    switch interval, which every blocking call of 24 client threads waits on) slowed the
    clients so that vLLM ran one request at a time while 24 had requests out (CI and a soak,
    2026-11-24: 1.1-1.3 sequences a step against the usual ~5)."""
    ctx = multiprocessing.get_context("spawn")
    started = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        out = pool.submit(fn, *args).result(timeout=1200)
    phases = REPORT.setdefault("phases", [])
    assert isinstance(phases, list)
    ended = time.monotonic()
    phase = {"apart": fn.__name__, "s": round(ended - started, 1)}
    if "began_at" in out and "returned_at" in out:
        phase["worker_start_s"] = round(out["began_at"] - started, 1)
        phase["worker_exit_s"] = round(ended - out["returned_at"], 1)
    phases.append(phase)
    return out


def test_twin_and_real_server_lose_alike_under_a_low_cap(
    lock: None, vllm_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    real: dict[str, dict[str, object]] = {}
    for arm, flags in (("uncapped", ()), ("cap2", ("--max-num-seqs", "2"))):
        with serve(vllm_venv, tiny_model, tmp_path, *flags) as server:
            real[arm] = apart(run_closed_loop, server.url)
            starved_runs: list[dict[str, Any]] = []
            while (
                arm == "uncapped"
                and real[arm]["sequences_per_step"] < STARVED_BELOW
                and len(starved_runs) < STARVED_RETRIES
            ):
                # The load never reached the engine: seen in soaks and CI rehearsals beside a
                # CPU hog before the engine ran behind the API server (serve(): 1.0 to 2.6
                # sequences a step, 8,300 to 18,000 steps against the usual 3,700). That
                # measures the host, not the engine. The closed loop (20-35 s) runs again on
                # the same server, and every run is reported.
                starved_runs.append(real[arm])
                real[arm] = apart(run_closed_loop, server.url)
            if starved_runs:
                real["uncapped_starved"] = {str(i): r for i, r in enumerate(starved_runs)}
            if arm == "uncapped":
                real["open_loop"] = REPORT["open_loop"] = apart(
                    over_capacity, server.url, real[arm]["requests_per_second"]
                )
    twin_uncapped, twin_uncapped_pre = closed_loop(None)
    twin_cap, twin_cap_pre = closed_loop(2)
    wall_ratio = real["cap2"]["tokens_per_second"] / real["uncapped"]["tokens_per_second"]
    modelled_ratio = real["uncapped"]["modelled_seconds"] / real["cap2"]["modelled_seconds"]
    twin_ratio = twin_cap / twin_uncapped
    REPORT.update(
        real=real,
        real_wall_ratio=round(wall_ratio, 3),
        real_modelled_ratio=round(modelled_ratio, 3),
        twin_ratio=round(twin_ratio, 3),
        twin_preemptions={"uncapped": twin_uncapped_pre, "cap2": twin_cap_pre},
    )
    print(REPORT)
    starved = float(real["uncapped"]["sequences_per_step"])  # type: ignore[arg-type]
    assert starved >= STARVED_BELOW, (
        f"{STARVED_RETRIES + 1} times, the 24 clients kept only {starved:.1f} sequences a step "
        "in the uncapped engine "
        "(about 5 when their load reaches it): the host starved the client or the API server",
        REPORT,
    )
    assert abs(real["uncapped"]["preemptions"] - twin_uncapped_pre) <= 12, REPORT
    assert abs(real["cap2"]["preemptions"] - twin_cap_pre) <= 12, REPORT
    # What one live pair can be trusted to show is the direction: under a cap at 0.4x what the
    # pool hosts, the real engine's own schedule costs clearly more engine time than uncapped,
    # and the twin says so too. Its size is not a one-pair number: the uncapped arm's schedule
    # depends on when 24 closed-loop clients resubmit, which a busy machine moves; the modelled
    # ratio was 0.66 over the study's 3 pairs, and single runs here gave 0.62 and 0.52 (the twin:
    # 0.67). Comparing one pair to the twin needed ±0.18, which passes or fails by the machine.
    # The size is checked where it is deterministic: the twin against the study's values, ±0.05
    # (tests/sim/test_step_cost.py; the twin before its calibration, 0.40, fails there). Wall
    # clock only has to show a loss: 0.43-0.53 on this shared VM (0.63-0.72 in the study).
    assert modelled_ratio < 0.85, REPORT
    assert twin_ratio < 0.85, REPORT
    assert wall_ratio < 0.9, REPORT
    est = real["open_loop"]
    if est["state"] != "estimated":
        return  # refused (too little data, or vLLM's queue not persistent): see over_capacity
    # What the estimate infers is the arrivals (the requests finished plus the growth of those
    # in the engine); its served rate is vLLM's success counter itself. So the reference is the
    # arrivals the client knows it made over the estimate's own span, against the counter over
    # the same span. The client's own count of completions is reported, not compared: it reads
    # a completion when its thread gets the GIL back, and beside a CPU hog hundreds of client
    # threads ran seconds late (2026-11-27: 380-390 completions read in a 45 s window in which
    # vLLM completed ~290; the estimate 1.60, the window's sent/completed 1.25, all else green).
    counted = float(est["counted"])  # type: ignore[arg-type]
    assert est["estimated"] == pytest.approx(counted, rel=0.25), REPORT
    # The replicas the generator's own count implies, within the same ±25 %. At exactly twice
    # what the server serves under this load that is 2; here the rate is twice the closed
    # loop's, and hundreds of open connections slow the API server (one of two shared cores):
    # measured once, 4.35x by the client's count, 4.58x estimated, 5 replicas.
    low, high = (math.ceil(f * counted / 1.1) for f in (0.75, 1.25))
    assert low <= float(est["replicas_needed"]) <= high, REPORT  # type: ignore[arg-type]


def over_capacity(
    url: str, served: float, window: float = 45.0, warmup: float = 15.0
) -> dict[str, float]:
    """Open loop at twice the rate the closed loop served (``served``: the server's capacity,
    just measured); the estimate against the client's own counts over the same window. (At
    three times, /metrics itself stopped answering within the window on two shared cores.)"""
    rate = 2.0 * served
    duration = warmup + window + 2.0
    n = int(rate * duration)
    outputs = shape_a_outputs(seed=202, requests=n)
    sent: list[float] = []
    done: list[float] = []
    snaps: list[Snapshot] = []
    stop = threading.Event()

    started: list[float] = []  # when each request's thread began its POST
    scrape_seconds: list[float] = []  # how long each in-window scrape took to answer

    def sampler() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                scrape = parse_vllm_metrics(metrics(url))
            except Exception:
                scrape = None
            scrape_seconds.append(time.monotonic() - t)
            snaps.append(Snapshot(t, (ServiceSnapshot("vllm", vllm=scrape),), None, ()))
            stop.wait(max(0.0, 1.0 - (time.monotonic() - t)))

    def one(i: int) -> None:
        prompt = support.prompt_ids(PROMPT_TOKENS, 500_000 + i)
        started.append(time.monotonic())
        r = support.stream_completion(url, prompt, outputs[i], stream=False, timeout=900)
        if r.done:
            done.append(r.ended)

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    start = time.monotonic()
    # One daemon thread per request, never joined: what is still in flight after the window
    # (85-244 requests in three runs) decides nothing, since the counts and the estimate are
    # the window's. Draining it took 40 s of the test beside a CPU hog; now this process
    # (apart()) exits without waiting on those threads, and the caller stops the server next
    # (1.1 s with 244 requests in flight, as with none).
    for i in range(n):
        due = start + i / rate
        time.sleep(max(0.0, due - time.monotonic()))
        sent.append(time.monotonic())
        threading.Thread(target=one, args=(i,), daemon=True).start()
    t0, t1 = start + warmup, start + warmup + window
    time.sleep(max(0.0, t1 + 1.0 - time.monotonic()))
    in_window = [s for s in snaps if t0 <= s.time_seconds <= t1]
    finished = list(done)
    stop.set()
    samples = capacity_samples(in_window, "vllm")
    est = estimate(samples, CapacitySettings(window_seconds=window))
    watcher.join(timeout=5)
    began = list(started)
    # The true ratio over the span the estimate observed: the requests the client started
    # between its first and last answered scrape, over vLLM's successful completions between
    # the same two scrapes (a scrape's values are the server's somewhere between its request
    # and its answer: the answers' times are reported, seconds under an overloaded API server).
    answered = [s for s in in_window if s.services[0].vllm is not None]
    counted = 0.0
    client_counted = 0.0
    if len(answered) >= 2:
        a, b = answered[0], answered[-1]
        first, last = (capacity_samples([x], "vllm")[0] for x in (a, b))
        ok = (first.finished_total or 0.0) - (first.failed_total or 0.0)
        ok_last = (last.finished_total or 0.0) - (last.failed_total or 0.0)
        arrived = sum(1 for x in began if a.time_seconds <= x <= b.time_seconds)
        counted = arrived / max(1.0, ok_last - ok)
        client_counted = sum(1 for s in sent if t0 <= s <= t1) / max(
            1, sum(1 for d in finished if t0 <= d <= t1)
        )
    # The share of vLLM's own samples with a request in its queue: the engine-side evidence.
    queued = [x for x in samples if x.waiting is not None]
    waited = sum(1 for x in queued if x.waiting is not None and x.waiting >= 1) / max(
        1, len(queued)
    )
    out: dict[str, object] = {
        "rate_per_second": rate,
        "served_per_second": served,
        "counted": counted,
        # The client's own sent ÷ completed over the whole window: reported, not compared (see
        # the test), beside how late the sender ran and how long the scrapes took.
        "client_counted": round(client_counted, 3),
        "sender_late_max_s": round(
            max((x - (start + i / rate) for i, x in enumerate(sent)), default=0.0), 2
        ),
        "scrape_s_max": round(max(scrape_seconds, default=0.0), 2),
        "engine_waited_share": round(waited, 2),
        "estimated": est.demand_ratio or 0.0,
        "replicas_needed": float(est.replicas_needed or 0),
        "state": est.state.value,
        "line": est.line(),
        "in_flight_at_end": len(sent) - len(finished),
        "began_at": start,  # monotonic, as apart() reads it: the worker's start-up before it
    }
    REPORT["open_loop"] = out
    # Never a number from too little data: an overloaded API server on two shared cores often
    # answers /metrics too slowly for 80 % of the window to be observed (seen: 6 scrapes in
    # 45 s). Then the estimate must refuse, and say so; otherwise it must estimate.
    observed = (answered[-1].time_seconds - answered[0].time_seconds) if answered else 0.0
    scraped = len(answered)
    if observed < 0.8 * window or scraped < 3:
        assert est.state is CapacityState.TOO_LITTLE_DATA, out
        assert "observed" in est.line() or "scrape" in est.line(), out
    elif waited >= 0.95:
        # vLLM's own queue held requests in (nearly) every sample: an overload it saw, which
        # the estimate must measure.
        assert est.state is CapacityState.ESTIMATED, out
    else:
        # The client sent twice the closed loop's rate, but vLLM did not always queue: an open
        # loop batches more than 24 closed-loop clients did, and the API server (one shared
        # core) can hold arrivals before the engine sees them. In CI (2026-11-24) the client
        # counted 1.33x and vLLM queued in 80 % of the samples. The estimate may then measure
        # a growing backlog (then within ±25 % of the client's count, as below), or refuse
        # because the queue was not persistent, and say so.
        assert est.state in (CapacityState.ESTIMATED, CapacityState.NOT_SATURATED), out
        if est.state is CapacityState.NOT_SATURATED:
            assert "waited in only" in est.line(), out
    out["returned_at"] = time.monotonic()  # apart(): the worker's exit after it
    return out
