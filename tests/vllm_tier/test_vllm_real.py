"""The `vllm` tier: the guardian against a real vLLM 0.32 (CPU build, tiny random Llama).

One real server at a time (about 3 GB of RAM), on 127.0.0.1 and a free port, run by the
guardian's own process manager (``policy.backend: process``, armed: ``dry_run: false``), so the
whole module shares one guardian and one vLLM and the tests run in file order:

1. the vLLM source reads every value the guardian uses, equal to the server's own /metrics;
2. the allocator plugin is loaded by vLLM's plugin loader in each vLLM process and stays idle;
   2b. requests whose model, prompt and headers carry failure signatures are logged by vLLM at
   ERROR and make the guardian do nothing;
3. KV pressure (32 blocks of 128 tokens, a bounded burst): saturation, waiting, preemptions,
   the KV alerts fire, ``/ready/vllm`` closes, then opens again after the burst;
4. the twin beside it: same families, types and labels, same qualitative behaviour under the
   same burst (it runs after the real server's burst, never beside a second real server);
5. a guardian-initiated restart while streams are in flight: the policy's relaunch (KV pressure
   with ``pressure_events_to_relaunch: 1``) drains, SIGTERMs a server started with
   ``--shutdown-timeout 30``: every in-flight stream completes, and a client that honours
   ``/ready`` sends nothing to the dying server;
6. engine death (SIGKILL of EngineCore): /health 503, exit 0, the guardian names
   ``engine_dead`` and the server is started exactly once more; through the deployed gate
   (``vllm-guardian gate -c``, following the guardian) a greedy stream is cut by the same
   death and continued on the new server, its text an uncut run's byte for byte, and an
   OpenAI SDK client (retries off) with two streams generating and a unary request in flight
   gets every answer whole;
7. engine hang (EngineCore stops itself with SIGSTOP at a step with the four requests in it,
   the fault plugin's hang file): the same requests through a gate whose
   progress watch holds after 3 s and takes back what the stopped engine holds
   (``take_back_hung``); the guardian's stall (8 s) names the hang and restarts vLLM once (the
   stopped engine core ignores SIGTERM; the process manager's SIGKILL of the group ends it), the
   gate continues the streams and sends the unary request again on the new server: every answer
   whole, the greedy stream's text the uncut run's byte for byte, nothing of the old server left.

Skipped (with the reason) without the vLLM venv; ``scripts/test`` builds it with
``scripts/vllm-setup`` and sets ``VLLM_GUARDIAN_REQUIRE_VLLM=1``, which turns the skip into a
failure. Measured numbers are printed (``pytest -s``) and written to ``$VLLM_GUARDIAN_TIER_REPORT``
when set; docs/vllm-tier.md has a run's figures.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for
from tests.vllm_tier import support
from tests.vllm_tier.frontdoor import (
    GateProcess,
    SdkClient,
    first_difference,
    request,
)
from tests.vllm_tier.support import MODEL_NAME, Sampler, StreamResult
from vllm_guardian.config import Config, parse_config
from vllm_guardian.model import AlertState
from vllm_guardian.shell.daemon import Guardian
from vllm_guardian.sources.vllm_metrics import WANTED, parse_vllm_metrics
from vllm_guardian.tools.demo import DEMO_RULES, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

# The pressure burst (tuned on the 2-core CPU machine): 24 concurrent streams of a
# 400-token prompt and 800 generated tokens need ~10 blocks each at the end; a 32-block pool
# runs 3-7 of them, queues the rest and preempts as they grow. 36 of them keep the pool full
# for ~25 s on 2 cores: long enough for alerts held 3 s even when a busy machine slows ticks. Not streamed:
# 24 streams' per-token events keep the API server's one core so busy that its /metrics
# answers late or not at all, for the guardian and for the test's own sampler alike.
BURST: dict[str, Any] = {"n": 36, "prompt_tokens": 400, "max_tokens": 800, "stream": False}
TWIN_SPEED = 5.0  # simulated seconds per second for the twin beside the real server (test 4)
BASE_FLAGS = (
    "--max-model-len", "2048", "--num-gpu-blocks-override", "32", "--max-num-seqs", "32",
    "--shutdown-timeout", "30", "--enable-server-load-tracking",
)  # fmt: skip
# The shipped VllmWaitingQueueLong at this pool's scale (32 blocks host 3-7 requests, not
# hundreds), with a demo-length `for`, beside the demo's KV rules. It matters on a real server:
# vLLM's KV gauge is a sawtooth under pressure (0.5-1.0 as requests finish and are preempted),
# so VllmKvCacheSaturated rarely holds >= 0.90 for its `for`, while the queue stays long.
# The three KV rules hold for 1 s here, not the demo's 3: on two busy cores a tick's scrape of
# the busy API server takes 1-2 s, so a 3 s `for` needed three or more ticks in a row to see a
# sawtooth above its threshold, and a CI run beside a CPU hog saw KV at 0.97, 29 waiting and
# 3.96 preemptions/s with none of the three held long enough to fire.
KV_RULES = ("VllmKvCacheSaturated", "VllmPreemptionRateHigh", "VllmWaitingQueueLong")


def _kv_rules_for_one_second(rules: str) -> str:
    out, name = [], ""
    for line in rules.splitlines(keepends=True):
        if line.lstrip().startswith("- name:"):
            name = line.split(":", 1)[1].strip()
        if name in KV_RULES and line.strip() == "for_seconds: 3":
            line = line.replace("for_seconds: 3", "for_seconds: 1")
        out.append(line)
    return "".join(out)


TIER_RULES = _kv_rules_for_one_second(
    DEMO_RULES
    + """
  - name: VllmWaitingQueueLong
    signal: requests_waiting
    op: ">"
    threshold: 10
    unit: count
    for_seconds: 3
    keep_firing_for_seconds: 2
    severity: warning
    cause: concurrency_overcommit
    summary: "{service}: {value} requests waiting (> {threshold})"
    runbook: "#waiting-queue-long"
