"""The list of sources: one line each. Adding a source means its module, a line here, its
config section under ``sources:`` and its tests."""

from __future__ import annotations

from pathlib import Path

from vllm_guardian.config import Config
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.sources.allocator import AllocatorCollector
from vllm_guardian.sources.base import Collector
from vllm_guardian.sources.gate import GateCollector
from vllm_guardian.sources.health import HealthCollector
from vllm_guardian.sources.logs import LogsCollector
from vllm_guardian.sources.nvml import NvmlCollector
from vllm_guardian.sources.unit import UnitCollector
from vllm_guardian.sources.vllm_metrics import VllmMetricsCollector


def build_collectors(cfg: Config, clock: Clock) -> list[Collector]:
    """Every collector the config asks for: per service first, then host-wide ones."""
    src = cfg.sources
    out: list[Collector] = []
    for svc in cfg.services:
        out.append(VllmMetricsCollector(svc, src.vllm_metrics))
        out.append(HealthCollector(svc, src.health, clock))
        if src.unit.enabled:
            # The process backend's supervisor writes the pid of the vLLM it starts here
            # (actuators/procmgr.py, healing.py): how a loading vLLM is seen without a unit.
            supervised = cfg.policy.backend == "process" and bool(svc.command)
            pid_file = Path(cfg.state_dir) / f"{svc.name}.pid" if supervised else None
            out.append(UnitCollector(svc, src.unit, clock=clock, pid_file=pid_file))
        if src.logs.enabled and (svc.unit or svc.log_file):
            out.append(LogsCollector(svc, src.logs, clock))
        if svc.gate is not None:
            out.append(GateCollector(svc, svc.gate, src.gate))
    if src.nvml.enabled:
        out.append(NvmlCollector(src.nvml, clock, interval_seconds=cfg.interval_seconds))
    if src.allocator.enabled:
        out.append(AllocatorCollector(src.allocator, clock))
    return out
