"""One name per alert condition, whichever engine evaluated it.

The guardian evaluates its own rules (vllm_guardian/defaults/rules.yaml) and sends them to
Alertmanager; Prometheus evaluates the shipped rules (alerts/vllm-guardian.rules.yml) on the
guardian's exported series. Where both watch the same condition they use the same alertname,
and the label ``evaluator`` (``guardian`` or ``prometheus``) says which one sent it, so
Alertmanager can page once (examples/alertmanager.yml inhibits the Prometheus copy while the
guardian's own alert for the same name and service fires: checked by amtool and by a real
Alertmanager below). Prometheus's copy still pages when the guardian is down.
"""

from __future__ import annotations

import functools
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests import hostneeds
from tests.test_alert_sinks import run_alertmanager
from vllm_guardian.actuators.alertmanager import am_alert
from vllm_guardian.actuators.webhook import iso8601
from vllm_guardian.model import Alert, AlertState, Severity

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_RULES = ROOT / "alerts" / "vllm-guardian.rules.yml"
GUARDIAN_RULES = ROOT / "vllm_guardian" / "defaults" / "rules.yaml"
EXAMPLE = ROOT / "examples" / "alertmanager.yml"
NAME = re.compile(r"^Vllm[A-Z][A-Za-z]+$")

# Conditions both engines watch: the Prometheus rule for each is named as the guardian's.
SHARED = [
    "VllmKvCacheSaturated", "VllmPreemptionRateHigh", "VllmWaitingQueueLong", "VllmOverCapacity",
    "VllmEngineStalled", "VllmEngineDead", "VllmGuardianMetricsSourceDown",
    "VllmGpuMemoryOverBudget", "VllmGpuSharedWithOtherProcess", "VllmGpuHeadroomExhaustionSoon",
    "VllmAllocatorFragmented", "VllmGpuResetRequired", "VllmGuardianBreakerLatched",
]  # fmt: skip


@functools.cache
def prometheus_rules() -> tuple[dict[str, Any], ...]:
    doc = yaml.safe_load(PROMETHEUS_RULES.read_text())
    return tuple(r for g in doc["groups"] for r in g["rules"] if "alert" in r)


@functools.cache
def guardian_names() -> frozenset[str]:
    return frozenset(r["name"] for r in yaml.safe_load(GUARDIAN_RULES.read_text())["rules"])


def test_every_alert_of_either_engine_is_named_alike() -> None:
    names = [r["alert"] for r in prometheus_rules()] + sorted(guardian_names())
    assert [n for n in names if not NAME.match(n)] == []


@pytest.mark.parametrize("name", SHARED)
def test_a_condition_both_engines_watch_has_one_name(name: str) -> None:
    assert name in guardian_names()
    assert name in {r["alert"] for r in prometheus_rules()}


def test_every_prometheus_rule_says_prometheus_evaluated_it() -> None:
    missing = [
        r["alert"] for r in prometheus_rules() if r["labels"].get("evaluator") != "prometheus"
    ]
    assert missing == []


def test_the_guardians_alerts_say_the_guardian_evaluated_them() -> None:
    a = Alert(
        name="VllmEngineDead",
        service="vllm",
        labels=(),
        state=AlertState.FIRING,
        severity=Severity.CRITICAL,
        cause=None,
        value=0.0,
        active_since_seconds=1.0,
        firing_since_seconds=61.0,
        last_true_seconds=99.0,
    )
    assert am_alert(a, 100.0, "docs/runbook.md")["labels"]["evaluator"] == "guardian"


def test_the_alertmanager_example_pages_once_per_name_and_service() -> None:
    """The guardian's alert inhibits Prometheus's for the same alertname and service."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    rules = [
        r
        for r in doc["inhibit_rules"]
        if r.get("source_matchers") == ['evaluator="guardian"']
        and r.get("target_matchers") == ['evaluator="prometheus"']
    ]
    assert len(rules) == 1, doc["inhibit_rules"]
    assert set(rules[0]["equal"]) >= {"alertname", "service"}


def amtool() -> str:
    return hostneeds.tool(
        "amtool",
        "the Alertmanager example is checked by the real one "
        "(apt-get install prometheus-alertmanager; scripts/test installs it)",
    )


def test_amtool_accepts_the_example() -> None:
    proc = subprocess.run(
        [amtool(), "check-config", str(EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=VllmEngineDead", "severity=critical", "service=vllm"], "vllm-pager"),
        (["alertname=VllmKvCacheSaturated", "severity=warning", "service=vllm"], "vllm-oncall"),
    ],
)
@pytest.mark.parametrize("evaluator", ["guardian", "prometheus"])
def test_both_copies_of_an_alert_take_the_same_route(
    labels: list[str], receiver: str, evaluator: str
) -> None:
    proc = subprocess.run(
        [amtool(), "config", "routes", "test", f"--config.file={EXAMPLE}",
         f"--verify.receivers={receiver}", *labels, f"evaluator={evaluator}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_real_alertmanager_inhibits_prometheuss_copy_while_the_guardians_fires(
    tmp_path: Path, free_port: int
) -> None:
    """The example config in a real Alertmanager: both copies of VllmEngineDead for service
    vllm arrive; the guardian's pages, Prometheus's is inhibited. Another service's copy from
    Prometheus (its guardian says nothing) is not."""
    now = time.time()

    def alert(evaluator: str, service: str) -> dict[str, Any]:
        return {
            "labels": {"alertname": "VllmEngineDead", "severity": "critical",
                       "service": service, "evaluator": evaluator},
            "startsAt": iso8601(now - 60),
            "endsAt": iso8601(now + 600),
        }  # fmt: skip

    with run_alertmanager(tmp_path, free_port, EXAMPLE.read_text()) as url:
        sent = [alert("guardian", "vllm"), alert("prometheus", "vllm"), alert("prometheus", "b")]
        requests.post(url + "/api/v2/alerts", json=sent, timeout=5).raise_for_status()
        want = {("guardian", "vllm"): "active", ("prometheus", "vllm"): "suppressed",
                ("prometheus", "b"): "active"}  # fmt: skip
        seen: dict[tuple[str, str], str] = {}
        deadline = time.monotonic() + 30
        while seen != want and time.monotonic() < deadline:
            got = requests.get(url + "/api/v2/alerts", timeout=5).json()
            seen = {
                (a["labels"]["evaluator"], a["labels"]["service"]): a["status"]["state"]
                for a in got
            }
            time.sleep(0.2)
        assert seen == want, f"after 30 s Alertmanager shows {seen}"
