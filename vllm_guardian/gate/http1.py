"""The gate's HTTP/1.1 server: client connections parsed by llhttp, answers written to them.

Where it sits: between the listening socket and the proxy (``proxy.py``). Each connection is
an :class:`asyncio.Protocol` fed by the loop; llhttp (through ``httptools``, the parser
uvicorn uses) cuts requests out of its bytes in C and calls back here. A request's head makes
a :class:`Request`; its body is fed to the request's :class:`RequestBody` as it arrives; one
task per busy connection runs the handler for each request in turn and writes its answer.

Why not aiohttp's server, which the gate ran on before: measured in one run on loopback
(docs/benchmarks.md, "The gate on its own server"), the gate costs 11–28 % less CPU per request
on this one (per event the same: the relay writes events past the server), and a proxy's tail
on a shared core follows its CPU. It does what the gate needs and nothing else (docs/gate.md,
"The gate's own HTTP server"):

* HTTP/1.1 keep-alive and HTTP/1.0 (kept alive only when asked); pipelined requests are
  answered in order, each after the one before it ends;
* ``Content-Length`` and chunked request bodies; ``gzip`` and ``deflate`` bodies decoded as
  they are read, a buffer at a time (any other coding, or bytes after the coded stream, is a
  body error: the gate must read the JSON);
* ``Expect: 100-continue`` (:meth:`Request.send_continue`);
* a request head over :data:`MAX_HEAD_BYTES` (a line of it over :data:`MAX_LINE_BYTES`), or
  one llhttp refuses, is answered 400 in OpenAI's error shape and counted
  (``MalformedRequests``), never logged with a traceback;
* answers framed by ``Content-Length``, chunked (HTTP/1.1), or by the close (HTTP/1.0), with
  none for ``HEAD``, 1xx, 204 and 304; the head goes out with the first body bytes, in one
  write;
* reading pauses while a connection has more than :data:`BUFFER_BYTES` of body not yet read by
  its handler, and a handler's write waits while the client's socket is full;
* a client that closes its connection cancels the handler of its request (what the proxy
  counts as a client that left);
* the connection guard (``connections.py``) sees every connection's life: accepted, bytes in,
  head in, body read, answer done, closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import http
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools
from multidict import CIMultiDict

from vllm_guardian.gate.connections import ConnectionGuard, GuardedConn, MalformedRequests
from vllm_guardian.gate.gone import ClientGone

log = logging.getLogger("vllm_guardian.gate")

# A request's line and headers together. nginx's default is 4 × 8 KiB buffers; aiohttp's was
# 8,190 bytes a line. A head this long is no client's: answered 400 and closed.
MAX_HEAD_BYTES = 64 * 1024
# One line of it (the request line, a header): nginx's buffer for one is 8 KiB, aiohttp's limit
# was this.
MAX_LINE_BYTES = 8190
# Body bytes a connection holds for its handler before reading from it pauses (aiohttp's
# high-water mark was 128 KiB too).
BUFFER_BYTES = 128 * 1024
# Pipelined requests parsed ahead of the one being answered before reading pauses; past the
# most one read may hold, the rest of that read is refused (400) after those are answered.
MAX_PIPELINED = 16
MAX_QUEUED = 64
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_NO_BODY_STATUSES = frozenset({204, 304})
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
# The request body codings decoded as they arrive (forwarded decoded, without the header).
DECODED_CODINGS = frozenset({"gzip", "x-gzip", "deflate"})
# A gzip body may be several members (RFC 1952); a client's has a few. More is refused.
MAX_GZIP_MEMBERS = 64

Handler = Callable[["Request", Callable[[], None]], Awaitable["Response"]]


class BodyError(Exception):
    """The request's body cannot be read: its framing broke (a chunk size that is not hex),
    its coding cannot be decoded, or the client left while it was being sent."""


class RequestBody:
    """A request's body as it arrives: what :func:`~vllm_guardian.gate.body.read_body` reads
    (``read_nowait`` what is there, ``read`` waiting for more, ``at_eof``). A coded body is
    decoded no further than :data:`BUFFER_BYTES` ahead of its reader: a small gzip body that
    inflates a thousandfold is refused at the body limit, never held whole."""

    __slots__ = (
        "_buf", "_conn", "_decoder", "_ended", "_eof", "_error", "_held", "_waiter", "discard",
    )  # fmt: skip

    def __init__(self, conn: Connection, decoder: _Decoder | None) -> None:
        self._conn = conn
        self._buf = bytearray()
        self._ended = False  # the whole body arrived (coded, maybe not decoded yet)
        self._eof = False  # ... and all of it is in _buf or was read
        self._error: BodyError | ClientGone | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decoder = decoder
        self._held = 0  # bytes counted in the connection's buffer: _buf and the coded tail
        self.discard = False  # answered without reading it: what still comes is dropped

    # --- fed by the connection -----------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self._error is not None or self.discard:
            return
        if self._decoder is None:
            self._buf += data
        else:
            self._decoder.add(data)
            self._decode()
        self._account()
        self._wake()

    def feed_eof(self) -> None:
        self._ended = True
        if self._error is not None or self.discard:
            return
        if self._decoder is None:
            self._eof = True
        else:
            self._decode()
        self._account()
        self._wake()

    def _decode(self) -> None:
        d = self._decoder
        assert d is not None
        try:
            while d.pending and len(self._buf) < BUFFER_BYTES:
                out = d.decode(BUFFER_BYTES - len(self._buf), self._ended)
                if not out:
                    break  # it needs more input first
                self._buf += out
            if self._ended and not d.pending and not self._eof:
                self._buf += d.finish()
                self._eof = True
        except zlib.error as e:
            self.fail(BodyError(f"the body's content coding could not be decoded: {e}"))

    def _account(self) -> None:
        """Tell the connection how much this body holds now (it pauses reading past a bound)."""
        held = len(self._buf) + (self._decoder.pending if self._decoder is not None else 0)
        delta, self._held = held - self._held, held
        if delta > 0:
            self._conn.buffered(delta)
        elif delta < 0:
            self._conn.consumed(-delta)

    def fail(self, error: BodyError | ClientGone) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- read by the handler -------------------------------------------------------------------

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    @property
    def complete(self) -> bool:
        """The whole body arrived (read or not)."""
        return self._ended

    def read_nowait(self, n: int) -> bytes:
        """Up to ``n`` bytes of what is there; b"" when nothing is (at the end, or not yet)."""
        if not self._buf and self._error is not None:
            raise self._error
        return self._take(n)

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, waiting for some; b"" at the end."""
        while not self._buf:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take(n)

    def _take(self, n: int) -> bytes:
        if len(self._buf) <= n:
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = bytes(self._buf[:n])
            del self._buf[:n]
        if self._decoder is not None and self._error is None:
            self._decode()  # the next piece, as the reader makes room for it
        self._account()
        return data

    def drop(self) -> None:
        """The handler is done without the rest: what is buffered and what still comes goes."""
        self.discard = True
        self._buf.clear()
        if self._decoder is not None:
            self._decoder.drop()
        self._account()


