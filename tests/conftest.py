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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the gate's modules run compiled (the suite run on the compiled build, scripts/test),
    a test marked ``python_only`` is skipped: it reaches into a class mypyc compiles, which
    takes no replaced method, no instance built without ``__init__`` and no fake where its code
    declares a compiled type. Everything else runs on the compiled code as it runs as Python."""
    marked = [item for item in items if item.get_closest_marker("python_only") is not None]
    if not marked:
        return  # (and the gate's modules are not imported: the plugin's venv runs this too)
    from vllm_guardian.gate.compiled import compiled_modules

    compiled = compiled_modules()
    if not compiled:
        return
    skip = pytest.mark.skip(reason=f"white box of a compiled module ({len(compiled)} compiled)")
    for item in marked:
        item.add_marker(skip)


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
