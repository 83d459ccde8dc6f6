"""The over-capacity estimate, as a specification: a series of scrapes → a ratio, or a refusal.

Constructed series say what a load shape looks like to vLLM's counters (one sample every 2 s
over the 120 s window); recorded ones are real vLLM 0.32 captures parsed by the guardian's own
parser. A refusal is a state and a reason, never a number.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core.capacity import (
    CapacitySample,
    CapacitySettings,
    CapacityState,
    estimate,
)
from vllm_guardian.core.signals import capacity_samples, derive_service
from vllm_guardian.model import ServiceSnapshot, Snapshot
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

from .conftest import read_fixture

STEP = 2.0
TOKENS_PER_REQUEST = 600.0  # prompt 200 + output 400


def series(
    *,
    served_per_s: float = 2.0,
    arrivals_per_s: float = 2.0,
    aborted_per_s: float = 0.0,
    running: float | Callable[[float], float] = 24.0,
    backlog: float = 10.0,
    seconds: float = 120.0,
    start: float = 1000.0,
    waiting_at: Callable[[float], float] | None = None,
    **overrides: object,
) -> list[CapacitySample]:
    """An engine serving ``served_per_s`` while ``arrivals_per_s`` arrive; the excess grows the
    queue, less what clients abandon (``aborted_per_s``: finished with reason abort)."""
    out = []
    t = 0.0
    while t <= seconds + 1e-9:
        growth = (arrivals_per_s - served_per_s - aborted_per_s) * t
        waiting = waiting_at(t) if waiting_at else backlog + growth
        fields: dict[str, object] = {
            "stats_enabled": True,
            "process_start_seconds": 500.0,
            "finished_total": 100.0 + (served_per_s + aborted_per_s) * t,
            "failed_total": 5.0 + aborted_per_s * t,
            "prompt_tokens_total": 1e5 + served_per_s * 200 * t,
            "generation_tokens_total": 2e5 + served_per_s * 400 * t,
            "running": (running(t) if callable(running) else running)
            if waiting > 0 or served_per_s > 0
            else 0.0,
            "waiting": max(0.0, waiting),
            "kv_usage_ratio": 0.97 if waiting > 0 else 0.4,
        }
        fields.update({k: (v(t) if callable(v) else v) for k, v in overrides.items()})
        out.append(CapacitySample(start + t, scraped=True, **fields))  # type: ignore[arg-type]
        t += STEP
    return out


def idle(t: float) -> float:
    return 0.0


CASES = [
    # name, samples, state, demand ratio (±2 %), replicas needed
    ("open loop at 2x capacity: the queue grows", series(arrivals_per_s=4.0), "estimated", 2.0, 2),
    (
        "2x capacity, clients give up in the queue: the queue is flat, the aborts are demand",
        series(arrivals_per_s=4.0, aborted_per_s=2.0),
        "estimated",
        2.0,
        2,
    ),
    ("1.5x capacity", series(arrivals_per_s=3.0), "estimated", 1.5, 2),
    (
        "2x, the admission gate holds the excess: vLLM's queue flat, the gate's grows",
        series(gate_queued=lambda t: 5.0 + 2.0 * t, gate_rejected_total=0.0),
        "estimated",
        2.0,
        2,
    ),
    (
        "2x, the gate turns the excess away (a counter restarted by the gate's own restart)",
        series(
            gate_queued=3.0, gate_rejected_total=lambda t: 2.0 * t if t < 60 else 2.0 * (t - 60)
        ),
        "estimated",
        2.0,
        2,
    ),
    (
        "2x at the gate, the excess abandoned before vLLM's engine saw it (a busy API server's "
        "backlog, the clients' timeouts): vLLM's counters say 1x, the gate's arrivals 2x",
        series(gate_queued=0.0, gate_arrived_total=lambda t: 50.0 + 4.0 * t),
        "estimated",
        2.0,
        2,
    ),
    (
        "clients that bypass the gate: vLLM counted more than the gate did, the larger stands",
        series(arrivals_per_s=4.0, gate_queued=0.0, gate_arrived_total=lambda t: 2.0 * t),
        "estimated",
        2.0,
        2,
    ),
    (
        "the gate's arrivals with a restart of the gate in the window (its counter from zero)",
        series(gate_queued=0.0, gate_arrived_total=lambda t: 4.0 * t if t < 60 else 4.0 * (t - 60)),
        "estimated",
        1.97,
        2,
    ),
    (
        "the gate's status missed now and then (its source's deadline on a busy host): its "
        "arrivals over the readings it has, scaled to the window",
        series(
            gate_queued=0.0,
            gate_arrived_total=lambda t: None if int(t) % 10 in (0, 8) else 50.0 + 4.0 * t,
        ),
        "estimated",
        2.0,
        2,
    ),
    (
        "the gate's status read over too little of the window: vLLM's own count",
        series(gate_queued=0.0, gate_arrived_total=lambda t: 4.0 * t if t > 90 else None),
        "estimated",
        1.0,
        1,
    ),
    (
        "healthy behind a gate: nothing queued anywhere most of the time",
        series(waiting_at=lambda t: 1.0 if int(t) % 20 == 0 else 0.0, gate_queued=0.0),
        "not_saturated",
        None,
        None,
    ),
    ("3.3x capacity", series(arrivals_per_s=6.6), "estimated", 3.3, 3),
    (
        "2x with room for sequences: no queue, the running count climbs (vLLM V1 admits into "
        "running up to --max-num-seqs; seen on the real vLLM tier)",
        series(arrivals_per_s=4.0, waiting_at=idle, running=lambda t: 10.0 + 2.0 * t),
        "estimated",
        2.0,
        2,
    ),
    (
        "healthy with room for sequences: no queue, the running count flat",
        series(waiting_at=idle, running=lambda t: 10.0 + (1.0 if int(t) % 20 == 0 else 0.0)),
        "not_saturated",
        None,
        None,
    ),
    (
        "saturated at exactly capacity (a closed loop): 1.0x, one replica",
        series(),
        "estimated",
        1.0,
        1,
    ),
    (
        "saturated and the backlog draining: demand below what it serves",
        series(arrivals_per_s=1.5, backlog=80.0),
        "estimated",
        0.75,
        1,
    ),
    (
        "healthy: the queue is empty most of the time",
        series(waiting_at=lambda t: 1.0 if int(t) % 20 == 0 else 0.0),
        "not_saturated",
        None,
        None,
    ),
    (
        "a burst shorter than the window",
        series(arrivals_per_s=4.0, waiting_at=lambda t: 5.0 if 40 <= t < 80 else 0.0),
        "not_saturated",
        None,
        None,
    ),
    (
        "idle",
        series(served_per_s=0.0, arrivals_per_s=0.0, waiting_at=idle),
        "idle",
        None,
        None,
    ),
    (
        "--disable-log-stats",
        series(arrivals_per_s=4.0, stats_enabled=False),
        "no_stats",
        None,
        None,
    ),
    (
        "no request counters exported",
        series(arrivals_per_s=4.0, finished_total=None),
        "no_stats",
        None,
        None,
    ),
    (
        "vLLM restarted in the window (new process start time)",
        series(arrivals_per_s=4.0, process_start_seconds=lambda t: 500.0 if t < 60 else 1060.0),
        "restarted",
        None,
        None,
    ),
    (
        "a counter went down (restart without a start time)",
        series(
            arrivals_per_s=4.0,
            process_start_seconds=None,
            finished_total=lambda t: 100.0 + 2 * t if t < 60 else 2 * (t - 60),
        ),
        "restarted",
        None,
        None,
    ),
    (
        "only 40 s seen (the guardian just started)",
        series(arrivals_per_s=4.0, seconds=40.0),
        "too_little_data",
        None,
        None,
    ),
    (
        "saturated but nothing finishes (a hung engine): not a capacity",
        series(served_per_s=0.0, arrivals_per_s=0.0, backlog=30.0),
        "too_little_data",
        None,
        None,
    ),
    (
        "no scrape at all",
        [CapacitySample(1000.0 + t, scraped=False) for t in range(0, 121, 2)],
        "no_data",
        None,
        None,
    ),
]


@pytest.mark.parametrize(("name", "samples", "state", "ratio", "replicas"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_estimate(name, samples, state, ratio, replicas):
    est = estimate(samples, CapacitySettings(window_seconds=120.0))
    assert est.state is CapacityState(state), est.reason
    assert est.reason
    if ratio is None:
        assert est.demand_ratio is None and est.replicas_needed is None
        assert "no estimate" in est.line()
        return
    assert est.demand_ratio == pytest.approx(ratio, rel=0.02), est.line()
    assert est.replicas_needed == replicas
    assert est.served_tokens_per_second == pytest.approx(2.0 * TOKENS_PER_REQUEST, rel=0.01)
    assert est.demand_tokens_per_second == pytest.approx(ratio * 2.0 * TOKENS_PER_REQUEST, rel=0.02)
    assert f"{est.demand_ratio:.2f}x" in est.line()


def test_scrapes_missing_in_the_middle_do_not_prevent_an_estimate():
    samples = series(arrivals_per_s=4.0)
    gappy = [s if i % 5 else CapacitySample(s.time_seconds, False) for i, s in enumerate(samples)]
    est = estimate(gappy)
    assert est.state is CapacityState.ESTIMATED and est.demand_ratio == pytest.approx(2.0, 0.02)


def test_the_newest_scrape_missing_its_counters_refuses():
    samples = series(arrivals_per_s=4.0)
    samples[-1] = CapacitySample(samples[-1].time_seconds, True, stats_enabled=True)
    assert estimate(samples).state is CapacityState.NO_STATS


# --- recorded: real vLLM 0.32 /metrics captures, through the guardian's parser and signals ------


def snaps(*names: str, span: float = 120.0) -> list[Snapshot]:
    step = span / (len(names) - 1)
    return [
        Snapshot(
            1000.0 + i * step,
            (ServiceSnapshot("vllm", vllm=parse_vllm_metrics(read_fixture(n))),),
            None,
            (),
        )
        for i, n in enumerate(names)
    ]


RECORDED = [
    # name, captures, state, ratio
    (
        "32 closed-loop clients on a 16-block pool (thrash): saturated at capacity, 1.0x",
        ["metrics-pressure-04.prom"] * 3 + ["metrics-pressure-07.prom"] * 3,
        "estimated",
        1.0,
    ),
    ("idle server", ["metrics-idle.prom"] * 6, "idle", None),
    (
        "a load that starts and ends inside the window",
        ["metrics-pressure-01.prom", "metrics-pressure-04.prom", "metrics-pressure-07.prom"]
        + ["metrics-pressure-10.prom"] * 3,
        "not_saturated",
        None,
    ),
    ("--disable-log-stats", ["disable-log-stats.prom"] * 6, "no_stats", None),
    (
        "a restart in the window (idle capture of another process)",
        ["metrics-pressure-04.prom"] * 3 + ["metrics-idle.prom"] * 3,
        "restarted",
        None,
    ),
]


@pytest.mark.parametrize(("name", "names", "state", "ratio"), RECORDED,
                         ids=[c[0] for c in RECORDED])  # fmt: skip
def test_recorded(name, names, state, ratio):
    history = snaps(*names)
    est = estimate(capacity_samples(history, "vllm"))
    assert est.state is CapacityState(state), est.reason
    sig = derive_service(history, ServiceConfig("vllm"), SignalsConfig())
    assert sig.capacity == est
    assert sig.capacity_demand_ratio == (None if ratio is None else pytest.approx(ratio, 0.02))
    assert (sig.capacity_replicas_needed is None) is (ratio is None)
