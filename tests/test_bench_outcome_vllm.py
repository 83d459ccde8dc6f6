"""The real-engine outcome benchmark's report: runs appended as they end, read back, judged by
the twin benchmark's verdict plus the real engine's own checks, and put beside the twin.

Hand-made runs in, the report's fields out; the harness itself runs on the real vLLM tier
(``--quick``) and in the benchmark, never here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench() -> ModuleType:
    name = "bench_outcome_vllm"
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "outcome_vllm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(b: ModuleType, scenario: str, operator: str, seed: int, **kw: object) -> object:
    base = {"sent": 100, "failed": 0, "cold_start_seconds": 28.0, "load_average": (0.5, 0.6)}
    return b.RealRun(scenario, operator, seed, **(base | kw))


def write(path: Path, b: ModuleType, runs: list[object], commit: str = "abc1234") -> None:
    with path.open("a") as f:
        for r in runs:
            inv = {"command": ["--seeds", "7,8"], "commit": commit}
            f.write(json.dumps({"run": dataclasses.asdict(r), "invocation": inv}) + "\n")


def test_the_report_judges_real_runs_and_puts_the_twin_beside(tmp_path: Path) -> None:
    b = bench()
    runs = [
        *(run(b, "prefill_oom", "unguarded", s, failed=60, oom_crashes=4) for s in (7, 8)),
        *(run(b, "prefill_oom", "sidecar", s, failed=50) for s in (7, 8)),
        *(
            run(
                b,
                "prefill_oom",
                "guardian+gate",
                s,
                failed=3,
                named_causes=["prefill_burst"],
                actions=["relaunch: prefill_burst"],
                deaths_after_last_action=0,
            )
            for s in (7, 8)
        ),
        run(b, "steady", "unguarded", 7),
        run(b, "steady", "guardian+gate", 7),
    ]
    write(b.runs_file(tmp_path, False), b, runs)
    twin = {"cells": [{"scenario": "prefill_burst", "operator": "guardian+gate",
                       "load_before": [0, 0, 0], "load_after": [0, 0, 0], "busy": False,
                       "runs": [{"scenario": "prefill_burst", "operator": "guardian+gate",
                                 "seed": 7, "sent": 279, "failed": 2}]}]}  # fmt: skip
    (tmp_path / "twin.json").write_text(json.dumps(twin))
    md = b.write_report(tmp_path, False, tmp_path / "twin.json")
    assert "- prefill_oom: met" in md, md
    assert "- steady: met" in md, md
    assert "named prefill_burst from vLLM's log in 2 of 2 runs ✓" in md, md
    assert "OOM deaths after its last relaunch [0, 0] ✓" in md, md
    # The twin's cell beside the real one: 3 % real, 0.7 % (2 of 279) on the twin.
    row = next(line for line in md.splitlines() if line.startswith("| prefill_oom ↔ prefill_burst | guardian+gate"))  # fmt: skip
    assert "3.0 \\| 0.7" in row, row
    assert "`.venv/bin/python bench/outcome_vllm.py --seeds 7,8` at abc1234: 8 runs" in md, md
    # What was not run is said, not left for a reader to take as nothing failing.
    assert "- Not run: prefill_oom/unguarded-on-failure, engine_death/unguarded," in md, md
    assert "- Fewer seeds than the others: steady/unguarded (1 of 2), steady/guardian+gate (1 of 2)." in md, md  # fmt: skip
    svg = (tmp_path / "outcome-vllm.svg").read_text()
    assert ">prefill_oom<" in svg and ">prefill_burst<" not in svg
    saved = json.loads((tmp_path / "outcome-vllm.json").read_text())
    assert len(saved["runs"]) == 8 and saved["runs"][0]["invocation"]["commit"] == "abc1234"


def test_a_missed_goal_is_named_and_a_later_run_replaces_an_earlier(tmp_path: Path) -> None:
    b = bench()
    path = b.runs_file(tmp_path, False)
    write(path, b, [run(b, "engine_death", "unguarded", 7, failed=40),
                    run(b, "engine_death", "guardian+gate", 7, failed=30)])  # fmt: skip
    md = b.write_report(tmp_path, False, tmp_path / "absent.json")
    assert "- engine_death: MISSED" in md and "bench/results/outcome.md: not found" in md, md
    write(path, b, [run(b, "engine_death", "guardian+gate", 7, failed=1)], commit="def5678")
    md = b.write_report(tmp_path, False, tmp_path / "absent.json")
    assert "- engine_death: met" in md, md
    assert "at def5678: 1 runs (engine_death/guardian+gate/7)" in md, md


def test_a_corrupt_runs_file_names_its_line(tmp_path: Path) -> None:
    b = bench()
    path = b.runs_file(tmp_path, False)
    write(path, b, [run(b, "steady", "unguarded", 7)])
    with path.open("a") as f:
        f.write('{"run": {"scenario": "steady"\n')
    with pytest.raises(SystemExit, match=r"outcome-vllm\.runs\.jsonl:2: not a run record"):
        b.read_runs(path)


def fault_plugin() -> Any:
    spec = importlib.util.spec_from_file_location(
        "faults_plugin", ROOT / "tests" / "vllm_tier" / "faults" / "vllm_guardian_faults.py"
    )
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return plugin


@pytest.mark.parametrize(
    ("content", "hangs"),
    [
        ("", True),
        ("{me}", True),
        ("{other}", False),
        (None, False),
        ("{me} running=4 tokens=32 step_ms=20 stop", True),
        ("{other} running=4 stop", False),
        ("running=2", True),
    ],
    ids=[
        "empty: every engine core",
        "this engine core",
        "another engine core",
        "no file",
        "this engine core, with words",
        "another engine core, with words",
        "words only: every engine core",
    ],
)
def test_the_fault_plugins_hang_is_one_off_when_it_names_an_engine_core(
    tmp_path: Path, content: str | None, hangs: bool
) -> None:
    """The benchmark's engine_hang names the engine core it hangs: the engine a restart brings
    (another pid) serves, as after a real hang; a restart that cured nothing would show as
    such (a hang file left behind hung every restarted engine in the first full run)."""
    hang = tmp_path / "hang"
    if content is not None:
        hang.write_text(content.format(me=os.getpid(), other=os.getpid() + 1))
    assert (fault_plugin()._hang_for_me(hang) is not None) is hangs


@dataclasses.dataclass
class Running:
    """What the hang reads of a request in vLLM's scheduler."""

    num_output_tokens: int


