"""A disruptive action as a sequence of phases, advanced once per tick. Pure.

Where it sits: inside ``core/policy.decide``. A restart or relaunch takes minutes (drain, model
load); instead of a thread that blocks and polls, the service's policy state holds an
:class:`ActionProgress` and every tick :func:`advance` moves it on from what the snapshot shows
and from the results of the blocking calls it asked for. Only those calls are actuators
(``model.Op``: the incident bundle, the flags file, the restart itself); their results come
back as observations (``Snapshot.op_results``) on a later tick, never assumed. Each phase change
is a decision: audited, recorded in the flight record, and shown by ``replay`` at the tick it
happened. This is oomd's multi-tick action and controller-runtime's requeue.

The phases of one action (a voluntary one with ``fleet.permit: lease`` first waits in
AWAITING_PERMIT, front door open, for one of the fleet's permits; it is renewed while the action
lasts and released at the end; a crash while it waits supersedes the wait: :func:`supersede`)::

    PREPARING ──► (vLLM died) AWAITING_SELF_RESTART ──► (its supervisor restarted it) AWAITING_READY
        │                          │ (nobody restarted it)
        └──────► DRAINING ◄────────┘
                    │ zero in flight (the gate's count when it answers, else vLLM's running +
                    │ waiting), or the drain deadline
                    ▼
                 RESTARTING ──► AWAITING_VRAM ──► AWAITING_READY ──► done (ok)

The front door stays closed through all of them (the policy answers 503 on /ready, and the gate
holds new requests); it opens when the action ends. Every waiting phase has a deadline; missing
it ends the action as failed, with what was seen, so the policy backs off and never waits
forever. Deadlines are in the same clock as ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.phase_records import (
    BEFORE_RESTART,
    PERMIT_CALL_TIMEOUT_SECONDS,
    PERMIT_RETRY_SECONDS,
    RESTART_CALL_MARGIN_SECONDS,
    ActionProgress,
    Advance,
    Move,
    Outcome,
    Phase,
    Seen,
    phase_limit_seconds,
)
from vllm_guardian.model import ActionKind, Cause, Op, OpRequest, OpResult

__all__ = [
    "BEFORE_RESTART",
    "PERMIT_CALL_TIMEOUT_SECONDS",
    "PERMIT_RETRY_SECONDS",
    "RESTART_CALL_MARGIN_SECONDS",
    "ActionProgress",
    "Advance",
    "Move",
    "Outcome",
    "Phase",
    "Seen",
    "advance",
    "phase_limit_seconds",
    "release",
    "runs_old_flags",
    "start",
    "supersede",
]

_OLD_FLAGS = (
    "its supervisor started vLLM again (pid {pid}) before the new flags were written: "
    "restarting it with them"
)


def runs_old_flags(a: ActionProgress, seen: Seen) -> bool:
    """A relaunch whose vLLM runs, but was started before its flags were written: its
    supervisor restarted it after a crash faster than the flags file was written (a real vLLM
    exits a second after its engine dies; Restart= and the process manager start it again a
    second later), so it runs the old flags and must be restarted once more with the new."""
    return (
        a.kind is ActionKind.RELAUNCH
        and a.flags_written_seconds is not None
        and seen.main_pid is not None
        and seen.main_started_seconds is not None
        and seen.main_started_seconds < a.flags_written_seconds
    )


def start(
    action_id: int,
    service: str,
    kind: ActionKind,
    cause: Cause | None,
    reason: str,
    flags: tuple[tuple[str, str], ...],
    env: tuple[tuple[str, str], ...],
    old_pid: int | None,
    now: float,
    p: PolicyConfig,
    operator: str | None = None,
    permit_timeout_seconds: float | None = None,
) -> tuple[ActionProgress, tuple[OpRequest, ...]]:
    """The first phase: ask for the bundle and (for a relaunch) the flags file. The flags go
    first: when vLLM is already dying (an OOM), its supervisor's own restart then reads them.
    With ``permit_timeout_seconds`` (a voluntary action, fleet.permit: lease) the first phase
    is AWAITING_PERMIT instead: one try for a fleet permit, preparing once it is granted."""
    if permit_timeout_seconds is not None:
        ask = OpRequest(
            action_id, service, Op.PERMIT, (), (), PERMIT_CALL_TIMEOUT_SECONDS, reason, cause
        )
        waiting = ActionProgress(
            action_id=action_id,
            kind=kind,
            cause=cause,
            reason=reason,
            phase=Phase.AWAITING_PERMIT,
            phase_since=now,
            deadline=now + phase_limit_seconds(Phase.AWAITING_PERMIT, p, permit_timeout_seconds),
            started_seconds=now,
            flags=flags,
            env=env,
            old_pid=old_pid,
            waiting_ops=(Op.PERMIT,),
            operator=operator,
        )
        return waiting, (ask,)
    ops: list[OpRequest] = []
    if kind is ActionKind.RELAUNCH:
        ops.append(OpRequest(action_id, service, Op.WRITE_FLAGS, flags, env, 10.0, reason, cause))
    ops.append(
        OpRequest(
            action_id, service, Op.BUNDLE, flags, env, p.bundle_timeout_seconds, reason, cause
        )
    )
    progress = ActionProgress(
        action_id=action_id,
        kind=kind,
        cause=cause,
        reason=reason,
        phase=Phase.PREPARING,
        phase_since=now,
        deadline=now + phase_limit_seconds(Phase.PREPARING, p),
        started_seconds=now,
        flags=flags,
        env=env,
        old_pid=old_pid,
        waiting_ops=tuple(o.op for o in ops),
        operator=operator,
    )
    return progress, tuple(ops)


def release(action_id: int, service: str, reason: str) -> OpRequest:
    """Give back every permit this guardian holds (a try still running may yet be granted: a
    grant for an action that is not waiting for it is given back too, core/acting.release_stray_grants)."""
    return OpRequest(
        action_id, service, Op.RELEASE_PERMIT, (), (), PERMIT_CALL_TIMEOUT_SECONDS, reason
    )


def supersede(a: ActionProgress, service: str, why: str) -> Advance:
    """End an action that is still waiting for a permit (nothing disrupted yet) because
    something more urgent came: a crash takes no permit, the replica is already down. Whatever
    the wait may hold is released: a try may be in flight, or a guardian restarted mid-wait may
    hold a Lease it was about to find again."""
    assert a.phase is Phase.AWAITING_PERMIT
    return Advance(
        None,
        (),
        (release(a.action_id, service, a.reason),),
        Outcome(False, False, f"superseded while waiting for a fleet permit: {why}"),
    )


class _Tick:
    """One :func:`advance` call's working copy: the action as it moves on, the phase changes
    and the calls asked for. Each phase's handler reads and changes it."""

    def __init__(
        self,
        a: ActionProgress,
        service: str,
        seen: Seen,
        now: float,
        p: PolicyConfig,
        permit_renew_seconds: float | None,
    ) -> None:
        self.a = a
        self.service = service
        self.seen = seen
        self.now = now
        self.p = p
        self.permit_renew_seconds = permit_renew_seconds
        self.moves: list[Move] = []
        self.ops: list[OpRequest] = []

    def go(self, phase: Phase, why: str, **kw: object) -> None:
        """Enter ``phase`` now, with its own deadline."""
        deadline = self.now + phase_limit_seconds(phase, self.p)
        self.a = replace(self.a, phase=phase, phase_since=self.now, deadline=deadline, **kw)  # type: ignore[arg-type]
        self.moves.append(Move(phase, why))

    def note(self, text: str) -> None:
        self.a = replace(self.a, notes=(*self.a.notes, text))

    def end(self, ok: bool, terminal: bool, detail: str) -> Advance:
        """The action ends: a permit held is released; the notes go with the detail."""
        a = self.a
        if a.permit_held:
            self.ops.append(release(a.action_id, self.service, a.reason))
        parts = [*a.notes, detail] if ok else [detail, *a.notes]
        return Advance(
            None, tuple(self.moves), tuple(self.ops), Outcome(ok, terminal, "; ".join(parts))
        )

    def restart(self, why: str, drain: bool = True) -> None:
        """Ask for the restart call and wait for it in RESTARTING; ``drain=False`` when nothing
        in flight can finish (the stop then waits only for vLLM's exit)."""
        a, p, seen = self.a, self.p, self.seen
        timeout = p.drain_timeout_seconds + p.ready_timeout_seconds
        self.ops.append(
            OpRequest(
                a.action_id, self.service, Op.RESTART, a.flags, a.env, timeout, a.reason,
                drain=drain,
            )
        )  # fmt: skip
        self.go(
            Phase.RESTARTING,
            why,
            waiting_ops=(*a.waiting_ops, Op.RESTART),
            stopped_seconds=self.now,
            old_device_pids=(seen.device_pids or ()) if seen.by_device else None,
        )

    def ask_permit(self) -> None:
        """One try at the fleet permit (core/permit.plan: acquire, or renew the one held)."""
        a = self.a
        self.ops.append(
            OpRequest(
                a.action_id, self.service, Op.PERMIT, (), (), PERMIT_CALL_TIMEOUT_SECONDS,
                a.reason, a.cause,
            )
        )  # fmt: skip
        self.a = replace(a, waiting_ops=(*a.waiting_ops, Op.PERMIT))


