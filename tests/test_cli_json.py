"""``--json`` on ``check-config``, ``pause`` and ``resume``: one object with the stable fields
of docs/cli.md, for scripts (the text stays for people). pause and resume talk to a real
control server on a Unix socket; its handler answers as the guardian's does."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.lowio.control import ControlServer
from vllm_guardian.tools import cli

SERVICE = "services:\n  - name: vllm\n    url: http://user:secret@127.0.0.1:8000\n"


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> tuple[int, Any]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    rc = cli.main(["check-config", "-c", str(cfg), "--json"])
    out, err = capsys.readouterr()
    assert err == "", err  # everything is in the object
    return rc, json.loads(out)


def test_check_config_json_of_a_valid_config(tmp_path: Path, capsys) -> None:
    rc, doc = check(tmp_path, capsys, SERVICE + f"    log_file: {tmp_path}/absent.log\n")
    assert rc == 0
    assert doc == {
        "schema": "vllm-guardian/check-config",
        "schema_version": 1,
        "config": str(tmp_path / "config.yaml"),
        "ok": True,
        "errors": [],
        "warnings": [
            f"services[0].log_file: {tmp_path}/absent.log does not exist: the logs source "
            "reports itself down until it does"
        ],
        "listen": doc["listen"],
        "alert_rules": doc["alert_rules"],
        "dry_run": True,
        "alert_sinks": ["log"],
        "services": [
            {"name": "vllm", "url": "http://user:***@127.0.0.1:8000", "gate_listen": None}
        ],
    }
    assert doc["alert_rules"] > 0 and isinstance(doc["listen"], str)


def test_check_config_json_lists_every_error_of_both_files(tmp_path: Path, capsys) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: X\n    signal: kv_cache_usage_ratio\n    fore_seconds: 1\n")
    rc, doc = check(
        tmp_path, capsys, f"interval_secnds: 2\nalerting:\n  rules_file: {rules}\n" + SERVICE
    )
    assert rc == 2 and doc["ok"] is False
    cfg = str(tmp_path / "config.yaml")
    assert doc["errors"][0] == {
        "file": cfg, "line": 1, "key": "interval_secnds",
        "message": "unknown key; did you mean interval_seconds?",
    }  # fmt: skip
    where = [(e["file"], e["line"], e["key"]) for e in doc["errors"][1:]]
    assert (str(rules), 4, "rules[0].fore_seconds") in where, where


@pytest.fixture
def guardian() -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """A control socket whose handler answers pause/resume as ``healing.py`` does."""
    asked: list[dict[str, Any]] = []

    def handler(req: dict[str, Any]) -> dict[str, Any]:
        asked.append(req)
        if req.get("service") not in (None, "vllm"):
            return {"ok": False, "error": f"unknown service {req['service']!r}"}
        return {"ok": True, "changed": ["vllm"]}

    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # a socket path has to be short
        server = ControlServer(Path(d) / "control.sock", handler)
        server.start()
        try:
            yield Path(d) / "control.sock", asked
        finally:
            server.stop()


@pytest.mark.parametrize(
    ("args", "rc", "expected"),
    [
        (["pause", "vllm"], 0,
         {"command": "pause", "service": "vllm", "ok": True, "changed": ["vllm"], "error": None}),
        (["resume"], 0,
         {"command": "resume", "service": None, "ok": True, "changed": ["vllm"], "error": None}),
        (["pause", "nope"], 1,
         {"command": "pause", "service": "nope", "ok": False, "changed": [],
          "error": "unknown service 'nope'"}),
    ],
    ids=["pause one", "resume all", "unknown service"],
)  # fmt: skip
def test_pause_and_resume_json(guardian, capsys, args: list[str], rc: int, expected) -> None:
    sock, asked = guardian
    assert cli.main([*args, "--socket", str(sock), "--json"]) == rc
    out, err = capsys.readouterr()
    assert (json.loads(out), err) == (expected, "")
    assert asked == [{"cmd": args[0], "service": expected["service"]}]


def test_pause_json_when_no_guardian_answers(tmp_path: Path, capsys) -> None:
    assert cli.main(["pause", "--socket", str(tmp_path / "none.sock"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["changed"]) == (False, [])
    assert str(tmp_path / "none.sock") in doc["error"]
