"""A cancelled wait of the gate's stays cancelled, even when what it waited for came in the
same turn of the loop.

On Python 3.11 ``asyncio.wait_for`` returns the result instead of raising when its task is
cancelled in the turn its awaitable completes: the cancellation is lost. For the gate that
meant a request whose client had left went on to vLLM with the grant it was given as it left,
and a task told to stop (the follower's, at the gate's stop) went on polling, so the stop
waited for it forever. Each wait here is driven to exactly that turn: its awaitable completes
and its task is cancelled before the loop runs again.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from vllm_guardian.gate.admission import Admission, Cost, Limits
from vllm_guardian.gate.body import BodyBudget
from vllm_guardian.gate.metrics import GateMetrics

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
