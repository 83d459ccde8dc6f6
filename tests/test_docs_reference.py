"""The reference pages list what the code exports: every metric the guardian and the gate
export, every shipped alert rule (the guardian's own and the Prometheus rules) can be found by
grepping ``docs/metrics.md`` for its full name, and the README points at it.

The guardian's families depend on what was observed, so its names are read from the source of
``exposition.py`` (the family constructors, ``_Families.add`` calls and the ``*_GAUGES``
tables); the gate registers all of its families when it starts, so its names come from a live
registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from vllm_guardian import exposition
from vllm_guardian.gate.metrics import GateMetrics

ROOT = Path(__file__).resolve().parents[1]
METRICS_PAGE = ROOT / "docs" / "metrics.md"
COUNTERS = {"CounterMetricFamily", "Counter"}


def _literal_name(node: ast.expr, ns: str) -> str | None:
    """``f"{NS}_name"`` or ``"name"`` as the full metric name, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (
        isinstance(node, ast.JoinedStr)
        and len(node.values) == 2
        and isinstance(node.values[1], ast.Constant)
        and isinstance(node.values[1].value, str)
    ):
        return ns + node.values[1].value
    return None


def guardian_metric_names() -> set[str]:
    tree = ast.parse(Path(exposition.__file__).read_text())
    ns = exposition.NS
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in {"GaugeMetricFamily", *COUNTERS}:
                name = _literal_name(node.args[0], ns)
                if name is not None:
                    names.add(name + ("_total" if called in COUNTERS else ""))
            elif called == "add" and len(node.args) >= 2:
                first, doc = node.args[0], node.args[1]
                if isinstance(first, ast.Constant) and isinstance(doc, ast.Constant):
                    names.add(f"{ns}_{first.value}")
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id.endswith("_GAUGES"):
            assert isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Tuple)
            for row in node.value.elts:
                assert isinstance(row, ast.Tuple) and isinstance(row.elts[0], ast.Constant)
                names.add(f"{ns}_{row.elts[0].value}")
    return names


def gate_metric_names() -> set[str]:
    registry = GateMetrics("vllm").registry
    names = set()
    for family in registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def guardian_rule_names() -> set[str]:
    doc = yaml.safe_load((ROOT / "vllm_guardian" / "defaults" / "rules.yaml").read_text())
    return {rule["name"] for rule in doc["rules"]}


def prometheus_alert_names() -> set[str]:
    doc = yaml.safe_load((ROOT / "alerts" / "vllm-guardian.rules.yml").read_text())
    return {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_the_extraction_finds_what_is_known_to_be_exported() -> None:
    """Guards the readers above: a refactor of exposition.py that hid names from them would
    otherwise make the page check pass on nothing."""
    guardian = guardian_metric_names()
    assert {
        "vllm_guardian_kv_cache_usage_ratio",  # a *_GAUGES table
        "vllm_guardian_allocator_fragmentation_ratio",  # the allocator's table
        "vllm_guardian_vllm_health",  # an _Families.add call
        "vllm_guardian_ticks_total",  # a counter family
        "vllm_guardian_alert_inhibited",  # a gauge family
    } <= guardian
    assert len(guardian) > 60, sorted(guardian)
    assert {"vllm_guardian_gate_open", "vllm_guardian_gate_rejected_total"} <= gate_metric_names()
    assert len(guardian_rule_names()) > 20 and len(prometheus_alert_names()) > 20


@pytest.mark.parametrize(
    ("what", "names"),
    [
        ("guardian metric", guardian_metric_names),
        ("gate metric", gate_metric_names),
        ("guardian alert rule", guardian_rule_names),
        ("Prometheus alert rule", prometheus_alert_names),
    ],
)
def test_every_exported_name_is_on_the_reference_page(what: str, names: object) -> None:
    assert callable(names)
    page = METRICS_PAGE.read_text()
    missing = sorted(n for n in names() if f"`{n}`" not in page)
    assert missing == [], f"{what}s not in docs/metrics.md as `full_name`: {missing}"


def test_the_readme_points_at_every_reference_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/metrics.md", "docs/benchmarks.md", "docs/testing.md", "docs/healing.md",
                 "docs/reliability.md"):  # fmt: skip
        assert page in readme, page
        assert (ROOT / page).is_file(), page  # it named docs/reliability.md before there was one
