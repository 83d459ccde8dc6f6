"""Model descriptions for the twin: the shapes that decide weights and KV bytes.

A ``ModelSpec`` carries what vLLM's sizing depends on (layers, KV heads, head dim, dtype,
parameter count, tensor parallelism) plus the twin's speed model (seconds per engine step).
Presets cover a tiny model, Llama-3-8B and Llama-3-70B with TP=4; ``from_hf_config`` reads a
Hugging Face ``config.json``. Everything is per GPU: the twin simulates rank 0 of a TP group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    dtype_bytes: int
    max_position_embeddings: int
    tensor_parallel_size: int = 1
    # Speed model: one engine step costs
    #   base + per_token × tokens + per_prefill_token × prefill-like tokens + per_seq × sequences
    # where prefill-like tokens are those of chunks longer than one token (prompts, and the
    # recompute of preempted sequences) and sequences are the requests in the step (each
    # decodes one token). The real vLLM tier's fit (the KV-thrash measurement,
    # docs/capacity.md, ~148 k steps) has this shape; with a fixed cost alone, batch width is
    # everything and recompute almost free, which overstates what a low --max-num-seqs loses.
    step_base_seconds: float = 0.012
    step_per_token_seconds: float = 6e-5
    step_per_prefill_token_seconds: float = 0.0
    step_per_seq_seconds: float = 0.0

    def step_seconds(self, tokens: int, prefill_tokens: int, sequences: int) -> float:
        """Simulated seconds of one engine step."""
        return (
            self.step_base_seconds
            + self.step_per_token_seconds * tokens
            + self.step_per_prefill_token_seconds * prefill_tokens
            + self.step_per_seq_seconds * sequences
        )

    @property
    def weights_bytes(self) -> int:
        """Weights held by one GPU of the TP group."""
        return self.num_params * self.dtype_bytes // self.tensor_parallel_size

    @property
    def kv_heads_per_gpu(self) -> int:
        return max(1, self.num_kv_heads // self.tensor_parallel_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 × layers × kv_heads/TP × head_dim × dtype bytes."""
        return 2 * self.num_layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """Live activations per batched token in a forward pass (hidden-size buffers + MLP)."""
        mlp = 2 * self.intermediate_size // self.tensor_parallel_size
        return (4 * self.hidden_size + mlp) * self.dtype_bytes

    @property
    def logits_bytes_per_seq(self) -> int:
        """Float32 logits the sampler holds for each sequence it samples."""
        return self.vocab_size * 4


PRESETS: dict[str, ModelSpec] = {
    # The 1.34M-parameter random Llama the CPU measurements used (tests/vllm_tier/tinymodel.py).
    "tiny": ModelSpec(
        name="tiny-llama",
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        hidden_size=128,
        intermediate_size=256,
        vocab_size=4096,
        num_params=1_340_000,
        dtype_bytes=2,
        max_position_embeddings=4096,
        # Fitted on the real vLLM 0.32 CPU engine serving this model (shape A of the KV-thrash
        # measurement, docs/capacity.md: 122,683 steps): 2.67 ms + 135 µs per prefill-like
        # token + 0.67 ms per sequence. Was 4 ms + 2 µs/token, which made a cap at 0.4x what
        # the pool hosts cost 60 % of throughput on the twin against 32-34 % on the real one.
        step_base_seconds=0.00267,
        step_per_token_seconds=0.0,
        step_per_prefill_token_seconds=135e-6,
        step_per_seq_seconds=0.00067,
    ),
    "llama-3-8b": ModelSpec(
        name="meta-llama/Meta-Llama-3-8B-Instruct",
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        num_params=8_030_261_248,
        dtype_bytes=2,
        max_position_embeddings=8192,
    ),
    "llama-3-70b": ModelSpec(
        name="meta-llama/Meta-Llama-3-70B-Instruct",
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        num_params=70_553_706_496,
        dtype_bytes=2,
        max_position_embeddings=8192,
        tensor_parallel_size=4,
        step_base_seconds=0.030,
        step_per_token_seconds=1.5e-4,
    ),
}


def estimate_num_params(cfg: dict[str, object]) -> int:
    """Parameter count of a Llama-shaped decoder from its config (embeddings, attention, MLP)."""
    hidden = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads)
    inter = _int(cfg, "intermediate_size")
    vocab = _int(cfg, "vocab_size")
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    tied = bool(cfg.get("tie_word_embeddings", False))
    return vocab * hidden * (1 if tied else 2) + layers * (attn + mlp + 2 * hidden) + hidden


def from_hf_config(path: Path, tensor_parallel_size: int = 1) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (Llama-like decoders)."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or path.parent.name or "model"),
        num_layers=_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        vocab_size=_int(cfg, "vocab_size"),
        num_params=estimate_num_params(cfg),
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        tensor_parallel_size=tensor_parallel_size,
    )


def resolve_model(spec: str, tensor_parallel_size: int | None = None) -> ModelSpec:
    """``--sim-model``: a preset name or a path to a ``config.json`` (or its directory)."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        if tensor_parallel_size is None or tensor_parallel_size == preset.tensor_parallel_size:
            return preset
        return _with_tp(preset, tensor_parallel_size)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(sorted(PRESETS))
        raise ValueError(f"--sim-model {spec!r}: not a preset ({names}) nor a config.json")
    return from_hf_config(path, tensor_parallel_size or 1)


def _with_tp(spec: ModelSpec, tp: int) -> ModelSpec:
    return replace(spec, tensor_parallel_size=tp)


def _int(cfg: dict[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"config.json lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"config.json {key!r} is not a number")
    return int(value)
