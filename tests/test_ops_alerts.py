"""The shipped Prometheus rules: promtool, unit tests, annotations, runbook, thresholds, live chain.

The live test runs a real guardian (fed by a loopback server replaying a vLLM capture under KV
pressure), a real Prometheus scraping it with the shipped rules (``for:`` shortened to 0s in a
temporary copy, expressions unchanged) and a real Alertmanager, all on 127.0.0.1 in temporary
directories; every process is stopped by the test.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests import hostneeds
from tests.conftest import read_fixture
from tests.httpfixture import Script, serve
from tests.support import wait_for
from vllm_guardian.config import PolicyConfig, SignalsConfig
from vllm_guardian.gate.metrics import GateMetrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "vllm-guardian.rules.yml"
TESTS = sorted((ROOT / "alerts" / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
DEFAULT_RULES = ROOT / "vllm_guardian" / "defaults" / "rules.yaml"
GOLDEN = ROOT / "tests" / "golden" / "exposition.prom"
# Guardian series the golden file does not hold yet.
PENDING_METRICS = {
    "vllm_guardian_alert",
    "vllm_guardian_breaker_latched",
    "vllm_guardian_policy_rung",
    "vllm_guardian_actions_total",
    "vllm_guardian_restart_budget_remaining",
    "vllm_guardian_paused",
    "vllm_guardian_action_in_flight",
    # The guardian's own restart (tests/test_exposition.py renders them).
    "vllm_guardian_alert_inhibited",
    "vllm_guardian_action_in_progress",
    "vllm_guardian_vllm_down_expected",
}
# Present only while the service is saturated and its capacity measurable, so absent from the
# golden file; tests/test_exposition.py::test_capacity_series renders them.
CONDITIONAL_METRICS = {
    "vllm_guardian_capacity_demand_ratio",
    "vllm_guardian_capacity_replicas_needed",
}

# Present only while an exhaustion forecast stands (tests/test_exposition.py renders them).
FORECAST_METRICS = {
    "vllm_guardian_headroom_exhaustion_seconds",
    "vllm_guardian_headroom_exhaustion_latest_seconds",
    "vllm_guardian_headroom_exhaustion_cause",
    "vllm_guardian_headroom_exhaustion_neighbour_info",
}


def tool(name: str) -> str:
    return hostneeds.tool(
        name,
        "the rules and alerts are checked by the real tool "
        "(apt-get install prometheus prometheus-alertmanager; scripts/test installs them)",
    )


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


def known_metrics() -> set[str]:
    names = {
        line.split("{")[0].split(" ")[0]
        for line in GOLDEN.read_text().splitlines()
        if line and not line.startswith("#")
    }
    for f in (ROOT / "tests" / "fixtures" / "vllm").glob("*.prom"):
        for line in f.read_text().splitlines():
            if line and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                names.add(name)
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    # build_info is rendered by exposition._build_info but left out of the golden file.
    return (
        names
        | PENDING_METRICS
        | CONDITIONAL_METRICS
        | FORECAST_METRICS
        | gate_metrics()
        | {"up", "vllm_guardian_build_info"}
    )


def gate_metrics() -> set[str]:
    """The admission gate's series, from its own registry (prometheus_client only: no aiohttp)."""
    names = set()
    for line in GateMetrics("x").render().decode().splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            names.add(name)
            names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


