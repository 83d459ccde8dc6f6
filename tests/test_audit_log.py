"""The audit log's one format: what ``AuditLog`` writes, ``audit.read`` gives back as the same
typed decisions; a line that is not a whole record is skipped, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_guardian.actuators import audit
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.policy import Decision, DecisionKind, Withheld
from vllm_guardian.model import ActionKind, Cause

DECISIONS = [
    Decision(
        10.0, "vllm", DecisionKind.ACTION, "relaunch: prefill_burst: one rung down",
        Cause.PREFILL_BURST, ("log:cuda_oom",), action_id=1, action_kind=ActionKind.RELAUNCH,
    ),
    Decision(
        10.0, "vllm", DecisionKind.PHASE, "front door closed", action_id=1,
        phase=Phase.PREPARING, action_kind=ActionKind.RELAUNCH,
    ),
    Decision(
        12.5, "vllm", DecisionKind.SUPPRESSED, "engine_dead: in cooldown until 40",
        Cause.ENGINE_DEAD, withheld=Withheld.COOLDOWN,
    ),
    Decision(13.0, "vllm", DecisionKind.GATE, "KV cache usage 93%", dry_run=True),
    Decision(
        20.0, "vllm", DecisionKind.RESULT, "relaunch succeeded", action_id=1,
        action_kind=ActionKind.RELAUNCH, ok=True,
    ),
]  # fmt: skip


def test_what_is_written_reads_back_as_the_same_decisions(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    assert audit.AuditLog(path).write(DECISIONS)
    assert audit.read(path) == DECISIONS
    assert [r.identity for r in audit.read_records(path)] == [{}] * len(DECISIONS)


def test_a_fleet_record_keeps_who_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit.AuditLog(path, identity={"pod": "llama-0"}).write(DECISIONS[:1])
    (record,) = audit.read_records(path)
    assert (record.decision, record.identity) == (DECISIONS[0], {"pod": "llama-0"})


@pytest.mark.parametrize(
    "line",
    [
        '{"time_seconds": 11.0, "service": "vllm", "what": "act',  # cut by a full disk
        '{"time_seconds": 11.0, "service": "vllm", "what": "dance", "reason": ""}',
        "[1, 2]",
        "not json at all",
    ],
    ids=["torn", "unknown kind", "not a record", "not json"],
)
def test_a_line_that_is_not_a_record_is_skipped(tmp_path: Path, line: str) -> None:
    path = tmp_path / "audit.jsonl"
    audit.AuditLog(path).write(DECISIONS[:1])
    with path.open("a") as fh:
        fh.write(line + "\n")
    audit.AuditLog(path).write(DECISIONS[1:2])
    assert audit.read(path) == DECISIONS[:2]


def test_a_missing_log_reads_as_empty(tmp_path: Path) -> None:
    assert audit.read(tmp_path / "none.jsonl") == []


def test_a_record_from_before_the_typed_fields_reads_with_them_unset(tmp_path: Path) -> None:
    """A log written by an older guardian (no ``action_kind``, no ``withheld``) still reads."""
    path = tmp_path / "audit.jsonl"
    path.write_text(
        '{"time_seconds": 5.0, "service": "vllm", "what": "action", "reason": "restart: x", '
        '"cause": "engine_dead", "evidence": [], "action_id": 3, "dry_run": false, "phase": null}\n'
    )
    (d,) = audit.read(path)
    assert (d.what, d.cause, d.action_id, d.action_kind) == (
        DecisionKind.ACTION, Cause.ENGINE_DEAD, 3, None,
    )  # fmt: skip
