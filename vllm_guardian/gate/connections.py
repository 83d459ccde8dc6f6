"""The gate's connection guard: a cap on open client connections and a deadline for idle ones.

Where it sits: between the listening socket and the proxy. aiohttp's server has no deadline
for a request head, so a client that sends half a request holds its connection (and a
descriptor) forever; ~1,000 of them and a normal POST got no answer at all. Here:

* a connection is *busy* from the moment its request body has been read (the proxy says so)
  until its answer is done, *reading* while the proxy waits for its body (the body's own
  deadline and rate floor apply: ``body.py``), and *idle* otherwise (sending its head, or
  kept alive between requests);
* an idle connection is closed after ``idle_timeout_seconds``: the request-head deadline and
  the keep-alive limit in one;
* at ``max_connections`` open, a new connection closes the one that has waited for its client
  the longest (idle, or reading a body); when every connection is busy, the new one is closed
  at once. A real client sends its head and body at once and becomes busy at once, so it is
  served during an attack of any size, heads that never end or bodies that never come;
* a request the gate cannot parse gets a 400 in OpenAI's error shape and is counted
  (:class:`MalformedRequests`), never logged with a traceback: any client can send them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import resource
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.proxy import openai_error

log = logging.getLogger("vllm_guardian.gate")

# The proxy's handler: the request, and what to call once its body is read.
Handler = Callable[[web.BaseRequest, Callable[[], None]], Awaitable[web.StreamResponse]]


class MalformedRequests:
    """Requests the gate could not parse: counted by phase (``head``: aiohttp's parser refused
    the request head; ``body``: its framing or encoding broke while the proxy read it), each
    logged at DEBUG, and at most one WARNING line per ``log_interval_seconds`` saying how many
    there were. Never a traceback: a malformed request is the client's doing, and any client
    could otherwise fill the log."""

    def __init__(
        self,
        metrics: GateMetrics,
        log_interval_seconds: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._interval_seconds = log_interval_seconds
        self._now = monotonic
        self._next_warning_monotonic = -math.inf
        self._unreported = 0

    def note(self, phase: str, peer: str | None, detail: str) -> None:
        self._metrics.malformed(phase)
        what = (detail.strip().splitlines() or ["?"])[0][:200]
        log.debug("gate: malformed request (%s) from %s: %s", phase, peer, what)
        self._unreported += 1
        now = self._now()
        if now < self._next_warning_monotonic:
            return
        log.warning(
            "gate: %d malformed request(s) answered 400 (the latest from %s: %s); at most one "
            "such line per %g s, all are counted in vllm_guardian_gate_malformed_requests_total",
            self._unreported, peer, what, self._interval_seconds,
        )  # fmt: skip
        self._unreported = 0
        self._next_warning_monotonic = now + self._interval_seconds


class _Protocol(RequestHandler):
    """aiohttp's connection handler, with malformed requests answered quietly (see above)."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._malformed = manager.malformed
        self._guard = manager

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        self._guard.received(self, len(data))
        super().data_received(data)
        if len(self._messages) <= queued:
            return
        # A request's head is in: the connection is no longer idle, though its handler starts
        # a step later (a starved loop reaped connections in between and lost their requests).
        self._guard.head_arrived(self)
        # aiohttp's parser, failing in the middle of a body (a chunk size that is not hex),
        # drops that body without telling its reader and queues a 400 for after the handler:
        # the handler would wait for the rest forever. Tell the reader instead.
        request = self._current_request
        if request is None:
            return
        message = self._messages[-1][0]
        if isinstance(message, _ErrInfo) and not request.content.is_eof():
            request.content.set_exception(RequestPayloadError(message.message))

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # the gate's own fault: aiohttp's ERROR with its traceback
            return super().handle_error(request, status, exc, message)
        self._malformed.note("head", request.remote, message or str(exc or ""))
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already started: the connection is closed")
        resp = openai_error(status, "the gate could not parse the request", "BadRequestError")
        resp.force_close()
        return resp


class IdleCloses:
    """The idle connections the reaper closed, by what each was waiting for: each at DEBUG, and
    at most one INFO line per ``log_interval_seconds`` with the counts. Closing a connection
    kept alive after its answer loses nothing; one that sent no byte, or part of a head, for
    the whole deadline is a client that stalled (or a gate too late to read it: its loop lag,
    gate/looplag.py, says which)."""

    def __init__(self, log_interval_seconds: float) -> None:
        self._interval = log_interval_seconds
        self._counts: dict[str, int] = {}
        self._next_report = -math.inf

    def note(self, conn: _Conn, now: float) -> None:
        kind = conn.idle_kind()
        self._counts[kind] = self._counts.get(kind, 0) + 1
        log.debug(
            "gate: closed an idle connection (%s): open %.1f s, %d request(s), %d byte(s) "
            "read, idle %.1f s",
            kind, now - conn.since, conn.requests, conn.bytes_in, now - conn.idle_since,
        )  # fmt: skip

    def report(self, now: float) -> None:
        if not self._counts or now < self._next_report:
            return
        log.info(
            "gate: closed %d idle connection(s) (%s); at most one such line per %g s",
            sum(self._counts.values()),
            ", ".join(f"{n} {kind}" for kind, n in sorted(self._counts.items())),
            self._interval,
        )
        self._counts = {}
        self._next_report = now + self._interval


