"""Every listener of the guardian survives hostile clients.

The guardian's endpoint (/metrics, /healthz, /ready) and the control socket, each real, on
127.0.0.1 or a Unix socket in tmp_path, against real sockets that send half a request and
wait, drip bytes, send too much, or leave mid-answer. What must hold: honest clients are
served during and after, each connection has deadlines, nothing prints a traceback, and the
server threads keep going.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.hostile import idle_clients, wait_for
from vllm_guardian.lowio.boundedhttp import Limits
from vllm_guardian.lowio.control import MAX_REQUEST_BYTES, ControlError, ControlServer, request
from vllm_guardian.lowio.httpget import fetch
from vllm_guardian.shell.exposition import ExpositionServer, GuardianCollector


def endpoint(limits: Limits) -> ExpositionServer:
    c = GuardianCollector(["vllm"])
    server = ExpositionServer(
        c, "127.0.0.1", 0, stale_after_seconds=10, monotonic=lambda: 0.0, limits=limits
    )
    server.start()
    return server


def scrape(server: ExpositionServer, path: str = "/metrics") -> int:
    host, port = server.address
    return fetch(f"http://{host}:{port}{path}", deadline_seconds=30, max_body_bytes=1 << 24).status


def test_the_endpoint_serves_scrapes_while_hundreds_of_clients_sit_idle():
    server = endpoint(Limits(max_connections=16, head_timeout_seconds=600))
    try:
        host, port = server.address
        with idle_clients(host, port, 300):
            # during: the idle ones are evicted, oldest first, to make room for real work
            assert [scrape(server), scrape(server, "/healthz"), scrape(server, "/ready/vllm")] == [
                200,
                503,  # no tick yet: /healthz says so, but it answers
                503,  # no tick yet: not ready before the guardian has seen vLLM
            ]
            open_now = server.http.open_connections()
            assert open_now <= 16 + 1, open_now
            assert server.http.evicted_total >= 300 - 16, server.http.evicted_total
            host_port = f"http://{host}:{port}/metrics"
            text = fetch(host_port, deadline_seconds=30, max_body_bytes=1 << 24).body.decode()
            evicted = next(
                line for line in text.splitlines()
                if line.startswith('vllm_guardian_http_connections_closed_total{reason="evicted"}')
            )  # fmt: skip
            assert float(evicted.rsplit(" ", 1)[1]) >= 300 - 16, evicted
        assert scrape(server) == 200  # after
    finally:
        server.stop()


def test_a_half_sent_request_is_cut_at_the_head_deadline():
    server = endpoint(Limits(head_timeout_seconds=0.5))
    try:
        host, port = server.address
        with idle_clients(host, port, 1) as (sock,):
            sock.settimeout(60)
            assert sock.recv(1024) == b""  # the server hung up on it
        wait_for(
            lambda: (server.http.timed_out_total == 1, server.http.timed_out_total),
            "the idle connection counted as timed out",
        )
        assert scrape(server) == 200
    finally:
        server.stop()


def test_a_client_leaving_mid_answer_prints_no_traceback(capfd: pytest.CaptureFixture[str]):
    server = endpoint(Limits())
    try:
        host, port = server.address
        for _ in range(20):
            s = socket.create_connection((host, port))
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset, right away: the answer meets a closed socket
        wait_for(
            lambda: (server.http.open_connections() == 0, server.http.open_connections()),
            "every connection finished",
        )
        assert scrape(server) == 200
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# --- the control socket ----------------------------------------------------------------------


def control(tmp_path: Path) -> tuple[ControlServer, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def handler(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        return {"ok": True, "echo": req.get("cmd")}

    server = ControlServer(tmp_path / "control.sock", handler)
    server.start()
    return server, seen


def raw(path: Path, data: bytes, timeout_seconds: float = 60) -> bytes:
    """Send data, read until the server closes; what it answered (b"" if it only hung up)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_seconds)
    try:
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)  # the server may hang up on a request too large
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    except ConnectionResetError:
        return b""
    finally:
        s.close()


