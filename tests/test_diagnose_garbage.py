"""Garbage bundles give a clear message and a partial report, never a traceback; a tar is never
extracted outside a temporary directory (``..``, absolute paths, links, devices, oversized)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from vllm_guardian.actuators.bundle import BundleWriter
from vllm_guardian.config import ServiceConfig
from vllm_guardian.diagnose import bundle as bundle_mod
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import BundleError, read_bundle, write_bundle
from vllm_guardian.diagnose.gather import whole_lines
from vllm_guardian.diagnose.report import render_text, to_json
from vllm_guardian.model import (
    Action,
    ActionKind,
    Cause,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
    UnitState,
)
from vllm_guardian.tools.cli import main

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def _report(path: Path) -> dict[str, object]:
    r = analyze(read_bundle(path))
    render_text(r)  # the text form must not fail either
    return to_json(r)


def test_missing_files_and_malformed_json(tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(BUNDLES / "prefill_burst", b)
    (b / "manifest.json").unlink()
    (b / "gpus.json").write_text("[{not json")
    (b / "health.json").write_text('"a string"')
    (b / "model_config.json").write_text('{"hidden_size": "big"}')
    (b / "metrics").mkdir()
    (b / "metrics" / "garbage.prom").write_text("x")
    (b / "metrics" / "1795306000.prom").write_text('vllm:kv_cache_usage_perc{engine="0" 1\n{{{{\n')
    (b / "allocator").mkdir()
    (b / "allocator" / "0.json").write_text('{"schema": "something else"}')
    doc = _report(b)
    problems = "\n".join(doc["problems"])  # type: ignore[arg-type]
    for needle in ("manifest.json missing", "gpus.json: not valid JSON", "health.json: expected an object",
                   "model_config.json", "garbage.prom", "malformed", "allocator/0.json"):  # fmt: skip
        assert needle in problems, needle
    # The journal's OOM alone names no cause: with health.json unreadable and the unit active,
    # nothing structural agrees with it (a request's text can reach the log).
    assert doc["verdict"] == "healthy"
    assert any("log lines alone name no cause" in n for n in doc["notes"]), doc["notes"]  # type: ignore[union-attr]
    # The unit's state agrees (its supervisor is restarting it): the journal tells the story.
    unit = json.loads((b / "unit.json").read_text())
    (b / "unit.json").write_text(json.dumps({**unit, "ActiveState": "activating"}))
    assert _report(b)["verdict"] == "prefill_burst"


def test_an_empty_directory_is_a_partial_report(tmp_path: Path) -> None:
    doc = _report(tmp_path)
    assert doc["verdict"] == "healthy" and "manifest.json missing" in doc["problems"][0]  # type: ignore[index]


def test_a_huge_log_keeps_its_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle_mod, "MAX_JOURNAL_BYTES", 64 * 1024)
    b = tmp_path / "b"
    shutil.copytree(BUNDLES / "engine_dead_exit_zero", b)
    tail = (b / "journal.log").read_text()
    (b / "journal.log").write_text("INFO noise " * 200_000 + "\n" + tail)
    doc = _report(b)
    assert doc["verdict"] == "engine_dead"
    assert any("only the last" in p for p in doc["problems"])  # type: ignore[union-attr]


ENGINE_OOM = (
    "(EngineCore_DP0 pid=4300) ERROR 11-22 00:07:30 [core.py:1007] torch.OutOfMemoryError: CUDA "
    "out of memory. Tried to allocate 5.86 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.62 GiB is free."
)


def test_a_tail_that_starts_mid_line_drops_that_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal tail read from a byte offset starts inside some line: one a request wrote could
    have a header exactly there (a long `model` full of them). That partial line is dropped."""
    monkeypatch.setattr(bundle_mod, "MAX_JOURNAL_BYTES", 64 * 1024)
    b = tmp_path / "b"
    shutil.copytree(BUNDLES / "prefill_burst", b)
    request = "(APIServer pid=4242) ERROR 11-22 00:07:30 [serving.py:274] Error with model "
    filler = "(APIServer pid=4242) INFO 11-22 00:07:31 [loggers.py:1] idle\n" * 100
    # The tail (64 KiB) starts exactly at the header inside the request's line.
    pad = "y" * (64 * 1024 - len(ENGINE_OOM) - len(filler) - 2) + "\n"
    (b / "journal.log").write_text(request + "x" * 100_000 + ENGINE_OOM + "\n" + filler + pad)
    doc = _report(b)
    assert not any("CUDA OOM" in e for c in doc["causes"] for e in c["evidence"]), doc["causes"]  # type: ignore[attr-defined,index]
    assert doc["verdict"] == "engine_dead"  # /health 503 still says the engine died


