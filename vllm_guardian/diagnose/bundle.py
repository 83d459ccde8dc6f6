"""The incident bundle (docs/bundle.md): read from a directory or a ``.tar.gz``, and write.

The format's one owner: the guardian's capture before an action (``actuators/bundle.py``) and
``diagnose --save-bundle`` both write through :func:`write_bundle`; ``diagnose`` reads through
:func:`read_bundle`. The documents it holds that are built from the guardian's own types
(``unit.json``, ``gpus.json``) are built here too.

Reading never raises on bad content: every missing, malformed or oversized file becomes a line
in :attr:`Bundle.problems` and the rest is still used, so a damaged bundle gives a partial
report with the reason instead of a traceback. Only a path that is neither a directory nor a
readable tar archive is an error (:class:`BundleError`, a usage error for the CLI).

A tar is never extracted outside a fresh temporary directory: members with absolute paths or
``..`` components, links, devices and FIFOs, and members larger than
:data:`MAX_MEMBER_BYTES` are skipped (and listed as problems), and the total extracted is capped.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from vllm_guardian.core.signals import belongs_to
from vllm_guardian.formats import recorder
from vllm_guardian.lowio.redact import redact_argv, redact_json, redact_text
from vllm_guardian.model import GpuDevice, UnitState, XidEvent

FORMAT = 1
# Bounded work and memory per bundle (docs/bundle.md "Reading limits"): a bundle the policy
# writes is a few MiB; these stop a crafted one (a 65 KB tar.gz can hold 64 MiB of tiny lines).
MAX_MEMBER_BYTES = 64 * 1024 * 1024
MAX_TOTAL_BYTES = 256 * 1024 * 1024  # extracted, all members together
MAX_MEMBERS = 10_000
MAX_NAME_CHARS = 1024  # a member's path; a longer one is no bundle file
MAX_READ_BYTES = 160 * 1024 * 1024  # read by the analysis, all files together
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_PROM_BYTES = 32 * 1024 * 1024
MAX_SCRAPES = 64  # the newest ones; rates need two, a trend a few
MAX_SCRAPE_TOTAL_BYTES = 64 * 1024 * 1024  # the newest scrapes up to this much
MAX_JOURNAL_BYTES = 16 * 1024 * 1024  # the tail is kept: the incident is at the end
MAX_JOURNAL_LINES = 200_000
MAX_FLIGHT_BYTES = 32 * 1024 * 1024
MAX_FLIGHT_RECORDS = 2_000  # the newest; the policy's bundle holds 300
MAX_ALLOCATOR_FILES = 256

_PROM_NAME = re.compile(r"(\d+(?:\.\d+)?)\.prom")


class BundleError(Exception):
    """The path is not a bundle at all (not a directory, not a readable tar)."""


@dataclass(frozen=True)
class Bundle:
    """A bundle's contents, parsed as far as they could be. Every field may be empty."""

    origin: str  # what it was read from (a path, or the URL of a live gathering)
    service: str = "vllm"
    created: str | None = None  # ISO 8601
    created_seconds: float | None = None
    manifest: dict[str, Any] | None = None
    scrapes: tuple[tuple[float, str], ...] = ()  # (unix time, /metrics body), oldest first
    metrics_error: str | None = None  # why a scrape is missing or cut (metrics/ERROR.txt)
    health: dict[str, Any] | None = None
    gpus: list[dict[str, Any]] | None = None
    cmdline: tuple[str, ...] | None = None
    model_config: dict[str, Any] | None = None
    safetensors_index: dict[str, Any] | None = None
    models: dict[str, Any] | None = None  # GET /v1/models
    journal: tuple[str, ...] = ()
    unit: dict[str, Any] | None = None
    allocator: tuple[tuple[str, dict[str, Any]], ...] = ()
    flight: tuple[dict[str, Any], ...] = ()  # flight-recorder records (the daemon's ticks)
    action: dict[str, Any] | None = None  # the action the policy was about to take
    picture: str | None = None  # where its incident picture (incident.svg) is, when it has one
    problems: tuple[str, ...] = field(default=())


# --- the documents built from the guardian's types ------------------------------------------


def unit_document(u: UnitState) -> dict[str, Any]:
    """``unit.json`` of the bundle format (docs/bundle.md)."""
    return {
        "Id": u.unit,
        "ActiveState": u.active_state,
        "SubState": u.sub_state,
        "Result": u.result,
        "NRestarts": u.n_restarts,
        "ExecMainStatus": u.exec_main_status,
        "MainPID": u.main_pid,
    }


