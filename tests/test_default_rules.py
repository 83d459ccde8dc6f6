"""The shipped rules (vllm_guardian/defaults/rules.yaml): each fires on the row meant to
trigger it and stays quiet on a healthy one; loading with an operator's file on top."""

from __future__ import annotations

import pytest

from vllm_guardian.actuators.alerts import default_rules_text, load_rules
from vllm_guardian.config import AlertingConfig, ConfigInvalid
from vllm_guardian.core import alert_rules as ar
from vllm_guardian.core import alerting as al
from vllm_guardian.core.signals import ServiceGpuSignals, ServiceSignals, Signals
from vllm_guardian.model import (
    Alert,
    AlertState,
    Cause,
    GpuReading,
    HealthState,
    Snapshot,
    SourceKind,
    SourceStatus,
)

GIB = 1024**3
RULES = ar.parse_rules(default_rules_text(), "rules.yaml")
BY_NAME = {r.name: r for r in RULES}
SVC = ("vllm", ())
GPU0 = ("vllm", (("gpu", "0"),))


def healthy_values() -> dict[al.SeriesKey, dict[str, float | None]]:
    """A busy, healthy server: KV high but below the 90 % watermark, some waiting, GPU memory
    at vLLM's reservation (used ≈ 90 %, which must not alert), every source up."""
    s = ServiceSignals(
        service="vllm",
        health_state=HealthState.UP,
        vllm_up=True,
        metrics_up=True,
        stats_enabled=True,
        kv_cache_usage_ratio=0.89,
        requests_running=64,
        requests_waiting=12,
        preemptions_per_second=0.0,
        generation_tokens_per_second=2400.0,
        prefix_cache_hit_ratio=0.0,  # a zero hit rate is harmless (measured)
        stall_seconds=0.0,
        stalled=False,
        gpu_memory_utilization_ratio=0.9,
        gpus=(ServiceGpuSignals(0, 72 * GIB, 0, 72 * GIB, 7 * GIB, 80 * GIB),),
        memory_budget_bytes=72 * GIB,
        service_memory_bytes=72 * GIB,
        memory_over_budget_bytes=0,
        other_processes_memory_bytes=0,
        headroom_bytes=7 * GIB,
        headroom_slope_bytes_per_second=0.0,
        seconds_to_headroom_exhaustion=None,
        capacity_demand_ratio=1.05,  # saturated at what it serves (a closed loop): not over
        capacity_replicas_needed=1,
    )
    snap = Snapshot(
        0.0,
        (),
        GpuReading(()),
        tuple(
            SourceStatus(k, None if k is SourceKind.NVML else "vllm", True, 0.01)
            for k in SourceKind
        ),
    )
    extra = {("vllm", "restart_budget_remaining"): 3.0, ("vllm", "breaker_latched"): 0.0}
    return al.signal_values(Signals(0.0, (s,)), snap, extra)


