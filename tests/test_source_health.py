"""The health source against a real loopback server: every answer is an observation."""

from __future__ import annotations

import json

import pytest

from tests.httpfixture import Script
from vllm_guardian.config import HealthSourceConfig, ServiceConfig
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import HealthState
from vllm_guardian.sources.health import HealthCollector, classify_status


@pytest.mark.parametrize(
    ("code", "state"),
    [
        (200, HealthState.UP),
        (503, HealthState.ENGINE_DEAD),
        (500, HealthState.ENGINE_DEAD),
        (404, HealthState.ERROR),
    ],
)
def test_status_codes(script: Script, http_server: str, code: int, state: HealthState):
    assert classify_status(code) is state
    script.set("/health", status=code)
    r = HealthCollector(
        ServiceConfig(name="v", url=http_server), HealthSourceConfig(), FakeClock()
    ).collect()
    assert r.payload is not None and r.error is None
    assert r.payload.state is state and r.payload.status_code == code  # type: ignore[union-attr]


def test_refused(free_port: int):
    r = HealthCollector(
        ServiceConfig(name="v", url=f"http://127.0.0.1:{free_port}"),
        HealthSourceConfig(),
        FakeClock(),
    ).collect()
    assert r.payload.state is HealthState.REFUSED  # type: ignore[union-attr]


def test_timeout(script: Script, http_server: str):
    script.set("/health", delay_seconds=1.5)
    cfg = HealthSourceConfig(timeout_seconds=0.3)
    r = HealthCollector(ServiceConfig(name="v", url=http_server), cfg, FakeClock()).collect()
    assert r.payload.state is HealthState.TIMEOUT  # type: ignore[union-attr]


def test_deep_probe_is_rate_limited(script: Script, http_server: str):
    script.set("/health")
    script.set(
        "/v1/models",
        body=json.dumps({"data": [{"id": "tiny"}]}).encode(),
        content_type="application/json",
    )
    completions = script.set(
        "/v1/completions",
        body=json.dumps({"choices": [{"text": "x"}]}).encode(),
        content_type="application/json",
    )
    clock = FakeClock()
    cfg = HealthSourceConfig(deep_probe=True, deep_probe_interval_seconds=60)
    c = HealthCollector(ServiceConfig(name="v", url=http_server), cfg, clock)
    first = c.collect().payload
    assert first.deep is not None and first.deep.ok  # type: ignore[union-attr]
    clock.advance(30)
    c.collect()
    assert completions.hits == 1  # within the interval: the last result is reused
    clock.advance(31)
    c.collect()
    assert completions.hits == 2


def test_deep_probe_failure_is_reported(script: Script, http_server: str):
    script.set("/health")
    script.set("/v1/models", body=json.dumps({"data": [{"id": "tiny"}]}).encode())
    script.set("/v1/completions", status=500, body=b"{}")
    cfg = HealthSourceConfig(deep_probe=True)
    probe = (
        HealthCollector(ServiceConfig(name="v", url=http_server), cfg, FakeClock())
        .collect()
        .payload
    )
    assert probe.state is HealthState.UP  # type: ignore[union-attr]
    assert probe.deep is not None and not probe.deep.ok and probe.deep.status_code == 500  # type: ignore[union-attr]


# vLLM's GET /is_paused (vllm/entrypoints/rl/online/api_router.py in 0.32, registered only
# with VLLM_SERVER_DEV_MODE=1): {"is_paused": <bool>}; without dev mode, FastAPI's 404.
@pytest.mark.parametrize(
    ("status", "body", "paused"),
    [
        # as vLLM 0.32 answered (tests/fixtures/vllm/pause-0.32.json)
        (200, b'{"is_paused":true}', True),
        (200, b'{"is_paused":false}', False),
        (404, b'{"detail": "Not Found"}', None),  # no dev mode: no /pause either
        (500, b'{"error": "Failed to fetch pause status: boom"}', None),
        (200, b"[1]", None),
    ],
)
def test_is_paused_is_read_beside_health(
    script: Script, http_server: str, status: int, body: bytes, paused: bool | None
) -> None:
    script.set("/health")
    route = script.set("/is_paused", status=status, body=body, content_type="application/json")
    collector = HealthCollector(
        ServiceConfig(name="v", url=http_server), HealthSourceConfig(), FakeClock()
    )
    for _ in range(3):
        r = collector.collect()
        assert r.payload.state is HealthState.UP  # type: ignore[union-attr]
        assert r.payload.paused is paused  # type: ignore[union-attr]
    # a server without the route is asked once, not on every tick
    assert route.hits == (1 if status == 404 else 3)


def test_a_hung_is_paused_is_no_answer_and_health_still_counts(script: Script, http_server: str):
    """/is_paused asks the engine core: a hung one never answers. /health's answer stands."""
    script.set("/health")
    hung = script.set("/is_paused", delay_seconds=60.0, body=b'{"is_paused": true}')
    # Not 0.5 s: /health must answer within 0.9 of it, which a busy 2-core machine can miss.
    cfg = HealthSourceConfig(timeout_seconds=3.0)
    try:
        r = HealthCollector(ServiceConfig(name="v", url=http_server), cfg, FakeClock()).collect()
    finally:
        hung.release()
    assert r.payload.state is HealthState.UP and r.payload.paused is None  # type: ignore[union-attr]