class Request:
    """One client request, its head parsed: what the proxy reads."""

    __slots__ = (
        "body_exists", "conn", "content", "content_length", "decoded", "headers", "keep_alive",
        "method", "path", "target", "version",
    )  # fmt: skip

    def __init__(
        self,
        conn: Connection,
        method: str,
        target: str,
        version: tuple[int, int],
        headers: CIMultiDict[str],
        keep_alive: bool,
        content_length: int | None,
        body_exists: bool,
        decoder: _Decoder | None,
    ) -> None:
        self.conn = conn
        self.method = method
        self.target = target  # as the client sent it: path and query (the origin form)
        self.path = unquote(target.partition("?")[0])
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.body_exists = body_exists
        self.content = RequestBody(conn, decoder)
        # Its body is decoded as it arrives (and forwarded so, without Content-Encoding).
        self.decoded = decoder is not None

    @property
    def remote(self) -> str | None:
        return self.conn.peer

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport

    def expects_continue(self) -> bool:
        """The client waits for "100 Continue" before it sends its body (an HTTP/1.1 request
        with ``Expect: 100-continue``; HTTP/1.0 has no interim answers)."""
        expect = self.headers.get("Expect")
        return (
            expect is not None
            and expect.strip().lower() == "100-continue"
            and self.version >= (1, 1)
            and not self.content.complete
        )

    def send_continue(self) -> None:
        """Tell the client to send its body. Raises :class:`ClientGone` when it left."""
        try:
            self.conn.send(CONTINUE, answer=False)
        except ConnectionResetError:
            raise ClientGone("the client closed its connection") from None


