"""The gate's own lateness (gate/looplag.py): a gate that answers late because its loop was late
says so, in ``/gate/status``, in its ``/metrics`` and in its log.

Why it exists: in the real-engine overload the guardian found the gate's status unanswered
within 1 s in most ticks, and nothing could say whether the gate or the host was to blame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry, Histogram

from tests.hostile import wait_for
from tests.test_gate_support import GateThread, Stub
from vllm_guardian.gate.looplag import LAG_BUCKETS, LoopLag, running_timeout


def _lag(**kw: float) -> LoopLag:
    h = Histogram("lag_seconds", "test", buckets=LAG_BUCKETS, registry=CollectorRegistry())
    return LoopLag(h, clock=lambda: 0.0, **kw)


@pytest.mark.parametrize(
    ("lags", "at", "expected"),
    [
        ([], 0.0, 0.0),  # nothing seen: no lag
        ([(1.0, 0.002)], 1.0, 0.002),
        ([(1.0, 2.5), (2.0, 0.01), (3.0, 0.02)], 3.0, 2.5),  # the largest, not the last
        ([(1.0, 2.5), (2.0, 0.01), (3.0, 0.02)], 61.5, 0.02),  # 2.5 s left the minute
        ([(1.0, 0.3), (2.0, 0.9), (3.0, 0.1)], 62.5, 0.1),  # ...and so did 0.9 s
        ([(1.0, -0.001)], 1.0, 0.0),  # woke early (clock granularity): not negative
    ],
    ids=["none", "one", "largest", "expired", "expired-later", "early"],
)
def test_the_status_figure_is_the_largest_lag_of_the_last_minute(
    lags: list[tuple[float, float]], at: float, expected: float
) -> None:
    lag = _lag(window_seconds=60.0)
    for now, seconds in lags:
        lag.observe(seconds, now, 0.0)
    assert lag.max_seconds(at) == expected


@pytest.mark.parametrize(
    ("lag_seconds", "cpu_seconds", "says"),
    [
        (2.0, 1.9, "the loop was busy"),
        (2.0, 0.05, "the process was not running (the host's CPUs taken) or blocked"),
        (0.5, 0.5, None),  # under warn_seconds: counted, not logged
    ],
    ids=["busy", "descheduled", "small"],
)
def test_a_late_loop_is_logged_with_the_cpu_it_used(
    caplog: pytest.LogCaptureFixture, lag_seconds: float, cpu_seconds: float, says: str | None
) -> None:
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    _lag(warn_seconds=1.0).observe(lag_seconds, 10.0, cpu_seconds)
    lines = [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]
    if says is None:
        assert lines == []
    else:
        assert len(lines) == 1 and says in lines[0], lines
        assert f"{lag_seconds:.1f} s late" in lines[0], lines


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


def test_a_stalled_gate_reports_its_stall_in_status_metrics_and_log(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    """The gate's loop blocks for 1.5 s (as a blocking call or a descheduled process does); the
    next status read shows it, the histogram counts it, and the log names it."""
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    g = GateThread(stub.url)
    try:
        before = requests.get(g.url + "/gate/status", timeout=60).json()
        print("before:", before["loop_lag_max_seconds"])
        g.lt.loop.call_soon_threadsafe(time.sleep, 1.5)
        doc: dict[str, object] = {}

        def stall_seen() -> tuple[bool, object]:
            nonlocal doc
            doc = requests.get(g.url + "/gate/status", timeout=60).json()
            return float(doc["loop_lag_max_seconds"]) >= 1.3, doc["loop_lag_max_seconds"]  # type: ignore[arg-type]

        wait_for(stall_seen, "the status to report the stall")
        text = requests.get(g.url + "/metrics", timeout=60).text
        over_one = [
            line
            for line in text.splitlines()
            if line.startswith("vllm_guardian_gate_loop_lag_seconds_bucket") and 'le="1.0"' in line
        ]
        count = [
            line
            for line in text.splitlines()
            if line.startswith("vllm_guardian_gate_loop_lag_seconds_count")
        ]
        print(over_one, count)
        assert float(count[0].split()[-1]) > float(over_one[0].split()[-1]), (over_one, count)
        warned = [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]
        assert warned and "not running" in warned[0], warned  # time.sleep uses no CPU
    finally:
        g.stop()


# --- a deadline the loop was not running to see --------------------------------------------
#
# An answer that reached the gate's socket while its loop was not running (the host's CPUs
# taken) is seen in the same turn of the loop as the deadline that passed meanwhile; with
# asyncio's own timeout the deadline wins and the answer is thrown away: the follower took a
# /health that had answered for vLLM's silence. The gate's polls give the answer that turn.


@contextlib.contextmanager
def _answering_server() -> Iterator[int]:
    """A loopback server, on a thread of its own, that answers each line at once."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = srv.accept()
            with conn:
                while conn.recv(64):
                    conn.sendall(b"pong\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield port
    finally:
        srv.close()
        t.join(timeout=30)


def _ask_across_a_stall(timeout: Callable[[float], Any], port: int) -> bytes:
    """Ask, and stall the loop for longer than the timeout while the answer arrives."""

    async def ask() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            loop = asyncio.get_running_loop()
            sock = writer.get_extra_info("socket")

            def stall(until: float) -> None:
                # The loop does nothing (as when the process is not scheduled) from before the
                # question until the answer is in the socket and the deadline long past.
                writer.write(b"ping\n")
                select.select([sock.fileno()], [], [], 30.0)
                time.sleep(max(0.0, until - loop.time()))

            async with timeout(0.3):
                loop.call_soon(stall, loop.time() + 1.0)
                answer = await reader.readline()
                # More than one turn of the loop after the stall, as an HTTP exchange takes
                # (its head, its body, the connection's release).
                for _ in range(3):
                    await asyncio.sleep(0)
                return answer
        finally:
            writer.close()

    return asyncio.run(ask())


def test_asyncios_own_timeout_throws_away_an_answer_that_came_during_a_stall() -> None:
    # Why the gate has its own: this is what the follower's polls did.
    with _answering_server() as port, pytest.raises(TimeoutError):
        _ask_across_a_stall(asyncio.timeout, port)


def test_an_answer_that_came_while_the_loop_was_stalled_is_taken_not_timed_out() -> None:
    with _answering_server() as port:
        assert _ask_across_a_stall(running_timeout, port) == b"pong\n"


def test_a_deadline_with_no_answer_still_times_out_once_given_its_time_again() -> None:
    # A loop late at every turn (each turn blocks 0.3 s): the block gets its time once more,
    # not at every late deadline, so it ends while the busy turns still go on.
    turns = 0

    async def wait(busy: bool) -> None:
        loop = asyncio.get_running_loop()

        def busy_turn() -> None:
            nonlocal turns
            turns += 1
            time.sleep(0.3)
            if turns < 100:
                loop.call_soon(busy_turn)

        async with running_timeout(0.2):
            if busy:
                loop.call_soon(busy_turn)
            await asyncio.Event().wait()  # never set

    with pytest.raises(TimeoutError):
        asyncio.run(wait(False))
    with pytest.raises(TimeoutError):
        asyncio.run(wait(True))
    # Given its time twice (0.2 s each), a few late turns: not the 100 of an endless extension.
    assert turns < 50, turns
