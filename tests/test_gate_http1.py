"""The gate's HTTP/1.1 server (gate/http1.py), byte for byte on a real socket: what a client
sends, what it gets back, what reaches the upstream stub, and whether the connection stays
open. One gate for the module, in front of the stub."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for
from tests.test_gate_support import GateThread, Stub, dechunk
from vllm_guardian.gate.http1 import MAX_HEAD_BYTES, MAX_LINE_BYTES


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gate(stub: Stub) -> Iterator[GateThread]:
    g = GateThread(stub.url, kv_admission=False)
    wait_for(lambda: g.gate.admission is not None and g.gate.admission.open, "the gate to open")
    yield g
    g.stop()


def sample(g: GateThread, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(g.gate.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def malformed(g: GateThread, phase: str) -> float:
    return sample(g, "vllm_guardian_gate_malformed_requests_total", phase=phase)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def read_answer(s: socket.socket, buf: bytearray, *, head_request: bool = False) -> Answer:
    """One answer off the socket (Content-Length, chunked, or to the close); what follows it
    stays in ``buf``."""

    def more() -> bool:
        chunk = s.recv(65536)
        buf.extend(chunk)
        return bool(chunk)

    while b"\r\n\r\n" not in buf:
        assert more(), f"closed before an answer's head: {bytes(buf)[:300]!r}"
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    buf[:] = rest
    if head_request or status in (204, 304):
        return Answer(status, headers, b"")
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            assert more(), "closed inside a body"
        body = bytes(buf[:n])
        del buf[:n]
        return Answer(status, headers, body)
    if headers.get("transfer-encoding") == "chunked":
        while not re.search(rb"(^|\r\n)0\r\n\r\n", bytes(buf)):
            assert more(), "closed inside a chunked body"
        raw, _, rest2 = bytes(buf).partition(b"0\r\n\r\n")
        buf[:] = rest2
        return Answer(status, headers, dechunk(raw))
    while more():
        pass
    body = bytes(buf)
    buf.clear()
    return Answer(status, headers, body)


def closed_after(s: socket.socket, buf: bytearray) -> bool:
    """The gate closes the connection (nothing more comes, then the end)."""
    s.settimeout(30)
    while chunk := s.recv(65536):
        buf.extend(chunk)
    return not buf


def exchange(g: GateThread, raw: bytes, *, head_request: bool = False) -> tuple[Answer, bool]:
    """Send ``raw``, read one answer: it, and whether the gate then closed the connection
    (probed by waiting for the end, or by a second request that must be answered)."""
    with socket.create_connection(("127.0.0.1", g.gate.port), timeout=30) as s:
        s.sendall(raw)
        buf = bytearray()
        answer = read_answer(s, buf, head_request=head_request)
        if answer.headers.get("connection", "").lower() == "close":
            return answer, closed_after(s, buf)
        s.sendall(b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\n")
        second = read_answer(s, buf)
        assert second.status == 200, second
        return answer, False


def echo(body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (
        b"POST /v1/echo HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


BODY = json.dumps({"prompt": "hello " * 200, "max_tokens": 1}).encode()


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def echoed(answer: Answer) -> dict[str, object]:
    doc = json.loads(answer.body)
    assert isinstance(doc, dict)
    return doc


def forwarded_headers(answer: Answer) -> set[str]:
    return {str(k).lower() for k, _ in echoed(answer)["headers"]}  # type: ignore[union-attr, misc]


@dataclass(frozen=True)
class Case:
    raw: bytes
    status: int
    closes: bool
    check: Callable[[Answer], bool] = lambda a: True
    head_request: bool = False


# fmt: off
CASES = {
    # Bodies: as sent, or decoded (and forwarded decoded, without their coding).
    "a body by length": Case(
        echo(BODY), 200, False, lambda a: echoed(a)["body_bytes"] == len(BODY)
    ),
    "a chunked body": Case(
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (BODY[:100], BODY[100:]))
        + b"0\r\n\r\n",
        200, False,
        lambda a: echoed(a)["body_bytes"] == len(BODY)
        and "transfer-encoding" not in forwarded_headers(a),
    ),
    "a gzip body": Case(
        echo(gzip.compress(BODY), b"Content-Encoding: gzip\r\n"), 200, False,
        lambda a: echoed(a)["body_bytes"] == len(BODY)
        and "content-encoding" not in forwarded_headers(a),
    ),
    "a deflate body (zlib-wrapped)": Case(
        echo(zlib.compress(BODY), b"Content-Encoding: deflate\r\n"), 200, False,
        lambda a: echoed(a)["body_bytes"] == len(BODY),
    ),
    "a deflate body (raw)": Case(
        echo(raw_deflate(BODY), b"Content-Encoding: deflate\r\n"), 200, False,
        lambda a: echoed(a)["body_bytes"] == len(BODY),
    ),
    "a gzip body cut short": Case(
        echo(gzip.compress(BODY)[:-20], b"Content-Encoding: gzip\r\n"), 400, True,
        lambda a: b"could not read the request body" in a.body,
    ),
    "a coding the gate cannot read": Case(
        echo(b"\x8b\x00\x80", b"Content-Encoding: br\r\n"), 400, True,
        lambda a: b"could not read the request body" in a.body,
    ),
    # Versions and keep-alive.
    "HTTP/1.0: closed after the answer": Case(
        echo(BODY, version=b"1.0"), 200, True, lambda a: a.headers["connection"] == "close"
    ),
    "HTTP/1.0 asking for keep-alive": Case(
        echo(BODY, b"Connection: keep-alive\r\n", b"1.0"), 200, False,
        lambda a: a.headers["connection"].lower() == "keep-alive",
    ),
    "Connection: close": Case(echo(BODY, b"Connection: close\r\n"), 200, True),
    # Targets.
    "an absolute-form target": Case(
        b"POST http://gate.example/v1/echo?a=1 HTTP/1.1\r\nHost: gate.example\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        200, False, lambda a: echoed(a)["path_qs"] == "/v1/echo?a=1",
    ),
    "a query passes as sent": Case(
        b"POST /v1/echo?x=%2F&y=a+b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 200,
        False, lambda a: echoed(a)["path_qs"] == "/v1/echo?x=%2F&y=a+b",
    ),
    # Answers without a body.
    "HEAD: the length, no body, the connection reusable": Case(
        b"HEAD /v1/echo HTTP/1.1\r\nHost: x\r\n\r\n", 200, False,
        lambda a: int(a.headers["content-length"]) > 0, head_request=True,
    ),
    # What the gate does not read.
    "a request target too long": Case(
        b"GET /" + b"a" * MAX_LINE_BYTES + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, True,
        lambda a: b"could not parse the request" in a.body,
    ),
    "a header line too long": Case(
        b"GET /gate/status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * MAX_LINE_BYTES
        + b"\r\n\r\n",
        400, True,
    ),
    "a head too long in all": Case(
        b"GET /gate/status HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: %b\r\n" % (i, b"v" * 4000) for i in range(MAX_HEAD_BYTES // 4000 + 2))
        + b"\r\n",
        400, True,
    ),
    "an upgrade: answered, then closed": Case(
        b"GET /gate/status HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n",
        200, True,
    ),
}
# fmt: on


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_what_a_client_sends_and_gets(gate: GateThread, stub: Stub, case: Case) -> None:
    heads_before = malformed(gate, "head")
    answer, closed = exchange(gate, case.raw, head_request=case.head_request)
    assert answer.status == case.status, answer
    assert closed == case.closes, answer
    assert case.check(answer), answer
    parse_error = case.status == 400 and b"could not parse" in answer.body
    assert malformed(gate, "head") == heads_before + (1 if parse_error else 0)
    assert "date" in answer.headers, answer.headers


def test_a_client_that_sends_its_head_in_pieces_is_answered(gate: GateThread, stub: Stub) -> None:
    """llhttp keeps its place between reads: a head and body cut at every byte is one request."""
    raw = echo(BODY)
    with socket.create_connection(("127.0.0.1", gate.gate.port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(300):
            s.sendall(raw[i : i + 1])
        s.sendall(raw[300:])
        answer = read_answer(s, bytearray())
    assert answer.status == 200 and echoed(answer)["body_bytes"] == len(BODY), answer


# --- what a review found, each held (the first run of each failed on the server's first version)


def conn(g: GateThread, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", g.gate.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def status_with_body(n: int) -> bytes:
    return b"GET /gate/status HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n + b"x" * n


def test_bodies_the_gate_does_not_read_never_stall_a_kept_connection(gate: GateThread) -> None:
    """A GET with a body is answered without reading it; what it left must not count against
    the connection's buffer (past 128 KiB of it, reading paused for good: request 15 of 20
    got no answer)."""
    with conn(gate) as s:
        buf = bytearray()
        for i in range(20):
            s.sendall(status_with_body(10_000))
            answer = read_answer(s, buf)
            assert answer.status == 200, (i, answer)


def test_a_connection_left_with_unread_bodies_is_still_closed_at_the_idle_deadline(
    stub: Stub,
) -> None:
    g = GateThread(stub.url, kv_admission=False, gate={"idle_timeout_seconds": 1.0})
    try:
        with conn(g) as s:
            buf = bytearray()
            for _ in range(14):  # 140,000 bytes the handler never reads
                s.sendall(status_with_body(10_000))
                read_answer(s, buf)
            s.sendall(b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(30)
            got = s.recv(65536)  # answered (and then closed at the deadline), never silent
            assert got.startswith(b"HTTP/1.1 200"), got[:100]
    finally:
        g.stop()


def test_a_deflate_body_whose_first_piece_is_one_byte_is_read(gate: GateThread) -> None:
    """Raw or zlib-wrapped deflate is told by the first two bytes, whatever the pieces."""
    data = zlib.compress(BODY)
    raw = (
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in (data[:1], data[1:]))
        + b"0\r\n\r\n"
    )
    with conn(gate) as s:
        s.sendall(raw)
        answer = read_answer(s, bytearray())
    assert answer.status == 200 and echoed(answer)["body_bytes"] == len(BODY), answer


def gzip_bomb(mib: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * (1 << 20)
    return b"".join(c.compress(zeros) for _ in range(mib)) + c.flush()


def test_a_gzip_bomb_is_refused_at_the_body_limit(gate: GateThread) -> None:
    """~200 KiB that inflate to 200 MiB: 413 at the limit (32 MiB), nothing else."""
    bomb = gzip_bomb(200)
    with conn(gate, timeout=60) as s:
        s.sendall(echo(bomb, b"Content-Encoding: gzip\r\n"))
        answer = read_answer(s, bytearray())
    assert answer.status == 413, answer


class _Conn:
    """What a request body tells its connection (white box: the buffer's accounting)."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def buffered(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def consumed(self, n: int) -> None:
        self.held -= n


@pytest.mark.python_only
def test_a_coded_body_is_decoded_no_further_than_the_buffer_ahead_of_its_reader() -> None:
    """A gzip body fed in one piece is decoded a buffer at a time as it is read: the server
    never holds more than BUFFER_BYTES of it decoded plus its coded rest (200 MiB inflated
    whole from one read before), and the reader gets every byte."""
    from vllm_guardian.gate.http1 import BUFFER_BYTES, RequestBody, _Decoder

    bomb = gzip_bomb(8)
    c = _Conn()
    body = RequestBody(c, _Decoder("gzip"))  # type: ignore[arg-type]
    body.feed(bomb)
    body.feed_eof()
    total = 0
    while chunk := body.read_nowait(64 * 1024):
        total += len(chunk)
    assert body.at_eof() and total == 8 << 20
    assert c.peak <= BUFFER_BYTES + len(bomb), c.peak
    assert c.held == 0


@pytest.mark.parametrize("how", ["closes", "resets"])
@pytest.mark.parametrize("behind", ["20 pipelined GETs", "a 200 KB body"])
def test_a_client_that_leaves_while_the_gate_has_stopped_reading_it_aborts_its_request(
    gate: GateThread, stub: Stub, behind: str, how: str
) -> None:
    """With reading paused (requests or a body queued behind the one answered) the gate reads
    no FIN and sees no reset; the guard sees the closed socket, so vLLM is still told to
    abort."""
    stub.reset()
    s = conn(gate)
    try:
        s.sendall(b"POST /v1/hold HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        wait_for(lambda: stub.active == 1, "the stub to hold the request")
        if behind == "20 pipelined GETs":
            s.sendall(b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
        else:
            s.sendall(echo(b"x" * 200_000))
    finally:
        if how == "resets":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    try:
        wait_for(
            lambda: stub.disconnects == 1 and stub.active == 0,
            "the held upstream request aborted",
            seen=lambda: (stub.disconnects, stub.active),
        )
    finally:
        stub.set_release()
        stub.reset()


def test_bytes_after_a_request_that_closes_are_not_a_malformed_request(gate: GateThread) -> None:
    before = malformed(gate, "head")
    with conn(gate) as s:
        s.sendall(
            b"GET /gate/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        buf = bytearray()
        assert read_answer(s, buf).status == 200
        assert closed_after(s, buf)
    assert malformed(gate, "head") == before


def test_a_broken_chunked_body_the_gate_does_not_read_closes_after_the_answer(
    gate: GateThread,
) -> None:
    with conn(gate) as s:
        s.sendall(
            b"GET /gate/status HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz\r\nhello\r\n0\r\n\r\n"
        )
        buf = bytearray()
        assert read_answer(s, buf).status == 200
        assert closed_after(s, buf)


def test_a_client_waiting_for_100_continue_on_a_route_that_reads_no_body_is_closed(
    gate: GateThread,
) -> None:
    """Answered without its body: the connection closes, or its body would be read as the
    next request."""
    with conn(gate) as s:
        s.sendall(
            b"GET /gate/status HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        buf = bytearray()
        answer = read_answer(s, buf)
        assert answer.status == 200 and answer.headers["connection"] == "close", answer
        assert closed_after(s, buf)


def test_an_answer_without_a_body_then_a_failing_handler_is_one_answer(gate: GateThread) -> None:
    """The server's contract (a handler injected): once a head went out, a handler's failure
    closes the connection; it never writes a 500 after it."""
    from vllm_guardian.gate.http1 import Request, StreamResponse

    server = gate.gate._server
    assert server is not None
    original = server.handler

    async def failing(request: Request, body_read: object) -> StreamResponse:
        resp = StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(b"some body")  # HEAD: the head goes out, the body does not
        raise RuntimeError("injected: the handler fails after its head went out")

    server.handler = failing  # type: ignore[assignment]
    try:
        with conn(gate) as s:
            s.sendall(b"HEAD /x HTTP/1.1\r\nHost: x\r\n\r\n")
            got = bytearray()
            closed_after(s, got)
    finally:
        server.handler = original
    assert bytes(got).count(b"HTTP/1.1 ") == 1, got


# --- what a second review found, each held (each failed before its mend)


def decoded_whole(coding: str, coded: bytes) -> bytes:
    """A coded body fed in one piece, read to its end (raises BodyError)."""
    from vllm_guardian.gate.http1 import RequestBody, _Decoder

    c = _Conn()
    body = RequestBody(c, _Decoder(coding))  # type: ignore[arg-type]
    body.feed(coded)
    body.feed_eof()
    out = b""
    while chunk := body.read_nowait(1 << 20):
        out += chunk
    assert c.held == 0
    return out


GZIPPED = gzip.compress(b'{"prompt":"abc"}')


@pytest.mark.parametrize(
    ("coding", "coded", "decoded"),
    [
        ("gzip", GZIPPED, b'{"prompt":"abc"}'),
        # RFC 1952: a gzip body may be several members (`gzip a >x; gzip b >>x`).
        ("gzip", gzip.compress(b'{"prompt":"a') + gzip.compress(b'bc"}'), b'{"prompt":"abc"}'),
        ("gzip", GZIPPED + b"trailing garbage", None),
        ("gzip", GZIPPED + b"\xaa" * (1 << 20), None),  # a megabyte no accounting saw
        ("deflate", zlib.compress(b'{"a":1}') + b"x" * 100, None),
        ("gzip", GZIPPED[:-4], None),  # cut short
        ("gzip", GZIPPED * 64, b'{"prompt":"abc"}' * 64),
        # Past 64 members: each member's end copies what follows it, so 11,000 empty members
        # in one read took 76 ms of the gate's loop (a third review).
        ("gzip", gzip.compress(b"") * 65, None),
    ],
    ids=[
        "one member",
        "two members",
        "garbage after",
        "a megabyte after",
        "deflate+garbage",
        "cut short",
        "64 members",
        "65 members",
    ],
)
@pytest.mark.python_only
def test_a_coded_body_is_all_its_members_and_nothing_after_them(
    coding: str, coded: bytes, decoded: bytes | None
) -> None:
    from vllm_guardian.gate.http1 import BodyError

    if decoded is None:
        with pytest.raises(BodyError):
            decoded_whole(coding, coded)
    else:
        assert decoded_whole(coding, coded) == decoded


@pytest.mark.parametrize(
    "codings",
    [
        b"Content-Encoding: identity\r\nContent-Encoding: gzip\r\n",
        b"Content-Encoding: gzip\r\nContent-Encoding: identity\r\n",
        b"Content-Encoding: identity, gzip\r\n",
    ],
    ids=["identity then gzip", "gzip then identity", "one header, two codings"],
)
def test_a_body_coded_once_whatever_identity_beside_it_is_decoded_and_forwarded_so(
    gate: GateThread, codings: bytes
) -> None:
    """The coding is read from every Content-Encoding header, in order, the same way for the
    decision to decode and for the header sent upstream (before: the last header decided one,
    the first the other)."""
    answer, _ = exchange(gate, echo(gzip.compress(BODY), codings))
    assert answer.status == 200, answer
    assert echoed(answer)["body_bytes"] == len(BODY), answer
    assert "content-encoding" not in forwarded_headers(answer), answer


def test_a_body_coded_twice_is_refused(gate: GateThread) -> None:
    raw = echo(gzip.compress(gzip.compress(BODY)), b"Content-Encoding: gzip, gzip\r\n")
    answer, closed = exchange(gate, raw)
    assert answer.status == 400 and closed, answer


def test_a_client_that_never_reads_its_answer_is_closed_at_the_deadline(stub: Stub) -> None:
    """As nginx's send_timeout: a client that takes nothing of its answer for the idle
    deadline is closed and its slot freed (before: such clients held every slot for good and
    each new client was closed at once)."""
    g = GateThread(
        stub.url, kv_admission=False, gate={"idle_timeout_seconds": 1.0, "max_connections": 2}
    )
    hogs = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", g.gate.port))
            s.sendall(b"POST /v1/sse?n=100000 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            hogs.append(s)
        server = g.gate._server
        assert server is not None
        wait_for(
            lambda: sum(c.writing_paused for c in list(server.connections)) == 2,
            "both answers stopped by clients that do not read",
            seen=lambda: [c.writing_paused for c in list(server.connections)],
        )

        def served() -> bool:
            with socket.create_connection(("127.0.0.1", g.gate.port), timeout=10) as s:
                s.sendall(b"GET /gate/status HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    return read_answer(s, bytearray()).status == 200
                except AssertionError:  # closed at once: over the cap
                    return False

        wait_for(
            served,
            "a new client served after the readers-of-nothing were closed",
            timeout_seconds=60,
        )
        closed = sample(g, "vllm_guardian_gate_connections_closed_total", reason="send_timeout")
        assert closed == 2, closed
    finally:
        for s in hogs:
            s.close()
        g.stop()


def test_a_client_that_reads_its_stream_slowly_but_steadily_is_served(stub: Stub) -> None:
    """The send deadline counts from the last bytes the client took, not from when the gate's
    writes paused (a third review: a client taking 512 bytes every 20 ms was cut at a 1 s
    deadline, its transport paused until it fell below its low-water mark)."""
    g = GateThread(stub.url, kv_admission=False, gate={"idle_timeout_seconds": 1.0})
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", g.gate.port))
        s.sendall(b"POST /v1/sse?n=20000 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        s.settimeout(30)
        got = 0
        while got < 120_000:  # several deadlines long at this pace
            chunk = s.recv(512)
            assert chunk, f"closed after {got} bytes"
            got += len(chunk)
            time.sleep(0.02)
        closed = sample(g, "vllm_guardian_gate_connections_closed_total", reason="send_timeout")
        assert closed == 0, closed
    finally:
        s.close()
        g.stop()


class _Gauge:
    def set(self, value: float) -> None:
        pass


class _GuardMetrics:
    def __init__(self) -> None:
        self.closed: list[str] = []
        self.connections = _Gauge()

    def connection_closed(self, reason: str) -> None:
        self.closed.append(reason)


class _DrainingTransport:
    """A transport whose client takes 1 KiB of the buffered answer each time it is looked at:
    a slow, steady reader."""

    def __init__(self, buffered: int) -> None:
        self.buffered = buffered
        self.aborted_with: int | None = None
        self.closed = False

    def get_write_buffer_size(self) -> int:
        self.buffered = max(0, self.buffered - 1024)
        return self.buffered

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def abort(self) -> None:
        self.aborted_with = self.buffered

    def close(self) -> None:
        self.closed = True


class _GuardedConn:
    def __init__(self, t: _DrainingTransport, bytes_out: int) -> None:
        self.transport = t
        self.reading_paused = False
        self.bytes_out = bytes_out

    def close(self) -> None:
        self.transport.close()


def test_the_idle_deadline_never_cuts_an_answer_its_client_is_still_taking() -> None:
    """Its handler done, 1 MiB of its answer still in the transport and taken steadily: only
    the send deadline judges it, and it moves (a fourth review: the idle deadline aborted it
    and dropped the rest)."""
    from vllm_guardian.gate.connections import ConnectionGuard

    async def run() -> tuple[list[str], int | None, bool]:
        metrics = _GuardMetrics()
        guard = ConnectionGuard(
            max_connections=10,
            idle_timeout_seconds=0.4,
            metrics=metrics,  # type: ignore[arg-type]
        )
        t = _DrainingTransport(1 << 20)
        now = time.monotonic()
        g = guard.accepted(_GuardedConn(t, bytes_out=2 << 20), now)  # type: ignore[arg-type]
        assert g is not None
        guard.busy(g, now)
        guard.idle(g, now)  # the answer was handed to the transport whole: the handler ended
        guard.start()
        while time.monotonic() < now + 1.2:  # three idle deadlines
            await asyncio.sleep(0.05)
        await guard.stop()
        return metrics.closed, t.aborted_with, t.closed

    closed, dropped, was_closed = asyncio.run(run())
    assert dropped is None and not was_closed, (closed, dropped)
