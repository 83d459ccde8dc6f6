"""The permit's Kubernetes adapter (actuators/k8s_permit.py) on lightkube, against a fake API server.

The fake (tests/fake_apiserver.py) is a real HTTP server on 127.0.0.1 answering as the API
server does: resourceVersion preconditions and 409s, 404s for missing Leases, the PDB's status
from its pods' readiness. Nothing here has run against a real cluster.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests import hostneeds

try:
    import lightkube  # noqa: F401  # the k8s extra
except ImportError:
    if hostneeds.required():
        raise
    pytest.skip(
        "lightkube is not installed: the Kubernetes permit needs the k8s extra "
        "(pip install 'vllm-guardian[k8s]'; scripts/test installs it)",
        allow_module_level=True,
    )

from tests.fake_apiserver import FakeCluster, fake_apiserver
from vllm_guardian.actuators.k8s_permit import LeasePermits
from vllm_guardian.core.permit import PermitWait, WaitStatus, begin

L0 = "vllm-guardian-llama-0"
PODS = {"llama-a": True, "llama-b": True, "llama-c": True}


@pytest.fixture
def cluster() -> FakeCluster:
    c = FakeCluster()
    c.add_pdb("llama", 1, PODS)
    return c


@pytest.fixture
def url(cluster: FakeCluster) -> Iterator[str]:
    with fake_apiserver(cluster) as u:
        yield u


def permits(url: str, holder: str, ttl: float = 900) -> LeasePermits:
    return LeasePermits.connect(
        "llama", "llama", holder, ttl, server=url, namespace="llm", token="t0ken"
    )


def test_granted_creates_the_lease_with_holder_and_ttl(cluster: FakeCluster, url: str) -> None:
    now = time.time()
    w = permits(url, "llama-a").try_once(begin(now, 60), now)
    assert w.status is WaitStatus.GRANTED and w.lease == L0, w.reason
    lease = cluster.leases[L0]
    assert lease["spec"]["holderIdentity"] == "llama-a"
    assert lease["spec"]["leaseDurationSeconds"] == 900
    renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
    assert abs(renewed.timestamp() - now) < 1
    assert cluster.requests == [
        ("GET", "/apis/policy/v1/namespaces/llm/poddisruptionbudgets/llama", 200),
        ("GET", f"/apis/coordination.k8s.io/v1/namespaces/llm/leases/{L0}", 404),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/llm/leases", 201),
    ]
    assert cluster.tokens == {"Bearer t0ken"}


def test_held_by_another_is_not_now_and_says_who(cluster: FakeCluster, url: str) -> None:
    now = time.time()
    assert permits(url, "llama-a").try_once(begin(now, 60), now).status is WaitStatus.GRANTED
    w = permits(url, "llama-b").try_once(begin(now, 60), now)
    assert w.status is WaitStatus.WAITING
    assert f"{L0} by llama-a" in w.reason and w.next_try_seconds > now


def test_a_spent_budget_is_not_now(cluster: FakeCluster, url: str) -> None:
    cluster.set_ready("llama", "llama-c", False)  # a node drain or a rollout took one replica
    now = time.time()
    w = permits(url, "llama-a").try_once(begin(now, 60), now)
    assert w.status is WaitStatus.WAITING and "disruptionsAllowed 0" in w.reason
    assert L0 not in cluster.leases


def test_a_lost_race_is_a_409_then_not_now(cluster: FakeCluster, url: str) -> None:
    now = time.time()
    cluster.leases[L0] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": L0, "namespace": "llm", "resourceVersion": "50"},
        "spec": {},
    }

    def other_writer_wins(c: FakeCluster, name: str) -> None:
        c.leases[name]["metadata"]["resourceVersion"] = c.bump()
        c.leases[name]["spec"] = {
            "holderIdentity": "llama-b",
            "renewTime": datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "leaseDurationSeconds": 900,
        }
        c.before_put = None

    cluster.before_put = other_writer_wins
    p = permits(url, "llama-a")
    w = p.try_once(begin(now, 60), now)
    assert w.status is WaitStatus.WAITING and "409" in w.reason
    assert w.next_try_seconds == now, "a conflict reads again at once"
    w = p.try_once(w, now + 1)
    assert w.status is WaitStatus.WAITING and "by llama-b" in w.reason
    assert cluster.holder(L0) == "llama-b"


def test_a_dead_holders_lease_is_taken_after_its_ttl(cluster: FakeCluster, url: str) -> None:
    t0 = time.time()
    assert permits(url, "llama-b", ttl=30).try_once(begin(t0, 60), t0).status is WaitStatus.GRANTED
    # llama-b's guardian dies: it never renews nor releases. Before the TTL: not now.
    a = permits(url, "llama-a")
    w = a.try_once(begin(t0 + 10, 600), t0 + 10)
    assert w.status is WaitStatus.WAITING
    w = a.try_once(w, t0 + 31)
    assert w.status is WaitStatus.GRANTED and "llama-b stopped renewing" in w.reason
    assert cluster.holder(L0) == "llama-a"


def test_release_frees_the_permit_for_the_next(cluster: FakeCluster, url: str) -> None:
    now = time.time()
    a = permits(url, "llama-a")
    assert a.try_once(begin(now, 60), now).status is WaitStatus.GRANTED
    assert a.release(now + 1) == (L0,)
    assert cluster.holder(L0) is None
    assert permits(url, "llama-b").try_once(begin(now, 60), now + 2).status is WaitStatus.GRANTED
    assert a.release(now + 3) == (), "not ours any more: left alone"
    assert cluster.holder(L0) == "llama-b"


def test_an_unreachable_api_server_is_waited_on_never_raised(free_port: int) -> None:
    p = permits(f"http://127.0.0.1:{free_port}", "llama-a")
    now = time.time()
    w = p.try_once(begin(now, 60), now)
    assert w.status is WaitStatus.WAITING and "did not answer" in w.reason
    assert p.release(now) == ()


def test_three_guardians_one_permit_never_two_disrupted_at_once(
    cluster: FakeCluster, url: str
) -> None:
    """Three replicas' guardians want a voluntary relaunch at the same moment. Each waits for
    the permit, "relaunches" (its pod unready, as the readiness probe would make it), becomes
    ready, releases. Never two at once; all three get their turn; the log says who held when."""
    lock = threading.Lock()
    in_action: set[str] = set()
    overlaps: list[set[str]] = []
    audit: list[tuple[str, str, float]] = []
    start = threading.Barrier(3)
    deadline = time.time() + 60

    def guardian(pod: str) -> None:
        p = permits(url, pod)
        start.wait(10)
        w: PermitWait = begin(time.time(), 60)
        while w.status is WaitStatus.WAITING and time.time() < deadline:
            w = p.try_once(w, time.time())
            if w.status is WaitStatus.WAITING:
                time.sleep(0.05)  # the next tick; the wait's own retry is 15 s, too long here
                w = PermitWait(w.since_seconds, w.deadline_seconds, time.time(), attempts=w.attempts, reason=w.reason)  # fmt: skip
        with lock:
            audit.append((pod, f"permit {w.status.value}: {w.reason}", time.time()))
        if w.status is not WaitStatus.GRANTED:
            return
        with lock:
            in_action.add(pod)
            if len(in_action) > 1:
                overlaps.append(set(in_action))
        cluster.set_ready("llama", pod, False)  # draining, relaunching, loading
        time.sleep(0.2)
        cluster.set_ready("llama", pod, True)
        with lock:
            in_action.discard(pod)
            audit.append((pod, "released " + ",".join(p.release(time.time())), time.time()))

    threads = [threading.Thread(target=guardian, args=(pod,)) for pod in PODS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(70)
    log = "\n".join(f"{t:.3f} {pod}: {what}" for pod, what, t in sorted(audit, key=lambda a: a[2]))
    assert overlaps == [], log
    granted = [pod for pod, what, _ in audit if what.startswith("permit granted")]
    assert sorted(granted) == sorted(PODS), log
    assert sum(1 for _, what, _ in audit if what == f"released {L0}") == 3, log


def _lease_gets(cluster: FakeCluster) -> int:
    return sum(1 for m, path, _ in cluster.requests if m == "GET" and "/leases/" in path)


def test_a_huge_max_unavailable_bounds_the_work_of_one_try(cluster: FakeCluster, url: str) -> None:
    """maxUnavailable 20,000 made one try read 20,000 Leases (20,015 GETs in 30 s), and the
    try outlived its phase. One try reads at most MAX_PERMITS Leases."""
    from vllm_guardian.core.permit import MAX_PERMITS

    cluster.add_pdb("llama", 20_000, PODS)
    now = time.time()
    p = permits(url, "llama-a")
    w = p.try_once(begin(now, 60), now)
    assert w.status is WaitStatus.GRANTED, w.reason
    assert _lease_gets(cluster) <= MAX_PERMITS
    cluster.requests.clear()
    ok, _, detail = p.release_all(now + 1)
    assert ok and L0 in detail
    assert _lease_gets(cluster) <= MAX_PERMITS
    # Every permit held by others: still at most MAX_PERMITS reads, and it says so.
    for k in range(MAX_PERMITS):
        assert permits(url, f"other-{k}").try_once(begin(now, 60), now).status is WaitStatus.GRANTED
    cluster.requests.clear()
    w = p.try_once(begin(now, 60), now)
    assert w.status is WaitStatus.WAITING and f"all {MAX_PERMITS} permits held" in w.reason
    assert _lease_gets(cluster) <= MAX_PERMITS


def test_a_renewed_permit_outlives_its_first_ttl(cluster: FakeCluster, url: str) -> None:
    """An action longer than its Lease renews it (core/phases: the phase's renewal is one more
    try, which plans RENEW for a Lease this holder has): the try writes a new renewTime, so
    another replica's guardian cannot take the permit while the action lasts, and takes it one
    TTL after the last renewal (the holder died mid-action)."""
    now = time.time()
    a, b = permits(url, "llama-a", ttl=60), permits(url, "llama-b", ttl=60)
    assert a.acquire(now)[0]
    granted, _, detail = a.acquire(now + 40)  # the renewal, before the Lease lapses
    assert granted and "ours already" in detail, detail
    # A renewal moves renewTime only: acquireTime says since when this holder has held it
    # (what `kubectl get lease -o yaml` shows an operator), leaseTransitions is unchanged.
    spec = cluster.leases[L0]["spec"]
    assert abs(_seconds(spec["renewTime"]) - (now + 40)) < 1, spec
    assert abs(_seconds(spec["acquireTime"]) - now) < 1, spec
    assert spec.get("leaseTransitions", 0) == 0, spec
    # Past the first TTL (now + 60), inside the renewed one (now + 100): still llama-a's.
    w = b.try_once(begin(now + 70, 60), now + 70)
    assert w.status is WaitStatus.WAITING and cluster.holder(L0) == "llama-a", w.reason
    w = b.try_once(begin(now + 101, 60), now + 101)
    assert w.status is WaitStatus.GRANTED and "llama-a stopped renewing" in w.reason, w.reason
    assert cluster.holder(L0) == "llama-b"
    # Taken from another holder: acquired now, one transition more.
    spec = cluster.leases[L0]["spec"]
    assert abs(_seconds(spec["acquireTime"]) - (now + 101)) < 1, spec
    assert spec["leaseTransitions"] == 1, spec


def _seconds(k8s_time: str) -> float:
    return datetime.fromisoformat(k8s_time.replace("Z", "+00:00")).timestamp()


def test_one_try_ends_within_its_time_budget(cluster: FakeCluster, url: str) -> None:
    """A slow API server: each call takes 5 s on the adapter's clock (a fake one, read before
    each call). A try given 30 s starts no call that could end past them (each may take the
    client's timeout), stops and says why: the thread ends with its phase."""
    import itertools

    from vllm_guardian.actuators import k8s_permit

    cluster.add_pdb("llama", 8, PODS)
    ticks = itertools.count(0.0, 5.0)
    p = permits(url, "llama-a")
    p.monotonic = lambda: next(ticks)
    now = time.time()
    granted, terminal, detail = p.acquire(now, timeout_seconds=30.0)
    assert not granted and not terminal
    assert "out of time" in detail, detail
    calls = len(cluster.requests)
    # Started at 0 s: a call may start while it can end by 30 s, at most 20 s in (10 s each).
    assert calls <= int((30.0 - k8s_permit.TIMEOUT_SECONDS) / 5.0) + 1, cluster.requests
    assert cluster.holder(L0) is None, "nothing written past the budget"


def test_the_daemon_never_imports_the_adapter() -> None:
    """With the default fleet.permit (none) nothing loads lightkube."""
    code = "import sys, vllm_guardian.shell.daemon, vllm_guardian.tools.cli; print(sorted(m for m in sys.modules if m.startswith(('lightkube', 'httpx2', 'vllm_guardian.actuators.k8s'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_the_executor_takes_and_gives_back_the_permit(
    cluster: FakeCluster, url: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The wiring: the policy's Op.PERMIT / Op.RELEASE_PERMIT through OpRunner to the adapter,
    built by the healing layer from fleet: {permit: lease, ...} as a pod's guardian would."""
    from vllm_guardian.actuators.executor import OpRunner
    from vllm_guardian.config import parse_config
    from vllm_guardian.lowio.clock import SystemClock
    from vllm_guardian.model import Op, OpRequest
    from vllm_guardian.shell.healing import Healing

    cfg = parse_config(
        "services:\n  - name: vllm\n"
        f"fleet:\n  permit: lease\n  model: llama\n  pdb: llama\n  api_server: {url}\n  namespace: llm\n"
    )
    backend = Healing._fleet_permits(cfg)
    assert isinstance(backend, LeasePermits)
    runner = OpRunner(SystemClock(), tmp_path, {}, permits=backend)

    def run(op: Op) -> tuple[bool, str]:
        runner.start(OpRequest(1, "vllm", op))
        runner.join(30)
        (r,) = runner.take_results()
        return r.ok, r.detail

    ok, detail = run(Op.PERMIT)
    assert ok and cluster.holder(L0) == backend.holder, detail
    ok, detail = run(Op.RELEASE_PERMIT)
    assert ok and detail == f"released {L0}" and cluster.holder(L0) is None
    cluster.set_ready("llama", "llama-b", False)
    ok, detail = run(Op.PERMIT)
    assert not ok and "disruptionsAllowed 0" in detail
    assert OpRunner(SystemClock(), tmp_path, {}).permits is None
    no_backend = OpRunner(SystemClock(), tmp_path, {})
    no_backend.start(OpRequest(1, "vllm", Op.PERMIT))
    no_backend.join(30)
    (r,) = no_backend.take_results()
    assert not r.ok and r.terminal, "asked for a permit with no backend: a person must look"
