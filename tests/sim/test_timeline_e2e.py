"""End to end: the run's timeline survives a restart, and a healthy run fails no request.

The twin runs as a real process on 127.0.0.1; the tests wait on its simulated clock
(``GET /sim/clock``) or on the timeline file, never on a fixed sleep.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.sim.conftest import Starter
from tests.sim.twinproc import TwinProc
from tests.support import wait_for
from vllm_guardian.sim.load import OutcomeKind, plan_requests, run_load
from vllm_guardian.sim.scenarios import SCENARIOS

pytestmark = pytest.mark.slow


def clock(t: TwinProc) -> dict[str, Any] | None:
    try:
        return dict(requests.get(f"{t.url}/sim/clock", timeout=2).json())
    except requests.RequestException:
        return None


def timeline(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize(("scenario", "kind"), [("engine_hang", "hang"),
                                                ("exit_zero_death", "death")])  # fmt: skip
def test_a_restarted_twin_past_the_fault_time_does_not_meet_it_again(
    twin: Starter, tmp_path: Path, scenario: str, kind: str
) -> None:
    path = tmp_path / "timeline.json"
    args = ("--sim-scenario", scenario, "--enforce-eager", "--sim-speed", "20",
            "--served-model-name", "m", "--sim-timeline-file", str(path))  # fmt: skip
    first = twin(*args)
    first.wait_ready()
    got = wait_for(
        lambda: (timeline(path) or {}).get("faults"),
        "the first process's fault in the timeline",
        seen=lambda: timeline(path),
    )
    assert [(f["kind"], f["pid"]) for f in got] == [(kind, first.proc.pid)]
    epoch = timeline(path)["epoch_unix_seconds"]  # type: ignore[index]
    first.sigterm()  # a hung engine is stopped; a dead one has exited by itself
    first.wait_exit()

    second = twin(*args)
    second.wait_ready()
    # Three times the fault's scenario time (30 s) on the run's clock, waited for in simulated time.
    now = wait_for(
        lambda: (c := clock(second)) and (c["scenario_seconds"] or 0) >= 90 and c,
        "scenario time 90 s on the restarted twin",
        seen=lambda: clock(second),
    )
    assert now["faults"] == [] and now["phase"] == "ready", now
    resp = second.post("/v1/completions", {"model": "m", "prompt": "a b c", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    doc = timeline(path)
    assert doc is not None
    assert doc["epoch_unix_seconds"] == epoch
    assert [f["pid"] for f in doc["faults"]] == [first.proc.pid]


def test_an_epoch_in_the_arguments_places_the_fault_on_the_runs_clock(
    twin: Starter, tmp_path: Path
) -> None:
    # The run started 60 simulated seconds (3 s real at 20×) before this process: the hang at
    # 30 s is in the past when it becomes ready.
    t = twin("--sim-scenario", "engine_hang", "--enforce-eager", "--sim-speed", "20",
             "--sim-epoch", f"{time.time() - 3.0:.3f}")  # fmt: skip
    t.wait_ready()
    now = wait_for(
        lambda: (c := clock(t)) and (c["scenario_seconds"] or 0) >= 120 and c,
        "scenario time 120 s",
        seen=lambda: clock(t),
    )
    assert now["faults"] == [] and now["phase"] == "ready", now


def test_a_file_that_is_not_a_timeline_is_refused_by_name(twin: Starter, tmp_path: Path) -> None:
    bad = tmp_path / "timeline.json"
    bad.write_text('{"epoch_unix_seconds": "yesterday"}')
    t = twin("--sim-timeline-file", str(bad))
    assert t.wait_exit() == 2
    assert f"{bad}: not a timeline file: epoch_unix_seconds is str" in t.stderr()


def test_a_healthy_run_fails_no_request_at_the_end_of_its_window(twin: Starter) -> None:
    # Before: a request's time bound was cut to what was left of the window, so the requests
    # sent in its last second timed out against a healthy server.
    t = twin("--enforce-eager", "--sim-speed", "10", "--served-model-name", "m")
    t.wait_ready()
    plan = plan_requests(SCENARIOS["steady"].load, 7, 10_000, 6.0 * 10)
    plan = [p if p.index % 2 else dataclasses.replace(p, stream=True) for p in plan]
    result = run_load(t.url, plan, model="m", speed=10, stream=False, max_duration_seconds=6.0)
    kinds = {k.value: n for k in OutcomeKind if (n := result.count(k))}
    assert kinds == {"ok": len(plan)}, kinds
    streamed = [o for o in result.outcomes if o.ttft_seconds is not None]
    assert len(streamed) == sum(1 for p in plan if p.stream)