PROMQL_WORDS = {
    "and", "or", "unless", "on", "by", "without", "ignoring", "group_left", "group_right",
    "bool", "offset", "max", "min", "sum", "avg", "count", "rate", "increase", "deriv",
    "predict_linear", "label_replace", "time", "histogram_quantile", "max_over_time",
    "min_over_time", "avg_over_time", "le", "instance", "job", "model_name", "service", "host",
    "gpu", "xid", "source", "action", "dry_run", "engine", "irate", "clamp_min", "topk",
    "sort_desc", "absent", "vector", "scalar", "changes", "resets", "quantile", "lever",
    "severity", "result", "alertstate", "reason", "cause", "model", "kind", "pod", "alertname",
    "outcome",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values and regexes
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {t for t in tokens if t not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", t)}


# --- static checks ---------------------------------------------------------------------------


def test_promtool_check_rules():
    proc = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


@pytest.mark.parametrize("test_file", TESTS, ids=[t.name for t in TESTS])
def test_promtool_unit_tests(test_file):
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", test_file.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=test_file.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_is_tested_firing_and_not_firing():
    fired: set[str] = set()
    silent: set[str] = set()
    for f in TESTS:
        for case in yaml.safe_load(f.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fired if t.get("exp_alerts") else silent).add(t["alertname"])
    names = {r["alert"] for r in rules()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent"


def test_every_alert_has_severity_summary_description_and_a_runbook_section():
    anchors = {
        slug(line[3:]) for line in RUNBOOK.read_text().splitlines() if line.startswith("## ")
    }
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for r in rules():
        assert r["labels"]["severity"] in ("info", "warning", "critical"), r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        # The description carries the value, except for a 0/1 state where it says nothing.
        boolean = re.search(r"== [01]$", r["expr"].strip()) is not None
        assert boolean or "$value" in ann["description"], r["alert"]
        url = ann["runbook_url"]
        assert url.startswith("https://") and "docs/runbook.md#" in url, r["alert"]
        assert url.split("#", 1)[1] in anchors, f"{r['alert']}: no runbook section {url}"
        if "cause" in r["labels"]:
            from vllm_guardian.model import Cause

            Cause(r["labels"]["cause"])  # the shared vocabulary


def test_the_guardians_own_rules_have_runbook_sections_too():
    assert DEFAULT_RULES.exists(), f"{DEFAULT_RULES} is missing"
    anchors = {
        slug(line[3:]) for line in RUNBOOK.read_text().splitlines() if line.startswith("## ")
    }
    for r in yaml.safe_load(DEFAULT_RULES.read_text())["rules"]:
        assert r["runbook"].lstrip("#") in anchors, f"{r['name']}: {r['runbook']}"


def test_every_metric_referenced_exists():
    known = known_metrics()
    for r in rules():
        unknown = metric_names(r["expr"]) - known
        assert unknown == set(), f"{r['alert']}: {unknown}"


def test_no_alert_on_plain_gpu_memory_used():
    for r in rules():
        assert "gpu_memory_used_bytes" not in r["expr"], r["alert"]
        assert "DCGM_FI_DEV_FB_USED" not in r["expr"], r["alert"]


# --- thresholds match the guardian's defaults ------------------------------------------------


def _default_rule(name: str) -> dict[str, Any] | None:
    if not DEFAULT_RULES.exists():
        return None
    for r in yaml.safe_load(DEFAULT_RULES.read_text())["rules"]:
        if r["name"] == name:
            return r
    return None


def _threshold(rule: dict[str, Any]) -> float:
    if "threshold_bytes" in rule:
        from vllm_guardian.config import parse_bytes

        v = rule["threshold_bytes"]
        return float(v if isinstance(v, int | float) else parse_bytes(v))
    return float(rule["threshold"])


def _reset_xids() -> set[int]:
    from vllm_guardian.core import alerting

    return set(alerting.RESET_CLASS_XIDS)


# (Prometheus alert, regex capturing each threshold in its expr, the guardian's default rule,
#  or a callable giving the default from config/code). Every capture must equal the default.
THRESHOLDS: list[tuple[str, str, str | Callable[[], float]]] = [
    ("VllmKvCacheSaturated", r"(?:ratio|perc\)) >= ([0-9.]+)", "VllmKvCacheSaturated"),
    (
        "VllmKvCacheSaturated",
        r"(?:ratio|perc\)) >= ([0-9.]+)",
        lambda: PolicyConfig().kv_high_watermark_ratio,
    ),
    ("VllmPreemptionRateHigh", r"(?:second|\[5m\]\)\)) > ([0-9.]+)", "VllmPreemptionRateHigh"),
    ("VllmWaitingQueueLong", r"waiting\)? > ([0-9.]+)\)?", "VllmWaitingQueueLong"),
    ("VllmOverCapacity", r"demand_ratio > ([0-9.]+)", "VllmOverCapacity"),
    ("VllmEngineStalled", r"stall_seconds >= ([0-9.]+)", lambda: SignalsConfig().stall_seconds),
    ("VllmGpuMemoryOverBudget", r"over_budget_bytes > ([0-9* ]+)", "VllmGpuMemoryOverBudget"),
    (
        "VllmGpuSharedWithOtherProcess",
        r"other_processes_memory_bytes > ([0-9* ]+)",
        "VllmGpuSharedWithOtherProcess",
    ),
    (
        "VllmGpuHeadroomExhaustionSoon",
        r"exhaustion_cause < ([0-9]+)",
        "VllmGpuHeadroomExhaustionSoon",
    ),
    ("VllmAllocatorFragmented", r"fragmentation_ratio > ([0-9.]+)", "VllmAllocatorFragmented"),
    ("VllmGuardianBreakerLatched", r"breaker_latched == ([0-9]+)", "VllmGuardianBreakerLatched"),
    (
        "VllmGuardianActionsFrequent",
        r"\[1h\]\)\) >= ([0-9]+)",
        lambda: float(PolicyConfig().restart_budget),
    ),
]


@pytest.mark.parametrize(
    ("alert", "pattern", "default"),
    THRESHOLDS,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(THRESHOLDS)],
)
def test_thresholds_match_the_guardians_defaults(alert, pattern, default):
    expr = next(r["expr"] for r in rules() if r["alert"] == alert)
    found = [math.prod(float(x) for x in m.split("*")) for m in re.findall(pattern, expr)]
    assert found, f"{alert}: {pattern!r} matches nothing in {expr}"
    if callable(default):
        want = float(default())
    else:
        rule = _default_rule(default)
        assert rule is not None, f"the guardian's rule {default} is not in {DEFAULT_RULES.name}"
        want = _threshold(rule)
    assert all(v == want for v in found), f"{alert}: {found} vs the guardian's {want}"


def test_reset_class_xids_match_the_guardians():
    expr = next(r["expr"] for r in rules() if r["alert"] == "VllmGpuResetRequired")
    m = re.search(r'xid=~"([0-9|]+)"', expr)
    assert m is not None
    assert {int(x) for x in m.group(1).split("|")} == _reset_xids()


# --- the live chain: guardian → Prometheus (shipped rules) → Alertmanager --------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def process(cmd: list[str], log: Path, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prometheus_scrapes_the_guardian_and_an_alert_reaches_alertmanager(tmp_path):
    prom, am = tool("prometheus"), tool("prometheus-alertmanager")
    g_port, p_port, a_port = free_port(), free_port(), free_port()
    script = Script()
    script.set(
        "/metrics", body=read_fixture("metrics-pressure-07.prom").encode()
    )  # KV 0.90, 27 waiting
    script.set("/health")
    shipped = RULES.read_text()
    fast = re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", shipped, flags=re.M)
    assert fast != shipped
    (tmp_path / "rules.yml").write_text(fast)
    (tmp_path / "am.yml").write_text(
        "route: {receiver: 'null', group_by: [alertname], group_wait: 1s, group_interval: 1s}\n"
        "receivers: [{name: 'null'}]\n"
    )
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [rules.yml]\n"
        f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{a_port}']}}]}}]}}\n"
        "scrape_configs:\n"
        f"  - job_name: vllm-guardian\n    static_configs: [{{targets: ['127.0.0.1:{g_port}']}}]\n"
    )
    with ExitStack() as stack:
        url = stack.enter_context(serve(script))
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f"interval_seconds: 0.5\nlisten: 127.0.0.1:{g_port}\nruntime_dir: {tmp_path / 'run'}\n"
            f"state_dir: {tmp_path}\nrecorder:\n  path: null\n"
            "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
            f"services:\n  - name: vllm\n    url: {url}\n"
        )
        guardian = stack.enter_context(
            process(
                [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
                tmp_path / "guardian.log",
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        )
        stack.enter_context(
            process(
                [am, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
                 f"--web.listen-address=127.0.0.1:{a_port}", "--cluster.listen-address="],
                tmp_path / "am.log",
            )
        )  # fmt: skip
        stack.enter_context(
            process(
                [prom, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{p_port}"],
                tmp_path / "prometheus.log",
                cwd=tmp_path,
            )
        )  # fmt: skip
        papi, aapi = f"http://127.0.0.1:{p_port}/api/v1", f"http://127.0.0.1:{a_port}/api/v2"

        def am_alert() -> list[dict[str, Any]]:
            got = requests.get(
                f"{aapi}/alerts",
                params={"filter": 'alertname="VllmKvCacheSaturated"'},
                timeout=5,
            ).json()
            return [a for a in got if a["status"]["state"] == "active"]

        t0 = time.monotonic()
        alerts = wait_for(am_alert, "VllmKvCacheSaturated in Alertmanager")
        elapsed = time.monotonic() - t0
        labels = alerts[0]["labels"]
        assert labels["service"] == "vllm" and labels["severity"] == "warning"
        assert labels["job"] == "vllm-guardian"
        assert alerts[0]["annotations"]["runbook_url"].endswith("#kv-cache-saturated")
        assert "KV-cache usage is 90.32%" in alerts[0]["annotations"]["description"]

        # Every shipped rule evaluates without error against real data, and a healthy
        # vLLM (/health 200) does not page as down.
        groups = requests.get(f"{papi}/rules", timeout=5).json()["data"]["groups"]
        evaluated = [r for g in groups for r in g["rules"]]
        assert len(evaluated) == len(rules())
        assert all(r["health"] == "ok" for r in evaluated), [
            (r["name"], r.get("lastError")) for r in evaluated if r["health"] != "ok"
        ]
        firing = {
            a["labels"]["alertname"]
            for a in requests.get(f"{papi}/alerts", timeout=5).json()["data"]["alerts"]
        }
        assert "VllmEngineDead" not in firing and "VllmGuardianDown" not in firing
        assert guardian.poll() is None
        print(f"alert in Alertmanager {elapsed:.1f}s after the servers started")


def test_the_autoscaler_query_in_the_docs_is_the_tested_one():
    tested = yaml.safe_load((ROOT / "alerts" / "tests" / "capacity-query.test.yml").read_text())
    exprs = {
        " ".join(t["expr"].split()) for case in tested["tests"] for t in case["promql_expr_test"]
    }
    assert len(exprs) == 1, exprs
    (expr,) = exprs
    doc = " ".join((ROOT / "docs" / "capacity.md").read_text().split())
    assert doc.count(expr) >= 2, "docs/capacity.md: the PromQL block and the KEDA query"
    adapter = expr.replace('job="vllm-guardian", service="vllm"', "<<.LabelMatchers>>").replace(
        "sum by (namespace)", "sum by (<<.GroupBy>>)"
    )
    assert adapter in doc, "docs/capacity.md: the prometheus-adapter metricsQuery"
