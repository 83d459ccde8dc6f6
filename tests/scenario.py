"""A fixed, realistic tick built from the real vLLM captures, for golden and end-to-end tests."""

from __future__ import annotations

from tests.conftest import read_fixture
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.signals import Signals, derive
from vllm_guardian.model import (
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
        )
        sources = tuple(
            SourceStatus(k, None if k is SourceKind.NVML else "vllm", True, 0.01)
            for k in SourceKind
        )
        xids = (XidEvent(0, 79, t),) if i == 1 else ()
        out.append(Snapshot(t, (svc,), gpus(free, xids), sources))
    return out


def signals_for(history: list[Snapshot]) -> Signals:
    return derive(history, [ServiceConfig(name="vllm", unit="vllm.service")], SignalsConfig())
