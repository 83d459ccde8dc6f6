"""``vllm serve``'s command line as the twin understands it.

The vLLM flags the guardian touches are parsed the way vLLM parses them (argparse: later
occurrences win, ``--x/--no-x`` booleans, vLLM 0.32's defaults, ``1k``/``1K`` sizes); twin-only
flags start with ``--sim-``. A scenario's own vLLM flags are put *before* the user's, so the
user's (and the guardian's ``$VLLM_GUARDIAN_ARGS``) override them, as on a real unit.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_guardian.formats.allocator_format import ENV_DIR as ALLOCATOR_ENV_DIR
from vllm_guardian.formats.allocator_format import ENV_INTERVAL as ALLOCATOR_ENV_INTERVAL
from vllm_guardian.sim.modelspec import ModelSpec, resolve_model
from vllm_guardian.sim.profiling import GIB, EngineConfig
from vllm_guardian.sim.scenarios import SCENARIOS, Scenario

DEFAULT_SIM_MODEL = "llama-3-8b"


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineConfig
    model: ModelSpec
    scenario: Scenario
    host: str | None
    port: int
    shutdown_timeout_seconds: int
    disable_log_stats: bool
    enable_server_load_tracking: bool
    speed: float
    seed: int
    gpu_memory_bytes: int
    exit_code: int
    gpu_state_file: Path | None
    gpu_state_interval_seconds: float
    epoch_unix_seconds: float | None
    timeline_file: Path | None
    fault_every_seconds: float | None
    non_default_args: tuple[tuple[str, object], ...]
    # The allocator plugin's directory (VLLM_GUARDIAN_ALLOCATOR_DIR, as the guardian's drop-in
    # sets it for vLLM): the twin publishes its allocator stats there like the plugin.
    allocator_dir: Path | None = None
    allocator_interval_seconds: float | None = None
    alloc_conf: str | None = None
    # Twin-only: after the engine's death, the watchdog's exit waits until this file exists.
    exit_hold_file: Path | None = None
    # vLLM 0.33's --watchdog-config: (timeout in seconds, dump_dir); None: dormant (as vLLM is
    # without a dump_dir).
    watchdog: tuple[float, Path] | None = None
    # vLLM's development routes (/pause, /resume, /is_paused): VLLM_SERVER_DEV_MODE=1, or the
    # scenario's operator uses them.
    dev_mode: bool = False


class FlagError(ValueError):
    """A flag combination vLLM itself rejects at start-up."""


def _watchdog(raw: str | None) -> tuple[float, Path] | None:
    """--watchdog-config's JSON as vLLM 0.33 reads it: dormant without a dump_dir; the
    timeout defaults to 300 s (vllm/utils/watch_dog.py)."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise FlagError(f"--watchdog-config: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise FlagError("--watchdog-config: must be a JSON object")
    dump_dir, timeout = doc.get("dump_dir"), doc.get("timeout", 300)
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise FlagError(f"--watchdog-config: timeout must be > 0 seconds, got {timeout!r}")
    return (float(timeout), Path(dump_dir)) if isinstance(dump_dir, str) and dump_dir else None


