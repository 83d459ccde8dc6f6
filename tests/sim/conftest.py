"""Fixtures of the twin's end-to-end tests: twins started as real processes, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sim.twinproc import TwinProc, start, stop

Starter = Callable[..., TwinProc]


@pytest.fixture
def twin(tmp_path: Path, free_port: int) -> Iterator[Starter]:
    """Start twins on 127.0.0.1 (``twin(*serve_args)``); every one is stopped afterwards."""
    started: list[TwinProc] = []

    def _start(*args: str) -> TwinProc:
        t = start(tmp_path, free_port, *args)
        started.append(t)
        return t

    yield _start
    for t in started:
        stop(t)
