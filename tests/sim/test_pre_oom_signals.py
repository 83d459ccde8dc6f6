"""What a real GPU shows before the crash, the twin shows too (docs/twin.md "Before the crash").

Sampled every 2 simulated seconds, as the guardian's sources would read them: activation peaks
in the reported device memory, the allocator plugin's statistics (stranded bytes that creep in
``fragmentation_creep`` and stay flat in ``steady``, retries before the OOM, the OOM counted),
and a neighbour that grows in ``noisy_neighbour``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sim.helpers import ready_engine
from tests.sim.twinproc import start, stop
from vllm_guardian.config import AllocatorSourceConfig
from vllm_guardian.formats import allocator_format as fmt
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.model import AllocatorReading
from vllm_guardian.sim.engine import EnginePhase, SimEngine
from vllm_guardian.sim.load import plan_requests
from vllm_guardian.sim.profiling import GIB
from vllm_guardian.sources.allocator import AllocatorCollector


@dataclass(frozen=True)
class Sample:
    t: float
    free_bytes: int
    activation_bytes: int
    other_bytes: int
    stranded_bytes: int  # reserved − allocated
    inactive_split_bytes: int
    retries: int
    ooms: int


def sampled_run(name: str, seconds: float, *argv: str) -> tuple[SimEngine, list[Sample]]:
    engine = ready_engine("--sim-scenario", name, *argv)
    assert engine.ready_at is not None
    t0 = engine.ready_at
    plan = plan_requests(engine.scenario.load, 0, 100_000, seconds)
    out: list[Sample] = []
    i, t = 0, 0.0
    while t < seconds and engine.phase is not EnginePhase.DEAD:
        t += 2.0
        while i < len(plan) and plan[i].at_seconds <= t:
            engine.advance(t0 + plan[i].at_seconds)
            if engine.accepting:
                engine.add_request(f"r{i}", plan[i].prompt.split(), plan[i].max_tokens)
            i += 1
        engine.advance(t0 + t)
        mem = engine.sampled_breakdown()
        rec = engine.allocator_stats(1, t, 2.0, None)
        assert mem is not None and rec is not None
        out.append(
            Sample(t, mem.free_bytes, mem.activation_bytes, mem.other_processes_bytes,
                   rec.unallocated_bytes, rec.inactive_split_bytes, rec.alloc_retries, rec.ooms)
        )  # fmt: skip
    return engine, out


def test_fragmentation_creep_strands_allocator_bytes_until_the_oom() -> None:
    engine, samples = sampled_run("fragmentation_creep", 200.0)
    assert engine.phase is EnginePhase.DEAD, "fragmentation_creep must still OOM unguarded"
    stranded = [s.stranded_bytes for s in samples]
    assert stranded == sorted(stranded), "stranded bytes only grow while the process lives"
    assert stranded[-1] > 5 * GIB
    assert all(s.inactive_split_bytes == s.stranded_bytes for s in samples)
    # Retries start before the OOM (the late warning), and the OOM is counted.
    first_retry = next(s.t for s in samples if s.retries > 0)
    assert first_retry < samples[-1].t
    assert samples[-1].ooms == 1
    free = [s.free_bytes for s in samples]
    assert free[0] - free[-1] > 5 * GIB


@pytest.mark.parametrize("name", ["steady", "prefix_cache_waste"])
def test_healthy_allocator_stays_flat(name: str) -> None:
    engine, samples = sampled_run(name, 300.0)
    assert engine.phase is EnginePhase.READY
    assert {s.stranded_bytes for s in samples} == {0}
    assert {s.retries for s in samples} == {0}
    assert {s.ooms for s in samples} == {0}


def test_reported_memory_carries_the_steps_activation_peaks() -> None:
    # Each sample holds the step in flight, sized by its batched tokens: a sawtooth, not a line.
    _, samples = sampled_run("steady", 120.0)
    acts = [s.activation_bytes for s in samples]
    assert max(acts) > 10 * min(a for a in acts if a > 0)
    frees = [s.free_bytes for s in samples]
    assert max(frees) - min(frees) == max(acts) - min(acts)
    # A burst of long prompts shows as GiBs of activations in the sample that catches it.
    _, burst = sampled_run("prefill_burst", 60.0, "--max-num-batched-tokens", "8192")
    assert max(s.activation_bytes for s in burst) > 1 * GIB


def test_noisy_neighbour_grows_until_the_oom() -> None:
    engine, samples = sampled_run("noisy_neighbour", 200.0)
    assert engine.phase is EnginePhase.DEAD
    others = [s.other_bytes for s in samples]
    assert others[0] == 0
    grown = [o for o in others if o > 0]
    assert grown == sorted(grown) and grown[-1] - grown[0] > 4 * GIB
    assert {s.stranded_bytes for s in samples} == {0}, "the neighbour is not fragmentation"


@pytest.mark.slow
def test_the_twin_publishes_allocator_files_the_guardian_reads(
    tmp_path: Path, free_port: int
) -> None:
    out = tmp_path / "alloc"
    t = start(tmp_path, free_port, "--sim-scenario", "steady", "--sim-speed", "10",
              env_extra={fmt.ENV_DIR: str(out), fmt.ENV_INTERVAL: "0.2"})  # fmt: skip
    try:
        t.wait_ready()
        collector = AllocatorCollector(AllocatorSourceConfig(directory=str(out)), SystemClock())
        deadline = time.monotonic() + 60
        seen = None
        while time.monotonic() < deadline:
            seen = collector.collect().payload
            if isinstance(seen, AllocatorReading) and seen.processes:
                break
            time.sleep(0.1)
        assert isinstance(seen, AllocatorReading) and seen.processes, f"saw {seen!r}"
        (proc,) = seen.processes
        assert proc.pid == t.proc.pid
        rec = proc.devices[0]
        assert rec.reserved_bytes >= rec.allocated_bytes > 10 * GIB
        assert rec.process_name == "VLLM::EngineCore"
        assert os.path.exists(out / fmt.file_name(t.proc.pid, 0))
    finally:
        stop(t)
