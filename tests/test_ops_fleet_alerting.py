"""Fleet alerting: the Alertmanager routing example groups by model and cause, and routes as it says.

The fleet rules themselves are promtool-tested with the others (alerts/tests/fleet.test.yml,
run by tests/test_ops_alerts.py). Here the real ``amtool`` checks examples/alertmanager-fleet.yml
and resolves receivers for label sets the rules produce.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests import hostneeds

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "alertmanager-fleet.yml"
RULES = ROOT / "alerts" / "vllm-guardian.rules.yml"


def amtool() -> str:
    return hostneeds.tool(
        "amtool",
        "the fleet's Alertmanager example is checked by the real one "
        "(apt-get install prometheus-alertmanager; scripts/test installs it)",
    )


def test_amtool_accepts_the_example() -> None:
    proc = subprocess.run(
        [amtool(), "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fleet_alerts_are_grouped_by_model_and_cause() -> None:
    route = yaml.safe_load(CONFIG.read_text())["route"]
    assert route["group_by"][:2] == ["model", "cause"]
    fleet = [
        r for g in yaml.safe_load(RULES.read_text())["groups"] if g["name"].endswith("fleet")
        for r in g["rules"]
    ]  # fmt: skip
    assert len(fleet) == 4
    for rule in fleet:  # every fleet alert carries the grouping label model
        assert "by (model" in " ".join(rule["expr"].split()), rule["alert"]


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=VllmFleetOoms", "severity=warning", "model=llama", "cause=gpu_memory_overcommit"], "ml-platform"),
        (["alertname=VllmFleetLatched", "severity=critical", "model=llama"], "ml-platform-pager"),
        (["alertname=VllmFleetReplicasNotReady", "severity=critical", "model=opt"], "ml-platform-pager"),
        (["alertname=VllmGpuLostOrRemapPending", "severity=critical", "instance=gpu1:9469"], "gpu-nodes"),
    ],
)  # fmt: skip
def test_routes_resolve_to_the_receiver(labels: list[str], receiver: str) -> None:
    proc = subprocess.run(
        [amtool(), "config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receiver}", *labels],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receiver
