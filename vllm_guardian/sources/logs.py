"""The logs source: vLLM's own account of what went wrong, counted per signature.

A reader thread per service follows either the unit's journal (``journalctl -f -o json``) or
a plain log file (like ``tail -F``), from the guardian's start on (``-n 0``; a file from its
end), and feeds every line to vLLM's log vocabulary (:func:`match_line`), which knows its
signatures: CUDA OOMs, start-up sizing failures,
engine death, hung workers, V0 preemption warnings. Once per tick :meth:`LogsCollector.collect`
hands out cumulative counts per kind and the events that are new since the previous tick;
it only copies state under a lock, so it never waits on the journal. Messages kept in events
are redacted and truncated: they end up in alerts, ``status`` and the flight recorder.

A journalctl that exits (journald restarted, a crash) is restarted with backoff, and resumes
after the last entry it handed over (``--after-cursor``, the entry's ``__CURSOR``): what the unit
logged while it was down is read, not lost. A cursor journalctl cannot seek to (it says so on
stderr: a journal vacuumed or replaced) is dropped when that run handed nothing over, and the
next run starts from now, as at the start.

Which lines are evidence, and what each signature means, is vLLM's log vocabulary
(:mod:`vllm_guardian.formats.vllm_log_format`): this module reads the lines and counts what it matches.

A flood (a million access-log or INFO lines in front of an OOM) costs little and delays
nothing for long: a line that cannot be evidence is dropped by its first characters before any
regex (:func:`may_be_evidence`; counted in ``lines_skipped``), and a file's backlog is read in
slices of :data:`FILE_SLICE_BYTES`, each handed over before the next is read, so memory stays
bounded by a slice and a tick takes the OOM once the slices in front of it are read. While a
backlog is being read, the reading's hint says how much is left and how many lines were skipped.

Even an engine line can quote a request (a request id, a grammar): no log line alone makes the
policy act or ``diagnose`` name a cause. ``core/diagnosis.corroborated`` is that rule.

Counting rules (why a count is a number of *incidents*, not of lines):
* vLLM reports one failure several times: the worker prints the OOM traceback, EngineCore
  re-raises it as ``Worker failed with error 'CUDA out of memory…'``, the API server logs
  ``EngineDeadError`` once per in-flight request. A match whose *dedup key* equals that of the
  previous counted event of its kind less than :data:`DEDUP_WINDOW_SECONDS` ago is the same
  incident and is dropped (the window slides while repeats keep coming). The key is the kind
  plus, for OOMs, the GPU and the requested size (two GPUs running out are two incidents),
  and for V0 preemption warnings the cumulative preemption number vLLM prints (every warning
  is a new 50 preemptions). Repeats never take less than 10 s apart in practice: after an
  engine death vLLM exits, and a restart takes longer than that to reach the next failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from vllm_guardian.config import LogsSourceConfig, ServiceConfig
from vllm_guardian.formats.vllm_log_format import (
    CONTINUED,
    KV_POOL_LINE,
    Details,
    Writer,
    display_line,
    line_origin,
    match_line,
    may_be_evidence,
)
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.lowio.redact import redact_text
from vllm_guardian.model import LogEvent, LogEventKind, LogReading, Reading, SourceKind
from vllm_guardian.sources.base import failed

if TYPE_CHECKING:
    from vllm_guardian.sources.base import Collector

DEDUP_WINDOW_SECONDS = 10.0
MESSAGE_MAX_CHARS = 500
# collect() copies counters under a lock; a second means the lock holder is stuck.
COLLECT_TIMEOUT_SECONDS = 1.0
# Restart a dead journalctl after 1 s, doubling to at most 30 s; a run that lasted a minute
# resets the backoff (it was a one-off exit, not a crash loop).
_BACKOFF_MIN_SECONDS = 1.0
_BACKOFF_MAX_SECONDS = 30.0
_BACKOFF_RESET_AFTER_SECONDS = 60.0
# A file is polled like tail -F does (tail's default is 1 s); 0.25 s keeps events within a tick.
_FILE_POLL_SECONDS = 0.25
_READ_CHUNK_BYTES = 64 * 1024
# A file's backlog is read and matched at most this much at a time: a flood of a million lines
# in front of an OOM is read slice by slice (the lock is released between slices, so a tick
# takes what the slices before handed over), in memory bounded by a slice, and the reader
# goes on at once while a slice comes back full.
FILE_SLICE_BYTES = 1024 * 1024
_STDERR_KEEP_BYTES = 4096

# journald's mark on an entry a NUL byte or LineMax cut, in journalctl's JSON.
_JOURNAL_CUT = re.compile(rb'"_LINE_BREAK" ?: ?"(?:nul|line-max)"')

_JOURNAL_GROUP_HINT = (
    "the guardian's user cannot read the system journal: add it to the systemd-journal group "
    "(SupplementaryGroups=systemd-journal in its unit), or follow a file with services[].log_file"
)

# Which details identify an incident (see the module docstring); other kinds: the kind alone.
_DEDUP_FIELDS: dict[LogEventKind, tuple[str, ...]] = {
    LogEventKind.CUDA_OOM: ("gpu", "tried_bytes"),
    LogEventKind.PREEMPTION: ("total_cumulative",),
}


def _clean_message(line: str) -> str:
    """Redact first, then truncate: truncation could cut a secret below what redaction knows."""
    text = redact_text(line)
    if len(text) > MESSAGE_MAX_CHARS:
        text = text[: MESSAGE_MAX_CHARS - 1] + "…"
    return text


class EventCounter:
    """Lines in, deduplicated events and counts out. Not thread-safe: the collector locks."""

    # Engine processes whose pool line is kept: more are a process naming churn, not engines.
    MAX_SIZED_ENGINES = 64

    def __init__(self, recent_events: int) -> None:
        self._sizing: dict[str, str] = {}  # engine process → its latest KV pool line
        self._counts = dict.fromkeys(LogEventKind, 0)
        self._pending: deque[LogEvent] = deque(maxlen=recent_events)
        self._last_seen: dict[tuple[LogEventKind, Details], float] = {}
        self.lines_total = 0
        self.lines_skipped = 0

    def feed(self, line: str, time_seconds: float) -> LogEvent | None:
        self.lines_total += 1
        if KV_POOL_LINE in line:
            self._note_pool(line)
        if not may_be_evidence(line):
            self.lines_skipped += 1
            return None
        matched = match_line(line)
        if matched is None:
            return None
        kind, details = matched
        fields = _DEDUP_FIELDS.get(kind, ())
        key = (kind, tuple((k, v) for k, v in details if k in fields))
        last = self._last_seen.get(key)
        self._last_seen[key] = time_seconds
        if last is not None and abs(time_seconds - last) < DEDUP_WINDOW_SECONDS:
            return None
        if len(self._last_seen) > 1024:  # OOM keys vary; forget the stale ones
            cutoff = time_seconds - DEDUP_WINDOW_SECONDS
            self._last_seen = {k: t for k, t in self._last_seen.items() if t >= cutoff}
        event = LogEvent(kind, time_seconds, _clean_message(display_line(line)), details)
        self._counts[kind] += 1
        self._pending.append(event)
        return event

    def _note_pool(self, line: str) -> None:
        """An engine's start-up line "GPU KV cache size: N tokens, …" (INFO), kept per engine
        process, the latest: the pool's size where /metrics has no vllm:cache_config_info
        (core/engine_signals.py parses it). From the engine's own lines only."""
        origin = line_origin(line)
        if origin is None or origin.writer is not Writer.ENGINE or not origin.process:
            return
        if origin.process not in self._sizing and len(self._sizing) >= self.MAX_SIZED_ENGINES:
            return
        self._sizing[origin.process] = origin.message[:MESSAGE_MAX_CHARS]

    def take(self) -> LogReading:
        """Cumulative counts (every kind, zeros included) and the events since the last take."""
        reading = LogReading(
            counts=tuple(self._counts.items()),
            recent=tuple(self._pending),
            lines_total=self.lines_total,
            lines_skipped=self.lines_skipped,
            engine_kv_sizing=tuple(sorted(self._sizing.items())),
        )
        self._pending.clear()
        return reading