def advance(
    a: ActionProgress,
    service: str,
    seen: Seen,
    results: Sequence[OpResult],
    now: float,
    p: PolicyConfig,
    permit_renew_seconds: float | None = None,
) -> Advance:
    """Move the action on as far as this tick's observations allow (several phases at once
    when nothing needs waiting for). ``permit_renew_seconds``: a permit held is renewed this
    often (a third of the Lease's duration), so an action longer than its Lease keeps it.

    In order: an action a restarted guardian left (orphaned) picks up; the results of the
    calls it asked for are read; a permit held is renewed when due; then the handler of the
    phase it is in (:data:`_PHASES`) runs, again while each moves it to another phase."""
    t = _Tick(a, service, seen, now, p, permit_renew_seconds)
    if a.orphaned:
        restarted = _pick_up_orphan(t)
        if restarted is not None:
            return restarted
    for r in results:
        if r.action_id == t.a.action_id:
            ended = _read_result(t, r)
            if ended is not None:
                return ended
    _renew_permit(t)
    for _ in range(len(Phase) + 1):  # each pass either waits (returns) or moves on
        phase = t.a.phase
        ended = _PHASES[phase](t)
        if ended is not None:
            return ended
        if t.a.phase is phase:
            break
    return Advance(t.a, tuple(t.moves), tuple(t.ops), None)


