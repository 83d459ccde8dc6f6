"""Benchmark: the SSE event rate the gate delivers saturated, with 1, 2 (and 4) workers, same run.

Run: .venv/bin/python bench/gate_workers.py [--workers 1,2,4] [--repeat 5] [--seconds 5]
     [--streams 3200] [--event-rate 50] [--out bench/results/gate-workers]
     (``--quick``: tiny loads, one repeat, no files written unless ``--out`` is given: what
     tests/test_bench_gate_workers.py runs; the figures then mean nothing)

What it answers: with ``gate.workers: N`` (N processes on one port, ``SO_REUSEPORT``), how many
SSE events a second the gate relays once it is the bottleneck, against one worker on the same
host in the same run. The acceptance bar for two workers is 1.8x one worker's rate.

Layout, all on 127.0.0.1 (bench/gate_cpu.py's pieces):

* one gate per worker count, all started at the beginning and kept running (``vllm-guardian
  gate --workers N`` with its defaults, following no guardian, plus ``--gate-args``: no release
  pacing), each pinned with ``taskset`` to cores 0..N-1 of the gate's cores. They take turns,
  point by point (the order rotates each repeat), so drift on a shared machine hits all alike;
  an idle gate costs only its ``/health`` polls;
* ``--stubs`` upstream stub processes (bench/gate_cpu.py's: a vLLM-like ``/v1/completions``
  that streams ``--events-per-stream`` completion chunks, one every ``1 / --event-rate``
  seconds, then ``[DONE]``) sharing one port with ``SO_REUSEPORT``, one core each;
* ``--clients`` client processes (gate_cpu.py's ``SseClient`` on uvloop, one core each), each
  holding its share of ``--streams`` keep-alive connections: a streamed completion, and the
  next as soon as it ends. One Python client reads at most ~40k events/s; several keep the
  client from being the limit;
* this process on what cores are left: it starts everything, reads CPU from ``/proc`` and
  takes no part in the traffic.

With fewer cores than gate + stubs + clients need, nothing is pinned and the run says so: the
figures are then not a saturation measurement (a smoke run).

Measured per point, in a window of ``--seconds`` after the ramp and ``--warmup``:

* events/s: the events the clients received in the window, over the window as each client
  timed it; the offered rate beside it (``--streams`` x the stub's real pace);
* the gate's CPU: user + system time from ``/proc/PID/stat`` of every worker (the children of
  the gate's parent; with one worker the gate itself), as cores busy, per worker and summed,
  and as gate CPU per event. A worker near 100% of a core is saturated: the point is
  gate-bound. The stubs' and the clients' cores busy beside it show they were not the limit
  (flagged when one passes ``--busy-limit``);
* streams per worker (``/gate/status``'s ``per_worker`` in-flight counts, read mid-window);
  a worker left with almost no streams or no CPU while its siblings work fails the run
  (exit 3): ``SO_REUSEPORT`` did not spread the connections;
* the added gap p99 (gaps between events as the clients received them, minus the stub's
  pace) and streams stalled (a gap over ``--stall-seconds``, or silent at the window's end).
  Saturated, the gate falls behind the offered rate by design, so both are large; they are
  reported, not judged;
* the host's load average, and each core's busy share from ``/proc/stat`` where the kernel
  keeps it.

Per worker count the table gives the median over repeats and the range, and the ratio to one
worker: of the medians, and the median of the per-repeat ratios (one worker and N workers
measured back to back). The offered load is the same for every N, so one worker runs further
over its capacity than two do and reads more events per wake-up (cheaper per event): if
anything the ratio is understated. Results go to ``OUT.json`` and ``OUT.md`` (with the
command line, the commit and the layout) and the gates' stderr to ``OUT.gate.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gate_cpu  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
STATUS_PATH = "/gate/status"
# A worker with less than this share of the mean (streams or CPU) is idle: the kernel's
# SO_REUSEPORT hash left it out.
IDLE_SHARE = 0.25
# The gaps' histogram: 1 ms buckets up to 10 s.
GAP_BUCKET_S = 0.001
GAP_BUCKETS = 10_000
# The gates' stderr kept in OUT.gate.log, at most (its end).
GATE_LOG_KEEP = 256 * 1024


# --- the client process (this file, run with --serve-client) ----------------------------------


class CountingWindow(gate_cpu.Window):
    """gate_cpu's window, plus the reads and the non-200 answers."""

    def __init__(self, stall_s: float) -> None:
        super().__init__(stall_s)
        self.reads = 0
        self.errors = 0


