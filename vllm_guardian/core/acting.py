"""Acting: what one ``decide`` call produces (:class:`Ctx`), starting an action, moving the action
under way through its phases (``core/phases.py``) at the start of each service's tick, and
ending it (success opens the front door and starts the cooldown; a failure backs off or
latches the breaker).

Also what the phases read of the tick (:func:`seen`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core import phases
from vllm_guardian.core.causes import cause_spec
from vllm_guardian.core.diagnosis import (
    Finding,
)
from vllm_guardian.core.policy_state import (
    Decision,
    DecisionKind,
    FrontDoorHolder,
    HoldOff,
    Levels,
    PolicySettings,
    PolicyState,
    ServiceState,
    Withheld,
)
from vllm_guardian.core.rungs import describe_flags, restore_levels
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.model import (
    Action,
    ActionKind,
    ActionResult,
    GpuDevice,
    HealthState,
    Op,
    OpRequest,
    OpResult,
    Snapshot,
)


class Ctx:
    """Accumulates what one decide() call produces."""

    def __init__(self, state: PolicyState, now: float, settings: PolicySettings) -> None:
        self.next_id = state.next_action_id
        self.now = now
        self.settings = settings
        self.actions: list[Action] = []
        self.decisions: list[Decision] = []
        self.ops: list[OpRequest] = []
        self.results: list[ActionResult] = []

    def decide(self, s: ServiceState, what: DecisionKind, reason: str, **kw: object) -> None:
        self.decisions.append(Decision(self.now, s.service, what, reason, **kw))  # type: ignore[arg-type]

    def act(
        self,
        s: ServiceState,
        kind: ActionKind,
        finding: Finding | None,
        reason: str,
        flags: tuple[tuple[str, str], ...] = (),
        env: tuple[tuple[str, str], ...] = (),
        operator: str | None = None,
        voluntary: bool = False,
        before: Levels | None = None,
    ) -> ServiceState:
        """``voluntary``: nothing has crashed (the replica serves), or an operator asked; with a
        fleet permit configured, such an action waits for one first (docs/kubernetes.md,
        "One disruption budget"). ``before``: the levels before this action changed them, restored if that
        wait ends without a permit."""
        p = self.settings.policy
        # An operator's explicit command acts although the policy is in dry-run.
        dry = operator is None and (p.dry_run or kind.value in p.dry_run_actions)
        evidence = tuple(e.name for e in finding.evidence) if finding else ()
        cause = finding.cause if finding else None
        action = Action(self.next_id, s.service, kind, cause, reason, evidence, dry, flags, env)
        self.actions.append(action)
        self.decide(
            s,
            DecisionKind.ACTION,
            f"{kind.value}: {reason}" + (f" (asked by {operator})" if operator else ""),
            cause=cause,
            evidence=evidence,
            action_id=self.next_id,
            dry_run=dry,
            action_kind=kind,
        )
        self.next_id += 1
        s = replace(s, log_items=())  # the evidence is acted upon: it must not trigger again
        if kind is ActionKind.ESCALATE:
            return s
        if dry:
            what = f"dry-run: would {kind.value}" + (
                f" with {describe_flags(flags, env) or 'the operator baseline'}"
                if kind is ActionKind.RELAUNCH
                else ""
            )
            return finish(self, s, action.id, kind, phases.Outcome(True, False, what), True)
        permit = self.settings.permit_timeout_seconds if voluntary else None
        progress, ops = phases.start(
            action.id, s.service, kind, cause, reason, flags, env,
            s.main_pid, self.now, p, operator, permit,
        )  # fmt: skip
        self.ops.extend(ops)
        if progress.phase is phases.Phase.AWAITING_PERMIT:
            self.decide(
                s,
                DecisionKind.PHASE,
                f"voluntary {kind.value}: waiting for a fleet permit (at most {permit:.0f}s); "
                "front door stays open",
                action_id=action.id,
                phase=progress.phase,
                action_kind=kind,
            )
            return replace(s, action=progress, levels_before=before or s.levels)
        self.decide(
            s,
            DecisionKind.PHASE,
            "front door closed; capturing the incident bundle"
            + (" and writing the flags file" if kind is ActionKind.RELAUNCH else ""),
            action_id=action.id,
            phase=progress.phase,
            action_kind=kind,
        )
        return replace(
            s,
            action=progress,
            front_door=s.front_door.closed(FrontDoorHolder.ACTION, f"{kind.value} in progress"),
        )

    def note(
        self, s: ServiceState, why: Withheld, reason: str, finding: Finding | None = None
    ) -> ServiceState:
        """A 'nothing done, because' decision, logged once until the reason changes."""
        if reason == s.last_note:
            return s
        evidence = tuple(e.name for e in finding.evidence) if finding else ()
        self.decide(
            s,
            DecisionKind.SUPPRESSED,
            reason,
            cause=finding.cause if finding else None,
            evidence=evidence,
            withheld=why,
        )
        return replace(s, last_note=reason)


def gate_dry_run(p: PolicyConfig) -> bool:
    return p.dry_run or "gate" in p.dry_run_actions


def disrupting(s: ServiceState) -> bool:
    """An action of ours is under way past its wait for a fleet permit: it holds the front door
    and the failures seen may be its own doing."""
    return s.action is not None and s.action.phase is not phases.Phase.AWAITING_PERMIT


def seen(snapshot: Snapshot, sig: ServiceSignals | None, name: str) -> phases.Seen:
    """What the phases of an action read of this tick: requests in flight, health, pids."""
    svc = snapshot.service(name)
    pids: frozenset[int] | None = None
    if snapshot.gpus is not None:
        pids = frozenset(p.pid for d in snapshot.gpus.devices for p in d.processes or ())
    in_flight: float | None = None
    source = ""
    gate = svc.gate if svc is not None else None
    if gate is not None and gate.reachable and gate.in_flight is not None:
        # The front door's own count of what it sent to vLLM and has not finished: exact,
        # where vLLM's gauges lag a scrape and count clients that bypass the gate.
        in_flight, source = float(gate.in_flight), "gate"
    elif sig is not None and sig.requests_running is not None:
        # No gate, or one that does not answer (never a reason to block an action): vLLM's
        # own running + waiting.
        in_flight = sig.requests_running + (sig.requests_waiting or 0)
        source = "vllm" if gate is None else "vllm (the gate did not answer)"
    health = sig.health_state if sig is not None else None
    by_device = bool(sig is not None and sig.gpu_memory_by_device)
    device_pids: tuple[tuple[int, tuple[int, ...] | None], ...] | None = None
    if sig is not None and by_device and snapshot.gpus is not None:
        # The service's GPUs (with gpus auto in a pod: every GPU it sees) and who holds them.
        devices = {d.index: d for d in snapshot.gpus.devices}
        device_pids = tuple((g.gpu, _host_pids(devices.get(g.gpu))) for g in sig.gpus)
    return phases.Seen(
        time_seconds=snapshot.time_seconds,
        in_flight=in_flight,
        in_flight_from=source,
        health_up=None if health is None else health is HealthState.UP,
        listening=None if health is None else health is not HealthState.REFUSED,
        main_pid=svc.unit.main_pid if svc is not None and svc.unit is not None else None,
        gpu_pids=pids,
        metrics_up=bool(sig is not None and sig.metrics_up),
        # Requests lost before the engine (input_hung) finish no more than a hung engine's.
        stalled=bool(sig is not None and (sig.stalled or sig.input_hung)),
        engine_dead=health is HealthState.ENGINE_DEAD,
        by_device=by_device,
        device_pids=device_pids,
        main_started_seconds=(
            svc.unit.main_started_seconds if svc is not None and svc.unit is not None else None
        ),
    )


def _host_pids(device: GpuDevice | None) -> tuple[int, ...] | None:
    """The pids holding memory on a device (None: gone, unreadable, or not listed), but vLLM's
    weight-cache daemon's, which keeps the weights across the restart on purpose."""
    if device is None or device.error is not None or device.processes is None:
        return None
    return tuple(sorted({p.pid for p in device.processes if not p.weight_cache}))


