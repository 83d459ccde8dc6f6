"""The health source against a real loopback server: every answer is an observation."""

from __future__ import annotations

import json

import pytest

from tests.httpfixture import Script
from vllm_guardian.clock import FakeClock
from vllm_guardian.config import HealthSourceConfig, ServiceConfig
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