WHOLE_LINES = [
    # log text, read from a byte offset (cut), its lines
    (b"a\nb\n", False, ["a", "b"]),
    (b"a\r\nb", False, ["a", "b"]),
    # split at newlines only: U+2028, U+0085, \x1c and form feeds are a request's text
    ("x\u2028y\x85z\x1c\x0cw\n".encode(), False, ["x\u2028y\x85z\x1c\x0cw"]),
    (b"the end of a line\nnext\n", True, ["next"]),
    (b"no newline at all", True, []),
]


@pytest.mark.parametrize(("data", "cut", "lines"), WHOLE_LINES)
def test_diagnose_reads_whole_lines(data: bytes, cut: bool, lines: list[str]) -> None:
    assert whole_lines(data, cut) == lines


def test_not_a_bundle_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\x00not a tar at all" * 10)
    with pytest.raises(BundleError):
        read_bundle(junk)
    assert main(["diagnose", "--bundle", str(junk)]) == 2
    assert "not a directory or a tar archive" in capsys.readouterr().err


def _add(
    tf: tarfile.TarFile,
    name: str,
    data: bytes = b"x",
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def test_hostile_tar_never_writes_outside_its_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundle_mod, "MAX_MEMBER_BYTES", 1024)
    victim = tmp_path / "outside"
    archive = tmp_path / "evil.tar.gz"
    manifest = json.dumps(
        {"format": 1, "created": "2026-11-22T00:00:00Z", "service": "vllm"}
    ).encode()
    with tarfile.open(archive, "w:gz") as tf:
        _add(tf, "b/manifest.json", manifest)
        _add(tf, "b/../../outside", b"pwned")
        _add(tf, "/tmp/absolute-evil", b"pwned")
        _add(tf, "b/journal.log", kind=tarfile.SYMTYPE, link="/etc/passwd")
        _add(tf, "b/health.json", kind=tarfile.LNKTYPE, link="b/manifest.json")
        _add(tf, "b/dev", kind=tarfile.CHRTYPE)
        _add(tf, "b/fifo", kind=tarfile.FIFOTYPE)
        _add(tf, "b/big.log", b"y" * 4096)
    b = read_bundle(archive)
    problems = "\n".join(b.problems)
    for why in (
        "leaves the bundle",
        "absolute path",
        "a link",
        "not a regular file",
        "larger than",
    ):
        assert why in problems, why
    assert not victim.exists() and not Path("/tmp/absolute-evil").exists()
    assert b.service == "vllm" and b.journal == () and b.health is None
    doc = to_json(analyze(b))
    assert doc["verdict"] == "healthy" and doc["problems"]


def test_tar_round_trip_through_save_bundle(tmp_path: Path) -> None:
    original = read_bundle(BUNDLES / "concurrency_overcommit")
    archive = write_bundle(original, tmp_path / "incident.tar.gz")
    again = read_bundle(archive)
    assert again.scrapes == original.scrapes and again.cmdline == original.cmdline
    assert to_json(analyze(again))["verdict"] == "concurrency_overcommit"


