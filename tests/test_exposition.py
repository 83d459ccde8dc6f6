"""The guardian's /metrics: a golden exposition from real captures, promtool's lint, the endpoints."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests import hostneeds
from tests.scenario import signals_for, snapshots
from vllm_guardian.model import EngineMetrics, ServiceSnapshot, Snapshot, VllmScrape
from vllm_guardian.shell.exposition import (
    ExpositionServer,
    GateState,
    GuardianCollector,
    Published,
    make_registry,
)

GOLDEN = Path(__file__).parent / "golden" / "exposition.prom"
REQUIRED = {
    # name: labels every sample must carry
    "vllm_guardian_kv_cache_usage_ratio": {"service"},
    "vllm_guardian_requests_waiting": {"service"},
    "vllm_guardian_requests_running": {"service"},
    "vllm_guardian_preemptions_per_second": {"service"},
    "vllm_guardian_gpu_memory_used_bytes": {"gpu"},
    "vllm_guardian_gpu_memory_total_bytes": {"gpu"},
    "vllm_guardian_service_gpu_memory_bytes": {"service", "gpu"},
    "vllm_guardian_vllm_health": {"service"},
    "vllm_guardian_source_up": {"service", "source"},
    "vllm_guardian_source_duration_seconds": {"service", "source"},
    "vllm_guardian_tick_duration_seconds": set(),
    "vllm_guardian_build_info": {"version", "python_version"},
}


def render() -> str:
    history = snapshots()
    c = GuardianCollector(["vllm"])
    for i in range(len(history)):
        c.publish(
            Published(history[i], signals_for(history[: i + 1]), 0.0125), monotonic_now=100.0 + i
        )
    return generate_latest(make_registry(c, process_metrics=False)).decode()


def without_build_info(text: str) -> str:
    return "".join(
        line + "\n"
        for line in text.splitlines()
        if not line.startswith("vllm_guardian_build_info{")
    )


def test_golden_exposition():
    text = without_build_info(render())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "exposition changed; rerun with UPDATE_GOLDEN=1 and review the diff"
    )


def test_required_names_and_labels_and_values():
    fams = {f.name: f for f in text_string_to_metric_families(render())}
    samples = {s.name: s for f in fams.values() for s in f.samples}
    for name, labels in REQUIRED.items():
        assert name in samples, name
        assert set(samples[name].labels) == labels, name
    # The values the real capture holds (metrics-pressure-07.prom).
    assert samples["vllm_guardian_requests_waiting"].value == 27.0
    assert samples["vllm_guardian_requests_running"].value == 5.0
    assert samples["vllm_guardian_kv_cache_usage_ratio"].value == pytest.approx(0.9032258064516129)
    # vLLM counted 15 then 89 preemptions in the two captures, 3 s apart.
    assert samples["vllm_guardian_preemptions_per_second"].value == pytest.approx((89 - 15) / 3)


def test_missing_values_are_absent_not_zero():
    text = render()
    # GPU 1 is lost: it is listed as down, and its memory series are absent.
    assert 'vllm_guardian_gpu_up{gpu="1"} 0.0' in text
    assert 'vllm_guardian_gpu_memory_used_bytes{gpu="1"}' not in text
    assert not [line for line in text.splitlines() if line.endswith(("NaN", "Inf"))]


def test_promtool_check_metrics():
    tool = hostneeds.tool(
        "promtool",
        "the exposition is checked by Prometheus's own linter "
        "(apt-get install prometheus; scripts/test installs it)",
    )
    proc = subprocess.run(
        [tool, "check", "metrics"], input=render(), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == ""


def test_http_endpoints():
    c = GuardianCollector(["vllm"])
    now = [100.0]
    server = ExpositionServer(c, "127.0.0.1", 0, stale_after_seconds=10, monotonic=lambda: now[0])
    server.start()
    try:
        base = "http://{}:{}".format(*server.address)
        assert requests.get(base + "/healthz", timeout=5).status_code == 503  # no tick yet
        starting = requests.get(base + "/ready/vllm", timeout=5)  # nothing seen: not ready
        assert starting.status_code == 503 and starting.json()["reason"] == "starting: no tick yet"
        history = snapshots()
        c.publish(Published(history[-1], signals_for(history), 0.01), monotonic_now=100.0)
        r = requests.get(base + "/metrics", timeout=5)
        assert r.status_code == 200 and "vllm_guardian_requests_waiting" in r.text
        assert "process_resident_memory_bytes" in r.text
        assert requests.get(base + "/healthz", timeout=5).status_code == 200
        assert requests.get(base + "/ready/vllm", timeout=5).json()["ready"] is True
        c.set_gate("vllm", GateState(False, "kv_cache_usage 0.95 above 0.90"))
        gated = requests.get(base + "/ready/vllm", timeout=5)
        assert gated.status_code == 503 and "0.95" in gated.json()["reason"]
        assert requests.get(base + "/ready/nope", timeout=5).status_code == 404
        now[0] = 200.0  # no tick for 100 s
        assert requests.get(base + "/healthz", timeout=5).status_code == 503
    finally:
        server.stop()
    assert time.monotonic() > 0


def overloaded(seconds: float = 120.0, step: float = 2.0) -> list[Snapshot]:
    """vLLM serving 2 requests/s while 4 arrive: saturated, its queue growing 2/s."""
    out = []
    t = 0.0
    while t <= seconds:
        engine = EngineMetrics(
            "m",
            "0",
            requests_running=24.0,
            requests_waiting=10.0 + 2.0 * t,
            kv_cache_usage_ratio=0.97,
            prompt_tokens_total=400.0 * t,
            generation_tokens_total=800.0 * t,
            requests_finished_total=2.0 * t,
            requests_failed_total=0.0,
        )
        scrape = VllmScrape((engine,), True, 500.0, 1000)
        out.append(Snapshot(1000.0 + t, (ServiceSnapshot("vllm", vllm=scrape),), None, ()))
        t += step
    return out


def capacity_lines(history: list[Snapshot]) -> list[str]:
    c = GuardianCollector(["vllm"])
    c.publish(Published(history[-1], signals_for(history), 0.01), monotonic_now=100.0)
    text = generate_latest(make_registry(c, process_metrics=False)).decode()
    return [line for line in text.splitlines() if line.startswith("vllm_guardian_capacity_")]


def test_capacity_series():
    assert capacity_lines(overloaded()) == [
        'vllm_guardian_capacity_demand_ratio{service="vllm"} 2.0',
        'vllm_guardian_capacity_replicas_needed{service="vllm"} 2.0',
    ]
    # 40 s of the same load: too little data, so no series at all (never a guess, never 0).
    assert capacity_lines(overloaded(seconds=40.0)) == []


def test_exhaustion_forecast_is_exported_per_gpu_and_absent_without_a_trend():
    from dataclasses import replace

    from vllm_guardian.core.forecast import Forecast, Neighbour
    from vllm_guardian.model import Cause

    history = snapshots()
    signals = signals_for(history)
    assert "headroom_exhaustion" not in render()  # the captures hold no trend
    fc = Forecast(0, 240.0, 400.0, 5.0 * 2**30, -2.0**24, 12, 110.0,
                  Cause.ALLOCATOR_FRAGMENTATION, "stranded bytes growing")  # fmt: skip
    svc = replace(signals.services[0], forecasts=(fc,))
    c = GuardianCollector(["vllm"])
    c.publish(Published(history[-1], replace(signals, services=(svc,)), 0.01), monotonic_now=1.0)
    text = generate_latest(make_registry(c, process_metrics=False)).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    key = (("gpu", "0"), ("service", "vllm"))
    assert samples[("vllm_guardian_headroom_exhaustion_seconds", key)] == 240.0
    assert samples[("vllm_guardian_headroom_exhaustion_latest_seconds", key)] == 400.0
    cause = (("cause", "allocator_fragmentation"), *key)
    assert samples[("vllm_guardian_headroom_exhaustion_cause", cause)] == 1.0
    assert not [k for k in samples if k[0].endswith("neighbour_info")]
    nb = replace(
        fc, cause=Cause.GPU_MEMORY_OVERCOMMIT, neighbour=Neighbour(4242, 9, "python3", None)
    )
    c.publish(
        Published(history[-1], replace(signals, services=(replace(svc, forecasts=(nb,)),)), 0.01),
        monotonic_now=2.0,
    )
    text = generate_latest(make_registry(c, process_metrics=False)).decode()
    assert (
        'vllm_guardian_headroom_exhaustion_neighbour_info{cgroup="",command="python3",gpu="0",'
        'pid="4242",service="vllm"} 1.0'
    ) in text


@pytest.mark.parametrize(("listen", "url_host"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_listen_binds_the_family_of_its_address(listen: str, url_host: str):
    """`listen: '[::1]:PORT'` serves /metrics over IPv6 (it raised gaierror before)."""
    c = GuardianCollector(["vllm"])
    server = ExpositionServer(c, listen, 0, stale_after_seconds=10, monotonic=lambda: 0.0)
    server.start()
    try:
        host, port = server.address
        assert host == listen
        history = snapshots()
        c.publish(Published(history[-1], signals_for(history), 0.01), monotonic_now=0.0)
        r = requests.get(f"http://{url_host}:{port}/metrics", timeout=10)
        assert r.status_code == 200 and "vllm_guardian_requests_waiting" in r.text
    finally:
        server.stop()


def test_inhibited_alerts_and_the_planned_restart_are_series_of_their_own() -> None:
    """An alert held during the guardian's own restart keeps its ALERTS-like series and gets a
    second one saying why it is not delivered; the action's phase and the expected-down flag
    are what the shipped Prometheus rules join on (alerts/vllm-guardian.rules.yml)."""
    from prometheus_client.core import Metric

    from vllm_guardian.core import inhibition, phases, policy
    from vllm_guardian.model import ActionKind, Alert, AlertState, Severity
    from vllm_guardian.shell.exposition import _healing_families
    from vllm_guardian.shell.healing import HealingView

    def alert(name: str, held: str | None) -> Alert:
        return Alert(name, "vllm", (), AlertState.FIRING, Severity.CRITICAL, None, 0.0, 10.0,
                     70.0, 100.0, inhibited_by=held)  # fmt: skip

    progress = phases.ActionProgress(
        3, ActionKind.RELAUNCH, None, "r", phases.Phase.AWAITING_READY, 50.0, 900.0, 0.0,
        stopped_seconds=40.0,
    )  # fmt: skip
    state = policy.PolicyState(
        (policy.ServiceState("vllm", action=progress), policy.ServiceState("other"))
    )
    view = HealingView(
        alerts=(
            alert("VllmEngineDead", "action 3 awaiting_ready"),
            alert("VllmCudaOomLogged", None),
        ),
        state=state,
        dry_run=False,
        actions_total=(),
        budget=3,
        budget_window_seconds=3600.0,
        windows=(inhibition.Window("vllm", "action 3 awaiting_ready", 40.0),),
    )

    class One:
        def collect(self) -> list[Metric]:
            return list(_healing_families(view, 100.0))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    text = generate_latest(reg).decode()
    lines = set(text.splitlines())
    for want in [
        'vllm_guardian_alert{alertname="VllmEngineDead",alertstate="firing",service="vllm",severity="critical"} 1.0',
        'vllm_guardian_alert{alertname="VllmCudaOomLogged",alertstate="firing",service="vllm",severity="critical"} 1.0',
        'vllm_guardian_alert_inhibited{alertname="VllmEngineDead",alertstate="firing",inhibited_by="action 3 awaiting_ready",service="vllm",severity="critical"} 1.0',
        'vllm_guardian_action_in_progress{action="relaunch",phase="awaiting_ready",service="vllm"} 1.0',
        'vllm_guardian_vllm_down_expected{service="vllm"} 1.0',
        'vllm_guardian_vllm_down_expected{service="other"} 0.0',
    ]:
        assert want in lines, f"{want}\nnot in\n{text}"
    assert "VllmCudaOomLogged" not in "".join(
        x for x in lines if x.startswith("vllm_guardian_alert_inhibited{")
    )
    assert not any(
        x.startswith(
            'vllm_guardian_action_in_progress{action="relaunch",phase="awaiting_ready",service="other"'
        )
        for x in lines
    )
