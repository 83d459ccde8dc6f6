"""The demo's configuration keeps the relations the shipped defaults keep.

The demo runs the twin at 4x and shortens some windows by hand; a window shortened on one side
of a relation and not the other silently turns a mechanism off. These tests pin the relations.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_guardian.config import Config, GateConfig, SignalsConfig
from vllm_guardian.tools.demo import DemoOptions, demo_config


def _shipped() -> tuple[float, float]:
    return GateConfig().stall_hold_seconds, SignalsConfig().stall_seconds


def _demo(tmp_path: Path) -> tuple[float, float]:
    cfg: Config = demo_config(DemoOptions(), tmp_path, 18000, 18001, gate_port=18002)
    gate = cfg.services[0].gate
    assert gate is not None
    return gate.stall_hold_seconds, cfg.signals.stall_seconds


@pytest.mark.parametrize("which", ["shipped", "demo"])
def test_the_gate_holds_new_requests_well_before_the_guardian_restarts_a_stalled_engine(
    which: str, tmp_path: Path
) -> None:
    # The gate's progress watch exists to stop sending requests into a hung engine while the
    # guardian waits out signals.stall_seconds before it restarts it (gate/progress.py: "a
    # third of the guardian's wait"). A hold longer than the guardian's wait never acts: the
    # engine is restarted first, and every request sent meanwhile reaches the hung engine.
    hold, stall = _shipped() if which == "shipped" else _demo(tmp_path)
    assert 0 < hold <= stall / 3 + 1e-9, (
        f"{which}: gate stall_hold_seconds {hold} against signals.stall_seconds {stall}"
    )
