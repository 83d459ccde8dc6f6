"""KV budget math: against vLLM's own numbers (real captures) and hand computation for the
model shapes (tests/fixtures/models: Llama-3-8B, Llama-3-70B, Qwen2-72B, Mistral-7B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_guardian.core.budget import (
    Deployment,
    ModelConfigError,
    compute_budget,
    fit_options,
    model_fits,
    model_shape,
    parse_human_int,
    parse_launch_flags,
    parse_startup_sizing,
)
from vllm_guardian.tools.cli import main

GIB = 1024**3
FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"


def shape(name: str, index: bool = False):  # type: ignore[no-untyped-def]
    cfg = json.loads((MODELS / name / "config.json").read_text())
    total = None
    if index:
        total = json.loads((MODELS / name / "model.safetensors.index.json").read_text())[
            "metadata"
        ]["total_size"]
    return model_shape(cfg, total)


# name, published parameter count, KV bytes per token by hand (bf16): 2 × layers × kv heads × 128 × 2
SHAPES = [
    ("llama-3-8b", 8_030_261_248, 2 * 32 * 8 * 128 * 2),  # 131,072 = 128 KiB
    ("llama-3-70b", 70_553_706_496, 2 * 80 * 8 * 128 * 2),  # 327,680 = 320 KiB
    ("qwen2-72b", 72_706_203_648, 2 * 80 * 8 * 128 * 2),
    ("mistral-7b", 7_241_732_096, 2 * 32 * 8 * 128 * 2),
]


@pytest.mark.parametrize(("name", "params", "per_token"), SHAPES)
def test_model_shapes_by_hand(name: str, params: int, per_token: int) -> None:
    m = shape(name)
    assert m.num_params == params  # the published counts (8.03B, 70.55B, 72.71B, 7.24B)
    assert m.kv_bytes_per_token() == per_token
    assert m.kv_bytes_per_token(tensor_parallel_size=2) == per_token // 2  # KV heads split
    assert m.kv_bytes_per_token(kv_dtype_bytes=1) == per_token // 2  # fp8 KV
    assert m.weights_bytes == 2 * params and m.weights_source == "estimated from config"


def test_weights_from_the_safetensors_index_win() -> None:
    m = shape("llama-3-8b", index=True)
    assert m.weights_bytes == 16_060_522_496 and m.weights_source == "safetensors index"


def test_llama_3_8b_on_an_h100_by_hand() -> None:
    m = shape("llama-3-8b")
    b = compute_budget(m, Deployment(gpu_memory_total_bytes=80 * GIB))
    requested = -(-80 * GIB * 92 // 100)  # ceil(total × 0.92)
    assert b.requested_bytes == requested
    activation = 8192 * (4 * 4096 + 2 * 14336) * 2 + 1024 * 128256 * 4  # batched tokens, logits
    graphs = 64 * 2**20 + 32 * 4096 * 512 * 4 * 2 // 2
    pool = requested - 16_060_522_496 - 512 * 2**20 - activation - graphs
    assert (b.activation_peak_bytes, b.cudagraph_bytes, b.kv_pool_bytes) == (
        activation,
        graphs,
        pool,
    )
    blocks = pool // (16 * 131_072)
    assert (b.pool_blocks, b.pool_tokens) == (blocks, blocks * 16)
    assert b.max_concurrency_at_max_model_len == round(blocks * 16 / 8192, 2)
    assert b.largest_max_model_len(4) == blocks // 4 * 16
    assert b.max_concurrency_at(1000) == blocks / 63  # ceil(1000 / 16) blocks per request


def test_pinned_kv_memory_matches_the_twins_kv_thrash_pool() -> None:
    # docs/twin.md: --kv-cache-memory-bytes 4 GiB on Llama-3-8B is a 32k-token pool.
    b = compute_budget(shape("llama-3-8b"), Deployment(80 * GIB, kv_cache_memory_bytes=4 * GIB))
    assert b.pool_tokens == 32_768 and b.kv_pool_source == "--kv-cache-memory-bytes"


def test_against_vllms_own_numbers_from_the_real_captures() -> None:
    # tiny-llama (2 layers, 2 KV heads, head dim 32, bf16) = 512 B/token; vLLM printed
    # "CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 4,096 tokens per request:
    # 512.00x" for its 1 GiB pool, and cache_config_info says 16384 blocks of 128.
    tiny = model_shape(
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "head_dim": 32, "intermediate_size": 128, "vocab_size": 4096, "max_position_embeddings": 4096}
    )  # fmt: skip
    assert tiny.kv_bytes_per_token() == 512
    b = compute_budget(
        tiny, Deployment(8 * GIB, block_size=128, max_model_len=4096), kv_pool_bytes=GIB
    )
    sizing = parse_startup_sizing(
        (FIXTURES / "logs" / "server-startup-run1-cold.log").read_text().splitlines()
    )
    assert sizing.kv_cache_size_tokens == b.pool_tokens == 2_097_152
    assert sizing.max_concurrency == b.max_concurrency_at_max_model_len == 512.0
    assert sizing.max_concurrency_request_tokens == 4096
    assert b.pool_blocks == 16_384
    # The pressure capture: num_gpu_blocks_override 32 × 128 = 4096 tokens, 2.0x at 2048.
    small = compute_budget(
        tiny, Deployment(8 * GIB, block_size=128, max_model_len=2048), kv_pool_bytes=32 * 128 * 512
    )
    assert (small.pool_tokens, small.max_concurrency_at_max_model_len) == (4096, 2.0)


def test_startup_sizing_lines_and_vllms_recommendation() -> None:
    lines = [
        "(EngineCore_DP0 pid=7) INFO 11-22 00:00:10 [gpu_worker.py:330] Available KV cache memory: 56.21 GiB",
        "(EngineCore_DP0 pid=7) INFO 11-22 00:00:10 [kv_cache_utils.py:1087] GPU KV cache size: 460,464 tokens, Maximum concurrency for 8,192 tokens per request: 56.21x",
        "(EngineCore_DP0 pid=7) INFO 11-22 00:00:09 [gpu_model_runner.py:2602] Model loading took 14.9888 GiB memory and 7.9 seconds",
        "(EngineCore_DP0 pid=7) INFO 11-22 00:00:20 [gpu_worker.py:470] Free memory on device (79.19/79.19 GiB) on startup. Desired GPU memory utilization is (0.92, 72.85 GiB). Actual usage is 15.49 GiB for consumed memory (weights + non-torch), 1.20 GiB for peak activation, and 0.33 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=60355903488` to fit into requested memory, or `--kv-cache-memory=<larger value>` to fully utilize gpu memory.",
        "INFO 12-27 10:00:00 gpu_executor.py:122] # GPU blocks: 27306, # CPU blocks: 2048",
    ]
    s = parse_startup_sizing(lines)
    assert s.available_kv_cache_bytes == int(56.21 * GIB)
    assert (s.kv_cache_size_tokens, s.max_concurrency, s.max_concurrency_request_tokens) == (
        460_464,
        56.21,
        8192,
    )
    assert s.recommended_kv_cache_memory_bytes == 60_355_903_488
    assert s.consumed_bytes == int(15.49 * GIB) and s.cudagraph_bytes == int(0.33 * GIB)
    assert s.model_weights_bytes == int(14.9888 * GIB) and s.num_gpu_blocks == 27306
    assert parse_startup_sizing(["nothing here"]).empty


@pytest.mark.parametrize(
    ("name", "gib", "tp", "fits"),
    [("llama-3-70b", 80, 1, False), ("llama-3-70b", 80, 2, True), ("qwen2-72b", 80, 1, False),
     ("llama-3-8b", 24, 1, True), ("mistral-7b", 16, 1, True), ("mistral-7b", 14, 1, False)],
)  # fmt: skip
def test_model_fits(name: str, gib: int, tp: int, fits: bool) -> None:
    assert model_fits(shape(name), gib * GIB, tp) is fits


def test_fit_options_for_a_model_that_does_not_fit() -> None:
    opts = fit_options(shape("llama-3-70b"), Deployment(80 * GIB))
    changes = [o.change for o in opts]
    assert "tensor parallelism over 2 GPUs" in changes and any("fp8" in c for c in changes)
    tp2 = next(o for o in opts if o.flags == (("--tensor-parallel-size", "2"),))
    assert (
        tp2.pool_tokens
        == compute_budget(
            shape("llama-3-70b"), Deployment(80 * GIB, tensor_parallel_size=2)
        ).pool_tokens
    )


def test_launch_flags_later_occurrences_win() -> None:
    f = parse_launch_flags(
        ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "--gpu-memory-utilization", "0.9",
         "--max-model-len=16k", "--gpu-memory-utilization", "0.85", "--enforce-eager", "-tp", "2",
         "--kv-cache-memory-bytes", "4G", "--max-num-seqs", "banana"]
    )  # fmt: skip
    assert f.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert (f.gpu_memory_utilization_ratio, f.max_model_len, f.tensor_parallel_size) == (
        0.85,
        16000,
        2,
    )
    assert f.enforce_eager and f.kv_cache_memory_bytes == 4 * GIB
    assert f.unknown_values == ("--max-num-seqs banana",)
    assert (parse_human_int("1k"), parse_human_int("1K"), parse_human_int("x")) == (
        1000,
        1024,
        None,
    )


def test_a_config_without_the_fields_is_a_clear_error() -> None:
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        model_shape({"hidden_size": 4096, "num_attention_heads": 32})


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(MODELS / "llama-3-70b" / "config.json")
    assert main(["plan", "--model", model, "--gpu-memory-gib", "80", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "model_does_not_fit" and doc["kv_budget"]["model_fits"] is False
    assert main(["plan", "--model", model, "--gpu-memory-gib", "80", "--tp", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "healthy" and doc["kv_budget"]["kv_bytes_per_token"] == 81_920
    qwen = str(MODELS / "qwen2-72b")
    assert main(["plan", "--model", qwen, "--gpu-memory-gib", "80", "--tp", "2", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "kv_cache_blowout"  # 32k max_model_len, ~15k-token pool
    fix = doc["recommendation"]["flags"][0]
    assert fix["flag"] == "--max-model-len" and int(fix["new"]) == doc["kv_budget"]["pool_tokens"]
    assert (
        main(
            [
                "plan",
                "--model",
                qwen,
                "--gpu-memory-gib",
                "80",
                "--tp",
                "2",
                "--kv-cache-dtype",
                "fp8",
                "--max-model-len",
                "16k",
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["plan", "--model", str(MODELS / "nope.json"), "--gpu-memory-gib", "80"]) == 2
    assert main(["plan", "--model", model, "--gpu-memory-gib", "-1"]) == 2
    assert main(["plan", "--model", model]) == 2  # --gpu-memory-gib is required


def test_plan_text_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "plan",
            "--model",
            str(MODELS / "llama-3-8b"),
            "--gpu-memory-gib",
            "24",
            "--request-tokens",
            "2000",
            "--concurrency",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert "KV BUDGET" in out and all(len(line) <= 80 for line in out.splitlines())
