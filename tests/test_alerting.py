"""core/alerting and core/alert_rules: rule evaluation in series notation, signal values,
rule-file errors."""

from __future__ import annotations

import pytest

from vllm_guardian.config import ConfigInvalid
from vllm_guardian.core import alert_rules as ar
from vllm_guardian.core import alerting as al
from vllm_guardian.core.signals import ServiceGpuSignals, ServiceSignals, Signals
from vllm_guardian.model import (
    Alert,
    AlertState,
    Cause,
    GpuReading,
    HealthState,
    LogEventKind,
    Severity,
    Snapshot,
    SourceKind,
    SourceStatus,
)

GIB = 1024**3
ABSENT = "absent"  # the service is not in the values at all


def rule(**kw: object) -> ar.Rule:
    base: dict[str, object] = {
        "name": "KvHigh",
        "signal": "kv_cache_usage_ratio",
        "op": ">=",
        "threshold": 0.9,
        "unit": "ratio",
        "for_seconds": 10.0,
        "keep_firing_for_seconds": 0.0,
        "severity": Severity.WARNING,
        "cause": Cause.CONCURRENCY_OVERCOMMIT,
        "summary": "{service}: KV {value} >= {threshold}",
        "runbook": "#kv",
    }
    base.update(kw)
    return ar.Rule(**base)  # type: ignore[arg-type]


def state_of(alerts: dict[al.AlertKey, Alert], name: str = "KvHigh") -> str | None:
    """'pending', 'firing', 'firing*' (stale) or None (inactive)."""
    a = alerts.get((name, "vllm", ()))
    if a is None:
        return None
    return a.state.value + ("*" if a.stale else "")


# One row per tick: (time, value or None or ABSENT, expected state after evaluating).
SERIES = [
    (
        "for: pending until it has held for_seconds, then firing; false resolves at once",
        rule(),
        [(0, 0.95, "pending"), (4, 0.95, "pending"), (10, 0.95, "firing"), (12, 0.5, None)],
    ),
    (
        "for 0 fires at the first true evaluation",
        rule(for_seconds=0.0),
        [(0, 0.5, None), (2, 0.9, "firing"), (4, 0.89, None)],
    ),
    (
        "pending that turns false before for_seconds is dropped, and starts over",
        rule(),
        [(0, 0.95, "pending"), (8, 0.5, None), (10, 0.95, "pending"), (18, 0.95, "pending"),
         (20, 0.95, "firing")],
    ),
    (
        "keep_firing_for: stays firing while false for less than it, true again restarts it",
        rule(for_seconds=0.0, keep_firing_for_seconds=10.0),
        [(0, 0.95, "firing"), (2, 0.5, "firing"), (8, 0.5, "firing"), (10, 0.95, "firing"),
         (18, 0.5, "firing"), (20, 0.5, None)],
    ),
    (
        "missing data holds firing (stale) and never resolves, however long",
        rule(for_seconds=0.0),
        [(0, 0.95, "firing"), (2, None, "firing*"), (600, None, "firing*"),
         (3600, ABSENT, "firing*"), (3602, 0.95, "firing"), (3604, 0.1, None)],
    ),
    (
        "pending with no data stays pending past for_seconds; fires when seen true again",
        rule(),
        [(0, 0.95, "pending"), (2, None, "pending*"), (30, ABSENT, "pending*"),
         (32, 0.95, "firing")],
    ),
    (
        "pending with no data, then seen false: dropped",
        rule(),
        [(0, 0.95, "pending"), (20, None, "pending*"), (22, 0.3, None)],
    ),
    (
        "no data never starts an alert",
        rule(for_seconds=0.0),
        [(0, None, None), (2, ABSENT, None), (4, 0.5, None)],
    ),
    (
        "a firing alert seen false after a blind gap longer than keep_firing_for resolves",
        rule(for_seconds=0.0, keep_firing_for_seconds=30.0),
        [(0, 0.95, "firing"), (2, None, "firing*"), (100, 0.2, None)],
    ),
    (
        "operators: < with a bytes threshold",
        rule(signal="headroom_bytes", op="<", threshold=float(GIB), unit="bytes",
             for_seconds=4.0),
        [(0, 2.0 * GIB, None), (2, 0.5 * GIB, "pending"), (6, 0.5 * GIB, "firing"),
         (8, float(GIB), None)],
    ),
    (
        "operators: == on a bool",
        rule(signal="stalled", op="==", threshold=1.0, unit="bool", for_seconds=0.0),
        [(0, 0.0, None), (2, 1.0, "firing"), (4, 0.0, None)],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "r", "rows"), SERIES, ids=[s[0] for s in SERIES])
