"""The gate on more than one core: N worker processes on one port, one gate as seen from outside.

* the shares: every limit split evenly over the workers, summing to the configured limit, none
  0; the default count from the host; limits that cannot be split named with key and line;
* the merged status: counts summed, ages the oldest, open only while every worker is;
* real processes on loopback in front of the scriptable stub (2 workers): both serve, the held
  queue's global bound holds under a burst, the guardian's gate source reads the sum, SIGTERM
  drains the in-flight requests of every worker, a killed worker is replaced and its requests
  counted as lost, SIGHUP replaces every worker while the in-flight ones finish;
* a silent worker: killed as wedged unless the kernel's account (/proc/<pid>/schedstat) says it
  waited for a CPU most of its silence (starved by the host: left alone, said once a minute).

The kernel spreads connections over the workers by a hash of each connection (SO_REUSEPORT):
where a test needs both workers to get some of a burst, the burst is 16 or more connections,
so one worker getting all of them (or all but one) is a chance of about 1 in 30,000.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for
from tests.test_gate_deploy import free_port
from tests.test_gate_support import Stub
from vllm_guardian.config import (
    ConfigInvalid,
    GateConfig,
    GateSourceConfig,
    SplitLimits,
    parse_config,
)
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import GateSettings, split_settings
from vllm_guardian.gate.supervisor import (
    Silence,
    Supervisor,
    _Worker,
    judge_silence,
    read_schedstat,
)
from vllm_guardian.gate.workers import (
    ControlServer,
    cpu_count_allowed,
    default_workers,
    merge_metrics,
    merge_status,
    share,
)
from vllm_guardian.lowio.procfs import parse_schedstat
from vllm_guardian.model import GateObservation
from vllm_guardian.sources.gate import GateCollector

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024

# --- the shares --------------------------------------------------------------------------------


def test_a_worker_that_stops_while_a_sibling_asks_logs_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sibling connected to a worker's control socket and not done asking when the worker's
    loop ends (a reload retires it): the handler's task is cancelled, and that is the end of
    the exchange, not an error. (On Python 3.11 asyncio's callback for a connection's handler
    calls ``exception()`` on its task, which raises for a cancelled one: a traceback in the
    gate's log, which its tests fail on.)"""

    async def main() -> None:
        server = ControlServer(tmp_path, lambda: {"in_flight": 0}, lambda: b"")
        await server.start()
        # Asks nothing yet: the handler waits for its line when asyncio.run ends the loop.
        _, writer = await asyncio.open_unix_connection(str(server.path))
        await asyncio.sleep(0.2)
        del writer

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


@pytest.mark.parametrize(
    ("total", "workers", "shares"),
    [(1024, 4, [256, 256, 256, 256]), (10, 4, [3, 3, 2, 2]), (4, 4, [1, 1, 1, 1]),
     (5, 2, [3, 2]), (0, 3, [0, 0, 0]), (7, 1, [7])],
)  # fmt: skip
def test_the_shares_sum_to_the_limit_and_differ_by_one_at_most(
    total: int, workers: int, shares: list[int]
) -> None:
    assert [share(total, i, workers) for i in range(workers)] == shares
    assert sum(shares) == total


def test_a_workers_settings_are_its_share_of_every_global_limit() -> None:
    s = GateSettings(
        proxy=ProxySettings(upstream="http://127.0.0.1:8000", body_budget_bytes=256 * MIB),
        limits=Limits(max_queue_requests=10, max_queued_tokens=1001, release_rate_per_second=50,
                      release_burst=3, per_key_share_ratio=0.25, max_wait_seconds=60),
        max_connections=4096,
    )  # fmt: skip
    parts = [split_settings(s, i, 3) for i in range(3)]
    assert [p.limits.max_queue_requests for p in parts] == [4, 3, 3]
    assert [p.limits.max_queued_tokens for p in parts] == [334, 334, 333]
    assert [p.limits.release_burst for p in parts] == [1, 1, 1]
    assert sum(p.limits.release_rate_per_second for p in parts) == pytest.approx(50)
    assert sum(p.proxy.body_budget_bytes for p in parts) == 256 * MIB
    assert sum(p.max_connections for p in parts) == 4096
    # What is not a bound stays as given: the per-key share is a ratio of each worker's queue.
    assert {(p.limits.per_key_share_ratio, p.limits.max_wait_seconds) for p in parts} == {
        (0.25, 60)
    }


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "cpus"),
    [(16, None, 16), (16, "max 100000", 16), (16, "250000 100000", 3), (16, "50000 100000", 1),
     (2, "800000 100000", 2), (4, "garbage", 4)],
)  # fmt: skip
def test_the_cpus_allowed_are_the_affinity_and_the_cgroups_limit(
    affinity: int, cpu_max: str | None, cpus: int
) -> None:
    assert cpu_count_allowed(affinity, cpu_max) == cpus


