"""Helpers for the twin's tests: build an engine from flags, feed it a plan on a stepped clock."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_guardian.sim.engine import EnginePhase, SimEngine
from vllm_guardian.sim.flags import ServeOptions, parse_serve_args
from vllm_guardian.sim.load import PlannedRequest, plan_requests


def options(*argv: str, env: dict[str, str] | None = None) -> ServeOptions:
    return parse_serve_args(list(argv), env or {})


def ready_engine(*argv: str, env: dict[str, str] | None = None) -> SimEngine:
    opts = options(*argv, env=env)
    engine = SimEngine(opts.model, opts.engine, opts.scenario, opts.gpu_memory_bytes, opts.seed)
    engine.advance(engine.startup_seconds)
    return engine


def drive(
    engine: SimEngine,
    plan: Sequence[PlannedRequest],
    until_seconds: float,
    ignore_eos: bool = True,
) -> dict[str, int]:
    """Feed ``plan`` at its times (relative to readiness) and run to ``until_seconds`` after it.

    Returns the largest values seen of the waiting queue and running batch.
    """
    assert engine.ready_at is not None
    t0 = engine.ready_at
    peak = {"waiting": 0, "running": 0}
    for p in plan:
        if p.at_seconds > until_seconds:
            break
        engine.advance(t0 + p.at_seconds)
        if engine.phase is EnginePhase.DEAD:
            break
        if engine.accepting:
            engine.add_request(f"r{p.index}", p.prompt.split(), p.max_tokens, ignore_eos)
        peak["waiting"] = max(peak["waiting"], engine.stats.num_requests_waiting)
        peak["running"] = max(peak["running"], engine.stats.num_requests_running)
    engine.advance(t0 + until_seconds)
    return peak


def scenario_engine(
    name: str, *argv: str, seconds: float = 150.0, env: dict[str, str] | None = None
) -> tuple[SimEngine, dict[str, int]]:
    engine = ready_engine("--sim-scenario", name, *argv, env=env)
    if engine.phase is not EnginePhase.READY:
        return engine, {}
    plan = plan_requests(engine.scenario.load, 0, 3000, seconds)
    return engine, drive(engine, plan, seconds)
