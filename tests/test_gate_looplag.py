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


def _lag(**kw: Any) -> LoopLag:
    """A ticker on its own histogram; virtual time (a clock at 0) unless ``clock`` is given."""
    kw.setdefault("clock", lambda: 0.0)
    h = Histogram("lag_seconds", "test", buckets=LAG_BUCKETS, registry=CollectorRegistry())
    return LoopLag(h, **kw)


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
    ("lag_seconds", "cpu_seconds", "busy_minute", "says"),
    [
        (2.0, 1.9, None, "the loop was busy"),
        (2.0, 1.9, 0.5, "the loop was busy"),
        # The process was on a CPU nearly all its last minute: saturated, not one long callback.
        (2.0, 1.9, 0.95, "saturated, its work queues (run more workers)"),
        (2.0, 0.05, 0.95, "the process was not running (the host's CPUs taken) or blocked"),
        (2.0, 0.05, None, "the process was not running (the host's CPUs taken) or blocked"),
        (0.5, 0.5, None, None),  # under warn_seconds: counted, not logged
    ],
    ids=["busy", "busy-half-minute", "saturated", "descheduled-busy-minute", "descheduled",
         "small"],
)  # fmt: skip
def test_a_late_loop_is_logged_with_the_cpu_it_used(
    caplog: pytest.LogCaptureFixture,
    lag_seconds: float,
    cpu_seconds: float,
    busy_minute: float | None,
    says: str | None,
) -> None:
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    lag = _lag(warn_seconds=1.0, busy_window_seconds=60.0, busy_warn_share=0.9)
    if busy_minute is not None:
        lag.note_cpu(0.0, 0.0)
        lag.note_cpu(60.0, 60.0 * busy_minute)
    caplog.clear()
    lag.observe(lag_seconds, 70.0, cpu_seconds)
    lines = [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]
    if says is None:
        assert lines == []
    else:
        assert len(lines) == 1 and says in lines[0], lines
        assert f"{lag_seconds:.1f} s late" in lines[0], lines
        assert ("saturated" in lines[0]) == ("saturated" in says), lines


# --- how busy the process keeps its core ------------------------------------------------------
#
# One gate process relays on one core; near all of it streams stall long before the loop is a
# second late (2,000 streams on one process: 99 % busy, 621 stalled, lag well under a second).


@pytest.mark.parametrize(
    ("readings", "share", "warned"),
    [
        ([], None, 0),  # nothing read yet
        ([(0.0, 5.0), (30.0, 34.0)], None, 0),  # half a window: no figure yet
        ([(0.0, 5.0), (60.0, 62.0)], 0.95, 1),  # 57 s of CPU in 60 s
        ([(0.0, 5.0), (60.0, 35.0)], 0.5, 0),
        ([(0.0, 5.0), (60.0, 59.0)], 0.9, 1),  # at the threshold: warned
        ([(0.0, 5.0), (60.0, 62.0), (120.0, 74.0)], 0.2, 1),  # the last window's, not a mean
        ([(0.0, 5.0), (60.0, 62.0), (90.0, 90.0)], 0.95, 1),  # the next window is not over
        ([(0.0, 5.0), (61.0, 4.0)], 0.0, 0),  # a CPU clock that went back: never negative
        ([(0.0, 0.0), (100.0, 99.0)], 0.99, 1),  # a late reading: its own window's length
    ],
    ids=["none", "partial", "busy", "half", "threshold", "last-window", "next-partial",
         "clock-back", "long-window"],
)  # fmt: skip
def test_the_busy_share_is_the_last_whole_windows_and_a_busy_one_is_logged(
    caplog: pytest.LogCaptureFixture,
    readings: list[tuple[float, float]],
    share: float | None,
    warned: int,
) -> None:
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    lag = _lag(busy_window_seconds=60.0, busy_warn_share=0.9)
    for now, cpu in readings:
        lag.note_cpu(now, cpu)
    assert lag.busy_share == (None if share is None else pytest.approx(share))
    lines = [r.getMessage() for r in caplog.records if "was on a CPU" in r.getMessage()]
    assert len(lines) == warned, lines
    if warned:
        assert "run more workers" in lines[0] and "gate.workers" in lines[0], lines


def test_a_loop_kept_busy_is_measured_busy_and_an_idle_one_not() -> None:
    """The running ticker with the real clocks: a loop whose callbacks spin shows most of its
    process's CPU as busy; the same ticker on an idle loop, little."""
    shares: dict[str, float] = {}
    for spin in (True, False):
        loop = asyncio.new_event_loop()
        began = (time.monotonic(), time.process_time())
        try:
            lag = _lag(clock=time.monotonic, interval_seconds=0.05, busy_window_seconds=0.5)

            async def run(lag: LoopLag = lag, spin: bool = spin) -> None:
                lag.start()
                deadline = time.monotonic() + 60.0  # bound: a host this busy says so below
                while lag.busy_share is None and time.monotonic() < deadline:
                    if spin:
                        t = time.process_time()
                        while time.process_time() - t < 0.02:  # 20 ms of CPU, then yield
                            pass
                    await asyncio.sleep(0 if spin else 0.05)
                await lag.stop()

            loop.run_until_complete(run())
        finally:
            loop.close()
        assert lag.busy_share is not None, "no window completed within 60 s"
        shares["spin" if spin else "idle"] = lag.busy_share
        # The same measure over the whole run, taken here: as much as a busy host lets the
        # spinning process run, it is on a CPU; the figure must follow that, not the host.
        wall, cpu = time.monotonic() - began[0], time.process_time() - began[1]
        shares["spin_whole_run" if spin else "idle_whole_run"] = cpu / wall
    print(shares)
    assert shares["spin"] >= 0.5 * shares["spin_whole_run"] > 0, shares
    assert shares["idle"] < 0.2, shares


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
        assert before["cpu_busy_share"] is None  # its first minute is not over
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
