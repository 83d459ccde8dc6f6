"""Append whole lines to a file, or none: what the flight recorder and the audit log write with.

Where it sits: under every writer of a JSON-lines file that is read line by line (the flight
recorder, the audit log). On a full disk ``write(2)`` stores part of a line and returns the
count, or stores part and fails with ENOSPC; a cut line left in the file had the next line
appended to it, and the reader lost both. Here the lines go in one ``os.write`` whose count is
checked; a line that did not land whole is cut back off the file (``ftruncate`` to the length
before it: it frees space, so it works on a full disk). Should that fail too, the next append
starts with a newline, so the cut line stays a line of its own, which the readers skip and
report, and the lines after it read again.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


def append_lines(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Append ``data`` (whole lines, each ending in a newline) to ``path``; raises OSError
    (the file left as it was, or, if even that failed, ending in a cut line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        before = os.fstat(fd).st_size
        if before and not _ends_a_line(path, before):
            data = b"\n" + data  # a cut line is there: ours starts on a line of its own
        try:
            written = os.write(fd, data)
        except OSError:
            _cut_back(fd, before)
            raise
        if written != len(data):
            _cut_back(fd, before)
            raise OSError(
                errno.ENOSPC,
                f"{os.strerror(errno.ENOSPC)}? only {written} of {len(data)} bytes written "
                "(cut back off)",
            )
    finally:
        os.close(fd)


def _ends_a_line(path: Path, size: int) -> bool:
    try:
        with path.open("rb") as fh:
            fh.seek(size - 1)
            return fh.read(1) in (b"\n", b"")
    except OSError:
        return True  # unreadable (a write-only file): nothing to mend


def _cut_back(fd: int, length: int) -> None:
    """Remove what a failed append left; if that fails, the next append mends the line."""
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_size > length:
            os.ftruncate(fd, length)
