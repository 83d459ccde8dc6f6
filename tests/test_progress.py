"""What "the engine is making progress" means (core/progress.py), table-driven: over the real
vLLM 0.32 capture of one long prompt alone and of a SIGSTOPped engine core, and over readings
built field by field (a KV thrash with flat token counters, a frozen engine, restarts, gaps).
"""

from __future__ import annotations

import itertools

import pytest

from tests.expositions import captured_series
from vllm_guardian.core.progress import ProgressReading, moved, quiet_seconds
from vllm_guardian.model import EngineMetrics, VllmScrape
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics


def scrape_of(text: str) -> VllmScrape:
    return parse_vllm_metrics(text, len(text))


def captured(name: str) -> list[tuple[float, ProgressReading | None]]:
    return [(r.t_seconds, ProgressReading.of(scrape_of(r.text))) for r in captured_series(name)]


def quiet_at_each(readings: list[tuple[float, ProgressReading | None]]) -> list[float | None]:
    return [quiet_seconds(reversed(readings[: i + 1])) for i in range(len(readings))]


# --- the real server -------------------------------------------------------------------------


def test_the_capture_is_the_blind_spot_of_the_token_counters() -> None:
    """The evidence the definition rests on: while the long prompt is prefilled (15.5 s, one
    request running) the token counters, the preemption counter and the per-step histogram's
    count stand still; the KV usage moves at every reading."""
    rows = captured_series("long_prefill")
    busy = [r for r in rows if scrape_of(r.text).sums.running == 1]
    assert busy[-1].t_seconds - busy[0].t_seconds > 15
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:iteration_tokens_total_count",
    ):
        assert len({_sample(r.text, name) for r in busy}) == 1, name
    kv = [_sample(r.text, "vllm:kv_cache_usage_perc") for r in busy]
    assert all(b > a for a, b in itertools.pairwise(kv)), kv
    assert kv[0] < 0.1 and kv[-1] > 0.9


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the reading")


CAPTURED = [
    # series, the longest quiet spell with requests in the engine (at least, at most)
    ("long_prefill", 0.0, 0.0),  # one 20,480-token prompt alone, 15.5 s: progress throughout
    ("hang", 11.0, 12.0),  # EngineCore stopped 12 s mid-prefill: quiet all that while
]


@pytest.mark.parametrize(("series", "least", "most"), CAPTURED, ids=[c[0] for c in CAPTURED])
def test_the_captured_series(series: str, least: float, most: float) -> None:
    readings = captured(series)
    assert all(r is not None for _, r in readings)
    assert any(r is not None and r.requests_in_engine > 0 for _, r in readings)
    longest = max(q or 0.0 for q in quiet_at_each(readings))
    assert least <= longest <= most, longest


def test_the_hang_is_quiet_from_the_stop_to_the_continue() -> None:
    rows = captured_series("hang")
    quiet = quiet_at_each([(r.t_seconds, ProgressReading.of(scrape_of(r.text))) for r in rows])
    stop = next(i for i, r in enumerate(rows) if r.event == "SIGSTOP EngineCore")
    cont = next(i for i, r in enumerate(rows) if r.event == "SIGCONT EngineCore")
    assert quiet[cont - 1] == pytest.approx(rows[cont - 1].t_seconds - rows[stop].t_seconds)
    assert quiet[cont] == 0.0  # it moved again at once


# --- readings built field by field -----------------------------------------------------------


def reading(
    *,
    running: float = 4,
    waiting: float = 0,
    prompt: float = 1000,
    generated: float = 500,
    kv: float | None = 0.5,
    preempted: float | None = 0,
    queried: float | None = 1000,
    start: float | None = 1.0,
) -> ProgressReading:
    e = EngineMetrics(
        "m",
        "0",
        requests_running=running,
        requests_waiting=waiting,
        kv_cache_usage_ratio=kv,
        prompt_tokens_total=prompt,
        generation_tokens_total=generated,
        preemptions_total=preempted,
        prefix_cache_queries_total=queried,
    )
    r = ProgressReading.of(VllmScrape((e,), True, start, 1))
    assert r is not None
    return r


