"""KV-cache budget math, launch-flag parsing and vLLM's own start-up sizing lines. Pure.

Shared by ``vllm-guardian diagnose`` (checked against what a live server reports) and
``vllm-guardian plan`` (before deployment). The formulas are vLLM V1's start-up profiling
(vllm/v1/worker/gpu_worker.py, determine_available_memory):

* bytes per token (per GPU) = 2 (K and V) × layers × KV heads / TP × head dim × KV dtype bytes;
* requested = ceil(total × gpu_memory_utilization) — a share of the card's *total* memory;
* KV pool = requested − weights − non-torch − peak activations − CUDA-graph estimate, or
  ``--kv-cache-memory-bytes`` verbatim; blocks = pool // (block_size × bytes per token);
* maximum concurrency at L = pool tokens / L.

vLLM measures the overheads; we can only estimate them (the same estimate as the twin,
docs/twin.md). Where vLLM's own numbers are available (``cache_config_info``, the start-up
lines "Available KV cache memory", "KV cache size: N tokens") they win over the estimate and
the report says which one it used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

GIB = 1024**3
MIB = 1024**2

# Parameter dtypes (config.json ``torch_dtype``) and KV dtypes (``--kv-cache-dtype``) in bytes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "float8": 1, "int8": 1,
}  # fmt: skip

# vLLM 0.33 defaults: utilization 0.92 since 0.21 (0.90 before); batch defaults by card size.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
# The twin's overhead model (docs/twin.md "Start-up profiling"): a CUDA context and NCCL
# buffers vLLM counts as non-torch memory; more with tensor parallelism.
NON_TORCH_BYTES = 512 * MIB
NON_TORCH_TP_EXTRA_BYTES = 256 * MIB
CUDAGRAPH_BASE_BYTES = 64 * MIB
# What "model_does_not_fit" assumes is the least any deployment needs besides the weights:
# utilization 0.98, eager mode, 2048 batched tokens, one sequence of 2048 tokens.
MIN_DEPLOY_UTILIZATION = 0.98
MIN_DEPLOY_TOKENS = 2048


class ModelConfigError(ValueError):
    """config.json lacks a field the math needs, or has one of the wrong type."""


def _int(cfg: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelConfigError(f"config.json lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelConfigError(f"config.json {key!r} is not a number: {value!r}")
    if value <= 0:
        raise ModelConfigError(f"config.json {key!r} must be positive, not {value!r}")
    return int(value)


@dataclass(frozen=True)
class ModelShape:
    """What vLLM's sizing depends on, from a Hugging Face ``config.json``."""

    name: str
    architecture: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    dtype_bytes: int
    num_params: int  # estimated from the shapes (Llama/Mistral/Qwen2-like decoders)
    weights_bytes: int  # all ranks together
    weights_source: str  # "safetensors index" | "estimated from config"
    quantization: str | None = None

    def kv_bytes_per_token(
        self, tensor_parallel_size: int = 1, kv_dtype_bytes: int | None = None
    ) -> int:
        """K and V of every layer for one token, on one GPU of the TP group."""
        heads = max(1, self.num_kv_heads // max(1, tensor_parallel_size))
        return 2 * self.num_layers * heads * self.head_dim * (kv_dtype_bytes or self.dtype_bytes)


def estimate_num_params(cfg: Mapping[str, object]) -> int:
    """Parameter count of a Llama-shaped decoder: embeddings (+ untied LM head), attention
    (Q, K, V, O; Qwen2's Q/K/V biases), gated MLP, two norms per layer and the final norm."""
    hidden = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads)
    inter = _int(cfg, "intermediate_size")
    vocab = _int(cfg, "vocab_size")
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if str(cfg.get("model_type", "")).startswith("qwen2"):
        attn += heads * head_dim + 2 * kv_heads * head_dim  # q/k/v projections carry a bias
    mlp = 3 * hidden * inter
    tied = bool(cfg.get("tie_word_embeddings", False))
    return vocab * hidden * (1 if tied else 2) + layers * (attn + mlp + 2 * hidden) + hidden


