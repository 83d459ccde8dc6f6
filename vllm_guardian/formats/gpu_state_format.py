"""The GPU state file (docs/gpu-state-file.md): its one writer and its one reader.

Where it sits: the vLLM twin (``sim/gpu_state.py``) builds the document with :func:`build_state`
and writes it atomically every interval; the guardian's GPU source (``sources/nvml.py``, its
``file`` backend) reads it back with :func:`parse_state_file` instead of NVML, so everything
above the backend runs the same code as with a real GPU. Like ``allocator_format.py``, one
module owns the format, so the writer and the reader cannot drift apart. Pure: no I/O here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_guardian.model import GpuDevice, GpuProcess, GpuReading, XidEvent

_T = TypeVar("_T")

# The twin rewrites its file every interval (2 s by default); three missed rewrites: stopped.
DEFAULT_MAX_AGE_SECONDS = 3 * 2.0

# --- the writer's side --------------------------------------------------------------------------

FORMAT_VERSION = 1
# Idle and full-load figures of an H100 SXM, for plausible readings.
IDLE_TEMPERATURE_CELSIUS = 34.0
LOADED_TEMPERATURE_CELSIUS = 72.0
IDLE_POWER_WATTS = 70.0
MAX_POWER_WATTS = 700.0


@dataclass(frozen=True)
class StateProcess:
    pid: int
    used_memory_bytes: int


@dataclass(frozen=True)
class StateXid:
    seq: int
    xid: int
    time_seconds: float


@dataclass(frozen=True)
class StateDevice:
    total_bytes: int
    processes: tuple[StateProcess, ...]
    utilization_ratio: float
    xid_events: tuple[StateXid, ...]
    name: str = "Sim H100 80GB"
    lost: bool = False

    @property
    def used_bytes(self) -> int:
        return min(self.total_bytes, sum(p.used_memory_bytes for p in self.processes))


def build_state(reading: StateDevice, unix_seconds: float) -> dict[str, Any]:
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


# --- the reader's side --------------------------------------------------------------------------


@dataclass(frozen=True)
class StateFileError:
    """Why a GPU state file cannot be used, and what a person can do about it."""

    error: str
    hint: str


@dataclass(frozen=True)
class ParsedStateFile:
    """A usable state file: the reading, and the XID high-water mark per device to remember."""

    reading: GpuReading
    xid_seq: tuple[tuple[str, int], ...]


class _Invalid(Exception):
    """A field of the state file is wrong; never leaves :func:`parse_state_file`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")


_FORMAT_HINT = (
    "the file does not follow docs/gpu-state-file.md (format 1): "
    "check the writer (the vLLM twin) and sources.nvml.state_file"
)


