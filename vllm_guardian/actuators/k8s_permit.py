"""Actuator: the fleet permit's Kubernetes edge (Lease objects and the PDB).

Where it sits: the act stage, only when ``fleet.permit`` is ``lease`` (the daemon never imports
this module otherwise; lightkube comes with the ``k8s`` extra). It reads the
PodDisruptionBudget and the Leases ``vllm-guardian-<model>-<k>``, lets the pure
``core/permit.plan`` choose, writes that one Lease with the ``resourceVersion`` it read as the
precondition, and hands the answer to ``core/permit.settle``. It never raises into the loop:
a 409 is a lost race, a 429 a spent budget, anything else an error the wait retries later.

One try is bounded: it reads at most ``core/permit.MAX_PERMITS`` Leases, and given a time
budget (the executor passes its call's timeout) it starts no API call that could end past it
(each may take :data:`TIMEOUT_SECONDS`), so its thread ends within the phase that asked.

This adapter has run against a protocol-level fake (tests/fake_apiserver.py), not a real
cluster.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.policy_v1 import PodDisruptionBudget

from vllm_guardian.core.permit import (
    Budget,
    LeaseRecord,
    PermitWait,
    Plan,
    PlanKind,
    WaitStatus,
    WriteResult,
    begin,
    lease_names,
    plan,
    release_plan,
    settle,
)

log = logging.getLogger("vllm_guardian.k8s_permit")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TIMEOUT_SECONDS = 10.0  # one API call


class OutOfTime(Exception):
    """The try's time budget cannot fit one more API call."""