def model_shape(
    cfg: Mapping[str, object], safetensors_total_bytes: int | None = None, name: str | None = None
) -> ModelShape:
    """A ModelShape from a parsed ``config.json`` (and the safetensors index's total size).

    Raises :class:`ModelConfigError` naming the field that is missing or wrong.
    """
    # Multimodal configs nest the language model's shapes under text_config.
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" in text:
        cfg = {**cfg, **text}
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    dtype_bytes = DTYPE_BYTES.get(dtype, 2)
    quant = cfg.get("quantization_config")
    quant_method = str(quant.get("quant_method")) if isinstance(quant, Mapping) else None
    params = estimate_num_params(cfg)
    if safetensors_total_bytes is not None and safetensors_total_bytes > 0:
        weights, source = safetensors_total_bytes, "safetensors index"
    else:
        per_param = 1 if quant_method in ("fp8", "compressed-tensors") else dtype_bytes
        # AWQ/GPTQ checkpoints hold 4-bit weights.
        weights = params // 2 if quant_method in ("awq", "gptq") else params * per_param
        source = "estimated from config"
    archs = cfg.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else None
    return ModelShape(
        name=name or str(cfg.get("_name_or_path") or arch or "model"),
        architecture=arch,
        num_layers=_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        vocab_size=_int(cfg, "vocab_size"),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        num_params=params,
        weights_bytes=weights,
        weights_source=source,
        quantization=quant_method,
    )


# --- launch flags ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchFlags:
    """The memory-relevant flags of one vLLM command line (later occurrences win, as argparse)."""

    model: str | None = None
    gpu_memory_utilization_ratio: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    enforce_eager: bool | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    port: int | None = None
    unknown_values: tuple[str, ...] = ()  # flags whose value could not be read


_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)(i?[bB])?")


def parse_human_int(text: str) -> int | None:
    """vLLM's human-readable integers: ``1k`` = 1000, ``1K`` = 1024 (and m/M, g/G, t/T)."""
    m = _HUMAN.fullmatch(text.strip())
    if m is None:
        return None
    value, unit = float(m.group(1)), m.group(2)
    if unit:
        power = "kmgt".index(unit.lower()) + 1
        value *= (1024 if unit.isupper() else 1000) ** power
    return int(value)


_VALUE_FLAGS = {
    "--model": "model",
    "--gpu-memory-utilization": "gpu_memory_utilization_ratio",
    "--device-memory-utilization": "gpu_memory_utilization_ratio",
    "--max-model-len": "max_model_len",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--kv-cache-memory": "kv_cache_memory_bytes",  # vLLM's hint spells it so (argparse prefix)
    "--block-size": "block_size",
    "--port": "port",
}
_SWITCHES = {
    "--enforce-eager": ("enforce_eager", True),
    "--no-enforce-eager": ("enforce_eager", False),
    "--enable-chunked-prefill": ("enable_chunked_prefill", True),
    "--no-enable-chunked-prefill": ("enable_chunked_prefill", False),
    "--enable-prefix-caching": ("enable_prefix_caching", True),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False),
}


def parse_launch_flags(argv: Sequence[str]) -> LaunchFlags:
    """The memory-relevant flags of ``vllm serve MODEL ...`` (or ``--model MODEL``)."""
    values: dict[str, object] = {}
    bad: list[str] = []
    args = list(argv)
    i = 0
    positional_model: str | None = None
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        if flag in _SWITCHES:
            field_name, on = _SWITCHES[flag]
            values[field_name] = on
        elif flag in _VALUE_FLAGS:
            if eq:
                raw = inline
            elif i + 1 < len(args):
                i += 1
                raw = args[i]
            else:
                bad.append(flag)
                break
            field_name = _VALUE_FLAGS[flag]
            parsed = _flag_value(field_name, raw)
            if parsed is None:
                bad.append(f"{flag} {raw}")
            else:
                values[field_name] = parsed
        elif arg == "serve" and i + 1 < len(args) and not args[i + 1].startswith("-"):
            positional_model = args[i + 1]
            i += 1
        i += 1
    if "model" not in values and positional_model is not None:
        values["model"] = positional_model
    return replace(LaunchFlags(), unknown_values=tuple(bad), **values)  # type: ignore[arg-type]


