"""The twin's simulated GPU, published as the JSON state file of docs/gpu-state-file.md.

The guardian's GPU source reads this file through its ``file`` backend instead of NVML.
``build_state`` is pure (the caller passes the time and the pid); ``write_state_atomically``
writes ``PATH.tmp`` and renames it over ``PATH``, so a reader never sees half a file.
XID events already in an existing file are kept: a GPU's error history outlives the process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_guardian.atomicfile import write_atomic

FORMAT_VERSION = 1
# Idle and full-load figures of an H100 SXM, for plausible readings.
IDLE_TEMPERATURE_CELSIUS = 34.0
LOADED_TEMPERATURE_CELSIUS = 72.0
IDLE_POWER_WATTS = 70.0
MAX_POWER_WATTS = 700.0


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int


@dataclass(frozen=True)
class Xid:
    seq: int
    xid: int
    time_seconds: float


@dataclass(frozen=True)
class GpuReading:
    total_bytes: int
    processes: tuple[GpuProcess, ...]
    utilization_ratio: float
    xid_events: tuple[Xid, ...]
    name: str = "Sim H100 80GB"
    lost: bool = False

    @property
    def used_bytes(self) -> int:
        return min(self.total_bytes, sum(p.used_memory_bytes for p in self.processes))


def build_state(reading: GpuReading, unix_seconds: float) -> dict[str, Any]:
    u = max(0.0, min(1.0, reading.utilization_ratio))
    temp = IDLE_TEMPERATURE_CELSIUS + (LOADED_TEMPERATURE_CELSIUS - IDLE_TEMPERATURE_CELSIUS) * u
    power = IDLE_POWER_WATTS + (MAX_POWER_WATTS - IDLE_POWER_WATTS) * u
    return {
        "format": FORMAT_VERSION,
        "time_seconds": round(unix_seconds, 3),
        "driver_version": "sim-1",
        "devices": [
            {
                "index": 0,
                "uuid": "GPU-sim-0",
                "name": reading.name,
                "memory_total_bytes": reading.total_bytes,
                "memory_used_bytes": reading.used_bytes,
                "memory_free_bytes": reading.total_bytes - reading.used_bytes,
                "utilization_ratio": round(u, 3),
                "temperature_celsius": round(temp, 1),
                "power_watts": round(power, 1),
                "processes": [
                    {"pid": p.pid, "used_memory_bytes": p.used_memory_bytes}
                    for p in reading.processes
                    if p.used_memory_bytes > 0
                ],
                "xid_events": [
                    {"seq": x.seq, "xid": x.xid, "time_seconds": round(x.time_seconds, 3)}
                    for x in reading.xid_events
                ],
                "lost": reading.lost,
            }
        ],
    }


def read_previous_xids(path: Path) -> tuple[Xid, ...]:
    """XID events recorded by an earlier run (empty when there is no readable file)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        events = doc["devices"][0]["xid_events"]
        return tuple(Xid(int(e["seq"]), int(e["xid"]), float(e["time_seconds"])) for e in events)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ()


def write_state_atomically(path: Path, state: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(state, sort_keys=True).encode(), 0o644)
