"""One guardian per state directory and per runtime directory.

A second ``vllm-guardian run`` on the same directories would unlink the first one's control
socket (runtime directory), start a second vLLM beside the first one's and delete its pid file
(state directory). ``run`` therefore takes an exclusive ``flock`` on ``guardian.lock`` in each
directory before it touches anything, and holds both for the daemon's life; the kernel drops
them when the process ends, however it ends, so a stale lock file never blocks a restart.

The lock file holds the pid of the guardian that holds it, for the second one's error. Its
descriptor is not inherited: vLLM, started by the process manager, outlives a restarted
guardian and must not keep the next one out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("vllm_guardian")

LOCK_NAME = "guardian.lock"


class AlreadyRunning(RuntimeError):
    """Another process holds one of the directories' locks."""


@dataclass(frozen=True)
class InstanceLock:
    fds: tuple[int, ...]

    def release(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def acquire(state_dir: Path, runtime_dir: Path) -> InstanceLock:
    """Lock both directories, the state directory first. Raises :class:`AlreadyRunning` naming
    the directory (by its config key) and the holder's pid when another guardian has it. A
    lock that cannot be taken for another reason (a read-only directory) is logged and
    skipped: the guardian still runs, without this guard."""
    fds: list[int] = []
    try:
        for key, directory in (("state_dir", state_dir), ("runtime_dir", runtime_dir)):
            if fds and _same_directory(directory, state_dir):
                continue
            fd = _lock(key, directory)
            if fd is not None:
                fds.append(fd)
    except BaseException:
        InstanceLock(tuple(fds)).release()
        raise
    return InstanceLock(tuple(fds))


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _lock(key: str, directory: Path) -> int | None:
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        log.warning(
            "%s %s: cannot open %s (%s): running without the one-guardian-per-directory lock",
            key, directory, path, e.strerror or e,
        )  # fmt: skip
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = f"pid {holder}" if holder is not None else "a process whose pid is not known"
            raise AlreadyRunning(
                f"{key} {directory} is in use by another guardian ({who} holds {path}): not "
                "starting a second one on it (stop that one, or give this one its own "
                "state_dir and runtime_dir)"
            ) from None
        log.warning(
            "%s %s: cannot lock %s (%s): running without the one-guardian-per-directory lock",
            key, directory, path, e.strerror or e,
        )  # fmt: skip
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:  # the lock holds; only the next one's error will lack the pid
        log.warning("cannot write the pid into %s: %s", path, e.strerror or e)
    return fd


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
