"""The fleet permit: one of N Lease objects taken before a voluntary action. Pure.

Where it sits: before a *voluntary* action (a relaunch without a crash, a pre-emptive restart,
a step back up) when ``fleet.permit`` is ``lease``. The edge (``actuators/k8s_permit.py``)
reads the PodDisruptionBudget and the Leases ``vllm-guardian-<model>-<k>`` (k < N, N from the
PDB) and writes the one :func:`plan` names, with the ``resourceVersion`` it read as the
precondition; :func:`settle` turns what the write answered into the wait's next state. A
restart after a crash takes no permit: the replica is already down.

The rules, so the fleet never has more than N replicas disrupted by guardians at once and
yields to node drains and rollouts (kured's lock is the precedent):

* a permit is taken only while the PDB's ``status.disruptionsAllowed`` is at least 1;
* a Lease is free when it has no holder or its holder stopped renewing it for
  ``leaseDurationSeconds`` (a dead guardian frees its permit by doing nothing);
* every write carries the ``resourceVersion`` read, so of two guardians racing for one Lease
  exactly one wins; the loser's 409 and an exhausted budget's 429 are "not now", never an error
  loop: the wait tries again later and gives up at its deadline, audited either way.

Times are seconds on the caller's clock (Unix time: Leases are compared across hosts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

LEASE_PREFIX = "vllm-guardian"
# A conflict means another guardian moved between our read and our write: read again at once
# (on the next try), it costs one GET. Anything else waits this long.
RETRY_SECONDS = 15.0
# At most this many permits, whatever the PDB allows: one try reads each permit's Lease, and a
# maxUnavailable of 20,000 made one try 20,000 reads. Fewer permits than the PDB allows is the
# safe side (fewer replicas down at once by guardians); the PDB still bounds every one of them.
MAX_PERMITS = 16


def lease_names(model: str, permits: int) -> tuple[str, ...]:
    """The N permits of a model (at most :data:`MAX_PERMITS`), in the order they are tried."""
    return tuple(f"{LEASE_PREFIX}-{model}-{k}" for k in range(max(0, min(permits, MAX_PERMITS))))


@dataclass(frozen=True)
class LeaseRecord:
    """One Lease as read: who holds it and until when."""

    name: str
    resource_version: str
    holder: str | None
    renew_seconds: float | None
    duration_seconds: float | None
    acquire_seconds: float | None = None  # since when its holder has held it
    transitions: int = 0  # how many times it changed holders (the Lease's leaseTransitions)

    def expires_seconds(self) -> float | None:
        if not self.holder or self.renew_seconds is None or self.duration_seconds is None:
            return None
        return self.renew_seconds + self.duration_seconds

    def free(self, now: float) -> bool:
        until = self.expires_seconds()
        return until is None or until <= now


@dataclass(frozen=True)
class Budget:
    """The PodDisruptionBudget as read."""

    permits: int  # N: how many replicas may be down at once (the PDB's maxUnavailable)
    disruptions_allowed: int  # status.disruptionsAllowed: what the PDB allows right now


class PlanKind(StrEnum):
    CREATE = "create"  # the Lease does not exist yet: create it, holding it
    TAKE = "take"  # a free or expired Lease: update it with the resourceVersion read
    RENEW = "renew"  # this guardian holds it already (e.g. it restarted mid-action)
    NOT_NOW = "not_now"


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    lease: str | None
    resource_version: str | None
    reason: str


def plan(
    model: str, holder: str, budget: Budget, leases: Mapping[str, LeaseRecord], now: float
) -> Plan:
    """Which Lease to write, if any, from what was just read."""
    names = lease_names(model, budget.permits)
    for name in names:
        lease = leases.get(name)
        if lease is not None and lease.holder == holder and not lease.free(now):
            return Plan(PlanKind.RENEW, name, lease.resource_version, f"{name} is ours already")
    if budget.permits < 1:
        return Plan(
            PlanKind.NOT_NOW, None, None, "the PDB allows no replica down (maxUnavailable 0)"
        )
    if budget.disruptions_allowed < 1:
        return Plan(
            PlanKind.NOT_NOW,
            None,
            None,
            "the PDB allows no disruption now (disruptionsAllowed 0): a node drain, a rollout "
            "or another replica is down",
        )
    held: list[str] = []
    for name in names:
        lease = leases.get(name)
        if lease is None:
            return Plan(PlanKind.CREATE, name, None, f"{name} does not exist yet")
        if lease.free(now):
            if lease.holder:
                why = f"{name} expired: {lease.holder} stopped renewing it"
            else:
                why = f"{name} is free"
            return Plan(PlanKind.TAKE, name, lease.resource_version, why)
        until = lease.expires_seconds()
        left = "" if until is None else f" for {until - now:.0f}s more"
        held.append(f"{name} by {lease.holder}{left}")
    return Plan(PlanKind.NOT_NOW, None, None, f"all {len(names)} permits held: " + ", ".join(held))


def release_plan(holder: str, leases: Mapping[str, LeaseRecord]) -> tuple[LeaseRecord, ...]:
    """The Leases this holder holds, to give back (holder cleared, with their resourceVersion)."""
    return tuple(lease for lease in leases.values() if lease.holder == holder)


class WriteResult(StrEnum):
    OK = "ok"
    CONFLICT = "conflict"  # 409: the Lease changed since it was read, or was created meanwhile
    EXHAUSTED = "exhausted"  # 429: the disruption budget is spent (the Eviction API's answer)
    ERROR = "error"  # anything else: the API server unreachable, forbidden, a timeout


class WaitStatus(StrEnum):
    WAITING = "waiting"
    GRANTED = "granted"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class PermitWait:
    """Waiting for a permit: a phase of a voluntary action."""

    since_seconds: float
    deadline_seconds: float
    next_try_seconds: float
    status: WaitStatus = WaitStatus.WAITING
    attempts: int = 0
    lease: str | None = None
    reason: str = "not tried yet"


def begin(now: float, timeout_seconds: float) -> PermitWait:
    return PermitWait(
        since_seconds=now, deadline_seconds=now + timeout_seconds, next_try_seconds=now
    )


def due(w: PermitWait, now: float) -> bool:
    """Whether the edge should read and try now."""
    return w.status is WaitStatus.WAITING and now >= w.next_try_seconds


def settle(
    w: PermitWait,
    p: Plan,
    write: WriteResult | None,
    detail: str,
    now: float,
    retry_seconds: float = RETRY_SECONDS,
) -> PermitWait:
    """The wait after one try: the plan, and what its write answered (None when nothing was
    written: NOT_NOW, or the read itself failed with ``detail``)."""
    if w.status is not WaitStatus.WAITING:
        return w
    n = w.attempts + 1
    if p.kind is not PlanKind.NOT_NOW and write is WriteResult.OK:
        return replace(w, status=WaitStatus.GRANTED, attempts=n, lease=p.lease, reason=p.reason)
    if write is WriteResult.CONFLICT:
        reason, retry = f"{p.lease}: another guardian wrote it first (409); reading again", 0.0
    elif write is WriteResult.EXHAUSTED:
        reason, retry = f"the disruption budget is spent (429): {detail}", retry_seconds
    elif write is WriteResult.ERROR or (write is None and detail):
        reason, retry = f"the API server did not answer as expected: {detail}", retry_seconds
    else:
        reason, retry = p.reason, retry_seconds
    if now >= w.deadline_seconds:
        waited = now - w.since_seconds
        return replace(
            w,
            status=WaitStatus.TIMED_OUT,
            attempts=n,
            reason=f"no permit after {waited:.0f}s ({n} tries); last: {reason}",
        )
    return replace(w, attempts=n, next_try_seconds=now + retry, reason=reason)