class CountingClient(gate_cpu.SseClient):
    def __init__(
        self, w: CountingWindow, req: bytes, ident: int, done: asyncio.Future[None]
    ) -> None:
        super().__init__(w, req, ident, done)
        self.cw = w

    def data_received(self, data: bytes) -> None:
        if self.cw.on:
            self.cw.reads += 1
            if data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 200"):
                self.cw.errors += 1
        super().data_received(data)


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def client_point(cmd: dict[str, Any]) -> dict[str, Any]:
    """One point's share of the streams; times are time.monotonic() (one clock for all the
    processes on the host)."""
    loop = asyncio.get_running_loop()
    port, n, ident0 = int(cmd["port"]), int(cmd["streams"]), int(cmd["ident0"])
    w = CountingWindow(float(cmd["stall_s"]))
    req = gate_cpu._stream_request(port, gate_cpu.STREAM_BODY)
    conns: list[asyncio.Transport] = []
    protos: list[CountingClient] = []
    dones: list[asyncio.Future[None]] = []
    failed = 0
    start, ramp = float(cmd["start_at"]), float(cmd["ramp_s"])
    connect_by = float(cmd["on_at"])  # a connection not made when the window opens has failed

    async def connect(i: int) -> None:
        # Each connection on its own task, at its slot in the ramp: one after another, a
        # saturated gate's full accept queue (a dropped SYN is retried 1, 3, 7 s later) held
        # every later stream back, and a device run's client never finished its ramp.
        nonlocal failed
        await _sleep_until(start + ramp * i / n)
        done: asyncio.Future[None] = loop.create_future()
        proto = CountingClient(w, req, ident0 + i, done)
        try:
            t, _ = await asyncio.wait_for(
                loop.create_connection(lambda p=proto: p, "127.0.0.1", port),  # type: ignore[misc]
                max(0.1, connect_by - time.monotonic()),
            )
        except (OSError, TimeoutError):
            failed += 1
            return
        conns.append(t)
        protos.append(proto)
        dones.append(done)

    await asyncio.gather(*(connect(i) for i in range(n)))
    ramped = time.monotonic()
    await _sleep_until(float(cmd["on_at"]))
    w.on = True
    on, on_perf = time.monotonic(), time.perf_counter()
    await _sleep_until(float(cmd["off_at"]))
    w.on = False
    off, off_perf = time.monotonic(), time.perf_counter()
    for p in protos:  # silent at the window's end (or never answered): stalled too
        if off_perf - p.seen > w.stall_s:
            w.stalled.add(p.ident)
    hist = Counter(min(int(g / GAP_BUCKET_S), GAP_BUCKETS) for g in w.gaps)
    await _sleep_until(float(cmd["release_at"]))  # the parent reads the gate's status first
    for t in conns:
        t.abort()
    if dones:
        await asyncio.wait(dones, timeout=10)
    return {
        "events": w.events, "requests": w.requests, "reads": w.reads, "errors": w.errors,
        "stalled": len(w.stalled), "connected": len(conns), "failed": failed,
        "on": on, "off": off, "late_s": max(0.0, ramped - float(cmd["on_at"])),
        "seconds": off - on, "gaps": {str(k): v for k, v in hist.items()},
        "window_perf_s": off_perf - on_perf,
    }  # fmt: skip


def serve_client() -> None:
    """A client process: one JSON command a line on stdin, one JSON result a line on stdout,
    until stdin ends."""
    import uvloop  # noqa: PLC0415 (only the clients and the stubs need it)

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print("ready", flush=True)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        for line in sys.stdin:
            if not line.strip():
                continue
            result = r.run(client_point(json.loads(line)))
            print(json.dumps(result), flush=True)


def serve_stub(port: int, events: int, rate: float) -> None:
    """One of the stubs sharing the port (SO_REUSEPORT); says ``ready`` once it listens."""
    gate_cpu.serve_stub(
        port, events, 1 / rate, reuse_port=True, on_listening=lambda: print("ready", flush=True)
    )


