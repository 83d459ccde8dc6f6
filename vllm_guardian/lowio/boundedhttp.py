"""A small threaded HTTP/1.0 server that hostile or idle clients cannot exhaust.

Where it sits: under the guardian's own endpoint (``/metrics``, ``/healthz``, ``/ready``,
:mod:`vllm_guardian.shell.exposition`), outside the tick: scrapes read the last published state.

The standard library's ``ThreadingHTTPServer`` gives every connection a thread and waits on it
forever: ~1,000 connections that send half a request take every descriptor the daemon has (the
policy state, the audit log and the flight recorder stop writing). Here:

* at most ``max_connections`` are open at once. A new connection past the cap closes the
  *oldest one that has not finished sending its request head* (an idle or dripping client);
  when every open connection is being answered, the new one is closed at once. A real scraper
  sends its head in one packet, so it is served during an attack of any size;
* the request head must arrive within ``head_timeout_seconds`` and the whole exchange end
  within ``total_timeout_seconds``; past either the socket is shut down;
* one request per connection (HTTP/1.0): no idle keep-alive connections to hold;
* a client that leaves mid-answer, or any error in one connection, ends that connection only,
  quietly (no traceback); a failed ``accept()`` (``EMFILE``) waits a moment and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger("vllm_guardian.http")

# method, path -> status, body, content type
Respond = Callable[[str, str], tuple[int, bytes, str]]


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64
    head_timeout_seconds: float = 5.0
    total_timeout_seconds: float = 30.0


@dataclass
class _Conn:
    sock: socket.socket
    opened_monotonic: float
    head_done: bool = False


class BoundedHTTPServer:
    def __init__(
        self,
        host: str,
        port: int,
        respond: Respond,
        limits: Limits | None = None,
        server_version: str = "vllm-guardian",
    ) -> None:
        self.limits = limits or Limits()
        self._respond = respond
        self._server_version = server_version
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(0.25)
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="http-accept", daemon=True)
        # What the defences did, for /metrics and the tests.
        self.evicted_total = 0  # idle connections closed to make room
        self.refused_total = 0  # new connections closed: every slot was being answered
        self.timed_out_total = 0  # connections shut down past a deadline
        self.accept_errors_total = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            for c in self._conns.values():
                _shutdown(c.sock)

    # --- the accept thread ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reap()
                try:
                    sock, _ = self._sock.accept()
                except TimeoutError:
                    continue
                self._admit(sock)
            except OSError as e:  # EMFILE/ENFILE and friends: the next accept may work
                self.accept_errors_total += 1
                if self._stop.is_set():
                    return
                log.warning("accept failed: %s (still serving)", e)
                self._stop.wait(0.1)
            except Exception:  # never let one connection end the server
                self.accept_errors_total += 1
                log.exception("http server: unexpected error (still serving)")
                self._stop.wait(0.1)

    def _admit(self, sock: socket.socket) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._conns) >= self.limits.max_connections:
                idle = [c for c in self._conns.values() if not c.head_done]
                if not idle:
                    self.refused_total += 1
                    sock.close()
                    return
                oldest = min(idle, key=lambda c: c.opened_monotonic)
                oldest.head_done = True  # evicted once
                _shutdown(oldest.sock)
                self.evicted_total += 1
            conn = _Conn(sock, now)
            self._conns[id(conn)] = conn
        try:
            threading.Thread(target=self._serve, args=(conn,), name="http", daemon=True).start()
        except RuntimeError:  # no thread to be had: drop this one
            self._forget(conn)
            sock.close()
            raise

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            for c in self._conns.values():
                age = now - c.opened_monotonic
                if (not c.head_done and age > self.limits.head_timeout_seconds) or (
                    age > self.limits.total_timeout_seconds
                ):
                    c.head_done = True
                    c.opened_monotonic = float("inf")  # shut down once
                    _shutdown(c.sock)
                    self.timed_out_total += 1

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.pop(id(conn), None)

    # --- one connection, in its own thread -----------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        try:
            conn.sock.settimeout(self.limits.total_timeout_seconds)
            _Handler(conn.sock, self, conn)
        except Exception as e:  # a client that left, a reset, a timeout: that client only
            log.debug("http connection ended: %s: %s", type(e).__name__, e)
        finally:
            self._forget(conn)
            with contextlib.suppress(OSError):
                conn.sock.close()


class _Handler(BaseHTTPRequestHandler):
    def __init__(self, sock: socket.socket, server: BoundedHTTPServer, conn: _Conn) -> None:
        self._bounded = server
        self._conn = conn
        self.server_version = server._server_version
        super().__init__(sock, ("", 0), None)  # type: ignore[arg-type]  # no socketserver

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._conn.head_done = True
        return ok

    def do_GET(self) -> None:
        code, body, ctype = self._bounded._respond("GET", self.path)
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the journal


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
