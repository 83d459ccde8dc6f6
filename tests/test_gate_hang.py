"""A hung engine's requests are taken back by the gate and served by the restarted engine.

The twin's ``engine_hang`` fault (the engine stops stepping 30 simulated seconds after it is
ready; ``/health`` stays 200, ``/metrics`` freezes with the requests still in it) behind a real
gate whose progress watch holds after 2 s. Streams that were generating, and streams and unary
requests that reached the hung engine and got nothing, are in flight when it hangs. The gate
takes them back (closes their upstream connections); the test then does what the guardian
does, a restart (the twin killed, a fresh one on the same port), and every client gets its
whole answer: one uninterrupted stream, with the text of an uncut one. Before the restart the
test ends the gate's hold by hand, as it ended on the real vLLM with the engine still hung:
what was taken back stays in the gate until the engine is a new one.

The twin's text is one " tok" per token, so an uncut answer of N tokens is known without
running one. About 14 s: two twin starts (~3 s each), ~1.5 s to the hang (the requests go 7
simulated seconds before it), the gate's 2 s hold, the rest the generation of 8,000 tokens a
request at 20 simulated seconds a second.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.sim.twinproc import TwinProc, start, stop
from tests.support import wait_for
from tests.test_gate_support import LoopThread
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

pytestmark = pytest.mark.slow

SPEED = "20"
MAX_MODEL_LEN = 8192
# Generating when the hang comes: sent 7 simulated seconds before it, a stream of 8,000 tokens
# (~880 a simulated second alone, fewer beside others) is still generating.
TOKENS = 8000
HANG_AT_SECONDS = 30.0  # the engine_hang scenario's, simulated
SEND_AT_SECONDS = HANG_AT_SECONDS - 7
PROMPT = "the quick brown fox"
ABORTED_TOKENS = 4000  # a request's in the restart test: generating when the SIGTERM comes


def twin_on(tmp: Path, port: int, *extra: str) -> TwinProc:
    t = start(tmp, port, "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
              "--sim-speed", SPEED, "--enforce-eager", *extra)  # fmt: skip
    t.wait_ready()
    return t


class HungGate:
    """A gate whose progress watch holds after 2 s without progress. A held request waits 1 s
    at most; one taken back from the hung engine 60 s more (the time the engine would have
    held it before a restart), which the restart here needs."""

    def __init__(self, upstream: str) -> None:
        self.lt = LoopThread("gate")
        self.gate = Gate(
            GateSettings(
                proxy=ProxySettings(
                    upstream=upstream,
                    keepalive_comment_seconds=0.5,
                    taken_back_extra_wait_seconds=60.0,
                ),
                listen_port=0,
                limits=Limits(max_wait_seconds=1.0, release_rate_per_second=0),
                poll_interval_seconds=0.05,
                kv_poll_interval_seconds=0.1,
                suspect_seconds=0.2,
                stall_hold_seconds=2.0,
                take_back_hung=True,  # experimental, off by default
                shutdown_timeout_seconds=1.0,
            )
        )
        self.lt.run(self.gate.start())
        self.url = f"http://127.0.0.1:{self.gate.port}"

    @property
    def taken_back(self) -> int:
        assert self.gate.follower is not None
        return self.gate.follower.taken_back

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(f"{self.url}/gate/status", timeout=10).json()
        return doc

    def metric(self, name: str) -> str:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return "\n".join(line for line in text.splitlines() if name in line and "_total{" in line)

    def stop(self) -> None:
        self.lt.run(self.gate.stop())
        self.lt.close()


def stream(
    url: str, tokens: int = TOKENS, first_text: threading.Event | None = None
) -> dict[str, Any]:
    """A streamed completion read to its end: its text, last finish_reason, usage, events;
    ``first_text`` is set when its first text arrives."""
    doc = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "stream": True,
           "temperature": 0, "ignore_eos": True,
           "stream_options": {"include_usage": True}}  # fmt: skip
    text, finish, usage, ids, done, first_text_at = "", None, None, set(), False, None
    with requests.post(f"{url}/v1/completions", json=doc, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for raw in r.iter_lines():
            if raw == b"data: [DONE]":
                done = True
            elif raw.startswith(b"data: "):
                chunk = json.loads(raw[6:])
                ids.add(chunk["id"])
                for c in chunk["choices"]:
                    if c["text"] and first_text_at is None:
                        first_text_at = time.monotonic()
                        if first_text is not None:
                            first_text.set()
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                usage = chunk.get("usage") or usage
    return {"text": text, "finish": finish, "usage": usage, "ids": ids, "done": done,
            "first_text_at": first_text_at}  # fmt: skip


def unary(url: str, tokens: int = TOKENS) -> dict[str, Any]:
    doc = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
           "ignore_eos": True}  # fmt: skip
    r = requests.post(f"{url}/v1/completions", json=doc, timeout=120)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return {"text": answer["choices"][0]["text"], "finish": answer["choices"][0]["finish_reason"],
            "usage": answer["usage"]}  # fmt: skip


@pytest.fixture
def twins(tmp_path: Path, free_port: int) -> Iterator[list[TwinProc]]:
    made: list[TwinProc] = []
    yield made
    for t in made:
        stop(t)


def test_a_hung_engines_requests_are_taken_back_and_served_by_the_restarted_one(
    tmp_path: Path, free_port: int, twins: list[TwinProc]
) -> None:
    hung = twin_on(tmp_path, free_port, "--sim-scenario", "engine_hang")
    twins.append(hung)

    def clock() -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(f"{hung.url}/sim/clock", timeout=10).json()
        return doc

    # The gate stops before the pool waits for its clients: a failure ends their reads.
    with ThreadPoolExecutor(8) as pool:
        g = HungGate(hung.url)
        t0 = time.monotonic()
        try:
            wait_for(
                lambda: clock()["scenario_seconds"] >= SEND_AT_SECONDS, "the send time", seen=clock
            )
            # Generating when the engine hangs: two streams and a unary request.
            early: list[Future[dict[str, Any]]] = [pool.submit(stream, g.url) for _ in range(2)]
            early.append(pool.submit(unary, g.url))
            wait_for(lambda: clock()["phase"] == "hung", "the hang", seen=clock)
            assert not any(f.done() for f in early), [f.result() for f in early if f.done()]
            # Sent into the hung engine before the gate holds (its watch needs 2 s), where
            # nothing comes back for them (or held by the gate, on a slow machine).
            late = [pool.submit(stream, g.url), pool.submit(unary, g.url)]
            # All five wait in the gate's queue: none is left in the hung engine.
            wait_for(
                lambda: (g.status()["queue_depth"], g.status()["in_flight"]) == (5, 0),
                "5 queued, none in the hung engine",
                seen=lambda: f"taken back {g.taken_back}, status {g.status()}",
            )
            taken_back_at, taken_back = time.monotonic(), g.taken_back
            print(f"taken back {time.monotonic() - t0:.1f} s after the gate started")
            assert not g.status()["open"]
            # The hold ends with the engine still hung (on the real vLLM it did, and what was
            # sent again went into the hung engine): what was taken back stays in the gate
            # until the engine is a new one.
            follower = g.gate.follower
            assert follower is not None
            follower.progress.hold_after_seconds = 1e9
            polls = follower.polls
            wait_for(
                lambda: follower.polls >= polls + 10 and follower.progress.stalled() is None,
                "ten polls after the hold ended",
                seen=g.status,
            )
            status = g.status()
            assert (status["queue_depth"], status["in_flight"], status["open"]) == (5, 0, False)
            assert "taken back" in status["reason"], status
            # What the guardian does after signals.stall_seconds: a restart.
            stop(hung)
            twins.append(twin_on(tmp_path, free_port))
            restarted_at = time.monotonic()
            answers = [f.result(timeout=120) for f in early + late]
            print(f"served {time.monotonic() - restarted_at:.1f} s after the restart")
            continued = g.metric('outcome="continued",reason="hang"')
            retried = g.status()["retried_total"]
        finally:
            g.stop()
    expected = " tok" * TOKENS
    for a in answers:
        assert a["text"] == expected, (len(a["text"]), a["finish"])
        assert a["finish"] == "length"
        assert a["usage"]["completion_tokens"] == TOKENS
    for a in (answers[0], answers[1], answers[3]):  # the streams: one id, one [DONE]
        assert a["done"] and len(a["ids"]) == 1, a["ids"]
    # A stream with text before the gate took it back is continued; what had nothing (the
    # unary requests, the late stream; an early one on a machine too busy to send it in time)
    # is sent again whole.
    had_text = sum(
        1 for a in (answers[0], answers[1]) if a["first_text_at"] is not None
        and a["first_text_at"] < taken_back_at
    )  # fmt: skip
    assert had_text >= 1, answers[:2]
    assert continued.endswith(f" {had_text:.1f}"), (continued, had_text)
    assert taken_back >= 3 and retried == taken_back - had_text, (taken_back, retried, had_text)


def test_a_restarts_aborted_answers_are_continued_or_sent_again(
    tmp_path: Path, free_port: int, twins: list[TwinProc]
) -> None:
    """vLLM shutting down (the guardian's restart: SIGTERM, ``--shutdown-timeout 0``) answers
    what it aborts with HTTP 200 and ``finish_reason: "abort"``. Through the gate, two streams
    generating and a unary request in flight at the SIGTERM each get their whole answer from
    the restarted twin: the streams continued, the unary request sent again; no client sees
    the abort. About 7 s: two twin starts (~2 s each), the SIGTERM after 300 of 3 × 4,000
    tokens, the rest on the restarted twin."""
    t0 = time.monotonic()
    # A 70B model's step: 4,000 tokens take ~6 s at 20 simulated seconds a second (the
    # SIGTERM comes well before, on a busy machine too); the restarted twin's model is fast.
    old = twin_on(tmp_path, free_port, "--sim-model", "llama-3-70b")
    twins.append(old)
    print(f"twin up {time.monotonic() - t0:.1f} s")
    lt = LoopThread("gate")
    gate = Gate(
        GateSettings(
            proxy=ProxySettings(upstream=old.url, keepalive_comment_seconds=0.5),
            listen_port=0,
            limits=Limits(max_wait_seconds=60.0, release_rate_per_second=0),
            poll_interval_seconds=0.05,
            suspect_seconds=0.2,
            stall_hold_seconds=0,
            shutdown_timeout_seconds=1.0,
        )
    )
    lt.run(gate.start())
    url = f"http://127.0.0.1:{gate.port}"

    def generated() -> float:
        text = requests.get(f"{old.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total{")
        )

    with ThreadPoolExecutor(4) as pool:
        try:
            texts = [threading.Event(), threading.Event()]
            futures = [pool.submit(stream, url, ABORTED_TOKENS, texts[0]),
                       pool.submit(stream, url, ABORTED_TOKENS, texts[1]),
                       pool.submit(unary, url, ABORTED_TOKENS)]  # fmt: skip
            # Both clients hold text (not only the twin's counter: on a busy host the gate's
            # relay may lag it), so the SIGTERM cuts streams that have started.
            wait_for(lambda: generated() >= 300 and all(e.is_set() for e in texts),
                     "300 tokens generated and text at every client",
                     seen=lambda: f"tokens generated: {generated()}, "
                                  f"clients with text: {[e.is_set() for e in texts]}")  # fmt: skip
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            stopped_at = time.monotonic()
            print(f"generating {time.monotonic() - t0:.1f} s")
            stop(old)  # SIGTERM: the twin answers what it aborts, then exits
            print(f"stopped {time.monotonic() - t0:.1f} s")
            twins.append(twin_on(tmp_path, free_port))
            print(f"restarted {time.monotonic() - t0:.1f} s")
            answers = [f.result(timeout=120) for f in futures]
            print(f"served {time.monotonic() - t0:.1f} s")
            text = requests.get(f"{url}/metrics", timeout=10).text
        finally:
            lt.run(gate.stop())
            lt.close()
    expected = " tok" * ABORTED_TOKENS
    for a in answers:
        assert (len(a["text"]), a["finish"]) == (len(expected), "length")
        assert a["text"] == expected and a["usage"]["completion_tokens"] == ABORTED_TOKENS
    for a in answers[:2]:
        assert a["done"] and len(a["ids"]) == 1, a["ids"]
        assert a["first_text_at"] is not None and a["first_text_at"] < stopped_at
    assert 'continuations_total{outcome="continued",reason="abort",service="vllm"} 2.0' in text
    assert 'upstream_errors_total{phase="aborted",service="vllm"} 1.0' in text