def _flag_value(field_name: str, raw: str) -> object | None:
    if field_name in ("model", "kv_cache_dtype"):
        return raw
    if field_name == "gpu_memory_utilization_ratio":
        try:
            v = float(raw)
        except ValueError:
            return None
        return v if 0 < v <= 1 else None
    if field_name == "max_model_len" and raw in ("-1", "auto"):
        return None  # vLLM picks the largest that fits: unknown until it starts
    v2 = parse_human_int(raw)
    return v2 if v2 is not None and v2 > 0 else None


# --- vLLM's own start-up sizing lines -------------------------------------------------------


@dataclass(frozen=True)
class StartupSizing:
    """What vLLM logged about its own sizing at the last start-up (None: not logged)."""

    available_kv_cache_bytes: int | None = None
    kv_cache_size_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_request_tokens: int | None = None
    num_gpu_blocks: int | None = None  # V0 "# GPU blocks: N"
    model_weights_bytes: int | None = None  # "Model loading took X GiB"
    cudagraph_estimate_bytes: int | None = None
    consumed_bytes: int | None = None  # weights + non-torch, from the --kv-cache-memory hint
    peak_activation_bytes: int | None = None
    cudagraph_bytes: int | None = None
    recommended_kv_cache_memory_bytes: int | None = None
    estimated_max_model_len: int | None = None  # from "To serve at least one request …"

    @property
    def empty(self) -> bool:
        return self == StartupSizing()


_NUM = r"([\d][\d,]*(?:\.\d+)?)"
_SIZING: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("available_kv_cache_bytes", re.compile(rf"Available KV cache memory: {_NUM} GiB"), "gib"),
    ("kv_cache_size_tokens", re.compile(rf"KV cache size: {_NUM} tokens"), "int"),
    ("max_concurrency_request_tokens", re.compile(rf"Maximum concurrency for {_NUM} tokens per request"), "int"),
    ("max_concurrency", re.compile(rf"tokens per request: {_NUM}x"), "float"),
    ("num_gpu_blocks", re.compile(r"# GPU blocks: (\d+)"), "int"),
    ("model_weights_bytes", re.compile(rf"Model loading took {_NUM} GiB"), "gib"),
    ("cudagraph_estimate_bytes", re.compile(rf"Estimated CUDA graph memory: {_NUM} GiB"), "gib"),
    ("consumed_bytes", re.compile(rf"Actual usage is {_NUM} GiB for consumed memory"), "gib"),
    ("peak_activation_bytes", re.compile(rf"{_NUM} GiB for peak activation"), "gib"),
    ("cudagraph_bytes", re.compile(rf"{_NUM} GiB for CUDAGraph memory"), "gib"),
    ("recommended_kv_cache_memory_bytes", re.compile(r"with `--kv-cache-memory=(\d+)`"), "int"),
    ("estimated_max_model_len", re.compile(r"estimated maximum model length is (\d+)"), "int"),
)  # fmt: skip


def parse_startup_sizing(lines: Iterable[str]) -> StartupSizing:
    """vLLM's sizing lines from its log (INFO lines included), the last start-up's values."""
    found: dict[str, object] = {}
    for line in lines:
        if (
            "KV cache" not in line
            and "GiB" not in line
            and "GPU blocks" not in line
            and "maximum model length" not in line
        ):
            continue
        for field_name, pattern, kind in _SIZING:
            m = pattern.search(line)
            if m is None:
                continue
            raw = m.group(1).replace(",", "")
            try:
                if kind == "gib":
                    found[field_name] = int(float(raw) * GIB)
                elif kind == "int":
                    found[field_name] = int(float(raw))
                else:
                    found[field_name] = float(raw)
            except ValueError:
                continue
    return replace(StartupSizing(), **found)  # type: ignore[arg-type]


# --- the budget ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """The inputs of the budget: a card and the flags (None: vLLM's default applies)."""

    gpu_memory_total_bytes: int
    gpu_memory_utilization_ratio: float | None = None
    tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    enforce_eager: bool | None = None


