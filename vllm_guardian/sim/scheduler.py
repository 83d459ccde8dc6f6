"""vLLM V1's observable scheduling: paged KV blocks, a running batch, a waiting queue.

What the guardian can see of vLLM's scheduler comes from here: blocks are allocated per token
as sequences grow (``block_size`` tokens per block); at most ``max_num_seqs`` requests run and
at most ``max_num_batched_tokens`` tokens are scheduled per step (long prompts are chunked);
when a running request needs a block and none is free, the latest-admitted running request is
preempted (recompute: its blocks are freed and it goes back to the head of the waiting queue);
with prefix caching, full prompt blocks are hashed and reused by later prompts that share the
prefix, and freed cached blocks stay evictable in the free queue, so they count as free
(``kv_cache_usage = 1 − free / (num_blocks − 1)``, block 0 being vLLM's null block).
Pure and deterministic: no clock, no randomness.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_guardian.sim.profiling import EngineConfig


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REPETITION = "repetition"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def prompt_block_hashes(words: Sequence[str], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as vLLM's prefix cache keys them."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(words) - block_size + 1, block_size):
        parent = hash((parent, tuple(words[start : start + block_size])))
        hashes.append(parent)
    return hashes


class SimRequest:
    """One request's scheduling state (mutable: it is the scheduler's working set)."""

    __slots__ = (
        "arrival_seconds",
        "block_hashes",
        "blocks",
        "cached_prompt_tokens",
        "finish_reason",
        "first_scheduled_seconds",
        "first_token_seconds",
        "hits_recorded",
        "last_token_seconds",
        "max_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "prompt_len",
        "request_id",
        "status",
        "stop_at",
    )

    def __init__(
        self,
        request_id: str,
        arrival_seconds: float,
        prompt_len: int,
        max_tokens: int,
        block_hashes: list[int],
        stop_at: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival_seconds = arrival_seconds
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.block_hashes = block_hashes
        self.stop_at = stop_at
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []
        # Blocks of ``blocks`` whose hash is registered in the prefix cache.
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        self.cached_prompt_tokens = 0
        self.hits_recorded = False
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.first_scheduled_seconds: float | None = None
        self.first_token_seconds: float | None = None
        self.last_token_seconds: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output


class BlockPool:
    """KV blocks with ref counts, an LRU free queue and a hash → block prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # vLLM's free queue starts as every block in order, then takes freed blocks at its
        # tail. Never-used blocks are kept as a counter (a small model on a big card has
        # millions of blocks); freed ones in an LRU dict. Block 0 is the null block.
        self._next_fresh = 1
        self._free: OrderedDict[int, None] = OrderedDict()
        self._ref: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._free)

    def usage_ratio(self) -> float:
        return 1.0 - self.num_free / max(1, self.num_blocks - 1)

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def take_cached(self, block: int) -> None:
        """A prefix hit: the cached block gains a user (and leaves the free queue if idle)."""
        if self._ref.get(block, 0) == 0:
            del self._free[block]
        self._ref[block] = self._ref.get(block, 0) + 1

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._next_fresh < self.num_blocks:
                block = self._next_fresh
                self._next_fresh += 1
            else:
                block, _ = self._free.popitem(last=False)
                old = self._hash_of.pop(block, None)
                if old is not None:
                    # Evicting a cached block on demand: why cached blocks count as free.
                    del self._cached[old]
            self._ref[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks first, so a prompt's leading blocks are evicted last (vLLM does the same).
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                del self._ref[block]
                self._free[block] = None

    def register(self, block: int, block_hash: int) -> None:
        if self.enable_caching and block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash


@dataclass(frozen=True)
class ScheduledChunk:
    request: SimRequest
    num_new_tokens: int
    # Tokens already computed before this chunk: attention context that the chunk reads.
    context_tokens: int


@dataclass(frozen=True)
class ScheduleResult:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[SimRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """The running batch, the waiting queue and the block pool of one engine."""

    def __init__(self, cfg: EngineConfig, num_blocks: int) -> None:
        self.cfg = cfg
        self.pool = BlockPool(num_blocks, cfg.enable_prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_preemptions_total = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Drop a request (finished or aborted) and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.status = RequestStatus.FINISHED

    def _blocks_needed(self, req: SimRequest, n_new: int) -> int:
        bs = self.cfg.block_size
        return -(-(req.num_computed + n_new) // bs) - len(req.blocks)

    def _grow(self, req: SimRequest, n_new: int) -> bool:
        need = self._blocks_needed(req, n_new)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions_total += 1

    def _admit_prefix(self, req: SimRequest) -> int:
        """Reuse cached prompt blocks; returns the number of hit tokens."""
        bs = self.cfg.block_size
        # At least one token must be computed to sample from, as in vLLM.
        max_hit_blocks = (req.num_tokens - 1) // bs
        hits = 0
        for block_hash in req.block_hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            self.pool.take_cached(block)
            req.blocks.append(block)
            hits += 1
        req.num_cached_blocks = hits
        req.num_computed = hits * bs
        return hits * bs

    def schedule(self) -> ScheduleResult:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n_new = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, n_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    n_new = 0
                    break
            if n_new == 0:
                break
            chunks.append(ScheduledChunk(req, n_new, req.num_computed))
            budget -= n_new
            i += 1
        # Like vLLM V1: no new admissions in a step that had to preempt.
        while (
            not preempted
            and self.waiting
            and len(self.running) < self.cfg.max_num_seqs
            and budget > 0
        ):
            req = self.waiting[0]
            hit_tokens = self._admit_prefix(req) if self.cfg.enable_prefix_caching else 0
            remaining = req.num_tokens - req.num_computed
            n_new = min(remaining, budget)
            blocked = not self.cfg.enable_chunked_prefill and n_new < remaining
            if blocked or not self._grow(req, n_new):
                self.pool.release(req.blocks)
                req.blocks = []
                req.num_cached_blocks = 0
                req.num_computed = 0
                break
            self.waiting.popleft()
            if not req.hits_recorded:
                # vLLM's exported prefix-cache counters skip preempted re-admissions.
                req.hits_recorded = True
                req.cached_prompt_tokens = hit_tokens
                self.prefix_queries_tokens += req.num_tokens
                self.prefix_hits_tokens += hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n_new, req.num_computed))
            budget -= n_new
        return ScheduleResult(tuple(chunks), tuple(preempted))

    def commit(self, chunk: ScheduledChunk) -> bool:
        """Apply an executed chunk; True when it completed the sequence (a token is sampled)."""
        req = chunk.request
        req.num_computed += chunk.num_new_tokens
        if self.cfg.enable_prefix_caching:
            full = min(req.num_computed, req.prompt_len) // self.cfg.block_size
            for idx in range(req.num_cached_blocks, min(full, len(req.block_hashes))):
                self.pool.register(req.blocks[idx], req.block_hashes[idx])
            req.num_cached_blocks = max(req.num_cached_blocks, full)
        return req.num_computed >= req.num_tokens
