"""A full disk cuts a line short: the flight recorder and the audit log write whole lines or none.

On a full disk ``write(2)`` stores part of a line and returns the count, or stores part and the
next call fails with ENOSPC. A cut record used to stay in the file, and the next record was
appended to it on the same line: the reader lost both, and with the keyframe gone every delta
after it until the next keyframe (``replay`` skipped 10 lines). Now a line that was not written
whole is cut back off the file, and where even that fails the next line starts on a line of its
own; the reader skips only the broken line and says so.

The full disk is a fake ``os.write`` (and ``os.ftruncate``) at the system-call boundary, for
the one file under test only: a small real filesystem needs privileges the tests do not have.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_guardian.actuators.audit import AuditLog
from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.formats.recorder import FlightRecorder, RecordError, read_records
from vllm_guardian.model import ServiceSnapshot, Snapshot

FAILING_WRITE = 6  # the write that meets the full disk
WRITES = 12


@dataclass(frozen=True)
class Fault:
    name: str
    raises: bool  # half the line lands, then ENOSPC (else: half lands, the count says so)
    truncate_fails: bool  # cutting the half line back off fails too
    broken_lines: int  # lines the reader must skip (and report)


FAULTS = [
    Fault("short count", raises=False, truncate_fails=False, broken_lines=0),
    Fault("half then ENOSPC", raises=True, truncate_fails=False, broken_lines=0),
    Fault("half then ENOSPC, cannot cut back", raises=True, truncate_fails=True, broken_lines=1),
]


def _is(fd: int, target: Path) -> bool:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")) == target
    except OSError:
        return False


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, Fault], list[str]]:
    """Arms the fault for one file: its FAILING_WRITE-th write meets the full disk. Returns
    what happened, for the failure message."""
    real_write, real_truncate = os.write, os.ftruncate
    armed: dict[str, object] = {}
    seen: list[str] = []

    def write(fd: int, data: bytes | memoryview) -> int:
        target = armed.get("path")
        if not isinstance(target, Path) or not _is(fd, target):
            return real_write(fd, data)
        n = int(armed["writes"]) + 1  # type: ignore[call-overload]
        armed["writes"] = n
        if n != FAILING_WRITE:
            return real_write(fd, data)
        half = bytes(data[: len(data) // 2])
        real_write(fd, half)
        fault = armed["fault"]
        assert isinstance(fault, Fault)
        seen.append(f"write {n}: {len(half)} of {len(data)} bytes landed")
        if fault.raises:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(half)

    def ftruncate(fd: int, length: int) -> None:
        fault = armed.get("fault")
        target = armed.get("path")
        if isinstance(fault, Fault) and isinstance(target, Path) and _is(fd, target):
            seen.append(f"ftruncate to {length}" + (" failed" if fault.truncate_fails else ""))
            if fault.truncate_fails:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_truncate(fd, length)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "ftruncate", ftruncate)

    def arm(path: Path, fault: Fault) -> list[str]:
        armed.update(path=path, fault=fault, writes=0)
        return seen

    return arm


def _snapshot(t: float) -> Snapshot:
    return Snapshot(t, (ServiceSnapshot("vllm"),), None)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_the_flight_recorder_writes_whole_lines_or_none(
    tmp_path: Path, full_disk: Callable[[Path, Fault], list[str]], fault: Fault
) -> None:
    path = tmp_path / "flight.jsonl"
    seen = full_disk(path, fault)
    rec = FlightRecorder(path, 1 << 20, 1, keyframe_every=60)
    ok = [
        rec.write({"time": float(i), "snapshot": _snapshot(float(i)), "signals": None})
        for i in range(1, WRITES + 1)
    ]
    print(seen, ok, rec.error)
    assert ok == [i != FAILING_WRITE for i in range(1, WRITES + 1)], "the cut write fails"
    out = list(read_records(path, now_seconds=1e9))
    errors = [r for r in out if isinstance(r, RecordError)]
    times = [r["time"] for r in out if isinstance(r, dict)]
    print("errors:", errors)
    assert times == [float(i) for i in range(1, WRITES + 1) if i != FAILING_WRITE]
    assert len(errors) == fault.broken_lines
    for e in errors:
        assert e.line == FAILING_WRITE and "not JSON" in e.message


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_the_audit_log_writes_whole_lines_or_none(
    tmp_path: Path, full_disk: Callable[[Path, Fault], list[str]], fault: Fault
) -> None:
    path = tmp_path / "audit.jsonl"
    seen = full_disk(path, fault)
    audit = AuditLog(path)
    ok = [
        audit.write([Decision(float(i), "vllm", DecisionKind.SUPPRESSED, f"decision {i}")])
        for i in range(1, WRITES + 1)
    ]
    print(seen, ok, audit.error)
    assert ok == [i != FAILING_WRITE for i in range(1, WRITES + 1)]
    assert audit.error is None  # the last write worked
    good, broken = [], []
    for line in path.read_text().splitlines():
        try:
            good.append(json.loads(line)["time_seconds"])
        except ValueError:
            broken.append(line)
    print("broken:", broken)
    assert good == [float(i) for i in range(1, WRITES + 1) if i != FAILING_WRITE]
    assert len(broken) == fault.broken_lines


def test_the_reader_recovers_a_record_glued_to_a_cut_one(tmp_path: Path) -> None:
    """A file written before this fix: a cut record with the next keyframe on the same line.
    The reader takes the keyframe back from behind the cut, so only the cut record is lost
    (before, the keyframe and every delta after it until the next keyframe were)."""
    path = tmp_path / "flight.jsonl"
    rec = FlightRecorder(path, 1 << 20, 1, keyframe_every=3)
    for i in range(1, 8):
        assert rec.write({"time": float(i), "snapshot": _snapshot(float(i)), "signals": None})
    lines = path.read_bytes().splitlines(keepends=True)
    kinds = [json.loads(x)["kind"] for x in lines]
    assert kinds == ["key", "delta", "delta", "key", "delta", "delta", "key"]
    cut = lines[2][: len(lines[2]) // 2]
    path.write_bytes(b"".join([*lines[:2], cut + lines[3], *lines[4:]]))
    out = list(read_records(path, now_seconds=1e9))
    print(out)
    assert [r["time"] for r in out if isinstance(r, dict)] == [1.0, 2.0, 4.0, 5.0, 6.0, 7.0]
    (error,) = [r for r in out if isinstance(r, RecordError)]
    assert error.line == 3 and "cut" in error.message


def test_diagnose_recovers_a_record_glued_to_a_cut_one(tmp_path: Path) -> None:
    """`diagnose --bundle` reads a bundle's flight.jsonl the same way, and names the cut."""
    from vllm_guardian.diagnose.bundle import read_bundle

    bundle = tmp_path / "bundle"
    path = bundle / "flight.jsonl"
    rec = FlightRecorder(path, 1 << 20, 1, keyframe_every=3)
    now = 1_800_000_000.0
    for i in range(1, 8):
        t = now + i
        assert rec.write({"time": t, "snapshot": _snapshot(t), "signals": None})
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:2], lines[2][:40] + lines[3], *lines[4:]]))
    b = read_bundle(bundle)
    print(b.problems)
    assert [r["time"] - now for r in b.flight] == [1.0, 2.0, 4.0, 5.0, 6.0, 7.0]
    assert any("cut record" in p for p in b.problems)
