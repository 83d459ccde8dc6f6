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

from dataclasses import dataclass

from vllm_guardian.core.progress import MARK_FIELDS, ProgressReading, moved

_GENERATED = MARK_FIELDS.index("generation_tokens_total")


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

    @property
    def last(self) -> ProgressReading | None:
        """The newest reading (None: none, or the newest could not be had)."""
        return self._last

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


@dataclass(frozen=True)
class EngineMark:
    """The engine as the follower's polls tell one from another: taken when the gate takes
    requests back from a hung engine, compared at each poll while they wait (the follower's
    :meth:`~vllm_guardian.gate.follower.Follower.poll_once`)."""

    process_start_time_seconds: float | None  # vLLM's API server process
    generation_tokens: float | None  # over all engines; None where a scrape lacks it
    health_failures: int  # /health refused or not 200, as the follower has counted them

    @staticmethod
    def of(reading: ProgressReading | None, health_failures: int) -> EngineMark:
        generated: float | None = None
        if reading is not None and reading.engines:
            values = [e.values[_GENERATED] for e in reading.engines]
            if all(v is not None for v in values):
                generated = sum(v for v in values if v is not None)
        start = reading.process_start_time_seconds if reading is not None else None
        return EngineMark(start, generated, health_failures)


def why_send_again(taken_from: EngineMark, now: EngineMark) -> str | None:
    """Why the requests taken back from the engine ``taken_from`` may be sent now, or None
    while the engine they would go to may still be that hung one.

    A new engine: ``/health`` failed since (a restart: the process gone, or vLLM's 503 for a
    dead engine), or vLLM's process start time changed. Or the same engine generated tokens
    (a false alarm, or it runs again): a hung engine core counts none, and the API server
    cannot count them without it. The end of the hold alone is not enough: a reading that
    cannot be had ends it too (the watch never holds on missing data), and on the real vLLM
    requests sent again then went into the still hung engine and were lost."""
    if now.health_failures > taken_from.health_failures:
        return "vLLM's /health failed since: a restarted server"
    if (
        taken_from.process_start_time_seconds is not None
        and now.process_start_time_seconds is not None
        and now.process_start_time_seconds != taken_from.process_start_time_seconds
    ):
        return "a new vLLM process"
    if (
        taken_from.generation_tokens is not None
        and now.generation_tokens is not None
        and now.generation_tokens > taken_from.generation_tokens
    ):
        return "the engine generates tokens again"
    return None


@dataclass(frozen=True)
class Unanswered:
    """The earliest request sent to vLLM that ended without a byte of its answer (its client
    gave up, or the gate did), kept for ``oldest_unanswered_seconds`` by the proxy
    (``gate/proxy.py``): one hung engine input must show whatever the clients' timeouts. On
    the real vLLM 0.32 an idle engine core blocked under clients with a 30 s timeout: each
    request left the gate at 30 s, the oldest live one never reached the guardian's 30 s, and
    the hang was never acted on."""

    sent_at: float  # the proxy's clock (perf_counter)
    engine: EngineMark  # the engine it was sent to
    reading: ProgressReading | None  # the follower's newest reading when it was sent


# An abandoned request's age is forgotten this long after it was sent even without news: far
# past the guardian's wait for this shape (signals.stall_seconds, 30 s) and its first backoff
# (60 s), so a hang is still acted on; below the guardian's cooldown after a restart
# (policy.cooldown_seconds, 600 s), so an age the gate failed to tie to the old engine (no
# reading of /metrics, /health never seen failing) is gone before a second restart could
# follow it. A hang that persists with traffic sets it again with the next abandoned request.
UNANSWERED_FORGET_SECONDS = 300.0


# A request given up sooner than this after its send says nothing about the engine: vLLM's API
# server may not have handed it to the engine yet (it tokenizes first; a client that cancels
# at once is dropped before that), and on a working engine a request in it longer moves
# /metrics (its prefill's KV blocks, its prefix-cache query, its tokens). Clients that give up
# sooner than this are not waiting on the engine's input, and cannot show its hang.
GIVEN_UP_MIN_SECONDS = 5.0


def abandoned(
    kept: Unanswered | None,
    sent: Unanswered,
    now: float,
    min_seconds: float = GIVEN_UP_MIN_SECONDS,
) -> Unanswered | None:
    """What the proxy keeps once the request ``sent`` ended at ``now`` with no byte of its
    answer: the earlier of the two. Not ``sent`` when it was given up within ``min_seconds``,
    or was sent with no reading of vLLM's /metrics: then a request that reached the engine and
    was dropped when its client left cannot be told from one that never reached it."""
    if sent.reading is None or now - sent.sent_at < min_seconds:
        return kept
    return kept if kept is not None and kept.sent_at <= sent.sent_at else sent


def still_unanswered(
    kept: Unanswered | None,
    now: float,
    engine: EngineMark,
    reading: ProgressReading | None,
    forget_after_seconds: float = UNANSWERED_FORGET_SECONDS,
) -> Unanswered | None:
    """``kept``, or None once it no longer says the engine's input is stuck: a new engine
    (``why_send_again``: /health failed since, another process, tokens generated), the engine
    moved since it was sent (a request that reaches the scheduler moves its prefix-cache
    queries, its KV usage, its token counters: core/progress.py, ``moved``), or older than
    ``forget_after_seconds``. An answer's first body byte on any request also forgets it (the
    proxy does, at once). Called by the proxy as the status is read: ``engine`` and
    ``reading`` are the follower's newest."""
    if kept is None:
        return None
    if now - kept.sent_at > forget_after_seconds:
        return None
    if why_send_again(kept.engine, engine) is not None:
        return None
    if kept.reading is not None and reading is not None and moved(kept.reading, reading):
        return None
    return kept
