"""Capture what vLLM 0.32 shows while an operator has paused it (``POST /pause?mode=keep``).

Run from the repository root with the daemon's venv (the vLLM venv must exist:
``scripts/vllm-setup``)::

    .venv/bin/python -m tests.vllm_tier.capture_pause OUT.json

It takes the tier's host lock, starts one ``vllm serve`` of the tier's model with
``VLLM_SERVER_DEV_MODE=1`` (the only way vLLM serves ``/pause``, ``/resume`` and ``/is_paused``),
sends one long streamed request, pauses the server with it in the engine, sends a second one
while paused, reads ``/is_paused``, ``/health`` and ``/metrics`` a few times, resumes, and
waits for both answers. OUT is one JSON document: each step with what was answered (status,
body, the engine's running and waiting gauges and token counters), and vLLM's log lines that
name the pause state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support import wait_for
from tests.vllm_tier import support
from vllm_guardian.tools.demo import free_port

GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:kv_cache_usage_perc",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    venv = support.vllm_venv_or_skip()
    lock = support.host_lock()
    work = Path(f"/tmp/vllm-guardian-capture-pause-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    support.build_model(venv, model)
    run_id = uuid.uuid4().hex
    port = free_port()
    env = {**support.vllm_env(run_id, work), "VLLM_SERVER_DEV_MODE": "1"}
    cmd = support.serve_command(venv, model, port, env, ("--max-num-seqs", "4"))
    url = f"http://127.0.0.1:{port}"
    census = support.Census(run_id).start()
    steps: list[dict[str, Any]] = []
    s = support.session()
    t0 = time.monotonic()

    def look(what: str) -> None:
        paused = s.get(url + "/is_paused", timeout=30)
        health = s.get(url + "/health", timeout=30)
        metrics = support.scalar_samples(s.get(url + "/metrics", timeout=30).text, GAUGES)
        steps.append(
            {
                "t_seconds": round(time.monotonic() - t0, 2),
                "step": what,
                "is_paused": {"status": paused.status_code, "body": paused.text},
                "health": health.status_code,
                "metrics": metrics,
            }
        )
        print(steps[-1])

    log_path = work / "vllm.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    done: list[support.StreamResult] = []
    try:
        wait_for(
            lambda: support.healthy(url),
            "vLLM /health 200",
            300,
            every_seconds=support.POLL_SECONDS,
        )
        warm = support.stream_completion(url, support.prompt_ids(32, 1), 2, stream=False)
        print("warm-up:", warm.status, warm.error)
        look("serving, idle")
        first_token = threading.Event()
        first = threading.Thread(
            target=lambda: done.append(
                support.stream_completion(
                    url, support.prompt_ids(64, 2), 1500, timeout=600, first_token=first_token
                )
            ),
            daemon=True,
        )
        first.start()
        wait_for(first_token.is_set, "the first request's first token", 120, every_seconds=0.1)
        look("one request generating")
        r = s.post(url + "/pause", params={"mode": "keep"}, timeout=60)
        steps.append({"step": "POST /pause?mode=keep", "status": r.status_code, "body": r.text})
        look("paused")
        second = threading.Thread(
            target=lambda: done.append(
                support.stream_completion(url, support.prompt_ids(64, 3), 8, timeout=600)
            ),
            daemon=True,
        )
        second.start()
        time.sleep(3.0)  # a capture, not a test: the second request has had time to arrive
        look("paused, a second request sent 3 s ago")
        time.sleep(3.0)
        look("paused, 3 s later")
        r = s.post(url + "/resume", timeout=60)
        steps.append({"step": "POST /resume", "status": r.status_code, "body": r.text})
        first.join(timeout=600)
        second.join(timeout=600)
        look("resumed, both answered")
        steps.append({"step": "answers", "status": [d.status for d in done]})
    finally:
        support.stop_group(proc, 30)
        swept = support.sweep(run_id, census)
        census.stop()
        lock.close()
        print("swept:", swept)
    lines = [
        line.rstrip("\n")
        for line in log_path.read_text(errors="replace").splitlines()
        if "pause" in line.lower()
    ]
    args.out.write_text(json.dumps({"steps": steps, "log_lines": lines}, indent=1) + "\n")
    print(f"{len(steps)} steps, {len(lines)} log lines -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