@pytest.mark.parametrize(
    ("words", "output_tokens", "due"),
    [
        ("", [], True),
        ("running=4 tokens=32", [40, 33, 32, 90], True),
        ("running=4 tokens=32", [40, 33, 31, 90], False),
        ("running=4 tokens=32", [40, 33, 32], False),
        ("running=2", [0, 0, 0], True),
    ],
    ids=["at once", "the batch", "one short of tokens", "one request short", "more running"],
)
def test_the_fault_plugins_hang_waits_for_its_batch(
    words: str, output_tokens: list[int], due: bool
) -> None:
    """Test 7 of the real tier stops the engine at the first step with its four requests in
    it, each with text generated: the plugin, not the test, sees that moment."""
    hang = fault_plugin().Hang(words.split())
    assert hang.due([Running(n) for n in output_tokens]) is due


def test_the_fault_plugins_hang_words() -> None:
    hang = fault_plugin().Hang(["running=4", "tokens=32", "step_ms=20", "stop"])
    assert (hang.running, hang.tokens, hang.step_seconds, hang.stop) == (4, 32, 0.02, True)
    assert fault_plugin().Hang([]).stop is False


def test_a_scenario_runs_its_server_with_its_own_values_of_the_base_flags() -> None:
    b = bench()
    plain = b.serve_flags(b.SCENARIOS["steady"])
    assert plain == b.BASE_FLAGS
    capped = b.serve_flags(
        dataclasses.replace(b.SCENARIOS["steady"], flags=("--max-num-seqs", "2"))
    )
    assert capped[capped.index("--max-num-seqs") + 1] == "2"
    assert len(capped) == len(b.BASE_FLAGS)  # replaced, not appended: vLLM takes the last value
    with pytest.raises(
        ValueError
    ):  # a flag the base set does not have is a mistake, not a new flag
        b.serve_flags(dataclasses.replace(b.SCENARIOS["steady"], flags=("--no-such-flag", "1")))