@pytest.mark.parametrize(
    ("cpus", "limits", "workers"),
    [
        (1, {}, 1),
        (2, {}, 2),
        (16, {}, 4),  # capped: every worker polls vLLM on its own
        (16, {"max_queue_requests": 3}, 3),
        (16, {"max_queue_requests": 0}, 4),  # 0: refuse at once, splits to 0 everywhere
        (16, {"body_budget_bytes": 64 * MIB}, 2),  # a largest body (32 MiB) per worker
        (16, {"kv_admission": True}, 1),
    ],
)
def test_the_default_count_comes_from_the_host_and_what_the_limits_allow(
    cpus: int, limits: dict[str, Any], workers: int
) -> None:
    values: dict[str, Any] = {
        "max_queue_requests": 1024, "max_queued_tokens": 1_000_000,
        "body_budget_bytes": 256 * MIB, "max_body_bytes": 32 * MIB, "kv_admission": False,
    }  # fmt: skip
    assert default_workers(cpus, SplitLimits(**{**values, **limits})) == workers


@pytest.mark.parametrize(
    ("gate_yaml", "line", "message"),
    [
        ("      workers: 3\n      max_queue_requests: 2\n", 7, "max_queue_requests (2) must be at least workers (3)"),
        ("      workers: 2\n      kv_admission: true\n", 7, "kv_admission needs workers: 1"),
        ("      workers: 16\n", 7, "body_budget_bytes / workers (16MiB) must be at least max_body_bytes (32MiB)"),
        ("      workers: 65\n", 7, "must be <= 64"),
    ],
)  # fmt: skip
def test_limits_that_cannot_be_split_are_named_with_key_and_line(
    gate_yaml: str, line: int, message: str
) -> None:
    text = (
        "listen: 127.0.0.1:9469\nservices:\n  - name: vllm\n    url: http://127.0.0.1:8000\n"
        "    gate:\n      listen: 127.0.0.1:8001\n" + gate_yaml
    )
    with pytest.raises(ConfigInvalid) as e:
        parse_config(text)
    shown = str(e.value)
    assert f"<config>:{line}: services[0].gate.workers: " in shown, shown
    assert message in shown, shown


def test_the_config_default_is_one_process() -> None:
    """The form the outcome benchmarks and the real vLLM tier measure; more is opt-in."""
    assert GateConfig().workers == 1


# --- the merged status ---------------------------------------------------------------------------


def test_the_status_sums_the_workers_and_is_open_only_when_all_are() -> None:
    a = {"service": "vllm", "pid": 11, "open": True, "reason": "open", "in_flight": 3,
         "queue_depth": 0, "admitted_total": 7, "oldest_wait_seconds": 0.0,
         "oldest_unanswered_seconds": 1.5, "upstream_healthy": True, "guardian_ready": True,
         "kv_capacity_tokens": None, "loop_lag_max_seconds": 0.01}  # fmt: skip
    b = {**a, "pid": 12, "open": False, "reason": "guardian: draining", "in_flight": 2,
         "queue_depth": 4, "admitted_total": 5, "oldest_wait_seconds": 2.0,
         "oldest_unanswered_seconds": 0.5, "guardian_ready": False,
         "loop_lag_max_seconds": 1.25, "cpu_busy_share": 0.93}  # fmt: skip
    m = merge_status([a, b], 3, {"restarts_total": 1, "lost_requests_total": 2})
    assert (m["in_flight"], m["queue_depth"], m["admitted_total"]) == (5, 4, 12)
    assert (m["oldest_wait_seconds"], m["oldest_unanswered_seconds"]) == (2.0, 1.5)
    assert m["loop_lag_max_seconds"] == 1.25  # the slowest worker's
    assert m["cpu_busy_share"] == 0.93  # the busiest worker's (a's is not known yet)
    assert merge_status([a, a], 2, None)["cpu_busy_share"] is None  # no worker can say yet
    assert (m["open"], m["reason"], m["guardian_ready"]) == (False, "guardian: draining", False)
    assert (m["workers"], m["workers_answered"]) == (3, 2)
    assert (m["worker_restarts_total"], m["worker_lost_requests_total"]) == (1, 2)
    assert [w["pid"] for w in m["per_worker"]] == [11, 12]  # type: ignore[attr-defined]