def parse_state_file(
    text: str,
    now: float,
    *,
    max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
    last_xid_seq: Mapping[str, int] | None = None,
) -> ParsedStateFile | StateFileError:
    """Parse and validate a GPU state file (docs/gpu-state-file.md) read at Unix time ``now``.

    A file whose ``time_seconds`` is more than ``max_age_seconds`` old (or that far in the
    future: a writer on another clock) is refused as a whole: stale values must not look
    current. ``last_xid_seq`` maps a device key (its uuid, else ``index:N``) to the highest
    XID ``seq`` already reported; only events above it are returned. A device whose highest
    seq fell below that mark has had its writer restart, so its count starts again from 0.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        return StateFileError(
            f"not valid JSON ({e})",
            "the writer must write PATH.tmp and rename it over PATH; "
            "is something else writing this file?",
        )
    try:
        return _parse_doc(doc, now, max_age_seconds, last_xid_seq or {})
    except _Invalid as e:
        return StateFileError(str(e), _FORMAT_HINT)


def _parse_doc(
    doc: Any, now: float, max_age_seconds: float, last_xid_seq: Mapping[str, int]
) -> ParsedStateFile | StateFileError:
    if not isinstance(doc, dict):
        raise _Invalid("(top level)", "expected a JSON object")
    fmt = doc.get("format")
    if fmt != 1:
        return StateFileError(
            f"unsupported format {fmt!r} (this guardian reads format 1)",
            "upgrade vllm-guardian or the vLLM twin so they write and read the same format",
        )
    written = _required(_number(doc, "time_seconds", "time_seconds"), "time_seconds")
    age = now - written
    if age > max_age_seconds:
        return StateFileError(
            f"stale: written {age:.1f} s ago, more than {max_age_seconds:g} s",
            "the writer (the vLLM twin) has stopped updating it: is it still running?",
        )
    if -age > max_age_seconds:
        return StateFileError(
            f"time_seconds is {-age:.1f} s in the future",
            "the writer and the guardian disagree about the time: check both clocks",
        )
    driver = _string(doc, "driver_version", "driver_version")
    raw_devices = doc.get("devices")
    if not isinstance(raw_devices, list):
        raise _Invalid("devices", "expected a list")
    devices: list[GpuDevice] = []
    events: list[XidEvent] = []
    high_water: dict[str, int] = {}
    seen_index: set[int] = set()
    for i, raw in enumerate(raw_devices):
        where = f"devices[{i}]"
        device, key, xids = _parse_device(raw, where)
        if device.index in seen_index:
            raise _Invalid(f"{where}.index", f"index {device.index} appears twice")
        seen_index.add(device.index)
        if key in high_water:
            raise _Invalid(f"{where}.uuid", f"uuid {device.uuid!r} appears twice")
        top = max((seq for seq, _ in xids), default=0)
        seen = last_xid_seq.get(key, 0)
        if top < seen:  # the writer restarted and numbers its events from 1 again
            seen = 0
        events.extend(e for seq, e in sorted(xids, key=lambda p: p[0]) if seq > seen)
        high_water[key] = top
        devices.append(device)
    devices.sort(key=lambda d: d.index)
    reading = GpuReading(devices=tuple(devices), driver_version=driver, xid_events=tuple(events))
    return ParsedStateFile(reading=reading, xid_seq=tuple(sorted(high_water.items())))


def _parse_device(raw: Any, where: str) -> tuple[GpuDevice, str, list[tuple[int, XidEvent]]]:
    if not isinstance(raw, dict):
        raise _Invalid(where, "expected an object")
    index = _required(_integer(raw, "index", f"{where}.index"), f"{where}.index")
    uuid = _string(raw, "uuid", f"{where}.uuid")
    name = _string(raw, "name", f"{where}.name")
    key = uuid if uuid is not None else f"index:{index}"
    xids: list[tuple[int, XidEvent]] = []
    raw_xids = raw.get("xid_events")
    if raw_xids is not None:
        if not isinstance(raw_xids, list):
            raise _Invalid(f"{where}.xid_events", "expected a list")
        for j, x in enumerate(raw_xids):
            xw = f"{where}.xid_events[{j}]"
            if not isinstance(x, dict):
                raise _Invalid(xw, "expected an object")
            seq = _required(_integer(x, "seq", f"{xw}.seq"), f"{xw}.seq")
            xid = _required(_integer(x, "xid", f"{xw}.xid"), f"{xw}.xid")
            at = _required(_number(x, "time_seconds", f"{xw}.time_seconds"), f"{xw}.time_seconds")
            xids.append((seq, XidEvent(gpu_index=index, xid=xid, time_seconds=at)))
    lost = raw.get("lost", False)
    if not isinstance(lost, bool):
        raise _Invalid(f"{where}.lost", "expected true or false")
    if lost:
        # Like NVML's "GPU is lost": identity is known, nothing measured can be trusted.
        device = GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=None,
            memory_used_bytes=None,
            memory_free_bytes=None,
            error="GPU is lost",
        )
        return device, key, xids
    total = _integer(raw, "memory_total_bytes", f"{where}.memory_total_bytes")
    used = _integer(raw, "memory_used_bytes", f"{where}.memory_used_bytes")
    free = _integer(raw, "memory_free_bytes", f"{where}.memory_free_bytes")
    if total is not None and used is not None:
        if used > total:
            raise _Invalid(f"{where}.memory_used_bytes", "is larger than memory_total_bytes")
        if free is None:
            free = total - used  # the documented derivation, not an invented value
    util = _number(raw, "utilization_ratio", f"{where}.utilization_ratio")
    if util is not None and not 0.0 <= util <= 1.0:
        raise _Invalid(f"{where}.utilization_ratio", "must be between 0 and 1")
    device = GpuDevice(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        utilization_ratio=util,
        temperature_celsius=_number(raw, "temperature_celsius", f"{where}.temperature_celsius"),
        power_watts=_number(raw, "power_watts", f"{where}.power_watts"),
        processes=_parse_processes(raw.get("processes"), f"{where}.processes"),
        remapped_rows_pending=_boolean(raw, "remapped_rows_pending", where),
        remapped_rows_failed=_boolean(raw, "remapped_rows_failed", where),
        retired_pages_pending=_boolean(raw, "retired_pages_pending", where),
    )
    return device, key, xids


def _parse_processes(raw: Any, where: str) -> tuple[GpuProcess, ...] | None:
    if raw is None:
        return None  # the writer would not say, like a driver that does not report processes
    if not isinstance(raw, list):
        raise _Invalid(where, "expected a list")
    by_pid: dict[int, GpuProcess] = {}
    for k, p in enumerate(raw):
        pw = f"{where}[{k}]"
        if not isinstance(p, dict):
            raise _Invalid(pw, "expected an object")
        pid = _required(_integer(p, "pid", f"{pw}.pid"), f"{pw}.pid")
        if pid <= 0:
            raise _Invalid(f"{pw}.pid", "must be a positive process id")
        used = _integer(p, "used_memory_bytes", f"{pw}.used_memory_bytes")
        by_pid[pid] = merge_process(by_pid.get(pid), GpuProcess(pid=pid, used_memory_bytes=used))
    return tuple(by_pid[pid] for pid in sorted(by_pid))


def _required(value: _T | None, path: str) -> _T:
    if value is None:
        raise _Invalid(path, "is required")
    return value


def _integer(obj: dict[str, Any], key: str, path: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Invalid(path, f"expected an integer, got {v!r}")
    if v < 0:
        raise _Invalid(path, f"must not be negative, got {v}")
    return v


def _number(obj: dict[str, Any], key: str, path: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _Invalid(path, f"expected a finite number, got {v!r}")
    return float(v)


def _string(obj: dict[str, Any], key: str, path: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Invalid(path, f"expected a string, got {v!r}")
    return v


def _boolean(obj: dict[str, Any], key: str, where: str) -> bool | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _Invalid(f"{where}.{key}", f"expected true or false, got {v!r}")
    return v


def merge_process(old: GpuProcess | None, new: GpuProcess) -> GpuProcess:
    """One process listed twice (compute and graphics): keep the larger known usage."""
    if old is None:
        return new
    known = [u for u in (old.used_memory_bytes, new.used_memory_bytes) if u is not None]
    return GpuProcess(pid=new.pid, used_memory_bytes=max(known) if known else None)
