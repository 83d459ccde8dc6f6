"""vLLM's log line format, for the twin's stderr.

``(APIServer pid=123) INFO 11-22 00:09:18 [launcher.py:254] message`` (vllm/logger.py); a
logged traceback repeats its record's header on every line, as vLLM's NewLineFormatter does,
and only what Python prints itself (an uncaught exception at exit) is bare. The wall-clock
timestamp is supplied by the caller, so formatting stays pure.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from vllm_guardian.sim.engine import LogEvent, Proc


def format_line(event: LogEvent, pid: int, unix_seconds: float) -> str:
    if event.proc is Proc.NONE:
        return event.message
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(unix_seconds))
    return (
        f"({event.proc.value} pid={pid}) {event.level} {stamp} [{event.fileinfo}] {event.message}"
    )


class LogWriter:
    """Writes events to a stream (stderr by default), one whole line at a time."""

    def __init__(self, pid: int, stream: TextIO | None = None) -> None:
        self.pid = pid
        self.stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()

    def write(self, events: list[LogEvent], unix_seconds: float) -> None:
        if not events:
            return
        text = "".join(format_line(e, self.pid, unix_seconds) + "\n" for e in events)
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def info(self, proc: Proc, fileinfo: str, message: str, unix_seconds: float) -> None:
        self.write([LogEvent(0.0, proc, "INFO", fileinfo, message)], unix_seconds)

    def warning(self, proc: Proc, fileinfo: str, message: str, unix_seconds: float) -> None:
        self.write([LogEvent(0.0, proc, "WARNING", fileinfo, message)], unix_seconds)

    def raw(self, line: str) -> None:
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()
