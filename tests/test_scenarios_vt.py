"""Each twin scenario end to end on virtual time: the right lever, the right flags, the latch.

The twin's engine, the scenario's load, the guardian's parsers and its pure ``step``, and a
process manager run on one fake clock (``tests/virtual_time.py``): the same experiment as
``run_demo`` with the same options, in about a second each instead of a minute of wall clock.
Three checks per scenario:

* what ``test_heal_e2e.py`` asserted on the real processes, on typed decisions and actions
  (the lever, its cause, the flags or environment it wrote, the engine the twin then ran with);
* the whole decision log (time, what, phase, cause, action kind, flags; alerts fired and
  resolved) against a golden file in ``tests/golden/scenarios/``: any change in when or how the
  guardian acts shows up as a diff. Regenerate with ``UPDATE_GOLDEN=1`` and review the diff;
* the run's snapshots, written by the flight recorder and replayed with the same config, give
  exactly the run's decisions (the daemon's step and ``replay`` are one).

The real-process path (HTTP, subprocesses, the process manager, the log file, the GPU state
file) keeps its smoke tests in ``test_heal_e2e.py``.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.virtual_time import Case, Run, run_case
from vllm_guardian.core.policy import DecisionKind
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.diagnose.report import to_json
from vllm_guardian.formats.recorder import (
    FlightRecorder,
    read_records,
    snapshot_from_record,
    to_jsonable,
)
from vllm_guardian.model import ActionKind, Cause
from vllm_guardian.tools.replay import replay

GOLDEN = Path(__file__).parent / "golden" / "scenarios"
BASELINE_GPU_MEMORY_UTILIZATION = 0.92  # the twin's (and vLLM 0.32's) default
FRAGMENTATION = ("--sim-fragmentation-creep-factor", "400")
# Flags alone make the twin's model not fit: Llama-3-70B on one 80 GiB card.
SEVENTY_B_ON_ONE_CARD = ("--sim-model", "llama-3-70b", "--tensor-parallel-size", "1")


def result_of(run: Run, action_id: int) -> bool | None:
    return next((r.ok for r in run.results if r.action_id == action_id), None)


def check_prefill(r: Run) -> None:
    relaunch = r.started("relaunch")
    assert relaunch and relaunch[0].cause is Cause.PREFILL_BURST
    assert ("--max-num-batched-tokens", "4096") in relaunch[0].flags
    assert ("--enable-chunked-prefill", "") in relaunch[0].flags
    assert result_of(r, relaunch[0].id) is True
    # The twin that came back runs with what the action wrote.
    assert r.engines[-1].max_num_batched_tokens == 4096
    assert r.engines[-1].enable_chunked_prefill
    assert r.requests["ok"] > 0


def check_exit_zero(r: Run) -> None:
    restart = r.started("restart")
    assert restart and restart[0].cause is Cause.ENGINE_DEAD
    assert result_of(r, restart[0].id) is True
    assert 0 in [code for _, code in r.twin_exits]  # it really died with status 0


def check_hang(r: Run) -> None:
    restart = r.started("restart")
    assert restart and restart[0].cause is Cause.ENGINE_DEAD
    assert "VllmEngineStalled" in restart[0].evidence
    assert result_of(r, restart[0].id) is True


def check_hang_once(r: Run) -> None:
    # The twin's processes share the run's timeline: the hang is a one-off at 30 s of the
    # scenario's clock, so the restarted engine does not hang again and one restart heals it.
    check_hang(r)
    assert len(r.started()) == 1, r.explain()
    assert len(r.twin_starts) == 2


def check_input_hang(r: Run) -> None:
    # The engine core's input thread dies at 30 s of the run's clock (once: the timeline): the
    # requests it had finish, the engine reads idle, new ones are never answered. The gate sees
    # them wait: restarted once, as input-hung, and the new engine serves.
    assert len(r.started()) == 1, r.explain()
    restart = r.started("restart")
    assert restart and restart[0].cause is Cause.ENGINE_INPUT_HANG, r.explain()
    assert "VllmEngineInputHang" in restart[0].evidence
    assert "VllmEngineStalled" not in r.alerts_fired  # by its metrics, the engine is idle
    assert result_of(r, restart[0].id) is True


def check_operator_pause(r: Run) -> None:
    # Paused at 30 s for 120 simulated seconds (30 s here) with requests in it, past the
    # stall wait (8 s) many times: never judged stalled or input-hung, never restarted. What
    # the pause costs is the operator's: clients whose requests waited through it past their
    # 30 s gave up (the load's timeouts).
    assert r.started() == [], [a.reason for a in r.started()]
    assert not {"VllmEngineStalled", "VllmEngineInputHang"} & set(r.alerts_fired), r.alerts_fired
    assert len(r.twin_starts) == 1 and r.twin_exits == []
    assert r.requests["ok"] > 0, r.requests


def check_operator_sleep(r: Run) -> None:
    # Asleep (level 1, requests kept in it) at 30 s for 120 simulated seconds: frozen requests
    # in the engine, new ones unanswered at the gate, exactly a hang's shape on both counts;
    # vllm:engine_sleep_state says it sleeps. Never judged stalled or input-hung, never
    # restarted.
    check_operator_pause(r)


def check_xid(r: Run) -> None:
    assert [a.kind for a in r.started()] == [ActionKind.ESCALATE]
    assert r.started()[0].cause is Cause.GPU_HARDWARE_FAULT
    latches = r.of(DecisionKind.LATCH)
    assert latches and latches[0].cause is Cause.GPU_HARDWARE_FAULT
    assert "VllmGpuResetRequired" in r.alerts_fired


def check_kv(r: Run) -> None:
    # KV thrash is a capacity problem (docs/capacity.md): the front door closes, the
    # over-capacity alert fires, the guardian says why it does not act; no restart, no relaunch.
    assert r.of(DecisionKind.GATE)
    assert r.started() == [], [a.reason for a in r.started()]
    assert any(d.cause is Cause.CONCURRENCY_OVERCOMMIT for d in r.of(DecisionKind.SUPPRESSED)), (
        r.explain()
    )
    assert "VllmOverCapacity" in r.alerts_fired, r.alerts_fired


def check_fragmentation(r: Run) -> None:
    acted = [a for a in r.started() if a.cause is Cause.ALLOCATOR_FRAGMENTATION]
    assert acted and acted[0].kind is ActionKind.RESTART  # first: drain + restart
    assert any(
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True") in a.env for a in acted[1:]
    ), [(a.kind, a.env) for a in acted]
    assert r.engines[-1].expandable_segments


def check_neighbour(r: Run) -> None:
    relaunch = r.started("relaunch")
    assert relaunch and relaunch[0].cause is Cause.GPU_MEMORY_OVERCOMMIT
    util = dict(relaunch[0].flags)["--gpu-memory-utilization"]
    assert float(util) < BASELINE_GPU_MEMORY_UTILIZATION
    assert result_of(r, relaunch[0].id) is True
    assert float(util) in [e.gpu_memory_utilization for e in r.engines[1:]]


def check_neighbour_as_demoed(r: Run) -> None:
    # `vllm-guardian demo --scenario noisy_neighbour`: twin at 4x, one timeline (the neighbour
    # outlives a restart). A deployed guardian's forecast sees the neighbour's trend and
    # relaunches low enough before the card runs out. (Its forecast left at wall-clock defaults
    # needed 160 simulated seconds of trend while the neighbour exhausts the card in ~66, and a
    # start-up reading vetoed it: the demo showed an OOM, a one-rung relaunch that died at once,
    # a crash loop in the cooldown; 82 failed requests.)
    # The forecast comes ~7 s before the card runs out (the neighbour needs 16 s from 1 GiB to
    # the end of the card at 4x), so the old instance may still OOM in its drain: the requests
    # in flight then are lost (this harness has no gate: those arriving while it is down fail
    # too). What must not happen: a relaunch too small, a crash loop, a second action.
    relaunch = r.started("relaunch")
    assert [a.cause for a in relaunch] == [Cause.GPU_MEMORY_OVERCOMMIT], r.explain()
    assert len(r.started()) == 1, r.explain()
    assert "pre-emptive" in relaunch[0].reason, relaunch[0].reason
    assert result_of(r, relaunch[0].id) is True
    assert len(r.twin_exits) <= 1, r.twin_exits  # the relaunched instance never dies
    util = float(dict(relaunch[0].flags)["--gpu-memory-utilization"])
    assert r.engines[-1].gpu_memory_utilization == util < BASELINE_GPU_MEMORY_UTILIZATION
    assert not r.requests.get("timeout"), r.requests


def check_startup_overcommit(r: Run) -> None:
    # Another process holds 10 GiB when vLLM starts: it exits 1 at start-up; a lower
    # utilization lets the next one start (not covered by the real-process runs before).
    relaunch = r.started("relaunch")
    assert relaunch and relaunch[0].cause is Cause.GPU_MEMORY_OVERCOMMIT
    util = float(dict(relaunch[0].flags)["--gpu-memory-utilization"])
    assert util < BASELINE_GPU_MEMORY_UTILIZATION
    assert result_of(r, relaunch[0].id) is True
    assert [code for _, code in r.twin_exits] == [1]  # the first start only
    assert r.engines[-1].gpu_memory_utilization == util


def check_does_not_fit(r: Run) -> None:
    assert [a.kind for a in r.started()] == [ActionKind.ESCALATE]
    assert r.started()[0].cause is Cause.MODEL_DOES_NOT_FIT
    assert r.of(DecisionKind.LATCH)
    assert 1 in [code for _, code in r.twin_exits]  # the twin failed its start-up


def check_nothing(r: Run) -> None:
    assert r.started() == [], [a.reason for a in r.started()]
    assert "VllmOverCapacity" not in r.alerts_fired
    assert not r.of(DecisionKind.GATE)
    assert r.requests["ok"] > 0


def check_step_up(r: Run) -> None:
    # prefill_burst's bursts are survived at rung 1; after a 12 s stable period the guardian
    # steps back to the operator's baseline, and the twin runs it again.
    assert r.of(DecisionKind.STEP_UP)
    batched = [e.max_num_batched_tokens for e in r.engines]
    down = batched.index(4096)
    assert 16384 in batched[down:], batched  # the scenario's own flag, the operator's baseline


# Same scenarios, speeds and policy overrides as the real-process runs; durations cover the
# events asserted on (no wall-clock slack is needed on virtual time).
COOL_5 = (("cooldown_seconds", 5),)
COOL_8 = (("cooldown_seconds", 8),)
STABLE_12 = (("stable_for_seconds", 12), ("cooldown_seconds", 5))
CASES: list[tuple[Case, Callable[[Run], None]]] = [
    (Case("prefill_burst", "prefill_burst", 4, 45), check_prefill),
    (Case("exit_zero_death", "exit_zero_death", 6, 40), check_exit_zero),
    (Case("engine_hang", "engine_hang", 6, 45), check_hang),
    (Case("engine_hang_once", "engine_hang", 6, 45, timeline=True), check_hang_once),
    (Case("engine_input_hang", "engine_input_hang", 6, 45, timeline=True, gate=True),
     check_input_hang),
    # Clients that give up at 6 s, before the stall wait (8 s): the hang is still acted on.
    (Case("engine_input_hang_impatient_clients", "engine_input_hang", 6, 45, timeline=True,
          gate=True, client_timeout_seconds=6.0), check_input_hang),
    (Case("operator_pause", "operator_pause", 4, 60, gate=True), check_operator_pause),
    (Case("operator_sleep", "operator_sleep", 4, 60, gate=True), check_operator_sleep),
    (Case("xid_fault", "xid_fault", 6, 35), check_xid),
    (Case("kv_thrash", "kv_thrash", 4, 45, (), COOL_8), check_kv),
    (Case("fragmentation_creep", "fragmentation_creep", 8, 35, FRAGMENTATION, COOL_5),
     check_fragmentation),
    (Case("noisy_neighbour", "noisy_neighbour", 8, 45), check_neighbour),
    (Case("noisy_neighbour_demo", "noisy_neighbour", 4, 60, timeline=True),
     check_neighbour_as_demoed),
    (Case("startup_overcommit", "startup_overcommit", 8, 15), check_startup_overcommit),
    (Case("prefix_cache_waste", "prefix_cache_waste", 8, 30), check_nothing),
    (Case("steady", "steady", 8, 40), check_nothing),  # a healthy control: no over-capacity
    (Case("model_does_not_fit", "steady", 10, 25, SEVENTY_B_ON_ONE_CARD), check_does_not_fit),
    (Case("step_up", "prefill_burst", 4, 60, (), STABLE_12), check_step_up),
]  # fmt: skip
IDS = [c.name for c, _ in CASES]
# Known defects these scenarios found, strict: the day one is fixed the test says so.
KNOWN_DEFECTS: dict[str, str] = {}
_RUNS: dict[str, Run] = {}


@pytest.fixture
def run_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Run]:
    """Each case runs once per session; both tests below read the same run."""

    def get(case: Case) -> Run:
        if case.name not in _RUNS:
            _RUNS[case.name] = run_case(case, tmp_path_factory.mktemp(case.name))
        return _RUNS[case.name]

    return get


@pytest.mark.parametrize(("case", "check"), CASES, ids=IDS)
def test_the_guardian_pulls_the_right_lever(
    run_of: Callable[[Case], Run],
    case: Case,
    check: Callable[[Run], None],
    request: pytest.FixtureRequest,
) -> None:
    if case.name in KNOWN_DEFECTS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS[case.name]))
    run = run_of(case)
    try:
        check(run)
    except AssertionError:
        print(run.explain())
        raise


@pytest.mark.parametrize(("case", "check"), CASES, ids=IDS)
def test_the_decision_log_matches_the_golden_file(
    run_of: Callable[[Case], Run], case: Case, check: Callable[[Run], None]
) -> None:
    text = run_of(case).golden_text()
    path = GOLDEN / f"{case.name}.jsonl"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    want = path.read_text() if path.exists() else ""
    diff = "".join(
        difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "this run")
    )
    assert text == want, (
        f"{case.name}: the decisions changed; review, then rerun with UPDATE_GOLDEN=1\n{diff}"
    )


@pytest.mark.parametrize(("case", "check"), CASES, ids=IDS)
def test_each_decision_says_in_fields_what_happened(
    run_of: Callable[[Case], Run], case: Case, check: Callable[[Run], None]
) -> None:
    """Code learns what happened from a decision's fields, never its wording: each decision on
    an action names the action's kind (as the action itself has it), each result whether it
    worked (as the action's result has it), and each "nothing done" what withheld it."""
    run = run_of(case)
    ok = {r.action_id: r.ok for r in run.results}
    for d in run.decisions:
        if d.action_id is not None and d.action_id in run.actions:
            assert d.action_kind is run.actions[d.action_id].kind, d
        if d.what is DecisionKind.RESULT:
            assert d.ok is ok[d.action_id], d
        if d.what is DecisionKind.SUPPRESSED:
            assert d.withheld is not None, d
        else:
            assert d.withheld is None, d


def test_a_case_is_deterministic(tmp_path: Path) -> None:
    """The same case twice gives the same log: nothing in the harness reads a real clock or an
    unseeded random source (the twin's request ids are uuids; nothing may depend on them)."""
    case = Case("prefill_burst", "prefill_burst", 4, 30)
    first = run_case(case, tmp_path / "a")
    assert first.started("relaunch")  # an incident happened: there is something to compare
    assert run_case(case, tmp_path / "b").golden_text() == first.golden_text()


def test_a_case_touches_no_socket_thread_or_sleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Virtual time means exactly that: a whole incident (an OOM, a relaunch, the restart)
    runs without a socket, a thread or a sleep; any of them here fails the run."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the virtual-time harness must not block or do I/O")

    monkeypatch.setattr(time, "sleep", forbidden)
    monkeypatch.setattr(threading.Thread, "start", forbidden)
    for method in ("connect", "bind", "connect_ex"):
        monkeypatch.setattr(socket.socket, method, forbidden)
    run = run_case(Case("prefill_burst", "prefill_burst", 4, 30), tmp_path)
    assert run.started("relaunch") and run.results and run.results[0].ok


