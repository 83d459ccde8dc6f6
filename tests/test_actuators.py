"""Actuators against real things: files, real child processes, a fake systemctl binary."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.support import wait_for
from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.actuators.executor import OpRunner
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.actuators.systemd import SystemdBackend
from vllm_guardian.core.policy import HoldOff, Levels, Lever, PolicyState, ServiceState
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.model import Cause, Op, OpRequest, OpResult
from vllm_guardian.shell.healing import load_state, save_state

# --- the flags file --------------------------------------------------------------------------

VALID = [
    ([("--max-num-seqs", "192")], [], "VLLM_GUARDIAN_ARGS=--max-num-seqs 192"),
    (
        [("--max-num-batched-tokens", "4096"), ("--enable-chunked-prefill", "")],
        [],
        "VLLM_GUARDIAN_ARGS=--max-num-batched-tokens 4096 --enable-chunked-prefill",
    ),
    (
        [("--gpu-memory-utilization", "0.85")],
        [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
        "VLLM_GUARDIAN_ARGS=--gpu-memory-utilization 0.85\nPYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    ([], [], "VLLM_GUARDIAN_ARGS="),
]


@pytest.mark.parametrize(("flags", "env", "expected"), VALID)
def test_flags_file_round_trip(tmp_path: Path, flags, env, expected):
    content = flagsfile.validate(flags, env)
    path = flagsfile.path_for(tmp_path, "vllm")
    flagsfile.write(path, content)
    text = path.read_text()
    assert expected in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert flagsfile.read(path) == content
    assert [p.name for p in tmp_path.iterdir()] == ["vllm.env"]  # no temp file left behind


REJECTED = [
    ([("--api-key", "x")], [], "not a flag the guardian may set"),
    ([("--max-num-seqs", "0")], [], "integer in [1"),
    ([("--max-num-seqs", "8; rm -rf /")], [], "integer"),
    ([("--gpu-memory-utilization", "1.5")], [], "number in [0.05"),
    ([("--gpu-memory-utilization", "0.9 --api-key x")], [], "number"),
    ([("--enforce-eager", "yes")], [], "takes no value"),
    ([], [("LD_PRELOAD", "/tmp/x.so")], "not a variable"),
    ([], [("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")], "expandable_segments"),
]


@pytest.mark.parametrize(("flags", "env", "why"), REJECTED)
def test_only_whitelisted_validated_flags(tmp_path: Path, flags, env, why):
    with pytest.raises(flagsfile.FlagsRejected, match=None) as exc:
        flagsfile.validate(flags, env)
    assert why in str(exc.value)


def test_a_tampered_flags_file_is_rejected_not_obeyed(tmp_path: Path):
    path = tmp_path / "vllm.env"
    path.write_text("VLLM_GUARDIAN_ARGS=--max-num-seqs 8 --trust-remote-code\n")
    with pytest.raises(flagsfile.FlagsRejected):
        flagsfile.read(path)


# Unicode digits pass Python's int()/float() and \\d, but are no vLLM value.
@pytest.mark.parametrize(
    "value",
    [
        "\u0661\u0662",
        "\uff19\uff16",
        "9\u0666",
        "1\u00b2",
    ],  # Arabic-Indic, fullwidth, mixed, superscript
)
def test_flag_values_are_ascii_digits_only(value: str):
    for flag in ("--max-num-seqs", "--gpu-memory-utilization"):
        v = value if flag == "--max-num-seqs" else f"0.{value}"
        with pytest.raises(flagsfile.FlagsRejected):
            flagsfile.validate([(flag, v)], [])


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p.write_bytes(b"VLLM_GUARDIAN_ARGS=--max-num-seqs 8\n\xff\xfe\n"), "UTF-8"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: p.write_bytes(b"# x\n" * 300_000), "larger than"),
    ],
    ids=["not-utf8", "directory", "huge"],
)
def test_an_unreadable_flags_file_is_rejected_with_its_reason(tmp_path: Path, make, why):
    path = tmp_path / "vllm.env"
    make(path)
    with pytest.raises(flagsfile.FlagsRejected, match=why):
        flagsfile.read(path)


# --- the process manager ---------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    # The handler before the first line: the tests take "argv" to mean SIGTERM will drain.
    signal.signal(signal.SIGTERM, lambda *a: (print("draining", flush=True), sys.exit(0)))
    print("argv", sys.argv[1:], "alloc", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), flush=True)
    mode = sys.argv[1] if len(sys.argv) > 1 else "run"
    if mode in ("exit0", "exit1"):
        time.sleep(0.3)
        sys.exit(int(mode[-1]))
    while True:
        time.sleep(0.1)
    """
)


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