def default_max_num_seqs(total_bytes: int) -> int:
    """vLLM 0.33's API-server default: 1024 on cards of 70 GiB and more, else 256."""
    return 1024 if total_bytes >= 70 * GIB else 256


def default_max_num_batched_tokens(total_bytes: int) -> int:
    """8192 on ≥ 70 GiB cards, 16384 on ≥ 160 GiB, else 2048 (chunked prefill on)."""
    if total_bytes >= 160 * GIB:
        return 16384
    return 8192 if total_bytes >= 70 * GIB else 2048


def kv_dtype_bytes(kv_cache_dtype: str | None, model: ModelShape) -> int:
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return model.dtype_bytes
    return DTYPE_BYTES.get(kv_cache_dtype, model.dtype_bytes)


@dataclass(frozen=True)
class KvBudget:
    """The KV budget of one deployment, per GPU of the TP group (bytes, tokens, blocks)."""

    model: str
    gpu_memory_total_bytes: int
    gpu_memory_utilization_ratio: float
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_bytes: int
    weights_bytes_per_gpu: int
    weights_source: str
    requested_bytes: int  # ceil(total × utilization)
    non_torch_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int
    kv_pool_bytes: int  # may be ≤ 0: nothing left for the KV cache
    kv_pool_source: (
        str  # "estimated" | "--kv-cache-memory-bytes" | "vLLM log" | "cache_config_info"
    )
    pool_tokens: int
    pool_blocks: int
    max_concurrency_at_max_model_len: float

    @property
    def fits_one_request(self) -> bool:
        return self.pool_tokens >= self.max_model_len

    def max_concurrency_at(self, request_tokens: float) -> float | None:
        if request_tokens <= 0:
            return None
        blocks_per_request = math.ceil(request_tokens / self.block_size)
        return self.pool_blocks / blocks_per_request

    def largest_max_model_len(self, concurrency: int) -> int:
        """The longest max_model_len of which ``concurrency`` sequences fit in the pool."""
        if concurrency <= 0:
            return 0
        return (self.pool_blocks // concurrency) * self.block_size


def compute_budget(
    model: ModelShape, d: Deployment, *, kv_pool_bytes: int | None = None, kv_pool_source: str = ""
) -> KvBudget:
    """The budget of ``model`` under ``d``; ``kv_pool_bytes`` replaces the estimate when vLLM
    said what it allocated (its log or ``cache_config_info``)."""
    total = d.gpu_memory_total_bytes
    tp = d.tensor_parallel_size or 1
    util = d.gpu_memory_utilization_ratio or DEFAULT_GPU_MEMORY_UTILIZATION
    seqs = d.max_num_seqs or default_max_num_seqs(total)
    batched = d.max_num_batched_tokens or default_max_num_batched_tokens(total)
    block = d.block_size or DEFAULT_BLOCK_SIZE
    mml = d.max_model_len or model.max_position_embeddings
    kv_dtype = d.kv_cache_dtype or "auto"
    per_token = model.kv_bytes_per_token(tp, kv_dtype_bytes(kv_dtype, model))
    weights = model.weights_bytes // tp
    requested = math.ceil(total * util)
    non_torch = NON_TORCH_BYTES + (NON_TORCH_TP_EXTRA_BYTES if tp > 1 else 0)
    act_per_token = (4 * model.hidden_size + 2 * model.intermediate_size // tp) * model.dtype_bytes
    activation = batched * act_per_token + seqs * model.vocab_size * 4
    graphs = (
        0
        if d.enforce_eager
        else CUDAGRAPH_BASE_BYTES
        + model.num_layers * model.hidden_size * min(2 * seqs, 512) * 4 * model.dtype_bytes // 2
    )
    if kv_pool_bytes is not None:
        pool, source = kv_pool_bytes, kv_pool_source or "reported"
    elif d.kv_cache_memory_bytes is not None:
        pool, source = d.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    else:
        pool, source = requested - weights - non_torch - activation - graphs, "estimated"
    block_bytes = block * per_token
    blocks = max(0, pool // block_bytes) if block_bytes > 0 else 0
    tokens = blocks * block
    return KvBudget(
        model=model.name,
        gpu_memory_total_bytes=total,
        gpu_memory_utilization_ratio=util,
        tensor_parallel_size=tp,
        max_model_len=mml,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        block_size=block,
        kv_cache_dtype=kv_dtype,
        kv_bytes_per_token=per_token,
        block_bytes=block_bytes,
        weights_bytes_per_gpu=weights,
        weights_source=model.weights_source,
        requested_bytes=requested,
        non_torch_bytes=non_torch,
        activation_peak_bytes=activation,
        cudagraph_bytes=graphs,
        kv_pool_bytes=pool,
        kv_pool_source=source,
        pool_tokens=tokens,
        pool_blocks=blocks,
        max_concurrency_at_max_model_len=round(tokens / mml, 2) if mml > 0 else 0.0,
    )


def minimum_footprint_bytes(model: ModelShape, tensor_parallel_size: int = 1) -> int:
    """The least one GPU of the TP group needs: weights, non-torch memory, the activations of
    2048 batched tokens and the KV cache of one 2048-token sequence, in eager mode."""
    tp = max(1, tensor_parallel_size)
    d = Deployment(
        gpu_memory_total_bytes=1 << 50,
        tensor_parallel_size=tp,
        max_num_seqs=1,
        max_num_batched_tokens=MIN_DEPLOY_TOKENS,
        enforce_eager=True,
        max_model_len=MIN_DEPLOY_TOKENS,
    )
    b = compute_budget(model, d, kv_pool_bytes=0)
    return (
        b.weights_bytes_per_gpu
        + b.non_torch_bytes
        + b.activation_peak_bytes
        + MIN_DEPLOY_TOKENS * b.kv_bytes_per_token
    )


def model_fits(model: ModelShape, total_bytes: int, tensor_parallel_size: int = 1) -> bool:
    return (
        minimum_footprint_bytes(model, tensor_parallel_size) <= total_bytes * MIN_DEPLOY_UTILIZATION
    )


@dataclass(frozen=True)
class FitOption:
    """One way to make a model fit that does not: what to change and what it leaves for KV."""

    change: str  # e.g. "--tensor-parallel-size 2"
    flags: tuple[tuple[str, str], ...]
    kv_pool_bytes: int
    pool_tokens: int


def fit_options(model: ModelShape, d: Deployment) -> tuple[FitOption, ...]:
    """Quantization, tensor parallelism or a shorter max_model_len, each with its numbers."""
    out: list[FitOption] = []
    tp = d.tensor_parallel_size or 1
    if model.dtype_bytes > 1 and model.quantization is None:
        fp8 = replace(
            model, weights_bytes=model.weights_bytes // model.dtype_bytes, quantization="fp8"
        )
        b = compute_budget(fp8, replace(d, kv_cache_memory_bytes=None))
        if b.kv_pool_bytes > 0 and b.fits_one_request:
            out.append(
                FitOption(
                    "fp8 weights (--quantization fp8)",
                    (("--quantization", "fp8"),),
                    b.kv_pool_bytes,
                    b.pool_tokens,
                )
            )
    for new_tp in (2, 4, 8):
        if new_tp <= tp or model.num_attention_heads % new_tp:
            continue  # vLLM needs the attention heads divisible by TP
        b = compute_budget(
            model, replace(d, tensor_parallel_size=new_tp, kv_cache_memory_bytes=None)
        )
        if b.kv_pool_bytes > 0 and b.fits_one_request:
            out.append(
                FitOption(
                    f"tensor parallelism over {new_tp} GPUs",
                    (("--tensor-parallel-size", str(new_tp)),),
                    b.kv_pool_bytes,
                    b.pool_tokens,
                )
            )
            break
    b = compute_budget(model, replace(d, kv_cache_memory_bytes=None))
    if b.kv_pool_bytes > 0 and not b.fits_one_request and b.pool_tokens >= MIN_DEPLOY_TOKENS:
        out.append(
            FitOption(
                f"a shorter --max-model-len {b.pool_tokens}",
                (("--max-model-len", str(b.pool_tokens)),),
                b.kv_pool_bytes,
                b.pool_tokens,
            )
        )
    return tuple(out)
