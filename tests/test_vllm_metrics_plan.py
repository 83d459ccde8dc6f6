"""The vLLM parser's plan (sources/vllm_metrics.VllmParser): a parser kept between scrapes
reads a body of the last shape from its values alone, and must give exactly what a fresh
full parse of the same body gives, whatever changes between two scrapes."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.conftest import read_fixture
from tests.expositions import multi_engine
from vllm_guardian.sources.vllm_metrics import (
    FULL_PARSES_BEFORE_PAUSE,
    SCANS_SKIPPED_IN_A_PAUSE,
    VllmParser,
    parse_vllm_metrics,
)

CAPTURES = [read_fixture(f"metrics-under-load-0{k}.prom") for k in (2, 5, 8)]


def _line(text: str, prefix: str) -> str:
    """The first line of ``text`` starting with ``prefix``."""
    m = re.search("^" + re.escape(prefix) + ".*$", text, re.MULTILINE)
    assert m is not None, f"no line starts with {prefix!r}"
    return m.group(0)


def _set_value(prefix: str, value: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        line = _line(text, prefix)
        return text.replace(line + "\n", line.rpartition(" ")[0] + " " + value + "\n", 1)

    return mutate


def _drop(prefix: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        return text.replace(_line(text, prefix) + "\n", "", 1)

    return mutate


def _add_after(prefix: str, new: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        line = _line(text, prefix)
        return text.replace(line + "\n", line + "\n" + new + "\n", 1)

    return mutate


def _duplicate(prefix: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        line = _line(text, prefix)
        return text.replace(line + "\n", line + "\n" + line + "\n", 1)

    return mutate


def _timestamp(prefix: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        line = _line(text, prefix)
        return text.replace(line + "\n", line + " 1795305600000\n", 1)

    return mutate


def _counter_reset(text: str) -> str:
    """Every counter and histogram back near zero, as after a restart (same series)."""
    out = []
    for line in text.splitlines():
        if line.startswith("vllm:") and (
            "_total" in line or "_bucket" in line or "_count" in line or "_sum" in line
        ):
            line = line.rpartition(" ")[0] + " 0.0"
        out.append(line)
    return "\n".join(out) + "\n"


RUNNING = 'vllm:num_requests_running{engine="0",model_name="tiny-llama"}'
KV = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"}'
STOP = 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"}'
BUCKET = 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="tiny-llama"}'
INF = 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"}'
START = "process_start_time_seconds"

# (what changes between scrapes, the change)
CHANGES: list[tuple[str, Callable[[str], str]]] = [
    ("a gauge moves", _set_value(RUNNING, "7.0")),
    ("a counter resets (a restart: every counter back to 0)", _counter_reset),
    ("a counter goes down", _set_value(STOP, "0.0")),
    ("a new series appears", _add_after(STOP, STOP.replace('"stop"', '"timeout"') + " 3.0")),
    ("a series disappears", _drop(STOP)),
    ("a histogram bucket disappears", _drop(BUCKET)),
    ("the +Inf bucket disappears", _drop(INF)),
    ("buckets stop being cumulative", _set_value(BUCKET, "1e9")),
    ("a gauge is NaN", _set_value(RUNNING, "NaN")),
    ("a gauge is +Inf", _set_value(RUNNING, "+Inf")),
    ("a counter is negative", _set_value(STOP, "-1.0")),
    ("a ratio is over 1", _set_value(KV, "1.5")),
    ("a value is not a number", _set_value(RUNNING, "abc")),
    ("a value has an underscore", _set_value(RUNNING, "1_000")),
    ("a value is an integer", _set_value(RUNNING, "7")),
    ("a line gets a timestamp", _timestamp(RUNNING)),
    ("a series is duplicated", _duplicate(RUNNING)),
    ("the process start time is 0", _set_value(START, "0")),
    ("the process start time changes", _set_value(START, "1.8e+09")),
    ("the process start time disappears", _drop(START)),
    ("a label gets an escape", _add_after(STOP, STOP.replace('"stop"', '"a\\"b"') + " 1.0")),
    ("the body is truncated", lambda text: text[: len(text) // 2]),
    ("the body uses CRLF", lambda text: text.replace("\n", "\r\n")),
    ("an engine joins", lambda text: multi_engine(text, 2)),
    ("vLLM's stats go away", lambda text: read_fixture("disable-log-stats.prom")),
]


def _scrapes(parser: VllmParser, texts: list[str]) -> None:
    for i, text in enumerate(texts):
        got = parse_vllm_metrics(text, None, parser)
        want = parse_vllm_metrics(text)  # a fresh, full parse
        assert got == want, f"scrape {i} differs from a full parse of the same body"


@pytest.mark.parametrize("engines", [1, 8])
@pytest.mark.parametrize(("change", "mutate"), CHANGES, ids=[c for c, _ in CHANGES])
def test_a_kept_parser_reads_every_scrape_as_a_full_parse_does(
    change: str, mutate: Callable[[str], str], engines: int
) -> None:
    base = [multi_engine(t, engines) for t in CAPTURES]
    changed = [mutate(t) for t in base]
    parser = VllmParser()
    # the plan is made (two scrapes of one shape) and used; then the change, held for a
    # while (its own plan, where it has one), then back
    _scrapes(parser, [*base, *base, *changed, *changed, *base, *changed, base[0]])


def test_the_plan_reads_scrapes_of_an_unchanged_shape() -> None:
    """The plan is used (so the tests above test it): from the third scrape of a busy
    server's series on, every scrape is read through it."""
    parser = VllmParser()
    texts = [multi_engine(t, 8) for t in CAPTURES] * 3
    _scrapes(parser, texts)
    assert parser.fast_scrapes == len(texts) - 2


