"""Three replicas, one disruption budget: the fleet test, as processes on 127.0.0.1.

Three guardians (real ``vllm-guardian run`` processes, container mode, each with its pod's
identity) supervise a vLLM twin each; an admission gate stands in front of each; one fake API
server (tests/fake_apiserver.py) holds the PodDisruptionBudget (``maxUnavailable: 1``) and the
Leases, and a mirror plays the kubelet and the endpoints controller: each pod's readiness is
its guardian's ``/ready/vllm``, which the fake PDB's ``disruptionsAllowed`` follows. A load runs
through every gate; then a voluntary restart falls due on all three at the same moment
(``vllm-guardian restart``, as an operator or a rollout script would). They must run one at a
time, never two at once; no request through any gate fails; the audit records say who held the
permit when.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests

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
from tests.test_gate_support import GateThread
from vllm_guardian.actuators import audit as auditlog
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.policy import DecisionKind
from vllm_guardian.sim.load import LoadResult, OutcomeKind, plan_requests, run_load
from vllm_guardian.sim.scenarios import LoadProfile
from vllm_guardian.tools.demo import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
PODS = ("llama-0", "llama-1", "llama-2")
LEASE = "vllm-guardian-llama-0"


def config(work: Path, vllm_port: int, guardian_port: int, api: str) -> Path:
    twin = [
        sys.executable, "-m", "vllm_guardian.sim", "serve", "--host", "127.0.0.1",
        "--port", str(vllm_port), "--served-model-name", "demo", "--shutdown-timeout", "10",
        "--sim-speed", "20", "--sim-model", "tiny", "--enforce-eager",
    ]  # fmt: skip
    doc = {
        "interval_seconds": 0.5,
        "listen": f"127.0.0.1:{guardian_port}",
        "runtime_dir": str(work / "run"),
        "state_dir": str(work / "state"),
        "recorder": {"path": str(work / "state" / "flight.jsonl")},
        "services": [
            {
                "name": "vllm",
                "url": f"http://127.0.0.1:{vllm_port}",
                "command": twin,
                "log_file": str(work / "vllm.log"),
            }
        ],
        "sources": {"nvml": {"enabled": False}, "unit": {"enabled": True}},
        "policy": {
            "dry_run": True,  # nothing of its own; the operator's restart acts regardless
            "backend": "process",
            "drain_timeout_seconds": 5,
            "startup_grace_seconds": 30,
            "ready_timeout_seconds": 60,
            "vram_release_timeout_seconds": 10,
        },
        "fleet": {
            "permit": "lease",
            "model": "llama",
            "pdb": "llama",
            "api_server": api,
            "namespace": "llm",
            "wait_timeout_seconds": 240,
        },
    }
    path = work / "config.yaml"
    path.write_text(json.dumps(doc))
    return path


def audit(work: Path) -> list[auditlog.Record]:
    return auditlog.read_records(work / "state" / "audit.jsonl")


def ready(url: str) -> bool | None:
    """The guardian's answer; None when it gave none (a slow answer on a busy machine is not a
    "not ready", which would read as a replica down that was not)."""
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return None


def test_three_replicas_restart_one_at_a_time_and_lose_nothing(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.add_pdb("llama", 1, dict.fromkeys(PODS, False))
    samples: list[tuple[float, int, int]] = []  # time, pods not ready, permits held
    who_down: list[tuple[float, str, bool | None]] = []  # time, pod, its answer (None: none)
    stop = threading.Event()
    with fake_apiserver(cluster) as api, ExitStack() as stack:
        replicas = []
        for pod in PODS:
            work = tmp_path / pod
            work.mkdir()
            vllm_port, guardian_port = free_port(), free_port()
            cfg = config(work, vllm_port, guardian_port, api)
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "VLLM_GUARDIAN_CONTAINER": "1",
                "VLLM_GUARDIAN_POD_NAME": pod,
                "VLLM_GUARDIAN_POD_NAMESPACE": "llm",
            }
            out = (work / "guardian.out").open("wb")
            stack.callback(out.close)
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

            def end(p: subprocess.Popen[bytes] = proc) -> None:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(10)

            stack.callback(end)
            replicas.append((pod, work, cfg, vllm_port, guardian_port))

        def mirror() -> None:
            """The kubelet's readiness probe and the disruption controller, every 0.1 s."""
            last: dict[str, bool] = {}
            while not stop.is_set():
                down = 0
                for pod, _, _, _, gport in replicas:
                    answer = ready(f"http://127.0.0.1:{gport}/ready/vllm")
                    ok = last.get(pod, False) if answer is None else answer
                    last[pod] = ok
                    cluster.set_ready("llama", pod, ok)
                    down += not ok
                    if not ok:
                        who_down.append((time.monotonic(), pod, answer))
                with cluster.lock:
                    held = sum(
                        1 for lease in cluster.leases.values() if lease.get("spec", {}).get("holderIdentity")
                    )  # fmt: skip
                samples.append((time.monotonic(), down, held))
                stop.wait(0.1)

        watcher = threading.Thread(target=mirror, daemon=True)
        watcher.start()
        stack.callback(watcher.join, 10)
        stack.callback(stop.set)

        def everyone_ready() -> bool:
            return bool(samples) and samples[-1][1] == 0

        deadline = time.monotonic() + 120
        while not everyone_ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert everyone_ready(), [
            (pod, (work / "guardian.out").read_text(errors="replace")[-1500:])
            for pod, work, *_ in replicas
        ]

        gates = []
        for _, _, _, vport, gport in replicas:
            g = GateThread(
                f"http://127.0.0.1:{vport}", guardian=f"http://127.0.0.1:{gport}",
                max_wait_seconds=90, kv_admission=False,
            )  # fmt: skip
            stack.callback(g.stop)
            gates.append(g)
        profile = LoadProfile(
            rate_per_second=1.0, prompt_tokens_min=20, prompt_tokens_max=60,
            output_tokens_min=8, output_tokens_max=24,
        )  # fmt: skip
        results: dict[int, LoadResult] = {}
        loads = []
        for i, g in enumerate(gates):
            plan = plan_requests(profile, seed=i, max_requests=400, duration_seconds=240)

            def load(i: int = i, url: str = g.url, plan: Any = plan) -> None:
                results[i] = run_load(
                    url, plan, model="demo", speed=1.0, stream=True, max_duration_seconds=240,
                    request_timeout_seconds=120, stop=stop,
                )  # fmt: skip

            t = threading.Thread(target=load, daemon=True)
            t.start()
            loads.append(t)

        def admitted() -> list[float]:
            return [float(g.gate.proxy.status()["admitted_total"]) for g in gates]  # type: ignore[union-attr,arg-type]

        # The load is in (each gate has let requests through) before the restarts are asked for.
        deadline = time.monotonic() + 60
        while min(admitted()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert min(admitted()) >= 2, f"requests admitted by each gate: {admitted()}"

        # The voluntary restart falls due on all three at once.
        def restart(cfg: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "vllm_guardian", "restart", "vllm", "-c", str(cfg), "--no-wait"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip

        asked_at = time.monotonic()
        replies: list[subprocess.CompletedProcess[str]] = []
        askers = [
            threading.Thread(target=lambda c=cfg: replies.append(restart(c)))
            for _, _, cfg, _, _ in replicas
        ]
        for t in askers:
            t.start()
        for t in askers:
            t.join(90)
        assert [r.returncode for r in replies] == [0, 0, 0], [r.stdout + r.stderr for r in replies]

        def done(work: Path) -> bool:
            return any(r.decision.what is DecisionKind.RESULT for r in audit(work))

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(done(w) for _, w, *_ in replicas):
            time.sleep(0.5)
        finished_at = time.monotonic()

        # The last replica's readiness back and nothing held at a gate, then the load stops.
        def settled() -> bool:
            return everyone_ready() and all(
                g.gate.admission is not None and g.gate.admission.queue_depth == 0 for g in gates
            )

        deadline = time.monotonic() + 120
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert settled(), (samples[-1:], [g.gate.proxy.status() for g in gates if g.gate.proxy])
        stop.set()
        for t in loads:
            t.join(150)

    # --- the record --------------------------------------------------------------------------
    timeline = []
    windows = []
    for pod, work, *_ in replicas:
        records = audit(work)
        assert records and all(r.identity.get("pod") == pod for r in records), records[:3]
        decisions = [r.decision for r in records]
        for d in decisions:
            timeline.append((d.time_seconds, pod, d.what.value, d.reason[:110]))
        # Granted: the action left its wait for a permit and began (preparing).
        granted = [
            d.time_seconds
            for d in decisions
            if d.what is DecisionKind.PHASE and d.phase is Phase.PREPARING
        ]
        ended = [d for d in decisions if d.what is DecisionKind.RESULT]
        assert len(granted) == 1 and len(ended) == 1, decisions
        assert ended[0].ok is True, ended[0]
        windows.append((granted[0], ended[0].time_seconds, pod))
    print("\n".join(f"{t:.2f} {pod:8} {what:10} {why}" for t, pod, what, why in sorted(timeline)))
    # The API server's own history: each holder took the one permit once and gave it back
    # before the next took it (a takeover without a release would be an expired holder).
    takers = cluster.holders[0::2]
    assert sorted(takers) == sorted(PODS) and cluster.holders[1::2] == [None] * 3, cluster.holders
    # The audit's windows (permit granted → result) in that order do not overlap. Records carry
    # their tick's snapshot time, up to one tick plus a collection earlier than the event:
    # 2 s of slack for that, far below the 15 s between a refusal and the next try.
    windows.sort(key=lambda w: takers.index(w[2]))
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(windows):
        assert end_a <= start_b + 2.0, f"{a} and {b} were disrupted at once: {windows}"
    # The kubelet's view, sampled every 0.1 s: never two replicas not ready at once.
    during = [s for s in samples if asked_at <= s[0] <= finished_at]
    assert max(s[1] for s in during) <= 1, (
        "two replicas not ready at once",
        [(round(t - asked_at, 1), pod, answer) for t, pod, answer in who_down if t >= asked_at],
    )
    assert max(s[1] for s in during) == 1, "nobody was ever down: nothing was restarted"
    assert max(s[2] for s in during) <= 1
    # A try refused: a second record of the wait for a permit, for the same action.
    waits = Counter(
        (w, r.decision.action_id)
        for _, w, *_ in replicas
        for r in audit(w)
        if r.decision.phase is Phase.AWAITING_PERMIT
    )
    waited = [key for key, n in waits.items() if n > 1]
    assert waited, "nobody had to wait: the three did not contend"
    for i, result in results.items():
        sent = [o for o in result.outcomes if o.kind is not OutcomeKind.NOT_SENT]
        kinds = {k.value: result.count(k) for k in OutcomeKind if result.count(k)}
        print(f"gate {i}: {kinds}")
        assert sent and all(o.kind is OutcomeKind.OK for o in sent), kinds
    assert cluster.holder(LEASE) is None, "the last holder released the permit"
    print(f"three restarts, one at a time, in {finished_at - asked_at:.0f}s")