def test_supervisor_applies_the_flags_file_and_restarts_on_demand(tmp_path: Path, child: Path):
    flags_path = tmp_path / "svc.env"
    log = tmp_path / "svc.log"
    sup = Supervisor(
        "svc",
        [sys.executable, str(child), "run"],
        flags_path,
        log,
        restart_delay_seconds=0.1,
        stop_timeout_seconds=5,
    )
    try:
        sup.start()
        wait_for(lambda: sup.pid is not None and "argv" in log.read_text(), "the stub started")
        first = sup.pid
        flagsfile.write(
            flags_path,
            flagsfile.validate(
                [("--max-num-seqs", "96")],
                [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
            ),
        )
        ok, terminal, detail = sup.restart()
        assert ok and not terminal, detail
        wait_for(lambda: "--max-num-seqs', '96'" in log.read_text(), "the new flags in use")
        assert sup.pid != first
        text = log.read_text()
        assert "draining" in text  # SIGTERM first: vLLM drains on it
        assert "alloc expandable_segments:True" in text
    finally:
        sup.stop()
    assert sup.pid is None


def test_supervisor_restarts_a_process_that_exits_zero(tmp_path: Path, child: Path):
    sup = Supervisor(
        "svc",
        [sys.executable, str(child), "exit0"],
        tmp_path / "none.env",
        tmp_path / "log",
        restart_delay_seconds=0.1,
    )
    try:
        sup.start()
        wait_for(lambda: sup.starts >= 3, "three starts")
        assert sup.exits[:2] == [0, 0]  # Restart=always: exit 0 after engine death is not "done"
    finally:
        sup.stop()


STUBBORN = textwrap.dedent(
    """
    import os, signal, sys, time
    def ignore(*a):
        print("ignored SIGTERM", os.getpid(), flush=True)
    signal.signal(signal.SIGTERM, ignore)
    print("started", os.getpid(), flush=True)
    while True:
        time.sleep(0.1)
    """
)


def stubborn(tmp_path: Path, **timeouts: float) -> tuple[Supervisor, Path]:
    """A supervisor of the stub that ignores SIGTERM (STUBBORN), and its log."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    log = tmp_path / "svc.log"
    sup = Supervisor("svc", [sys.executable, str(script)], tmp_path / "none.env", log,
                     restart_delay_seconds=0.1, **timeouts)  # fmt: skip
    return sup, log


def test_a_restart_kills_a_vllm_that_ignores_sigterm_after_the_stop_timeout(
    tmp_path: Path,
) -> None:
    """The executor's restart call carries the whole action's timeout (drain + ready, 1,020 s
    by default): a vLLM that ignored SIGTERM was killed only when that ran out, the front door
    closed all along. The stop timeout bounds the stop of a restart too: SIGTERM, at most the
    stop timeout, SIGKILL to the group, then the new start."""
    sup, log = stubborn(tmp_path, stop_timeout_seconds=0.5)
    got: list[tuple[bool, bool, str]] = []
    try:
        sup.start()
        wait_for(lambda: sup.pid is not None and "started" in log.read_text(), "the stub started")
        first = sup.pid
        # What the executor passes: the action's drain + ready timeouts, far past the stop's.
        t = threading.Thread(target=lambda: got.append(sup.restart(timeout_seconds=1020.0)))
        t.start()
        wait_for(
            lambda: bool(got), "the stop", timeout_seconds=120
        )  # generous: the stop timeout is 0.5 s
        ok, terminal, detail = got[0]
        assert ok and not terminal, detail
        second = sup.pid
        assert second is not None and second != first
        wait_for(lambda: f"started {second}" in log.read_text(), "the second start")
        lines = log.read_text().splitlines()
        # The order of events: the first started, ignored SIGTERM, then the second started.
        assert lines.index(f"started {first}") < lines.index(f"ignored SIGTERM {first}")
        assert lines.index(f"ignored SIGTERM {first}") < lines.index(f"started {second}")
        assert sup.exits == [-9]  # the first one ended by SIGKILL, not by its own exit
    finally:
        sup.stop(timeout_seconds=0.5)
        t.join(timeout=60)


def test_a_restart_with_nothing_to_drain_waits_only_for_vllms_exit(tmp_path: Path) -> None:
    """A hung or dead engine finishes nothing in flight, so its restart does not drain
    (core/phases.py): the stop waits only the exit time, not the drain's stop timeout. On a
    real vLLM 0.32 a hung engine's API server, SIGTERMed, stopped its engine in 10 s, then
    waited for the gate's open connections to the hung requests: the restart took 120 s (the
    clients' timeout) under a 150 s stop timeout, the front door closed all along."""
    # The drain's stop timeout is never reached by a restart with none.
    sup, log = stubborn(tmp_path, stop_timeout_seconds=3600.0, exit_timeout_seconds=0.5)
    got: list[tuple[bool, bool, str]] = []
    try:
        sup.start()
        wait_for(lambda: sup.pid is not None and "started" in log.read_text(), "the stub started")
        first = sup.pid
        t = threading.Thread(
            target=lambda: got.append(sup.restart(timeout_seconds=1020.0, drain=False))
        )
        t.start()
        # Generous against the 0.5 s exit time; far short of the 3,600 s stop timeout.
        wait_for(lambda: bool(got), "the stop, within the exit time", timeout_seconds=120)
        ok, terminal, detail = got[0]
        assert ok and not terminal, detail
        assert sup.pid is not None and sup.pid != first
        assert sup.exits == [-9]  # SIGKILLed after the exit time: it ignored SIGTERM
    finally:
        sup.stop(timeout_seconds=0.5)
        t.join(timeout=60)


@pytest.mark.parametrize(
    "make",
    [lambda p: p.write_bytes(b"VLLM_GUARDIAN_ARGS=\xff\n"), lambda p: p.mkdir()],
    ids=["not-utf8", "directory"],
)
def test_a_broken_flags_file_never_stops_supervision(tmp_path: Path, child: Path, make, caplog):
    """A non-UTF-8 flags file killed the supervisor thread, a directory in its
    place prevented every start. Now: rejected and reported, vLLM runs with the base flags and
    is restarted when it exits."""
    flags_path = tmp_path / "svc.env"
    make(flags_path)
    log = tmp_path / "svc.log"
    sup = Supervisor(
        "svc",
        [sys.executable, str(child), "exit0"],
        flags_path,
        log,
        restart_delay_seconds=0.1,
    )
    try:
        sup.start()
        wait_for(lambda: sup.starts >= 3, "three starts")
        assert log.read_text().count("argv ['exit0']") >= 2, log.read_text()
        ok, terminal, detail = sup.restart(timeout_seconds=5)
        assert ok and not terminal, detail
    finally:
        sup.stop()
    assert "flags file" in caplog.text and "rejected" in caplog.text


@pytest.mark.parametrize(("mode", "restarted"), [("exit0", False), ("exit1", True)])
def test_supervisor_on_failure_leaves_a_clean_exit_down(
    tmp_path: Path, child: Path, mode: str, restarted: bool
):
    # Restart=on-failure: vLLM's exit 0 after an engine death defeats it; a failure does not.
    sup = Supervisor(
        "svc",
        [sys.executable, str(child), mode],
        tmp_path / "none.env",
        tmp_path / "log",
        restart_delay_seconds=0.1,
        restart_on_clean_exit=False,
    )
    try:
        sup.start()
        if restarted:
            wait_for(lambda: sup.starts >= 2, "two starts")
            assert sup.exits[0] == 1 and sup.wants_running
        else:
            wait_for(
                lambda: sup.exits == [0] and not sup.wants_running,
                "one exit with 0, and no restart wanted",
            )
            assert sup.starts == 1
    finally:
        sup.stop()


# A command that exits at once is restarted after a delay that doubles up to a cap (it was
# restarted about once a second, forever); one that stayed up a while starts the doubling over.
# (what happened to the previous run, its delay before → the delay before the next start)
RESTART_DELAYS = [
    ("first quick exit", 0.0, None, 1.0),
    ("second quick exit", 0.5, 1.0, 2.0),
    ("doubling", 3.0, 8.0, 16.0),
    ("at the cap", 1.0, 40.0, 60.0),
    ("stays at the cap", 1.0, 60.0, 60.0),
    ("up for long enough: over", 120.0, 60.0, 1.0),
    ("up a while, not long enough", 119.0, 16.0, 32.0),
]


@pytest.mark.parametrize(
    ("ran", "before", "expected"),
    [r[1:] for r in RESTART_DELAYS],
    ids=[r[0] for r in RESTART_DELAYS],
)
def test_restart_delay_backs_off_for_quick_exits(
    ran: float, before: float | None, expected: float
) -> None:
    from vllm_guardian.actuators.procmgr import next_restart_delay

    got = next_restart_delay(
        ran, before, initial_seconds=1.0, max_seconds=60.0, stable_seconds=120.0
    )
    assert got == expected


def test_a_command_that_exits_at_once_is_restarted_with_backoff(tmp_path: Path) -> None:
    """A real command, on a fake clock: the supervisor measures how long each run lasted on
    the clock it is given, so every run is quick until the clock is moved on while one runs."""
    from vllm_guardian.lowio.clock import FakeClock

    clock = FakeClock()
    stay = tmp_path / "stay"
    sup = Supervisor(
        "svc",
        ["sh", "-c", f"test -e {stay} && exec sleep 600; exit 1"],
        tmp_path / "none.env",
        tmp_path / "log",
        restart_delay_seconds=0.02,
        restart_delay_max_seconds=0.16,
        stable_seconds=120.0,
        clock=clock,
    )
    try:
        sup.start()
        wait_for(lambda: len(sup.delays) >= 6, "six restart delays")
        print("delays:", sup.delays)
        assert sup.delays[:6] == [0.02, 0.04, 0.08, 0.16, 0.16, 0.16]
        stay.touch()  # the next run stays up...
        wait_for(lambda: sup.pid is not None and sup.starts >= 7, "the seventh start")
        long_run = sup.pid
        before = len(sup.delays)
        clock.advance(121.0)  # ...long enough on the supervisor's clock
        stay.unlink()
        os.kill(long_run, 9)
        wait_for(lambda: len(sup.delays) >= before + 3, "three more restart delays")
        print("delays:", sup.delays)
        assert sup.delays[before : before + 3] == [0.02, 0.04, 0.08]
    finally:
        sup.stop(timeout_seconds=5)


# --- systemd ---------------------------------------------------------------------------------


def fake_systemctl(tmp_path: Path, body: str) -> str:
    path = tmp_path / "systemctl"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


SYSTEMCTL = [
    # script body, ok, terminal, detail fragment
    ('echo "$@" > "$(dirname "$0")/args"\nexit 0\n', True, False, "systemctl restart vllm.service"),
    (
        'echo "Failed to restart vllm.service: Unit vllm.service not found." >&2\nexit 5\n',
        False,
        True,
        "not found",
    ),
    ('echo "Failed to restart vllm.service: Access denied" >&2\nexit 1\n', False, True, "polkit"),
    (
        'echo "Job for vllm.service failed because the control process exited with error code." >&2\nexit 1\n',
        False,
        False,
        "control process exited",
    ),
    ("sleep 5\n", False, False, "did not return within 1s"),
]


@pytest.mark.parametrize(("body", "ok", "terminal", "detail"), SYSTEMCTL)
def test_systemd_backend(tmp_path: Path, body, ok, terminal, detail):
    b = SystemdBackend("vllm.service", fake_systemctl(tmp_path, body))
    got = b.restart(timeout_seconds=1)
    assert got[:2] == (ok, terminal) and detail in got[2]
    if ok:
        assert (tmp_path / "args").read_text().split() == [
            "restart",
            "--no-ask-password",
            "--",
            "vllm.service",
        ]


def test_systemd_backend_without_systemctl():
    ok, terminal, detail = SystemdBackend("vllm.service", "/nonexistent/systemctl").restart(1)
    assert (ok, terminal) == (False, True) and "not found" in detail


# --- the blocking calls (the phases around them: tests/test_phases.py) ----------------------


class Backend:
    def __init__(self, result=(True, False, "restarted")):  # type: ignore[no-untyped-def]
        self.calls = 0
        self.result = result

    def restart(self, timeout_seconds: float, drain: bool = True):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.result


def take(runner: OpRunner, n: int = 1, timeout: float = 30.0) -> list[OpResult]:
    got: list[OpResult] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(got) < n:
        got += runner.take_results()
        time.sleep(0.01)
    assert len(got) >= n, f"{len(got)} result(s) of {n} within {timeout}s: {got}"
    return got


def op(kind: Op, flags=(), env=()) -> OpRequest:  # type: ignore[no-untyped-def]
    return OpRequest(1, "vllm", kind, tuple(flags), tuple(env), 5.0, "test")


OPS = [
    # name, request, backend result, (ok, terminal, words in the detail), restarts
    ("flags written", op(Op.WRITE_FLAGS, [("--max-num-seqs", "48")]), None,
     (True, False, "flags file written"), 0),
    ("flags off the whitelist are terminal", op(Op.WRITE_FLAGS, [("--trust-remote-code", "")]),
     None, (False, True, "flags rejected"), 0),
    ("restart through the backend", op(Op.RESTART), (True, False, "restarted"),
     (True, False, "restarted"), 1),
    ("a failed restart is a result", op(Op.RESTART), (False, False, "unit failed"),
     (False, False, "unit failed"), 1),
    ("no bundle writer", op(Op.BUNDLE), None, (True, False, "not captured"), 0),
]  # fmt: skip


@pytest.mark.parametrize(("name", "req", "backend_result", "expected", "restarts"), OPS,
                         ids=[o[0] for o in OPS])  # fmt: skip
def test_op_runner(tmp_path: Path, name, req, backend_result, expected, restarts):  # type: ignore[no-untyped-def]
    backend = Backend(backend_result or (True, False, "restarted"))
    runner = OpRunner(SystemClock(), tmp_path, {"vllm": backend})
    runner.start(req)
    (r,) = take(runner)
    ok, terminal, words = expected
    assert (r.ok, r.terminal, r.op, r.action_id) == (ok, terminal, req.op, 1)
    assert words in r.detail
    assert backend.calls == restarts
    if req.op is Op.WRITE_FLAGS and ok:
        assert "--max-num-seqs 48" in flagsfile.path_for(tmp_path, "vllm").read_text()


def test_op_runner_without_a_backend_is_terminal(tmp_path: Path):
    runner = OpRunner(SystemClock(), tmp_path, {})
    runner.start(op(Op.RESTART))
    (r,) = take(runner)
    assert not r.ok and r.terminal and "no restart backend" in r.detail


def test_op_runner_turns_a_crashing_call_into_a_result(tmp_path: Path):
    class Broken:
        def restart(self, timeout_seconds: float, drain: bool = True):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    runner = OpRunner(SystemClock(), tmp_path, {"vllm": Broken()})
    runner.start(op(Op.RESTART))
    (r,) = take(runner)
    assert not r.ok and "internal error: RuntimeError: boom" in r.detail


# --- persisted policy state ------------------------------------------------------------------


def test_policy_state_round_trip_and_corrupt_file_set_aside(tmp_path: Path):
    path = tmp_path / "policy-state.json"
    state = PolicyState(
        (
            ServiceState(
                "vllm",
                levels=Levels(rungs=((Lever.MAX_NUM_SEQS, 2),)),
                breaker_latched=True,
                breaker_reason="budget",
                restarts=(1.0, 2.0),
            ),
        ),
        7,
    )
    save_state(path, state)
    assert load_state(path) == state
    path.write_text("{not json")
    assert load_state(path) is None
    assert (tmp_path / "policy-state.json.corrupt").read_text() == "{not json"
    assert not path.exists()


def test_a_state_saved_with_flat_levels_keeps_its_rungs_flags_and_hold_off(tmp_path: Path):
    """The rungs, pins, operator flags and baseline, the cooldown and the backoff were flat
    fields of a service's state before they were grouped (ServiceState.levels, .hold_off); an
    upgrade reads them into the groups: the flags vLLM runs with, and the time the next action
    waits, are not forgotten."""
    path = tmp_path / "policy-state.json"
    old = {
        "format": 1,
        "state": {
            "services": [
                {
                    "service": "vllm",
                    "rungs": [["max_num_seqs", 2]],
                    "last_step_up": [["max_num_seqs", 5.0]],
                    "pinned_until": [["max_num_seqs", 9.0]],
                    "operator_flags": [["--max-model-len", "4096"]],
                    "restarts": [1.0],
                    "cooldown_until": 40.0,
                    "backoff_until": 30.0,
                    "backoff_seconds": 20.0,
                    "backoff_voluntary_only": True,
                }
            ],
            "next_action_id": 3,
        },
    }
    path.write_text(json.dumps(old))
    state = load_state(path)
    assert state is not None
    s = state.service("vllm")
    assert s.levels == Levels(
        rungs=((Lever.MAX_NUM_SEQS, 2),),
        last_step_up=((Lever.MAX_NUM_SEQS, 5.0),),
        pinned_until=((Lever.MAX_NUM_SEQS, 9.0),),
        operator_flags=(("--max-model-len", "4096"),),
    )
    assert s.restarts == (1.0,)
    assert s.hold_off == HoldOff(40.0, 30.0, 20.0, backoff_voluntary_only=True)


def _grouped_state() -> PolicyState:
    return PolicyState(
        (
            ServiceState(
                "vllm",
                levels=Levels(rungs=((Lever.MAX_NUM_SEQS, 2),)),
                hold_off=HoldOff(130.0),
                restarts=(1.0,),
            ),
        ),
        4,
    )


def test_a_state_is_saved_in_a_format_an_older_guardian_refuses(tmp_path: Path):
    """Format 1 files were first flat, then grouped (levels, hold-off, front door) under the
    same number: a guardian that knew only the flat fields read a grouped file and dropped
    its rungs and cooldown without a word. Saved now as format 2, which such a guardian sets
    aside instead (an unknown format), starting fresh, as for any file it cannot read."""
    from vllm_guardian.shell.statefile import STATE_FORMAT

    path = tmp_path / "policy-state.json"
    save_state(path, _grouped_state())
    assert STATE_FORMAT == 2
    assert json.loads(path.read_text())["format"] == 2
    assert load_state(path) == _grouped_state()


def test_a_grouped_state_saved_as_format_1_is_read(tmp_path: Path):
    """What guardians between the grouping and format 2 saved: grouped fields, format 1."""
    path = tmp_path / "policy-state.json"
    save_state(path, _grouped_state())
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "format": 1}))
    assert load_state(path) == _grouped_state()


