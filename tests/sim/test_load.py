"""The load generator: seeded, bounded, loopback only."""

from __future__ import annotations

import pytest

from vllm_guardian.sim.load import OutcomeKind, plan_requests, require_loopback, run_load
from vllm_guardian.sim.scenarios import SCENARIOS, LoadProfile


def test_plans_are_seeded_and_bounded() -> None:
    profile = SCENARIOS["steady"].load
    a = plan_requests(profile, 1, 50, 1000.0)
    assert a == plan_requests(profile, 1, 50, 1000.0)
    assert a != plan_requests(profile, 2, 50, 1000.0)
    assert len(a) == 50
    short = plan_requests(profile, 1, 10_000, 10.0)
    assert all(p.at_seconds < 10.0 for p in short)
    assert all(profile.prompt_tokens_min <= p.prompt_tokens <= profile.prompt_tokens_max for p in a)
    assert all(len(p.prompt.split()) == p.prompt_tokens for p in a)


def test_bursts_and_shared_prefixes() -> None:
    burst = SCENARIOS["prefill_burst"].load
    plan = plan_requests(burst, 0, 100, 40.0)
    first = [p for p in plan if p.burst and p.at_seconds == burst.burst_start_seconds]
    assert len(first) == burst.burst_size
    assert all(p.prompt_tokens >= burst.burst_prompt_tokens_min for p in first)
    shared = LoadProfile(1.0, 100, 100, 1, 1, shared_prefix_ratio=0.5, num_shared_prefixes=1)
    p0, p1 = plan_requests(shared, 0, 2, 100.0)
    assert p0.prompt.split()[:50] == p1.prompt.split()[:50]
    assert p0.prompt.split()[50:] != p1.prompt.split()[50:]


@pytest.mark.parametrize("url", ["http://192.0.2.1:8000", "http://example.invalid:8000", "nohost"])
def test_refuses_anything_but_loopback(url: str) -> None:
    with pytest.raises(ValueError, match=r"loopback|resolve|no host"):
        require_loopback(url)
    with pytest.raises(ValueError):
        run_load(url, [], model="m")


def test_connection_errors_are_outcomes(free_port: int) -> None:
    plan = plan_requests(SCENARIOS["steady"].load, 0, 3, 100.0)
    result = run_load(f"http://127.0.0.1:{free_port}", plan, model="m", speed=100.0,
                      max_duration_seconds=5.0)  # fmt: skip
    assert [o.kind for o in result.outcomes] == [OutcomeKind.CONNECTION_ERROR] * 3
    assert result.summary()["connection_error"] == 3
