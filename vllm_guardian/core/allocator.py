"""Allocator signals: the in-vLLM plugin's records attributed to services and reduced. Pure.

* :func:`attribute` keeps the processes of one service: the unit's pids, their descendants or
  the unit's cgroup, the same test ``core/signals.belongs_to`` applies to GPU processes. The
  daemon calls it in ``assemble``, so a :class:`ServiceSnapshot` holds only its own processes.
* :func:`physical_gpu` maps a process's CUDA device index to the host's GPU index through the
  process's ``CUDA_VISIBLE_DEVICES`` (indices, or GPU-/MIG- UUIDs matched against NVML).
* :func:`allocator_fields` derives, per GPU and for the service: reserved, allocated,
  reserved − allocated, inactive-split bytes, the fragmentation ratio (inactive-split /
  reserved), allocator retries per second and the OOM count delta within the rate window.
  Counters follow Prometheus ``rate()``: a drop (or a new pid) is a restart and counts from
  zero; a series needs two readings in the window, and a process's first reading is its
  baseline, so days of retries are not mistaken for a burst when the guardian starts.

No I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_guardian.formats.allocator_format import AllocatorStats
from vllm_guardian.model import (
    AllocatorReading,
    GpuReading,
    Snapshot,
    UnitState,
)


@dataclass(frozen=True)
class AllocatorGpuSignals:
    """One service's allocator on one GPU (summed over its processes there)."""

    gpu: int
    processes: int
    reserved_bytes: int
    allocated_bytes: int
    unallocated_bytes: int  # reserved − allocated
    inactive_split_bytes: int
    fragmentation_ratio: float | None  # inactive-split / reserved; None when nothing reserved
    retries_per_second: float | None  # None: fewer than two readings in the window
    recent_ooms: int | None  # num_ooms increase within the window
    alloc_retries: int  # cumulative, current processes (a counter that resets with them)
    ooms: int


def owned_by(pid: int, ancestors: Sequence[int], cgroup: str | None, unit: UnitState) -> bool:
    pids = set(unit.pids)
    if unit.main_pid is not None:
        pids.add(unit.main_pid)
    if pid in pids or any(a in pids for a in ancestors):
        return True
    cg = unit.control_group
    if cg and cg != "/" and cgroup:
        return cgroup == cg or cgroup.startswith(cg.rstrip("/") + "/")
    return False


def attribute(reading: AllocatorReading, unit: UnitState | None) -> AllocatorReading | None:
    """The part of a host-wide reading that belongs to the service of ``unit``."""
    if unit is None:
        return None
    mine = tuple(p for p in reading.processes if owned_by(p.pid, p.ancestors, p.cgroup, unit))
    return AllocatorReading(mine, reading.stale_files, reading.unparsable_files)


def physical_gpu(rec: AllocatorStats, gpus: GpuReading | None) -> int:
    visible = (rec.cuda_visible_devices or "").strip()
    if not visible:
        return rec.device
    entries = [e.strip() for e in visible.split(",")]
    if rec.device >= len(entries):
        return rec.device
    entry = entries[rec.device]
    if entry.isdigit():
        return int(entry)
    for d in gpus.devices if gpus is not None else ():
        if d.uuid and (d.uuid == entry or d.uuid.startswith(entry)):
            return d.index
    return rec.device


_Key = tuple[int, int]  # (pid, physical gpu)


def _series(window: Sequence[Snapshot], service: str) -> dict[_Key, dict[float, tuple[int, int]]]:
    """Per (pid, gpu): record time → (alloc_retries, ooms), deduplicated (ticks outpace files)."""
    out: dict[_Key, dict[float, tuple[int, int]]] = {}
    for snap in window:
        svc = snap.service(service)
        if svc is None or svc.allocator is None:
            continue
        for proc in svc.allocator.processes:
            for rec in proc.devices:
                key = (rec.pid, physical_gpu(rec, snap.gpus))
                out.setdefault(key, {})[rec.time_seconds] = (rec.alloc_retries, rec.ooms)
    return out


def _increase(values: Sequence[int]) -> int:
    total = 0
    for prev, cur in itertools.pairwise(values):
        total += cur if cur < prev else cur - prev
    return total


def allocator_fields(
    history: Sequence[Snapshot], service: str, window_seconds: float
) -> dict[str, object]:
    """The allocator fields of ``ServiceSignals`` for the newest snapshot (empty: no data)."""
    now = history[-1]
    cur = now.service(service)
    if cur is None or cur.allocator is None or not cur.allocator.processes:
        return {}
    window = [s for s in history if s.time_seconds >= now.time_seconds - window_seconds - 1e-9]
    series = _series(window, service)
    by_gpu: dict[int, list[AllocatorStats]] = {}
    for proc in cur.allocator.processes:
        for rec in proc.devices:
            by_gpu.setdefault(physical_gpu(rec, now.gpus), []).append(rec)
    gpus: list[AllocatorGpuSignals] = []
    for gpu, recs in sorted(by_gpu.items()):
        rates: list[float] = []
        ooms: list[int] = []
        # Every process seen on this GPU within the window, ended ones too: sum(rate()).
        for key in sorted(k for k in series if k[1] == gpu):
            points = sorted(series[key].items())
            if len(points) < 2 or points[-1][0] <= points[0][0]:
                continue
            span = points[-1][0] - points[0][0]
            rates.append(_increase([r for _, (r, _) in points]) / span)
            ooms.append(_increase([o for _, (_, o) in points]))
        reserved = sum(r.reserved_bytes for r in recs)
        allocated = sum(r.allocated_bytes for r in recs)
        inactive = sum(r.inactive_split_bytes for r in recs)
        gpus.append(
            AllocatorGpuSignals(
                gpu=gpu,
                processes=len(recs),
                reserved_bytes=reserved,
                allocated_bytes=allocated,
                unallocated_bytes=max(0, reserved - allocated),
                inactive_split_bytes=inactive,
                fragmentation_ratio=min(1.0, inactive / reserved) if reserved > 0 else None,
                retries_per_second=sum(rates) if rates else None,
                recent_ooms=sum(ooms) if ooms else None,
                alloc_retries=sum(r.alloc_retries for r in recs),
                ooms=sum(r.ooms for r in recs),
            )
        )
    ratios = [g.fragmentation_ratio for g in gpus if g.fragmentation_ratio is not None]
    rates_all = [g.retries_per_second for g in gpus if g.retries_per_second is not None]
    ooms_all = [g.recent_ooms for g in gpus if g.recent_ooms is not None]
    return {
        "allocator": tuple(gpus),
        "allocator_reserved_bytes": sum(g.reserved_bytes for g in gpus),
        "allocator_allocated_bytes": sum(g.allocated_bytes for g in gpus),
        "allocator_unallocated_bytes": sum(g.unallocated_bytes for g in gpus),
        # The worst GPU: one fragmented rank is enough to OOM the whole tensor-parallel group.
        "allocator_fragmentation_ratio": max(ratios) if ratios else None,
        "allocator_retries_per_second": sum(rates_all) if rates_all else None,
        "allocator_recent_ooms": sum(ooms_all) if ooms_all else None,
    }