def human_int(text: str) -> int:
    """vLLM's sizes: ``1k`` = 1000, ``1K`` = 1024 (likewise m/M, g/G); plain ints pass."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size: {text!r}")
    number, suffix = float(m.group(1)), m.group(2)
    power = " kmgt".index(suffix.lower()) if suffix else 0
    base = 1024 if suffix.isupper() else 1000
    return int(number * base**power)


def build_parser(prog: str = "vllm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="The vLLM twin: a simulated vLLM 0.32 OpenAI-compatible server.",
    )
    p.add_argument("model_tag", nargs="?", default=None, help="model name or path")
    p.add_argument("--model", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--max-model-len", type=human_int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    # vLLM 0.32's admission limit: HTTP 503 past this many unfinished requests (async_llm.py).
    p.add_argument("--max-num-queued-reqs", type=int, default=None)
    # vLLM 0.33's hang watchdog: JSON {"timeout": s, "check_interval": s, "dump_dir": path}.
    p.add_argument("--watchdog-config", default=None)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--block-size", type=int, default=None, choices=[1, 8, 16, 32, 64, 128])
    p.add_argument("--kv-cache-memory-bytes", type=human_int, default=None)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--disable-log-stats", action="store_true", default=False)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False
    )
    sim = p.add_argument_group("twin-only flags")
    sim.add_argument("--sim-scenario", choices=sorted(SCENARIOS), default="steady")
    sim.add_argument("--sim-speed", type=float, default=1.0, help="simulated seconds per second")
    sim.add_argument("--sim-seed", type=int, default=0)
    sim.add_argument("--sim-model", default=DEFAULT_SIM_MODEL, help="preset or config.json")
    sim.add_argument("--sim-gpu-memory-gib", type=float, default=80.0)
    sim.add_argument(
        "--sim-exit-code", type=int, default=0, help="exit status after engine death (vLLM: 0)"
    )
    sim.add_argument(
        "--sim-exit-hold-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="after the engine's death, hold the watchdog's exit until PATH exists (a test "
        "looks at the dead engine, /health 503 and new requests 500, at leisure)",
    )
    sim.add_argument("--sim-gpu-state-file", type=Path, default=None)
    sim.add_argument("--sim-gpu-state-interval-seconds", type=float, default=1.0)
    sim.add_argument(
        "--sim-epoch",
        type=float,
        default=None,
        help="wall time (Unix seconds) of the scenario's zero; its one-off faults are timed "
        "from it (default: the timeline file's, else this process's readiness)",
    )
    sim.add_argument(
        "--sim-timeline-file",
        type=Path,
        default=None,
        help="JSON file shared by the processes of one run: the scenario's epoch (set by the "
        "first to become ready) and every fault, with its wall time",
    )
    sim.add_argument(
        "--sim-fault-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="mean simulated seconds between seeded recurrences of the scenario's fault",
    )
    sim.add_argument(
        "--sim-fragmentation-creep-factor",
        type=float,
        default=None,
        help="override the scenario's fragmentation creep multiplier",
    )
    return p


def scenario_from_argv(argv: Sequence[str]) -> Scenario:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sim-scenario", choices=sorted(SCENARIOS), default="steady")
    known, _ = pre.parse_known_args(list(argv))
    return SCENARIOS[known.sim_scenario]


def parse_serve_args(
    argv: Sequence[str], environ: Mapping[str, str], prog: str = "vllm serve"
) -> ServeOptions:
    """Parse ``serve`` arguments; ``environ`` supplies PYTORCH_CUDA_ALLOC_CONF."""
    scenario = scenario_from_argv(argv)
    parser = build_parser(prog)
    ns = parser.parse_args([*scenario.vllm_args, *argv])
    defaults = parser.parse_args([])
    if ns.sim_fragmentation_creep_factor is not None:
        scenario = replace(scenario, fragmentation_creep_factor=ns.sim_fragmentation_creep_factor)
    gpu_bytes = int(ns.sim_gpu_memory_gib * GIB)
    model = resolve_model(ns.sim_model, ns.tensor_parallel_size)
    model_path = ns.model or ns.model_tag or model.name
    served = ns.served_model_name[0] if ns.served_model_name else model_path
    max_model_len = ns.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise FlagError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={model.max_position_embeddings} in model's "
            "config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    gib = ns.sim_gpu_memory_gib
    max_num_seqs = ns.max_num_seqs or (1024 if gib >= 70 else 256)
    chunked = True if ns.enable_chunked_prefill is None else ns.enable_chunked_prefill
    if ns.max_num_batched_tokens is not None:
        batched = ns.max_num_batched_tokens
    elif not chunked:
        batched = max(max_model_len, 2048)
    else:
        batched = 16384 if gib >= 160 else 8192 if gib >= 70 else 2048
    if batched < max_num_seqs:
        raise FlagError(
            f"max_num_batched_tokens ({batched}) must be greater than or equal to "
            f"max_num_seqs ({max_num_seqs})."
        )
    if not chunked and batched < max_model_len:
        raise FlagError(
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len "
            f"({max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    if ns.sim_fault_every is not None and not ns.sim_fault_every > 0:
        raise FlagError(f"--sim-fault-every must be > 0 seconds, got {ns.sim_fault_every}")
    # As torch 2.13 (vLLM 0.32's) reads it: PYTORCH_CUDA_ALLOC_CONF when set, else
    # PYTORCH_ALLOC_CONF (measured: with both set, the first alone is parsed).
    alloc_conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", environ.get("PYTORCH_ALLOC_CONF", ""))
    engine = EngineConfig(
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_queued_reqs=ns.max_num_queued_reqs,
        max_num_batched_tokens=batched,
        block_size=ns.block_size or 16,
        enable_prefix_caching=True
        if ns.enable_prefix_caching is None
        else ns.enable_prefix_caching,
        enable_chunked_prefill=chunked,
        enforce_eager=bool(ns.enforce_eager),
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        expandable_segments="expandable_segments:true" in alloc_conf.replace(" ", "").lower(),
        served_model_name=served,
        model_path=model_path,
    )
    non_default = tuple(
        (k, v)
        for k, v in sorted(vars(ns).items())
        if not k.startswith("sim_") and v != getattr(defaults, k)
    )
    return ServeOptions(
        engine=engine,
        model=model,
        scenario=scenario,
        host=ns.host,
        port=ns.port,
        shutdown_timeout_seconds=ns.shutdown_timeout,
        disable_log_stats=ns.disable_log_stats,
        enable_server_load_tracking=ns.enable_server_load_tracking,
        speed=ns.sim_speed,
        seed=ns.sim_seed,
        gpu_memory_bytes=gpu_bytes,
        exit_code=ns.sim_exit_code,
        gpu_state_file=ns.sim_gpu_state_file,
        gpu_state_interval_seconds=ns.sim_gpu_state_interval_seconds,
        epoch_unix_seconds=ns.sim_epoch,
        timeline_file=ns.sim_timeline_file,
        fault_every_seconds=ns.sim_fault_every,
        non_default_args=non_default,
        allocator_dir=Path(d) if (d := environ.get(ALLOCATOR_ENV_DIR, "").strip()) else None,
        dev_mode=scenario.dev_mode or environ.get("VLLM_SERVER_DEV_MODE", "0") == "1",
        allocator_interval_seconds=_allocator_interval(environ),
        alloc_conf=alloc_conf or None,
        exit_hold_file=ns.sim_exit_hold_file,
        watchdog=_watchdog(ns.watchdog_config),
    )


def _allocator_interval(environ: Mapping[str, str]) -> float | None:
    raw = environ.get(ALLOCATOR_ENV_INTERVAL, "").strip()
    try:
        value = float(raw) if raw else None
    except ValueError:
        raise FlagError(f"{ALLOCATOR_ENV_INTERVAL}={raw!r} is not a number of seconds") from None
    if value is not None and not 0.1 <= value <= 3600:
        raise FlagError(f"{ALLOCATOR_ENV_INTERVAL}={raw!r} is not 0.1..3600 seconds")
    return value