R = reading
MOVED = [
    ("nothing changed", R(), R(), False),
    ("generated tokens", R(), R(generated=501), True),
    ("prompt tokens (a prefill finished)", R(), R(prompt=3000), True),
    ("KV usage alone (a chunk of a long prefill)", R(kv=0.5), R(kv=0.52), True),
    ("KV usage down alone (blocks freed)", R(kv=0.5), R(kv=0.4), True),
    ("preemptions alone (thrash, token counters flat)", R(preempted=3), R(preempted=9), True),
    ("a request scheduled (prefix-cache queries)", R(), R(queried=5000), True),
    ("the scheduler's counts changed", R(running=4, waiting=2), R(running=5, waiting=1), True),
    ("a counter went down: a restarted process", R(generated=500), R(generated=3), True),
    ("another process start time", R(start=1.0), R(start=2.0), True),
    ("the KV gauge is gone", R(kv=0.5), R(kv=None), True),
]  # fmt: skip


@pytest.mark.parametrize(("case", "before", "after", "expected"), MOVED, ids=[m[0] for m in MOVED])
def test_moved(case: str, before: ProgressReading, after: ProgressReading, expected: bool) -> None:
    assert moved(before, after) is expected


SPELLS = [
    # name, (t, reading or None) oldest first, quiet seconds at the newest
    ("frozen with requests inside", [(0, R()), (10, R()), (20, R()), (30, R())], 30.0),
    ("thrash: token counters flat, preemptions rising",
     [(0, R(preempted=0)), (10, R(preempted=4)), (20, R(preempted=9)), (30, R(preempted=15))], 0.0),
    ("thrash: token counters and preemptions flat, KV see-saws",
     [(0, R(kv=0.9)), (10, R(kv=1.0)), (20, R(kv=0.9)), (30, R(kv=1.0))], 0.0),
    ("a long prefill: token counters flat, KV rising",
     [(0, R(kv=0.1)), (10, R(kv=0.4)), (20, R(kv=0.7)), (30, R(kv=0.9))], 0.0),
    ("froze after the last move", [(0, R(kv=0.1)), (10, R(kv=0.4)), (20, R(kv=0.4)), (30, R(kv=0.4))], 20.0),
    ("an A-B-A change is two moves, not a frozen pair", [(0, R(kv=0.1)), (10, R(kv=0.2)), (20, R(kv=0.1))], 0.0),
    ("idle: nothing to process", [(0, R(running=0)), (30, R(running=0))], 0.0),
    ("requests arrived at a frozen engine: counted from the arrival",
     [(0, R(running=0)), (10, R()), (30, R())], 20.0),
    ("a gap ends what can be vouched for", [(0, R()), (10, None), (20, R()), (30, R())], 10.0),
    ("the newest cannot be judged", [(0, R()), (10, None)], None),
    ("nothing at all", [], None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "readings", "expected"), SPELLS, ids=[s[0] for s in SPELLS])
def test_quiet_seconds(
    case: str, readings: list[tuple[float, ProgressReading | None]], expected: float | None
) -> None:
    assert quiet_seconds(reversed(readings)) == expected


def test_a_reading_needs_the_requests_and_a_token_counter() -> None:
    base = EngineMetrics("m", "0", requests_running=1, generation_tokens_total=5)
    assert ProgressReading.of(VllmScrape((base,), True, 1.0, 1)) is not None
    no_requests = EngineMetrics("m", "0", generation_tokens_total=5)
    assert ProgressReading.of(VllmScrape((no_requests,), True, 1.0, 1)) is None
    no_tokens = EngineMetrics("m", "0", requests_running=1, kv_cache_usage_ratio=0.5)
    assert ProgressReading.of(VllmScrape((no_tokens,), True, 1.0, 1)) is None
    assert ProgressReading.of(VllmScrape((), False, 1.0, 1)) is None
