"""The phases of a restart or relaunch (core/phases.py), as a specification on virtual time.

Each case is a list of ticks: what the tick shows (requests in flight, health, pids, the
calls' results) and the phase the action must be in after it, or how it ended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core import phases, policy
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import (
    ActionKind,
    Cause,
    GateObservation,
    HealthState,
    Op,
    OpResult,
    ServiceSnapshot,
    Snapshot,
)

P = PolicyConfig(
    drain_timeout_seconds=30,
    vram_release_timeout_seconds=20,
    ready_timeout_seconds=100,
    bundle_timeout_seconds=10,
)


@dataclass(frozen=True)
class T:
    """One tick: time, what it shows, the calls that finished, and what must follow."""

    t: float
    in_flight: float | None = 0.0
    up: bool | None = True
    listening: bool | None = True
    pid: int | None = 10
    gpu_pids: frozenset[int] | None = frozenset({10})
    done: tuple[tuple[Op, bool, bool], ...] = ()  # (call, ok, terminal)
    expect: Phase | str = ""  # the phase after the tick, or "ok"/"failed"/"terminal"
    stalled: bool = False  # requests in the engine and not a token processed
    dead: bool = False  # /health 503
    words: str = ""  # in the outcome's detail or the last move's reason
    finished: float | None = None  # when the calls finished (default: just before the scrape)
    started: float | None = None  # when vLLM's main process started (None: unknown)


def seen(x: T) -> phases.Seen:
    return phases.Seen(
        x.t, x.in_flight, "gate", x.up, x.listening, x.pid, x.gpu_pids, True, x.stalled, x.dead,
        main_started_seconds=x.started,
    )  # fmt: skip


BUNDLE_OK = ((Op.BUNDLE, True, False),)
PREPARED = ((Op.WRITE_FLAGS, True, False), (Op.BUNDLE, True, False))
RESTARTED = ((Op.RESTART, True, False),)

CASES = [
    ("restart: drain, restart, VRAM freed, ready", ActionKind.RESTART, [
        T(1, in_flight=3, done=BUNDLE_OK, expect=Phase.DRAINING),
        T(2, in_flight=1, expect=Phase.DRAINING),
        T(3, in_flight=0, expect=Phase.RESTARTING),
        T(9, pid=11, gpu_pids=frozenset({10, 11}), done=RESTARTED, expect=Phase.AWAITING_VRAM),
        T(10, pid=11, gpu_pids=frozenset({11}), up=False, expect=Phase.AWAITING_READY),
        T(40, pid=11, gpu_pids=frozenset({11}), expect="ok", words="drained in 2s"),
    ]),
    ("relaunch waits for the flags file before anything else", ActionKind.RELAUNCH, [
        T(1, done=BUNDLE_OK, expect=Phase.PREPARING),
        T(2, done=((Op.WRITE_FLAGS, True, False),), expect=Phase.RESTARTING),
        T(3, pid=11, gpu_pids=frozenset(), done=RESTARTED, expect="ok", words="flags"),
    ]),
    ("rejected flags: terminal, nothing restarted", ActionKind.RELAUNCH, [
        T(1, done=((Op.WRITE_FLAGS, False, True),), expect="terminal", words="nothing restarted"),
    ]),
    ("a late bundle does not hold the action", ActionKind.RESTART, [
        T(5, expect=Phase.PREPARING),
        T(21, expect=Phase.RESTARTING, words="front door closed"),
    ]),
    ("a hung engine is not drained: nothing in it can finish", ActionKind.RESTART, [
        T(1, in_flight=7, stalled=True, done=BUNDLE_OK, expect=Phase.RESTARTING,
          words="hung"),
    ]),
    ("a dead engine (503) is not drained either", ActionKind.RESTART, [
        T(1, in_flight=7, up=False, dead=True, done=BUNDLE_OK, expect=Phase.RESTARTING,
          words="not serving"),
    ]),
    ("a /health that times out under load is not a dead engine: drain", ActionKind.RESTART, [
        T(1, in_flight=7, up=False, done=BUNDLE_OK, expect=Phase.DRAINING),
    ]),
    ("drain deadline: restart anyway, say how many were cut", ActionKind.RESTART, [
        T(1, in_flight=5, done=BUNDLE_OK, expect=Phase.DRAINING),
        T(32, in_flight=4, expect=Phase.RESTARTING, words="4 in flight"),
    ]),
    ("unknown in-flight (no gauge, no gate) is nothing to wait for", ActionKind.RESTART, [
        T(1, in_flight=None, done=BUNDLE_OK, expect=Phase.RESTARTING),
    ]),
    ("a failed restart call ends the action", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        T(5, done=((Op.RESTART, False, False),), expect="failed"),
    ]),
    ("a restart call that never returns is lost", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        T(1 + 30 + 100 + 61, expect="failed", words="did not return"),
    ]),
    ("the old instance keeps its GPU memory", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        T(2, pid=11, done=RESTARTED, expect=Phase.AWAITING_VRAM),
        T(23, pid=11, gpu_pids=frozenset({10, 11}), expect="failed", words="pid 10"),
    ]),
    ("GPU processes not visible: not waited on", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        T(2, pid=11, gpu_pids=None, up=False, done=RESTARTED, expect=Phase.AWAITING_READY),
    ]),
    ("never ready: failed at the deadline", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        T(2, pid=11, gpu_pids=frozenset(), up=False, done=RESTARTED,
          expect=Phase.AWAITING_READY),
        T(50, pid=11, up=False, expect=Phase.AWAITING_READY),
        T(103, pid=11, up=False, expect="failed", words="not ready within 100s"),
    ]),
    ("a scrape from before the restart returned is not readiness", ActionKind.RESTART, [
        T(1, done=BUNDLE_OK, expect=Phase.RESTARTING),
        # The call finished at t=4 (after this tick's scrape at t=3): not ready yet.
        T(3, pid=11, gpu_pids=None, done=RESTARTED, finished=4, expect=Phase.AWAITING_READY),
        T(5, pid=11, gpu_pids=None, expect="ok"),
    ]),
    ("vLLM exited: its supervisor restarts it, no second restart", ActionKind.RELAUNCH, [
        T(1, up=False, listening=False, done=PREPARED, expect=Phase.AWAITING_SELF_RESTART),
        T(4, up=False, listening=False, pid=11, expect=Phase.AWAITING_READY),
        T(30, pid=11, expect="ok", words="restarted on its own"),
    ]),
    # The flags file is written at t=0.5 (a call's result finishes just before its tick).
    ("vLLM exited: restarted by its supervisor after the flags were written, no second restart",
     ActionKind.RELAUNCH, [
        T(1, up=False, listening=False, pid=None, done=PREPARED,
          expect=Phase.AWAITING_SELF_RESTART),
        T(4, up=False, listening=False, pid=11, started=2.0, expect=Phase.AWAITING_READY),
        T(30, pid=11, started=2.0, expect="ok", words="restarted on its own"),
    ]),
    # A real vLLM 0.32 under the process manager: the API server exits a second after its
    # engine dies and is started again a second later, before the guardian's next tick writes
    # the relaunch's flags; the action began with that new pid, which never changes again.
    ("vLLM restarted by its supervisor before the flags were written: restarted with them",
     ActionKind.RELAUNCH, [
        T(1, up=False, listening=False, pid=10, started=0.2, done=PREPARED,
          expect=Phase.RESTARTING, words="before the new flags"),
    ]),
    ("...also when it is up again by the time the flags are written", ActionKind.RELAUNCH, [
        T(1, up=False, listening=False, pid=None, done=PREPARED,
          expect=Phase.AWAITING_SELF_RESTART),
        T(4, up=True, listening=True, in_flight=0, pid=11, started=0.3,
          expect=Phase.RESTARTING, words="before the new flags"),
    ]),
    ("a plain restart takes its supervisor's restart whenever it came", ActionKind.RESTART, [
        T(1, up=False, listening=False, pid=10, started=-100, done=BUNDLE_OK,
          expect=Phase.AWAITING_SELF_RESTART),
        T(4, up=False, listening=False, pid=11, started=0.3, expect=Phase.AWAITING_READY),
    ]),
    ("vLLM exited and nobody restarts it (exit 0 under on-failure)", ActionKind.RESTART, [
        T(1, up=False, listening=False, done=BUNDLE_OK, expect=Phase.AWAITING_SELF_RESTART),
        T(22, up=False, listening=False, in_flight=None, expect=Phase.RESTARTING),
    ]),
    ("a hung engine that still answers 503 is restarted by us at once", ActionKind.RESTART, [
        T(1, up=False, listening=True, in_flight=None, done=BUNDLE_OK, expect=Phase.RESTARTING),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kind", "ticks"), CASES, ids=[c[0] for c in CASES])
def test_phases(name: str, kind: ActionKind, ticks: list[T]) -> None:
    flags = (("--max-num-seqs", "48"),) if kind is ActionKind.RELAUNCH else ()
    progress, ops = phases.start(1, "vllm", kind, Cause.ENGINE_DEAD, "test", flags, (), 10, 0.0, P)
    asked = {o.op for o in ops}
    assert asked == ({Op.BUNDLE, Op.WRITE_FLAGS} if kind is ActionKind.RELAUNCH else {Op.BUNDLE})
    a: phases.ActionProgress | None = progress
    for x in ticks:
        assert a is not None, f"{name}: the action ended before t={x.t}"
        results = [OpResult(1, "vllm", o, ok, term, "call detail",
                            x.t - 0.5 if x.finished is None else x.finished)
                   for o, ok, term in x.done]  # fmt: skip
        adv = phases.advance(a, "vllm", seen(x), results, x.t, P)
        asked |= {o.op for o in adv.ops}
        if isinstance(x.expect, Phase):
            assert adv.outcome is None, f"t={x.t}: ended early: {adv.outcome}"
            assert adv.progress is not None and adv.progress.phase is x.expect, (
                f"t={x.t}: in {adv.progress.phase if adv.progress else None}, moves {adv.moves}"
            )
            if x.words:
                assert any(x.words in m.why for m in adv.moves) or any(
                    x.words in n for n in adv.progress.notes
                ), (adv.moves, adv.progress.notes)
        else:
            assert adv.outcome is not None, f"t={x.t}: still {adv.progress}"
            want = {"ok": (True, False), "failed": (False, False), "terminal": (False, True)}
            assert (adv.outcome.ok, adv.outcome.terminal) == want[x.expect], adv.outcome
            assert x.words in adv.outcome.detail, adv.outcome.detail
        a = adv.progress
    if "no second restart" in name or "nothing restarted" in name or "whenever" in name:
        assert Op.RESTART not in asked


@pytest.mark.parametrize(
    ("tick", "drain"),
    [
        (T(1, in_flight=7, stalled=True, done=BUNDLE_OK), False),
        (T(1, in_flight=7, up=False, dead=True, done=BUNDLE_OK), False),
        (T(1, in_flight=0, done=BUNDLE_OK), True),
    ],
    ids=["hung", "dead", "drained"],
)
def test_a_restart_with_nothing_in_flight_to_finish_asks_no_drain_of_the_stop(
    tick: T, drain: bool
) -> None:
    """The restart call says whether its stop drains: a hung or dead engine finishes nothing,
    so the process manager waits only for vLLM's exit (actuators/procmgr.py), not the drain."""
    progress, _ = phases.start(1, "vllm", ActionKind.RESTART, Cause.ENGINE_DEAD, "test", (), (),
                               10, 0.0, P)  # fmt: skip
    results = [OpResult(1, "vllm", o, ok, term, "call detail", tick.t - 0.5)
               for o, ok, term in tick.done]  # fmt: skip
    adv = phases.advance(progress, "vllm", seen(tick), results, tick.t, P)
    (restart,) = [o for o in adv.ops if o.op is Op.RESTART]
    assert restart.drain is drain


