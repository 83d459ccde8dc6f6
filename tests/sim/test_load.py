"""The load generator: seeded, bounded, loopback only."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from vllm_guardian.sim.load import (
    LoadResult,
    OutcomeKind,
    plan_requests,
    require_loopback,
    run_load,
    send_one,
)
from vllm_guardian.sim.scenarios import SCENARIOS, LoadProfile


def test_plans_are_seeded_and_bounded() -> None:
    profile = SCENARIOS["steady"].load
    a = plan_requests(profile, 1, 50, 1000.0)
    assert a == plan_requests(profile, 1, 50, 1000.0)
    assert a != plan_requests(profile, 2, 50, 1000.0)
    assert len(a) == 50
    short = plan_requests(profile, 1, 10_000, 10.0)
    assert all(p.at_seconds < 10.0 for p in short)
    assert all(profile.prompt_tokens_min <= p.prompt_tokens <= profile.prompt_tokens_max for p in a)
    assert all(len(p.prompt.split()) == p.prompt_tokens for p in a)


def test_bursts_and_shared_prefixes() -> None:
    burst = SCENARIOS["prefill_burst"].load
    plan = plan_requests(burst, 0, 100, 40.0)
    first = [p for p in plan if p.burst and p.at_seconds == burst.burst_start_seconds]
    assert len(first) == burst.burst_size
    assert all(p.prompt_tokens >= burst.burst_prompt_tokens_min for p in first)
    shared = LoadProfile(1.0, 100, 100, 1, 1, shared_prefix_ratio=0.5, num_shared_prefixes=1)
    p0, p1 = plan_requests(shared, 0, 2, 100.0)
    assert p0.prompt.split()[:50] == p1.prompt.split()[:50]
    assert p0.prompt.split()[50:] != p1.prompt.split()[50:]


@pytest.mark.parametrize("url", ["http://192.0.2.1:8000", "http://example.invalid:8000", "nohost"])
def test_refuses_anything_but_loopback(url: str) -> None:
    with pytest.raises(ValueError, match=r"loopback|resolve|no host"):
        require_loopback(url)
    with pytest.raises(ValueError):
        run_load(url, [], model="m")


def test_connection_errors_are_outcomes(free_port: int) -> None:
    plan = plan_requests(SCENARIOS["steady"].load, 0, 3, 100.0)
    result = run_load(f"http://127.0.0.1:{free_port}", plan, model="m", speed=100.0,
                      max_duration_seconds=5.0)  # fmt: skip
    assert [o.kind for o in result.outcomes] == [OutcomeKind.CONNECTION_ERROR] * 3
    assert result.summary()["connection_error"] == 3


# --- the client against a scripted server: outcome kinds, and threads held -------------------


class Scripted:
    """An HTTP server on 127.0.0.1 (asyncio streams, its own thread) that answers every request
    the way ``behaviour`` says; ``open`` counts the requests it holds."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.open = 0
        self.release = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        self.open += 1
        try:
            await self._answer(writer)
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> None:
        sse = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        event = b'data: {"choices": [{"text": " tok", "finish_reason": null}]}\n\n'
        chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
        if self.behaviour == "hold":  # answer once released: many requests in flight
            while not self.release.is_set():
                await asyncio.sleep(0.05)
            body = b'{"usage": {"completion_tokens": 3}, "choices": [{"finish_reason": "length"}]}'
            head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            writer.write(head + body)
        elif self.behaviour == "cut_stream":  # 200, two tokens, then the process dies
            writer.write(sse + chunk + chunk)
        elif self.behaviour == "error_event":  # 200, then the engine's error event
            err = b'data: {"error": {"message": "EngineCore encountered an issue"}}\n\n'
            writer.write(sse + chunk + f"{len(err):x}\r\n".encode() + err + b"\r\n0\r\n\r\n")
        elif self.behaviour == "ended_without_done":  # a clean end, but no [DONE]
            writer.write(sse + chunk + b"0\r\n\r\n")
        elif self.behaviour == "aborted_unary":  # vLLM at shutdown: 200, finish_reason "abort"
            body = b'{"usage": {"completion_tokens": 0}, "choices": [{"finish_reason": "abort"}]}'
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        elif self.behaviour == "aborted_stream":  # a token, an "abort" delta, then [DONE]
            abort = b'data: {"choices": [{"text": "", "finish_reason": "abort"}]}\n\n'
            done = b"data: [DONE]\n\n"
            writer.write(sse + chunk + b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n"
                                                for e in (abort, done)) + b"0\r\n\r\n")  # fmt: skip
        elif self.behaviour == "http_500":
            body = b'{"error": {"message": "cannot schedule new futures after shutdown"}}'
            writer.write(f"HTTP/1.1 500 x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        elif self.behaviour == "silent":  # never answers
            await asyncio.sleep(30)
        # "hang_up": closes the connection before any answer
        await writer.drain()

    def close(self) -> None:
        self.release.set()

        async def shut() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.mark.parametrize(
    ("behaviour", "stream", "kind", "tokens"),
    [
        ("cut_stream", True, OutcomeKind.INCOMPLETE, 2),
        ("error_event", True, OutcomeKind.STREAM_ERROR, 1),
        ("ended_without_done", True, OutcomeKind.INCOMPLETE, 1),
        ("http_500", False, OutcomeKind.HTTP_ERROR, 0),
        # vLLM answers the requests it aborts (at shutdown, on a client's or an engine's
        # abort) with 200 and finish_reason "abort": no answer, whatever the status says.
        ("aborted_unary", False, OutcomeKind.ABORTED, 0),
        ("aborted_stream", True, OutcomeKind.ABORTED, 1),
        ("hang_up", False, OutcomeKind.CONNECTION_ERROR, 0),
        ("silent", False, OutcomeKind.TIMEOUT, 0),
    ],
)
def test_the_event_loop_client_records_what_the_blocking_one_does(
    behaviour: str, stream: bool, kind: OutcomeKind, tokens: int
) -> None:
    server = Scripted(behaviour)
    try:
        planned = plan_requests(SCENARIOS["steady"].load, 0, 1, 100.0)[0]
        result = run_load(server.url, [dataclasses.replace(planned, at_seconds=0.0)], model="m",
                          stream=stream, request_timeout_seconds=1.0)  # fmt: skip
        blocking = send_one(server.url, planned, "m", stream, 1.0, 0.0)
    finally:
        server.close()
    (out,) = result.outcomes
    seen = (out.kind, out.completion_tokens, blocking.kind, blocking.completion_tokens)
    assert seen == (kind, tokens, kind, tokens), seen
    assert out.ended_seconds is not None and out.latency_seconds is not None


def test_many_requests_in_flight_hold_no_thread_each() -> None:
    server = Scripted("hold")
    n = 400
    plan = [
        dataclasses.replace(p, at_seconds=0.001 * p.index)
        for p in plan_requests(SCENARIOS["steady"].load, 0, n, 1000.0)
    ]
    results: list[LoadResult] = []
    before = threading.active_count()
    load = threading.Thread(
        target=lambda: results.append(
            run_load(server.url, plan, model="m", stream=False, max_in_flight=2048,
                     max_duration_seconds=30.0, request_timeout_seconds=60.0)
        ),
        daemon=True,
    )  # fmt: skip
    load.start()
    try:
        deadline = time.monotonic() + 60.0
        while server.open < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.open == n, f"only {server.open} of {n} requests reached the server"
        # The load thread itself, and nothing per request (the thread pool held one each).
        held = threading.active_count() - before
        assert held <= 2, f"{held} threads for {n} requests in flight"
        server.release.set()
        load.join(timeout=60.0)
    finally:
        server.close()
    assert not load.is_alive()
    assert results[0].summary()["ok"] == n