def _pick_up_orphan(t: _Tick) -> Advance | None:
    """The guardian died mid-action: the calls it was waiting for died with it. An action
    still preparing starts again (returned); the others go on from their phase."""
    a = t.a = replace(t.a, orphaned=False, waiting_ops=())
    if a.phase is Phase.AWAITING_PERMIT:
        # The try died with the guardian: ask again now (a Lease it got meanwhile is found
        # again as its own: core/permit.plan renews it).
        t.a = replace(a, permit_retry_at=t.now)
        t.moves.append(
            Move(a.phase, "the guardian restarted while waiting for a permit: asking again")
        )
    elif a.phase is Phase.PREPARING:
        # Nothing disruptive happened yet: prepare again.
        fresh, again = start(
            a.action_id, t.service, a.kind, a.cause, a.reason, a.flags, a.env,
            a.old_pid, t.now, t.p, a.operator,
        )  # fmt: skip
        return Advance(
            fresh,
            (Move(Phase.PREPARING, "the guardian restarted while preparing: preparing again"),),
            again,
            None,
        )
    if a.phase is Phase.RESTARTING:
        t.go(
            Phase.AWAITING_READY,
            "the guardian restarted during the restart call: waiting for vLLM to be ready",
            ready_after=t.now,
        )
    else:
        t.moves.append(Move(a.phase, f"the guardian restarted during {a.phase.value}: going on"))
    return None


