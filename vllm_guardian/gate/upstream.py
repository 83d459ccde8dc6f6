"""The proxy's client to vLLM: keep-alive HTTP/1.1 connections, one request at a time on each.

Where it sits: :class:`~vllm_guardian.gate.proxy.GateProxy` sends every admitted exchange
through :class:`UpstreamPool`, and the follower polls vLLM through pools of its own (no
aiohttp client in the gate at all). Why not aiohttp's client: on the bench's stub it cost ~0.14 ms of CPU per
request against ~0.04 ms for writing the request and reading the answer on a plain asyncio
stream, a third of the gate's whole CPU per request; and on two shared cores a proxy's tail
follows its CPU per request (docs/gate.md, "Where the gate's tail goes").

What it does and does not do, on purpose:

* the request goes out in one write: request line, ``Host``, the headers it is given, a
  ``Content-Length`` when there is a body (or the client sent one), then the body;
* the answer's framing follows RFC 9112 §6.3: no body for HEAD, 1xx, 204 and 304;
  ``Transfer-Encoding: chunked`` decoded as it arrives (the proxy re-frames it for its client);
  ``Content-Length``; otherwise until the upstream closes (that connection is not reused);
* a connection goes back to the pool only when its answer was read to the end and neither
  side said ``Connection: close``; an idle one the upstream closed (a restart) is dropped when
  next taken, before anything is written to it, and one idle longer than
  ``keepalive_seconds`` is closed instead of reused;
* a request on a kept connection that the upstream closes (or resets) before a byte of answer
  is sent again once, on a new connection (:attr:`UpstreamPool.stale_retries`): the server's
  keep-alive timer closed it as the request arrived (vLLM closes a connection idle for 5 s, and
  on a busy server the timer and the request race), so vLLM's handler never had it. Not on a
  new connection, not after any byte of answer, not for an exchange taken back: those are the
  upstream's failures, the proxy's to count and decide on;
* errors are one type, :class:`UpstreamError`, with the phase the proxy counts them under; no
  redirects, cookies, decompression or proxies (the gate forwards, it does not browse);
* :meth:`UpstreamPool.take_back` closes the connections of the exchanges under way that their
  sender marked ``saveable`` (a hung engine: the follower's progress watch). Their reads fail as
  a cut would, which is what the proxy retries and the relay continues, and vLLM aborts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from multidict import CIMultiDict

# An answer's status line and headers: vLLM's are a few hundred bytes.
MAX_HEAD_BYTES = 64 * 1024
# What one read hands to the proxy at most (it writes each piece to its client as it comes).
READ_BYTES = 256 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A body up to this size goes out in the same write as the head.
_COALESCE_BYTES = 64 * 1024
# How long an idle connection is kept for reuse: under vLLM's own keep-alive limit
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so that the gate, not the server, closes it.
KEEPALIVE_SECONDS = 4.0


class UpstreamError(Exception):
    """The exchange with the upstream failed: ``connect`` (no connection), ``before_first_byte``
    (no complete answer head) or ``streaming`` (the body was cut or malformed)."""

    def __init__(
        self,
        phase: str,
        detail: str,
        *,
        taken_back: bool = False,
        unanswered: bool = False,
        timed_out: bool = False,
    ) -> None:
        super().__init__(detail)
        self.phase = phase
        self.taken_back = taken_back  # the gate closed it (UpstreamPool.take_back)
        # The connect timed out: the server's listen queue is full (a busy server accepts
        # late), or it is unreachable; not a refusal. Only with phase "connect".
        self.timed_out = timed_out
        # The connection closed or reset before a byte of answer came (on a kept connection,
        # the server's keep-alive close racing the request: UpstreamPool sends it again).
        self.unanswered = unanswered


class BodySink(Protocol):
    """Where :meth:`UpstreamResponse.stream` hands an answer's body, in the event loop's own
    callbacks (no task switch per piece)."""

    def body(self, data: bytes) -> None:
        """The next piece of the body (its framing removed)."""

    def end(self, error: UpstreamError | None) -> None:
        """The body is complete (None), or failed: called once, and nothing after it."""


class _Link(asyncio.Protocol):
    """One upstream connection's bytes. Read by awaiting (:meth:`read`, :meth:`readuntil`, with
    asyncio.StreamReader's results and errors) for an answer's head and a small body, or handed
    to a sink as they arrive for a streamed body (:meth:`UpstreamResponse.stream`): an SSE
    event then costs a callback, not a future, a task switch and a chain of awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._eof = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_paused = False  # by this link's buffer limit, not by a sink's owner
        self.sink: UpstreamResponse | None = None

    # --- the transport's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink._feed(data)
            return
        self._buf += data
        self._wake()
        if len(self._buf) > 2 * MAX_HEAD_BYTES and not self._read_paused:
            assert self.transport is not None
            self._read_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        if self.sink is not None:
            self.sink._lost(None)
        return False  # close the transport: a half-closed upstream answers nothing more

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._eof = True
        else:
            self._error = exc
        self._wake()
        drain, self._drain_waiter = self._drain_waiter, None
        if drain is not None and not drain.done():
            if exc is None:
                drain.set_result(None)
            else:
                drain.set_exception(exc)
        if self.sink is not None:
            self.sink._lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drain, self._drain_waiter = self._drain_waiter, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- reading by awaiting ---------------------------------------------------------------------

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _taken(self, n: int) -> bytes:
        data = bytes(self._buf[:n])
        del self._buf[:n]
        if self._read_paused and len(self._buf) <= MAX_HEAD_BYTES:
            assert self.transport is not None
            self._read_paused = False
            self.transport.resume_reading()
        return data

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes as they come; ``b""`` at the end; the connection's error if it
        failed (asyncio.StreamReader.read's results)."""
        while not self._buf:
            if self._eof:
                return b""
            await self._wait()
        if self._error is not None:
            raise self._error
        return self._taken(n)

    async def readuntil(self, separator: bytes) -> bytes:
        """Up to and including ``separator`` (asyncio.StreamReader.readuntil's results and
        errors, with MAX_HEAD_BYTES as its limit)."""
        offset = 0
        while True:
            found = self._buf.find(separator, offset)
            if found >= 0:
                end = found + len(separator)
                if end > MAX_HEAD_BYTES:
                    raise asyncio.LimitOverrunError("separator found past the limit", found)
                return self._taken(end)
            if len(self._buf) > MAX_HEAD_BYTES:
                raise asyncio.LimitOverrunError("separator not found within the limit", offset)
            if self._error is not None:
                raise self._error
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, None)
            offset = max(0, len(self._buf) - len(separator) + 1)
            await self._wait()

    def take_buffered(self) -> bytes:
        """What arrived and was not read yet (a sink's owner takes it first)."""
        return self._taken(len(self._buf)) if self._buf else b""

    # --- writing ---------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        if self._error is not None:
            raise self._error
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        if self._write_paused:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        # A sink still set hears of it (connection_lost): take_back cuts a streamed answer so.
        if self.transport is not None:
            self.transport.close()