def test_series(name, r, rows):
    alerts: dict[al.AlertKey, Alert] = {}
    for t, v, expected in rows:
        values = {} if v == ABSENT else {("vllm", ()): {r.signal: v}}
        alerts, _ = al.evaluate([r], alerts, values, float(t))
        assert state_of(alerts) == expected, f"t={t} value={v}"


def test_transitions_name_each_change_once():
    r = rule()
    seen = []
    alerts: dict[al.AlertKey, Alert] = {}
    for t, v in [(0, 0.95), (2, 0.95), (10, 0.95), (12, None), (14, 0.95), (16, 0.1)]:
        alerts, ts = al.evaluate([r], alerts, {("vllm", ()): {r.signal: v}}, float(t))
        seen += [(t, x.previous.value, x.current.value, x.resolved) for x in ts]
    assert seen == [
        (0, "inactive", "pending", False),
        (10, "pending", "firing", False),
        (16, "firing", "inactive", True),
    ]


def test_firing_alert_carries_times_value_summary_and_rule_identity():
    r = rule(for_seconds=4.0)
    alerts: dict[al.AlertKey, Alert] = {}
    for t, v in [(100, 0.92), (104, 0.955)]:
        alerts, _ = al.evaluate([r], alerts, {("vllm", ()): {r.signal: v}}, float(t))
    a = alerts[("KvHigh", "vllm", ())]
    assert (a.state, a.active_since_seconds, a.firing_since_seconds, a.last_true_seconds) == (
        AlertState.FIRING, 100.0, 104.0, 104.0,
    )  # fmt: skip
    assert (a.severity, a.cause, a.runbook, a.value) == (
        Severity.WARNING, Cause.CONCURRENCY_OVERCOMMIT, "#kv", 0.955,
    )  # fmt: skip
    assert a.summary == "vllm: KV 95.5% >= 90.0%"
    stale, _ = al.evaluate([r], alerts, {("vllm", ()): {r.signal: None}}, 106.0)
    assert stale[a.key].value == 0.955  # the last value seen, not None
    assert stale[a.key].stale


def test_multiple_services_and_gpus_are_separate_alerts():
    r = rule(
        name="Neighbour",
        signal="other_processes_memory_bytes",
        op=">",
        threshold=0.0,
        unit="bytes",
        for_seconds=0.0,
        scope="gpu",
        summary="{service}: {value} on GPU {gpu}",
    )
    g0, g1 = (("gpu", "0"),), (("gpu", "1"),)
    values = {
        ("a", ()): {},
        ("a", g0): {"other_processes_memory_bytes": 0.0},
        ("a", g1): {"other_processes_memory_bytes": 2.0 * GIB},
        ("b", (("gpu", "2"),)): {"other_processes_memory_bytes": 1.0 * GIB},
    }
    alerts, ts = al.evaluate([r], {}, values, 0.0)
    assert sorted(alerts) == [("Neighbour", "a", g1), ("Neighbour", "b", (("gpu", "2"),))]
    assert alerts[("Neighbour", "a", g1)].summary == "a: 2.00 GiB on GPU 1"
    assert len(ts) == 2
    # GPU 1's row disappears (NVML down): held, stale; service b resolves on its own.
    values2 = {("a", ()): {}, ("b", (("gpu", "2"),)): {"other_processes_memory_bytes": 0.0}}
    alerts2, ts2 = al.evaluate([r], alerts, values2, 2.0)
    assert list(alerts2) == [("Neighbour", "a", g1)] and alerts2[("Neighbour", "a", g1)].stale
    assert [(t.alert.service, t.resolved) for t in ts2] == [("b", True)]


def test_service_scope_rule_ignores_gpu_rows():
    r = rule(signal="headroom_bytes", op="<", threshold=1.0 * GIB, unit="bytes", for_seconds=0)
    values = {("a", (("gpu", "0"),)): {"headroom_bytes": 0.0}, ("a", ()): {"headroom_bytes": 9e9}}
    alerts, _ = al.evaluate([r], {}, values, 0.0)
    assert alerts == {}


