"""A continued stream's steady state: events go from the upstream's callbacks straight to the
client (gate/streamer.py's ``Streamer``), with the flow control a relay owes both sides.

A real gate on 127.0.0.1 in front of a raw upstream that writes a vLLM-shaped completion stream
(chunked, one ``data:`` event per token, ``token_ids`` as the gate asks for them) as fast as the
socket takes it, and counts what it managed to write; real client sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import uvloop

from tests.support import wait_for
from tests.test_gate_support import LoopThread, dechunk
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.continuation import StreamState
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

PAD = "x" * 900  # ~1 KiB an event


def event(i: int) -> bytes:
    if i == 0:  # the first chunk: the prompt's ids, as vLLM sends them with return_token_ids
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None,
                  "stop_reason": None, "prompt_token_ids": [1, 7], "token_ids": []}  # fmt: skip
    else:
        choice = {"index": 0, "text": f"{PAD}{i}", "logprobs": None, "finish_reason": None,
                  "stop_reason": None, "token_ids": [i % 50 + 3]}  # fmt: skip
    doc = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def stream_body(n: int) -> bytes:
    """What the client must get: every event and ``[DONE]``, unchanged (it asked for ids)."""
    return b"".join(event(i) for i in range(n)) + b"data: [DONE]\n\n"


@dataclass
class Upstream:
    """vLLM-shaped enough for the gate: /health, and a stream of ``events`` per completion."""

    events: int
    port: int = 0
    written: int = 0  # body bytes handed to the socket so far
    completions: int = 0  # completion requests answered (a continuation is a second one)
    done: bool = False  # the whole stream was written
    gone: bool = False  # the gate closed the connection before the end

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if head.startswith(b"GET "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.completions += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for i in range(self.events):
                    data = event(i)
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.written += len(data)
                    await writer.drain()
                writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
                await writer.drain()
                self.done = True
        except (asyncio.IncompleteReadError, ConnectionError):
            self.gone = not self.done
        finally:
            writer.close()


class Setup:
    def __init__(self, events: int, loop: str) -> None:
        self.lt = LoopThread(
            "relay-direct", uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        )
        self.up = Upstream(events)

        async def start() -> asyncio.Server:
            srv = await asyncio.start_server(self.up.handle, "127.0.0.1", 0)
            self.up.port = srv.sockets[0].getsockname()[1]
            return srv

        self.srv = self.lt.run(start())
        self.gate = Gate(
            GateSettings(
                proxy=ProxySettings(upstream=f"http://127.0.0.1:{self.up.port}"),
                listen_port=0,
                limits=Limits(release_rate_per_second=0),
                poll_interval_seconds=0.05,
                shutdown_timeout_seconds=1.0,
            )
        )
        self.lt.run(self.gate.start())
        wait_for(lambda: self.gate.admission is not None and self.gate.admission.open, "gate open")

    def request(self, version: str = "1.1", rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(60)
        s.connect(("127.0.0.1", self.gate.port))
        doc = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 10**6, "stream": True,
                          "return_token_ids": True}).encode()  # fmt: skip
        s.sendall(
            f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(doc)}\r\nConnection: close\r\n\r\n".encode()
            + doc
        )
        return s

    def upstream_paused(self) -> bool:
        """The gate stopped reading the stream's upstream connection (white box: its pool)."""
        pool = self.gate.proxy.pool if self.gate.proxy is not None else None
        return pool is not None and any(
            c.link.transport is not None and not c.link.transport.is_reading()
            for c in list(pool._busy)
        )

    def held_for_clients(self) -> int:
        """Bytes the gate holds for its clients, not yet taken by their sockets (white box:
        its server's connections)."""
        server = self.gate._server
        assert server is not None
        return sum(
            c.transport.get_write_buffer_size()
            for c in list(server.connections)
            if c.transport is not None
        )

    def open_exchanges(self) -> int:
        return self.gate.proxy.open_exchanges if self.gate.proxy is not None else -1

    def stop(self) -> None:
        self.lt.run(self.gate.stop())

        async def close() -> None:
            # On the server's loop: asyncio.Server is not thread-safe, and connections the
            # gate's stop closed may still be leaving it (a close from this thread raced their
            # detaching: TypeError in Server._wakeup).
            self.srv.close()

        self.lt.run(close())
        self.lt.close()


