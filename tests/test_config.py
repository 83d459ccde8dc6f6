"""Config validation: every error at once, each with its key path and line; exit code 2."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from vllm_guardian import cli
from vllm_guardian.config import Config, ConfigInvalid, load_config, parse_bytes, parse_config

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