"""
)
REPORT: dict[str, Any] = {}
BODIES: dict[str, str] = {}  # /metrics bodies the later tests compare (kept out of the report)


def _policy(relaunch_after: int) -> dict[str, Any]:
    return {
        "dry_run": False,
        "backend": "process",
        "cooldown_seconds": 5,
        # vLLM loads in 23-45 s on a quiet machine and several minutes on a busy one (the fixture
        # waits up to 240 s for /health): refused connections for that long are a start.
        "startup_grace_seconds": 300,
        # Short on purpose: the SIGTERM then reaches vLLM with streams in flight, and its own
        # --shutdown-timeout drain is what test 5 proves.
        "drain_timeout_seconds": 2,
        "ready_timeout_seconds": 180,
        # How long the executor waits for the process manager's own restart of a dead engine
        # (a new pid on the port) before restarting it itself: the new API server binds its
        # port ~15 s after the old one exits on this machine.
        "vram_release_timeout_seconds": 90,
        "backoff_initial_seconds": 5,
        "pressure_events_to_relaunch": relaunch_after,
        "pressure_window_seconds": 600,
        "early_failure_seconds": 0,
        "stable_for_seconds": 3600,
    }


def guardian_config(
    workdir: Path, command: list[str], vllm_port: int, guardian_port: int, relaunch_after: int
) -> Config:
    (workdir / "rules.yaml").write_text(TIER_RULES)
    text = json.dumps(
        {
            "interval_seconds": 0.5,
            "listen": f"127.0.0.1:{guardian_port}",
            "runtime_dir": str(workdir / "run"),
            "state_dir": str(workdir / "state"),
            "recorder": {"path": str(workdir / "state" / "flight.jsonl")},
            "services": [
                {
                    "name": "vllm",
                    "url": f"http://127.0.0.1:{vllm_port}",
                    "command": command,
                    "log_file": str(workdir / "vllm.log"),
                }
            ],
            "sources": {
                # A scrape of a server whose two cores are both busy takes 1-2 s here.
                "vllm_metrics": {"timeout_seconds": 8},
                "health": {"timeout_seconds": 8},
                "nvml": {"enabled": False},  # no GPU on this machine kind
                "unit": {"enabled": True},  # no unit: the main pid is the port's listener
                "logs": {"enabled": True},
                "allocator": {"directory": str(workdir / "allocator")},
            },
            "signals": {
                "rate_window_seconds": 10,
                "quantile_window_seconds": 20,
                "slope_window_seconds": 20,
                "stall_seconds": 8,
            },
            "alerting": {"rules_file": str(workdir / "rules.yaml")},
            "policy": _policy(relaunch_after),
        }
    )
    return parse_config(text, str(workdir / "config.yaml"))


@dataclass
class Guarded:
    """The module's guardian, its vLLM and what the tests read of them."""

    guardian: Guardian
    thread: threading.Thread
    workdir: Path
    url: str
    guardian_url: str
    run_id: str
    command: list[str]
    vllm_port: int
    guardian_port: int
    sigterm_times: list[float] = field(default_factory=list)

    @property
    def supervisor(self) -> Any:
        assert self.guardian.healing is not None
        return self.guardian.healing.supervisors["vllm"]

    def ticks_after(self, n: int, timeout: float, what: str) -> None:
        """Wait until the guardian has finished ``n`` more ticks (counted by its ``last``
        result changing): an absence ("no second restart") is checked over ticks the guardian
        actually ran, which a busy host slows, not over seconds of wall clock."""
        seen: list[object] = [self.guardian.last]

        def counted() -> bool:
            if self.guardian.last is not seen[-1]:
                seen.append(self.guardian.last)
            return len(seen) > n

        wait_for(counted, f"{n} guardian ticks ({what})", timeout, every_seconds=0.05)

    def ready_status(self) -> int | None:
        try:
            return support.session().get(self.guardian_url + "/ready/vllm", timeout=2).status_code
        except support.requests.RequestException:
            return None

    def audit(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(OSError), (self.workdir / "state" / "audit.jsonl").open() as fh:
            for line in fh:
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def log(self) -> str:
        return (self.workdir / "vllm.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    return support.vllm_venv_or_skip()


@pytest.fixture(scope="module")
def tiny_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    REPORT["model_build_seconds"] = round(support.build_model(vllm_venv, out), 1)
    return out


def test_tiny_model_is_byte_identical_when_rebuilt(
    vllm_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    support.build_model(vllm_venv, tmp_path / "again")
    first = json.loads((tiny_model / "MANIFEST.json").read_text())
    assert json.loads((tmp_path / "again" / "MANIFEST.json").read_text()) == first
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)


@pytest.fixture(scope="module")
def guarded(
    vllm_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guarded]:
    # One real server at a time on this host, even across concurrent pytest runs (~3 GB each).
    lock = support.host_lock()
    workdir = tmp_path_factory.mktemp("guarded")
    run_id = uuid.uuid4().hex
    vllm_port, guardian_port = free_port(), free_port()
    # The fault plugin armed for test 7's hang only: inert until its hang file exists.
    faults = {"VLLM_GUARDIAN_FAULT_HANG_FILE": str(_hang_file(workdir))}
    env = support.vllm_env(run_id, workdir, faults=faults)
    command = support.serve_command(vllm_venv, tiny_model, vllm_port, env, BASE_FLAGS)
    cfg = guardian_config(workdir, command, vllm_port, guardian_port, relaunch_after=100)
    guardian = Guardian(cfg)
    thread = threading.Thread(
        target=guardian.run, kwargs={"install_signals": False}, name="guardian", daemon=True
    )
    g = Guarded(
        guardian,
        thread,
        workdir,
        f"http://127.0.0.1:{vllm_port}",
        f"http://127.0.0.1:{guardian_port}",
        run_id,
        command,
        vllm_port,
        guardian_port,
    )
    start = time.monotonic()
    census = support.Census(run_id).start()
    thread.start()
    try:
        wait_for(
            lambda: support.healthy(g.url),
            "vLLM /health 200",
            240,
            every_seconds=support.POLL_SECONDS,
        )
        REPORT["first_start_seconds"] = round(time.monotonic() - start, 1)
        # The first tick that saw it up: the guardian's view is what the tests compare.
        wait_for(
            lambda: g.ready_status() == 200,
            "/ready/vllm 200",
            30,
            every_seconds=support.POLL_SECONDS,
        )
        yield g
    finally:
        guardian.request_stop()
        thread.join(timeout=90)
        swept = support.sweep(run_id, census)
        left = support.leftovers(run_id, census=census)
        census.stop()
        REPORT["module_seconds"] = round(time.monotonic() - start, 1)
        REPORT["swept_at_teardown"] = swept
        lock.close()
        _emit_report()
        assert not left, f"vLLM processes left behind: {left}"


def _emit_report() -> None:
    text = json.dumps(REPORT, indent=2, sort_keys=True, default=str)
    print("\nvllm tier report:\n" + text)
    path = os.environ.get("VLLM_GUARDIAN_TIER_REPORT")
    if path:
        Path(path).write_text(text + "\n")


def _family_shapes(text: str, prefix: str = "vllm:") -> dict[str, tuple[str, frozenset[str]]]:
    """family → (type, label keys) for the families whose name starts with ``prefix``."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(prefix):
            continue
        keys = {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        out[fam.name] = (fam.type, frozenset(keys))
    return out


def _sum(text: str, name: str, **match: str) -> float | None:
    total = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                total = (total or 0.0) + s.value
    return total


# --- 0. the server the tier starts serves its first request --------------------------------


def test_a_short_first_request_is_served_by_a_fresh_server(guarded: Guarded) -> None:
    """The first request a fresh server gets is a 3-token prompt, as the relaunch test's client
    sends. On a CPU with AMX, vLLM 0.32's bf16 attention kernel runs AMX tile instructions
    without asking Linux for them; unless a large enough matmul (oneDNN asks) ran first in that
    process, the worker died of SIGILL ("Worker proc VllmWorker-0 died unexpectedly (exit code:
    -4)"), every time, and the guardian rightly restarted it. The tier's vLLMs ask at start
    (tests/vllm_tier/amx/sitecustomize.py); this is the request that killed them before."""
    r = support.session().post(
        guarded.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": [17, 18, 19], "max_tokens": 4},
        timeout=120,
    )
    died = [line for line in guarded.log().splitlines() if "died unexpectedly" in line]
    assert r.status_code == 200 and not died, (r.status_code, r.text[:300], died)


def test_vllms_ipc_sockets_are_in_the_tests_directory(guarded: Guarded) -> None:
    """vLLM's ZMQ IPC sockets (API server to engine core) go where VLLM_RPC_BASE_PATH says:
    the test's directory (support.rpc_dir), not the host's temporary directory, where every
    vLLM the tier killed left its own."""
    given = [a for a in guarded.command if a.startswith("VLLM_RPC_BASE_PATH=")]
    assert len(given) == 1, guarded.command
    rpc = Path(given[0].split("=", 1)[1])
    assert rpc.is_relative_to(guarded.workdir), rpc
    sockets = [p for p in rpc.iterdir() if p.is_socket()]
    assert sockets, sorted(p.name for p in rpc.iterdir())
    assert all(len(str(p)) <= support.SOCKET_PATH_MAX for p in sockets), sockets


# --- 1. the source reads what the server says ----------------------------------------------


def test_source_reads_every_value_the_server_reports(guarded: Guarded) -> None:
    results = support.burst(guarded.url, 4, 64, 48)
    assert all(r.status == 200 and r.finish_reason == "length" for r in results), results
    s = support.session()
    # One body, two readers: the guardian's parser and prometheus_client's reference parser.
    body = s.get(guarded.url + "/metrics", timeout=10).text
    BODIES["real"] = body
    scrape = parse_vllm_metrics(body)
    assert scrape.stats_enabled and scrape.malformed_lines == 0 and scrape.rejected_values == 0
    assert len(scrape.engines) == 1
    e = scrape.engines[0]
    assert (e.model_name, e.engine) == (MODEL_NAME, "0")
    expected = {
        "requests_running": _sum(body, "vllm:num_requests_running"),
        "requests_waiting": _sum(body, "vllm:num_requests_waiting"),
        "kv_cache_usage_ratio": _sum(body, "vllm:kv_cache_usage_perc"),
        "preemptions_total": _sum(body, "vllm:num_preemptions_total"),
        "prompt_tokens_total": _sum(body, "vllm:prompt_tokens_total"),
        "generation_tokens_total": _sum(body, "vllm:generation_tokens_total"),
        "prefix_cache_queries_total": _sum(body, "vllm:prefix_cache_queries_total"),
        "prefix_cache_hits_total": _sum(body, "vllm:prefix_cache_hits_total"),
        "requests_finished_total": _sum(body, "vllm:request_success_total"),
        "requests_failed_total": (
            _sum(body, "vllm:request_success_total", finished_reason="abort") or 0
        )
        + (_sum(body, "vllm:request_success_total", finished_reason="error") or 0),
    }
    for name, want in expected.items():
        assert want is not None, f"the real server does not export what {name} reads"
        assert getattr(e, name) == want, (name, getattr(e, name), want)
    assert e.prompt_tokens_total and e.prompt_tokens_total >= 4 * 64
    assert e.requests_finished_total and e.requests_finished_total >= 4
    for hname, family in (
        ("time_to_first_token", "vllm:time_to_first_token_seconds"),
        ("e2e_request_latency", "vllm:e2e_request_latency_seconds"),
        ("request_queue_time", "vllm:request_queue_time_seconds"),
    ):
        h = getattr(e, hname)
        assert h is not None, hname
        assert h.count == _sum(body, family + "_count") and h.sum == _sum(body, family + "_sum")
        assert h.buckets[-1] == (math.inf, h.count)
    assert e.cache_config is not None
    assert (e.cache_config.num_gpu_blocks, e.cache_config.block_size) == (32, 128)
    assert scrape.process_start_time_seconds == _sum(body, "process_start_time_seconds")
    # Every name the parser wants that this vLLM exports is one it read; what is missing is
    # only the fallbacks for other vLLM versions.
    exported = {s.name for f in text_string_to_metric_families(body) for s in f.samples}
    missing = sorted(n for n in WANTED if n not in exported)
    REPORT["wanted_not_exported_by_0.32"] = missing
    assert all(
        n
        in {
            "vllm:num_requests_swapped",
            "vllm:gpu_cache_usage_perc",
            "vllm:gpu_prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_hit_rate",
        }
        for n in missing
    ), missing

    # The daemon's own tick at the same moment: the server is idle, so the counters hold still
    # and the guardian's last snapshot must equal a scrape taken now, value for value.
    tick_after = time.time()
    wait_for(
        lambda: (
            guarded.guardian.last is not None
            and guarded.guardian.last.snapshot.time_seconds > tick_after + 0.5
        ),
        "a fresh tick",
        20,
        every_seconds=support.POLL_SECONDS,
    )
    body2 = s.get(guarded.url + "/metrics", timeout=10).text
    last = guarded.guardian.last
    assert last is not None
    svc = last.snapshot.service("vllm")
    assert svc is not None and svc.vllm is not None
    live = svc.vllm.engines[0]
    now = parse_vllm_metrics(body2).engines[0]
    for name in (*expected, "time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert getattr(live, name) == getattr(now, name), name
    sig = last.signals.service("vllm")
    assert sig is not None and sig.vllm_up and sig.kv_cache_capacity_tokens == 32 * 128


# --- 2. the allocator plugin inside vLLM -----------------------------------------------------


def test_allocator_plugin_loaded_in_every_vllm_process_and_idle(
    guarded: Guarded, vllm_venv: Path
) -> None:
    pid = guarded.supervisor.pid
    assert pid is not None
    engine = [p for p, cmd in support.children(pid) if cmd.startswith("VLLM::EngineCore")]
    assert len(engine) == 1
    worker = [p for p, cmd in support.children(engine[0]) if cmd.startswith("VLLM::Worker")]
    assert len(worker) == 1
    log = guarded.log()
    loaded = {
        int(line.split("loaded in pid ")[1].split(":")[0])
        for line in log.splitlines()
        if "vllm-guardian allocator plugin loaded in pid" in line
    }
    idle = {
        int(line.split("no CUDA in pid ")[1].split(":")[0])
        for line in log.splitlines()
        if "vllm-guardian allocator plugin: torch has no CUDA in pid" in line
    }
    REPORT["plugin"] = {
        "pids": {"api_server": pid, "engine_core": engine[0], "worker": worker[0]},
        "loaded_line_in": sorted(loaded),
        "idle_line_in": sorted(idle),
    }
    # vLLM's loader ran the entry point in EngineCore and the Worker (the processes that own
    # CUDA on a GPU host), each says so once, and without CUDA each stays idle.
    assert {engine[0], worker[0]} <= loaded, REPORT["plugin"]
    assert {engine[0], worker[0]} <= idle, REPORT["plugin"]
    assert sum(1 for line in log.splitlines() if "plugin loaded in pid" in line) == len(loaded)
    # The API server runs it too, but while building its CLI parser, before vLLM 0.32 applies
    # any logging configuration, so its INFO line goes nowhere (docs/vllm-tier.md). Proof there:
    # vLLM's own loader, in the vLLM venv, finds the entry point and running it logs the line.
    probe = subprocess.run(
        [
            str(vllm_venv / "bin" / "python"),
            "-c",
            "import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
            "from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group\n"
            "found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)\n"
            "print('found', sorted(found))\n"
            "found['vllm_guardian']()\n",
        ],
        env={
            **os.environ,
            "VLLM_GUARDIAN_ALLOCATOR_DIR": str(guarded.workdir / "allocator"),
            support.MARKER: guarded.run_id,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "'vllm_guardian'" in probe.stdout and "plugin loaded in pid" in probe.stdout, probe
    assert "allocator plugin: not started" not in log  # it raised nothing into vLLM
    alloc = guarded.workdir / "allocator"
    # Idle: not one file written (the guardian's process backend creates the service's
    # directory, <directory>/<service>, before it starts vLLM: a directory is not a write).
    written = [p for p in alloc.rglob("*") if not p.is_dir()] if alloc.exists() else []
    assert written == []
    last = guarded.guardian.last
    assert last is not None
    svc = last.snapshot.service("vllm")
    # The guardian's allocator source reads the directory and finds no process publishing.
    assert svc is not None and (svc.allocator is None or not svc.allocator.processes)


# --- 2b. a client's text in vLLM's log --------------------------------------------------------

# Failure signatures as a client can send them. vLLM 0.32 logs an unknown `model` at ERROR
# ("Error with model ..."): the first made an armed guardian relaunch with
# --max-num-batched-tokens halved, the second latch its breaker.
HOSTILE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.02 GiB is free.",
    "RuntimeError: CUDA error: GPU has fallen off the bus",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python3, GPU has fallen off the bus.",
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "EngineCore encountered a fatal error.",
    "ValueError: No available memory for the cache blocks.",
    "Available KV cache memory: 0.01 GiB",
)
# The engine core's header, which a request spells out after a newline, a line separator or a
# NUL byte, hoping to start a line of its own.
FAKE_HEADER = "(EngineCore_DP0 pid=1) ERROR 11-22 00:07:30 [core.py:1007] "


def _hostile_requests(url: str) -> list[tuple[str, int | str]]:
    """Every way a client puts text in vLLM's log: (what, status)."""
    s = support.session()
    out: list[tuple[str, int | str]] = []

    def post(what: str, path: str, body: dict[str, Any], **headers: str) -> None:
        try:
            r = s.post(url + path, json=body, headers=headers, timeout=60)
            out.append((what, r.status_code))
        except support.requests.RequestException as e:
            out.append((what, type(e).__name__))

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    models = [*HOSTILE, *(lead + FAKE_HEADER + HOSTILE[0] for lead in ("", "\n", "\u2028", "\x00"))]
    for i, m in enumerate(models):
        post(f"model {i} (chat)", "/v1/chat/completions", {**chat, "model": m})
    post("model (completions)", "/v1/completions", {"model": HOSTILE[0], "prompt": "x"})
    post("model (responses)", "/v1/responses", {"model": HOSTILE[1], "input": "x"})
    text = "\n".join(FAKE_HEADER + h for h in HOSTILE)
    post("prompt (chat)", "/v1/chat/completions",
         {**chat, "model": MODEL_NAME, "messages": [{"role": "user", "content": text}]})  # fmt: skip
    post("prompt (completions)", "/v1/completions",
         {"model": MODEL_NAME, "prompt": text, "max_tokens": 2})  # fmt: skip
    headers = {
        "X-Request-Id": HOSTILE[0],
        "User-Agent": HOSTILE[1],
        "X-Debug": FAKE_HEADER + HOSTILE[0],
    }
    post("headers", "/v1/chat/completions", {**chat, "model": MODEL_NAME}, **headers)
    post("headers and model", "/v1/chat/completions", {**chat, "model": HOSTILE[0]}, **headers)
    return out


def test_hostile_request_text_is_not_evidence(guarded: Guarded) -> None:
    """Requests whose `model`, prompt and headers carry an OOM, a lost GPU, an engine death and
    fake engine headers, against the real server and the armed guardian: vLLM logs them at
    ERROR; the guardian reads those lines and counts nothing, decides nothing, names no cause,
    and vLLM stays up, never restarted."""
    healing = guarded.guardian.healing
    assert healing is not None
    wait_for(
        lambda: support.healthy(guarded.url) and healing.state.service("vllm").action is None,
        "vLLM up and no action under way",
        240,
        every_seconds=1.0,
    )
    sup = guarded.supervisor
    starts, pid = sup.starts, sup.pid
    audit_before = len(guarded.audit())
    log_path = guarded.workdir / "vllm.log"
    offset = log_path.stat().st_size

    def reading() -> Any:
        last = guarded.guardian.last
        svc = last.snapshot.service("vllm") if last is not None else None
        return svc.logs if svc is not None else None

    wait_for(
        lambda: reading() is not None,
        "the guardian's logs source",
        30,
        every_seconds=support.POLL_SECONDS,
    )
    before = reading()
    sent = _hostile_requests(guarded.url)
    # The chat handler logs every unknown model ("Error with model ..."): one line each.
    chat_models = sum(1 for w, _ in sent if w.startswith("model") and w.endswith("(chat)"))

    def logged() -> list[str]:
        with log_path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace").split("\n")

    # Every hostile model is in vLLM's log at ERROR before the guardian is looked at; then ten
    # more ticks, each after the log file's reader (every 0.25 s) has handed over what it read.
    wait_for(
        lambda: sum(1 for line in logged() if "Error with model" in line) >= chat_models,
        "vLLM to log the requests' models",
        60,
        every_seconds=support.POLL_SECONDS,
    )
    guarded.ticks_after(10, 120, "the hostile lines read")
    lines = logged()
    at_error = [
        line for line in lines if " ERROR " in line and any(h[:30] in line for h in HOSTILE)
    ]
    after = reading()
    assert after is not None and before is not None
    decisions = guarded.audit()[audit_before:]
    log_rules = {r.name for r in healing.rules if r.signal.startswith("log_events.")}
    firing = sorted(
        a.name
        for a in healing.view().alerts
        if a.state is AlertState.FIRING and a.name in log_rules
    )
    state = healing.state.service("vllm")
    REPORT["hostile_requests"] = {
        "sent": sent,
        "vllm_error_lines_with_hostile_text": len(at_error),
        "example": [line[:200] for line in at_error[:2]],
        "guardian_lines_read": after.lines_total - before.lines_total,
        "guardian_events": {k.value: n for k, n in after.counts if n != dict(before.counts)[k]},
        "decisions": [(d["what"], d.get("cause"), d["reason"][:120]) for d in decisions],
        "log_alerts_firing": firing,
        "starts_added": sup.starts - starts,
    }
    print("\nhostile requests:", json.dumps(REPORT["hostile_requests"], indent=1))

    # vLLM refused every unknown model and served the rest: the attack reached its log at ERROR.
    assert all(code in (400, 404) for w, code in sent if w.startswith("model")), sent
    assert all(code == 200 for w, code in sent if w in ("prompt (chat)", "headers")), sent
    assert len(at_error) >= chat_models, lines[-20:]
    # The guardian read those lines and made nothing of them.
    assert after.lines_total - before.lines_total >= len(at_error)
    assert dict(after.counts) == dict(before.counts), REPORT["hostile_requests"]
    assert not firing
    assert [d for d in decisions if d.get("cause") or d["what"] in ("action", "latch")] == []
    assert not state.breaker_latched and state.action is None
    assert support.healthy(guarded.url) and sup.starts == starts and sup.pid == pid


# --- 3. KV pressure: seen, alerted, gated, ungated -------------------------------------------


@dataclass
class GuardianWatch:
    """What the guardian saw and published, every 0.25 s, while a test ran."""

    g: Guarded
    rows: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.is_set():
            last = self.g.guardian.last
            row: dict[str, Any] = {
                "t": time.monotonic(),
                # The last tick published before /ready was asked (the audit's clock), and when
                # the answer came: to place an answer inside a gated interval without a race.
                "tick": last.snapshot.time_seconds if last is not None else None,
                "ready": self.g.ready_status(),
                "answered_wall": time.time(),
            }
            if last is not None:
                sig = last.signals.service("vllm")
                svc = last.snapshot.service("vllm")
                eng = svc.vllm.engines[0] if svc and svc.vllm and svc.vllm.engines else None
                if sig is not None:
                    row.update(
                        kv=sig.kv_cache_usage_ratio,
                        waiting=sig.requests_waiting,
                        running=sig.requests_running,
                        preempt_rate=sig.preemptions_per_second,
                    )
                if eng is not None:
                    row["preemptions_total"] = eng.preemptions_total
            assert self.g.guardian.healing is not None
            row["firing"] = sorted(
                a.name
                for a in self.g.guardian.healing.view().alerts
                if a.state is AlertState.FIRING
            )
            self.rows.append(row)
            self._stop.wait(0.25)

    @contextlib.contextmanager
    def running(self) -> Iterator[GuardianWatch]:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join(timeout=10)

    def max(self, key: str) -> float:
        return max((r[key] for r in self.rows if r.get(key) is not None), default=0.0)

    def fired(self) -> set[str]:
        return {n for r in self.rows for n in r["firing"]}

    def flips(self) -> int:
        states = [r["ready"] for r in self.rows if r["ready"] is not None]
        return sum(1 for a, b in itertools.pairwise(states) if a != b)


def _pressure_numbers(
    sampler: Sampler, results: list[StreamResult], seconds: float
) -> dict[str, Any]:
    pre = sampler.series("vllm:num_preemptions_total")
    kv = sampler.series("vllm:kv_cache_usage_perc")
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r.status == 200 and r.finish_reason == "length"),
        "seconds": round(seconds, 1),
        "kv_usage_max": round(max(kv, default=0.0), 3),
        "kv_usage_ge_0.9_share": round(sum(1 for v in kv if v >= 0.9) / max(1, len(kv)), 2),
        "waiting_max": max(sampler.series("vllm:num_requests_waiting"), default=0.0),
        "running_max": max(sampler.series("vllm:num_requests_running"), default=0.0),
        "preemptions": (pre[-1] - pre[0]) if pre else None,
        "scrapes": len(sampler.samples),
        "kv_series": [round(v, 2) for v in kv],
    }


