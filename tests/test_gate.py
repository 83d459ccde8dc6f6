"""The admission gate against a scriptable upstream stub: pass-through, holds, overflow answers,
retries, disconnects, hostile input. Each case has a defined answer, and after each one the
gate holds nothing: no open exchange, no queued or in-flight request, no upstream handler left
running; at the end no task and no file descriptor survives the gate."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for
from tests.test_gate_support import GateThread, LoopThread, Stub, dechunk
from vllm_guardian.gate.admission import MAX_PROMPT_DEPTH, Cost, estimate_cost


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gate_env(stub: Stub) -> Iterator[GateThread]:
    """One gate for the module (the stub doubles as the guardian), checked for leaks at the end."""
    before = fds()
    g = GateThread(
        stub.url, guardian=stub.url, max_queue_requests=4, max_wait_seconds=1.5,
        release_rate_per_second=0, per_key_share_ratio=0.5, kv_admission=False,
        proxy={"trust_key_header": True},  # each Authorization value is a client here
    )  # fmt: skip
    baseline_tasks = {t.get_name() for t in g.lt.tasks()}
    yield g

    def leftover() -> set[str]:
        return {repr(t.get_coro()) for t in g.lt.tasks() if t.get_name() not in baseline_tasks}

    # A client's connection may still be closing: wait for it, then say what is left.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not leftover(), "the clients' tasks gone", timeout_seconds=30)
    left = leftover()
    g.stop()
    assert left == set(), left
    wait_for(lambda: fds() <= before, "fds() <= before", seen=lambda: (fds(), before))


@pytest.fixture
def gate(gate_env: GateThread, stub: Stub) -> Iterator[GateThread]:
    stub.reset()
    wait_for(
        lambda: gate_env.gate.admission is not None and gate_env.gate.admission.open,
        "gate_env.gate.admission is not None and gate_env.gate.admission.open",
    )
    yield gate_env
    stub.set_release()
    proxy, adm = gate_env.gate.proxy, gate_env.gate.admission
    assert proxy is not None and adm is not None
    wait_for(
        lambda: proxy.open_exchanges == 0 and adm.in_flight == 0 and adm.queue_depth == 0,
        "no exchange, request or queued request left",
        seen=proxy.status,
    )
    wait_for(lambda: stub.active == 0, "no upstream request left running", seen=lambda: stub.active)
    stub.healthy = stub.ready = True
    wait_for(lambda: adm.open, "adm.open")


def close_gate(g: GateThread, stub: Stub) -> None:
    stub.ready = False
    assert g.gate.admission is not None
    wait_for(lambda: not g.gate.admission.open, "not g.gate.admission.open")  # type: ignore[union-attr]


def error_of(r: requests.Response) -> dict:  # type: ignore[type-arg]
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == r.status_code
    return body["error"]  # type: ignore[no-any-return]


# --- pass-through ------------------------------------------------------------------------------


def test_sse_bytes_pass_through_chunk_by_chunk(gate: GateThread, stub: Stub):
    direct = requests.post(f"{stub.url}/v1/sse?n=20", data=b"{}", timeout=5).content
    through = requests.post(f"{gate.url}/v1/sse?n=20", data=b"{}", timeout=5).content
    assert through == direct
    # Not buffered: the first event reaches the client while the upstream holds the rest back
    # (until released); a gate that buffered would never hand it over (the read timeout fails).
    with requests.post(f"{gate.url}/v1/sse?n=10&hold=1", data=b"{}", stream=True, timeout=30) as r:
        chunks = r.iter_content(chunk_size=None)
        first = next(chunks)
        assert not stub.release.is_set(), "the upstream was released before the first event"
        stub.set_release()
        rest = b"".join(chunks)
    assert first.startswith(b'data: {"i": 0'), first[:80]
    assert b'data: {"i": 9' in first + rest
    assert rest.endswith(b"data: [DONE]\n\n")


def test_headers_and_authorization_pass_hop_by_hop_do_not(gate: GateThread, stub: Stub):
    r = requests.post(
        f"{gate.url}/v1/echo?x=1&y=%20z",
        data=b'{"prompt": "hi"}',
        headers={
            "Authorization": "Bearer sk-secret",
            "Content-Type": "application/json",
            "X-Custom": "kept",
            # A client may not use Connection to strip Authorization on its way upstream.
            "Connection": "keep-alive, Authorization, X-Custom",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic eA==",
            "TE": "trailers",
        },
        timeout=5,
    )
    assert r.status_code == 200
    got = {k.lower(): v for k, v in r.json()["headers"]}
    assert got["authorization"] == "Bearer sk-secret"
    assert got["x-custom"] == "kept"
    assert got["content-type"] == "application/json"
    for hop in ("keep-alive", "proxy-authorization", "te"):
        assert hop not in got
    assert got["host"] == f"127.0.0.1:{stub.port}"
    assert r.json()["path_qs"] == "/v1/echo?x=1&y=%20z"


def test_upstream_errors_pass_untouched(gate: GateThread, stub: Stub):
    direct = requests.post(f"{stub.url}/v1/error", data=b"{}", timeout=5)
    through = requests.post(f"{gate.url}/v1/error", data=b"{}", timeout=5)
    assert (through.status_code, through.content) == (400, direct.content)
    assert through.headers["X-Vllm"] == "1"
    missing = requests.get(f"{gate.url}/nope", timeout=5)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}


def test_header_injection_attempts_get_400_and_reach_nothing(gate: GateThread, stub: Stub):
    attempts = [
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nX-A: a\rX-Injected: b\r\nContent-Length: 0\r\n\r\n",
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nX-A: a\nb: c\x00\r\nContent-Length: 0\r\n\r\n",
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\nab",
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\n folded: header\r\nContent-Length: 0\r\n\r\n",
    ]
    for raw in attempts:
        with socket.create_connection(("127.0.0.1", gate.gate.port), timeout=5) as s:
            s.sendall(raw)
            answer = s.recv(65536)
        assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400"), (raw, answer[:200])
    assert stub.calls.get("/v1/echo", 0) == 0


def test_body_over_the_limit_gets_413_before_it_is_read(gate: GateThread, stub: Stub):
    big = b"x" * (50 * 1024 * 1024)
    r = requests.post(f"{gate.url}/v1/completions", data=big, timeout=30)
    assert r.status_code == 413
    assert error_of(r)["type"] == "BadRequestError"
    assert stub.calls.get("/v1/completions", 0) == 0
    # Chunked (no Content-Length): cut off while reading.
    r = requests.post(f"{gate.url}/v1/completions", data=iter([big[: 1 << 20]] * 12), timeout=30)
    assert r.status_code == 413
    # Under the limit, the body arrives whole.
    mid = os.urandom(5 * 1024 * 1024)
    r = requests.post(f"{gate.url}/v1/echo", data=mid, timeout=30)
    assert r.json()["body_bytes"] == len(mid)


def _read_head(s: socket.socket) -> bytes:
    """Bytes up to and including the first blank line (a head), read as they come."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_client_that_expects_100_continue_is_told_to_send_its_body(gate: GateThread, stub: Stub):
    """RFC 9110 §10.1.1: the gate answers "100 Continue" before it waits for the body, so a
    client that asks (libcurl with a large body, PHP's curl) sends it at once, not after its
    own wait (curl's: 1 s a request). The Expect header does not go upstream."""
    body = json.dumps({"prompt": "x" * 5000}).encode()
    head = (
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", gate.gate.port), timeout=30) as s:
        s.sendall(head)
        interim = _read_head(s)  # the body is not sent until this arrives
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), interim[:200]
        s.sendall(body)
        answer = interim.split(b"\r\n\r\n", 1)[1] + _read_head(s)
        while not answer.rstrip().endswith(b"}"):
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    echoed = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert echoed["body_bytes"] == len(body), echoed
    assert "expect" not in {k.lower() for k, _ in echoed["headers"]}, echoed["headers"]


