"""scripts/gpu-check without a GPU: its one line and exit 2, and every verdict from numbers.

The card itself is a boundary CI cannot cross; what it measured on one (an H100, twice) is
committed under bench/results/gpu/, and the tables below take their passing rows from those
runs, so the verdicts tested here are the ones the card produced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import hostneeds
from tests.nvml_fake import FakeNvmlState, build_fake_nvml
from vllm_guardian.formats.allocator_format import STATS_KEYS, from_memory_stats
from vllm_guardian.gpucheck import report as rp
from vllm_guardian.gpucheck import steps as st
from vllm_guardian.model import Cause, LogEventKind

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check"
RESULTS = REPO / "bench" / "results" / "gpu"
GIB = 1 << 30


def _run(outdir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), str(outdir), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_STATE")}
    env["PYTHON"] = sys.executable  # the repository's venv: the guardian, no torch
    env.pop("VLLM_GUARDIAN_GPU_CHECK_PYTHON", None)
    return env | extra


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# --- without a GPU ----------------------------------------------------------------------------


def test_a_host_without_nvml_gets_one_line_exit_2_and_no_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    p = _run(out, _env())
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert _one_line(p).startswith("gpu-check: no NVIDIA GPU here (NVML")
    assert not out.exists()


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))
    except FileNotFoundError:
        hostneeds.cannot_run("gcc builds the fake NVML library")


def _fake_gpu(tmp_path: Path, *lines: str) -> dict[str, str]:
    state = FakeNvmlState(tmp_path)
    state.write(*lines)
    return {"FAKE_NVML_STATE": str(state.path), "FAKE_NVML_CALLS": str(state.calls_path)}


GPU_LINE = "gpu 0 uuid=GPU-0 name=H100 total=85520809984 used=0 free=85520809984"


def test_nvml_without_gpus_is_no_gpu(tmp_path: Path, fake_lib: Path) -> None:
    p = _run(tmp_path / "r", _env(**_fake_gpu(tmp_path)), "--nvml-library", str(fake_lib))
    assert p.returncode == 2
    assert _one_line(p) == "gpu-check: no NVIDIA GPU here (NVML lists no GPU); nothing to check"


def test_a_gpu_but_no_torch_in_the_workload_python_is_exit_2(
    tmp_path: Path, fake_lib: Path
) -> None:
    p = _run(tmp_path / "r", _env(**_fake_gpu(tmp_path, GPU_LINE)), "--nvml-library", str(fake_lib))
    assert p.returncode == 2
    line = _one_line(p)
    assert line.startswith(f"gpu-check: torch with CUDA is needed in {sys.executable}"), line
    assert "No module named 'torch'" in line


def test_a_gpu_and_torch_without_cuda_is_exit_2(tmp_path: Path, fake_lib: Path) -> None:
    torch_python = REPO / ".venv-plugin" / "bin" / "python"
    if not torch_python.exists():
        hostneeds.cannot_run("scripts/test builds .venv-plugin (torch, CPU build)")
    env = _env(**_fake_gpu(tmp_path, GPU_LINE), VLLM_GUARDIAN_GPU_CHECK_PYTHON=str(torch_python))
    p = _run(tmp_path / "r", env, "--nvml-library", str(fake_lib))
    assert p.returncode == 2
    assert "sees no CUDA device; nothing to check" in _one_line(p)


def test_an_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    p = _run(tmp_path / "r", _env(), "--steps", "nvml_source,warp_drive")
    assert p.returncode == 2
    assert "unknown step(s): warp_drive" in p.stderr


def test_the_bounds_fit_eight_minutes_by_construction() -> None:
    assert set(st.BOUNDS_SECONDS) == {"environment", *st.STEP_NAMES}
    assert sum(st.BOUNDS_SECONDS.values()) <= st.TOTAL_SECONDS <= 8 * 60


# --- verdicts from numbers --------------------------------------------------------------------


def _nvml(**over: object) -> rp.NvmlMeasured:
    # An H100 as measured (bench/results/gpu/h100-run1.json).
    base: dict[str, object] = {
        "nvml_total_bytes": 85520809984,
        "nvml_used_before_bytes": 503316480,
        "nvml_used_during_bytes": 5350686720,
        "torch_total_bytes": 85017493504,
        "held_bytes": 4 * GIB,
        "child_pid": 510,
        "pid_visible": True,
        "process_used_bytes": 4838129664,
        "ancestors_include_parent": True,
        "process_name": "python3",
    }
    return rp.NvmlMeasured(**(base | over))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "measured", "verdict", "said"),
    [
        ("as on the H100", _nvml(), rp.Verdict.PASS, "pid 510 seen holding 4.51 GiB"),
        ("attributed less than held", _nvml(process_used_bytes=GIB), rp.Verdict.FAIL, "pid 510"),
        ("far more than held", _nvml(process_used_bytes=8 * GIB), rp.Verdict.FAIL, "pid 510"),
        ("/proc lost the parent", _nvml(ancestors_include_parent=False), rp.Verdict.FAIL, "pid"),
        (
            "totals disagree",
            _nvml(nvml_total_bytes=90 * GIB),
            rp.Verdict.FAIL,
            "pid 510",
        ),
        (
            "pids hidden, by device right",
            _nvml(pid_visible=False, process_used_bytes=None, other_pids=(4242,)),
            rp.Verdict.PASS,
            "per-process pids not visible",
        ),
        (
            "pids hidden, by device wrong",
            _nvml(pid_visible=False, process_used_bytes=None, nvml_used_during_bytes=600 << 20),
            rp.Verdict.FAIL,
            "per-process pids not visible",
        ),
        ("no total", _nvml(nvml_total_bytes=None), rp.Verdict.FAIL, "NVML gave no total"),
    ],
)
def test_nvml_verdicts(
    case: str, measured: rp.NvmlMeasured, verdict: rp.Verdict, said: str
) -> None:
    r = rp.judge_nvml(measured, parent_pid=478)
    assert (r.verdict, said in r.summary) == (verdict, True), (case, r)


def test_hidden_pids_point_at_the_by_device_setting() -> None:
    r = rp.judge_nvml(_nvml(pid_visible=False, process_used_bytes=None), parent_pid=1)
    assert any("gpu_memory_by_device" in n for n in r.notes)


def _stats(
    reserved_peak: int, allocated_peak: int, reserved: int, allocated: int
) -> dict[str, int]:
    s = dict.fromkeys(STATS_KEYS, 0)
    s |= {
        "reserved_bytes.all.peak": reserved_peak,
        "allocated_bytes.all.peak": allocated_peak,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.current": allocated,
        "segment.all.current": 12,
    }
    return s


def _run_of(
    label: str, overhead: int, *, expandable: bool | None, record_differs: bool = False
) -> rp.FragmentRun:
    stats = _stats(8 * GIB + overhead, 8 * GIB, 9 * GIB, 3 * GIB)
    published = dict(stats)
    if record_differs:
        published["num_alloc_retries"] = 1
    conf = None if label == "default" else "expandable_segments:True"
    record = from_memory_stats(
        published, pid=1, device=0, time_seconds=0.0, interval_seconds=5.0, alloc_conf=conf
    )
    return rp.FragmentRun(
        label=label,
        alloc_conf=conf,
        stats=stats,
        record=record,
        source_error=None,
        expandable_in_use=expandable,
        during=stats,
        after=stats,
        big_request_bytes=2 * GIB,
        big_request_grew_reserved_bytes=2 * GIB,
    )


# The H100's peak overheads: default 2.98 GiB, expandable 2.07 GiB (0.70×).
H100_DEFAULT = 3199442944
H100_EXPANDABLE = 2227765248


@pytest.mark.parametrize(
    ("case", "runs", "plugin", "premise"),
    [
        (
            "as on the H100",
            [
                _run_of("default", H100_DEFAULT, expandable=False),
                _run_of("PYTORCH_ALLOC_CONF", H100_EXPANDABLE, expandable=True),
                _run_of("PYTORCH_CUDA_ALLOC_CONF", H100_EXPANDABLE, expandable=True),
            ],
            rp.Verdict.PASS,
            rp.Verdict.PASS,
        ),
        (
            "a published field differs from torch's",
            [
                _run_of("default", H100_DEFAULT, expandable=False, record_differs=True),
                _run_of("PYTORCH_ALLOC_CONF", H100_EXPANDABLE, expandable=True),
            ],
            rp.Verdict.FAIL,
            rp.Verdict.PASS,
        ),
        (
            "expandable strands as much",
            [
                _run_of("default", H100_DEFAULT, expandable=False),
                _run_of("PYTORCH_ALLOC_CONF", H100_DEFAULT, expandable=True),
            ],
            rp.Verdict.PASS,
            rp.Verdict.FAIL,
        ),
        (
            "the setting was not honoured",
            [
                _run_of("default", H100_DEFAULT, expandable=False),
                _run_of("PYTORCH_ALLOC_CONF", H100_EXPANDABLE, expandable=False),
            ],
            rp.Verdict.PASS,
            rp.Verdict.FAIL,
        ),
        (
            "only the default ran",
            [_run_of("default", H100_DEFAULT, expandable=False)],
            rp.Verdict.PASS,
            rp.Verdict.ERROR,
        ),
        ("nothing ran", [], rp.Verdict.ERROR, rp.Verdict.ERROR),
    ],
)
def test_allocator_verdicts(
    case: str, runs: list[rp.FragmentRun], plugin: rp.Verdict, premise: rp.Verdict
) -> None:
    got = (rp.judge_plugin(runs).verdict, rp.judge_expandable(runs).verdict)
    assert got == (plugin, premise), case


def test_a_record_the_source_could_not_read_is_a_mismatch() -> None:
    run = _run_of("default", 1, expandable=False)
    lost = rp.FragmentRun(**{**run.__dict__, "record": None, "source_error": "no record for pid 1"})
    assert rp.plugin_mismatches(lost) == [
        "the guardian's allocator source read no record (no record for pid 1)"
    ]


@pytest.mark.parametrize(
    ("expandable", "verdict", "winner"),
    [
        (False, rp.Verdict.PASS, "PYTORCH_CUDA_ALLOC_CONF"),  # the H100, torch 2.11
        (True, rp.Verdict.PASS, "PYTORCH_ALLOC_CONF"),
        (None, rp.Verdict.NOT_APPLICABLE, None),
    ],
)
def test_precedence_reports_the_winner(
    expandable: bool | None, verdict: rp.Verdict, winner: str | None
) -> None:
    r = rp.judge_precedence(expandable, "both set")
    assert (r.verdict, r.numbers.get("winner")) == (verdict, winner)


# --- the CUDA OOM the H100 raised, through the log matcher ------------------------------------


def _h100_step(name: str, run: int = 1) -> dict[str, object]:
    doc = json.loads((RESULTS / f"h100-run{run}.json").read_text())
    (step,) = [s for s in doc["steps"] if s["name"] == name]
    numbers: dict[str, object] = step["numbers"]
    return numbers


def test_the_h100_oom_is_named_with_its_sizes_in_every_way_vllm_logs_it() -> None:
    n = _h100_step("cuda_oom")
    tb, message = str(n["traceback"]), str(n["message"])
    assert tb.rstrip().endswith(message.splitlines()[0])  # torch's text, verbatim
    ways = {
        "engine core": st.engine_lines(tb, 510, "EngineCore_DP0"),
        "worker": st.engine_lines(tb, 510, "Worker_TP0"),
        "log record": [
            st.logged_line(
                "torch.OutOfMemoryError", message, 510, "EngineCore_DP0", "11-26 14:08:40"
            )
        ],
    }
    matches = {k: st.first_match(v) for k, v in ways.items()}
    measured = rp.OomMeasured(
        exception_type="torch.OutOfMemoryError",
        message=message,
        requested_bytes=int(str(n["requested_bytes"])),
        total_bytes=int(str(n["total_bytes"])),
        matches=matches,
    )
    r = rp.judge_oom(measured)
    assert r.verdict is rp.Verdict.PASS, r.notes
    assert {m[0] for m in matches.values() if m} == {LogEventKind.CUDA_OOM}


def test_the_oom_text_from_anywhere_else_is_not_evidence() -> None:
    n = _h100_step("cuda_oom")
    tb = str(n["traceback"])
    assert st.first_match(tb.splitlines()) is None  # a bare traceback: no vLLM process wrote it
    assert st.first_match(st.engine_lines(tb, 7, "APIServer")) is None
    assert n["api_server_line_is_evidence"] is False


@pytest.mark.parametrize(
    ("case", "details", "verdict"),
    [
        ("sizes right", {"tried_bytes": "88497801134", "total_bytes": "85018877624"}, "pass"),
        (
            "tried off by 1 GiB",
            {"tried_bytes": str(88497801134 - GIB), "total_bytes": "85018877624"},
            "fail",
        ),
        ("no total", {"tried_bytes": "88497801134"}, "fail"),
    ],
)
def test_oom_sizes_must_parse(case: str, details: dict[str, str], verdict: str) -> None:
    m = rp.OomMeasured(
        "torch.OutOfMemoryError",
        "CUDA out of memory.",
        88497801134,
        85017493504,
        {"engine core": (LogEventKind.CUDA_OOM, details)},
    )
    assert rp.judge_oom(m).verdict.value == verdict, case


def test_an_oom_named_as_something_else_fails() -> None:
    m = rp.OomMeasured("x", "y", 1, 1, {"engine core": (LogEventKind.ENGINE_DEAD, {})})
    assert rp.judge_oom(m).verdict is rp.Verdict.FAIL


# --- the forecast -----------------------------------------------------------------------------


def _forecast(
    first_said: float,
    cause: Cause | None = Cause.GPU_MEMORY_OVERCOMMIT,
    pid: int | None = 706,
    exhausted: float | None = 107.8,
    visible: bool = True,
) -> rp.ForecastMeasured:
    # The H100 run: first forecast 44 s after the growth began, the card out at 107.8 s.
    return rp.ForecastMeasured(
        start_seconds=0.0,
        exhausted_seconds=exhausted,
        rate_bytes_per_second=237 * (1 << 20),
        grower_pid=706,
        pid_visible=visible,
        samples=54,
        points=(rp.ForecastPoint(44.0, first_said, first_said, cause, pid),),
    )


@pytest.mark.parametrize(
    ("case", "measured", "verdict"),
    [
        ("as on the H100 (said 59 s, was 64 s)", _forecast(59.1), rp.Verdict.PASS),
        ("said half the time", _forecast(32.0), rp.Verdict.FAIL),
        ("said twice the time", _forecast(128.0), rp.Verdict.FAIL),
        ("named no cause", _forecast(59.1, cause=None, pid=None), rp.Verdict.FAIL),
        ("named another pid", _forecast(59.1, pid=1), rp.Verdict.FAIL),
        (
            "pids hidden: no name needed",
            _forecast(59.1, None, None, visible=False),
            rp.Verdict.PASS,
        ),
        ("only after the card ran out", _forecast(59.1, exhausted=40.0), rp.Verdict.FAIL),
        ("the card never ran out", _forecast(59.1, exhausted=None), rp.Verdict.ERROR),
    ],
)
def test_forecast_verdicts(case: str, measured: rp.ForecastMeasured, verdict: rp.Verdict) -> None:
    assert rp.judge_forecast(measured).verdict is verdict, case


@pytest.mark.parametrize(
    ("freed", "verdict"),
    [(0.17, rp.Verdict.PASS), (130.0, rp.Verdict.FAIL), (None, rp.Verdict.FAIL)],
)
def test_release_verdicts(freed: float | None, verdict: rp.Verdict) -> None:
    m = rp.ReleaseMeasured(71 * GIB, freed, freed, 41.0, 120.0)
    assert rp.judge_release(m).verdict is verdict


@pytest.mark.parametrize(
    ("durations", "verdict"),
    [
        ([0.0004] * 100, rp.Verdict.PASS),  # the H100: 0.4 ms a collect
        ([0.0004] * 90 + [0.5] * 10, rp.Verdict.FAIL),  # p99 a quarter of a tick
        ([0.0004] * 5, rp.Verdict.ERROR),
    ],
)
def test_cost_verdicts(durations: list[float], verdict: rp.Verdict) -> None:
    assert rp.judge_cost(durations, 2.0).verdict is verdict


# --- the runner and the report ----------------------------------------------------------------


def _ok(name: str) -> Callable[[st.Context, float], list[rp.StepResult]]:
    return lambda ctx, deadline: [rp.StepResult(name, rp.Verdict.PASS, f"{name} fine")]


def _boom(ctx: st.Context, deadline: float) -> list[rp.StepResult]:
    raise RuntimeError("the driver said no")


def _late(ctx: st.Context, deadline: float) -> list[rp.StepResult]:
    raise st.StepTimeout("no ready from the workload in time")


def test_a_step_that_breaks_costs_only_its_own_verdict(tmp_path: Path) -> None:
    said: list[str] = []
    table = {
        "nvml_source": _ok("nvml_source"),
        "cuda_oom": _boom,
        "allocator": _late,
        "vram_release": _ok("vram_release"),
    }
    ctx = st.Context(python=sys.executable, env={}, nvml=None, work_dir=tmp_path)  # type: ignore[arg-type]
    results = st.run_steps(
        ctx,
        list(table),
        tmp_path,
        {"card": "test"},
        {"commit": "abc"},
        time.monotonic(),
        said.append,
        table,
    )
    assert [(r.name, r.verdict) for r in results] == [
        ("nvml_source", rp.Verdict.PASS),
        ("cuda_oom", rp.Verdict.ERROR),
        ("allocator", rp.Verdict.ERROR),
        ("vram_release", rp.Verdict.PASS),
    ]
    assert results[1].summary == "RuntimeError: the driver said no"
    assert "bound 140 s" in results[2].summary
    assert rp.exit_code(results) == 1
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (doc["schema"], doc["verdict"], len(doc["steps"])) == (rp.SCHEMA, "fail", 4)
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| cuda_oom | error |" in md
    assert "Verdict: **fail**" in md


def test_a_spent_total_bound_skips_the_rest_with_a_reason(tmp_path: Path) -> None:
    ctx = st.Context(python=sys.executable, env={}, nvml=None, work_dir=tmp_path)  # type: ignore[arg-type]
    results = st.run_steps(
        ctx,
        ["nvml_source"],
        tmp_path,
        {},
        {},
        time.monotonic() - st.TOTAL_SECONDS - 1,
        lambda _: None,
        {"nvml_source": _ok("nvml_source")},
    )
    assert results[0].verdict is rp.Verdict.ERROR
    assert "total bound was spent" in results[0].summary


@pytest.mark.parametrize("run", [1, 2])
def test_the_committed_h100_reports_passed_every_step(run: int) -> None:
    doc = json.loads((RESULTS / f"h100-run{run}.json").read_text())
    assert doc["schema"] == rp.SCHEMA
    assert doc["host"]["card"] == "NVIDIA H100 80GB HBM3"
    names = [s["name"] for s in doc["steps"]]
    assert names == [
        "nvml_source",
        "nvml_cost",
        "cuda_oom",
        "allocator_plugin",
        "expandable_segments",
        "alloc_conf_precedence",
        "vram_release",
        "neighbour_forecast",
    ]
    assert {s["verdict"] for s in doc["steps"]} == {"pass"}


def test_the_markdown_escapes_table_cells() -> None:
    md = rp.render_markdown({}, [rp.StepResult("x", rp.Verdict.PASS, "a|b\nc")], {})
    assert "| x | pass |  | a\\|b c |" in md
