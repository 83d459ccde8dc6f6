"""The fleet permit, pure (core/permit.py): which Lease to write, and the wait, on virtual time.

Tables first (one row per situation: granted, 409 conflict, 429 budget
exhausted, holder died and its lease expired, two guardians racing for one permit), then the
race itself against an in-memory store that keeps resourceVersions as the API server does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_guardian.core.permit import (
    Budget,
    LeaseRecord,
    PermitWait,
    Plan,
    PlanKind,
    WaitStatus,
    WriteResult,
    begin,
    due,
    lease_names,
    plan,
    release_plan,
    settle,
)

T0 = 1_800_000_000.0  # virtual Unix time
TTL = 900.0
L0, L1 = "vllm-guardian-llama-0", "vllm-guardian-llama-1"


def held(name: str, holder: str | None, renewed_ago: float, rv: str = "7") -> LeaseRecord:
    return LeaseRecord(name, rv, holder, T0 - renewed_ago, TTL)


def test_lease_names() -> None:
    assert lease_names("llama", 2) == (L0, L1)
    assert lease_names("llama", 0) == ()


def test_the_permits_scanned_are_capped() -> None:
    """One try reads every permit's Lease: a maxUnavailable of 20,000 made one try 20,000 GETs.
    Fewer permits than the PDB allows is the safe side: fewer replicas down at once."""
    from vllm_guardian.core.permit import MAX_PERMITS

    names = lease_names("llama", 20_000)
    assert len(names) == MAX_PERMITS <= 16
    assert names[0] == L0


PLANS = [
    # (what, budget, leases, expected kind, lease, resourceVersion, reason fragment)
    ("granted: no Lease yet", Budget(1, 1), [], PlanKind.CREATE, L0, None, "does not exist"),
    (
        "granted: a released Lease",
        Budget(1, 1),
        [LeaseRecord(L0, "9", None, None, None)],
        PlanKind.TAKE, L0, "9", "is free",
    ),
    (
        "holder died: its Lease expired",
        Budget(1, 1),
        [held(L0, "pod-b", renewed_ago=TTL + 1, rv="12")],
        PlanKind.TAKE, L0, "12", "pod-b stopped renewing",
    ),
    (
        "holder alive: not now, and who holds it",
        Budget(1, 1),
        [held(L0, "pod-b", renewed_ago=100)],
        PlanKind.NOT_NOW, None, None, f"all 1 permits held: {L0} by pod-b for 800s more",
    ),
    (
        "the second of two permits",
        Budget(2, 1),
        [held(L0, "pod-b", renewed_ago=100)],
        PlanKind.CREATE, L1, None, "does not exist",
    ),
    (
        "budget exhausted: a node drain took the one disruption",
        Budget(1, 0),
        [],
        PlanKind.NOT_NOW, None, None, "disruptionsAllowed 0",
    ),
    (
        "a PDB of maxUnavailable 0: never",
        Budget(0, 0),
        [],
        PlanKind.NOT_NOW, None, None, "maxUnavailable 0",
    ),
    (
        "ours already (the guardian restarted mid-action): renew, even with the budget at 0",
        Budget(1, 0),
        [held(L0, "pod-a", renewed_ago=60, rv="3")],
        PlanKind.RENEW, L0, "3", "ours already",
    ),
    (
        "ours but expired: taken again like any free one",
        Budget(1, 1),
        [held(L0, "pod-a", renewed_ago=TTL, rv="3")],
        PlanKind.TAKE, L0, "3", "pod-a stopped renewing",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("budget", "leases", "kind", "lease", "rv", "reason"),
    [row[1:] for row in PLANS],
    ids=[row[0] for row in PLANS],
)
def test_plan(
    budget: Budget,
    leases: list[LeaseRecord],
    kind: PlanKind,
    lease: str | None,
    rv: str | None,
    reason: str,
) -> None:
    got = plan("llama", "pod-a", budget, {r.name: r for r in leases}, T0)
    assert (got.kind, got.lease, got.resource_version) == (kind, lease, rv)
    assert reason in got.reason


def test_release_gives_back_only_our_leases() -> None:
    leases = {L0: held(L0, "pod-a", 10, "4"), L1: held(L1, "pod-b", 10, "5")}
    assert release_plan("pod-a", leases) == (leases[L0],)


TAKE = Plan(PlanKind.TAKE, L0, "7", f"{L0} is free")
NOT_NOW = Plan(PlanKind.NOT_NOW, None, None, "the PDB allows no disruption now")

SETTLE = [
    # (what, plan, write, detail, seconds after begin, status, next try after, reason fragment)
    ("granted", TAKE, WriteResult.OK, "", 0, WaitStatus.GRANTED, None, "is free"),
    ("409: lost the race, read again at once", TAKE, WriteResult.CONFLICT, "", 0,
     WaitStatus.WAITING, 0, "409"),
    ("429: budget exhausted, wait", TAKE, WriteResult.EXHAUSTED, "Cannot evict pod", 0,
     WaitStatus.WAITING, 15, "429"),
    ("not now, wait", NOT_NOW, None, "", 0, WaitStatus.WAITING, 15, "allows no disruption"),
    ("the API server down: wait, never an error loop", NOT_NOW, None, "connection refused", 0,
     WaitStatus.WAITING, 15, "connection refused"),
    ("a 500 on the write: wait", TAKE, WriteResult.ERROR, "500 Internal", 0,
     WaitStatus.WAITING, 15, "500 Internal"),
    ("deadline passed: timed out, with the last reason", NOT_NOW, None, "", 1800,
     WaitStatus.TIMED_OUT, None, "no permit after 1800s (1 tries); last: the PDB allows"),
    ("granted at the deadline still counts", TAKE, WriteResult.OK, "", 1800,
     WaitStatus.GRANTED, None, "is free"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("p", "write", "detail", "after", "status", "retry", "reason"),
    [row[1:] for row in SETTLE],
    ids=[row[0] for row in SETTLE],
)
def test_settle(
    p: Plan,
    write: WriteResult | None,
    detail: str,
    after: float,
    status: WaitStatus,
    retry: float | None,
    reason: str,
) -> None:
    w = begin(T0, timeout_seconds=1800)
    assert due(w, T0)
    got = settle(w, p, write, detail, T0 + after)
    assert got.status is status and got.attempts == 1
    assert reason in got.reason
    if retry is not None:
        assert got.next_try_seconds == T0 + after + retry
        assert not due(got, T0 + after + retry - 0.001) or retry == 0
        assert due(got, T0 + after + retry)
    if status is WaitStatus.GRANTED:
        assert got.lease == L0 and not due(got, T0 + 10_000)


def test_a_settled_wait_stays_settled() -> None:
    w = settle(begin(T0, 60), TAKE, WriteResult.OK, "", T0)
    assert settle(w, NOT_NOW, None, "", T0 + 1) == w


# --- the race, against a store that keeps resourceVersions as the API server does ----------


@dataclass
class Store:
    """Leases by name; every write bumps a global resourceVersion; a stale one is a 409."""

    leases: dict[str, LeaseRecord] = field(default_factory=dict)
    rv: int = 0
    log: list[str] = field(default_factory=list)

    def write(self, p: Plan, holder: str, now: float) -> WriteResult:
        assert p.lease is not None
        current = self.leases.get(p.lease)
        if p.kind is PlanKind.CREATE and current is not None:
            return WriteResult.CONFLICT  # AlreadyExists
        if p.kind in (PlanKind.TAKE, PlanKind.RENEW) and (
            current is None or current.resource_version != p.resource_version
        ):
            return WriteResult.CONFLICT
        self.rv += 1
        self.leases[p.lease] = LeaseRecord(p.lease, str(self.rv), holder, now, TTL)
        self.log.append(f"{holder} {p.kind.value} {p.lease}")
        return WriteResult.OK


@pytest.mark.parametrize(
    ("permits", "seed", "winners"),
    [
        (1, [], 1),  # both create the one Lease: one AlreadyExists
        (1, [LeaseRecord(L0, "5", None, None, None)], 1),  # both update rv 5: one 409
        (2, [], 2),  # two permits: the loser of the first race takes the second
    ],
    ids=["race-on-create", "race-on-update", "two-permits"],
)
def test_two_guardians_racing(permits: int, seed: list[LeaseRecord], winners: int) -> None:
    store = Store({r.name: r for r in seed}, rv=5)
    budget = Budget(permits, permits)
    waits = {g: begin(T0, 1800) for g in ("pod-a", "pod-b")}
    # Both read the same state before either writes.
    plans = {g: plan("llama", g, budget, dict(store.leases), T0) for g in waits}
    assert plans["pod-a"].lease == plans["pod-b"].lease
    for g, w in list(waits.items()):
        waits[g] = settle(w, plans[g], store.write(plans[g], g, T0), "", T0)
    assert [w.status for w in waits.values()] == [WaitStatus.GRANTED, WaitStatus.WAITING]
    assert "409" in waits["pod-b"].reason and due(waits["pod-b"], T0)
    # The loser reads again at once (the next tick).
    now = T0 + 2
    again = plan("llama", "pod-b", budget, dict(store.leases), now)
    waits["pod-b"] = settle(waits["pod-b"], again, store.write(again, "pod-b", now) if again.kind is not PlanKind.NOT_NOW else None, "", now)  # fmt: skip
    granted = [g for g, w in waits.items() if w.status is WaitStatus.GRANTED]
    assert len(granted) == winners, store.log
    holders = {lease.holder for lease in store.leases.values()}
    assert holders == set(granted)


def test_a_dead_holder_frees_its_permit_after_its_ttl() -> None:
    store = Store()
    budget = Budget(1, 1)
    a = plan("llama", "pod-a", budget, store.leases, T0)
    assert store.write(a, "pod-a", T0) is WriteResult.OK
    # pod-a dies (never renews, never releases); pod-b tries every 15 s.
    w = begin(T0, 1800)
    now = T0
    while w.status is WaitStatus.WAITING:
        p = plan("llama", "pod-b", budget, store.leases, now)
        write = store.write(p, "pod-b", now) if p.kind is not PlanKind.NOT_NOW else None
        w = settle(w, p, write, "", now)
        now = max(now + 1, w.next_try_seconds)
    assert w.status is WaitStatus.GRANTED
    assert T0 + TTL <= now - 1 < T0 + TTL + 15 + 1, "taken within one retry of the expiry"
    assert "pod-a stopped renewing" in w.reason


def test_the_wait_is_bounded() -> None:
    """Every try either grants, or moves the next try on (or re-reads once after a 409); a
    held permit that never frees ends in TIMED_OUT at the deadline."""
    store = Store()
    budget = Budget(1, 1)
    store.write(plan("llama", "pod-a", budget, store.leases, T0), "pod-a", T0)
    w: PermitWait = begin(T0, 300)
    now, tries = T0, 0
    while w.status is WaitStatus.WAITING:
        # pod-a renews every 10 s: alive.
        store.leases[L0] = LeaseRecord(L0, "99", "pod-a", now, TTL)
        p = plan("llama", "pod-b", budget, store.leases, now)
        w = settle(w, p, None, "", now)
        tries += 1
        now = max(now + 10, w.next_try_seconds)
    assert w.status is WaitStatus.TIMED_OUT and tries == 21