def test_a_client_that_expects_100_continue_and_leaves_is_no_error_of_the_gates(
    gate: GateThread, stub: Stub, caplog: pytest.LogCaptureFixture
):
    """A client gone before the gate's "100 Continue" reaches it is a client gone, as one that
    leaves while sending its body: no traceback, no exchange left."""
    caplog.set_level(logging.WARNING)
    head = (
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n"
    )
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", gate.gate.port), timeout=30)
        s.sendall(head)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        s.close()
    proxy = gate.gate.proxy
    assert proxy is not None
    wait_for(
        lambda: proxy.open_exchanges == 0, "no exchange left", seen=lambda: proxy.open_exchanges
    )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors[:3]


def test_pipelined_requests_are_answered_in_order_on_their_connection(gate: GateThread, stub: Stub):
    """RFC 9112 §9.3.2: requests a client sends without waiting for the answers get them in
    the order it sent them, on the same connection."""
    bodies = [b"a" * 10, b"b" * 2000, b"c" * 300]
    raw = b"".join(
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(b), b)
        for b in bodies
    )
    answers: list[dict[str, object]] = []
    with socket.create_connection(("127.0.0.1", gate.gate.port), timeout=30) as s:
        s.sendall(raw)  # all three at once
        data = b""
        while len(answers) < len(bodies):
            head_end = data.find(b"\r\n\r\n")
            length = (
                re.search(rb"(?i)content-length: *(\d+)", data[:head_end])
                if head_end >= 0
                else None
            )
            if length is not None and len(data) >= head_end + 4 + int(length[1]):
                end = head_end + 4 + int(length[1])
                assert data.startswith(b"HTTP/1.1 200"), data[:200]
                answers.append(json.loads(data[head_end + 4 : end]))
                data = data[end:]
                continue
            chunk = s.recv(65536)
            assert chunk, (answers, data[:300])
            data += chunk
    assert [a["body_bytes"] for a in answers] == [len(b) for b in bodies], answers