def test_every_phase_change_is_a_move_with_a_reason() -> None:
    a, _ = phases.start(1, "vllm", ActionKind.RESTART, None, "r", (), (), 10, 0.0, P)
    adv = phases.advance(a, "vllm", seen(T(1, in_flight=0)), [
        OpResult(1, "vllm", Op.BUNDLE, True, False, "/b", 1.0)], 1.0, P)  # fmt: skip
    assert [m.phase for m in adv.moves] == [Phase.DRAINING, Phase.RESTARTING]
    assert all(m.why for m in adv.moves)
    assert [o.op for o in adv.ops] == [Op.RESTART]


ORPHANS = [
    # the phase the guardian died in → the phase after the first tick of the new guardian
    (Phase.PREPARING, Phase.PREPARING, {Op.BUNDLE}),
    (Phase.DRAINING, Phase.RESTARTING, {Op.RESTART}),
    (Phase.RESTARTING, Phase.AWAITING_READY, set()),
    (Phase.AWAITING_READY, Phase.AWAITING_READY, set()),
]


@pytest.mark.parametrize(("died_in", "then", "ops"), ORPHANS, ids=[o[0].value for o in ORPHANS])
def test_a_guardian_restarted_mid_action_finds_it_again(
    died_in: Phase, then: Phase, ops: set[Op]
) -> None:
    a, _ = phases.start(7, "vllm", ActionKind.RESTART, None, "r", (), (), 10, 0.0, P)
    a = replace(a, phase=died_in, deadline=1000.0, waiting_ops=(Op.RESTART,), orphaned=True)
    # vLLM is up but not yet serving a fresh scrape: nothing may end the action at once.
    adv = phases.advance(a, "vllm", seen(T(50, in_flight=0, up=False)), [], 50.0, P)
    assert adv.outcome is None and adv.progress is not None
    assert adv.progress.phase is then and not adv.progress.orphaned
    assert {o.op for o in adv.ops} == ops
    assert adv.moves and "guardian restarted" in adv.moves[0].why