def _unix(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _classify(e: Exception) -> tuple[WriteResult, str]:
    if isinstance(e, ApiError):
        code = e.status.code
        text = f"{code} {e.status.reason or ''}: {e.status.message or ''}".strip()
        if code == 409:
            return WriteResult.CONFLICT, text
        if code == 429:
            return WriteResult.EXHAUSTED, text
        return WriteResult.ERROR, text
    return WriteResult.ERROR, f"{type(e).__name__}: {e}"


class LeasePermits:
    """One guardian's side of the fleet permit (one model's Leases, one PDB, one namespace)."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        model: str,
        pdb: str,
        holder: str,
        ttl_seconds: float,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.model = model
        self.pdb = pdb
        self.holder = holder
        self.ttl_seconds = ttl_seconds
        # The clock the time budget of a try is measured on (a test's fake one).
        self.monotonic: Callable[[], float] = time.monotonic

    def _deadline(self, budget_seconds: float) -> float:
        return self.monotonic() + budget_seconds

    def _call(self, deadline: float) -> None:
        """Before each API call: one more must fit the try's time budget (``deadline``, on
        :attr:`monotonic`; a try and a release may run at once, each with its own)."""
        if self.monotonic() + TIMEOUT_SECONDS > deadline:
            raise OutOfTime("the try ran out of time before its next API call")

    @classmethod
    def connect(
        cls,
        model: str,
        pdb: str,
        holder: str,
        ttl_seconds: float,
        server: str | None = None,
        namespace: str | None = None,
        token: str | None = None,
    ) -> LeasePermits:
        """In the pod: the service account's token, CA and namespace. ``server`` and ``token``
        (tests; an API server reached without a kubeconfig) skip the service account."""
        if server is not None:
            config = KubeConfig.from_one(
                cluster=Cluster(server=server),
                user=User(token=token) if token else User(),
                namespace=namespace,
            )
        else:
            config = KubeConfig.from_service_account()
        ns = namespace or SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        client = Client(
            config,
            namespace=ns,
            timeout=httpx2.Timeout(TIMEOUT_SECONDS),
            trust_env=False,  # the API server is reached directly, never through $HTTP_PROXY
            field_manager="vllm-guardian",
        )
        return cls(client, ns, model, pdb, holder, ttl_seconds)

    # --- reads ------------------------------------------------------------------------------

    def read_budget(self, deadline: float = math.inf) -> Budget:
        self._call(deadline)
        pdb = self.client.get(PodDisruptionBudget, self.pdb, namespace=self.namespace)
        spec, status = pdb.spec, pdb.status
        # No status yet (the controller has not seen it): no disruption allowed.
        allowed = (status.disruptionsAllowed or 0) if status is not None else 0
        max_unavailable = spec.maxUnavailable if spec is not None else None
        if isinstance(max_unavailable, int):
            permits = max_unavailable
        elif status is not None:  # a percentage or minAvailable: what the controller computed
            permits = max(0, (status.expectedPods or 0) - (status.desiredHealthy or 0))
        else:
            permits = 0
        return Budget(permits=permits, disruptions_allowed=allowed)

    def read_leases(self, permits: int, deadline: float = math.inf) -> dict[str, LeaseRecord]:
        out: dict[str, LeaseRecord] = {}
        for name in lease_names(self.model, permits):
            self._call(deadline)
            try:
                lease = self.client.get(Lease, name, namespace=self.namespace)
            except ApiError as e:
                if e.status.code == 404:
                    continue
                raise
            spec = lease.spec or LeaseSpec()
            meta = lease.metadata or ObjectMeta()
            out[name] = LeaseRecord(
                name=name,
                resource_version=meta.resourceVersion or "",
                holder=spec.holderIdentity or None,
                renew_seconds=_unix(spec.renewTime or spec.acquireTime),
                duration_seconds=None
                if spec.leaseDurationSeconds is None
                else float(spec.leaseDurationSeconds),
                acquire_seconds=_unix(spec.acquireTime),
                transitions=spec.leaseTransitions or 0,
            )
        return out

    # --- writes -----------------------------------------------------------------------------

    def _lease(
        self, name: str, rv: str | None, holder: str | None, now: float, read: LeaseRecord | None
    ) -> Lease:
        """The Lease to write (``rv``: the resourceVersion it replaces, None: a new one), held
        by ``holder`` (None: released) from ``now``, over ``read`` (the Lease as read). As
        Kubernetes' own leader election writes it: a renewal by its holder moves renewTime
        only; a new holder sets acquireTime and counts a transition."""
        when = _time(now) if holder else None
        acquired, transitions = when, 0
        if read is not None:
            transitions = read.transitions
            if holder and read.holder == holder:  # a renewal: held since its first acquire
                if read.acquire_seconds is not None:
                    acquired = _time(read.acquire_seconds)
            elif holder and read.holder:  # taken from another holder
                transitions += 1
        return Lease(
            metadata=ObjectMeta(name=name, namespace=self.namespace, resourceVersion=rv),
            spec=LeaseSpec(
                holderIdentity=holder,
                acquireTime=acquired,
                renewTime=when,
                leaseDurationSeconds=int(self.ttl_seconds) if holder else None,
                leaseTransitions=transitions,
            ),
        )

    def _write(
        self, p: Plan, read: LeaseRecord | None, now: float, deadline: float
    ) -> tuple[WriteResult, str]:
        assert p.lease is not None
        try:
            self._call(deadline)
            if p.kind is PlanKind.CREATE:
                self.client.create(self._lease(p.lease, None, self.holder, now, None))
            else:
                self.client.replace(
                    self._lease(p.lease, p.resource_version, self.holder, now, read)
                )
        except Exception as e:  # classified: the loop never sees an exception
            return _classify(e)
        return WriteResult.OK, ""

    def try_once(self, w: PermitWait, now: float, budget_seconds: float = math.inf) -> PermitWait:
        """Read, plan, write: one try of the wait, within ``budget_seconds``. Never raises."""
        deadline = self._deadline(budget_seconds)
        try:
            budget = self.read_budget(deadline)
            leases = self.read_leases(budget.permits, deadline)
        except Exception as e:
            _, detail = _classify(e)
            log.warning("permit: cannot read the PDB or the Leases: %s", detail)
            return settle(w, Plan(PlanKind.NOT_NOW, None, None, "read failed"), None, detail, now)
        p = plan(self.model, self.holder, budget, leases, now)
        if p.kind is PlanKind.NOT_NOW:
            return settle(w, p, None, "", now)
        write, detail = self._write(p, leases.get(p.lease or ""), now, deadline)
        return settle(w, p, write, detail, now)

    def acquire(self, now: float, timeout_seconds: float = math.inf) -> tuple[bool, bool, str]:
        """One try, for the executor's PERMIT op (the phase AWAITING_PERMIT does the waiting):
        (granted, terminal, detail), within ``timeout_seconds``. Never raises."""
        # A wait with no deadline of its own: the phase AWAITING_PERMIT owns the deadline.
        w = self.try_once(begin(now, math.inf), now, timeout_seconds)
        return w.status is WaitStatus.GRANTED, False, f"{self.holder}: {w.reason}"

    def release_all(self, now: float, timeout_seconds: float = math.inf) -> tuple[bool, bool, str]:
        """The executor's RELEASE_PERMIT op. Never raises; a permit not released expires."""
        names = self.release(now, timeout_seconds)
        return True, False, ("released " + ", ".join(names)) if names else "nothing held"

    def release(self, now: float, timeout_seconds: float = math.inf) -> tuple[str, ...]:
        """Give back every permit this holder holds. Never raises; a Lease that changed since it
        was read (409) is someone else's now and is left alone."""
        deadline = self._deadline(timeout_seconds)
        try:
            leases = self.read_leases(self.read_budget(deadline).permits, deadline)
        except Exception as e:
            log.warning("permit: cannot read the Leases to release them: %s", _classify(e)[1])
            return ()
        released: list[str] = []
        for lease in release_plan(self.holder, leases):
            try:
                self._call(deadline)
                self.client.replace(
                    self._lease(lease.name, lease.resource_version, None, now, lease)
                )
            except Exception as e:
                log.warning("permit: %s not released: %s", lease.name, _classify(e)[1])
                continue
            released.append(lease.name)
        return tuple(released)

    def close(self) -> None:
        self.client.close()
