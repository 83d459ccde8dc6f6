"""`vllm-guardian run` as a real process against a real loopback server replaying vLLM captures.

It must export the values the captures hold, and keep running when the server dies, comes
back, or serves garbage; SIGHUP with a bad config keeps the old one; SIGTERM stops it cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import read_fixture
from tests.httpfixture import Script, serve
from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent


def samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(base + "/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(base: str, name: str, **labels: str) -> float | None:
    return samples(base).get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def guardian(
    tmp_path: Path, free_port: int
) -> Iterator[tuple[subprocess.Popen[str], str, Script, Path]]:
    script = Script()
    script.set("/metrics", body=read_fixture("metrics-pressure-04.prom").encode())
    script.set("/health")
    with serve(script) as url:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f"interval_seconds: 0.3\nlisten: 127.0.0.1:{free_port}\nruntime_dir: {tmp_path / 'run'}\n"
            f"state_dir: {tmp_path}\nrecorder:\n  path: {tmp_path / 'flight.jsonl'}\n"
            "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
            f"services:\n  - name: vllm\n    url: {url}\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            yield proc, f"http://127.0.0.1:{free_port}", script, cfg
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_exports_what_vllm_said_and_survives_its_failures(guardian):
    proc, base, script, cfg = guardian
    wait_for(
        lambda: value(base, "vllm_guardian_kv_cache_usage_ratio", service="vllm") == 1.0,
        "KV usage 1.0 (capture 04)",
    )  # capture 04
    assert requests.get(base + "/healthz", timeout=5).status_code == 200
    script.set("/metrics", body=read_fixture("metrics-pressure-07.prom").encode())
    wait_for(
        lambda: (
            value(base, "vllm_guardian_kv_cache_usage_ratio", service="vllm") == 0.9032258064516129
        ),
        "KV usage 0.903 (pressure 07)",
    )
    assert value(base, "vllm_guardian_requests_waiting", service="vllm") == 27.0
    assert value(base, "vllm_guardian_requests_running", service="vllm") == 5.0
    wait_for(
        lambda: (value(base, "vllm_guardian_preemptions_per_second", service="vllm") or 0) > 0,
        "a preemption rate",
    )

    # Garbage: the source goes down, the guardian keeps serving and does not invent values.
    script.set("/metrics", body=b"<html>502 Bad Gateway</html>", content_type="text/html")
    wait_for(
        lambda: (
            value(base, "vllm_guardian_source_up", service="vllm", source="vllm_metrics") == 0.0
        ),
        "the vLLM metrics source down",
    )
    assert value(base, "vllm_guardian_requests_waiting", service="vllm") is None
    # The engine dies.
    script.set("/health", status=503)
    wait_for(
        lambda: value(base, "vllm_guardian_vllm_health", service="vllm") == 0.0,
        "vLLM's health at 0",
    )
    # It comes back.
    script.set("/health")
    script.set("/metrics", body=read_fixture("metrics-idle.prom").encode())
    wait_for(
        lambda: value(base, "vllm_guardian_requests_waiting", service="vllm") == 0.0,
        "no request waiting again",
    )
    assert value(base, "vllm_guardian_vllm_health", service="vllm") == 1.0

    # SIGHUP with a broken config: refused, still running with the old one.
    good = cfg.read_text()
    cfg.write_text("services: oops\n")
    ticks = value(base, "vllm_guardian_ticks_total") or 0.0
    proc.send_signal(signal.SIGHUP)
    # The loop reloads before a tick: two more ticks and the refused reload is behind it.
    wait_for(
        lambda: (
            proc.poll() is not None or (value(base, "vllm_guardian_ticks_total") or 0) >= ticks + 2
        ),
        "two ticks after the refused reload",
    )
    assert proc.poll() is None
    assert value(base, "vllm_guardian_requests_waiting", service="vllm") == 0.0
    cfg.write_text(good)

    # status over the control socket
    out = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", "status", "-c", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 0, out.stderr
    assert "service vllm: health=up" in out.stdout
    assert "policy vllm: acting (dry-run)" in out.stdout

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vllm_guardian", *args, "-c", str(cfg)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=20,
        )

    paused = cli("pause", "vllm")
    assert paused.returncode == 0 and "vllm: paused" in paused.stdout, paused.stderr
    assert "policy vllm: PAUSED" in cli("status").stdout
    assert cli("pause", "nope").returncode == 1
    resumed = cli("resume")
    assert resumed.returncode == 0 and "vllm: acting again" in resumed.stdout

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    log = proc.stdout.read() if proc.stdout else ""
    assert "reload refused, keeping the running config" in log
    assert "source vllm_metrics [vllm] down" in log and "returned HTML" in log


def test_the_server_disappearing_entirely(guardian):
    proc, base, script, _ = guardian
    wait_for(
        lambda: value(base, "vllm_guardian_requests_waiting", service="vllm") is not None,
        "a first scrape",
    )
    script.routes.clear()  # 404 everywhere
    wait_for(
        lambda: (
            value(base, "vllm_guardian_source_up", service="vllm", source="vllm_metrics") == 0.0
        ),
        "the vLLM metrics source down",
    )
    assert proc.poll() is None
    assert requests.get(base + "/healthz", timeout=5).status_code == 200


def test_sighup_with_a_hostile_config_or_a_new_listen_keeps_the_daemon(guardian, free_port):
    """Each of these used to end the daemon (exit 1) or change silently."""
    proc, base, _, cfg = guardian
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()

    def logged(text: str) -> int:
        return sum(text in line for line in list(lines))

    wait_for(
        lambda: value(base, "vllm_guardian_requests_waiting", service="vllm") is not None,
        "a first scrape",
    )
    good = cfg.read_text()
    url = good.split("    url: ", 1)[1].split("\n", 1)[0]
    hostile = [
        good.replace(url, '"http://[::1:8000"'),
        good + "signals:\n  stall_seconds: !!int abc\n",
        good + "policy:\n  cooldown_seconds: !!timestamp x\n",
        "a: " + "[" * 3000 + "]" * 3000 + "\n",
    ]
    for n, text in enumerate(hostile, 1):
        cfg.write_text(text)
        proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda n=n: logged("reload refused") >= n or proc.poll() is not None,
            "the reload refused",
        )
        assert proc.poll() is None, "".join(lines)
        assert requests.get(base + "/healthz", timeout=5).status_code == 200
    # A new listen address: reported, and the old one keeps serving.
    port = base.rsplit(":", 1)[1]
    cfg.write_text(good.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port + 1}"))
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: logged("listen changes need a restart") >= 1, "the listen change reported")
    assert requests.get(base + "/healthz", timeout=5).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    reader.join(timeout=30)
    assert "Traceback" not in "".join(lines)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_sighup_with_a_config_that_is_not_a_regular_file_keeps_the_daemon(guardian, kind):
    """A FIFO put in place of the config used to hang the main loop on SIGHUP (the read waits
    for a writer forever): no tick, no SIGTERM. The reload is refused, naming why."""
    proc, base, _, cfg = guardian
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    wait_for(
        lambda: value(base, "vllm_guardian_requests_waiting", service="vllm") is not None,
        "a first scrape",
    )
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.mkdir()
    try:
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while not any("not a regular file" in line for line in list(lines)):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        if kind == "fifo" and proc.poll() is None:  # unblock a reader stuck on it
            with contextlib.suppress(OSError):
                os.close(os.open(cfg, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(timeout=30)
    print("".join(lines))
    assert "Traceback" not in "".join(lines)