def test_the_metrics_sum_the_workers_series_and_open_is_the_least() -> None:
    a, b = GateMetrics("vllm"), GateMetrics("vllm")
    a.set_open(True)
    b.set_open(False)
    a.admitted.inc(3)
    b.admitted.inc(4)
    b.rejected.labels("queue_full").inc(2)
    a.kv_capacity_tokens.set(8192)
    b.kv_capacity_tokens.set(8192)
    a.wait_seconds.observe(0.2)
    b.wait_seconds.observe(7.0)
    merged = merge_metrics([a.render().decode(), b.render().decode()]).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(merged)
        for s in fam.samples
    }
    svc = (("service", "vllm"),)
    assert got[("vllm_guardian_gate_open", svc)] == 0
    assert got[("vllm_guardian_gate_admitted_total", svc)] == 7
    assert got[("vllm_guardian_gate_rejected_total", (("reason", "queue_full"), *svc))] == 2
    assert got[("vllm_guardian_gate_kv_capacity_tokens", svc)] == 8192
    assert got[("vllm_guardian_gate_wait_seconds_count", svc)] == 2
    assert got[("vllm_guardian_gate_wait_seconds_bucket", (("le", "0.25"), *svc))] == 1
    assert got[("vllm_guardian_gate_wait_seconds_sum", svc)] == pytest.approx(7.2)


# --- real workers on loopback --------------------------------------------------------------------


class Workers:
    """``vllm-guardian gate -c CONFIG`` with ``workers: 2``: the parent process, its status."""

    def __init__(self, stub: Stub, directory: Path, extra: str = "") -> None:
        self.port = free_port()
        self.cfg = directory / "config.yaml"
        # The stub doubles as the guardian (/ready/vllm), so a test can close the front door.
        self.cfg.write_text(
            f"listen: 127.0.0.1:{stub.port}\nservices:\n  - name: vllm\n"
            f"    url: http://127.0.0.1:{stub.port}\n    gate:\n"
            f"      listen: 127.0.0.1:{self.port}\n      workers: 2\n"
            f"      release_rate_per_second: 0\n{extra}"
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "gate.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_guardian", "gate", "-c", str(self.cfg), "--service", "vllm"],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.pool = ThreadPoolExecutor(48)
        try:
            wait_for(
                lambda: self.status()["workers_answered"] == 2, "both workers up", seen=self.seen
            )
        except BaseException:
            # The test never gets the object to stop: a gate left running here outlived the
            # session and took CPU from every later test and benchmark on the host.
            self.stop()
            raise

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(f"{self.url}/gate/status", timeout=5).json()
        return doc

    def seen(self) -> str:
        try:
            return repr(self.status())
        except (OSError, ValueError) as e:
            return f"no status ({e!r}); log: {self.log.read_text()[-3000:]}"

    def pids(self) -> set[int]:
        return {int(w["pid"]) for w in self.status()["per_worker"]}

    def post(self, path: str, n: int) -> list[Future[requests.Response]]:
        # One connection each (no session): the kernel picks a worker per connection.
        return [
            self.pool.submit(requests.post, f"{self.url}{path}", json={"prompt": "x"}, timeout=120)
            for _ in range(n)
        ]

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pool.shutdown(wait=False, cancel_futures=True)
        return self.log.read_text()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.set_release()
    s.stop()


def close_the_front_door(stub: Stub) -> None:
    """The guardian says draining and vLLM's /health says 503: a worker that misses the
    guardian's answer on a busy host (an unreachable guardian does not close the gate) still
    holds, on vLLM's own."""
    stub.ready = stub.healthy = False


def codes(futures: list[Future[requests.Response]]) -> list[int]:
    return sorted(f.result(timeout=120).status_code for f in futures)


def per_worker(gate: Workers, key: str) -> list[int]:
    return [int(w[key]) for w in gate.status()["per_worker"]]


