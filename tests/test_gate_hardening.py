"""The gate under hostile clients and a hostile upstream.

Real gates on 127.0.0.1 in front of the scriptable stub (tests/test_gate_support.py) or a
hostile server (tests/hostile.py); real sockets that send half a request and wait.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import logging
import socket
import struct
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import aiohttp
import pytest
import requests

from tests.conftest import read_fixture
from tests.hostile import Hostility, hostile_server, idle_clients, partial_bodies, wait_for
from tests.test_gate_support import LoopThread, Stub
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.body import (
    BodyBudget,
    BodyLimits,
    BodyMalformed,
    BodyRefused,
    NoRoom,
    read_body,
)
from vllm_guardian.gate.follower import METRICS_MAX_BYTES
from vllm_guardian.gate.http1 import BodyError
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings


class Running:
    def __init__(
        self, upstream: str, proxy: dict[str, object] | None = None, **settings: object
    ) -> None:
        self.lt = LoopThread("gate")
        base = GateSettings(
            proxy=replace(ProxySettings(upstream=upstream), **(proxy or {})),  # type: ignore[arg-type]
            listen_port=0,
            poll_interval_seconds=0.05,
            kv_poll_interval_seconds=3600,  # the tests call poll_kv themselves
            shutdown_timeout_seconds=1.0,
        )
        self.gate = Gate(replace(base, **settings))  # type: ignore[arg-type]
        self.lt.run(self.gate.start())
        self.url = f"http://127.0.0.1:{self.gate.port}"

    def closed(self, reason: str) -> float:
        return (
            self.gate.metrics.registry.get_sample_value(
                "vllm_guardian_gate_connections_closed_total", {"service": "vllm", "reason": reason}
            )
            or 0.0
        )

    def sample(self, name: str, **labels: str) -> float:
        value = self.gate.metrics.registry.get_sample_value(name, {"service": "vllm", **labels})
        return value or 0.0

    def stop(self) -> None:
        self.lt.run(self.gate.stop())
        self.lt.close()


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


def post_echo(url: str) -> requests.Response:
    return requests.post(url + "/v1/echo", json={"prompt": "hi", "max_tokens": 1}, timeout=60)


def gate_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Tracebacks logged by the gate (the stub upstream shares aiohttp's logger: not those)."""
    out = []
    for r in caplog.records:
        if r.exc_info:
            text = "".join(traceback.format_exception(*r.exc_info))  # type: ignore[misc]
            if "test_gate_support.py" not in text:
                out.append(f"{r.name}: {r.getMessage()}\n{text}")
    return out


HALF_POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_normal_post_is_served_while_hundreds_of_clients_sit_idle(stub: Stub):
    g = Running(stub.url, max_connections=32, idle_timeout_seconds=600)
    try:
        with idle_clients("127.0.0.1", g.gate.port, 300, head=HALF_POST):
            r = post_echo(g.url)  # during
            assert r.status_code == 200, r.text
            assert g.closed("evicted") >= 300 - 32, g.closed("evicted")
        assert post_echo(g.url).status_code == 200  # after
    finally:
        g.stop()


def test_the_gate_keeps_an_idle_connection_longer_than_clients_keep_theirs() -> None:
    """A server that closes a kept connection when its client's pool reuses it fails that
    request (a POST is not sent again): the closer must be the client. aiohttp's pool keeps a
    connection 15 s, the OpenAI SDK's (httpx) 5 s; the gate's deadline was 15 s, a race with
    every aiohttp client. It is also how long a client may take to send its head: a client
    starved of CPU for 15 s (seen on a saturated host) lost its request to the deadline."""

    async def aiohttp_keepalive() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return float(connector._keepalive_timeout)
        finally:
            await connector.close()

    clients = {"aiohttp": asyncio.run(aiohttp_keepalive()), "httpx (OpenAI SDK)": 5.0}
    idle = GateSettings(proxy=ProxySettings(upstream="http://127.0.0.1:1")).idle_timeout_seconds
    assert all(idle >= 4 * keep for keep in clients.values()), (idle, clients)


def test_an_idle_connection_is_closed_at_the_deadline(stub: Stub):
    g = Running(stub.url, idle_timeout_seconds=0.5)
    try:
        with idle_clients("127.0.0.1", g.gate.port, 1, head=HALF_POST) as (sock,):
            sock.settimeout(60)
            assert sock.recv(1024) == b""
        wait_for(lambda: (g.closed("idle_timeout") == 1, g.closed("idle_timeout")), "counted")
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()


