"""A hostile vLLM cannot hold a fetch or fill memory.

Every fetch from vLLM — the metrics and health sources, ``diagnose --url``, the bundle
actuator — goes through ``vllm_guardian.lowio.httpget``: a total deadline (not per read) and a size
cap. The servers here are real sockets on 127.0.0.1 that drip a byte at a time or never end
their body. Each fetch runs in a thread so that a regression fails the test instead of hanging
it; the bound is generous (the deadline under test is a fraction of it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.hostile import Hostility, hostile_server, wait_for
from tests.httpfixture import Script, serve
from vllm_guardian.config import HealthSourceConfig, ServiceConfig, VllmMetricsSourceConfig
from vllm_guardian.diagnose.gather import GatherOptions, _Gatherer
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.lowio.httpget import Cancel, Failure, HttpGetError, Oversize, fetch
from vllm_guardian.model import HealthState
from vllm_guardian.sources.health import HealthCollector
from vllm_guardian.sources.vllm_metrics import VllmMetricsCollector

ROOT = Path(__file__).resolve().parent.parent
BOUND_SECONDS = 60.0  # a fetch with a 0.5 s deadline that is still running after this hangs


def finishes(fn: Callable[[], Any]) -> Any:
    """fn's result (or exception), or fail if it is still running after BOUND_SECONDS."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_SECONDS)
    assert not t.is_alive(), f"still fetching after {BOUND_SECONDS:g}s: the deadline is not total"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize(
    ("mode", "oversize", "failure"),
    [
        ("drip", Oversize.FAIL, Failure.DEADLINE),
        ("drip", Oversize.TRUNCATE, Failure.DEADLINE),
        ("endless", Oversize.FAIL, Failure.TOO_LARGE),
    ],
)
def test_a_hostile_server_ends_in_a_named_failure(mode: str, oversize: Oversize, failure: Failure):
    with hostile_server(Hostility(mode=mode)) as url, pytest.raises(HttpGetError) as e:
        finishes(
            lambda: fetch(
                url + "/metrics",
                deadline_seconds=0.5,
                max_body_bytes=1024 * 1024,
                oversize=oversize,
            )
        )
    assert e.value.failure is failure, e.value


def test_a_dripping_answer_that_says_it_closes_is_cut_at_the_deadline_too():
    """http.client lets go of a connection whose answer says it will close (the body is read
    through the answer): the deadline still cuts the socket in use, not the connection's."""
    h = Hostility(mode="drip", interval_seconds=0.05, head_extra="Connection: close\r\n",
                  head_at_once=True)  # fmt: skip
    with hostile_server(h) as url:
        with pytest.raises(HttpGetError) as e:
            finishes(lambda: fetch(url, deadline_seconds=0.5, max_body_bytes=1 << 20))
        assert e.value.failure is Failure.DEADLINE
        with pytest.raises(HttpGetError) as e:
            finishes(
                lambda: fetch(url, deadline_seconds=0.5, max_body_bytes=1 << 20, cancel=Cancel())
            )
        assert e.value.failure is Failure.DEADLINE


def test_an_endless_body_is_cut_at_the_cap_when_truncating():
    with hostile_server(Hostility(mode="endless")) as url:
        resp = finishes(
            lambda: fetch(
                url, deadline_seconds=30, max_body_bytes=100_000, oversize=Oversize.TRUNCATE
            )
        )
    assert (resp.status, len(resp.body), resp.truncated) == (200, 100_000, True)


def test_a_normal_answer_and_a_refusal(free_port: int):
    script = Script()
    script.set("/metrics", body=b"vllm:x 1\n")
    with serve(script) as url:
        resp = fetch(url + "/metrics", deadline_seconds=5, max_body_bytes=1024)
    assert (resp.status, resp.body, resp.truncated) == (200, b"vllm:x 1\n", False)
    assert resp.header("content-type") == "text/plain; version=0.0.4; charset=utf-8"
    with pytest.raises(HttpGetError) as e:
        fetch(f"http://127.0.0.1:{free_port}/", deadline_seconds=5, max_body_bytes=1024)
    assert e.value.failure is Failure.REFUSED
    for bad in ("http://[::1:8000/", "ftp://127.0.0.1/", "http://127.0.0.1:99999/"):
        with pytest.raises(HttpGetError) as e:
            fetch(bad, deadline_seconds=1, max_body_bytes=1)
        assert e.value.failure is Failure.BAD_URL, bad


def test_the_metrics_source_reports_a_dripping_server_within_its_deadline():
    with hostile_server(Hostility(mode="drip")) as url:
        c = VllmMetricsCollector(
            ServiceConfig(name="vllm", url=url), VllmMetricsSourceConfig(timeout_seconds=0.5)
        )
        reading = finishes(c.collect)
        c.close()
    assert reading.payload is None
    assert reading.error == f"GET {url}/metrics: no answer within 0.5s", reading


def test_the_metrics_source_reports_an_endless_body():
    with hostile_server(Hostility(mode="endless")) as url:
        c = VllmMetricsCollector(
            ServiceConfig(name="vllm", url=url),
            VllmMetricsSourceConfig(timeout_seconds=30, max_body_bytes=64 * 1024),
        )
        reading = finishes(c.collect)
        c.close()
    assert reading.payload is None
    assert reading.error == f"GET {url}/metrics: body exceeds 65536 bytes", reading
    assert reading.hint is not None and "max_body_bytes" in reading.hint


