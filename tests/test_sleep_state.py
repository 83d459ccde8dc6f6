"""An engine an operator put to sleep is not a hung engine.

vLLM exports ``vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}`` per
engine (vllm/v1/metrics/loggers.py, ``record_sleep_state``: awake 1 and the others 0 when
awake; asleep, awake 0 and weights_offloaded 1 at level 1, discard_all 1 at level 2). While an
engine sleeps it makes no progress by design: requests sit in it, its counters freeze. The
stall signal must not read that as a hang (which the guardian restarts).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, read_fixture
from tests.test_signals import derive, engine, snap
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.diagnose.report import to_json
from vllm_guardian.sources.vllm_metrics import make_parser, parse_vllm_metrics

BUNDLES = FIXTURES / "bundles"

CAPTURE = "metrics-under-load-05.prom"  # real vLLM 0.32: awake


def asleep_capture(level: int) -> str:
    """The real capture with the sleep gauges set as vLLM's record_sleep_state sets them."""
    text = read_fixture(CAPTURE)
    values = {"awake": 0, "weights_offloaded": int(level == 1), "discard_all": int(level == 2)}
    for state, value in values.items():
        text, n = re.subn(
            rf'(vllm:engine_sleep_state\{{[^}}]*sleep_state="{state}"[^}}]*\}}) \S+',
            rf"\g<1> {value}.0",
            text,
        )
        assert n == 1
    return text


@pytest.mark.parametrize(
    ("text", "asleep"),
    [
        (read_fixture(CAPTURE), False),
        (asleep_capture(1), True),
        (asleep_capture(2), True),
        # vLLM's Rust frontend exports no sleep state: unknown
        (read_fixture("rust-frontend-under-load-05.om"), None),
    ],
)
def test_the_sleep_state_is_read(text: str, asleep: bool | None) -> None:
    (e,) = parse_vllm_metrics(text).engines
    assert e.asleep is asleep
    # and the kept parser's plan reads it the same
    parser = make_parser()
    for _ in range(3):
        assert parse_vllm_metrics(text, parser=parser) == parse_vllm_metrics(text)
    assert parser.fast_scrapes >= 1


# (t, waiting, generated tokens, asleep)
FROZEN = [(0, 5, 10), (2, 5, 10), (4, 5, 10), (6, 5, 10)]


@pytest.mark.parametrize(
    ("asleep", "seconds", "stalled"),
    [
        (False, 6.0, True),  # awake, requests in it, nothing moves: the hang
        (None, 6.0, True),  # no sleep state exported: as before
        (True, None, None),  # asleep: nothing to judge, never a hang
    ],
)
def test_a_sleeping_engine_is_never_stalled(
    asleep: bool | None, seconds: float | None, stalled: bool | None
) -> None:
    h = [
        snap(t, engine(requests_waiting=float(w), generation_tokens_total=float(g), asleep=asleep))
        for t, w, g in FROZEN
    ]
    s = derive(*h)
    assert (s.stall_seconds, s.stalled) == (seconds, stalled)


def test_waking_up_starts_the_stall_clock_afresh() -> None:
    h = [
        snap(t, engine(requests_waiting=5.0, generation_tokens_total=10.0, asleep=t < 4))
        for t in (0, 2, 4, 6)
    ]
    s = derive(*h)
    assert (s.stall_seconds, s.stalled) == (2.0, False)


def test_diagnose_says_an_engine_sleeps(tmp_path: Path) -> None:
    """A bundle of a server put to sleep (level 1) with requests waiting in it: not a hang,
    and the report says why nothing moves."""
    bundle = tmp_path / "asleep"
    shutil.copytree(BUNDLES / "healthy_queueing", bundle)
    for scrape in (bundle / "metrics").iterdir():
        text = scrape.read_text()
        for state, value in (("awake", 0), ("weights_offloaded", 1), ("discard_all", 0)):
            text = re.sub(
                rf'(vllm:engine_sleep_state\{{[^}}]*sleep_state="{state}"[^}}]*\}}) \S+',
                rf"\g<1> {value}.0",
                text,
            )
        scrape.write_text(text)
    doc = to_json(analyze(read_bundle(bundle)))
    assert doc["verdict"] != "engine_dead"
    assert any("asleep" in n for n in doc["notes"])  # type: ignore[union-attr]
