"""Each scenario reproduces its failure on the bare (unguarded) simulation core, fast."""

from __future__ import annotations

import pytest

from tests.sim.helpers import scenario_engine
from vllm_guardian.sim.engine import EnginePhase
from vllm_guardian.sim.profiling import GIB, StartupFailureKind
from vllm_guardian.sim.scenarios import SCENARIOS

CAUSES = {
    "gpu_memory_overcommit", "kv_cache_blowout", "concurrency_overcommit", "prefill_burst",
    "allocator_fragmentation", "prefix_cache_waste", "model_does_not_fit", "engine_dead",
    "engine_input_hang",
    "gpu_hardware_fault", "healthy",
}  # fmt: skip


def test_every_scenario_names_a_cause_of_the_vocabulary() -> None:
    assert len(SCENARIOS) == 13
    for s in SCENARIOS.values():
        assert s.expected_cause in CAUSES
    # A low hit rate is harmless: prefix_cache_waste is a negative control, never the verdict.
    assert SCENARIOS["prefix_cache_waste"].expected_cause == "healthy"


@pytest.mark.parametrize("name", ["prefill_burst", "fragmentation_creep", "noisy_neighbour"])
def test_runtime_oom_kills_the_engine(name: str) -> None:
    engine, _ = scenario_engine(name)
    assert engine.phase is EnginePhase.DEAD
    assert engine.death is not None
    assert engine.death.exception == "torch.OutOfMemoryError"
    lines = [e.message for e in engine.take_logs()]
    oom = [
        m
        for m in lines
        if m.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    ]
    assert len(oom) == 1
    assert "EngineCore encountered a fatal error." in lines
    assert any(
        m.startswith("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue")
        for m in lines
    )
    assert engine.death.exit_at_seconds - engine.death.sim_seconds <= 5.0


def test_prefill_burst_signature_and_its_lever() -> None:
    engine, _ = scenario_engine("prefill_burst")
    assert engine.death is not None and engine.ready_at is not None
    assert engine.death.sim_seconds - engine.ready_at < 10  # the first burst
    assert engine.memory is not None and engine.memory.fragmentation_bytes < 0.1 * GIB
    cured, _ = scenario_engine("prefill_burst", "--max-num-batched-tokens", "8192")
    assert cured.phase is EnginePhase.READY


def test_fragmentation_creep_signature_and_expandable_segments() -> None:
    engine, _ = scenario_engine("fragmentation_creep")
    assert engine.death is not None and engine.ready_at is not None
    assert engine.death.sim_seconds - engine.ready_at > 60  # chronic, not a burst
    assert "GiB is reserved by PyTorch but unallocated" in engine.death.message
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    slow, _ = scenario_engine("fragmentation_creep", env=env)
    assert slow.phase is EnginePhase.READY
    assert slow.memory is not None and 0 < slow.memory.fragmentation_bytes < 1 * GIB


def test_noisy_neighbour_names_the_other_process() -> None:
    engine, _ = scenario_engine("noisy_neighbour")
    assert engine.death is not None
    nb = SCENARIOS["noisy_neighbour"].neighbour
    assert nb is not None
    assert f"Process {nb.pid} has" in engine.death.message


def test_kv_thrash_thrashes_without_crashing() -> None:
    engine, peak = scenario_engine("kv_thrash", seconds=60.0)
    st = engine.stats
    assert engine.phase is EnginePhase.READY
    assert st.num_preemptions > 50
    assert peak["waiting"] > 100 and st.num_requests_waiting > 100
    assert st.kv_cache_usage_ratio > 0.9
    assert peak["running"] < 100  # far below max_num_seqs 1024: the pool is the limit


def test_engine_hang_stops_progress_but_stays_alive() -> None:
    engine, _ = scenario_engine("engine_hang", seconds=60.0)
    assert engine.phase is EnginePhase.HUNG
    assert engine.death is None
    tokens = engine.stats.generation_tokens
    running = engine.stats.num_requests_running
    engine.advance(engine.now + 60.0)
    assert engine.stats.generation_tokens == tokens
    assert running > 0 and engine.num_unfinished > running  # work is waiting, nothing moves


def test_exit_zero_death() -> None:
    engine, _ = scenario_engine("exit_zero_death", seconds=40.0)
    assert engine.phase is EnginePhase.DEAD
    assert engine.death is not None and engine.death.exception == "SystemExit"
    assert SCENARIOS["exit_zero_death"].forced_exit_code == 0
    engine.advance(engine.death.exit_at_seconds)
    assert engine.exit_due()


def test_xid_fault_records_the_xid_and_kills_the_engine() -> None:
    engine, _ = scenario_engine("xid_fault", seconds=40.0)
    assert [x.xid for x in engine.xid_events] == [48]
    assert engine.phase is EnginePhase.DEAD
    assert engine.death is not None and "uncorrectable ECC error" in engine.death.message


def test_startup_overcommit_fails_start_up() -> None:
    engine, _ = scenario_engine("startup_overcommit")
    assert engine.phase is EnginePhase.FAILED_STARTUP
    assert engine.startup_failure is not None
    assert engine.startup_failure.kind is StartupFailureKind.FREE_MEMORY_BELOW_REQUEST
    lines = [e.message for e in engine.take_logs()]
    assert any(m.startswith("ValueError: Free memory on device cuda:0") for m in lines)
    assert any("Engine core initialization failed" in m for m in lines)
    lowered, _ = scenario_engine(
        "startup_overcommit", "--gpu-memory-utilization", "0.8", seconds=10.0
    )
    assert lowered.phase is EnginePhase.READY


@pytest.mark.parametrize("name", ["steady", "prefix_cache_waste"])
def test_healthy_scenarios_stay_healthy(name: str) -> None:
    engine, peak = scenario_engine(name, seconds=200.0)
    st = engine.stats
    assert engine.phase is EnginePhase.READY
    assert st.num_preemptions == 0
    assert peak["waiting"] < 5
    assert st.kv_cache_usage_ratio < 0.2
    mem = engine.memory_breakdown()
    assert mem is not None and mem.free_bytes > 4 * GIB
    hit_rate = st.prefix_cache_hits / st.prefix_cache_queries
    if name == "prefix_cache_waste":
        assert hit_rate < 0.05  # low hit rate, and nothing is wrong
    else:
        assert hit_rate > 0.15


def test_runs_are_deterministic() -> None:
    a, _ = scenario_engine("kv_thrash", seconds=20.0)
    b, _ = scenario_engine("kv_thrash", seconds=20.0)
    assert (a.stats.num_preemptions, a.stats.generation_tokens, a.now) == (
        b.stats.num_preemptions, b.stats.generation_tokens, b.now,
    )  # fmt: skip
