"""The gate's connection guard: a cap on open client connections and a deadline for idle ones.

Where it sits: the gate's HTTP server (``http1.py``) tells it of every connection's life. A
server with no deadline for a request head lets a client that sends half a request hold its
connection (and a descriptor) forever; ~1,000 of them and a normal POST got no answer at all
(measured on aiohttp's server, which the gate ran on before). Here:

* a connection is *busy* from the moment its request body has been read (the proxy says so)
  until its answer is done, *reading* while the proxy waits for its body (the body's own
  deadline and rate floor apply: ``body.py``), and *idle* otherwise (sending its head, or
  kept alive between requests);
* an idle connection is closed after ``idle_timeout_seconds``: the request-head deadline and
  the keep-alive limit in one; so is one whose client takes none of the answer bytes waiting
  for it for as long (``send_timeout``, as nginx's ``send_timeout``): a client that never
  reads holds no slot, one that reads slowly is served;
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
import socket
import struct
import termios
import time
from collections.abc import Callable
from typing import Protocol

from vllm_guardian.gate.metrics import GateMetrics

log = logging.getLogger("vllm_guardian.gate")

# Linux's tcp_states.h: the peer sent its FIN (CLOSE_WAIT), or reset the connection (CLOSE).
_PEER_GONE_STATES = frozenset({7, 8})


class MalformedRequests:
    """Requests the gate could not parse: counted by phase (``head``: the parser refused the
    request head; ``body``: its framing or encoding broke while the proxy read it), each
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

    def note(self, conn: GuardedConn, now: float) -> None:
        kind = conn.idle_kind()
        self._counts[kind] = self._counts.get(kind, 0) + 1
        log.debug(
            "gate: closed an idle connection (%s): open %.1f s, %d request(s), %d byte(s) "
            "read, idle %.1f s",
            kind, now - conn.since, conn.requests, conn.bytes_in, now - conn.idle_since,
        )  # fmt: skip

    def note_stalled(self, conn: GuardedConn, now: float) -> None:
        kind = "an answer the client did not read"
        self._counts[kind] = self._counts.get(kind, 0) + 1
        log.debug(
            "gate: closed a connection whose client read nothing of its answer for the "
            "deadline: open %.1f s, %d request(s)",
            now - conn.since, conn.requests,
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


class Connection(Protocol):
    """A client connection as the guard sees it (``http1.Connection``)."""

    transport: asyncio.Transport | None
    reading_paused: bool  # the server stopped reading it (its buffer is full)
    bytes_out: int  # bytes handed to its transport (what the transport holds is not sent yet)

    def close(self) -> None: ...


class GuardedConn:
    """What the guard knows of one connection."""

    __slots__ = (
        "busy", "bytes_in", "conn", "head_in", "idle_since", "reading", "requests", "sent",
        "sent_moved", "since",
    )  # fmt: skip

    def __init__(self, conn: Connection, now: float) -> None:
        self.conn = conn
        self.busy = 0
        self.reading = False  # busy, but still waiting for its request body
        self.head_in = False  # a request's head was parsed; its handler has not started yet
        self.idle_since = now  # since when it waits for its client (idle, or reading)
        self.since = now  # accepted
        self.requests = 0  # requests handled on it
        self.bytes_in = 0  # bytes read from its client
        self.sent = 0  # bytes of answers the transport had passed on at the reaper's last look
        self.sent_moved = now  # when that last grew, or the transport held nothing

    def idle_kind(self) -> str:
        """What an idle connection was waiting for, for the log (what a close lost, if any)."""
        if self.requests:
            return "kept alive after an answer"
        return "part of a request head" if self.bytes_in else "no byte"

    @property
    def waiting_for_client(self) -> bool:
        return not self.busy or self.reading


class ConnectionGuard:
    """The cap and the idle deadline over every client connection (see the module's
    docstring). The server calls :meth:`accepted`, :meth:`busy`, :meth:`idle` and
    :meth:`lost`; a reaper task closes the idle ones past the deadline."""

    def __init__(
        self,
        *,
        max_connections: int,
        idle_timeout_seconds: float,
        metrics: GateMetrics,
        idle_log_interval_seconds: float = 60.0,
    ) -> None:
        self.max_connections = max_connections
        self.idle_timeout_seconds = idle_timeout_seconds
        self._metrics = metrics
        self._conns: dict[Connection, GuardedConn] = {}
        self._idle_closes = IdleCloses(idle_log_interval_seconds)
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(
            self._reap(), name="gate-connection-reaper"
        )

    def accepted(self, conn: Connection, now: float) -> GuardedConn | None:
        """A new connection: guarded, or closed at once (None) when every slot is busy."""
        if len(self._conns) >= self.max_connections:
            # Not one whose answer is still being taken (its transport holds some): closing
            # it would cut that answer.
            idle = [
                (g.idle_since, c)
                for c, g in self._conns.items()
                if g.waiting_for_client
                and not (c.transport is not None and c.transport.get_write_buffer_size())
            ]
            if not idle:
                self._metrics.connection_closed("over_cap")
                if conn.transport is not None:
                    conn.transport.abort()
                return None
            _, oldest = min(idle, key=lambda pair: pair[0])
            self._close(oldest, "evicted")
        guarded = self._conns[conn] = GuardedConn(conn, now)
        self._metrics.connections.set(len(self._conns))
        return guarded

    def lost(self, conn: Connection) -> None:
        if self._conns.pop(conn, None) is not None:
            self._metrics.connections.set(len(self._conns))

    @staticmethod
    def busy(g: GuardedConn, now: float) -> None:
        """Its handler starts: busy, reading its body until the proxy says it is in."""
        g.busy += 1
        g.requests += 1
        g.reading = True
        g.head_in = False
        g.idle_since = now

    @staticmethod
    def idle(g: GuardedConn, now: float) -> None:
        """Its answer is done (or its handler ended)."""
        g.busy -= 1
        g.reading = False
        g.idle_since = now

    def _pop(self, conn: Connection, reason: str) -> None:
        if self._conns.pop(conn, None) is not None:
            self._metrics.connection_closed(reason)
            self._metrics.connections.set(len(self._conns))

    def _close(self, conn: Connection, reason: str) -> None:
        if conn in self._conns:
            self._pop(conn, reason)
            t = conn.transport
            if t is not None and t.get_write_buffer_size():
                # A close would wait to flush what a client that reads nothing never takes:
                # the socket would stay open, outside the cap.
                t.abort()
            else:
                conn.close()

    async def _reap(self) -> None:
        step = min(1.0, self.idle_timeout_seconds / 4)
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            deadline = now - self.idle_timeout_seconds
            for conn, g in list(self._conns.items()):
                t = conn.transport
                # Answer bytes not taken yet: the transport's buffer, and the kernel's send
                # queue (which hides a slow reader's progress from the transport for long).
                # None when the client had taken all at the last look and nothing was written
                # since: no syscall for an idle or caught-up connection.
                if t is None or conn.bytes_out == g.sent:
                    held = 0
                else:
                    held = t.get_write_buffer_size() + _unsent(t)
                if not held or conn.bytes_out - held != g.sent:
                    g.sent, g.sent_moved = conn.bytes_out - held, now  # the client takes it
                elif t is not None and g.sent_moved < deadline:
                    # Answer bytes wait and the client took none of them for the whole
                    # deadline (nginx's send_timeout): gone, or never reading. Its slot is
                    # freed, its request aborted in vLLM as for a client that left.
                    self._pop(conn, "send_timeout")
                    self._idle_closes.note_stalled(g, now)
                    t.abort()
                    continue
                if conn.reading_paused and conn.transport is not None and _peer_closed(conn):
                    # Paused, the server reads no FIN: a client gone while its request is
                    # answered would keep it running in vLLM. Closed as a client that left.
                    conn.transport.abort()
                    continue
                if (
                    not g.busy
                    and not g.head_in
                    and not held  # an answer still being taken is the send deadline's
                    and g.idle_since < deadline
                    and conn.transport is not None
                    and not _unread(conn.transport)
                ):
                    self._idle_closes.note(g, now)
                    self._close(conn, "idle_timeout")
            self._idle_closes.report(now)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            # asyncio.wait, not a suppressed await of it: that would swallow a cancellation
            # of this stop's own caller too (tests/test_gate_cancel.py).
            await asyncio.wait({self._reaper})
            self._reaper = None


def _peer_closed(conn: Connection) -> bool:
    """The client closed its side or reset the connection (the socket is in CLOSE_WAIT or
    CLOSE); False when it cannot say."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None:
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except (OSError, ValueError, AttributeError):  # closed meanwhile, or not Linux TCP
        return False
    return bool(info) and info[0] in _PEER_GONE_STATES


def _socket_count(transport: asyncio.Transport, request: int) -> int:
    """A byte count the kernel keeps for this connection's socket (an ``ioctl`` such as
    FIONREAD or SIOCOUTQ); 0 when it cannot say (closed meanwhile, or not a socket)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        raw = fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    (count,) = struct.unpack("i", raw)
    return max(0, int(count))


def _unsent(transport: asyncio.Transport) -> int:
    """Bytes in the kernel's send queue for this connection, not yet taken by the client
    (SIOCOUTQ)."""
    return _socket_count(transport, termios.TIOCOUTQ)


def _unread(transport: asyncio.Transport) -> bool:
    """Bytes wait in the kernel for this connection that the gate has not read yet: the client
    sent them (a request) before a starved loop got to them. Such a connection is not idle; it
    is read on the loop's next turn. Closing it would reset the client's request."""
    return _socket_count(transport, termios.FIONREAD) > 0


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
