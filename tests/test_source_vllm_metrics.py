"""The vLLM metrics source: real captures across versions, and a real server that misbehaves."""

from __future__ import annotations

import math

import pytest

from tests.conftest import read_fixture
from tests.expositions import multi_engine
from tests.httpfixture import Script
from vllm_guardian.config import ServiceConfig, VllmMetricsSourceConfig
from vllm_guardian.sources.vllm_metrics import VllmMetricsCollector, parse_vllm_metrics

# What vLLM 0.32 itself said in each capture (grep of the file: the source must read the same).
CAPTURES = [
    # file, running, waiting, kv usage, preemptions, generated tokens
    ("metrics-idle.prom", 0.0, 0.0, 0.0, 0.0, 0.0),
    ("metrics-pressure-07.prom", 5.0, 27.0, 0.9032258064516129, 89.0, 58328.0),
]


@pytest.mark.parametrize(("name", "running", "waiting", "kv", "preempt", "gen"), CAPTURES)
def test_reads_the_values_vllm_0_32_reported(name, running, waiting, kv, preempt, gen):
    scrape = parse_vllm_metrics(read_fixture(name))
    assert scrape.stats_enabled
    assert scrape.malformed_lines == scrape.rejected_values == scrape.duplicate_series == 0
    (e,) = scrape.engines
    assert (e.model_name, e.engine) == ("tiny-llama", "0")
    assert (e.requests_running, e.requests_waiting, e.kv_cache_usage_ratio) == (
        running,
        waiting,
        kv,
    )
    assert (e.preemptions_total, e.generation_tokens_total) == (preempt, gen)
    assert e.requests_swapped is None  # V1 has no swapping: unknown, not zero
    assert scrape.process_start_time_seconds == pytest.approx(1.79530599248e9)


def test_cache_config_info_is_parsed_dynamically():
    (e,) = parse_vllm_metrics(read_fixture("metrics-pressure-07.prom")).engines
    cc = e.cache_config
    assert cc is not None
    assert (cc.num_gpu_blocks, cc.block_size, cc.kv_cache_size_tokens) == (32, 128, 4096)
    assert cc.gpu_memory_utilization_ratio == 0.92
    assert cc.kv_cache_memory_bytes == 1073741824
    assert cc.enable_prefix_caching is True
    assert cc.capacity_tokens == 4096
    assert ("kv_cache_layout", "None") in cc.labels  # everything else kept, unparsed


def test_histograms_are_cumulative_with_inf_last():
    (e,) = parse_vllm_metrics(read_fixture("metrics-under-load-05.prom")).engines
    for h in (e.time_to_first_token, e.e2e_request_latency, e.request_queue_time):
        assert h is not None
        assert math.isinf(h.buckets[-1][0])
        counts = [c for _, c in h.buckets]
        assert counts == sorted(counts)
        assert h.count == counts[-1]


def test_v0_names_and_labels():
    scrape = parse_vllm_metrics(read_fixture("v0-0.6.6.prom"))
    (e,) = scrape.engines
    assert (e.model_name, e.engine) == ("meta-llama/Llama-3.1-8B-Instruct", "")
    assert e.kv_cache_usage_ratio == 0.97  # from gpu_cache_usage_perc
    assert e.requests_swapped == 2.0
    assert e.prefix_cache_hit_ratio is None  # -1 means "prefix caching off", not a ratio
    assert e.requests_finished_total == 1000.0
    assert e.requests_failed_total == 10.0
    assert e.cache_config is not None and e.cache_config.num_gpu_blocks == 27306
    assert e.cache_config.capacity_tokens == 27306 * 16
    assert e.time_to_first_token is not None and e.time_to_first_token.count == 1000.0


def test_v1_0_10_prefers_new_kv_name_and_reads_old_prefix_counters():
    scrape = parse_vllm_metrics(read_fixture("v1-0.10-two-engines.prom"))
    e0, e1 = scrape.engines
    assert (e0.engine, e1.engine) == ("0", "1")
    assert (e0.kv_cache_usage_ratio, e1.kv_cache_usage_ratio) == (0.25, 0.75)
    assert (e0.prefix_cache_hits_total, e1.prefix_cache_queries_total) == (500.0, 3000.0)
    assert e1.cache_config is not None and e1.cache_config.num_gpu_blocks == 3000


def test_eight_engines_from_the_real_capture():
    text = multi_engine(read_fixture("metrics-pressure-07.prom"), 8)
    scrape = parse_vllm_metrics(text)
    assert [e.engine for e in scrape.engines] == [str(i) for i in range(8)]
    assert all(e.requests_waiting == 27.0 and e.cache_config is not None for e in scrape.engines)


def test_disable_log_stats_is_not_read_as_zeros():
    scrape = parse_vllm_metrics(read_fixture("disable-log-stats.prom"))
    assert scrape.stats_enabled is False
    assert scrape.engines == ()


