"""The flight recorder: one JSON line per tick, size-bounded with rotation, and its reader.

Where it sits: the last stage of the tick. Each line holds the tick's snapshot, its derived
signals and its decisions, so an incident can be replayed through the same pure core
(``vllm-guardian replay``). The codec below turns the frozen dataclasses of
:mod:`vllm_guardian.model` into JSON and back using their type hints; ``+Inf`` (histogram
bounds) travels as the string ``"+Inf"`` because JSON has no infinity.

**Formats 2 and 3: what the tick saw, not all of it again.** Most of a snapshot is the same as the
previous tick's (the cache config, idle engines, the histogram buckets no request reached), so
a line holds the snapshot and signals whole only every :data:`KEYFRAME_EVERY` records (a
*keyframe*: also the first line of each file and the first after a failed write); the lines in
between are *deltas*: only the fields that differ from the previous record, found by walking
the two tick's objects side by side (equal subtrees are skipped with one C-level comparison,
so a tick costs what changed, not what exists). Each line carries ``seq`` (and a delta ``base``,
the ``seq`` it applies to): a missing or damaged line breaks the chain until the next keyframe
with an error that says so, while a stray line inserted between two records does not. The
reader (:func:`read_records`, :class:`Resolver`) rebuilds every line into the same full record
format 1 wrote, so replay, diagnose and bundles read either format; a line that names a format
this version does not know is an error naming it.

Delta encoding, for a value ``new`` against the previous tick's ``old`` (both Python objects):
a dataclass of the same type becomes ``{field: delta}`` for the fields that changed; a tuple of
dataclasses of the same length ``{"@": {index: delta}}``; anything else that changed is its JSON
(wrapped as ``{"=": value}`` when that is an object or a list); format 3 adds one form, for a
tuple of pairs whose first items are the old tuple's (a histogram's buckets that kept their
bounds, the common change under load: only the counts moved), ``{"#": [second items]}``, which
costs a C-level pass over the buckets instead of a list per bucket and holds half the numbers.
Unchanged fields are absent. A tuple is first compared whole, so numbers that compare equal inside one (``1``, ``1.0``,
``True``) count as unchanged: decoding is typed by the model (:func:`from_jsonable`), so they
read back alike.

Writes never raise into the loop: a full disk or a read-only path disables recording with one
error on record, and the guardian keeps guarding.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import operator
import threading
import time
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from vllm_guardian.lowio.appendfile import append_lines
from vllm_guardian.model import Snapshot

T = TypeVar("T")


@functools.lru_cache(maxsize=256)
def _field_names(tp: type) -> tuple[str, ...] | None:
    if dataclasses.is_dataclass(tp):
        return tuple(f.name for f in dataclasses.fields(tp))
    return None


_PLAIN = frozenset({str, int, bool, type(None)})  # JSON as they are


def to_jsonable(obj: Any) -> Any:
    """Dataclasses → dicts, enums → values, tuples → lists, ±Inf/NaN → strings.

    Runs on every tick for the flight recorder, so the common types are checked first and a
    dataclass's field names are looked up once per type.
    """
    tp = type(obj)
    if tp in _PLAIN:
        return obj
    if tp is float:
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("+Inf" if obj > 0 else "-Inf")
    if tp is tuple or tp is list:
        # Plain values inline, without a call each (``v - v == 0``: a finite float).
        out_list = []
        for v in obj:
            tv = type(v)
            if tv in _PLAIN or (tv is float and v - v == 0.0):
                out_list.append(v)
            elif tv is tuple and len(v) == 2 and type(v[1]) is float and v[1] - v[1] == 0.0:
                # A histogram bucket (le, count): le may be +Inf, count is a finite float.
                le = v[0]
                out_list.append(
                    [le if type(le) is float and le - le == 0.0 else to_jsonable(le), v[1]]
                )
            else:
                out_list.append(to_jsonable(v))
        return out_list
    if isinstance(obj, enum.Enum):
        return obj.value
    names = _field_names(tp)  # type: ignore[arg-type]  # types are hashable
    if names is not None:
        out = {}
        for n in names:
            v = getattr(obj, n)
            tv = type(v)
            out[n] = v if tv in _PLAIN or (tv is float and v - v == 0.0) else to_jsonable(v)
        return out
    if isinstance(obj, tuple | list):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float):
        return to_jsonable(float(obj))
    return obj


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` (dataclass, enum, tuple, union, scalar) from JSON data."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        last_error: Exception | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_jsonable(arg, data)
            except (TypeError, ValueError, KeyError) as e:
                last_error = e
        raise ValueError(f"no member of {tp} fits {data!r}: {last_error}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TypeError(f"expected an object for {tp.__name__}, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {
            f.name: from_jsonable(hints[f.name], data[f.name])
            for f in dataclasses.fields(tp)
            if f.name in data and f.init
        }
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise TypeError(f"expected a list for {tp}, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in data)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=True))
    if tp is float:
        if isinstance(data, str) and data in ("+Inf", "-Inf", "NaN"):
            return float(data.replace("+", ""))
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise TypeError(f"expected a number, got {data!r}")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise TypeError(f"expected an integer, got {data!r}")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise TypeError(f"expected a boolean, got {data!r}")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise TypeError(f"expected a string, got {data!r}")
        return data
    if tp is Any or tp is object:
        return data
    raise TypeError(f"cannot decode {tp}")


FORMAT = 3
# 1: every line whole (no "format" key); 2: keyframes and deltas; 3: 2 and new histogram counts
# ({"#": ...}), so that a reader that knows only 2 says the file is newer instead of misreading
KNOWN_FORMATS = (1, 2, 3)
# A keyframe a minute at a 1 s interval: a tail of the file (a bundle's) holds one within a
# minute of records, and a damaged line costs at most this many records.
KEYFRAME_EVERY = 60
DELTA_KEYS = ("snapshot", "signals")  # delta-encoded; the record's other keys are whole

_SAME: Any = object()
_SCALARS = (str, int, float, bool)


def _whole(value: Any) -> Any:
    j = to_jsonable(value)
    return {"=": j} if type(j) is dict or type(j) is list else j


def delta(new: Any, old: Any) -> Any:
    """What changed from ``old`` to ``new`` (module docstring), or :data:`_SAME`."""
    if new is old:
        return _SAME
    tp = type(new)
    if tp is not type(old):
        return _whole(new)
    if tp in _SCALARS:
        return _SAME if new == old else to_jsonable(new)
    names = _field_names(tp)  # type: ignore[arg-type]  # types are hashable
    if names is not None:
        out: dict[str, Any] = {}
        for n in names:
            a = getattr(new, n)
            b = getattr(old, n)
            if a is b:
                continue
            ta = type(a)
            if ta is type(b) and ta in _SCALARS:  # the common case, without a call
                if a != b:
                    out[n] = to_jsonable(a)
                continue
            d = delta(a, b)
            if d is not _SAME:
                out[n] = d
        return out if out else _SAME
    if tp is tuple or tp is list:
        if new == old:  # one C-level comparison for tuples of numbers (histogram buckets)
            return _SAME
        if len(new) != len(old) or not new:
            return _whole(new)
        if type(new[0]) is tuple:
            seconds = _new_seconds(new, old)
            return _whole(new) if seconds is None else {"#": seconds}
        if _field_names(type(new[0])) is None:  # type: ignore[arg-type]
            return _whole(new)  # element by element only for records (engines, devices)
        changed: dict[str, Any] = {}
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            d = delta(a, b)
            if d is not _SAME:
                changed[str(i)] = d
        return {"@": changed} if changed else _SAME
    return _SAME if new == old else _whole(new)


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_NUMBERS = frozenset({float, int})


def _new_seconds(new: tuple[Any, ...], old: tuple[Any, ...]) -> list[Any] | None:
    """The second items of ``new``'s pairs when its first items are ``old``'s pairs' (a
    histogram whose buckets kept their bounds: only the counts moved) and each is a finite
    number (JSON as it is); None otherwise. Each test is one pass in C over the tuple."""
    if set(map(type, new)) != {tuple} or set(map(type, old)) != {tuple}:
        return None
    if set(map(len, new)) != {2} or set(map(len, old)) != {2}:
        return None
    if list(map(_FIRST, new)) != list(map(_FIRST, old)):
        return None
    seconds = list(map(_SECOND, new))
    if not set(map(type, seconds)) <= _NUMBERS:
        return None
    total = sum(seconds)
    return seconds if total - total == 0 else None  # an infinity or NaN makes the sum one


def apply_delta(old: Any, d: Any) -> Any:
    """``old``'s JSON with delta ``d`` applied (raises ValueError when they do not fit).

    Unchanged subtrees are shared with ``old``, never copied: records are read, not edited."""
    if type(d) is not dict:
        return d
    if len(d) == 1:
        if "=" in d:
            return d["="]
        if "@" in d:
            if type(old) is not list or type(d["@"]) is not dict:
                raise ValueError("an element delta for something that is not a list")
            out = list(old)
            for k, v in d["@"].items():
                i = int(k)
                if not 0 <= i < len(out):
                    raise ValueError(f"an element delta for index {i} of a {len(out)}-list")
                out[i] = apply_delta(out[i], v)
            return out
        if "#" in d:
            seconds = d["#"]
            if type(old) is not list or type(seconds) is not list or len(old) != len(seconds):
                raise ValueError("new second items for something that is not a list as long")
            if any(type(pair) is not list or len(pair) != 2 for pair in old):
                raise ValueError("new second items for a list that is not of pairs")
            return [[pair[0], v] for pair, v in zip(old, seconds, strict=True)]
    if type(old) is not dict:
        raise ValueError("a field delta for something that is not an object")
    new = dict(old)
    for k, v in d.items():
        new[k] = apply_delta(old.get(k), v)
    return new


class FlightRecorder:
    """Appends JSON lines to ``path``; at ``max_bytes`` rotates path → path.1 → … path.N.

    Format 3 (module docstring): a keyframe every ``keyframe_every`` records, deltas between."""

    def __init__(
        self,
        path: str | Path,
        max_bytes: int,
        backups: int,
        keyframe_every: int = KEYFRAME_EVERY,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.keyframe_every = max(1, keyframe_every)
        self._lock = threading.Lock()
        self.error: str | None = None
        self.records_written = 0
        self._previous: dict[str, Any] | None = None  # the last written record's own values
        self._since_keyframe = 0
        self._seq = 0

    def _line(self, record: dict[str, Any], keyframe: bool) -> bytes:
        head: dict[str, Any] = {"format": FORMAT, "seq": self._seq}
        previous = self._previous
        if keyframe or previous is None:
            body = {"kind": "key", **to_jsonable(record)}
        else:
            changes = {}
            for k in DELTA_KEYS:
                if k in record:
                    d = delta(record[k], previous[k])
                    if d is not _SAME:
                        changes[k] = d
            rest = {k: v for k, v in record.items() if k not in DELTA_KEYS}
            body = {"kind": "delta", "base": self._seq - 1, **to_jsonable(rest)}
            body["delta"] = changes  # already JSON: not walked again
        return (
            json.dumps({**head, **body}, separators=(",", ":"), allow_nan=False) + "\n"
        ).encode()

    def write(self, record: dict[str, Any]) -> bool:
        with self._lock:
            self._seq += 1
            keyframe = (
                self._previous is None
                or self._since_keyframe >= self.keyframe_every
                or self._previous.keys() != record.keys()
            )
            line = self._line(record, keyframe)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                size = self.path.stat().st_size if self.path.exists() else 0
                if size and size + len(line) > self.max_bytes:
                    self._rotate()
                    if not keyframe:  # each file starts with a keyframe: it reads on its own
                        keyframe = True
                        line = self._line(record, keyframe)
                # The whole line or none (a full disk): a cut record must not swallow the next.
                append_lines(self.path, line)
            except OSError as e:
                self.error = f"cannot write flight record to {self.path}: {e.strerror or e}"
                self._previous = None  # the next line that lands is a keyframe
                return False
            self.error = None
            self.records_written += 1
            self._previous = record
            self._since_keyframe = 1 if keyframe else self._since_keyframe + 1
            return True

    def _rotate(self) -> None:
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))


@dataclasses.dataclass(frozen=True)
class RecordError:
    file: str
    line: int
    message: str


# A record stamped this far ahead of the reader's clock is not from this world (a clock set
# years ahead, a tampered line). Generous, so that recordings made under a test's fake clock
# (a few months ahead) still read; a smaller jump is caught against the records around it.
MAX_FUTURE_SECONDS = 366 * 86400.0


def _no_constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON (the recorder writes it as a string)")


def decode_line(line: str) -> dict[str, Any] | str:
    """One flight-record line → its record, or why it is not one (never raises)."""
    try:
        rec = json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return f"not JSON: {e.msg}"
    except ValueError as e:
        return f"not JSON: {e}"
    except RecursionError:
        return "nested too deeply to be a flight record"
    if not isinstance(rec, dict):
        return "not a JSON object"
    return rec


# How every record of format 2 and later begins (json.dumps of the head, no spaces).
_RECORD_START = '{"format":'
_MAX_RESYNC_TRIES = 16


def split_cut(line: str) -> tuple[str, str] | None:
    """A line that is not a record but holds a whole one after a cut one: before writes were
    whole lines or none (appendfile.py), a record cut by a full disk had the next one appended
    to it on the same line. ``(why the cut part is skipped, the whole record's text)``, or None.
    Inside a record a string never holds ``{"format":`` unescaped, so each place it appears
    past the start is where a record may begin."""
    i = line.find(_RECORD_START, 1)
    for _ in range(_MAX_RESYNC_TRIES):
        if i == -1:
            break
        if isinstance(decode_line(line[i:]), dict):
            return (
                f"a cut record ({i} bytes: a short write, a full disk?) with the next record "
                "glued to it: the cut part is skipped, the record after it read",
                line[i:],
            )
        i = line.find(_RECORD_START, i + 1)
    return None


class Resolver:
    """Turns a file's decoded lines, in order, into full records (format 1's shape).

    :meth:`feed` gives the full record, or why the line is not one: a format this version does
    not know, or a delta whose base record is missing (a lost or damaged line: the chain
    resumes at the next keyframe). A stray line that is not a record does not break the chain:
    a delta names the record it applies to."""

    def __init__(self) -> None:
        self._base: dict[str, Any] | None = None
        self._base_seq: int | None = None

    def feed(self, rec: dict[str, Any]) -> dict[str, Any] | str:
        fmt = rec.get("format", 1)
        if fmt == 1 and "format" not in rec:
            return rec
        if fmt not in KNOWN_FORMATS or fmt == 1:
            return (
                f"flight record format {fmt!r} is not one this version reads "
                f"({', '.join(map(str, KNOWN_FORMATS))}): written by a newer vllm-guardian?"
            )
        seq, kind = rec.get("seq"), rec.get("kind")
        if isinstance(seq, bool) or not isinstance(seq, int):
            return f"format {fmt} record without a sequence number"
        full = {k: v for k, v in rec.items() if k not in ("format", "seq", "kind", "base", "delta")}
        if kind == "key":
            self._base, self._base_seq = full, seq
            return full
        if kind != "delta":
            return f"format {fmt} record of unknown kind {kind!r}"
        if self._base is None or rec.get("base") != self._base_seq:
            return (
                f"delta record {seq} without the record it applies to ({rec.get('base')!r}): "
                "a line is missing or damaged; reading resumes at the next keyframe"
            )
        changes = rec.get("delta")
        if not isinstance(changes, dict):
            return "delta record without its changes"
        try:
            for k in DELTA_KEYS:
                full[k] = (
                    apply_delta(self._base.get(k), changes[k])
                    if k in changes
                    else (self._base.get(k))
                )
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            self._base, self._base_seq = None, None
            return f"delta record {seq} does not fit the record before it: {e}"
        self._base, self._base_seq = full, seq
        return full


def _snapshot_time(rec: dict[str, Any], now_seconds: float) -> tuple[float | None, str | None]:
    snap = rec.get("snapshot")
    if not isinstance(snap, dict) or "time_seconds" not in snap:
        return None, None  # not a snapshot record: decoding it says so
    t = snap["time_seconds"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return None, f"snapshot time {t!r} is not a finite number"
    if t > now_seconds + MAX_FUTURE_SECONDS:
        return None, f"snapshot time {t:.0f} is in the future (now {now_seconds:.0f})"
    return float(t), None


def checked_times(
    records: Iterable[tuple[T, dict[str, Any]]], now_seconds: float
) -> Iterator[tuple[T, dict[str, Any], str | None]]:
    """Each (tag, record) with why its snapshot time is unusable, or None.

    Unusable: not a finite number; over :data:`MAX_FUTURE_SECONDS` ahead of ``now_seconds``;
    before the last accepted record (backwards); or ahead of the record after it while that one
    follows the last accepted record (a jump forward). One bad stamp would otherwise reorder or
    stretch the windows that every rate and alert duration is computed over — and a single jump
    forward would make every later record look like it went backwards. A record is yielded once
    its successor is seen, so tags may come out in a slightly different order.
    """
    last: float | None = None
    pending: tuple[T, dict[str, Any], float] | None = None
    for tag, rec in records:
        t, why = _snapshot_time(rec, now_seconds)
        if why is not None or t is None:
            yield tag, rec, why
            continue
        if last is not None and t < last:
            yield tag, rec, f"snapshot time {t:.3f} goes backwards (previous {last:.3f})"
            continue
        if pending is not None:
            ptag, prec, pt = pending
            if pt > t:
                yield ptag, prec, f"snapshot time {pt:.3f} jumps ahead of the records after it"
            else:
                last = pt
                yield ptag, prec, None
        pending = (tag, rec, t)
    if pending is not None:
        yield pending[0], pending[1], None


def read_records(
    path: str | Path, include_rotated: bool = True, now_seconds: float | None = None
) -> Iterator[dict[str, Any] | RecordError]:
    """Yield each record, oldest file first; a bad line yields a RecordError and reading goes on.

    Bad: not JSON (bare NaN/Infinity included), nested too deeply, not an object, or a snapshot
    time that :func:`checked_times` rejects (``now_seconds``: default the clock)."""
    p = Path(path)
    files: list[Path] = []
    if include_rotated:
        rotated = sorted(
            (f for f in p.parent.glob(p.name + ".*") if f.suffix[1:].isdigit()),
            key=lambda f: -int(f.suffix[1:]),
        )
        files.extend(rotated)
    files.append(p)
    errors: list[RecordError] = []

    def decoded() -> Iterator[tuple[tuple[str, int], dict[str, Any]]]:
        for f in files:
            if not f.exists():
                continue
            resolver = Resolver()  # each file starts with a keyframe
            with f.open("r", encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = decode_line(line)
                    if isinstance(rec, str) and (cut := split_cut(line)) is not None:
                        errors.append(RecordError(str(f), n, cut[0]))
                        rec = decode_line(cut[1])
                    if not isinstance(rec, str):
                        rec = resolver.feed(rec)
                    if isinstance(rec, str):
                        errors.append(RecordError(str(f), n, rec))
                    else:
                        yield (str(f), n), rec

    now = time.time() if now_seconds is None else now_seconds
    for (file, n), rec, why in checked_times(decoded(), now):
        while errors:
            yield errors.pop(0)
        yield RecordError(file, n, why) if why is not None else rec
    yield from errors


def snapshot_from_record(rec: dict[str, Any]) -> Snapshot:
    """The Snapshot of a flight record (raises ValueError/TypeError/KeyError when malformed)."""
    result: Snapshot = from_jsonable(Snapshot, rec["snapshot"])
    return result
