"""Faults on the scenario's timeline: one-off faults strike once per run, not once per process.

The engine is driven on its own (simulated) clock; ``scenario_zero_seconds`` is where the run's
zero lies on that clock, as the server computes it from ``--sim-epoch`` or the timeline file.
"""

from __future__ import annotations

import io
import itertools

import pytest

from tests.sim.helpers import drive, options
from vllm_guardian.sim.engine import EnginePhase, SimEngine
from vllm_guardian.sim.flags import FlagError
from vllm_guardian.sim.load import plan_requests
from vllm_guardian.sim.scenarios import SCENARIOS, FaultKind, fault_schedule
from vllm_guardian.sim.server import Twin
from vllm_guardian.sim.vllm_log import LogWriter
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

EAGER = ("--enforce-eager",)  # start-up 21 simulated seconds for the 8B model


def engine(
    scenario: str,
    zero: float | None,
    every: float | None = None,
    seed: int = 7,
    flags: tuple[str, ...] = (),
) -> SimEngine:
    opts = options("--sim-scenario", scenario, *EAGER, *flags)
    return SimEngine(
        opts.model, opts.engine, opts.scenario, opts.gpu_memory_bytes, seed,
        scenario_zero_seconds=zero, fault_every_seconds=every,
    )  # fmt: skip


def run(e: SimEngine, seconds_after_ready: float) -> SimEngine:
    e.advance(e.startup_seconds)
    assert e.ready_at is not None
    e.advance(e.ready_at + seconds_after_ready)
    return e


ONE_OFF = [("engine_hang", FaultKind.HANG), ("exit_zero_death", FaultKind.DEATH),
           ("xid_fault", FaultKind.XID)]  # fmt: skip


@pytest.mark.parametrize(("scenario", "kind"), ONE_OFF)
def test_a_first_process_meets_the_fault_at_its_time(scenario: str, kind: FaultKind) -> None:
    e = run(engine(scenario, zero=None), 60.0)
    assert [f.kind for f in e.faults] == [kind]
    assert e.ready_at is not None
    assert e.faults[0].sim_seconds == pytest.approx(e.ready_at + 30.0, abs=0.5)
    assert e.phase is (EnginePhase.HUNG if kind is FaultKind.HANG else EnginePhase.DEAD)


@pytest.mark.parametrize(("scenario", "kind"), ONE_OFF)
def test_a_restarted_process_past_the_fault_time_does_not_meet_it_again(
    scenario: str, kind: FaultKind
) -> None:
    # The run's zero lay 40 simulated seconds before this process started: it becomes ready at
    # scenario time 61, past the fault at 30.
    e = run(engine(scenario, zero=-40.0), 600.0)
    assert e.faults == []
    assert e.phase is EnginePhase.READY
    assert e.scenario_seconds == pytest.approx(661.0, abs=1.0)


@pytest.mark.parametrize(("scenario", "kind"), ONE_OFF)
def test_a_process_started_before_the_fault_time_meets_it_on_the_runs_clock(
    scenario: str, kind: FaultKind
) -> None:
    # Zero 5 s before this process started: ready at scenario time 26, the fault at 30 comes
    # 4 s after readiness (not 30).
    e = run(engine(scenario, zero=-5.0), 20.0)
    assert [f.kind for f in e.faults] == [kind]
    assert e.faults[0].sim_seconds == pytest.approx(25.0, abs=0.5)


def test_without_a_run_clock_the_neighbour_counts_from_readiness() -> None:
    # No timeline: the neighbour appears 20 s after this process is ready and grows into the
    # OOM, in every process.
    e = run(engine("noisy_neighbour", zero=None), 0.0)
    assert e.other_bytes(e.now) == 0
    drive(e, plan_requests(e.scenario.load, 0, 3000, 120.0), 120.0)
    assert [f.kind for f in e.faults] == [FaultKind.OOM]
    assert e.death is not None and e.death.exception == "torch.OutOfMemoryError"