@pytest.mark.parametrize(("case", "check"), CASES, ids=IDS)
def test_replay_of_the_recording_makes_the_same_decisions(
    run_of: Callable[[Case], Run], case: Case, check: Callable[[Run], None], tmp_path: Path
) -> None:
    """The scenario's snapshots, through the flight recorder's file and ``replay`` with the same
    config, give the decisions the run made, each at its tick: the daemon's step and replay's
    are one, on real scenario data (every phase of every action, the blocking calls' recorded
    results included)."""
    run = run_of(case)
    assert run.config is not None
    recorder = FlightRecorder(tmp_path / "flight.jsonl", 256 * 1024 * 1024, 1)
    for snap in run.snapshots:
        assert recorder.write({"time": snap.time_seconds, "snapshot": snap, "decisions": []})
    records = [r for r in read_records(tmp_path / "flight.jsonl") if isinstance(r, dict)]
    assert len(records) == len(run.snapshots)
    replayed = [
        line.body
        for line in replay([snapshot_from_record(r) for r in records], run.config)
        if line.kind == "decision"
    ]
    live = [to_jsonable(d) for d in run.decisions]
    assert replayed == live, "\n".join(
        difflib.unified_diff(
            [json.dumps(d, sort_keys=True) for d in live],
            [json.dumps(d, sort_keys=True) for d in replayed],
            "live",
            "replayed",
            lineterm="",
        )
    )


