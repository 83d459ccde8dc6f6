"""Container mode of `run`: the guardian as a pod's entrypoint, driven as the kubelet would.

The real guardian process (``vllm-guardian run``, process backend) supervises the vLLM twin as
its child with the environment the Helm chart sets (container mode, the downward API's
identity). A prober hits ``/healthz`` (liveness) and ``/ready/vllm`` (readiness) every 0.2 s as
the kubelet does, from the start to the SIGTERM: liveness never fails while the model loads,
readiness is false until vLLM serves; vLLM's log reaches the guardian's stdout (`kubectl logs`)
and the followed file; a changed config file (a ConfigMap update) is reloaded without a
SIGHUP; SIGTERM, with a client's stream in flight through the gate, closes the front door, lets
the stream finish whole and only then stops vLLM (whose own SIGTERM would abort it:
``--shutdown-timeout 0``, vLLM's default), well within the grace period.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from tests.support import wait_for
from tests.test_gate_support import GateThread
from vllm_guardian.actuators.audit import AuditLog
from vllm_guardian.core.policy import Decision, DecisionKind
from vllm_guardian.shell.container import container_mode, pod_identity

ROOT = Path(__file__).resolve().parent.parent
POD_ENV = {
    "VLLM_GUARDIAN_CONTAINER": "1",
    "VLLM_GUARDIAN_POD_NAME": "llama-7d9f-abcde",
    "VLLM_GUARDIAN_POD_NAMESPACE": "llm",
    "VLLM_GUARDIAN_POD_UID": "0b6e-uid",
    "VLLM_GUARDIAN_NODE_NAME": "gpu-node-3",
}


@pytest.mark.parametrize(
    ("env", "mode", "identity"),
    [
        ({}, False, {}),
        ({"VLLM_GUARDIAN_CONTAINER": "0"}, False, {}),
        (
            POD_ENV,
            True,
            {"pod": "llama-7d9f-abcde", "namespace": "llm", "pod_uid": "0b6e-uid", "node": "gpu-node-3"},
        ),
        ({"VLLM_GUARDIAN_POD_NAME": "p", "VLLM_GUARDIAN_NODE_NAME": ""}, False, {"pod": "p"}),
    ],
    ids=["host", "off", "pod", "partial"],
)  # fmt: skip
def test_mode_and_identity_from_the_environment(
    env: dict[str, str], mode: bool, identity: dict[str, str]
) -> None:
    assert container_mode(env) is mode
    assert pod_identity(env) == identity


def test_audit_records_carry_the_pods_identity(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", identity=pod_identity(POD_ENV))
    assert log.write([Decision(1.0, "vllm", DecisionKind.GATE, "kv high")])
    (record,) = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert record["pod"] == "llama-7d9f-abcde" and record["node"] == "gpu-node-3"
    assert record["service"] == "vllm" and record["reason"] == "kv high"
    plain = AuditLog(tmp_path / "host.jsonl")
    assert plain.write([Decision(1.0, "vllm", DecisionKind.GATE, "kv high")])
    assert "pod" not in json.loads((tmp_path / "host.jsonl").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Kubelet:
    """Probes liveness and readiness on a schedule, as the kubelet does, and keeps every answer."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.liveness: list[tuple[float, int | None]] = []
        self.readiness: list[tuple[float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _probe(self, path: str) -> int | None:
        try:
            return requests.get(self.base + path, timeout=1).status_code
        except requests.RequestException:
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            self.liveness.append((now, self._probe("/healthz")))
            self.readiness.append((now, self._probe("/ready/vllm")))
            self._stop.wait(0.2)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_the_pod_as_processes(tmp_path: Path) -> None:
    guardian_port, vllm_port = free_port(), free_port()
    log_file = tmp_path / "state" / "vllm.log"
    twin = [
        sys.executable, "-m", "vllm_guardian", "sim", "serve", "facebook/opt-125m",
        "--host", "127.0.0.1", "--port", str(vllm_port), "--sim-speed", "4", "--enforce-eager",
    ]  # fmt: skip
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "interval_seconds": 0.5,
                "listen": f"127.0.0.1:{guardian_port}",
                "runtime_dir": str(tmp_path / "run"),
                "state_dir": str(tmp_path / "state"),
                "recorder": {"path": str(tmp_path / "state" / "flight.jsonl")},
                "sources": {"nvml": {"enabled": False}, "unit": {"enabled": False}},
                "policy": {"backend": "process", "dry_run": True, "drain_timeout_seconds": 30},
                "services": [
                    {
                        "name": "vllm",
                        "url": f"http://127.0.0.1:{vllm_port}",
                        "log_file": str(log_file),
                        "command": twin,
                    }
                ],
            }
        )
    )
    out_path = tmp_path / "guardian.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **POD_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{guardian_port}"

    def seen() -> str:
        text = out_path.read_text(errors="replace")
        problems = [line for line in text.splitlines() if "ERROR" in line or "cannot" in line]
        return "\n".join(problems[-10:]) + "\n...\n" + text[-2000:]

    try:
        with Kubelet(base) as kubelet:
            wait_for(lambda: bool(kubelet.liveness) and kubelet.liveness[-1][1] == 200, "liveness 200", seen=seen)  # fmt: skip
            wait_for(lambda: bool(kubelet.readiness) and kubelet.readiness[-1][1] == 200, "readiness 200", seen=seen)  # fmt: skip
            # vLLM's own log, through the guardian's stdout (`kubectl logs`) and into the file.
            wait_for(lambda: "Starting vLLM server" in out_path.read_text(errors="replace"), "vLLM's log on stdout", seen=seen)  # fmt: skip
            wait_for(lambda: log_file.exists() and "Starting vLLM server" in log_file.read_text(errors="replace"), "vLLM's log in the file", seen=seen)  # fmt: skip
            assert (
                requests.get(f"http://127.0.0.1:{vllm_port}/health", timeout=5).status_code == 200
            )
            # A ConfigMap update: the kubelet swaps the file under the mount; no SIGHUP comes.
            doc = json.loads(cfg.read_text())
            doc["interval_seconds"] = 0.4
            staged = tmp_path / "config.new"
            staged.write_text(json.dumps(doc))
            os.replace(staged, cfg)
            wait_for(lambda: "config reloaded from" in out_path.read_text(errors="replace"), "the changed ConfigMap reloaded", seen=seen)  # fmt: skip
            # The pod is told to stop while a client's stream runs through the gate.
            gate = GateThread(f"http://127.0.0.1:{vllm_port}", guardian=base)
            try:
                wait_for(lambda: requests.get(f"{gate.url}/health", timeout=2).ok, "the gate is open", seen=seen)  # fmt: skip
                stop_at, lines = stream_and_sigterm(gate.url, proc, MAX_TOKENS, seen)
                proc.wait(timeout=60)
                stopped_in = time.monotonic() - stop_at
            finally:
                gate.stop()
        first_live = next(t for t, code in kubelet.liveness if code == 200)
        after_up = [code for t, code in kubelet.liveness if first_live <= t < stop_at]
        assert set(after_up) == {200}, f"liveness failed while running: {after_up}"
        ready = [code for t, code in kubelet.readiness if t < stop_at and code is not None]
        # Not ready while vLLM starts (the twin takes seconds to import and load), then ready.
        assert 503 in ready and ready[-1] == 200, ready
        assert ready.index(200) > ready.index(503), ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, seen()
    # The stream ended whole: every token, its finish reason, [DONE]; the drain was said.
    said = "\n".join(
        x for x in out_path.read_text(errors="replace").splitlines() if "stopping" in x
    )
    events = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]", f"{lines[-3:]}\n{said}"
    assert [e["choices"][0]["finish_reason"] for e in events[-1:]] == ["length"], events[-2:]
    assert len(events) == MAX_TOKENS, (len(events), events[-2:])
    assert "stopping: front door closed; draining vllm" in said, said
    assert "stopping: drained in" in said, said
    assert stopped_in < 60, "within the pod's grace period"
    with socket.socket() as s:  # vLLM stopped with the guardian: nothing on its port
        assert s.connect_ex(("127.0.0.1", vllm_port)) != 0
    print(f"SIGTERM to exit: {stopped_in:.1f}s, {len(events)} tokens streamed through it")


