"""What the tests share for waiting on a real process, socket or thread.

One wait: a condition polled with a generous bound (the machine may be two busy cores), and on
timeout what was asked for and, where the caller says how to see it, what was seen instead. A
test that passes or fails by the clock is a defect; this waits for a condition instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T],
    what: str,
    timeout_seconds: float = 60.0,
    seen: Callable[[], object] | None = None,
    every_seconds: float = 0.05,
) -> T:
    """Poll ``check()`` until it returns something true, and return that. An ``OSError`` (a
    refused connection, a file not written yet; ``requests``' errors are ``OSError``\\ s) counts
    as "not yet". After ``timeout_seconds``, fail naming ``what`` and ``seen()``."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            got = check()
        except OSError as e:
            got, error = None, e  # type: ignore[assignment]
        else:
            error = None
        if got:
            return got
        if time.monotonic() >= deadline:
            saw = f"; seen: {seen()!r}" if seen is not None else ""
            why = f"; last error: {error!r}" if error is not None else ""
            raise AssertionError(
                f"timed out after {timeout_seconds:g} s waiting for {what}{saw}{why}"
            )
        time.sleep(every_seconds)
