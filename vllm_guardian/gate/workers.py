"""Several gate workers on one port: the shares of the limits, the merged status, the control
sockets the workers read each other through.

Where it sits: around one :class:`~vllm_guardian.gate.server.Gate`, never inside its per-request
path. With ``workers`` > 1 the parent (``supervisor.py``) starts N worker processes; each binds
the listen port with ``SO_REUSEPORT`` (the kernel spreads new connections over the listening
sockets by a hash of the connection) and runs one whole gate on an even share of the global
limits (``server.split_settings``): the shares sum to the configured limit and none is 0, so the
held-request bound and the body budget hold for the gate as a whole without a lock shared
between processes. Each worker also answers its own status on a unix socket in the control
directory (:class:`ControlServer`); the one that receives ``GET /gate/status`` reads its
siblings' there and answers the sum (:func:`merge_status`), which is what the guardian's drain
waits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import math
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_guardian.config import SplitLimits, workers_problem

log = logging.getLogger("vllm_guardian.gate")

# A default never above this many workers: each worker follows vLLM on its own (/health every
# poll interval, /metrics every KV poll interval), and vLLM answers those on the event loop
# that serves its requests; one gate worker carries about one GPU's token stream.
DEFAULT_WORKERS_CAP = 4
# What the parent writes for the workers to merge into the status (restarts, lost requests).
PARENT_FILE = "parent.json"
WORKER_SOCKET_PREFIX = "worker-"
# A sibling that has not answered its status within this long is left out of the sum (and
# said to be missing: ``workers_answered`` < ``workers``).
SIBLING_TIMEOUT_SECONDS = 0.5
# What a reader asks comes with its connection; one that asks nothing within this gets the
# status (below).
ASK_WAIT_SECONDS = 0.25

# The status fields that add up over workers; the ages take the largest.
SUMMED = (
    "queue_depth", "queued_tokens", "in_flight", "kv_committed_tokens", "open_exchanges",
    "unanswered", "arrived_total", "admitted_total", "held_total", "retried_total", "rejected_total",
    "continued_total", "continuations_failed_total",
)  # fmt: skip
OLDEST = ("oldest_wait_seconds", "oldest_unanswered_seconds", "longest_wait_seconds")
# The gate is as slow as its slowest worker, and as close to stalling as its busiest: each
# answers on its own loop, on its own core.
LARGEST = ("loop_lag_max_seconds", "cpu_busy_share")
# Each worker follows the guardian and vLLM on its own: the gate is open only when all are.
ALL_TRUE = ("open", "upstream_healthy", "guardian_ready")


def share(total: int, index: int, workers: int) -> int:
    """Worker ``index``'s share of ``total``: the shares of 0..workers-1 sum to ``total`` and
    differ by at most one."""
    return total // workers + (1 if index < total % workers else 0)


def cpu_count_allowed(affinity: int, cgroup_cpu_max: str | None) -> int:
    """The CPUs this process may use: its affinity mask, and the cgroup's CPU limit where one
    is set (``cpu.max`` ``"QUOTA PERIOD"``; ``"max PERIOD"`` is none), rounded up."""
    n = affinity
    if cgroup_cpu_max:
        parts = cgroup_cpu_max.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) > 0:
            n = min(n, max(1, math.ceil(int(parts[0]) / int(parts[1]))))
    return max(1, n)


def host_cpus() -> int:
    """:func:`cpu_count_allowed` for this process, read from the host."""
    affinity = 1
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or a seccomp filter
        affinity = len(os.sched_getaffinity(0))
    cpu_max: str | None = None
    with contextlib.suppress(OSError):
        cpu_max = Path("/sys/fs/cgroup/cpu.max").read_text()
    return cpu_count_allowed(affinity, cpu_max)


def default_workers(cpus: int, limits: SplitLimits) -> int:
    """``workers: 0`` (auto): one per CPU this process may use, at most
    :data:`DEFAULT_WORKERS_CAP`, and no more than the limits can be split into (each worker's
    share of every positive limit at least 1, its body budget a whole largest body; KV-need
    admission: one)."""
    n = max(1, min(cpus, DEFAULT_WORKERS_CAP))
    while n > 1 and workers_problem(n, limits):
        n -= 1
    return n


def _all_true(values: Iterable[object]) -> bool | None:
    seen = [v for v in values if isinstance(v, bool)]
    return all(seen) if seen else None


def merge_status(
    docs: Sequence[Mapping[str, Any]], workers: int, parent: Mapping[str, Any] | None
) -> dict[str, object]:
    """One status for the gate from its workers' (docs/gate.md, "Status"): counts summed, ages
    the oldest, open only while every worker is open (the reason: the first closed one's),
    plus ``workers`` (configured), ``workers_answered`` and per worker its pid, in-flight,
    queued and admitted counts; from the parent, ``worker_restarts_total`` and
    ``worker_lost_requests_total`` (requests a dead worker had in flight or held)."""
    if not docs:
        raise ValueError("no worker answered")
    first = docs[0]
    out: dict[str, object] = dict(first)
    for key in SUMMED:
        out[key] = sum(int(d.get(key) or 0) for d in docs)
    for key in OLDEST:
        out[key] = max(float(d.get(key) or 0.0) for d in docs)
    for key in LARGEST:
        known = [float(d[key]) for d in docs if d.get(key) is not None]
        out[key] = max(known) if known else None  # None: no worker can say yet
    for key in ALL_TRUE:
        out[key] = _all_true(d.get(key) for d in docs)
    closed = [d for d in docs if d.get("open") is False]
    out["reason"] = closed[0].get("reason") if closed else first.get("reason")
    caps = [d["kv_capacity_tokens"] for d in docs if d.get("kv_capacity_tokens") is not None]
    out["kv_capacity_tokens"] = max(caps) if caps else None
    out["workers"] = workers
    out["workers_answered"] = len(docs)
    out["per_worker"] = [
        {k: d.get(k) for k in ("pid", "open", "in_flight", "queue_depth", "admitted_total")}
        for d in sorted(docs, key=lambda d: int(d.get("pid") or 0))
    ]
    out["worker_restarts_total"] = int((parent or {}).get("restarts_total", 0))
    out["worker_lost_requests_total"] = int((parent or {}).get("lost_requests_total", 0))
    return out


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(parent_pid: int) -> None:
    """A worker gets SIGTERM (and drains) when its parent ends, however it ends: a parent
    killed with SIGKILL leaves no worker behind on the port. Linux only (prctl); elsewhere the
    parent's own stop is the only one."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # it ended before the prctl took hold
        os.kill(os.getpid(), signal.SIGTERM)


def worker_socket(control_dir: Path, pid: int) -> Path:
    return control_dir / f"{WORKER_SOCKET_PREFIX}{pid}.sock"


# The gauges that are not a count over workers: open only while every worker is; the KV pool
# is vLLM's, the same one each worker read.
METRICS_MIN = ("vllm_guardian_gate_open",)
METRICS_MAX = ("vllm_guardian_gate_kv_capacity_tokens",)


def _exposed(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def merge_metrics(texts: Sequence[str]) -> bytes:
    """One ``/metrics`` exposition from the workers' own (Prometheus text format): a sample of
    the same name and labels is summed over workers (counters, histograms' buckets, sums and
    counts, and the gauges that count requests, bytes or connections); ``_created`` takes the
    earliest, ``vllm_guardian_gate_open`` the least (1 only while every worker admits) and the
    KV pool size the largest. A family or sample only some workers have is kept."""
    families: dict[str, list[str]] = {}  # its HELP/TYPE lines
    samples: dict[str, dict[str, float]] = {}  # family -> "name{labels}" -> value
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split(" ", 3)[2]
                families.setdefault(family, [])
                samples.setdefault(family, {})
            if line.startswith("#"):
                if line not in families.setdefault(family, []):
                    families[family].append(line)
                continue
            key, _, value = line.rpartition(" ")
            if not key:
                continue
            name = key.partition("{")[0]
            v = float(value)
            have = samples.setdefault(family, {})
            if key not in have:
                have[key] = v
            elif name.endswith("_created") or name in METRICS_MIN:
                have[key] = min(have[key], v)
            elif name in METRICS_MAX:
                have[key] = max(have[key], v)
            else:
                have[key] += v
    out: list[str] = []
    for family, comments in families.items():
        out += comments
        out += [f"{key} {_exposed(v)}" for key, v in samples.get(family, {}).items()]
    return ("\n".join(out) + "\n").encode()


class ControlServer:
    """A worker's own status and metrics on ``worker-<pid>.sock`` in the control directory: a
    sibling (or the parent) connects, sends ``status`` or ``metrics`` and a newline, and reads
    the answer (a JSON document, or the Prometheus text) until the worker closes."""

    def __init__(
        self,
        control_dir: Path,
        status: Callable[[], dict[str, object]],
        metrics: Callable[[], bytes],
    ) -> None:
        self.path = worker_socket(control_dir, os.getpid())
        self._status = status
        self._metrics = metrics
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._answer, path=str(self.path))

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(ASK_WAIT_SECONDS):  # (not wait_for: see ask_sibling)
                    what = await reader.readline()
            except TimeoutError:
                # A reader that asks nothing gets the status: a parent started from an older
                # version of this file (an upgrade under a running gate) reads it that way.
                what = b"status"
            if what.strip() == b"metrics":
                writer.write(self._metrics())
            else:
                writer.write(json.dumps({**self._status(), "pid": os.getpid()}).encode())
            await writer.drain()
        except (ConnectionError, OSError, TimeoutError):
            pass  # the reader gave up: nothing to answer
        except asyncio.CancelledError:
            # The worker is stopping (its loop ends) while a sibling asks: the exchange ends
            # here. Not re-raised: on Python 3.11 asyncio's callback for the handler's task
            # calls its exception(), which raises for a cancelled task (a traceback in the log).
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


async def ask_sibling(path: Path, what: bytes, timeout_seconds: float) -> bytes | None:
    """One worker's answer to ``what`` (``status`` or ``metrics``) from its control socket;
    None when it does not answer in time (it died, restarts, or its loop is wedged)."""

    async def read() -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(path))
        try:
            writer.write(what + b"\n")
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()

    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # comes in the turn the answer does (tests/test_gate_cancel.py).
        async with asyncio.timeout(timeout_seconds):
            return await read()
    except (OSError, TimeoutError):
        return None


