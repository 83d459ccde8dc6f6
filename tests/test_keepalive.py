"""A connection kept between a collector's GETs (httpget.KeepAlive) changes what a
fetch costs, never what it answers: a vLLM that restarted between two scrapes, one that closes
the kept connection as the request arrives, one that hangs on it, one that refuses after a
restart, each gives the answer (or the failure) a fresh connection gives.

The servers are real sockets on 127.0.0.1 whose every connection follows a script: for each
request on it, answer and keep the connection, answer and close, close without answering,
answer half a body then close, or hang. Each fetch runs under a generous bound
(tests/test_httpget.py's ``finishes``) so that a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from tests.hostile import wait_for
from tests.test_httpget import finishes
from vllm_guardian.config import HealthSourceConfig, ServiceConfig, VllmMetricsSourceConfig
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.lowio.httpget import Cancel, Failure, HttpGetError, KeepAlive, fetch
from vllm_guardian.model import HealthState
from vllm_guardian.sources.health import HealthCollector
from vllm_guardian.sources.vllm_metrics import VllmMetricsCollector

BODY = b"vllm:num_requests_running 1\n"
ANSWER = "answer"  # 200 with BODY, the connection kept (HTTP/1.1)
ANSWER_CLOSE = "answer-close"  # 200 with BODY and "Connection: close"
CLOSE = "close"  # read the request, close without a byte of answer (an idle timeout's race)
RESET = "reset"  # read the request, reset the connection (RST)
HALF = "half"  # the head and half the body, then close
HANG = "hang"  # read the request, never answer


@dataclass
class Scripted:
    """What the server does with request ``r`` (0-based) on its connection ``c`` (0-based)."""

    plan: Callable[[int, int], str]
    connections: int = 0
    requests: list[tuple[int, int]] = field(default_factory=list)
    ended: int = 0  # connections the client (or the script) closed


def _read_request(conn: socket.socket) -> bool:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return False
        buf += chunk
    return True


def _serve(conn: socket.socket, index: int, s: Scripted, stop: threading.Event) -> None:
    head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {n}\r\n{extra}\r\n"
    try:
        conn.settimeout(30)
        for r in range(1000):
            if not _read_request(conn):
                return
            s.requests.append((index, r))
            what = s.plan(index, r)
            if what == ANSWER:
                conn.sendall(head.format(n=len(BODY), extra="").encode() + BODY)
            elif what == ANSWER_CLOSE:
                extra = "Connection: close\r\n"
                conn.sendall(head.format(n=len(BODY), extra=extra).encode() + BODY)
                return
            elif what == CLOSE:
                return
            elif what == RESET:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                return
            elif what == HALF:
                conn.sendall(head.format(n=len(BODY), extra="").encode() + BODY[:5])
                return
            elif what == HANG:
                stop.wait(60)
                return
    except OSError:
        pass
    finally:
        s.ended += 1
        conn.close()


@contextmanager
def scripted(s: Scripted, port: int = 0) -> Iterator[int]:
    """A server on 127.0.0.1 (``port``: 0 for any) following ``s``; yields its port. On exit
    it stops listening and closes every connection: a vLLM that exited."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", port))
    lsock.listen(16)
    lsock.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []
    workers: list[threading.Thread] = []

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            t = threading.Thread(target=_serve, args=(conn, s.connections, s, stop), daemon=True)
            s.connections += 1
            t.start()
            workers.append(t)

    acceptor = threading.Thread(target=accept_loop, daemon=True)
    acceptor.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        acceptor.join(timeout=10)
        lsock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in workers:
            t.join(timeout=10)


def get(port: int, keep: KeepAlive | None, deadline: float = 5.0, **kw: object) -> object:
    """The body, or the failure, of one fetch of /metrics."""
    try:
        resp = finishes(
            lambda: fetch(
                f"http://127.0.0.1:{port}/metrics",
                deadline_seconds=deadline,
                max_body_bytes=1 << 20,
                keep_alive=keep,
                **kw,  # type: ignore[arg-type]
            )
        )
    except HttpGetError as e:
        return e.failure
    return resp.body  # type: ignore[attr-defined]