class _Conn:
    __slots__ = (
        "busy", "bytes_in", "head_in", "idle_since", "reading", "requests", "since",
        "transport",
    )  # fmt: skip

    def __init__(self, transport: asyncio.Transport, now: float) -> None:
        self.transport = transport
        self.busy = 0
        self.reading = False  # busy, but still waiting for its request body
        self.head_in = False  # a request's head was parsed; its handler has not started yet
        self.idle_since = now  # since when it waits for its client (idle, or reading)
        self.since = now  # accepted
        self.requests = 0  # requests handled on it
        self.bytes_in = 0  # bytes read from its client

    def idle_kind(self) -> str:
        """What an idle connection was waiting for, for the log (what a close lost, if any)."""
        if self.requests:
            return "kept alive after an answer"
        return "part of a request head" if self.bytes_in else "no byte"

    @property
    def waiting_for_client(self) -> bool:
        return not self.busy or self.reading


class GuardedServer(web.Server):
    """aiohttp's low-level server with the guard on every connection."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int,
        idle_timeout_seconds: float,
        metrics: GateMetrics,
        malformed: MalformedRequests,
        idle_log_interval_seconds: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(self._guarded, **kwargs)
        self._inner = handler
        self.max_connections = max_connections
        self.idle_timeout_seconds = idle_timeout_seconds
        self._metrics = metrics
        self.malformed = malformed
        self._conns: dict[RequestHandler, _Conn] = {}
        self._idle_closes = IdleCloses(idle_log_interval_seconds)
        self._reaper = self._loop.create_task(self._reap(), name="gate-connection-reaper")

    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        now = time.monotonic()
        if len(self._conns) >= self.max_connections:
            idle = [(c.idle_since, h) for h, c in self._conns.items() if c.waiting_for_client]
            if not idle:
                self._metrics.connection_closed("over_cap")
                transport.abort()
                return
            _, oldest = min(idle, key=lambda pair: pair[0])
            self._close(oldest, "evicted")
        self._conns[handler] = _Conn(transport, now)
        self._metrics.connections.set(len(self._conns))

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._conns.pop(handler, None)
        self._metrics.connections.set(len(self._conns))
        super().connection_lost(handler, exc)

    def received(self, handler: RequestHandler, count: int) -> None:
        conn = self._conns.get(handler)
        if conn is not None:
            conn.bytes_in += count

    def head_arrived(self, handler: RequestHandler) -> None:
        conn = self._conns.get(handler)
        if conn is not None:
            conn.head_in = True

    def _close(self, handler: RequestHandler, reason: str) -> None:
        conn = self._conns.pop(handler, None)
        if conn is not None:
            self._metrics.connection_closed(reason)
            conn.transport.close()

    async def _guarded(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.busy += 1
            conn.requests += 1
            conn.reading = True
            conn.head_in = False
            conn.idle_since = time.monotonic()

        def body_read() -> None:
            if conn is not None:
                conn.reading = False

        try:
            return await self._inner(request, body_read)
        finally:
            if conn is not None:
                conn.busy -= 1
                conn.reading = False
                conn.idle_since = time.monotonic()

    async def _reap(self) -> None:
        step = min(1.0, self.idle_timeout_seconds / 4)
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            deadline = now - self.idle_timeout_seconds
            for handler, conn in list(self._conns.items()):
                if (
                    not conn.busy
                    and not conn.head_in
                    and conn.idle_since < deadline
                    and not _unread(conn.transport)
                ):
                    self._idle_closes.note(conn, now)
                    self._close(handler, "idle_timeout")
            self._idle_closes.report(now)

    async def shutdown(self, timeout: float | None = None) -> None:
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper
        await super().shutdown(timeout)


def _unread(transport: asyncio.Transport) -> bool:
    """Bytes wait in the kernel for this connection that the gate has not read yet: the client
    sent them (a request) before a starved loop got to them. Such a connection is not idle; it
    is read on the loop's next turn. Closing it would reset the client's request."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        pending = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile, or not a socket that says
        return False
    (count,) = struct.unpack("i", pending)
    return int(count) > 0


def fit_descriptor_limit(max_connections: int, reserve: int = 256) -> tuple[int, str | None]:
    """Raise the soft descriptor limit toward what the cap needs (a client and an upstream
    connection each, plus ``reserve``); if the hard limit is short, lower the cap to fit it.
    Returns the cap to use and, when it was lowered, why."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections, None
    cap = max(16, (soft - reserve) // 2)
    return cap, (
        f"the descriptor limit is {soft} (raise LimitNOFILE): at most {cap} client connections, "
        f"not {max_connections}"
    )
