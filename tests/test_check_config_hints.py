"""``check-config`` as a first-hour user meets it: a misspelt key gets "did you mean", a YAML
syntax error is one line with its line and column, and files the config names but that are not
there (a service's ``log_file``, the GPU state file of the ``file`` backend) are warned about
while the config stays valid (the sources report themselves down until the file appears)."""

from __future__ import annotations

import pytest

from vllm_guardian.config import ConfigInvalid, parse_config
from vllm_guardian.tools import cli

SERVICE = "services:\n  - name: vllm\n    url: http://127.0.0.1:8000\n"


def messages(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(ConfigInvalid) as exc:
        parse_config(text, "c.yaml")
    return [(e.line, e.path, e.message) for e in exc.value.errors]


@pytest.mark.parametrize(
    ("text", "line", "path", "message"),
    [
        ("interval_secnds: 2\n" + SERVICE, 1, "interval_secnds", "unknown key; did you mean interval_seconds?"),
        (SERVICE + "    unti: vllm.service\n", 4, "services[0].unti", "unknown key; did you mean unit?"),
        (SERVICE + "signals:\n  rate_window: 30\n", 5, "signals.rate_window", "unknown key; did you mean rate_window_seconds?"),
        (SERVICE + "polcy:\n  dry_run: false\n", 4, "polcy", "unknown key; did you mean policy?"),
    ],
)  # fmt: skip
def test_a_misspelt_key_gets_the_one_it_resembles(text, line, path, message) -> None:
    assert messages(text) == [(line, path, message)]


def test_a_key_like_none_lists_the_keys_there() -> None:
    [(line, path, message)] = messages(SERVICE + "zzzzzz: 1\n")
    assert (line, path) == (4, "zzzzzz")
    assert message.startswith("unknown key (known keys here: alerting, fleet, ")


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "services:\n  - name: vllm\n    url: [http://x\n",
            4,
            "not valid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>' "
            "(in the flow sequence opened at line 3, column 10)",
        ),
        (
            "services:\n  - name: vllm\n   url: http://x\n",
            3,
            "not valid YAML at line 3, column 4: expected <block end>, but found '<block mapping "
            "start>' (in the block collection opened at line 2, column 3)",
        ),
        (
            "services:\n\t- name: vllm\n",
            2,
            "not valid YAML at line 2, column 1: found character '\\t' that cannot start any "
            "token (a tab: indent with spaces)",
        ),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_where(text: str, line: int, message: str) -> None:
    assert messages(text) == [(line, "", message)]


@pytest.mark.parametrize(
    ("extra", "exists", "warning"),
    [
        ("    log_file: {path}\n", False, "services[0].log_file: {path} does not exist"),
        ("    log_file: {path}\n", True, None),
        (
            "sources:\n  nvml:\n    backend: file\n    state_file: {path}\n",
            False,
            "sources.nvml.state_file: {path} does not exist",
        ),
        ("sources:\n  nvml:\n    backend: file\n    state_file: {path}\n", True, None),
    ],
)
def test_check_config_warns_of_a_named_file_that_is_not_there(
    tmp_path, capsys, extra: str, exists: bool, warning: str | None
) -> None:
    path = tmp_path / "vllm.log"
    if exists:
        path.write_text("")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(SERVICE + extra.format(path=path))
    assert cli.main(["check-config", "-c", str(cfg)]) == 0  # valid: the file may come later
    err = capsys.readouterr().err
    if warning is None:
        assert "warning" not in err, err
    else:
        assert f"warning: {warning.format(path=path)}" in err, err


def test_the_rules_files_errors_come_with_the_configs(tmp_path, capsys) -> None:
    """Both files' errors in one run: the rules file's appeared only once the config was fixed."""
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: X\n    signal: kv_cache_usage_ratio\n    fore_seconds: 1\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"interval_secnds: 2\nalerting:\n  rules_file: {rules}\n" + SERVICE)
    assert cli.main(["check-config", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}:1: interval_secnds: unknown key" in err, err
    assert f"{rules}:4: rules[0].fore_seconds: unknown key" in err, err
