"""The gate's client to vLLM (gate/upstream.py) against a raw HTTP server on 127.0.0.1 that
answers with scripted bytes: what goes out, how each answer's body is framed, which
connections are kept for the next request, and which phase each failure is counted under."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from vllm_guardian.gate.upstream import MAX_HEAD_BYTES, UpstreamError, UpstreamPool

CLOSE = b"<close>"  # in a script: close the connection here
HANG = b"<hang>"  # in a script: answer nothing, keep the connection open


@dataclass
class Server:
    """Answers the n-th request with ``script[n]`` (bytes, or CLOSE / HANG markers)."""

    script: list[list[bytes]]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed_by_peer: int = 0
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_peer += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.requests.append(head + await reader.readexactly(length))
                for part in self.script[len(self.requests) - 1]:
                    if part == CLOSE:
                        return
                    if part == HANG:
                        if not await reader.read(1):
                            self.closed_by_peer += 1
                        return
                    writer.write(part)
                    await writer.drain()
        finally:
            writer.close()


def run(
    script: list[list[bytes]], test: Callable[[UpstreamPool, Server], Awaitable[None]]
) -> Server:
    server = Server(script)

    async def main() -> None:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        server.port = srv.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}/base")
        try:
            await asyncio.wait_for(test(pool, server), 60)
        finally:
            pool.close()
            srv.close()
            await srv.wait_closed()

    asyncio.run(main())
    return server


async def body_of(
    pool: UpstreamPool, method: str = "POST", body: bytes | None = b"{}"
) -> tuple[int, bytes, int | None]:
    up = await pool.request(method, "/v1/x?q=1", [("Authorization", "Bearer k")], body)
    chunks = []
    while chunk := await up.read():
        chunks.append(chunk)
    assert up.at_eof()
    up.release()
    return up.status, b"".join(chunks), up.content_length


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

# name, answer to the first request, method; status, body, content_length expected; kept alive
FRAMING = [
    ("content-length", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"], "POST", 200, b"hello", 5, True),
    ("chunked, extension and trailer", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n", b"6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"], "POST", 200, b"hello world", None, True),
    ("chunked wins over Content-Length", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n2\r\nok\r\n0\r\n\r\n"], "POST", 200, b"ok", None, True),
    ("204 has no body", [b"HTTP/1.1 204 No Content\r\n\r\n"], "POST", 204, b"", None, True),
    ("304 has no body whatever its length says", [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n"], "GET", 304, b"", 10, True),
    ("HEAD has no body", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"], "HEAD", 200, b"", 5, True),
    ("an interim 100 is skipped", [b"HTTP/1.1 100 Continue\r\n\r\n", OK], "POST", 200, b"ok", 2, True),
    ("no length: until the close", [b"HTTP/1.1 200 OK\r\n\r\nuntil the close", CLOSE], "POST", 200, b"until the close", None, False),
    ("Connection: close is honoured", [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", CLOSE], "POST", 200, b"ok", 2, False),
    ("HTTP/1.0 without keep-alive", [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", CLOSE], "POST", 200, b"ok", 2, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "method", "status", "body", "length", "kept"),
    [c[1:] for c in FRAMING],
    ids=[c[0] for c in FRAMING],
)
def test_an_answer_is_framed_and_its_connection_kept_only_when_reusable(
    answer: list[bytes], method: str, status: int, body: bytes, length: int | None, kept: bool
) -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        assert await body_of(pool, method) == (status, body, length)
        assert await body_of(pool) == (200, b"ok", 2)  # the next request, on whichever connection

    server = run([answer, [OK]], test)
    assert server.connections == (1 if kept else 2)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED_BODY = b"5;x=y\r\nhello\r\n6\r\n world\r\n1\r\n!\r\n0\r\nX-T: 1\r\n\r\n"
# How the chunked body arrives: the proxy's read parses what came, whatever the split.
SPLITS = [
    ("in one packet", [CHUNKED_BODY]),
    ("byte by byte", [CHUNKED_BODY[i : i + 1] for i in range(len(CHUNKED_BODY))]),
    ("at every CRLF", [part + b"\r\n" for part in CHUNKED_BODY.split(b"\r\n")[:-1]]),
]


@pytest.mark.parametrize("parts", [s[1] for s in SPLITS], ids=[s[0] for s in SPLITS])
def test_a_chunked_body_is_the_same_however_its_bytes_arrive(parts: list[bytes]) -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        assert await body_of(pool) == (200, b"hello world!", None)
        assert await body_of(pool) == (200, b"ok", 2)

    server = run([[CHUNKED_HEAD, *parts], [OK]], test)
    assert server.connections == 1  # read to its end: kept


def test_the_chunks_that_came_together_are_handed_on_in_one_read() -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        up = await pool.request("POST", "/v1/x", [], b"{}")
        pieces = []
        while piece := await up.read():
            pieces.append(piece)
        up.release()
        assert pieces == [b"hello world!"]

    run([[CHUNKED_HEAD + CHUNKED_BODY]], test)


def test_the_request_goes_out_as_one_message_with_host_length_and_the_given_headers() -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        await body_of(pool, "POST", b'{"a": 1}')
        await body_of(pool, "POST", None)  # a bodiless POST says Content-Length: 0
        await body_of(pool, "GET", None)  # a GET says nothing of a body

    server = run([[OK], [OK], [OK]], test)
    host = f"Host: 127.0.0.1:{server.port}".encode()
    assert server.requests == [
        b"POST /base/v1/x?q=1 HTTP/1.1\r\n" + host + b"\r\nAuthorization: Bearer k\r\nContent-Length: 8\r\n\r\n" + b'{"a": 1}',
        b"POST /base/v1/x?q=1 HTTP/1.1\r\n" + host + b"\r\nAuthorization: Bearer k\r\nContent-Length: 0\r\n\r\n",
        b"GET /base/v1/x?q=1 HTTP/1.1\r\n" + host + b"\r\nAuthorization: Bearer k\r\n\r\n",
    ]  # fmt: skip
    assert server.connections == 1


# name, answer, the phase it fails in: at pool.request (no answer head) or reading the body
FAILURES = [
    ("closed before answering", [CLOSE], "before_first_byte"),
    ("not HTTP", [b"SSH-2.0-OpenSSH\r\n\r\n"], "before_first_byte"),
    ("a bad Content-Length", [b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"], "before_first_byte"),
    ("a malformed header line", [b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "before_first_byte"),
    ("a head past the limit", [b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"], "before_first_byte"),
    ("cut mid-body", [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", CLOSE], "streaming"),
    ("a malformed chunk size", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "streaming"),
    ("a chunk cut short", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\nabc", CLOSE], "streaming"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "phase"), [c[1:] for c in FAILURES], ids=[c[0] for c in FAILURES]
)
def test_a_failure_is_an_upstream_error_of_its_phase_and_its_connection_is_not_reused(
    answer: list[bytes], phase: str
) -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        with pytest.raises(UpstreamError) as e:
            await body_of(pool)
        assert e.value.phase == phase
        assert pool.idle_connections == 0
        assert await body_of(pool) == (200, b"ok", 2)  # the pool goes on with a new connection

    server = run([answer, [OK]], test)
    assert server.connections == 2


def test_no_listener_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused

        async def main() -> None:
            pool = UpstreamPool(f"http://127.0.0.1:{port}")
            with pytest.raises(UpstreamError) as e:
                await pool.request("GET", "/health", [], None)
            assert e.value.phase == "connect"
            assert not e.value.timed_out  # refused: nobody there

        asyncio.run(main())


def test_a_full_listen_queue_is_a_connect_that_timed_out() -> None:
    """A server that does not accept (busy): the kernel drops the SYN once its queue is full."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        fillers = []
        try:
            while True:  # fill the queue until a connect of our own times out
                f = socket.socket()
                f.settimeout(0.5)
                try:
                    f.connect(("127.0.0.1", port))
                except TimeoutError:
                    f.close()
                    break
                fillers.append(f)
                assert len(fillers) < 16, "the listen queue never filled"

            async def main() -> None:
                pool = UpstreamPool(f"http://127.0.0.1:{port}", connect_timeout_seconds=0.5)
                with pytest.raises(UpstreamError) as e:
                    await pool.request("GET", "/health", [], None)
                assert (e.value.phase, e.value.timed_out) == ("connect", True)

            asyncio.run(main())
        finally:
            for f in fillers:
                f.close()