GUARDIAN_SAID = "the guardian acted on it"  # diagnose's evidence read from action.json


@pytest.mark.parametrize(("case", "check"), CASES, ids=IDS)
def test_diagnose_on_the_bundle_the_guardian_saved_names_the_actions_cause(
    run_of: Callable[[Case], Run], case: Case, check: Callable[[Run], None]
) -> None:
    """Every incident bundle the run's guardian saved as it acted, read by ``vllm-guardian
    diagnose`` as an on-call engineer would: its verdict is the cause in the bundle's own
    ``action.json``, and what diagnose reads in the bundle itself (its scrapes, log lines, the
    daemon's flight record judged with the daemon's windows) shows that cause too: not only
    the action's own word for it."""
    run = run_of(case)
    for action_id, path in run.bundles:
        # An action with no cause (the step back up to the operator's baseline after a stable
        # period) has nothing wrong to name: healthy.
        said = json.loads((path / "action.json").read_text())["cause"] or "healthy"
        # As `vllm-guardian diagnose --bundle PATH --config CONFIG` reads it: the daemon's
        # config gives the windows it judged its flight record with (the demo's 8 s stall).
        assert run.config is not None
        report = to_json(analyze(read_bundle(path), signals=run.config.signals))
        found = {c["id"]: c["evidence"] for c in report["causes"]}
        own = [e for e in found.get(said, []) if not e.startswith(GUARDIAN_SAID)]
        print(f"{case.name} action {action_id}: {said}; verdict {report['verdict']}; own {own}")
        assert report["verdict"] == said, (path, report["verdict"], report["notes"])
        assert own or said == "healthy", (path, report)