ECHO_POST = (
    b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 33\r\n\r\n"
    b'{"prompt": "hi", "max_tokens": 1}'
)


@pytest.mark.parametrize(
    ("send", "kind"),
    [
        (b"", "no byte"),
        (HALF_POST, "part of a request head"),
        (ECHO_POST, "kept alive after an answer"),
    ],
    ids=["silent", "half-head", "kept-alive"],
)
def test_an_idle_close_says_what_the_connection_was_waiting_for(
    stub: Stub, caplog: pytest.LogCaptureFixture, send: bytes, kind: str
):
    """Closing a kept-alive connection loses nothing; one that never finished its head is a
    client (or a gate) that stalled for the whole deadline: the log tells them apart."""
    caplog.set_level(logging.DEBUG, "vllm_guardian.gate")
    g = Running(stub.url, idle_timeout_seconds=0.5)
    try:
        with socket.create_connection(("127.0.0.1", g.gate.port), timeout=60) as sock:
            if send:
                sock.sendall(send)
            if send is ECHO_POST:
                assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the answer"
            wait_for(lambda: (g.closed("idle_timeout") == 1, g.closed("idle_timeout")), "closed")
        lines = [
            r.getMessage() for r in caplog.records if "closed an idle connection" in r.getMessage()
        ]
        assert len(lines) == 1 and f"({kind})" in lines[0], lines
        assert f"{len(send)} byte(s) read" in lines[0], lines
    finally:
        g.stop()


