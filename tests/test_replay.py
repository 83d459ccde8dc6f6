"""`vllm-guardian replay`: a recorded incident through a config, against a golden decision log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_fixture
from vllm_guardian.formats.recorder import KEYFRAME_EVERY, FlightRecorder
from vllm_guardian.model import (
    GpuDevice,
    GpuReading,
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
)
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics
from vllm_guardian.tools import replay

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "replay-kv-then-oom.jsonl"
GIB = 1024**3


def recording(path: Path, keyframe_every: int = KEYFRAME_EVERY) -> None:
    """Idle, then KV pressure (the real captures), then relief, then a prefill OOM crash.

    31 ticks: with the default, one keyframe and 30 deltas (recorder.py's format 3)."""
    rec = FlightRecorder(path, 64 * 1024 * 1024, 1, keyframe_every)
    t0 = 1_795_306_000.0
    phases = ["metrics-idle.prom"] * 5 + [
        "metrics-pressure-04.prom",
        "metrics-pressure-07.prom",
        "metrics-pressure-10.prom",
    ] * 4
    phases += ["metrics-idle.prom"] * 10
    counts = 0
    for i, name in enumerate([*phases, None, None, None]):
        t = t0 + 2 * i
        recent: tuple[LogEvent, ...] = ()
        if name is None and counts == 0:
            recent = (
                LogEvent(
                    LogEventKind.CUDA_OOM,
                    t,
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB.",
                    (("tried_bytes", str(6 * GIB)),),
                ),
                LogEvent(
                    LogEventKind.ENGINE_DEAD, t, "EngineDeadError: EngineCore encountered an issue."
                ),
            )
            counts = 1
        health = (
            HealthProbe(HealthState.UP, 200, 0.01)
            if name
            else HealthProbe(HealthState.ENGINE_DEAD, 503, 0.01)
        )
        logs = LogReading(
            ((LogEventKind.CUDA_OOM, counts), (LogEventKind.ENGINE_DEAD, counts)), recent, 100 + i
        )
        scrape = parse_vllm_metrics(read_fixture(name)) if name else None
        gpu = GpuReading(
            (GpuDevice(0, "GPU-0", "H100", 80 * GIB, 70 * GIB, 10 * GIB, processes=()),)
        )
        snap = Snapshot(t, (ServiceSnapshot("vllm", vllm=scrape, health=health, logs=logs),), gpu)
        rec.write({"time": t, "snapshot": snap, "signals": None, "decisions": []})


def run_replay(recording_path: Path, config: Path) -> list[dict]:  # type: ignore[type-arg]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_guardian",
            "replay",
            str(recording_path),
            "-c",
            str(config),
            "--json",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_replay_matches_the_golden_decision_log(tmp_path: Path):
    flight = tmp_path / "flight.jsonl"
    recording(flight)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    lines = run_replay(flight, cfg)
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "decisions changed; rerun with UPDATE_GOLDEN=1 and review the diff"
    )
    whats = [(line["what"], line.get("cause")) for line in lines]
    assert ("gate", "concurrency_overcommit") in whats and ("ungate", None) in whats
    relaunch = [line for line in lines if line["what"] == "action"]
    assert (
        len(relaunch) == 1
        and relaunch[0]["cause"] == "prefill_burst"
        and relaunch[0]["dry_run"] is True
    )


def test_a_new_config_changes_the_outcome(tmp_path: Path):
    flight = tmp_path / "flight.jsonl"
    recording(flight)
    cfg = tmp_path / "c.yaml"
    # With the batched-token floor at vLLM's default there is no rung to step down: the same
    # incident gets a plain restart instead of a relaunch, and no admission gate at 100 % KV.
    cfg.write_text(
        f"state_dir: {tmp_path}\nservices:\n  - name: vllm\npolicy:\n  max_num_batched_tokens_floor: 8192\n"
        "  kv_high_watermark_ratio: 1.0\n  kv_low_watermark_ratio: 0.5\n"
    )
    lines = run_replay(flight, cfg)
    actions = [line["action_kind"] for line in lines if line["what"] == "action"]
    assert actions == ["restart"]
    gates = [line["what"] for line in lines].count("gate")
    assert gates == 2  # only at exactly 100 % (never at 90 %), held 10 s each time


