"""Capture what vLLM 0.32's ``/metrics`` shows while its engine works on one long prompt alone,
and while its engine is stopped (SIGSTOP of EngineCore) with requests in it.

Run from the repository root with the daemon's venv (the vLLM venv must exist:
``scripts/vllm-setup``)::

    .venv/bin/python -m tests.vllm_tier.capture_progress OUT.jsonl [--prompt-tokens 20480]

It takes the tier's host lock, builds the long-context variant of the tier's model
(``tinymodel.py --long-context``), starts one ``vllm serve`` with chunked prefill in small chunks
(``--max-num-batched-tokens``), and reads ``/metrics`` every 0.5 s:

* ``long_prefill``: idle, then one prompt of ``--prompt-tokens`` tokens (2 generated tokens)
  alone in the engine, until it is answered, then idle again;
* ``hang``: the same prompt sent again; once the engine is prefilling it (KV usage moved), its
  EngineCore is stopped with SIGSTOP for 12 s, then continued, until the prompt is answered.

Each line of OUT is one reading: ``{"series", "t_seconds" (since the series' first reading),
"event" (what the script did just before, or null), "metrics" (the exposition, reduced)}``.
The exposition keeps every ``vllm:`` sample except the ``_created`` ones and the buckets of the
histograms the guardian does not read, and ``process_start_time_seconds``: what the guardian's
parser reads, and every counter and gauge that could say the engine moved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support import wait_for
from tests.vllm_tier import support
from vllm_guardian.tools.demo import free_port

EVERY_SECONDS = 0.5
HANG_SECONDS = 12.0
KEPT_BUCKETS = (
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:iteration_tokens_total_bucket",
)


def reduce(text: str) -> str:
    """The samples and TYPE lines that matter (see the module's docstring), in their order."""
    out = []
    for line in text.splitlines():
        if line.startswith("# HELP"):
            continue
        typed = line.startswith("# TYPE")
        name = line.split()[2] if typed else line.split("{", 1)[0].split(" ", 1)[0]
        if name == "process_start_time_seconds":
            out.append(line)
        elif not name.startswith("vllm:") or name.endswith("_created"):
            continue
        elif typed or not name.endswith("_bucket") or name in KEPT_BUCKETS:
            out.append(line)
    return "\n".join(out) + "\n"


class Recorder:
    def __init__(self, url: str, out: list[dict[str, Any]]) -> None:
        self.url = url
        self.out = out
        self.series = ""
        self.t0 = 0.0
        self.event: str | None = None
        self.last = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start_series(self, name: str) -> None:
        with self._lock:
            self.series, self.t0 = name, time.monotonic()

    def mark(self, event: str) -> None:
        with self._lock:
            self.event = event

    def _run(self) -> None:
        s = support.session()
        while not self._stop.is_set():
            tick = time.monotonic()
            try:
                text = s.get(self.url + "/metrics", timeout=5).text
            except support.requests.RequestException as e:
                text = ""
                print("scrape failed:", e)
            with self._lock:
                if self.series and text:
                    self.last = text
                    self.out.append(
                        {
                            "series": self.series,
                            "t_seconds": round(tick - self.t0, 3),
                            "event": self.event,
                            "metrics": reduce(text),
                        }
                    )
                    self.event = None
            self._stop.wait(max(0.0, EVERY_SECONDS - (time.monotonic() - tick)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def kv(text: str) -> float:
    return support.scalar_samples(text, ["vllm:kv_cache_usage_perc"]).get(
        "vllm:kv_cache_usage_perc", 0.0
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=20480)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--no-hang", action="store_true")
    args = ap.parse_args()
    venv = support.vllm_venv_or_skip()
    lock = support.host_lock()
    work = Path(f"/tmp/vllm-guardian-capture-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    subprocess.run(
        [str(venv / "bin" / "python"), str(support.HERE / "tinymodel.py"), str(model),
         "--long-context"],
        check=True, timeout=120,
    )  # fmt: skip
    run_id = uuid.uuid4().hex
    port = free_port()
    env = support.vllm_env(run_id, work)
    blocks = (args.prompt_tokens + 8 * 128) // 128 + 1
    flags = (
        "--max-model-len", str(args.prompt_tokens + 512),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--num-gpu-blocks-override", str(blocks),
        "--max-num-seqs", "4",
    )  # fmt: skip
    cmd = support.serve_command(venv, model, port, env, flags)
    url = f"http://127.0.0.1:{port}"
    census = support.Census(run_id).start()
    rows: list[dict[str, Any]] = []
    log = (work / "vllm.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rec = Recorder(url, rows)
    try:
        wait_for(
            lambda: support.healthy(url),
            "vLLM /health 200",
            300,
            every_seconds=support.POLL_SECONDS,
        )
        # A first short request: a fresh server's first one warms it up.
        warm = support.stream_completion(url, support.prompt_ids(32, 1), 2, stream=False)
        print("warm-up:", warm.status, warm.error)
        rec.start()
        prompt = support.prompt_ids(args.prompt_tokens, 7)

        rec.start_series("long_prefill")
        time.sleep(2.0)
        rec.mark("sent")
        r = support.stream_completion(url, prompt, 2, stream=False, timeout=600)
        rec.mark("answered")
        print("long prefill:", r.status, r.error, round(r.ended - r.started, 1), "s")
        time.sleep(2.0)

        if not args.no_hang:
            engine = [
                p for p, c in support.descendants(proc.pid) if c.startswith("VLLM::EngineCore")
            ]
            assert len(engine) == 1, support.descendants(proc.pid)
            rec.start_series("hang")
            time.sleep(1.0)
            base = kv(rec.last)
            done: list[support.StreamResult] = []
            prompt2 = support.prompt_ids(args.prompt_tokens, 8)  # no prefix-cache hit
            t = threading.Thread(
                target=lambda: done.append(
                    support.stream_completion(url, prompt2, 2, stream=False, timeout=600)
                ),
                daemon=True,
            )
            rec.mark("sent")
            t.start()
            wait_for(lambda: kv(rec.last) > base, "KV usage to move", 120, every_seconds=0.1)
            time.sleep(1.0)
            os.kill(engine[0], signal.SIGSTOP)
            rec.mark("SIGSTOP EngineCore")
            time.sleep(HANG_SECONDS)
            os.kill(engine[0], signal.SIGCONT)
            rec.mark("SIGCONT EngineCore")
            t.join(timeout=600)
            print("after the hang:", done[0].status if done else None)
            time.sleep(2.0)
    finally:
        rec.stop()
        swept = support.sweep(run_id, census)
        census.stop()
        lock.close()
        print("swept:", swept)
    with args.out.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
    print(f"{len(rows)} readings -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
