"""A fixed, realistic tick built from the real vLLM captures, for golden and end-to-end tests."""

from __future__ import annotations

from tests.conftest import read_fixture
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.signals import Signals, derive
from vllm_guardian.formats.allocator_format import AllocatorStats
from vllm_guardian.model import (
    AllocatorProcess,
    AllocatorReading,
    GateObservation,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthProbe,
    HealthState,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    SourceKind,
    SourceStatus,
    UnitState,
    XidEvent,
)
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

GIB = 1024**3
T0 = 1795306080.0

UNIT = UnitState(
    unit="vllm.service",
    active_state="active",
    sub_state="running",
    result="success",
    main_pid=4242,
    n_restarts=2,
    exec_main_status=0,
    active_enter_monotonic_seconds=1234.5,
    control_group="/system.slice/vllm.service",
    cmdline=("vllm", "serve", "tiny-llama", "--api-key", "***"),
    pids=(4242, 4250),
)


def gpus(free_gib: float, xids: tuple[XidEvent, ...] = ()) -> GpuReading:
    total = 80 * GIB
    used = total - int(free_gib * GIB)
    procs = (
        GpuProcess(4250, 70 * GIB, "python3", "/system.slice/vllm.service", (4242, 1)),
        GpuProcess(9001, 3 * GIB, "other", "/user.slice", (1,)),
    )
    return GpuReading(
        (
            GpuDevice(
                0,
                "GPU-0",
                "NVIDIA H100 80GB HBM3",
                total,
                used,
                total - used,
                0.93,
                61.0,
                412.5,
                procs,
                False,
                False,
                False,
            ),
            GpuDevice(1, "GPU-1", "NVIDIA H100 80GB HBM3", total, None, None, error="GPU is lost"),
        ),
        "550.54.15",
        xids,
    )


def allocator(t: float, retries: int) -> AllocatorReading:
    """The EngineCore's allocator on GPU 0 as the in-vLLM plugin publishes it (a file 1 s old)."""
    rec = AllocatorStats(
        pid=4250,
        device=0,
        time_seconds=t - 1.0,
        interval_seconds=5.0,
        allocated_bytes=12 * GIB,
        allocated_peak_bytes=14 * GIB,
        reserved_bytes=20 * GIB,
        reserved_peak_bytes=20 * GIB,
        active_bytes=13 * GIB,
        active_peak_bytes=15 * GIB,
        inactive_split_bytes=7 * GIB,
        inactive_split_peak_bytes=7 * GIB,
        alloc_retries=retries,
        ooms=0,
        segments=180,
        alloc_conf=None,
        process_name="VLLM::EngineCore",
    )
    proc = AllocatorProcess(4250, (rec,), "/system.slice/vllm.service", (4242, 1))
    return AllocatorReading((proc,))


def snapshots() -> list[Snapshot]:
    out = []
    for i, (name, free) in enumerate(
        [("metrics-pressure-04.prom", 7.0), ("metrics-pressure-07.prom", 6.0)]
    ):
        t = T0 + 3 * i
        logs = LogReading(((LogEventKind.CUDA_OOM, 1), (LogEventKind.ENGINE_DEAD, 1)), (), 1200)
        svc = ServiceSnapshot(
            "vllm",
            vllm=parse_vllm_metrics(read_fixture(name)),
            health=HealthProbe(HealthState.UP, 200, 0.004),
            unit=UNIT,
            logs=logs,
            allocator=allocator(t, 10 + 3 * i),
            gate=GateObservation(True, in_flight=3 + i, queued=i, open=i == 0, reason="open"),
        )
        sources = tuple(
            SourceStatus(
                k, None if k in (SourceKind.NVML, SourceKind.ALLOCATOR) else "vllm", True, 0.01
            )
            for k in SourceKind
        )
        xids = (XidEvent(0, 79, t),) if i == 1 else ()
        out.append(Snapshot(t, (svc,), gpus(free, xids), sources))
    return out


def signals_for(history: list[Snapshot]) -> Signals:
    return derive(history, [ServiceConfig(name="vllm", unit="vllm.service")], SignalsConfig())
