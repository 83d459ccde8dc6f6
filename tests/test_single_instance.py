"""One guardian per state directory and per runtime directory.

A second `vllm-guardian run` on the same directories would unlink the first one's control
socket, start a second vLLM beside the first one's and delete its pid file. It must refuse to
start instead, exit non-zero, and name the directory and the pid of the guardian holding it;
the first one keeps running with its socket in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import read_fixture
from tests.httpfixture import Script, serve
from tests.support import wait_for
from vllm_guardian.shell.instancelock import acquire

ROOT = Path(__file__).resolve().parent.parent


def _config(path: Path, url: str, port: int, state: Path, runtime: Path) -> Path:
    path.write_text(
        f"interval_seconds: 0.3\nlisten: 127.0.0.1:{port}\nruntime_dir: {runtime}\n"
        f"state_dir: {state}\n"
        "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
        f"services:\n  - name: vllm\n    url: {url}\n"
    )
    return path


def _start(cfg: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def vllm_url() -> Iterator[str]:
    script = Script()
    script.set("/metrics", body=read_fixture("metrics-pressure-04.prom").encode())
    script.set("/health")
    with serve(script) as url:
        yield url


# (what the second guardian shares with the first, the directory its error must name)
SHARED = [
    ("both", "state_dir"),
    ("state", "state_dir"),
    ("runtime", "runtime_dir"),
]


@pytest.mark.parametrize(("shared", "named"), SHARED)
def test_a_second_guardian_on_the_same_directories_refuses_to_start(
    tmp_path: Path, vllm_url: str, free_port: int, shared: str, named: str
) -> None:
    first_state, first_run = tmp_path / "state", tmp_path / "run"
    first = _start(_config(tmp_path / "a.yaml", vllm_url, free_port, first_state, first_run))
    second: subprocess.Popen[str] | None = None
    try:
        sock = first_run / "control.sock"
        wait_for(
            sock.exists,
            "the first guardian's control socket",
            seen=lambda: f"exit code {first.poll()}",
        )
        inode = sock.stat().st_ino
        state = first_state if shared in ("both", "state") else tmp_path / "state2"
        runtime = first_run if shared in ("both", "runtime") else tmp_path / "run2"
        second = _start(_config(tmp_path / "b.yaml", vllm_url, 0, state, runtime))
        try:
            out, _ = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            second.kill()
            out, _ = second.communicate()
            raise AssertionError(f"the second guardian kept running; it said:\n{out}") from None
        print(out)
        assert second.returncode != 0
        directory = {"state_dir": state, "runtime_dir": runtime}[named]
        assert named in out and str(directory) in out
        assert f"pid {first.pid}" in out
        assert "serving /metrics" not in out  # it stopped before touching anything
        assert first.poll() is None, "the first guardian must keep running"
        assert sock.exists() and sock.stat().st_ino == inode, "its control socket is untouched"
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()


def test_the_lock_is_not_inherited_by_what_the_guardian_starts(tmp_path: Path) -> None:
    """vLLM, started by the process manager, outlives a guardian that is restarted: holding
    the lock, it would keep the next guardian from starting."""
    held = acquire(tmp_path / "state", tmp_path / "run")
    try:
        assert held.fds and not any(os.get_inheritable(fd) for fd in held.fds)
    finally:
        held.release()
