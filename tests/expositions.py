"""Expositions built from the real vLLM captures: multi-engine (data parallel) variants, and\nseries of readings captured over time."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import VLLM_FIXTURES


def multi_engine(text: str, engines: int) -> str:
    """Repeat every ``engine="0"`` series for engines 0..N-1, grouped per engine like vLLM does."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        per_engine = [line for line in block if 'engine="0"' in line]
        others = [line for line in block if 'engine="0"' not in line]
        out.extend(others)
        for i in range(engines):
            out.extend(line.replace('engine="0"', f'engine="{i}"') for line in per_engine)
        block.clear()

    for line in text.splitlines():
        if line.startswith("#"):
            if block:
                flush()
            out.append(line)
        else:
            block.append(line)
    if block:
        flush()
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class CapturedReading:
    """One ``/metrics`` reading of a captured series (tests/vllm_tier/capture_progress.py)."""

    series: str
    t_seconds: float  # since the series' first reading
    event: str | None  # what the capture did just before this reading
    text: str


# vLLM 0.32, the tier's long-context model: one 20,480-token prompt alone ("long_prefill"), then
# the same length again with EngineCore stopped by SIGSTOP for 12 s mid-prefill ("hang").
LONG_PREFILL_CAPTURE = VLLM_FIXTURES / "long-prefill-and-hang-0.32.jsonl.gz"


def captured_series(name: str, path: Path = LONG_PREFILL_CAPTURE) -> list[CapturedReading]:
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    return [
        CapturedReading(r["series"], r["t_seconds"], r["event"], r["metrics"])
        for r in rows
        if r["series"] == name
    ]