def gpus_document(
    devices: Iterable[GpuDevice], unit: UnitState | None, xid_events: Iterable[XidEvent]
) -> list[dict[str, Any]]:
    """``gpus.json`` of the bundle format: each GPU, its processes (the service's marked), its XIDs."""
    xids = list(xid_events)
    return [
        {
            "index": d.index,
            "name": d.name,
            "memory_total_bytes": d.memory_total_bytes,
            "memory_used_bytes": d.memory_used_bytes,
            "processes": [
                {
                    "pid": p.pid,
                    "name": p.name,
                    "used_memory_bytes": p.used_memory_bytes,
                    "service": belongs_to(p, unit),
                    # vLLM's weight-cache daemon (``vllm preload``): only where it is one.
                    **({"weight_cache": True} if p.weight_cache else {}),
                }
                for p in d.processes or ()
            ],
            "xid_events": [
                {"xid": e.xid, "unix_time": e.time_seconds} for e in xids if e.gpu_index == d.index
            ],
        }
        for d in devices
    ]


# --- reading ---------------------------------------------------------------------------------


def read_bundle(path: str | Path) -> Bundle:
    """A bundle from a directory or a tar archive (``.tar.gz``, ``.tgz``, ``.tar``)."""
    p = Path(path)
    if p.is_dir():
        return _read_dir(p, str(p))
    if not p.exists():
        raise BundleError(f"{p}: no such file or directory")
    if not p.is_file():
        raise BundleError(f"{p}: not a directory or a file")
    with tempfile.TemporaryDirectory(prefix="vllm-guardian-bundle-") as tmp:
        problems = safe_extract(p, Path(tmp))
        root = _bundle_root(Path(tmp))
        b = _read_dir(root, str(p))
    return _with_problems(b, problems)


def safe_extract(archive: Path, dest: Path) -> list[str]:
    """Extract the regular files and directories of ``archive`` under ``dest`` and nothing else.

    Returns what was skipped and why. Raises BundleError when the file is not a tar archive.
    """
    problems: list[str] = []
    total = 0
    seen: set[str] = set()
    dest = dest.resolve()
    try:
        tf = tarfile.open(archive, "r:*")  # noqa: SIM115  # closed below, after the loop
    except (tarfile.TarError, OSError) as e:
        raise BundleError(f"{archive}: not a directory or a tar archive ({e})") from None
    with tf:
        try:
            for n, member in enumerate(_members(tf)):
                if n >= MAX_MEMBERS:
                    problems.append(f"{archive}: more than {MAX_MEMBERS} members; the rest skipped")
                    break
                shown = member.name if len(member.name) <= 200 else member.name[:200] + "…"
                why = _unsafe(member, dest)
                if why is None and member.isfile():
                    key = str(PurePosixPath(member.name))
                    if key in seen:
                        why = "stored more than once; the first copy is used"
                    elif total + member.size > MAX_TOTAL_BYTES:
                        why = f"the bundle exceeds {MAX_TOTAL_BYTES >> 20} MiB"
                    seen.add(key)
                if why is None:
                    try:
                        total += _extract_one(tf, member, dest)
                    except OSError as e:  # this member only: the others are still extracted
                        why = f"cannot be written ({e.strerror or e})"
                if why is not None:
                    problems.append(f"{archive}: skipped {shown!r}: {why}")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            problems.append(f"{archive}: damaged archive, read up to the damage ({e})")
    return problems