@pytest.mark.parametrize("kept", [False, True], ids=["new connection", "kept connection"])
def test_a_request_that_arrived_while_the_gate_was_stalled_is_served_not_reaped(
    stub: Stub, kept: bool
):
    """A starved gate (a busy host) reads what arrived late. A request that came within the
    deadline is not idle, however late the gate gets to it: closing its connection then lost
    it (the client saw a reset; the real-engine overload lost requests so)."""
    g = Running(stub.url, idle_timeout_seconds=1.0)
    try:
        with socket.create_connection(("127.0.0.1", g.gate.port), timeout=60) as sock:
            body = b'{"prompt": "hi", "max_tokens": 1}'
            post = (
                b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            if kept:  # one exchange first: the connection is kept alive, then idle
                sock.sendall(post)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the first answer"
            conns = g.gate._server.guard._conns  # type: ignore[union-attr]
            wait_for(lambda: (len(conns) == 1, len(conns)), "the gate has the connection")
            # The gate's loop stalls past the deadline; the request arrives within it.
            g.lt.loop.call_soon_threadsafe(time.sleep, 2.5)
            time.sleep(0.5)
            sock.sendall(post)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert g.closed("idle_timeout") == 0
    finally:
        g.stop()


def test_a_head_dripped_a_byte_at_a_time_is_closed_at_the_idle_deadline(stub: Stub):
    # Bytes keep coming, but the head is never complete: the deadline counts from the connection's
    # start, not from its last byte (240 bytes at one per 50 ms could not finish in 0.5 s).
    g = Running(stub.url, idle_timeout_seconds=0.5)
    try:
        with partial_bodies("127.0.0.1", g.gate.port, 1, b"", HALF_POST * 3, 0.05) as (client,):
            wait_for(lambda: (client.closed.is_set(), client.answer[:200]), "the drip cut off")
        assert g.closed("idle_timeout") == 1
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()


def test_a_prompt_nested_900_deep_gets_400_not_a_traceback(
    stub: Stub, caplog: pytest.LogCaptureFixture
):
    g = Running(stub.url)
    try:
        deep = '{"prompt": ' + "[" * 900 + "1" + "]" * 900 + ', "max_tokens": 1}'
        with caplog.at_level(logging.DEBUG):
            r = requests.post(
                g.url + "/v1/completions",
                data=deep,
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
        assert r.status_code == 400, r.text
        assert "nested too deeply" in r.json()["error"]["message"]
        assert gate_tracebacks(caplog) == []
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()


@pytest.mark.parametrize(
    ("query", "reset"),
    [
        ("n=400&delay=0.005", True),
        ("n=400&delay=0.005", False),
        ("n=3000", True),
        ("n=3000", False),
    ],
    ids=["slow-reset", "slow-close", "fast-reset", "fast-close"],
)
def test_clients_leaving_mid_stream_leave_no_traceback(
    stub: Stub, caplog: pytest.LogCaptureFixture, query: str, reset: bool
):
    g = Running(stub.url)
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(10):
                s = socket.create_connection(("127.0.0.1", g.gate.port), timeout=60)
                s.sendall(
                    f"POST /v1/sse?{query} HTTP/1.1\r\nHost: x\r\n".encode()
                    + b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                )
                assert s.recv(4096)  # the stream has started
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # mid-stream
            wait_for(
                lambda: (g.gate.proxy is not None and g.gate.proxy.open_exchanges == 0, None),
                "every exchange finished",
            )
        assert gate_tracebacks(caplog) == []
    finally:
        g.stop()


def test_the_gate_reads_at_most_its_cap_of_an_endless_metrics_body(
    caplog: pytest.LogCaptureFixture,
):
    h = Hostility(mode="endless")
    with hostile_server(h) as url:
        # The poll's timeout (5 polls, at least 1 s) generous: the cap is 16 MiB, which a busy
        # host may not deliver within 1 s, and then the poll times out before it reaches it.
        g = Running(url, poll_interval_seconds=12.0)
        try:
            assert g.gate.follower is not None
            with caplog.at_level(logging.WARNING):
                g.lt.run(g.gate.follower.poll_kv(), timeout=120)
        finally:
            g.stop()
    read = max(h.served)  # what the server managed to send on the /metrics connection
    assert read < METRICS_MAX_BYTES + 16 * 1024 * 1024, read  # the cap plus socket buffers
    assert any("/metrics is over" in r.getMessage() for r in caplog.records)


def test_status_reports_the_connection_metrics(stub: Stub):
    g = Running(stub.url)
    try:
        text = requests.get(g.url + "/metrics", timeout=60).text
        assert 'vllm_guardian_gate_connections{service="vllm"}' in text
        assert json.loads(requests.get(g.url + "/gate/status", timeout=60).text)["service"]
    finally:
        g.stop()


def test_with_every_slot_busy_a_new_connection_is_closed_at_once(stub: Stub):
    stub.reset()
    g = Running(stub.url, max_connections=4, idle_timeout_seconds=600)
    busy: list[socket.socket] = []
    try:
        for _ in range(4):  # four requests held upstream: four busy connections
            s = socket.create_connection(("127.0.0.1", g.gate.port), timeout=60)
            busy.append(s)
            s.sendall(b"GET /v1/hold HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: (stub.active == 4, stub.active), "four requests held upstream")
        late = socket.create_connection(("127.0.0.1", g.gate.port), timeout=60)
        try:
            assert late.recv(1024) == b""  # closed at once, nothing else to close
        except ConnectionResetError:
            pass  # closed with a reset: the same
        finally:
            late.close()
        assert g.closed("over_cap") == 1
        stub.set_release()
        for s in busy:
            assert s.recv(1024).startswith(b"HTTP/1.1 200"), "the busy ones are answered"
    finally:
        for s in busy:
            s.close()
        g.stop()
        stub.reset()


def test_a_compressed_body_is_read_whole_after_its_content_length(stub: Stub) -> None:
    """aiohttp decompresses a request body (Content-Encoding: gzip), so more bytes come out
    than its Content-Length counts: all of them go upstream, not the first Content-Length."""
    doc = json.dumps({"model": "m", "prompt": "word " * 200}).encode()
    packed = gzip.compress(doc)
    assert len(packed) < len(doc)
    g = Running(stub.url)
    try:
        r = requests.post(
            f"{g.url}/v1/echo", data=packed, timeout=30,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["body_bytes"] == len(doc)
    finally:
        g.stop()


CHUNKED_HEAD = (
    b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
# (what the client sends at once, what it sends once the gate reads its body, the phase counted)
MALFORMED = [
    (b"GARBAGE\r\n\r\n", b"", "head"),
    (b"GET /gate/status HTTP/1.1\r\nHost x\r\n\r\n", b"", "head"),
    (b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", b"", "head"),
    (b"GET /gate/status HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b"", "head"),
    # A good request, then garbage on the same connection: the good one answered, then 400.
    (b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n", b"", "head"),
    (CHUNKED_HEAD, b"ZZ\r\n{}\r\n0\r\n\r\n", "body"),  # a chunk size that is not hex
    (
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: 10\r\n\r\nnot gzip !",
        b"",
        "body",
    ),
]


def test_malformed_requests_are_counted_and_logged_once_without_a_traceback(
    stub: Stub, caplog: pytest.LogCaptureFixture
):
    g = Running(stub.url, malformed_log_interval_seconds=3600.0)
    caplog.clear()  # what the gate logged as it started
    rounds = 5
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(rounds):
                for first, later, _phase in MALFORMED:
                    s = socket.create_connection(("127.0.0.1", g.gate.port), timeout=60)
                    try:
                        s.sendall(first)
                        if later:  # the head is read and the proxy reads the body: then the rest
                            wait_for(
                                lambda: (
                                    g.gate.proxy is not None and g.gate.proxy.open_exchanges == 1,
                                    None,
                                ),
                                "the body being read",
                            )
                            s.sendall(later)
                        answer = b""
                        while chunk := s.recv(65536):
                            answer += chunk
                    finally:
                        s.close()
                    last = answer[answer.rfind(b"HTTP/1.") :]  # the answer to the bad one
                    assert last.split(b" ", 2)[1:2] == [b"400"], answer[:300]
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()
    traced = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info]
    assert traced == [], traced
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "malformed" in loud[0], loud
    for phase in ("head", "body"):
        expected = rounds * sum(1 for *_, p in MALFORMED if p == phase)
        got = g.sample("vllm_guardian_gate_malformed_requests_total", phase=phase)
        assert got == expected, (phase, got, expected)


# --- request bodies: deadline, rate floor, the gate-wide budget ---------------------------------


def body_head(content_length: int) -> bytes:
    return (
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {content_length}\r\n\r\n".encode()
    )


def served(url: str, count: int) -> tuple[int, list[str]]:
    """How many of ``count`` normal POSTs got 200, and what the others got."""
    ok, other = 0, []
    for _ in range(count):
        try:
            r = post_echo(url)
        except requests.RequestException as e:
            other.append(type(e).__name__)
            continue
        if r.status_code == 200:
            ok += 1
        else:
            other.append(f"{r.status_code} {r.text[:100]}")
    return ok, other


def test_normal_requests_are_served_while_hundreds_of_bodies_never_come(stub: Stub):
    # Each attacker's head is complete and announces a body that never comes: the gate is
    # reading it, so the connection is not idle; at the cap it must still make room.
    g = Running(
        stub.url,
        proxy={"body_timeout_seconds": 600.0, "body_min_rate_bytes_per_second": 0},
        max_connections=32,
        idle_timeout_seconds=600,
    )
    try:
        with idle_clients("127.0.0.1", g.gate.port, 300, head=body_head(1000)):
            # The attack in place before the normal requests come: the 32 connections left are
            # each reading a body (1,000 bytes of the budget reserved apiece). Sent before the
            # gate had read the last heads, the normal requests were served even with a
            # body-reading connection counted as busy (the defect): it evicted ones whose head
            # was still unread.
            wait_for(
                lambda: (
                    g.sample("vllm_guardian_gate_body_bytes") == 32 * 1000
                    and g.sample("vllm_guardian_gate_connections") == 32,
                    (g.sample("vllm_guardian_gate_body_bytes"), g.closed("evicted")),
                ),
                "32 connections reading a body that never comes",
            )
            ok, other = served(g.url, 20)
            assert (ok, other) == (20, []), other
            assert g.closed("evicted") >= 300 - 32, g.closed("evicted")
    finally:
        g.stop()


@pytest.mark.parametrize(
    ("proxy", "drip_interval_seconds", "reason"),
    [
        # Ten bytes of a thousand, then nothing: the whole body is due within 1 s.
        ({"body_timeout_seconds": 1.0, "body_min_rate_bytes_per_second": 0}, None, "body_timeout"),
        # A byte every 50 ms (20 B/s) against a floor of 1,000 B/s per half-second window; the
        # deadline is far away, so only the floor can cut it.
        (
            {"body_timeout_seconds": 600.0, "body_min_rate_bytes_per_second": 1000,
             "body_rate_window_seconds": 0.5},
            0.05,
            "body_too_slow",
        ),
    ],
    ids=["deadline", "rate-floor"],
)  # fmt: skip
def test_a_body_too_slow_is_cut_with_408(
    stub: Stub, proxy: dict[str, object], drip_interval_seconds: float | None, reason: str
):
    g = Running(stub.url, proxy=proxy, idle_timeout_seconds=600)
    try:
        with partial_bodies(
            "127.0.0.1", g.gate.port, 1, body_head(1000), b"{" + b" " * 9, drip_interval_seconds
        ) as (client,):
            wait_for(lambda: (client.answered(), client.answer[:300]), "an answer")
        assert client.status == 408, client.answer[:300]
        assert b"\r\nConnection: close\r\n" in client.answer, client.answer[:300]
        assert client.error()["type"] == "RequestTimeoutError", client.error()
        for r in ("body_timeout", "body_too_slow"):
            want = 1.0 if r == reason else 0.0
            assert g.sample("vllm_guardian_gate_rejected_total", reason=r) == want, r
        wait_for(
            lambda: (
                g.sample("vllm_guardian_gate_body_bytes") == 0,
                g.sample("vllm_guardian_gate_body_bytes"),
            ),
            "the body's bytes given back",
        )
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()


def test_bodies_being_read_stay_within_the_gate_wide_budget(stub: Stub):
    budget = 1024 * 1024
    g = Running(
        stub.url,
        proxy={
            "max_body_bytes": 512 * 1024,
            "body_budget_bytes": budget,
            "body_budget_wait_seconds": 0.5,
            "body_timeout_seconds": 600.0,
            "body_min_rate_bytes_per_second": 0,
        },
        idle_timeout_seconds=600,
    )
    assert g.gate.proxy is not None
    bodies = g.gate.proxy.bodies
    try:
        # Ten clients each send 300 KiB of a 400 KiB body and stop: 3 MiB, three times the budget.
        with partial_bodies(
            "127.0.0.1", g.gate.port, 10, body_head(400 * 1024), b" " * (300 * 1024)
        ) as clients:
            wait_for(
                lambda: (g.sample("vllm_guardian_gate_rejected_total", reason="body_budget") >= 5,
                         (bodies.held_bytes, [c.status for c in clients])),
                "the budget refuses bodies past it",
            )  # fmt: skip
            assert bodies.held_bytes <= budget
            for c in clients:
                if c.closed.is_set() and c.status is not None:
                    assert c.status == 503 and "budget" in str(c.error()["message"]), c.answer
        assert budget / 2 <= bodies.peak_bytes <= budget, bodies.peak_bytes
        wait_for(lambda: (bodies.held_bytes == 0, bodies.held_bytes), "every body's bytes back")
        assert g.sample("vllm_guardian_gate_body_bytes") == 0
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()


class _StalledBody:
    """A request body that is all there when the gate reads it, behind a stall of the gate's own
    event loop (a busy host): the loop's clock moves past the rate window during the read."""

    def __init__(self, body: bytes, stall_seconds: float) -> None:
        self.parts = [body, b""]
        self.stall_seconds = stall_seconds

    async def read(self, n: int) -> bytes:
        time.sleep(self.stall_seconds)  # blocks the loop, as a busy host does
        part = self.parts[0][:n]
        self.parts[0] = self.parts[0][n:]
        if not self.parts[0]:
            self.parts.pop(0)
        return part

    def read_nowait(self, n: int) -> bytes:
        return b""  # nothing buffered: each read waits, as on a host that is behind

    def at_eof(self) -> bool:
        return False

    def feed_eof(self) -> None:
        pass


def test_a_body_that_has_all_arrived_is_never_too_slow():
    # Seen on the real engine at 24 requests a second on a loaded host: a 300-byte body, whole
    # in the gate's buffer, was cut with 408 body_too_slow because the loop's clock had passed
    # the rate window when the read returned. The floor cuts a body still trickling in, not
    # one that is complete.
    body = b'{"prompt": "' + b"x" * 280 + b'"}'
    limits = BodyLimits(timeout_seconds=30.0, min_rate_bytes_per_second=10_000,
                        rate_window_seconds=0.1)  # fmt: skip

    async def scenario() -> bytes:
        budget = BodyBudget(1024 * 1024, GateMetrics("vllm"))
        held = await read_body(_StalledBody(body, 0.3), len(body), limits, budget)  # type: ignore[arg-type]
        return bytes(held.data)

    assert asyncio.run(scenario()) == body


class _BufferedBody:
    """The server's request body as read_body sees it (http1.RequestBody): ``buffered`` already there (read_nowait),
    the rest by awaiting; or a broken body (``error``)."""

    def __init__(self, buffered: bytes, rest: bytes = b"", error: Exception | None = None):
        self.buffered, self.parts, self.error = buffered, [rest, b""] if rest else [b""], error
        self.awaited_reads = 0

    def read_nowait(self, n: int) -> bytes:
        if self.error is not None:
            raise self.error
        got, self.buffered = self.buffered[:n], self.buffered[n:]
        return got

    def at_eof(self) -> bool:
        return not self.buffered and self.parts == [b""]

    async def read(self, n: int) -> bytes:
        self.awaited_reads += 1
        part = self.parts[0][:n]
        self.parts[0] = self.parts[0][n:]
        if not self.parts[0]:
            self.parts.pop(0)
        return part


@pytest.mark.parametrize(
    ("buffered", "rest", "awaited_reads"),
    [
        (b'{"prompt": "hi"}', b"", 0),  # all there with the head: no await at all
        (b'{"prompt"', b': "hi"}', 2),  # the rest read as it comes, then the end
        (b"", b'{"prompt": "hi"}', 2),  # nothing yet
    ],
    ids=["whole", "part", "none"],
)
def test_a_small_body_is_taken_whole_from_the_buffer_and_held_in_the_budget(
    buffered: bytes, rest: bytes, awaited_reads: int
) -> None:
    async def scenario() -> tuple[bytes, int, int, int]:
        budget = BodyBudget(1024, GateMetrics("vllm"))
        stream = _BufferedBody(buffered, rest)
        held = await read_body(stream, len(buffered + rest), BodyLimits(), budget)  # type: ignore[arg-type]
        holding = budget.held_bytes
        held.release()
        return bytes(held.data), holding, budget.held_bytes, stream.awaited_reads

    body = buffered + rest
    assert asyncio.run(scenario()) == (body, len(body), 0, awaited_reads)


def test_a_small_body_finds_the_budget_full_and_waits_its_turn_then_is_refused():
    async def scenario() -> tuple[str, int]:
        budget = BodyBudget(100, GateMetrics("vllm"))
        await budget.take(90, 1)
        limits = BodyLimits(budget_wait_seconds=0.01)
        try:
            await read_body(_BufferedBody(b"x" * 20), 20, limits, budget)  # type: ignore[arg-type]
        except BodyRefused as e:
            return e.refusal.value, budget.held_bytes
        return "read", budget.held_bytes

    assert asyncio.run(scenario()) == ("body_budget", 90)


def test_a_broken_small_body_gives_its_budget_back():
    async def scenario() -> tuple[str, int]:
        budget = BodyBudget(1024, GateMetrics("vllm"))
        stream = _BufferedBody(b"", error=BodyError("bad chunk"))
        try:
            await read_body(stream, 20, BodyLimits(), budget)
        except BodyMalformed as e:
            return str(e), budget.held_bytes
        return "read", budget.held_bytes

    assert asyncio.run(scenario()) == ("bad chunk", 0)


def test_the_body_budget_grants_in_order_and_leaves_nothing_behind():
    async def scenario() -> list[object]:
        budget = BodyBudget(100, GateMetrics("vllm"))
        seen: list[object] = []
        assert await budget.take(80, 60) == 0.0
        b = asyncio.ensure_future(budget.take(50, 60))
        c = asyncio.ensure_future(budget.take(10, 60))  # fits, but waits behind b: first come
        await asyncio.sleep(0)
        seen.append((b.done(), c.done(), budget.held_bytes))
        budget.give(80)
        await asyncio.gather(b, c)
        seen.append(budget.held_bytes)
        try:  # no room, and none given back: refused after its wait
            await budget.take(41, 0.01)
        except NoRoom:
            seen.append("no room")
        d = asyncio.ensure_future(budget.take(41, 60))
        await asyncio.sleep(0)
        d.cancel()  # a client gone while it waited
        await asyncio.gather(d, return_exceptions=True)
        budget.give(60)
        seen.append((budget.held_bytes, budget.peak_bytes, len(budget._waiters)))
        return seen

    assert asyncio.run(scenario()) == [(False, False, 80), 60, "no room", (0, 80, 0)]


# --- fairness: who counts as one client ---------------------------------------------------------


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    "attacker_headers",
    [
        lambda i: {"Authorization": f"Bearer rotated-{i}"},  # a fresh key per request
        lambda i: {},  # no key at all
    ],
    ids=["rotating-authorization", "no-authorization"],
)
def test_an_attacker_rotating_keys_cannot_starve_a_known_key(stub: Stub, attacker_headers):
    victim = {"Authorization": "Bearer sk-victim"}
    g = Running(
        stub.url,
        proxy={"known_keys_sha256": frozenset({sha256_hex(victim["Authorization"])})},
        guardian=stub.url,
        limits=Limits(max_queue_requests=8, per_key_share_ratio=0.25, release_rate_per_second=0),
    )
    adm = g.gate.admission
    assert adm is not None

    def post(headers: dict[str, str]) -> int:
        r = requests.post(g.url + "/v1/echo", data=b"{}", headers=headers, timeout=120)
        return r.status_code

    try:
        stub.ready = False  # the guardian holds the service: everything queues
        wait_for(lambda: (not adm.open, adm.reason), "the gate closed")
        with ThreadPoolExecutor(12) as pool:
            attack = [pool.submit(post, attacker_headers(i)) for i in range(8)]
            wait_for(
                lambda: (sum(f.done() for f in attack) == 6 and adm.queue_depth == 2,
                         (adm.queue_depth, [f.result() for f in attack if f.done()])),
                "the attacker held to one share of the queue",
            )  # fmt: skip
            served = [pool.submit(post, victim) for _ in range(2)]
            wait_for(lambda: (adm.queue_depth == 4, adm.queue_depth), "the victim queued")
            stub.ready = True
            assert [f.result() for f in served] == [200, 200]
            assert sorted(f.result() for f in attack) == [200] * 2 + [429] * 6
    finally:
        stub.ready = True
        g.stop()


def test_a_metrics_page_is_read_whatever_the_server_would_compress() -> None:
    """The gate asks /metrics for no compression. prometheus_client's own exposition gzips the
    page for a client that accepts gzip; vLLM 0.32 serves its /metrics through
    prometheus_fastapi_instrumentator, which does not by default (checked on the real one:
    48 KB, no Content-Encoding, asked for gzip). The gate's aiohttp client used to ask for
    gzip and parse the bytes as they came: behind a server that compressed, the KV admission
    and the hang hold would have had no reading at all. Here prometheus_client's server with a
    real capture's families: the gate reads its KV pool and a progress reading."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    text = read_fixture("metrics-pressure-07.prom")

    class Capture:
        def collect(self) -> Iterator[prometheus_client.Metric]:
            yield from text_string_to_metric_families(text)

    registry = prometheus_client.CollectorRegistry()
    registry.register(Capture())  # type: ignore[arg-type]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = prometheus_client.start_http_server(port, "127.0.0.1", registry)
    asked = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=60)  # requests asks gzip
    assert asked.headers.get("Content-Encoding") == "gzip"  # what a client asking for it gets
    g = Running(f"http://127.0.0.1:{port}", limits=Limits(kv_admission=True))
    try:
        assert g.gate.follower is not None
        g.lt.run(g.gate.follower.poll_kv(), timeout=120)
        doc = requests.get(g.url + "/gate/status", timeout=60).json()
        assert (doc["kv_capacity_tokens"], doc["kv_capacity_source"]) == (4096, "cache_config_info")
        assert g.gate.follower.progress.last is not None
    finally:
        g.stop()
        server.shutdown()
        thread.join(timeout=60)


@pytest.mark.parametrize(
    ("fixture", "capacity", "source"),
    [
        ("metrics-pressure-07.prom", 4096, "cache_config_info"),
        # vLLM's Rust frontend has no vllm:cache_config_info: the pool is unknown, and the KV
        # admission admits (never a guessed pool); the status says so
        ("rust-frontend-under-load-05.om", None, None),
    ],
)
def test_the_kv_pool_and_its_source_in_the_status(
    stub: Stub, fixture: str, capacity: int | None, source: str | None
) -> None:
    stub.reset()
    stub.metrics_text = read_fixture(fixture)
    g = Running(stub.url, limits=Limits(kv_admission=True))
    try:
        assert g.gate.follower is not None
        g.lt.run(g.gate.follower.poll_kv(), timeout=120)
        doc = requests.get(g.url + "/gate/status", timeout=60).json()
        assert (doc["kv_capacity_tokens"], doc["kv_capacity_source"]) == (capacity, source)
        gauge = g.gate.metrics.registry.get_sample_value(
            "vllm_guardian_gate_kv_capacity_tokens", {"service": "vllm"}
        )
        assert gauge == (capacity or 0)  # the gauge's help: 0 is unknown
        assert post_echo(g.url).status_code == 200
    finally:
        g.stop()
