"""Actuator: the audit log, one JSON line per policy decision (time, service, what, why, evidence).

Where it sits: the end of the act stage. Every gate change, action, suppressed action, result,
latch and operator command is written here with its reason, so "why did it restart at 03:12?"
has an answer. Never raises: a write error is returned and logged once by the caller.

The format's one owner: :class:`AuditLog` writes it and :func:`read` reads it back as typed
:class:`~vllm_guardian.core.policy.Decision` records (the demo, the benches and the tests read
through it). A record's fields say what happened; its ``reason`` is for a person.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_guardian.core.phases import Phase
from vllm_guardian.core.policy import Decision, DecisionKind, Withheld
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio.appendfile import append_lines
from vllm_guardian.lowio.redact import redact_json
from vllm_guardian.model import ActionKind, Cause


class AuditLog:
    def __init__(self, path: Path, identity: Mapping[str, str] | None = None) -> None:
        self.path = path
        # Who wrote the record, in a fleet (container mode: the pod from the downward API).
        self.identity = dict(identity or {})
        self._lock = threading.Lock()
        self.error: str | None = None

    def write(self, decisions: Iterable[Decision]) -> bool:
        lines = "".join(
            json.dumps(self._record(d), separators=(",", ":")) + "\n" for d in decisions
        )
        if not lines:
            return True
        with self._lock:
            try:  # whole lines or none: a record cut by a full disk must not swallow the next
                append_lines(self.path, lines.encode())
            except OSError as e:
                self.error = f"cannot write the audit log {self.path}: {e.strerror or e}"
                return False
        self.error = None
        return True

    def _record(self, d: Decision) -> object:
        # A reason or an evidence line may quote a log line or an operator's words.
        record = redact_json(to_jsonable(d))
        if self.identity and isinstance(record, dict):
            return {**record, **self.identity}
        return record


@dataclass(frozen=True)
class Record:
    """One line of the audit log, read back."""

    decision: Decision
    # Who wrote it, in a fleet (the pod's identity fields), empty on a single host.
    identity: Mapping[str, str] = field(default_factory=dict)


def read_records(path: Path) -> list[Record]:
    """Every whole record of the audit log at ``path``, in order; none when it does not exist.
    A line that is not a record (cut short by a full disk before the whole-line writes, or
    from another program) is skipped: the audit log is read to learn, never to fail."""
    out: list[Record] = []
    with contextlib.suppress(OSError), path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                out.append(_record_of(json.loads(line)))
    return out


def read(path: Path) -> list[Decision]:
    """The decisions of the audit log at ``path`` (see :func:`read_records`)."""
    return [r.decision for r in read_records(path)]


def _optional(kind: Any, value: object) -> Any:
    return None if value is None else kind(value)


def _record_of(doc: Any) -> Record:
    if not isinstance(doc, dict):
        raise TypeError("not a record")
    d = Decision(
        time_seconds=float(doc["time_seconds"]),
        service=str(doc["service"]),
        what=DecisionKind(doc["what"]),
        reason=str(doc["reason"]),
        cause=_optional(Cause, doc.get("cause")),
        evidence=tuple(str(e) for e in doc.get("evidence") or ()),
        action_id=_optional(int, doc.get("action_id")),
        dry_run=bool(doc.get("dry_run", False)),
        phase=_optional(Phase, doc.get("phase")),
        action_kind=_optional(ActionKind, doc.get("action_kind")),
        withheld=_optional(Withheld, doc.get("withheld")),
        ok=_optional(bool, doc.get("ok")),
    )
    known = set(Decision.__dataclass_fields__)
    identity = {k: str(v) for k, v in doc.items() if k not in known}
    return Record(d, identity)
