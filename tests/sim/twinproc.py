"""Start the twin as a real subprocess on a loopback port, and always stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]


@dataclass
class TwinProc:
    proc: subprocess.Popen[bytes]
    port: int
    stderr_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def health(self) -> int | None:
        """/health's status; None while refused. A slow answer is waited for (a busy host)."""
        try:
            return requests.get(f"{self.url}/health", timeout=10.0).status_code
        except requests.ConnectionError:
            return None

    def wait_ready(self, timeout_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.health() == 200:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"twin exited {self.proc.returncode}:\n{self.stderr()}")
            time.sleep(0.05)
        raise AssertionError(f"twin not ready in {timeout_seconds}s:\n{self.stderr()}")

    def wait_exit(self, timeout_seconds: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout_seconds)

    def post(self, path: str, body: dict[str, object], stream: bool = False) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, stream=stream, timeout=20.0)

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)


def start(tmp: Path, port: int, *args: str, env_extra: dict[str, str] | None = None) -> TwinProc:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)  # the twin reads it first, as torch does
    stderr_path = tmp / f"twin-{port}.log"
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian.sim", "serve",
             "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    return TwinProc(proc, port, stderr_path)


def stop(twin: TwinProc) -> None:
    """Finalizer: terminate, then kill; never leave a process behind."""
    if twin.proc.poll() is None:
        twin.proc.terminate()
        try:
            twin.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            twin.proc.kill()
            twin.proc.wait(timeout=5)


def sse(resp: requests.Response) -> Iterator[dict[str, object] | str]:
    """The stream's events: parsed JSON objects, or the string "[DONE]"."""
    for raw in resp.iter_lines():
        line = raw.decode() if isinstance(raw, bytes) else str(raw)
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)