def _read_result(t: _Tick, r: OpResult) -> Advance | None:
    """One result of a call this action asked for (the action ends: returned)."""
    a = t.a = replace(t.a, waiting_ops=tuple(o for o in t.a.waiting_ops if o is not r.op))
    if r.op is Op.PERMIT:
        return _read_permit(t, r)
    if r.op is Op.BUNDLE:
        t.note(f"bundle {r.detail}" if r.ok else r.detail)
    elif r.op is Op.WRITE_FLAGS and not r.ok:
        return t.end(False, r.terminal, f"flags not written, nothing restarted: {r.detail}")
    elif r.op is Op.WRITE_FLAGS:
        t.a = replace(
            a, notes=(*a.notes, "flags file written"), flags_written_seconds=r.finished_seconds
        )
    elif r.op is Op.RESTART:
        if not r.ok:
            return t.end(False, r.terminal, r.detail)
        t.a = replace(a, notes=(*a.notes, r.detail), ready_after=r.finished_seconds)
        if t.a.old_pid is not None or t.a.old_device_pids is not None:
            t.go(Phase.AWAITING_VRAM, "restart returned")
        else:
            t.go(Phase.AWAITING_READY, "restart returned")
    return None


def _read_permit(t: _Tick, r: OpResult) -> Advance | None:
    """A permit call's result: granted (the action starts, the front door closes), refused
    (wait and retry, or end when it says it never will), or a renewal that failed."""
    a, now = t.a, t.now
    if r.ok and a.phase is Phase.AWAITING_PERMIT:
        waited = now - a.phase_since
        fresh, prepare = start(
            a.action_id, t.service, a.kind, a.cause, a.reason, a.flags, a.env,
            a.old_pid, now, t.p, a.operator,
        )  # fmt: skip
        t.ops.extend(prepare)
        t.a = replace(
            fresh,
            started_seconds=a.started_seconds,
            permit_held=True,
            permit_renew_at=None
            if t.permit_renew_seconds is None
            else now + t.permit_renew_seconds,
            notes=(*a.notes, f"fleet permit after {waited:.0f}s ({r.detail})"),
        )
        t.moves.append(
            Move(Phase.PREPARING, f"fleet permit granted: {r.detail}; front door closed")
        )
    elif a.phase is Phase.AWAITING_PERMIT:
        if r.terminal:
            return t.end(False, True, f"no fleet permit: {r.detail}")
        if r.detail != a.permit_reason:  # audited when the reason changes, not every try
            t.moves.append(Move(Phase.AWAITING_PERMIT, f"no fleet permit yet: {r.detail}"))
        t.a = replace(a, permit_retry_at=now + PERMIT_RETRY_SECONDS, permit_reason=r.detail)
    elif a.permit_held and not r.ok:
        # Audited; the action goes on: the Lease lasts its duration from the last renewal,
        # and the next renewal tries again.
        t.moves.append(Move(a.phase, f"fleet permit not renewed: {r.detail}"))
    return None


def _renew_permit(t: _Tick) -> None:
    """One try renews the Lease this guardian holds (core/permit.plan: RENEW), when due."""
    a, every = t.a, t.permit_renew_seconds
    if (
        a.permit_held
        and every is not None
        and a.permit_renew_at is not None
        and t.now >= a.permit_renew_at
        and Op.PERMIT not in a.waiting_ops
    ):
        t.ask_permit()
        t.a = replace(t.a, permit_renew_at=t.now + every)


