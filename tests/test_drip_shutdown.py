"""A vLLM that drips its /metrics blinds nothing for long and never holds SIGTERM.

The real daemon against a server that answers every request one byte per 0.2 s: the metrics
source is reported down within its deadline on every tick (never "still busy from an earlier
tick"), and SIGTERM ends the daemon promptly, with exit code 0, while the drip goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.hostile import Hostility, hostile_server, wait_for

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def guardian(
    tmp_path: Path, port: int, url: str, timeout_seconds: float, reap_seconds: float
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The real daemon watching ``url`` with these source timeouts; killed if still running."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"interval_seconds: 0.5\nlisten: 127.0.0.1:{port}\n"
        f"runtime_dir: {tmp_path / 'run'}\nstate_dir: {tmp_path / 'state'}\n"
        "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
        "  logs:\n    enabled: false\n"
        f"  vllm_metrics:\n    timeout_seconds: {timeout_seconds:g}\n"
        f"  health:\n    timeout_seconds: {timeout_seconds:g}\n"
        f"services:\n  - name: vllm\n    url: {url}\n"
    )
    log_path = tmp_path / "guardian.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=reap_seconds)


def test_a_dripping_metrics_server_is_reported_at_the_deadline(tmp_path: Path, free_port: int):
    with (
        hostile_server(Hostility(mode="drip")) as url,
        guardian(tmp_path, free_port, url, 1, reap_seconds=30) as (proc, log_path),
    ):
        wait_for(
            lambda: (
                "source vllm_metrics [vllm] down: GET"
                in (text := log_path.read_text(errors="replace")),
                text[-2000:],
            ),
            "the metrics source reported down at its deadline",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = log_path.read_text(errors="replace")
    assert "still busy from an earlier tick" not in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]


def test_sigterm_cuts_a_fetch_in_progress(tmp_path: Path, free_port: int):
    """Deadlines of 54 s (timeout_seconds 60, the most allowed): SIGTERM must not wait them."""
    h = Hostility(mode="drip")
    with (
        hostile_server(h) as url,
        guardian(tmp_path, free_port, url, 60, reap_seconds=90) as (proc, log_path),
    ):
        wait_for(lambda: (h.accepted >= 2, h.accepted), "both fetches are dripping")
        proc.send_signal(signal.SIGTERM)
        # Far under the 54 s deadline the fetches would otherwise run to.
        assert proc.wait(timeout=30) == 0, log_path.read_text(errors="replace")[-3000:]
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