# rule name → the row (changes from healthy) meant to trigger it
TRIGGERS: dict[str, dict[al.SeriesKey, dict[str, float | None]]] = {
    "VllmKvCacheSaturated": {SVC: {"kv_cache_usage_ratio": 0.90}},
    "VllmPreemptionRateHigh": {SVC: {"preemptions_per_second": 2.0}},
    "VllmWaitingQueueLong": {SVC: {"requests_waiting": 300}},
    "VllmOverCapacity": {SVC: {"capacity_demand_ratio": 2.1, "capacity_replicas_needed": 2.0}},
    "VllmEngineStalled": {SVC: {"stalled": 1.0}},
    "VllmEngineDead": {SVC: {"vllm_up": 0.0}},
    "VllmEngineInputHang": {SVC: {"input_hung": 1.0}},
    "VllmHeldWithRequestsWaiting": {SVC: {"held_waiting_seconds": 300.0}},
    "VllmGpuMemoryOverBudget": {SVC: {"memory_over_budget_bytes": 3.0 * GIB}},
    "VllmGpuSharedWithOtherProcess": {GPU0: {"other_processes_memory_bytes": 2.0 * GIB}},
    "VllmGpuHeadroomLow": {GPU0: {"headroom_bytes": 0.5 * GIB}},
    "VllmGpuHeadroomExhaustionSoon": {SVC: {"seconds_to_headroom_exhaustion": 240.0}},
    "VllmGpuNeighbourExhaustionSoon": {SVC: {"seconds_to_exhaustion_gpu_memory_overcommit": 240.0}},
    "VllmAllocatorFragmented": {SVC: {"allocator_fragmentation_ratio": 0.6}},
    "VllmAllocatorRetries": {SVC: {"allocator_retries_per_second": 0.2}},
    "VllmCudaOomLogged": {SVC: {"log_events.cuda_oom": 1.0}},
    "VllmNonTorchOomLogged": {SVC: {"log_events.non_torch_oom": 1.0}},
    "VllmGpuHardwareErrorLogged": {SVC: {"log_events.gpu_hardware_error": 1.0}},
    "VllmStartupMemoryShort": {SVC: {"log_events.free_memory_below_utilization": 1.0}},
    "VllmMaxModelLenExceedsKvCache": {SVC: {"log_events.max_seq_len_exceeds_kv": 1.0}},
    "VllmEngineDeathLogged": {SVC: {"log_events.engine_dead": 1.0}},
    "VllmWorkerDiedLogged": {SVC: {"log_events.worker_died": 1.0}},
    "VllmGpuResetRequired": {GPU0: {"xid_reset_class": 1.0}},
    "VllmGuardianRestartBudgetSpent": {SVC: {"policy.restart_budget_remaining": 0.0}},
    "VllmGuardianBreakerLatched": {SVC: {"policy.breaker_latched": 1.0}},
    "VllmGuardianMetricsSourceDown": {SVC: {"source_up.vllm_metrics": 0.0}},
    "VllmGuardianHealthSourceDown": {SVC: {"source_up.health": 0.0}},
    "VllmGuardianGpuSourceDown": {SVC: {"source_up.nvml": 0.0}},
    "VllmGuardianLogsSourceDown": {SVC: {"source_up.logs": 0.0}},
    "VllmGuardianUnitSourceDown": {SVC: {"source_up.unit": 0.0}},
}

TICK = 2.0


def run(
    rows: dict[al.SeriesKey, dict[str, float | None]], seconds: float
) -> dict[al.AlertKey, Alert]:
    alerts: dict[al.AlertKey, Alert] = {}
    t = 0.0
    while t <= seconds:
        alerts, _ = al.evaluate(RULES, alerts, rows, t)
        t += TICK
    return alerts


def with_changes(
    changes: dict[al.SeriesKey, dict[str, float | None]],
) -> dict[al.SeriesKey, dict[str, float | None]]:
    rows = healthy_values()
    for key, vals in changes.items():
        rows[key] = {**rows[key], **vals}
    return rows


def test_every_shipped_rule_has_a_trigger_row():
    assert set(TRIGGERS) == set(BY_NAME)


def test_healthy_row_raises_nothing_not_even_pending():
    assert run(healthy_values(), 3600) == {}


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_rule_fires_on_its_trigger_row_and_only_it(name):
    r = BY_NAME[name]
    alerts = run(with_changes(TRIGGERS[name]), r.for_seconds + TICK)
    fired = {k: a for k, a in alerts.items() if a.state is AlertState.FIRING}
    assert [k[0] for k in fired] == [name]
    (a,) = fired.values()
    assert a.cause == r.cause and a.severity == r.severity and not a.stale
    assert "{" not in a.summary and a.summary.startswith("vllm")
    # ... and not before for_seconds
    if r.for_seconds > 0:
        early = run(with_changes(TRIGGERS[name]), r.for_seconds - TICK)
        assert all(x.state is AlertState.PENDING for x in early.values())


