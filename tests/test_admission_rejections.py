"""``vllm:admission_rejections_total{reason}``: the 503s vLLM's own queue limits answer.

vLLM 0.32's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` turn a request away with
HTTP 503 ("The engine is currently busy and cannot accept new requests…") and count it by reason
(``max_num_queued_reqs``, ``max_num_queued_tokens``), with ``model_name`` and no ``engine``
label. What the guardian does with it: the rate is a signal (exported as
``vllm_guardian_admission_rejections_per_second``, shown by ``diagnose``), and the capacity
estimate counts each rejection as demand the service did not meet, as it counts the gate's.
No alert of its own: an over-capacity server is alerted on by VllmOverCapacity.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from tests.conftest import VLLM_FIXTURES
from tests.sim.helpers import options
from tests.test_capacity import series
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.core.capacity import estimate
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import Bundle
from vllm_guardian.diagnose.report import render_text
from vllm_guardian.model import ServiceSnapshot, Snapshot
from vllm_guardian.shell.exposition import GuardianCollector, Published, make_registry
from vllm_guardian.sim.server import ApiError, Twin
from vllm_guardian.sim.vllm_log import LogWriter
from vllm_guardian.sources.vllm_metrics import make_parser, parse_vllm_metrics

IDLE = (VLLM_FIXTURES / "metrics-idle.prom").read_text()
# The same capture after 28 requests were turned away by --max-num-queued-reqs 4 (the count
# vLLM 0.32's CPU build reported for 32 requests at concurrency 16).
REJECTING = IDLE.replace(
    'vllm:admission_rejections_total{model_name="tiny-llama",reason="max_num_queued_reqs"} 0.0',
    'vllm:admission_rejections_total{model_name="tiny-llama",reason="max_num_queued_reqs"} 28.0',
)
RUST = (VLLM_FIXTURES / "rust-frontend-under-load-05.om").read_text()


def test_the_counter_is_read_by_reason() -> None:
    assert REJECTING != IDLE
    assert parse_vllm_metrics(REJECTING).admission_rejections == (
        ("max_num_queued_reqs", 28.0),
        ("max_num_queued_tokens", 0.0),
    )
    assert parse_vllm_metrics(RUST).admission_rejections is None  # the Rust frontend has none


def test_the_fast_path_reads_it_as_the_full_parse_does() -> None:
    parser = make_parser()
    for text in (IDLE, IDLE, IDLE, REJECTING):
        fast = parse_vllm_metrics(text, parser=parser)
        assert fast == parse_vllm_metrics(text)
    assert parser.fast_scrapes >= 1


def _snap(t: float, text: str) -> Snapshot:
    return Snapshot(t, (ServiceSnapshot("vllm", vllm=parse_vllm_metrics(text)),), None)


def test_the_rate_is_a_signal_and_exported() -> None:
    history = [_snap(0.0, IDLE), _snap(10.0, REJECTING)]
    signals = sig.derive(history, [ServiceConfig(name="vllm")], SignalsConfig())
    assert signals.services[0].admission_rejections_per_second == 2.8
    c = GuardianCollector(["vllm"])
    c.publish(Published(history[-1], signals, 0.01), monotonic_now=100.0)
    text = generate_latest(make_registry(c, process_metrics=False)).decode()
    assert 'vllm_guardian_admission_rejections_per_second{service="vllm"} 2.8' in text


def test_each_rejection_is_demand_in_the_capacity_estimate() -> None:
    # 2 served/s; vLLM's queue is capped (flat at 4) and the excess, 2/s, is turned away.
    capped = series(arrivals_per_s=2.0, backlog=4.0, admission_rejected_total=lambda t: 2.0 * t)
    got = estimate(capped)
    assert got.state.value == "estimated"
    assert got.demand_ratio is not None and abs(got.demand_ratio - 2.0) < 0.04
    assert estimate([replace(s, admission_rejected_total=None) for s in capped]).demand_ratio == 1.0


def test_diagnose_shows_the_rejections() -> None:
    report = analyze(Bundle(origin="t", scrapes=((1000.0, IDLE), (1010.0, REJECTING))))
    assert report.signals["admission_rejections_per_second"] == 2.8
    assert (
        "admission_rejections_per_second"
        not in analyze(Bundle(origin="t", scrapes=((1000.0, IDLE), (1010.0, IDLE)))).signals
    )
    (note,) = [n for n in report.notes if "503" in n]
    assert "2.8 requests/s" in note and "--max-num-queued-reqs" in note
    assert "503/s 2.80" in render_text(report)
    quiet = analyze(Bundle(origin="t", scrapes=((1000.0, IDLE), (1010.0, IDLE))))
    assert not [n for n in quiet.notes if "503" in n]


def test_the_twin_turns_requests_away_at_its_queue_limit() -> None:
    twin = Twin(options("--sim-model", "tiny", "--served-model-name", "tiny-llama",
                        "--max-num-queued-reqs", "2"), LogWriter(0, io.StringIO()))  # fmt: skip
    twin.engine.advance(twin.engine.startup_seconds)
    body = {"prompt": "hello there", "max_tokens": 64}
    twin.submit(body, chat=False)
    twin.submit(body, chat=False)
    with pytest.raises(ApiError) as err:
        twin.submit(body, chat=False)
    # vLLM 0.32's QueueOverflowError, as its error response carries it.
    assert err.value.status == 503
    assert err.value.body["error"] == {
        "message": "The engine is currently busy and cannot accept new requests. Please try "
        "again later or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
    scrape = parse_vllm_metrics(twin.metrics_text())
    assert scrape.admission_rejections == (
        ("max_num_queued_reqs", 1.0),
        ("max_num_queued_tokens", 0.0),
    )