SEEN = [
    # the gate's observation, vLLM's running + waiting → what the drain waits on, and whose count
    (GateObservation(True, in_flight=3, queued=9), 0.0, (3.0, "gate")),
    (GateObservation(True, in_flight=0, queued=9), 5.0, (0.0, "gate")),  # queued ≠ in flight
    (GateObservation(False, error="connection refused"), 4.0,
     (4.0, "vllm (the gate did not answer)")),
    (None, 4.0, (4.0, "vllm")),  # no gate configured
    (None, None, (None, "")),  # nothing to count: nothing to wait for
]  # fmt: skip


@pytest.mark.parametrize(("gate", "vllm", "expected"), SEEN)
def test_the_drain_counts_what_the_front_door_has_in_flight(
    gate: GateObservation | None, vllm: float | None, expected: tuple[float | None, str]
) -> None:
    snap = Snapshot(50.0, (ServiceSnapshot("vllm", gate=gate),), None)
    sig = ServiceSignals("vllm", HealthState.UP, True, True, True, requests_running=vllm)
    s = policy.seen(snap, sig, "vllm")
    assert (s.in_flight, s.in_flight_from) == expected


def test_the_action_remembers_when_the_guardian_took_vllm_down() -> None:
    """``stopped_seconds`` (what core/inhibition.py opens its window from) is set when the
    restart call starts, kept through the phases after it; a restart by vLLM's own supervisor
    after a crash leaves it unset (that outage is not the guardian's doing)."""
    a, _ = phases.start(1, "vllm", ActionKind.RESTART, None, "r", (), (), 10, 0.0, P)
    assert a.stopped_seconds is None
    adv = phases.advance(a, "vllm", seen(T(1, in_flight=0)), [
        OpResult(1, "vllm", Op.BUNDLE, True, False, "/b", 1.0)], 1.0, P)  # fmt: skip
    assert adv.progress is not None and adv.progress.phase is Phase.RESTARTING
    assert adv.progress.stopped_seconds == 1.0
    adv = phases.advance(adv.progress, "vllm", seen(T(5, up=False, listening=False, pid=None,
                         gpu_pids=frozenset())), [
        OpResult(1, "vllm", Op.RESTART, True, False, "restarted", 4.0)], 5.0, P)  # fmt: skip
    assert adv.progress is not None and adv.progress.phase is Phase.AWAITING_READY
    assert adv.progress.stopped_seconds == 1.0
    # vLLM died by itself while preparing; its supervisor started it again.
    b, _ = phases.start(2, "vllm", ActionKind.RESTART, None, "r", (), (), 10, 0.0, P)
    bundle = [OpResult(2, "vllm", Op.BUNDLE, True, False, "/b", 1.0)]
    adv = phases.advance(b, "vllm", seen(T(1, up=False, listening=False, pid=None)), bundle, 1.0, P)
    assert adv.progress is not None and adv.progress.phase is Phase.AWAITING_SELF_RESTART
    adv = phases.advance(adv.progress, "vllm", seen(T(3, up=False, pid=11)), [], 3.0, P)
    assert adv.progress is not None and adv.progress.phase is Phase.AWAITING_READY
    assert adv.progress.stopped_seconds is None