def test_a_connect_done_while_the_gate_was_stalled_is_a_connect_not_a_timeout() -> None:
    """The gate's loop is stalled past the connect deadline (a busy host deschedules it) while
    the kernel completes the connect at once: the request goes out on it. Before, the deadline
    fired first when the loop woke and the connect was cancelled as timed out (the real-engine
    overload counted 15-160 such "timeouts" per run on a listener that was never full)."""
    import time

    async def test(pool: UpstreamPool, server: Server) -> None:
        pool.connect_timeout_seconds = 0.2
        loop = asyncio.get_running_loop()
        exchange = asyncio.create_task(pool.request("POST", "/v1/x", [], b"{}"))
        await asyncio.sleep(0)  # the connect is under way
        loop.call_soon(time.sleep, 0.6)  # the loop stalls past its deadline
        up = await exchange
        assert up.status == 200
        up.release()

    server = run([[OK]], test)
    assert server.connections == 1


def test_a_cancelled_exchange_closes_its_connection() -> None:
    """How vLLM learns that the client left: its connection closes."""

    async def test(pool: UpstreamPool, server: Server) -> None:
        task = asyncio.create_task(pool.request("POST", "/v1/x", [], b"{}"))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while server.closed_by_peer == 0:
            await asyncio.sleep(0.01)
        assert pool.idle_connections == 0

    run([[HANG]], test)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_take_back_closes_only_the_saveable_exchanges_each_read_failing_like_a_cut() -> None:
    """A hung engine (the follower's progress watch): the exchanges marked saveable are taken
    back, whether still waiting for the head or mid-answer; the others are left alone."""

    async def test(pool: UpstreamPool, server: Server) -> None:
        waiting = asyncio.create_task(pool.request("POST", "/v1/a", [], b"{}", saveable=True))
        while not server.requests:  # the script goes by arrival: this one first
            await asyncio.sleep(0.01)
        streaming = await pool.request("POST", "/v1/b", [], b"{}", saveable=True)
        assert await streaming.read() == b"abc"
        committed = await pool.request("POST", "/v1/c", [], b"{}", saveable=True)
        committed.set_saveable(False)  # its answer reached the client: not sent again
        left = await pool.request("POST", "/v1/d", [], b"{}")
        assert pool.take_back() == 2
        assert pool.take_back() == 0  # once each
        with pytest.raises(UpstreamError) as e:
            await waiting
        assert e.value.phase == "before_first_byte"
        with pytest.raises(UpstreamError) as e:
            await streaming.read()
        assert e.value.phase == "streaming" and streaming.taken_back
        assert not committed.taken_back and not left.taken_back
        for up in (streaming, committed, left):
            up.release()
        while server.closed_by_peer < 4:  # two taken back, two released unfinished
            await asyncio.sleep(0.01)

    stream = [CHUNKED_HEAD + b"3\r\nabc\r\n", HANG]
    server = run([[HANG], stream, stream, stream], test)
    assert server.connections == 4


