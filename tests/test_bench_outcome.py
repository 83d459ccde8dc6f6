"""The outcome benchmark's bookkeeping: how failures are split and times are measured.

``measure`` is pure (outcomes, fault and action times in, measures out), so it is tested on a
hand-made timeline. The smoke test runs the whole bench once, shortly, on the twin, and checks
what it writes, never its numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.sim.load import OutcomeKind, RequestOutcome

ROOT = Path(__file__).resolve().parent.parent


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_outcome", ROOT / "bench" / "outcome.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_outcome"] = module
    spec.loader.exec_module(module)
    return module


def outcome(i: int, sent: float, latency: float, kind: OutcomeKind, tokens: int = 10,
            ttft: float | None = None) -> RequestOutcome:  # fmt: skip
    return RequestOutcome(i, kind, sent, latency, ttft, None, 5, tokens, None, None)


OK, TIMEOUT, REFUSED, HTTP = (OutcomeKind.OK, OutcomeKind.TIMEOUT, OutcomeKind.CONNECTION_ERROR,
                              OutcomeKind.HTTP_ERROR)  # fmt: skip

# The load starts at Unix time 1000; the fault strikes at 1100 (100 s in).
TIMELINE = [
    # (sent s after start, latency s, kind, expected bucket)
    (50.0, 1.0, HTTP, "other"),  # before any fault
    (90.0, 20.0, TIMEOUT, "in_flight"),  # sent before the fault, still open when it struck
    (99.0, 0.5, OK, None),
    (102.0, 1.0, REFUSED, "outage"),  # arrived after the fault, before serving again
    (104.0, 9.0, TIMEOUT, "outage"),
    (105.0, 1.0, OK, None),  # the first success sent after the fault: serving again at 1106
    (107.0, 1.0, HTTP, "other"),  # after recovery
]


def test_failures_are_split_by_the_fault_and_the_recovery() -> None:
    b = bench()
    run = b.Run("engine_hang", "guardian", 7)
    outcomes = [outcome(i, s, lat, k) for i, (s, lat, k, _) in enumerate(TIMELINE)]
    b.measure(run, outcomes, 1000.0, 60.0, faults=[1100.0], action_times=[1095.0, 1103.0])
    want = {
        bucket: sum(1 for *_, x in TIMELINE if x == bucket)
        for bucket in ("in_flight", "outage", "other")
    }
    got = {"in_flight": run.failed_in_flight, "outage": run.failed_during_outage,
           "other": run.failed_other}  # fmt: skip
    assert got == want
    assert (run.sent, run.failed, run.faults) == (7, 5, 1)
    assert run.time_to_detect_seconds == pytest.approx(3.0)  # the action before the fault is not it
    assert run.time_to_recover_seconds == pytest.approx(6.0)
    assert run.goodput_tokens_per_second == pytest.approx(20 / 60)


def test_without_a_fault_every_failure_is_other_and_no_time_is_measured() -> None:
    b = bench()
    run = b.Run("kv_thrash", "unguarded", 7)
    outcomes = [outcome(0, 1.0, 30.0, TIMEOUT), outcome(1, 2.0, 1.0, OK, ttft=0.2)]
    b.measure(run, outcomes, 1000.0, 60.0, faults=[], action_times=[1001.0])
    assert (run.failed_other, run.failed_in_flight, run.failed_during_outage) == (1, 0, 0)
    assert run.time_to_detect_seconds is None and run.time_to_recover_seconds is None
    assert run.p99_ttft_seconds == pytest.approx(0.2)


def test_a_fault_never_recovered_from_has_no_recovery_time() -> None:
    b = bench()
    run = b.Run("exit_zero_death", "unguarded-on-failure", 7)
    outcomes = [outcome(0, 1.0, 1.0, OK), outcome(1, 20.0, 0.01, REFUSED)]
    b.measure(run, outcomes, 1000.0, 60.0, faults=[1010.0], action_times=[])
    assert run.failed_during_outage == 1
    assert run.time_to_recover_seconds is None and run.time_to_detect_seconds is None


@pytest.mark.slow
def test_the_bench_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    b = bench()
    code = b.main(["--scenarios", "steady", "--operators", "unguarded,guardian+gate",
                   "--seeds", "1", "--duration", "4", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "outcome.json").read_text())
    assert [(c["scenario"], c["operator"]) for c in doc["cells"]] == [
        ("steady", "unguarded"), ("steady", "guardian+gate")]  # fmt: skip
    assert all(len(c["runs"]) == 1 and c["runs"][0]["sent"] > 0 for c in doc["cells"])
    # The gate's continuations were read from its /metrics before it stopped (steady cuts
    # nothing: every series it exports, at 0); without a gate there are none.
    unguarded, gated = (c["runs"][0] for c in doc["cells"])
    assert unguarded["continuations"] is None and unguarded["gate_retried"] is None
    assert gated["continuations"] and set(gated["continuations"].values()) == {0.0}
    assert "continued/hang" in gated["continuations"] and gated["gate_retried"] == 0.0
    md = (tmp_path / "outcome.md").read_text()
    assert "| steady | guardian+gate |" in md and "- steady: " in md
    assert "| 0 / 0 / 0 / 0 / 0 |" in md
    assert (tmp_path / "outcome.svg").read_text().startswith("<svg")

    # One cell run again (in a worker process, --jobs), merged into the earlier report: the
    # other cell is kept as it was, the order is the matrix's, the report says where each
    # came from.
    merged = tmp_path / "merged"
    code = b.main(["--scenarios", "steady", "--operators", "unguarded", "--seeds", "1",
                   "--duration", "4", "--jobs", "2", "--merge", str(tmp_path / "outcome.json"),
                   "--out", str(merged)])  # fmt: skip
    assert code == 0
    again = json.loads((merged / "outcome.json").read_text())
    assert [(c["scenario"], c["operator"]) for c in again["cells"]] == [
        ("steady", "unguarded"), ("steady", "guardian+gate")]  # fmt: skip
    assert again["cells"][1]["runs"] == doc["cells"][1]["runs"]
    assert [s["cells"] for s in again["sources"]] == [
        ["steady/guardian+gate"],
        ["steady/unguarded"],
    ]
    assert again["jobs"] == 2
    assert "**Assembled from 2 runs**" in (merged / "outcome.md").read_text()
    with pytest.raises(SystemExit, match="duration_seconds"):
        b.main(["--scenarios", "steady", "--operators", "unguarded", "--seeds", "1",
                "--duration", "3", "--merge", str(tmp_path / "outcome.json"),
                "--out", str(merged)])  # fmt: skip


def test_a_request_sent_late_by_a_busy_client_is_dated_by_its_real_end() -> None:
    # Scheduled at 95 s, sent late, failed at 101 s: in flight at the fault at 100 s, although
    # scheduled + latency (95.5 s) lies before it.
    b = bench()
    run = b.Run("exit_zero_death", "unguarded", 7)
    late = dataclasses.replace(outcome(0, 95.0, 0.5, HTTP), ended_seconds=101.0)
    b.measure(run, [late], 1000.0, 60.0, faults=[1100.0], action_times=[])
    assert (run.failed_in_flight, run.failed_other) == (1, 0)


def test_a_failure_a_few_milliseconds_before_the_faults_date_is_in_flight() -> None:
    # The twin dates the fault by its engine clock, up to a step ahead of the wall clock.
    b = bench()
    run = b.Run("exit_zero_death", "unguarded", 7)
    b.measure(run, [outcome(0, 99.0, 0.999, HTTP)], 1000.0, 60.0, faults=[1100.0], action_times=[])
    assert (run.failed_in_flight, run.failed_other) == (1, 0)


def test_the_gates_continuations_are_read_by_outcome_and_reason() -> None:
    # The gate's own exposition (its metrics class), as its /metrics serves it.
    m = GateMetrics("vllm")
    for outcome_, reason in [("continued", "hang"), ("continued", "hang"),
                             ("continued", "error_event"), ("completed", "connection"),
                             ("refused", "n"), ("failed", "wait_timeout")]:  # fmt: skip
        m.continuation(outcome_, reason)
    m.retried.inc(3)
    counts, retried = bench().gate_counts(m.render().decode())
    assert {k: v for k, v in counts.items() if v} == {
        "continued/hang": 2.0, "continued/error_event": 1.0, "completed/connection": 1.0,
        "refused/n": 1.0, "failed/wait_timeout": 1.0,
    }  # fmt: skip
    assert "fallback/hang" in counts  # every series the gate exports, its zeros too
    assert retried == 3.0


def _args(b: ModuleType) -> argparse.Namespace:
    return argparse.Namespace(command="bench/outcome.py", seeds=[7, 8, 9], speed=4.0,
                              duration=60.0, fault_every=None, jobs=1, commit="abc1234")  # fmt: skip


def test_the_report_shows_each_cells_continuations_median_and_range() -> None:
    b = bench()
    # (continued by reason, completed, refused, failed, sent again) per seed.
    seeds = [({"continued/hang": 3.0, "continued/error_event": 1.0}, 0.0, 0.0, 0.0, 5.0),
             ({"continued/hang": 2.0}, 1.0, 0.0, 0.0, 5.0),
             ({"continued/hang": 6.0}, 0.0, 0.0, 1.0, 9.0)]  # fmt: skip
    gated = []
    for seed, (cont, done, refused, failed, retried) in zip((7, 8, 9), seeds, strict=True):
        counts = cont | {"completed/connection": done, "refused/n": refused,
                         "failed/wait_timeout": failed}  # fmt: skip
        gated.append(b.Run("engine_hang", "guardian+gate", seed, sent=100, continuations=counts,
                           gate_retried=retried))  # fmt: skip
    plain = [b.Run("engine_hang", "guardian", seed, sent=100) for seed in (7, 8, 9)]
    load = (0.5, 0.5, 0.5)
    cells = [b.Cell("engine_hang", "guardian", plain, load, load, False),
             b.Cell("engine_hang", "guardian+gate", gated, load, load, False)]  # fmt: skip
    md = b.markdown(cells, _args(b), 60.0)
    row = {
        line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| engine_hang")
    }
    # Continued 4, 2, 6: median 4 (2–6); completed 0, 1, 0; refused 0; failed 0, 0, 1; sent
    # again 5, 5, 9.
    assert "| 4 (2–6) / 0 (0–1) / 0 / 0 (0–1) / 5 (5–9) |" in row["guardian+gate"]
    assert "| – |" in row["guardian"]
    assert "continuations" in md.split("| scenario |", 1)[1].splitlines()[0]
    stats = cells[1].to_json()["stats"]
    assert stats["continued"] == (4.0, 2.0, 6.0)
    assert stats["gate_retried"] == (5.0, 5.0, 9.0)
    assert cells[0].to_json()["stats"]["continued"] is None
    # A run written to outcome.json is read back whole (--merge, --jobs).
    again = b.Run(**json.loads(json.dumps(dataclasses.asdict(gated[0]))))
    assert again.continued == 4.0 and again.gate_retried == 5.0
