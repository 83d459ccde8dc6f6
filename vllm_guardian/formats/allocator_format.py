"""The allocator file format: the contract between the in-vLLM plugin and the guardian.

The plugin (:mod:`vllm_guardian.plugin`, inside vLLM's processes, next to torch) writes one
JSON file per (process, CUDA device) into the directory named by :data:`ENV_DIR`; the
guardian's allocator source reads them without importing torch. Both sides use this module
and nothing else to build, encode and decode a record, so the format cannot drift. Standard
library only: the plugin must stay cheap to import and the daemon must never pull in torch.

A file (``<pid>-<device>.json``, replaced atomically) looks like::

    {"schema": "vllm-guardian.allocator/1", "pid": 4250, "device": 0,
     "time_seconds": 1795306080.0, "interval_seconds": 5.0,
     "allocated_bytes": ..., "allocated_peak_bytes": ..., "reserved_bytes": ...,
     "reserved_peak_bytes": ..., "active_bytes": ..., "active_peak_bytes": ...,
     "inactive_split_bytes": ..., "inactive_split_peak_bytes": ...,
     "alloc_retries": 0, "ooms": 0, "segments": 12, "largest_free_block_bytes": null,
     "alloc_conf": "expandable_segments:True", "process_name": "VLLM::EngineCore",
     "cuda_visible_devices": "2,3"}

Counters (``alloc_retries``, ``ooms``) are cumulative for the life of the process, as torch
keeps them. A reader accepts unknown extra keys (a newer plugin may add some) but not a
different schema major version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SCHEMA = "vllm-guardian.allocator/1"
# The plugin is idle unless this names a directory (the guardian's vLLM drop-in sets it).
ENV_DIR = "VLLM_GUARDIAN_ALLOCATOR_DIR"
# How often the plugin publishes; optional, DEFAULT_INTERVAL_SECONDS when unset.
ENV_INTERVAL = "VLLM_GUARDIAN_ALLOCATOR_INTERVAL_SECONDS"
# Every 5 s: a trend over days needs no more, and the guardian's 30 s rate window sees 6 points.
DEFAULT_INTERVAL_SECONDS = 5.0
# A record is ~600 bytes; anything far bigger is not one of ours.
MAX_FILE_BYTES = 64 * 1024

_FILE_NAME = re.compile(r"^(?P<pid>[1-9][0-9]{0,9})-(?P<device>[0-9]{1,4})\.json$")

# torch.cuda.memory_stats() key → record field.
STATS_KEYS: Mapping[str, str] = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "allocated_peak_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "reserved_peak_bytes",
    "active_bytes.all.current": "active_bytes",
    "active_bytes.all.peak": "active_peak_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "inactive_split_bytes.all.peak": "inactive_split_peak_bytes",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
    "segment.all.current": "segments",
}


class FormatError(ValueError):
    """The bytes are not a record of this schema (the reason says which part)."""


@dataclass(frozen=True)
class AllocatorStats:
    """PyTorch's CUDA caching allocator in one process on one device, at one moment."""

    pid: int
    device: int  # the CUDA device index as the process sees it
    time_seconds: float  # Unix time of the reading
    interval_seconds: float  # how often the plugin publishes
    allocated_bytes: int
    allocated_peak_bytes: int
    reserved_bytes: int
    reserved_peak_bytes: int
    active_bytes: int
    active_peak_bytes: int
    inactive_split_bytes: int  # free fragments inside split blocks: not releasable
    inactive_split_peak_bytes: int
    alloc_retries: int  # cudaMalloc failed, the cache was flushed and the call retried
    ooms: int  # the allocator raised OutOfMemoryError
    segments: int  # cudaMalloc'd segments held by the cache
    largest_free_block_bytes: int | None = None  # only when cheap to get; None otherwise
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF of the process
    process_name: str | None = None  # e.g. VLLM::EngineCore, VLLM::Worker_TP1
    # CUDA_VISIBLE_DEVICES of the process: maps ``device`` to the physical GPU (an index or a
    # GPU-/MIG- UUID per entry); None: device is the physical index.
    cuda_visible_devices: str | None = None

    @property
    def unallocated_bytes(self) -> int:
        """Reserved by the cache but not handed out: what fragmentation can strand."""
        return max(0, self.reserved_bytes - self.allocated_bytes)

    @property
    def fragmentation_ratio(self) -> float | None:
        """inactive-split / reserved: the share of the cache stranded in split blocks."""
        if self.reserved_bytes <= 0:
            return None
        return min(1.0, self.inactive_split_bytes / self.reserved_bytes)


def file_name(pid: int, device: int) -> str:
    return f"{pid}-{device}.json"


def parse_file_name(name: str) -> tuple[int, int] | None:
    """``4250-0.json`` → (4250, 0); None for any other name (temporary files included)."""
    m = _FILE_NAME.match(name)
    if m is None:
        return None
    return int(m.group("pid")), int(m.group("device"))


def from_memory_stats(
    stats: Mapping[str, Any],
    *,
    pid: int,
    device: int,
    time_seconds: float,
    interval_seconds: float,
    alloc_conf: str | None = None,
    process_name: str | None = None,
    cuda_visible_devices: str | None = None,
    largest_free_block_bytes: int | None = None,
) -> AllocatorStats | None:
    """Build a record from ``torch.cuda.memory_stats(device)``; None when it is empty (no CUDA,
    or a device the process never allocated on) or lacks a key."""
    values: dict[str, int] = {}
    for key, name in STATS_KEYS.items():
        v = stats.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return None
        values[name] = int(v)
    return AllocatorStats(
        pid=pid,
        device=device,
        time_seconds=float(time_seconds),
        interval_seconds=float(interval_seconds),
        largest_free_block_bytes=largest_free_block_bytes,
        alloc_conf=alloc_conf,
        process_name=process_name,
        cuda_visible_devices=cuda_visible_devices,
        **values,
    )


def encode(record: AllocatorStats) -> bytes:
    body = {"schema": SCHEMA, **dataclasses.asdict(record)}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> AllocatorStats:
    """Parse one file's bytes. Raises :class:`FormatError` with a short reason."""
    if len(data) > MAX_FILE_BYTES:
        raise FormatError(f"{len(data)} bytes, more than a record can be")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise FormatError("not a JSON object")
    schema = doc.get("schema")
    if schema != SCHEMA:
        raise FormatError(f"schema {schema!r}, expected {SCHEMA!r}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(AllocatorStats):
        v = doc.get(f.name)
        optional = f.default is None
        if v is None:
            if not optional:
                raise FormatError(f"{f.name} is missing")
            kwargs[f.name] = None
        elif f.type == "str | None":
            if not isinstance(v, str):
                raise FormatError(f"{f.name} is not a string")
            kwargs[f.name] = v[:256]
        elif f.type == "float":
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise FormatError(f"{f.name} is not a finite number")
            kwargs[f.name] = float(v)
        else:  # the integers: pid, device, the byte counts and counters
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FormatError(f"{f.name} is not a non-negative integer")
            kwargs[f.name] = v
    return AllocatorStats(**kwargs)
