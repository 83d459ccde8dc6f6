"""One bounded HTTP exchange with vLLM: a total deadline and a size cap, enforced.

Where it sits: at the edges, under every fetch the guardian makes from a vLLM server — the
``vllm_metrics`` and ``health`` sources (collect stage of the tick), ``diagnose`` gathering a
live bundle, and the bundle actuator. Each caller keeps its own error reporting; this module
only says *what* went wrong (:class:`Failure`).

Why not ``requests``' timeout: it is per socket read, so a server that drips one byte a second
keeps a fetch alive for as long as it drips (and the thread with it, and shutdown waiting on
that thread). Here ``deadline_seconds`` covers connect, head and body together: the socket's
timeout is set to the time left, and a timer shuts the socket down at the deadline whatever
the server does; a :class:`Cancel` cuts it at once when its owner shuts down. A deadline the
timer reaches more than ``LATE_DEADLINE_SECONDS`` after it passed (the process was not running:
a host whose CPUs another process holds) is not taken for silence at once: the answer may be in
the socket already, and the fetch gets its time once more, counted from then. ``max_body_bytes`` bounds memory against an endless body: past it the fetch
fails (:attr:`Oversize.FAIL`) or keeps the first bytes and says so (:attr:`Oversize.TRUNCATE`).

Plain ``http.client``: no proxy from the environment (the guardian talks to loopback), no
redirects followed, no compression asked for. A collector that fetches every tick keeps one
connection between its GETs (:class:`KeepAlive`): the answer is always the one a fresh
connection would give (a connection the server closed is dropped, or retried once afresh
when it fails before any answer), and the deadline bounds every fetch as without it.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import itertools
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from vllm_guardian.lowio.clock import reached_late


class Failure(enum.Enum):
    BAD_URL = "bad_url"
    REFUSED = "refused"
    CONNECT_TIMEOUT = "connect_timeout"
    DEADLINE = "deadline"  # no complete answer within the total deadline
    TOO_LARGE = "too_large"
    BROKEN = "broken"  # reset, unresolvable host, malformed HTTP …
    CANCELLED = "cancelled"  # the owner is shutting down (:meth:`Cancel.cut`)


class Oversize(enum.Enum):
    FAIL = "fail"
    TRUNCATE = "truncate"


class HttpGetError(Exception):
    def __init__(self, failure: Failure, url: str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.failure = failure
        self.url = url
        self.detail = detail


class Cancel:
    """A collector's kill switch: :meth:`cut` ends the fetch in progress at once and fails
    every later one, so that shutting down never waits on a server (SIGTERM).

    It also keeps its fetches' deadlines: one thread per Cancel (started with the first
    fetch, ended by :meth:`cut`) shuts a fetch's socket down at its deadline, where a fetch
    without a Cancel starts a timer thread of its own. A collector fetches every tick: a
    thread started per fetch cost more CPU than the rest of the exchange."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.cut_done = False
        self._wake = threading.Condition(self._lock)
        # → (monotonic, what to do then: cut, or say the new deadline)
        self._deadlines: dict[int, tuple[float, Callable[[], float | None]]] = {}
        self._tokens = itertools.count()
        self._watcher: threading.Thread | None = None
        self._waiting_until = math.inf  # when the watcher wakes next on its own

    def cut(self) -> None:
        with self._lock:
            self.cut_done = True
            for sock in self._socks:
                _shutdown(sock)
            self._wake.notify()  # the watcher ends

    def _at_deadline(self, end_monotonic: float, due: Callable[[], float | None]) -> int:
        """Call ``due`` at ``end_monotonic`` unless :meth:`_clear` comes first, and again at
        the deadline it returns, if any."""
        with self._lock:
            token = next(self._tokens)
            self._deadlines[token] = (end_monotonic, due)
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch, name="httpget-deadlines", daemon=True
                )
                self._watcher.start()
            elif end_monotonic < self._waiting_until:
                self._wake.notify()
            return token

    def _clear(self, token: int) -> None:
        with self._lock:
            self._deadlines.pop(token, None)

    def _watch(self) -> None:
        with self._lock:
            while not self.cut_done:
                now = time.monotonic()
                for token, (end, due) in list(self._deadlines.items()):
                    if end <= now:
                        later = due()
                        if later is None:
                            del self._deadlines[token]
                        else:
                            self._deadlines[token] = (later, due)
                nearest = min((end for end, _ in self._deadlines.values()), default=math.inf)
                self._waiting_until = nearest
                self._wake.wait(None if nearest == math.inf else nearest - now)

    def _add(self, sock: socket.socket) -> bool:
        with self._lock:
            if self.cut_done:
                return False
            self._socks.add(sock)
            return True

    def _remove(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    truncated: bool = False  # the body was cut at max_body_bytes (Oversize.TRUNCATE only)

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)


