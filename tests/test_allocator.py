"""Allocator telemetry, daemon side: the file format (a contract both sides share), the source
on real files and real processes, attribution, the derived signals and the diagnosis."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guardian.config import AllocatorSourceConfig, ServiceConfig, SignalsConfig
from vllm_guardian.core import diagnosis
from vllm_guardian.core.allocator import attribute, physical_gpu
from vllm_guardian.core.signals import derive
from vllm_guardian.formats import allocator_format as fmt
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import (
    AllocatorProcess,
    AllocatorReading,
    Cause,
    GpuDevice,
    GpuReading,
    Reading,
    ServiceSnapshot,
    Snapshot,
    SourceKind,
    UnitState,
)
from vllm_guardian.shell.daemon import assemble
from vllm_guardian.sources.allocator import AllocatorCollector

GIB = 1024**3
NOW = 1_795_306_080.0


def stats(**over: int) -> dict[str, int]:
    """A torch.cuda.memory_stats() dict (only the keys the format reads, plus noise)."""
    base = {
        "allocated_bytes.all.current": 12 * GIB,
        "allocated_bytes.all.peak": 14 * GIB,
        "reserved_bytes.all.current": 20 * GIB,
        "reserved_bytes.all.peak": 21 * GIB,
        "active_bytes.all.current": 13 * GIB,
        "active_bytes.all.peak": 15 * GIB,
        "inactive_split_bytes.all.current": 2 * GIB,
        "inactive_split_bytes.all.peak": 3 * GIB,
        "num_alloc_retries": 0,
        "num_ooms": 0,
        "segment.all.current": 180,
        "num_device_alloc": 400,  # keys the format does not use are ignored
    }
    base.update({k.replace("__", "."): v for k, v in over.items()})
    return base


def record(pid: int = 4250, device: int = 0, t: float = NOW, **kw: object) -> fmt.AllocatorStats:
    rec = fmt.from_memory_stats(stats(), pid=pid, device=device, time_seconds=t, interval_seconds=5)
    assert rec is not None
    return dataclasses.replace(rec, **kw)  # type: ignore[arg-type]


# --- the format ------------------------------------------------------------------------------


def test_round_trip_keeps_every_field():
    rec = record(alloc_conf="expandable_segments:True", process_name="VLLM::Worker_TP1",
                 cuda_visible_devices="2,3", largest_free_block_bytes=5 * GIB)  # fmt: skip
    assert fmt.decode(fmt.encode(rec)) == rec
    doc = json.loads(fmt.encode(rec))
    assert doc["schema"] == fmt.SCHEMA
    assert set(doc) == {"schema"} | {f.name for f in dataclasses.fields(fmt.AllocatorStats)}


def test_memory_stats_keys_map_to_fields():
    rec = record()
    assert (rec.allocated_bytes, rec.reserved_bytes, rec.inactive_split_bytes) == (
        12 * GIB, 20 * GIB, 2 * GIB)  # fmt: skip
    assert rec.unallocated_bytes == 8 * GIB and rec.fragmentation_ratio == pytest.approx(0.1)
    # CUDA-less torch's memory_stats() returns {} rather than raising: no record, no exception.
    assert fmt.from_memory_stats({}, pid=1, device=0, time_seconds=0, interval_seconds=5) is None


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"schema": "vllm-guardian.allocator/2"}', "schema"),
        (json.dumps({"schema": fmt.SCHEMA, "pid": 1}).encode(), "missing"),
        (b"x" * (fmt.MAX_FILE_BYTES + 1), "more than a record"),
    ],
)
def test_decode_rejects_with_a_reason(data: bytes, reason: str):
    with pytest.raises(fmt.FormatError, match=reason):
        fmt.decode(data)


def test_decode_rejects_wrong_types_and_ignores_unknown_keys():
    doc = json.loads(fmt.encode(record()))
    for key, bad in (("reserved_bytes", -1), ("ooms", 1.5), ("time_seconds", "x"), ("pid", True)):
        with pytest.raises(fmt.FormatError, match=key):
            fmt.decode(json.dumps({**doc, key: bad}).encode())
    assert fmt.decode(json.dumps({**doc, "future_key": 1}).encode()) == record()


@pytest.mark.parametrize(
    ("name", "parsed"),
    [("4250-0.json", (4250, 0)), ("1-12.json", (1, 12)), (".4250-0.json.tmp", None),
     ("0-0.json", None), ("x-0.json", None), ("4250-0.json~", None)],
)  # fmt: skip
def test_file_names(name: str, parsed: tuple[int, int] | None):
    assert fmt.parse_file_name(name) == parsed


# --- the source on real files ------------------------------------------------------------------


def gone_pid() -> int:
    """The pid of a real process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write(directory: Path, rec: fmt.AllocatorStats) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / fmt.file_name(rec.pid, rec.device)
    path.write_bytes(fmt.encode(rec))
    return path