def _extract_one(tf: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> int:
    """Write one checked member under ``dest``; the bytes written. Raises OSError."""
    target = dest.joinpath(*PurePosixPath(member.name).parts)
    if member.isdir():
        if target.exists() and not target.is_dir():
            raise FileExistsError(errno.EEXIST, "a file of that name came first")
        target.mkdir(parents=True, exist_ok=True)
        return 0
    src = tf.extractfile(member)
    if src is None:
        raise OSError(errno.EIO, "unreadable")
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL + O_NOFOLLOW: never write through something already there.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with src, os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return member.size


def _members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (m := tf.next()) is not None:
        yield m


def _unsafe(member: tarfile.TarInfo, dest: Path) -> str | None:
    name = member.name
    if len(name) > MAX_NAME_CHARS or any(len(p) > 255 for p in PurePosixPath(name).parts):
        return f"name longer than {MAX_NAME_CHARS} characters (or a part over 255)"
    pure = PurePosixPath(name)
    if name.startswith(("/", "\\")) or pure.is_absolute() or re.match(r"^[A-Za-z]:", name):
        return "absolute path"
    if any(part == ".." for part in pure.parts) or "\\" in name:
        return "path leaves the bundle ('..')"
    if member.issym() or member.islnk():
        return "a link"
    if not (member.isfile() or member.isdir()):
        return "not a regular file (device, FIFO or other special file)"
    if member.isfile() and member.size > MAX_MEMBER_BYTES:
        return f"larger than {MAX_MEMBER_BYTES >> 20} MiB"
    target = dest.joinpath(*pure.parts).resolve()
    if target != dest and dest not in target.parents:
        return "path leaves the bundle"
    return None


def _bundle_root(tmp: Path) -> Path:
    """The directory holding manifest.json: the archive's top or its single top directory."""
    if (tmp / "manifest.json").is_file():
        return tmp
    subdirs = [d for d in tmp.iterdir() if d.is_dir() and not d.is_symlink()]
    for d in subdirs:
        if (d / "manifest.json").is_file():
            return d
    return subdirs[0] if len(subdirs) == 1 and not any(tmp.glob("*.json")) else tmp


def _with_problems(b: Bundle, more: list[str]) -> Bundle:
    if not more:
        return b
    import dataclasses  # noqa: PLC0415  # keeps the module's imports about reading files

    return dataclasses.replace(b, problems=(*more, *b.problems))


class _Reader:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.problems: list[str] = []
        self.budget_bytes = MAX_READ_BYTES  # left to read, all files together

    def _file(self, rel: str) -> Path | None:
        p = self.root / rel
        if p.is_symlink():
            self.problems.append(f"{rel}: a symbolic link, ignored")
            return None
        return p if p.is_file() else None

    def text(self, rel: str, limit: int, tail: bool = False) -> str | None:
        p = self._file(rel)
        if p is None:
            return None
        if self.budget_bytes <= 0:
            self.problems.append(
                f"{rel}: not read, the bundle's {MAX_READ_BYTES >> 20} MiB are spent"
            )
            return None
        limit = min(limit, self.budget_bytes)
        try:
            size = p.stat().st_size
            with p.open("rb") as fh:
                if size > limit:
                    self.problems.append(
                        f"{rel}: {size >> 20} MiB, only the {'last' if tail else 'first'} {limit >> 20} MiB read"
                    )
                    if tail:
                        fh.seek(size - limit)
                data = fh.read(limit)
        except OSError as e:
            self.problems.append(f"{rel}: unreadable ({e.strerror or e})")
            return None
        self.budget_bytes -= len(data)
        if tail and size > limit:
            # The tail starts mid-line: that partial line could start anywhere in a line a
            # request wrote (a header in it is not one). Dropped.
            data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
        return data.decode("utf-8", errors="replace")

    def json(self, rel: str, want: type) -> Any:
        text = self.text(rel, MAX_JSON_BYTES)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            self.problems.append(f"{rel}: not valid JSON ({e}), ignored")
            return None
        if not isinstance(value, want):
            kind = "an object" if want is dict else "a list"
            self.problems.append(f"{rel}: expected {kind}, got {type(value).__name__}, ignored")
            return None
        return value


def _iso_seconds(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def _read_dir(root: Path, origin: str) -> Bundle:
    r = _Reader(root)
    manifest = r.json("manifest.json", dict)
    service, created = "vllm", None
    if manifest is None:
        if not (root / "manifest.json").exists():
            r.problems.append("manifest.json missing: is this a bundle? (read what is there)")
    else:
        fmt = manifest.get("format")
        if fmt != FORMAT:
            r.problems.append(
                f"manifest.json: format {fmt!r}, this reader knows {FORMAT}; read as {FORMAT}"
            )
        if isinstance(manifest.get("service"), str) and manifest["service"]:
            service = manifest["service"]
        created = manifest.get("created") if isinstance(manifest.get("created"), str) else None
        if created is not None and _iso_seconds(created) is None:
            r.problems.append(f"manifest.json: created {created!r} is not ISO 8601")
    # The small files first, so a bundle that spends its read budget still has them.
    small = {
        name: r.json(name, dict)
        for name in ("health.json", "model_config.json", "model.safetensors.index.json",
                     "models.json", "unit.json", "action.json")
    }  # fmt: skip
    gpus = r.json("gpus.json", list)
    if gpus is not None and not all(isinstance(g, dict) for g in gpus):
        r.problems.append("gpus.json: entries must be objects; the others ignored")
        gpus = [g for g in gpus if isinstance(g, dict)]
    cmdline_text = r.text("cmdline.txt", 1024 * 1024)
    cmdline = tuple(line for line in cmdline_text.splitlines() if line) if cmdline_text else None
    scrapes: list[tuple[float, str]] = []
    mdir = root / "metrics"
    if mdir.is_dir() and not mdir.is_symlink():
        named = []
        for f in mdir.iterdir():
            m = _PROM_NAME.fullmatch(f.name)
            if m is None:
                if f.suffix == ".prom":
                    r.problems.append(f"metrics/{f.name}: not named <unix seconds>.prom, ignored")
                continue
            named.append((float(m.group(1)), f.name))
        named.sort()
        if len(named) > MAX_SCRAPES:
            r.problems.append(f"metrics/: {len(named)} scrapes, the newest {MAX_SCRAPES} used")
            named = named[-MAX_SCRAPES:]
        scrape_bytes = 0
        for t, name in reversed(named):  # newest first, until the scrapes' share is spent
            if scrape_bytes >= MAX_SCRAPE_TOTAL_BYTES:
                r.problems.append(
                    f"metrics/: over {MAX_SCRAPE_TOTAL_BYTES >> 20} MiB of scrapes; "
                    f"{name} and older ones not read"
                )
                break
            body = r.text(
                f"metrics/{name}", min(MAX_PROM_BYTES, MAX_SCRAPE_TOTAL_BYTES - scrape_bytes)
            )
            if body is not None:
                scrapes.append((t, body))
                scrape_bytes += len(body)
        scrapes.reverse()
    error_text = r.text("metrics/ERROR.txt", 64 * 1024) if mdir.is_dir() else None
    metrics_error = error_text.strip() or None if error_text is not None else None
    journal_text = r.text("journal.log", MAX_JOURNAL_BYTES, tail=True)
    journal: tuple[str, ...] = ()
    if journal_text is not None:
        lines, more = _last_lines(journal_text, MAX_JOURNAL_LINES)
        if more:
            r.problems.append(
                f"journal.log: over {MAX_JOURNAL_LINES} lines, the last {MAX_JOURNAL_LINES} used"
            )
        journal = tuple(lines)
    allocator: list[tuple[str, dict[str, Any]]] = []
    adir = root / "allocator"
    if adir.is_dir() and not adir.is_symlink():
        for f in sorted(adir.glob("*.json"))[:MAX_ALLOCATOR_FILES]:
            doc = r.json(f"allocator/{f.name}", dict)
            if doc is not None:
                allocator.append((f.name, doc))
    flight = _flight(r)
    picture = None
    if (root / "incident.svg").is_file():
        # A directory's picture can be opened where it is; an archive's is a member of it.
        picture = (
            str(Path(origin) / "incident.svg")
            if Path(origin).is_dir()
            else f"incident.svg inside {origin}"
        )
    return Bundle(
        origin=origin,
        service=service,
        created=created,
        created_seconds=_iso_seconds(created),
        manifest=manifest,
        scrapes=tuple(scrapes),
        metrics_error=metrics_error,
        health=small["health.json"],
        gpus=gpus,
        cmdline=cmdline,
        model_config=small["model_config.json"],
        safetensors_index=small["model.safetensors.index.json"],
        models=small["models.json"],
        journal=journal,
        unit=small["unit.json"],
        allocator=tuple(allocator),
        flight=tuple(flight),
        action=small["action.json"],
        picture=picture,
        problems=tuple(r.problems),
    )


def _last_lines(text: str, n: int) -> tuple[list[str], bool]:
    """The last ``n`` lines of ``text`` (oldest first) and whether there were more; the work is
    that of the lines kept, however many tiny lines the text holds."""
    out: list[str] = []
    end = len(text)
    if text.endswith("\n"):
        end -= 1
    while end >= 0 and len(out) < n:
        start = text.rfind("\n", 0, end) + 1
        out.append(text[start:end].rstrip("\r"))
        end = start - 1
    out.reverse()
    return out, end >= 0


def _flight(r: _Reader) -> list[dict[str, Any]]:
    """The newest flight records, decoded and checked as `replay` checks them (recorder.py)."""
    text = r.text("flight.jsonl", MAX_FLIGHT_BYTES, tail=True)
    if not text:
        return []
    lines, more = _last_lines(text, MAX_FLIGHT_RECORDS)
    if more:
        r.problems.append(
            f"flight.jsonl: over {MAX_FLIGHT_RECORDS} lines, the newest {MAX_FLIGHT_RECORDS} used"
        )
    flight: list[dict[str, Any]] = []
    bad: dict[str, int] = {}
    decoded: list[tuple[int, dict[str, Any]]] = []
    resolver = recorder.Resolver()
    whole_seen = False  # a tail may begin with deltas of a keyframe before it: not an error
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        rec = recorder.decode_line(line)
        if isinstance(rec, str) and (cut := recorder.split_cut(line)) is not None:
            bad[cut[0]] = bad.get(cut[0], 0) + 1
            rec = recorder.decode_line(cut[1])
        if not isinstance(rec, str):
            rec = resolver.feed(rec)
        if isinstance(rec, str):
            if whole_seen or not rec.startswith("delta record"):
                bad[rec] = bad.get(rec, 0) + 1
        else:
            whole_seen = True
            decoded.append((n, rec))
    for _, rec, why in recorder.checked_times(decoded, time.time()):
        if why is not None:
            why = why.split(" (")[0] if "goes backwards" in why else why
            bad[why] = bad.get(why, 0) + 1
        else:
            flight.append(rec)
    for why, count in sorted(bad.items(), key=lambda kv: -kv[1])[:5]:
        r.problems.append(f"flight.jsonl: {count} line(s) skipped: {why}")
    if len(bad) > 5:
        r.problems.append(f"flight.jsonl: {sum(bad.values())} line(s) skipped in all")
    return flight


# --- writing ---------------------------------------------------------------------------------


def write_bundle(b: Bundle, path: str | Path) -> Path:
    """Write ``b`` as a bundle directory, or as a ``.tar.gz`` when ``path`` ends so."""
    p = Path(path)
    if p.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory(prefix="vllm-guardian-bundle-") as tmp:
            inner = Path(tmp) / p.name.removesuffix(".tgz").removesuffix(".tar.gz")
            _write_dir(b, inner)
            p.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(p, "w:gz") as tf:
                tf.add(inner, arcname=inner.name)
        return p
    _write_dir(b, p)
    return p


def _dump(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _write_dir(b: Bundle, p: Path) -> None:
    p.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "created": b.created, "service": b.service}
    _dump(p / "manifest.json", manifest)
    if b.scrapes or b.metrics_error:
        (p / "metrics").mkdir(exist_ok=True)
        for t, body in b.scrapes:
            stamp = str(int(t)) if float(t).is_integer() else f"{t:.3f}"
            (p / "metrics" / f"{stamp}.prom").write_text(body, encoding="utf-8")
        if b.metrics_error:  # an error may name the URL, and a URL may carry user:password
            (p / "metrics" / "ERROR.txt").write_text(
                redact_text(b.metrics_error) + "\n", encoding="utf-8"
            )
    for name, value in (
        ("health.json", b.health),
        ("gpus.json", b.gpus),
        ("model_config.json", b.model_config),
        ("model.safetensors.index.json", b.safetensors_index),
        ("models.json", b.models),
        ("unit.json", b.unit),
        ("action.json", b.action),
    ):
        if value is not None:
            _dump(p / name, value)
    # Sources redact what they read; the writer redacts again, so no path into a bundle (a
    # bundle read back and saved, a gathering that missed a shape) can carry a secret out.
    if b.cmdline is not None:
        (p / "cmdline.txt").write_text(
            "".join(a + "\n" for a in redact_argv(b.cmdline)), encoding="utf-8"
        )
    if b.journal:
        (p / "journal.log").write_text(
            "".join(redact_text(line) + "\n" for line in b.journal), encoding="utf-8"
        )
    if b.allocator:
        (p / "allocator").mkdir(exist_ok=True)
        for name, doc in b.allocator:
            _dump(p / "allocator" / Path(name).name, doc)
    if b.flight:
        with (p / "flight.jsonl").open("w", encoding="utf-8") as fh:
            for rec in b.flight:
                try:
                    fh.write(json.dumps(redact_json(rec), separators=(",", ":")) + "\n")
                except RecursionError:  # nested deeper than any record: not written
                    continue
