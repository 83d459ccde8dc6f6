"""``vllm-guardian loadtest`` against the twin on loopback, and on bad input.

The twin runs as a subprocess on a free 127.0.0.1 port at a high ``--sim-speed`` and is always
stopped. What is checked: a ramp finds the knee where the pool saturates
and the verdict says by how much the load is over one replica and how many replicas would carry
it, never a lower ``--max-num-seqs`` (that costs throughput); on prefill_burst settings the ramp stops at the headroom floor before
the twin OOMs (and without a floor, the OOM line stops it and nothing is retried); bad input
gives a clear message and, where anything ran, a partial report.

Not here: the same ramp against a real vLLM with a small KV pool, checked against the server's
own counters. That belongs to the integration tier (a GPU host with vLLM installed);
docs/loadtest.md says how to run it by hand.
"""

from __future__ import annotations

import http.server
import io
import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import hostneeds
from tests.sim import twinproc
from vllm_guardian.config import ConfigInvalid
from vllm_guardian.loadtest import cli
from vllm_guardian.loadtest.profile import (
    Limits,
    PromptsInvalid,
    Reach,
    classify_url,
    doubling_ramp,
    load_prompts,
    parse_profile,
)
from vllm_guardian.loadtest.recommend import Action, recommend
from vllm_guardian.loadtest.report import write_chart
from vllm_guardian.loadtest.results import StepResult
from vllm_guardian.loadtest.runner import (
    Limit,
    forecast_headroom,
    log_violation,
    run_loadtest,
    server_info,
)
from vllm_guardian.model import LogEvent, LogEventKind
from vllm_guardian.tools.demo import free_port

pytestmark = pytest.mark.timeout(120)

SPEED = "20"
# The twin's KV pool pinned to 2 GiB (16k tokens of Llama-3-8B): ~1.5k-token requests saturate
# it between 8 and 16 in flight.
KV_POOL = ("--kv-cache-memory-bytes", str(2 * 1024**3))
KNEE_LOAD = (
    "--ramp", "1,2,4,8,16,32", "--step-seconds", "2", "--prompt-tokens", "800-1200",
    "--output-tokens", "200-400", "--no-stream",
)  # fmt: skip
# prefill_burst's flags (docs/twin.md) on the command line, where the loadtest reads them.
PREFILL_FLAGS = ("--gpu-memory-utilization", "0.95", "--max-num-batched-tokens", "16384")
# Long prompts: a step of four of them needs ~6.5 GiB of unprofiled workspace at 16384
# batched tokens. The twin's headroom is a sawtooth (each step's activations while it runs), and
# a sample may or may not land on a peak. The first ramp's floor (6 GiB) is above the idle
# headroom of these settings (5.9 GiB), so it stops at the first step whatever a sample catches;
# the recommended settings' peaks leave ~5.9 GiB, so their ramp is held to a 4 GiB floor, a
# margin past the peaks that no sampling can cross.
PREFILL_LOAD = (
    "--ramp", "1,2,4", "--step-seconds", "2", "--prompt-tokens", "6500-7800",
    "--output-tokens", "16-32", "--no-stream",
)  # fmt: skip
PREFILL_FLOOR = ("--gpu-headroom-floor", "6GiB")
PREFILL_FIXED_FLOOR = ("--gpu-headroom-floor", "4GiB")

Twin = Callable[..., twinproc.TwinProc]


@pytest.fixture
def twin(tmp_path: Path) -> Iterator[Twin]:
    started: list[twinproc.TwinProc] = []

    def start(*args: str) -> twinproc.TwinProc:
        port = free_port()
        t = twinproc.start(
            tmp_path, port, "--sim-speed", SPEED,
            "--sim-gpu-state-file", str(tmp_path / f"gpu-{port}.json"), *args,
        )  # fmt: skip
        started.append(t)
        t.wait_ready()  # up to 60 s: a twin starting beside a busy neighbour
        return t

    yield start
    for t in started:
        twinproc.stop(t)


