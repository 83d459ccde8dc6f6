"""The reference pages list what the code exports: every metric the guardian and the gate
export, every shipped alert rule (the guardian's own and the Prometheus rules) can be found by
grepping ``docs/metrics.md`` for its full name, with the labels the code gives it, and the
README points at it.

The guardian's families are rows of ``metric_catalogue.py``; ``exposition.py`` renders each by
name, and every name it renders must have a row (else a scrape fails at run time) and every row
a use (else the table lies). The gate registers all of its families when it starts, so its
names come from a live registry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from vllm_guardian.formats.metric_catalogue import CATALOGUE, MetricSpec
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.shell import exposition

ROOT = Path(__file__).resolve().parents[1]
METRICS_PAGE = ROOT / "docs" / "metrics.md"


def names_rendered_by_exposition() -> set[str]:
    """The catalogue names ``exposition.py`` renders: ``catalogue.gauge/counter("x")``,
    ``_Families.add("x", ...)`` and the ``*_GAUGES`` tables' first column."""
    tree = ast.parse(Path(exposition.__file__).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            if node.func.attr in {"gauge", "counter", "add"} and isinstance(first, ast.Constant):
                names.add(str(first.value))
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id.endswith("_GAUGES"):
            assert isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Tuple)
            for row in node.value.elts:
                assert isinstance(row, ast.Tuple) and isinstance(row.elts[0], ast.Constant)
                names.add(str(row.elts[0].value))
    return names


def guardian_metric_names() -> set[str]:
    return {m.full_name for m in CATALOGUE}


def test_exposition_renders_exactly_the_catalogue() -> None:
    rendered = names_rendered_by_exposition()
    table = {m.name for m in CATALOGUE}
    assert sorted(rendered - table) == [], "rendered without a row in metric_catalogue.py"
    assert sorted(table - rendered) == [], "rows of metric_catalogue.py nothing renders"
    assert len(CATALOGUE) == len(table), "a name with two rows"


def _page_rows() -> dict[str, str]:
    """Each full metric name on the page → its row's labels cell."""
    rows: dict[str, str] = {}
    for line in METRICS_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_:]+)`", cells[0]):
                rows.setdefault(name, cells[1])
    return rows


@pytest.mark.parametrize("m", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_the_page_gives_each_guardian_metric_its_labels(m: MetricSpec) -> None:
    rows = _page_rows()
    assert m.full_name in rows, f"`{m.full_name}` has no row in docs/metrics.md's table"
    missing = [label for label in m.labels if not re.search(rf"\b{label}\b", rows[m.full_name])]
    assert missing == [], f"{m.full_name}: labels {missing} not in its row: {rows[m.full_name]!r}"


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
    rendered = names_rendered_by_exposition()
    assert {
        "kv_cache_usage_ratio",  # a *_GAUGES table
        "allocator_fragmentation_ratio",  # the allocator's table
        "vllm_health",  # an _Families.add call
        "ticks",  # a counter family
        "alert_inhibited",  # a gauge family
    } <= rendered
    assert len(rendered) > 60, sorted(rendered)
    assert len(_page_rows()) > 60
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
