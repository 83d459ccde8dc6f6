"""After `kill -9` of the guardian, the vLLM it started (its own session) keeps
running; the next guardian adopts it through the pid file and never starts a second copy.

Real processes throughout: `vllm-guardian run` with ``policy.backend: process`` and a stub
server that records every start (and every failed bind) in a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import wait_for
from vllm_guardian.actuators.procmgr import Supervisor, process_start_ticks

ROOT = Path(__file__).resolve().parent.parent

STUB = textwrap.dedent(
    """
    import os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, starts = int(sys.argv[1]), sys.argv[2]

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"vllm:num_requests_running 0\\n" if self.path == "/metrics" else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass

    try:
        srv = HTTPServer(("127.0.0.1", port), H)
    except OSError as e:
        with open(starts, "a") as fh:
            fh.write(f"fail {os.getpid()} {e}\\n")
        sys.exit(1)
    with open(starts, "a") as fh:
        fh.write(f"start {os.getpid()}\\n")
    srv.serve_forever()
    """
)


def alive(pid: int) -> bool:
    return process_start_ticks(pid) is not None


@pytest.fixture
def setup(
    tmp_path: Path, free_port: int
) -> Iterator[tuple[Path, Path, Callable[[], subprocess.Popen[str]]]]:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    starts = tmp_path / "starts"
    starts.touch()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        guardian_port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"interval_seconds: 0.3\nlisten: 127.0.0.1:{guardian_port}\nruntime_dir: {tmp_path / 'run'}\n"
        f"state_dir: {tmp_path / 'state'}\nrecorder:\n  path: {tmp_path / 'flight.jsonl'}\n"
        "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
        "policy:\n  backend: process\n"
        f"services:\n  - name: vllm\n    url: http://127.0.0.1:{free_port}\n"
        f"    log_file: {tmp_path / 'vllm.log'}\n"
        f"    command: [{sys.executable}, {stub}, '{free_port}', {starts}]\n"
    )
    procs: list[subprocess.Popen[str]] = []

    def guardian() -> subprocess.Popen[str]:
        out = open(tmp_path / f"guardian{len(procs)}.log", "w")  # noqa: SIM115
        p = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        out.close()
        procs.append(p)
        return p

    try:
        yield tmp_path, starts, guardian
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for line in starts.read_text().splitlines():
            pid = int(line.split()[1])
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


def started(starts: Path) -> list[int]:
    return [
        int(line.split()[1]) for line in starts.read_text().splitlines() if line.startswith("start")
    ]


def test_the_next_guardian_adopts_the_orphan_and_never_starts_a_second(setup) -> None:  # type: ignore[no-untyped-def]
    tmp_path, starts, guardian = setup
    first = guardian()
    wait_for(lambda: len(started(starts)) == 1, "the stub to start")
    orphan = started(starts)[0]
    pid_file = tmp_path / "state" / "vllm.pid"
    wait_for(lambda: pid_file.read_text().split()[0] == str(orphan), "the pid file")

    first.kill()  # kill -9: no chance to stop what it started
    first.wait(timeout=30)
    assert alive(orphan), "the stub should outlive the guardian (own session)"

    second = guardian()
    log = tmp_path / "guardian1.log"
    wait_for(lambda: f"adopting pid {orphan}" in log.read_text(), "the adoption")
    flight = tmp_path / "flight.jsonl"
    records_then = flight.read_text().count("\n")
    # Ten ticks of the second guardian later: still the one stub, no failed bind.
    wait_for(lambda: flight.read_text().count("\n") >= records_then + 10, "ten more ticks")
    assert starts.read_text().splitlines() == [f"start {orphan}"], starts.read_text()
    assert alive(orphan) and second.poll() is None

    # The adopted process is supervised: when it dies, the guardian starts it again.
    os.kill(orphan, signal.SIGKILL)
    wait_for(lambda: len(started(starts)) == 2, "a restart of the dead orphan")
    new = started(starts)[1]
    wait_for(lambda: pid_file.read_text().split()[0] == str(new), "the new pid file")
    assert "fail" not in starts.read_text()

    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0
    wait_for(lambda: not alive(new), "the stub to be stopped with the guardian")
    assert not pid_file.exists()


@pytest.mark.parametrize(
    "content",
    ["{pid} 1\n", "not a pid file\n", "{pid}\n", "1 1\n", "\xff\xfe"],
    ids=["reused-pid", "garbage", "no-start-time", "init", "non-ascii"],
)
def test_a_pid_file_that_does_not_name_our_process_is_not_adopted(
    tmp_path: Path, content: str
) -> None:
    """A pid that now names another process (here: the test itself, with a wrong start time)
    is never adopted, signalled or mistaken for vLLM: a fresh copy is started."""
    (tmp_path / "vllm.pid").write_text(
        content.format(pid=os.getpid()), encoding="utf-8", errors="surrogateescape"
    )
    sup = Supervisor(
        "vllm",
        [sys.executable, "-c", "import time; time.sleep(120)"],
        tmp_path / "vllm.env",
        None,
        restart_delay_seconds=0.1,
        stop_timeout_seconds=5,
    )
    try:
        sup.start()
        wait_for(lambda: sup.starts == 1 and sup.pid is not None, "a fresh start")
        assert sup.adopted is None
        mine = sup.pid
        assert mine is not None
        assert (tmp_path / "vllm.pid").read_text() == f"{mine} {process_start_ticks(mine)}\n"
    finally:
        sup.stop(timeout_seconds=5)
    assert not (tmp_path / "vllm.pid").exists()
