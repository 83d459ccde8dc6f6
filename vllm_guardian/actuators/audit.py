"""Actuator: the audit log, one JSON line per policy decision (time, service, what, why, evidence).

Where it sits: the end of the act stage. Every gate change, action, suppressed action, result,
latch and operator command is written here with its reason, so "why did it restart at 03:12?"
has an answer. Never raises: a write error is returned and logged once by the caller.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from vllm_guardian.appendfile import append_lines
from vllm_guardian.core.policy import Decision
from vllm_guardian.recorder import to_jsonable
from vllm_guardian.redact import redact_json


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
