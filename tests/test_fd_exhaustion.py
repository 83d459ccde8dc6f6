"""The daemon keeps watching and keeps control under descriptor pressure.

The adversarial pass found that ~1,100 half-sent requests to /metrics took every descriptor:
/metrics and /healthz timed out, the policy state, audit log and flight recorder stopped
writing, and the control thread died on a failed ``accept()`` for good. Here the real daemon
(``python -m vllm_guardian run``) runs under ``prlimit --nofile=256`` against a stub vLLM on
loopback while 1,100 connections send half a request to /metrics and wait. During the attack
and after it: /metrics and /healthz answer, ``vllm-guardian status`` answers, a ``pause`` and
a ``resume`` are saved to the policy state file, and the flight recorder keeps writing.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import hostneeds
from tests.conftest import read_fixture
from tests.hostile import idle_clients, wait_for
from tests.httpfixture import Script, serve
from vllm_guardian.lowio.httpget import fetch

ROOT = Path(__file__).resolve().parent.parent
ATTACKERS = 1100
NOFILE = 256


@pytest.fixture
def daemon(tmp_path: Path, free_port: int) -> Iterator[tuple[subprocess.Popen[bytes], Path, str]]:
    if shutil.which("prlimit") is None:
        hostneeds.cannot_run(
            "prlimit not installed: it caps the daemon's descriptors (util-linux; Debian has it)"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = ATTACKERS + 200
    if soft < need:  # the attacking side (this test) needs the descriptors
        if hard != resource.RLIM_INFINITY and hard < need:
            hostneeds.cannot_run(
                f"the attacking side needs {need} descriptors, and this process may open only "
                f"{hard} (raise the hard limit: ulimit -Hn)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    script = Script()
    script.set("/metrics", body=read_fixture("metrics-pressure-04.prom").encode())
    script.set("/health")
    with serve(script) as url:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f"interval_seconds: 0.5\nlisten: 127.0.0.1:{free_port}\n"
            f"runtime_dir: {tmp_path / 'run'}\nstate_dir: {tmp_path / 'state'}\n"
            f"recorder:\n  path: {tmp_path / 'flight.jsonl'}\n"
            "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
            "  logs:\n    enabled: false\n"
            f"services:\n  - name: vllm\n    url: {url}\n"
        )
        log = (tmp_path / "guardian.log").open("wb")
        argv = [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)]
        proc = subprocess.Popen(
            ["prlimit", f"--nofile={NOFILE}", "--", *argv],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc, tmp_path, f"http://127.0.0.1:{free_port}"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            log.close()


def cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_guardian", *args, "-c", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def everything_works(tmp: Path, base: str, paused: bool) -> None:
    """/metrics, /healthz, status, a saved pause/resume, a growing flight record."""

    def get(path: str) -> tuple[bool, object]:
        r = fetch(base + path, deadline_seconds=30, max_body_bytes=1 << 24)
        return r.status == 200, (r.status, r.body[:200])

    wait_for(lambda: get("/metrics"), "/metrics answers 200")
    wait_for(lambda: get("/healthz"), "/healthz answers 200 (ticks are recent)")
    cfg = tmp / "config.yaml"
    status = cli(cfg, "status")
    assert status.returncode == 0, (status.stdout, status.stderr)
    records = (tmp / "flight.jsonl").read_text().count("\n")
    wait_for(
        lambda: (
            (n := (tmp / "flight.jsonl").read_text().count("\n")) > records + 2,
            (records, n),
        ),
        "the flight recorder keeps writing",
    )
    command = "pause" if paused else "resume"
    out = cli(cfg, command)
    assert out.returncode == 0, (out.stdout, out.stderr)
    state = tmp / "state" / "policy-state.json"

    def saved() -> tuple[bool, object]:
        doc = json.loads(state.read_text())
        flags = [s.get("paused") for s in doc["state"]["services"]]
        return flags == [paused], flags

    wait_for(saved, f"the policy state file records the {command}")


def test_the_daemon_survives_a_thousand_idle_connections_under_a_low_descriptor_limit(
    daemon: tuple[subprocess.Popen[bytes], Path, str],
):
    proc, tmp, base = daemon
    host, port = base.removeprefix("http://").split(":")
    everything_works(tmp, base, paused=True)  # before
    with idle_clients(host, int(port), ATTACKERS):
        everything_works(tmp, base, paused=False)  # during
        everything_works(tmp, base, paused=True)
        assert proc.poll() is None
    everything_works(tmp, base, paused=False)  # after
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = (tmp / "guardian.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