def loadtest(t: twinproc.TwinProc, *args: str) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(
        [
            "--url", t.url, "--json", "--interval", "0.2",
            "--gpu-state-file", str(t.stderr_path.parent / f"gpu-{t.port}.json"),
            "--log-file", str(t.stderr_path), *args,
        ],
        out=out,
        err=err,
    )  # fmt: skip
    return rc, json.loads(out.getvalue()), err.getvalue()


def rec(doc: dict[str, Any], flag: str) -> dict[str, Any]:
    return next(r for r in doc["verdict"]["recommendations"] if r["flag"] == flag)


def test_a_ramp_finds_the_knee_and_says_capacity_not_a_lower_cap(twin: Twin) -> None:
    rc, doc, _ = loadtest(twin(*KV_POOL), *KNEE_LOAD)
    assert rc == cli.EXIT_STOPPED
    steps = doc["steps"]
    knee = next(s for s in steps if s["index"] == doc["verdict"]["knee_step"])
    # The knee: the pool saturates and preemptions start; the steps before it held.
    assert knee["preemptions_per_second"] > 0
    assert all(s["held"] for s in steps if s["index"] < knee["index"])
    assert any(limit == "preemption_rate" for limit, _ in steps[-1]["violations"])
    assert knee["concurrency"] < 32  # it stopped there: the last step was never sent
    seqs = rec(doc, "--max-num-seqs")
    # A capacity problem: by how much, how many replicas, and never a lower cap.
    assert seqs["action"] == "keep" and seqs["value"] is None, seqs
    assert "saturated" in seqs["reason"] and "over capacity by" in seqs["reason"], seqs
    assert "replica(s)" in seqs["reason"] and "costs throughput" in seqs["reason"], seqs


def test_on_prefill_burst_settings_the_ramp_stops_at_the_floor_before_the_oom(
    twin: Twin,
) -> None:
    t = twin(*PREFILL_FLAGS)
    rc, doc, _ = loadtest(t, *PREFILL_LOAD, *PREFILL_FLOOR)
    assert rc == cli.EXIT_STOPPED
    assert doc["stop_reason"].startswith("GPU headroom")
    assert [lim for lim, _ in doc["steps"][-1]["violations"]] == ["gpu_headroom"]
    # Stopped before the crash: the twin is alive and never logged an OOM.
    assert t.health() == 200
    assert "out of memory" not in t.stderr()
    assert rec(doc, "--max-num-batched-tokens") == {
        "flag": "--max-num-batched-tokens",
        "action": "lower",
        "value": "8192",
        "reason": rec(doc, "--max-num-batched-tokens")["reason"],
    }
    util = rec(doc, "--gpu-memory-utilization")
    assert util["action"] == "lower"
    assert float(util["value"]) < 0.95

    # The recommendation applied: the same ramp, every step holds a floor past its peaks.
    fixed = twin(
        "--gpu-memory-utilization", util["value"],
        "--max-num-batched-tokens", rec(doc, "--max-num-batched-tokens")["value"],
    )  # fmt: skip
    rc2, doc2, _ = loadtest(fixed, *PREFILL_LOAD, *PREFILL_FIXED_FLOOR)
    assert rc2 == cli.EXIT_PASS, doc2["stop_reason"]
    assert fixed.health() == 200
    assert "out of memory" not in fixed.stderr()


def test_without_a_floor_the_oom_line_stops_the_run_and_nothing_is_retried(twin: Twin) -> None:
    t = twin(*PREFILL_FLAGS)
    # No floor at all: the default 1 GiB one is under the peaks of the step that crashes, and
    # a sample that lands on one stops the run before the OOM (seen beside a CPU hog, where the
    # twin's steps last longer): then the OOM line this test is about is never read.
    rc, doc, _ = loadtest(t, *PREFILL_LOAD, "--gpu-headroom-floor", "0")
    assert rc == cli.EXIT_STOPPED
    last = doc["steps"][-1]
    assert last["concurrency"] == 4
    assert "oom" in [lim for lim, _ in last["violations"]]
    assert "CUDA out of memory" in doc["stop_reason"]
    # Not retried into the dying server: four in flight when it died, a few more as workers
    # moved on before the stop, never a storm.
    assert last["errors"] <= 4 * 4
    assert [s["held"] for s in doc["steps"][:2]] == [True, True]
    assert rec(doc, "--gpu-memory-utilization")["action"] == "lower"


