"""The service's GPUs' signals (part of ``core/signals.derive_service``): which processes belong
to the service, its memory against its budget, the headroom and its slope, XID events, and the
device-memory exhaustion forecast's inputs."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.allocator import physical_gpu
from vllm_guardian.core.forecast import (
    ForecastSettings,
    MemorySample,
    Neighbour,
    forecast,
)
from vllm_guardian.core.series import slope, sum_int, window_of
from vllm_guardian.core.signal_records import ServiceGpuSignals
from vllm_guardian.model import (
    Cause,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthState,
    ServiceSnapshot,
    Snapshot,
    UnitState,
)


def belongs_to(proc: GpuProcess, unit: UnitState | None) -> bool:
    if unit is None:
        return False
    pids = set(unit.pids)
    if unit.main_pid is not None:
        pids.add(unit.main_pid)
    if proc.pid in pids or any(a in pids for a in proc.ancestors):
        return True
    cg = unit.control_group
    if cg and cg != "/" and proc.cgroup:
        return proc.cgroup == cg or proc.cgroup.startswith(cg.rstrip("/") + "/")
    return False


def in_budget(proc: GpuProcess, unit: UnitState | None) -> bool:
    """Whether ``proc``'s GPU memory counts as the service's: its own processes, and vLLM's
    weight-cache daemon (``vllm preload``), whose weights vLLM subtracts from the budget of an
    engine started with ``--load-format ipc_cache``: never a hostile neighbour. Which GPUs are
    the service's is still told by its own processes only (:func:`belongs_to`)."""
    return proc.weight_cache or belongs_to(proc, unit)


def _service_gpus(
    devices: Sequence[GpuDevice], svc: ServiceConfig, unit: UnitState | None
) -> list[GpuDevice]:
    if svc.gpus is not None:
        wanted = set(svc.gpus)
        return [d for d in devices if d.index in wanted]
    if svc.gpu_memory_by_device:  # a pod: every GPU it sees is its own
        return list(devices)
    return [d for d in devices if d.processes and any(belongs_to(p, unit) for p in d.processes)]


def _gpu_signals(
    devices: Sequence[GpuDevice],
    unit: UnitState | None,
    utilization: float | None,
    by_device: bool = False,
) -> tuple[ServiceGpuSignals, ...]:
    out = []
    for d in devices:
        mine: int | None = None
        other: int | None = None
        if by_device:
            # NVML's pids are the host's (services[].gpu_memory_by_device): the device's
            # memory in use is the service's, nobody else's.
            mine, other = d.memory_used_bytes, 0
        elif d.processes is not None:
            mine_sum = other_sum = 0
            unknown = False
            for p in d.processes:
                if p.used_memory_bytes is None:
                    unknown = True
                    continue
                if in_budget(p, unit):
                    mine_sum += p.used_memory_bytes
                else:
                    other_sum += p.used_memory_bytes
            mine = None if unknown and mine_sum == 0 else mine_sum
            other = other_sum
        budget = (
            int(utilization * d.memory_total_bytes)
            if utilization is not None and d.memory_total_bytes is not None
            else None
        )
        out.append(
            ServiceGpuSignals(
                d.index, mine, other, budget, d.memory_free_bytes, d.memory_total_bytes
            )
        )
    return tuple(out)


def _kept_headroom(snap: Snapshot, indices: set[int], frozen: frozenset[int]) -> int | None:
    """:func:`_headroom`, computed once per snapshot and set of GPUs (``frozen``: the same
    indices, as the memo's key): the slope's window is read whole on every tick."""
    key = ("headroom", frozen)
    memo = snap.memo
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    h = memo[key] = _headroom(snap, indices)
    return h


def _headroom(snap: Snapshot, indices: set[int]) -> int | None:
    if snap.gpus is None or not indices:
        return None
    free = [d.memory_free_bytes for d in snap.gpus.devices if d.index in indices]
    if not free or any(f is None for f in free):
        return None
    return min(f for f in free if f is not None)


def gpu_fields(
    history: Sequence[Snapshot],
    rate_win: Sequence[Snapshot],
    svc: ServiceConfig,
    cfg: SignalsConfig,
    cur: ServiceSnapshot,
    gpus_seen: GpuReading,
    utilization: float | None,
) -> dict[str, object]:
    """The service's GPUs' signals (part of :func:`derive_service`): memory, headroom, XIDs
    and the exhaustion forecast."""
    fields: dict[str, object] = {}
    devices = _service_gpus(gpus_seen.devices, svc, cur.unit)
    gpus = _gpu_signals(devices, cur.unit, utilization, svc.gpu_memory_by_device)
    indices = {d.index for d in devices}
    service_mem = sum_int([g.service_memory_bytes for g in gpus]) if gpus else None
    budget = sum_int([g.budget_bytes for g in gpus]) if gpus else None
    frozen = frozenset(indices)
    slope_points = [
        (snap.time_seconds, float(h))
        for snap in window_of(history, cfg.slope_window_seconds)
        if (h := _kept_headroom(snap, indices, frozen)) is not None
    ]
    fields.update(
        gpus=gpus,
        gpu_memory_by_device=svc.gpu_memory_by_device,
        memory_budget_bytes=budget,
        service_memory_bytes=service_mem,
        memory_over_budget_bytes=(
            max(0, service_mem - budget) if service_mem is not None and budget is not None else None
        ),
        other_processes_memory_bytes=sum_int([g.other_memory_bytes for g in gpus])
        if gpus
        else None,
        headroom_bytes=_headroom(history[-1], indices),
        headroom_slope_bytes_per_second=slope(slope_points),
        recent_xid_events=_recent_xids(rate_win, indices),
    )
    fields.update(_forecast_fields(history, svc, cfg, sorted(indices), utilization))
    return fields


