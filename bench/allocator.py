"""Benchmark: the allocator source on a directory where dead processes' files linger.

Run: .venv/bin/python bench/allocator.py [--stale 33] [--collects 300]

A plugin directory that nothing cleans (a RuntimeDirectory= that outlived a crash, a host that
ran many vLLMs) holds files of processes that are gone; one host had 33. Each tick the source
lists the directory and must leave those out. Measured in the same run, thread CPU per collect:

* ``kept``: one collector, as the daemon runs it (a dropped file keeps its verdict while it is
  the same unchanged file);
* ``fresh``: a new collector each time, which reads and decodes every file (what every tick
  cost before verdicts were kept).

The ratio fresh ÷ kept is the figure; both walk the same directory on the same host.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_guardian.config import AllocatorSourceConfig  # noqa: E402
from vllm_guardian.formats import allocator_format as fmt  # noqa: E402
from vllm_guardian.lowio.clock import FakeClock  # noqa: E402
from vllm_guardian.sources.allocator import AllocatorCollector  # noqa: E402

NOW = 1_700_000_000.0


def _record(pid: int) -> bytes:
    gib = 1 << 30
    return fmt.encode(
        fmt.AllocatorStats(
            pid=pid, device=0, time_seconds=NOW, interval_seconds=5.0,
            allocated_bytes=20 * gib, allocated_peak_bytes=22 * gib, reserved_bytes=24 * gib,
            reserved_peak_bytes=25 * gib, active_bytes=20 * gib, active_peak_bytes=22 * gib,
            inactive_split_bytes=gib, inactive_split_peak_bytes=2 * gib, alloc_retries=0,
            ooms=0, segments=120, process_name="VLLM::Worker",
        )
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--stale", type=int, default=33)
    ap.add_argument("--collects", type=int, default=300)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the "left out" warning, once per collector
    directory = Path(tempfile.mkdtemp(prefix="alloc-bench-"))
    for _ in range(args.stale):
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        (directory / fmt.file_name(gone.pid, 0)).write_bytes(_record(gone.pid))
    (directory / fmt.file_name(os.getpid(), 0)).write_bytes(_record(os.getpid()))
    cfg = AllocatorSourceConfig(directory=str(directory))
    clock = FakeClock(start=NOW)
    kept = AllocatorCollector(cfg, clock)
    kept.collect()

    def per_collect(make: bool) -> float:
        t = time.thread_time()
        for _ in range(args.collects):
            (AllocatorCollector(cfg, clock) if make else kept).collect()
        return float((time.thread_time() - t) / args.collects * 1e3)

    rounds = [(per_collect(True), per_collect(False)) for _ in range(5)]
    fresh = sorted(r[0] for r in rounds)[2]
    steady = sorted(r[1] for r in rounds)[2]
    print(f"{args.stale} stale files + 1 live, {args.collects} collects x 5 rounds (median):")
    print(f"  fresh (every file read): {fresh:.3f} ms per collect")
    print(f"  kept verdicts:           {steady:.3f} ms per collect")
    print(f"  fresh / kept: {fresh / steady:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
