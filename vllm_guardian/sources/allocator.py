"""Source: the in-vLLM plugin's allocator files (torch's caching allocator, per process and GPU).

Where it sits: collect stage of the tick, one host-wide collector. The plugin
(:mod:`vllm_guardian.plugin`) writes ``<pid>-<device>.json`` files into
``sources.allocator.directory`` (or one directory level below it: the drop-in gives each vLLM
unit its own ``<directory>/<service>``); this source reads them with the shared schema
(:mod:`vllm_guardian.formats.allocator_format`) and never imports torch.

What it keeps: records of live processes, grouped by pid, with the pid's cgroup and ancestors
so the pure core can attribute each process to a service exactly as it does GPU processes
(the daemon does that in ``assemble``). What it drops, counting each: files it cannot parse,
and stale ones (the process is gone, or the file was not updated within ``stale_seconds``).
A warning names them when the set of dropped files changes, not every tick.

A dropped file is not read again while it stays the same file, unchanged (inode, mtime, size):
its verdict is kept. A dead process's files can linger (a RuntimeDirectory= that outlived a
crash, a plugin directory that nothing cleans), and decoding each of them every tick cost a
guardian ~2 ms a tick on a host with 33 of them. A kept "stale" verdict is checked again each
tick against the clock and /proc (one ``exists``): a file that would now pass is read afresh.

No directory is an observation, not an error: the plugin is not enabled, or vLLM is not
running (its RuntimeDirectory= exists only while it runs). The source never raises.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from vllm_guardian.config import AllocatorSourceConfig
from vllm_guardian.formats import allocator_format as fmt
from vllm_guardian.formats.allocator_format import AllocatorStats
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.lowio.procfs import parse_cgroup, parse_ppid
from vllm_guardian.model import (
    AllocatorProcess,
    AllocatorReading,
    Reading,
    SourceKind,
)
from vllm_guardian.sources.base import failed

log = logging.getLogger(__name__)

MAX_ANCESTORS = 64  # deeper trees do not occur; guards against a /proc changing under us


@dataclass(frozen=True)
class _Dropped:
    """Why a file was left out, kept while the file is unchanged."""

    identity: tuple[int, int, int]  # inode, mtime (ns), size
    pid: int | None  # the record's (None: unparsable)
    time_seconds: float | None  # the record's last update (None: unparsable)
    why: str  # for an unparsable file


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _read_small(path: Path | str, limit: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


class AllocatorCollector:
    kind = SourceKind.ALLOCATOR

    def __init__(
        self, cfg: AllocatorSourceConfig, clock: Clock, proc_root: Path = Path("/proc")
    ) -> None:
        self.service: str | None = None
        self.timeout_seconds = cfg.timeout_seconds
        self._cfg = cfg
        self._dir = Path(cfg.directory)
        self._clock = clock
        self._proc = proc_root
        self._last_dropped: frozenset[str] = frozenset()
        self._dropped: dict[str, _Dropped] = {}  # verdicts kept while a file is unchanged

    def collect(self) -> Reading:
        try:
            return self._collect()
        except Exception as e:  # a source reports, it never raises into the tick
            return failed(self.kind, None, f"{type(e).__name__}: {e}")

    def close(self) -> None:
        pass

    def _files(self) -> list[str]:
        """Candidate files in the directory and its subdirectories, at most max_files. Paths
        as str: pathlib's objects were most of what a tick spent here."""
        out: list[str] = []
        dirs: list[Path | str] = [self._dir]
        with os.scandir(self._dir) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    dirs.append(entry.path)
                elif fmt.parse_file_name(entry.name) is not None:
                    out.append(entry.path)
        for d in dirs[1:]:
            try:
                with os.scandir(d) as it:
                    out += [e.path for e in it if fmt.parse_file_name(e.name) is not None]
            except OSError:
                continue  # removed while we looked (vLLM stopped): nothing to read there
        return sorted(out)[: self._cfg.max_files]

    def _collect(self) -> Reading:
        try:
            files = self._files()
        except FileNotFoundError:
            return Reading(
                self.kind,
                None,
                AllocatorReading(()),
                hint=f"no {self._dir}: the vLLM allocator plugin is not enabled or vLLM is not running",
            )
        except PermissionError as e:
            return failed(
                self.kind,
                None,
                f"cannot read {self._dir}: {e.strerror}",
                hint="the vLLM drop-in's RuntimeDirectoryMode= must let the guardian's user read it",
            )
        now = self._clock.time()
        by_pid: dict[int, list[AllocatorStats]] = {}
        dropped: dict[str, str] = {}  # file → why
        stale = unparsable = 0
        kept: dict[str, _Dropped] = {}
        for path in files:
            name = fmt.parse_file_name(os.path.basename(path))
            assert name is not None  # _files keeps only matching names
            identity = _identity(path)
            verdict = self._dropped.get(path)
            if verdict is not None and verdict.identity == identity:
                if verdict.pid is None or verdict.time_seconds is None:
                    unparsable += 1
                    dropped[path] = verdict.why
                    kept[path] = verdict
                    continue
                why = self._stale(verdict.pid, verdict.time_seconds, now)
                if why is not None:
                    stale += 1
                    dropped[path] = why
                    kept[path] = verdict
                    continue
            data = _read_small(path, fmt.MAX_FILE_BYTES + 1)
            if data is None:
                continue  # replaced or removed between listing and reading
            try:
                rec = fmt.decode(data)
                if (rec.pid, rec.device) != name:
                    raise fmt.FormatError(f"holds pid {rec.pid} device {rec.device}")
            except fmt.FormatError as e:
                unparsable += 1
                dropped[path] = f"unparsable ({e})"
                if identity is not None:
                    kept[path] = _Dropped(identity, None, None, dropped[path])
                continue
            why = self._stale(rec.pid, rec.time_seconds, now)
            if why is not None:
                stale += 1
                dropped[path] = why
                if identity is not None:
                    kept[path] = _Dropped(identity, rec.pid, rec.time_seconds, why)
                continue
            by_pid.setdefault(rec.pid, []).append(rec)
        self._dropped = kept  # files gone from the directory are forgotten
        self._warn(dropped)
        processes = tuple(
            AllocatorProcess(
                pid=pid,
                devices=tuple(sorted(recs, key=lambda r: r.device)),
                cgroup=self._cgroup(pid),
                ancestors=self._ancestors(pid),
            )
            for pid, recs in sorted(by_pid.items())
        )
        hint = f"{stale} stale and {unparsable} unparsable files left out" if dropped else None
        return Reading(self.kind, None, AllocatorReading(processes, stale, unparsable), hint=hint)

    def _stale(self, pid: int, time_seconds: float, now: float) -> str | None:
        """Why a record of ``pid`` last updated at ``time_seconds`` is stale, or None."""
        if not os.path.exists(f"{self._proc}/{pid}"):
            return f"stale (process {pid} is gone)"
        age = now - time_seconds
        if age > self._cfg.stale_seconds:
            return f"stale (not updated for {age:.0f} s)"
        return None

    def _warn(self, dropped: dict[str, str]) -> None:
        keys = frozenset(dropped)
        if keys and keys != self._last_dropped:
            log.warning(
                "allocator files left out: %d (%s)",
                len(dropped),
                "; ".join(f"{p}: {why}" for p, why in sorted(dropped.items())[:5]),
            )
        self._last_dropped = keys

    def _cgroup(self, pid: int) -> str | None:
        text = _read_small(self._proc / str(pid) / "cgroup", 64 * 1024)
        return parse_cgroup(text.decode(errors="replace")) if text is not None else None

    def _ancestors(self, pid: int) -> tuple[int, ...]:
        chain: list[int] = []
        seen = {pid}
        current = pid
        for _ in range(MAX_ANCESTORS):
            stat = _read_small(self._proc / str(current) / "stat", 4096)
            ppid = parse_ppid(stat.decode(errors="replace")) if stat is not None else None
            if ppid is None or ppid == 0 or ppid in seen:
                break
            chain.append(ppid)
            if ppid == 1:
                break
            seen.add(ppid)
            current = ppid
        return tuple(chain)