def advance_action(
    ctx: Ctx, s: ServiceState, snapshot: Snapshot, sig: ServiceSignals | None
) -> ServiceState:
    """Move the action under way on by one tick (core/phases.py); record each phase change.
    What the phases read of the tick is gathered only while an action is under way."""
    results = [r for r in snapshot.op_results if r.service == s.service]
    release_stray_grants(ctx, s, results)
    if s.action is None:
        return s
    action = s.action
    adv = phases.advance(
        action, s.service, seen(snapshot, sig, s.service), results,
        ctx.now, ctx.settings.policy, ctx.settings.permit_renew_seconds,
    )  # fmt: skip
    ctx.ops.extend(adv.ops)
    for m in adv.moves:
        ctx.decide(
            s, DecisionKind.PHASE, m.why,
            action_id=action.action_id, phase=m.phase, action_kind=action.kind,
        )  # fmt: skip
    if adv.outcome is None:
        if (
            action.phase is phases.Phase.AWAITING_PERMIT
            and adv.progress is not None
            and adv.progress.phase is not phases.Phase.AWAITING_PERMIT
        ):  # the permit is granted: from here on the action holds the front door
            s = replace(
                s,
                front_door=s.front_door.closed(
                    FrontDoorHolder.ACTION, f"{action.kind.value} in progress"
                ),
                levels_before=None,
            )
        return replace(s, action=adv.progress)
    detail = adv.outcome.detail
    if action.kind is ActionKind.RELAUNCH and adv.outcome.ok:
        detail = f"flags now: {describe_flags(action.flags, action.env) or 'the operator baseline'}; {detail}"
    if action.phase is not phases.Phase.AWAITING_PERMIT:
        return finish(
            ctx, replace(s, action=None), action.action_id, action.kind,
            replace(adv.outcome, detail=detail), False,
        )  # fmt: skip
    # The wait for a permit ended without one: nothing was restarted, so no budget slot is
    # spent, and the backoff holds voluntary actions only.
    s = finish(
        ctx, restore_levels(give_back_slot(replace(s, action=None), action)),
        action.action_id, action.kind, replace(adv.outcome, detail=detail), False,
    )  # fmt: skip
    return (
        s
        if s.breaker_latched
        else replace(s, hold_off=replace(s.hold_off, backoff_voluntary_only=True))
    )


