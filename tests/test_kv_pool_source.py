"""The KV pool's size, and where the guardian read it.

vLLM's Python frontend exports ``vllm:cache_config_info``; its Rust frontend does not. Then the
pool is what each engine logged at start-up ("GPU KV cache size: N tokens, Maximum concurrency
…", an INFO line of the engine core: vllm/v1/core/kv_cache_utils.py; "CPU" on the CPU build),
read from the engine's own lines only, text or JSON; and where neither says, it is unknown
(None), never a default.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_fixture
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.model import LogReading, ServiceSnapshot, Snapshot
from vllm_guardian.sources.logs import EventCounter
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

MESSAGE = (
    "CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 4,096 tokens per request: 512.00x"
)
# The real vLLM 0.32 line (tests/fixtures/logs/server-startup-run1-cold.log), as EngineCore_DP0.
KV_LINE = f"(EngineCore_DP0 pid=18791) INFO 11-22 00:01:08 [kv_cache_utils.py:2327] {MESSAGE}"
KV_JSON = json.dumps(
    {
        "asctime": "2026-11-26 14:10:09,179",
        "levelname": "INFO",
        "name": "vllm.v1.core.kv_cache_utils",
        "processName": "EngineCore_DP0",
        "process": 4120,
        "message": MESSAGE,
        "vllm_process_name": "EngineCore_DP0",
    }
)
# A request's text the API server logs must not size the pool.
FAKE = (
    "(APIServer pid=4119) INFO 11-22 00:01:43 [logger.py:40] Received request cmpl-1: prompt: "
    "'GPU KV cache size: 99 tokens'"
)


def reading(*lines: str) -> LogReading:
    counter = EventCounter(16)
    for i, line in enumerate(lines):
        counter.feed(line, float(i))
    return counter.take()


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ((KV_LINE,), (("EngineCore_DP0", MESSAGE),)),
        ((KV_JSON,), (("EngineCore_DP0", MESSAGE),)),
        ((FAKE,), ()),
        # a restarted engine logs its new pool: the latest line per engine process counts
        (
            (KV_LINE, KV_LINE.replace("2,097,152", "1,024")),
            (("EngineCore_DP0", MESSAGE.replace("2,097,152", "1,024")),),
        ),
    ],
)
def test_the_logs_source_keeps_each_engines_latest_pool_line(
    lines: tuple[str, ...], expected: tuple[tuple[str, str], ...]
) -> None:
    assert reading(*lines).engine_kv_sizing == expected


def _signals(metrics: str, logs: LogReading | None) -> sig.ServiceSignals:
    scrape = parse_vllm_metrics(metrics)
    snaps = [Snapshot(t, (ServiceSnapshot("vllm", vllm=scrape, logs=logs),), None) for t in (0, 1)]
    return sig.derive(snaps, [ServiceConfig("vllm")], SignalsConfig()).services[0]


@pytest.mark.parametrize(
    ("metrics", "log_lines", "tokens", "source"),
    [
        # the Python frontend: cache_config_info says it (num_gpu_blocks × block_size)
        ("metrics-pressure-07.prom", (), 4096, "cache_config_info"),
        ("metrics-pressure-07.prom", (KV_LINE,), 4096, "cache_config_info"),
        # the Rust frontend: the engine's log says it, or nothing does
        ("rust-frontend-under-load-05.om", (KV_LINE,), 2_097_152, "vLLM log"),
        ("rust-frontend-under-load-05.om", (KV_JSON,), 2_097_152, "vLLM log"),
        ("rust-frontend-under-load-05.om", (), None, None),
        ("rust-frontend-under-load-05.om", (FAKE,), None, None),
        # two engine processes logged a pool, one engine serves: which one is it? unknown
        (
            "rust-frontend-under-load-05.om",
            (KV_LINE, KV_LINE.replace("EngineCore_DP0", "EngineCore_DP1")),
            None,
            None,
        ),
    ],
)
def test_signals_say_the_pool_and_its_source(
    metrics: str, log_lines: tuple[str, ...], tokens: int | None, source: str | None
) -> None:
    s = _signals(read_fixture(metrics), reading(*log_lines) if log_lines else None)
    assert (s.kv_cache_capacity_tokens, s.kv_cache_capacity_source) == (tokens, source)