def test_the_policys_bundle_is_read(tmp_path: Path) -> None:
    """The bundle actuators/bundle.py writes before each disruptive action (with flight.jsonl)."""
    oom = (
        "(EngineCore_DP0 pid=4300) ERROR 11-22 00:07:30 [core.py:1007] "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.86 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.62 GiB is free. Of the allocated memory 76.55 GiB is "
        "allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated."
    )
    unit = UnitState("vllm.service", "active", "running", "success", 4242, 1, 0, None, None,
                     ("vllm", "serve", "m", "--max-num-batched-tokens", "16384"), (4242,))  # fmt: skip
    snaps = [
        Snapshot(
            1795306000.0 + i,
            (
                ServiceSnapshot(
                    "vllm",
                    health=HealthProbe(HealthState.ENGINE_DEAD, 503, 0.01),
                    unit=unit,
                    logs=LogReading(
                        (),
                        (LogEvent(LogEventKind.CUDA_OOM, 1795306000.0, oom),) if i == 1 else (),
                        3,
                    ),
                ),
            ),
            GpuReading(
                (
                    GpuDevice(
                        0,
                        "GPU-0",
                        "H100",
                        80 * 2**30,
                        78 * 2**30,
                        2 * 2**30,
                        processes=(GpuProcess(4242, 78 * 2**30),),
                    ),
                )
            ),
        )
        for i in range(3)
    ]
    svc = ServiceConfig(name="vllm", url="http://127.0.0.1:9")  # nothing listens: no scrape
    writer = BundleWriter(tmp_path / "bundles", lambda name: (svc, snaps), timeout_seconds=1.0)
    action = Action(
        1, "vllm", ActionKind.RELAUNCH, Cause.PREFILL_BURST, "OOM", ("log:cuda_oom",), False
    )
    path = writer.capture(action)
    b = read_bundle(path)
    assert b.action is not None and len(b.flight) == 3 and b.unit is not None
    doc = to_json(analyze(b))
    assert doc["verdict"] == "prefill_burst"
    assert doc["recommendation"]["flags"][0]["new"] == "8192"  # type: ignore[index]


def _tar_of(directory: Path, archive: Path, before: list[tuple[str, bytes, bytes]]) -> None:
    """``directory`` as b/…, with ``before`` (name, data, type) stored first."""
    with tarfile.open(archive, "w:gz") as tf:
        for name, data, kind in before:
            _add(tf, name, data, kind=kind)
        for f in sorted(directory.rglob("*")):
            if f.is_file():
                _add(tf, "b/" + f.relative_to(directory).as_posix(), f.read_bytes())


def test_every_member_that_cannot_be_written_is_reported_and_the_rest_read(tmp_path: Path) -> None:
    """Extraction used to stop at the first member that failed to write and dropped
    the rest silently; a stored-twice manifest.json turned prefill_burst into `healthy`."""
    src = BUNDLES / "prefill_burst"
    manifest = (src / "manifest.json").read_bytes()
    archive = tmp_path / "twice.tar.gz"
    _tar_of(
        src,
        archive,
        [
            ("b/manifest.json", manifest, tarfile.REGTYPE),
            ("b/manifest.json", manifest, tarfile.REGTYPE),  # stored twice
            ("b/extra", b"a file", tarfile.REGTYPE),
            ("b/extra", b"", tarfile.DIRTYPE),  # then a directory of that name
            ("b/extra/inside", b"x", tarfile.REGTYPE),  # then a file below it
            ("b/" + "n" * 300, b"x", tarfile.REGTYPE),  # a name no filesystem takes
        ],
    )
    b = read_bundle(archive)
    problems = "\n".join(b.problems)
    for why in ("stored more than once", "a file of that name came first", "cannot be written",
                "name longer than"):  # fmt: skip
        assert why in problems, problems
    assert to_json(analyze(b))["verdict"] == "prefill_burst", problems  # the rest was read