@pytest.fixture(params=["asyncio", "uvloop"])
def setup_of(request: pytest.FixtureRequest) -> Iterator[Callable[[int], Setup]]:
    """A gate and its upstream on the loop named (uvloop: the gate's own when deployed, whose
    transports are not asyncio's classes)."""
    made: list[Setup] = []

    def make(events: int) -> Setup:
        made.append(Setup(events, request.param))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def read_all(s: socket.socket) -> bytes:
    got = bytearray()
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return bytes(got)


def test_a_client_that_stops_reading_stops_the_upstream_and_then_gets_every_event(
    setup_of: Callable[[int], Setup],
) -> None:
    n = 32000  # ~30 MiB: more than the kernel's buffers on both sides of the gate hold
    st = setup_of(n)
    s = st.request(rcvbuf=4096)
    first = s.recv(64)
    assert first.startswith(b"HTTP/1.1 200")  # then it reads nothing for a while
    wait_for(
        lambda: st.upstream_paused() or st.held_for_clients() > 4 * 2**20 or st.up.done,
        "the gate to pause the upstream (or to buffer the stream for the client)",
        seen=lambda: (st.up.written, st.held_for_clients()),
    )
    held = st.held_for_clients()
    # Bounded by one read of the upstream past the client's high-water mark, not the stream.
    assert held <= 2**20, f"the gate holds {held} bytes for a client that reads nothing"
    assert not st.up.done
    head, _, body = (first + read_all(s)).partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert dechunk(body) == stream_body(n)
    assert st.up.done
    wait_for(lambda: st.open_exchanges() == 0, "the exchange to end", seen=st.open_exchanges)


def test_an_http_1_0_client_gets_the_stream_unframed_until_the_close(
    setup_of: Callable[[int], Setup],
) -> None:
    n = 300
    st = setup_of(n)
    head, _, body = read_all(st.request(version="1.0")).partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), head
    assert b"chunked" not in head.lower()
    assert body == stream_body(n)


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "close"])
def test_a_client_leaving_mid_stream_closes_the_upstream_connection(
    setup_of: Callable[[int], Setup], reset: bool
) -> None:
    st = setup_of(10**6)  # longer than the test: only the client's leaving ends it
    s = st.request()
    got = b""
    while got.count(b"data: ") < 50:  # well into the steady state
        got += s.recv(65536)
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    wait_for(
        lambda: st.up.gone and st.open_exchanges() == 0,
        "the upstream connection closed (vLLM aborts the request) and the exchange ended",
        seen=lambda: (st.up.gone, st.open_exchanges()),
    )


@pytest.mark.python_only
def test_a_failure_reading_an_event_ends_the_exchange_and_is_not_taken_for_a_cut(
    setup_of: Callable[[int], Setup],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception in the relay's own code while it reads an event (a defect, or input no
    test foresaw) ends the client's stream as any error of the gate's does. It must not reach
    the upstream connection's callback: the loop would close that connection, and the relay
    would take it for vLLM cutting the stream and continue it against a healthy engine."""
    calls = [0]
    relay_common = StreamState.relay_common

    def failing(self: StreamState, raw: bytes) -> bytes | None:
        calls[0] += 1
        if calls[0] == 50:
            raise RuntimeError("a defect reading event 50")
        return relay_common(self, raw)

    monkeypatch.setattr(StreamState, "relay_common", failing)
    st = setup_of(10**6)  # still being written when the gate fails: its close is seen
    with caplog.at_level(logging.ERROR):
        got = read_all(st.request())
        wait_for(
            lambda: st.up.gone and st.open_exchanges() == 0,
            "the upstream connection closed and the exchange ended",
            seen=lambda: (st.up.gone, st.open_exchanges(), st.up.completions),
        )
    assert b"data: [DONE]" not in got and b"0\r\n\r\n" not in got  # cut, not ended
    assert st.up.completions == 1  # no continuation
    assert "a defect reading event 50" in caplog.text  # said, with its traceback
    assert "Fatal error" not in caplog.text  # not the upstream connection's failure
