"""pytest-timeout's alarm, struck only inside a test's own phases (setup, call, teardown).

pytest-timeout (``timeout`` in pyproject, ``method = signal``) arms SIGALRM for a test's whole
protocol and raises ``Failed`` wherever the alarm finds the main thread. Inside a phase pytest
catches that and reports the test as timed out. Between phases pytest itself is running: making
a report, formatting a traceback (parsing the test file's source), writing to the terminal; an
exception there escapes pytest's machinery and ends the whole session with an INTERNALERROR,
so one slow failure would cost every test after it. Here an alarm that comes between phases is
put off by a second, again and again, until the next phase or the end of the test, when
pytest-timeout cancels it as usual. Loaded by ``tests/conftest.py``; the thread method, which
ends the process by design, is left to pytest-timeout.
"""

from __future__ import annotations

import signal
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest
import pytest_timeout

# Seconds between tries of an alarm that came while pytest, not the test, was running.
RETRY_SECONDS = 1.0

_IN_PHASE = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Arm the alarm as pytest-timeout does, with a handler that strikes only in a phase."""
    if settings.method != "signal":
        return None  # pytest-timeout's own (the thread method, or a test outside the main thread)

    def handler(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        if not item.stash.get(_IN_PHASE, False):
            signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
            return
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout calls it
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


def _phase(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_IN_PHASE] = True
    try:
        yield
    finally:
        item.stash[_IN_PHASE] = False


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item)