def forecast_settings(cfg: SignalsConfig) -> ForecastSettings:
    return ForecastSettings(
        interval_seconds=cfg.forecast_interval_seconds,
        min_intervals=cfg.forecast_min_intervals,
        min_span_seconds=cfg.forecast_min_span_seconds,
        max_gap_seconds=cfg.forecast_max_gap_seconds,
    )


def _memory_columns(
    history: Sequence[Snapshot], service: str, gpus: Sequence[int], utilization: float | None
) -> dict[int, list[MemorySample]]:
    """Each GPU of a service, per snapshot, as the forecast reads it (None: not observed), in
    one pass over the snapshots: each snapshot keeps its row (one sample per GPU) in its memo,
    computed once (the window is read whole on every tick), and the rows are turned into
    columns."""
    order = tuple(gpus)
    key = ("memory_samples", service, utilization, order)
    rows = []
    for snap in history:
        memo = snap.memo
        row = memo.get(key)
        if row is None:
            row = memo[key] = tuple(
                [_memory_sample(snap, service, gpu, utilization) for gpu in order]
            )
        rows.append(row)
    if not rows:
        return {gpu: [] for gpu in order}
    columns = zip(*rows, strict=True)
    return {gpu: list(column) for gpu, column in zip(order, columns, strict=True)}


def _memory_sample(
    snap: Snapshot, service: str, gpu: int, utilization: float | None
) -> MemorySample:
    svc = snap.service(service) or ServiceSnapshot(service)
    unit = svc.unit
    ready = svc.health is not None and svc.health.state is HealthState.UP
    generation: float | None = None
    if svc.vllm is not None and svc.vllm.process_start_time_seconds is not None:
        generation = svc.vllm.process_start_time_seconds
    elif unit is not None and unit.main_pid is not None:
        generation = float(unit.main_pid)
    dev = next((d for d in snap.gpus.devices if d.index == gpu), None) if snap.gpus else None
    free = dev.memory_free_bytes if dev is not None else None
    mine: int | None = None
    other: int | None = None
    neighbours: tuple[Neighbour, ...] = ()
    if dev is not None and dev.processes is not None:
        procs = [p for p in dev.processes if p.used_memory_bytes is not None]
        mine = sum(p.used_memory_bytes or 0 for p in procs if in_budget(p, unit))
        others = [p for p in procs if not in_budget(p, unit)]
        other = sum(p.used_memory_bytes or 0 for p in others)
        neighbours = tuple(Neighbour(p.pid, p.used_memory_bytes, p.name, p.cgroup) for p in others)
    reserved: int | None = None
    allocated: int | None = None
    if svc.allocator is not None and svc.allocator.processes:
        recs = [
            r
            for proc in svc.allocator.processes
            for r in proc.devices
            if physical_gpu(r, snap.gpus) == gpu
        ]
        if recs:
            reserved = sum(r.reserved_bytes for r in recs)
            allocated = sum(r.allocated_bytes for r in recs)
    budget = (
        int(utilization * dev.memory_total_bytes)
        if utilization is not None and dev is not None and dev.memory_total_bytes is not None
        else None
    )
    return MemorySample(
        time_seconds=snap.time_seconds,
        free_bytes=free,
        ready=ready,
        generation=generation,
        service_bytes=mine,
        other_bytes=other,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        budget_bytes=budget,
        neighbours=neighbours,
    )


_CAUSE_FIELDS = {
    Cause.ALLOCATOR_FRAGMENTATION: "seconds_to_exhaustion_allocator_fragmentation",
    Cause.GPU_MEMORY_OVERCOMMIT: "seconds_to_exhaustion_gpu_memory_overcommit",
    Cause.PREFILL_BURST: "seconds_to_exhaustion_prefill_burst",
}


def _forecast_fields(
    history: Sequence[Snapshot],
    svc: ServiceConfig,
    cfg: SignalsConfig,
    gpus: Sequence[int],
    utilization: float | None,
) -> dict[str, object]:
    window = window_of(history, cfg.forecast_window_seconds)
    settings = forecast_settings(cfg)
    now = history[-1].time_seconds
    columns = _memory_columns(window, svc.name, gpus, utilization)
    found = [f for gpu in gpus if (f := forecast(gpu, columns[gpu], now, settings)) is not None]
    if not found:
        return {}
    worst = min(found, key=lambda f: f.seconds)
    fields: dict[str, object] = {
        "forecasts": tuple(found),
        "seconds_to_headroom_exhaustion": worst.seconds,
        "headroom_exhaustion_latest_seconds": worst.seconds_latest,
        "forecast_cause": worst.cause,
    }
    if worst.cause in _CAUSE_FIELDS:
        fields[_CAUSE_FIELDS[worst.cause]] = worst.seconds
    return fields


def _recent_xids(window: Sequence[Snapshot], gpus: set[int]) -> tuple[tuple[int, int, int], ...]:
    counts: dict[tuple[int, int], int] = {}
    for snap in window:
        for ev in snap.gpus.xid_events if snap.gpus is not None else ():
            if not gpus or ev.gpu_index in gpus:
                counts[(ev.gpu_index, ev.xid)] = counts.get((ev.gpu_index, ev.xid), 0) + 1
    return tuple(sorted((g, x, n) for (g, x), n in counts.items()))
