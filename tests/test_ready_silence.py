"""The guardian's ``/ready/<service>`` closes when vLLM says it is not serving, not when one
``/health`` answer came late.

A busy vLLM's API server answers ``/health`` late while it serves (seen on the real engine
under overload: 5-30 s of silence with answers streaming). The gate's own poll gives silence a
grace and counts answer bytes as life (docs/gate.md); the guardian's ``/ready`` closing on a
single timeout held every new request for a tick (12 s in one overload run) with vLLM serving.
Silence that lasts is still acted on: the gate's poll holds after its grace, and the guardian's
hang detection restarts a server that stays silent.
"""

from __future__ import annotations

import pytest

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.core.policy import PolicyState, ServiceState
from vllm_guardian.core.step import gate_states
from vllm_guardian.model import HealthProbe, HealthState, ServiceSnapshot, Snapshot

ROWS = [
    (HealthState.UP, 200, True, "open"),
    (HealthState.TIMEOUT, None, True, "open"),  # late, not down: the gate judges silence
    (HealthState.ENGINE_DEAD, 503, False, "vLLM is not up (engine_dead)"),
    (HealthState.ERROR, 500, False, "vLLM is not up (error)"),
    (HealthState.REFUSED, None, False, "vLLM is not up (refused)"),
    (HealthState.SCALING, 503, False, "vLLM is not up (scaling)"),
]


def test_every_health_state_has_a_row() -> None:
    assert {row[0] for row in ROWS} == set(HealthState)


@pytest.mark.parametrize(("state", "status", "ready", "reason"), ROWS)
def test_ready_follows_what_vllm_says_not_a_late_answer(
    state: HealthState, status: int | None, ready: bool, reason: str
) -> None:
    probe = HealthProbe(state, status, 1.0 if state is HealthState.TIMEOUT else 0.01, None)
    snap = Snapshot(10.0, (ServiceSnapshot("vllm", health=probe),), None)
    signals = sig.derive([snap], [ServiceConfig(name="vllm")], SignalsConfig())
    ((_, gate),) = gate_states(PolicyState((ServiceState("vllm"),), 1), signals, dry_run=False)
    assert (gate.ready, gate.reason) == (ready, reason)
