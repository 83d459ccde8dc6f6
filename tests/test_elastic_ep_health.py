"""vLLM's elastic EP scaling is not an engine death.

While ``/scale_elastic_ep`` runs, vLLM 0.32's ScalingMiddleware
(vllm/entrypoints/serve/elastic_ep/middleware.py) answers every HTTP request, ``/health``
included, with 503 and the body below: 40-55 s by the PR that added it. A 503 from ``/health``
is otherwise vLLM's dead engine (the guardian restarts it within seconds); this one says the
server is not serving and is not dead: the front door holds requests and nothing restarts it.
"""

from __future__ import annotations

import json

import pytest

from tests.httpfixture import Script
from vllm_guardian.config import HealthSourceConfig, ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.core.policy import PolicyState, ServiceState
from vllm_guardian.core.step import gate_states
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import Bundle
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import Cause, HealthProbe, HealthState, ServiceSnapshot, Snapshot
from vllm_guardian.sources.health import SCALING_ERROR_PREFIX, HealthCollector

# The middleware's JSONResponse, as Starlette renders it.
SCALING = json.dumps(
    {"error": "The model is currently scaling. Please try again later."}, separators=(",", ":")
).encode()

BODIES = [
    # body, state
    (SCALING, HealthState.SCALING),
    (b"", HealthState.ENGINE_DEAD),  # vLLM's dead engine: an empty 503
    (b'{"error":"something else"}', HealthState.ENGINE_DEAD),
    (b"The model is currently scaling.", HealthState.ENGINE_DEAD),  # not the middleware's JSON
]


@pytest.mark.parametrize(("body", "state"), BODIES)
def test_a_503_is_told_by_its_body(
    script: Script, http_server: str, body: bytes, state: HealthState
) -> None:
    script.set("/health", status=503, body=body, content_type="application/json")
    r = HealthCollector(
        ServiceConfig(name="v", url=http_server), HealthSourceConfig(), FakeClock()
    ).collect()
    assert r.payload.state is state  # type: ignore[union-attr]
    if state is HealthState.SCALING:
        assert "elastic EP" in (r.payload.error or "")  # type: ignore[union-attr]


def test_scaling_is_neither_up_nor_dead() -> None:
    probe = HealthProbe(HealthState.SCALING, 503, 0.01, "elastic EP scaling")
    snap = Snapshot(10.0, (ServiceSnapshot("vllm", health=probe),), None)
    signals = sig.derive([snap], [ServiceConfig(name="vllm")], SignalsConfig())
    s = signals.services[0]
    assert s.vllm_up is None  # VllmEngineDead (vllm_up == 0) does not fire: no restart
    assert s.health_state is HealthState.SCALING
    ((_, gate),) = gate_states(PolicyState((ServiceState("vllm"),), 1), signals, dry_run=False)
    assert not gate.ready and "scaling" in gate.reason


def test_diagnose_of_a_bundle_taken_while_scaling_names_no_dead_engine() -> None:
    # The health source's own words, as the incident bundle's health.json keeps them.
    probe_error = f"HTTP 503: {SCALING_ERROR_PREFIX} (vLLM refuses every request until …)"
    report = analyze(Bundle(origin="t", health={"status_code": 503, "error": probe_error}))
    assert report.verdict is not Cause.ENGINE_DEAD
    assert any("elastic EP" in n for n in report.notes)
    dead = analyze(Bundle(origin="t", health={"status_code": 503, "error": "HTTP 503"}))
    assert dead.verdict is Cause.ENGINE_DEAD