async def read_sibling(path: Path, timeout_seconds: float) -> dict[str, Any] | None:
    """One worker's status document; None without one."""
    body = await ask_sibling(path, b"status", timeout_seconds)
    try:
        doc = json.loads(body) if body is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _siblings(control_dir: Path) -> list[Path]:
    me = worker_socket(control_dir, os.getpid())
    return [p for p in control_dir.glob(f"{WORKER_SOCKET_PREFIX}*.sock") if p != me]


async def gate_metrics(control_dir: Path, own: bytes) -> bytes:
    """The gate's ``/metrics`` in a worker: its own series and every sibling's that answers,
    merged (:func:`merge_metrics`)."""
    paths = _siblings(control_dir)
    others = await asyncio.gather(
        *(ask_sibling(p, b"metrics", SIBLING_TIMEOUT_SECONDS) for p in paths)
    )
    texts = [own.decode()] + [o.decode("utf-8", "replace") for o in others if o is not None]
    return merge_metrics(texts)


def read_parent(control_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((control_dir / PARENT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


async def gate_status(control_dir: Path, workers: int, own: dict[str, object]) -> dict[str, object]:
    """``GET /gate/status`` in a worker: its own status and every sibling's that answers,
    merged. A worker being replaced (a reload) answers beside its successor until it has
    drained, so its in-flight requests are still counted."""
    paths = _siblings(control_dir)
    others = await asyncio.gather(*(read_sibling(p, SIBLING_TIMEOUT_SECONDS) for p in paths))
    docs: list[Mapping[str, Any]] = [{**own, "pid": os.getpid()}]
    docs += [d for d in others if d is not None]
    return merge_status(docs, workers, read_parent(control_dir))