class KeepAlive:
    """One connection kept open between a collector's GETs to one server (HTTP/1.1 keep-alive),
    so that a fetch every tick costs a request, not a connection.

    A kept connection is only reused for a GET, only after its previous answer was read whole
    and the server did not say it would close; one found closed (readable while idle: the
    server's end-of-stream, as when vLLM restarted or its keep-alive timeout passed) is
    dropped before use. A reused connection that fails before any answer arrives (reset,
    closed, a broken pipe: the server went away while it sat idle) is retried once on a fresh
    connection, within the same total deadline: GET is idempotent, and the answer is then the
    fresh connection's, as it would have been without keeping one. Any other failure (a
    deadline, a cut, a malformed answer) closes the connection, and the next fetch connects
    afresh: a hung server is bounded exactly as without keep-alive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: tuple[tuple[str, str, int | None], http.client.HTTPConnection] | None = None
        self._closed = False

    def take(self, key: tuple[str, str, int | None]) -> http.client.HTTPConnection | None:
        """The idle connection to ``key`` if it is still open; None: connect afresh."""
        with self._lock:
            idle, self._idle = self._idle, None
        if idle is None:
            return None
        kept_key, conn = idle
        if kept_key != key or conn.sock is None or _readable(conn.sock):
            conn.close()
            return None
        return conn

    def put(self, key: tuple[str, str, int | None], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and self._idle is None:
                self._idle = (key, conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connection; later answers are not kept (shutting down)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, None
        if idle is not None:
            idle[1].close()


# A kept connection the server closed while it sat idle fails in one of these ways, before an
# answer arrives (http.client.RemoteDisconnected is a ConnectionResetError).
_STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def fetch(
    url: str,
    *,
    deadline_seconds: float,
    max_body_bytes: int,
    method: str = "GET",
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    oversize: Oversize = Oversize.FAIL,
    cancel: Cancel | None = None,
    keep_alive: KeepAlive | None = None,
) -> HttpResponse:
    """One request, finished (or failed with :class:`HttpGetError`) within ``deadline_seconds``
    (or, where the deadline was reached late because the process was not running, within
    twice that plus the time it was not running).

    ``keep_alive``: reuse a connection between GETs (:class:`KeepAlive`)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise HttpGetError(Failure.BAD_URL, url, f"bad URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpGetError(Failure.BAD_URL, url, "not an http(s) URL with a host")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname
    key = (parts.scheme, host, port)
    keep = keep_alive if method == "GET" else None

    def connection(timeout: float) -> http.client.HTTPConnection:
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                host, port, timeout=timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(host, port, timeout=timeout)

    end = time.monotonic() + deadline_seconds
    expired = threading.Event()
    # The socket in use: the deadline and a cut shut it down (kept here, not read from the
    # connection, which lets go of its socket when the answer says it will close).
    in_use: list[socket.socket] = []

    def cut() -> None:
        expired.set()
        for sock in list(in_use):
            _shutdown(sock)

    extended = False
    finished = threading.Event()  # the fetch returned: a deadline due now does nothing

    def due() -> float | None:
        """At the deadline: cut; or, reached late (the process was not running), once, the
        new deadline."""
        nonlocal end, extended
        if finished.is_set():
            return None
        now = time.monotonic()
        if not extended and reached_late(now, end):
            extended = True
            end = now + deadline_seconds
            return end
        cut()
        return None

    if cancel is not None and cancel.cut_done:
        raise HttpGetError(Failure.CANCELLED, url, "shutting down")

    timers: list[threading.Timer] = []
    timers_lock = threading.Lock()  # a timer armed again is cancelled with the rest
    token: int | None = None

    def arm(at: float) -> None:
        def fire() -> None:
            if (later := due()) is not None:
                arm(later)

        with timers_lock:
            if finished.is_set():
                return
            timer = threading.Timer(max(0.0, at - time.monotonic()), fire)
            timer.daemon = True
            timers.append(timer)
            timer.start()

    if cancel is not None:
        token = cancel._at_deadline(end, due)
    else:
        arm(end)
    conn = keep.take(key) if keep is not None else None
    reused = conn is not None
    connected = reused
    answered = False
    kept = False
    try:
        while True:
            try:
                if conn is None:
                    conn = connection(max(0.001, end - time.monotonic()))
                    conn.connect()
                    connected = True
                sock = conn.sock
                if sock is not None:
                    in_use.append(sock)
                    if cancel is not None and not cancel._add(sock):
                        raise HttpGetError(Failure.CANCELLED, url, "shutting down")
                    if expired.is_set():  # the deadline passed while there was no socket to cut
                        raise TimeoutError
                    sock.settimeout(max(0.001, end - time.monotonic()))
                conn.request(method, target, body=body, headers=dict(headers or {}))
                resp = conn.getresponse()
                answered = True
                answer = _read(resp, url, max_body_bytes, oversize)
                if expired.is_set() or (
                    cancel is not None and cancel.cut_done
                ):  # a cut can look like a clean end
                    raise TimeoutError
                if keep is not None and not resp.will_close and not answer.truncated:
                    keep.put(key, conn)
                    kept = True
                return answer
            except _STALE:
                if not reused or answered or expired.is_set():
                    raise
                if cancel is not None and cancel.cut_done:
                    raise
                # A kept connection the server closed while idle: once more, afresh.
                if conn is not None:
                    _forget(conn, in_use, cancel)
                conn, reused = None, False
    except HttpGetError:
        raise
    except ConnectionRefusedError:
        raise HttpGetError(Failure.REFUSED, url, "connection refused") from None
    except (TimeoutError, OSError, http.client.HTTPException) as e:
        if cancel is not None and cancel.cut_done:
            raise HttpGetError(Failure.CANCELLED, url, "shutting down") from None
        if expired.is_set() or (connected and isinstance(e, TimeoutError)):
            raise HttpGetError(
                Failure.DEADLINE, url, f"no complete answer within {deadline_seconds:g}s"
            ) from None
        if isinstance(e, TimeoutError):
            raise HttpGetError(
                Failure.CONNECT_TIMEOUT, url, f"no connection within {deadline_seconds:g}s"
            ) from None
        if isinstance(e, socket.gaierror):
            raise HttpGetError(Failure.BROKEN, url, f"cannot resolve {parts.hostname}") from None
        raise HttpGetError(Failure.BROKEN, url, _short(e)) from None
    finally:
        with timers_lock:
            finished.set()
            for timer in timers:
                timer.cancel()
        if cancel is not None and token is not None:
            cancel._clear(token)
        if cancel is not None:
            for sock in in_use:
                cancel._remove(sock)
        if conn is not None and not kept:
            conn.close()


def _forget(
    conn: http.client.HTTPConnection, in_use: list[socket.socket], cancel: Cancel | None
) -> None:
    """Close a connection that failed and stop tracking its socket."""
    for sock in in_use:
        if cancel is not None:
            cancel._remove(sock)
    in_use.clear()
    conn.close()


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection's socket has something to read: on a connection whose last
    answer was read whole, that is the server's end-of-stream (or bytes nobody asked for)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _read(
    resp: http.client.HTTPResponse, url: str, max_body_bytes: int, oversize: Oversize
) -> HttpResponse:
    headers = tuple(resp.getheaders())
    declared = resp.getheader("Content-Length")
    if (
        oversize is Oversize.FAIL
        and declared is not None
        and declared.isdigit()
        and int(declared) > max_body_bytes
    ):
        raise HttpGetError(
            Failure.TOO_LARGE, url, f"body of {declared} bytes exceeds {max_body_bytes} bytes"
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = resp.read(min(65536, max_body_bytes + 1 - size))
        if not chunk:
            if resp.length:  # http.client ends a short Content-Length body quietly
                raise http.client.IncompleteRead(b"", resp.length)
            break
        size += len(chunk)
        chunks.append(chunk)
        if size > max_body_bytes:
            if oversize is Oversize.FAIL:
                raise HttpGetError(Failure.TOO_LARGE, url, f"body exceeds {max_body_bytes} bytes")
            return HttpResponse(resp.status, b"".join(chunks)[:max_body_bytes], headers, True)
    return HttpResponse(resp.status, b"".join(chunks), headers)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the base method: a raw shutdown, even under TLS
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