def test_optional_rule_on_a_signal_nobody_produces_is_absent_not_stale():
    r = rule(name="Frag", signal="allocator_fragmentation_ratio", optional=True, for_seconds=0)
    held = Alert("Frag", "vllm", (), AlertState.FIRING, Severity.WARNING, None, 0.5, 0, 0, 0)
    alerts, ts = al.evaluate([r], {held.key: held}, {("vllm", ()): {"kv": 0.1}}, 10.0)
    assert alerts == {held.key: held} and ts == ()
    alerts, _ = al.evaluate([r], {}, {("vllm", ()): {"kv": 0.1}}, 10.0)
    assert alerts == {}
    # Once the plugin publishes it, it is an ordinary rule.
    alerts, _ = al.evaluate([r], {}, {("vllm", ()): {"allocator_fragmentation_ratio": 0.95}}, 0)
    assert state_of(alerts, "Frag") == "firing"


def test_alerts_of_a_removed_rule_are_resolved():
    r = rule(for_seconds=0.0)
    alerts, _ = al.evaluate([r], {}, {("vllm", ()): {r.signal: 0.99}}, 0.0)
    alerts, ts = al.evaluate([], alerts, {("vllm", ()): {r.signal: 0.99}}, 2.0)
    assert alerts == {}
    assert [(t.alert.name, t.previous, t.resolved) for t in ts] == [
        ("KvHigh", AlertState.FIRING, True)
    ]


def test_firing_and_sort_are_stable_and_filter_pending():
    def mk(name: str, svc: str, state: AlertState) -> Alert:
        return Alert(name, svc, (), state, Severity.INFO, None, 1.0, 0, None, 0)

    xs = [mk("B", "b", AlertState.FIRING), mk("A", "z", AlertState.PENDING),
          mk("A", "b", AlertState.FIRING), mk("A", "a", AlertState.FIRING)]  # fmt: skip
    assert [(a.name, a.service) for a in al.firing(xs)] == [("A", "a"), ("A", "b"), ("B", "b")]
    assert [a.name for a in al.sort_alerts(xs)] == ["A", "A", "A", "B"]
    assert al.firing({a.key: a for a in xs}) == al.firing(xs)


FORMATS = [
    (0.9234, "ratio", "92.3%"),
    (1.5 * GIB, "bytes", "1.50 GiB"),
    (95.4, "seconds", "95s"),
    (2.5, "per_second", "2.50/s"),
    (3.0, "count", "3"),
    (1.0, "bool", "true"),
    (None, "count", "n/a"),
]


@pytest.mark.parametrize(("value", "unit", "text"), FORMATS)
def test_format_value(value, unit, text):
    assert al.format_value(value, unit) == text


# --- signal_values ---------------------------------------------------------------------------


def _signals(**kw: object) -> ServiceSignals:
    base: dict[str, object] = {
        "service": "vllm",
        "health_state": HealthState.UP,
        "vllm_up": True,
        "metrics_up": True,
        "stats_enabled": True,
    }
    base.update(kw)
    return ServiceSignals(**base)  # type: ignore[arg-type]


def _status(kind: SourceKind, service: str | None, up: bool) -> SourceStatus:
    return SourceStatus(kind, service, up, 0.01)


