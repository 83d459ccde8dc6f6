"""The contract every source implements, and the helper that keeps a failure an observation."""

from __future__ import annotations

from typing import Protocol

from vllm_guardian.model import Reading, SourceKind


class Collector(Protocol):
    """One source for one service (or for the host, ``service=None``).

    ``collect`` is called once per tick from a worker thread, never concurrently with itself:
    if a previous call is still running when the next tick starts, the daemon skips it and
    reports the source as hung. It must return a Reading and should not raise; the daemon
    still catches anything that escapes and reports it as the source being down.
    """

    kind: SourceKind
    service: str | None
    timeout_seconds: float

    def collect(self) -> Reading: ...

    def close(self) -> None:
        """Release threads, subprocesses and libraries. Idempotent."""
        ...


def failed(kind: SourceKind, service: str | None, error: str, hint: str | None = None) -> Reading:
    return Reading(source=kind, service=service, payload=None, error=error, hint=hint)