FATAL = LogEvent(LogEventKind.ENGINE_FATAL, 1.0, "EngineCore encountered a fatal error.")
OOM = LogEvent(LogEventKind.CUDA_OOM, 1.0, "CUDA out of memory. Tried to allocate 6.26 GiB.")
DEAD = LogEvent(LogEventKind.ENGINE_DEAD, 1.0, "EngineDeadError")


@pytest.mark.parametrize(
    ("events", "limit", "names"),
    [
        ((), None, None),
        ((FATAL,), Limit.SERVER_DOWN, "fatal error"),
        ((FATAL, DEAD), Limit.SERVER_DOWN, "fatal error"),
        # vLLM logs the fatal error before the OOM that caused it: the OOM is named.
        ((FATAL, OOM, DEAD), Limit.OOM, "CUDA out of memory"),
        ((OOM, FATAL), Limit.OOM, "CUDA out of memory"),
    ],
)
def test_a_log_read_stops_on_its_cause(
    events: tuple[LogEvent, ...], limit: Limit | None, names: str | None
) -> None:
    v = log_violation(events)
    assert (v.limit if v else None) == limit
    assert names is None or (v is not None and names in v.message), v


# --- bad input -------------------------------------------------------------------------------


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(list(args), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_an_unreachable_url_is_a_clear_message_and_no_load() -> None:
    rc, out, err = run("--url", f"http://127.0.0.1:{free_port()}", "--concurrency", "1")
    assert rc == cli.EXIT_UNREACHABLE
    assert "does not answer" in err
    assert out == ""


class _Failing(http.server.BaseHTTPRequestHandler):
    """A server that lists a model and fails every completion: errors from the start."""

    def do_GET(self) -> None:
        body = b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b"ok"
        self.send_response(200 if self.path in ("/v1/models", "/health") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b'{"error": {"message": "internal"}}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def failing_server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_errors_from_the_start_stop_at_once_with_a_partial_report(failing_server: str) -> None:
    rc, out, _err = run(
        "--url", failing_server, "--ramp", "1,2", "--step-seconds", "5", "--interval", "0.1",
        "--gpu-backend", "none", "--quiet",
    )  # fmt: skip
    assert rc == cli.EXIT_STOPPED
    assert "requests fail from the start" in out
    assert "1 c=1" in out  # the partial table
    assert "2 c=2" not in out  # the next step was never sent
    assert "no step held every limit" in out


def test_a_malformed_profile_names_every_key_and_line(tmp_path: Path) -> None:
    p = tmp_path / "profile.yaml"
    p.write_text(
        "url: http://127.0.0.1:8000\n"
        "load:\n"
        "  ramp: [1, 2, 4]\n"
        "  step_seconds: forever\n"
        "  shared_prefix_ratio: 1.5\n"
        "  burst: true\n"
        "limits:\n"
        "  gpu_headroom_floor_bytes: 2 potatoes\n"
    )
    rc, out, err = run("--profile", str(p))
    assert rc == cli.EXIT_USAGE
    assert out == ""
    assert f"{p}:4: load.step_seconds: expected a number" in err
    assert f"{p}:5: load.shared_prefix_ratio: must be <= 1" in err
    assert f"{p}:6: load.burst: unknown key" in err
    assert f"{p}:8: limits.gpu_headroom_floor_bytes:" in err
    with pytest.raises(ConfigInvalid, match="give one of ramp, concurrency"):
        parse_profile("load:\n  ramp: [1]\n  concurrency: 2\n", "x.yaml")
    with pytest.raises(ConfigInvalid, match="steps must go up"):
        parse_profile("load:\n  ramp: [4, 2]\n", "x.yaml")


@pytest.mark.parametrize(
    ("args", "rc", "said"),
    [
        (["--profile", "P"], cli.EXIT_USAGE, ["load.burst: unknown key"]),
        (
            ["-c", "P"],
            cli.EXIT_USAGE,
            ["-c/--config is deprecated here", "load.burst: unknown key"],
        ),
        (["--config", "P"], cli.EXIT_USAGE, ["use --profile", "load.burst: unknown key"]),
        (["-c", "P", "--profile", "Q"], cli.EXIT_USAGE, ["give the profile once"]),
    ],
    ids=["--profile", "-c (deprecated)", "--config (deprecated)", "both, differing"],
)
def test_the_profile_is_profile_and_c_a_deprecated_alias(
    tmp_path: Path, args: list[str], rc: int, said: list[str]
) -> None:
    """Everywhere else -c is the guardian's config; loadtest's -c was its load profile."""
    p = tmp_path / "profile.yaml"
    p.write_text("url: http://127.0.0.1:8000\nload:\n  burst: true\n")
    got, out, err = run(
        *[str(p) if a == "P" else str(tmp_path / "q.yaml") if a == "Q" else a for a in args]
    )
    assert (got, out) == (rc, "")
    for text in said:
        assert text in err, err
    if args[0] == "--profile":
        assert "deprecated" not in err


def test_flags_are_bounded_like_the_profile() -> None:
    rc, _, err = run("--url", "http://127.0.0.1:1", "--ramp", "1,2", "--step-seconds", "100000")
    assert rc == cli.EXIT_USAGE
    assert "load.step_seconds: must be <= 600" in err


def test_a_prompts_file_with_broken_lines_names_them(tmp_path: Path) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_text(
        '{"prompt": "hello there", "max_tokens": 8}\n'
        "not json\n"
        "\n"
        '{"prompt": ""}\n'
        '{"prompt": "x", "max_tokens": -1}\n'
        '{"prompt": "y", "temperature": 0}\n'
    )
    with pytest.raises(PromptsInvalid) as e:
        load_prompts(p)
    assert [x.split(":")[0] for x in e.value.problems] == ["line 2", "line 4", "line 5", "line 6"]
    rc, out, err = run(
        "--url", "http://127.0.0.1:1", "--prompts-file", str(p), "--concurrency", "1"
    )
    assert rc == cli.EXIT_USAGE
    assert "line 2: not JSON" in err
    assert out == ""


def test_a_public_url_needs_the_confirmation_flag() -> None:
    assert classify_url("http://127.0.0.1:8000") is Reach.LOOPBACK
    assert classify_url("http://10.1.2.3:8000") is Reach.PRIVATE
    assert classify_url("http://8.8.8.8:8000") is Reach.PUBLIC
    rc, _out, err = run("--url", "http://8.8.8.8:8000", "--concurrency", "1")
    assert rc == cli.EXIT_USAGE
    assert "WARNING" in err
    assert "--allow-public-url" in err


def test_ctrl_c_stops_at_once_and_keeps_what_was_measured(failing_server: str) -> None:
    profile = parse_profile(
        "load: {ramp: [1, 2], step_seconds: 30}\nlimits: {error_ratio: 1.0}\n"
        "watch: {gpu_backend: none, interval_seconds: 0.05}\n",
        "p.yaml",
    )
    samples = 0

    def progress(*_: object) -> None:
        nonlocal samples
        samples += 1
        if samples == 5:
            raise KeyboardInterrupt

    state = run_loadtest(
        failing_server, profile, server_info(failing_server, "m", []), progress=progress
    )
    assert state.interrupted
    assert "Ctrl-C" in (state.stop_reason or "")
    assert len(state.results) == 1
    assert not state.results[0].complete
    assert state.results[0].requests > 0


# --- the pure parts --------------------------------------------------------------------------


def test_doubling_ramp() -> None:
    assert doubling_ramp(1) == (1,)
    assert doubling_ramp(8) == (1, 2, 4, 8)
    assert doubling_ramp(12) == (1, 2, 4, 8, 12)


def _step(i: int, c: int, **kw: Any) -> StepResult:
    base: dict[str, Any] = {
        f: None
        for f in StepResult.__dataclass_fields__
        if f not in ("index", "label", "concurrency", "violations", "complete")
    }
    base.update(requests=10, errors=0, dropped=0, duration_seconds=10.0)
    base.update(kw)
    return StepResult(index=i, label=f"c={c}", concurrency=c, violations=(), complete=True, **base)


def test_headroom_to_spare_with_the_pool_as_the_limit_raises_utilization() -> None:
    gib = 1024**3
    common = {
        "kv_capacity_tokens": 32768,
        "request_tokens_max": 2048,
        "gpu_memory_total_bytes": 80 * gib,
        "gpu_headroom_min_bytes": 10 * gib,
        "gpu_memory_utilization_ratio": 0.85,
    }
    steps = [
        _step(1, 4, kv_usage_peak_ratio=0.4, preemptions_per_second=0.0, **common),
        _step(2, 16, kv_usage_peak_ratio=0.99, preemptions_per_second=2.0, **common),
    ]
    from vllm_guardian.core.budget import LaunchFlags

    v = recommend(steps, LaunchFlags(), Limits(), stop_reason="preemptions")
    by = {r.flag: r for r in v.recommendations}
    seqs = by["--max-num-seqs"]  # the pool holds floor(0.9 * 32768 / 2048) = 14 requests
    assert (seqs.action, seqs.value) == (Action.KEEP, None)
    assert "over capacity by 1.14x: 2 replica(s) (add 1) or shed at the gate" in seqs.reason
    low = recommend(steps, LaunchFlags(max_num_seqs=8), Limits(), stop_reason="preemptions")
    raised = next(r for r in low.recommendations if r.flag == "--max-num-seqs")
    assert (raised.action, raised.value) == (Action.RAISE, "14")  # 8 < what the pool hosts
    assert by["--gpu-memory-utilization"].action is Action.RAISE
    assert by["--gpu-memory-utilization"].value == "0.90"
    assert by["policy.kv_high_watermark_ratio"].action is Action.KEEP


def test_the_chart_is_a_png(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        hostneeds.cannot_run(
            "matplotlib not installed: `loadtest --chart` draws with it (pip install "
            "'vllm-guardian[loadtest]'; scripts/test installs it)"
        )
    steps = [_step(1, 1, output_tokens_per_second=100.0), _step(2, 2)]
    assert write_chart(steps, tmp_path / "c.png") is None
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_without_matplotlib_the_chart_is_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    steps = [_step(1, 1, output_tokens_per_second=100.0), _step(2, 2)]
    problem = write_chart(steps, tmp_path / "c.png")
    assert problem is not None
    assert "pip install 'vllm-guardian[loadtest]'" in problem
    assert not (tmp_path / "c.png").exists()


GIB_ = 1024**3
FORECASTS = [
    # (c, min GiB, max GiB) of the last two steps → headroom forecast at c=8 (GiB), None: no trend
    (((2, 10.0, 10.5), (4, 8.0, 8.5)), 4.0),  # falls 2 GiB a step, swings 0.5: a trend
    (((2, 9.0, 12.0), (4, 8.0, 12.0)), None),  # falls 1 GiB, swings 4: a sampled peak, not a trend
    (((2, 8.0, 9.0), (4, 8.5, 9.0)), None),  # not falling
    (((2, 10.0, None), (4, 8.0, None)), 4.0),  # no maximum known: the old straight line
]


@pytest.mark.parametrize(("steps", "expected"), FORECASTS)
def test_the_headroom_forecast_reads_a_trend_not_a_sampled_peak(steps, expected) -> None:  # type: ignore[no-untyped-def]
    records = [
        _step(i, c, gpu_headroom_min_bytes=int(lo * GIB_),
              gpu_headroom_max_bytes=None if hi is None else int(hi * GIB_))
        for i, (c, lo, hi) in enumerate(steps, 1)
    ]  # fmt: skip
    got = forecast_headroom(records, 8)
    assert (None if got is None else round(got / GIB_, 3)) == expected
