"""The GPU source (vllm_guardian/sources/nvml.py).

The ``nvml`` backend is driven through the real, unmodified pynvml over a fake
libnvidia-ml.so.1 (tests/fake_nvml/fake_nvml.c) compiled here with gcc; the ``file`` backend
over state files in tmp_path; the pure parsers directly. Process attribution is checked on
real child processes (real /proc) and on a fake /proc tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import hostneeds
from tests.nvml_fake import FakeNvmlState, build_fake_nvml, make_proc_entry
from vllm_guardian.config import NvmlSourceConfig
from vllm_guardian.formats.gpu_state_format import (
    ParsedStateFile,
    StateDevice,
    StateFileError,
    StateProcess,
    StateXid,
    build_state,
    parse_state_file,
)
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.lowio.procfs import parse_cgroup
from vllm_guardian.lowio.procfs import parse_ppid as parse_proc_stat_ppid
from vllm_guardian.model import GpuDevice, GpuProcess, GpuReading, Reading, SourceKind, XidEvent
from vllm_guardian.sources.nvml import NvmlCollector

INTERVAL = 2.0
GIB = 1024**3


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hostneeds.tool(
        "gcc",
        "cannot build the fake libnvidia-ml.so.1 the NVML source is tested against "
        "(apt-get install gcc libc6-dev; scripts/test installs them)",
    )
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


@pytest.fixture
def nvml_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvmlState:
    state = FakeNvmlState(tmp_path)
    monkeypatch.setenv("FAKE_NVML_STATE", str(state.path))
    monkeypatch.setenv("FAKE_NVML_CALLS", str(state.calls_path))
    return state


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def nvml_collector(
    lib: Path | str,
    clock: FakeClock,
    proc_root: Path = Path("/proc"),
    **cfg: object,
) -> NvmlCollector:
    config = NvmlSourceConfig(backend="nvml", library_path=str(lib), **cfg)  # type: ignore[arg-type]
    return NvmlCollector(config, clock, proc_root, interval_seconds=INTERVAL)


@pytest.fixture
def collectors() -> Iterator[list[NvmlCollector]]:
    """Every collector a test makes is closed, so the fake driver is shut down after it."""
    made: list[NvmlCollector] = []
    yield made
    for c in made:
        c.close()


def gpus(reading: Reading) -> GpuReading:
    assert reading.error is None, (reading.error, reading.hint)
    assert reading.source is SourceKind.NVML
    assert reading.service is None
    assert isinstance(reading.payload, GpuReading)
    return reading.payload


def down(reading: Reading) -> tuple[str, str]:
    assert reading.payload is None
    assert reading.error is not None
    assert reading.hint is not None
    return reading.error, reading.hint


# --- pure parsers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ppid"),
    [
        ("1234 (python3) S 1 1234 1234 0 -1 4194560\n", 1),
        ("77 (vllm serve) R 4242 77 77 0 -1\n", 4242),
        ("78 (a) b) (c) S 900 78 78\n", 900),  # comm holding ") (" and spaces
        ("79 () Z 0 0 0\n", 0),
        ("", None),
        ("80 (noclose S 1 2 3", None),
        ("81 (x) S\n", None),
        ("82 (x) S notanumber 1\n", None),
    ],
)
def test_parse_proc_stat_ppid(text: str, ppid: int | None) -> None:
    assert parse_proc_stat_ppid(text) == ppid


@pytest.mark.parametrize(
    ("text", "cgroup"),
    [
        ("0::/system.slice/vllm.service\n", "/system.slice/vllm.service"),
        ("12:memory:/x\n1:cpu:/y\n0::/user.slice/a.scope\n", "/user.slice/a.scope"),
        ("4:memory:/docker/abc\n1:cpu:/\n", None),  # cgroup v1 only: no unified line
        ("0::/\n", "/"),
        ("0::\n", None),
        ("", None),
    ],
)
def test_parse_cgroup(text: str, cgroup: str | None) -> None:
    assert parse_cgroup(text) == cgroup


NOW = 1_800_000_000.0


def state_doc(**top: object) -> dict[str, object]:
    device: dict[str, object] = {
        "index": 0,
        "uuid": "GPU-sim-0",
        "name": "Sim H100 80GB",
        "memory_total_bytes": 80 * GIB,
        "memory_used_bytes": 72 * GIB,
        "utilization_ratio": 0.62,
        "temperature_celsius": 61.0,
        "power_watts": 412.5,
        "processes": [{"pid": 4242, "used_memory_bytes": 70 * GIB}],
        "xid_events": [],
        "lost": False,
    }
    doc: dict[str, object] = {
        "format": 1,
        "time_seconds": NOW - 1.0,
        "driver_version": "sim-1",
        "devices": [device],
    }
    doc.update(top)
    return doc


def with_device(**fields: object) -> dict[str, object]:
    doc = state_doc()
    devices = doc["devices"]
    assert isinstance(devices, list)
    devices[0] = {**devices[0], **fields}
    return doc


def parse(doc: object, **kw: object) -> ParsedStateFile | StateFileError:
    return parse_state_file(json.dumps(doc), NOW, max_age_seconds=6.0, **kw)  # type: ignore[arg-type]


def test_parse_state_file_good() -> None:
    result = parse(state_doc())
    assert isinstance(result, ParsedStateFile)
    assert result.reading == GpuReading(
        devices=(
            GpuDevice(
                index=0,
                uuid="GPU-sim-0",
                name="Sim H100 80GB",
                memory_total_bytes=80 * GIB,
                memory_used_bytes=72 * GIB,
                memory_free_bytes=8 * GIB,  # total - used: the file gave no free
                utilization_ratio=0.62,
                temperature_celsius=61.0,
                power_watts=412.5,
                processes=(GpuProcess(pid=4242, used_memory_bytes=70 * GIB),),
            ),
        ),
        driver_version="sim-1",
    )
    assert result.xid_seq == (("GPU-sim-0", 0),)


def test_parse_state_file_never_invents_missing_values() -> None:
    doc = state_doc(driver_version=None)
    doc["devices"] = [{"index": 3}]
    result = parse(doc)
    assert isinstance(result, ParsedStateFile)
    assert result.reading == GpuReading(
        devices=(GpuDevice(3, None, None, None, None, None, processes=None),), driver_version=None
    )


@pytest.mark.parametrize(
    ("fields", "expect"),
    [
        ({"memory_free_bytes": 5 * GIB}, {"memory_free_bytes": 5 * GIB}),
        ({"processes": []}, {"processes": ()}),
        ({"processes": None}, {"processes": None}),
        (
            {
                "processes": [
                    {"pid": 9, "used_memory_bytes": None},
                    {"pid": 9, "used_memory_bytes": 7},
                ]
            },
            {"processes": (GpuProcess(9, 7),)},
        ),
        (
            {
                "remapped_rows_pending": True,
                "remapped_rows_failed": False,
                "retired_pages_pending": True,
            },
            {
                "remapped_rows_pending": True,
                "remapped_rows_failed": False,
                "retired_pages_pending": True,
            },
        ),
        (
            {"lost": True},
            {
                "memory_total_bytes": None,
                "memory_used_bytes": None,
                "memory_free_bytes": None,
                "utilization_ratio": None,
                "temperature_celsius": None,
                "power_watts": None,
                "processes": None,
                "error": "GPU is lost",
            },
        ),
    ],
)
def test_parse_state_file_device_fields(
    fields: dict[str, object], expect: dict[str, object]
) -> None:
    result = parse(with_device(**fields))
    assert isinstance(result, ParsedStateFile)
    device = result.reading.devices[0]
    for name, value in expect.items():
        assert getattr(device, name) == value, name
    assert device.uuid == "GPU-sim-0"  # identity survives a lost device


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "(top level): expected a JSON object"),
        (json.dumps(state_doc(format=2)), "unsupported format 2"),
        (json.dumps(state_doc(format=None)), "unsupported format None"),
        (json.dumps(state_doc(time_seconds=None)), "time_seconds: is required"),
        (json.dumps(state_doc(time_seconds="now")), "time_seconds: expected a finite number"),
        (json.dumps(state_doc(time_seconds=NOW - 6.5)), "stale: written 6.5 s ago, more than 6 s"),
        (json.dumps(state_doc(time_seconds=NOW + 60)), "60.0 s in the future"),
        (json.dumps(state_doc(devices={"0": {}})), "devices: expected a list"),
        (json.dumps(state_doc(devices=[{"uuid": "x"}])), "devices[0].index: is required"),
        (
            json.dumps(with_device(memory_used_bytes=True)),
            "devices[0].memory_used_bytes: expected an integer",
        ),
        (
            json.dumps(with_device(memory_used_bytes=-1)),
            "devices[0].memory_used_bytes: must not be negative",
        ),
        (json.dumps(with_device(memory_used_bytes=81 * GIB)), "larger than memory_total_bytes"),
        (
            json.dumps(with_device(utilization_ratio=62)),
            "devices[0].utilization_ratio: must be between 0 and 1",
        ),
        (json.dumps(with_device(lost="no")), "devices[0].lost: expected true or false"),
        (
            json.dumps(with_device(processes=[{"pid": 0}])),
            "devices[0].processes[0].pid: must be a positive",
        ),
        (
            json.dumps(with_device(xid_events=[{"seq": 1, "xid": 79}])),
            "xid_events[0].time_seconds: is required",
        ),
        (
            json.dumps(state_doc(devices=[{"index": 0}, {"index": 0, "uuid": "b"}])),
            "devices[1].index: index 0 appears twice",
        ),
    ],
)
def test_parse_state_file_refuses(text: str, error: str) -> None:
    result = parse_state_file(text, NOW, max_age_seconds=6.0)
    assert isinstance(result, StateFileError)
    assert error in result.error
    assert result.hint


def test_parse_state_file_stale_boundary_is_inclusive() -> None:
    assert isinstance(parse(state_doc(time_seconds=NOW - 6.0)), ParsedStateFile)


def xids(*events: tuple[int, int]) -> list[dict[str, object]]:
    return [{"seq": seq, "xid": xid, "time_seconds": NOW - 10 + seq} for seq, xid in events]


@pytest.mark.parametrize(
    ("last_seq", "events", "reported", "high_water"),
    [
        ({}, [(1, 79), (2, 48)], [79, 48], 2),  # first read: everything in the file is new
        ({"GPU-sim-0": 1}, [(1, 79), (2, 48)], [48], 2),
        ({"GPU-sim-0": 2}, [(1, 79), (2, 48)], [], 2),
        ({"GPU-sim-0": 9}, [(1, 13)], [13], 1),  # the writer restarted: seq began again
        ({"GPU-sim-0": 2}, [], [], 0),
        ({"other": 5}, [(2, 31), (1, 13)], [13, 31], 2),  # in seq order
    ],
)
def test_parse_state_file_xid_seq(
    last_seq: dict[str, int], events: list[tuple[int, int]], reported: list[int], high_water: int
) -> None:
    result = parse(with_device(xid_events=xids(*events)), last_xid_seq=last_seq)
    assert isinstance(result, ParsedStateFile)
    assert [e.xid for e in result.reading.xid_events] == reported
    assert all(e.gpu_index == 0 for e in result.reading.xid_events)
    assert result.xid_seq == (("GPU-sim-0", high_water),)


# --- file backend through the collector ------------------------------------------------------


def file_collector(path: Path | None, clock: FakeClock, proc_root: Path) -> NvmlCollector:
    cfg = NvmlSourceConfig(backend="file", state_file=str(path) if path else None)
    return NvmlCollector(cfg, clock, proc_root, interval_seconds=INTERVAL)


def write_state(path: Path, doc: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def test_file_backend_good_file_with_attribution(tmp_path: Path, clock: FakeClock) -> None:
    proc = tmp_path / "proc"
    make_proc_entry(proc, 4242, ppid=4000, comm="python3", cgroup="0::/system.slice/vllm.service\n")
    make_proc_entry(proc, 4000, ppid=1, comm="vllm", cgroup="0::/system.slice/vllm.service\n")
    state = tmp_path / "gpu.json"
    write_state(state, state_doc(time_seconds=clock.time()))
    c = file_collector(state, clock, proc)
    reading = gpus(c.collect())
    (device,) = reading.devices
    assert device.memory_free_bytes == 8 * GIB
    assert device.processes == (
        GpuProcess(
            pid=4242,
            used_memory_bytes=70 * GIB,
            name="python3",
            cgroup="/system.slice/vllm.service",
            ancestors=(4000, 1),
        ),
    )
    assert reading.driver_version == "sim-1"
    c.close()
    c.close()  # idempotent
    assert c.collect().error == "the GPU source is closed"


@pytest.mark.parametrize(
    ("content", "error", "hint"),
    [
        (None, "does not exist", "start the vLLM twin"),
        ("{", "not valid JSON", "rename"),
        (json.dumps({"format": 1}), "time_seconds: is required", "docs/gpu-state-file.md"),
        (json.dumps(state_doc(format=7)), "unsupported format 7", "upgrade"),
    ],
)
def test_file_backend_unusable_file(
    tmp_path: Path, clock: FakeClock, content: str | None, error: str, hint: str
) -> None:
    state = tmp_path / "gpu.json"
    if content is not None:
        state.write_text(content)
    got_error, got_hint = down(file_collector(state, clock, tmp_path).collect())
    assert str(state) in got_error
    assert error in got_error
    assert hint in got_hint


def test_file_backend_without_state_file(tmp_path: Path, clock: FakeClock) -> None:
    error, hint = down(file_collector(None, clock, tmp_path).collect())
    assert "no state file" in error
    assert "sources.nvml.state_file" in hint


def test_file_backend_stale_after_three_intervals(tmp_path: Path, clock: FakeClock) -> None:
    state = tmp_path / "gpu.json"
    write_state(state, state_doc(time_seconds=clock.time()))
    c = file_collector(state, clock, tmp_path)
    assert gpus(c.collect()).devices[0].memory_used_bytes == 72 * GIB
    clock.advance(3 * INTERVAL)
    assert c.collect().error is None
    clock.advance(0.5)
    error, hint = down(c.collect())
    assert "stale: written 6.5 s ago" in error
    assert "stopped updating" in hint
    write_state(state, state_doc(time_seconds=clock.time()))
    assert c.collect().error is None  # fresh again: up again


def test_file_backend_reports_each_xid_once(tmp_path: Path, clock: FakeClock) -> None:
    state = tmp_path / "gpu.json"
    c = file_collector(state, clock, tmp_path)
    write_state(state, with_device(time_seconds=clock.time(), xid_events=xids((1, 79))))
    assert gpus(c.collect()).xid_events == (XidEvent(0, 79, NOW - 9),)
    assert gpus(c.collect()).xid_events == ()
    write_state(state, with_device(time_seconds=clock.time(), xid_events=xids((1, 79), (2, 48))))
    assert gpus(c.collect()).xid_events == (XidEvent(0, 48, NOW - 8),)
    # A broken file in between does not lose the high-water mark.
    state.write_text("garbage")
    assert c.collect().error is not None
    write_state(state, with_device(time_seconds=clock.time(), xid_events=xids((1, 79), (2, 48))))
    assert gpus(c.collect()).xid_events == ()


def test_file_backend_lost_device_keeps_others(tmp_path: Path, clock: FakeClock) -> None:
    doc = state_doc(time_seconds=clock.time())
    devices = doc["devices"]
    assert isinstance(devices, list)
    devices.append(
        {**devices[0], "index": 1, "uuid": "GPU-sim-1", "lost": True, "xid_events": xids((1, 79))}
    )
    state = tmp_path / "gpu.json"
    write_state(state, doc)
    reading = gpus(file_collector(state, clock, tmp_path).collect())
    ok, lost = reading.devices
    assert ok.error is None
    assert ok.memory_used_bytes == 72 * GIB
    assert lost.error == "GPU is lost"
    assert (lost.memory_used_bytes, lost.processes, lost.uuid) == (None, None, "GPU-sim-1")
    assert reading.xid_events == (XidEvent(1, 79, NOW - 9),)


# --- nvml backend over the fake driver ------------------------------------------------------


def test_nvml_reports_every_value(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    nvml_state.write(
        "driver 550.54.15",
        f"gpu 0 uuid=GPU-aaa name=NVIDIA_H100_80GB_HBM3 total={80 * GIB} used={30 * GIB} "
        "util=42 temp=55 power_mw=312500 remap=1,0 retired=1",
        f"gpu 1 total={80 * GIB} used={GIB} free={70 * GIB} util=na temp=na power_mw=na "
        "remap=na retired=na procs=na",
    )
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    reading = gpus(c.collect())
    assert reading.driver_version == "550.54.15"
    assert reading.xid_events == ()
    assert reading.devices == (
        GpuDevice(
            index=0,
            uuid="GPU-aaa",
            name="NVIDIA H100 80GB HBM3",
            memory_total_bytes=80 * GIB,
            memory_used_bytes=30 * GIB,
            memory_free_bytes=50 * GIB,
            utilization_ratio=0.42,
            temperature_celsius=55.0,
            power_watts=312.5,
            processes=(),
            remapped_rows_pending=True,
            remapped_rows_failed=False,
            retired_pages_pending=True,
        ),
        # Not supported on this GPU: absent, and not an error.
        GpuDevice(
            index=1,
            uuid="GPU-fake-1",
            name="Fake H100 80GB",
            memory_total_bytes=80 * GIB,
            memory_used_bytes=GIB,
            memory_free_bytes=70 * GIB,
            processes=None,
        ),
    )


# An H100 as measured (bench/results/gpu/): NVML's v1 total and used include 480 MiB the
# driver reserves; v2 reports it apart, and total - reserved and v2's used are exactly what
# CUDA (cudaMemGetInfo, hence vLLM's gpu_memory_utilization) counts.
H100_TOTAL = 85520809984
H100_RESERVED = 503316480


@pytest.mark.parametrize(
    ("driver", "total", "used", "free"),
    [
        # A driver with nvmlDeviceGetMemoryInfo_v2 (R510 and later): CUDA's view.
        ("v2", H100_TOTAL - H100_RESERVED, 4847370240, 80170123264),
        # An older driver: v1, the reservation counted as used.
        ("v1", H100_TOTAL, 4847370240 + H100_RESERVED, 80170123264),
    ],
)
def test_nvml_memory_is_what_cuda_counts_where_the_driver_says(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    driver: str,
    total: int,
    used: int,
    free: int,
) -> None:
    v2 = "" if driver == "v2" else " memory_v2=0"
    nvml_state.write(
        f"gpu 0 total={H100_TOTAL} reserved={H100_RESERVED} "
        f"used={4847370240 + H100_RESERVED} free=80170123264{v2}"
    )
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    for _ in range(2):  # the first read finds out which call the driver has; the second uses it
        (d,) = gpus(c.collect()).devices
        assert (d.memory_total_bytes, d.memory_used_bytes, d.memory_free_bytes) == (
            total,
            used,
            free,
        )
    assert nvml_state.calls("nvmlDeviceGetMemoryInfo_v2") == (2 if driver == "v2" else 1)


def test_nvml_gpus_appear_and_disappear(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    steps = [
        (["gpu 0"], ["GPU-fake-0"]),
        (["gpu 0", "gpu 1", "gpu 2"], ["GPU-fake-0", "GPU-fake-1", "GPU-fake-2"]),
        (["gpu 0"], ["GPU-fake-0"]),
        ([], []),
        (["gpu 0 uuid=GPU-new"], ["GPU-new"]),
    ]
    for lines, uuids in steps:
        nvml_state.write("driver 1", *lines)
        reading = gpus(c.collect())
        assert [d.uuid for d in reading.devices] == uuids
        assert [d.index for d in reading.devices] == list(range(len(uuids)))
    assert nvml_state.calls("nvmlInitWithFlags") == 1  # one session throughout


def test_nvml_static_facts_are_read_once_per_session_and_values_every_tick(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    """A GPU's handle, UUID and name (and the driver's version) do not change within an NVML
    session: read once per device, again when the device count changes, a device fails, or
    the session starts over. Memory is read every tick, and every change shows."""
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    static = ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID", "nvmlDeviceGetName")

    def counts() -> list[int]:
        return [nvml_state.calls(n) for n in (*static, "nvmlSystemGetDriverVersion")]

    for used in (1, 2, 3):
        nvml_state.write("driver 1", f"gpu 0 used={used * GIB}", "gpu 1 uuid=GPU-b")
        reading = gpus(c.collect())
        assert [d.memory_used_bytes for d in reading.devices] == [used * GIB, 0]
        assert [d.uuid for d in reading.devices] == ["GPU-fake-0", "GPU-b"]
    assert counts() == [2, 2, 2, 1]
    assert nvml_state.calls("nvmlDeviceGetMemoryInfo_v2") == 6  # this driver has v2
    # A third GPU: every device is read afresh (indices may now name other GPUs).
    nvml_state.write("driver 1", "gpu 0 uuid=GPU-x", "gpu 1 uuid=GPU-y", "gpu 2 uuid=GPU-z")
    assert [d.uuid for d in gpus(c.collect()).devices] == ["GPU-x", "GPU-y", "GPU-z"]
    assert counts() == [5, 5, 5, 1]
    # A device that fails is read afresh once it answers again.
    nvml_state.write("driver 1", "gpu 0 uuid=GPU-x", "gpu 1 lost=1", "gpu 2 uuid=GPU-z")
    assert [d.error for d in gpus(c.collect()).devices] == [None, "GPU is lost", None]
    nvml_state.write("driver 1", "gpu 0 uuid=GPU-x", "gpu 1 uuid=GPU-w", "gpu 2 uuid=GPU-z")
    assert [d.uuid for d in gpus(c.collect()).devices] == ["GPU-x", "GPU-w", "GPU-z"]
    assert counts()[:3] == [6, 6, 6]
    # A new session (the driver went away and came back) reads everything again.
    nvml_state.write("count_rc 9")
    assert c.collect().error is not None
    nvml_state.write("driver 2", "gpu 0 uuid=GPU-x")
    reading = gpus(c.collect())
    assert (reading.driver_version, reading.devices[0].uuid) == ("2", "GPU-x")
    assert counts() == [7, 7, 7, 2]


def test_nvml_lost_gpu_is_listed_and_others_keep_reporting(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    nvml_state.write(f"gpu 0 used={GIB}", "gpu 1 lost=1", f"gpu 2 used={2 * GIB}")
    reading = gpus(c.collect())
    assert [d.memory_used_bytes for d in reading.devices] == [GIB, None, 2 * GIB]
    assert [d.error for d in reading.devices] == [None, "GPU is lost", None]
    lost = reading.devices[1]
    assert (lost.index, lost.uuid, lost.memory_free_bytes, lost.processes) == (1, None, None, None)
    # The GPU comes back (after a reset): it reports again without a new session, and its
    # XID events, which it could not be registered for while lost, now arrive.
    back = (f"gpu 0 used={GIB}", f"gpu 1 used={3 * GIB}", f"gpu 2 used={2 * GIB}")
    nvml_state.write(*back)
    assert [d.memory_used_bytes for d in gpus(c.collect()).devices] == [GIB, 3 * GIB, 2 * GIB]
    nvml_state.write(*back, "xid 1 79 1")
    assert gpus(c.collect()).xid_events == (XidEvent(1, 79, clock.time()),)


@pytest.mark.parametrize(
    ("util_rc", "error", "utilization"),
    [
        (15, "GPU is lost", None),  # fell off the bus between two queries: nothing is kept
        (16, "GPU requires restart", None),
        (999, None, None),  # an odd sensor error: only that value is absent
        (0, None, 0.07),
    ],
)
def test_nvml_error_midway_through_a_device(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    util_rc: int,
    error: str | None,
    utilization: float | None,
) -> None:
    nvml_state.write(f"gpu 0 used={GIB} util=7 util_rc={util_rc}", f"gpu 1 used={GIB}")
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    d0, d1 = gpus(c.collect()).devices
    assert d0.error == error
    assert d0.utilization_ratio == utilization
    assert d0.uuid == "GPU-fake-0"
    assert d0.memory_used_bytes == (None if error else GIB)
    assert d0.temperature_celsius == (None if error else 40.0)
    assert (d1.error, d1.memory_used_bytes) == (None, GIB)


class Children:
    """Real processes for the attribution test; every one is stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.groups: list[int] = []

    def sleeper(self) -> int:
        p = subprocess.Popen(["sleep", "60"], text=True)
        self.procs.append(p)
        return p.pid

    def grandchild(self) -> tuple[int, int]:
        """A shell that starts ``sleep``: returns (shell pid, sleep pid)."""
        p = subprocess.Popen(
            ["sh", "-c", "sleep 60 & echo $!; wait"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group, so stopping it stops the grandchild too
        )
        self.procs.append(p)
        self.groups.append(p.pid)
        assert p.stdout is not None
        pid = int(p.stdout.readline())
        # The forked shell becomes `sleep` only once it has exec'd: wait for that, not a while.
        comm = Path(f"/proc/{pid}/comm")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and comm.read_text().strip() != "sleep":
            time.sleep(0.01)
        assert comm.read_text().strip() == "sleep", f"pid {pid} is {comm.read_text()!r} after 60 s"
        return p.pid, pid

    def stop(self) -> None:
        for pgid in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def children() -> Iterator[Children]:
    c = Children()
    try:
        yield c
    finally:
        c.stop()


def test_nvml_processes_attributed_from_real_proc(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    children: Children,
) -> None:
    child = children.sleeper()
    shell, grandchild = children.grandchild()
    own_cgroup = parse_cgroup(Path("/proc/self/cgroup").read_text())
    nvml_state.write(
        "gpu 0",
        "gpu 1",
        # The same process in both lists is listed once, with the usage the driver knows.
        f"proc 0 compute {child} na",
        f"proc 0 graphics {child} {5 * GIB}",
        f"proc 0 compute {grandchild} na",
        f"proc 1 compute {grandchild} {GIB}",
    )
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    d0, d1 = gpus(c.collect()).devices
    assert d0.processes is not None
    assert d1.processes is not None
    by_pid = {p.pid: p for p in d0.processes}
    assert sorted(by_pid) == sorted([child, grandchild])
    assert by_pid[child].used_memory_bytes == 5 * GIB
    assert by_pid[child].name == "sleep"
    assert by_pid[child].cgroup == own_cgroup
    assert by_pid[child].ancestors[0] == os.getpid()
    assert by_pid[child].ancestors[-1] == 1
    assert by_pid[grandchild].used_memory_bytes is None  # the driver could not say
    assert by_pid[grandchild].ancestors[:2] == (shell, os.getpid())
    assert d1.processes == (
        GpuProcess(grandchild, GIB, "sleep", own_cgroup, by_pid[grandchild].ancestors),
    )


def test_nvml_processes_attributed_from_fake_proc(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc"
    make_proc_entry(
        proc, 501, ppid=500, comm="VLLM::EngineCor", cgroup="0::/system.slice/vllm-a.service\n"
    )
    make_proc_entry(proc, 500, ppid=400, comm="vllm", cgroup="0::/system.slice/vllm-a.service\n")
    make_proc_entry(proc, 400, ppid=1, comm="systemd", cgroup=None)
    make_proc_entry(proc, 600, ppid=1, comm="python (worker)", cgroup="7:memory:/x\n")  # orphan, v1
    make_proc_entry(proc, 700, ppid=650, comm=None, cgroup=None)  # parent unreadable
    make_proc_entry(proc, 800, ppid=801, comm="loop", cgroup=None)
    make_proc_entry(proc, 801, ppid=800, comm="loop", cgroup=None)  # a /proc that lies
    # pid 900: not in this PID namespace at all
    nvml_state.write("gpu 0", *(f"proc 0 compute {pid} 1024" for pid in (501, 600, 700, 800, 900)))
    c = nvml_collector(fake_lib, clock, proc)
    collectors.append(c)
    (device,) = gpus(c.collect()).devices
    assert device.processes == (
        GpuProcess(501, 1024, "VLLM::EngineCor", "/system.slice/vllm-a.service", (500, 400, 1)),
        GpuProcess(600, 1024, "python (worker)", None, (1,)),
        GpuProcess(700, 1024, None, None, (650,)),
        GpuProcess(800, 1024, "loop", None, (801,)),
        GpuProcess(900, 1024, None, None, ()),
    )


def test_nvml_xid_events_delivered_once(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    # Like the real driver, an event from before the event set existed is never delivered.
    nvml_state.write("gpu 0", "xid 0 31 1")
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    assert gpus(c.collect()).xid_events == ()
    nvml_state.write("gpu 0", "gpu 1", "xid 0 31 1", "xid 0 79 2", "xid 0 48 3")
    # Events queued since the first collect come now, once each, in order; gpu 1 appeared
    # and is registered on this collect.
    first = gpus(c.collect()).xid_events
    assert first == (XidEvent(0, 79, clock.time()), XidEvent(0, 48, clock.time()))
    clock.advance(INTERVAL)
    assert gpus(c.collect()).xid_events == ()
    nvml_state.write("gpu 0", "gpu 1", "xid 0 31 1", "xid 0 79 2", "xid 0 48 3", "xid 1 94 4")
    assert gpus(c.collect()).xid_events == (XidEvent(1, 94, clock.time()),)
    assert gpus(c.collect()).xid_events == ()


def test_nvml_library_missing_then_appears_after_backoff(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    tmp_path: Path,
) -> None:
    nvml_state.write("driver 550", "gpu 0")
    # Another library was in use before (pynvml keeps it and its function pointers in
    # module globals): the one that appears at library_path must be the one called.
    before = nvml_collector(fake_lib, clock)
    assert gpus(before.collect()).driver_version == "550"
    before.close()
    lib = tmp_path / "driver" / "libnvidia-ml.so.1"
    c = nvml_collector(lib, clock)
    collectors.append(c)
    error, hint = down(c.collect())
    assert f"NVML library not found at {lib}" in error
    assert "next init retry at 2027-01-15T08:00:02Z" in error  # FakeClock start + one interval
    assert hint == (
        "NVML library not found: install the NVIDIA driver or set sources.nvml.library_path"
    )
    build_fake_nvml(tmp_path, variant="-b")
    lib.parent.mkdir()
    (tmp_path / "libnvidia-ml.so.1").rename(lib)
    clock.advance(INTERVAL - 0.1)
    assert "next init retry at 2027-01-15T08:00:02Z" in down(c.collect())[0]  # backing off
    clock.advance(0.1)
    reading = gpus(c.collect())
    assert [d.uuid for d in reading.devices] == ["GPU-fake-0"]
    assert reading.driver_version == "550-b"


def test_nvml_init_backoff_doubles_and_is_capped(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    nvml_state.write("init_rc 9", "gpu 0")
    c = nvml_collector(fake_lib, clock, init_retry_max_seconds=10.0)
    collectors.append(c)
    attempts_at: list[float] = []
    start = clock.monotonic()
    for _ in range(60):  # 30 s in half-second ticks
        before = nvml_state.calls("nvmlInitWithFlags")
        error, hint = down(c.collect())
        if nvml_state.calls("nvmlInitWithFlags") > before:
            attempts_at.append(clock.monotonic() - start)
        assert error.startswith("NVML init failed: Driver Not Loaded; next init retry at ")
        assert "kernel driver is not loaded" in hint
        clock.advance(0.5)
    # Delays 2, 4, 8, then capped at 10.
    assert attempts_at == [0.0, 2.0, 6.0, 14.0, 24.0]
    nvml_state.write("gpu 0")  # the driver loads
    clock.advance(34.0 - 30.0)
    assert gpus(c.collect()).devices[0].uuid == "GPU-fake-0"
    assert nvml_state.calls("nvmlInitWithFlags") == 6


@pytest.mark.parametrize(
    ("init_rc", "error", "hint"),
    [
        (9, "Driver Not Loaded", "kernel driver is not loaded"),
        (4, "Insufficient Permissions", "/dev/nvidia*"),
        (18, "RM has detected an NVML/RM version mismatch.", "reboot"),
        (999, "Unknown Error", "nvidia-smi"),
    ],
)
def test_nvml_init_failures_have_hints(
    fake_lib: Path,
    nvml_state: FakeNvmlState,
    clock: FakeClock,
    collectors: list[NvmlCollector],
    init_rc: int,
    error: str,
    hint: str,
) -> None:
    nvml_state.write(f"init_rc {init_rc}", "gpu 0")
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    got_error, got_hint = down(c.collect())
    assert got_error.startswith(f"NVML init failed: {error}; next init retry at ")
    assert hint in got_hint


def test_nvml_session_lost_midway_reinitialises(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector]
) -> None:
    nvml_state.write("gpu 0")
    c = nvml_collector(fake_lib, clock)
    collectors.append(c)
    assert gpus(c.collect()).devices
    nvml_state.write("count_rc 9", "gpu 0")
    error, hint = down(c.collect())
    assert error == "NVML device count failed: Driver Not Loaded"
    assert "kernel driver" in hint
    assert nvml_state.calls("nvmlShutdown") == 1  # the broken session was released
    nvml_state.write("gpu 0")
    assert gpus(c.collect()).devices[0].uuid == "GPU-fake-0"  # re-initialised at once
    assert nvml_state.calls("nvmlInitWithFlags") == 2


def test_nvml_library_that_is_not_a_library(
    nvml_state: FakeNvmlState, clock: FakeClock, collectors: list[NvmlCollector], tmp_path: Path
) -> None:
    bogus = tmp_path / "libnvidia-ml.so.1"
    bogus.write_text("not an ELF file")
    c = nvml_collector(bogus, clock)
    collectors.append(c)
    error, hint = down(c.collect())
    assert error.startswith(f"cannot load NVML library {bogus}: ")
    assert "library_path" in hint


def test_nvml_close_releases_the_driver(
    fake_lib: Path, nvml_state: FakeNvmlState, clock: FakeClock
) -> None:
    nvml_state.write("gpu 0")
    c = nvml_collector(fake_lib, clock)
    assert gpus(c.collect()).devices
    c.close()
    c.close()
    assert nvml_state.calls("nvmlEventSetFree") == 1
    assert nvml_state.calls("nvmlShutdown") == 1
    assert c.collect().error == "the GPU source is closed"


def test_disabled_source_reports_itself_down(tmp_path: Path, clock: FakeClock) -> None:
    c = NvmlCollector(NvmlSourceConfig(enabled=False), clock, tmp_path)
    assert c.kind is SourceKind.NVML
    assert c.timeout_seconds == 3.0
    assert "disabled" in (c.collect().error or "")


# Without library_path pynvml loads libnvidia-ml.so.1 from the loader path and keeps it in a
# module global, so these cases each need an interpreter of their own.
_CHILD = textwrap.dedent(
    """
    import ctypes, json, sys
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        real = True
    except OSError:
        real = False
    from pathlib import Path
    from vllm_guardian.lowio.clock import FakeClock
    from vllm_guardian.config import NvmlSourceConfig
    from vllm_guardian.sources.nvml import NvmlCollector
    c = NvmlCollector(NvmlSourceConfig(), FakeClock(), Path("/proc"))
    r = c.collect()
    c.close()
    n = len(r.payload.devices) if r.payload is not None else None
    print(json.dumps({"found": real, "error": r.error, "hint": r.hint, "devices": n}))
    """
)


@pytest.mark.parametrize("on_loader_path", [False, True])
def test_nvml_default_library_lookup(
    fake_lib: Path, nvml_state: FakeNvmlState, on_loader_path: bool
) -> None:
    nvml_state.write("gpu 0", "gpu 1")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if on_loader_path:
        env["LD_LIBRARY_PATH"] = str(fake_lib.parent)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    result = json.loads(out.stdout)
    if on_loader_path:
        assert result == {"found": True, "error": None, "hint": None, "devices": 2}
        return
    if result["found"]:
        pytest.skip(
            "this host has a real libnvidia-ml.so.1 on the loader path, so NVML's absence "
            "cannot be seen here (the CI hosts have none; the case runs there)"
        )
    assert result["devices"] is None
    assert result["error"].startswith(
        "NVML init failed: NVML Shared Library Not Found; next init retry at "
    )
    assert (
        result["hint"]
        == "NVML library not found: install the NVIDIA driver or set sources.nvml.library_path"
    )


def test_the_state_file_round_trips_through_its_one_module() -> None:
    """The twin's writer and the source's reader are one format (gpu_state_format.py)."""
    device = StateDevice(
        80 * GIB,
        (StateProcess(4242, 70 * GIB), StateProcess(77, 2 * GIB)),
        0.5,
        (StateXid(1, 79, 1_800_000_000.0),),
    )
    doc = build_state(device, 1_800_000_001.0)
    parsed = parse_state_file(json.dumps(doc), 1_800_000_002.0)
    assert isinstance(parsed, ParsedStateFile), parsed
    (gpu,) = parsed.reading.devices
    assert (gpu.memory_total_bytes, gpu.memory_used_bytes) == (80 * GIB, 72 * GIB)
    assert sorted((p.pid, p.used_memory_bytes) for p in gpu.processes or ()) == [
        (77, 2 * GIB), (4242, 70 * GIB)]  # fmt: skip
    assert [(x.xid, x.time_seconds) for x in parsed.reading.xid_events] == [(79, 1_800_000_000.0)]