def test_an_unfinished_answer_released_closes_its_connection() -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        up = await pool.request("POST", "/v1/x", [], b"{}")
        assert await up.read() == b"abc"
        up.release()  # the client left mid-answer
        assert pool.idle_connections == 0
        while server.closed_by_peer == 0:
            await asyncio.sleep(0.01)

    run([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", HANG]], test)


def test_an_idle_connection_the_upstream_closed_is_not_used_again() -> None:
    """vLLM restarted, or its keep-alive timeout closed the connection while it sat idle."""

    async def test(pool: UpstreamPool, server: Server) -> None:
        assert await body_of(pool) == (200, b"ok", 2)
        assert pool.idle_connections == 1
        while server.connections == 1 and not pool._idle[0].link.at_eof():
            await asyncio.sleep(0.01)  # the upstream's close reaches the idle connection
        assert await body_of(pool) == (200, b"ok", 2)

    server = run([[OK, CLOSE], [OK]], test)
    assert server.connections == 2


# What the upstream does with the second request, sent on the connection the first one's
# answer left open: closed with no answer (uvicorn's keep-alive timer fired as it arrived: vLLM
# closes a connection idle for 5 s, and on a busy server the timer and the request race), or
# closed after part of an answer. Expected: answered on a new connection, or an UpstreamError.
STALE = [
    ("closed with no answer: sent again on a new connection", [CLOSE], [OK], (200, 1), 2),
    ("closed with no answer twice: the new connection's failure is the error", [CLOSE], [CLOSE], ("before_first_byte", 1), 2),
    ("closed after part of the head: never sent again", [b"HTTP/1.1 200", CLOSE], [OK], ("before_first_byte", 0), 1),
]  # fmt: skip


@pytest.mark.parametrize(
    ("second", "third", "expected", "connections"),
    [c[1:] for c in STALE],
    ids=[c[0] for c in STALE],
)
def test_a_kept_connection_closed_before_any_answer_is_sent_again_once_on_a_new_one(
    second: list[bytes], third: list[bytes], expected: tuple[object, int], connections: int
) -> None:
    """Not a broken upstream: a request the server closed its idle connection on, before a
    byte of answer, never reached vLLM's handler; a fresh connection is its first real try."""

    async def test(pool: UpstreamPool, server: Server) -> None:
        assert await body_of(pool) == (200, b"ok", 2)
        assert pool.idle_connections == 1
        status_or_phase, retried = expected
        if status_or_phase == 200:
            assert await body_of(pool) == (200, b"ok", 2)
        else:
            with pytest.raises(UpstreamError) as e:
                await body_of(pool)
            assert e.value.phase == status_or_phase
        assert pool.stale_retries == retried

    server = run([[OK], second, third], test)
    assert server.connections == connections


def test_an_exchange_taken_back_is_not_sent_again_on_a_new_connection() -> None:
    """take_back closes a kept connection's exchange on purpose (the engine is hung): its
    failure goes to the sender, who decides, not to a silent second try on this engine."""

    async def test(pool: UpstreamPool, server: Server) -> None:
        assert await body_of(pool) == (200, b"ok", 2)
        waiting = asyncio.create_task(pool.request("POST", "/v1/a", [], b"{}", saveable=True))
        while len(server.requests) < 2:
            await asyncio.sleep(0.01)
        assert pool.take_back() == 1
        with pytest.raises(UpstreamError) as e:
            await waiting
        assert e.value.taken_back
        assert pool.stale_retries == 0

    server = run([[OK], [HANG], [OK]], test)
    assert server.connections == 1


def test_an_idle_connection_past_the_keepalive_is_closed_not_reused() -> None:
    async def test(pool: UpstreamPool, server: Server) -> None:
        pool.keepalive_seconds = 0.0
        await body_of(pool)
        await body_of(pool)

    server = run([[OK], [OK]], test)
    assert server.connections == 2


@pytest.mark.parametrize(
    ("url", "host", "port", "host_header", "base_path"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", 8000, "127.0.0.1:8000", ""),
        ("http://127.0.0.1:8000/", "127.0.0.1", 8000, "127.0.0.1:8000", ""),
        ("http://vllm.local/api/", "vllm.local", 80, "vllm.local", "/api"),
        ("https://vllm.local", "vllm.local", 443, "vllm.local", ""),
        ("http://[::1]:8000", "::1", 8000, "[::1]:8000", ""),
    ],
)
def test_the_base_url_gives_address_host_header_and_path_prefix(
    url: str, host: str, port: int, host_header: str, base_path: str
) -> None:
    pool = UpstreamPool(url)
    assert (pool.host, pool.port, pool.host_header, pool.base_path) == (
        host,
        port,
        host_header,
        base_path,
    )


@pytest.mark.parametrize("url", ["ftp://x", "127.0.0.1:8000", "http://"])
def test_a_base_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="expected http"):
        UpstreamPool(url)