@pytest.mark.parametrize(
    ("request_bytes", "error"),
    [
        (b"x" * (MAX_REQUEST_BYTES + 10), "request too large"),
        (b"[" * 60_000 + b"\n", "bad request"),  # deep, and under 64 KiB
        (b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n", "bad request"),
        (b"\xff\xfe\n", "bad request"),
        (b"[1, 2]\n", "request must be a JSON object"),
    ],
    ids=["over-64KiB-no-newline", "deep-list", "deep-object", "not-utf8", "not-an-object"],
)
def test_control_answers_garbage_with_an_error_and_keeps_serving(
    tmp_path: Path, request_bytes: bytes, error: str
):
    server, _ = control(tmp_path)
    try:
        answer = raw(server.path, request_bytes)
        assert error in json.loads(answer)["error"], answer[:200]
        assert request(server.path, {"cmd": "status"}) == {"ok": True, "echo": "status"}
    finally:
        server.stop()


def exchange(path: Path, data: bytes) -> bytes:
    """One request as a plain client sends it: all of it, then read the answer to the end. A
    reset (the server closing with the request unread) is raised, not forgiven."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    try:
        s.connect(str(path))
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"x" * (MAX_REQUEST_BYTES + 10),
        b"x" * (4 * 1024 * 1024),
        b'{"cmd": "status", "pad": "' + b"x" * (2 * MAX_REQUEST_BYTES) + b'"}\n',
    ],
    ids=["just-over-no-newline", "4MiB-no-newline", "128KiB-json-line"],
)
def test_control_a_request_over_64KiB_gets_the_json_error_not_a_reset(
    tmp_path: Path, request_bytes: bytes
):
    server, seen = control(tmp_path)
    try:
        answer = json.loads(exchange(server.path, request_bytes))
        assert answer["ok"] is False and "request too large" in answer["error"], answer
        assert seen == []
        big = {"cmd": "status", "pad": "x" * (2 * MAX_REQUEST_BYTES)}
        answer = request(server.path, big, timeout_seconds=60)  # the client the CLI uses
        assert answer["ok"] is False and "request too large" in answer["error"], answer
        assert request(server.path, {"cmd": "status"}) == {"ok": True, "echo": "status"}
    finally:
        server.stop()


def test_control_a_dripping_client_blocks_no_one_and_is_cut_at_its_deadline(tmp_path: Path):
    server, _ = control(tmp_path)
    drip = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = threading.Event()
    cut: list[bool] = []

    def dripping() -> None:  # a byte a second, for up to two minutes, until the server hangs up
        for i in range(120):
            try:
                drip.sendall(b'{"cmd": "status"'[i % 16 : i % 16 + 1])
            except OSError:
                cut.append(True)
                return
            if stop.wait(1.0):
                return

    try:
        drip.settimeout(120)
        drip.connect(str(server.path))
        t = threading.Thread(target=dripping)
        t.start()
        for _ in range(3):  # others are answered meanwhile
            assert request(server.path, {"cmd": "status"}, timeout_seconds=30)["ok"] is True
        answer = drip.recv(65536)  # the server gives up on the drip at its deadline
        assert b"deadline" in answer, answer
        wait_for(lambda: (bool(cut), cut), "the dripping client cut off")
    finally:
        stop.set()
        drip.close()
        server.stop()


def test_control_many_idle_clients_leave_room_and_the_socket_stays_private(tmp_path: Path):
    server, _ = control(tmp_path)
    socks: list[socket.socket] = []
    try:
        assert server.path.stat().st_mode & 0o777 == 0o600
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(s)
            s.connect(str(server.path))
        answers: list[Any] = []

        def ask() -> None:
            try:
                answers.append(request(server.path, {"cmd": "status"}, timeout_seconds=60))
            except ControlError as e:
                answers.append(str(e))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert answers == [{"ok": True, "echo": "status"}] * 4, answers
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_the_unit_raises_the_descriptor_limit_well_past_the_listener_caps():
    from vllm_guardian.lowio.control import MAX_CLIENTS
    from vllm_guardian.tools.install import GUARDIAN_SERVICE

    root = Path(__file__).resolve().parent.parent
    for text in ((root / "systemd/vllm-guardian.service").read_text(), GUARDIAN_SERVICE):
        limits = [line for line in text.splitlines() if line.startswith("LimitNOFILE=")]
        assert limits == ["LimitNOFILE=65536"], limits
    assert 8 * (Limits().max_connections + MAX_CLIENTS) < 65536


class FailingAccept:
    """A listening socket whose accept() fails like a process out of descriptors, N times."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock, self.failures = sock, failures

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_control_survives_a_failed_accept(tmp_path: Path):
    server, _ = control(tmp_path)
    try:
        assert server._sock is not None
        failing = FailingAccept(server._sock, failures=5)
        server._sock = failing  # type: ignore[assignment]
        wait_for(lambda: (failing.failures == 0, failing.failures), "accept() failed 5 times")
        assert request(server.path, {"cmd": "status"}, timeout_seconds=30)["ok"] is True
    finally:
        server.stop()


def test_the_endpoint_survives_a_failed_accept():
    server = endpoint(Limits())
    try:
        failing = FailingAccept(server.http._sock, failures=5)
        server.http._sock = failing  # type: ignore[assignment]
        wait_for(lambda: (failing.failures == 0, failing.failures), "accept() failed 5 times")
        assert scrape(server) == 200
        assert server.http.accept_errors_total == 5
    finally:
        server.stop()