# name → (the server's plan, the fetches' answers, connections the server saw)
CASES: dict[str, tuple[Callable[[int, int], str], list[object], int]] = {
    "one connection for every scrape": (lambda c, r: ANSWER, [BODY] * 5, 1),
    "closed as the request arrives: once more afresh": (
        lambda c, r: CLOSE if (c, r) == (0, 2) else ANSWER,
        [BODY] * 5,
        2,
    ),
    "reset as the request arrives: once more afresh": (
        lambda c, r: RESET if (c, r) == (0, 1) else ANSWER,
        [BODY] * 3,
        2,
    ),
    "the fresh connection closes too: broken, not retried again": (
        lambda c, r: CLOSE if (c, r) in ((0, 1), (1, 0)) else ANSWER,
        [BODY, Failure.BROKEN, BODY],
        3,
    ),
    "a fresh connection closed unanswered: broken, as without keep-alive": (
        lambda c, r: CLOSE if c == 0 else ANSWER,
        [Failure.BROKEN, BODY, BODY],
        2,
    ),
    "the answer says it closes: a connection a scrape": (
        lambda c, r: ANSWER_CLOSE,
        [BODY] * 3,
        3,
    ),
    "half a body on a kept connection: broken, not retried": (
        lambda c, r: HALF if (c, r) == (0, 1) else ANSWER,
        [BODY, Failure.BROKEN, BODY],
        2,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_kept_connection_answers_as_a_fresh_one(name: str) -> None:
    plan, expected, connections = CASES[name]
    s = Scripted(plan)
    keep = KeepAlive()
    with scripted(s) as port:
        got = [get(port, keep) for _ in expected]
    keep.close()
    assert got == expected, s.requests
    assert s.connections == connections, s.requests


def test_without_keep_alive_every_scrape_connects() -> None:
    s = Scripted(lambda c, r: ANSWER)
    with scripted(s) as port:
        assert [get(port, None) for _ in range(3)] == [BODY] * 3
    assert s.connections == 3


@pytest.mark.parametrize("then", ["up again", "refusing"])
def test_a_vllm_restarted_between_two_scrapes(then: str) -> None:
    """The kept connection died with the old process: the next scrape reads the new one, or
    is refused like any fresh connection (vLLM still loading), never a broken answer."""
    keep = KeepAlive()
    first = Scripted(lambda c, r: ANSWER)
    with scripted(first) as port:
        assert get(port, keep) == BODY
    second = Scripted(lambda c, r: ANSWER)
    if then == "up again":
        with scripted(second, port):
            assert [get(port, keep), get(port, keep)] == [BODY, BODY]
        assert second.connections == 1
    else:
        assert get(port, keep) is Failure.REFUSED
    keep.close()


def test_a_vllm_that_hangs_on_the_kept_connection_is_bounded_by_the_deadline() -> None:
    """The request is sent on the kept connection and never answered: the fetch fails at its
    deadline (no retry: a hung server is not a closed one), and the next one connects afresh."""
    s = Scripted(lambda c, r: HANG if (c, r) == (0, 1) else ANSWER)
    keep = KeepAlive()
    cancel = Cancel()
    with scripted(s) as port:
        assert get(port, keep, cancel=cancel) == BODY
        assert get(port, keep, deadline=0.5, cancel=cancel) is Failure.DEADLINE
        assert s.connections == 1
        assert get(port, keep, cancel=cancel) == BODY
        assert s.connections == 2
    cancel.cut()
    keep.close()


def test_a_cut_ends_a_fetch_on_the_kept_connection() -> None:
    s = Scripted(lambda c, r: HANG if r == 1 else ANSWER)
    keep = KeepAlive()
    cancel = Cancel()
    with scripted(s) as port:
        assert get(port, keep, cancel=cancel) == BODY
        out: list[object] = []
        worker = threading.Thread(target=lambda: out.append(get(port, keep, 600, cancel=cancel)))
        worker.start()
        wait_for(lambda: (len(s.requests) == 2, s.requests), "the second request arrives")
        cancel.cut()
        worker.join(60)
        assert not worker.is_alive() and out == [Failure.CANCELLED], out
    keep.close()


def test_only_a_get_with_a_whole_answer_keeps_its_connection() -> None:
    s = Scripted(lambda c, r: ANSWER)
    keep = KeepAlive()
    with scripted(s) as port:
        assert get(port, keep, method="POST", body=b"{}") == BODY
        assert get(port, keep, method="POST", body=b"{}") == BODY
        assert s.connections == 2  # a POST neither takes nor leaves a kept connection
        assert get(port, keep) == BODY
        assert get(port, keep) == BODY
        assert s.connections == 3
        keep.close()  # closes the idle connection; later answers are not kept
        assert get(port, keep) == BODY
        assert get(port, keep) == BODY
        assert s.connections == 5


def test_the_sources_keep_their_connection_and_close_it() -> None:
    s = Scripted(lambda c, r: ANSWER)
    with scripted(s) as port:
        svc = ServiceConfig(name="vllm", url=f"http://127.0.0.1:{port}")
        metrics = VllmMetricsCollector(svc, VllmMetricsSourceConfig(timeout_seconds=5))
        health = HealthCollector(svc, HealthSourceConfig(timeout_seconds=5), FakeClock())
        for _ in range(3):
            assert finishes(metrics.collect).error is None
            assert finishes(health.collect).payload.state is HealthState.UP
        assert (s.connections, s.ended) == (2, 0), s.requests  # one each, kept open
        metrics.close()
        health.close()
        # Closed: the server sees each connection end (its reader returns).
        wait_for(lambda: (s.ended == 2, s.ended), "both kept connections closed")
