"""KV thrash, the same advice everywhere: diagnose, plan and loadtest say over capacity
by X× (or that capacity is not measurable), add N replicas or shed at the gate, and that a
--max-num-seqs below what the pool hosts costs throughput; none lowers --max-num-seqs."""

from __future__ import annotations

import json

import pytest

from vllm_guardian.core.budget import LaunchFlags
from vllm_guardian.core.capacity import CapacityEstimate, CapacityState
from vllm_guardian.core.levers import (
    LOW_CAP_COSTS,
    admission_limit,
    mean_context_tokens,
    median,
    recompute_share,
    sequences_hosted,
)
from vllm_guardian.diagnose.recommend import Context, recommend
from vllm_guardian.model import Cause
from vllm_guardian.tools.cli import main

from .conftest import FIXTURES

OVER = CapacityEstimate(
    CapacityState.ESTIMATED, "saturated", 120.0, 1.0, 2.0, 4.0, 1200.0, 2400.0, 2.0, 2
)
REFUSED = CapacityEstimate(CapacityState.RESTARTED, "vLLM restarted within the window")

DIAGNOSE = [
    # name, context overrides, summary says, an action says
    ("measured: over capacity by 2x", {"capacity": OVER},
     "Over capacity by 2.00x: KV thrash is a capacity problem. Run 2 replica(s) (add 1) or shed at the gate.",
     "capacity: demand 2.00x what it serves at saturation"),
    ("refused: says why", {"capacity": REFUSED},
     "Saturated (KV thrash); capacity not measurable from this data: vLLM restarted within the window.",
     "shed at the gate"),
    ("the pool hosts 16 at the p95 length", {"pool_tokens": 32768, "p95_request_tokens": 2048, "running_requests": 9},
     "capacity not measurable from this data",
     "keep --max-num-seqs (now 256) at or above what the pool hosts: the pool hosts about 16 sequences"),
    ("running under thrash is the larger reading", {"pool_tokens": 4096, "p95_request_tokens": 1885, "running_requests": 5},
     "capacity not measurable", "the pool hosts about 5 sequences (2: 4,096 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kw", "summary", "action"), DIAGNOSE,
                         ids=[d[0] for d in DIAGNOSE])  # fmt: skip
def test_diagnose_says_capacity_never_a_lower_cap(name, kw, summary, action):
    c = Context(Cause.CONCURRENCY_OVERCOMMIT, LaunchFlags(max_num_seqs=256), None, **kw)
    r = recommend(c)
    assert summary in r.summary, r.summary
    assert any(action in a for a in r.actions), r.actions
    assert r.flags == () and r.env_file is None and r.command_line is None
    assert any(LOW_CAP_COSTS in a for a in r.actions)


def test_plan_sizes_replicas_instead_of_a_cap(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(FIXTURES / "models" / "llama-3-8b")
    main(["plan", "--model", model, "--gpu-memory-gib", "24", "--request-tokens", "2000",
          "--concurrency", "64", "--max-num-seqs", "256", "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "concurrency_overcommit"
    rec = doc["recommendation"]
    assert rec["flags"] == [], rec
    assert "pool hosts 24 sequences" in doc["causes"][0]["evidence"][0]
    assert rec["actions"][0] == (
        "for 64 concurrent requests: 64 ÷ 24 sequences per replica = 3 replica(s), "
        "or shed the rest at the gate"
    )
    assert "Capacity not measurable from this data: a plan has no traffic" in rec["summary"]


LEVERS = [
    # name, value, expected
    ("hosted: 15 usable blocks of 128 ÷ 512-token sequences", sequences_hosted(1920, 512), 3),
    ("hosted under a 90 % watermark", sequences_hosted(32768, 2048, 0.9), 14),
    ("hosted: unknown pool", sequences_hosted(None, 2048), None),
    ("hosted: zero-length requests", sequences_hosted(32768, 0), None),
    ("admission: 15 usable blocks ÷ 2-block prompts", admission_limit(15, 2), 7),
    ("admission: unknown", admission_limit(15, None), None),
    ("median, odd", median([1, 7, 5, 5, 3]), 5.0),
    ("median, even", median([3, 28, 20, 21]), 20.5),
    ("median, none", median([]), None),
    ("context: 97 % of 32768 over 16 running", mean_context_tokens(0.97, 32768, 16), 1986.56),
    ("context: nothing running", mean_context_tokens(0.97, 32768, 0), None),
    ("recompute: 2/s × 2000 ÷ 5000 tok/s", recompute_share(2.0, 2000.0, 5000.0), 0.8),
    ("recompute: no throughput", recompute_share(2.0, 2000.0, 0.0), None),
]


@pytest.mark.parametrize(("name", "value", "expected"), LEVERS, ids=[x[0] for x in LEVERS])
def test_levers(name, value, expected):
    assert value == (expected if expected is None else pytest.approx(expected))