@pytest.mark.slow
def test_two_workers_serve_hold_one_bound_and_report_one_sum(stub: Stub, tmp_path: Path) -> None:
    gate = Workers(stub, tmp_path, "      max_queue_requests: 4\n")
    try:
        # Served by both: count per worker pid.
        assert codes(gate.post("/v1/echo", 24)) == [200] * 24
        admitted = per_worker(gate, "admitted_total")
        assert sum(admitted) == 24 and min(admitted) > 0, admitted
        # The gate's own /metrics, whichever worker answers it, counts both.
        metrics = requests.get(f"{gate.url}/metrics", timeout=5).text
        assert 'vllm_guardian_gate_admitted_total{service="vllm"} 24.0' in metrics, metrics
        # Two processes, each with its own CPU clock: VllmGateBusy divides the one by the other.
        assert 'vllm_guardian_gate_processes{service="vllm"} 2.0' in metrics, metrics
        cpu = [line for line in metrics.splitlines() if line.startswith(
            'vllm_guardian_gate_cpu_seconds_total{service="vllm"}')]  # fmt: skip
        assert len(cpu) == 1 and float(cpu[0].split()[-1]) > 0, cpu

        # The guardian closes the front door; a burst of 20 against a bound of 4 (2 a worker):
        # exactly 4 held, the other 16 answered 503 at once, as a single gate answers them.
        close_the_front_door(stub)
        wait_for(lambda: not any(w["open"] for w in gate.status()["per_worker"]),
                 "both workers closed", seen=gate.seen)  # fmt: skip
        burst = gate.post("/v1/echo", 20)
        wait_for(lambda: gate.status()["rejected_total"] == 16, "16 refused", seen=gate.seen)
        st = gate.status()
        assert (st["queue_depth"], per_worker(gate, "queue_depth")) == (4, [2, 2]), st
        stub.ready = stub.healthy = True
        assert codes(burst) == [200] * 4 + [503] * 16

        # In flight on both workers, as the guardian's gate source reads it: the sum.
        held = gate.post("/v1/hold", 16)
        collector = GateCollector(
            parse_config(gate.cfg.read_text()).services[0],
            GateConfig(listen=f"127.0.0.1:{gate.port}"),
            GateSourceConfig(timeout_seconds=5.0),
        )

        def in_flight() -> int:
            obs = collector.collect().payload
            assert isinstance(obs, GateObservation)
            return obs.in_flight or 0

        wait_for(lambda: in_flight() == 16, "16 in flight through the source", seen=gate.seen)
        assert min(per_worker(gate, "in_flight")) > 0, gate.seen()
        stub.set_release()
        assert codes(held) == [200] * 16
        wait_for(lambda: in_flight() == 0, "nothing in flight", seen=gate.seen)
    finally:
        out = gate.stop()
    assert gate.proc.returncode == 0, out
    assert "Traceback" not in out, out


@pytest.mark.slow
def test_sigterm_drains_the_in_flight_requests_of_every_worker(stub: Stub, tmp_path: Path) -> None:
    gate = Workers(stub, tmp_path, "      shutdown_timeout_seconds: 120\n")
    try:
        held = gate.post("/v1/hold", 16)
        wait_for(lambda: gate.status()["in_flight"] == 16, "16 in flight", seen=gate.seen)
        assert min(per_worker(gate, "in_flight")) > 0, gate.seen()
        gate.proc.terminate()

        def refused() -> bool:
            try:
                requests.get(f"{gate.url}/gate/status", timeout=5)
            except requests.ConnectionError:
                return True
            return False

        # Both workers have closed their listeners (nothing accepts any more) and still wait
        # for their requests: the parent has not exited, no request has been answered.
        wait_for(refused, "both listeners closed")
        assert gate.proc.poll() is None
        assert not any(f.done() for f in held)
        stub.set_release()
        assert codes(held) == [200] * 16
        assert gate.proc.wait(timeout=60) == 0
    finally:
        out = gate.stop()
    assert "Traceback" not in out, out


