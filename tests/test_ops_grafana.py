"""The shipped Grafana dashboard: schema from ``@grafana/schema``, PromQL through promtool, names.

The JSON schema is generated from the npm package's TypeScript types with
ts-json-schema-generator, installed into /var/cache/vllm-guardian-ci/npm the
first time (about 6 s) and reused after. Panels are validated against ``Panel`` or ``RowPanel``
by their type, which gives readable errors where the schema's ``anyOf`` would not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import hostneeds
from tests.test_ops_alerts import known_metrics, metric_names

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "vllm-guardian.json"
CACHE = Path(os.environ.get("VLLM_GUARDIAN_CI_CACHE", "/var/cache/vllm-guardian-ci")) / "npm"
NPM_PACKAGES = ["@grafana/schema@13.2.3", "ts-json-schema-generator@2.9.0"]
TYPES = "node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts"


def require(name: str) -> str:
    return hostneeds.tool(
        name,
        "it builds the dashboard's schema from @grafana/schema "
        "(apt-get install npm; scripts/test installs it)",
    )


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def schema() -> dict[str, Any]:
    out = CACHE / "dashboard.schema.json"
    if not out.exists():
        npm, npx = require("npm"), require("npx")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--silent", *NPM_PACKAGES],
            cwd=CACHE,
            check=True,
            timeout=300,
            capture_output=True,
        )
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [npx, "--no-install", "ts-json-schema-generator", "--path", TYPES, "--type",
             "Dashboard", "--no-type-check", "--additional-properties", "-o", str(tmp)],
            cwd=CACHE, check=True, timeout=300, capture_output=True,
        )  # fmt: skip
        tmp.rename(out)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def schema_errors(dash: dict[str, Any]) -> list[str]:
    jsonschema = (
        pytest.importorskip(
            "jsonschema", reason="jsonschema not installed (scripts/test installs it)"
        )
        if not hostneeds.required()
        else __import__("jsonschema")
    )
    s = schema()
    defs = s["definitions"]
    top = {**defs["Dashboard"], "definitions": defs}
    top["properties"] = {k: v for k, v in top["properties"].items() if k != "panels"}
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}"
        for e in jsonschema.Draft7Validator(top).iter_errors(dash)
    ]
    for i, p in enumerate(dash.get("panels", [])):
        kind = "RowPanel" if p.get("type") == "row" else "Panel"
        v = jsonschema.Draft7Validator({"$ref": f"#/definitions/{kind}", "definitions": defs})
        errors += [
            f"panels[{i}]/{'/'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(p)
        ]
    return errors


def exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    found = [
        (f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])
    ]
    found += [
        (f"annotation {a['name']!r}", a["expr"]) for a in dash["annotations"]["list"] if "expr" in a
    ]
    return found


def as_promql(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = expr.replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def test_dashboard_validates_against_grafana_schema():
    assert schema_errors(dashboard()) == []


def test_schema_check_can_fail():
    bad = dashboard()
    bad["panels"][1]["gridPos"]["w"] = "wide"
    bad["schemaVersion"] = "x"
    errors = schema_errors(bad)
    assert any("'wide' is not of type 'number'" in e for e in errors), errors
    assert any("'x' is not of type 'number'" in e for e in errors), errors


def test_every_expression_passes_promtool_as_a_recording_rule(tmp_path):
    promtool = require("promtool")
    all_exprs = exprs(dashboard())
    rules = "groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:expr{i}\n        expr: {json.dumps(as_promql(e))}\n"
        for i, (_, e) in enumerate(all_exprs)
    )
    (tmp_path / "dash.rules.yml").write_text(rules)
    proc = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "dash.rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(all_exprs)} rules found" in proc.stdout


def test_every_metric_referenced_exists():
    known = known_metrics()
    dash = dashboard()
    queries = [(w, as_promql(e)) for w, e in exprs(dash)]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", v["query"]["query"])
            assert m, v["query"]
            queries.append((f"variable {v['name']}", m.group(1)))
    for where, q in queries:
        unknown = metric_names(q) - known
        assert unknown == set(), f"{where}: {unknown}"


def test_structure():
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"service", "model", "gpu"} <= set(variables)
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Overview", "KV pool and queue", "GPU memory", "Latency and throughput", "Admission gate",
        "Capacity", "Fleet",
    ]  # fmt: skip
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["fieldConfig"]["defaults"]["thresholds"]["steps"], p["title"]
        assert p["description"], p["title"]
    titles = {p["title"] for p in panels}
    for needed in ("Policy rung", "Gate", "Breaker", "Firing alerts", "GPU memory by owner",
                   "Allocator fragmentation", "Latency quantiles", "Throughput", "Preemptions",
                   "Gate queue", "Gate decisions", "Gate queue wait", "Gate overhead",
                   "Gate cut streams", "Gate CPU per process",
                   "Capacity: demand vs served"):  # fmt: skip
        assert needed in titles
    annotations = {a["name"]: a for a in dash["annotations"]["list"]}
    assert "vllm_guardian_actions_total" in annotations["Guardian actions"]["expr"]
    # GPU memory by owner: stacked, the budget unstacked as a line.
    mem = next(p for p in panels if p["title"] == "GPU memory by owner")
    assert mem["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    budget = mem["fieldConfig"]["overrides"][0]
    assert budget["matcher"]["options"] == "D"
    assert "memory_budget_bytes" in mem["targets"][3]["expr"]
    # Panels over vLLM's own metrics work on V0 and V1 names alike.
    for _, e in exprs(dash):
        if "kv_cache_usage_perc" in e:
            assert "gpu_cache_usage_perc" in e


def grafana_import(dash: dict[str, Any], inputs: dict[str, str]) -> dict[str, Any]:
    """What Grafana's "Import dashboard" does with the JSON: asks a value for each ``__inputs``
    entry, puts it in place of every ``${NAME}`` of an input, and drops ``__inputs``."""
    text = json.dumps({k: v for k, v in dash.items() if k != "__inputs"})
    for name, value in inputs.items():
        text = text.replace("${" + name + "}", value)
    data: dict[str, Any] = json.loads(text)
    return data


def test_grafanas_import_asks_for_the_prometheus_data_source():
    dash = dashboard()
    inputs = dash.get("__inputs", [])
    assert [(i["name"], i["type"], i["pluginId"]) for i in inputs] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ], inputs
    assert {"type": "datasource", "id": "prometheus"}.items() <= next(
        r for r in dash["__requires"] if r["type"] == "datasource"
    ).items()
    imported = grafana_import(dash, {"DS_PROMETHEUS": "prom-uid-42"})
    variable = next(v for v in imported["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == "prom-uid-42", variable
    # Every reference left is a dashboard variable or one of Grafana's own: none is unresolved.
    names = {v["name"] for v in imported["templating"]["list"]}
    left = set(re.findall(r"\$\{(\w+)", json.dumps(imported)))
    assert left <= names | {"__interval", "__rate_interval", "__range"}, left - names


def test_provisioned_without_import_the_panels_still_follow_the_variable():
    """The Helm chart's ConfigMap goes to Grafana's sidecar, which does not import: nothing but the
    variable's default names the input, and Grafana replaces a default it cannot find."""
    text = DASHBOARD.read_text()
    dash = dashboard()
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    without = json.dumps({**dash, "__inputs": [], "templating": {"list": []}})
    assert "${DS_PROMETHEUS}" in json.dumps(variable["current"])
    assert "${DS_PROMETHEUS}" not in without, "only the variable's default may name the input"
    assert text.count("${datasource}") >= len([p for p in dash["panels"] if p["type"] != "row"])
