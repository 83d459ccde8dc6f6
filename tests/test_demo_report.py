"""The demo's summary reads the audit log: what it says the guardian did."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_guardian.demo import kv_gated

GATE_KV = {"what": "gate", "cause": "concurrency_overcommit", "reason": "KV cache usage 93%"}
# A pre-emptive relaunch for a growing neighbour closes the front door too (a CRITICAL gate
# decision): that is not KV pressure (the noisy_neighbour demo said "for KV pressure: yes").
GATE_FORECAST = {"what": "gate", "cause": "gpu_memory_overcommit", "reason": "CRITICAL: forecast"}
ACTION = {"what": "action", "cause": "gpu_memory_overcommit", "reason": "relaunch"}


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
    audit: list[dict[str, Any]], expected: bool
) -> None:
    assert kv_gated(audit) is expected