def test_a_body_too_large_is_refused_before_the_client_is_told_to_send_it(
    gate: GateThread, stub: Stub
):
    """An Expect whose body is over the limit gets the 413 at once, and no 100."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % (50 * 1024 * 1024)
    )
    with socket.create_connection(("127.0.0.1", gate.gate.port), timeout=30) as s:
        s.sendall(head)
        answer = _read_head(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert stub.calls.get("/v1/completions", 0) == 0


# --- holding and overflow ----------------------------------------------------------------------


def test_held_while_closed_then_released_in_order(gate: GateThread, stub: Stub):
    close_gate(gate, stub)
    order: list[int] = []

    def send(i: int) -> int:
        r = requests.post(f"{gate.url}/v1/echo", data=json.dumps({"i": i}), timeout=10,
                          headers={"Authorization": f"key-{i}"})  # fmt: skip
        order.append(i)
        return r.status_code

    with ThreadPoolExecutor(4) as pool:
        futs = []
        for i in range(3):
            futs.append(pool.submit(send, i))
            wait_for(
                lambda i=i: gate.gate.admission.queue_depth == i + 1,
                "gate.gate.admission.queue_depth == i + 1",
            )  # type: ignore[union-attr]
        assert stub.calls.get("/v1/echo", 0) == 0
        stub.ready = True
        assert [f.result() for f in futs] == [200, 200, 200]
    assert stub.calls["/v1/echo"] == 3


def test_queue_full_and_per_key_limit(gate: GateThread, stub: Stub):
    overflow_the_queue(gate, stub)


def overflow_the_queue(gate: GateThread, stub: Stub) -> None:
    """One 429 (a key over its share) and one 503 (the queue full), then every held one served."""
    close_gate(gate, stub)
    with ThreadPoolExecutor(8) as pool:
        same_key = [
            pool.submit(requests.post, f"{gate.url}/v1/echo", data=b"{}", timeout=10,
                        headers={"Authorization": "heavy"})
            for _ in range(2)
        ]  # fmt: skip
        wait_for(
            lambda: gate.gate.admission.queue_depth == 2, "gate.gate.admission.queue_depth == 2"
        )  # type: ignore[union-attr]
        # A third from the same key: over its share (half of a 4-deep queue) → 429.
        r = requests.post(
            f"{gate.url}/v1/echo", data=b"{}", headers={"Authorization": "heavy"}, timeout=5
        )
        assert r.status_code == 429 and error_of(r)["type"] == "RateLimitError"
        assert r.headers["Retry-After"] == "2"
        others = [
            pool.submit(requests.post, f"{gate.url}/v1/echo", data=b"{}", timeout=10,
                        headers={"Authorization": f"light-{i}"})
            for i in range(2)
        ]  # fmt: skip
        wait_for(
            lambda: gate.gate.admission.queue_depth == 4, "gate.gate.admission.queue_depth == 4"
        )  # type: ignore[union-attr]
        r = requests.post(f"{gate.url}/v1/echo", data=b"{}", timeout=5)
        assert r.status_code == 503 and "queue is full" in error_of(r)["message"]
        assert r.headers["Retry-After"] == "2"
        stub.ready = True
        assert [f.result().status_code for f in same_key + others] == [200] * 4


def _closures(g: GateThread, opening: bool = False) -> list[str]:
    """Every reason the gate closes for from now on (``opening``: opens for), a spy on the
    admission's state."""
    adm = g.gate.admission
    assert adm is not None
    seen: list[str] = []
    real = adm.set_state

    def spy(open_: bool, reason: str) -> None:
        if open_ is opening and adm.open is not opening:
            seen.append(reason)
        real(open_, reason)

    adm.set_state = spy  # type: ignore[method-assign]
    return seen