def control_dir(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--control-dir") + 1].decode())


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_requests_are_counted_lost(
    stub: Stub, tmp_path: Path
) -> None:
    gate = Workers(stub, tmp_path)
    try:
        held = gate.post("/v1/hold", 16)
        wait_for(lambda: gate.status()["in_flight"] == 16, "16 in flight", seen=gate.seen)
        victim, *_ = gate.status()["per_worker"]
        pid, n = int(victim["pid"]), int(victim["in_flight"])
        assert n > 0, gate.seen()
        # The parent has read what the victim holds (it reads every second).
        parent_file = control_dir(pid) / "parent.json"
        wait_for(lambda: '"' + str(pid) + '": ' + str(n) in parent_file.read_text(),
                 "the parent's reading", seen=parent_file.read_text)  # fmt: skip
        before = gate.pids()
        os.kill(pid, signal.SIGKILL)

        def replaced() -> bool:
            st = gate.status()
            pids = {int(w["pid"]) for w in st["per_worker"]}
            return st["workers_answered"] == 2 and pid not in pids and len(pids & before) == 1

        wait_for(replaced, "a new worker in its place", seen=gate.seen)
        st = gate.status()
        assert (st["worker_restarts_total"], st["worker_lost_requests_total"]) == (1, n), st
        stub.set_release()
        results = []
        for f in held:
            try:
                results.append(f.result(timeout=120).status_code)
            except requests.ConnectionError:
                results.append(0)  # its worker died under it
        assert sorted(results) == [0] * n + [200] * (16 - n)
        # The gate keeps serving, on both workers.
        assert codes(gate.post("/v1/echo", 24)) == [200] * 24
        assert min(per_worker(gate, "admitted_total")) > 0, gate.seen()
    finally:
        out = gate.stop()
    assert gate.proc.returncode == 0, out
    assert f"worker 1 (pid {pid}) ended (signal 9); {n} requests" in out or (
        f"(pid {pid}) ended (signal 9); {n} requests" in out
    ), out


@pytest.mark.slow
def test_sighup_replaces_every_worker_and_loses_nothing_they_held(
    stub: Stub, tmp_path: Path
) -> None:
    gate = Workers(stub, tmp_path)
    try:
        # In flight on both workers (the stub holds them), and held in both queues (the
        # guardian has closed the front door).
        in_flight = gate.post("/v1/hold", 16)
        wait_for(lambda: gate.status()["in_flight"] == 16, "16 in flight", seen=gate.seen)
        close_the_front_door(stub)
        wait_for(lambda: not any(w["open"] for w in gate.status()["per_worker"]),
                 "both workers closed", seen=gate.seen)  # fmt: skip
        queued = gate.post("/v1/echo", 16)
        wait_for(lambda: gate.status()["queue_depth"] == 16, "16 held", seen=gate.seen)
        before = gate.pids()
        gate.proc.send_signal(signal.SIGHUP)

        def new_workers_beside_the_old() -> bool:
            st = gate.status()
            pids = {int(w["pid"]) for w in st["per_worker"]}
            # The old workers answer beside their successors while they still hold requests.
            return len(pids - before) == 2 and (st["in_flight"], st["queue_depth"]) == (16, 16)

        wait_for(new_workers_beside_the_old, "two new workers", seen=gate.seen)
        # Once retired, the old workers take no new connection: these wait in the new ones'.
        wait_for(lambda: gate.log.read_text().count(": retiring (a reload)") == 2,
                 "both old workers retired", seen=lambda: gate.log.read_text()[-2000:])  # fmt: skip
        later = gate.post("/v1/echo", 8)

        def held_by() -> tuple[int, int]:
            ws = gate.status()["per_worker"]
            old = sum(int(w["queue_depth"]) for w in ws if int(w["pid"]) in before)
            return old, sum(int(w["queue_depth"]) for w in ws) - old

        wait_for(lambda: held_by() == (16, 8), "8 more held by the new workers", seen=held_by)
        stub.ready = stub.healthy = True
        assert codes(queued + later) == [200] * 24
        stub.set_release()
        assert codes(in_flight) == [200] * 16
        wait_for(lambda: not (gate.pids() & before) and len(gate.pids()) == 2,
                 "only the new workers", seen=gate.seen)  # fmt: skip
        assert codes(gate.post("/v1/echo", 24)) == [200] * 24
        st = gate.status()
        assert (st["worker_restarts_total"], st["worker_lost_requests_total"]) == (0, 0), st
    finally:
        out = gate.stop()
    assert gate.proc.returncode == 0, out
    assert "Traceback" not in out, out


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.slow
def test_workers_end_with_a_parent_killed_outright(stub: Stub, tmp_path: Path) -> None:
    gate = Workers(stub, tmp_path)
    try:
        pids = gate.pids()
        gate.proc.kill()
        gate.proc.wait(timeout=60)
        wait_for(lambda: all(gone(p) for p in pids), "no worker left", seen=lambda: pids)
    finally:
        gate.stop()


# --- a silent worker: wedged or starved ------------------------------------------------------
#
# The parent kills a worker whose control socket has not answered for a while (its loop is
# stuck) and starts another. A worker that was runnable and waited for a CPU most of that time
# was starved by the host (measured here: vLLM's CPU engine kept other processes off both cores
# for up to 50 s), not stuck: killing it cuts every stream it carries and starts the same wait
# again. What the task did meanwhile is the kernel's account, /proc/<pid>/schedstat.


@pytest.mark.parametrize(
    ("silent", "limit", "waited", "ran", "verdict"),
    [
        (9.0, 10.0, 0.0, 0.0, None),  # not silent long enough
        (9.0, 10.0, None, None, None),
        (11.0, 10.0, 0.0, 0.0, Silence.WEDGED),  # asleep the whole time: blocked
        (11.0, 10.0, 0.5, 10.5, Silence.WEDGED),  # on a CPU the whole time: spinning
        (11.0, 10.0, 5.4, 0.1, Silence.WEDGED),  # waited less than half of it
        (11.0, 10.0, 5.5, 0.1, Silence.STARVED),
        (40.0, 10.0, 39.0, 0.5, Silence.STARVED),
        # Spinning beside a busy engine: it waits half the time and runs the other half.
        (20.0, 10.0, 10.0, 9.9, Silence.WEDGED),
        (40.0, 10.0, 37.0, 2.0, Silence.WEDGED),  # seconds of CPU and no answer: stuck
        (40.0, 10.0, 37.0, 1.9, Silence.STARVED),
        (11.0, 10.0, None, None, Silence.WEDGED),  # no account of it: as before there was one
        (91.0, 90.0, 80.0, 0.2, Silence.STARVED),  # a worker starting up
    ],
)
def test_a_silent_worker_is_wedged_unless_it_waited_for_a_cpu_most_of_the_time(
    silent: float, limit: float, waited: float | None, ran: float | None, verdict: Silence | None
) -> None:
    assert judge_silence(silent, limit, waited, ran) is verdict


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("152307944 654501203 313\n", (152307944, 654501203)),
        ("0 0 0", (0, 0)),
        ("", None),
        ("12", None),
        ("-1 2 3", None),
        ("a b c", None),
    ],
)
def test_schedstat_is_read_as_time_on_a_cpu_and_time_waiting_for_one(
    text: str, parsed: tuple[int, int] | None
) -> None:
    assert parse_schedstat(text) == parsed


