"""The GPU check's child processes: the CUDA work each step measures, one mode a process.

Run as ``python -m vllm_guardian.gpucheck.workload MODE [ARGS as JSON]`` by
:mod:`vllm_guardian.gpucheck.steps`, never imported by the daemon: this is the one module of
the check that imports torch (an import-linter rule names it), so that every step's CUDA
context lives and dies with its own process, as a vLLM engine's does, and NVML sees it as a
process of its own.

The protocol is JSON, one object per line on stdout (``{"event": ..., ...}``); a mode that
holds memory prints ``{"event": "ready", ...}`` and then waits until its stdin closes (or it
is killed), so the parent measures while the memory is held. Anything torch prints goes to
stderr, which the parent keeps for the report.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from vllm_guardian.plugin.publisher import Publisher

MIB = 1 << 20
GIB = 1 << 30


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _wait_for_parent() -> None:
    # The parent closes our stdin (or kills us) once it has measured what we hold.
    sys.stdin.read()


def _device_facts() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    uuid = getattr(props, "uuid", None)
    return {
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "name": props.name,
        "uuid": f"GPU-{uuid}" if uuid is not None else None,
        "capability": f"{props.major}.{props.minor}",
        "torch_free_bytes": int(free),
        "torch_total_bytes": int(total),
    }


def _stats() -> dict[str, int]:
    s = torch.cuda.memory_stats(0)
    keys = (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.peak",
        "inactive_split_bytes.all.current",
        "inactive_split_bytes.all.peak",
        "num_alloc_retries",
        "num_ooms",
        "segment.all.current",
    )
    return {k: int(s.get(k, 0)) for k in keys}


def _expandable_in_use() -> bool | None:
    """Whether the allocator's segments are expandable, from its own snapshot (None: unknown)."""
    segments = torch.cuda.memory_snapshot()
    flags = [s.get("is_expandable") for s in segments if isinstance(s, dict)]
    known = [f for f in flags if isinstance(f, bool)]
    return any(known) if known else None


def mode_info(_: dict[str, Any]) -> None:
    torch.cuda.init()
    emit("info", **_device_facts())


def mode_hold(args: dict[str, Any]) -> None:
    """Hold ``bytes`` of device memory (one tensor; never touched, so allocation is instant)."""
    held = torch.empty(int(args["bytes"]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    emit("ready", held_bytes=int(held.numel()), **_device_facts())
    _wait_for_parent()


def _fragment(seed: int, live_budget_bytes: int, steps: int) -> dict[str, Any]:
    """A long-running server's activations in miniature: interleaved allocations and frees of
    mixed sizes (small, medium and large blocks, as the caching allocator's pools split them),
    freed in random order so holes open between live blocks, then most of it freed."""
    rng = random.Random(seed)  # noqa: S311 (a reproducible workload, not a secret)
    live: list[torch.Tensor] = []
    live_bytes = 0
    for _ in range(steps):
        r = rng.random()
        if r < 0.5:
            size = rng.randrange(64 * 1024, MIB)  # small pool (< 1 MiB)
        elif r < 0.85:
            size = rng.randrange(MIB, 10 * MIB)  # medium: carved out of 20 MiB segments
        else:
            size = rng.randrange(10 * MIB, 160 * MIB)  # large: own segments, split when reused
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        live.append(t)
        live_bytes += size
        while live_bytes > live_budget_bytes and len(live) > 1:
            victim = live.pop(rng.randrange(len(live) - 1))  # never the newest
            live_bytes -= victim.numel()
            del victim
    torch.cuda.synchronize()
    during = _stats()
    # The burst is over: keep a random third, as a server keeps its weights and caches.
    rng.shuffle(live)
    del live[len(live) // 3 :]
    torch.cuda.synchronize()
    after = _stats()
    # What the stranded memory costs: the largest block that still fits without a new
    # cudaMalloc is unknown without a snapshot walk, so ask for a big one and see the cache grow.
    before_big = torch.cuda.memory_reserved(0)
    big = torch.empty(live_budget_bytes // 4, dtype=torch.uint8, device="cuda")
    grew = int(torch.cuda.memory_reserved(0) - before_big)
    del big
    return {
        "during": during,
        "after": after,
        "big_request_bytes": live_budget_bytes // 4,
        "big_request_grew_reserved_bytes": grew,
        "kept_tensors": len(live),
        "_live": live,
    }


def mode_fragment(args: dict[str, Any]) -> None:
    """Run the fragmenting workload, publish through the guardian's allocator plugin, and print
    the plugin's view next to ``torch.cuda.memory_stats()`` read in this same process."""
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context exists: the publisher may read stats
    out = Path(args["out_dir"])
    result = _fragment(int(args["seed"]), int(args["live_budget_bytes"]), int(args["steps"]))
    live = result.pop("_live")
    publisher = Publisher(out, interval_seconds=5.0)
    written = publisher.step()
    stats_now = _stats()  # no allocation between the publish and this read
    emit(
        "fragment",
        pid=os.getpid(),
        written=written,
        publisher_errors=publisher.errors,
        stats=stats_now,
        expandable_in_use=_expandable_in_use(),
        env_alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF"),
        env_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        **result,
    )
    _wait_for_parent()  # the parent reads the file through the guardian's source meanwhile
    del live


def mode_oom(args: dict[str, Any]) -> None:
    """Ask for more than the card has free; print torch's exception and traceback verbatim."""
    torch.cuda.init()
    keep = torch.empty(int(args.get("keep_bytes", 256 * MIB)), dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info(0)
    request = int(free + int(args.get("over_bytes", 4 * GIB)))
    try:
        torch.empty(request, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        emit(
            "oom",
            pid=os.getpid(),
            exception_type=f"{type(e).__module__}.{type(e).__qualname__}",
            message=str(e),
            traceback=traceback.format_exc(),
            requested_bytes=request,
            free_bytes=int(free),
            total_bytes=int(total),
            allocated_bytes=int(torch.cuda.memory_allocated(0)),
            reserved_bytes=int(torch.cuda.memory_reserved(0)),
        )
    else:
        emit("no_oom", requested_bytes=request, free_bytes=int(free))
    del keep


def mode_grow(args: dict[str, Any]) -> None:
    """A neighbour that grows at a fixed rate until the card is full; prints when it ran out."""
    torch.cuda.init()
    chunk = int(args["chunk_bytes"])
    rate = float(args["rate_bytes_per_second"])
    held = [torch.empty(int(args["start_bytes"]), dtype=torch.uint8, device="cuda")]
    emit("ready", pid=os.getpid())
    start = time.monotonic()
    grown = 0
    while True:
        due = start + (grown + chunk) / rate
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            emit(
                "exhausted",
                monotonic=time.monotonic(),
                grown_bytes=grown,
                seconds=time.monotonic() - start,
            )
            break
        grown += chunk
        if time.monotonic() - start > float(args["max_seconds"]):
            emit("gave_up", grown_bytes=grown)
            break
    _wait_for_parent()


MODES = {
    "info": mode_info,
    "hold": mode_hold,
    "fragment": mode_fragment,
    "oom": mode_oom,
    "grow": mode_grow,
}


def main(argv: list[str]) -> int:
    mode = MODES[argv[0]]
    args: dict[str, Any] = json.loads(argv[1]) if len(argv) > 1 else {}
    if not torch.cuda.is_available():
        emit("no_cuda", torch=torch.__version__, cuda=torch.version.cuda)
        return 2
    mode(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