# Each phase's handler: it moves the action to another phase (``_Tick.go``), ends it (returns
# the Advance), or leaves it where it is to wait for a later tick.


def _awaiting_permit(t: _Tick) -> Advance | None:
    a, now = t.a, t.now
    if Op.PERMIT in a.waiting_ops:
        if now >= a.deadline + PERMIT_CALL_TIMEOUT_SECONDS:
            return t.end(False, False, "the permit call did not return in time")
    elif now >= a.deadline:
        waited = now - a.phase_since
        return t.end(
            False,
            False,
            f"no fleet permit within {waited:.0f}s; nothing restarted (last: "
            f"{a.permit_reason or 'no answer'})",
        )
    elif now >= a.permit_retry_at:
        t.ask_permit()
    return None


def _preparing(t: _Tick) -> Advance | None:
    a, now, seen = t.a, t.now, t.seen
    if Op.WRITE_FLAGS in a.waiting_ops and now < a.deadline:
        return None
    if Op.WRITE_FLAGS in a.waiting_ops:
        return t.end(False, False, "the flags file was not written in time; nothing restarted")
    if Op.BUNDLE in a.waiting_ops and now < a.deadline:
        return None
    if Op.BUNDLE in a.waiting_ops:
        t.note("bundle not finished in time; going on without it")
    if runs_old_flags(t.a, seen):
        t.go(Phase.DRAINING, _OLD_FLAGS.format(pid=seen.main_pid))
    elif seen.listening is False and t.a.old_pid is not None:
        # The process is gone: a supervisor (Restart=always, the process manager) may
        # be starting it already, with the flags just written. A process that still
        # answers (503, hung) is restarted by nobody but us.
        t.go(
            Phase.AWAITING_SELF_RESTART,
            "vLLM is down: waiting for its supervisor to start it again",
        )
    else:
        t.go(Phase.DRAINING, "front door closed")
    return None


def _awaiting_self_restart(t: _Tick) -> Advance | None:
    a, seen = t.a, t.seen
    if runs_old_flags(a, seen):
        t.go(Phase.DRAINING, _OLD_FLAGS.format(pid=seen.main_pid))
    elif seen.main_pid is not None and (
        seen.main_pid != a.old_pid
        or (
            a.flags_written_seconds is not None
            and seen.main_started_seconds is not None
            and seen.main_started_seconds >= a.flags_written_seconds
        )
    ):
        t.note("vLLM restarted on its own after dying (no second restart)")
        t.go(
            Phase.AWAITING_READY,
            f"its supervisor started vLLM again (pid {seen.main_pid})",
            ready_after=t.now,
        )
    elif t.now >= a.deadline:
        t.go(Phase.DRAINING, "nobody restarted it")
    return None


def _draining(t: _Tick) -> Advance | None:
    a, now, seen = t.a, t.now, t.seen
    left = seen.in_flight
    if seen.stalled or seen.engine_dead or seen.listening is False:
        # A hung, dead or exited engine finishes nothing: waiting out the drain would
        # only hold the front door closed longer (the requests in it fail either way).
        why = (
            "hung (no progress)"
            if seen.stalled
            else "not serving (/health 503)"
            if seen.engine_dead
            else "not serving (nothing listens)"
        )
        t.note(f"not drained: the engine is {why}")
        t.restart(f"the engine is {why}: nothing in flight can finish", drain=False)
    elif left is None or left <= 0:
        took = now - a.phase_since
        t.note(f"drained in {took:.0f}s")
        t.restart(f"drained (in flight per {seen.in_flight_from or 'nothing'}: 0)")
    elif now >= a.deadline:
        t.note(
            f"drain timed out after {t.p.drain_timeout_seconds:.0f}s with {left:.0f} in "
            "flight (vLLM's --shutdown-timeout takes over)"
        )
        t.restart(f"drain deadline passed with {left:.0f} in flight per {seen.in_flight_from}")
    return None


