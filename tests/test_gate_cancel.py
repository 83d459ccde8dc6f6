"""A cancelled wait of the gate's stays cancelled, even when what it waited for came in the
same turn of the loop.

On Python 3.11 ``asyncio.wait_for`` returns the result instead of raising when its task is
cancelled in the turn its awaitable completes: the cancellation is lost. For the gate that
meant a request whose client had left went on to vLLM with the grant it was given as it left,
and a task told to stop (the follower's, at the gate's stop) went on polling, so the stop
waited for it forever. Each wait here is driven to exactly that turn: its awaitable completes
and its task is cancelled before the loop runs again.

Then the same for the waits around them (found by an adversarial review, each reproduced here
first): the exchange that offers a held request to the fallback replica while it keeps its
place in the queue (the grant and the fallback's answer each given back, whatever the turn the
client leaves in), the stops that cancel a task of their own and wait for it (the caller's own
cancellation kept), and a request rejected by the gate's stop in the turn its client leaves.
Gate-level cases run a real gate between two stand-ins on loopback, one event loop, events
ordered by loop turns; every wait is bounded and prints what it saw.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.test_gate_support import refused_url
from vllm_guardian.gate.admission import Admission, Cost, Limits, Rejected
from vllm_guardian.gate.body import BodyBudget
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

COST = Cost(10, 10)


async def _cancelled_as_it_completes(task: asyncio.Future[object], complete: object) -> str:
    """Complete the awaited thing (``complete()``) and cancel ``task`` in one turn; what the
    task did: "cancelled" or "returned"."""
    await asyncio.sleep(0.01)  # the task waits now
    assert not task.done()
    complete()  # type: ignore[operator]
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "returned"


def test_a_request_cancelled_as_it_is_admitted_stays_cancelled_and_gives_its_grant_back() -> None:
    async def run() -> tuple[str, int, int]:
        a = Admission(Limits(release_rate_per_second=0.0), GateMetrics("vllm"))
        # Not started and closed: the request waits in the queue; the grant is made here, as
        # the dispatcher makes it.
        task = asyncio.ensure_future(a.acquire("k", COST))

        def grant() -> None:
            ((wid, waiter),) = list(a._queue.items())
            a._remove(wid)
            waiter.future.set_result(a._grant(waiter.cost))

        got = await _cancelled_as_it_completes(task, grant)
        return got, a.in_flight, a.committed_tokens

    assert asyncio.run(run()) == ("cancelled", 0, 0)


def test_a_body_read_cancelled_as_its_room_is_granted_stays_cancelled_and_gives_it_back() -> None:
    async def run() -> tuple[str, int]:
        budget = BodyBudget(100, GateMetrics("vllm"))
        assert budget.try_take(100)
        task = asyncio.ensure_future(budget.take(60, 30.0))
        got = await _cancelled_as_it_completes(task, lambda: budget.give(100))
        return got, budget.held_bytes

    assert asyncio.run(run()) == ("cancelled", 0)


@pytest.mark.python_only  # hands the compiled connect a loop of its own making
def test_a_connect_cancelled_as_it_completes_stays_cancelled() -> None:
    from vllm_guardian.gate.upstream import _connected

    class Loop:
        """Only what the connect asks of its loop: the connect itself, as a future."""

        def __init__(self, connected: asyncio.Future[None]) -> None:
            self.connected = connected

        def sock_connect(self, sock: socket.socket, address: object) -> asyncio.Future[None]:
            return self.connected

    async def run() -> str:
        connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with socket.socket() as sock:
            task = asyncio.ensure_future(
                _connected(Loop(connected), sock, ("127.0.0.1", 9), 30.0)  # type: ignore[arg-type]
            )
            return await _cancelled_as_it_completes(task, lambda: connected.set_result(None))

    assert asyncio.run(run()) == "cancelled"


# --- the exchange, the fallback and the stops ----------------------------------------------------

BOUND = 30.0
DOC = {"model": "m", "prompt": "hi", "max_tokens": 4}  # a unary completion: fallback allowed
ANSWER = b'{"id":"x","choices":[{"text":"ok"}]}'

Handler = Callable[[str, str, bytes, asyncio.StreamWriter], Awaitable[None]]


async def until(cond: Callable[[], bool], what: str) -> None:
    """One loop turn at a time until ``cond()``; fails after BOUND seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + BOUND
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0)


