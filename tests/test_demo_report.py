"""The demo's summary reads the audit log: what it says the guardian did."""

from __future__ import annotations

import pytest

from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.model import ActionKind, Cause
from vllm_guardian.tools.demo import kv_gated

GATE_KV = Decision(
    0.0, "vllm", DecisionKind.GATE, "KV cache usage 93%", Cause.CONCURRENCY_OVERCOMMIT
)
# A pre-emptive relaunch for a growing neighbour closes the front door too (a CRITICAL gate
# decision): that is not KV pressure (the noisy_neighbour demo said "for KV pressure: yes").
GATE_FORECAST = Decision(
    0.0, "vllm", DecisionKind.GATE, "CRITICAL: forecast", Cause.GPU_MEMORY_OVERCOMMIT
)
ACTION = Decision(
    0.0, "vllm", DecisionKind.ACTION, "relaunch", Cause.GPU_MEMORY_OVERCOMMIT,
    action_id=1, action_kind=ActionKind.RELAUNCH,
)  # fmt: skip


@pytest.mark.parametrize(
    ("audit", "expected"),
    [
        ([], False),
        ([GATE_KV], True),
        ([GATE_FORECAST, ACTION], False),
        ([GATE_FORECAST, GATE_KV], True),
    ],
    ids=["nothing", "kv", "forecast only", "both"],
)
def test_the_summary_says_kv_gating_only_for_kv_pressure(
    audit: list[Decision], expected: bool
) -> None:
    assert kv_gated(audit) is expected
