"""`vllm-guardian restart|relaunch` follows its action and exits by how it ended: read from the
result's ``ok`` field, never from its wording."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio import control
from vllm_guardian.model import ActionKind
from vllm_guardian.tools import operator

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
