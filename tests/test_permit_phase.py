"""Waiting for a fleet permit as the first phase of a voluntary action (core/phases.py, policy).

On virtual time: the action asks for a permit (Op.PERMIT), is refused "not now" (audited once
per reason, asked again after PERMIT_RETRY_SECONDS), is granted and goes on as any action does,
or gives up at its deadline having restarted nothing. A granted permit is released whatever way
the action ends (Op.RELEASE_PERMIT). In the policy, only voluntary actions wait, and the front
door stays open while they do.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core import phases
from vllm_guardian.core.phases import PERMIT_RETRY_SECONDS, Advance, Phase
from vllm_guardian.core.policy import DecisionKind
from vllm_guardian.model import ActionKind, Cause, Op, OpResult

P = PolicyConfig(
    drain_timeout_seconds=30,
    vram_release_timeout_seconds=20,
    ready_timeout_seconds=100,
    bundle_timeout_seconds=10,
)
WAIT = 300.0


def seen(t: float, pid: int = 10, up: bool = True) -> phases.Seen:
    return phases.Seen(t, 0.0, "gate", up, True, pid, frozenset({pid}), True)


def result(op: Op, ok: bool, detail: str, t: float, terminal: bool = False) -> OpResult:
    return OpResult(1, "vllm", op, ok, terminal, detail, t)


def begin(kind: ActionKind = ActionKind.RELAUNCH) -> phases.ActionProgress:
    a, ops = phases.start(
        1, "vllm", kind, Cause.KV_CACHE_BLOWOUT, "stable: step up",
        (("--max-num-seqs", "192"),), (), 10, 0.0, P, None, WAIT,
    )  # fmt: skip
    assert a.phase is Phase.AWAITING_PERMIT and a.deadline == WAIT
    assert [o.op for o in ops] == [Op.PERMIT], "nothing else before the permit"
    return a


def tick(a: phases.ActionProgress, t: float, *results: OpResult, pid: int = 10) -> Advance:
    return phases.advance(a, "vllm", seen(t, pid), list(results), t, P)


def test_granted_then_prepares_and_releases_at_the_end() -> None:
    a = begin()
    adv = tick(a, 2, result(Op.PERMIT, True, "pod-a: vllm-guardian-llama-0 is free", 1.5))
    assert adv.progress is not None and adv.progress.phase is Phase.PREPARING
    assert adv.progress.permit_held
    assert {o.op for o in adv.ops} == {Op.WRITE_FLAGS, Op.BUNDLE}
    assert "fleet permit granted" in adv.moves[0].why
    a = adv.progress
    adv = tick(a, 3, result(Op.WRITE_FLAGS, True, "ok", 2.5), result(Op.BUNDLE, True, "/b", 2.5))
    assert adv.progress is not None and adv.progress.phase is Phase.RESTARTING
    a = adv.progress
    adv = tick(a, 9, result(Op.RESTART, True, "restarted", 8.5), pid=11)
    assert adv.outcome is not None and adv.outcome.ok
    assert [o.op for o in adv.ops] == [Op.RELEASE_PERMIT]
    assert "fleet permit after 2s" in adv.outcome.detail


def test_not_now_is_audited_once_per_reason_and_asked_again() -> None:
    a = begin()
    busy = "pod-a: all 1 permits held: vllm-guardian-llama-0 by pod-b for 800s more"
    adv = tick(a, 1, result(Op.PERMIT, False, busy, 0.5))
    assert adv.progress is not None and adv.progress.phase is Phase.AWAITING_PERMIT
    assert [m.why for m in adv.moves] == [f"no fleet permit yet: {busy}"]
    assert adv.ops == () and adv.outcome is None
    a = adv.progress
    adv = tick(a, 1 + PERMIT_RETRY_SECONDS - 1)
    assert adv.ops == (), "not before the retry"
    assert adv.progress is not None
    adv = tick(adv.progress, 1 + PERMIT_RETRY_SECONDS)
    assert [o.op for o in adv.ops] == [Op.PERMIT]
    assert adv.progress is not None
    adv = tick(adv.progress, 17, result(Op.PERMIT, False, busy, 16.5))
    assert adv.moves == (), "the same reason again: not audited again"
    assert adv.progress is not None
    drain = "pod-a: the PDB allows no disruption now (disruptionsAllowed 0)"
    adv = tick(replace(adv.progress, permit_retry_at=0), 33, result(Op.PERMIT, False, drain, 32))
    assert [m.why for m in adv.moves] == [f"no fleet permit yet: {drain}"]


@pytest.mark.parametrize(
    ("last", "terminal", "words"),
    [
        (None, False, "no fleet permit within 300s; nothing restarted (last: no answer)"),
        ("held by pod-b", False, "(last: held by pod-b)"),
    ],
)
def test_the_wait_ends_at_its_deadline_having_restarted_nothing(
    last: str | None, terminal: bool, words: str
) -> None:
    a = begin()
    adv = tick(a, 1, result(Op.PERMIT, False, last, 0.5)) if last else tick(a, 1, result(Op.PERMIT, False, "", 0.5))  # fmt: skip
    assert adv.progress is not None
    a = adv.progress if last else replace(adv.progress, permit_reason="")
    adv = tick(replace(a, waiting_ops=()), WAIT)
    assert adv.outcome is not None and not adv.outcome.ok and not adv.outcome.terminal
    assert words in adv.outcome.detail
    assert adv.ops == (), "nothing held, nothing to release"


def test_a_terminal_refusal_ends_it() -> None:
    adv = tick(begin(), 1, result(Op.PERMIT, False, "no fleet permit backend", 0.5, terminal=True))
    assert adv.outcome is not None and adv.outcome.terminal
    assert "no fleet permit: no fleet permit backend" in adv.outcome.detail


def test_a_failure_after_the_grant_still_releases() -> None:
    a = begin()
    adv = tick(a, 1, result(Op.PERMIT, True, "granted", 0.5))
    assert adv.progress is not None
    adv = tick(adv.progress, 2, result(Op.WRITE_FLAGS, False, "flags rejected", 1.5, terminal=True))
    assert adv.outcome is not None and not adv.outcome.ok
    assert [o.op for o in adv.ops] == [Op.RELEASE_PERMIT]


def test_a_guardian_restarted_while_waiting_asks_again() -> None:
    a = replace(begin(), orphaned=True, permit_retry_at=1000.0)
    adv = tick(a, 50)
    assert adv.progress is not None and adv.progress.phase is Phase.AWAITING_PERMIT
    assert [o.op for o in adv.ops] == [Op.PERMIT]
    assert "asking again" in adv.moves[0].why


def test_without_a_permit_timeout_nothing_waits() -> None:
    a, ops = phases.start(1, "vllm", ActionKind.RESTART, None, "r", (), (), 10, 0.0, P)
    assert a.phase is Phase.PREPARING and Op.PERMIT not in {o.op for o in ops}


# --- in the policy: who waits, and the front door meanwhile ---------------------------------


@pytest.fixture
def permit_run(monkeypatch: pytest.MonkeyPatch) -> type:
    """tests/test_policy.py's Run, with fleet.permit: lease (300 s) and permits refused while
    ``refuse`` is set."""
    import functools

    from tests import test_policy
    from vllm_guardian.core.policy import PolicySettings

    monkeypatch.setattr(
        test_policy,
        "PolicySettings",
        functools.partial(PolicySettings, permit_timeout_seconds=WAIT),
    )

    class PermitRun(test_policy.Run):  # type: ignore[misc]
        refuse = False

        @property
        def ops(self) -> list:  # every call asked for, in order
            return self.__dict__.setdefault("_ops", [])

        def _step(self, row, results, logs_now):  # type: ignore[no-untyped-def]
            if self.refuse:
                results = tuple(
                    replace(r, ok=False, detail="all 1 permits held") if r.op is Op.PERMIT else r
                    for r in results
                )
            out = super()._step(row, results, logs_now)
            self.ops.extend(out.ops)
            return out

    return PermitRun


def test_a_step_up_waits_for_the_permit_with_the_front_door_open(permit_run: type) -> None:
    from tests.test_policy import DEAD, Row, oom
    from vllm_guardian.core.policy import Lever

    r = permit_run().run(Row(0, logs=(oom(6.0),), health=DEAD), Row(2))  # a crash: no permit
    assert [d.phase for d in r.decisions if d.phase is Phase.AWAITING_PERMIT] == []
    assert r.svc.rung(Lever.MAX_NUM_BATCHED_TOKENS) == 1
    r.refuse = True
    r.run(Row(500), Row(1002))  # stable: a step up is due, voluntary
    assert r.svc.action is not None and r.svc.action.phase is Phase.AWAITING_PERMIT
    assert r.svc.front_door.open, "the front door stays open while waiting for a permit"
    step_up = r.svc.action.action_id
    waiting = [d for d in r.decisions if d.phase is Phase.AWAITING_PERMIT]
    # Entered, then a try refused: both on record, the refusal with the cluster's answer.
    assert [d.action_id for d in waiting] == [step_up, step_up], waiting
    assert "all 1 permits held" in waiting[-1].reason, "a person reads why not"
    r.refuse = False
    r.run(Row(1002 + PERMIT_RETRY_SECONDS), Row(1020))
    assert r.svc.action is None and r.svc.rung(Lever.MAX_NUM_BATCHED_TOKENS) == 0
    # Granted: the action moved on from waiting to preparing, and ended well.
    moves = [(d.what, d.phase, d.ok) for d in r.decisions if d.action_id == step_up]
    assert (DecisionKind.PHASE, Phase.PREPARING, None) in moves, moves
    assert moves[-1] == (DecisionKind.RESULT, None, True), moves


# --- a crash while waiting: the replica is already down, no permit is needed -----------------

CRASH_WHILE_WAITING = [
    # name, the row that shows the crash
    ("an OOM and a dead engine", {"logs": ("oom",), "health": "dead"}),
    ("a dead engine (the alert)", {"alerts": ("EngineDead",), "health": "dead"}),
    ("the unit exited, nobody restarts it", {"unit_state": "failed", "health": "refused"}),
]


def _row(t: float, **kw):  # type: ignore[no-untyped-def]
    from tests.test_policy import DEAD, Row, oom
    from vllm_guardian.model import HealthState

    health = {"dead": DEAD, "refused": HealthState.REFUSED}.get(kw.pop("health", ""))
    logs = tuple(oom(6.0) for _ in kw.pop("logs", ()))
    return Row(t, logs=logs, **kw, **({"health": health} if health else {}))


def _waiting(permit_run: type):  # type: ignore[no-untyped-def]
    """A step up (voluntary) waiting for a permit that is refused, after a crash lowered a rung."""
    from tests.test_policy import DEAD, Row, oom

    r = permit_run().run(Row(0, logs=(oom(6.0),), health=DEAD), Row(2))
    r.refuse = True
    r.run(Row(500), Row(1002))
    assert r.svc.action is not None and r.svc.action.phase is Phase.AWAITING_PERMIT
    return r


@pytest.mark.parametrize(
    "crash", [c[1] for c in CRASH_WHILE_WAITING], ids=[c[0] for c in CRASH_WHILE_WAITING]
)
def test_a_crash_while_waiting_for_a_permit_ends_the_wait_and_acts_at_once(
    permit_run: type, crash: dict
) -> None:
    r = _waiting(permit_run)
    waiting = r.svc.action.action_id
    slots = len(r.svc.restarts)
    r.decisions.clear()
    r.ops.clear()
    r.tick(_row(1010, **dict(crash)))
    log = "\n".join(f"{d.what} {d.action_id} {d.phase}: {d.reason}" for d in r.decisions)
    ended = [d for d in r.decisions if d.what == "result" and d.action_id == waiting]
    assert [d.ok for d in ended] == [False], log
    assert r.svc.hold_off.backoff_until <= 1010, "no backoff: the crash is acted on now\n" + log
    assert r.svc.action is not None and r.svc.action.action_id != waiting, log
    assert r.svc.action.phase is not Phase.AWAITING_PERMIT, "a crash needs no permit\n" + log
    assert not r.svc.front_door.open, "the crash action holds the front door"
    assert (waiting, Op.RELEASE_PERMIT) in {(o.action_id, o.op) for o in r.ops}, (
        "whatever the wait may hold is given back\n" + log
    )
    assert Op.PERMIT not in {o.op for o in r.ops if o.action_id != waiting}
    assert len(r.svc.restarts) == slots, "the wait's budget slot is given back, the crash takes one"
    if "logs" in crash:  # the OOM steps down from the rung vLLM runs with, not the step up's
        from vllm_guardian.core.policy import Lever

        assert r.svc.rung(Lever.MAX_NUM_BATCHED_TOKENS) == 2, log


def test_pressure_while_waiting_does_not_end_the_wait(permit_run: type) -> None:
    r = _waiting(permit_run)
    waiting = r.svc.action.action_id
    r.run(_row(1010, alerts=("KvSaturated",), kv=0.99))
    assert r.svc.action is not None and r.svc.action.action_id == waiting
    assert r.svc.action.phase is Phase.AWAITING_PERMIT


def test_a_permit_wait_that_times_out_spends_no_budget_and_holds_no_crash(
    permit_run: type,
) -> None:
    r = _waiting(permit_run)
    waiting = r.svc.action.action_id
    slots = len(r.svc.restarts)
    t = 1002.0
    while r.svc.action is not None and t < 1002 + WAIT + 120:
        t += PERMIT_RETRY_SECONDS
        r.tick(_row(t))
    assert r.svc.action is None
    log = "\n".join(f"{d.what} {d.action_id} {d.phase}: {d.reason}" for d in r.decisions)
    ended = [(d.what, d.ok) for d in r.decisions if d.action_id == waiting and d.ok is not None]
    assert ended == [(DecisionKind.RESULT, False)], log
    assert len(r.svc.restarts) == slots - 1, "nothing was restarted: the slot is given back"
    from vllm_guardian.core.policy import Lever

    assert r.svc.rung(Lever.MAX_NUM_BATCHED_TOKENS) == 1, "vLLM still runs one rung down"
    assert r.svc.levels.last_step_up == (), "nothing stepped up"
    assert r.svc.hold_off.backoff_until > t, "a voluntary action backs off after a fruitless wait"
    r.tick(_row(t + 2, logs=("oom",), health="dead"))
    log = "\n".join(f"{d.what} {d.action_id} {d.phase}: {d.reason}" for d in r.decisions)
    assert r.svc.action is not None and r.svc.action.phase is not Phase.AWAITING_PERMIT, log


# --- an action longer than its Lease renews it ----------------------------------------------

RENEW = 100.0


def test_a_permit_held_is_renewed_while_the_action_lasts() -> None:
    def at(a: phases.ActionProgress, t: float, *results: OpResult) -> Advance:
        return phases.advance(a, "vllm", seen(t), list(results), t, P, RENEW)

    adv = at(begin(), 1, result(Op.PERMIT, True, "granted", 0.5))
    assert adv.progress is not None and adv.progress.permit_renew_at == 1 + RENEW
    # Stuck waiting for the restart call (it may take the drain and the ready timeouts).
    a = replace(adv.progress, phase=Phase.RESTARTING, waiting_ops=(Op.RESTART,), deadline=1e9)
    adv = at(a, RENEW)
    assert adv.ops == (), "not before it is due"
    assert adv.progress is not None
    adv = at(adv.progress, 1 + RENEW)
    assert [o.op for o in adv.ops] == [Op.PERMIT], "one try renews the Lease it holds"
    assert adv.progress is not None and adv.progress.permit_renew_at == 1 + 2 * RENEW
    adv = at(adv.progress, 1 + RENEW + 5)
    assert adv.ops == (), "one renewal at a time"
    assert adv.progress is not None
    adv = at(adv.progress, 1 + RENEW + 6, result(Op.PERMIT, True, "ours already", 1 + RENEW + 6))
    assert adv.moves == () and adv.progress is not None, "a renewal is not news"
    assert Op.PERMIT not in adv.progress.waiting_ops
    adv = at(adv.progress, 1 + 2 * RENEW)
    assert adv.progress is not None
    adv = at(adv.progress, 1 + 2 * RENEW + 1, result(Op.PERMIT, False, "API down", 2 * RENEW))
    assert [m.why for m in adv.moves] == ["fleet permit not renewed: API down"]
    assert adv.progress is not None and adv.progress.phase is Phase.RESTARTING, "it goes on"
    adv = at(adv.progress, 1 + 2 * RENEW + 2, result(Op.RESTART, False, "failed", 2 * RENEW))
    assert adv.outcome is not None and [o.op for o in adv.ops] == [Op.RELEASE_PERMIT]


def test_without_a_renewal_period_nothing_is_renewed() -> None:
    adv = tick(begin(), 1, result(Op.PERMIT, True, "granted", 0.5))
    assert adv.progress is not None and adv.progress.permit_renew_at is None
    adv = tick(replace(adv.progress, phase=Phase.RESTARTING, deadline=1e9), 1e6)
    assert Op.PERMIT not in {o.op for o in adv.ops}


def test_a_grant_nobody_waits_for_is_given_back(permit_run: type) -> None:
    """The try that was in flight when a crash superseded the wait comes back granted."""
    r = _waiting(permit_run)
    waiting = r.svc.action.action_id
    r.tick(_row(1010, logs=("oom",), health="dead"))
    assert r.svc.action is not None and r.svc.action.action_id != waiting
    r.ops.clear()
    r.refuse = False
    seen = len(r.decisions)
    late = OpResult(waiting, "vllm", Op.PERMIT, True, False, "vllm-guardian-llama-0 is free", 1011)
    r._step(_row(1012), (late,), ())
    assert (waiting, Op.RELEASE_PERMIT) in {(o.action_id, o.op) for o in r.ops}
    given_back = [d.phase for d in r.decisions[seen:] if d.action_id == waiting]
    assert given_back == [Phase.AWAITING_PERMIT], r.decisions[seen:]


@pytest.mark.parametrize(
    ("fleet", "renew"),
    [
        ("fleet:\n  permit: lease\n  model: llama\n  pdb: llama\n  lease_ttl_seconds: 90\n", 30.0),
        ("fleet:\n  permit: lease\n  model: llama\n  pdb: llama\n", 300.0),  # the 900 s default
        ("", None),  # no fleet permit: nothing to renew
    ],
    ids=["ttl 90 s", "default ttl", "no permit"],
)
def test_the_daemon_renews_every_third_of_the_lease_ttl(
    fleet: str, renew: float | None, tmp_path: object
) -> None:
    """The daemon and replay build their settings in one place (core/driver.py): a permit held
    is renewed every third of fleet.lease_ttl_seconds, so a renewal lost to a slow API server
    still leaves two before the Lease lapses mid-action (docs/reliability.md). Without this
    wiring the phase above never renews, and an action longer than its Lease loses its permit
    to another replica."""
    from vllm_guardian.config import parse_config
    from vllm_guardian.core.driver import settings_from_config

    cfg = parse_config(
        f"state_dir: {tmp_path}/state\nruntime_dir: {tmp_path}/run\n"
        "services:\n  - name: vllm\n    url: http://127.0.0.1:9\n" + fleet
    )
    assert settings_from_config(cfg, ()).policy.permit_renew_seconds == renew
