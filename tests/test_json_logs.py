"""vLLM's ``--logging-config.formatter json``: the same signatures, the same origin rule.

tests/fixtures/vllm/logs/json-formatter-0.32.jsonl pairs each header line of the text-line
tests (tests/test_source_logs.py) with the record vLLM's own JSON formatter wrote for it
(make_json_formatter.py beside it, run with vLLM 0.32.0's CPU build). Whatever the guardian
concludes from the text line it must conclude from the record: an engine process's signature
is evidence, the API server's request text never is, INFO never is, the input dump's request
copies never are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import VLLM_FIXTURES
from vllm_guardian.core.budget import parse_startup_sizing
from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.diagnose.report import to_json
from vllm_guardian.formats.vllm_log_format import (
    engine_message,
    line_origin,
    match_line,
    may_be_evidence,
)
from vllm_guardian.sources.logs import EventCounter

PAIRS = [
    (p["text"], p["json"])
    for p in map(json.loads, (VLLM_FIXTURES / "logs" / "json-formatter-0.32.jsonl").open())
]


def _ids(pair: tuple[str, str]) -> str:
    return pair[0][:60]


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_a_record_reads_as_its_text_line(pair: tuple[str, str]) -> None:
    text, record = pair
    assert match_line(record) == match_line(text)
    assert engine_message(record) == engine_message(text)
    origin, expected = line_origin(record), line_origin(text)
    assert (origin and (origin.writer, origin.level)) == (
        expected and (expected.writer, expected.level)
    )


def test_the_fixture_holds_evidence_and_request_text() -> None:
    found = [match_line(record) for _, record in PAIRS]
    assert sum(f is not None for f in found) >= 20
    assert sum(f is None for f in found) >= 40


def _record(**fields: object) -> str:
    base: dict[str, object] = {
        "asctime": "2026-11-26 14:10:09,179",
        "levelname": "ERROR",
        "name": "vllm.v1.engine.core",
        "processName": "EngineCore_DP0",
        "process": 4120,
        "message": "EngineCore encountered a fatal error.",
        "vllm_process_name": "EngineCore_DP0",
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None})


FATAL = "EngineCore encountered a fatal error."
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total "
    "capacity of 93.02 GiB of which 1.18 GiB is free."
)


@pytest.mark.parametrize(
    ("line", "evidence"),
    [
        (_record(), True),
        # the traceback a record carries (logger.exception) is the engine's, as the text
        # format's header on every traceback line says
        (_record(message="EngineCore failed to start.", exc_info="Traceback\n" + OOM), True),
        # a field a request could fill is never read: only the engine's own message
        (_record(message="ok", request_id=FATAL, prompt=OOM), False),
        (_record(levelname="INFO"), False),
        (_record(levelname="DEBUG", message=OOM), False),
        # the API server's request text, whatever it says
        (_record(processName="APIServer", vllm_process_name="APIServer", message=OOM), False),
        (
            _record(
                name="vllm.entrypoints.openai.chat_completion.serving",
                processName="APIServer",
                vllm_process_name="APIServer",
                message="Error with model " + _record(),
            ),
            False,
        ),
        # the engine core's input dump copies requests
        (_record(name="vllm.logging_utils.dump_input", message=OOM), False),
        # the process vLLM named wins over multiprocessing's name
        (_record(processName="EngineCore_DP0", vllm_process_name="APIServer"), False),
        # not a record: a JSON value, broken JSON, a record without a process or message
        ('"' + FATAL + '"', False),
        (_record()[:-1], False),
        (_record(vllm_process_name=None, processName=None), False),
        (_record(message=None), False),
        (_record(message=["x"]), False),
        # uvicorn's access log is not JSON and stays ignored
        ('INFO:     10.0.0.7:51234 - "GET /' + _record() + ' HTTP/1.1" 404 Not Found', False),
        # a record that does not start the line is text
        (" " + _record(), False),
    ],
)
def test_the_origin_rule_in_json_records(line: str, evidence: bool) -> None:
    assert (match_line(line) is not None) is evidence
    if evidence:
        assert may_be_evidence(line)


def test_a_sizing_line_in_a_record_is_read() -> None:
    line = _record(levelname="INFO", message="GPU KV cache size: 4,096 tokens")
    assert engine_message(line) == "GPU KV cache size: 4,096 tokens"
    assert not may_be_evidence(line)  # INFO: skipped by the matcher's pre-filter


# --- diagnose: a bundle whose journal vLLM wrote as JSON -------------------------------------

BUNDLES = VLLM_FIXTURES.parent / "bundles"
JSON_JOURNALS = sorted((VLLM_FIXTURES / "logs" / "json-journals").glob("*.log"))


@pytest.mark.parametrize("journal", JSON_JOURNALS, ids=lambda p: p.stem)
def test_diagnose_reaches_the_same_verdict_from_a_json_journal(
    journal: Path, tmp_path: Path
) -> None:
    text_bundle = BUNDLES / journal.stem
    json_bundle = tmp_path / journal.stem
    shutil.copytree(text_bundle, json_bundle)
    shutil.copy(journal, json_bundle / "journal.log")
    text, js = (to_json(analyze(read_bundle(b))) for b in (text_bundle, json_bundle))
    assert js["verdict"] == text["verdict"]
    assert _evidence(js) == _evidence(text)


_HEADER = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) .*?\] ")


def _evidence(doc: dict[str, object]) -> object:
    """What diagnose concluded, each log line it quotes without its header (the record's time
    and pid are another run's, and it names the logger where the text names the file) and cut
    at 100 characters (where a quote is cut depends on its header's length)."""
    causes = json.loads(json.dumps(doc["causes"]))
    for cause in causes:
        cause["evidence"] = [_HEADER.sub("", e)[:100] for e in cause["evidence"]]
    return causes


# --- a real start-up, vLLM 0.32's CPU build with --logging-config.formatter json ------------

# Captured from `vllm serve` of the tier's tiny model (tests/vllm_tier/tinymodel.py) with
# --logging-config.formatter json --max-model-len 4096, stdout and stderr together, from the
# start to "Application startup complete" (torch's and Python's own warnings are not JSON).
# Its text twin: tests/fixtures/logs/server-startup-run1-cold.log, the same tiny model and
# --max-model-len (without --enforce-eager, which the JSON run had).
JSON_STARTUP = VLLM_FIXTURES / "logs" / "json-startup-0.32-cpu.log"
TEXT_STARTUP = VLLM_FIXTURES.parent / "logs" / "server-startup-run1-cold.log"


def test_a_real_json_startup_reads_as_the_text_one() -> None:
    lines = JSON_STARTUP.read_text().splitlines()
    assert sum(line.startswith("{") for line in lines) > 50
    sizing = [
        parse_startup_sizing(
            m for line in f.read_text().splitlines() if (m := engine_message(line))
        )
        for f in (JSON_STARTUP, TEXT_STARTUP)
    ]
    assert sizing[0] == sizing[1]
    assert sizing[0].kv_cache_size_tokens == 2_097_152
    counter = EventCounter(16)
    for i, line in enumerate(lines):
        assert counter.feed(line, float(i)) is None  # a healthy start: no evidence of anything
    reading = counter.take()
    # The API server's records say processName "MainProcess": vLLM's own name for the process
    # (vllm_process_name "APIServer") is the one read, as the text header's.
    assert [p for p, _ in reading.engine_kv_sizing] == ["EngineCore"]
