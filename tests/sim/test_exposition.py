"""The twin's /metrics against real vLLM 0.32 captures: families, types, label sets, buckets."""

from __future__ import annotations

import io
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import read_fixture
from tests.sim.helpers import drive, options
from vllm_guardian.sim.load import plan_requests
from vllm_guardian.sim.scenarios import SCENARIOS
from vllm_guardian.sim.server import Twin
from vllm_guardian.sim.vllm_log import LogWriter

Shape = dict[tuple[str, str], frozenset[frozenset[str]]]


def shape(text: str) -> Shape:
    """(family, type) → the set of label-name sets its samples carry (``le`` excluded)."""
    out: dict[tuple[str, str], set[frozenset[str]]] = defaultdict(set)
    for fam in text_string_to_metric_families(text):
        key = (fam.name, fam.type)
        out[key]
        for s in fam.samples:
            out[key].add(frozenset(k for k in s.labels if k != "le"))
    return {k: frozenset(v) for k, v in out.items()}


def buckets(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            les = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")]
            out[fam.name] = list(dict.fromkeys(les))
    return out


def twin_metrics(loaded: bool, *argv: str) -> str:
    twin = Twin(options("--sim-model", "tiny", "--served-model-name", "tiny-llama", *argv),
                LogWriter(0, io.StringIO()))  # fmt: skip
    engine = twin.engine
    engine.advance(engine.startup_seconds)
    if loaded:
        drive(engine, plan_requests(SCENARIOS["steady"].load, 1, 40, 20.0), 30.0)
        for handler in ("/v1/completions", "/v1/chat/completions"):
            twin.http_stats.observe(handler, "POST", 200, 400, 900, 0.3, 1.8e9)
        twin.http_stats.observe("/health", "GET", 200, 0, 0, 0.001, 1.8e9)  # not instrumented
    return twin.metrics_text()


@pytest.mark.parametrize(
    ("loaded", "capture"),
    [
        (False, "metrics-idle.prom"),
        (True, "metrics-under-load-05.prom"),
        (True, "metrics-pressure-07.prom"),
    ],
)
def test_family_type_label_diff_is_empty(loaded: bool, capture: str) -> None:
    real = shape(read_fixture(capture))
    twin = shape(twin_metrics(loaded))
    assert sorted(set(real) - set(twin)) == []
    assert sorted(set(twin) - set(real)) == []
    diff = {k: (real[k], twin[k]) for k in real if real[k] != twin[k]}
    assert diff == {}


def test_histogram_buckets_match() -> None:
    real = buckets(read_fixture("metrics-under-load-05.prom"))
    twin = buckets(twin_metrics(True))
    assert twin == real


def test_cache_config_info_labels_and_values() -> None:
    def labels(text: str) -> dict[str, str]:
        fam = next(
            f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"
        )
        return dict(fam.samples[0].labels)

    real = labels(read_fixture("metrics-idle.prom"))
    twin = labels(twin_metrics(False))
    assert set(twin) == set(real)
    assert twin["num_gpu_blocks"].isdigit()
    assert int(twin["kv_cache_size_tokens"]) == int(twin["num_gpu_blocks"]) * 16
    assert twin["gpu_memory_utilization"] == "0.92"
    assert twin["enable_prefix_caching"] == "True"


def test_created_samples_are_gauge_families_like_prometheus_client() -> None:
    text = twin_metrics(True)
    assert "# TYPE vllm:num_preemptions_created gauge\n" in text
    assert "# TYPE vllm:num_preemptions_total counter\n" in text
    assert '\nvllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} ' in text


def test_disable_log_stats_removes_every_vllm_family() -> None:
    text = twin_metrics(True, "--disable-log-stats")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert not any(n.startswith("vllm:") for n in names)
    assert "http_requests" in names
