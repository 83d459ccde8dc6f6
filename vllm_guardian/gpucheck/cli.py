"""The GPU check's command line: find the card, probe torch, run the steps, write the report.

Where it sits: ``scripts/gpu-check`` → ``python -m vllm_guardian.gpucheck`` → :func:`main`.
A host without a GPU, or without torch built with CUDA, gets one line and exit status 2,
before anything is written.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_guardian.config import NvmlSourceConfig
from vllm_guardian.gpucheck import report as rp
from vllm_guardian.gpucheck import steps as st
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.model import GpuReading
from vllm_guardian.sources.nvml import DEFAULT_INTERVAL_SECONDS, NvmlCollector

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_GPU_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=(
            "Measure the guardian's GPU-facing parts on this host's first visible NVIDIA GPU "
            "(NVML source, allocator plugin, CUDA OOM matching, exhaustion forecast, VRAM "
            "release) and write gpu-check.json and gpu-check.md into OUTDIR. Needs torch "
            "with CUDA in the Python that runs the workloads; takes at most 8 minutes. "
            "Exit status: 0 all applicable steps passed, 1 one failed, 2 no GPU here."
        ),
    )
    p.add_argument("outdir", type=Path, help="where the report is written (created if needed)")
    p.add_argument(
        "--steps",
        default=",".join(st.STEP_NAMES),
        help=f"comma-separated subset of: {', '.join(st.STEP_NAMES)} (default: all)",
    )
    p.add_argument(
        "--python",
        default=st.interpreter(),
        help="the Python with torch (CUDA) that runs the workloads (default: this one)",
    )
    p.add_argument(
        "--nvml-library",
        default=None,
        help="path of libnvidia-ml.so.1 when it is not on the loader path",
    )
    return p


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _commit() -> str | None:
    """The checkout's commit, ``-dirty`` when the tree differs from it (a copied tree may)."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return f"{head}-dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


def _say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in st.STEP_NAMES]
    if unknown:
        _parser().error(f"unknown step(s): {', '.join(unknown)}")
    # The sources log their own troubles; here the check's lines say what matters.
    logging.basicConfig(level=logging.ERROR, format="gpu-check: %(name)s: %(message)s")
    started = time.monotonic()
    nvml = NvmlCollector(
        NvmlSourceConfig(library_path=args.nvml_library),
        SystemClock(),
        interval_seconds=DEFAULT_INTERVAL_SECONDS,
    )
    reading = nvml.collect()
    if not isinstance(reading.payload, GpuReading) or not reading.payload.devices:
        why = reading.error or "NVML lists no GPU"
        print(f"gpu-check: no NVIDIA GPU here ({why}); nothing to check", file=sys.stderr)
        return NO_GPU_EXIT
    args.outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    env = st.child_env(os.environ, REPO_ROOT)
    probe = st.Child(args.python, "info", {}, env)
    try:
        info = probe.event(time.monotonic() + st.BOUNDS_SECONDS["environment"], "info", "no_cuda")
    except st.StepTimeout as e:
        # One line: the workload's own last word (ModuleNotFoundError: No module named 'torch').
        said = probe.stderr_tail().strip().splitlines()
        why = said[-1] if said else str(e)
        print(f"gpu-check: torch with CUDA is needed in {args.python}: {why}", file=sys.stderr)
        return NO_GPU_EXIT
    finally:
        probe.release()
    if info["event"] == "no_cuda":
        print(
            f"gpu-check: {args.python}'s torch {info.get('torch')} sees no CUDA device; "
            "nothing to check",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    ctx = st.Context(python=args.python, env=env, nvml=nvml, work_dir=work, uuid=info.get("uuid"))
    host = st.host_facts(ctx, info, reading.payload)
    meta = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": "scripts/gpu-check " + " ".join(argv),
        "bounds_seconds": dict(st.BOUNDS_SECONDS),
    }
    _say(
        f"{host['card']} (driver {host['driver']}, torch {host['torch']}, CUDA {host['torch_cuda']})"
    )
    results = st.run_steps(ctx, names, args.outdir, host, meta, started, _say)
    code = rp.exit_code(results)
    _say(
        f"{rp.overall(results).value}: report in {args.outdir / 'gpu-check.md'} "
        f"({time.monotonic() - started:.0f} s)"
    )
    nvml.close()
    return code
