"""Hostile peers on 127.0.0.1, for the hardening tests.

:func:`hostile_server` is an HTTP server that misbehaves on purpose: it drips its answer a byte
at a time, or sends a body that never ends. :func:`idle_clients` opens many connections that
send half a request and then say nothing; :func:`partial_bodies` sends request heads and only
part of their bodies, at once or a byte at a time. Everything opened here is closed on exit.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tests import support


@dataclass
class Hostility:
    mode: str = "drip"  # drip: head+body a byte per interval; endless: chunked body forever
    status: int = 200
    interval_seconds: float = 0.2
    chunk: bytes = b"# x\n" * 16384  # endless: what each chunk carries (64 KiB)
    served: list[int] = field(default_factory=list)  # bytes sent per finished connection
    accepted: int = 0  # connections accepted so far
    head_extra: str = ""  # more head lines, e.g. "Connection: close\r\n"
    head_at_once: bool = False  # drip: the head in one packet, only the body a byte at a time


def _serve_one(conn: socket.socket, h: Hostility, stop: threading.Event) -> None:
    sent = 0
    try:
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            conn.recv(65536)  # the request head; its content does not matter
        if h.mode == "drip":
            payload = (
                f"HTTP/1.1 {h.status} OK\r\nContent-Type: text/plain\r\n{h.head_extra}"
                "Content-Length: 100000\r\n\r\n"
            ).encode() + b"#" * 100000
            start = payload.index(b"\r\n\r\n") + 4 if h.head_at_once else 0
            conn.sendall(payload[:start])
            for i in range(start, len(payload)):
                if stop.wait(h.interval_seconds):
                    return
                conn.sendall(payload[i : i + 1])
                sent += 1
        else:
            conn.sendall(
                f"HTTP/1.1 {h.status} OK\r\nContent-Type: text/plain\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            frame = f"{len(h.chunk):x}\r\n".encode() + h.chunk + b"\r\n"
            while not stop.is_set():
                conn.sendall(frame)
                sent += len(frame)
    except OSError:
        pass
    finally:
        h.served.append(sent)
        conn.close()


@contextmanager
def hostile_server(h: Hostility) -> Iterator[str]:
    """``http://127.0.0.1:<port>``: every request on every path gets the hostile answer."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    lsock.settimeout(0.2)
    stop = threading.Event()
    workers: list[threading.Thread] = []

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            h.accepted += 1
            t = threading.Thread(target=_serve_one, args=(conn, h, stop), daemon=True)
            t.start()
            workers.append(t)

    acceptor = threading.Thread(target=accept_loop, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(timeout=10)
        lsock.close()
        for t in workers:
            t.join(timeout=10)


@contextmanager
def idle_clients(
    host: str, port: int, count: int, head: bytes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
) -> Iterator[list[socket.socket]]:
    """``count`` connections, each sending ``head`` (half a request) and then nothing."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(10)
            try:
                s.connect((host, port))
                s.sendall(head)
            except OSError:
                pass  # refused or reset: the server defends itself; the attack goes on
        yield socks
    finally:
        for s in socks:
            s.close()


@dataclass
class PartialBody:
    """One client of :func:`partial_bodies`: what the server answered before it closed."""

    answer: bytes = b""
    closed: threading.Event = field(default_factory=threading.Event)  # the server hung up

    @property
    def status(self) -> int | None:
        line = self.answer.split(b"\r\n", 1)[0].split(b" ")
        return int(line[1]) if len(line) > 1 and line[1].isdigit() else None

    def answered(self) -> bool:
        """Whether a whole answer (head and its Content-Length of body) has arrived."""
        head, sep, body = self.answer.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if sep and name.strip().lower() == b"content-length":
                return len(body) >= int(value)
        return False

    def error(self) -> dict[str, object]:
        body = self.answer.split(b"\r\n\r\n", 1)[1]
        return json.loads(body)["error"]  # type: ignore[no-any-return]


def _send_partial(
    host: str,
    port: int,
    head: bytes,
    body: bytes,
    drip_interval_seconds: float | None,
    stop: threading.Event,
    out: PartialBody,
    socks: list[socket.socket],
) -> None:
    try:
        s = socket.create_connection((host, port), timeout=60)
    except OSError:
        out.closed.set()
        return
    socks.append(s)
    try:
        s.sendall(head)
        if drip_interval_seconds is None:
            s.sendall(body)
        else:
            for i in range(len(body)):
                if stop.wait(drip_interval_seconds):
                    break
                s.sendall(body[i : i + 1])
    except OSError:
        pass  # the server answered and hung up before taking it all: read what it said
    try:
        while not stop.is_set():
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            out.answer += chunk
    except OSError:
        pass  # reset, or closed by the test at its end
    finally:
        out.closed.set()


@contextmanager
def partial_bodies(
    host: str,
    port: int,
    count: int,
    head: bytes,
    body: bytes,
    drip_interval_seconds: float | None = None,
) -> Iterator[list[PartialBody]]:
    """``count`` connections, each in a thread: ``head``, then ``body`` (at once, or a byte per
    ``drip_interval_seconds``), then nothing more; each keeps what the server answers."""
    stop = threading.Event()
    clients = [PartialBody() for _ in range(count)]
    socks: list[socket.socket] = []
    threads = [
        threading.Thread(
            target=_send_partial,
            args=(host, port, head, body, drip_interval_seconds, stop, c, socks),
            daemon=True,
        )
        for c in clients
    ]
    for t in threads:
        t.start()
    try:
        yield clients
    finally:
        stop.set()
        for s in list(socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=90)
        for s in socks:
            s.close()


def wait_for(
    check: Callable[[], tuple[bool, object]], what: str, timeout_seconds: float = 60.0
) -> object:
    """:func:`tests.support.wait_for` for a check that says what it saw, ``(holds, seen)``:
    returns the last seen once it holds, fails naming it. A check that raises has not held yet
    (a hostile peer makes the first tries fail); its exception is what was seen."""
    last: list[object] = [None]

    def holds() -> bool:
        try:
            ok, last[0] = check()
        except Exception as e:  # the check may fail until the condition holds
            ok, last[0] = False, f"{type(e).__name__}: {e}"
        return ok

    support.wait_for(holds, what, timeout_seconds, seen=lambda: last[0], every_seconds=0.1)
    return last[0]
