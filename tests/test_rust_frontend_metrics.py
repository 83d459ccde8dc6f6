"""vLLM's Rust frontend (``VLLM_USE_RUST_FRONTEND=1``) answers /metrics in OpenMetrics 1.0.

Its exposition (tests/fixtures/vllm/rust-frontend-under-load-05.om, built from the frontend's
source by make_rust_frontend.py beside it, from the values of the real 0.32 capture
metrics-under-load-05.prom) ends in ``# EOF``, types counters by their family name (``vllm:x``)
with samples ``vllm:x_total``, and has no ``vllm:cache_config_info`` nor ``process_*``. The
guardian must read the same engine state from it as from the Python frontend's body.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from tests.conftest import FIXTURES, read_fixture
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.diagnose.report import render_text, to_json
from vllm_guardian.formats import promtext
from vllm_guardian.sources.vllm_metrics import WANTED, make_parser, parse_vllm_metrics

RUST = "rust-frontend-under-load-05.om"
BUNDLES = FIXTURES / "bundles"
PYTHON = "metrics-under-load-05.prom"


def _reference(text: str, wanted: frozenset[str]) -> list[tuple[str, promtext.Labels, float]]:
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in openmetrics_families(text)
        for s in fam.samples
        if s.name in wanted
    ]


def _mine(text: str, wanted: frozenset[str]) -> list[tuple[str, promtext.Labels, float]]:
    return [(s.name, s.labels, s.value) for s in promtext.parse(text, wanted).samples]


def test_the_fixture_is_valid_openmetrics_of_the_rust_shape() -> None:
    text = read_fixture(RUST)
    families = {fam.name: fam for fam in openmetrics_families(text)}  # raises if not OpenMetrics
    assert text.endswith("# EOF\n")
    assert families["vllm:num_preemptions"].type == "counter"
    assert [s.name for s in families["vllm:num_preemptions"].samples] == [
        "vllm:num_preemptions_total"
    ]
    absent = ("vllm:cache_config_info", "vllm:engine_sleep_state", "vllm:admission_rejections")
    assert not [n for n in families if n in absent or n.startswith("process_")]


def test_parser_agrees_with_the_openmetrics_parser() -> None:
    text = read_fixture(RUST)
    assert _mine(text, WANTED) == _reference(text, WANTED)
    assert len(_mine(text, WANTED)) > 40
    every = frozenset(s.name for fam in openmetrics_families(text) for s in fam.samples)
    assert _mine(text, every) == _reference(text, every)
    assert promtext.parse(text, every).malformed_lines == 0


def test_reads_the_same_engine_state_as_from_the_python_frontend() -> None:
    rust = parse_vllm_metrics(read_fixture(RUST))
    python = parse_vllm_metrics(read_fixture(PYTHON))
    assert rust.stats_enabled
    assert rust.malformed_lines == rust.rejected_values == rust.duplicate_series == 0
    (r,) = rust.engines
    (p,) = python.engines
    assert r.cache_config is None  # no vllm:cache_config_info: unknown, never a guess
    assert p.cache_config is not None
    assert r.asleep is None  # no vllm:engine_sleep_state either: unknown
    assert dataclasses.replace(p, cache_config=None, asleep=None) == r
    assert (r.requests_running, r.kv_cache_usage_ratio, r.generation_tokens_total) == (
        31.0,
        0.005493499359091714,
        41131.0,
    )
    assert (r.requests_finished_total, r.requests_failed_total) == (130.0, 0.0)
    assert rust.process_start_time_seconds is None  # no process_* families


def test_kept_parser_reads_repeated_rust_scrapes_through_its_plan() -> None:
    text = read_fixture(RUST)
    parser = make_parser()
    full = parse_vllm_metrics(text)
    for _ in range(4):
        assert parse_vllm_metrics(text, parser=parser) == full
    assert parser.fast_scrapes >= 1
    assert not math.isnan(full.engines[0].kv_cache_usage_ratio or math.nan)


# --- diagnose: the KV budget without vllm:cache_config_info ---------------------------------


def _rust_bundle(tmp_path: Path, journal_kv_line: bool) -> Path:
    """The healthy_idle bundle (real 0.32 captures) as a Rust-frontend server would leave it:
    its scrapes replaced by the Rust exposition, its journal with or without vLLM's
    "GPU KV cache size" line."""
    bundle = tmp_path / "rust"
    shutil.copytree(BUNDLES / "healthy_idle", bundle)
    for scrape in (bundle / "metrics").iterdir():
        scrape.write_text(read_fixture(RUST))
    journal = bundle / "journal.log"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(x for x in lines if journal_kv_line or "KV cache size" not in x))
    return bundle


def test_diagnose_takes_the_kv_pool_from_the_engines_log_and_says_so(tmp_path: Path) -> None:
    doc = to_json(analyze(read_bundle(_rust_bundle(tmp_path, journal_kv_line=True))))
    budget = doc["kv_budget"]
    assert isinstance(budget, dict)
    assert budget["kv_pool_source"] == "vLLM log"
    assert budget["pool_tokens"] == 2_097_152  # "GPU KV cache size: 2,097,152 tokens"
    assert budget["max_concurrency_at_max_model_len"] == 512.0


def test_diagnose_says_the_kv_pool_is_unknown_rather_than_guess(tmp_path: Path) -> None:
    report = analyze(read_bundle(_rust_bundle(tmp_path, journal_kv_line=False)))
    budget = to_json(report)["kv_budget"]
    assert isinstance(budget, dict)
    assert budget["pool_tokens"] is None
    assert budget["kv_pool_source"] is None
    assert "cache_config_info" in budget["unknown"]
    assert "KV BUDGET" in render_text(report)
    assert "pool unknown" in render_text(report)