class _Conn:
    __slots__ = ("idle_since", "link", "saveable", "taken_back")

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.idle_since = 0.0
        # While busy: whether take_back may close it (its exchange can be sent again or
        # continued), and whether it did.
        self.saveable = False
        self.taken_back = False

    def usable(self, now: float, keepalive_seconds: float) -> bool:
        return (
            not self.link.is_closing()
            and not self.link.at_eof()
            and now - self.idle_since < keepalive_seconds
        )

    def close(self) -> None:
        self.link.close()


class UpstreamResponse:
    """One answer's head, and its body read piece by piece with :meth:`read`."""

    def __init__(
        self,
        pool: UpstreamPool,
        conn: _Conn,
        status: int,
        reason: str,
        headers: CIMultiDict[str],
        *,
        head_request: bool,
    ) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self._origin = conn  # kept after release: whether it was taken back
        self.status = status
        self.reason = reason
        self.headers = headers
        self.chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self.content_length: int | None = None
        raw_length = headers.get("Content-Length")
        if not self.chunked and raw_length is not None:
            try:
                self.content_length = int(raw_length)
            except ValueError:
                raise UpstreamError("before_first_byte", "bad Content-Length") from None
            if self.content_length < 0:
                raise UpstreamError("before_first_byte", "bad Content-Length")
        self._keep = "close" not in headers.get("Connection", "").lower()
        self._eof = False
        # A byte of the body arrived: vLLM sends a streamed answer's headers before the engine
        # has the request, so only the body says the request reached it (gate/proxy.py's
        # unanswered requests).
        self.body_started = False
        self._chunk_left = 0  # chunked: bytes left in the current chunk
        self._crlf_due = False  # chunked: the CRLF after a chunk's data is next
        self._trailers = False  # chunked: the last chunk was read, trailers follow
        self._left = 0  # Content-Length: bytes left (-1: until the upstream closes)
        self._raw = b""  # chunked: bytes read and not parsed yet
        self._sink: BodySink | None = None  # stream(): who gets the body as it arrives
        self._paused = False  # pause(): the upstream's reads stopped for the sink's reader
        if head_request or status in _NO_BODY_STATUSES or 100 <= status < 200:
            self._eof = True
        elif self.chunked:
            pass
        elif self.content_length is not None:
            self._left = self.content_length
            self._eof = self._left == 0
        else:
            self._keep = False  # delimited by the close: the connection ends with it
            self._left = -1

    def at_eof(self) -> bool:
        return self._eof

    @property
    def taken_back(self) -> bool:
        """The gate closed this answer's connection (:meth:`UpstreamPool.take_back`)."""
        return self._origin.taken_back

    def set_saveable(self, saveable: bool) -> None:
        """Whether :meth:`UpstreamPool.take_back` may close this answer's connection from now."""
        self._origin.saveable = saveable

    async def read(self) -> bytes:
        """The next piece of the body as it arrives; ``b""`` once it is complete."""
        data = await self._read_body()
        if data:
            self.body_started = True
            self._pool.last_data_monotonic = time.monotonic()
        return data

    async def read_at_most(self, limit: int) -> bytes:
        """The body's pieces until it ends or ``limit`` bytes are in: all of a shorter body,
        else at least ``limit`` bytes (the last piece whole; a caller that keeps no more cuts)."""
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = await self.read()
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    async def _read_body(self) -> bytes:
        if self._eof:
            return b""
        conn = self._conn
        if conn is None:
            raise UpstreamError("streaming", "the connection is closed")
        try:
            if self.chunked:
                return await self._read_chunked(conn.link)
            if self._left < 0:  # until the upstream closes
                data = await conn.link.read(READ_BYTES)
                if not data:
                    self._eof = True
                return data
            data = await conn.link.read(min(self._left, READ_BYTES))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            raise UpstreamError("streaming", type(e).__name__) from None
        if not data:
            raise UpstreamError("streaming", "the upstream closed the connection mid-answer")
        self._left -= len(data)
        self._eof = self._left == 0
        return data

    async def _read_chunked(self, reader: _Link) -> bytes:
        # One read of what has arrived, its framing parsed here: one await per piece (an SSE
        # event is one chunk), not three (size line, data, CRLF), and every chunk that came in
        # one packet handed on at once.
        while True:
            data = self._parse_chunks()
            if data or self._eof:
                return data
            more = await reader.read(READ_BYTES)
            if not more:
                raise asyncio.IncompleteReadError(b"", self._chunk_left)
            self._raw = self._raw + more if self._raw else more

    def _parse_chunks(self) -> bytes:
        """The payload of the chunks in ``_raw`` (what is complete of them), framing consumed."""
        raw, pos, end_of_raw = self._raw, 0, len(self._raw)
        pieces: list[bytes] = []
        while pos < end_of_raw:
            if self._chunk_left:
                take = min(self._chunk_left, end_of_raw - pos)
                pieces.append(raw[pos : pos + take])
                pos += take
                self._chunk_left -= take
                self._crlf_due = self._chunk_left == 0
                continue
            if self._crlf_due:
                if end_of_raw - pos < 2:
                    break
                if raw[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self._crlf_due = False
                continue
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                if end_of_raw - pos > MAX_HEAD_BYTES:
                    raise ValueError("chunk size line too long")
                break
            line, pos = raw[pos:eol], eol + 2
            if self._trailers:  # not forwarded (the proxy re-frames the body)
                if not line:
                    self._eof = True
                    if pos < end_of_raw:  # bytes past the answer: the connection is not reused
                        self._keep = False
                    break
                continue
            size = int(line.split(b";", 1)[0].strip(), 16)  # ValueError: malformed
            if size < 0:
                raise ValueError("negative chunk size")
            if size == 0:
                self._trailers = True
            self._chunk_left = size
        self._raw = raw[pos:] if pos < end_of_raw else b""
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    # --- the body handed to a sink as it arrives ------------------------------------------------

    def stream(self, sink: BodySink) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, in the loop's callbacks: what
        has arrived already at once, then each read. Ends with ``sink.end`` (also when the
        body was complete already); :meth:`unstream` hands it back to :meth:`read`."""
        conn = self._conn
        if conn is None:
            sink.end(UpstreamError("streaming", "the connection is closed"))
            return
        self._sink = sink
        link = conn.link
        link.sink = self
        buffered = link.take_buffered()
        if buffered or self._raw:
            self._feed(buffered)
        if self._sink is not None and self._eof:
            self._finish(None)
        elif self._sink is not None and (link._eof or link._error is not None):
            self._lost(link._error)

    def unstream(self) -> None:
        """Reads go back to :meth:`read` (what arrives from now on waits for it). A pause
        stays: the reader resumes when it is ready for more (:meth:`resume`)."""
        self._sink = None
        if self._conn is not None:
            self._conn.link.sink = None

    def pause(self) -> None:
        """Stop reading from the upstream (its sink's reader is slower than it)."""
        conn = self._conn
        if conn is not None and conn.link.transport is not None and not self._paused:
            self._paused = True
            conn.link.transport.pause_reading()

    def resume(self) -> None:
        conn = self._conn
        if conn is not None and conn.link.transport is not None and self._paused:
            self._paused = False
            conn.link.transport.resume_reading()

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is None:
            return
        if self.chunked:
            whole = self._one_chunk(data)
            if whole is not None:
                data = whole
            else:
                self._raw = self._raw + data if self._raw else data
                try:
                    data = self._parse_chunks()
                except ValueError as e:
                    self._finish(UpstreamError("streaming", type(e).__name__))
                    return
        elif self._left >= 0:
            if len(data) > self._left:  # bytes past the answer: not the body's, and the
                self._keep = False  # connection is out of step for the next exchange
                data = data[: self._left]
            self._left -= len(data)
            self._eof = self._left == 0
        if data:
            self.body_started = True
            self._pool.last_data_monotonic = time.monotonic()
            sink.body(data)
        if self._eof and self._sink is sink:
            self._finish(None)

    def _one_chunk(self, data: bytes) -> bytes | None:
        """The payload when ``data`` is exactly one whole chunk and nothing is pending (an SSE
        event as vLLM writes it, read as it came): what :meth:`_parse_chunks` would return,
        without its general walk. None: anything else (then that walk)."""
        if self._raw or self._chunk_left or self._crlf_due or self._trailers:
            return None
        eol = data.find(b"\r\n", 0, 18)
        if eol <= 0:
            return None
        try:
            size = int(data[:eol], 16)
        except ValueError:
            return None  # an extension, or malformed: the walk says which
        end = eol + 2 + size
        if size <= 0 or len(data) != end + 2 or data[end:] != b"\r\n":
            return None
        return data[eol + 2 : end]

    def _lost(self, error: Exception | None) -> None:
        """The connection ended under a sink: the body's end when it is delimited by the close,
        else a cut."""
        if self._sink is None:
            return
        if error is None and not self.chunked and self._left < 0:
            self._eof = True
            self._finish(None)
            return
        detail = (
            type(error).__name__
            if error is not None
            else "the upstream closed the connection mid-answer"
        )
        self._finish(UpstreamError("streaming", detail))

    def _finish(self, error: UpstreamError | None) -> None:
        sink, self._sink = self._sink, None
        if self._conn is not None:
            self._conn.link.sink = None
        if sink is not None:
            sink.end(error)

    def release(self) -> None:
        """The exchange is over: a complete answer's connection is kept for the next one,
        any other is closed (for an unfinished answer, how vLLM learns to abort it)."""
        self.unstream()
        self.resume()  # a kept connection reads again for its next exchange
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._pool._busy.discard(conn)
        if self._eof and self._keep:
            self._pool._put(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections to one upstream (``http://`` or ``https://`` base URL)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_seconds: float = 5.0,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        max_idle: int = 256,
        on_stale_retry: Callable[[], None] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r}: expected http://HOST:PORT")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        default = (parts.scheme, self.port) in (("http", 80), ("https", 443))
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default else f"{host}:{self.port}"
        self.base_path = parts.path.rstrip("/")
        self.connect_timeout_seconds = connect_timeout_seconds
        self.keepalive_seconds = keepalive_seconds
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()  # handed out for an exchange, not released yet
        self._closed = False
        # When a byte of an answer's body last arrived (time.monotonic(); None: never): the
        # server is alive and writing, whatever its /health poll says (gate/follower.py).
        self.last_data_monotonic: float | None = None
        self.stale_retries = 0  # requests sent again after a kept connection closed unanswered
        self._on_stale_retry = on_stale_retry  # and who counts them (the gate's metric)

    async def request(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]],
        body: bytes | bytearray | None,
        *,
        saveable: bool = False,
    ) -> UpstreamResponse:
        """Send one request (``target``: path and query, appended to the base URL's path) and
        read its answer's head. Raises :class:`UpstreamError`. ``saveable``: :meth:`take_back`
        may close it (the sender can send it again or continue it)."""
        lines = [f"{method} {self.base_path}{target} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        elif method in _BODY_METHODS:
            lines.append("Content-Length: 0")  # as aiohttp's client did: an empty body, said so
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        conn, kept = await self._take()
        while True:
            conn.saveable, conn.taken_back = saveable, False
            self._busy.add(conn)
            try:
                return await self._exchange(conn, head, body, head_request=method == "HEAD")
            except UpstreamError as e:
                self._busy.discard(conn)
                e.taken_back = conn.taken_back
                if not (kept and e.unanswered and not conn.taken_back):
                    raise
            except BaseException:
                self._busy.discard(conn)
                raise
            self.stale_retries += 1
            if self._on_stale_retry is not None:
                self._on_stale_retry()
            conn, kept = await self._connect(), False

    def take_back(self) -> int:
        """Close the connection of every exchange under way that is marked saveable (the
        engine behind them is hung); how many. Each one's pending read fails like a cut."""
        taken = 0
        for conn in [c for c in self._busy if c.saveable and not c.taken_back]:
            conn.taken_back = True
            conn.close()
            taken += 1
        return taken

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes | bytearray | None, *, head_request: bool
    ) -> UpstreamResponse:
        try:
            link = conn.link
            if body and len(body) > _COALESCE_BYTES:
                link.write(head)  # no copy of a large body just to save a write
                link.write(body)
            else:
                link.write(head + body if body else head)
            if link.write_buffer_size() > 0:
                await link.drain()
            return await self._read_head(conn, head_request=head_request)
        except (ConnectionResetError, BrokenPipeError) as e:  # before a byte of answer
            conn.close()
            raise UpstreamError("before_first_byte", type(e).__name__, unanswered=True) from None
        except UpstreamError:
            conn.close()
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            conn.close()
            raise UpstreamError("before_first_byte", type(e).__name__) from None
        except BaseException:  # cancelled: the half-done exchange cannot be reused
            conn.close()
            raise

    async def _read_head(self, conn: _Conn, *, head_request: bool) -> UpstreamResponse:
        first = True  # no byte of answer yet (an interim 1xx answer is one)
        while True:
            try:
                raw = await conn.link.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise UpstreamError(
                        "before_first_byte", "the upstream closed the connection", unanswered=first
                    ) from None
                raise
            except (ConnectionResetError, BrokenPipeError) as e:
                if first:
                    raise
                raise UpstreamError("before_first_byte", type(e).__name__) from None
            first = False
            lines = raw[:-4].decode("utf-8", "surrogateescape").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
                raise UpstreamError("before_first_byte", f"not an HTTP/1 answer: {lines[0][:80]!r}")
            status = int(code)
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise UpstreamError("before_first_byte", f"malformed header line {line[:80]!r}")
                headers.add(name, value.strip(" \t"))
            if 100 <= status < 200 and status != 101:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            response = UpstreamResponse(
                self, conn, status, reason, headers, head_request=head_request
            )
            if version == "HTTP/1.0" and "keep-alive" not in headers.get("Connection", "").lower():
                response._keep = False
            return response

    async def _take(self) -> tuple[_Conn, bool]:
        """A connection for the next exchange, and whether it was kept from an earlier one."""
        now = time.monotonic()  # closed: no idle ones left, and _connect refuses
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self.keepalive_seconds):
                return conn, True
            conn.close()
        return await self._connect(), False

    async def _connect(self) -> _Conn:
        """A new connection within ``connect_timeout_seconds``; the TLS handshake, if any,
        within as long again."""
        if self._closed:
            raise UpstreamError("connect", "the gate is shutting down")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise UpstreamError("connect", type(e).__name__) from None
        sock: socket.socket | None = None
        failure: UpstreamError | None = None
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await _connected(loop, sock, address, self.connect_timeout_seconds)
                break
            except TimeoutError:
                failure = UpstreamError("connect", "TimeoutError", timed_out=True)
            except OSError as e:
                failure = UpstreamError("connect", type(e).__name__)
            except BaseException:  # cancelled: the exchange's client left
                sock.close()
                raise
            sock.close()
            sock = None
        if sock is None:
            raise failure or UpstreamError("connect", f"{self.host} resolves to no address")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _, link = await loop.create_connection(
                lambda: _Link(loop),
                sock=sock,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl is not None else None,
                ssl_handshake_timeout=self.connect_timeout_seconds if self._ssl else None,
            )
        except TimeoutError:
            sock.close()
            raise UpstreamError("connect", "TimeoutError", timed_out=True) from None
        except OSError as e:
            sock.close()
            raise UpstreamError("connect", type(e).__name__) from None
        except BaseException:
            sock.close()
            raise
        return _Conn(link)

    def _put(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections; exchanges under way close theirs when they end."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _connected(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, address: tuple[Any, ...], timeout: float
) -> None:
    """Connect ``sock`` (non-blocking) within ``timeout`` seconds, raising TimeoutError or the
    connect's OSError. At the deadline the kernel is asked whether the connect is done: a loop
    that woke late (a starved host) finds the deadline and the finished connect in the same
    turn, and a connect that worked is not thrown away as timed out."""
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # comes in the turn the connect completes (tests/test_gate_cancel.py).
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, address)
    except TimeoutError:
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, os.strerror(error)) from None
        try:
            sock.getpeername()  # ENOTCONN while the handshake is still under way
        except OSError:
            raise TimeoutError from None