def _restarting(t: _Tick) -> Advance | None:
    if Op.RESTART in t.a.waiting_ops and t.now >= t.a.deadline:
        return t.end(False, False, "the restart call did not return in time")
    return None


def _awaiting_vram(t: _Tick) -> Advance | None:
    """The old instance's GPU memory freed: per device where the service's GPUs are known,
    else by its pid among the GPU processes."""
    a, seen = t.a, t.seen
    if a.old_device_pids is not None:
        return _awaiting_vram_by_device(t, a.old_device_pids)
    if seen.gpu_pids is None or a.old_pid not in seen.gpu_pids:
        t.go(
            Phase.AWAITING_READY,
            "the old instance's GPU memory is free"
            if seen.gpu_pids is not None
            else "GPU processes not visible: not waiting on them",
        )
    elif t.now >= a.deadline:
        return t.end(
            False,
            False,
            f"the old instance (pid {a.old_pid}) still holds GPU memory after "
            f"{t.p.vram_release_timeout_seconds:.0f}s",
        )
    return None


def _awaiting_vram_by_device(
    t: _Tick, old: tuple[tuple[int, tuple[int, ...] | None], ...]
) -> Advance | None:
    held, blind = _held_by_device(old, t.seen.device_pids)
    if not held:
        freed = [g for g, _ in old if g not in blind]
        said: list[str] = []
        if freed:
            said.append(f"the old instance's GPU memory is free on {_gpus(freed)}")
        if blind:
            said.append(f"GPU processes not visible on {_gpus(blind)}: not waiting on them")
        if not old:
            said.append("GPU processes not visible: not waiting on them")
        t.go(Phase.AWAITING_READY, "; ".join(said))
    elif t.now >= t.a.deadline:
        still = ", ".join(
            f"GPU {g} (host pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))})"
            for g, pids in held
        )
        return t.end(
            False,
            False,
            f"the old instance still holds {still} after {t.p.vram_release_timeout_seconds:.0f}s",
        )
    return None


def _awaiting_ready(t: _Tick) -> Advance | None:
    a, seen = t.a, t.seen
    if seen.time_seconds > a.ready_after and seen.health_up and seen.metrics_up:
        took = t.now - a.started_seconds
        return t.end(True, False, f"ready after {took:.0f}s")
    if t.now >= a.deadline:
        return t.end(
            False,
            False,
            f"not ready within {t.p.ready_timeout_seconds:.0f}s after the restart",
        )
    return None


_PHASES: dict[Phase, Callable[[_Tick], Advance | None]] = {
    Phase.AWAITING_PERMIT: _awaiting_permit,
    Phase.PREPARING: _preparing,
    Phase.AWAITING_SELF_RESTART: _awaiting_self_restart,
    Phase.DRAINING: _draining,
    Phase.RESTARTING: _restarting,
    Phase.AWAITING_VRAM: _awaiting_vram,
    Phase.AWAITING_READY: _awaiting_ready,
}


def _gpus(indices: Sequence[int]) -> str:
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, indices))


def _held_by_device(
    old: tuple[tuple[int, tuple[int, ...] | None], ...],
    now: tuple[tuple[int, tuple[int, ...] | None], ...] | None,
) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Which of the old instance's host pids each device still shows, and the devices that
    cannot tell (NVML not read, the device gone or unreadable, its processes not listed now or
    before the restart). A pid is compared only on the device it was seen on."""
    current = dict(now) if now is not None else {}
    held: list[tuple[int, list[int]]] = []
    blind: list[int] = []
    for gpu, before in old:
        after = current.get(gpu)
        if before is None or after is None:
            blind.append(gpu)
        elif left := sorted(set(before) & set(after)):
            held.append((gpu, left))
    return held, blind