def ten_more_polls(stub: Stub, path: str) -> None:
    """Wait for the gate to poll ``path`` ten more times (a slow answer among them)."""
    before = stub.calls.get(path, 0)
    wait_for(
        lambda: stub.calls.get(path, 0) >= before + 10,
        f"ten more polls of {path}",
        timeout_seconds=30,
        seen=lambda: stub.calls,
    )


@pytest.mark.python_only
def test_one_slow_health_answer_does_not_close_the_gate(gate: GateThread, stub: Stub):
    # vLLM answers /health on the event loop that serves the requests: busy, it answers late.
    # Past the poll's 1 s timeout, once, while the requests still pass: no reason to hold them.
    closures = _closures(gate)
    try:
        stub.health_delay_seconds, stub.slow_health_answers = 1.5, 1
        ten_more_polls(stub, "/health")
        assert stub.slow_health_answers == 0
        assert closures == [], closures
        assert requests.post(f"{gate.url}/v1/echo", data=b"{}", timeout=10).status_code == 200
    finally:
        del gate.gate.admission.set_state  # type: ignore[union-attr]


@pytest.mark.python_only
def test_a_silent_health_closes_the_gate_after_the_grace(gate: GateThread, stub: Stub):
    closures = _closures(gate)
    grace = gate.settings.health_grace_seconds
    try:
        stub.health_delay_seconds, stub.slow_health_answers = 1.5, 10_000
        silent_from = time.monotonic()
        wait_for(lambda: bool(closures), "the gate closed", timeout_seconds=grace + 30)
        waited = time.monotonic() - silent_from
        assert waited >= grace, (waited, closures)  # never sooner than the grace
        assert len(closures) == 1 and "silent for" in closures[0], closures
        assert "within 1 s" in closures[0], closures
    finally:
        stub.slow_health_answers = 0
        del gate.gate.admission.set_state  # type: ignore[union-attr]
    wait_for(lambda: gate.gate.admission.open, "gate.gate.admission.open", timeout_seconds=30)  # type: ignore[union-attr]


@pytest.mark.python_only
def test_a_silent_health_while_vllm_streams_answers_is_not_silence(gate: GateThread, stub: Stub):
    """vLLM answers /health on the loop that writes its answers: overloaded, it answers late,
    while the answers under way go on arriving. That is a busy server, not a silent one: the
    gate holds nobody for it. Once the answers stop too, the grace runs as before."""
    closures = _closures(gate)
    grace = gate.settings.health_grace_seconds
    try:
        with ThreadPoolExecutor(1) as pool:
            # 16 s of events, one every 0.1 s: longer than twice the grace.
            stream = pool.submit(
                requests.post, f"{gate.url}/v1/sse?n=160&delay=0.1", data=b"{}", timeout=60
            )
            wait_for(lambda: stub.active == 1, "the stream under way", timeout_seconds=30)
            stub.health_delay_seconds, stub.slow_health_answers = 1.5, 10_000
            silent_from = time.monotonic()
            wait_for(
                lambda: time.monotonic() - silent_from > 2 * grace or stream.done(),
                "twice the grace of silence",
                timeout_seconds=60,
            )
            assert not stream.done(), "the stream ended before the silence outlasted the grace"
            assert closures == [], closures
            assert stream.result().status_code == 200
        # The answers have stopped: the silence is silence now.
        wait_for(lambda: bool(closures), "the gate closed", timeout_seconds=grace + 30)
        assert "silent for" in closures[0], closures
    finally:
        stub.slow_health_answers = 0
        del gate.gate.admission.set_state  # type: ignore[union-attr]
    wait_for(lambda: gate.gate.admission.open, "gate.gate.admission.open", timeout_seconds=30)  # type: ignore[union-attr]


