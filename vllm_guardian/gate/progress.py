"""The gate's progress watch: is vLLM processing the requests it already holds?

Where it sits: the follower reads vLLM's ``/metrics`` every ``kv_poll_interval_seconds`` and
hands each reading to :meth:`ProgressWatch.observe`; its state poll (every
``poll_interval_seconds``) closes the gate while :meth:`ProgressWatch.stalled` gives a reason.
Pure: the time is an argument.

Why the gate holds sooner than the guardian restarts. A hung engine still answers ``/health``
with 200 and accepts requests (vllm#39863), which then wait in it until the client's timeout and
fail. The guardian restarts it after ``signals.stall_seconds`` (30 s) without a processed token,
a disruptive act it must not take on a slow step. Holding new requests at the gate is not
disruptive: a false alarm costs the held requests the time until the next token is seen (the
gate reopens on the next reading that moved), while a true one saves every request that arrives
until the restart; they are sent, in order, to the restarted instance. So the gate holds after
``stall_hold_seconds`` (10 s), a third of the guardian's wait.

"Progress" is any change of vLLM's prompt + generation token counters (a decrease is a restarted
process) or nothing in the engine at all (an idle engine processes nothing and is not stalled).
A reading that cannot be had (``/metrics`` unreadable, the counters absent) forgets what was
seen: the gate never holds on missing data, it serves on ``/health`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_guardian.model import VllmScrape


@dataclass(frozen=True)
class Progress:
    """One reading of vLLM's ``/metrics``, summed over its engines."""

    tokens_total: float  # prompt + generation tokens processed since the process started
    requests_in_engine: float  # running + waiting

    @staticmethod
    def of(scrape: VllmScrape) -> Progress | None:
        """The reading, or None when an engine lacks a counter (nothing to judge by)."""
        if not scrape.engines:
            return None
        tokens = 0.0
        inside = 0.0
        for e in scrape.engines:
            if e.generation_tokens_total is None or e.prompt_tokens_total is None:
                return None
            tokens += e.generation_tokens_total + e.prompt_tokens_total
            inside += (e.requests_running or 0.0) + (e.requests_waiting or 0.0)
        return Progress(tokens, inside)


class ProgressWatch:
    """Remembers when vLLM last made progress; says why it is stalled, or None."""

    def __init__(self, hold_after_seconds: float) -> None:
        # 0 turns the watch off.
        self.hold_after_seconds = hold_after_seconds
        self._last: Progress | None = None
        self._progress_at: float | None = None
        self._seen_at: float | None = None

    def observe(self, now: float, reading: Progress | None) -> None:
        last, self._last = self._last, reading
        if reading is None:
            self._progress_at = self._seen_at = None
            return
        self._seen_at = now
        if (
            last is None
            or self._progress_at is None
            or reading.tokens_total != last.tokens_total
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
            f"vLLM processed no token for {quiet:.0f} s with "
            f"{self._last.requests_in_engine:.0f} requests in it: new requests are held"
        )