class Response:
    """An answer: its status, headers and body. Written whole by the server after the handler
    returns it; a :class:`StreamResponse` is written by the handler as it goes."""

    def __init__(
        self,
        *,
        status: int = 200,
        reason: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers: CIMultiDict[str] = CIMultiDict(headers or ())
        self.body = body
        self.content_length: int | None = None
        self.keep_alive = True  # False: the connection closes after this answer

    def force_close(self) -> None:
        self.keep_alive = False


class StreamResponse(Response):
    """An answer the handler writes as it goes: :meth:`prepare`, then :meth:`write` (waits
    while the client's socket is full) or :meth:`write_nowait`, then :meth:`write_eof`. The
    status line and headers go out with the first body bytes, in one write."""

    def __init__(
        self,
        *,
        status: int = 200,
        reason: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self._conn: Connection | None = None
        self._head: bytes | None = None  # not written yet
        self.chunked = False
        self._no_body = False
        self.prepared = False
        self.eof = False
        self.output_size = 0  # body bytes written

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        self.prepared = True
        self._conn = request.conn
        self._head, self.chunked, self._no_body = request.conn.head_for(self, request)

    @property
    def writing_paused(self) -> bool:
        return self._conn is not None and self._conn.writing_paused

    def write_nowait(self, data: bytes) -> None:
        """Write ``data`` now (framed); raises ConnectionResetError when the client left."""
        conn = self._conn
        assert conn is not None, "prepare() first"
        if self._no_body:
            data = b""  # HEAD, 1xx, 204, 304: the head alone
        out = b"%x\r\n%b\r\n" % (len(data), data) if data and self.chunked else data
        if self._head is not None:
            out, self._head = self._head + out, None
        conn.send(out)
        self.output_size += len(data)

    async def write(self, data: bytes) -> None:
        self.write_nowait(data)
        await self.drain()

    async def drain(self) -> None:
        if self._conn is not None:
            await self._conn.drain()

    async def write_eof(self) -> None:
        if self.eof:
            return
        conn = self._conn
        assert conn is not None, "prepare() first"
        self.eof = True
        end = b"0\r\n\r\n" if self.chunked else b""
        if self._head is not None:
            end, self._head = self._head + end, None
        conn.send(end)


def openai_error(
    status: int, message: str, kind: str, *, retry_after_seconds: int | None = None
) -> Response:
    """An answer of the gate's own, in the shape vLLM and OpenAI use for errors."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    headers = {"Content-Type": "application/json"}
    if retry_after_seconds:
        headers["Retry-After"] = str(retry_after_seconds)
    return Response(status=status, body=json.dumps(body).encode(), headers=headers)


def json_response(doc: object, status: int = 200) -> Response:
    return Response(
        status=status,
        headers={"Content-Type": "application/json; charset=utf-8"},
        body=json.dumps(doc).encode(),
    )


class _HeadTooLong(Exception):
    """Raised in llhttp's callbacks: the head is longer than the gate reads."""


class _Malformed:
    """A request the parser refused, queued behind the requests before it on the connection:
    answered 400 in its turn, then the connection closes."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail


class Connection(asyncio.Protocol):
    """One client connection: llhttp's callbacks build its requests; :meth:`_serve` answers
    them in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = server.loop
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.guard: GuardedConn | None = None
        self._queue: collections.deque[Request | _Malformed] = collections.deque()
        self._parsing: Request | None = None  # its head is in, its body is not all in yet
        self._task: asyncio.Task[None] | None = None
        self._handling: Request | None = None  # its handler runs
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # read while a head is being parsed (one that never ends)
        self._header_bytes = 0  # of the headers parsed (a head that ends, but too long)
        self._in_head = True
        self._broken = False  # the parser refused its input: nothing more is read
        self._last_closes = False  # the last request parsed closes the connection after it
        self._buffered = 0  # body bytes fed and not yet read by handlers
        self.reading_paused = False
        self.writing_paused = False
        # Bytes handed to the transport: less what it still holds, what the client took
        # (the guard's send deadline watches it move).
        self.bytes_out = 0
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closing = False  # no request after the current one
        self.answer_started = False  # a byte of the current answer went out
        self._lost = False

    # --- the transport's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.guard = self._server.guard.accepted(self, time.monotonic())

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._server.guard.lost(self)
        self._server.connections.discard(self)
        gone = ClientGone("the client closed its connection")
        if self._parsing is not None:
            self._parsing.content.fail(gone)
        for item in self._queue:
            if isinstance(item, Request):
                item.content.fail(gone)
        self._queue.clear()
        if self._handling is not None:
            self._handling.content.fail(gone)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops (and counts it so)
        self._wake_drain()
        self.transport = None

    def eof_received(self) -> bool:
        # The client half-closed: taken as a client that left (as aiohttp's server took it,
        # and as nginx does by default): the transport closes, and the handler of its request
        # is cancelled, which aborts its request in vLLM.
        return False

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError("the client's connection is closed")
        if not self.writing_paused:
            return
        self._drain_waiter = self._loop.create_future()
        await self._drain_waiter
        if self._lost:
            raise ConnectionResetError("the client's connection is closed")

    def data_received(self, data: bytes) -> None:
        if self.guard is not None:
            self.guard.bytes_in += len(data)
        if self._broken:
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade (WebSocket, h2c) is answered as an ordinary request; nothing after its
            # head is read, and the connection closes after the answer.
            self._broken = True
            self.closing = True
        except httptools.HttpParserError as e:
            if self._last_closes:
                # Bytes after a request that closes the connection (Connection: close, an
                # HTTP/1.0 one): not read, and not the client's fault to count.
                self._broken = True
                return
            # A callback's own exception comes wrapped (HttpParserCallbackError).
            cause = e.__context__ if isinstance(e.__context__, _HeadTooLong) else e
            self._refused(str(cause) or type(cause).__name__)
            return
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
            self._refused(f"a request head longer than {MAX_HEAD_BYTES} bytes")
            return
        if len(self._queue) >= MAX_PIPELINED:
            self._pause_reading()

    def _refused(self, detail: str) -> None:
        """The parser refused the input: a body being read fails; the head is answered 400 in
        its turn (then the connection closes); nothing more is read."""
        self._broken = True
        if self._parsing is not None:
            # Its head was fine, its body broke: its handler, reading it, answers 400, and the
            # connection closes after that answer. (Queued behind another request, it is not
            # answered: the connection closes after the one before it.)
            self.closing = True
            self._parsing.content.fail(BodyError(f"the request body's framing broke: {detail}"))
            self._parsing = None
            return
        self._server.malformed.note("head", self.peer, detail)
        self._queue.append(_Malformed(detail))
        self._start()

    # --- llhttp's callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url.clear()
        self._headers.clear()
        self._header_bytes = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise _HeadTooLong(f"a request target longer than {MAX_LINE_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        if size > MAX_LINE_BYTES:
            raise _HeadTooLong(f"a header line longer than {MAX_LINE_BYTES} bytes")
        self._header_bytes += size + 4
        if self._header_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLong(f"a request head longer than {MAX_HEAD_BYTES} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if len(self._queue) >= MAX_QUEUED:
            raise _HeadTooLong(f"more than {MAX_QUEUED} requests sent ahead of their answers")
        p = self._parser
        self._in_head = False
        self._head_bytes = 0
        headers: CIMultiDict[str] = CIMultiDict()
        length: int | None = None
        chunked = False
        codings: list[str] = []
        for name, value in self._headers:
            k = name.decode("utf-8", "surrogateescape")
            v = value.decode("utf-8", "surrogateescape")
            headers.add(k, v)
            lk = k.lower()
            if lk == "content-length":
                length = int(v)  # llhttp checked it: digits, and one value
            elif lk == "transfer-encoding":
                chunked = chunked or "chunked" in v.lower()
            elif lk == "content-encoding":
                codings += [c for c in (c.strip().lower() for c in v.split(",")) if c]
        major, _, minor = p.get_http_version().partition(".")
        body_exists = chunked or bool(length)
        decoder: _Decoder | None = None
        refused: str | None = None
        codings = [c for c in codings if c != "identity"]
        if codings and body_exists:
            # One coding the gate reads, or none: it must read the JSON inside, and forwards
            # it decoded (vLLM's server decodes no request body).
            if len(codings) == 1 and codings[0] in DECODED_CODINGS:
                decoder = _Decoder(codings[0])
            else:
                refused = (
                    f"the gate does not decode a body of Content-Encoding {', '.join(codings)!r}"
                )
        request = Request(
            self,
            p.get_method().decode("ascii", "replace"),
            _origin_form(self._url.decode("utf-8", "surrogateescape")),
            (int(major or 1), int(minor or 1)),
            headers,
            p.should_keep_alive(),
            length,
            body_exists,
            decoder,
        )
        if refused is not None:
            request.content.fail(BodyError(refused))
        self._parsing = request
        if self.guard is not None:
            self.guard.head_in = True
        self._queue.append(request)
        self._start()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.content.feed(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._last_closes = not self._parser.should_keep_alive()
        if self._parsing is not None:
            self._parsing.content.feed_eof()
            self._parsing = None

    # --- flow control --------------------------------------------------------------------------

    def buffered(self, n: int) -> None:
        self._buffered += n
        if self._buffered > BUFFER_BYTES:
            self._pause_reading()

    def consumed(self, n: int) -> None:
        self._buffered -= n
        if self._buffered <= BUFFER_BYTES // 2 and len(self._queue) < MAX_PIPELINED:
            self._resume_reading()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self._broken:
            self.reading_paused = False
            self.transport.resume_reading()

    # --- answering -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self._queue and not self._lost:
                item = self._queue.popleft()
                if len(self._queue) < MAX_PIPELINED and self._buffered <= BUFFER_BYTES // 2:
                    self._resume_reading()
                if isinstance(item, _Malformed):
                    self._answer_malformed()
                    self.closing = True
                    return
                if not await self._answer(item):
                    self.closing = True
                    return
        except asyncio.CancelledError:
            pass  # the client left (connection_lost), or the server stopped: closed below
        finally:
            self._task = None
            self._handling = None
            if self._lost or self.closing:
                self.close()

    async def _answer(self, request: Request) -> bool:
        """Run the handler for ``request`` and write its answer; whether the connection takes
        another request."""
        self._handling = request
        self.answer_started = False
        guard = self.guard
        if guard is not None:
            self._server.guard.busy(guard, time.monotonic())

        def body_read() -> None:
            if guard is not None:
                guard.reading = False

        resp: Response | None = None
        try:
            resp = await self._server.handler(request, body_read)
            await self._finish(request, resp)
        except ConnectionResetError:
            return False
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("gate: error handling %s %s", request.method, request.path)
            if self.answer_started or self.transport is None:
                return False
            resp = Response(status=500, body=b"500 Internal Server Error")
            resp.force_close()
            with contextlib.suppress(ConnectionResetError):
                await self._finish(request, resp)
            return False
        finally:
            self._handling = None
            if guard is not None:
                self._server.guard.idle(guard, time.monotonic())
        # What the handler left of the body goes: read and dropped until the request ends.
        incomplete = not request.content.complete
        request.content.drop()
        # A body not all sent when the answer went (a refusal; a client still waiting for
        # "100 Continue"): the connection closes rather than wait for the rest.
        return resp.keep_alive and request.keep_alive and not self.closing and not incomplete

    async def _finish(self, request: Request, resp: Response) -> None:
        if isinstance(resp, StreamResponse):
            if not resp.prepared:
                await resp.prepare(request)
            await resp.write_eof()
            return
        resp.content_length = len(resp.body)
        if not request.content.complete:
            resp.keep_alive = False  # see _answer: said in the head
        head, _, no_body = self.head_for(resp, request)
        self.send(head if no_body or not resp.body else head + resp.body)
        await self.drain()

    def head_for(self, resp: Response, request: Request) -> tuple[bytes, bool, bool]:
        """``resp``'s status line and headers, and how its body is framed: (head, chunked,
        no body)."""
        status = resp.status
        no_body = request.method == "HEAD" or status in _NO_BODY_STATUSES or status < 200
        keep = resp.keep_alive and request.keep_alive and not self.closing
        chunked = False
        h = resp.headers
        lines = [
            f"HTTP/1.1 {status} {resp.reason or _REASONS.get(status, 'Unknown')}",
            *(f"{k}: {v}" for k, v in h.items()),
        ]
        if "Date" not in h:
            lines.append(f"Date: {self._server.date()}")
        if resp.content_length is not None:
            if status not in _NO_BODY_STATUSES and status >= 200:
                lines.append(f"Content-Length: {resp.content_length}")
        elif not no_body:
            if request.version >= (1, 1):
                chunked = True
                lines.append("Transfer-Encoding: chunked")
            else:
                keep = False  # HTTP/1.0 and no length: the close ends the body
        if not keep:
            resp.keep_alive = False
            lines.append("Connection: close")
        elif request.version < (1, 1):
            lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        return head, chunked, no_body

    def _answer_malformed(self) -> None:
        resp = openai_error(400, "the gate could not parse the request", "BadRequestError")
        head = "\r\n".join(
            [
                "HTTP/1.1 400 Bad Request",
                *(f"{k}: {v}" for k, v in resp.headers.items()),
                f"Date: {self._server.date()}",
                f"Content-Length: {len(resp.body)}",
                "Connection: close",
            ]
        )
        with contextlib.suppress(ConnectionResetError):  # gone: nothing to answer
            self.send(head.encode() + b"\r\n\r\n" + resp.body)

    def send(self, data: bytes, *, answer: bool = True) -> None:
        """Every write to the client: ``data`` counted in :attr:`bytes_out` (the guard's send
        deadline) and, for an ``answer``'s bytes, the answer marked started. Raises
        ConnectionResetError when the client left, whether or not there is data."""
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        if data:
            t.write(data)
            self.bytes_out += len(data)
            self.answer_started = self.answer_started or answer

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def idle(self) -> bool:
        """No request being answered or waiting its turn."""
        return self._task is None and not self._queue

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task


class _Decoder:
    """A coded body, decoded piece by piece as its reader asks: ``gzip`` (one member or
    several, as RFC 1952 allows), or ``deflate`` zlib-wrapped as RFC 9110 says or raw as some
    clients send it (its first two bytes tell which: a zlib header's check bits). Bytes after
    the coded stream's end that begin no gzip member are not the body's: an error."""

    def __init__(self, coding: str) -> None:
        self._gzip = coding != "deflate"
        self._d: zlib._Decompress | None = (
            zlib.decompressobj(16 + zlib.MAX_WBITS) if self._gzip else None
        )
        self._tail = b""  # coded bytes not decoded yet
        self._members = 1

    @property
    def pending(self) -> int:
        return len(self._tail)

    def add(self, data: bytes) -> None:
        self._tail = self._tail + data if self._tail else data

    def decode(self, max_bytes: int, ended: bool) -> bytes:
        """At most ``max_bytes`` of the body; b"" when it needs more input first. Raises
        zlib.error for a broken coding or bytes after its end."""
        if self._d is None:
            t = self._tail
            if len(t) < 2 and not ended:
                return b""
            wrapped = len(t) >= 2 and t[0] & 0x0F == 8 and (t[0] << 8 | t[1]) % 31 == 0
            self._d = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        while True:
            if self._d.eof:
                if not self._tail:
                    return b""
                if not (self._gzip and self._tail[:1] == b"\x1f"):
                    raise zlib.error("bytes after the end of the coded body")
                self._members += 1
                if self._members > MAX_GZIP_MEMBERS:
                    # Each member's end copies what follows it (zlib's unused_data): many
                    # tiny ones would cost CPU by the square of their number.
                    raise zlib.error(f"more than {MAX_GZIP_MEMBERS} gzip members")
                self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)  # the next gzip member
            out = self._d.decompress(self._tail, max_bytes)
            # After the stream's end zlib keeps what follows in unused_data: ours to judge.
            self._tail = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            if out or not (self._d.eof and self._tail):
                return out

    def finish(self) -> bytes:
        """The rest, once all the coded bytes are decoded; raises zlib.error when the coded
        stream is not complete."""
        d = self._d if self._d is not None else zlib.decompressobj(-zlib.MAX_WBITS)
        rest = d.flush()
        if not d.eof:
            raise zlib.error("the coded body ended before its stream did")
        return rest

    def drop(self) -> None:
        self._tail = b""


def _origin_form(target: str) -> str:
    """The request target as a path and query: an absolute form (``http://host/p?q``, which a
    server must accept) is cut to its path and query; the origin form passes as it came."""
    if target.startswith("/") or target == "*":
        return target
    parts = urlsplit(target)
    if parts.scheme and parts.netloc:
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return target


class HttpServer:
    """The protocol factory for the listening socket, and what the gate stops: every
    connection, the guard's reaper, the handlers."""

    def __init__(
        self,
        handler: Handler,
        guard: ConnectionGuard,
        malformed: MalformedRequests,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.handler = handler
        self.guard = guard
        self.malformed = malformed
        self.loop = loop
        self.connections: set[Connection] = set()
        self._date_second = -1
        self._date = ""

    def __call__(self) -> Connection:
        conn = Connection(self)
        self.connections.add(conn)
        return conn

    def date(self) -> str:
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date = email.utils.formatdate(now, usegmt=True)
        return self._date

    def retire(self) -> None:
        """No request after the current one on any connection; idle ones close now."""
        for conn in list(self.connections):
            conn.closing = True
            if conn.idle:
                conn.close()

    async def shutdown(self, timeout_seconds: float) -> None:
        """Close idle connections, give the busy ones ``timeout_seconds`` to finish their
        answer, then cancel their handlers and close them."""
        self.retire()
        tasks = [t for c in self.connections if (t := c.task) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_seconds)
        for conn in list(self.connections):
            task = conn.task
            if task is not None and not task.done():
                task.cancel()
        tasks = [t for c in self.connections if (t := c.task) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        await self.guard.stop()