def test_kv_pressure_is_seen_alerted_gated_and_ungated(guarded: Guarded) -> None:
    audit_before = len(guarded.audit())
    watch = GuardianWatch(guarded)
    sampler = Sampler(guarded.url)
    unsaturated: list[dict[str, Any]] = []
    with watch.running(), sampler.running():
        while True:
            t0 = time.monotonic()
            results = support.burst(guarded.url, **BURST)
            seconds = time.monotonic() - t0
            # After the burst: the gate opens again below the low watermark and stays open.
            wait_for(
                lambda: guarded.ready_status() == 200,
                "/ready/vllm 200 again",
                30,
                every_seconds=support.POLL_SECONDS,
            )
            time.sleep(3)
            gated = any(d["what"] == "gate" for d in guarded.audit()[audit_before:])
            if (gated and set(KV_RULES) & watch.fired()) or len(unsaturated) >= 2:
                break
            # The burst never held the pool full long enough for the guardian's ticks: beside
            # a CPU hog the API server handed vLLM 3 requests at a time and its KV gauge read
            # 0.9 in 1 of 11 scrapes (a CI run, 2026-11-26: the guardian's peak 0.87, no gate); with
            # other work beside, a gate but no KV alert held for its `for`. That measures the
            # host, not the guardian: the burst runs again (35 s), every run reported.
            unsaturated.append(_pressure_numbers(sampler, results, seconds))
    real = _pressure_numbers(sampler, results, seconds)
    real["unsaturated_bursts"] = unsaturated
    decisions = guarded.audit()[audit_before:]
    gates = [d for d in decisions if d["what"] in ("gate", "ungate")]
    real.update(
        guardian_kv_max=watch.max("kv"),
        guardian_waiting_max=watch.max("waiting"),
        guardian_preempt_rate_max=round(watch.max("preempt_rate"), 2),
        alerts_fired=sorted(watch.fired()),
        ready_503_share=round(
            sum(1 for r in watch.rows if r["ready"] == 503) / max(1, len(watch.rows)), 2
        ),
        ready_flips=watch.flips(),
        gate_decisions=[f"{d['what']}: {d['reason']}" for d in gates],
    )
    REPORT["real_pressure"] = real
    print("\nreal vLLM under the KV-pressure burst:", json.dumps(real, indent=1))

    assert real["ok"] == BURST["n"], results  # KV pressure never fails a request: it queues
    # What the guardian saw at its peak: its watch samples the last tick every 0.25 s and can
    # miss a short peak on a busy host; the gate decision quotes the tick that saw it.
    quoted = [
        float(m.group(1)) / 100
        for d in gates
        if (m := re.search(r"KV cache usage (\d+)%", d["reason"])) is not None
    ]
    real["gate_quoted_kv_max"] = max(quoted, default=0.0)
    assert max([watch.max("kv"), *quoted]) >= 0.9, real
    # Requests wait: how deep the queue gets depends on how fast the API server hands the 36
    # requests to the engine (22-33 in most runs; 3 in one CI run with the same 16 s burst,
    # the same KV peak and 40 preemptions), so the claim is that a queue forms, not its depth.
    assert watch.max("waiting") >= 1, real
    assert real["preemptions"] and real["preemptions"] > 0
    # The KV alerts: on a real server the KV gauge and the preemption rate are sawtooths (see
    # TIER_RULES) and a busy 2-core machine slows the ticks, so which of them hold for their
    # `for` varies run to run (measured: one to all three); at least one fires every time.
    kv_alerts = set(KV_RULES)
    # An alert fires when the pressure holds for its `for`: required where vLLM's own gauge held
    # the pool full in at least 30 % of its scrapes. Beside a CPU hog three bursts in a row read
    # 0.9 in 10 %, 0 % and none (a CI run, 2026-11-26: gated, no alert): reported then.
    sustained = real["kv_usage_ge_0.9_share"] >= 0.3
    real["kv_pressure_sustained"] = sustained
    assert kv_alerts & watch.fired() or not sustained, real
    assert gates and gates[0]["what"] == "gate" and not gates[0].get("dry_run")
    assert gates[-1]["what"] == "ungate"
    # /ready said 503 while the guardian's audit says it gated: every answer to a question
    # asked after the gating tick had published (the guardian sets /ready before it publishes
    # the tick) and answered before the ungating tick began (it sets /ready after). The
    # decision's time is its tick's start and /ready follows at the tick's end: beside a CPU
    # hog a tick took seconds and two answers after the decision's time said 200 (2026-11-27),
    # so the audit's times alone are no bound. A span with no such answer (the guardian
    # starved; a CI run beside a hog, 2026-11-27) is reported.
    spans = [
        (a["time_seconds"], b["time_seconds"])
        for a, b in itertools.pairwise(gates)
        if a["what"] == "gate" and b["what"] == "ungate"
    ]
    for gated_from, gated_to in spans:
        inside = [
            r["ready"]
            for r in watch.rows
            if r["tick"] is not None and r["tick"] >= gated_from and r["answered_wall"] < gated_to
        ]
        answered = [x for x in inside if x is not None]
        real.setdefault("ready_inside_gate", []).append(
            {"rows": len(inside), "answered": answered[:40]}
        )
        assert all(x == 503 for x in answered), real
    assert all(r["ready"] == 200 for r in watch.rows[-8:])  # open after the burst
    # The gate is the lever for KV pressure: nothing was restarted.
    assert not [d for d in decisions if d["what"] == "action"]
    assert guarded.supervisor.starts == 1