def collect(directory: Path, now: float = NOW) -> Reading:
    cfg = AllocatorSourceConfig(directory=str(directory))
    return AllocatorCollector(cfg, FakeClock(start=now)).collect()


def test_source_keeps_live_fresh_files_and_drops_stale_and_garbage(tmp_path, caplog):
    me = os.getpid()
    write(tmp_path / "vllm", record(pid=me, device=0, t=NOW - 3))
    write(tmp_path / "vllm", record(pid=me, device=1, t=NOW - 1))
    write(tmp_path, record(pid=gone_pid(), t=NOW))  # process gone
    write(tmp_path, record(pid=os.getppid(), t=NOW - 31))  # not updated for 31 s
    (tmp_path / "vllm" / "77-0.json").write_text("{half a fi")  # garbage
    (tmp_path / "vllm" / "78-0.json").write_bytes(fmt.encode(record(pid=79)))  # name lies
    (tmp_path / "vllm" / ".99-0.json.tmp").write_text("ignored: not a record name")
    (tmp_path / "README").write_text("ignored")
    r = collect(tmp_path)
    assert r.source is SourceKind.ALLOCATOR and r.service is None and r.error is None
    p = r.payload
    assert isinstance(p, AllocatorReading)
    assert [(x.pid, [d.device for d in x.devices]) for x in p.processes] == [(me, [0, 1])]
    assert (p.stale_files, p.unparsable_files) == (2, 2)
    assert p.processes[0].ancestors[0] == os.getppid()
    assert r.hint == "2 stale and 2 unparsable files left out"
    warnings = [m for m in caplog.messages if "allocator files left out: 4" in m]
    assert len(warnings) == 1


def test_source_warns_once_per_change(tmp_path, caplog):
    write(tmp_path, record(pid=gone_pid()))
    c = AllocatorCollector(AllocatorSourceConfig(directory=str(tmp_path)), FakeClock(start=NOW))
    c.collect()
    c.collect()
    assert len([m for m in caplog.messages if "left out" in m]) == 1


def test_no_directory_is_an_observation_not_an_error(tmp_path):
    r = collect(tmp_path / "absent")
    assert r.error is None and r.payload == AllocatorReading(())
    assert r.hint is not None and "not enabled" in r.hint


def test_max_files_bounds_the_work(tmp_path):
    me = os.getpid()
    for dev in range(10):
        write(tmp_path, record(pid=me, device=dev))
    cfg = AllocatorSourceConfig(directory=str(tmp_path), max_files=3)
    p = AllocatorCollector(cfg, FakeClock(start=NOW)).collect().payload
    assert isinstance(p, AllocatorReading) and len(p.processes[0].devices) == 3


# --- attribution and signals (pure) ----------------------------------------------------------

UNIT = UnitState("vllm.service", "active", "running", "success", 4242, 0, 0, 1.0,
                 "/system.slice/vllm.service", None, pids=(4242, 4250))  # fmt: skip


@pytest.mark.parametrize(
    ("proc", "mine"),
    [
        (AllocatorProcess(4250, ()), True),  # a listed pid
        (AllocatorProcess(5000, (), ancestors=(4250, 4242, 1)), True),  # a worker forked later
        (AllocatorProcess(5001, (), cgroup="/system.slice/vllm.service/x"), True),
        (AllocatorProcess(5002, (), cgroup="/system.slice/vllm.service2", ancestors=(1,)), False),
        (AllocatorProcess(5003, ()), False),
    ],
)
def test_attribution(proc: AllocatorProcess, mine: bool):
    got = attribute(AllocatorReading((proc,), 1, 2), UNIT)
    assert got is not None and (got.processes == (proc,)) is mine
    assert (got.stale_files, got.unparsable_files) == (1, 2)
    assert attribute(AllocatorReading((proc,)), None) is None


@pytest.mark.parametrize(
    ("visible", "device", "gpu"),
    [(None, 1, 1), ("2,3", 1, 3), ("GPU-bbb", 0, 5), ("GPU-zzz", 0, 0), ("4", 3, 3)],
)
def test_physical_gpu(visible: str | None, device: int, gpu: int):
    devices = GpuReading((GpuDevice(5, "GPU-bbbb-1", None, None, None, None),))
    assert physical_gpu(record(device=device, cuda_visible_devices=visible), devices) == gpu