def test_signal_values_flattens_fields_sources_logs_xids_and_policy():
    s = _signals(
        kv_cache_usage_ratio=0.5,
        stalled=False,
        requests_waiting=None,
        recent_log_events=((LogEventKind.CUDA_OOM, 2),),
        recent_xid_events=((0, 48, 1), (0, 13, 5), (1, 79, 2)),
        gpus=(
            ServiceGpuSignals(0, 70 * GIB, GIB, 72 * GIB, 4 * GIB, 80 * GIB),
            ServiceGpuSignals(1, 75 * GIB, 0, 72 * GIB, None, 80 * GIB),
        ),
    )
    other = _signals(service="other")
    snap = Snapshot(
        1.0,
        (),
        GpuReading(()),
        (
            _status(SourceKind.VLLM_METRICS, "vllm", True),
            _status(SourceKind.LOGS, "vllm", True),
            _status(SourceKind.VLLM_METRICS, "other", False),
            _status(SourceKind.LOGS, "other", False),
            _status(SourceKind.NVML, None, True),
        ),
    )
    extra = {("vllm", "policy.breaker_latched"): 1.0, ("vllm", "restart_budget_remaining"): 2.0}
    v = al.signal_values(Signals(1.0, (s, other)), snap, extra)
    mine = v[("vllm", ())]
    assert mine["kv_cache_usage_ratio"] == 0.5
    assert mine["stalled"] == 0.0 and mine["vllm_up"] == 1.0
    assert mine["requests_waiting"] is None
    assert mine["source_up.vllm_metrics"] == 1.0
    assert mine["source_up.nvml"] == 1.0  # host-wide counts for every service
    assert mine["source_up.unit"] is None  # not collected at all
    assert mine["log_events.cuda_oom"] == 2.0 and mine["log_events.engine_dead"] == 0.0
    assert mine["xid_reset_class"] == 3.0  # 48 and 79, not 13
    assert mine["policy.breaker_latched"] == 1.0
    assert mine["policy.restart_budget_remaining"] == 2.0
    theirs = v[("other", ())]
    assert theirs["source_up.vllm_metrics"] == 0.0 and theirs["source_up.nvml"] == 1.0
    assert theirs["log_events.cuda_oom"] is None  # logs down: unknown, not zero
    assert "policy.breaker_latched" not in theirs
    g0, g1 = v[("vllm", (("gpu", "0"),))], v[("vllm", (("gpu", "1"),))]
    assert g0["memory_over_budget_bytes"] == 0.0 and g1["memory_over_budget_bytes"] == 3 * GIB
    assert g0["other_processes_memory_bytes"] == GIB and g1["headroom_bytes"] is None
    assert (g0["xid_reset_class"], g1["xid_reset_class"]) == (1.0, 2.0)


def test_signal_values_without_gpu_reading_has_no_xid_count():
    v = al.signal_values(Signals(1.0, (_signals(),)), Snapshot(1.0, (), None))
    assert v[("vllm", ())]["xid_reset_class"] is None
    assert v[("vllm", ())]["log_events.cuda_oom"] is None  # no logs source
    assert list(v) == [("vllm", ())]


# --- the rules file --------------------------------------------------------------------------

GOOD = """\
rules:
  - name: KvHigh
    signal: kv_cache_usage_ratio
    op: ">="
    threshold: 0.9
    unit: ratio
    for_seconds: 60
    severity: warning
    cause: concurrency_overcommit
    summary: "{service}: {value}"
    runbook: "#kv"
  - name: Neighbour
    signal: other_processes_memory_bytes
    scope: gpu
    op: ">"
    threshold_bytes: 256MiB
    unit: bytes
    severity: critical
    summary: "{service} GPU {gpu}: {value}"
    runbook: "#neighbour"
"""


def test_parse_rules_reads_every_field():
    kv, nb = ar.parse_rules(GOOD, "r.yaml")
    assert kv == rule(
        for_seconds=60.0, summary="{service}: {value}", runbook="#kv", keep_firing_for_seconds=0.0
    )
    assert (nb.threshold, nb.scope, nb.cause, nb.severity) == (
        256.0 * 1024 * 1024, "gpu", None, Severity.CRITICAL,
    )  # fmt: skip


def _rule_yaml(**over: str | None) -> str:
    fields = {
        "name": "KvHigh",
        "signal": "kv_cache_usage_ratio",
        "op": '">="',
        "threshold": "0.9",
        "unit": "ratio",
        "severity": "warning",
        "summary": '"{service}"',
        "runbook": '"#kv"',
    }
    fields.update(over)
    lines = ["rules:"]
    for i, (k, v) in enumerate((k, v) for k, v in fields.items() if v is not None):
        lines.append(f"  {'- ' if i == 0 else '  '}{k}: {v}")
    return "\n".join(lines) + "\n"