@pytest.mark.python_only
def test_one_slow_ready_answer_from_the_guardian_does_not_open_a_closed_gate(
    gate: GateThread, stub: Stub
):
    # The guardian answers /ready between its ticks: busy, it answers late. While it holds
    # new requests (a drain before a restart, KV above the watermark), one answer past the
    # poll's 1 s timeout is no reason to let them into vLLM.
    close_gate(gate, stub)
    openings = _closures(gate, opening=True)
    try:
        stub.ready_delay_seconds, stub.slow_ready_answers = 1.5, 1
        ten_more_polls(stub, "/ready/vllm")
        assert stub.slow_ready_answers == 0
        assert openings == [], openings
        assert not gate.gate.admission.open  # type: ignore[union-attr]
    finally:
        del gate.gate.admission.set_state  # type: ignore[union-attr]
        stub.ready = True
    wait_for(lambda: gate.gate.admission.open, "gate.gate.admission.open", timeout_seconds=30)  # type: ignore[union-attr]


@pytest.mark.python_only
def test_a_silent_guardian_counts_as_gone_after_the_grace(gate: GateThread, stub: Stub):
    # A guardian that stays silent is treated as one that is gone (the service keeps serving
    # on vLLM's own health, as without a guardian), but never sooner than the grace.
    close_gate(gate, stub)
    openings = _closures(gate, opening=True)
    grace = gate.settings.health_grace_seconds
    try:
        stub.ready_delay_seconds, stub.slow_ready_answers = 1.5, 10_000
        silent_from = time.monotonic()
        wait_for(lambda: bool(openings), "the gate open", timeout_seconds=grace + 30)
        waited = time.monotonic() - silent_from
        assert waited >= grace, (waited, openings)
        assert openings == ["open"], openings
    finally:
        stub.slow_ready_answers = 0
        stub.ready = True
        del gate.gate.admission.set_state  # type: ignore[union-attr]
    wait_for(lambda: gate.gate.admission.open, "gate.gate.admission.open", timeout_seconds=30)  # type: ignore[union-attr]


@pytest.mark.python_only
def test_a_failing_health_answer_closes_the_gate_without_grace(gate: GateThread, stub: Stub):
    closures = _closures(gate)
    try:
        stub.healthy = False  # 503: vLLM says it is not healthy; no grace for a clear answer
        wait_for(lambda: bool(closures), "the gate closed", timeout_seconds=30)
        assert closures == ["vLLM /health answers 503"], closures
    finally:
        del gate.gate.admission.set_state  # type: ignore[union-attr]


def test_upstream_down_longer_than_the_wait_limit(gate: GateThread, stub: Stub):
    stub.healthy = False
    wait_for(lambda: not gate.gate.admission.open, "not gate.gate.admission.open")  # type: ignore[union-attr]
    start = time.monotonic()
    r = requests.post(f"{gate.url}/v1/echo", data=b"{}", timeout=30)
    waited = time.monotonic() - start
    print(f"answered 503 after {waited:.2f} s")
    assert r.status_code == 503 and r.headers["Retry-After"] == "2"
    assert error_of(r)["type"] == "ServiceUnavailableError"
    assert "within 1.5 s" in error_of(r)["message"]
    # Held for the whole wait limit, never less (a load can only lengthen it); that it then
    # answers at all, not hold on past it, is the 503 above within the client's timeout.
    assert waited >= 1.4, waited
    assert stub.calls.get("/v1/echo", 0) == 0
    # GETs are not held: they say what vLLM says.
    assert requests.get(f"{gate.url}/health", timeout=5).status_code == 503


# --- the upstream dies ---------------------------------------------------------------------------


def test_no_byte_from_a_dying_upstream_is_retried_once(gate: GateThread, stub: Stub):
    upstream_dies_before_a_byte_twice(gate, stub)


def upstream_dies_before_a_byte_twice(gate: GateThread, stub: Stub) -> None:
    """Two retries: one that then succeeds, one that then fails with the gate's own 502."""
    r = requests.post(f"{gate.url}/v1/dying_500", data=b"{}", timeout=10)
    assert r.status_code == 200 and r.json() == {"ok": True, "call": 2}
    # A connection cut before any byte: retried once, then the gate's own 502. A send that
    # went out on a kept connection was first sent again at once on a new one (the upstream's
    # keep-alive timer may have closed it): that one try more is counted, not a retry.
    stale_before = gate.gate.metrics.total("upstream_stale_connections")
    r = requests.post(f"{gate.url}/v1/die_before", data=b"{}", timeout=10)
    stale = gate.gate.metrics.total("upstream_stale_connections") - stale_before
    assert stale in (0, 1, 2)
    assert stub.calls["/v1/die_before"] == 2 + stale
    assert r.status_code == 502 and error_of(r)["type"] == "BadGatewayError"