def give_back_slot(s: ServiceState, action: phases.ActionProgress) -> ServiceState:
    """The restart-budget slot an action took when it began (at its start time), given back
    because it ended without disrupting anything. An operator's action took none."""
    if action.operator is not None or action.started_seconds not in s.restarts:
        return s
    kept = list(s.restarts)
    kept.remove(action.started_seconds)
    return replace(s, restarts=tuple(kept))


def release_stray_grants(ctx: Ctx, s: ServiceState, results: Sequence[OpResult]) -> None:
    """A permit granted (or renewed) for an action that is no longer waiting for it (its wait
    was superseded by a crash, or it ended while a renewal ran) is given back at once, unless
    the action under way holds or awaits a permit itself (it releases everything when it ends,
    and would find this Lease as its own)."""
    a = s.action
    if a is not None and (a.permit_held or a.phase is phases.Phase.AWAITING_PERMIT):
        return
    for r in results:
        if r.op is not Op.PERMIT or not r.ok or (a is not None and r.action_id == a.action_id):
            continue
        ctx.ops.append(phases.release(r.action_id, s.service, "a permit no action waits for"))
        ctx.decide(
            s,
            DecisionKind.PHASE,
            f"fleet permit granted after action {r.action_id} stopped waiting for it: given "
            f"back ({r.detail})",
            action_id=r.action_id,
            phase=phases.Phase.AWAITING_PERMIT,
        )


def supersede(ctx: Ctx, s: ServiceState, top: Finding) -> ServiceState:
    """A crash while an action waits for a fleet permit: the wait ends (nothing was disrupted:
    no backoff, its budget slot given back) and the crash is acted on now, without a permit."""
    a = s.action
    assert a is not None
    adv = phases.supersede(a, s.service, f"{top.cause.value}: {top.evidence[0].sentence}")
    assert adv.outcome is not None
    ctx.ops.extend(adv.ops)
    s = restore_levels(give_back_slot(replace(s, action=None), a))
    ctx.results.append(
        ActionResult(
            a.action_id, s.service, a.kind, False, False, adv.outcome.detail, ctx.now, False
        )
    )
    then = (
        "escalating instead"
        if cause_spec(top.cause).escalation is not None
        else "acting on it now, without a permit (the replica is already down)"
    )
    ctx.decide(
        s,
        DecisionKind.RESULT,
        f"{a.kind.value} {adv.outcome.detail}; {then}",
        cause=top.cause,
        evidence=tuple(e.name for e in top.evidence),
        action_id=a.action_id,
        action_kind=a.kind,
        ok=False,
    )
    return s


def finish(
    ctx: Ctx,
    s: ServiceState,
    action_id: int,
    kind: ActionKind,
    outcome: phases.Outcome,
    dry_run: bool,
) -> ServiceState:
    """An action ended: success opens the front door and starts the cooldown; a failure backs
    off (doubling) or, when retrying cannot help, latches the breaker."""
    p = ctx.settings.policy
    ctx.results.append(
        ActionResult(
            action_id, s.service, kind, outcome.ok, outcome.terminal, outcome.detail, ctx.now,
            dry_run,
        )
    )  # fmt: skip
    s = replace(s, action=None)
    if outcome.ok:
        s = replace(
            s,
            ready_since=ctx.now,
            hold_off=HoldOff(cooldown_until=ctx.now + p.cooldown_seconds),
            front_door=s.front_door.opened(),
        )
        ctx.decide(
            s,
            DecisionKind.RESULT,
            f"{kind.value} succeeded: {outcome.detail}",
            action_id=action_id,
            dry_run=dry_run,
            action_kind=kind,
            ok=True,
        )
    elif outcome.terminal:
        s = replace(
            s,
            breaker_latched=True,
            breaker_reason=f"{kind.value} failed for good: {outcome.detail}",
            front_door=s.front_door.opened(),
        )
        ctx.decide(
            s, DecisionKind.LATCH, s.breaker_reason or "",
            action_id=action_id, action_kind=kind, ok=False,
        )  # fmt: skip
    else:
        backoff = min(
            p.backoff_max_seconds, max(p.backoff_initial_seconds, 2 * s.hold_off.backoff_seconds)
        )
        s = replace(
            s,
            hold_off=replace(
                s.hold_off,
                backoff_seconds=backoff,
                backoff_until=ctx.now + backoff,
                backoff_voluntary_only=False,
            ),
            front_door=s.front_door.opened(),
        )
        ctx.decide(
            s,
            DecisionKind.RESULT,
            f"{kind.value} failed ({outcome.detail}); next try in {backoff:.0f}s",
            action_id=action_id,
            action_kind=kind,
            ok=False,
        )
    return s
