"""The tier's front door as a user deploys it: ``vllm-guardian gate -c CONFIG`` as a process of
its own in front of the module's vLLM, following the module's guardian, and an OpenAI SDK client
(``sdk_client.py``, run with the vLLM venv's Python, retries off) with requests in flight
through it. Used by the engine death and engine hang tests, on the servers those modules start
anyway (no vLLM start of its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for
from tests.vllm_tier import support
from vllm_guardian.tools.demo import free_port

ROOT = support.HERE.parents[1]


class GateProcess:
    """``vllm-guardian gate -c`` with a config whose service has a ``gate:`` section of
    ``keys`` (the guardian's ``listen`` is what it follows); its config and log are
    ``NAME-config.yaml`` and ``NAME.log`` in ``workdir`` (one pair per test that starts one)."""

    def __init__(
        self, workdir: Path, vllm_port: int, guardian_port: int, name: str = "gate", **keys: Any
    ) -> None:
        port = free_port()
        self.config = workdir / f"{name}-config.yaml"
        self.config.write_text(
            json.dumps(
                {
                    "listen": f"127.0.0.1:{guardian_port}",
                    "services": [
                        {
                            "name": "vllm",
                            "url": f"http://127.0.0.1:{vllm_port}",
                            # One gate process unless a test asks for more: the CPU
                            # engine takes the cores, and the tier's runs compare with earlier.
                            "gate": {"listen": f"127.0.0.1:{port}", "workers": 1, **keys},
                        }
                    ],
                }
            )
        )
        self.log_path = workdir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian", "gate", "-c", str(self.config),
             "--service", "vllm"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        wait_for(self._answers, f"the gate on {self.url}\n{self.log()}", 60, every_seconds=0.2)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gate exited {self.proc.returncode}:\n{self.log()}")
        try:
            return requests.get(f"{self.url}/gate/status", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(f"{self.url}/gate/status", timeout=10).json()
        return doc

    def continuations(self) -> dict[str, float]:
        """continuations_total by "outcome/reason", the series that counted something."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return {
            f"{s.labels['outcome']}/{s.labels['reason']}": s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "vllm_guardian_gate_continuations_total" and s.value
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def request(stream: bool, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One completion of a wave (greedy; ``ignore_eos``: random weights, exact lengths)."""
    return {"stream": stream, "prompt": prompt, "max_tokens": max_tokens}


class SdkClient:
    """``sdk_client.py`` against ``base_url`` (``.../v1``); ``waves`` of requests, the first
    sent at once, each further one on :meth:`next_wave`. ``on_text`` (requests, call): the
    reader calls ``call`` once, in its own thread, when all those requests have text (a test
    thread polling was scheduled late beside a CPU hog)."""

    def __init__(
        self,
        venv: Path,
        base_url: str,
        waves: list[list[dict[str, Any]]],
        on_text: tuple[set[int], Callable[[], None]] | None = None,
    ) -> None:
        self.on_text = on_text
        self.count = sum(len(w) for w in waves)
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(support.HERE / "sdk_client.py"), base_url,
             support.MODEL_NAME, json.dumps({"waves": waves})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.with_text: set[int] = set()
        self.ready = threading.Event()  # the client has imported openai
        self.done: dict[int, dict[str, Any]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["event"] == "ready":
                self.ready.set()
            elif event["event"] == "text":
                self.with_text.add(event["i"])
                if self.on_text is not None and self.on_text[0] <= self.with_text:
                    call, self.on_text = self.on_text[1], None
                    call()
            else:
                self.done[event["i"]] = event

    def next_wave(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def results(self, timeout: float) -> list[dict[str, Any]]:
        """Every request's end, in order; waits for the client to exit."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # no further wave
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        err = self.proc.stderr.read() if self.proc.stderr is not None else ""
        assert self.proc.returncode == 0, err
        assert sorted(self.done) == list(range(self.count)), (self.done, err)
        return [self.done[i] for i in range(self.count)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def first_difference(a: str, b: str) -> int | None:
    """Where two texts first differ (None: equal)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def wait_for_text(client: SdkClient, which: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not which <= client.with_text:
        if time.monotonic() > deadline:
            raise AssertionError(f"no text for {which - client.with_text}: {client.done}")
        time.sleep(0.05)
