"""The GPU check's steps: CUDA work in child processes, measured through the guardian's own parts.

Where it sits: ``scripts/gpu-check`` → :func:`vllm_guardian.gpucheck.main` → :func:`run_all`,
which runs each step in turn, hands its numbers to the step's judge in
:mod:`vllm_guardian.gpucheck.report` and rewrites the report after every step (a check cut
short still leaves what it measured). The card is read only through the guardian's NVML
source and allocator source, the log lines only through its matcher, the forecast only
through ``core/forecast``: what is checked is the code the daemon runs. torch lives only in
the child processes (:mod:`vllm_guardian.gpucheck.workload`); this process never imports it.

Each step has a bound (``BOUNDS_SECONDS``), and the whole check another (``TOTAL_SECONDS``):
the bounds add up to less than eight minutes, so one run fits a short GPU lease by
construction. A step that reaches its bound ends with an ``error`` verdict and what it saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from vllm_guardian.config import AllocatorSourceConfig, PolicyConfig
from vllm_guardian.core.forecast import ForecastSettings, MemorySample, Neighbour, forecast
from vllm_guardian.formats.vllm_log_format import match_line
from vllm_guardian.gpucheck import report as rp
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.model import AllocatorReading, GpuDevice, GpuReading
from vllm_guardian.sources.allocator import AllocatorCollector
from vllm_guardian.sources.nvml import DEFAULT_INTERVAL_SECONDS, NvmlCollector

GIB = 1 << 30
MIB = 1 << 20

# Per step, the most it may take (seconds, CUDA start-up of its children included); they add up
# to 465 s, under TOTAL_SECONDS, so the check fits 8 minutes whatever the card does.
BOUNDS_SECONDS: Mapping[str, float] = {
    "environment": 45.0,
    "nvml_source": 40.0,  # nvml_cost is measured inside it
    "allocator": 140.0,  # allocator_plugin, expandable_segments, alloc_conf_precedence
    "cuda_oom": 40.0,
    "neighbour_forecast": 150.0,
    "vram_release": 45.0,
}
TOTAL_SECONDS = 480.0
# The neighbour runs the card out in about this long: the forecast needs five 10 s floors over
# 40 s before it speaks (core/forecast's defaults), which leaves it about a minute of lead.
FORECAST_TARGET_SECONDS = 110.0
# What the step's growing neighbour allocates at a time (one caching-allocator segment each).
GROW_CHUNK_BYTES = 32 * MIB
# The fragmenting workload: allocations per run, and the most it keeps live at once.
FRAGMENT_STEPS = 3000
FRAGMENT_LIVE_MAX_BYTES = 8 * GIB
# The check's own per-process figure, small enough for any card the guardian runs on.
HELD_BYTES = 4 * GIB
COST_COLLECTS = 100
RELEASE_POLL_SECONDS = 0.02
# Memory back within this of the baseline counts as released (the driver's own bookkeeping).
RELEASE_SLACK_BYTES = 256 * MIB


class StepTimeout(Exception):
    """A child did not say what it was asked within the step's bound."""