BAD_VALUES = [
    # line, what the source must do with it
    ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN', "rejected"),
    ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} +Inf', "rejected"),
    ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.7', "rejected"),
    ('vllm:num_requests_waiting{engine="0",model_name="m"} -3', "rejected"),
    ('vllm:num_requests_waiting{engine="0",model_name="m"} three', "malformed"),
    ('vllm:num_requests_waiting{engine="0",model_name="m" 3', "malformed"),
]


@pytest.mark.parametrize(("line", "outcome"), BAD_VALUES)
def test_bad_values_never_become_values(line, outcome):
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 1\n' + line + "\n"
    scrape = parse_vllm_metrics(text)
    (e,) = scrape.engines
    assert e.requests_running == 1.0
    assert e.kv_cache_usage_ratio is None and e.requests_waiting is None
    assert (scrape.rejected_values, scrape.malformed_lines) == (
        (1, 0) if outcome == "rejected" else (0, 1)
    )


def test_duplicate_series_keep_the_first_and_are_counted():
    text = 'vllm:num_requests_waiting{engine="0",model_name="m"} 4\nvllm:num_requests_waiting{engine="0",model_name="m"} 9\n'
    scrape = parse_vllm_metrics(text)
    assert scrape.engines[0].requests_waiting == 4.0
    assert scrape.duplicate_series == 1


def test_corrupt_histogram_is_dropped_not_trusted():
    text = "".join(
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {c}\n'
        for le, c in [("1.0", 5), ("2.0", 3), ("+Inf", 6)]
    )
    assert parse_vllm_metrics(text).engines[0].e2e_request_latency is None


# --- the collector against a real loopback server ----------------------------------------------


def collector(url: str, **kw: object) -> VllmMetricsCollector:
    cfg = VllmMetricsSourceConfig(**{"timeout_seconds": 1.0, **kw})  # type: ignore[arg-type]
    return VllmMetricsCollector(ServiceConfig(name="vllm", url=url), cfg)


def test_scrapes_a_real_server(script: Script, http_server: str):
    script.set("/metrics", body=read_fixture("metrics-pressure-07.prom").encode())
    r = collector(http_server).collect()
    assert r.error is None and r.payload is not None
    assert r.payload.engines[0].requests_waiting == 27.0  # type: ignore[union-attr]


FAILURES = [
    # route settings, expected error fragment, expected hint fragment
    ({"status": 500, "body": b"Internal Server Error"}, "HTTP 500", None),
    ({"delay_seconds": 2.5, "body": b"vllm:x 1\n"}, "no answer within 1s", "hung"),
    (
        {"body": b"<!DOCTYPE html><html><body>login</body></html>", "content_type": "text/html"},
        "HTML",
        "services[].url",
    ),
    ({"body": read_fixture("metrics-idle.prom").encode(), "truncate_to": 1000}, "GET", None),
]


@pytest.mark.parametrize(
    ("route", "error", "hint"), FAILURES, ids=["500", "slow", "html", "truncated"]
)
def test_a_misbehaving_server_is_an_observation(
    script: Script, http_server: str, route, error, hint
):
    script.set("/metrics", **route)
    r = collector(http_server).collect()
    assert r.payload is None
    assert r.error is not None and error in r.error
    if hint:
        assert r.hint is not None and hint in r.hint


def test_refused_connection_says_vllm_is_not_listening(free_port: int):
    r = collector(f"http://127.0.0.1:{free_port}").collect()
    assert r.payload is None and "connection refused" in (r.error or "")
    assert "not listening" in (r.hint or "")


def test_a_50_mb_body_is_cut_off(script: Script, http_server: str):
    script.set("/metrics", body=b"vllm:x 1\n" * (50 * 1024 * 1024 // 9))
    r = collector(http_server, max_body_bytes=16 * 1024 * 1024).collect()
    assert r.payload is None and "exceeds" in (r.error or "")


def test_disable_log_stats_server_is_reported_clearly(script: Script, http_server: str):
    script.set("/metrics", body=read_fixture("disable-log-stats.prom").encode())
    r = collector(http_server).collect()
    assert r.payload is not None and r.payload.stats_enabled is False  # type: ignore[union-attr]
    assert "no vllm:* series" in (r.error or "")
    assert "--disable-log-stats" in (r.hint or "")


def test_engines_past_the_cap_are_counted_not_read() -> None:
    """16,000 engines in one body cost minutes; past MAX_ENGINES they are
    counted and reported (the exported engines_dropped, the reading's hint), the rest read."""
    from tests.expositions import multi_engine
    from vllm_guardian.sources.vllm_metrics import MAX_ENGINES

    text = multi_engine(read_fixture("metrics-pressure-07.prom"), MAX_ENGINES + 40)
    scrape = parse_vllm_metrics(text)
    assert len(scrape.engines) == MAX_ENGINES
    assert scrape.engines_dropped == 40
    assert (
        parse_vllm_metrics(
            multi_engine(read_fixture("metrics-pressure-07.prom"), 8)
        ).engines_dropped
        == 0
    )