@pytest.mark.python_only
def test_a_hold_on_a_broken_exchange_says_how_it_broke(gate: GateThread, stub: Stub):
    """The reason (in the log and /gate/status) names the phase and the error: a refused or
    timed-out connect, a cut before the answer, tell an operator different things."""
    seen = _closures(gate)
    requests.post(f"{gate.url}/v1/die_before", data=b"{}", timeout=10)
    assert any(r.startswith("the upstream broke an exchange (before_first_byte: ") for r in seen), (
        seen
    )


def test_a_started_stream_is_never_replayed(gate: GateThread, stub: Stub):
    with requests.post(f"{gate.url}/v1/die_mid", data=b"{}", stream=True, timeout=10) as r:
        assert r.status_code == 200
        chunks = r.iter_content(chunk_size=None)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            b"".join(chunks)
    assert stub.calls["/v1/die_mid"] == 1


# --- the client goes away --------------------------------------------------------------------------


def test_client_disconnect_while_queued_leaves_the_queue(gate: GateThread, stub: Stub):
    close_gate(gate, stub)
    s = socket.create_connection(("127.0.0.1", gate.gate.port), timeout=5)
    s.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    wait_for(lambda: gate.gate.admission.queue_depth == 1, "gate.gate.admission.queue_depth == 1")  # type: ignore[union-attr]
    s.close()
    wait_for(lambda: gate.gate.admission.queue_depth == 0, "gate.gate.admission.queue_depth == 0")  # type: ignore[union-attr]
    stub.ready = True
    # Never sent: a request after it, sent once the gate is open again, is the only one that
    # reaches the upstream (not a fixed sleep, then a look).
    wait_for(lambda: gate.gate.admission.open, "gate.gate.admission.open")  # type: ignore[union-attr]
    r = requests.post(f"{gate.url}/v1/echo", data=b"{}", timeout=10)
    assert r.status_code == 200
    assert stub.calls.get("/v1/echo", 0) == 1, stub.calls


