"""Benchmark: the guardian's own footprint per tick, in the configurations users run.

Run: .venv/bin/python bench/tick.py [--engines 1,8] [--configs url,unit,nvml] [--seconds 20]

For each engine count, a stand-in for vLLM (a child process on 127.0.0.1) serves an N-engine
exposition built from the real vLLM 0.32 captures in tests/fixtures/vllm/ (``engine`` label
0..N-1), rotating through three captures taken under load so that every scrape's values move as
they do on a busy server (counters, histograms), and answers /health, over HTTP/1.1 with
keep-alive as uvicorn serves vLLM's API (the guardian keeps one connection per source). Then, per configuration:

* ``url``: the service found by its port (no ``unit:``; the unit source reads /proc), NVML off;
* ``unit``: ``unit: vllm.service``, with a stand-in ``systemctl`` (a shell script printing
  ``systemctl show``'s answer with the stand-in's pid as MainPID: a real fork and exec per read)
  and a stand-in ``journalctl`` following the stand-in's journal (``tail -F`` of a file of
  ``journalctl -o json`` entries: one uvicorn access line per request the stand-in answers, as
  vLLM logs the guardian's own scrapes and probes); NVML off;
* ``nvml``: as ``url``, plus NVML through the fake libnvidia-ml.so.1 (tests/fake_nvml, built
  with gcc) with one GPU per engine, each holding a process of the stand-in.

The allocator source reads a directory of its own, absent (the plugin is not part of these
configurations; the host's ``/run/vllm-guardian-allocator`` may hold other runs' files).

it measures, in the same run:

1. **per component**, the guardian's own ``tick()`` in this process for ``--ticks`` ticks on a
   fake clock that advances 1 s per tick (so every cadence behaves as at a 1 s interval), after
   as many ticks as fill the history the daemon keeps (steady state; about 300 at 1 s): CPU
   time per tick of each source (its thread's CPU), of the decision step (signals, alerts,
   policy), of the flight recorder, of publishing, and of the whole tick (process CPU); and
   the whole tick's ratio to prometheus_client's parse of the same exposition, taken on the
   same host at the same moment. The ticks run in rounds of one unit-source refresh period
   (30 ticks: every round holds one full unit read, a ``systemctl`` fork and a /proc walk),
   with three parses before the first round and after each one; each round's ratio is the
   median of the parses on either side of it over the round's whole-tick CPU per tick, and the
   ratio printed is the median over the rounds (their range and the ratio of the means are
   printed too): a load that comes or goes weighs on both sides of a round's ratio, and one
   round caught by a burst of load on the host does not decide the figure;
2. **the whole daemon**: ``vllm-guardian run`` at a 1 s interval for ``--seconds``, as its own
   process: CPU share of one core and peak RSS, read from /proc. A short run has a short
   history (the step's windows fill over 5 minutes), so its CPU share is a lower bound; the
   in-process whole tick at full history, over the 1 s interval, is the steady-state share
   (printed as "steady CPU").

Figures are printed as a table; nothing here is asserted. Keep runs short on a shared host.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.expositions import multi_engine  # noqa: E402
from tests.nvml_fake import build_fake_nvml  # noqa: E402
from vllm_guardian.config import parse_config  # noqa: E402
from vllm_guardian.core.driver import history_span_seconds  # noqa: E402
from vllm_guardian.lowio.clock import FakeClock  # noqa: E402
from vllm_guardian.shell.daemon import Guardian  # noqa: E402

CAPTURES = [
    ROOT / "tests" / "fixtures" / "vllm" / f"metrics-under-load-0{k}.prom" for k in (2, 5, 8)
]
CONFIGS = ("url", "unit", "nvml")
PARSES_BETWEEN_ROUNDS = 3
GIB = 1024**3

# The stand-in for vLLM: serves the expositions in turn on /metrics, 200 on /health, and logs
# every request as uvicorn's access log does ("INFO:     host:port - "GET /metrics HTTP/1.1" 200
# OK"), one journal entry a request in ``journalctl -o json``'s form (the fields a unit's stdout
# line carries), appended to the file the stand-in journalctl follows: the guardian's own scrapes
# are in vLLM's journal, one line each, and the logs source reads them as it would there.
STAND_IN = textwrap.dedent(
    """
    import sys, itertools, json, os, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    journal = open(sys.argv[1], "a", buffering=1)
    bodies = itertools.cycle([open(p, "rb").read() for p in sys.argv[2:]])
    seq = itertools.count(1)
    FIELDS = {
        "_BOOT_ID": "6c1b7e7f5d0e4c4a9d3f2b1a0e9d8c7b", "_MACHINE_ID": "0f" * 16,
        "_HOSTNAME": "gpu-node-1", "PRIORITY": "6", "SYSLOG_FACILITY": "3", "_UID": "997",
        "_GID": "997", "_CAP_EFFECTIVE": "0", "_TRANSPORT": "stdout", "SYSLOG_IDENTIFIER": "vllm",
        "_COMM": "python3", "_EXE": "/usr/bin/python3.12",
        "_CMDLINE": "/opt/vllm/bin/python3 /opt/vllm/bin/vllm serve /models/Qwen3-32B "
        "--tensor-parallel-size 8 --gpu-memory-utilization 0.9 --max-num-seqs 256 --port 8000",
        "_SYSTEMD_CGROUP": "/system.slice/vllm.service", "_SYSTEMD_UNIT": "vllm.service",
        "_SYSTEMD_SLICE": "system.slice", "_SYSTEMD_INVOCATION_ID": "a1" * 16,
        "_STREAM_ID": "b2" * 16, "_PID": str(os.getpid()),
    }
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves vLLM's API
        def do_GET(self):
            body = next(bodies) if self.path == "/metrics" else b""
            self.send_response(200 if self.path in ("/metrics", "/health") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_request(self, code="-", size="-"):
            n, now = next(seq), time.time()
            host, port = self.client_address[:2]
            journal.write(json.dumps({
                "__CURSOR": f"s=6c1b7e7f;i={n:x};b=6c1b7e7f;m={n:x};t={int(now * 1e6):x}",
                "__REALTIME_TIMESTAMP": str(int(now * 1e6)),
                "__MONOTONIC_TIMESTAMP": str(int(time.monotonic() * 1e6)),
                **FIELDS,
                "MESSAGE": f'INFO:     {host}:{port} - "{self.requestline}" {code} OK',
            }) + "\\n")
        def log_message(self, *a):
            pass
    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(s.server_address[1], flush=True)
    s.serve_forever()
    """
)


def journal_file(tmp: Path) -> Path:
    """The stand-in's journal: an entry per request, followed by the stand-in journalctl."""
    return tmp / "journal.jsonl"


@contextmanager
def stand_in(texts: list[str], tmp: Path) -> Iterator[tuple[int, int]]:
    """(pid, port) of a running stand-in for vLLM serving ``texts`` in turn."""
    paths = []
    for i, text in enumerate(texts):
        p = tmp / f"exposition-{i}.prom"
        p.write_text(text)
        paths.append(str(p))
    journal_file(tmp).touch()
    proc = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(journal_file(tmp)), *paths],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def config_text(kind: str, tmp: Path, port: int, pid: int, engines: int, lib: Path | None) -> str:
    d = tmp / kind
    d.mkdir(exist_ok=True)
    systemctl = d / "systemctl"
    show = (
        f"MainPID={pid}\nExecMainStatus=0\nResult=success\nNRestarts=0\n"
        "ControlGroup=/system.slice/vllm.service\nLoadState=loaded\nActiveState=active\n"
        "SubState=running\nActiveEnterTimestampMonotonic=52889123456\n"
    )
    systemctl.write_text(f"#!/bin/sh\ncat <<'EOF'\n{show}EOF\n")
    journalctl = d / "journalctl"
    # The stand-in's journal from now on (-n 0), followed.
    journalctl.write_text(f"#!/bin/sh\nexec tail -n 0 -F {journal_file(tmp)}\n")
    for f in (systemctl, journalctl):
        f.chmod(0o755)
    nvml = "    enabled: false\n"
    if kind == "nvml":
        assert lib is not None
        state = d / "nvml-state.txt"
        lines = ["driver 550.54.15"]
        for i in range(engines):
            lines.append(
                f"gpu {i} total={80 * GIB} used={70 * GIB} util=90 temp=60 power_mw=500000"
            )
            lines.append(f"proc {i} compute {pid} {69 * GIB}")
        state.write_text("\n".join(lines) + "\n")
        os.environ["FAKE_NVML_STATE"] = str(state)  # read by the fake library (and the child)
        nvml = f"    backend: nvml\n    library_path: {lib}\n"
    unit = "    unit: vllm.service\n" if kind == "unit" else ""
    return (
        f"interval_seconds: 1\nlisten: 127.0.0.1:0\nruntime_dir: {d}/run\nstate_dir: {d}/state\n"
        f"recorder:\n  path: {d}/flight.jsonl\n"
        # The allocator plugin is not part of these configurations: its own directory, absent
        # (the host's /run/vllm-guardian-allocator may hold other runs' files).
        f"sources:\n  allocator:\n    directory: {d}/allocator\n"
        f"  nvml:\n{nvml}  unit:\n    systemctl: {systemctl}\n"
        f"  logs:\n    journalctl: {journalctl}\n"
        f"services:\n  - name: vllm\n    url: http://127.0.0.1:{port}\n{unit}"
    )