def test_diagnose_says_a_paused_server_is_paused_and_since_when(
    run_of: Callable[[Case], Run], tmp_path: Path
) -> None:
    """operator_pause has no action, so no bundle: one is written as the daemon's flight
    record stood 10 ticks before the resume. diagnose names no cause (healthy: nothing is
    broken) and says the server is paused, since when, and that requests wait through it."""
    case = next(c for c, _ in CASES if c.name == "operator_pause")
    run = run_of(case)
    paused = [i for i, s in enumerate(run.snapshots) if (h := s.services[0].health) and h.paused]
    assert paused, "the twin never paused"
    upto = run.snapshots[: paused[-10] + 1]
    bundle = tmp_path / "paused"
    bundle.mkdir()
    created = dt.datetime.fromtimestamp(upto[-1].time_seconds, dt.UTC).isoformat()
    (bundle / "manifest.json").write_text(
        json.dumps({"format": 1, "created": created, "service": "vllm"})
    )
    with (bundle / "flight.jsonl").open("w") as fh:
        for snap in upto:
            fh.write(json.dumps({"snapshot": to_jsonable(snap)}) + "\n")
    assert run.config is not None
    report = to_json(analyze(read_bundle(bundle), signals=run.config.signals))
    held_for = upto[-1].time_seconds - run.snapshots[paused[0]].time_seconds
    said = [n for n in report["notes"] if n.startswith("vLLM paused for")]
    print(report["verdict"], said)
    assert report["verdict"] == "healthy", report
    assert said and f"paused for {held_for:.0f} s" in said[0], (held_for, report["notes"])
    assert "requests have waited" in said[0] and "/resume" in said[0], said