@pytest.mark.parametrize("mode", ["drip", "endless"])
def test_the_health_source_is_bounded_in_time_and_memory(mode: str):
    with hostile_server(Hostility(mode=mode)) as url:
        c = HealthCollector(
            ServiceConfig(name="vllm", url=url),
            HealthSourceConfig(timeout_seconds=0.5 if mode == "drip" else 30),
            FakeClock(),
        )
        reading = finishes(c.collect)
        c.close()
    if mode == "drip":
        assert reading.payload.state is HealthState.TIMEOUT, reading
    else:  # the status is what /health says; the body is not needed, and is capped
        assert reading.payload.state is HealthState.UP, reading
        assert reading.hint is not None and "body over" in reading.hint, reading


def test_diagnose_url_does_not_hang_on_a_dripping_server():
    with hostile_server(Hostility(mode="drip")) as url:
        g = _Gatherer(
            ServiceConfig(name="vllm", url=url),
            GatherOptions(timeout_seconds=0.5, interval_seconds=0.0),
            lambda _msg: None,
        )
        metrics = finishes(g.metrics)
        health = finishes(g.health)
    assert metrics == []
    assert g.problems == ["/metrics: timed out after 0.5 s (vLLM down or starting?)"], g.problems
    assert health["error"] == "timed out after 0.5 s", health


def test_a_cut_ends_a_fetch_in_progress_and_every_later_one():
    h = Hostility(mode="drip")
    cancel = Cancel()
    with hostile_server(h) as url:
        outcome: list[object] = []

        def run() -> None:
            try:
                fetch(url, deadline_seconds=600, max_body_bytes=1 << 20, cancel=cancel)
            except HttpGetError as e:
                outcome.append(e.failure)

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: (h.accepted == 1, h.accepted), "the fetch is dripping")
        cancel.cut()
        t.join(BOUND_SECONDS)
        assert not t.is_alive() and outcome == [Failure.CANCELLED], outcome
        with pytest.raises(HttpGetError) as e:
            fetch(url, deadline_seconds=600, max_body_bytes=1, cancel=cancel)
        assert e.value.failure is Failure.CANCELLED


def test_the_gate_source_reports_a_dripping_gate_within_its_deadline():
    from vllm_guardian.sources.gate import read_status

    with hostile_server(Hostility(mode="drip")) as url:
        port = int(url.rsplit(":", 1)[1])
        obs = finishes(lambda: read_status("127.0.0.1", port, 0.5))
    assert obs.reachable is False and obs.error == "no answer within 0.5s", obs


def test_a_cancel_s_fetches_share_one_deadline_thread_and_keep_their_deadlines() -> None:
    """A collector fetches every tick: its Cancel keeps the deadlines in one thread, not a
    thread per fetch; each fetch is still cut at its own deadline, and the thread ends with
    the cut."""
    cancel = Cancel()
    script = Script()
    script.set("/metrics", body=b"vllm:x 1\n")

    def watchers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "httpget-deadlines"]

    before = set(watchers())  # other tests' collectors may still be ending theirs
    with serve(script) as url:
        for _ in range(20):
            resp = fetch(url + "/metrics", deadline_seconds=5, max_body_bytes=1024, cancel=cancel)
            assert resp.body == b"vllm:x 1\n"
    mine = cancel._watcher
    assert mine is not None and mine.is_alive()
    assert set(watchers()) - before == {mine}, "one thread for the 20 fetches"
    h = Hostility(mode="drip")
    with hostile_server(h) as url, pytest.raises(HttpGetError) as e:
        # a short deadline after the long ones: the thread wakes for it
        finishes(lambda: fetch(url, deadline_seconds=0.5, max_body_bytes=1 << 20, cancel=cancel))
    assert e.value.failure is Failure.DEADLINE
    cancel.cut()
    wait_for(lambda: (not mine.is_alive(), mine), "the deadline thread ends")


# --- a deadline the guardian was not running to see -----------------------------------------
#
# A guardian process kept off the CPUs (measured here: 15-50 s beside vLLM's CPU engine under
# overload) wakes with vLLM's answer in its socket and its fetch's deadline long past. The
# answer came; the deadline thread must not throw it away for silence. The process is stopped
# (SIGSTOP) from before the answer is sent until well past the deadline: starved, as the host
# starved it.

_CHILD = """
import sys
from vllm_guardian.lowio.httpget import Cancel, HttpGetError, fetch
cancel = Cancel() if sys.argv[2] == "cancel" else None
try:
    r = fetch(sys.argv[1], deadline_seconds=5.0, max_body_bytes=1024, cancel=cancel)
    print("answer", r.status, r.body.decode(), flush=True)
except HttpGetError as e:
    print("failed", e.failure.value, e.detail, flush=True)
"""


def _stopped(pid: int) -> tuple[bool, str]:
    with open(f"/proc/{pid}/stat") as f:
        state = f.read().rpartition(")")[2].split()[0]
    return state in ("T", "t"), state


@pytest.mark.parametrize("deadlines", ["cancel", "timer"])
def test_an_answer_that_came_while_the_guardian_was_not_running_is_taken(deadlines: str) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/health"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, deadlines], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        srv.settimeout(60)
        conn, _ = srv.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            os.kill(child.pid, signal.SIGSTOP)
            wait_for(lambda: _stopped(child.pid), "the guardian's process stopped")
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            time.sleep(7.0)  # stopped past its 5 s deadline, the answer in its socket
            os.kill(child.pid, signal.SIGCONT)
            out, _ = child.communicate(timeout=60)
    finally:
        srv.close()
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    assert out.strip() == "answer 200 ok", out