def test_kv_high_but_below_the_watermark_does_not_fire():
    assert run(with_changes({SVC: {"kv_cache_usage_ratio": 0.899}}), 600) == {}
    assert BY_NAME["VllmKvCacheSaturated"].threshold == 0.90


def test_allocator_rules_are_silent_without_the_plugin():
    # The allocator signals exist now (no rule is optional), but a service without the
    # in-vLLM plugin has no allocator values: no alert, nothing stale.
    assert not [r.name for r in RULES if r.optional]
    for name in ("VllmAllocatorFragmented", "VllmAllocatorRetries"):
        assert ar.known_signal(BY_NAME[name].signal, "service")
        assert ar.known_signal(BY_NAME[name].signal, "gpu")
    rows = healthy_values()
    assert rows[SVC]["allocator_fragmentation_ratio"] is None
    assert run(rows, 900) == {}


def test_engine_down_alerts_go_stale_not_resolved_when_blind():
    rows = with_changes(TRIGGERS["VllmEngineDead"])
    alerts = run(rows, 120)
    key = ("VllmEngineDead", "vllm", ())
    assert alerts[key].state is AlertState.FIRING
    blind = with_changes({SVC: {"vllm_up": None}})
    alerts, ts = al.evaluate(RULES, alerts, blind, 130.0)
    assert alerts[key].state is AlertState.FIRING and alerts[key].stale and ts == ()


def test_no_rule_reads_prefix_cache_hit_rate_or_plain_memory_used():
    signals = {r.signal for r in RULES}
    assert "prefix_cache_hit_ratio" not in signals
    assert not any(r.cause is Cause.PREFIX_CACHE_WASTE for r in RULES)
    assert "service_memory_bytes" not in signals  # used memory alone means nothing for vLLM
    for r in RULES:
        assert r.runbook.startswith("#") and r.name.startswith("Vllm")


def test_load_rules_defaults_operator_file_and_off(tmp_path):
    f = tmp_path / "rules.yaml"
    f.write_text(
        """rules:
  - name: VllmKvCacheSaturated
    signal: kv_cache_usage_ratio
    op: ">="
    threshold: 0.95
    unit: ratio
    severity: critical
    summary: "{service}: {value}"
    runbook: "#kv-cache-saturated"
  - name: MyQueue
    signal: requests_waiting
    op: ">"
    threshold: 5
    unit: count
    severity: info
    summary: "{service}"
    runbook: "#my-queue"
"""
    )
    merged = load_rules(AlertingConfig(rules_file=str(f)))
    names = [r.name for r in merged]
    assert names[0] == "VllmKvCacheSaturated" and names[-1] == "MyQueue"
    assert len(merged) == len(RULES) + 1
    assert merged[0].threshold == 0.95
    only = load_rules(AlertingConfig(default_rules=False, rules_file=str(f)))
    assert [r.name for r in only] == ["VllmKvCacheSaturated", "MyQueue"]
    assert load_rules(AlertingConfig()) == RULES
    f.write_text("rules:\n  - name: bad\n")
    with pytest.raises(ConfigInvalid, match=r"rules.yaml:2: rules\[0\].name"):
        load_rules(AlertingConfig(rules_file=str(f)))
    with pytest.raises(ConfigInvalid, match="cannot read"):
        load_rules(AlertingConfig(rules_file=str(tmp_path / "missing.yaml")))


def test_over_capacity_says_by_how_much_and_how_many_replicas():
    alerts = run(with_changes(TRIGGERS["VllmOverCapacity"]), 300)
    (a,) = [a for a in alerts.values() if a.name == "VllmOverCapacity"]
    assert a.state is AlertState.FIRING
    assert "demand is 2.10x what it serves at saturation (> 1.20x); 2 replica(s) needed" in (
        a.summary
    ), a.summary
    # No estimate (not saturated, idle, restarted): nothing, not even pending.
    assert run(with_changes({SVC: {"capacity_demand_ratio": None}}), 600) == {}