async def http_server(handler: Handler) -> tuple[asyncio.Server, str]:
    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
                n = 0
                for line in head.split("\r\n")[1:]:
                    k, _, v = line.partition(":")
                    if k.strip().lower() == "content-length":
                        n = int(v)
                body = await reader.readexactly(n) if n else b""
                await handler(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the test's loop ends (a stand-in's own task: nothing after it)
        finally:
            writer.close()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def answer(writer: asyncio.StreamWriter, body: bytes = ANSWER) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def vllm(method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
    answer(writer, b"" if path == "/health" else ANSWER)


class Fallback:
    """The fallback replica: holds each request until ``release`` is set."""

    def __init__(self) -> None:
        self.got = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, method: str, path: str, body: bytes, w: asyncio.StreamWriter) -> None:
        self.got.set()
        await self.release.wait()
        answer(w)
        await w.drain()


async def held_gate(fallback_url: str, fallback_after: float) -> tuple[Gate, asyncio.Server]:
    """A gate in front of an always-healthy vLLM stand-in, then held by the test (the follower
    polls once more after start, then not for 1000 s)."""
    up, up_url = await http_server(vllm)
    gate = Gate(
        GateSettings(
            proxy=ProxySettings(
                upstream=up_url,
                fallback_url=fallback_url,
                fallback_after_seconds=fallback_after,
            ),
            listen_port=0,
            limits=Limits(max_wait_seconds=BOUND, release_rate_per_second=0),
            poll_interval_seconds=1000.0,
            stall_hold_seconds=0,
            shutdown_timeout_seconds=1.0,
        )
    )
    await gate.start()
    assert gate.follower is not None and gate.admission is not None
    follower = gate.follower
    await until(lambda: follower.polls >= 2, "the follower's second poll")
    gate.admission.set_state(False, "held by the test")
    return gate, up


async def send(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(DOC).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return reader, writer


def acquiring_task() -> asyncio.Task[Any]:
    """The proxy's ``waiting`` task (GateProxy._admit: ensure_future(admission.acquire(...)))."""
    (t,) = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "Admission.acquire"
    ]
    return t


def handler_task(gate: Gate) -> asyncio.Task[Any]:
    assert gate._server is not None
    (task,) = [c.task for c in gate._server.connections if c.task is not None]
    return task


# --- a held request offered to the fallback gives its grant back ------------------------------


@pytest.mark.python_only  # finds the proxy's waiting task by its coroutine's name
def test_a_ticket_granted_while_the_fallback_answers_is_given_back() -> None:
    """Held, offered to the fallback; this server admits it while the fallback works on it;
    the fallback answers 200. The exchange ends: the admission must hold no ticket for it."""

    async def run() -> tuple[int, int, int, bytes]:
        fb = Fallback()
        fsrv, furl = await http_server(fb)
        gate, up = await held_gate(furl, fallback_after=0.05)
        a, proxy = gate.admission, gate.proxy
        assert a is not None and proxy is not None
        reader, writer = await send(gate.port)
        await asyncio.wait_for(fb.got.wait(), BOUND)  # offered to the fallback (still queued)
        assert a.queue_depth == 1
        a.set_state(True, "open")  # this server admits it meanwhile
        await until(lambda: a.queue_depth == 0 and a.in_flight == 1, "the grant")
        fb.release.set()  # the fallback takes it: 200
        status_line = await asyncio.wait_for(reader.readline(), BOUND)
        await until(lambda: proxy.open_exchanges == 0, "the exchange's end")
        seen = (a.in_flight, a.committed_tokens, len(a._queue), status_line)
        print(f"after the exchange: in_flight={seen[0]} committed_tokens={seen[1]} "
              f"queued={seen[2]} client got {status_line!r}")  # fmt: skip
        writer.close()
        await gate.stop()
        for s in (up, fsrv):
            s.close()
        return seen

    in_flight, committed, _, status = asyncio.run(run())
    assert status.startswith(b"HTTP/1.1 200")
    assert (in_flight, committed) == (0, 0)


