"""The incident bundle (docs/bundle.md): read from a directory or a ``.tar.gz``, and write.

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
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT = 1
MAX_MEMBER_BYTES = 64 * 1024 * 1024
MAX_TOTAL_BYTES = 512 * 1024 * 1024
MAX_MEMBERS = 10_000
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_PROM_BYTES = 32 * 1024 * 1024
MAX_SCRAPES = 64  # the newest ones; rates need two, a trend a few
MAX_JOURNAL_BYTES = 16 * 1024 * 1024  # the tail is kept: the incident is at the end
MAX_JOURNAL_LINES = 200_000
MAX_FLIGHT_BYTES = 64 * 1024 * 1024
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
    problems: tuple[str, ...] = field(default=())


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
                why = _unsafe(member, dest)
                if why is not None:
                    problems.append(f"{archive}: skipped {member.name!r}: {why}")
                    continue
                target = dest.joinpath(*PurePosixPath(member.name).parts)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if total + member.size > MAX_TOTAL_BYTES:
                    problems.append(
                        f"{archive}: skipped {member.name!r}: the bundle exceeds {MAX_TOTAL_BYTES >> 20} MiB"
                    )
                    continue
                src = tf.extractfile(member)
                if src is None:
                    problems.append(f"{archive}: skipped {member.name!r}: unreadable")
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                # O_EXCL + O_NOFOLLOW: never write through something already there.
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with src, os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                total += member.size
        except (tarfile.TarError, OSError, EOFError) as e:
            problems.append(f"{archive}: damaged archive, read up to the damage ({e})")
    return problems


def _members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (m := tf.next()) is not None:
        yield m


def _unsafe(member: tarfile.TarInfo, dest: Path) -> str | None:
    name = member.name
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
        for t, name in named:
            body = r.text(f"metrics/{name}", MAX_PROM_BYTES)
            if body is not None:
                scrapes.append((t, body))
    cmdline_text = r.text("cmdline.txt", 1024 * 1024)
    cmdline = tuple(line for line in cmdline_text.splitlines() if line) if cmdline_text else None
    journal_text = r.text("journal.log", MAX_JOURNAL_BYTES, tail=True)
    journal: tuple[str, ...] = ()
    if journal_text is not None:
        lines = journal_text.splitlines()
        if len(lines) > MAX_JOURNAL_LINES:
            r.problems.append(f"journal.log: {len(lines)} lines, the last {MAX_JOURNAL_LINES} used")
            lines = lines[-MAX_JOURNAL_LINES:]
        journal = tuple(lines)
    allocator: list[tuple[str, dict[str, Any]]] = []
    adir = root / "allocator"
    if adir.is_dir() and not adir.is_symlink():
        for f in sorted(adir.glob("*.json"))[:MAX_ALLOCATOR_FILES]:
            doc = r.json(f"allocator/{f.name}", dict)
            if doc is not None:
                allocator.append((f.name, doc))
    flight: list[dict[str, Any]] = []
    flight_text = r.text("flight.jsonl", MAX_FLIGHT_BYTES, tail=True)
    if flight_text:
        bad = 0
        for line in flight_text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(rec, dict):
                flight.append(rec)
            else:
                bad += 1
        if bad:
            r.problems.append(f"flight.jsonl: {bad} unreadable line(s) skipped")
    gpus = r.json("gpus.json", list)
    if gpus is not None and not all(isinstance(g, dict) for g in gpus):
        r.problems.append("gpus.json: entries must be objects; the others ignored")
        gpus = [g for g in gpus if isinstance(g, dict)]
    return Bundle(
        origin=origin,
        service=service,
        created=created,
        created_seconds=_iso_seconds(created),
        manifest=manifest,
        scrapes=tuple(scrapes),
        health=r.json("health.json", dict),
        gpus=gpus,
        cmdline=cmdline,
        model_config=r.json("model_config.json", dict),
        safetensors_index=r.json("model.safetensors.index.json", dict),
        models=r.json("models.json", dict),
        journal=journal,
        unit=r.json("unit.json", dict),
        allocator=tuple(allocator),
        flight=tuple(flight),
        action=r.json("action.json", dict),
        problems=tuple(r.problems),
    )


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
    if b.scrapes:
        (p / "metrics").mkdir(exist_ok=True)
        for t, body in b.scrapes:
            stamp = str(int(t)) if float(t).is_integer() else f"{t:.3f}"
            (p / "metrics" / f"{stamp}.prom").write_text(body, encoding="utf-8")
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
    if b.cmdline is not None:
        (p / "cmdline.txt").write_text("".join(a + "\n" for a in b.cmdline), encoding="utf-8")
    if b.journal:
        (p / "journal.log").write_text("".join(line + "\n" for line in b.journal), encoding="utf-8")
    if b.allocator:
        (p / "allocator").mkdir(exist_ok=True)
        for name, doc in b.allocator:
            _dump(p / "allocator" / Path(name).name, doc)
    if b.flight:
        with (p / "flight.jsonl").open("w", encoding="utf-8") as fh:
            for rec in b.flight:
                fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
