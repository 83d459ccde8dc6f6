"""Is vLLM's engine making progress? Defined once, for the stall signal (``core/signals.py``),
the gate's progress watch (``gate/progress.py``) and ``diagnose`` (through the signals).

Pure: a reading is taken from one ``/metrics`` scrape, and two readings are compared.

What moves when the engine steps, as measured on the real vLLM 0.32 (V1) CPU build reading
``/metrics`` every 0.5 s (tests/fixtures/vllm/long-prefill-and-hang-0.32.jsonl.gz):

* One 20,480-token prompt alone, prefilled in chunks of 256 tokens over 15.5 s: the prompt and
  generation token counters, the preemption counter and the per-step histogram
  ``vllm:iteration_tokens_total`` did not move at all. V1 counts a request's prompt tokens when
  its prefill has finished, and it observes the histogram only on a step that has output for a
  client (a finished chunk of a prefill has none), so the histogram moves with the token
  counters and tells nothing more. What moved at every reading was the KV cache usage gauge
  (0.095 to 0.94 in steps of 1-2 %): the scheduler reports its statistics after every step,
  outputs or not, and each chunk allocates KV blocks.
* The engine core stopped (SIGSTOP) in the middle of such a prefill: every series, the KV gauge
  included, stayed as it was for the 12 s of the stop, then moved again at once on SIGCONT.

So a reading is the set of engine-written values that a step changes, per engine: the KV usage
gauge, the running and waiting gauges (the scheduler's own counts, published with the KV
gauge), and the counters of prompt and generation tokens, preemptions and prefix-cache queries
(counted when the scheduler first schedules a request). The engine made progress between two
readings when any of them changed, in either direction (a decrease is a restarted process), or
vLLM's process start time changed. An engine thrashing its KV pool (preempting, recomputing,
its token counters flat) is making progress by this definition: its preemption counter and its
KV gauge move. A stopped or wedged engine publishes nothing new, or the same values: no change.

Not counted: the finished and failed request counters (vLLM counts them from the engine's
outputs, which move the token counters anyway) and anything the API server keeps on its own
(HTTP counters, its process CPU), which moves while the engine is stopped.

Blind spot, by construction: a prefill whose chunk is smaller than one KV block
(``--max-num-batched-tokens`` below the block size) moves no series on some steps; a step
that itself lasts longer than the wait is not told from a hang either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_guardian.model import EngineMetrics, VllmScrape

# The engine-written values a step changes, in this order in EngineMarks.values.
MARK_FIELDS = (
    "kv_cache_usage_ratio",
    "requests_running",
    "requests_waiting",
    "prompt_tokens_total",
    "generation_tokens_total",
    "preemptions_total",
    "prefix_cache_queries_total",
)


@dataclass(frozen=True)
class EngineMarks:
    model_name: str
    engine: str
    values: tuple[float | None, ...]  # MARK_FIELDS, None where the scrape lacks one


@dataclass(frozen=True)
class ProgressReading:
    """One ``/metrics`` scrape as progress is judged: what is in the engines, and the marks."""

    requests_in_engine: float  # running + waiting, over all engines
    engines: tuple[EngineMarks, ...]
    process_start_time_seconds: float | None

    @staticmethod
    def of(scrape: VllmScrape, paused: bool | None = None) -> ProgressReading | None:
        """The reading, or None when it cannot be judged: no engine, an engine asleep, a server
        paused (``paused``: vLLM's ``/is_paused``, which ``/metrics`` does not show), or an
        engine that reports neither running nor waiting, or neither token counter."""
        if not scrape.engines or paused:
            # Paused (/pause): the scheduler is frozen by an operator; as asleep, below.
            return None
        inside = 0.0
        marks = []
        for e in scrape.engines:
            if e.asleep:
                # An operator put it to sleep (/sleep): no progress is expected of it, and none
                # missing is a hang. Nothing is judged while it sleeps.
                return None
            if e.requests_running is None and e.requests_waiting is None:
                return None
            if e.prompt_tokens_total is None and e.generation_tokens_total is None:
                return None
            inside += (e.requests_running or 0.0) + (e.requests_waiting or 0.0)
            marks.append(_marks(e))
        return ProgressReading(inside, tuple(marks), scrape.process_start_time_seconds)


def _marks(e: EngineMetrics) -> EngineMarks:
    return EngineMarks(e.model_name, e.engine, tuple([getattr(e, f) for f in MARK_FIELDS]))


def moved(before: ProgressReading, after: ProgressReading) -> bool:
    """Did the engine make progress from ``before`` to ``after``? Any engine-written value that
    changed, or another process (see the module's docstring)."""
    return (
        after.engines != before.engines
        or after.process_start_time_seconds != before.process_start_time_seconds
    )


def quiet_seconds(newest_first: Iterable[tuple[float, ProgressReading | None]]) -> float | None:
    """How long requests have been in the engine with no progress, as of the newest reading.

    ``newest_first``: (time, reading) pairs from the newest back (None: no reading at that
    time); read only as far as needed. 0 when the engine is empty or moved at the newest
    reading; None when there is none or the newest cannot be judged. A reading that cannot be
    judged, or an empty engine, ends what can be vouched for."""
    it = iter(newest_first)
    now, cur = next(it, (0.0, None))
    if cur is None:
        return None
    if cur.requests_in_engine <= 0:
        return 0.0
    since = now
    for t, earlier in it:
        if earlier is None or earlier.requests_in_engine <= 0 or moved(earlier, cur):
            break
        since, cur = t, earlier
    return now - since


def unreached_seconds(
    oldest_unanswered_seconds: float | None,
    newest_first: Iterable[tuple[float, ProgressReading | None]],
) -> float | None:
    """How long requests sent to vLLM have not reached its engine, as of the newest reading.

    The hang that looks idle: vLLM's API server accepts requests and hands them to the engine
    core's input thread; when that thread dies or blocks (vllm#26139, #47958) they never reach
    the scheduler, so the engine reports nothing running or waiting, makes no progress because
    it has nothing to do, and ``/health`` answers 200. Only whoever sent the requests sees it:
    the gate's oldest forwarded request with no byte of its answer yet
    (``oldest_unanswered_seconds``).

    The answer is the shorter of that age and how long the engine has reported nothing in it
    (``requests_in_engine`` 0 at every reading back to then): a request the engine holds
    (a long prefill, a queue, a non-streamed answer still generating) is in it and never
    counts here, it is the stall's to judge (:func:`quiet_seconds`). 0 when nothing is
    unanswered or the engine holds requests; None when the age is unknown (no gate) or the
    newest reading cannot be judged (an engine asleep or paused, ``/metrics`` unreadable)."""
    if oldest_unanswered_seconds is None:
        return None
    it = iter(newest_first)
    now, cur = next(it, (0.0, None))
    if cur is None:
        return None
    if oldest_unanswered_seconds <= 0 or cur.requests_in_engine > 0:
        return 0.0
    since = now
    for t, earlier in it:
        if earlier is None or earlier.requests_in_engine > 0 or now - t > oldest_unanswered_seconds:
            break
        since = t
    return min(oldest_unanswered_seconds, now - since)
