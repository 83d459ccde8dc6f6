"""vLLM's fast-restart machinery (``vllm preload``, 0.31+) is not the guardian's to break.

``vllm preload --model M`` starts one weight-cache daemon per GPU (a ``spawn`` child of the
launcher, no process title of its own: vllm/entrypoints/cli/preload.py) holding the model's
weights; engines started with ``--load-format ipc_cache`` map them, and vLLM subtracts what the
daemon holds from the engine's own budget (vllm/v1/worker/utils.py ``request_memory``). So the
daemon's memory is inside the service's budget, not a hostile neighbour's; it outlives every
restart on purpose (that is what makes the restart fast), so the VRAM-freed wait does not wait
for it and no sweep of a process group kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nvml_fake import make_proc_entry
from vllm_guardian.actuators.flags import parse, render, validate
from vllm_guardian.actuators.procmgr import marked_processes, signal_group
from vllm_guardian.config import ServiceConfig, SignalsConfig
from vllm_guardian.core import signals as sig
from vllm_guardian.core.diagnosis import evidence_from_logs
from vllm_guardian.core.policy import seen
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import Bundle
from vllm_guardian.formats.vllm_log_format import match_line
from vllm_guardian.lowio.procfs import is_weight_cache_command
from vllm_guardian.model import (
    Cause,
    GpuDevice,
    GpuProcess,
    GpuReading,
    LogEvent,
    LogEventKind,
    ServiceSnapshot,
    Snapshot,
    UnitState,
)
from vllm_guardian.sources.nvml import _ProcReader
from vllm_guardian.tools.operator import parse_set

GIB = 1024**3
VENV = "/opt/vllm/bin"

COMMANDS = [
    # name, /proc/PID/cmdline's arguments, a weight-cache launcher?
    ("the console script", [f"{VENV}/python", f"{VENV}/vllm", "preload", "--model", "/m"], True),
    ("run as itself", [f"{VENV}/vllm", "preload", "--model", "/m", "-tp", "4"], True),
    ("python -m", ["python3", "-m", "vllm.entrypoints.cli.main", "preload", "--model", "/m"], True),
    ("an engine mapping the cache", [f"{VENV}/vllm", "serve", "/m", "--load-format", "ipc_cache"],
     False),
    ("a model named preload", [f"{VENV}/vllm", "serve", "preload"], False),
    ("another program's preload", ["python3", "train.py", "preload"], False),
    ("the daemon itself (a spawn child)", ["python3", "-c", "from multiprocessing.spawn import "
     "spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)", "--multiprocessing-fork"], False),
    ("nothing", [], False),
]  # fmt: skip


@pytest.mark.parametrize(("name", "argv", "cache"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_the_launcher_is_told_by_its_command(name: str, argv: list[str], cache: bool) -> None:
    assert is_weight_cache_command("".join(a + "\0" for a in argv)) is cache


def _proc_tree(root: Path) -> None:
    """launcher 5000 (vllm preload) → daemon 5001 (spawn child); vllm serve 4000 → worker 4242."""
    for pid, ppid, argv in (
        (5000, 1, [f"{VENV}/python", f"{VENV}/vllm", "preload", "--model", "/m"]),
        (5001, 5000, ["python3", "-c", "from multiprocessing.spawn import spawn_main"]),
        (4000, 1, [f"{VENV}/python", f"{VENV}/vllm", "serve", "/m", "--load-format", "ipc_cache"]),
        (4242, 4000, ["VLLM::Worker"]),
    ):
        make_proc_entry(root, pid, ppid=ppid, comm="python3", cgroup="0::/x\n")
        (root / str(pid) / "cmdline").write_text("".join(a + "\0" for a in argv))


def test_the_gpu_source_marks_the_daemon_by_its_launcher(tmp_path: Path) -> None:
    _proc_tree(tmp_path)
    procs = tuple(GpuProcess(pid, GIB) for pid in (5001, 4242))
    dev = GpuDevice(0, "GPU-0", "H100", 80 * GIB, 2 * GIB, 78 * GIB, processes=procs)
    got = _ProcReader(tmp_path).attribute(GpuReading((dev,)))
    assert [(p.pid, p.weight_cache) for p in got.devices[0].processes or ()] == [
        (5001, True),
        (4242, False),
    ]


UNIT = UnitState("vllm.service", "active", "running", "success", 4000, 0, None, None,
                 "/system.slice/vllm.service", None, pids=(4000, 4242))  # fmt: skip
DAEMON = GpuProcess(5001, 20 * GIB, "python3", "/system.slice/vllm-preload.service", (5000, 1),
                    weight_cache=True)  # fmt: skip
ENGINE = GpuProcess(4242, 50 * GIB, "python3", "/system.slice/vllm.service", (4000, 1))
STRANGER = GpuProcess(900, 3 * GIB, "python3", "/user.slice/job", (1,))


def _snap(*procs: GpuProcess) -> Snapshot:
    used = sum(p.used_memory_bytes or 0 for p in procs)
    dev = GpuDevice(0, "GPU-0", "H100", 80 * GIB, used, 80 * GIB - used, processes=procs)
    return Snapshot(10.0, (ServiceSnapshot("vllm", unit=UNIT),), GpuReading((dev,)))


def test_the_daemon_is_inside_the_budget_not_a_neighbour() -> None:
    s = sig.derive([_snap(ENGINE, DAEMON, STRANGER)], [ServiceConfig(name="vllm")],
                   SignalsConfig()).services[0]  # fmt: skip
    assert s.other_processes_memory_bytes == 3 * GIB  # the stranger only
    assert s.service_memory_bytes == 70 * GIB  # vLLM counts the mapped weights in its budget


def test_a_pod_restart_does_not_wait_for_the_daemon() -> None:
    svc = ServiceConfig(name="vllm", gpu_memory_by_device=True)
    snap = _snap(ENGINE, DAEMON)
    s = sig.derive([snap], [svc], SignalsConfig()).services[0]
    assert seen(snap, s, "vllm").device_pids == ((0, (4242,)),)


# This test process's own mark: no other process on the machine carries it.
MARK = f"vllm:{os.getpid()}"


@pytest.fixture
def group_with_a_daemon(tmp_path: Path):
    """A shell (the command, its own process group) that started ``vllm preload`` (a fake
    launcher: a program named vllm run with ``preload``) and a worker, both in its group."""
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    fake.chmod(0o755)
    env = dict(os.environ, VLLM_GUARDIAN_SUPERVISED=MARK)
    script = f"{fake} preload --model /m & sleep 120 & echo started; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, env=env,
                            stdout=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    members: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(members) < 2:
        members = [
            int(d) for d in os.listdir("/proc")
            if d.isdigit() and int(d) != proc.pid and _pgid(int(d)) == proc.pid
        ]  # fmt: skip
        time.sleep(0.05)
    assert len(members) == 2, f"the group's children did not start: saw {members}"
    yield proc, members
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _cmd(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_group_sweep_spares_the_daemon(group_with_a_daemon) -> None:
    proc, members = group_with_a_daemon
    daemon = next(m for m in members if b"preload" in _cmd(m))
    other = next(m for m in members if m != daemon)
    assert marked_processes(MARK, outside_pgid=os.getpgid(os.getpid())) == sorted(
        [proc.pid, other]
    )  # the daemon carries the mark too, but is no escapee
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _cmd(other):
        time.sleep(0.05)
    assert _cmd(other) == b"", f"pid {other} still runs"
    assert b"preload" in _cmd(daemon), "the weight-cache daemon was killed"


# vLLM 0.32's two start-up errors about externally held weights (vllm/v1/worker/utils.py
# request_memory, an engine started with --load-format ipc_cache), as a worker logs them.
WORKER = "(Worker pid=7) ERROR 11-26 17:00:00 [multiproc_executor.py:772] ValueError: "
EXCEED = (
    WORKER + "Externally held weights on device cuda:0 (70.00/79.18 GiB) exceed the desired GPU "
    "memory utilization (0.8, 63.34 GiB). Increase GPU memory utilization or reduce GPU memory "
    "used by other processes."
)
SHORT = (
    WORKER + "Free memory on device cuda:0 (12.00/79.18 GiB) on startup is less than the engine's "
    "budget after excluding external process's weights (0.9, 31.26 GiB). Decrease GPU memory "
    "utilization or reduce GPU memory used by other processes."
)


def test_the_start_up_errors_about_external_weights_are_read() -> None:
    kind, details = match_line(EXCEED) or (None, ())
    assert kind is LogEventKind.EXTERNAL_WEIGHTS_EXCEED_BUDGET
    assert dict(details) == {
        "device": "cuda:0",
        "external_weights_bytes": str(70 * GIB),
        "total_bytes": str(int(79.18 * GIB)),
        "gpu_memory_utilization": "0.8",
        "requested_bytes": str(int(63.34 * GIB)),
    }
    kind, details = match_line(SHORT) or (None, ())
    assert kind is LogEventKind.FREE_MEMORY_BELOW_UTILIZATION
    assert dict(details)["external_weights"] == "true"
    assert dict(details)["engine_budget_bytes"] == str(int(31.26 * GIB))


def test_diagnose_names_what_to_change_for_each() -> None:
    kind, details = match_line(EXCEED) or (None, ())
    assert kind is not None
    (ev,) = evidence_from_logs([LogEvent(kind, 0.0, EXCEED, details)], None)
    assert ev.cause is Cause.MODEL_DOES_NOT_FIT and ev.unambiguous
    assert "vllm preload" in ev.sentence and "raise --gpu-memory-utilization" in ev.sentence
    kind, details = match_line(SHORT) or (None, ())
    assert kind is not None
    (ev,) = evidence_from_logs([LogEvent(kind, 0.0, SHORT, details)], None)
    assert ev.cause is Cause.GPU_MEMORY_OVERCOMMIT
    assert "external process's weights" in ev.sentence


def test_a_bundle_with_the_daemon_reports_no_neighbour(tmp_path: Path) -> None:
    gpus = [{"index": 0, "name": "H100", "memory_total_bytes": 80 * GIB,
             "memory_used_bytes": 73 * GIB, "xid_events": [], "processes": [
                 {"pid": 4242, "used_memory_bytes": 50 * GIB, "service": True},
                 {"pid": 5001, "used_memory_bytes": 20 * GIB, "service": False,
                  "weight_cache": True},
                 {"pid": 900, "used_memory_bytes": 3 * GIB, "service": False}]}]  # fmt: skip
    report = analyze(Bundle(origin="t", gpus=gpus))
    (g,) = report.gpus
    assert g.vllm_bytes == 70 * GIB
    assert [o.pid for o in g.others] == [900]


LOAD_FORMATS = [
    # value, accepted? (vLLM 0.32's LoadFormats: the ones that read the same checkpoint with no
    # further configuration; never "dummy", whose weights are random)
    ("ipc_cache", True),
    ("auto", True),
    ("safetensors", True),
    ("dummy", False),
    ("tensorizer", False),
    ("ipc_cache --enforce-eager", False),
    ("", False),
]


@pytest.mark.parametrize(("value", "ok"), LOAD_FORMATS)
def test_an_operator_may_switch_the_load_format(value: str, ok: bool) -> None:
    if ok:
        assert parse_set(f"load_format={value}") == ("--load-format", value)
        text = render(validate([("--load-format", value)], ()))
        assert parse(text).flags == (("--load-format", value),)
    else:
        with pytest.raises(ValueError, match="--load-format"):
            parse_set(f"load_format={value}")
