"""Start-up memory profiling as vLLM V1 does it: how many KV blocks fit, or why none do.

vLLM (0.21+, ``gpu_worker.determine_available_memory``) reserves ``total × utilization``,
loads the weights, runs a dummy forward pass of ``max_num_batched_tokens`` to find the
activation peak, estimates the CUDA-graph pool, and gives the rest to the KV cache:

    requested  = ceil(total × gpu_memory_utilization)
    kv_bytes   = requested − (weights + non_torch + activation_peak) − cudagraph_estimate
    num_blocks = kv_bytes // (block_size × kv_bytes_per_token)

``--kv-cache-memory-bytes`` replaces ``kv_bytes``. Start-up fails with vLLM's own messages when
free memory is below ``requested``, when no block fits, or when one max-length sequence does
not fit. Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from vllm_guardian.sim.modelspec import ModelSpec

GIB = 1 << 30
MIB = 1 << 20

# CUDA context, cuBLAS/cuDNN workspaces, attention-backend buffers: memory torch does not
# track. Measured vLLM start-ups log 0.4-0.8 GiB of it on one GPU; NCCL adds more under TP.
NON_TORCH_BYTES = 512 * MIB
NON_TORCH_TP_EXTRA_BYTES = 256 * MIB
# Graph pool per captured token per layer per hidden unit (calibrated to ~0.6 GiB for an
# 8B model at the default capture size of 512).
CUDAGRAPH_BYTES_PER_UNIT = 4
CUDAGRAPH_BASE_BYTES = 64 * MIB
# vLLM's default largest capture size: min(max_num_seqs × 2, 512).
MAX_CUDAGRAPH_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class EngineConfig:
    """The resolved memory flags of one engine (vLLM defaults already applied)."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    enforce_eager: bool
    kv_cache_memory_bytes: int | None
    expandable_segments: bool
    served_model_name: str
    model_path: str
    # --max-num-queued-reqs: past this many unfinished requests the API server answers 503.
    max_num_queued_reqs: int | None = None


class StartupFailureKind(enum.Enum):
    FREE_MEMORY_BELOW_REQUEST = "free_memory_below_request"
    WEIGHTS_DO_NOT_FIT = "weights_do_not_fit"
    NO_CACHE_BLOCKS = "no_cache_blocks"
    MAX_LEN_DOES_NOT_FIT = "max_len_does_not_fit"


@dataclass(frozen=True)
class StartupFailure:
    kind: StartupFailureKind
    message: str
    # The exception class vLLM raises (printed on the traceback's last line).
    exception: str


@dataclass(frozen=True)
class StartupPlan:
    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    non_torch_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int
    kv_cache_bytes: int
    num_gpu_blocks: int
    block_bytes: int
    block_size: int
    max_model_len: int

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_cache_size_tokens / self.max_model_len


def activation_peak_bytes(model: ModelSpec, num_tokens: int, num_seqs: int) -> int:
    """What the profile run's dummy batch peaks at: tokens × per-token buffers + logits."""
    return num_tokens * model.activation_bytes_per_token + num_seqs * model.logits_bytes_per_seq


def non_torch_bytes(model: ModelSpec) -> int:
    extra = NON_TORCH_TP_EXTRA_BYTES if model.tensor_parallel_size > 1 else 0
    return NON_TORCH_BYTES + extra


def cudagraph_estimate_bytes(model: ModelSpec, cfg: EngineConfig) -> int:
    """0 with ``--enforce-eager``; else grows with layers × hidden × largest capture size."""
    if cfg.enforce_eager:
        return 0
    capture = min(cfg.max_num_seqs * 2, MAX_CUDAGRAPH_CAPTURE_SIZE)
    per_unit = CUDAGRAPH_BYTES_PER_UNIT * model.dtype_bytes // 2
    return CUDAGRAPH_BASE_BYTES + model.num_layers * model.hidden_size * capture * per_unit


