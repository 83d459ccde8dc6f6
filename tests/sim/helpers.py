"""Helpers for the twin's tests: build an engine from flags, feed it a plan on a stepped clock."""

from __future__ import annotations

import random
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


# Shape A of the KV-thrash measurement (docs/capacity.md): a 16-block pool of 128 tokens
# (15 usable) on the tiny model, chunked prefill with 2048 batched tokens.
SHAPE_A = (
    "--sim-model", "tiny", "--block-size", "128", "--kv-cache-memory-bytes", str(16 * 128 * 512),
    "--enable-chunked-prefill", "--max-num-batched-tokens", "2048", "--max-model-len", "1024",
)  # fmt: skip


def shape_a_outputs(seed: int = 101, requests: int = 96) -> list[int]:
    """Each request's output length (128-256), the same for the twin and the real server."""
    rng = random.Random(seed)
    return [rng.randint(128, 256) for _ in range(requests)]


def closed_loop(
    cap: int | None, seed: int = 101, requests: int = 96, clients: int = 24
) -> tuple[float, int]:
    """Shape A on the twin's stepped clock, to completion: (generated tokens per simulated
    second, preemptions). 200-token prompts of unique words (no prefix hits)."""
    engine = ready_engine(*SHAPE_A, *(("--max-num-seqs", str(cap)) if cap else ()))
    outputs = shape_a_outputs(seed, requests)
    start, sent, done, generated = engine.now, 0, 0, 0

    def send() -> None:
        nonlocal sent
        engine.add_request(f"r{sent}", [f"w{sent}_{i}" for i in range(200)], outputs[sent], True)
        sent += 1

    for _ in range(clients):
        send()
    t = engine.now
    while done < requests:
        t += 0.002
        assert t - start < 600, f"run did not finish: {done}/{requests} done"
        for d in engine.advance(t):
            generated += d.new_tokens
            if d.finish_reason is not None:
                done += 1
                if sent < requests:
                    send()
    assert engine.scheduler is not None
    return generated / (engine.now - start), engine.scheduler.num_preemptions_total