@pytest.mark.parametrize("future", [3, 17])
def test_a_newer_format_is_set_aside_named_and_not_overwritten(
    tmp_path: Path, future: int, caplog: pytest.LogCaptureFixture
):
    """A state from a newer guardian (a downgrade): never read as if it were ours, never
    overwritten by the next save; set aside whole, as a corrupt file is, with a warning that
    names the file, its format and the formats this guardian reads; a fresh state goes on."""
    path = tmp_path / "policy-state.json"
    body = json.dumps({"format": future, "state": {"services": [], "next_action_id": 9}})
    path.write_text(body)
    assert load_state(path) is None
    aside = tmp_path / "policy-state.json.corrupt"
    assert aside.read_text() == body
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    print(warning)
    assert str(path) in warning and str(aside) in warning, warning
    assert f"format {future}" in warning and "formats 1 to 2" in warning, warning
    assert "newer vllm-guardian" in warning and "starting fresh" in warning, warning
    save_state(path, _grouped_state())  # the next tick's save
    assert aside.read_text() == body
    assert load_state(path) == _grouped_state()


def test_status_reads_the_rungs_from_the_policy_state_the_daemon_sends():
    """`vllm-guardian status` renders the policy state as the control socket sends it
    (to_jsonable): the rungs are under the service's levels, the cooldown under its hold-off."""
    from vllm_guardian.formats.recorder import to_jsonable
    from vllm_guardian.tools.cli import render_status

    levels = Levels(rungs=((Lever.MAX_NUM_SEQS, 2),))
    state = PolicyState((ServiceState("vllm", levels=levels, hold_off=HoldOff(130.0)),))
    reply = {"version": "x", "time": 100.0, "signals": {"services": [{"service": "vllm"}]}}
    text = render_status({**reply, "policy": to_jsonable(state)})
    print(text)
    assert "max_num_seqs rung 2" in text
    assert "cooldown 30s" in text
    fresh = PolicyState((ServiceState("vllm"),))
    assert "flags: operator baseline" in render_status({**reply, "policy": to_jsonable(fresh)})


