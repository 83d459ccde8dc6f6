"""``vllm-guardian status --watch``: the running guardian's status, live, until Ctrl-C.

Each ``interval`` it asks the daemon for its status over the control socket (the same request
as ``status``) and shows it filled to the terminal's width at spaces (``demo_view.fill``: no word
or path cut). In a terminal the screen is repainted, as the demo's is; into a pipe each refresh
is printed after a time line, as ``top -b`` does. A guardian that does not answer (restarting,
not started yet) is shown as such and asked again: a live view outlives a daemon restart.
Ctrl-C ends it with exit status 130, as shells expect, without a traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from vllm_guardian.tools.demo_view import clock, fill_all, text_width

EXIT_INTERRUPTED = 130  # 128 + SIGINT
CLEAR = "\x1b[H\x1b[2J"


def screen(
    status: dict[str, Any] | None, error: str | None, render: Callable[[dict[str, Any]], str],
    now: float, interval: float, width: int,
) -> list[str]:  # fmt: skip
    """One refresh: a title line, then the status as ``status`` renders it, or why there is none."""
    title = f"vllm-guardian status — {clock(now)}, every {interval:g}s — Ctrl-C stops"
    body = render(status).splitlines() if status is not None else [f"no answer: {error}"]
    return fill_all([title, "", *body], width)


def watch(
    fetch: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    out: TextIO,
    interval: float,
    errors: tuple[type[Exception], ...],
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], float] = time.time,
    refreshes: int | None = None,
) -> int:
    """Show ``fetch()`` every ``interval`` seconds (``refreshes`` times; None: until Ctrl-C).
    ``errors``: what ``fetch`` raises when the daemon does not answer."""
    tty = bool(getattr(out, "isatty", lambda: False)())
    shown = 0
    try:
        while refreshes is None or shown < refreshes:
            status: dict[str, Any] | None = None
            error: str | None = None
            try:
                status = fetch()
            except errors as e:
                error = str(e)
            lines = screen(status, error, render, now(), interval, text_width(out))
            out.write((CLEAR if tty else "" if shown == 0 else "\n") + "\n".join(lines) + "\n")
            out.flush()
            shown += 1
            if refreshes is None or shown < refreshes:
                sleep(interval)
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        return EXIT_INTERRUPTED
    return 0
