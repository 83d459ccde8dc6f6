"""The twin parses vLLM's flags like vLLM: defaults, later occurrences win, --no-x booleans."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.helpers import options
from vllm_guardian.sim.flags import FlagError, human_int


def test_vllm_defaults_on_an_80_gib_card() -> None:
    cfg = options().engine
    assert cfg.gpu_memory_utilization == 0.92
    assert cfg.max_num_seqs == 1024
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.block_size == 16
    assert cfg.enable_prefix_caching is True
    assert cfg.enable_chunked_prefill is True
    assert cfg.enforce_eager is False
    assert cfg.kv_cache_memory_bytes is None
    assert cfg.max_model_len == 8192  # the model's max_position_embeddings


def test_smaller_card_gets_smaller_batch_defaults() -> None:
    cfg = options("--sim-gpu-memory-gib", "24").engine
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 2048)


def test_later_occurrences_win() -> None:
    opts = options(
        "--gpu-memory-utilization", "0.9", "--max-num-seqs", "512",
        "--gpu-memory-utilization", "0.85", "--max-num-seqs", "128",
    )  # fmt: skip
    assert opts.engine.gpu_memory_utilization == 0.85
    assert opts.engine.max_num_seqs == 128


def test_scenario_flags_come_first_so_the_command_line_overrides_them() -> None:
    assert options("--sim-scenario", "prefill_burst").engine.max_num_batched_tokens == 16384
    overridden = options("--sim-scenario", "prefill_burst", "--max-num-batched-tokens", "4096")
    assert overridden.engine.max_num_batched_tokens == 4096


def test_boolean_optional_flags_and_env() -> None:
    opts = options(
        "--no-enable-prefix-caching", "--enforce-eager", "--served-model-name", "m1", "m2",
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )  # fmt: skip
    assert opts.engine.enable_prefix_caching is False
    assert opts.engine.enforce_eager is True
    assert opts.engine.served_model_name == "m1"
    assert opts.engine.expandable_segments is True
    assert options().engine.expandable_segments is False


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("1k", 1000), ("1K", 1024), ("4G", 4 << 30), ("2g", 2 * 10**9)],
)
def test_human_readable_sizes(text: str, value: int) -> None:
    assert human_int(text) == value


def test_sim_flags() -> None:
    opts = options(
        "--sim-speed", "20", "--sim-seed", "7", "--sim-model", "tiny", "--sim-exit-code", "3",
        "--sim-gpu-memory-gib", "40", "--shutdown-timeout", "30", "--port", "9000",
    )  # fmt: skip
    assert (opts.speed, opts.seed, opts.exit_code, opts.port) == (20.0, 7, 3, 9000)
    assert opts.model.name == "tiny-llama"
    assert opts.gpu_memory_bytes == 40 << 30
    assert opts.shutdown_timeout_seconds == 30
    assert ("shutdown_timeout", 30) in opts.non_default_args
    assert opts.exit_hold_file is None
    assert options("--sim-exit-hold-file", "/run/x").exit_hold_file == Path("/run/x")


def test_rejected_combinations() -> None:
    with pytest.raises(FlagError, match="max_model_len"):
        options("--max-model-len", "100000")
    with pytest.raises(FlagError, match="max_num_seqs"):
        options("--max-num-batched-tokens", "512")


def test_unknown_flag_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        options("--swap-space", "4")