# --- 4. the twin beside the real server ------------------------------------------------------


def test_twin_matches_the_real_server_side_by_side(guarded: Guarded, tiny_model: Path) -> None:
    real_body = BODIES.get("real")
    real = REPORT.get("real_pressure")
    if real_body is None or real is None:
        pytest.fail("needs the real server's numbers from the tests above")
    port = free_port()
    # The twin sized like the real server: the tiny model's own config.json (512 B of KV per
    # token) and a 2 MiB pool = 4,096 tokens = 32 blocks of 128, the same max-model-len.
    # At --sim-speed 5 its burst lasts about as long as the real server's (17 s against 16 s),
    # so the sampler sees both on one time scale; at speed 1 its simulated load and steps took
    # 24 s + 87 s of wall clock with the same numbers (42 preemptions, KV 1.0, 33 waiting).
    twin_cmd = [
        sys.executable, "-m", "vllm_guardian.sim", "serve", str(tiny_model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--sim-model", str(tiny_model / "config.json"), "--block-size", "128",
        "--kv-cache-memory-bytes", str(32 * 128 * 512), "--max-model-len", "2048",
        "--max-num-seqs", "32", "--shutdown-timeout", "30", "--sim-speed", str(TWIN_SPEED),
    ]  # fmt: skip
    env = {**os.environ, support.MARKER: guarded.run_id}
    log = (guarded.workdir / "twin.log").open("wb")
    proc = subprocess.Popen(
        twin_cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: support.healthy(url),
            "the twin's /health",
            60,
            every_seconds=support.POLL_SECONDS,
        )
        support.burst(url, 4, 64, 48)  # the same warm-up as test 1, so histograms have data
        twin_body = support.session().get(url + "/metrics", timeout=10).text
        sampler = Sampler(url)
        with sampler.running():
            t0 = time.monotonic()
            results = support.burst(url, **BURST)
            seconds = time.monotonic() - t0
        twin = _pressure_numbers(sampler, results, seconds)
    finally:
        support.stop_group(proc, 40)
        log.close()
    REPORT["twin_pressure"] = twin
    print("\ntwin under the same burst:", json.dumps(twin, indent=1))

    real_shapes, twin_shapes = _family_shapes(real_body), _family_shapes(twin_body)
    only_real = sorted(set(real_shapes) - set(twin_shapes))
    only_twin = sorted(set(twin_shapes) - set(real_shapes))
    differ = sorted(
        f"{n}: real {real_shapes[n]} twin {twin_shapes[n]}"
        for n in set(real_shapes) & set(twin_shapes)
        if real_shapes[n] != twin_shapes[n]
    )
    REPORT["families"] = {
        "real": len(real_shapes),
        "twin": len(twin_shapes),
        "only_real": only_real,
        "only_twin": only_twin,
        "differ": differ,
    }
    assert not only_real and not only_twin and not differ, REPORT["families"]
    # The same qualitative behaviour: every request served, the pool saturates, requests wait,
    # running ones are preempted.
    # The real server's peaks are read from both of its observers, the test's sampler and the
    # guardian's ticks (and the KV its gate decision quoted): the KV gauge is a sawtooth and one observer's scrapes can miss its top
    # when /metrics answers late (a soak beside a hog: the sampler's peak 0.645 while vLLM's
    # own log said 96.8 % and the guardian saw >= 0.9).
    real = {
        **real,
        "kv_usage_max": max(
            real["kv_usage_max"],
            real.get("guardian_kv_max") or 0.0,
            real.get("gate_quoted_kv_max") or 0.0,
        ),
        "waiting_max": max(real["waiting_max"], real.get("guardian_waiting_max") or 0.0),
    }
    for name, numbers in (("real", real), ("twin", twin)):
        assert numbers["ok"] == numbers["requests"], (name, numbers)
        assert numbers["kv_usage_max"] >= 0.9, (name, numbers)
        assert numbers["waiting_max"] >= 1, (name, numbers)  # see test 3 on the queue's depth
        assert numbers["preemptions"] and numbers["preemptions"] > 0, (name, numbers)


# --- 5. a guardian-initiated restart with streams in flight ----------------------------------


@dataclass
class GateHonouringClient:
    """Sends a short request only while /ready/vllm says 200; holds otherwise (a load balancer)."""

    g: Guarded
    sent: list[tuple[float, int | str]] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        s = support.session()
        while not self._stop.is_set():
            if self.g.ready_status() != 200:
                self.held.append(time.monotonic())
            else:
                t = time.monotonic()
                try:
                    r = s.post(
                        self.g.url + "/v1/completions",
                        json={"model": MODEL_NAME, "prompt": [17, 18, 19], "max_tokens": 4},
                        timeout=60,
                    )
                    self.sent.append((t, r.status_code))
                except support.requests.RequestException as e:
                    self.sent.append((t, type(e).__name__))
            self._stop.wait(0.25)

    @contextlib.contextmanager
    def running(self) -> Iterator[GateHonouringClient]:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join(timeout=70)


def test_operator_relaunch_drains_in_flight_streams_and_holds_new_work(guarded: Guarded) -> None:
    """`vllm-guardian relaunch vllm --set max_num_seqs=N`, triggered deterministically while
    streams are in flight and a client (honouring /ready like the gate and a load balancer do)
    keeps sending: the guardian's phases close the front door, drain, SIGTERM, start with the
    new flag, wait for ready and open. Zero failed requests; every stream complete."""
    healing = guarded.guardian.healing
    assert healing is not None
    sup = guarded.supervisor
    wait_for(
        lambda: support.healthy(guarded.url) and healing.state.service("vllm").action is None,
        "vLLM up and no action under way",
        240,
        every_seconds=1.0,
    )
    starts, old_pid = sup.starts, sup.pid
    original = sup.restart

    def timed_restart(
        timeout_seconds: float | None = None, drain: bool = True
    ) -> tuple[bool, bool, str]:
        guarded.sigterm_times.append(time.monotonic())
        return original(timeout_seconds, drain=drain)  # type: ignore[no-any-return]

    sup.restart = timed_restart
    audit_before = len(guarded.audit())
    client = GateHonouringClient(guarded)
    streams: list[StreamResult] = []
    firsts = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        streams.append(
            support.stream_completion(
                guarded.url, support.prompt_ids(64, 3000 + i), 600, first_token=firsts[i]
            )
        )

    try:
        with client.running():
            streamers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
            for t in streamers:
                t.start()
            # All four streams are in flight (each got its first token, as the client sees it;
            # the guardian's scrape can time out meanwhile on a busy host) before the command.
            # Any one would not do: a starved client started three of them 1.45 s after the
            # first, one had no token yet when the drain began (these streams go straight to
            # vLLM, past /ready), and it was cut at the SIGTERM (CI rehearsal beside a hog).
            for e in firsts:
                assert e.wait(120), "not every stream got a first token within 120 s"
            reply = healing.control(
                "relaunch", "vllm", sets=[("--max-num-seqs", "24")], who="the vllm tier"
            )
            assert reply["ok"], reply
            wait_for(
                lambda: any(
                    d["what"] in ("result", "latch") and d.get("action_id") == reply["action_id"]
                    for d in guarded.audit()[audit_before:]
                ),
                "the relaunch's result",
                240,
                every_seconds=1.0,
            )
            for t in streamers:
                t.join(timeout=240)
            wait_for(
                lambda: guarded.ready_status() == 200,
                "/ready/vllm 200",
                120,  # generous: a bound on a busy host, not a timing (it is 200 at once here)
                every_seconds=support.POLL_SECONDS,
            )
            wait_for(
                lambda: any(
                    guarded.sigterm_times and t > guarded.sigterm_times[0] and c == 200
                    for t, c in client.sent
                ),
                "the honouring client served by the new instance",
                180,
                every_seconds=support.POLL_SECONDS,
            )
    finally:
        sup.restart = original
    decisions = guarded.audit()[audit_before:]
    sigterm = guarded.sigterm_times[0] if guarded.sigterm_times else None
    new_pid = sup.pid
    REPORT["drain_restart"] = {
        "trigger": "vllm-guardian relaunch --set max_num_seqs=24 (the control command)",
        "phases": [d.get("phase") for d in decisions if d["what"] == "phase"],
        "result": [d["reason"] for d in decisions if d["what"] in ("result", "latch")],
        "streams": len(streams),
        "streams_ended_after_sigterm": sum(1 for r in streams if sigterm and r.ended > sigterm),
        "completed": sum(
            1 for r in streams if r.status == 200 and r.done and r.finish_reason == "length"
        ),
        "honouring_client_sent": len(client.sent),
        "honouring_client_failed": [x for x in client.sent if x[1] != 200],
        "honouring_client_held_polls": len(client.held),
        "new_cmdline_tail": support.cmdline(new_pid)[-2:] if new_pid else None,
    }
    print("\noperator relaunch:", json.dumps(REPORT["drain_restart"], indent=1))
    assert any("relaunch succeeded" in r for r in REPORT["drain_restart"]["result"]), decisions
    assert sup.starts == starts + 1 and new_pid not in (None, old_pid)
    # Zero lost: every stream ended normally; the client never saw an error.
    bad = [r for r in streams if not (r.status == 200 and r.done and r.finish_reason == "length")]
    assert len(streams) == 4 and not bad, bad
    assert not REPORT["drain_restart"]["honouring_client_failed"], client.sent
    assert REPORT["drain_restart"]["honouring_client_held_polls"] > 0  # it really waited
    assert (support.cmdline(new_pid) if new_pid else [])[-2:] == ["--max-num-seqs", "24"]


GATED_TOKENS = 600  # the greedy stream through the gate: about 5 of the 32 blocks
UNCUT: dict[str, support.TextStream] = {}  # the greedy stream's uncut run, sent straight to vLLM


# --- 6. engine death -----------------------------------------------------------------------


@pytest.fixture
def gate(guarded: Guarded) -> Iterator[GateProcess]:
    """The deployed gate (``vllm-guardian gate -c``), its defaults but for the wait, which
    spans a restart here."""
    g = GateProcess(guarded.workdir, guarded.vllm_port, guarded.guardian_port, max_wait_seconds=300)
    yield g
    g.stop()


# An OpenAI SDK client's requests through the gate when the engine dies: (stream, seed, tokens).
# 1,900 tokens: the engine had generated all of 600 before the client read its first (a run of
# 2026-11-26), and then nothing is cut.
SDK_IN_FLIGHT = [(True, 3101, 1900), (True, 3102, 1900), (False, 3103, 1900)]


def _sdk_wave() -> list[dict[str, Any]]:
    return [request(st, support.prompt_ids(32, seed), n) for st, seed, n in SDK_IN_FLIGHT]


def test_engine_death_is_named_and_restarted_once(
    guarded: Guarded, gate: GateProcess, vllm_venv: Path
) -> None:
    sup = guarded.supervisor
    healing = guarded.guardian.healing
    assert healing is not None
    # Whatever test 5 left running (an action, a restart) ends first; then its cooldown (5 s).
    wait_for(
        lambda: (
            support.healthy(guarded.url) and healing.view().state.service("vllm").in_flight is None
        ),
        "vLLM up and no action in flight",
        240,
        every_seconds=1.0,
    )
    time.sleep(6)
    starts, exits = sup.starts, len(sup.exits)
    pid = sup.pid
    assert pid is not None
    audit_before = len(guarded.audit())
    engine = [p for p, cmd in support.children(pid) if cmd.startswith("VLLM::EngineCore")]
    assert len(engine) == 1
    # One greedy stream goes through a gate; its uncut text first, straight from vLLM.
    greedy = {
        "model": MODEL_NAME, "prompt": support.prompt_ids(16, 3000), "max_tokens": GATED_TOKENS,
        "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    uncut = support.TextStream()
    support.stream_text(guarded.url, greedy, uncut)
    assert uncut.done and uncut.events > 0 and not uncut.errors, uncut
    UNCUT["greedy"] = uncut  # test 7's reference too (greedy: the same on any engine)
    # Streams in flight when the engine dies, as in production: each gets an error event.
    streams: list[StreamResult] = []
    streaming = threading.Event()
    t = threading.Thread(
        target=lambda: streams.extend(
            support.burst(guarded.url, 4, 32, 1900, seed=2000, first_token=streaming)
        ),
        daemon=True,
    )
    t.start()
    # The streams reach the engine before the kill: a first token arrived, as the client sees
    # it (the guardian's scrape of /metrics can time out meanwhile: seen beside a CPU hog).
    # Whether one is still running when the engine dies depends on the machine's pace:
    # reported below, not required.
    assert streaming.wait(120), "no stream got a first token within 120 s"
    # The engine dies when an OpenAI SDK client's two streams (1,900 tokens each) have their
    # first text, its unary request in flight, and the gated stream sent with them: the reader
    # of the SDK client's events kills it. (Killed at the gated stream's tenth event, the
    # engine had generated all of them, 600 and 1,900 tokens: the client reads far behind it.)
    kills: list[float] = []

    def kill_engine() -> None:
        kills.append(time.monotonic())
        os.kill(engine[0], signal.SIGKILL)

    sdk = SdkClient(vllm_venv, gate.url + "/v1", [[], _sdk_wave()], on_text=({0, 1}, kill_engine))
    gated = support.TextStream()
    gated_thread = threading.Thread(
        target=support.stream_text, args=(gate.url, greedy, gated), daemon=True
    )
    gated_thread.start()
    sdk.next_wave()  # the SDK imported and the gated stream sent: its requests now
    wait_for(lambda: bool(kills), "the SDK client's first text", 120, every_seconds=0.05)
    killed_at = kills[0]
    gated_at_kill = gated.events
    sdk_in_flight_at_kill = len(SDK_IN_FLIGHT) - len(sdk.done)  # as the client saw it
    # /health until it says 503 or the API server is gone (it exits 0 some seconds after the
    # death). Each call may wait 5 s: beside a CPU hog the shutting-down server answered none
    # within 2 s and exited 10 s after the kill (a CI run, 2026-11-26), so no 503 was read.
    statuses: list[int | None] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and 503 not in statuses and len(sup.exits) <= exits:
        try:
            statuses.append(support.session().get(guarded.url + "/health", timeout=5).status_code)
        except support.requests.RequestException:
            statuses.append(None)
        time.sleep(0.1)
    t.join(timeout=60)
    wait_for(
        lambda: len(sup.exits) > exits,
        "the old API server to exit",
        30,
        every_seconds=support.POLL_SECONDS,
    )
    exited_after = time.monotonic() - killed_at
    wait_for(
        lambda: any(
            d["what"] == "result" and d.get("action_id") is not None
            for d in guarded.audit()[audit_before:]
        ),
        "the engine_dead action's result",
        240,
        every_seconds=1.0,
    )
    wait_for(
        lambda: support.healthy(guarded.url),
        "vLLM up again",
        120,
        every_seconds=support.POLL_SECONDS,
    )
    # A second restart would be decided within the action's cooldown (5 s of wall clock, which
    # the guardian counts itself) plus a few ticks that see vLLM up: wait for both.
    time.sleep(5)
    guarded.ticks_after(10, 120, "after the cooldown, vLLM up")
    gated_thread.join(timeout=300)
    try:
        through_gate = sdk.results(timeout=300)
    finally:
        sdk.stop()
    continuations = gate.continuations()
    continued = sum(v for k, v in continuations.items() if k.startswith("continued/"))
    uncut_sdk = SdkClient(vllm_venv, guarded.url + "/v1", [_sdk_wave()])
    try:
        sdk_uncut = uncut_sdk.results(timeout=300)
    finally:
        uncut_sdk.stop()
    REPORT["sdk_through_gate"] = {
        "in_flight_at_kill": sdk_in_flight_at_kill,
        "answers": [
            {
                "error": a["error"],
                "finish": a["finish"],
                "ids": len(a["ids"]),
                "completion_tokens": (a["usage"] or {}).get("completion_tokens"),
                "same_text": a["text"] == u["text"],
                "first_difference": first_difference(a["text"], u["text"]),
                "gap_at": a["gap_at"],
            }
            for a, u in zip(through_gate, sdk_uncut, strict=True)
        ],
        "continuations": continuations,
        "retried_total": gate.status()["retried_total"],
    }
    print("\nSDK client through the gate:", json.dumps(REPORT["sdk_through_gate"], indent=1))
    REPORT["gated_stream"] = {
        "events_at_kill": gated_at_kill,
        "events": gated.events,
        "keepalives": gated.keepalives,
        "continued": continued,
        "same_text": gated.text == uncut.text,
        "ended_after_kill_s": round(gated.ended - killed_at, 1),
        "usage": gated.usage,
        "errors": gated.errors,
        "failure": gated.failure,
    }
    print("\ngated stream:", json.dumps(REPORT["gated_stream"], indent=1))
    decisions = guarded.audit()[audit_before:]
    actions = [d for d in decisions if d["what"] == "action"]
    REPORT["engine_death"] = {
        "health_after_kill": statuses[-5:],
        "health_polls_after_kill": len(statuses),
        "exit_code": sup.exits[exits] if len(sup.exits) > exits else None,
        "api_server_exit_after_kill_s": round(exited_after, 1),
        "streams": [
            (r.status, r.finish_reason, (r.error or "")[:80], r.ended > killed_at) for r in streams
        ],
        "actions": [d["reason"] for d in actions],
        "results": [d["reason"] for d in decisions if d["what"] == "result"],
        "starts_added": sup.starts - starts,
    }
    print("\nengine death:", json.dumps(REPORT["engine_death"], indent=1))

    # The dead engine's server never says it is up again, and says 503 where it answers at all
    # before it exits (a busy host may leave it no time to answer: then nothing but errors).
    after = statuses[next((i for i, c in enumerate(statuses) if c != 200), len(statuses)) :]
    assert 200 not in after, REPORT["engine_death"]
    assert 503 in statuses or (after and all(c is None for c in after)), REPORT["engine_death"]
    assert sup.exits[exits] == 0  # vLLM exits 0 with a dead engine: Restart=always is needed
    assert actions and all(a["cause"] == "engine_dead" for a in actions)
    assert sup.starts - starts == 1, REPORT["engine_death"]
    # A stream the dead engine cut gets vLLM's error event (without a gate in front); the
    # others had their tokens already.
    assert all(r.error or r.finish_reason == "length" for r in streams), REPORT["engine_death"]
    # The gated one, cut by the death, is continued on the new server: one stream to its
    # client, the uncut run's text byte for byte, one id, the prompt counted once. Whether the
    # death cut it at all is the engine's pace: killed at the client's tenth event, vLLM had
    # already generated all 600 tokens in two runs on 2026-11-26 (the client reads the stream
    # well behind the engine on this machine), and then the client rightly gets the whole stream
    # with nothing to continue. So the cut is reported; what the client got is required either
    # way. (tests/test_gate_continuation.py cuts a scripted upstream mid-stream every time.)
    # The SDK client (retries off) lost nothing: every answer whole, one stream each. Their
    # text beside the same requests sent straight to the new server is reported, not required
    # equal: greedy text depends on the batch on this CPU build (test_vllm_progress.py).
    sdk_report = REPORT["sdk_through_gate"]
    assert sdk_in_flight_at_kill > 0, sdk_report
    # Whether the death cut one of them (continued, the gated stream's continuation showing in
    # its keep-alives, or sent again whole) is the engine's pace against the client's.
    # Reported, not required: beside other work the client read so far behind the engine that
    # vLLM had generated all 1,900 tokens of each before the kill (2026-11-26), and the whole
    # answers below are then what the client rightly gets, with nothing cut.
    sdk_continued = continued - (1 if gated.keepalives > 0 else 0)
    sdk_report["cut_by_the_death"] = sdk_continued + sdk_report["retried_total"]
    for (_, _, n), a, u in zip(SDK_IN_FLIGHT, through_gate, sdk_uncut, strict=True):
        assert a["error"] is None and u["error"] is None, sdk_report
        assert a["finish"] == "length" and a["usage"]["completion_tokens"] == n, sdk_report
        assert len(a["ids"]) == 1, sdk_report
    g = REPORT["gated_stream"]
    # Its keep-alives say it waited for the server: the death cut it (continued counts the
    # SDK client's streams too).
    g["cut_by_the_death"] = gated.keepalives > 0
    assert continued <= 1 + sum(1 for st, _, _ in SDK_IN_FLIGHT if st), g
    assert gated.done and not gated.errors and gated.failure is None, g
    assert gated.text.encode() == uncut.text.encode(), (gated.text, uncut.text)
    assert len(gated.ids) == 1 and len(gated.created) == 1, g
    assert gated.finish_reason == "length", g
    assert gated.usage == uncut.usage, (gated.usage, uncut.usage)
    # Whether a stream was still running at the kill depends on this machine's pace (all four
    # sometimes finish first), so a cut stream is reported, not required.


# --- 7. engine hang ------------------------------------------------------------------------

# The gate's progress watch holds (and, with take-back on, takes back what the stopped engine
# holds) after this long without progress: well inside the guardian's stall wait (the tier's
# signals.stall_seconds, 8 s), so the gate, not the restart, is what cuts the streams.
HANG_HOLD_SECONDS = 3.0


# The engine core stops itself (the fault plugin's hang file, its words) at the first step with
# the four requests running, each with this many tokens generated: every stream has text to
# continue and most of its tokens still to come. Until then each step sleeps HANG_STEP_MS, so
# that four requests sent by two processes on a busy host are in the engine together (a test
# that watched vLLM's gauges from outside and stopped the engine itself never saw the four
# together in 5 of 7 runs: this small model on a CPU serves a request in about a second).
HANG_EACH_AFTER_TOKENS = 32
HANG_STEP_MS = 20


def _hang_file(workdir: Path) -> Path:
    """The module's vLLM's hang file (its engine cores read it at every step)."""
    return workdir / "engine-hang"


def test_engine_hang_is_named_restarted_once_and_every_request_completes(
    guarded: Guarded, vllm_venv: Path
) -> None:
    """EngineCore stops itself (SIGSTOP) and stays stopped, with a greedy stream and an OpenAI SDK
    client's (retries off) two streams and unary request in flight through the deployed gate
    (``--take-back-hung on``): the guardian sees no progress (its stall), names the hang and
    restarts vLLM once (the stopped process ignores SIGTERM: the process manager's SIGKILL of
    the group ends it); the gate takes the requests back, continues the streams and sends the
    unary request again on the new server. Every answer whole, the greedy stream's text the
    uncut run's byte for byte, nothing of the old server left."""
    sup = guarded.supervisor
    healing = guarded.guardian.healing
    assert healing is not None
    assert guarded.guardian.cfg.signals.stall_seconds > 2 * HANG_HOLD_SECONDS
    # What test 6 left (its restart) ends first. Its cooldown (5 s) needs no wait: the stall
    # wait (8 s) is longer.
    wait_for(
        lambda: (
            support.healthy(guarded.url) and healing.view().state.service("vllm").in_flight is None
        ),
        "vLLM up and no action in flight",
        240,
        every_seconds=1.0,
    )
    starts, old_pid = sup.starts, sup.pid
    assert old_pid is not None
    engine = [p for p, cmd in support.children(old_pid) if cmd.startswith("VLLM::EngineCore")]
    assert len(engine) == 1
    audit_before = len(guarded.audit())
    greedy = {
        "model": MODEL_NAME, "prompt": support.prompt_ids(16, 3000), "max_tokens": GATED_TOKENS,
        "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    uncut = UNCUT.get("greedy") or support.TextStream()  # test 6's, unless it did not run
    if not uncut.done:
        support.stream_text(guarded.url, greedy, uncut)
    assert uncut.done and uncut.events > 0 and not uncut.errors, uncut
    gate = GateProcess(
        guarded.workdir, guarded.vllm_port, guarded.guardian_port, name="gate-hang",
        max_wait_seconds=300, stall_hold_seconds=HANG_HOLD_SECONDS, take_back_hung=True,
    )  # fmt: skip
    sdk: SdkClient | None = None
    gated = support.TextStream()
    hang = _hang_file(guarded.workdir)
    hung = hang.with_name(hang.name + ".hung")
    try:
        # Stopped by the engine itself, at a step with the four requests in it, not by what a
        # client has read (beside other work the clients read far behind the engine) nor by
        # what vLLM's gauges said a moment ago: a hang with nothing left in the engine is no
        # hang. The four are sent at once, when the SDK client has imported openai.
        sdk = SdkClient(vllm_venv, gate.url + "/v1", [[], _sdk_wave()])
        assert sdk.ready.wait(120), "the SDK client did not start within 120 s"
        # The gate must be open before the four are sent: it follows the guardian, which after
        # test 6's restart may still say not ready on a slow host, and held requests never reach
        # vLLM. Waited for, with what the gate says printed if it never opens.
        wait_for(
            lambda: bool(gate.status().get("open")),
            "the gate open (following the guardian)",
            300,
            seen=lambda: (gate.status(), gate.log()[-1500:]),
            every_seconds=0.5,
        )
        hang.write_text(
            f"{engine[0]} running={1 + len(SDK_IN_FLIGHT)} tokens={HANG_EACH_AFTER_TOKENS} "
            f"step_ms={HANG_STEP_MS} stop\n"
        )
        gated_thread = threading.Thread(
            target=support.stream_text, args=(gate.url, greedy, gated), daemon=True
        )
        sdk.next_wave()
        gated_thread.start()
        wait_for(
            lambda: hung.exists() and hung.read_text().endswith("\n"),
            f"the engine core stopped with the four requests in it ({hang.read_text()!r})",
            240,
            seen=lambda: (gate.status(), gate.log()[-1500:]),
            every_seconds=0.1,
        )
        at_stop = json.loads(hung.read_text())
        stopped_at = time.monotonic() - max(0.0, time.time() - at_stop["time"])
        gated_at_stop = gated.events
        sdk_with_text_at_stop = sorted(sdk.with_text)
        sdk_in_flight_at_stop = sorted(set(range(len(SDK_IN_FLIGHT))) - set(sdk.done))
        wait_for(
            lambda: any(d["what"] == "action" for d in guarded.audit()[audit_before:]),
            "the guardian's action on the stopped engine",
            120,
            seen=lambda: (guarded.audit()[audit_before:][-3:], gate.log()[-1500:]),
            every_seconds=0.5,
        )
        named_after = time.monotonic() - stopped_at
        wait_for(
            lambda: any(
                d["what"] == "result" and d.get("action_id") is not None
                for d in guarded.audit()[audit_before:]
            ),
            "the action's result",
            240,
            seen=lambda: guarded.audit()[audit_before:][-3:],
            every_seconds=1.0,
        )
        wait_for(lambda: support.healthy(guarded.url), "vLLM up again", 120, every_seconds=1.0)
        up_after = time.monotonic() - stopped_at
        # No second restart: past the cooldown (5 s), over ticks that see the new engine serve
        # what the gate sends it again.
        time.sleep(5)
        guarded.ticks_after(10, 120, "after the cooldown, vLLM up")
        gated_thread.join(timeout=300)
        through_gate = sdk.results(timeout=300)
        continuations = gate.continuations()
        status = gate.status()
    finally:
        if sdk is not None:
            sdk.stop()
        gate.stop()
        hang.unlink(missing_ok=True)  # it names the old engine core's pid, but pids are reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine[0], signal.SIGCONT)  # whatever the restart left of it (nothing)
    decisions = guarded.audit()[audit_before:]
    actions = [d for d in decisions if d["what"] == "action"]
    left = support.in_session(old_pid)
    REPORT["engine_hang"] = {
        "in_engine_at_stop": at_stop["running"],
        "sdk_in_flight_at_stop": sdk_in_flight_at_stop,
        "sdk_with_text_at_stop": sdk_with_text_at_stop,
        "gated_events_at_stop": gated_at_stop,
        "named_after_stop_s": round(named_after, 1),
        "up_after_stop_s": round(up_after, 1),
        "actions": [(d.get("cause"), d.get("evidence"), d["reason"]) for d in actions],
        "results": [d["reason"] for d in decisions if d["what"] == "result"],
        "starts_added": sup.starts - starts,
        "continuations": continuations,
        "retried_total": status.get("retried_total"),
        "sdk": [
            {
                "error": a["error"],
                "finish": a["finish"],
                "ids": len(a["ids"]),
                "completion_tokens": (a["usage"] or {}).get("completion_tokens"),
                "gap_at": a["gap_at"],
            }
            for a in through_gate
        ],
        "gated": {
            "events": gated.events,
            "keepalives": gated.keepalives,
            "same_text": gated.text == uncut.text,
            "first_difference": first_difference(gated.text, uncut.text),
            "errors": gated.errors,
            "failure": gated.failure,
        },
        "old_session_left": left,
        "after_stop_s": round(time.monotonic() - stopped_at, 1),
    }
    print("\nengine hang:", json.dumps(REPORT["engine_hang"], indent=1))
    print("\nthe gate's log, its end:\n" + gate.log()[-3000:])
    report = REPORT["engine_hang"]
    # The hang, named as one: the guardian's stall (no progress with requests in the engine),
    # as its alert VllmEngineStalled (the rule reads the signal `stalled`), and "hung" in the
    # action's reason; its cause the restart's (engine_dead: a hung engine is down as a dead
    # one is; the first run's action: evidence ["VllmEngineStalled"], "... it makes no
    # progress: the engine is hung").
    assert actions, report
    assert all(
        a["cause"] == "engine_dead"
        and {"VllmEngineStalled", "stalled"} & set(a["evidence"])
        and "hung" in a["reason"]
        for a in actions
    ), report
    assert sup.starts - starts == 1 and sup.pid not in (None, old_pid), report
    # The stopped engine and its API server are gone (SIGKILL reaches a stopped process).
    assert not left, report
    assert not any(k.startswith(("failed/", "refused/")) for k in continuations), report
    for (_, _, n), a in zip(SDK_IN_FLIGHT, through_gate, strict=True):
        assert a["error"] is None, report
        assert a["finish"] == "length" and a["usage"]["completion_tokens"] == n, report
        assert len(a["ids"]) == 1, report
    assert gated.done and not gated.errors and gated.failure is None, report
    assert gated.text.encode() == uncut.text.encode(), (gated.text, uncut.text)
    assert len(gated.ids) == 1 and len(gated.created) == 1, report
    assert gated.finish_reason == "length", report
    assert gated.usage == uncut.usage, (gated.usage, uncut.usage)
