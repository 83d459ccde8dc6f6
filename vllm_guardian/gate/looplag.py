"""How late the gate's event loop runs: the one measure that says whether the gate itself was
answering, when a client or the guardian saw it slow.

Everything the gate does (accepting, reading heads, relaying chunks, answering
``/gate/status``) runs on one event loop per process. A loop that is late by a second answers
nothing for that second: on a host whose CPUs the engine saturates (the gate descheduled), or
when something on the loop blocked. :class:`LoopLag` wakes every ``interval_seconds`` and
records how much later than asked it woke:

* every lag into ``vllm_guardian_gate_loop_lag_seconds`` (a histogram);
* the largest in the last ``window_seconds`` as ``loop_lag_max_seconds`` in ``/gate/status``
  (the guardian's gate source carries it into the flight recording);
* a WARNING for each lag of at least ``warn_seconds``, with the CPU time this process used
  meanwhile: about the lag, the loop was busy (something ran on it that long); near zero, the
  process was not running (the host's CPUs were taken) or blocked outside Python.

And how busy the process keeps its core: every ``busy_window_seconds`` the share of that window
it spent on a CPU, as ``cpu_busy_share`` in ``/gate/status``, and a WARNING at
``busy_warn_share`` or more. One gate process relays on one core; near all of it, events queue
behind each other and streams stall (2,000 streams of 20 events/s on one process: 621 stalled,
docs/benchmarks.md), long before the loop is a second late. The remedy is more workers.

Where it runs: a task of its own beside the follower, started and stopped with the gate.

:func:`running_timeout` is ``asyncio.timeout`` for a loop that may not run: a deadline the loop
reached late (it was not running when it passed) is not taken for silence at once, since an
answer that arrived meanwhile is seen in the same turn of the loop and asyncio would let the
deadline win (the follower's polls use it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import Histogram

from vllm_guardian.lowio.clock import reached_late

log = logging.getLogger("vllm_guardian.gate")

# Lags from scheduler noise (a millisecond) to a starved or blocked loop (seconds).
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LoopLag:
    def __init__(
        self,
        histogram: Histogram,
        *,
        interval_seconds: float = 0.1,
        window_seconds: float = 60.0,
        warn_seconds: float = 1.0,
        busy_window_seconds: float = 60.0,
        busy_warn_share: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self._histogram = histogram
        self._interval = interval_seconds
        self._window = window_seconds
        self._warn = warn_seconds
        self._busy_window, self._busy_warn = busy_window_seconds, busy_warn_share
        self._busy_from: tuple[float, float] | None = None  # (clock, CPU clock) at its start
        # The share of the last whole busy window this process was on a CPU (None before one).
        self.busy_share: float | None = None
        self._clock, self._cpu = clock, cpu_clock
        # (when it ended, lag) of the lags in the window, largest kept only while it is largest
        # of what follows it: the front is the window's maximum.
        self._recent: collections.deque[tuple[float, float]] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def observe(self, lag_seconds: float, now: float, cpu_seconds: float) -> None:
        """Record one wake-up ``lag_seconds`` late, ending at ``now`` (the clock's seconds),
        during which this process used ``cpu_seconds`` of CPU."""
        lag = max(0.0, lag_seconds)
        self._histogram.observe(lag)
        while self._recent and self._recent[-1][1] <= lag:
            self._recent.pop()
        self._recent.append((now, lag))
        if lag >= self._warn:
            if cpu_seconds < 0.5 * lag:
                why = (
                    "the process was not running (the host's CPUs taken) or blocked outside Python"
                )
            elif self.busy_share is not None and self.busy_share >= self._busy_warn:
                # No one callback need have run that long: a saturated loop reaches its timers
                # only after the reads queued before them (2,000 streams on one process).
                why = (
                    f"the loop was busy, in a process on a CPU {self.busy_share:.0%} of its last "
                    "minute: saturated, its work queues (run more workers)"
                )
            else:
                why = "the loop was busy"
            log.warning(
                "gate: its event loop ran %.1f s late (nothing was answered meanwhile); this "
                "process used %.2f s of CPU in it: %s",
                lag,
                cpu_seconds,
                why,
            )

    def note_cpu(self, now: float, cpu_seconds: float) -> None:
        """This process's CPU clock read at ``now``: once a busy window has passed since the
        last, its share of that window on a CPU becomes :attr:`busy_share`, with a WARNING when
        it is ``busy_warn_share`` or more."""
        if self._busy_from is None:
            self._busy_from = (now, cpu_seconds)
            return
        began, cpu_then = self._busy_from
        if now - began < self._busy_window:
            return
        self.busy_share = max(0.0, cpu_seconds - cpu_then) / (now - began)
        self._busy_from = (now, cpu_seconds)
        if self.busy_share >= self._busy_warn:
            log.warning(
                "gate: this process was on a CPU %.0f%% of the last %.0f s; one gate process "
                "relays on one core, and near all of it events queue and streams stall: run "
                'more workers (gate.workers, docs/gate.md "More than one core")',
                100 * self.busy_share,
                now - began,
            )

    def max_seconds(self, now: float | None = None) -> float:
        """The largest lag that ended within the last ``window_seconds`` (0 when none)."""
        t = self._clock() if now is None else now
        while self._recent and self._recent[0][0] < t - self._window:
            self._recent.popleft()
        return self._recent[0][1] if self._recent else 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait, not a suppressed await of it: that would swallow a cancellation
            # of this stop's own caller too (tests/test_gate_cancel.py).
            await asyncio.wait({self._task})
            self._task = None

    async def _run(self) -> None:
        while True:
            asked, cpu = self._clock(), self._cpu()
            await asyncio.sleep(self._interval)
            now, cpu_now = self._clock(), self._cpu()
            self.observe(now - asked - self._interval, now, cpu_now - cpu)
            self.note_cpu(now, cpu_now)


@contextlib.asynccontextmanager
async def running_timeout(seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)``, except when the loop reaches the deadline more than
    ``LATE_DEADLINE_SECONDS`` after it passed (it was not running): what arrived meanwhile is
    handled in that turn, and the block gets ``seconds`` more, once, counted from then. Raises
    TimeoutError as asyncio's does; bounded by twice ``seconds`` plus the stalls."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as cm:
        due = loop.time() + seconds
        extended = False
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal due, extended, handle
            now = loop.time()
            if not extended and reached_late(now, due):
                extended = True
                due = now + seconds
                handle = loop.call_at(due, check)
            else:
                cm.reschedule(now)  # expires: the block is cancelled, TimeoutError raised

        handle = loop.call_at(due, check)
        try:
            yield
        finally:
            if handle is not None:
                handle.cancel()