def test_a_run_records_the_gates_own_account_of_what_it_refused_and_why_it_held() -> None:
    """Read from the gate's real /metrics exposition: the non-zero rejections, upstream errors
    by phase, retries, stale connections and closed connections, the service label left out."""
    from vllm_guardian.gate.metrics import GateMetrics

    b = bench()
    m = GateMetrics("vllm")
    m.rejected.labels("queue_full").inc(267)
    m.upstream_error("before_first_byte")
    m.upstream_error("before_first_byte")
    m.upstream_error("connect")
    m.stale_connections.inc(3)
    m.retried.inc(2)
    m.admitted.inc(900)  # not one of the counters a run records
    m.loop_lag_seconds.observe(0.002)
    m.loop_lag_seconds.observe(3.0)  # one wake-up 3 s late
    got = b.gate_counters(m.render().decode())
    assert got["vllm_guardian_gate_loop_lag_seconds_count"] == 2.0
    assert got["vllm_guardian_gate_loop_lag_seconds_bucket{le=2.5}"] == 1.0
    assert got["vllm_guardian_gate_loop_lag_seconds_bucket{le=5.0}"] == 2.0
    assert {k: v for k, v in got.items() if "loop_lag" not in k} == {
        "vllm_guardian_gate_rejected_total{reason=queue_full}": 267.0,
        "vllm_guardian_gate_upstream_errors_total{phase=before_first_byte}": 2.0,
        "vllm_guardian_gate_upstream_errors_total{phase=connect}": 1.0,
        "vllm_guardian_gate_upstream_stale_connections_total": 3.0,
        "vllm_guardian_gate_retried_total": 2.0,
    }


def test_the_guardians_restarts_are_read_from_its_pid_file(tmp_path: Path) -> None:
    """The guardian runs in its own process: each new pid its supervisor writes after the
    first is a start of vLLM again; a missing, half-written or unchanged file is none."""
    from tests.support import wait_for

    b = bench()
    pid_file = tmp_path / "vllm.pid"
    assert b.vllm_pid(pid_file) is None  # not written yet
    with b.PidFileWatch(pid_file) as watch:
        pid_file.write_text("100 5000")
        wait_for(lambda: watch.pid == 100, "the first pid seen", timeout_seconds=30)
        pid_file.write_text("garbage")
        pid_file.write_text("100 5000")
        pid_file.write_text("200 6000")  # a restart
        wait_for(lambda: len(watch.restarts_unix_seconds) == 1, "one restart", timeout_seconds=30,
                 seen=lambda: watch.restarts_unix_seconds)  # fmt: skip
    assert b.vllm_pid(pid_file) == 200


def test_each_partys_cpu_is_read_from_proc() -> None:
    """What the guardian, the gate and vLLM cost the shared cores: /proc's user + system time,
    of a process or of its whole tree; a process that is not there reads None."""
    import subprocess

    b = bench()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert b.process_cpu_seconds(None) is None
        from tests.support import wait_for

        wait_for(lambda: (b.process_cpu_seconds(busy.pid) or 0.0) >= 0.2, "the child's CPU counted",
                 timeout_seconds=60)  # fmt: skip
        own = b.process_cpu_seconds(os.getpid())
        tree = b.process_cpu_seconds(os.getpid(), tree=True)
        assert own is not None and tree is not None and tree >= own + 0.2, (own, tree)
        assert set(b.cpu_reading({"x": (busy.pid, False)})) == {"x", "load_client"}
    finally:
        busy.kill()
        busy.wait()
    assert b.process_cpu_seconds(busy.pid) is None  # reaped: gone


def test_vllm_is_put_on_the_cpus_given_and_left_alone_otherwise() -> None:
    b = bench()
    serve = ["/usr/bin/env", "A=1", "/venv/bin/vllm", "serve", "/m", "--max-num-seqs", "1"]
    assert b.on_cpus(serve, None) == serve
    assert b.on_cpus(serve, "1") == ["/usr/bin/taskset", "-c", "1", *serve]
    # the guardian still reads vLLM's flags from the pinned command line
    from vllm_guardian.core.budget import parse_launch_flags

    assert parse_launch_flags(b.on_cpus(serve, "1")).max_num_seqs == 1