GIB = 1024**3


@pytest.mark.parametrize(
    ("zero", "other_at_start_gib"),
    [
        (-5.0, 0.0),  # scenario time 5 at this start: the neighbour is not there yet
        (-30.0, 2.0),  # 10 s after it appeared with 1 GiB, growing 0.1 GiB/s
        (-400.0, 12.0),  # long grown to its cap
    ],
)
def test_on_the_runs_clock_the_neighbour_is_another_process(
    zero: float, other_at_start_gib: float
) -> None:
    # A restart of vLLM does not make a neighbour go away: its memory is where the run's clock
    # has it, from this process's first instant (and its start-up profile sees it).
    e = engine("noisy_neighbour", zero=zero)
    assert e.other_bytes(0.0) == pytest.approx(other_at_start_gib * GIB, rel=1e-6)


def test_a_restart_beside_a_grown_neighbour_fails_and_a_lower_utilization_fits() -> None:
    # 12 GiB held by the neighbour: 0.90 of the card is no longer free at start-up (vLLM's own
    # check), so the same flags cannot start; 0.70 fits and the capped neighbour never OOMs it.
    e = engine("noisy_neighbour", zero=-400.0)
    e.advance(e.startup_seconds + 60)
    assert e.phase is EnginePhase.FAILED_STARTUP
    assert e.startup_failure is not None
    assert "less than desired GPU memory utilization" in e.startup_failure.message
    e = run(engine("noisy_neighbour", zero=-400.0, flags=("--gpu-memory-utilization", "0.7")), 0.0)
    drive(e, plan_requests(e.scenario.load, 0, 3000, 120.0), 120.0)
    assert e.faults == [] and e.phase is EnginePhase.READY


def schedule(name: str, seed: int, every: float | None, n: int) -> list[tuple[float, FaultKind]]:
    return list(itertools.islice(fault_schedule(SCENARIOS[name], seed, every), n))