def test_client_disconnect_while_streaming_aborts_upstream(gate: GateThread, stub: Stub):
    s = socket.create_connection(("127.0.0.1", gate.gate.port), timeout=5)
    s.sendall(b"POST /v1/sse?n=200&delay=0.05 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    wait_for(lambda: stub.active == 1, "stub.active == 1")
    s.close()
    wait_for(
        lambda: stub.disconnects == 1 and stub.active == 0,
        "the upstream request cancelled (else vLLM would keep generating)",
    )


def test_client_disconnect_before_any_answer_aborts_upstream(gate: GateThread, stub: Stub):
    """A unary request still in vLLM (no byte of its answer yet) whose client leaves (its
    timeout): vLLM must learn it, or it goes on generating for nobody."""
    s = socket.create_connection(("127.0.0.1", gate.gate.port), timeout=5)
    s.sendall(b"POST /v1/hold HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    wait_for(lambda: stub.active == 1, "stub.active == 1")
    s.close()
    wait_for(
        lambda: stub.disconnects == 1 and stub.active == 0,
        "the upstream request cancelled (else vLLM would keep generating)",
        seen=lambda: (stub.disconnects, stub.active),
    )


def test_slow_client_gets_everything(gate: GateThread, stub: Stub):
    direct = requests.post(f"{stub.url}/v1/sse?n=2000", data=b"{}", timeout=10).content
    s = socket.create_connection(("127.0.0.1", gate.gate.port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    s.sendall(
        b"POST /v1/sse?n=2000 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    got = bytearray()
    for i in range(100_000):
        chunk = s.recv(16384)
        if not chunk:
            break
        got += chunk
        if i < 20:
            time.sleep(0.02)  # slow at first: the gate must wait, not buffer or drop
    s.close()
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert hashlib.sha256(dechunk(body)).digest() == hashlib.sha256(direct).digest()


def _gate_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_count_what_happened(gate: GateThread, stub: Stub):
    # Self-contained: what this test makes happen, counted as the difference from before it
    # (the gate is shared by the module; the tests before it, if any ran, counted too).
    before = _gate_samples(requests.get(f"{gate.url}/metrics", timeout=5).text)
    overflow_the_queue(gate, stub)
    stub.reset()
    upstream_dies_before_a_byte_twice(gate, stub)
    text = requests.get(f"{gate.url}/metrics", timeout=5).text
    for name in ("open", "queue_depth", "queued_tokens", "in_flight", "wait_seconds_bucket",
                 "overhead_seconds_bucket", "admitted_total", "held_total", "rejected_total",
                 "retried_total", "kv_committed_tokens"):  # fmt: skip
        assert f"vllm_guardian_gate_{name}" in text, name
    after = _gate_samples(text)

    def counted(name: str, **labels: str) -> float:
        key = (f"vllm_guardian_gate_{name}", frozenset({"service": "vllm", **labels}.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert counted("rejected_total", reason="queue_full") == 1.0, (before, after)
    assert counted("rejected_total", reason="per_key_limit") == 1.0, (before, after)
    assert counted("retried_total") == 2.0, (before, after)


# --- the estimate (pure) -----------------------------------------------------------------------------


def test_cost_estimate():
    assert estimate_cost(b'{"prompt": "a b c", "max_tokens": 10}', 256) == Cost(3, 10)
    assert estimate_cost(b'{"prompt": [1, 2, 3, 4], "n": 2, "max_tokens": 5}', 256) == Cost(4, 10)
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_completion_tokens": 7}
    assert estimate_cost(json.dumps(chat).encode(), 256) == Cost(4 + 3 + 2, 7)
    assert estimate_cost(b'{"prompt": "x"}', 256).output_tokens == 256
    assert estimate_cost(b"not json at all", 256).output_tokens == 0
    long_word = "y" * 400
    assert estimate_cost(json.dumps({"prompt": long_word}).encode(), 0).prompt_tokens == 100
    # A lone surrogate is valid JSON and no UTF-8: counted as the bytes its escape stands for,
    # not an exception (which was the client's 500).
    lone = b'{"prompt": "a \\ud800 b", "messages": [{"content": "\\udfff"}]}'
    assert estimate_cost(lone, 0).prompt_tokens == 3 + (4 + 1 + 2)  # words; role, 3 bytes; chat


@pytest.mark.parametrize(
    ("levels", "read"),
    [(1, True), (2, True), (MAX_PROMPT_DEPTH, True), (MAX_PROMPT_DEPTH + 1, False), (900, False)],
)
def test_a_prompt_is_walked_to_a_bounded_depth_not_to_the_recursion_limit(
    levels: int, read: bool
) -> None:
    """Lists around a prompt's text past MAX_PROMPT_DEPTH are no prompt vLLM reads: the walk
    stops there (the proxy answers 400) instead of at the interpreter's recursion limit, which
    code compiled to C does not meet."""
    body = ('{"prompt": ' + "[" * levels + '"a b"' + "]" * levels + "}").encode()
    if read:
        assert estimate_cost(body, 0).prompt_tokens == 2
    else:
        with pytest.raises(RecursionError):
            estimate_cost(body, 0)


def test_a_prompt_no_utf_8_can_carry_is_forwarded_not_a_500(gate: GateThread, stub: Stub):
    r = requests.post(
        f"{gate.url}/v1/echo",
        data=b'{"prompt": "\\ud800", "max_tokens": 1}',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, (r.status_code, r.text[:300])
    assert r.json()["body_bytes"] == 37, r.text[:300]


# --- the harness ---------------------------------------------------------------------------------


def test_a_closed_loop_thread_leaves_no_coroutine_to_the_garbage_collector():
    """What a test leaves running on a LoopThread ends inside LoopThread.close, not later in
    whichever test the garbage collector happens to run in (an unraisable exception there)."""
    lt = LoopThread("harness")
    ended: list[str] = []

    async def never_started() -> None:
        ended.append("never_started")

    async def suspended() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("suspended")
            asyncio.get_running_loop().create_task(never_started())  # work scheduled as it ends

    async def start() -> None:
        asyncio.get_running_loop().create_task(suspended())
        await asyncio.sleep(0)

    lt.run(start())
    lt.close()
    assert ended == ["suspended", "never_started"], ended
    del lt
    gc.collect()  # an unraisable exception here fails this test (pyproject's filterwarnings)