def snap(t: float, *recs: fmt.AllocatorStats) -> Snapshot:
    procs: dict[int, list[fmt.AllocatorStats]] = {}
    for r in recs:
        procs.setdefault(r.pid, []).append(r)
    reading = AllocatorReading(tuple(AllocatorProcess(p, tuple(rs)) for p, rs in procs.items()))
    return Snapshot(t, (ServiceSnapshot("vllm", unit=UNIT, allocator=reading),), None)


def signals(history: list[Snapshot]):
    s = derive(history, [ServiceConfig(name="vllm")], SignalsConfig(rate_window_seconds=30))
    return s.services[0]


# (retries, ooms) of pid 4250 on GPU 0 per file time; the window is 30 s.
RATE_CASES = [
    # name, [(time, pid, retries, ooms)], retries/s, recent OOMs
    ("steady", [(0, 4250, 10, 0), (10, 4250, 10, 0), (20, 4250, 10, 0)], 0.0, 0),
    ("climbing", [(0, 4250, 10, 0), (10, 4250, 20, 1), (20, 4250, 30, 1)], 1.0, 1),
    ("first reading is a baseline", [(20, 4250, 5000, 3)], None, None),
    (
        "restart: a drop counts from zero",
        [(0, 4250, 50, 2), (10, 4250, 60, 2), (20, 4250, 4, 0)],
        0.7,
        0,
    ),
    (
        "new pid: a new series, its first file a baseline",
        [(0, 4250, 50, 0), (10, 4250, 60, 0), (20, 4300, 7, 0)],
        1.0,
        0,
    ),
    ("ticks repeat the same file", [(0, 4250, 1, 0), (0, 4250, 1, 0), (10, 4250, 6, 0)], 0.5, 0),
    ("out of the window", [(-60, 4250, 0, 0), (20, 4250, 100, 0)], None, None),
]


@pytest.mark.parametrize(
    ("name", "points", "rate", "ooms"), RATE_CASES, ids=[c[0] for c in RATE_CASES]
)
def test_retry_rate_and_oom_delta(name, points, rate, ooms):
    history = []
    for i, (t, pid, retries, n) in enumerate(points):
        rec = record(pid=pid, t=NOW + t, alloc_retries=retries, ooms=n)
        history.append(snap(NOW + t + 1 + i * 1e-3, rec))
    s = signals(history)
    assert s.allocator_retries_per_second == (None if rate is None else pytest.approx(rate))
    assert s.allocator_recent_ooms == ooms


def test_bytes_and_ratio_per_gpu_and_worst_gpu_for_the_service():
    a = record(pid=4250, device=0, reserved_bytes=20 * GIB, allocated_bytes=12 * GIB,
               inactive_split_bytes=8 * GIB)  # fmt: skip
    b = record(pid=4251, device=1, reserved_bytes=10 * GIB, allocated_bytes=9 * GIB,
               inactive_split_bytes=1 * GIB)  # fmt: skip
    s = signals([snap(NOW, a, b)])
    assert [(g.gpu, g.fragmentation_ratio, g.unallocated_bytes) for g in s.allocator] == [
        (0, pytest.approx(0.4), 8 * GIB), (1, pytest.approx(0.1), 1 * GIB)]  # fmt: skip
    assert s.allocator_reserved_bytes == 30 * GIB and s.allocator_allocated_bytes == 21 * GIB
    assert s.allocator_unallocated_bytes == 9 * GIB
    assert s.allocator_fragmentation_ratio == pytest.approx(0.4)


def test_no_plugin_means_no_values():
    s = signals([Snapshot(NOW, (ServiceSnapshot("vllm", unit=UNIT),), None)])
    assert s.allocator == () and s.allocator_fragmentation_ratio is None
    assert s.allocator_reserved_bytes is None and s.allocator_retries_per_second is None


def test_assemble_gives_each_service_its_own_processes():
    host = AllocatorReading(
        (AllocatorProcess(4250, (record(),)), AllocatorProcess(777, (record(pid=777),))), 0, 1
    )
    other_unit = dataclasses.replace(UNIT, main_pid=777, pids=(777,), control_group=None)
    snapshot = assemble(
        NOW,
        ["vllm", "other", "no-unit"],
        [
            Reading(SourceKind.ALLOCATOR, None, host),
            Reading(SourceKind.UNIT, "vllm", UNIT),
            Reading(SourceKind.UNIT, "other", other_unit),
        ],
        [],
    )
    by = {s.name: s.allocator for s in snapshot.services}
    assert [p.pid for p in by["vllm"].processes] == [4250]  # type: ignore[union-attr]
    assert [p.pid for p in by["other"].processes] == [777]  # type: ignore[union-attr]
    assert by["no-unit"] is None


