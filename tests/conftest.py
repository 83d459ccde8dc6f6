"""Shared fixtures: paths to the real vLLM captures, a scriptable loopback HTTP server, ports."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.httpfixture import Script, serve

# A test's timeout strikes in its own phases, never while pytest reports (tests/timeouts.py).
from tests.timeouts import (  # noqa: F401  (hooks: pytest finds them in this module)
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_timeout_set_timer,
)

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_FIXTURES = FIXTURES / "vllm"


def read_fixture(name: str) -> str:
    return (VLLM_FIXTURES / name).read_text()


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
def http_server(script: Script) -> Iterator[str]:
    with serve(script) as url:
        yield url


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
