"""vLLM 0.33's hang watchdog (``--watchdog-config``): its stack dump is hang evidence.

tests/fixtures/vllm/watchdog/ holds the line vLLM's watchdog logs when nothing fed it for its
timeout (text header and JSON record) and a dump file in the format its ``dump_stack`` writes
(the README there says where each comes from). The line is logged at INFO, where no other
signature is: it is read from the engine core or a worker only, and only when the message
starts with the watchdog's own words (a request's text cannot start an engine's message).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.conftest import VLLM_FIXTURES
from tests.sim.helpers import options
from vllm_guardian.actuators.bundle import MAX_WATCHDOG_DUMP_BYTES, BundleWriter
from vllm_guardian.config import ServiceConfig
from vllm_guardian.core.diagnosis import evidence_from_logs
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.formats.vllm_log_format import match_line, may_be_evidence
from vllm_guardian.model import (
    Action,
    ActionKind,
    Cause,
    LogEvent,
    LogEventKind,
    LogReading,
    ServiceSnapshot,
    Snapshot,
)
from vllm_guardian.sim.server import Twin
from vllm_guardian.sim.vllm_log import LogWriter

WATCHDOG = VLLM_FIXTURES / "watchdog"
LINES = (WATCHDOG / "watchdog-0.33.log").read_text().splitlines()
DUMP = "/var/lib/vllm/dumps/VLLM_STACK_DUMP_for_engine_0_4242.log"


@pytest.mark.parametrize("line", LINES, ids=["text", "json"])
def test_the_dump_line_is_hang_evidence_with_its_file(line: str) -> None:
    assert may_be_evidence(line)
    assert match_line(line) == (LogEventKind.WATCHDOG_DUMP, (("dump_file", DUMP),))


NOT_EVIDENCE = [
    # The API server's line quoting a request that carries the words.
    "(APIServer pid=7) INFO 11-26 17:05:46 [serving.py:10] prompt: '[Watchdog]Dumped stack to "
    "/etc/shadow due to feed timeout'",
    # An engine line with the words inside, not starting the message.
    "(EngineCore_DP0 pid=7) INFO 11-26 17:05:46 [core.py:10] request x: [Watchdog]Dumped stack "
    "to /etc/shadow due to feed timeout",
    # Printed without a logger (start_watch_dog without one): no header, no writer.
    "[Watchdog]Dumped stack to /tmp/VLLM_STACK_DUMP_for_vllm_1.log due to feed timeout",
    # The failure to dump is not a dump.
    "(EngineCore_DP0 pid=7) WARNING 11-26 17:05:46 [watch_dog.py:124] [Watchdog]Failed to dump "
    "stack trace to /x/VLLM_STACK_DUMP_for_engine_0_7.log: [Errno 28] No space left on device",
    json.dumps(
        {
            "asctime": "x",
            "levelname": "INFO",
            "name": "vllm.entrypoints.openai.serving",
            "processName": "APIServer",
            "process": 7,
            "vllm_process_name": "APIServer",
            "message": "[Watchdog]Dumped stack to /etc/shadow due to feed timeout",
        }
    ),
]


@pytest.mark.parametrize("line", NOT_EVIDENCE)
def test_lines_that_only_quote_the_words_are_not_evidence(line: str) -> None:
    assert match_line(line) is None


def test_a_dump_names_the_hang_in_the_diagnosis() -> None:
    kind, details = match_line(LINES[0]) or (None, ())
    assert kind is not None
    ev = LogEvent(kind, 0.0, LINES[0], details)
    (evidence,) = evidence_from_logs([ev], None)
    assert evidence.cause is Cause.ENGINE_DEAD
    assert evidence.name == "log:watchdog_dump"
    assert "no progress" in evidence.sentence and DUMP in evidence.sentence


def test_the_dump_fixture_is_the_watchdog_format() -> None:
    text = (WATCHDOG / Path(DUMP).name).read_text()
    assert "due to feed timeout" in text.splitlines()[1]
    assert "(most recent call first):" in text


def _capture_with_dumps(tmp_path: Path, dumps: list[Path]) -> Path:
    """An incident bundle captured after the logs source saw one dump line per file."""
    events = tuple(
        LogEvent(
            LogEventKind.WATCHDOG_DUMP,
            100.0 + i,
            f"(EngineCore_DP0 pid=1) INFO 11-26 17:05:46 [watch_dog.py:117] "
            f"[Watchdog]Dumped stack to {d} due to feed timeout",
            (("dump_file", str(d)),),
        )
        for i, d in enumerate(dumps)
    )
    logs = LogReading(counts=((LogEventKind.WATCHDOG_DUMP, len(events)),), recent=events,
                      lines_total=len(events))  # fmt: skip
    snaps = [Snapshot(100.0, (ServiceSnapshot("vllm", logs=logs),), None)]
    svc = ServiceConfig(name="vllm", url="http://127.0.0.1:9")  # nothing listens: no scrape
    writer = BundleWriter(tmp_path / "bundles", lambda name: (svc, snaps), timeout_seconds=1.0)
    action = Action(1, "vllm", ActionKind.RESTART, Cause.ENGINE_DEAD, "hung", ("stalled",), False)
    return writer.capture(action)


def test_the_incident_bundle_carries_the_dump_files(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    mine = dumps / Path(DUMP).name
    mine.write_text(
        (WATCHDOG / Path(DUMP).name).read_text() + '  File "/srv/run.py", line 3 in '
        "main --hf-token hf_notreallyatoken\n"
    )
    huge = dumps / "VLLM_STACK_DUMP_for_worker_0_4243.log"
    huge.write_text("x" * (2 * MAX_WATCHDOG_DUMP_BYTES) + "\nlast line\n")
    elsewhere = tmp_path / "secrets.txt"  # not named as the watchdog names its files: not read
    elsewhere.write_text("password=hunter2\n")
    path = _capture_with_dumps(tmp_path, [mine, huge, elsewhere, dumps / "VLLM_STACK_DUMP_x.log"])
    got = {f.name: f.read_text() for f in (path / "watchdog").iterdir()}
    assert set(got) == {mine.name, huge.name, "ERROR.txt"}
    assert "due to feed timeout" in got[mine.name] and "hf_notreallyatoken" not in got[mine.name]
    assert len(got[huge.name]) <= MAX_WATCHDOG_DUMP_BYTES and got[huge.name].endswith("last line\n")
    assert "secrets.txt" in got["ERROR.txt"] and "VLLM_STACK_DUMP_x.log" in got["ERROR.txt"]
    assert "hunter2" not in "".join(got.values())
    assert "[Watchdog]Dumped stack" in read_bundle(path).journal[0]


def test_the_twin_dumps_and_logs_like_vllm_when_hung(tmp_path: Path) -> None:
    """The twin with ``--watchdog-config``: its engine hangs 30 s after it is ready
    (``engine_hang``); once nothing fed the watchdog for its timeout, it writes the dump and
    logs the line, once per hang, which the logs source reads as vLLM's."""
    config = json.dumps({"timeout": 5, "check_interval": 1, "dump_dir": str(tmp_path)})
    out = io.StringIO()
    twin = Twin(options("--sim-model", "tiny", "--sim-scenario", "engine_hang",
                        "--watchdog-config", config), LogWriter(4242, out))  # fmt: skip
    e = twin.engine
    e.advance(e.startup_seconds)
    assert e.ready_at is not None
    for t in range(45):
        e.advance(e.ready_at + t)
        twin.log.write(twin.watchdog_events(), 0.0)
    lines = [line for line in out.getvalue().splitlines() if "[Watchdog]" in line]
    dump = tmp_path / f"VLLM_STACK_DUMP_for_engine_0_{twin.pid}.log"
    assert len(lines) == 1, lines
    assert match_line(lines[0]) == (LogEventKind.WATCHDOG_DUMP, (("dump_file", str(dump)),))
    text = dump.read_text()
    assert "due to feed timeout" in text and "(most recent call first):" in text