@pytest.mark.python_only  # finds the proxy's waiting task by its coroutine's name
def test_a_request_whose_client_leaves_as_it_is_admitted_gives_its_ticket_back() -> None:
    """With a fallback set, the admission's wait runs in a task of its own; the client leaves
    (its handler is cancelled, as connection_lost does) in the turn that task completes."""

    async def run() -> tuple[str, int, int]:
        fb = Fallback()
        fsrv, furl = await http_server(fb)
        gate, up = await held_gate(furl, fallback_after=BOUND)  # never reached
        a = gate.admission
        assert a is not None
        _, writer = await send(gate.port)
        await until(lambda: a.queue_depth == 1, "the request held")
        waiting, handler = acquiring_task(), handler_task(gate)
        a.set_state(True, "open")
        await until(waiting.done, "the grant")
        handler.cancel()  # the client left in this turn (http1.Connection.connection_lost)
        await asyncio.wait({handler}, timeout=BOUND)
        got = "cancelled" if handler.cancelled() else f"done: {handler.exception()!r}"
        seen = (got, a.in_flight, a.committed_tokens)
        print(f"handler {got}; waiting={waiting!r}; in_flight={a.in_flight} "
              f"committed_tokens={a.committed_tokens}")  # fmt: skip
        writer.close()
        await gate.stop()
        for s in (up, fsrv):
            s.close()
        return seen

    _, in_flight, committed = asyncio.run(run())
    assert (in_flight, committed) == (0, 0)


# --- ... and the fallback's answer, whenever its client leaves --------------------------------


@pytest.mark.python_only  # finds the proxy's waiting task by its coroutine's name
def test_a_fallback_answer_is_released_when_the_client_leaves_as_the_queue_lets_go() -> None:
    """The fallback answered; _admit's finally cancels its place in the queue and waits for
    that; the client leaves in that wait. The fallback's connection must not stay busy."""

    async def run() -> tuple[int, int]:
        fb = Fallback()
        fsrv, furl = await http_server(fb)
        gate, up = await held_gate(furl, fallback_after=0.05)
        pool = gate._fallback_pool
        assert pool is not None
        _, writer = await send(gate.port)
        await asyncio.wait_for(fb.got.wait(), BOUND)
        waiting, handler = acquiring_task(), handler_task(gate)
        fb.release.set()  # the fallback takes it: _admit returns its answer...
        await until(waiting.done, "the queue place given up")  # ...after this wait
        handler.cancel()  # the client left in this turn
        await asyncio.wait({handler}, timeout=BOUND)
        busy = len(pool._busy)
        print(f"handler cancelled={handler.cancelled()}; waiting cancelled="
              f"{waiting.cancelled()}; fallback pool busy={busy}")  # fmt: skip
        writer.close()
        await gate.stop()
        after_stop = len(pool._busy)
        print(f"after gate.stop(): fallback pool busy={after_stop}")
        for s in (up, fsrv):
            s.close()
        return busy, after_stop

    assert asyncio.run(run()) == (0, 0)


# --- a stop keeps its caller's cancellation ----------------------------------------------------


async def _gate() -> Gate:
    gate = Gate(
        GateSettings(
            proxy=ProxySettings(upstream=refused_url()),
            listen_port=0,
            poll_interval_seconds=1000.0,
            stall_hold_seconds=0,
        )
    )
    await gate.start()
    return gate


async def _guard() -> Any:
    from vllm_guardian.gate.connections import ConnectionGuard

    guard = ConnectionGuard(
        max_connections=4, idle_timeout_seconds=60.0, metrics=GateMetrics("vllm")
    )
    guard.start()
    return guard