@pytest.mark.parametrize(
    ("change", "mutate"),
    [
        ("a gauge is NaN", _set_value(RUNNING, "NaN")),
        ("a ratio is over 1", _set_value(KV, "1.5")),
        ("a value is not a number", _set_value(RUNNING, "abc")),
        ("the process start time is 0", _set_value(START, "0")),
    ],
)
def test_a_value_the_plan_cannot_judge_goes_to_the_full_parse(
    change: str, mutate: Callable[[str], str]
) -> None:
    parser = VllmParser()
    for t in CAPTURES:
        parse_vllm_metrics(t, None, parser)
    fast = parser.fast_scrapes
    bad = mutate(CAPTURES[0])
    got = parse_vllm_metrics(bad, None, parser)
    assert got == parse_vllm_metrics(bad)
    assert got.rejected_values + got.malformed_lines == 1, change
    assert parser.fast_scrapes == fast, "read through the plan"
    parse_vllm_metrics(CAPTURES[1], None, parser)
    assert parser.fast_scrapes == fast + 1, "the plan is still there for the next scrape"


def test_a_server_no_plan_fits_is_rarely_scanned_and_read_in_full() -> None:
    """vLLM V0 exports the prefix-cache hit-rate gauge as -1 with prefix caching off: a value
    only the full parse reads, on every scrape. Such a server costs a full parse and, past
    the first few scrapes, only a rare look for a plan; once a plan fits, it is found."""
    v0 = read_fixture("v0-0.6.6.prom")
    parser = VllmParser()
    want = parse_vllm_metrics(v0)
    assert want.rejected_values == 1
    for i in range(100):
        assert parse_vllm_metrics(v0, None, parser) == want, f"scrape {i}"
    assert parser.fast_scrapes == 0
    pauses = 100 // (FULL_PARSES_BEFORE_PAUSE + SCANS_SKIPPED_IN_A_PAUSE)
    assert parser.scans <= 100 - pauses * SCANS_SKIPPED_IN_A_PAUSE, parser.scans
    # The server's values become readable (prefix caching on): the plan is found again.
    fixed = _set_value("vllm:gpu_prefix_cache_hit_rate", "0.5")(v0)
    for _ in range(SCANS_SKIPPED_IN_A_PAUSE + 3):
        assert parse_vllm_metrics(fixed, None, parser) == parse_vllm_metrics(fixed)
    assert parser.fast_scrapes > 0
