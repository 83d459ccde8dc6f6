"""The `vllm` tier: a long prefill is progress, a stopped engine core is a hang (core/progress.py).

One real vLLM 0.32 serving the long-context variant of the tier's model (``tinymodel.py
--long-context``) with chunked prefill in chunks of 256 tokens, run by the guardian's own
process manager, armed (``dry_run: false``), with the stall wait of the tier (8 s):

1. **One long prompt alone is served.** A 20,480-token prompt is prefilled for longer than the
   stall wait (about 15 s on the 2-core machine) while no token counter moves (vLLM V1 counts
   a prompt's tokens when its prefill is done): it is answered 200, the guardian's stall never
   reaches its wait, no alert fires, no action is taken and vLLM is never restarted. (Before
   core/progress.py the stall signal read tokens only: the prompt was a hung engine and the
   armed guardian restarted vLLM under it.)
2. **A stopped engine core is still a hang.** The same length again; once the engine is
   prefilling it, its EngineCore is stopped with SIGSTOP: the guardian names the engine hung
   (``stalled``, cause ``engine_dead``) and restarts vLLM once. (The gate's experimental
   take-back of a hung engine's requests, ``--take-back-hung``, is off by default: checked
   through the deployed gate with an OpenAI SDK client, two runs of five lost two and three
   requests, sent again into the still hung engine before the restart and cut a second time
   by it. The gate now keeps them until the engine is a new one; not run on this tier since;
   docs/gate.md, "Across a hang".)

The model makes the module slower than the tiny one's (a 46 MB model, ~15 s per long prompt):
about 2-3 minutes in all on the 2-core machine, most of it the two vLLM starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for
from tests.vllm_tier import support
from tests.vllm_tier.support import StreamResult
from tests.vllm_tier.test_vllm_real import Guarded, guardian_config
from vllm_guardian.model import AlertState
from vllm_guardian.shell.daemon import Guardian, TickResult
from vllm_guardian.tools.demo import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT_TOKENS = 20480
STALL_SECONDS = 8.0  # the tier's signals.stall_seconds (test_vllm_real.guardian_config)
FLAGS = (
    "--max-model-len", str(PROMPT_TOKENS + 512),
    "--max-num-batched-tokens", "256",  # 80 chunks for one prompt
    "--num-gpu-blocks-override", "169",  # 21,632 tokens: one such prompt at a time
    "--max-num-seqs", "4",
    "--shutdown-timeout", "5",
)  # fmt: skip
REPORT: dict[str, Any] = {}


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    return support.vllm_venv_or_skip()


@pytest.fixture(scope="module")
def long_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-long")
    subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(support.HERE / "tinymodel.py"), str(out),
         "--long-context"],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def guarded(
    vllm_venv: Path, long_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guarded]:
    lock = support.host_lock()  # one real server on this host at a time
    workdir = tmp_path_factory.mktemp("guarded-long")
    run_id = uuid.uuid4().hex
    vllm_port, guardian_port = free_port(), free_port()
    env = support.vllm_env(run_id, workdir)
    command = support.serve_command(vllm_venv, long_model, vllm_port, env, FLAGS)
    cfg = guardian_config(workdir, command, vllm_port, guardian_port, relaunch_after=100)
    assert cfg.signals.stall_seconds == STALL_SECONDS
    guardian = Guardian(cfg)
    thread = threading.Thread(
        target=guardian.run, kwargs={"install_signals": False}, name="guardian", daemon=True
    )
    g = Guarded(
        guardian, thread, workdir, f"http://127.0.0.1:{vllm_port}",
        f"http://127.0.0.1:{guardian_port}", run_id, command, vllm_port, guardian_port,
    )  # fmt: skip
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
        wait_for(
            lambda: g.ready_status() == 200,
            "/ready/vllm 200",
            30,
            every_seconds=support.POLL_SECONDS,
        )
        # A fresh server's first request is a short one (test_vllm_real, test 0).
        first = support.stream_completion(g.url, support.prompt_ids(32, 1), 2, stream=False)
        assert first.status == 200, first
        yield g
    finally:
        guardian.request_stop()
        thread.join(timeout=90)
        swept = support.sweep(run_id, census)
        left = support.leftovers(run_id, census=census)
        census.stop()
        lock.close()
        REPORT["module_seconds"] = round(time.monotonic() - start, 1)
        REPORT["swept_at_teardown"] = swept
        print("\nvllm progress tier:", json.dumps(REPORT, indent=1, default=str))
        assert not left, f"vLLM processes left behind: {left}"


@dataclass
class Watch:
    """What the guardian derived at every one of its ticks: its stall, the engine's counters and
    gauges. Each tick's result is recorded as the guardian records it (its ``_record`` step),
    not sampled by a thread: beside a CI load a sampling thread missed the one tick on which
    the stall crossed its wait before the guardian acted (ci run, 2026-11-26, load ~9)."""

    g: Guarded
    rows: list[dict[str, Any]] = field(default_factory=list)

    def _row(self, last: TickResult) -> None:
        sig = last.signals.service("vllm")
        svc = last.snapshot.service("vllm")
        eng = svc.vllm.engines[0] if svc and svc.vllm and svc.vllm.engines else None
        assert self.g.guardian.healing is not None
        self.rows.append(
            {
                "t": last.snapshot.time_seconds,
                "stall": sig.stall_seconds if sig else None,
                "stalled": sig.stalled if sig else None,
                "running": eng.requests_running if eng else None,
                "kv": eng.kv_cache_usage_ratio if eng else None,
                "tokens": (
                    (eng.prompt_tokens_total or 0) + (eng.generation_tokens_total or 0)
                    if eng
                    else None
                ),
                "firing": sorted(
                    a.name
                    for a in self.g.guardian.healing.view().alerts
                    if a.state is AlertState.FIRING
                ),
            }
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[Watch]:
        guardian = self.g.guardian
        record = guardian._record

        def recorded(result: TickResult) -> None:
            self._row(result)
            record(result)

        guardian._record = recorded  # type: ignore[method-assign]
        try:
            yield self
        finally:
            guardian._record = record  # type: ignore[method-assign]

    def longest_flat_tokens_while_running(self) -> float:
        """The longest span of the guardian's snapshots with a request running and the token
        counters unchanged: the blind spot a token-only stall signal had."""
        longest, since, tokens = 0.0, None, None
        for r in self.rows:
            if not r["running"]:
                since = None
            elif since is None or r["tokens"] != tokens:
                since, tokens = r["t"], r["tokens"]
            else:
                longest = max(longest, r["t"] - since)
        return longest


def _engine_core(g: Guarded) -> int:
    pid = g.supervisor.pid
    assert pid is not None
    cores = [p for p, cmd in support.children(pid) if cmd.startswith("VLLM::EngineCore")]
    assert len(cores) == 1, support.children(pid)
    return cores[0]


def test_one_long_prompt_alone_is_served_without_a_restart(guarded: Guarded) -> None:
    sup = guarded.supervisor
    starts, pid = sup.starts, sup.pid
    audit_before = len(guarded.audit())
    with Watch(guarded).running() as watch:
        r = support.stream_completion(
            guarded.url, support.prompt_ids(PROMPT_TOKENS, 7), 2, stream=False, timeout=300
        )
        guarded.ticks_after(4, 60, "after the answer")
    decisions = guarded.audit()[audit_before:]
    REPORT["long_prompt"] = {
        "status": r.status,
        "seconds": round(r.ended - r.started, 1),
        "flat_tokens_while_running_s": round(watch.longest_flat_tokens_while_running(), 1),
        "stall_max_s": max((w["stall"] or 0.0 for w in watch.rows), default=None),
        "kv_max": max((w["kv"] or 0.0 for w in watch.rows), default=None),
        "fired": sorted({n for w in watch.rows for n in w["firing"]}),
        "decisions": [(d["what"], d.get("cause"), d.get("reason")) for d in decisions],
        "starts_added": sup.starts - starts,
    }
    print("\nlong prompt alone:", json.dumps(REPORT["long_prompt"], indent=1))
    assert r.status == 200 and r.chunks == 2, r
    # The blind spot happened: no token counter moved for longer than the stall wait.
    assert watch.longest_flat_tokens_while_running() > STALL_SECONDS, REPORT["long_prompt"]
    assert not any(w["stalled"] for w in watch.rows), REPORT["long_prompt"]
    assert "VllmEngineStalled" not in REPORT["long_prompt"]["fired"]
    assert [d for d in decisions if d["what"] in ("action", "latch")] == []
    assert sup.starts == starts and sup.pid == pid


def test_a_stopped_engine_core_is_named_hung_and_restarted(guarded: Guarded) -> None:
    sup = guarded.supervisor
    starts = sup.starts
    audit_before = len(guarded.audit())
    engine = _engine_core(guarded)
    results: list[StreamResult] = []
    t = threading.Thread(
        target=lambda: results.append(
            support.stream_completion(
                guarded.url, support.prompt_ids(PROMPT_TOKENS, 8), 2, stream=False, timeout=300
            )
        ),
        daemon=True,
    )
    stopped_at: float | None = None
    try:
        with Watch(guarded).running() as watch:
            t.start()
            wait_for(
                lambda: any(w["running"] and (w["kv"] or 0) > 0 for w in watch.rows),
                "the guardian to see the prompt being prefilled",
                120,
                every_seconds=0.1,
            )
            os.kill(engine, signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_for(
                lambda: any(d["what"] == "action" for d in guarded.audit()[audit_before:]),
                "the guardian's action on the stopped engine",
                120,
                every_seconds=0.5,
            )
            named_after = time.monotonic() - stopped_at
            # The audit line is written inside the tick that acted, before that tick is
            # recorded: watch until it and the next are (leaving at once lost the very tick
            # whose stall crossed the wait: "stall_max_s 7.5", the action at 8.5-9 s).
            ticks = len(watch.rows)
            wait_for(
                lambda: len(watch.rows) >= ticks + 2,
                "two more guardian ticks",
                60,
                every_seconds=0.2,
            )
        actions = [d for d in guarded.audit()[audit_before:] if d["what"] == "action"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)  # whatever the restart has left of it
    wait_for(
        lambda: any(
            d["what"] == "result" and d.get("action_id") is not None
            for d in guarded.audit()[audit_before:]
        ),
        "the action's result",
        240,
        every_seconds=1.0,
    )
    wait_for(
        lambda: support.healthy(guarded.url),
        "vLLM up again",
        120,
        every_seconds=support.POLL_SECONDS,
    )
    t.join(timeout=60)
    REPORT["stopped_engine"] = {
        "named_after_stop_s": round(named_after, 1),
        "stall_max_s": max((w["stall"] or 0.0 for w in watch.rows), default=None),
        "actions": [(d.get("cause"), d.get("reason")) for d in actions],
        "results": [
            d.get("reason") for d in guarded.audit()[audit_before:] if d["what"] == "result"
        ],
        "starts_added": sup.starts - starts,
        "request": [(r.status, (r.error or "")[:80]) for r in results],
    }
    print("\nstopped engine core:", json.dumps(REPORT["stopped_engine"], indent=1))
    assert any(w["stalled"] for w in watch.rows), REPORT["stopped_engine"]
    assert actions and all(a["cause"] == "engine_dead" for a in actions), actions
    assert sup.starts - starts == 1, REPORT["stopped_engine"]