# --- input framing (pure) --------------------------------------------------------------------


def truncate_utf8(text: str, max_bytes: int) -> str:
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", errors="ignore")


def _decode_line(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r")


class LineSplitter:
    """Bytes → complete lines. An incomplete last line waits for its newline; a line longer
    than ``max_line_bytes`` is cut there (emitted at once) and the rest of it dropped."""

    def __init__(self, max_line_bytes: int) -> None:
        self._max = max_line_bytes
        self._buf = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> list[str]:
        out: list[str] = []
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            if self._discarding:
                self._discarding = False
            else:
                self._buf += data[start:nl]
                out.append(_decode_line(bytes(self._buf[: self._max])))
            self._buf.clear()
            start = nl + 1
        if not self._discarding:
            self._buf += data[start:]
            if len(self._buf) > self._max:
                out.append(_decode_line(bytes(self._buf[: self._max])))
                self._buf.clear()
                self._discarding = True
        return out

    def flush(self) -> list[str]:
        """The unterminated last line of a file that will not grow any more (rotated away)."""
        out = [] if self._discarding or not self._buf else [_decode_line(bytes(self._buf))]
        self.reset()
        return out

    def reset(self) -> None:
        self._buf.clear()
        self._discarding = False


@dataclass(frozen=True)
class JournalEntry:
    message: str | None  # None: journalctl printed null (a field over 4096 bytes)
    time_seconds: float | None
    cursor: str | None = None  # where a restarted journalctl resumes (--after-cursor)
    # journald's _LINE_BREAK: why this entry ended without a newline (nul, line-max, eof,
    # pid-change); None when a newline ended it.
    line_break: str | None = None

    @property
    def cut(self) -> bool:
        """The line goes on in the next entry: a NUL byte or journald's LineMax cut it."""
        return self.line_break in ("nul", "line-max")


def split_message(message: str, continued: bool) -> list[str]:
    """A journal MESSAGE as lines: split at newlines only. ``str.splitlines`` also splits at
    U+2028, U+0085, \\x1c-\\x1e and form feeds, characters a request's text can carry: a header
    after one of them is in the middle of a line. ``continued``: the entry goes on with a line
    the journal cut (:attr:`JournalEntry.cut` on the entry before), so it starts mid-line."""
    lines = [line.rstrip("\r") for line in message.split("\n")]
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()
    if continued:
        lines[0] = CONTINUED + lines[0]
    return lines


def parse_journal_line(raw: bytes | str) -> JournalEntry | None:
    """One line of ``journalctl -o json``. MESSAGE is a string, or a list of byte values when
    it is not valid UTF-8 or holds control characters (colour codes)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    msg = obj.get("MESSAGE")
    text: str | None = None
    if isinstance(msg, str):
        text = msg
    elif isinstance(msg, list) and all(isinstance(b, int) and 0 <= b < 256 for b in msg):
        text = bytes(msg).decode("utf-8", errors="replace")
    ts: float | None = None
    raw_ts = obj.get("__REALTIME_TIMESTAMP")
    if isinstance(raw_ts, str | int) and str(raw_ts).isdigit():
        ts = int(raw_ts) / 1e6
    cursor = obj.get("__CURSOR")
    brk = obj.get("_LINE_BREAK")
    return JournalEntry(
        text,
        ts,
        cursor if isinstance(cursor, str) and cursor else None,
        brk if isinstance(brk, str) and brk else None,
    )


# --- following a file like tail -F ----------------------------------------------------------


class FileFollower:
    """Follows one path across rotation by rename and truncation.

    Opened at construction and positioned at the end, so only lines written after the guardian
    started count. A file that appears later (or replaces a rotated one) is read from its start.
    """

    def __init__(self, path: Path, max_line_bytes: int) -> None:
        self._path = path
        self._splitter = LineSplitter(max_line_bytes)
        self._fh: IO[bytes] | None = None
        self._ident: tuple[int, int] | None = None
        self.behind = False  # the last poll stopped at its budget: more is waiting
        with contextlib.suppress(OSError):  # missing or unreadable: poll() reports it
            self._open(at_end=True)

    def _open(self, at_end: bool) -> None:
        fh = self._path.open("rb")
        st = os.fstat(fh.fileno())
        if at_end:
            fh.seek(0, os.SEEK_END)
        self._fh, self._ident = fh, (st.st_dev, st.st_ino)

    def _drain(self, max_bytes: int | None) -> tuple[list[str], bool]:
        """Complete lines from the current position, at most ``max_bytes`` read (None: to the
        end); and whether the budget ran out before the end."""
        assert self._fh is not None
        out: list[str] = []
        left = max_bytes
        while left is None or left > 0:
            chunk = self._fh.read(
                _READ_CHUNK_BYTES if left is None else min(left, _READ_CHUNK_BYTES)
            )
            if not chunk:
                return out, False
            out += self._splitter.feed(chunk)
            if left is not None:
                left -= len(chunk)
        return out, True

    def poll(self, max_bytes: int | None = None) -> list[str]:
        """The complete lines written since the last poll, at most ``max_bytes`` of the file
        read (None: all of it); :attr:`behind` says whether more is waiting. Raises OSError
        while the file cannot be opened (missing, no permission)."""
        if self._fh is None:
            self._open(at_end=False)
        lines, self.behind = self._drain(max_bytes)
        if self.behind:
            return lines  # the rest of this file first; rotation is looked at once it is read
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return lines  # rotated away and not recreated yet: keep the old file open
        assert self._fh is not None
        if (st.st_dev, st.st_ino) != self._ident:
            rest, self.behind = self._drain(max_bytes)  # what the writer finished there
            lines += rest
            if self.behind:
                return lines
            lines += self._splitter.flush()  # the writer has moved on
            self.close()
            self._open(at_end=False)
            self.behind = True  # the new file is read from its start by the next poll
        elif st.st_size < self._fh.tell():  # truncated (copytruncate): start over
            self._fh.seek(0)
            self._splitter.reset()
            self.behind = True
        return lines

    def backlog_bytes(self) -> int:
        """How much of the open file is not read yet (0 when it cannot be told)."""
        if self._fh is None:
            return 0
        try:
            return max(0, os.fstat(self._fh.fileno()).st_size - self._fh.tell())
        except OSError:
            return 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# --- the collector ---------------------------------------------------------------------------


class LogsCollector:
    """Follows one service's journal or log file in a thread; collect() reports what it saw.

    ``journal_argv_prefix`` is put in front of the journalctl command, e.g.
    ``("nsenter", "-t", PID, "-a")`` to read the journal of a container's systemd.
    """

    kind = SourceKind.LOGS

    def __init__(
        self,
        service: ServiceConfig,
        cfg: LogsSourceConfig,
        clock: Clock,
        journal_argv_prefix: Sequence[str] | None = None,
    ) -> None:
        self.service: str | None = service.name
        self.timeout_seconds = COLLECT_TIMEOUT_SECONDS
        self._cfg = cfg
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counter = EventCounter(cfg.recent_events)
        self._down: tuple[str, str | None] | None = None  # (error, hint) while not following
        self._backlog_bytes = 0  # a file's backlog still to read after the last slice
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._follower: FileFollower | None = None
        self._log_path = service.log_file
        target: Callable[[], None]
        if service.log_file:
            self._follower = FileFollower(Path(service.log_file), cfg.max_line_bytes)
            target = self._run_file
        elif service.unit:
            self._argv_head = [
                *(journal_argv_prefix or ()),
                cfg.journalctl,
                "-f",
                "-o",
                "json",
                # Without --all, journalctl prints messages over 4 KiB as null, and vLLM's fatal
                # errors (with their config dumps) are exactly those.
                "--all",
            ]
            self._unit_arg = f"--unit={service.unit}"  # one argument: never read as an option
            # The last entry handed over (its __CURSOR): a restarted journalctl resumes after it.
            # Only the reader thread touches it.
            self._cursor: str | None = None
            target = self._run_journal
        else:
            self._down = (
                "no log to follow: the service has neither a unit nor a log file",
                "set services[].unit (its journal is followed) or services[].log_file",
            )
            return
        self._thread = threading.Thread(target=target, name=f"logs-{service.name}", daemon=True)
        self._thread.start()

    # -- the tick side

    def collect(self) -> Reading:
        try:
            with self._lock:
                if self._down is not None:
                    return failed(self.kind, self.service, self._down[0], self._down[1])
                blind = self._journal_blind()
                if blind is not None:
                    return failed(self.kind, self.service, blind, _JOURNAL_GROUP_HINT)
                reading = self._counter.take()
                hint = None
                if self._backlog_bytes:
                    hint = (
                        f"reading a backlog of {self._backlog_bytes} bytes in slices of "
                        f"{FILE_SLICE_BYTES} bytes; {reading.lines_skipped} of "
                        f"{reading.lines_total} lines so far were skipped unread by their first "
                        "characters (no engine header at WARNING or above)"
                    )
                return Reading(source=self.kind, service=self.service, payload=reading, hint=hint)
        except Exception as e:  # a source that is down is an observation, never an exception
            return failed(self.kind, self.service, f"logs source failed: {type(e).__name__}: {e}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            proc = self._proc
        if proc is not None:
            # Only signal here: the reader thread owns the pipe; it sees EOF, reaps and closes.
            _signal_group(proc, signal.SIGTERM)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive() and proc is not None:
                _signal_group(proc, signal.SIGKILL)
                self._thread.join(timeout=5.0)
        if self._follower is not None and (self._thread is None or not self._thread.is_alive()):
            self._follower.close()

    def _journal_blind(self) -> str | None:
        """journalctl keeps running when it may not read the system journal; it only says so
        once on stderr. Called with the lock held."""
        if self._stderr is None:
            return None
        with contextlib.suppress(OSError):
            head = os.pread(self._stderr.fileno(), _STDERR_KEEP_BYTES, 0)
            if (
                b"not seeing messages from other users" in head
                or b"insufficient permissions" in head
            ):
                return "journalctl runs but cannot read the system journal"
        return None

    # -- the reader thread

    def _feed(
        self,
        lines: Iterable[str],
        time_seconds: float | None = None,
        backlog_bytes: int = 0,
    ) -> None:
        with self._lock:
            self._backlog_bytes = backlog_bytes
            for line in lines:
                t = time_seconds if time_seconds is not None else self._clock.time()
                self._counter.feed(line, t)

    def _set_down(self, error: str | None, hint: str | None = None) -> None:
        with self._lock:
            self._down = None if error is None else (error, hint)

    def _run_file(self) -> None:
        assert self._follower is not None
        path = self._log_path
        while not self._stop.is_set():
            try:
                lines = self._follower.poll(FILE_SLICE_BYTES)
            except FileNotFoundError:
                self._set_down(
                    f"log file {path} does not exist",
                    "check services[].log_file; it appears once vLLM's output is written there",
                )
            except PermissionError:
                self._set_down(
                    f"log file {path} is not readable",
                    "give the guardian's user read access to the file (e.g. group adm)",
                )
            except OSError as e:
                self._set_down(f"cannot read log file {path}: {e.strerror or e}")
            else:
                behind = self._follower.behind
                self._feed(lines, backlog_bytes=self._follower.backlog_bytes() if behind else 0)
                self._set_down(None)
                if behind:
                    continue  # a backlog: the next slice at once (the lock was released)
            self._stop.wait(_FILE_POLL_SECONDS)

    def _run_journal(self) -> None:
        backoff = _BACKOFF_MIN_SECONDS
        while not self._stop.is_set():
            started = time.monotonic()  # real time: backoff is about this process, not the clock
            self._follow_journal_once()
            if time.monotonic() - started >= _BACKOFF_RESET_AFTER_SECONDS:
                backoff = _BACKOFF_MIN_SECONDS
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, _BACKOFF_MAX_SECONDS)

    def _follow_journal_once(self) -> None:
        # stderr goes to a file, not a pipe: nobody has to drain it, and collect() can look
        # at it for journalctl's "not seeing messages" notice.
        with tempfile.TemporaryFile() as stderr:
            proc = self._spawn_journal(stderr)
            if proc is None:
                return
            with self._lock:
                self._proc, self._stderr, self._down = proc, stderr, None
                stopping = self._stop.is_set()
            from_cursor = self._cursor
            try:
                if not stopping:
                    self._read_journal(proc)
            finally:
                _terminate(proc)
                tail = _tail(stderr)
                if from_cursor is not None and self._cursor == from_cursor and "cursor" in tail:
                    # journalctl could not resume there ("Failed to seek to cursor": a journal
                    # vacuumed or replaced) and handed nothing over: the next run starts from
                    # now, or every restart would fail the same way.
                    self._cursor = None
                with self._lock:
                    self._proc, self._stderr = None, None
                    if not self._stop.is_set():
                        self._down = (
                            f"journalctl exited with status {proc.returncode}"
                            + (f": {tail}" if tail else ""),
                            f"restarting it with backoff; if it cannot read the journal, "
                            f"{_JOURNAL_GROUP_HINT}",
                        )

    def _journal_argv(self) -> list[str]:
        """From the entry after the last one handed over, or (at the start, or when no cursor
        is known) from now on: only lines logged while the guardian runs count."""
        where = ["-n", "0"] if self._cursor is None else [f"--after-cursor={self._cursor}"]
        return [*self._argv_head, *where, self._unit_arg]

    def _spawn_journal(self, stderr: IO[bytes]) -> subprocess.Popen[bytes] | None:
        tool = self._cfg.journalctl
        try:
            return subprocess.Popen(
                self._journal_argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,  # so close() can stop whatever it started, too
            )
        except FileNotFoundError:
            self._set_down(
                f"{self._argv_head[0]} not found",
                f"install journalctl or set sources.logs.journalctl to its path (now {tool!r}), "
                "or follow a file with services[].log_file",
            )
        except OSError as e:
            self._set_down(f"cannot run {tool}: {e.strerror or e}", _JOURNAL_GROUP_HINT)
        return None

    def _read_journal(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        # JSON escaping can make a line several times longer than its MESSAGE.
        limit = 8 * self._cfg.max_line_bytes + 64 * 1024
        oversized = False
        continued = False  # the entry before was cut: this one does not start a line
        # An entry too long to parse: whether it was cut, read from its raw JSON as it passes
        # (an unescaped quote is never the MESSAGE's text), and the end of its last piece.
        big_cut, tail = False, b""
        while raw := proc.stdout.readline(limit):
            complete = raw.endswith(b"\n")
            if oversized or not complete:
                # The tail of a line too long to parse: count it once, then skip to its end.
                if not oversized:
                    self._feed([""])
                    big_cut, tail = False, b""
                big_cut = big_cut or _JOURNAL_CUT.search(tail + raw) is not None
                tail = raw[-64:]
                oversized = not complete
                if not oversized:
                    continued = big_cut
                continue
            entry = parse_journal_line(raw)
            if entry is None or entry.message is None:
                self._feed([""])  # a line was logged; its text cannot be matched
            else:
                lines = [
                    truncate_utf8(line, self._cfg.max_line_bytes)
                    for line in split_message(entry.message, continued)
                ]
                self._feed(lines, entry.time_seconds)
            continued = entry.cut if entry is not None else bool(_JOURNAL_CUT.search(raw))
            if entry is not None and entry.cursor is not None:
                self._cursor = entry.cursor


def _tail(f: IO[bytes]) -> str:
    with contextlib.suppress(OSError):
        size = os.fstat(f.fileno()).st_size
        data = os.pread(f.fileno(), _STDERR_KEEP_BYTES, max(0, size - _STDERR_KEEP_BYTES))
        lines = [
            ln.strip() for ln in data.decode("utf-8", errors="replace").splitlines() if ln.strip()
        ]
        return redact_text(" / ".join(lines[-3:]))[:_STDERR_KEEP_BYTES]
    return ""


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """Stop journalctl and anything it started: SIGTERM to its group, SIGKILL after 1 s."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    else:
        with contextlib.suppress(OSError):  # the leader exited; its children may not have
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdout is not None:
        proc.stdout.close()


if TYPE_CHECKING:

    def _is_collector(c: LogsCollector) -> Collector:
        return c