class Child:
    """One workload process: its JSON events on stdout, its stderr kept (bounded) for errors."""

    def __init__(self, python: str, mode: str, args: Mapping[str, Any], env: Mapping[str, str]):
        self.proc = subprocess.Popen(
            [python, "-m", "vllm_guardian.gpucheck.workload", mode, json.dumps(dict(args))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            text=True,
        )
        self.pid = self.proc.pid
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        threading.Thread(target=self._read_events, args=(self.proc.stdout,), daemon=True).start()
        self._stderr_reader = threading.Thread(
            target=self._read_stderr, args=(self.proc.stderr,), daemon=True
        )
        self._stderr_reader.start()

    def _read_events(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a stray print; stderr has the story
            if isinstance(event, dict):
                self._events.put(event)
        self._events.put(None)

    def _read_stderr(self, stream: IO[str]) -> None:
        for line in stream:
            self._stderr.append(line)
            del self._stderr[:-200]  # keep the tail: a traceback, not a flood

    def stderr_tail(self, chars: int = 4000) -> str:
        return "".join(self._stderr)[-chars:]

    def event(self, deadline: float, *names: str) -> dict[str, Any]:
        """The next event named one of ``names`` before the monotonic ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepTimeout(f"no {'/'.join(names)} from the workload in time")
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if event is None:
                self.proc.wait(timeout=10)
                self._stderr_reader.join(timeout=5)  # its last words, before they are quoted
                raise StepTimeout(
                    f"the workload exited ({self.proc.returncode}) before {'/'.join(names)}: "
                    f"{self.stderr_tail(600).strip()}"
                )
            if event.get("event") in names:
                return event

    def release(self, timeout_seconds: float = 15.0) -> None:
        """Let the child exit (it waits on stdin); kill it if it does not."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@dataclass(frozen=True)
class Context:
    python: str
    env: Mapping[str, str]  # the children's environment (allocator settings removed)
    nvml: NvmlCollector
    work_dir: Path
    uuid: str | None = None  # the card the children use, as NVML names it
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS

    def child(self, mode: str, args: Mapping[str, Any], **env: str) -> Child:
        return Child(self.python, mode, args, {**self.env, **env})

    def device(self) -> GpuDevice:
        reading = self.nvml.collect()
        if not isinstance(reading.payload, GpuReading):
            raise RuntimeError(f"the NVML source failed: {reading.error}")
        return pick_device(reading.payload, self.uuid)


def pick_device(reading: GpuReading, uuid: str | None) -> GpuDevice:
    """The card the children run on: by UUID (torch and NVML agree on it whatever
    CUDA_VISIBLE_DEVICES says), else the first one."""
    for d in reading.devices:
        if uuid is not None and d.uuid == uuid:
            return d
    if not reading.devices:
        raise RuntimeError("NVML lists no GPU")
    return reading.devices[0]


def child_env(base: Mapping[str, str], repo_root: Path) -> dict[str, str]:
    """The children's environment: the package importable from ``repo_root``, no inherited
    allocator setting (each run sets its own), the first visible card only."""
    env = {
        k: v for k, v in base.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), base.get("PYTHONPATH")) if p)
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- the steps --------------------------------------------------------------------------------


