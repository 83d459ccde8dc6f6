"""Acting before the crash on the twin: the armed core (signals, forecast, shipped rules, policy)
against the twin's engine in simulated time (``bench/forecast.py``), each run printed.

``fragmentation_creep`` and ``noisy_neighbour`` must end with no CUDA OOM under the guardian,
its first pre-emptive step before the unguarded run's first OOM; the negative controls must see
no pre-emptive action, no forecast gate and no exhaustion alert.
"""

from __future__ import annotations

import pytest

from bench import forecast as bench

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scenario", ["fragmentation_creep", "noisy_neighbour"])
def test_the_guardian_acts_before_the_oom(scenario: str) -> None:
    oom_at = bench.first_oom(scenario, 0, 5.0)
    unguarded = bench.run(scenario, 0, 5.0, guarded=False)
    guarded = bench.run(scenario, 0, 5.0, guarded=True)
    first = guarded.first_preemptive_seconds
    print(f"{scenario}: unguarded {unguarded.ooms} OOM(s), first at {oom_at}s; guardian "
          f"{guarded.ooms} OOM(s), first pre-emptive step at {first}s; actions {guarded.actions}")  # fmt: skip
    assert oom_at is not None and unguarded.ooms >= 1
    assert guarded.ooms == 0
    assert first is not None and first < oom_at


@pytest.mark.parametrize("scenario", ["steady", "prefix_cache_waste"])
def test_negative_controls_see_no_forecast_action(scenario: str) -> None:
    r = bench.run(scenario, 3, 10.0, guarded=True)
    print(f"{scenario}: {r.served} served, actions {r.actions}, gates {r.forecast_gates}, "
          f"alerts {r.exhaustion_alerts}")  # fmt: skip
    assert r.served > 1000
    assert (r.actions, r.forecast_gates, r.exhaustion_alerts) == ([], [], [])
