"""Test helpers for the GPU source: build the fake libnvidia-ml, drive its state, fake /proc.

The fake library (tests/fake_nvml/fake_nvml.c) re-reads the text file named by the env var
FAKE_NVML_STATE on every call, so a test rewrites that file between collects to change
GPUs, memory, processes, lost GPUs, XID events and init return codes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

FAKE_NVML_SOURCE = Path(__file__).parent / "fake_nvml" / "fake_nvml.c"


def build_fake_nvml(out_dir: Path, variant: str = "") -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``; raises if gcc fails.

    ``variant`` is appended to the driver version it reports, to tell two builds apart.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FileNotFoundError("gcc")
    lib = out_dir / "libnvidia-ml.so.1"
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Werror",
            f"-DFAKE_NVML_VARIANT={json.dumps(variant)}",
            "-o",
            str(lib),
            str(FAKE_NVML_SOURCE),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return lib


class FakeNvmlState:
    """The fake driver's state file and call log for one test."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "nvml-state.txt"
        self.calls_path = directory / "nvml-calls.txt"
        self.path.write_text("")

    def write(self, *lines: str) -> None:
        # Written whole and renamed, like a real state change: the library never sees half.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)

    def calls(self, name: str) -> int:
        if not self.calls_path.exists():
            return 0
        return self.calls_path.read_text().splitlines().count(name)


def make_proc_entry(
    root: Path, pid: int, *, ppid: int | None, comm: str | None, cgroup: str | None
) -> None:
    """A ``<root>/<pid>`` directory with the stat/comm/cgroup files the collector reads.

    ``None`` leaves that file out, like a file the guardian may not read.
    """
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    if ppid is not None:
        name = comm or "x"
        # The comm field may hold spaces and ')' itself: the parser must find the last one.
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560 0 0 0\n")
    if comm is not None:
        (d / "comm").write_text(comm + "\n")
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
