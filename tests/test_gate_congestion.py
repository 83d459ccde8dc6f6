"""A busy vLLM that accepts connections late is congested, not dead.

vLLM's API server accepts connections on the event loop that serves its requests; overloaded,
its listen queue fills and a new connect times out, while the connections it already holds
(the gate's /health poll among them) are answered. The real-engine overload showed the gate
reading such a connect as a dead upstream: it closed for every new request, then released the
queue in a burst. Here the upstream is the stub behind a relay whose listen queue is filled on
purpose (a real socket: the kernel drops the SYN, the connect times out), so the gate's own
poll goes on being answered on its kept connection while new connects time out."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.support import wait_for
from tests.test_gate_support import GateThread, Stub


class SlowAcceptRelay:
    """A TCP relay to ``target`` that can stop accepting: while it does not, its listen queue
    (backlog 1) fills with ``fill()``'s idle connections and the kernel drops new SYNs."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepting = threading.Event()
        self.accepting.set()
        self._paused = threading.Event()
        self._socks: list[socket.socket] = []
        self._fillers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            if not self.accepting.is_set():
                self._paused.set()  # from here on, no accept() until accept_again()
                self.accepting.wait()
                self._paused.clear()
            try:
                ready, _, _ = select.select([self.listener], [], [], 0.05)
                if not ready:
                    continue
                conn, _ = self.listener.accept()
            except (OSError, ValueError):  # closed by stop()
                return
            up = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._socks += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop_accepting(self) -> None:
        """Stop accepting and fill the listen queue until a connect times out."""
        self.accepting.clear()
        assert self._paused.wait(30), "the relay did not stop accepting"
        for _ in range(16):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", self.port))
            except TimeoutError:
                s.close()
                return
            self._fillers.append(s)
        raise AssertionError("the listen queue never filled")

    def accept_again(self) -> None:
        for s in self._fillers:
            s.close()
        self._fillers.clear()
        self.accepting.set()

    def stop(self) -> None:
        self.accept_again()
        self.listener.close()
        with self._lock:
            for s in self._socks:
                s.close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


@pytest.fixture
def relay(stub: Stub) -> Iterator[SlowAcceptRelay]:
    r = SlowAcceptRelay(stub.port)
    yield r
    r.stop()


def closures(g: GateThread) -> list[str]:
    """Every reason the gate closes for from now on (a spy on the admission's state)."""
    adm = g.gate.admission
    assert adm is not None
    seen: list[str] = []
    real = adm.set_state

    def spy(open_: bool, reason: str) -> None:
        if not open_ and adm.open:
            seen.append(reason)
        real(open_, reason)

    adm.set_state = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.python_only
def test_a_connect_that_times_out_waits_its_turn_again_and_holds_nobody(
    relay: SlowAcceptRelay, stub: Stub
):
    g = GateThread(
        relay.url, max_wait_seconds=30.0, release_rate_per_second=0,
        proxy={"connect_timeout_seconds": 0.5},
        # The test is about exchanges, not /health: a poll slowed by the host is no closure.
        gate={"health_grace_seconds": 30.0},
    )  # fmt: skip
    try:
        adm, metrics = g.gate.admission, g.gate.metrics
        assert adm is not None
        wait_for(lambda: adm.open, "the gate open", timeout_seconds=30)
        assert g.gate.proxy is not None
        g.gate.proxy.pool.max_idle = 0  # every request connects anew
        seen = closures(g)
        relay.stop_accepting()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(requests.post, f"{g.url}/v1/echo", data=b"{}", timeout=60)
            wait_for(
                lambda: metrics.total("upstream_connect_timeouts") >= 2 or answer.done(),
                "two connects timed out (or the answer)",
                timeout_seconds=60,
                seen=lambda: g.gate.proxy.status() if g.gate.proxy else None,
            )
            relay.accept_again()
            r = answer.result()
        assert r.status_code == 200, r.text
        assert seen == [], seen
        # Not an upstream that broke: nothing counted under it, and no retry spent.
        assert metrics.total("upstream_errors") == 0
        assert metrics.total("retried") == 0
    finally:
        g.stop()


@pytest.mark.python_only
def test_a_vllm_that_never_accepts_gets_the_held_requests_answer_not_a_hold(
    relay: SlowAcceptRelay, stub: Stub
):
    """Connects that go on timing out end as a held request does that waited its limit: 503
    with Retry-After, while the gate stays open for what its kept connections can serve."""
    g = GateThread(
        relay.url, max_wait_seconds=2.0, release_rate_per_second=0,
        proxy={"connect_timeout_seconds": 0.5}, gate={"health_grace_seconds": 30.0},
    )  # fmt: skip
    try:
        adm, metrics = g.gate.admission, g.gate.metrics
        assert adm is not None and g.gate.proxy is not None
        wait_for(lambda: adm.open, "the gate open", timeout_seconds=30)
        g.gate.proxy.pool.max_idle = 0
        seen = closures(g)
        relay.stop_accepting()
        r = requests.post(f"{g.url}/v1/echo", data=b"{}", timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "2", r.text
        assert "did not accept a connection" in r.json()["error"]["message"], r.text
        assert metrics.total("upstream_connect_timeouts") >= 2
        assert metrics.total("upstream_errors") == 0
        assert seen == [], seen
        assert stub.calls.get("/v1/echo", 0) == 0
    finally:
        g.stop()
