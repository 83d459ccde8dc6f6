"""Parsers for the /proc files the sources read: ``/proc/<pid>/stat`` and ``/proc/<pid>/cgroup``
(and ``/proc/<pid>/schedstat``, which the gate's parent reads of its workers).

Where it sits: below the unit, NVML and allocator sources, which each walk /proc to tie a
process to a service (its parent chain, its cgroup). Pure functions of the file's text, so each
is tested on crafted text; the reading itself (and what to do with an entry that vanished
mid-scan) stays with the source that reads.
"""

from __future__ import annotations


def parse_stat(text: str) -> tuple[int, int] | None:
    """``/proc/<pid>/stat`` → (pid, ppid), or None when malformed.

    The second field (``comm``) is in parentheses and may itself hold spaces and ``)``, so the
    fields after it are found from the *last* ``)``.
    """
    head, sep, tail = text.rpartition(")")
    if not sep:
        return None
    fields = tail.split()
    if len(fields) < 2:
        return None
    try:
        pid, ppid = int(head.split("(", 1)[0].strip()), int(fields[1])
    except ValueError:
        return None
    return (pid, ppid) if ppid >= 0 else None


def parse_start_ticks(text: str) -> int | None:
    """The process's start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot), or
    None when malformed. With the pid it names one process: a reused pid starts later."""
    _, sep, tail = text.rpartition(")")
    fields = tail.split()
    if not sep or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def parse_ppid(text: str) -> int | None:
    """The parent pid from ``/proc/<pid>/stat``'s text, or None when malformed."""
    parsed = parse_stat(text)
    return parsed[1] if parsed is not None else None


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """``/proc/<pid>/schedstat`` → (nanoseconds on a CPU, nanoseconds runnable but waiting for
    one), the task's totals since it started; None when malformed."""
    fields = text.split()
    if len(fields) < 2 or not all(f.isascii() and f.isdigit() for f in fields[:2]):
        return None
    return int(fields[0]), int(fields[1])


def parse_cgroup(text: str) -> str | None:
    """The cgroup v2 path from ``/proc/<pid>/cgroup``'s text (its ``0::/path`` line).

    None when there is no unified line (a pure cgroup v1 host), which the core treats as
    "cannot attribute by cgroup" rather than guessing from v1 controller paths.
    """
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or None
    return None


# vLLM's CLI as a process runs it: its console script (``…/bin/vllm``, as itself or under the
# interpreter its shebang names) or ``python -m vllm.entrypoints.cli.main``.
_VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"


def is_weight_cache_command(cmdline: str) -> bool:
    """Whether ``/proc/<pid>/cmdline`` (NUL-separated) is vLLM's weight-cache launcher,
    ``vllm preload …`` (0.31+): the process whose ``spawn`` children hold a model's weights on
    each GPU for engines started with ``--load-format ipc_cache``. The subcommand is the first
    argument after the CLI that is not an option."""
    argv = cmdline.split("\0")
    for i, arg in enumerate(argv):
        if arg.rpartition("/")[2] == "vllm" or (
            arg == _VLLM_CLI_MODULE and i > 0 and argv[i - 1] == "-m"
        ):
            rest = [a for a in argv[i + 1 :] if a]
            return bool(rest) and rest[0] == "preload"
    return False


def parse_pid_file(text: str) -> tuple[int, int] | None:
    """A supervisor's pid file, ``PID START_TICKS`` (procmgr writes it; the unit source reads
    it): the pair, or None when it is not exactly two decimal numbers."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def process_age_seconds(
    stat_text: str, boottime_seconds: float, clock_ticks_per_second: int
) -> float | None:
    """How long ago the process of ``/proc/<pid>/stat``'s text started: its start time is in
    clock ticks since boot, and ``boottime_seconds`` is CLOCK_BOOTTIME now (the same clock).
    None when malformed, or when the start is in the future (another boot's text)."""
    ticks = parse_start_ticks(stat_text)
    if ticks is None or clock_ticks_per_second <= 0:
        return None
    age = boottime_seconds - ticks / clock_ticks_per_second
    return age if age >= 0 else None
