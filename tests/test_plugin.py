"""The in-vLLM plugin: the entry point, its idle paths, and its publishing loop under torch.

Tests that need torch run under the real CPU build of torch 2.13.0 in ``.venv-plugin``
(scripts/test creates it; the daemon's venv stays free of torch) and skip elsewhere. CUDA is
the one boundary faked: ``torch.version.cuda``, ``torch.cuda.is_initialized``,
``device_count`` and ``memory_stats`` are patched with realistic values.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm_guardian.formats import allocator_format as fmt
from vllm_guardian.plugin import publisher as pub

GIB = 1024**3


def require_torch() -> ModuleType:
    try:
        import torch
    except ImportError:
        if os.environ.get("VLLM_GUARDIAN_REQUIRE_TORCH"):
            pytest.fail("torch is required here (scripts/test installs it in .venv-plugin)")
        pytest.skip(
            "torch not installed here (the daemon's venv never has it): scripts/test runs this "
            "file again in .venv-plugin, with torch, where a missing torch fails"
        )
    return torch


REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """A fresh interpreter, isolated (-I: no PYTHONPATH, user site or working directory), that
    imports this checkout's vllm_guardian, never another one installed beside it (a worktree
    sharing the main checkout's venv would otherwise test the main checkout's code).

    The checkout reaches it through a directory holding only a link to the package: the
    repository root itself may hold a vllm_guardian.egg-info (an editable install's), which
    would be a second distribution with the same entry point. Entry points come from the
    installed distribution's metadata, checked against pyproject.toml where they matter.
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GUARDIAN_ALLOCATOR")}
    full.update(env or {})
    with tempfile.TemporaryDirectory(prefix="plugin-path-") as path:
        (Path(path) / "vllm_guardian").symlink_to(REPO / "vllm_guardian")
        prologue = f"""
            import importlib.util as _util, pathlib as _pathlib, sys as _sys
            _sys.path.insert(0, {path!r})
            _origin = _pathlib.Path(_util.find_spec("vllm_guardian").origin).resolve()
            assert _origin.is_relative_to({str(REPO)!r}), f"vllm_guardian from {{_origin}}"
            del _util, _pathlib, _sys, _origin
        """
        return subprocess.run(
            [sys.executable, "-I", "-c", textwrap.dedent(prologue) + textwrap.dedent(code)],
            capture_output=True, text=True, timeout=60, env=full, cwd=cwd or Path("/"),
        )  # fmt: skip


def test_subprocesses_import_this_checkout():
    proc = run_python(
        """
        import pathlib
        import vllm_guardian.plugin
        print(pathlib.Path(vllm_guardian.plugin.__file__).resolve())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == REPO / "vllm_guardian/plugin/__init__.py"


def stats(device: int) -> dict[str, int]:
    if device == 1:
        return {}  # a device this process never touched (another rank's)
    return {
        "allocated_bytes.all.current": 12 * GIB, "allocated_bytes.all.peak": 14 * GIB,
        "reserved_bytes.all.current": 20 * GIB, "reserved_bytes.all.peak": 21 * GIB,
        "active_bytes.all.current": 13 * GIB, "active_bytes.all.peak": 15 * GIB,
        "inactive_split_bytes.all.current": 7 * GIB, "inactive_split_bytes.all.peak": 7 * GIB,
        "num_alloc_retries": 3, "num_ooms": 0, "segment.all.current": 180,
    }  # fmt: skip


# --- the entry point, without vLLM -------------------------------------------------------------


def test_entry_point_is_discoverable_and_runs_without_vllm(tmp_path):
    out = tmp_path / "alloc"
    proc = run_python(
        """
        import importlib.metadata, importlib.util, logging
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        assert importlib.util.find_spec("vllm") is None, "vLLM must not be needed"
        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
        (ep,) = [e for e in eps if e.name == "vllm_guardian"]
        print("entry point", ep.value)
        fn = ep.load()
        fn(); fn()  # vLLM calls it once per process; it must be re-entrant
        """,
        env={fmt.ENV_DIR: str(out)},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    value = declared["vllm.general_plugins"]["vllm_guardian"]
    assert value == "vllm_guardian.plugin:register"
    # The installed metadata declares what this checkout's pyproject.toml does.
    assert f"entry point {value}" in proc.stdout, (proc.stdout, "reinstall: pip install -e .")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vllm_guardian.plugin")]
    assert len(lines) == 1, proc.stderr  # its one line, whatever torch is there
    assert "no torch" in lines[0] or "publishing to" in lines[0]
    assert not out.exists()  # no CUDA: nothing written


def test_disabled_without_the_environment_variable():
    proc = run_python(
        """
        import logging, sys, threading
        logging.basicConfig(level=logging.DEBUG)
        from vllm_guardian.plugin import register
        register()
        assert threading.active_count() == 1, threading.enumerate()
        assert "torch" not in sys.modules
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # silent: installed but not asked for


def test_idle_without_torch(tmp_path):
    proc = run_python(
        """
        import logging, sys, threading
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        sys.modules["torch"] = None  # as if torch were not installed
        from vllm_guardian.plugin import register
        register(); register()
        assert threading.active_count() == 1
        """,
        env={fmt.ENV_DIR: str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"vllm-guardian allocator plugin: no torch in pid {proc.stderr.split()[-2][:-1]}: idle"
    ]


@pytest.mark.parametrize("module", ["vllm_guardian.shell.daemon", "vllm_guardian.tools.cli"])
def test_the_daemon_never_imports_torch(module: str):
    proc = run_python(
        f"""
        import importlib, sys
        importlib.import_module("{module}")
        import vllm_guardian.sources.registry, vllm_guardian.plugin
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- the publisher with an injected backend (no torch needed) ---------------------------------


class FakeCuda:
    """The GPU boundary: what torch.cuda would answer in a process with two visible GPUs."""

    def __init__(self, ready: bool = True, capable: bool = True) -> None:
        self.is_ready = ready
        self.is_capable = capable
        self.calls = 0

    def capable(self) -> bool:
        return self.is_capable

    def ready(self) -> bool:
        return self.is_ready

    def device_count(self) -> int:
        return 2

    def memory_stats(self, device: int) -> dict[str, int]:
        self.calls += 1
        return stats(device)


def test_step_waits_for_cuda_then_writes_one_file_per_used_device(tmp_path):
    cuda = FakeCuda(ready=False)
    p = pub.Publisher(tmp_path / "d", 5.0, lambda: cuda, pid=4250, time_fn=lambda: 100.0,
                      env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                           "CUDA_VISIBLE_DEVICES": "2,3"})  # fmt: skip
    assert p.step() == 0 and cuda.calls == 0  # vLLM has not set the device yet: no CUDA call
    assert not (tmp_path / "d").exists()
    cuda.is_ready = True
    assert p.step() == 1
    assert sorted(os.listdir(tmp_path / "d")) == ["4250-0.json"]
    rec = fmt.decode((tmp_path / "d" / "4250-0.json").read_bytes())
    assert (rec.pid, rec.device, rec.time_seconds, rec.alloc_retries) == (4250, 0, 100.0, 3)
    assert rec.alloc_conf == "expandable_segments:True" and rec.cuda_visible_devices == "2,3"


def test_no_cuda_build_logs_one_line_and_stops(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vllm_guardian.plugin")
    p = pub.Publisher(tmp_path, 0.01, lambda: FakeCuda(capable=False), pid=7)
    p.start()
    p._thread.join(5)  # type: ignore[union-attr]
    assert not p.alive() and p.written == 0
    assert caplog.messages == ["vllm-guardian allocator plugin: torch has no CUDA in pid 7: idle"]


def test_exceptions_are_caught_and_logged_once(tmp_path, caplog):
    class Broken(FakeCuda):
        def memory_stats(self, device: int) -> dict[str, int]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    p = pub.Publisher(tmp_path, 5.0, Broken, pid=7)
    assert [p.step() for _ in range(3)] == [0, 0, 0]
    assert p.errors == 3
    assert len([m for m in caplog.messages if "RuntimeError" in m]) == 1


def test_leftovers_of_dead_processes_are_removed_at_start(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / fmt.file_name(dead.pid, 0)).write_text("{}")
    (tmp_path / fmt.file_name(os.getppid(), 0)).write_text("{}")  # alive: not ours to remove
    pub.Publisher(tmp_path, 5.0, FakeCuda, pid=4250).step()
    assert sorted(os.listdir(tmp_path)) == sorted(["4250-0.json", fmt.file_name(os.getppid(), 0)])


@pytest.mark.parametrize(("raw", "interval"), [("", 5.0), ("2", 2.0), ("0", 5.0), ("x", 5.0)])
def test_interval_from_the_environment(raw: str, interval: float):
    assert pub._interval({fmt.ENV_INTERVAL: raw}) == interval


# --- under the real torch CPU build -----------------------------------------------------------


def test_real_torch_without_cuda_stays_idle(tmp_path, caplog):
    torch = require_torch()
    assert torch.version.cuda is None and not torch.cuda.is_initialized()
    caplog.set_level(logging.INFO, "vllm_guardian.plugin")
    p = pub.Publisher(tmp_path, 5.0, pid=11)  # the default backend: the loaded torch
    assert p.step() == 0 and os.listdir(tmp_path) == []
    assert caplog.messages == ["vllm-guardian allocator plugin: torch has no CUDA in pid 11: idle"]


def test_real_torch_register_in_a_process(tmp_path):
    require_torch()
    proc = run_python(
        """
        import logging, time, torch
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from vllm_guardian.plugin import register
        register()
        time.sleep(0.5)
        """,
        env={fmt.ENV_DIR: str(tmp_path), fmt.ENV_INTERVAL: "0.1"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, lines  # the thread and the caller race: order is not fixed
    assert any("loaded in pid" in x for x in lines) and any("torch has no CUDA" in x for x in lines)
    assert os.listdir(tmp_path) == []


def test_publishing_loop_with_torch_stats_injected(tmp_path, monkeypatch):
    torch = require_torch()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats(device))
    p = pub.Publisher(tmp_path, 0.05)
    p.start()
    try:
        deadline = time.monotonic() + 10
        while p.written < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        p.stop()
    assert not p.alive() and p.written >= 3 and p.errors == 0
    assert os.listdir(tmp_path) == [fmt.file_name(os.getpid(), 0)]  # no temporary file left
    rec = fmt.decode((tmp_path / fmt.file_name(os.getpid(), 0)).read_bytes())
    assert rec.inactive_split_bytes == 7 * GIB and rec.fragmentation_ratio == pytest.approx(0.35)
    doc: dict[str, Any] = json.loads((tmp_path / fmt.file_name(os.getpid(), 0)).read_text())
    assert doc["schema"] == fmt.SCHEMA


def test_a_forked_child_gets_its_own_publisher(tmp_path):
    require_torch()
    proc = run_python(
        """
        import os, time, torch
        from vllm_guardian.plugin import publisher as pub
        parent = pub.start()
        pid = os.fork()
        if pid == 0:
            child = pub._process.publisher
            ok = child is not None and child is not parent and child.pid == os.getpid()
            time.sleep(0.3)
            os._exit(0 if ok and child.alive() is False else 3)  # CPU torch: idle and done
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        env={fmt.ENV_DIR: str(tmp_path), fmt.ENV_INTERVAL: "0.1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "child 0", proc.stderr
