"""Support for the gate's tests (no tests here): an event loop in a thread, an in-process gate
on it, and a scriptable upstream stub (aiohttp) that counts what reaches it. 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web

from vllm_guardian.formats.ready_format import ReadyAnswer, encode
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

T = TypeVar("T")


def refused_url() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class LoopThread:
    """An asyncio loop running in a daemon thread; ``run`` executes a coroutine on it."""

    def __init__(
        self, name: str, new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    ) -> None:
        self.loop = new_loop()  # uvloop.new_event_loop: the loop the gate runs on when deployed
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tasks(self) -> set[asyncio.Task[Any]]:
        async def get() -> set[asyncio.Task[Any]]:
            me = asyncio.current_task()
            return {t for t in asyncio.all_tasks() if t is not me}

        return self.run(get())

    def close(self) -> None:
        """Stop the loop, then end it the way ``asyncio.run`` ends one: cancel every task still
        on it and run the loop until they have finished, then close it.

        A task left pending on a closed loop is not an error at the time: its coroutine is
        finalised later, whenever the garbage collector reaches it, inside whatever test runs
        then. One never started warns "coroutine ... was never awaited"; a suspended one runs
        its ``finally`` blocks on a closed loop ("Event loop is closed"). pytest reports either
        as an unraisable exception of that later test (it was seen in test_gate.py's
        test_cost_estimate, whose teardown tears down the module's gate and stub). Work can be
        left whenever the loop stops in the iteration in which something scheduled it: on a
        busy machine, a keep-alive connection's close reaching the stub as it shuts down, or a
        cancelled handler's cleanup (not reproduced here in a few runs; the test of this
        method reproduces both kinds deterministically).
        """
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), f"the {self.thread.name} loop did not stop"
        loop = self.loop
        for _ in range(10):  # a cancelled task may start another one while it ends
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if not left:
                break
            for t in left:
                t.cancel()
            loop.run_until_complete(asyncio.wait(left, timeout=10))  # one that ignores it
            for t in left:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: ending with one is not this harness's concern
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        assert not left, f"tasks still pending on the {self.thread.name} loop: {left!r}"


class GateThread:
    """One gate on its own loop thread."""

    def __init__(
        self,
        upstream: str,
        guardian: str | None = None,
        proxy: dict[str, Any] | None = None,
        gate: dict[str, Any] | None = None,
        **limits: Any,
    ) -> None:
        self.lt = LoopThread("gate")
        self.settings = replace(
            GateSettings(
                proxy=replace(
                    ProxySettings(upstream=upstream, max_body_bytes=8 * 1024 * 1024),
                    **(proxy or {}),
                ),
                listen_port=0,
                guardian=guardian,
                limits=replace(Limits(), **limits),
                poll_interval_seconds=0.02,
                kv_poll_interval_seconds=0.1,
                suspect_seconds=0.2,
                shutdown_timeout_seconds=1.0,
            ),
            **(gate or {}),
        )
        self.gate = Gate(self.settings)
        self.lt.run(self.gate.start())
        self.url = f"http://127.0.0.1:{self.gate.port}"

    def stop(self) -> None:
        self.lt.run(self.gate.stop())
        self.lt.close()


class Stub:
    """A scriptable upstream: vLLM's shape where it matters, and ways to misbehave."""

    def __init__(self) -> None:
        self.lt = LoopThread("stub")
        self.healthy = True
        self.slow_health_answers = 0  # the next N /health answers come after health_delay_seconds
        self.health_delay_seconds = 0.0
        self.ready = True  # what /ready/vllm answers (the stub doubles as the guardian)
        self.slow_ready_answers = 0  # the next N /ready answers come after ready_delay_seconds
        self.ready_delay_seconds = 0.0
        self.restarting = False  # ...and whether it says a restart is in progress
        self.metrics_text: str | None = None  # what /metrics answers (None: 404)
        self.calls: dict[str, int] = {}
        self.active = 0
        self.disconnects = 0
        self.last_headers: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.port = 0
        self.lt.run(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self.release = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.close()

    def set_release(self) -> None:
        self.lt.loop.call_soon_threadsafe(self.release.set)

    def reset(self) -> None:
        async def fresh() -> None:
            self.release = asyncio.Event()

        self.lt.run(fresh())
        self.healthy, self.ready, self.restarting = True, True, False
        self.slow_health_answers, self.health_delay_seconds = 0, 0.0
        self.slow_ready_answers, self.ready_delay_seconds = 0, 0.0
        self.metrics_text = None
        self.calls.clear()
        self.disconnects = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.calls[path] = self.calls.get(path, 0) + 1
        if path == "/health":
            if self.slow_health_answers > 0:
                self.slow_health_answers -= 1
                await asyncio.sleep(self.health_delay_seconds)
            return web.Response(status=200 if self.healthy else 503)
        if path == "/metrics":
            if self.metrics_text is None:
                return web.Response(status=404)
            return web.Response(text=self.metrics_text, content_type="text/plain")
        if path == "/ready/vllm":
            if self.slow_ready_answers > 0:
                self.slow_ready_answers -= 1
                await asyncio.sleep(self.ready_delay_seconds)
            answer = ReadyAnswer(
                "vllm",
                self.ready,
                "open" if self.ready else "restart in progress" if self.restarting else "draining",
                self.restarting,
            )
            return web.Response(
                body=encode(answer), status=answer.status, content_type="application/json"
            )
        self.active += 1
        try:
            return await self._work(request, path)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            self.active -= 1

    async def _work(self, request: web.Request, path: str) -> web.StreamResponse:
        body = await request.read()
        self.last_headers = list(request.headers.items())
        if path == "/v1/echo":
            return web.json_response(
                {"headers": self.last_headers, "body_bytes": len(body), "path_qs": request.path_qs}
            )
        if path == "/v1/error":
            err = {
                "error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}
            }
            return web.Response(
                status=400, body=json.dumps(err).encode(), headers={"X-Vllm": "1"},
                content_type="application/json",
            )  # fmt: skip
        if path == "/v1/hold":
            await self.release.wait()
            return web.json_response({"ok": True})
        if request.headers.get("X-Stub-Hold-Body") == "1":
            # vLLM whose engine never gets the request: a stream's headers at once, no body
            # until released (then one completion chunk, as vLLM writes it, and [DONE]).
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await self.release.wait()
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "hi", "logprobs": None,
                                  "finish_reason": "length", "stop_reason": None,
                                  "prompt_token_ids": [1], "token_ids": [2]}]}  # fmt: skip
            await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        if path == "/v1/sse":
            n = int(request.query.get("n", "5"))
            delay = float(request.query.get("delay", "0"))
            hold = request.query.get("hold") == "1"  # the rest only once released
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                await resp.write(f'data: {{"i": {i}, "pad": "{"x" * 1000}"}}\n\n'.encode())
                if hold and i == 0:
                    await self.release.wait()
                if delay:
                    await asyncio.sleep(delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if path == "/v1/die_before":
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("stub: dies before answering")
        if path == "/v1/die_mid":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"i": 0}\n\n')
            await asyncio.sleep(0.05)
            if request.transport is not None:
                request.transport.abort()
            return resp
        if path == "/v1/dying_500":
            if self.calls[path] == 1:
                err = {
                    "error": {
                        "message": "cannot schedule new futures after shutdown",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                return web.Response(status=500, body=json.dumps(err).encode(), content_type="application/json")  # fmt: skip
            return web.json_response({"ok": True, "call": self.calls[path]})
        return web.json_response({"detail": "Not Found"}, status=404)


def dechunk(body: bytes) -> bytes:
    """A chunked HTTP/1.1 body's payload (its framing checked), up to its last chunk."""
    out = bytearray()
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]
    return bytes(out)