def test_a_small_archive_cannot_cost_unbounded_work(tmp_path: Path) -> None:
    """The 65 KB tar.gz with 64 MiB of `{}` lines in flight.jsonl (74 s and 3.26 GB before):
    only the newest MAX_FLIGHT_RECORDS lines of the last MAX_FLIGHT_BYTES are looked at."""
    archive = tmp_path / "bomb.tar.gz"
    data = b"{}\n" * (64 * 1024 * 1024 // 3)
    with tarfile.open(archive, "w:gz", compresslevel=9) as tf:
        _add(tf, "b/manifest.json", json.dumps({"format": 1, "service": "vllm"}).encode())
        _add(tf, "b/flight.jsonl", data)
        _add(tf, "b/journal.log", b"\n" * (16 * 1024 * 1024))
    assert archive.stat().st_size < 200_000
    b = read_bundle(archive)
    problems = "\n".join(b.problems)
    assert f"only the last {bundle_mod.MAX_FLIGHT_BYTES >> 20} MiB read" in problems
    assert f"newest {bundle_mod.MAX_FLIGHT_RECORDS} used" in problems
    assert len(b.flight) <= bundle_mod.MAX_FLIGHT_RECORDS
    assert len(b.journal) == bundle_mod.MAX_JOURNAL_LINES and "journal.log: over" in problems
    doc = to_json(analyze(b))
    assert doc["problems"]


@pytest.mark.parametrize(
    ("limit", "value", "why"),
    [
        ("MAX_MEMBERS", 5, "more than 5 members"),
        ("MAX_TOTAL_BYTES", 100_000, "the bundle exceeds"),
        ("MAX_READ_BYTES", 100_000, "MiB are spent"),
        ("MAX_SCRAPE_TOTAL_BYTES", 60_000, "of scrapes"),
    ],
)
def test_each_cap_is_reported_when_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, value: int, why: str
) -> None:
    monkeypatch.setattr(bundle_mod, limit, value)
    archive = tmp_path / "b.tar.gz"
    _tar_of(BUNDLES / "concurrency_overcommit", archive, [])
    b = read_bundle(archive)
    assert any(why in p for p in b.problems), b.problems


def test_the_daemons_ticks_give_the_exhaustion_forecast(tmp_path: Path) -> None:
    """Live mode reads the daemon's recent ticks: a neighbour growing shows as a forecast."""
    from vllm_guardian.formats.recorder import to_jsonable

    unit = UnitState("vllm.service", "active", "running", "success", 4242, 1, 0, None, None,
                     ("vllm", "serve", "m"), (4242,))  # fmt: skip

    def tick(t: float) -> Snapshot:
        other = int((1 + 0.05 * t) * 2**30)
        procs = (GpuProcess(4242, 66 * 2**30), GpuProcess(777, other, "python3", "/user.slice"))
        free = 80 * 2**30 - 66 * 2**30 - other
        dev = GpuDevice(0, "GPU-0", "H100", 80 * 2**30, 80 * 2**30 - free, free, processes=procs)
        return Snapshot(
            1795306000.0 + t,
            (ServiceSnapshot("vllm", health=HealthProbe(HealthState.UP, 200, 0.01), unit=unit),),
            GpuReading((dev,)),
        )

    flight = tuple({"snapshot": to_jsonable(tick(float(t)))} for t in range(0, 122, 2))
    b = bundle_mod.Bundle(origin="test", flight=flight, created_seconds=1795306125.0)
    report = analyze(b, "live")
    assert report.signals["headroom_exhaustion_cause"] == "gpu_memory_overcommit"
    assert 100 < report.signals["headroom_exhaustion_seconds"] < 180
    assert "FORECAST (GPU memory exhaustion)" in render_text(report)
    # Without the daemon's ticks there is no series, hence no forecast.
    assert (
        analyze(bundle_mod.Bundle(origin="test"), "live").signals["headroom_exhaustion_seconds"]
        is None
    )
