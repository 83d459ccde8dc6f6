"""End to end on the vLLM twin, real processes: the smoke tests of the path the virtual-time
scenarios (tests/test_scenarios_vt.py) leave out: HTTP on 127.0.0.1, the twin as a subprocess
under the guardian's process manager, the admission gate in front of it (the demo's default),
the flags file, the log file, the GPU state file, the guardian's threads and the load generator. Asserted on the audit log and on the twin's own exits.
One guardian, one twin and one bounded load per test, all stopped by ``run_demo`` before it
returns."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_guardian.actuators import audit
from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.model import ActionKind, Cause
from vllm_guardian.tools.demo import DemoOptions, DemoReport, run_demo

pytestmark = pytest.mark.slow


def actions(r: DemoReport, kind: ActionKind | None = None) -> list[Decision]:
    return [a for a in r.actions if kind is None or a.action_kind is kind]


def results(r: DemoReport) -> list[Decision]:
    return [d for d in r.decisions if d.what is DecisionKind.RESULT]


def check_prefill(r: DemoReport) -> None:
    relaunches = actions(r, ActionKind.RELAUNCH)
    assert relaunches and relaunches[0].cause is Cause.PREFILL_BURST
    assert "max_num_batched_tokens one rung down to 4096" in relaunches[0].reason
    assert any(
        "--max-num-batched-tokens 4096 --enable-chunked-prefill" in d.reason for d in results(r)
    )
    assert r.requests.get("ok", 0) > 0
    # The demo's default: the load goes through the gate, which holds what arrives while vLLM
    # relaunches. No connection refused, no error of the gate's own; what fails is only what
    # was streaming when the engine died (never replayed).
    print("requests:", r.requests, "gate:", r.gate)
    assert r.gate is not None, "the demo ran without its gate"
    failed = {k: v for k, v in r.requests.items() if k not in ("ok", "not_sent")}
    assert set(failed) <= {"stream_error", "incomplete"}, failed
    assert r.gate["rejected_total"] == 0, r.gate


def check_exit_zero(r: DemoReport) -> None:
    restarts = actions(r, ActionKind.RESTART)
    assert restarts and restarts[0].cause is Cause.ENGINE_DEAD
    assert 0 in r.twin_exits  # it really died with status 0


def outcomes(workdir: Path) -> list[str]:
    """The load's outcome kinds so far (written as each request ends)."""
    out = []
    with contextlib.suppress(OSError), (workdir / "outcomes.jsonl").open() as fh:
        for line in fh:
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                out.append(str(json.loads(line).get("kind")))
    return out


def an_action_ended(workdir: Path) -> bool:
    return any(d.what is DecisionKind.RESULT for d in audit.read(workdir / "state" / "audit.jsonl"))


def an_action_ended_and_a_request_was_served(workdir: Path) -> bool:
    # Through the gate, requests that arrive during the relaunch are held and served after it.
    return an_action_ended(workdir) and "ok" in outcomes(workdir)


def stop_when(done: Callable[[Path], bool], workdir: Path, stop: threading.Event) -> None:
    """Ends the demo as soon as what the checks need has happened, instead of after a fixed
    duration; the duration is only the upper bound."""
    while not stop.wait(0.5):
        if done(workdir):
            stop.set()


# The smoke tests of the real-process path: one relaunch (a new flags file read by the process
# manager's restart) and one death with status 0 (Restart=always). Every scenario's decisions,
# these two included, are checked on virtual time in tests/test_scenarios_vt.py against golden
# logs. The duration is a generous bound (3x what a busy 2-core machine needs, and within
# pytest's 120 s timeout with the teardown): each run ends as soon as what its check needs has
# happened. prefill_burst runs the twin at 6x (4x on virtual time): the same decisions there
# (`python -m tests.virtual_time prefill_burst --speed 6 --duration 30`), a shorter wait here.
CASES: list[tuple[str, float, float, Callable[[Path], bool], Callable[[DemoReport], None]]] = [
    ("prefill_burst", 6, 75, an_action_ended_and_a_request_was_served, check_prefill),
    ("exit_zero_death", 6, 75, an_action_ended, check_exit_zero),
]


@pytest.mark.parametrize(
    ("scenario", "speed", "bound", "done", "check"), CASES, ids=[c[0] for c in CASES]
)
def test_scenario(
    tmp_path: Path,
    scenario: str,
    speed: float,
    bound: float,
    done: Callable[[Path], bool],
    check: Callable[[DemoReport], None],
) -> None:
    # Through the demo's gate (its default, the deployed form): the load goes to the gate, which
    # holds what arrives while vLLM restarts.
    stop = threading.Event()
    watcher = threading.Thread(target=stop_when, args=(done, tmp_path, stop), daemon=True)
    watcher.start()
    try:
        report = run_demo(DemoOptions(scenario, speed, bound, tmp_path, quiet=True), stop=stop)
    finally:
        stop.set()
        watcher.join(timeout=5)
    try:
        check(report)
    except AssertionError:
        print(f"bound {bound:g}s; {done.__name__}: {done(tmp_path)}")
        print("\n".join(f"{d.what}: {d.reason}" for d in report.decisions))
        print(
            "alerts fired:",
            report.alerts_fired,
            "twin exits:",
            report.twin_exits,
            "requests:",
            report.requests,
        )
        raise
