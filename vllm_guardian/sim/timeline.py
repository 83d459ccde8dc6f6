"""The run's timeline file (``--sim-timeline-file``): the scenario's epoch and its faults.

One JSON object shared by the successive twin processes of one run (a restart, a relaunch)::

    {"epoch_unix_seconds": 1764000000.0,
     "faults": [{"kind": "hang", "unix_seconds": 1764000007.5, "pid": 4242}]}

The first process to become ready writes the epoch (its readiness) unless ``--sim-epoch``
gave one; later processes read it, so the scenario's one-off faults keep their place on the
run's clock. Each process appends the faults it meets (OOMs included), which is what a
benchmark reads to time detection and recovery. Written atomically (temporary file and
rename, atomicfile.py); read by the twin's main thread only, at start and when a fault is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_guardian.lowio.atomicfile import write_atomic


class TimelineError(ValueError):
    """The timeline file exists but is not a timeline."""


@dataclass(frozen=True)
class FaultEntry:
    kind: str
    unix_seconds: float
    pid: int


@dataclass(frozen=True)
class Timeline:
    epoch_unix_seconds: float | None
    faults: tuple[FaultEntry, ...] = ()


def read_timeline(path: Path) -> Timeline:
    """The file's content; an absent file is an empty timeline."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Timeline(None)
    except OSError as exc:
        raise TimelineError(f"{path}: cannot read the timeline: {exc}") from exc
    try:
        data = json.loads(raw)
        epoch = data.get("epoch_unix_seconds")
        if epoch is not None and not isinstance(epoch, int | float):
            raise TypeError(f"epoch_unix_seconds is {type(epoch).__name__}, not a number")
        faults = tuple(
            FaultEntry(str(f["kind"]), float(f["unix_seconds"]), int(f["pid"]))
            for f in data.get("faults", [])
        )
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TimelineError(f"{path}: not a timeline file: {exc}") from exc
    return Timeline(None if epoch is None else float(epoch), faults)


def write_timeline(path: Path, timeline: Timeline) -> None:
    data = {
        "epoch_unix_seconds": timeline.epoch_unix_seconds,
        "faults": [
            {"kind": f.kind, "unix_seconds": f.unix_seconds, "pid": f.pid} for f in timeline.faults
        ],
    }
    write_atomic(path, json.dumps(data, indent=1).encode(), 0o644)