# --- /proc -------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process; None once it is gone."""
    try:
        return gate_cpu.proc_cpu_s(pid)
    except (OSError, IndexError, ValueError):
        return None


def children(ppid: int) -> list[int]:
    """The processes whose parent is ``ppid`` (scanned from /proc: no ``children`` file needed)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
            out.append(int(d.name))
    return sorted(out)


def host_cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) clock ticks from /proc/stat; empty where it is not kept."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and len(vals) >= 5:
                v = [int(x) for x in vals]
                total = sum(v[:8])
                out[int(name[3:])] = (total - v[3] - v[4], total)
    return out


def allowed_cores(pid: int) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return "?"


# --- the processes -------------------------------------------------------------------------------


def taskset_works() -> bool:
    if shutil.which("taskset") is None:
        return False
    try:
        return subprocess.run(["taskset", "-c", "0", "true"], capture_output=True, timeout=10, check=False).returncode == 0  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False


def pinned(cores: Sequence[int] | None, argv: list[str]) -> list[str]:
    if not cores:
        return argv
    return ["taskset", "-c", ",".join(str(c) for c in cores), *argv]


def wait_ready(proc: subprocess.Popen[str], what: str, timeout_s: float = 60) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        raise SystemExit(f"{what} did not start (exit {proc.poll()}): {line!r}")


def stop(proc: subprocess.Popen[Any], group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        proc.wait()


def gate_status(port: int, timeout_s: float = 5.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{STATUS_PATH}", timeout=timeout_s) as r:  # fmt: skip
            doc = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class GateProc:
    workers: int
    port: int
    proc: subprocess.Popen[bytes]
    cores: list[int]
    pids: list[int] = field(default_factory=list)
    idle_cores: float = 0.0  # CPU rate of the workers together, no load

    def worker_pids(self) -> list[int]:
        return [self.proc.pid] if self.workers == 1 else children(self.proc.pid)


def start_gate(
    n: int, cores: list[int], up: int, args: argparse.Namespace, log: IO[bytes]
) -> GateProc:
    port = gate_cpu.free_port()
    argv = [sys.executable, "-m", "vllm_guardian.gate", "--listen", f"127.0.0.1:{port}",
            "--upstream", f"http://127.0.0.1:{up}", "--log-level", "WARNING",
            "--workers", str(n), *args.gate_args.split()]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log.write(f"--- gate with {n} worker(s), port {port}: {' '.join(argv)}\n".encode())
    log.flush()
    # cwd: ``-m`` puts the working directory first on the path; the tree measured is ROOT's.
    proc = subprocess.Popen(pinned(cores, argv), stdout=log, stderr=log, env=env, cwd=ROOT, start_new_session=True)  # fmt: skip
    g = GateProc(n, port, proc, cores)
    deadline = time.monotonic() + args.start_timeout
    while True:
        doc = gate_status(port, 2.0)
        answered = 1 if doc is not None and "workers" not in doc else int((doc or {}).get("workers_answered") or 0)  # fmt: skip
        if doc is not None and doc.get("open") and answered >= n:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, group=True)
            raise SystemExit(f"the gate with {n} workers did not come up (exit {proc.poll()}; status {doc}): see the gate log")  # fmt: skip
        time.sleep(0.2)
    g.pids = g.worker_pids()
    if len(g.pids) != n:
        stop(proc, group=True)
        raise SystemExit(f"the gate with {n} workers runs {len(g.pids)} worker processes: {g.pids}")  # fmt: skip
    return g


# --- one point ------------------------------------------------------------------------------------


@dataclass
class Point:
    workers: int
    repeat: int
    seconds: float
    events: int
    rate_per_s: float
    offered_per_s: float
    gate_cores_busy: float  # the workers' CPU seconds over the window
    worker_busy: list[float]
    gate_us_per_event: float
    stub_busy: list[float]
    client_busy: list[float]
    streams_per_worker: list[int] | None
    requests: int
    events_per_read: float
    gap_p99_added_ms: float
    stalled_streams: int
    errors: int
    connected: int
    failed_connects: int
    client_late_s: float
    load_avg: tuple[float, float, float]
    core_busy_host: dict[str, float] = field(default_factory=dict)
    limited_by: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _busy(c0: dict[int, float | None], c1: dict[int, float | None], secs: float) -> dict[int, float]:  # fmt: skip
    out = {}
    for pid, a in c0.items():
        b = c1.get(pid)
        if a is not None and b is not None:
            out[pid] = round((b - a) / secs, 3)
    return out


def _snap(pids: Sequence[int]) -> dict[int, float | None]:
    return {p: proc_cpu_s(p) for p in pids}


def _p99_ms(hist: Counter[int]) -> float:
    total = sum(hist.values())
    if not total:
        return 0.0
    want, seen = 0.99 * total, 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= want:
            return k * GAP_BUCKET_S * 1e3
    return GAP_BUCKETS * GAP_BUCKET_S * 1e3


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise SystemExit(f"a client (pid {proc.pid}) gave no result (exit {proc.poll()})")
    return line


def run_point(
    g: GateProc,
    rep: int,
    args: argparse.Namespace,
    clients: list[subprocess.Popen[str]],
    stubs: list[subprocess.Popen[str]],
) -> Point:
    pids = g.worker_pids()
    problems = []
    if sorted(pids) != sorted(g.pids):
        problems.append(f"worker pids changed: {g.pids} -> {pids} (a worker died and was restarted)")  # fmt: skip
        g.pids = pids
    now = time.monotonic()
    start = now + 0.3
    on = start + args.ramp + args.warmup
    off = on + args.seconds
    release = off + 0.3
    per = [args.streams // len(clients) + (1 if i < args.streams % len(clients) else 0) for i in range(len(clients))]  # fmt: skip
    ident = 0
    for c, n in zip(clients, per, strict=True):
        cmd = {"port": g.port, "streams": n, "ident0": ident, "start_at": start,
               "ramp_s": args.ramp, "on_at": on, "off_at": off, "release_at": release,
               "stall_s": args.stall_seconds}  # fmt: skip
        ident += n
        assert c.stdin is not None
        c.stdin.write(json.dumps(cmd) + "\n")
        c.stdin.flush()
    la = os.getloadavg()
    status: list[dict[str, Any] | None] = [None]

    def read_status() -> None:
        time.sleep(max(0.0, on + args.seconds / 2 - time.monotonic()))
        status[0] = gate_status(g.port, args.seconds / 2)

    reader = threading.Thread(target=read_status, daemon=True)
    reader.start()
    everyone = [*pids, *(s.pid for s in stubs), *(c.pid for c in clients)]
    time.sleep(max(0.0, on - time.monotonic()))
    h0, c0, t0 = host_cpu_ticks(), _snap(everyone), time.monotonic()
    time.sleep(max(0.0, off - time.monotonic()))
    h1, c1, t1 = host_cpu_ticks(), _snap(everyone), time.monotonic()
    busy = _busy(c0, c1, t1 - t0)
    reader.join(timeout=args.seconds + 5)
    results = [json.loads(read_line(c, release + 60)) for c in clients]
    time.sleep(args.settle)  # the gate closes what the clients cut
    events = sum(int(r["events"]) for r in results)
    rate = sum(int(r["events"]) / max(float(r["seconds"]), 1e-6) for r in results)
    hist: Counter[int] = Counter()
    for r in results:
        hist.update({int(k): int(v) for k, v in r["gaps"].items()})
    worker_busy = [busy.get(p, 0.0) for p in pids]
    gate_busy = sum(worker_busy)
    doc = status[0]
    streams_per_worker: list[int] | None = None
    if doc is not None:
        if "per_worker" in doc:
            streams_per_worker = [int(w.get("in_flight") or 0) for w in doc["per_worker"]]
        else:
            streams_per_worker = [int(doc.get("in_flight") or 0)]
        if len(streams_per_worker) < g.workers:
            problems.append(f"only {len(streams_per_worker)} of {g.workers} workers answered the status")  # fmt: skip
    else:
        problems.append("the gate's status did not answer mid-window")
    if g.workers > 1:
        mean_busy = gate_busy / g.workers
        if mean_busy >= 0.2 and min(worker_busy) < IDLE_SHARE * mean_busy:
            problems.append(f"IDLE WORKER: SO_REUSEPORT left a worker idle: cores busy per worker {worker_busy}")  # fmt: skip
        if streams_per_worker and len(streams_per_worker) == g.workers:
            mean_streams = sum(streams_per_worker) / g.workers
            if mean_streams >= 8 and min(streams_per_worker) < IDLE_SHARE * mean_streams:
                problems.append(f"IDLE WORKER: SO_REUSEPORT left a worker without streams: {streams_per_worker}")  # fmt: skip
    stub_busy = [busy.get(s.pid, 0.0) for s in stubs]
    client_busy = [busy.get(c.pid, 0.0) for c in clients]
    limited = []
    if g.workers and min(worker_busy, default=0) >= args.busy_limit:
        limited.append("gate")
    if stub_busy and max(stub_busy) >= args.busy_limit:
        limited.append("stub")
    if client_busy and max(client_busy) >= args.busy_limit:
        limited.append("client")
    if rate >= 0.9 * args.offered:
        limited.append("offered load")
    host = {
        str(core): round((h1[core][0] - h0[core][0]) / (h1[core][1] - h0[core][1]), 3)
        for core in sorted(h1)
        if core in h0 and h1[core][1] > h0[core][1]
    }
    reads = sum(int(r["reads"]) for r in results)
    return Point(
        workers=g.workers, repeat=rep, seconds=round(t1 - t0, 3), events=events,
        rate_per_s=round(rate, 1), offered_per_s=args.offered,
        gate_cores_busy=round(gate_busy, 3), worker_busy=worker_busy,
        gate_us_per_event=round(gate_busy * (t1 - t0) / events * 1e6, 2) if events else float("inf"),
        stub_busy=stub_busy, client_busy=client_busy, streams_per_worker=streams_per_worker,
        requests=sum(int(r["requests"]) for r in results),
        events_per_read=round(events / reads, 2) if reads else 0.0,
        gap_p99_added_ms=round(_p99_ms(hist) - 1e3 / args.real_rate, 1),
        stalled_streams=sum(int(r["stalled"]) for r in results),
        errors=sum(int(r["errors"]) for r in results),
        connected=sum(int(r["connected"]) for r in results),
        failed_connects=sum(int(r["failed"]) for r in results),
        client_late_s=round(max(float(r["late_s"]) for r in results), 3),
        load_avg=(round(la[0], 2), round(la[1], 2), round(la[2], 2)),
        core_busy_host=host, limited_by=limited, problems=problems,
    )  # fmt: skip


# --- the report -------------------------------------------------------------------------------


def _med(xs: Sequence[float], f: str) -> str:
    return format(statistics.median(xs), f) if xs else "–"


def summarize(points: list[Point], args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The markdown table and the verdict lines; and the per-N summary for the JSON."""
    lines = [
        "| workers | events/s (median, range) | ÷ 1 worker: medians; per repeat (median, range) | "
        "gate cores busy | per worker busy | gate µs/event | stubs busy (max) | clients busy (max) | "
        "streams per worker | events/read | +gap p99 ms | stalled | errors | limited by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    base = {p.repeat: p.rate_per_s for p in points if p.workers == 1}
    base_med = statistics.median(base.values()) if base else None
    for n in args.workers:
        ps = [p for p in points if p.workers == n]
        if not ps:
            continue
        rates = [p.rate_per_s for p in ps]
        med = statistics.median(rates)
        paired = [p.rate_per_s / base[p.repeat] for p in ps if base.get(p.repeat)]
        ratio = med / base_med if base_med else None
        ratio_s = "–"
        if ratio is not None and paired:
            ratio_s = f"{ratio:.2f}×; {statistics.median(paired):.2f}× ({min(paired):.2f}–{max(paired):.2f})"  # fmt: skip
        per_worker = [statistics.median(p.worker_busy[i] for p in ps) for i in range(n) if all(len(p.worker_busy) > i for p in ps)]  # fmt: skip
        spw = [p.streams_per_worker for p in ps if p.streams_per_worker]
        limited = sorted({x for p in ps for x in p.limited_by})
        lines.append(
            f"| {n} | {med:.0f} ({min(rates):.0f}–{max(rates):.0f}) | {ratio_s} | "
            f"{_med([p.gate_cores_busy for p in ps], '.2f')} | "
            f"{' '.join(f'{b:.0%}' for b in per_worker)} | "
            f"{_med([p.gate_us_per_event for p in ps], '.1f')} | "
            f"{max(max(p.stub_busy, default=0) for p in ps):.0%} | "
            f"{max(max(p.client_busy, default=0) for p in ps):.0%} | "
            f"{'/'.join(str(x) for x in spw[-1]) if spw else '–'} | "
            f"{_med([p.events_per_read for p in ps], '.1f')} | "
            f"{_med([p.gap_p99_added_ms for p in ps], '.0f')} | "
            f"{max(p.stalled_streams for p in ps)} | {sum(p.errors for p in ps)} | "
            f"{', '.join(limited) or 'none'} |"
        )  # fmt: skip
        summary[str(n)] = {
            "rate_median": med, "rate_min": min(rates), "rate_max": max(rates),
            "ratio_of_medians": ratio and round(ratio, 3),
            "ratio_paired_median": round(statistics.median(paired), 3) if paired else None,
            "ratio_paired_range": [round(min(paired), 3), round(max(paired), 3)] if paired else None,
            "gate_cores_busy_median": statistics.median(p.gate_cores_busy for p in ps),
            "worker_busy_median": per_worker, "limited_by": limited,
            # Every point gate-bound (each worker at --busy-limit or more) and nothing else.
            "gate_bound": all(p.limited_by == ["gate"] for p in ps),
        }  # fmt: skip
    verdict = []
    for n, v in summary.items():
        if n == "1" or v["ratio_of_medians"] is None or v["ratio_paired_median"] is None:
            continue
        r: float = v["ratio_of_medians"]
        lo, hi = v["ratio_paired_range"]
        line = f"- {n} workers ÷ 1 worker: {r:.2f}× (medians), {v['ratio_paired_median']:.2f}× (per repeat, range {lo:.2f}–{hi:.2f})"  # fmt: skip
        if not (v["gate_bound"] and summary["1"]["gate_bound"]):
            line += (
                f"; not every point was gate-bound (limited by: 1 worker {', '.join(summary['1']['limited_by']) or 'none'}; "
                f"{n} workers {', '.join(v['limited_by']) or 'none'}; gate-bound: each worker at {args.busy_limit:.0%} of a core or more)"
            )  # fmt: skip
            if n == "2":
                line += ": the 1.8× bar is not judged"
        elif n == "2":
            line += f"; bar 1.8×: {'met' if r >= 1.8 else 'NOT met'}"
        verdict.append(line)
    problems = [f"- rep {p.repeat}, {p.workers} workers: {x}" for p in points for x in p.problems]
    if problems:
        verdict += ["", "Problems:", *problems]
    return [*lines, "", *verdict], summary


# --- main ---------------------------------------------------------------------------------------


def layout(
    args: argparse.Namespace,
) -> tuple[list[int] | None, list[list[int]] | None, list[list[int]] | None, list[int] | None]:
    """Cores for the gate, each stub, each client and this process; all None when there are
    too few to keep them apart (or no taskset)."""
    avail = sorted(os.sched_getaffinity(0))
    maxn = max(args.workers)
    need = maxn + args.stubs + args.clients
    if args.no_pin or len(avail) < need or not taskset_works():
        return None, None, None, None
    gate = avail[:maxn]
    stubs = [[c] for c in avail[maxn : maxn + args.stubs]]
    clients = [[c] for c in avail[maxn + args.stubs : need]]
    rest = avail[need:] or avail[need - 1 : need]
    return gate, stubs, clients, rest


def _auto_counts(args: argparse.Namespace) -> None:
    """--stubs and --clients when 0: from the cores left after the gate's."""
    cores = len(os.sched_getaffinity(0))
    left = max(0, cores - max(args.workers) - 1)  # one for this process
    if not args.stubs:
        args.stubs = max(1, min(3, round(left / 4)))
    if not args.clients:
        args.clients = max(1, min(8, left - args.stubs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument(
        "--workers", help="worker counts to compare, 1 first (default 1,2,4; --quick: 1,2)"
    )
    ap.add_argument("--streams", type=int, default=3200, help="concurrent SSE streams (all clients)")  # fmt: skip
    ap.add_argument("--event-rate", type=float, default=50.0, help="events/s per stream (the stub's pace, in 5 ms ticks)")  # fmt: skip
    ap.add_argument("--events-per-stream", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement window per point")
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds over which the streams start")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after the ramp")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds after a point")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stubs", type=int, default=0, help="stub processes (0: from the cores)")
    ap.add_argument("--clients", type=int, default=0, help="client processes (0: from the cores)")  # fmt: skip
    ap.add_argument("--stall-seconds", type=float, default=1.0)
    ap.add_argument("--busy-limit", type=float, default=0.9, help="a process this busy is the limit")  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--no-pin", action="store_true", help="pin nothing")
    ap.add_argument(
        "--gate-args", default="--release-rate 0",
        help="extra gate flags (default: no release pacing; this measures the data path)",
    )  # fmt: skip
    ap.add_argument("--out", help="OUT.json, OUT.md, OUT.gate.log (default bench/results/gate-workers)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny loads")
    ap.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_stub:
        serve_stub(args.serve_stub, args.events_per_stream, args.event_rate)
        return 0
    if args.serve_client:
        serve_client()
        return 0
    if args.quick:
        args.streams, args.event_rate, args.events_per_stream = 20, 10.0, 10
        args.seconds, args.ramp, args.warmup, args.settle, args.repeat = 1.0, 0.3, 0.3, 0.3, 1
        args.stubs, args.clients = args.stubs or 2, args.clients or 2
        args.workers = args.workers or "1,2"
    if args.out is None and not args.quick:
        args.out = str(ROOT / "bench" / "results" / "gate-workers")
    args.workers = [int(x) for x in str(args.workers or "1,2,4").split(",") if x]
    if not args.workers or args.workers[0] != 1 or any(n < 1 for n in args.workers):
        ap.error("--workers: a list of counts starting with 1, e.g. 1,2,4")
    _auto_counts(args)
    # The stub's real pace: one event per stream every whole number of 5 ms ticks, the first
    # one tick after the request; a connection asks again as soon as its stream ends.
    gap = max(1, round(1 / args.event_rate / gate_cpu.TICK_S)) * gate_cpu.TICK_S
    args.real_rate = 1 / gap
    stream_s = (args.events_per_stream - 1) * gap + gate_cpu.TICK_S
    args.offered = round(args.streams * args.events_per_stream / stream_s, 1)
    gate_cores, stub_cores, client_cores, own_cores = layout(args)

    def on_term(_sig: int, _frame: object) -> None:  # a time limit: write what was measured
        raise SystemExit("SIGTERM (a time limit?)")

    signal.signal(signal.SIGTERM, on_term)
    # A copy of the tree without its .git (bench/results from another machine) says its commit.
    commit = os.environ.get("BENCH_COMMIT") or gate_cpu.commit()
    if own_cores:
        os.sched_setaffinity(0, set(own_cores))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    py = sys.executable
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    where = (
        f"gate on cores {gate_cores} (N workers on the first N), stubs on {stub_cores}, "
        f"clients on {client_cores}, this process on {own_cores}"
        if gate_cores
        else f"NOTHING PINNED ({len(os.sched_getaffinity(0))} cores for {max(args.workers)} "
        f"workers + {args.stubs} stubs + {args.clients} clients, or no taskset): a smoke run, "
        "not a saturation measurement"
    )
    print(f"# bench/gate_workers.py at {commit}; {where}", flush=True)
    print(
        f"# offered: {args.streams} streams × {args.real_rate:g} events/s = {args.offered:.0f}/s, "
        f"{args.events_per_stream} events a stream; {args.repeat} repeats of {args.seconds:g} s; "
        f"RLIMIT_NOFILE {hard}",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-gate-workers-"))
    gate_log_path = tmp / "gate.log"
    procs: list[subprocess.Popen[str]] = []
    gates: list[GateProc] = []
    points: list[Point] = []
    error: str | None = None
    try:
        with gate_log_path.open("wb") as gate_log:
            up = gate_cpu.free_port()
            stubs = []
            for i in range(args.stubs):
                p = subprocess.Popen(pinned(stub_cores[i] if stub_cores else None, [py, __file__, "--serve-stub", str(up), "--events-per-stream", str(args.events_per_stream), "--event-rate", str(args.event_rate)]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)  # fmt: skip
                procs.append(p)
                wait_ready(p, f"stub {i}")
                stubs.append(p)
            clients = []
            for i in range(args.clients):
                p = subprocess.Popen(pinned(client_cores[i] if client_cores else None, [py, __file__, "--serve-client"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
                procs.append(p)
                wait_ready(p, f"client {i}")
                clients.append(p)
            for n in args.workers:
                g = start_gate(n, gate_cores[:n] if gate_cores else [], up, args, gate_log)
                gates.append(g)
                print(f"# gate with {n} worker(s): pids {g.pids}, cores allowed {allowed_cores(g.pids[0])}", flush=True)  # fmt: skip
            for g in gates:  # what each costs with nothing to relay (its /health polls)
                c0, t0 = _snap(g.pids), time.monotonic()
                time.sleep(1.0 if not args.quick else 0.3)
                g.idle_cores = round(sum(_busy(c0, _snap(g.pids), time.monotonic() - t0).values()), 3)  # fmt: skip
            for rep in range(args.repeat):
                k = rep % len(gates)
                for g in gates[k:] + gates[:k]:
                    pt = run_point(g, rep, args, clients, stubs)
                    points.append(pt)
                    print(
                        f"rep {rep} workers {g.workers}: {pt.rate_per_s:8.0f} events/s of {pt.offered_per_s:.0f} "
                        f"gate {pt.gate_cores_busy:.2f} cores ({' '.join(f'{b:.0%}' for b in pt.worker_busy)}) "
                        f"{pt.gate_us_per_event:.1f} µs/event; stubs {' '.join(f'{b:.0%}' for b in pt.stub_busy)}; "
                        f"clients {' '.join(f'{b:.0%}' for b in pt.client_busy)}; streams/worker {pt.streams_per_worker}; "
                        f"{pt.events_per_read:.1f} events/read; +gap p99 {pt.gap_p99_added_ms:.0f} ms; stalled {pt.stalled_streams}; "
                        f"errors {pt.errors}; connected {pt.connected} (failed {pt.failed_connects}); load {pt.load_avg[0]:.2f}"
                        + (f"; limited by {', '.join(pt.limited_by)}" if pt.limited_by else "")
                        + "".join(f"\n  PROBLEM: {x}" for x in pt.problems),
                        flush=True,
                    )  # fmt: skip
    except (SystemExit, Exception) as e:  # what was measured is still written
        error = f"{type(e).__name__}: {e}"
        print(f"ERROR: {error}", file=sys.stderr, flush=True)
    finally:
        for g in gates:
            stop(g.proc, group=True)
        for p in procs:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
            stop(p)
    table, summary = summarize(points, args)
    if error is not None:
        table += ["", f"The run stopped early: {error}"]
    print("\n".join(table), flush=True)
    failed = any("IDLE WORKER" in x for p in points for x in p.problems)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": command, "commit": commit, "cores": sorted(os.sched_getaffinity(0)),
                "python": sys.version.split()[0], "layout": {"gate": gate_cores, "stubs": stub_cores,
                "clients": client_cores, "self": own_cores},
                "workers": args.workers, "streams": args.streams, "event_rate": args.real_rate,
                "offered_per_s": args.offered, "events_per_stream": args.events_per_stream,
                "seconds": args.seconds, "ramp": args.ramp, "warmup": args.warmup, "repeat": args.repeat,
                "gate_args": args.gate_args, "gate_idle_cores": {str(g.workers): g.idle_cores for g in gates},
                "rlimit_nofile": hard, "load_avg_end": os.getloadavg()}  # fmt: skip
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "points": [asdict(p) for p in points]}, indent=1) + "\n")  # fmt: skip
        la = os.getloadavg()
        out.with_suffix(".md").write_text(
            f"# gate workers: the SSE event rate saturated, by worker count\n\n`{command}` at `{meta['commit']}`; "
            f"{where}; offered {args.streams} streams × {args.real_rate:g} events/s = {args.offered:.0f}/s; "
            f"{args.repeat} repeats of {args.seconds:g} s, the worker counts taking turns; load average at the end "
            f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f} (per point in the JSON, with each core's busy share where /proc/stat has it).\n\n"
            + "\n".join(table) + "\n"
        )  # fmt: skip
        log_bytes = gate_log_path.read_bytes()
        if len(log_bytes) > GATE_LOG_KEEP:  # its end: what went wrong last
            log_bytes = b"[... cut ...]\n" + log_bytes[-GATE_LOG_KEEP:]
        out.with_suffix(".gate.log").write_bytes(log_bytes)
    shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        return 4
    if failed:
        print("FAIL: SO_REUSEPORT left a worker idle (see Problems above)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