# (yaml, [(line, path, words in the message)])  — line 2 is the rule's first key.
ERRORS = [
    ("unknown signal", _rule_yaml(signal="kv_usage"), [(3, "rules[0].signal", "unknown signal")]),
    ("bad op and unit", _rule_yaml(op='"=>"', unit="percent"),
     [(4, "rules[0].op", "must be one of"), (6, "rules[0].unit", "must be one of")]),
    ("ratio above 1", _rule_yaml(threshold="90"), [(5, "rules[0].threshold", "between 0 and 1")]),
    ("unit does not match the signal", _rule_yaml(unit="count"),
     [(6, "rules[0].unit", "is in ratio")]),
    ("name not CamelCase", _rule_yaml(name="kv_high"), [(2, "rules[0].name", "CamelCase")]),
    ("bad severity and cause", _rule_yaml(severity="page", cause="oom"),
     [(7, "rules[0].severity", "must be one of"), (10, "rules[0].cause", "must be one of")]),
    ("unknown placeholder", _rule_yaml(summary='"{svc}"'), [(8, "rules[0].summary", "svc")]),
    ("gpu placeholder needs gpu scope", _rule_yaml(summary='"{gpu}"'),
     [(8, "rules[0].summary", "scope: gpu")]),
    ("runbook not an anchor", _rule_yaml(runbook="docs/x.md"), [(9, "rules[0].runbook", "anchor")]),
    ("no threshold", _rule_yaml(threshold=None), [(2, "rules[0].threshold", "exactly one")]),
    ("threshold_bytes on a ratio", _rule_yaml(threshold=None, threshold_bytes="1GiB"),
     [(9, "rules[0].threshold_bytes", "only for unit bytes")]),
    ("negative for", _rule_yaml(for_seconds="-1"), [(10, "rules[0].for_seconds", ">= 0")]),
    ("unknown key", _rule_yaml(fore_seconds="10"), [(10, "rules[0].fore_seconds", "unknown key")]),
    ("missing keys", "rules:\n  - name: KvHigh\n",
     [(2, "rules[0].op", "required"), (2, "rules[0].runbook", "required"),
      (2, "rules[0].severity", "required"), (2, "rules[0].signal", "required"),
      (2, "rules[0].summary", "required"), (2, "rules[0].unit", "required")]),
    ("bool compared with >", _rule_yaml(signal="stalled", unit="bool", threshold="0", op='">"'),
     [(4, "rules[0].op", "== or !=")]),
    ("not YAML", "rules: [\n", [(2, "", "not valid YAML")]),
    ("rules not a list", "rules: 3\n", [(1, "rules", "expected a list")]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "expected"), ERRORS, ids=[e[0] for e in ERRORS])
def test_rule_file_errors_have_path_and_line(name, text, expected):
    with pytest.raises(ConfigInvalid) as exc:
        ar.parse_rules(text, "rules.yaml")
    got = [(e.line, e.path, e.message) for e in exc.value.errors]
    assert len(got) == len(expected), got
    for (line, path, msg), (want_line, want_path, words) in zip(got, expected, strict=True):
        assert (line, path) == (want_line, want_path), got
        assert words in msg, msg
    assert str(exc.value).startswith("rules.yaml:")


def test_all_errors_of_all_rules_at_once_and_duplicates():
    text = GOOD + GOOD.replace("rules:\n", "").replace("kv_cache_usage_ratio", "nope")
    with pytest.raises(ConfigInvalid) as exc:
        ar.parse_rules(text, "r.yaml")
    got = [(e.line, e.path, e.message.split(" (")[0]) for e in exc.value.errors]
    assert got == [
        (21, "rules[2].name", "duplicate rule name 'KvHigh'"),
        (22, "rules[2].signal", "unknown signal 'nope'"),
        (31, "rules[3].name", "duplicate rule name 'Neighbour'"),
    ]


def test_optional_rule_may_name_an_unknown_signal_but_not_a_wrong_unit():
    ok = _rule_yaml(signal="allocator_fragmentation_ratio", optional="true")
    (r,) = ar.parse_rules(ok, "r.yaml")
    assert r.optional
    with pytest.raises(ConfigInvalid, match="is in ratio"):
        ar.parse_rules(_rule_yaml(unit="count", optional="true"), "r.yaml")


def test_policy_signals_are_open_but_must_look_like_names():
    (r,) = ar.parse_rules(_rule_yaml(signal="policy.breaker_latched", unit="bool",
                                     op='"=="', threshold="1"), "r")  # fmt: skip
    assert r.signal == "policy.breaker_latched"
    with pytest.raises(ConfigInvalid, match="unknown signal"):
        ar.parse_rules(_rule_yaml(signal="policy.Bad-Name"), "r")


def test_empty_file_has_no_rules_and_merge_replaces_by_name():
    assert ar.parse_rules("", "r") == ()
    a, b = rule(name="Aaa"), rule(name="Bbb")
    b2, c = rule(name="Bbb", threshold=0.5), rule(name="Ccc")
    assert ar.merge_rules([a, b], [c, b2]) == (a, b2, c)
