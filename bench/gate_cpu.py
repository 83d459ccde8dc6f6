"""Benchmark: the gate's CPU per SSE event and per unary request, against nginx, same run.

Run: .venv/bin/python bench/gate_cpu.py [--repeat 3] [--seconds 5] [--out bench/results/gate-cpu]
     (``--quick``: one repeat, small loads, no files written: what tests/test_bench_gate_cpu.py runs)

Layout, all on 127.0.0.1: the proxy under test is pinned to core 0 with ``taskset``: the gate
(``vllm-guardian gate`` with its defaults), Debian's nginx (one process, ``master_process
off``, ``proxy_buffering off``, HTTP/1.1 keep-alive to the upstream), ``splice``, the floor
of the gate's own stack (a byte relay in Python on uvloop that passes each connection's bytes
through unchanged, no HTTP at all: :func:`serve_splice`), ``lean``, an HTTP/1.1 proxy on that
stack with an llhttp parser and nothing of the gate's, and ``lean-gate``, the same with the
core of the gate's work done by its own modules (:func:`serve_lean`). The client (this process) and a
cheap upstream stub (a raw asyncio protocol on uvloop, a subprocess) are pinned to core 1.
The proxies run side by side the whole time and take turns, load point by load point, so
drift on a shared machine hits them all alike.

The stub answers ``POST /v1/completions`` like vLLM: a ~300-byte JSON answer, or with
``"stream": true`` a chunked ``text/event-stream`` of ``--events-per-stream`` completion
chunks (with ``token_ids`` when the request asks ``return_token_ids``, as the gate does for
continuation), one every ``1 / --event-rate`` seconds per stream, then ``data: [DONE]``.
Streams are paced by one timer wheel (5 ms ticks), not a task per stream, so 2,000 streams
cost the stub little. A finished stream's connection sends the next request at once.

Measured per load point, in a window of ``--seconds`` after a ramp:

* CPU per unit of work: the proxy process's user + system time from ``/proc/PID/stat``
  over the window, divided by the events (or requests) the client received in it. Robust on
  a noisy machine: other work slows the proxy down but does not add to its CPU time. Also
  the same after subtracting the proxy's idle CPU rate (the gate polls the upstream's
  ``/health`` on its own), and the proxy core's share used;
* SSE: events/s delivered against the offered rate, the added gap p99 (the gaps between
  events as the client received them, minus the stub's pace), and streams stalled (a gap of
  more than ``--stall-seconds``, or nothing received for that long at the window's end, a
  stream never answered included);
* memory per active stream: the proxy's RSS during the window minus its RSS before the
  first point, divided by the streams;
* unary: requests/s with N keep-alive connections in a closed loop.

Each point is measured ``--repeat`` times; the table gives the median and the range, and the
host's load average beside each repeat. A window in which the proxy spent more than
``--max-wait-share`` of it runnable but waiting for a core (``/proc/PID/schedstat``: other work
had it), or in which a stream stalled, is measured again, up to ``--retries`` times: a
starved proxy handles several events a wake-up and reads cheaper than it is, and a proxy that
got no core at all measures nothing. Each point's JSON says how long it waited
(``runq_wait_share``) and in which attempt it was taken (``attempts``). Results go to ``OUT.json`` and ``OUT.md`` with the
command line and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK_S = 0.005

NGINX_CONF = """
master_process off;
worker_processes 1;
worker_rlimit_nofile 20000;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 10000; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 100000;
    upstream vllm {{ server 127.0.0.1:{upstream}; keepalive 4096; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 32m;
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""

UNARY_BODY = json.dumps(
    {"model": "demo", "prompt": "the quick brown fox", "max_tokens": 1}
).encode()
STREAM_BODY = json.dumps(
    {"model": "demo", "prompt": "the quick brown fox", "max_tokens": 100, "stream": True}
).encode()


# --- the floor: a byte relay on the gate's stack (this file, --serve-splice PORT UPSTREAM) -----


async def _serve_until_sigterm(protocol: Callable[[], asyncio.Protocol], port: int) -> None:
    """Listen on 127.0.0.1:``port`` with ``protocol`` until SIGTERM (the splice and lean
    proxies)."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, "127.0.0.1", port, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()


async def _connect_upstream(
    protocol: Callable[[], asyncio.Protocol], port: int, queued: list[bytes]
) -> asyncio.Transport:
    """A client connection's own connection to the upstream, with what the client sent before
    it was open (``queued``, emptied) written first."""
    up, _ = await asyncio.get_running_loop().create_connection(protocol, "127.0.0.1", port)
    transport = cast("asyncio.Transport", up)
    for data in queued:
        transport.write(data)
    queued.clear()
    return transport


def serve_splice(port: int, upstream_port: int) -> None:
    """Until SIGTERM: each client connection gets its own connection to the upstream, and the
    bytes pass through unchanged both ways (no HTTP parsing, no admission, no continuation).
    What Python and uvloop cost a relay with nothing else to do: the gate's own work is what
    it costs above this."""
    import uvloop  # noqa: PLC0415 (only this process needs it)

    class Upstream(asyncio.Protocol):
        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client

        def data_received(self, data: bytes) -> None:
            self.client.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.close()

    class Client(asyncio.Protocol):
        def __init__(self) -> None:
            self.up: asyncio.Transport | None = None
            self.early: list[bytes] = []  # what the client sent before the upstream connected
            self.t: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = cast("asyncio.Transport", transport)
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            assert self.t is not None
            client = self.t
            self.up = await _connect_upstream(lambda: Upstream(client), upstream_port, self.early)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.early.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

    uvloop.run(_serve_until_sigterm(Client, port))


# --- an HTTP proxy with nothing else in it (this file, --serve-lean PORT UPSTREAM) -----------

# Hop-by-hop headers (RFC 9110 §7.6.1) and the framing the lean proxy sets itself.
_LEAN_DROP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
     b"transfer-encoding", b"content-length", b"host"}
)  # fmt: skip


def serve_lean(port: int, upstream_port: int, *, gate_core: bool = False) -> None:
    """Until SIGTERM: an HTTP/1.1 reverse proxy on the gate's stack, with the HTTP work a proxy
    cannot skip and nothing of the gate's: each request parsed (llhttp, through ``httptools``,
    the parser uvicorn uses), its head rebuilt without hop-by-hop headers and sent on the
    client connection's own kept-alive upstream connection; the answer's head parsed and
    rebuilt the same way, its chunked body de-chunked and chunked again for the client (as
    nginx does with ``proxy_http_version 1.1``). No admission, continuation, metrics or logs.
    What a gate on asyncio protocols and an llhttp parser would cost before its own work:
    the budget that leaves the gate's work under a ratio to nginx is that ratio minus this
    one. Not hardened (no limits, one request at a time per connection): a measuring stick.

    ``gate_core`` (target ``lean-gate``): the same proxy with the core of the gate's work, done
    by the gate's own modules: each POST as a task that reads its body as JSON once, estimates
    its cost, plans its stream (``return_token_ids`` asked of the upstream), counts it and
    waits for the admission (open, so at once) and gives its ticket back at the answer's end;
    each event of a planned stream cut from the chunks and read for its token ids
    (``StreamState``), stripped of them unless the client asked. Not in it: the retry and
    fallback paths, the hung-engine bookkeeping, the connection guard, the body budget, the
    client's timeout, the status. What is left of a ratio to nginx after this one is what
    those may cost."""
    import httptools  # noqa: PLC0415 (only this process needs it)
    import uvloop  # noqa: PLC0415

    from vllm_guardian.gate import continuation  # noqa: PLC0415
    from vllm_guardian.gate.admission import Admission, Limits, Ticket, cost_of  # noqa: PLC0415
    from vllm_guardian.gate.metrics import GateMetrics  # noqa: PLC0415

    metrics = GateMetrics("bench")
    admission = Admission(Limits(release_rate_per_second=0), metrics)

    class Upstream(asyncio.Protocol):
        head: bytes | None  # the answer's head, until its first body bytes go with it
        state: continuation.StreamState | None = None  # gate_core: a planned stream's
        splitter: continuation.SseSplitter | None = None

        def __init__(self, client: Client) -> None:
            self.client = client
            self.parser = httptools.HttpResponseParser(self)
            self.headers: list[tuple[bytes, bytes]] = []
            self.head = None
            self.chunked = False

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.upstream_lost()

        # httptools' callbacks
        def on_message_begin(self) -> None:
            self.headers.clear()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

        def on_headers_complete(self) -> None:
            status = self.parser.get_status_code()
            self.state = self.splitter = None
            plan = self.client.plan
            if plan is not None and status == 200:
                self.state = continuation.StreamState(plan)
                self.splitter = continuation.SseSplitter(1 << 20)
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
            length: bytes | None = None
            for k, v in self.headers:
                lk = k.lower()
                if lk == b"content-length":
                    length = v
                elif lk not in _LEAN_DROP:
                    lines.append(k + b": " + v + b"\r\n")
            self.chunked = length is None
            if length is None:
                lines.append(b"Transfer-Encoding: chunked\r\n\r\n")
            else:
                lines.append(b"Content-Length: " + length + b"\r\n\r\n")
            self.head = b"".join(lines)  # written with the first body bytes

        def with_head(self, out: bytes) -> bytes:
            head = self.head
            if head is None:
                return out
            self.head = None
            return head + out

        def on_body(self, body: bytes) -> None:
            if self.state is not None and self.splitter is not None:
                body = self.events(self.state, self.splitter, body)
                if not body:
                    return
            out = b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body
            self.client.write(self.with_head(out))

        @staticmethod
        def events(state: continuation.StreamState, splitter: continuation.SseSplitter, data: bytes) -> bytes:  # fmt: skip
            out = []
            for event in splitter.feed(data):
                common = state.relay_common(event)
                if common is None:
                    common = state.on_event(event).data
                if common:
                    out.append(common)
            return out[0] if len(out) == 1 else b"".join(out)

        def on_message_complete(self) -> None:
            out = self.with_head(b"0\r\n\r\n" if self.chunked else b"")
            if out:
                self.client.write(out)
            self.client.answered()
            self.state = self.splitter = None

    class Client(asyncio.Protocol):
        plan: continuation.Plan | None = None  # gate_core: the request's stream plan
        ticket: Ticket | None = None  # gate_core: its hold on the admission

        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.t: asyncio.Transport | None = None
            self.up: asyncio.Transport | None = None
            self.pending: list[bytes] = []  # requests ready before the upstream connected
            self.url = b""
            self.headers: list[tuple[bytes, bytes]] = []
            self.body: list[bytes] = []

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = cast("asyncio.Transport", transport)
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            self.up = await _connect_upstream(lambda: Upstream(self), upstream_port, self.pending)

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                assert self.t is not None
                self.t.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self.t.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

        def write(self, data: bytes) -> None:
            assert self.t is not None
            self.t.write(data)

        def answered(self) -> None:
            """The answer is whole: the next request may go (one at a time, no pipelining)."""
            assert self.t is not None
            if self.ticket is not None:
                admission.release(self.ticket)
                self.ticket = None
            self.t.resume_reading()

        async def exchange(self, method: bytes, head: list[bytes], body: bytes) -> None:
            """gate_core: the gate's work on one request, before it goes upstream."""
            started = time.perf_counter()
            path = self.url.split(b"?", 1)[0].decode("latin-1")
            doc = continuation.body_json(body)
            cost = cost_of(body, doc, 256)
            metrics.arrived.inc()
            plan = continuation.plan_of(path, body, doc, enabled=True)
            if isinstance(plan, continuation.Plan):
                self.plan, body = plan, plan.upstream_body
            self.ticket = await admission.acquire("bench", cost)
            metrics.overhead_seconds.observe(time.perf_counter() - started)
            self.send(b"".join(head) + b"Content-Length: %d\r\n\r\n" % len(body) + body)

        def send(self, request: bytes) -> None:
            if self.up is None:
                self.pending.append(request)
            else:
                self.up.write(request)

        def upstream_lost(self) -> None:
            assert self.t is not None
            self.t.close()

        # httptools' callbacks
        def on_message_begin(self) -> None:
            self.url = b""
            self.headers.clear()
            self.body.clear()

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            assert self.t is not None
            self.t.pause_reading()  # until the answer is whole
            body = b"".join(self.body)
            method = self.parser.get_method()
            lines = [method + b" " + self.url + b" HTTP/1.1\r\n"]
            lines.append(b"Host: 127.0.0.1:%d\r\n" % upstream_port)
            lines += [k + b": " + v + b"\r\n" for k, v in self.headers if k.lower() not in _LEAN_DROP]  # fmt: skip
            self.plan = None
            if gate_core and method == b"POST":
                asyncio.get_running_loop().create_task(self.exchange(method, lines, body))
                return
            lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
            self.send(b"".join(lines) + body)

    async def main() -> None:
        admission.start()
        admission.set_state(True, "open")
        await _serve_until_sigterm(Client, port)

    uvloop.run(main())


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


# --- the stub upstream (this file, run with --serve-stub PORT) -------------------------------


def serve_stub(
    port: int,
    events: int,
    gap_s: float,
    *,
    reuse_port: bool = False,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM. ``reuse_port``: bind with SO_REUSEPORT, so several stub processes
    share the port (bench/gate_workers.py); ``on_listening`` is called once it listens."""
    import uvloop  # noqa: PLC0415 (only the stub's process needs it)

    answer = json.dumps(
        {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "demo",
         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length",
                      "stop_reason": None}],
         "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}}
    ).encode()  # fmt: skip
    unary = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(answer)).encode()
        + b"\r\n\r\n"
        + answer
    )
    empty = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    missing = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
    sse_head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
        b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def event(i: int, ids: bool) -> bytes:
        choice = '"index":0,"text":" tok","logprobs":null'
        if i == 0 and ids:
            choice += ',"prompt_token_ids":[1,2,3,4]'
        last = i == events - 1
        choice += ',"finish_reason":"length","stop_reason":null' if last else (
            ',"finish_reason":null,"stop_reason":null'
        )  # fmt: skip
        if ids:
            choice += f',"token_ids":[{1000 + i}]'
        doc = (
            '{"id":"cmpl-0","object":"text_completion","created":1,"model":"demo",'
            f'"choices":[{{{choice}}}],"usage":null}}'
        )
        return chunk(b"data: " + doc.encode() + b"\n\n")

    with_ids = [event(i, True) for i in range(events)]
    without = [event(i, False) for i in range(events)]
    tail = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    slots = max(1, round(gap_s / TICK_S))
    wheel: list[set[Stream]] = [set() for _ in range(slots)]
    tick = 0

    class Stream:
        __slots__ = ("conn", "evs", "i")

        def __init__(self, conn: Conn, evs: list[bytes]) -> None:
            self.conn, self.i, self.evs = conn, 0, evs

    class Conn(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = b""
            self.t: asyncio.Transport | None = None
            self.stream: Stream | None = None
            self.slot = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

        def connection_lost(self, exc: Exception | None) -> None:
            if self.stream is not None:
                wheel[self.slot].discard(self.stream)
                self.stream = None

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end].lower()
                n = 0
                at = head.find(b"content-length:")
                if at >= 0:
                    n = int(head[at + 15 :].split(b"\r\n", 1)[0])
                if len(self.buf) < end + 4 + n:
                    return
                body = self.buf[end + 4 : end + 4 + n]
                self.buf = self.buf[end + 4 + n :]
                self.answer(head, body)

        def answer(self, head: bytes, body: bytes) -> None:
            assert self.t is not None
            if head.startswith(b"get /health"):
                self.t.write(empty)
            elif not head.startswith(b"post"):
                self.t.write(missing)
            elif b'"stream":true' in body.replace(b" ", b""):
                ids = b'"return_token_ids":true' in body.replace(b" ", b"")
                self.t.write(sse_head)
                self.stream = Stream(self, with_ids if ids else without)
                self.slot = (tick + 1) % slots
                wheel[self.slot].add(self.stream)
            else:
                self.t.write(unary)

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    t0 = loop.time()

    def on_tick() -> None:
        nonlocal tick
        tick += 1
        slot = wheel[tick % slots]
        done = []
        for s in slot:
            t = s.conn.t
            assert t is not None
            t.write(s.evs[s.i])
            s.i += 1
            if s.i == len(s.evs):
                t.write(tail)
                done.append(s)
        for s in done:
            slot.discard(s)
            s.conn.stream = None
        # Paced against the start: a late tick does not shift the later ones.
        loop.call_at(max(loop.time(), t0 + (tick + 1) * TICK_S), on_tick)

    loop.call_at(t0 + TICK_S, on_tick)
    server = loop.run_until_complete(
        loop.create_server(
            Conn, "127.0.0.1", port, backlog=4096, reuse_address=True, reuse_port=reuse_port
        )
    )
    if on_listening is not None:
        on_listening()
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.run_forever()
    server.close()


# --- a gate with its collections logged (this file, run with --gate-gc-log FILE ARGS...) ------


def gate_with_gc_log(out: str, gate_argv: list[str]) -> None:
    """Run ``vllm-guardian gate`` recording each collection: generation, CPU and wall seconds
    (CPU: the collection's own work, whatever the scheduler does); written to ``out`` at exit."""
    import gc  # noqa: PLC0415
    import runpy  # noqa: PLC0415

    log: list[tuple[int, float, float, float]] = []
    started = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.thread_time(), time.perf_counter()]
        else:
            cpu, wall = time.thread_time() - started[0], time.perf_counter() - started[1]
            log.append((info["generation"], cpu, wall, time.monotonic()))

    gc.callbacks.append(on_gc)
    sys.argv = ["vllm_guardian.gate", *gate_argv]
    try:
        runpy.run_module("vllm_guardian.gate", run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(log))


def gc_summary(name: str, path: Path, since: float) -> str:
    """The collections of one gate from the first load point on (start-up's are not the hot
    path's): CPU ms, as the collection's own work."""
    log = [e for e in (json.loads(path.read_text()) if path.exists() else []) if e[3] >= since]
    full = [cpu for gen, cpu, _, _ in log if gen == 2]
    young = [cpu for gen, cpu, _, _ in log if gen < 2]
    return (
        f"- {name}: {len(young)} young collections (max {max(young, default=0) * 1e3:.2f} ms "
        f"CPU), {len(full)} full (max {max(full, default=0) * 1e3:.2f} ms CPU, total "
        f"{sum(full) * 1e3:.1f} ms)"
    )


# --- the client --------------------------------------------------------------------------


class Window:
    """What the client saw of one load point, counted only while ``on``."""

    def __init__(self, stall_s: float) -> None:
        self.on = False
        self.events = 0
        self.requests = 0
        self.gaps: list[float] = []
        self.stall_s = stall_s
        self.stalled: set[int] = set()


def _stream_request(port: int, body: bytes) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer bench\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class SseClient(asyncio.Protocol):
    """One keep-alive connection: a streamed completion, and the next as soon as it ends."""

    def __init__(self, w: Window, req: bytes, ident: int, done: asyncio.Future[None]) -> None:
        self.w, self.req, self.ident, self.done = w, req, ident, done
        self.t: asyncio.Transport | None = None
        self.tail = b""
        self.last: float | None = None  # the last event of the current stream
        self.seen = time.perf_counter()  # the last bytes of any stream, or the connection
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        self.t.write(self.req)

    def data_received(self, data: bytes) -> None:
        now = self.seen = time.perf_counter()
        seen = self.tail + data
        n = data.count(b"\n\n") + (self.tail[-1:] == b"\n" and data[:1] == b"\n")
        if not self.ended and b"[DONE]" in seen:
            n -= 1
            self.ended = True
        self.tail = data[-8:]
        if n > 0:
            w = self.w
            if w.on:
                w.events += n
                if self.last is not None:
                    gap = now - self.last
                    w.gaps.append(gap)
                    if gap > w.stall_s:
                        w.stalled.add(self.ident)
                    w.gaps.extend([0.0] * (n - 1))  # several events in one read
            self.last = now
        if self.ended and seen.endswith(b"0\r\n\r\n"):
            if self.w.on:
                self.w.requests += 1
            self.ended, self.tail, self.last = False, b"", None
            assert self.t is not None
            self.t.write(self.req)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


class UnaryClient(asyncio.Protocol):
    """One keep-alive connection in a closed loop of unary requests."""

    def __init__(self, w: Window, req: bytes, done: asyncio.Future[None]) -> None:
        self.w, self.req, self.done = w, req, done
        self.buf = b""
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        self.t.write(self.req)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            n = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            self.buf = self.buf[end + 4 + n :]
            if self.w.on:
                self.w.requests += 1
            assert self.t is not None
            self.t.write(self.req)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_sys_s(pid: int) -> float:
    """System (kernel) CPU seconds of the process: the sockets' share of its CPU."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / CLK_TCK


def proc_rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


@dataclass
class Point:
    target: str
    kind: str  # "sse" or "unary"
    concurrency: int
    repeat: int
    seconds: float
    cpu_s: float
    units: int  # events (sse) or requests (unary) received in the window
    us_per_unit: float
    us_per_unit_net: float  # less the proxy's idle CPU rate
    core_busy: float
    rate_per_s: float
    offered_per_s: float | None = None
    gap_p99_added_ms: float | None = None
    stalled_streams: int | None = None
    rss_per_stream_kib: float | None = None
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    gc: dict[str, float] = field(default_factory=dict)
    # The share of the window the proxy spent runnable but not running (other work had its
    # core), and how many windows it took to get one under the bound.
    runq_wait_share: float | None = None
    attempts: int = 1
    # Of us_per_unit, the kernel's (system time): the sockets' work, which a proxy's own code
    # does not change; the rest is the proxy's user time.
    sys_us_per_unit: float | None = None


async def run_point(
    port: int, pid: int, kind: str, n: int, args: argparse.Namespace, idle: tuple[float, int]
) -> tuple[float, int, float, int, list[float], int, float, float, float]:
    """Drive one load point; (cpu_s, units, seconds, rss, gaps, stalled, ramp, the share of
    the window the proxy waited for a core, its system CPU seconds)."""
    loop = asyncio.get_running_loop()
    w = Window(args.stall_seconds)
    conns: list[asyncio.Transport] = []
    protos: list[SseClient] = []
    dones: list[asyncio.Future[None]] = []
    ramp = min(2.0, max(0.2, n / 1000)) if kind == "sse" else 0.2
    for i in range(n):
        done: asyncio.Future[None] = loop.create_future()
        dones.append(done)
        if kind == "sse":
            proto: asyncio.Protocol = SseClient(w, _stream_request(port, STREAM_BODY), i, done)
            protos.append(proto)  # type: ignore[arg-type]
        else:
            proto = UnaryClient(w, _stream_request(port, UNARY_BODY), done)
        t, _ = await loop.create_connection(lambda p=proto: p, "127.0.0.1", port)  # type: ignore[misc]
        conns.append(t)
        await asyncio.sleep(ramp / n)
    await asyncio.sleep(args.warmup)
    w.on = True
    cpu0, t0 = proc_cpu_s(pid), time.perf_counter()
    sys0, wait0 = proc_sys_s(pid), proc_runq_wait_s(pid)
    await asyncio.sleep(args.seconds)
    # A window with nothing received measures nothing: it goes on until something is (a
    # proxy starved of its core by other work), within a generous bound.
    while not (w.events or w.requests) and time.perf_counter() - t0 < 60:
        await asyncio.sleep(0.05)
    cpu1, t1 = proc_cpu_s(pid), time.perf_counter()
    sys_s = proc_sys_s(pid) - sys0
    # The proxy's wait only: the client shares its core with the stub by design (a closed
    # unary loop keeps both runnable), and a client too starved to read shows as stalls.
    waited = (proc_runq_wait_s(pid) - wait0) / (t1 - t0)
    w.on = False
    rss = proc_rss_bytes(pid)
    if kind == "sse":  # silent at the window's end (or never answered): stalled too
        for p in protos:
            if t1 - p.seen > w.stall_s:
                w.stalled.add(p.ident)
    for t in conns:
        t.abort()
    await asyncio.wait(dones, timeout=10)
    await asyncio.sleep(0.5)  # the proxy closes its side
    units = w.events if kind == "sse" else w.requests
    return cpu1 - cpu0, units, t1 - t0, rss, w.gaps, len(w.stalled), ramp, waited, sys_s


def proc_runq_wait_s(pid: int) -> float:
    """Seconds the process has spent runnable but waiting for a core (``/proc/PID/schedstat``,
    its second field; 0 where the kernel does not keep it)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def idle_rate(pid: int, seconds: float) -> float:
    c0, t0 = proc_cpu_s(pid), time.perf_counter()
    time.sleep(seconds)
    return (proc_cpu_s(pid) - c0) / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


@contextlib.contextmanager
def process(
    argv: list[str], port: int, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env, cwd=cwd)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{argv[0]}: nothing listens on 127.0.0.1:{port}")
            time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(core: int | None, argv: list[str]) -> list[str]:
    return argv if core is None else ["taskset", "-c", str(core), *argv]


def compile_gate(tree: Path, into: Path) -> Path:
    """A copy of ``tree`` in ``into`` with the gate's request and event path compiled by mypyc
    (``scripts/compile-gate``: the modules of ``gate/compiled.py``, as ``VLLM_GUARDIAN_COMPILE=1``
    builds them), which Python imports ahead of their sources: the tree the gate-mypyc target
    runs, beside the gate as Python."""
    print("# compiling the gate for gate-mypyc (scripts/compile-gate)", flush=True)
    done = subprocess.run([str(tree / "scripts" / "compile-gate"), str(into)],
                          env={**os.environ, "COMPILE_GATE_PYTHON": sys.executable},
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"scripts/compile-gate failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-2000:]}")  # fmt: skip
    return into


def commit(tree: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + ("+dirty" if dirty else "")


def summarize(points: list[Point]) -> list[str]:
    """The markdown table: per load, the median over repeats (range) for each target."""
    lines = [
        "| load | target | µs/unit (median, range) | net of idle | of it kernel | core busy | "
        "rate/s | offered/s | +gap p99 ms | stalled | RSS KiB/stream |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    loads = list(dict.fromkeys((p.kind, p.concurrency) for p in points))
    targets = list(dict.fromkeys(p.target for p in points))
    ratios: list[str] = []
    for kind, n in loads:
        med: dict[str, float] = {}
        for t in targets:
            ps = [p for p in points if (p.kind, p.concurrency, p.target) == (kind, n, t)]
            if not ps:
                continue
            us = [p.us_per_unit for p in ps]
            med[t] = statistics.median(us)
            unit = "event" if kind == "sse" else "request"

            def m(xs: list[float | None], f: str) -> str:
                v = [x for x in xs if x is not None]
                return format(statistics.median(v), f) if v else "–"

            lines.append(
                f"| {kind} × {n} | {t} | {med[t]:.1f} µs/{unit} ({min(us):.1f}–{max(us):.1f}) | "
                f"{m([p.us_per_unit_net for p in ps], '.1f')} | "
                f"{m([p.sys_us_per_unit for p in ps], '.1f')} | "
                f"{m([p.core_busy for p in ps], '.0%')} | {m([p.rate_per_s for p in ps], '.0f')} | "
                f"{m([p.offered_per_s for p in ps], '.0f')} | "
                f"{m([p.gap_p99_added_ms for p in ps], '.1f')} | "
                f"{max((p.stalled_streams or 0) for p in ps) if kind == 'sse' else '–'} | "
                f"{m([p.rss_per_stream_kib for p in ps], '.1f')} |"
            )
        if "nginx" in med and med["nginx"] > 0:
            for g in ("gate", "gate-base", "gate-mypyc", "splice", "lean", "lean-gate"):
                if g in med:
                    ratios.append(f"- {kind} × {n}: {g} ÷ nginx = {med[g] / med['nginx']:.2f}×")
    return [*lines, "", *ratios]


async def drive(args: argparse.Namespace, targets: dict[str, tuple[int, int]]) -> list[Point]:
    # Stopped with SIGTERM (SIGINT is ignored in a background job): the servers stop too.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    points: list[Point] = []
    idle = {t: (idle_rate(pid, args.idle_seconds), proc_rss_bytes(pid)) for t, (_, pid) in targets.items()}  # fmt: skip
    loads = [("sse", n) for n in args.streams] + [("unary", n) for n in args.unary]
    args.load_started = time.monotonic()
    for rep in range(args.repeat):
        for kind, n in loads:
            for t, (port, pid) in targets.items():
                # A window in which the proxy waited long for its core (other work on the
                # machine), or a stream stalled, is measured again: a starved proxy handles
                # several events a wake-up, which reads cheaper than it is.
                attempts = 0
                while True:
                    attempts += 1
                    la = os.getloadavg()
                    cpu, units, secs, rss, gaps, stalled, _, waited, sys_s = await run_point(port, pid, kind, n, args, idle[t])  # fmt: skip
                    starved = waited > args.max_wait_share or (kind == "sse" and stalled > 0)
                    if not starved or attempts > args.retries:
                        break
                    print(f"rep {rep} {kind:5} × {n:5} {t:6} starved (waited {waited:.0%} of the window for a core, {stalled or 0} stalled): measured again", flush=True)  # fmt: skip
                net = max(0.0, cpu - idle[t][0] * secs)
                p = Point(
                    target=t, kind=kind, concurrency=n, repeat=rep, seconds=round(secs, 3),
                    cpu_s=round(cpu, 3), units=units,
                    us_per_unit=round(cpu / units * 1e6, 2) if units else float("inf"),
                    us_per_unit_net=round(net / units * 1e6, 2) if units else float("inf"),
                    core_busy=round(cpu / secs, 3), rate_per_s=round(units / secs, 1),
                    load_avg=(round(la[0], 2), round(la[1], 2), round(la[2], 2)),
                    runq_wait_share=round(waited, 3), attempts=attempts,
                    sys_us_per_unit=round(sys_s / units * 1e6, 2) if units else None,
                )  # fmt: skip
                if kind == "sse":
                    p.offered_per_s = n * args.event_rate
                    p.gap_p99_added_ms = round((pct(gaps, 0.99) - 1 / args.event_rate) * 1e3, 2)
                    p.stalled_streams = stalled
                    if rep == 0:  # loads rise in the first repeat; freed memory is kept after
                        p.rss_per_stream_kib = round((rss - idle[t][1]) / n / 1024, 2)
                points.append(p)
                print(
                    f"rep {rep} {kind:5} × {n:5} {t:6} {p.us_per_unit:8.1f} µs/unit "
                    f"(net {p.us_per_unit_net:6.1f}, sys {p.sys_us_per_unit or 0:5.1f}) "
                    f"busy {p.core_busy:5.0%} {p.rate_per_s:8.0f}/s"
                    + (f" +gap p99 {p.gap_p99_added_ms:6.1f} ms stalled {stalled}" if kind == "sse" else "")
                    + (f" rss/stream {p.rss_per_stream_kib:.1f} KiB" if p.rss_per_stream_kib is not None else "")
                    + f"  load {la[0]:.2f} waited {waited:.0%}",
                    flush=True,
                )  # fmt: skip
    return points


# A fixed pure-Python loop, best of 5, in the gates' interpreter: how fast it runs bytecode,
# recorded beside the results so runs on other hosts or interpreters can be told apart. (On one
# host Debian's python3.11 ran it in ~0.65x the time of a pyenv 3.11.7, yet the gate's CPU per
# event and per request were about the same under both in back-to-back runs: 39 vs 41 µs per
# event at 512 streams, 195 vs 171 µs per request.)
_PROBE = """
import json, sys, time
def f(n):
    s = 0
    for i in range(n):
        s += i * 2 % 7
    return s
took = []
for _ in range(5):
    t = time.process_time()
    f(2_000_000)
    took.append(time.process_time() - t)
print(json.dumps({"version": sys.version.split()[0], "executable": sys.executable,
                  "loop_ms": round(min(took) * 1e3)}))
"""


def interpreter(python: str) -> dict[str, object]:
    """Which Python the gates ran under, and how fast it runs bytecode (:data:`_PROBE`)."""
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, check=True)
    doc: dict[str, object] = json.loads(out.stdout)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--streams", default="16,128,512,2000", help="concurrent SSE streams per point")
    ap.add_argument("--unary", default="1,16,128", help="keep-alive connections per unary point")
    ap.add_argument("--event-rate", type=float, default=20.0, help="events/s per stream")
    ap.add_argument("--events-per-stream", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement window per point")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds after the ramp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stall-seconds", type=float, default=1.0)
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument(
        "--max-wait-share", type=float, default=0.2,
        help="a window in which the proxy waited longer than this share of it "
        "for a core (/proc/PID/schedstat), or a stream stalled, is measured again",
    )  # fmt: skip
    ap.add_argument("--retries", type=int, default=3, help="how many times, at most")
    ap.add_argument(
        "--targets",
        default="gate,nginx,splice,lean,lean-gate",
        help="what to measure: gate, nginx, splice (a bare byte relay on the gate's stack), "
        "lean (an HTTP proxy on the gate's stack with nothing of the gate's: serve_lean), "
        "lean-gate (the same with the core of the gate's work), gate-mypyc (this checkout's "
        "gate with its request and event path compiled by mypyc: scripts/compile-gate)",
    )
    ap.add_argument(
        "--base", metavar="TREE",
        help="also measure the gate of another checkout (target gate-base), e.g. the commit "
        "before a change, in the same run",
    )  # fmt: skip
    ap.add_argument(
        "--base-compiled",
        action="store_true",
        help="run gate-base compiled as gate-mypyc is (its tree's scripts/compile-gate): a "
        "same-run A/B of a change to the compiled gate",
    )
    ap.add_argument(
        "--gate-args", default="--release-rate 0",
        help="extra gate flags (default: no release pacing, so that a moment's hold during the "
        "run cannot leave a queue released at 50 requests/s; this measures the data path)",
    )  # fmt: skip
    ap.add_argument(
        "--base-args", metavar="ARGS",
        help="the flags of gate-base instead of --gate-args: with --base naming this checkout, "
        "a same-run A/B of a flag (e.g. --base . --base-args '--release-rate 0 "
        "--continuation off')",
    )  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gate-cpu"))
    ap.add_argument(
        "--gate-python",
        metavar="PYTHON",
        help="the interpreter the gates run under (default: this one; it needs the gate's "
        "dependencies)",
    )
    ap.add_argument("--profile", metavar="FILE", help="run the gate under cProfile, into FILE")
    ap.add_argument(
        "--gc-log", metavar="DIR", help="log every gate's collections into DIR and summarise them"
    )
    ap.add_argument("--gate-gc-log", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny loads, nothing written")
    ap.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-splice", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--serve-lean", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--serve-lean-gate", type=int, nargs=2, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if rest and not args.gate_gc_log:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.serve_stub:
        serve_stub(args.serve_stub, args.events_per_stream, 1 / args.event_rate)
        return 0
    if args.serve_splice:
        serve_splice(*args.serve_splice)
        return 0
    if args.serve_lean:
        serve_lean(*args.serve_lean)
        return 0
    if args.serve_lean_gate:
        serve_lean(*args.serve_lean_gate, gate_core=True)
        return 0
    if args.gate_gc_log:
        gate_with_gc_log(args.gate_gc_log, rest)
        return 0
    if args.quick:
        args.streams, args.unary, args.repeat = "4", "2", 1
        args.seconds, args.warmup, args.idle_seconds = 0.6, 0.2, 0.2
        args.events_per_stream = 10
        args.retries = 0  # a smoke run: whatever the machine gives
    args.streams = [int(x) for x in str(args.streams).split(",") if x]
    args.unary = [int(x) for x in str(args.unary).split(",") if x]
    names = [t for t in args.targets.split(",") if t]
    if args.base_compiled and not args.base:
        ap.error("--base-compiled needs --base")
    if args.base:
        names.insert(names.index("gate") + 1 if "gate" in names else 0, "gate-base")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if "nginx" in names and not Path(nginx).exists():
        if os.environ.get("VLLM_GUARDIAN_REQUIRE_TOOLS") == "1":
            raise SystemExit("nginx not found (apt-get install nginx-light)")
        print("nginx not found: measuring the gate alone")
        names.remove("nginx")
    cores = os.sched_getaffinity(0)
    proxy_core, client_core = (0, 1) if {0, 1} <= cores and shutil.which("taskset") else (None, None)  # fmt: skip
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    py = sys.executable
    gate_py = args.gate_python or py
    up = free_port()
    stub = pinned(client_core, [py, __file__, "--serve-stub", str(up),
                                "--events-per-stream", str(args.events_per_stream),
                                "--event-rate", str(args.event_rate)])  # fmt: skip
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    print(f"# bench/gate_cpu.py at {commit()}, proxy on core {proxy_core}, client and stub on core {client_core}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-gate-cpu-") as tmp, contextlib.ExitStack() as stack:  # fmt: skip
        stack.enter_context(process(stub, up))
        targets: dict[str, tuple[int, int]] = {}
        compiled = compile_gate(ROOT, Path(tmp) / "mypyc") if "gate-mypyc" in names else None
        compiled_base = (
            compile_gate(Path(args.base).resolve(), Path(tmp) / "mypyc-base")
            if args.base and args.base_compiled
            else None
        )
        for name in names:
            port = free_port()
            env: dict[str, str] | None = None
            cwd: Path | None = None
            if name.startswith("gate"):
                argv_ = [gate_py, "-m", "vllm_guardian.gate", "--listen", f"127.0.0.1:{port}",
                         "--upstream", f"http://127.0.0.1:{up}", "--log-level", "WARNING",
                         *(args.base_args if name == "gate-base" and args.base_args is not None
                           else args.gate_args).split()]  # fmt: skip
                if args.profile and name == "gate":  # cProfile's cost inflates the figures
                    argv_[1:3] = ["-m", "cProfile", "-o", args.profile, "-m", "vllm_guardian.gate"]
                elif args.gc_log:
                    argv_[1:3] = [
                        str(Path(__file__).resolve()),
                        "--gate-gc-log",
                        str(Path(args.gc_log) / f"{name}.json"),
                    ]
                tree = Path(args.base).resolve() if name == "gate-base" else ROOT
                if name == "gate-mypyc":
                    assert compiled is not None
                    tree = compiled
                elif name == "gate-base" and compiled_base is not None:
                    tree = compiled_base
                # Run from the tree too: ``python -m`` puts the working directory first on
                # sys.path, ahead of PYTHONPATH (from another checkout, the base would be that
                # checkout's code, not its own).
                env, cwd = {**os.environ, "PYTHONPATH": str(tree)}, tree
            elif name == "splice":
                argv_ = [py, __file__, "--serve-splice", str(port), str(up)]
            elif name == "lean":
                argv_ = [py, __file__, "--serve-lean", str(port), str(up)]
            elif name == "lean-gate":  # the gate's modules from this tree, as the gate runs
                argv_ = [py, __file__, "--serve-lean-gate", str(port), str(up)]
                env, cwd = {**os.environ, "PYTHONPATH": str(ROOT)}, ROOT
            else:
                d = Path(tmp) / "nginx"
                d.mkdir()
                conf = d / "nginx.conf"
                conf.write_text(NGINX_CONF.format(d=d, upstream=up, port=port))
                argv_ = [nginx, "-p", str(d), "-e", str(d / "error.log"), "-c", str(conf), "-g", "daemon off;"]  # fmt: skip
            proc = stack.enter_context(process(pinned(proxy_core, argv_), port, env, cwd))
            targets[name] = (port, proc.pid)
        import uvloop  # noqa: PLC0415

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            points = r.run(drive(args, targets))
    table = summarize(points)
    if args.gc_log:  # written by each gate as it stopped
        table += ["", "Collections in each gate, start to stop:"] + [
            gc_summary(n, Path(args.gc_log) / f"{n}.json", args.load_started)
            for n in names
            if n.startswith("gate")
        ]
    print("\n".join(table))
    if args.quick:
        return 0
    out = Path(args.out)
    meta = {"command": command, "commit": commit(), "cores": os.cpu_count(),
            "proxy_core": proxy_core, "client_core": client_core,
            "event_rate": args.event_rate, "events_per_stream": args.events_per_stream,
            "seconds": args.seconds, "repeat": args.repeat, "load_avg_end": os.getloadavg(),
            "gate_args": args.gate_args, "base": args.base and commit(Path(args.base)),
            "base_args": args.base_args, "base_compiled": args.base_compiled,
            "max_wait_share": args.max_wait_share, "retries": args.retries,
            "gate_python": interpreter(gate_py)}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=1) + "\n")  # fmt: skip
    out.with_suffix(".md").write_text(
        f"# gate vs nginx: CPU per SSE event and per unary request\n\n`{command}` at `{meta['commit']}`; "
        f"proxy pinned to core {proxy_core}, client and stub on core {client_core}; "
        f"{args.repeat} repeats of {args.seconds:g} s per point; "
        f"the gates on Python {meta['gate_python']['version']} "
        f"({meta['gate_python']['executable']}, {meta['gate_python']['loop_ms']} ms for the "
        "interpreter probe in `interpreter()`); "
        f"load average per repeat in the JSON (`load_avg`), at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}.\n\n"
        + "\n".join(table) + "\n"
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