# --- diagnosis from the allocator files of a bundle ------------------------------------------


def read_bundle(bundle: Path) -> list[fmt.AllocatorStats]:
    """How diagnose reads a bundle's allocator/*.json (docs/allocator-plugin.md)."""
    return [fmt.decode(p.read_bytes()) for p in sorted((bundle / "allocator").glob("*.json"))]


def test_fragmentation_is_diagnosed_from_a_bundles_allocator_files(tmp_path):
    write(tmp_path / "allocator", record(pid=4250, device=0, reserved_bytes=60 * GIB,
          allocated_bytes=31 * GIB, inactive_split_bytes=27 * GIB, alloc_retries=42,
          alloc_conf=None))  # fmt: skip
    write(tmp_path / "allocator", record(pid=4251, device=1))  # a healthy rank
    evidence = diagnosis.evidence_from_allocator(read_bundle(tmp_path))
    assert [e.name for e in evidence] == ["allocator:fragmented", "allocator:retries"]
    assert "45% of the 60.00 GiB" in evidence[0].sentence
    assert "PYTORCH_CUDA_ALLOC_CONF=unset" in evidence[0].sentence
    findings = diagnosis.rank(evidence)
    assert diagnosis.verdict(findings) is Cause.ALLOCATOR_FRAGMENTATION
    assert diagnosis.actionable(findings[0])  # two independent items


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({}, []),  # 10 % stranded: healthy
        ({"inactive_split_bytes": 8 * GIB, "reserved_bytes": 20 * GIB}, ["allocator:fragmented"]),
        ({"inactive_split_bytes": GIB // 2, "reserved_bytes": GIB // 2}, []),  # too small to matter
        ({"alloc_retries": 1}, ["allocator:retries"]),
        (
            {"inactive_split_bytes": 8 * GIB, "reserved_bytes": 20 * GIB, "ooms": 2},
            ["allocator:fragmented", "allocator:ooms"],
        ),
    ],
)
def test_allocator_evidence_table(over: dict[str, int], names: list[str]):
    evidence = diagnosis.evidence_from_allocator([record(**over)])
    assert [e.name for e in evidence] == names
    assert all(e.cause is Cause.ALLOCATOR_FRAGMENTATION and not e.unambiguous for e in evidence)


def test_a_dropped_file_is_not_read_again_while_it_is_unchanged(tmp_path, monkeypatch, caplog):
    """A dead process's files linger; decoding each one every tick cost ~2 ms a tick on a host
    with 33 of them. A dropped file keeps its verdict while its inode, mtime and size stay; the
    verdict's words follow the clock; a changed file is read again; a live file every tick."""
    me = os.getpid()
    write(tmp_path, record(pid=me, device=0, t=NOW))
    write(tmp_path, record(pid=gone_pid(), device=0, t=NOW))
    write(tmp_path, record(pid=os.getppid(), device=0, t=NOW - 31))
    garbage = tmp_path / f"{me}-1.json"
    garbage.write_text("{half a fi")
    decoded: list[bytes] = []
    real = fmt.decode

    def counting(data: bytes) -> fmt.AllocatorStats:
        decoded.append(data)
        return real(data)

    monkeypatch.setattr(fmt, "decode", counting)
    clock = FakeClock(start=NOW)
    c = AllocatorCollector(AllocatorSourceConfig(directory=str(tmp_path)), clock)

    def tick() -> tuple[int, AllocatorReading, str | None]:
        decoded.clear()
        r = c.collect()
        assert isinstance(r.payload, AllocatorReading)
        return len(decoded), r.payload, r.hint

    n, first, hint = tick()
    assert n == 4 and (first.stale_files, first.unparsable_files) == (2, 1), (n, first)
    clock.advance(10)
    write(tmp_path, record(pid=me, device=0, t=NOW + 10))  # the live process writes again
    n, second, hint2 = tick()
    assert n == 1, decoded  # the live file only
    assert (second.stale_files, second.unparsable_files) == (2, 1) and hint2 == hint
    assert [(p.pid, len(p.devices)) for p in second.processes] == [(me, 1)]
    caplog.clear()
    garbage.write_bytes(fmt.encode(record(pid=me, device=1, t=NOW + 10)))  # changed: read again
    n, third, _ = tick()
    assert n == 2, decoded  # the live file and the rewritten one
    assert (third.stale_files, third.unparsable_files) == (2, 0)
    assert [(p.pid, len(p.devices)) for p in third.processes] == [(me, 2)]
    # The warning (the set of dropped files changed) gives the kept verdict's age as of now.
    assert any("not updated for 41 s" in m for m in caplog.messages), caplog.messages