MAX_TOKENS = 500  # about 1.5 s of stream at --sim-speed 4 on this machine


def stream_and_sigterm(
    gate_url: str, proc: subprocess.Popen[bytes], max_tokens: int, seen: Callable[[], str]
) -> tuple[float, list[str]]:
    """Stream a completion through the gate and SIGTERM the guardian at its first event;
    read the stream to its end. Returns when the SIGTERM was sent and the lines received."""
    body = {"model": "facebook/opt-125m", "prompt": "hello", "max_tokens": max_tokens,
            "stream": True}  # fmt: skip
    lines: list[str] = []
    term_at = 0.0
    try:
        with requests.post(f"{gate_url}/v1/completions", json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            for raw in r.iter_lines():
                if raw:
                    lines.append(raw.decode())
                if len(lines) == 1 and not term_at:  # the stream is under way
                    term_at = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
    except requests.RequestException as e:
        raise AssertionError(f"the stream broke after {len(lines)} lines: {e!r}\n{seen()}") from e
    assert term_at, f"no event came: {lines}"
    return term_at, lines


# --- GPU memory in a container: NVML's pids are the host's ------------------------------------

GIB = 1024**3


def _gpu_case(
    by_device: bool, gpus: tuple[int, ...] | None
) -> tuple[list[int], int | None, int | None]:
    from vllm_guardian.config import ServiceConfig
    from vllm_guardian.core.gpu_signals import _gpu_signals, _service_gpus
    from vllm_guardian.model import GpuDevice, GpuProcess, UnitState

    # vLLM is pid 7 in the pod; NVML names it by its host pid 48213, which /proc here lacks.
    device = GpuDevice(0, "GPU-1", "H100", 80 * GIB, 70 * GIB, 10 * GIB, processes=(GpuProcess(48213, 69 * GIB),))  # fmt: skip
    unit = UnitState("vllm", "active", "running", "success", 7, 0, 0, None, None, None, (7,))
    svc = ServiceConfig(name="vllm", gpus=gpus, gpu_memory_by_device=by_device)
    devices = _service_gpus([device], svc, unit)
    signals = _gpu_signals(devices, unit, 0.9, svc.gpu_memory_by_device)
    mine = sum(g.service_memory_bytes or 0 for g in signals) if signals else None
    other = sum(g.other_memory_bytes or 0 for g in signals) if signals else None
    return [d.index for d in devices], mine, other


@pytest.mark.parametrize(
    ("by_device", "gpus", "expected"),
    [
        (False, None, ([], None, None)),  # by process, auto: vLLM's GPU is not even found
        (False, (0,), ([0], 0, 69 * GIB)),  # by process, listed: vLLM counted as "another process"
        (True, None, ([0], 70 * GIB, 0)),  # by device (the chart): the pod's GPU, all its memory
        (True, (0,), ([0], 70 * GIB, 0)),
    ],
    ids=["process-auto", "process-listed", "device-auto", "device-listed"],
)
def test_gpu_memory_by_device_in_a_container(
    by_device: bool,
    gpus: tuple[int, ...] | None,
    expected: tuple[list[int], int | None, int | None],
) -> None:
    assert _gpu_case(by_device, gpus) == expected


def test_status_says_memory_is_attributed_by_device() -> None:
    from vllm_guardian.tools.cli import render_status

    svc = {"service": "vllm", "service_memory_bytes": 70 * GIB, "gpu_memory_by_device": True}
    text = render_status({"version": "x", "signals": {"services": [svc]}})
    assert "GPU memory (by device: NVML's host pids are not visible here): service 70.0 GiB" in text
    del svc["gpu_memory_by_device"]
    assert "by device" not in render_status({"version": "x", "signals": {"services": [svc]}})
