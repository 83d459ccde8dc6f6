"""The physical memory of the simulated GPU, which, unlike the KV pool, can overflow.

At every engine step the card holds::

    used = weights + non_torch + cudagraphs + kv_pool            (fixed at start-up)
         + activations(batch)                                     (this step's forward pass)
         + fragmentation                                          (creeps with request churn)
         + other processes                                        (another tenant)

and the step's allocation fails (``torch.OutOfMemoryError``) when ``used > total``. The
start-up profile budgets activations for ``max_num_batched_tokens`` tokens, but prefill chunks
that attend over long contexts also need workspace the profile run never exercises; it grows
with chunk × context, which is why large batched-token prefills OOM at runtime and why a lower
``--max-num-batched-tokens`` cures it. Fragmentation grows by a share of each finished request's
activation footprint (stranded split blocks of the caching allocator), 20× slower with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_guardian.sim.modelspec import ModelSpec
from vllm_guardian.sim.profiling import StartupPlan, activation_peak_bytes
from vllm_guardian.sim.scheduler import ScheduledChunk

# Workspace per (query token × context token) per attention head of a prefill chunk that the
# profile run does not reserve (long-context attention metadata and split-KV buffers).
UNPROFILED_BYTES_PER_TOKEN_PAIR_PER_HEAD = 1.5
# Share of a finished request's activation footprint left stranded as an unusable split block.
FRAGMENTATION_RATIO = 0.002
# expandable_segments maps pages into one growing segment instead of carving fixed blocks:
# it slows fragmentation down a lot but does not stop it.
EXPANDABLE_SEGMENTS_SLOWDOWN = 20.0


@dataclass(frozen=True)
class MemoryBreakdown:
    total_bytes: int
    weights_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    fragmentation_bytes: int
    other_processes_bytes: int

    @property
    def process_bytes(self) -> int:
        """What this (twin) process holds on the card."""
        return (
            self.weights_bytes
            + self.non_torch_bytes
            + self.cudagraph_bytes
            + self.kv_cache_bytes
            + self.activation_bytes
            + self.fragmentation_bytes
        )

    @property
    def torch_allocated_bytes(self) -> int:
        return (
            self.weights_bytes + self.cudagraph_bytes + self.kv_cache_bytes + self.activation_bytes
        )

    @property
    def torch_reserved_bytes(self) -> int:
        """The caching allocator's reservation: allocated plus the stranded split blocks."""
        return self.torch_allocated_bytes + self.fragmentation_bytes

    @property
    def used_bytes(self) -> int:
        return self.process_bytes + self.other_processes_bytes

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    @property
    def over_bytes(self) -> int:
        return self.used_bytes - self.total_bytes


def alloc_retry_needed(mem: MemoryBreakdown, activation_budget_bytes: int) -> bool:
    """The step fit, but only after the caching allocator freed its cached blocks and retried
    ``cudaMalloc`` (``num_alloc_retries``): the card's free memory is below one full-batch
    activation pool (the profile's budget), so the pool the allocator keeps for the next large
    step no longer fits beside everything else. It happens only near the end of the card,
    which is what makes retries a late pre-OOM signal."""
    return mem.over_bytes <= 0 and mem.free_bytes < activation_budget_bytes


def unprofiled_bytes(model: ModelSpec, chunks: Iterable[ScheduledChunk]) -> int:
    heads = max(1, model.num_attention_heads // model.tensor_parallel_size)
    pairs = sum(
        c.num_new_tokens * (c.context_tokens + c.num_new_tokens)
        for c in chunks
        if c.num_new_tokens > 1
    )
    return int(pairs * heads * UNPROFILED_BYTES_PER_TOKEN_PAIR_PER_HEAD)


def step_activation_bytes(model: ModelSpec, chunks: tuple[ScheduledChunk, ...]) -> int:
    """Profiled part (tokens × per-token buffers + logits) plus the unprofiled workspace."""
    tokens = sum(c.num_new_tokens for c in chunks)
    return activation_peak_bytes(model, tokens, len(chunks)) + unprofiled_bytes(model, chunks)


class MemoryModel:
    """The twin process's device memory over time (mutable: fragmentation accumulates)."""

    def __init__(
        self,
        model: ModelSpec,
        plan: StartupPlan,
        expandable_segments: bool,
        fragmentation_creep_factor: float,
    ) -> None:
        self.model = model
        self.plan = plan
        self.expandable_segments = expandable_segments
        self.creep_factor = fragmentation_creep_factor
        self.fragmentation_bytes = 0.0

    def on_request_finished(self, prompt_tokens: int) -> None:
        growth = prompt_tokens * self.model.activation_bytes_per_token * FRAGMENTATION_RATIO
        growth *= self.creep_factor
        if self.expandable_segments:
            growth /= EXPANDABLE_SEGMENTS_SLOWDOWN
        self.fragmentation_bytes += growth

    def breakdown(self, activation_bytes: int, other_processes_bytes: int) -> MemoryBreakdown:
        return MemoryBreakdown(
            total_bytes=self.plan.total_bytes,
            weights_bytes=self.plan.weights_bytes,
            non_torch_bytes=self.plan.non_torch_bytes,
            cudagraph_bytes=self.plan.cudagraph_bytes,
            kv_cache_bytes=self.plan.kv_cache_bytes,
            activation_bytes=activation_bytes,
            fragmentation_bytes=int(self.fragmentation_bytes),
            other_processes_bytes=other_processes_bytes,
        )
