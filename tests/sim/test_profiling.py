"""Start-up profiling: KV blocks from the budget, and vLLM's start-up failures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.sim.helpers import options
from vllm_guardian.sim.modelspec import PRESETS, from_hf_config
from vllm_guardian.sim.profiling import (
    GIB,
    StartupFailure,
    StartupFailureKind,
    StartupPlan,
    profile_startup,
)

LLAMA8B = PRESETS["llama-3-8b"]
H100 = 80 * GIB


def plan_for(*argv: str, total: int = H100, other: int = 0) -> StartupPlan | StartupFailure:
    opts = options(*argv)
    return profile_startup(opts.model, opts.engine, total, other)


def test_kv_bytes_per_token_of_the_presets() -> None:
    assert LLAMA8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert PRESETS["tiny"].kv_bytes_per_token == 512  # measured on the real tiny model
    assert PRESETS["llama-3-70b"].kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # TP=4


def test_blocks_follow_the_budget_formula() -> None:
    plan = plan_for()
    assert isinstance(plan, StartupPlan)
    expected_kv = (
        plan.requested_bytes
        - plan.weights_bytes
        - plan.non_torch_bytes
        - plan.activation_peak_bytes
        - plan.cudagraph_bytes
    )
    assert plan.num_gpu_blocks == expected_kv // (16 * LLAMA8B.kv_bytes_per_token)
    assert plan.requested_bytes == int(H100 * 0.92) or plan.requested_bytes == int(H100 * 0.92) + 1


def test_levers_move_the_pool_the_right_way() -> None:
    base = plan_for()
    eager = plan_for("--enforce-eager")
    lower = plan_for("--gpu-memory-utilization", "0.85")
    fewer_tokens = plan_for("--max-num-batched-tokens", "2048")
    pinned = plan_for("--kv-cache-memory-bytes", str(4 * GIB))
    assert isinstance(base, StartupPlan)
    assert isinstance(eager, StartupPlan)
    assert isinstance(lower, StartupPlan)
    assert isinstance(fewer_tokens, StartupPlan)
    assert isinstance(pinned, StartupPlan)
    assert eager.cudagraph_bytes == 0
    assert eager.num_gpu_blocks > base.num_gpu_blocks
    assert lower.num_gpu_blocks < base.num_gpu_blocks
    assert fewer_tokens.activation_peak_bytes < base.activation_peak_bytes
    assert pinned.kv_cache_size_tokens == 4 * GIB // LLAMA8B.kv_bytes_per_token


def test_free_memory_below_request_fails_like_vllm() -> None:
    result = plan_for(other=10 * GIB)
    assert isinstance(result, StartupFailure)
    assert result.kind is StartupFailureKind.FREE_MEMORY_BELOW_REQUEST
    assert result.message.startswith("Free memory on device cuda:0 (70.00/80.00 GiB) on startup")
    assert "is less than desired GPU memory utilization (0.92, 73.60 GiB)" in result.message
    assert isinstance(plan_for("--gpu-memory-utilization", "0.8", other=10 * GIB), StartupPlan)


def test_no_cache_blocks() -> None:
    result = plan_for("--gpu-memory-utilization", "0.2")
    assert isinstance(result, StartupFailure)
    assert result.kind is StartupFailureKind.NO_CACHE_BLOCKS
    assert result.message.startswith("No available memory for the cache blocks.")


def test_max_len_does_not_fit() -> None:
    result = plan_for("--kv-cache-memory-bytes", str(512 << 20))  # 4096 tokens < 8192
    assert isinstance(result, StartupFailure)
    assert result.kind is StartupFailureKind.MAX_LEN_DOES_NOT_FIT
    assert "To serve at least one request with the model's max seq len (8192)" in result.message
    assert "the estimated maximum model length is 4096" in result.message


def test_model_does_not_fit_is_an_oom_at_load() -> None:
    opts = options("--sim-model", "llama-3-70b", "--tensor-parallel-size", "1")
    result = profile_startup(opts.model, opts.engine, H100, 0)
    assert isinstance(result, StartupFailure)
    assert result.kind is StartupFailureKind.WEIGHTS_DO_NOT_FIT
    assert result.message.startswith("CUDA out of memory. Tried to allocate")


def test_hf_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        '{"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,'
        ' "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,'
        ' "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}'
    )
    spec = from_hf_config(cfg)
    assert spec.kv_bytes_per_token == LLAMA8B.kv_bytes_per_token
    # The estimate lands within 1 % of Llama-3-8B's published parameter count.
    assert abs(spec.num_params - LLAMA8B.num_params) / LLAMA8B.num_params < 0.01
    assert replace(spec, name="x").max_position_embeddings == 8192