def _timed(fn: Callable[..., Any], key: str, acc: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.thread_time() - t

    return wrapper


def per_component(cfg_text: str, ticks: int, reference: str) -> dict[str, Any]:
    """CPU seconds per tick of each part of the guardian's own tick, and the whole tick's ratio
    to prometheus_client's parse of ``reference`` taken round by round (module docstring)."""
    cfg = parse_config(cfg_text)
    clock = FakeClock(time.time())
    g = Guardian(cfg, clock=clock, notifier=None)
    acc: dict[str, float] = defaultdict(float)
    # A round spans one refresh period of the unit source, so every round holds exactly one full
    # unit read (a systemctl fork, a /proc walk): no round is spared the periodic costs.
    round_ticks = max(1, int(cfg.sources.unit.refresh_seconds / cfg.interval_seconds))
    rounds = max(1, -(-ticks // round_ticks))
    try:
        for slot in g._slots:  # a benchmark looks inside
            c = slot.collector
            c.collect = _timed(c.collect, c.kind.value, acc)  # type: ignore[method-assign]
        if g.healing is not None:
            g.healing.run = _timed(g.healing.run, "step", acc)  # type: ignore[method-assign]
        g._record = _timed(g._record, "recorder", acc)  # type: ignore[method-assign]
        g.exposition.publish = _timed(g.exposition.publish, "publish", acc)  # type: ignore[method-assign]
        # Warm-up: the first scrape (cold parser), the first full reads, and a history as long
        # as the daemon keeps (history_span_seconds: the longest signal window), as in steady
        # state: the step's windows grow with it.
        for _ in range(int(history_span_seconds(cfg)) + 5):
            g.tick()
            clock.advance(1.0)
        acc.clear()
        # The logs source's reader thread (journalctl's output: JSON, the matcher) works between
        # collects; its CPU is part of the "logs" column.
        readers = [
            time.pthread_getcpuclockid(t.ident)
            for slot in g._slots
            if (t := getattr(slot.collector, "_thread", None)) is not None and t.ident is not None
        ]
        reader_cpu = sum(time.clock_gettime(c) for c in readers)
        parses = [prometheus_parse_cpu(reference, PARSES_BETWEEN_ROUNDS)]
        round_whole: list[float] = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(round_ticks):
                g.tick()
                clock.advance(1.0)
            if readers:
                time.sleep(0.1)  # the reader thread's work on the round's last lines is its own
            round_whole.append((time.process_time() - t0) / round_ticks)
            parses.append(prometheus_parse_cpu(reference, PARSES_BETWEEN_ROUNDS))
        if readers:
            acc["logs"] += sum(time.clock_gettime(c) for c in readers) - reader_cpu
    finally:
        g.close()
    n = rounds * round_ticks
    out: dict[str, Any] = {k: v / n for k, v in acc.items()}
    out["whole tick"] = statistics.fmean(round_whole)
    # Each round against the parses just before and just after it: a load that comes or goes
    # weighs on both sides of that round's ratio.
    refs = [statistics.median(parses[i] + parses[i + 1]) for i in range(rounds)]
    ratios = sorted(r / w for r, w in zip(refs, round_whole, strict=True))
    out["parse"] = statistics.median(p for ps in parses for p in ps)
    out["ratio"] = statistics.median(ratios)
    out["ratio range"] = (ratios[0], ratios[-1])
    out["ratio of means"] = statistics.fmean(refs) / out["whole tick"]
    out["rounds"] = (rounds, round_ticks)
    return out


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return cpu, rss


def whole_daemon(cfg_text: str, tmp: Path, seconds: float) -> tuple[float, int]:
    """(CPU share of one core, peak RSS bytes) of ``vllm-guardian run`` over ``seconds``."""
    cfg = tmp / "daemon.yaml"
    cfg.write_text(cfg_text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flight = Path(cfg_text.split("recorder:\n  path: ", 1)[1].split("\n", 1)[0])
    flight.unlink(missing_ok=True)  # the in-process run's records: not this daemon's ticks
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Start-up (imports, the first ticks) is not the steady state: measure from the third
        # recorded tick (on a loaded host start-up alone can take seconds).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if flight.exists() and flight.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the daemon recorded no 3 ticks within 60 s (exit {proc.poll()})")
        cpu0, _ = proc_usage(proc.pid)
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < seconds:
            time.sleep(0.5)
            peak = max(peak, proc_usage(proc.pid)[1])
        cpu1, _ = proc_usage(proc.pid)
        return (cpu1 - cpu0) / (time.monotonic() - t0), peak
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prometheus_parse_cpu(text: str, repeat: int) -> list[float]:
    """CPU seconds of each of ``repeat`` prometheus_client parses of ``text`` (this thread's:
    a guardian's threads working meanwhile are not the parse's)."""
    list(text_string_to_metric_families(text))
    times = []
    for _ in range(repeat):
        t = time.thread_time()
        list(text_string_to_metric_families(text))
        times.append(time.thread_time() - t)
    return times


COMPONENTS = ("vllm_metrics", "health", "unit", "logs", "nvml", "allocator", "step", "recorder",
              "publish")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", default="1,8", help="engine counts, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    ap.add_argument(
        "--ticks",
        type=int,
        default=300,
        help="in-process ticks per configuration (whole rounds of the unit source's refresh)",
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="daemon run; 0 skips it")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}: choose from {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tick-") as tmpname:
        tmp = Path(tmpname)
        lib = None
        if "nvml" in configs:
            if shutil.which("gcc") is None:
                ap.error("the nvml configuration needs gcc to build the fake libnvidia-ml.so.1")
            lib = build_fake_nvml(tmp)
        for engines in [int(e) for e in args.engines.split(",")]:
            texts = [multi_engine(p.read_text(), engines) for p in CAPTURES]
            lines = len(texts[1].splitlines())
            print(
                f"exposition: {engines} engine(s), {lines} lines, {len(texts[1]) / 1024:.0f} KiB",
                flush=True,
            )
            with stand_in(texts, tmp) as (pid, port):
                for kind in configs:
                    text = config_text(kind, tmp, port, pid, engines, lib)
                    parts = per_component(text, args.ticks, texts[1])
                    daemon = whole_daemon(text, tmp / kind, args.seconds) if args.seconds else None
                    rows.append((engines, kind, parts, daemon))
                    (lo, hi), (rounds, round_ticks) = parts["ratio range"], parts["rounds"]
                    print(
                        f"  {kind}: whole tick {parts['whole tick'] * 1e3:.2f} ms, "
                        f"prometheus_client parse {parts['parse'] * 1e3:.2f} ms; parse / tick "
                        f"in {rounds} rounds of {round_ticks} ticks: median {parts['ratio']:.1f}×"
                        f" ({lo:.1f}× to {hi:.1f}×), of the means {parts['ratio of means']:.1f}×",
                        flush=True,
                    )
    print()
    head = ["engines", "config", *COMPONENTS, "whole tick", "parse / tick", "steady CPU",
            "daemon CPU", "RSS"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for engines, kind, parts, daemon in rows:
        cells = [str(engines), kind]
        cells += [f"{parts[c] * 1e3:.2f}" if c in parts else "–" for c in COMPONENTS]
        whole = parts["whole tick"]
        cells += [
            f"{whole * 1e3:.2f} ms",
            f"{parts['ratio']:.1f}× ({parts['parse'] * 1e3:.1f} ms)",
            f"{100 * whole:.2f} %",
        ]
        if daemon is not None:
            cells += [f"{100 * daemon[0]:.2f} %", f"{daemon[1] / 2**20:.1f} MiB"]
        else:
            cells += ["–", "–"]
        print("| " + " | ".join(cells) + " |")
    print(
        "\ncomponents: CPU ms per tick (sources: their thread's CPU); whole tick: process CPU per "
        "tick in this process at full history; parse / tick: the median over the rounds of "
        "prometheus_client's parse CPU (around the round) over the round's whole tick (the "
        "median parse in brackets); steady CPU: the whole tick over a 1 s interval, as a share "
        "of one core; "
        f"daemon: `vllm-guardian run` at a 1 s interval over {args.seconds:.0f} s (a short "
        "history: a lower bound), CPU share of one core and peak RSS."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