def profile_startup(
    model: ModelSpec, cfg: EngineConfig, total_bytes: int, other_used_bytes: int
) -> StartupPlan | StartupFailure:
    """Size the KV cache like vLLM's start-up profiling, or fail with vLLM's message."""
    total_gib = total_bytes / GIB
    requested = math.ceil(total_bytes * cfg.gpu_memory_utilization)
    free = total_bytes - other_used_bytes
    if free < requested:
        return StartupFailure(
            StartupFailureKind.FREE_MEMORY_BELOW_REQUEST,
            f"Free memory on device cuda:0 ({free / GIB:.2f}/{total_gib:.2f} GiB) on startup "
            f"is less than desired GPU memory utilization ({cfg.gpu_memory_utilization}, "
            f"{requested / GIB:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory "
            "used by other processes.",
            "ValueError",
        )
    weights = model.weights_bytes
    non_torch = non_torch_bytes(model)
    if weights + non_torch > free:
        return StartupFailure(
            StartupFailureKind.WEIGHTS_DO_NOT_FIT,
            oom_message(
                tried_bytes=weights + non_torch - free + 256 * MIB,
                total_bytes=total_bytes,
                free_bytes=max(0, free - weights),
                process_bytes=weights,
                allocated_bytes=weights,
                reserved_unallocated_bytes=0,
                other_processes=(),
            ),
            "torch.OutOfMemoryError",
        )
    act = activation_peak_bytes(model, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    graphs = cudagraph_estimate_bytes(model, cfg)
    if cfg.kv_cache_memory_bytes is not None:
        kv_bytes = cfg.kv_cache_memory_bytes
    else:
        kv_bytes = requested - (weights + non_torch + act) - graphs
    block_bytes = cfg.block_size * model.kv_bytes_per_token
    num_blocks = max(0, kv_bytes) // block_bytes
    if num_blocks <= 0:
        return StartupFailure(
            StartupFailureKind.NO_CACHE_BLOCKS,
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine (this flag also controls CPU memory reservation on "
            "the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            "ValueError",
        )
    needed = cfg.max_model_len * model.kv_bytes_per_token
    if num_blocks * block_bytes < needed:
        est_len = num_blocks * cfg.block_size
        return StartupFailure(
            StartupFailureKind.MAX_LEN_DOES_NOT_FIT,
            f"To serve at least one request with the model's max seq len "
            f"({cfg.max_model_len}), ({needed / GIB:.2f} GiB KV cache is needed, which is "
            f"larger than the available KV cache memory ({kv_bytes / GIB:.2f} GiB). Based on "
            f"the available memory, the estimated maximum model length is {est_len}. Try "
            "increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine. See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            "ValueError",
        )
    return StartupPlan(
        total_bytes=total_bytes,
        requested_bytes=requested,
        weights_bytes=weights,
        non_torch_bytes=non_torch,
        activation_peak_bytes=act,
        cudagraph_bytes=graphs,
        kv_cache_bytes=num_blocks * block_bytes,
        num_gpu_blocks=num_blocks,
        block_bytes=block_bytes,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
    )


def fmt_gib(n_bytes: int) -> str:
    """torch's size formatting in OOM messages: GiB with two decimals, MiB below 1 GiB."""
    if n_bytes >= GIB:
        return f"{n_bytes / GIB:.2f} GiB"
    return f"{n_bytes / MIB:.2f} MiB"


def oom_message(
    *,
    tried_bytes: int,
    total_bytes: int,
    free_bytes: int,
    process_bytes: int,
    allocated_bytes: int,
    reserved_unallocated_bytes: int,
    other_processes: tuple[tuple[int, int], ...],
    device_index: int = 0,
) -> str:
    """torch ≥ 2.1's ``CUDA out of memory`` text, one "Process N has X in use." per process."""
    others = "".join(
        f"Process {pid} has {fmt_gib(b)} memory in use. " for pid, b in other_processes
    )
    return (
        f"CUDA out of memory. Tried to allocate {fmt_gib(tried_bytes)}. GPU {device_index} has a "
        f"total capacity of {fmt_gib(total_bytes)} of which {fmt_gib(max(0, free_bytes))} is "
        f"free. {others}Including non-PyTorch memory, this process has "
        f"{fmt_gib(process_bytes)} memory in use. Of the allocated memory "
        f"{fmt_gib(allocated_bytes)} is allocated by PyTorch, and "
        f"{fmt_gib(reserved_unallocated_bytes)} is reserved by PyTorch but unallocated. If "
        "reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
