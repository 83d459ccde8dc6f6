"""Time, injected: the daemon uses SystemClock, tests drive FakeClock.

The pure core never reads a clock; the shell reads one here and passes ``now`` in.
"""

from __future__ import annotations

import time
from typing import Protocol

# A deadline seen this much after it passed was not seen in time: the process was not running
# (the host's CPUs taken), and what it waited for may have come meanwhile. The gate's polls,
# the guardian's fetches and its tick give such a wait its time once more instead of taking it
# for silence (gate/looplag.py, lowio/httpget.py, shell/daemon.py).
LATE_DEADLINE_SECONDS = 0.25


def reached_late(now: float, due: float) -> bool:
    """Whether a deadline ``due``, seen at ``now`` (the same clock), was seen too late to have
    been seen in time: the process was not running when it passed."""
    return now - due > LATE_DEADLINE_SECONDS


class Clock(Protocol):
    def time(self) -> float:
        """Unix time in seconds (what snapshots and records carry)."""
        ...

    def monotonic(self) -> float:
        """A clock that never jumps, for durations and deadlines."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SteadyClock:
    """Unix time that never steps: the wall clock once, at start, plus monotonic time since.

    The daemon runs on this, so an NTP step (or an operator's ``date -s``) never moves a
    cooldown, a budget window, a rate or a phase's deadline. Its ``time()`` stays within the
    wall clock's slew since the guardian started, so records and the saved policy state still
    read as Unix time, and a restarted guardian (anchored afresh) compares saved times with an
    error of that slew only (normally milliseconds).
    """

    def __init__(self, clock: Clock) -> None:
        self.inner = clock
        self._wall0 = clock.time()
        self._mono0 = clock.monotonic()

    def time(self) -> float:
        return self._wall0 + (self.inner.monotonic() - self._mono0)

    def monotonic(self) -> float:
        return self.inner.monotonic()

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to; ``sleep`` advances it instantly."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._mono = 1000.0

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))

    def advance(self, seconds: float) -> None:
        self._now += seconds
        self._mono += seconds