def test_a_state_saved_before_log_items_keeps_its_breaker(tmp_path: Path):
    """Log evidence was saved as plain tuples (`pending`); an upgrade reads the rest of that
    state (a latched breaker stays latched) and drops those items: nothing agreed with them."""
    from vllm_guardian.core.policy import LogItem

    path = tmp_path / "policy-state.json"
    old = {
        "format": 1,
        "state": {
            "services": [
                {
                    "service": "vllm",
                    "breaker_latched": True,
                    "breaker_reason": "GPU hardware fault",
                    "pending": [["prefill_burst", "log:cuda_oom", "CUDA OOM", 12.0]],
                }
            ],
            "next_action_id": 3,
        },
    }
    path.write_text(json.dumps(old))
    state = load_state(path)
    assert state is not None and state.service("vllm").breaker_latched
    assert state.service("vllm").log_items == ()
    item = LogItem(Cause.PREFILL_BURST, "log:cuda_oom", "CUDA OOM", 12.0, ("health:engine_dead",))
    new = PolicyState((ServiceState("vllm", log_items=(item,), structural_at=12.0),), 3)
    save_state(path, new)
    assert load_state(path) == new


def test_concurrent_saves_leave_a_readable_file(tmp_path: Path):
    path = tmp_path / "s.json"
    states = [PolicyState((ServiceState("vllm", restarts=(float(i),)),), i) for i in range(50)]
    threads = [threading.Thread(target=save_state, args=(path, s)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert load_state(path) in states
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    assert os.path.getsize(path) > 0


# Shapes of a corrupt policy-state file; each is set aside, start-up goes on.
CORRUPT_STATES = [
    ("deep-list", lambda p: p.write_text("[" * 200_000 + "]" * 200_000)),
    ("deep-state", lambda p: p.write_text('{"format": 1, "state": ' + '{"a":' * 100_000 + "1" + "}" * 100_001)),
    ("not-utf8", lambda p: p.write_bytes(b'{"format": 1, "state": "\xff"}')),
    ("a-list", lambda p: p.write_text("[1, 2]")),
    ("wrong-format", lambda p: p.write_text('{"format": 99, "state": {}}')),
    ("format-zero", lambda p: p.write_text('{"format": 0, "state": {}}')),
    ("format-true", lambda p: p.write_text('{"format": true, "state": {}}')),
    ("format-text", lambda p: p.write_text('{"format": "2", "state": {}}')),
    ("wrong-shape", lambda p: p.write_text('{"format": 1, "state": {"services": 5}}')),
    ("huge", lambda p: p.write_bytes(b" " * (17 * 1024 * 1024) + b"{}")),
    ("directory", lambda p: p.mkdir()),
]  # fmt: skip


@pytest.mark.parametrize("make", [m for _, m in CORRUPT_STATES], ids=[n for n, _ in CORRUPT_STATES])
def test_a_corrupt_policy_state_is_set_aside_not_fatal(tmp_path: Path, make, caplog):
    from vllm_guardian.shell.statefile import load_state as load

    path = tmp_path / "policy-state.json"
    make(path)
    assert load(path) is None
    assert not path.exists()
    assert (tmp_path / "policy-state.json.corrupt").exists()
    assert "set aside" in caplog.text


# --- the process backend hands vLLM the allocator plugin's directory ----------------------------


@pytest.mark.parametrize(
    ("allocator", "expected"),
    [
        # The plugin inside vLLM writes where the guardian's allocator source reads: one
        # directory per service below sources.allocator.directory, as the systemd drop-in does.
        ({"directory": "{tmp}/alloc"}, "{tmp}/alloc/vllm"),
        # The source is off: vLLM is not told to publish anything.
        ({"enabled": False, "directory": "{tmp}/alloc"}, None),
    ],
)
def test_process_backend_passes_the_allocator_directory(
    tmp_path: Path, allocator: dict[str, object], expected: str | None
) -> None:
    from vllm_guardian.config import parse_config
    from vllm_guardian.formats.allocator_format import ENV_DIR
    from vllm_guardian.shell.healing import Healing

    allocator = {
        k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in allocator.items()
    }
    text = json.dumps(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime_dir": str(tmp_path / "run"),
            "services": [
                {
                    "name": "vllm",
                    "url": "http://127.0.0.1:1",
                    "command": [sys.executable, "-c", "0"],
                }
            ],
            "sources": {"allocator": allocator},
            "policy": {"backend": "process"},
        }
    )
    healing = Healing(parse_config(text, "test.yaml"), SystemClock())
    try:
        _, env = healing.supervisors["vllm"].argv_and_env()
        want = None if expected is None else expected.format(tmp=tmp_path)
        assert env.get(ENV_DIR) == want
        if want is not None:
            assert Path(want).is_dir(), "the directory exists before vLLM starts"
    finally:
        healing.close()
