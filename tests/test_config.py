"""Config validation: every error at once, each with its key path and line; exit code 2."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_guardian.config import (
    Config,
    ConfigError,
    ConfigInvalid,
    load_config,
    parse_bytes,
    parse_config,
)
from vllm_guardian.tools import cli

EXAMPLE = Path(__file__).parent.parent / "examples" / "config.yaml"


def errors(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(ConfigInvalid) as exc:
        parse_config(text, "c.yaml")
    return [(e.path, e.line, e.message) for e in exc.value.errors]


def test_example_config_is_valid_and_equals_the_defaults():
    cfg = load_config(EXAMPLE)
    default = Config(services=cfg.services)
    assert (
        dataclasses.replace(cfg) == default
    )  # the example spells out exactly the shipped defaults


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted."""
    out = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            out += _keys(factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append(prefix + f.name)
    return out


def test_every_key_is_in_the_example_with_a_comment():
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    for key in _keys(Config):
        leaf = key.split(".")[-1]
        idx = next((i for i, line in enumerate(lines) if re.match(rf"\s*-?\s*{leaf}:", line)), None)
        assert idx is not None, f"{key} missing from examples/config.yaml"
        commented = "#" in lines[idx] or lines[idx - 1].strip().startswith("#")
        assert commented, f"{key} has no comment saying why"


MINIMAL = "services:\n  - name: vllm\n"

CASES = [
    # config text, expected (path, line, message fragment) — all reported at once
    (
        "interval_seconds: 0\nlisten: nope\nservices:\n  - name: a\n    url: ftp://x\n",
        [
            ("interval_seconds", 1, "must be >= 0.1"),
            ("listen", 2, "HOST:PORT"),
            ("services[0].url", 5, "http://"),
        ],
    ),
    (
        "services:\n  - name: a\n    gpus: [0, x]\n",
        [("services[0].gpus[1]", 3, "expected an integer")],
    ),
    ("services:\n  - name: a\n    gpus: [0, 0]\n", [("services[0].gpus", 3, "duplicate")]),
    (
        "services:\n  - name: a\n    gpus: all\n",
        [("services[0].gpus", 3, "expected a list or 'auto'")],
    ),
    ("services:\n  - url: http://x:1\n", [("services[0].name", 2, "required key is missing")]),
    ("services: []\n", [("services", 1, "at least 1")]),
    ("interval_seconds: 2\n", [("services", 1, "required key is missing")]),
    (
        MINIMAL + "sources:\n  health:\n    deep_probe: maybe\n",
        [("sources.health.deep_probe", 5, "true or false")],
    ),
    (
        MINIMAL + "sources:\n  vllm_metrics:\n    max_body_bytes: lots\n",
        [("sources.vllm_metrics.max_body_bytes", 5, "not a size")],
    ),
    (
        MINIMAL + "sources:\n  nvml:\n    backend: cuda\n",
        [("sources.nvml.backend", 5, "'nvml' or 'file'")],
    ),
    (MINIMAL + "recorder:\n  backups: -1\n", [("recorder.backups", 4, "must be >= 0")]),
    (MINIMAL + "signals:\n  rate_window: 30\n", [("signals.rate_window", 4, "unknown key")]),
    (MINIMAL + "interval_seconds: .nan\n", [("interval_seconds", 3, "expected a number")]),
    (MINIMAL + "interval_seconds: true\n", [("interval_seconds", 3, "expected a number")]),
    (MINIMAL + "listen: 127.0.0.1:99999\n", [("listen", 3, "0..65535")]),
    (
        "services:\n  - name: a\n  - name: a\n    url: http://127.0.0.1:8001\n",
        [("services[1].name", 3, "duplicate service name")],
    ),
    (
        "services:\n  - name: a\n    unit: 'x; rm -rf /'\n",
        [("services[0].unit", 3, "systemd unit name")],
    ),
    ("services:\n  - name: 'bad name'\n", [("services[0].name", 2, "letters, digits")]),
    ("services: {name: a}\n", [("services", 1, "expected a list")]),
    ("- just\n- a list\n", [("", 1, "expected a mapping")]),
    ("services:\n  - name: a\n  bad: [\n", [("", None, "not valid YAML")]),
    ("", [("services", None, "empty")]),
    (MINIMAL + "fleet:\n  permit: etcd\n", [("fleet.permit", 4, "'none' or 'lease'")]),
    (
        MINIMAL + "fleet:\n  permit: lease\n",
        [("fleet.model", 4, "required with fleet.permit: lease"), ("fleet.pdb", 4, "required")],
    ),
    (
        MINIMAL + "fleet:\n  permit: lease\n  model: Llama_3\n  pdb: p\n",
        [("fleet.model", 5, "Kubernetes name")],
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_errors_name_key_and_line(text, expected):
    got = errors(text)
    assert len(got) == len(expected), got
    for (path, line, frag), (gpath, gline, gmsg) in zip(expected, got, strict=True):
        assert gpath == path and frag in gmsg
        if line is not None:
            assert gline == line


def test_valid_values():
    cfg = parse_config(
        "services:\n  - name: a\n    gpus: [1, 0]\n    unit: vllm@a.service\nlisten: '[::1]:9000'\n"
        "sources:\n  vllm_metrics:\n    max_body_bytes: 512MiB\n"
    )
    assert cfg.services[0].gpus == (1, 0)
    assert cfg.listen_address == ("::1", 9000)
    assert cfg.sources.vllm_metrics.max_body_bytes == 512 * 1024**2


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("16MiB", 16 * 1024**2), ("1.5 GiB", int(1.5 * 1024**3)), ("2GB", 2 * 10**9)],
)
def test_sizes(text, value):
    assert parse_bytes(text) == value


def test_check_config_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(MINIMAL)
    assert cli.main(["check-config", "-c", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval_seconds: -1\nservices:\n  - name: a\n    url: x\n")
    assert cli.main(["check-config", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: interval_seconds" in err and f"{bad}:4: services[0].url" in err
    assert cli.main(["check-config", "-c", str(tmp_path / "missing.yaml")]) == 2


def test_yaml_is_loaded_safely():
    with pytest.raises(ConfigInvalid):
        parse_config("services: !!python/object/apply:os.system ['true']\n")
    assert yaml.__name__ == "yaml"


# Shapes from the adversarial pass: each used to escape as a traceback (exit 1).
# Every one must be a ConfigInvalid naming the key and its line.
HOSTILE = [
    ('services:\n  - name: a\n    url: "http://[::1:8000"\n', "services[0].url", 3, "not a URL"),
    ("services:\n  - name: a\ninterval_seconds: !!int abc\n", "interval_seconds", 3, "valid int"),
    ("services:\n  - name: a\ninterval_seconds: !!float x\n", "interval_seconds", 3, "valid float"),
    ("services:\n  - name: a\ninterval_seconds: !!binary abc\n", "interval_seconds", 3, "binary"),
    ("services:\n  - name: a\ninterval_seconds: !!timestamp x\n", "interval_seconds", 3, "timestamp"),
    ("services:\n  - name: a\ninterval_seconds: !!python/name:os.system x\n", "interval_seconds", 3, "python/name"),
    ("services:\n  - name: a\n    gpus: [!!int 0x]\n", "services[0].gpus[0]", 3, "valid int"),
    ("services:\n  - name: a\nrecorder:\n  max_bytes: " + "9" * 400 + "TiB\n", "recorder.max_bytes", 4, "too large"),
    ('services:\n  - name: a\nalerting:\n  webhooks: ["http://[x"]\n', "alerting.webhooks[0]", 4, "not a URL"),
    ('services:\n  - name: a\nalerting:\n  alertmanager_url: "https://[::1"\n', "alerting.alertmanager_url", 4, "not a URL"),
    ("services:\n  - name: a\n    unit: -x.service\n", "services[0].unit", 3, "must not start with '-'"),
    ("services:\n  - name: a\n    unit: --help.service\n", "services[0].unit", 3, "must not start with '-'"),
    ('services:\n  - name: a\nstate_dir: ""\n', "state_dir", 3, "must not be empty"),
    ("services:\n  - name: a\nruntime_dir: '  '\n", "runtime_dir", 3, "must not be empty"),
    ("services:\n  - name: a\nrecorder:\n  path: ''\n", "recorder.path", 4, "must not be empty"),
    ("services:\n  - name: a\nsources:\n  allocator:\n    directory: ''\n", "sources.allocator.directory", 5, "must not be empty"),
    ("a: " + "[" * 3000 + "]" * 3000 + "\n", "", None, "nested too deeply"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "path", "line", "fragment"), HOSTILE)
def test_hostile_configs_are_reported_with_key_and_line(text, path, line, fragment):
    got = errors(text)
    assert any(p == path and ln == line and fragment in m for p, ln, m in got), got


def test_check_config_never_prints_a_traceback(tmp_path):
    """The real CLI, as a subprocess: every hostile shape is exit 2 with its key and line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for i, (text, path, line, fragment) in enumerate(HOSTILE):
        cfg = tmp_path / f"c{i}.yaml"
        cfg.write_text(text)
        p = subprocess.run(
            [sys.executable, "-m", "vllm_guardian", "check-config", "-c", str(cfg)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert p.returncode == 2, (text, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        where = f"{cfg}:{line}: {path}" if line is not None else f"{cfg}: (top level)"
        assert where in p.stderr and fragment in p.stderr, p.stderr


@pytest.mark.parametrize("unit", ["vllm.service", "vllm@a.service", "a-b.service", "x.scope"])
def test_unit_names_that_stay_valid(unit):
    assert parse_config(f"services:\n  - name: a\n    unit: {unit}\n").services[0].unit == unit


_NASTY = ["[", "{", "[::1", "http://[::1:8000", "-x.service", "''", "1e999", "9" * 400, ".nan",
          "~", "&a x", "*a", "? x", "|\n  x"]  # fmt: skip
_TAGS = ["", "!!int ", "!!float ", "!!bool ", "!!str ", "!!binary ", "!!timestamp ", "!!null ",
         "!!seq ", "!!map ", "!!set ", "!!omap ", "!!python/tuple ", "!custom "]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    tag=st.sampled_from(_TAGS),
    value=st.one_of(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
        st.sampled_from(_NASTY),
    ),
)
def test_any_value_at_any_key_is_a_config_or_a_config_error(data, tag, value):
    """Fuzz: every leaf of the example config replaced by an arbitrary (tagged) scalar."""
    lines = EXAMPLE.read_text().splitlines()
    leaves = [
        i
        for i, line in enumerate(lines)
        if re.match(r"\s*-?\s*\w+: \S", line) and not line.lstrip().startswith("#")
    ]
    i = data.draw(st.sampled_from(leaves))
    key = lines[i].split(":", 1)[0]
    lines[i] = f"{key}: {tag}{json_quote(value) if data.draw(st.booleans()) else value}"
    errors: list[ConfigError] = []
    try:
        parse_config("\n".join(lines) + "\n", "c.yaml")
    except ConfigInvalid as e:  # the only exception allowed
        errors = e.errors
    assert all(err.message for err in errors)


def json_quote(v: str) -> str:
    import json

    return json.dumps(v)


@pytest.mark.parametrize(
    "key", ["interval_seconds", "recorder:\n  backups", "signals:\n  stall_seconds"]
)
def test_a_huge_integer_is_too_large_not_a_crash(key):
    got = errors(f"services:\n  - name: a\n{key}: {'9' * 400}\n")
    assert len(got) == 1 and "too large" in got[0][2] and got[0][1] is not None, got
