"""Benchmark: the guardian's per-tick cost on a large vLLM exposition, against prometheus_client.

Run: .venv/bin/python bench/tick.py [--seconds 60] [--engines 8]

1. Builds an N-engine exposition from the real vLLM 0.32 capture (the ``engine`` label 0..N-1).
2. Times, in the same run, (a) ``prometheus_client.parser.text_string_to_metric_families`` over
   it and (b) the guardian's scrape-to-signals work per tick: parse with the daemon's long-lived
   parser, assemble the snapshot, derive the signals from a full history. (c) is (b) with a
   fresh parser each time (the first tick after start-up).
3. Runs ``vllm-guardian run`` at a 1 s interval for ``--seconds`` against a loopback server
   serving that text, and reports its RSS and CPU share; as a peer, a plain loop that does what
   a naive exporter would (GET + prometheus_client parse every second) for the same time.

Figures are printed as ratios against the peer; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.expositions import multi_engine  # noqa: E402
from vllm_guardian.config import ServiceConfig, SignalsConfig  # noqa: E402
from vllm_guardian.core.signals import derive  # noqa: E402
from vllm_guardian.daemon import assemble  # noqa: E402
from vllm_guardian.model import Reading, SourceKind  # noqa: E402
from vllm_guardian.sources.vllm_metrics import VllmParser, parse_vllm_metrics  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "vllm" / "metrics-under-load-05.prom"


def timeit(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per call over ``repeat`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_work(text: str, repeat: int) -> dict[str, float]:
    services = [ServiceConfig(name="vllm")]
    scfg = SignalsConfig()
    parser = VllmParser()
    history: collections.deque = collections.deque(maxlen=int(scfg.slope_window_seconds / 2) + 2)
    clock = [1_800_000_000.0]

    def guardian_tick() -> None:
        scrape = parse_vllm_metrics(text, len(text), parser)
        clock[0] += 2.0
        snap = assemble(clock[0], ["vllm"], [Reading(SourceKind.VLLM_METRICS, "vllm", scrape)], [])
        history.append(snap)
        derive(list(history), services, scfg)

    for _ in range(history.maxlen or 0):  # a full history, as in steady state
        guardian_tick()
    reference = timeit(lambda: list(text_string_to_metric_families(text)), max(5, repeat // 10))
    warm = timeit(guardian_tick, repeat)
    cold = timeit(lambda: parse_vllm_metrics(text, len(text), VllmParser()), repeat)
    return {
        "prometheus_client": reference,
        "guardian_tick": warm,
        "guardian_first_tick_parse": cold,
    }


class _Handler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        code = 200 if self.path in ("/metrics", "/health") else 404
        body = self.body if self.path == "/metrics" else b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return cpu, rss


def run_process(argv: list[str], seconds: float, env: dict[str, str]) -> tuple[float, int]:
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(3)  # start-up (imports) is not the steady state
        cpu0, _ = proc_usage(proc.pid)
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < seconds:
            time.sleep(1)
            _, rss = proc_usage(proc.pid)
            peak = max(peak, rss)
        cpu1, _ = proc_usage(proc.pid)
        return (cpu1 - cpu0) / (time.monotonic() - t0), peak
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PEER = textwrap.dedent(
    """
    import sys, time, requests
    from prometheus_client.parser import text_string_to_metric_families
    url = sys.argv[1]
    s = requests.Session()
    while True:
        t = time.monotonic()
        list(text_string_to_metric_families(s.get(url, timeout=5).text))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
    """
)


def daemon_usage(text: str, seconds: float) -> dict[str, tuple[float, int]]:
    handler = type("H", (_Handler,), {"body": text.encode()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "config.yaml"
            cfg.write_text(
                f"interval_seconds: 1\nlisten: 127.0.0.1:0\nruntime_dir: {tmp}/run\nstate_dir: {tmp}\n"
                f"recorder:\n  path: {tmp}/flight.jsonl\n"
                "sources:\n  nvml:\n    enabled: false\n  unit:\n    enabled: false\n"
                f"services:\n  - name: vllm\n    url: {url}\n"
            )
            guardian = run_process(
                [sys.executable, "-m", "vllm_guardian", "run", "-c", str(cfg)], seconds, env
            )
        peer = run_process([sys.executable, "-c", PEER, url + "/metrics"], seconds, env)
    finally:
        httpd.shutdown()
        httpd.server_close()
    return {"guardian": guardian, "peer": peer}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0, help="daemon run length; 0 skips it")
    args = ap.parse_args()
    text = multi_engine(CAPTURE.read_text(), args.engines)
    print(
        f"exposition: {args.engines} engines, {len(text.splitlines())} lines, {len(text) / 1024:.0f} KiB"
    )
    t = cpu_work(text, args.repeat)
    ref = t["prometheus_client"]
    print(f"(a) prometheus_client parse:            {ref * 1e3:8.2f} ms")
    print(
        f"(b) guardian scrape-to-signals, a tick: {t['guardian_tick'] * 1e3:8.2f} ms   {ref / t['guardian_tick']:5.1f}x cheaper"
    )
    print(
        f"(c) guardian parse, first tick (cold):  {t['guardian_first_tick_parse'] * 1e3:8.2f} ms"
        f"   {ref / t['guardian_first_tick_parse']:5.1f}x cheaper"
    )
    if args.seconds > 0:
        u = daemon_usage(text, args.seconds)
        (gcpu, grss), (pcpu, prss) = u["guardian"], u["peer"]
        print(
            f"daemon over {args.seconds:.0f}s at 1s interval: CPU {100 * gcpu:.2f}% of a core, peak RSS {grss / 2**20:.1f} MiB"
        )
        print(
            f"peer (GET + prometheus_client parse each 1s): CPU {100 * pcpu:.2f}% of a core, peak RSS {prss / 2**20:.1f} MiB"
        )
        print(f"guardian/peer: CPU {gcpu / pcpu:.2f}x, RSS {grss / prss:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