def step_nvml(ctx: Context, deadline: float) -> list[rp.StepResult]:
    before = settle(ctx, deadline)
    info_total = before.memory_total_bytes
    held = min(HELD_BYTES, (before.memory_free_bytes or 0) // 4)
    child = ctx.child("hold", {"bytes": held})
    try:
        ready = child.event(deadline, "ready")
        during = ctx.device()
        mine = [p for p in during.processes or () if p.pid == child.pid]
        others = tuple(p.pid for p in during.processes or () if p.pid != child.pid)
        durations = []
        for _ in range(COST_COLLECTS + 1):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            ctx.nvml.collect()
            durations.append(time.perf_counter() - t0)
    finally:
        child.release()
    measured = rp.NvmlMeasured(
        nvml_total_bytes=info_total,
        nvml_used_before_bytes=before.memory_used_bytes,
        nvml_used_during_bytes=during.memory_used_bytes,
        torch_total_bytes=int(ready["torch_total_bytes"]),
        held_bytes=int(ready["held_bytes"]),
        child_pid=child.pid,
        pid_visible=bool(mine),
        process_used_bytes=mine[0].used_memory_bytes if mine else None,
        ancestors_include_parent=(os.getpid() in mine[0].ancestors) if mine else None,
        process_name=mine[0].name if mine else None,
        other_pids=others,
    )
    return [
        rp.judge_nvml(measured, os.getpid()),
        rp.judge_cost(durations[1:], ctx.interval_seconds),  # the first one opens the session
    ]


def _fragment_run(
    ctx: Context, label: str, conf_env: Mapping[str, str], deadline: float, steps: int
) -> tuple[rp.FragmentRun, str | None]:
    out = Path(tempfile.mkdtemp(prefix=f"alloc-{label}-", dir=ctx.work_dir))
    free = ctx.device().memory_free_bytes or 0
    budget = min(FRAGMENT_LIVE_MAX_BYTES, free // 4)
    child = ctx.child(
        "fragment",
        {"out_dir": str(out), "seed": 7, "live_budget_bytes": budget, "steps": steps},
        **conf_env,
    )
    try:
        ev = child.event(deadline, "fragment")
        source = AllocatorCollector(
            AllocatorSourceConfig(directory=str(out), stale_seconds=3600.0), SystemClock()
        )
        reading = source.collect()
        record = None
        error = reading.error
        if isinstance(reading.payload, AllocatorReading):
            for p in reading.payload.processes:
                if p.pid == child.pid and p.devices:
                    record = p.devices[0]
            if record is None:
                error = f"no record for pid {child.pid} ({ev.get('written')} files written)"
    finally:
        child.release()
    conf = conf_env.get("PYTORCH_ALLOC_CONF") or conf_env.get("PYTORCH_CUDA_ALLOC_CONF")
    run = rp.FragmentRun(
        label=label,
        alloc_conf=conf,
        stats=ev["stats"],
        record=record,
        source_error=error,
        expandable_in_use=ev.get("expandable_in_use"),
        during=ev["during"],
        after=ev["after"],
        big_request_bytes=int(ev["big_request_bytes"]),
        big_request_grew_reserved_bytes=int(ev["big_request_grew_reserved_bytes"]),
    )
    return run, child.stderr_tail(1000) or None


EXPANDABLE = "expandable_segments:True"


def step_allocator(ctx: Context, deadline: float) -> list[rp.StepResult]:
    runs = []
    stderr: dict[str, str | None] = {}
    settings: tuple[tuple[str, dict[str, str]], ...] = (
        ("default", {}),
        ("PYTORCH_ALLOC_CONF", {"PYTORCH_ALLOC_CONF": EXPANDABLE}),
        ("PYTORCH_CUDA_ALLOC_CONF", {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}),
    )
    error = None
    for label, conf in settings:
        try:
            run, err = _fragment_run(ctx, label, conf, deadline, FRAGMENT_STEPS)
        except StepTimeout as e:
            error = f"{label}: {e}"
            break
        runs.append(run)
        stderr[label] = err
    out = [rp.judge_plugin(runs), rp.judge_expandable(runs)]
    if error is not None:
        out = [replace(r, notes=(*r.notes, error)) for r in out]
    both = "PYTORCH_ALLOC_CONF=expandable_segments:True, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    try:
        run, err = _fragment_run(
            ctx,
            "both",
            {
                "PYTORCH_ALLOC_CONF": EXPANDABLE,
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
            },
            deadline,
            50,
        )
        prec = rp.judge_precedence(run.expandable_in_use, both)
        if err:
            prec = replace(prec, notes=(*prec.notes, f"torch said: {err.strip()[-400:]}"))
        out.append(prec)
    except StepTimeout as e:
        out.append(rp.errored("alloc_conf_precedence", str(e)))
    return out


def engine_lines(traceback_text: str, pid: int, process: str) -> list[str]:
    """A child's traceback as vLLM's log shows it: every line under the process's prefix
    (``(EngineCore_DP0 pid=N) ...``, what vLLM puts before each line its children write)."""
    return [f"({process} pid={pid}) {line}" for line in traceback_text.splitlines()]


def logged_line(exception_type: str, message: str, pid: int, process: str, when: str) -> str:
    """The exception as vLLM's logger writes it in an engine process (one record, one line)."""
    first = message.splitlines()[0] if message else ""
    return f"({process} pid={pid}) ERROR {when} [core.py:1] {exception_type}: {first}"


def first_match(lines: Sequence[str]) -> tuple[Any, Mapping[str, str]] | None:
    for line in lines:
        found = match_line(line)
        if found is not None:
            return found[0], dict(found[1])
    return None


def step_oom(ctx: Context, deadline: float) -> list[rp.StepResult]:
    child = ctx.child("oom", {"over_bytes": 4 * GIB})
    try:
        ev = child.event(deadline, "oom", "no_oom")
    finally:
        child.release()
    if ev["event"] == "no_oom":
        return [
            rp.StepResult(
                "cuda_oom",
                rp.Verdict.FAIL,
                f"asking for {ev['requested_bytes']} bytes with {ev['free_bytes']} free raised nothing",
                ev,
            )
        ]
    when = time.strftime("%m-%d %H:%M:%S")
    ways = {
        "engine core traceback": engine_lines(ev["traceback"], ev["pid"], "EngineCore_DP0"),
        "worker traceback": engine_lines(ev["traceback"], ev["pid"], "Worker_TP0"),
        "engine core log record": [
            logged_line(ev["exception_type"], ev["message"], ev["pid"], "EngineCore_DP0", when)
        ],
        # The API server's serving code is not evidence: the same text there must not match.
    }
    matches = {k: first_match(v) for k, v in ways.items()}
    result = rp.judge_oom(
        rp.OomMeasured(
            exception_type=ev["exception_type"],
            message=ev["message"],
            requested_bytes=int(ev["requested_bytes"]),
            total_bytes=int(ev["total_bytes"]),
            matches=matches,
        )
    )
    api_line = f"ERROR {when} [serving_completion.py:1] {ev['exception_type']}: {ev['message']}"
    numbers = dict(result.numbers) | {
        "traceback": ev["traceback"][-3000:],
        "api_server_line_is_evidence": match_line(api_line) is not None,
    }
    if match_line(api_line) is not None:
        return [
            replace(
                result,
                verdict=rp.Verdict.FAIL,
                numbers=numbers,
                notes=(*result.notes, "the API server's copy of the text counted as evidence"),
            )
        ]
    return [replace(result, numbers=numbers)]


def _sample(ctx: Context, service_pid: int, generation: float) -> tuple[MemorySample, bool]:
    d = ctx.device()
    procs = d.processes or ()
    visible = any(p.pid == service_pid for p in procs)
    service = sum(p.used_memory_bytes or 0 for p in procs if p.pid == service_pid)
    others = [p for p in procs if p.pid != service_pid]
    sample = MemorySample(
        time_seconds=time.monotonic(),
        free_bytes=d.memory_free_bytes,
        ready=True,
        generation=generation,
        service_bytes=service if visible else None,
        other_bytes=sum(p.used_memory_bytes or 0 for p in others) if visible else None,
        neighbours=tuple(Neighbour(p.pid, p.used_memory_bytes, p.name) for p in others),
    )
    return sample, visible


def step_forecast(ctx: Context, deadline: float) -> list[rp.StepResult]:
    free = settle(ctx, deadline).memory_free_bytes or 0
    headroom = min(24 * GIB, free // 2)
    service = ctx.child("hold", {"bytes": max(0, free - headroom - 2 * GIB)})  # "vLLM"
    grower: Child | None = None
    try:
        service.event(deadline, "ready")
        room = ctx.device().memory_free_bytes or 0
        rate = room / FORECAST_TARGET_SECONDS
        grower = ctx.child(
            "grow",
            {
                "chunk_bytes": GROW_CHUNK_BYTES,
                "rate_bytes_per_second": rate,
                "start_bytes": GROW_CHUNK_BYTES,
                "max_seconds": deadline - time.monotonic(),
            },
        )
        grower.event(deadline, "ready")
        start = time.monotonic()
        samples: list[MemorySample] = []
        points: list[rp.ForecastPoint] = []
        visible = False
        settings = ForecastSettings()
        exhausted: float | None = None
        next_tick = start
        while time.monotonic() < deadline and exhausted is None:
            sample, seen = _sample(ctx, service.pid, float(service.pid))
            visible = visible or seen
            samples.append(sample)
            f = forecast(0, samples, sample.time_seconds, settings)
            if f is not None:
                points.append(
                    rp.ForecastPoint(
                        sample.time_seconds,
                        f.seconds,
                        f.seconds_latest,
                        f.cause,
                        f.neighbour.pid if f.neighbour else None,
                    )
                )
            next_tick += ctx.interval_seconds
            while time.monotonic() < next_tick and exhausted is None:
                try:
                    ev = grower.event(min(next_tick, deadline), "exhausted", "gave_up")
                except StepTimeout:
                    break
                exhausted = float(ev["monotonic"]) if ev["event"] == "exhausted" else -1.0
        measured = rp.ForecastMeasured(
            start_seconds=start,
            exhausted_seconds=exhausted if exhausted is not None and exhausted > 0 else None,
            rate_bytes_per_second=rate,
            grower_pid=grower.pid,
            pid_visible=visible,
            samples=len(samples),
            points=tuple(points),
        )
    finally:
        if grower is not None:
            grower.kill()
        service.kill()
    return [rp.judge_forecast(measured)]


def settle(ctx: Context, deadline: float) -> GpuDevice:
    """The card once the memory of the steps before has come back: used stops falling (two
    reads half a second apart within 64 MiB), at most 10 s."""
    last = ctx.device()
    end = min(deadline, time.monotonic() + 10.0)
    while time.monotonic() < end:
        time.sleep(0.5)
        now = ctx.device()
        if (
            now.memory_used_bytes is None
            or last.memory_used_bytes is None
            or last.memory_used_bytes - now.memory_used_bytes < 64 * MIB
        ):
            return now
        last = now
    return last


def step_release(ctx: Context, deadline: float) -> list[rp.StepResult]:
    before = settle(ctx, deadline)
    baseline = before.memory_used_bytes or 0
    held = int((before.memory_free_bytes or 0) * 0.9)
    child = ctx.child("hold", {"bytes": held})
    try:
        child.event(deadline, "ready")
    except StepTimeout:
        child.kill()
        raise
    timeout = PolicyConfig().vram_release_timeout_seconds
    t0 = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    freed = gone = None
    bound = deadline - t0
    while time.monotonic() < deadline and (freed is None or gone is None):
        d = ctx.device()
        now = time.monotonic() - t0
        if (
            freed is None
            and d.memory_used_bytes is not None
            and d.memory_used_bytes <= baseline + RELEASE_SLACK_BYTES
        ):
            freed = now
        if (
            gone is None
            and d.processes is not None
            and all(p.pid != child.pid for p in d.processes)
        ):
            gone = now
        time.sleep(RELEASE_POLL_SECONDS)
    child.kill()
    return [rp.judge_release(rp.ReleaseMeasured(held, freed, gone, bound, timeout))]


# In the order they run: the long forecast last, so a short lease still gets the others.
STEPS: Mapping[str, Callable[[Context, float], list[rp.StepResult]]] = {
    "nvml_source": step_nvml,
    "cuda_oom": step_oom,
    "allocator": step_allocator,
    "vram_release": step_release,
    "neighbour_forecast": step_forecast,
}
STEP_NAMES = tuple(STEPS)


def host_facts(ctx: Context, info: Mapping[str, Any], reading: GpuReading) -> dict[str, Any]:
    d = pick_device(reading, info.get("uuid"))
    return {
        "card": d.name or info.get("name"),
        "uuid": d.uuid,
        "driver": reading.driver_version,
        "torch": info.get("torch"),
        "torch_cuda": info.get("cuda"),
        "capability": info.get("capability"),
        "memory_total_bytes": d.memory_total_bytes,
        "gpus_on_host": len(reading.devices),
        "python": ctx.python,
    }


def write_report(
    out_dir: Path, host: Mapping[str, Any], steps: Sequence[rp.StepResult], meta: Mapping[str, Any]
) -> None:
    for name, text in (
        ("gpu-check.json", rp.to_json(host, steps, meta)),
        ("gpu-check.md", rp.render_markdown(host, steps, meta)),
    ):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)


def run_steps(
    ctx: Context,
    names: Sequence[str],
    out_dir: Path,
    host: Mapping[str, Any],
    meta: Mapping[str, Any],
    started: float,
    say: Callable[[str], None],
    steps: Mapping[str, Callable[[Context, float], list[rp.StepResult]]] | None = None,
) -> list[rp.StepResult]:
    """Run ``names`` in turn, each within its bound and the check's; the report is rewritten
    after every step. ``steps``: the step functions (tests pass their own)."""
    table = STEPS if steps is None else steps
    results: list[rp.StepResult] = []
    for name in names:
        bound = min(BOUNDS_SECONDS[name], started + TOTAL_SECONDS - time.monotonic())
        t0 = time.monotonic()
        if bound <= 0:
            got = [rp.errored(name, "the check's total bound was spent before this step")]
        else:
            say(f"{name}: running (at most {bound:.0f} s)")
            try:
                got = table[name](ctx, t0 + bound)
            except StepTimeout as e:
                got = [rp.errored(name, f"{e} (bound {bound:.0f} s)")]
            except Exception as e:  # one step's surprise must not cost the others' numbers
                got = [rp.errored(name, f"{type(e).__name__}: {e}")]
        took = time.monotonic() - t0
        for r in got:
            r = replace(r, seconds=took)
            results.append(r)
            say(f"{r.name}: {r.verdict.value}: {r.summary}")
        write_report(out_dir, host, results, meta)
    return results


def interpreter() -> str:
    return os.environ.get("VLLM_GUARDIAN_GPU_CHECK_PYTHON") or sys.executable
