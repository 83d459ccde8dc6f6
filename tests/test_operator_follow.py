"""`vllm-guardian restart|relaunch` follows its action and exits by how it ended: read from the
result's ``ok`` field, never from its wording."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio import control
from vllm_guardian.model import ActionKind
from vllm_guardian.tools import cli, operator

STARTED = Decision(
    1.0, "vllm", DecisionKind.ACTION, "restart: asked by test",
    action_id=7, action_kind=ActionKind.RESTART,
)  # fmt: skip


def ended(what: DecisionKind, ok: bool | None, reason: str) -> Decision:
    return Decision(2.0, "vllm", what, reason, action_id=7, action_kind=ActionKind.RESTART, ok=ok)


@pytest.mark.parametrize(
    ("last", "code"),
    [
        (ended(DecisionKind.RESULT, True, "restart succeeded: ready"), operator.EXIT_OK),
        # The wording says "succeeded" (a quoted log line); the field says it failed.
        (ended(DecisionKind.RESULT, False, "failed (vLLM said: succeeded)"), operator.EXIT_FAIL),
        (ended(DecisionKind.LATCH, False, "restart failed for good"), operator.EXIT_FAIL),
    ],
    ids=["succeeded", "failed", "latched"],
)
def test_the_exit_code_is_the_results_ok_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], last: Decision, code: int
) -> None:
    def reply(path: Path, doc: dict[str, Any], **kw: object) -> dict[str, Any]:
        assert doc == {"cmd": "action", "service": "vllm", "action_id": 7}
        return {"ok": True, "decisions": [to_jsonable(STARTED), to_jsonable(last)]}

    monkeypatch.setattr(control, "request", reply)
    assert operator.follow(Path("/nonexistent"), "vllm", 7, timeout_seconds=30) == code
    assert last.reason in capsys.readouterr().out


def test_the_command_line_starts_an_action_on_the_socket_it_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``vllm-guardian restart vllm --socket S --no-wait`` asks the guardian listening on S (the
    command line resolves the socket and hands its resolver to the operator module), a real
    control socket on a short path."""
    asked: list[dict[str, Any]] = []

    def handler(req: dict[str, Any]) -> dict[str, Any]:
        asked.append(req)
        return {"ok": True, "action_id": 7, "reason": "asked by test"}

    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # a socket path has to be short
        server = control.ControlServer(Path(d) / "control.sock", handler)
        server.start()
        try:
            args = ["restart", "vllm", "--socket", str(Path(d) / "control.sock"), "--no-wait"]
            assert cli.main(args) == operator.EXIT_OK
        finally:
            server.stop()
    assert [(r["cmd"], r["service"], r["force"]) for r in asked] == [("restart", "vllm", False)]
    assert capsys.readouterr().out == "vllm: action 7 started: asked by test\n"