def test_recurrence_is_seeded() -> None:
    a = schedule("exit_zero_death", 7, 100.0, 50)
    assert a == schedule("exit_zero_death", 7, 100.0, 50)
    assert a != schedule("exit_zero_death", 8, 100.0, 50)
    assert a[0] == (30.0, FaultKind.DEATH)  # the one-off fault first
    times = [t for t, _ in a]
    assert times == sorted(times) and len(set(times)) == len(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 50.0 < sum(gaps) / len(gaps) < 200.0  # exponential gaps of mean 100


@pytest.mark.parametrize(
    ("name", "kinds"),
    [("engine_hang", {FaultKind.HANG}), ("xid_fault", {FaultKind.XID}),
     ("steady", {FaultKind.DEATH}), ("prefill_burst", {FaultKind.DEATH})],
)  # fmt: skip
def test_recurrence_repeats_the_scenarios_fault_or_a_death(
    name: str, kinds: set[FaultKind]
) -> None:
    assert {k for _, k in schedule(name, 1, 60.0, 20)} == kinds


def test_without_recurrence_a_scenario_has_only_its_one_off_faults() -> None:
    assert schedule("engine_hang", 7, None, 10) == [(30.0, FaultKind.HANG)]
    assert schedule("steady", 7, None, 10) == []


def test_a_restarted_process_meets_the_later_recurrences_only() -> None:
    every = 50.0
    due = [t for t, _ in schedule("exit_zero_death", 3, every, 40)]
    # Ready at scenario time 21 + 200: the next fault is the first one due after that.
    e = engine("exit_zero_death", zero=-200.0, every=every, seed=3)
    run(e, 2000.0)
    assert e.ready_at is not None and len(e.faults) == 1
    met = e.faults[0].sim_seconds + 200.0
    assert met == pytest.approx(min(t for t in due if t >= e.ready_at + 200.0), abs=0.5)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_fault_interval_must_be_positive(value: str) -> None:
    with pytest.raises(FlagError, match="--sim-fault-every must be > 0"):
        options("--sim-fault-every", value)


def test_the_input_hang_reaches_no_request_to_the_scheduler() -> None:
    """engine_input_hang at 30 s (vllm#26139, #47958): what the engine held finishes; what is
    added after never reaches the scheduler, so the engine reports nothing in it, forever."""
    e = run(engine("engine_input_hang", zero=None), 0.0)
    assert e.ready_at is not None
    drive(e, plan_requests(e.scenario.load, 0, 3000, 60.0), 60.0)
    assert [f.kind for f in e.faults] == [FaultKind.INPUT_HANG]
    assert e.faults[0].sim_seconds == pytest.approx(e.ready_at + 30.0, abs=0.5)
    assert e.phase is EnginePhase.READY and e.accepting and e.death is None  # /health 200
    assert (e.stats.num_requests_running, e.stats.num_requests_waiting) == (0, 0)
    assert e.num_unfinished > 0  # the API server's requests: never answered
    finished = sum(e.stats.request_success.values())
    e.advance(e.now + 60.0)
    assert sum(e.stats.request_success.values()) == finished


def test_a_pause_freezes_the_scheduler_and_a_resume_lets_it_go() -> None:
    """operator_pause: /pause?mode=keep at 30 s, /resume 120 s later. Its requests stay in the
    scheduler, nothing steps, adds wait before it; vLLM's scheduler logs each state it sets."""
    e = run(engine("operator_pause", zero=None), 0.0)
    assert e.ready_at is not None
    drive(e, plan_requests(e.scenario.load, 0, 3000, 90.0), 90.0)
    assert [f.kind for f in e.faults] == [FaultKind.PAUSE] and e.paused
    frozen = (e.stats.num_requests_running, e.stats.num_requests_waiting)
    tokens = e.stats.generation_tokens
    assert sum(frozen) > 0  # requests frozen in it
    e.add_request("late", ["1"] * 10, 4)
    e.advance(e.now + 30.0)
    assert (e.stats.num_requests_running, e.stats.num_requests_waiting) == frozen
    assert e.stats.generation_tokens == tokens
    e.advance(e.ready_at + 151.0)
    assert [f.kind for f in e.faults] == [FaultKind.PAUSE, FaultKind.RESUME] and not e.paused
    e.advance(e.now + 30.0)
    assert e.num_unfinished == 0  # the frozen ones and the late one all finished
    said = [ev.message for ev in e.take_logs()]
    assert "setting pause state to PAUSED_ALL" in said
    assert "setting pause state to UNPAUSED" in said


def test_a_sleep_pauses_and_says_so_in_the_sleep_gauges() -> None:
    """operator_sleep: /sleep?level=1&mode=keep at 30 s pauses the scheduler (its requests
    stay) and the twin's /metrics reads vllm:engine_sleep_state as vLLM's record_sleep_state
    sets it; /wake_up 120 s later resumes."""
    twin = Twin(options("--sim-scenario", "operator_sleep", *EAGER), LogWriter(0, io.StringIO()))
    assert twin.opts.dev_mode  # the scenario's operator uses vLLM's development routes
    e = run(twin.engine, 0.0)
    assert e.ready_at is not None
    drive(e, plan_requests(e.scenario.load, 0, 3000, 60.0), 60.0)
    assert [f.kind for f in e.faults] == [FaultKind.PAUSE, FaultKind.SLEEP]
    assert e.paused and e.sleep_level == 1
    (scraped,) = parse_vllm_metrics(twin.metrics_text()).engines
    assert scraped.asleep is True and (scraped.requests_running or 0) > 0
    e.advance(e.ready_at + 151.0)
    assert [f.kind for f in e.faults][-2:] == [FaultKind.WAKE, FaultKind.RESUME]
    (scraped,) = parse_vllm_metrics(twin.metrics_text()).engines
    assert scraped.asleep is False and not e.paused