def test_the_kernels_account_of_a_process_is_read_from_proc() -> None:
    here = read_schedstat(os.getpid())
    assert here is not None and here[0] > 0, here
    assert read_schedstat(2**22 + 1) is None  # above pid_max: no such process


@pytest.mark.parametrize(("waited_seconds", "killed"), [(0.0, True), (12.0, False)])
def test_the_parent_kills_a_silent_worker_only_when_it_was_not_starved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, waited_seconds: float, killed: bool
) -> None:
    # The worker: a real process that never answers on a control socket (it has none); the
    # kernel's account of it is given, as a starved host would give it.
    sup = Supervisor(
        [], 1, "127.0.0.1", 0, shutdown_timeout_seconds=1.0, notify=lambda _m: None,
        watchdog_seconds=None, status_line=lambda _d: "",
        schedstat=lambda _pid: (10**8, int(1e9 * (waited_seconds + 1.0))),
    )  # fmt: skip
    proc = subprocess.Popen(["sleep", "60"])
    try:
        now = 1000.0
        w = _Worker(0, proc, now - 100.0, last_answer=now - 13.0, sched_at_answer=(10**8, 10**9))
        sup.slots[0].worker = w
        with caplog.at_level("WARNING", logger="vllm_guardian.gate"):
            sup._poll(now)
        assert (proc.wait(timeout=30) == -signal.SIGKILL) if killed else proc.poll() is None
        said = caplog.text
        if killed:
            assert "has not answered for 13 s: killed" in said, said
        else:
            assert "has not answered for 13 s; it waited for a CPU 12 s of them" in said, said
            assert "not killed" in said, said
            caplog.clear()
            with caplog.at_level("WARNING", logger="vllm_guardian.gate"):
                sup._poll(now + 1.0)  # starved still: said once a minute, not every second
            assert "waited for a CPU" not in caplog.text
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sup.control_dir, ignore_errors=True)