def test_garbage_lines_are_skipped_with_a_message(tmp_path: Path):
    flight = tmp_path / "flight.jsonl"
    recording(flight)
    with flight.open("a") as fh:
        fh.write("{not json\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    out = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", "replay", str(flight), "-c", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "skipped: not JSON" in out.stderr
    assert "relaunch" in out.stdout


def test_hostile_lines_are_reported_and_do_not_change_the_result(tmp_path: Path):
    """A deeply nested line crashed replay; a record with a NaN, infinite,
    future or backwards time silently changed its result. Each is now a reported skip, and the
    decisions are those of the clean recording."""
    clean = tmp_path / "clean.jsonl"
    recording(clean, keyframe_every=1)  # every line whole, so each can be stamped afresh
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    expected = run_replay(clean, cfg)
    lines = clean.read_text().splitlines()

    def stamped(i: int, t: str) -> str:
        rec = json.loads(lines[i])
        return json.dumps(rec).replace(
            f'"time_seconds": {rec["snapshot"]["time_seconds"]}', f'"time_seconds": {t}', 1
        )

    hostile = {
        3: "[" * 100_000 + "]" * 100_000,
        6: stamped(6, "NaN"),  # a bare NaN: Python's json reads it, JSON has none
        9: stamped(9, '"NaN"'),
        12: stamped(12, "1e999"),
        15: stamped(15, "4102444800.0"),  # 2100-01-01: the future
        18: stamped(18, "1795305000.0"),  # 1000 s before the recording began: backwards
        21: stamped(21, "true"),
        24: stamped(24, "1795392000.0"),  # a day ahead of its neighbours: a jump forward
    }
    tampered = tmp_path / "flight.jsonl"
    out_lines = []
    for i, line in enumerate(lines):
        out_lines.append(line)
        if i in hostile:
            out_lines.append(hostile[i])
    tampered.write_text("\n".join(out_lines) + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", "replay", str(tampered), "-c", str(cfg), "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert [json.loads(line) for line in p.stdout.splitlines()] == expected
    for why in (
        "nested too deeply",
        "bare NaN",
        "not a finite number",
        "in the future",
        "goes backwards",
    ):
        assert why in p.stderr, p.stderr
    assert p.stderr.count("skipped:") == len(hostile), p.stderr


def _replay_stderr(flight: Path, cfg: Path) -> tuple[list[dict], str]:  # type: ignore[type-arg]
    p = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", "replay", str(flight), "-c", str(cfg), "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines()], p.stderr


def test_delta_recording_replays_as_the_whole_one(tmp_path: Path):
    """Format 2 (deltas between keyframes) decides exactly as every line written whole, is a
    fraction of its size, and stray lines between deltas do not break the chain."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    whole, deltas = tmp_path / "whole.jsonl", tmp_path / "deltas.jsonl"
    recording(whole, keyframe_every=1)
    recording(deltas)
    assert deltas.stat().st_size < whole.stat().st_size / 3
    expected = run_replay(whole, cfg)
    assert run_replay(deltas, cfg) == expected
    lines = deltas.read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines[:3]] == ["key", "delta", "delta"]
    stray = tmp_path / "stray.jsonl"
    stray.write_text(
        "\n".join(x for line in lines for x in (line, "{not json", "[1]", lines[1])) + "\n"
    )
    got, err = _replay_stderr(stray, cfg)
    assert got == expected
    assert "not JSON" in err and "without the record it applies to" in err


def test_a_lost_delta_line_is_an_error_and_reading_resumes_at_the_next_keyframe(
    tmp_path: Path,
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    flight = tmp_path / "flight.jsonl"
    recording(flight, keyframe_every=10)
    lines = flight.read_text().splitlines()
    flight.write_text("\n".join(lines[:4] + lines[5:]) + "\n")  # line 5 (a delta) lost
    _, err = _replay_stderr(flight, cfg)
    # Lines 6..10 apply to the lost one: each is reported, none is guessed; line 11 is a keyframe.
    assert err.count("without the record it applies to") == 5, err
    assert "delta record 6 without the record it applies to (5)" in err


def test_old_and_unknown_formats(tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    whole = tmp_path / "whole.jsonl"
    recording(whole, keyframe_every=1)
    expected = run_replay(whole, cfg)
    # Format 1 (before keyframes and deltas): the same records without format/seq/kind.
    old = tmp_path / "v1.jsonl"
    v1 = []
    for line in whole.read_text().splitlines():
        rec = json.loads(line)
        for k in ("format", "seq", "kind"):
            del rec[k]
        v1.append(json.dumps(rec))
    old.write_text("\n".join(v1) + "\n")
    assert run_replay(old, cfg) == expected
    # Format 2 (keyframes and deltas, before the histogram counts' own form): its lines are
    # format 3's without that form, and read the same.
    deltas = tmp_path / "deltas.jsonl"
    recording(deltas)
    v2 = tmp_path / "v2.jsonl"
    lines = [json.loads(line) for line in deltas.read_text().splitlines()]
    assert all(rec["format"] == 3 for rec in lines)
    v2.write_text("".join(json.dumps({**rec, "format": 2}) + "\n" for rec in lines))
    assert run_replay(v2, cfg) == expected
    future = tmp_path / "v4.jsonl"
    future.write_text(json.dumps({"format": 4, "seq": 1, "kind": "columns"}) + "\n")
    got, err = _replay_stderr(future, cfg)
    assert got == []
    assert "flight record format 4 is not one this version reads (1, 2, 3)" in err


ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ vllm ")


def test_replay_reads_the_default_config_like_restart_and_prints_utc_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """-c is optional, as for restart and relaunch; people read ISO 8601 UTC, --json keeps
    the Unix seconds."""
    flight = tmp_path / "flight.jsonl"
    recording(flight)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nservices:\n  - name: vllm\n")
    monkeypatch.setattr(replay, "DEFAULT_CONFIG_PATH", str(cfg))
    assert replay.main([str(flight), "--transitions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(ISO_UTC.match(line) for line in lines), lines
    assert lines[0].startswith("2026-11-22T00:")  # the recording starts at 1795306000
    assert replay.main([str(flight), "--json"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert isinstance(first["time_seconds"], float) and first["time_seconds"] > 1_795_306_000

    monkeypatch.setattr(replay, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))
    assert replay.main([str(flight)]) == 2
    assert "give the config to decide with: -c CONFIG" in capsys.readouterr().err
