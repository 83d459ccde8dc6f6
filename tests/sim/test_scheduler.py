"""The scheduler's observable behaviour: blocks per token, caps, preemption, prefix hits."""

from __future__ import annotations

from vllm_guardian.sim.profiling import EngineConfig
from vllm_guardian.sim.scheduler import BlockPool, Scheduler, SimRequest, prompt_block_hashes


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "gpu_memory_utilization": 0.92, "max_model_len": 256, "max_num_seqs": 8,
        "max_num_batched_tokens": 512, "block_size": 16, "enable_prefix_caching": True,
        "enable_chunked_prefill": True, "enforce_eager": False, "kv_cache_memory_bytes": None,
        "expandable_segments": False, "served_model_name": "m", "model_path": "m",
    }  # fmt: skip
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def req(rid: str, words: list[str], max_tokens: int = 100, block_size: int = 16) -> SimRequest:
    return SimRequest(rid, 0.0, len(words), max_tokens, prompt_block_hashes(words, block_size))


def step(s: Scheduler) -> None:
    for chunk in s.schedule().chunks:
        if s.commit(chunk):
            chunk.request.num_output += 1


def test_blocks_are_allocated_per_token() -> None:
    s = Scheduler(cfg(), num_blocks=65)
    r = req("a", [f"w{i}" for i in range(20)])
    s.add(r)
    step(s)  # prefill 20 tokens: 2 blocks
    assert len(r.blocks) == 2
    for _ in range(12):  # 32 tokens computed: still 2 blocks (the 33rd is sampled, not stored)
        step(s)
    assert r.num_tokens == 33
    assert len(r.blocks) == 2
    step(s)  # computing the 33rd token's KV needs a third block
    assert len(r.blocks) == 3
    assert s.pool.num_free == 64 - 3


def test_running_is_capped_by_max_num_seqs() -> None:
    s = Scheduler(cfg(max_num_seqs=3), num_blocks=1000)
    for i in range(10):
        s.add(req(str(i), [f"u{i}w{j}" for j in range(10)]))
    step(s)
    assert len(s.running) == 3
    assert len(s.waiting) == 7


def test_preemption_when_blocks_run_out() -> None:
    s = Scheduler(cfg(enable_prefix_caching=False), num_blocks=9)  # 8 usable blocks
    reqs = [req(str(i), [f"u{i}w{j}" for j in range(32)]) for i in range(4)]  # 2 blocks each
    for r in reqs:
        s.add(r)
    step(s)
    assert len(s.running) == 4
    assert s.pool.usage_ratio() == 1.0
    step(s)  # the first decode token of request 0 needs a third block
    assert s.num_preemptions_total >= 1
    assert reqs[3] in s.waiting and reqs[3].num_computed == 0 and reqs[3].num_preemptions == 1


def test_prefix_cache_hits_and_evictable_blocks_count_as_free() -> None:
    s = Scheduler(cfg(), num_blocks=33)
    shared = [f"s{j}" for j in range(64)]
    a = req("a", [*shared, "a1", "a2"], max_tokens=1)
    s.add(a)
    step(s)
    assert a.status.value == "running" and a.num_output == 1
    s.remove(a)
    assert s.pool.usage_ratio() == 0.0  # cached but unused blocks are free
    b = req("b", [*shared, "b1"], max_tokens=1)
    s.add(b)
    step(s)
    assert b.cached_prompt_tokens == 64
    assert (s.prefix_queries_tokens, s.prefix_hits_tokens) == (66 + 65, 64)


def test_cached_blocks_are_evicted_on_demand() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(4)
    assert blocks is not None
    for i, b in enumerate(blocks):
        pool.register(b, 1000 + i)
    pool.release(blocks)
    assert pool.lookup(1000) is not None
    assert pool.allocate(4) is not None  # everything evictable is reusable
    assert pool.lookup(1000) is None
