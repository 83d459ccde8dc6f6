"""A filtering parser for the Prometheus text exposition format (0.0.4, and OpenMetrics samples).

Where it sits: the vLLM metrics source hands it each scrape body; it returns only the samples
whose names the guardian uses. vLLM exposes ~60 families (~450 lines per engine); the guardian
reads about 20. Parsing everything with ``prometheus_client.parser`` costs ~50 ms for an
8-engine server, every tick. This parser skips whole unwanted family blocks with C-level
string searches and parses label sets only for wanted lines, which makes the same work 20×
cheaper or better (``bench/tick.py``). A differential test checks it agrees with
prometheus_client on every fixture and on generated expositions.

Pure: no I/O. Malformed lines are counted and skipped, never raised.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

Labels = tuple[tuple[str, str], ...]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# One label pair in the general case: name="value" with \\ \" \n escapes.
_LABEL_PAIR = re.compile(
    r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)', re.DOTALL
)
# A whole sample line in the common shape; label bodies with escapes or '#' take the slow path.
_SIMPLE_LINE = re.compile(
    r"^([^{\s#]+)\{([^\n#\\]*)\}[ \t]+(\S+)(?:[ \t]+(\S+))?[ \t]*$", re.MULTILINE
)
# A Scan's line head that is a sample's name and labels alone (no escapes, no blanks, no '#').
_HEAD = re.compile(r"([^{\s#]+)(?:\{([^\n#\\]*)\})?\Z")
_ESCAPE = re.compile(r"\\(.)")
_BLANK = re.compile(r"[ \t]")  # what separates a sample's name from its value
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class Sample(NamedTuple):
    """One sample. A NamedTuple, not a dataclass: hundreds are built per scrape."""

    name: str
    labels: Labels  # sorted by label name
    value: float
    note: object = None  # what the parser's `annotate` hook said about these labels


@dataclass(frozen=True)
class ParseResult:
    samples: tuple[Sample, ...]
    malformed_lines: int
    prefixes_seen: frozenset[str]  # which of the watched prefixes had any sample at all


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), value)


def _parse_value(text: str) -> float | None:
    if "_" in text:  # float() accepts 1_000; the exposition format does not
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _parse_labels(body: str) -> Labels | None:
    """The text between ``{`` and ``}``. None if malformed."""
    if not body.strip() or body.strip() == ",":  # {} and {,} are both an empty label set
        return ()
    if "\\" not in body:
        # Fast path: without escapes a value cannot contain '"', so '",' and '="' split exactly.
        out: list[tuple[str, str]] = []
        stripped = body.strip().removesuffix(",").rstrip()
        if not stripped.endswith('"'):
            return None
        for part in stripped[:-1].split('",'):
            k, sep, v = part.partition('="')
            k = k.strip()
            if not sep or not _LABEL_NAME.match(k):
                # `name = "v"` with spaces around '=' is legal but rare: use the general path.
                return _parse_labels_general(body)
            out.append((k, v))
        return tuple(sorted(out))
    return _parse_labels_general(body)


def _parse_labels_general(body: str) -> Labels | None:
    out: list[tuple[str, str]] = []
    pos = 0
    body = body.strip()
    while pos < len(body):
        m = _LABEL_PAIR.match(body, pos)
        if not m:
            return None
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(sorted(out))


def _split_sample(line: str) -> tuple[str, Labels, float] | None:
    """Parse one sample line; None if malformed."""
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace].rstrip()
        close = _closing_brace(line, brace)
        if close < 0:
            return None
        labels = _parse_labels(line[brace + 1 : close])
        if labels is None:
            return None
        rest = line[close + 1 :]
    else:
        parts = line.split(None, 1)
        if len(parts) < 2:
            return None
        name, rest = parts
        labels = ()
    # OpenMetrics exemplar: "value [ts] # {labels} value [ts]"; the sample is what precedes it.
    hash_at = rest.find("#")
    if hash_at >= 0:
        rest = rest[:hash_at]
    fields = rest.split()
    if not fields or len(fields) > 2 or not _NAME.match(name):
        return None
    value = _parse_value(fields[0])
    if value is None:
        return None
    if len(fields) == 2 and _parse_value(fields[1]) is None:
        return None
    return name, labels, value


def _closing_brace(line: str, brace: int) -> int:
    close = line.find("}", brace)
    if close < 0:
        return -1
    segment = line[brace:close]
    if '"' not in segment or ("\\" not in segment and segment.count('"') % 2 == 0):
        return close
    # A '}' inside a quoted label value: walk the string honouring escapes.
    in_quote = False
    i = brace + 1
    while i < len(line):
        c = line[i]
        if in_quote:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_quote = False
        elif c == '"':
            in_quote = True
        elif c == "}":
            return i
        i += 1
    return -1


class Scan(NamedTuple):
    """A body's lines outside the skipped families, each cut at its last space, not read.

    ``shape`` is everything of the body that :meth:`Parser.parse` reads except what follows
    each line's last space: two bodies of equal shapes whose lines all read as
    ``name{labels} value`` (:func:`split_head`) parse to the same samples in the same order,
    with the values read from ``raw_values`` at the same positions (:meth:`Parser.scan`)."""

    shape: tuple[object, ...]
    heads: tuple[str, ...]  # each line up to its last space
    raw_values: tuple[str, ...]  # and after it


class Parser:
    """A filtering parser for one set of wanted sample names.

    Keep one per scrape target: it caches parsed label sets (bounded), and a server repeats
    the same label sets every scrape, so from the second scrape on most wanted lines cost one
    dict lookup and one float().
    """

    MAX_CACHED_LABEL_SETS = 20_000

    def __init__(
        self,
        wanted: Iterable[str],
        watch_prefixes: Iterable[str] = (),
        annotate: Callable[[Labels], object] | None = None,
    ) -> None:
        """``annotate`` (optional) derives a note from a label set once, cached with it:
        callers use it to avoid re-reading the same labels on every scrape."""
        self.wanted = frozenset(wanted)
        self.prefixes = tuple(watch_prefixes)
        self._annotate = annotate
        self._labels: dict[str, tuple[Labels, object] | None] = {}
        self._skippable: dict[str, bool] = {}

    def _label_set(self, body: str) -> tuple[Labels, object] | None:
        cache = self._labels
        if len(cache) >= self.MAX_CACHED_LABEL_SETS:
            cache.clear()  # label churn (e.g. per-request labels): start over, stay bounded
        labels = _parse_labels(body)
        entry = (
            None if labels is None else (labels, self._annotate(labels) if self._annotate else None)
        )
        cache[body] = entry
        return entry

    def _general(self, line: str, samples: list[Sample]) -> bool:
        parsed = _split_sample(line)
        if parsed is None:
            return False
        note = self._annotate(parsed[1]) if self._annotate else None
        samples.append(Sample(parsed[0], parsed[1], parsed[2], note))
        return True

    def _sample_blocks(self, text: str, wanted: frozenset[str]) -> Iterator[tuple[int, int]]:
        """The ``(start, end)`` of each run of sample lines between comment lines, in order,
        except a run that wholly belongs to a typed family no wanted name starts with: the walk
        :meth:`parse` and :meth:`scan` share, so the plan sees the lines the parse reads."""
        n = len(text)
        pos = 0
        family: str | None = None  # the family named by the last # TYPE line
        while pos < n:
            if text.startswith("#", pos):
                eol = text.find("\n", pos)
                eol = n if eol < 0 else eol
                if text.startswith("# TYPE ", pos):
                    parts = text[pos:eol].split()
                    family = parts[2] if len(parts) >= 3 else None
                pos = eol + 1
                continue
            end = _next_comment_line(text, pos)
            end = n if end < 0 else end
            start, pos = pos, end
            if family is not None:
                skippable = self._skippable.get(family)
                if skippable is None:
                    skippable = not any(w.startswith(family) for w in wanted)
                    self._skippable[family] = skippable
                # Skip the block at C speed, without copying it, when every line in it belongs
                # to the typed family. (start - 1 is the newline that ends the previous line.)
                if skippable and start > 0:
                    lines = text.count("\n", start, end)
                    if text.count("\n" + family, start - 1, end) == lines:
                        continue
            yield start, end

    def parse(self, text: str) -> ParseResult:
        """Return the samples whose *sample name* is wanted, in exposition order.

        A body that does not end in a newline has its last line dropped as malformed: the
        format requires the final newline, so a missing one means a truncated body.
        """
        wanted = self.wanted
        prefixes = self.prefixes
        samples: list[Sample] = []
        malformed = 0
        if "\r" in text:
            text = text.replace("\r\n", "\n")
        if text and not text.endswith("\n"):
            cut = text.rfind("\n")
            tail = text[cut + 1 :]
            if tail.strip() and not tail.lstrip().startswith("#"):
                malformed += 1
            text = text[: cut + 1]
        # "Does any sample start with this prefix?" is one C-level search per prefix.
        seen = {p for p in prefixes if text.startswith(p) or ("\n" + p) in text}
        label_cache = self._labels
        for start, end in self._sample_blocks(text, wanted):
            block = text[start:end]
            simple = _SIMPLE_LINE.findall(block)
            if len(simple) == block.count("\n"):
                # Every line of the block is `name{labels} value [ts]` without escapes or
                # exemplars: the regex did the splitting in C; only wanted lines cost more.
                for name, body, raw_value, raw_ts in simple:
                    if name not in wanted:
                        if not _NAME.match(name):
                            malformed += 1
                        continue
                    entry = label_cache.get(body, _MISS)
                    if entry is _MISS:
                        entry = self._label_set(body)
                    if entry is None or "_" in raw_value:
                        malformed += 1
                        continue
                    try:
                        value = float(raw_value)
                        if raw_ts:
                            float(raw_ts)
                    except ValueError:
                        malformed += 1
                        continue
                    samples.append(Sample(name, entry[0], value, entry[1]))  # type: ignore[index]
                continue
            for line in block.split("\n"):
                if not line:
                    continue
                if line[0] in " \t":  # leading blanks are allowed before a sample or comment
                    line = line.lstrip(" \t")
                    if not line or line[0] == "#":
                        continue
                brace = line.find("{")
                if brace > 0:
                    name = line[:brace]
                    if name in wanted:
                        if "#" not in line and "\\" not in line:
                            # Common case, inlined: name{simple labels} value [timestamp]
                            close = line.rfind("}")
                            body = line[brace + 1 : close]
                            entry = label_cache.get(body, _MISS)
                            if entry is _MISS:
                                entry = self._label_set(body)
                            fields = line[close + 1 :].split()
                            if entry is not None and close > brace and 1 <= len(fields) <= 2:
                                try:
                                    value = float(fields[0])
                                    if len(fields) == 2:
                                        float(fields[1])
                                except ValueError:
                                    malformed += 1
                                    continue
                                if "_" not in fields[0]:
                                    samples.append(Sample(name, entry[0], value, entry[1]))  # type: ignore[index]
                                    continue
                        if not self._general(line, samples):
                            malformed += 1
                        continue
                    if " " not in name and _NAME.match(name):
                        continue  # an unwanted sample
                blank = _BLANK.search(line)  # a space or a tab
                space = blank.start() if blank is not None else -1
                name = line[:space] if space >= 0 else line
                if name in wanted:
                    if not self._general(line, samples):
                        malformed += 1
                    continue
                if (space < 0 or not _NAME.match(name.strip() or "-")) and not line.isspace():
                    malformed += 1  # not even a metric name: garbage
        return ParseResult(tuple(samples), malformed, frozenset(seen))

    def scan(self, text: str) -> Scan | None:
        """The sample lines :meth:`parse` would read, split but not interpreted; None when a
        line needs more than the common shape (escapes, exemplars, blanks, a truncated body),
        which only :meth:`parse` reads.

        It walks the body exactly as :meth:`parse` does (the same blocks skipped), so a
        caller that has parsed a body of the same :attr:`Scan.shape` before can reuse what it
        derived from it and read only the values (sources/vllm_metrics.py does)."""
        if "\r" in text or (text and not text.endswith("\n")):
            return None
        prefixes = self.prefixes
        seen = frozenset(p for p in prefixes if text.startswith(p) or ("\n" + p) in text)
        wanted = self.wanted
        heads: list[str] = []
        raw_values: list[str] = []
        sizes: list[int] = []
        for start, end in self._sample_blocks(text, wanted):
            lines = text[start:end].split("\n")
            lines.pop()  # the block ends with a newline
            cut = [line.rpartition(" ") for line in lines]
            heads += [c[0] for c in cut]
            raw_values += [c[2] for c in cut]
            sizes.append(len(lines))
        return Scan((seen, tuple(sizes), tuple(heads)), tuple(heads), tuple(raw_values))

    @staticmethod
    def split_head(head: str) -> tuple[str, str] | None:
        """A :class:`Scan` line head as ``(name, label text)`` when it is just a sample's name
        and labels without escapes; None for anything else (a timestamp, a blank, an exemplar),
        which only :meth:`parse` reads."""
        m = _HEAD.match(head)
        return None if m is None else (m.group(1), m.group(2) or "")

    def label_set(self, body: str) -> tuple[Labels, object] | None:
        """The parsed labels of a label text (without braces) and its note, cached; None if
        malformed."""
        entry = self._labels.get(body, _MISS)
        if entry is _MISS:
            entry = self._label_set(body)
        return entry  # type: ignore[return-value]


_MISS = object()


def _next_comment_line(text: str, pos: int) -> int:
    """Index of the next line starting with '#', or -1.

    A one-character find is a memchr; searching for "\\n#" is several times slower on
    a body where every line ends in a newline.
    """
    while True:
        i = text.find("#", pos)
        if i <= 0 or text[i - 1] == "\n":
            return i
        pos = i + 1  # a '#' inside a label value or an exemplar


def parse(text: str, wanted: Iterable[str], watch_prefixes: Iterable[str] = ()) -> ParseResult:
    """One-off parse (no label cache carried between calls). See :class:`Parser`."""
    return Parser(wanted, watch_prefixes).parse(text)


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