@pytest.mark.parametrize("started", [_gate, _guard], ids=["Gate", "ConnectionGuard"])
def test_a_stop_cancelled_in_its_first_wait_raises_cancelled_error(
    started: Callable[[], Awaitable[Any]],
) -> None:
    """Its first wait is for the task of its own it cancelled (the gate's: the loop-lag
    watch's)."""

    async def run() -> str:
        stopping = await started()
        stopper = asyncio.ensure_future(stopping.stop())
        await asyncio.sleep(0)  # the stop waits for its own task now
        stopper.cancel()
        done, _ = await asyncio.wait({stopper}, timeout=BOUND)
        assert done
        got = "cancelled" if stopper.cancelled() else f"returned {stopper.result()!r}"
        print(f"{type(stopping).__name__}.stop() cancelled in its first wait: {got}")
        return got

    assert asyncio.run(run()) == "cancelled"


# --- a request rejected by the stop as its client leaves stays cancelled ----------------------


def test_a_request_cancelled_as_the_gate_stops_stays_cancelled() -> None:
    async def run() -> str:
        a = Admission(Limits(release_rate_per_second=0.0), GateMetrics("vllm"))
        a.start()  # closed: the request waits in the queue
        task = asyncio.ensure_future(a.acquire("k", Cost(10, 10)))
        await until(lambda: a.queue_depth == 1, "the request queued")
        await a.stop()  # rejects the queued request (SHUTDOWN)...
        task.cancel()  # ...and its client leaves in the same turn
        await asyncio.wait({task}, timeout=BOUND)
        if task.cancelled():
            got = "cancelled"
        elif isinstance(e := task.exception(), Rejected):
            got = f"Rejected({e.reason.value})"
        else:
            got = f"done: {task.exception()!r}"
        print(f"acquire cancelled as stop() rejected it: {got}")
        return got

    assert asyncio.run(run()) == "cancelled"


def test_a_fallback_whose_5xx_answer_breaks_off_is_a_refusal_and_the_request_waits_on() -> None:
    """The fallback answers 500 and closes before the body it announced: the gate counts a
    refusal and the request waits on for this server, as for any 5xx (it used to escape as an
    error of the gate's: 500 to the client)."""

    async def broken(method: str, path: str, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\nshort")
        await w.drain()
        w.close()

    async def run() -> tuple[float, bytes]:
        fsrv, furl = await http_server(broken)
        gate, up = await held_gate(furl, fallback_after=0.05)
        a = gate.admission
        assert a is not None

        def refused() -> float:
            value = gate.metrics.registry.get_sample_value(
                "vllm_guardian_gate_fallbacks_total", {"service": "vllm", "result": "refused"}
            )
            return value or 0.0

        reader, writer = await send(gate.port)
        await until(lambda: refused() == 1, "the fallback's refusal")
        a.set_state(True, "open")
        status_line = await asyncio.wait_for(reader.readline(), BOUND)
        print(f"refused {refused()}, the client got {status_line!r}")
        writer.close()
        await gate.stop()
        for s in (up, fsrv):
            s.close()
        return refused(), status_line

    refusals, status = asyncio.run(run())
    assert refusals == 1
    assert status.startswith(b"HTTP/1.1 200")


def test_the_gates_stop_leaves_no_queued_tokens_or_shares_behind() -> None:
    """The admission's stop rejects what waits and empties the queue: its queued tokens (a
    gauge read at scrape) and per-client shares go with it, not left counting requests that
    are gone."""

    async def run() -> tuple[int, int, int]:
        a = Admission(Limits(release_rate_per_second=0.0), GateMetrics("vllm"))
        a.start()  # closed: requests wait in the queue
        tasks = [asyncio.ensure_future(a.acquire(k, Cost(10, 10))) for k in ("a", "a", "b")]
        await until(lambda: a.queue_depth == 3, "three requests queued")
        await a.stop()
        await asyncio.wait(tasks, timeout=BOUND)
        assert all(isinstance(t.exception(), Rejected) for t in tasks)
        return a.queue_depth, a.queued_tokens, len(a._per_key)

    assert asyncio.run(run()) == (0, 0, 0)
