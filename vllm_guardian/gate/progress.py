"""The gate's progress watch: is vLLM processing the requests it already holds?

Where it sits: the follower reads vLLM's ``/metrics`` every ``kv_poll_interval_seconds`` and
hands each reading to :meth:`ProgressWatch.observe`; its state poll (every
``poll_interval_seconds``) closes the gate while :meth:`ProgressWatch.stalled` gives a reason.
Pure: the time is an argument.

Why the gate holds sooner than the guardian restarts. A hung engine still answers ``/health``
with 200 and accepts requests (vllm#39863), which then wait in it until the client's timeout and
fail. The guardian restarts it after ``signals.stall_seconds`` (30 s) without progress, a
disruptive act it must not take on a slow step. Holding new requests at the gate is not
disruptive: a false alarm costs the held requests the time until the engine is seen to move
(the gate reopens on the next reading that moved), while a true one saves every request that arrives
until the restart; they are sent, in order, to the restarted instance. So the gate holds after
``stall_hold_seconds`` (10 s), a third of the guardian's wait.

"Progress" is :func:`vllm_guardian.core.progress.moved`, the guardian's own definition (any
value the engine writes on a step changed: KV usage, running and waiting, token, preemption and
prefix-cache counters; or another process), or nothing in the engine at all (an idle engine
processes nothing and is not stalled). One long prompt alone moves no token counter while it is
prefilled (vLLM V1 counts its prompt tokens at the end), but its KV usage grows at every chunk:
it is not held. A reading that cannot be had (``/metrics`` unreadable, the counters absent)
forgets what was seen: the gate never holds on missing data, it serves on ``/health`` as before.
"""

from __future__ import annotations

from vllm_guardian.core.progress import ProgressReading, moved


class ProgressWatch:
    """Remembers when vLLM last made progress; says why it is stalled, or None."""

    def __init__(self, hold_after_seconds: float) -> None:
        # 0 turns the watch off.
        self.hold_after_seconds = hold_after_seconds
        self._last: ProgressReading | None = None
        self._progress_at: float | None = None
        self._seen_at: float | None = None

    def observe(self, now: float, reading: ProgressReading | None) -> None:
        last, self._last = self._last, reading
        if reading is None:
            self._progress_at = self._seen_at = None
            return
        self._seen_at = now
        if (
            last is None
            or self._progress_at is None
            or moved(last, reading)
            or reading.requests_in_engine <= 0
        ):
            self._progress_at = now

    def stalled(self) -> str | None:
        """Why new requests should be held (as of the last reading), or None."""
        if (
            self.hold_after_seconds <= 0
            or self._last is None
            or self._progress_at is None
            or self._seen_at is None
        ):
            return None
        quiet = self._seen_at - self._progress_at
        if self._last.requests_in_engine <= 0 or quiet < self.hold_after_seconds:
            return None
        return (
            f"vLLM made no progress for {quiet:.0f} s with "
            f"{self._last.requests_in_engine:.0f} requests in it: new requests are held"
        )
