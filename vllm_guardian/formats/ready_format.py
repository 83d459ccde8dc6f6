"""The guardian's ``/ready/<service>`` answer (docs/gate.md): its one writer and its one reader.

Where it sits: the exposition (``exposition.py``) answers ``/ready/<service>`` with
:func:`encode`; the admission gate's follower (``gate/follower.py``) reads the reason with
:func:`reason_of`. The status code carries the verdict (200 ready, 503 held back, 404 no such
service); the JSON body says which service and why, for a person and for the gate's
``/gate/status``, and in ``restart_in_progress`` whether the guardian is restarting or
relaunching it (its action holds the front door: :func:`restart_in_progress_of` reads it; the
gate lets what it holds wait longer for the new engine then). A field, not the reason's prose,
so a rewording cannot change what the gate does. Like ``gpu_state_format.py``, one module owns the format, so the writer and
the reader cannot drift apart. Pure: no I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class ReadyAnswer:
    service: str
    ready: bool
    reason: str  # "open", or why new work is held back
    restart_in_progress: bool = False  # a restart or relaunch holds the front door

    @property
    def status(self) -> int:
        return 200 if self.ready else 503


def encode(answer: ReadyAnswer) -> bytes:
    return json.dumps(
        {
            "service": answer.service,
            "ready": answer.ready,
            "reason": answer.reason,
            "restart_in_progress": answer.restart_in_progress,
        }
    ).encode()


def encode_unknown(service: str) -> bytes:
    """The 404 body: the guardian watches no service of that name."""
    return json.dumps({"error": f"unknown service {service!r}"}).encode()


def reason_of(body: bytes, default: str) -> str:
    """The answer's reason; ``default`` when the body is not an answer (a proxy's error page)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return default
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return str(reason) if reason is not None else default


def restart_in_progress_of(body: bytes) -> bool:
    """Whether the answer says a restart or relaunch is in progress; False for a body that is
    not an answer, or one from a guardian that does not say (older than the field)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("restart_in_progress") is True
