"""Actuator: the incident bundle, captured before every disruptive action.

Where it sits: the first step of a restart or relaunch (``actuators/executor.py``). It writes
what the on-call person (and ``vllm-guardian diagnose --bundle``) needs to know what was going
on just before the guardian acted, in the bundle format of ``docs/bundle.md`` (written by that
format's one writer, ``diagnose/bundle.py``):
``manifest.json``, ``metrics/<unix>.prom`` (a fresh scrape), ``health.json``, ``gpus.json``,
``cmdline.txt`` (secrets already redacted), ``unit.json``, ``journal.log`` (the matched log
lines the guardian saw), ``flight.jsonl`` (the recent ticks), ``action.json`` and
``incident.svg`` (the incident picture, ``incident_svg.py``: drawn at capture and drawn again,
with every phase, when the action ends: :meth:`BundleWriter.redraw`), and ``watchdog/`` (the
stack dumps of vLLM's hang watchdog that its log lines named).

Time-boxed by ``policy.bundle_timeout_seconds``; a failure to capture never blocks the action.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_guardian.config import ServiceConfig
from vllm_guardian.diagnose.bundle import Bundle, gpus_document, unit_document, write_bundle
from vllm_guardian.formats import incident_svg
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio import httpget
from vllm_guardian.lowio.redact import redact_text
from vllm_guardian.model import Action, LogEventKind, Snapshot

log = logging.getLogger("vllm_guardian.bundle")

Context = Callable[[str], tuple[ServiceConfig | None, Sequence[Snapshot]]]
# The recent decisions and alert transitions as the flight record holds them (JSON), for the
# incident picture's alert and phase lanes.
Events = Callable[[], Sequence[Mapping[str, Any]]]
PICTURE = "incident.svg"
PICTURE_ERROR = "incident.svg.ERROR.txt"

# vLLM's hang watchdog (0.33's --watchdog-config) names its dump file in the line it logs
# (vllm/utils/watch_dog.py: "<dump_dir>/VLLM_STACK_DUMP_for_<name>_<pid>.log"). Only a file
# named so is read: the path comes from a log line, and no other file may end up in a bundle.
WATCHDOG_DUMP_NAME = re.compile(r"VLLM_STACK_DUMP_for_[A-Za-z0-9_.-]+_\d+\.log")
MAX_WATCHDOG_DUMPS = 4  # the newest files named
# A dump is every thread's stack, appended at each timeout: the tail holds the latest.
MAX_WATCHDOG_DUMP_BYTES = 256 * 1024


class BundleWriter:
    def __init__(
        self,
        root: Path,
        context: Context,
        timeout_seconds: float,
        keep: int = 50,
        events: Events | None = None,
        read_metrics: Callable[[ServiceConfig], bytes | None] | None = None,
    ) -> None:
        self.root = root
        self.context = context
        self.timeout_seconds = timeout_seconds
        self.keep = keep
        self.events = events
        # How the fresh /metrics scrape is taken: GET over HTTP; the virtual-time tests hand in
        # the twin's exposition (nothing listens there), None when it does not answer.
        self.read_metrics = read_metrics

    def __call__(self, action: Action) -> str | None:
        try:
            return str(self.capture(action))
        except Exception:  # a bundle is evidence, never a reason not to act
            log.exception("incident bundle for action %d failed", action.id)
            return None

    def capture(self, action: Action) -> Path:
        svc, history = self.context(action.service)
        now = history[-1].time_seconds if history else 0.0
        stamp = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        path = self.root / f"{action.service}-{stamp}-{action.id}-{action.kind.value}"
        scrapes: tuple[tuple[float, str], ...] = ()
        metrics_error = None
        if svc is not None and self.read_metrics is not None:
            body = self.read_metrics(svc)
            if body is None:
                metrics_error = "GET /metrics: no answer"
            else:
                scrapes = ((float(int(now)), body.decode("utf-8", "replace")),)
        elif svc is not None:
            try:
                resp = httpget.fetch(
                    svc.url.rstrip("/") + "/metrics",
                    deadline_seconds=min(5.0, self.timeout_seconds),
                    max_body_bytes=32 * 1024 * 1024,
                    oversize=httpget.Oversize.TRUNCATE,
                )
                if resp.status == 200:
                    scrapes = ((float(int(now)), resp.body.decode("utf-8", "replace")),)
                if resp.truncated:
                    metrics_error = "/metrics body over 32 MiB: cut there"
            except httpget.HttpGetError as e:  # names the URL; the format's writer redacts it
                metrics_error = str(e)
        latest = history[-1] if history else None
        ss = latest.service(action.service) if latest is not None else None
        health = None
        if ss is not None and ss.health is not None:
            h = ss.health
            health = {
                "status_code": h.status_code,
                "error": redact_text(h.error) if h.error else h.error,
                "latency_seconds": h.latency_seconds,
            }
        unit = ss.unit if ss is not None else None
        gpus = None
        if latest is not None and latest.gpus is not None:
            xids = [e for snap in history if snap.gpus is not None for e in snap.gpus.xid_events]
            gpus = gpus_document(latest.gpus.devices, unit, xids)
        journal = tuple(
            ev.message
            for snap in history
            if (s := snap.service(action.service)) is not None and s.logs is not None
            for ev in s.logs.recent
        )
        write_bundle(
            Bundle(
                origin=str(path),
                service=action.service,
                created=dt.datetime.fromtimestamp(now, dt.UTC).isoformat(),
                scrapes=scrapes,
                metrics_error=metrics_error,
                health=health,
                gpus=gpus,
                cmdline=tuple(unit.cmdline) if unit is not None and unit.cmdline else None,
                journal=journal,
                unit=unit_document(unit) if unit is not None else None,
                flight=tuple({"snapshot": to_jsonable(snap)} for snap in history[-300:]),
                action=to_jsonable(action),
            ),
            path,
        )
        dumps = [
            dict(ev.details).get("dump_file", "")
            for snap in history
            if (s := snap.service(action.service)) is not None and s.logs is not None
            for ev in s.logs.recent
            if ev.kind is LogEventKind.WATCHDOG_DUMP
        ]
        if dumps:
            copy_watchdog_dumps(dumps, path / "watchdog")
        self.draw(path, action.service, history[-300:])
        self._prune()
        return path

    def redraw(self, path: Path, service: str) -> threading.Thread | None:
        """Draw the bundle's picture again when its action ends (called by ``healing.py`` on
        the action's result, in the tick): at capture the action had only begun; now every
        phase shows. The history and events are taken now; the drawing (tens of milliseconds
        for 300 ticks on a busy host) runs in a thread of its own, returned, so the tick does
        not wait for it."""
        try:
            _, history = self.context(service)
            events = list(self.events()) if self.events is not None else []
        except Exception:  # the tick calls this: nothing here may stop it
            log.exception("incident picture for %s: no history", path)
            return None
        if not path.is_dir():
            return None
        t = threading.Thread(
            target=self.draw,
            args=(path, service, history[-300:], events),
            name="incident-picture",
            daemon=True,
        )
        t.start()
        return t

    def draw(
        self,
        path: Path,
        service: str,
        history: Sequence[Snapshot],
        events: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Write ``incident.svg`` (``events``: default the writer's own); an error drawing it is
        written beside it and logged, and never costs the rest of the bundle."""
        try:
            if events is None:
                events = list(self.events()) if self.events is not None else []
            tl = incident_svg.timeline([to_jsonable(s) for s in history], events, service)
            tmp = path / (PICTURE + ".tmp")
            tmp.write_text(incident_svg.render(tl))
            tmp.replace(path / PICTURE)
            (path / PICTURE_ERROR).unlink(missing_ok=True)
        except Exception as e:  # a picture is a convenience, never a reason to lose the bundle
            log.exception("incident picture for %s failed", path)
            with contextlib.suppress(OSError):
                (path / PICTURE_ERROR).write_text(f"the incident picture was not drawn: {e!r}\n")

    def _prune(self) -> None:
        bundles = sorted(
            (p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for old in bundles[: max(0, len(bundles) - self.keep)]:
            for f in sorted(old.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            old.rmdir()


def _read_tail(path: str, limit: int) -> bytes:
    """The last ``limit`` bytes of a regular file, never following a link at its end."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file ({stat.filemode(st.st_mode)})")
        f.seek(max(0, st.st_size - limit))
        data = f.read(limit)
    if st.st_size > limit:  # start at a whole line
        data = data[data.find(b"\n") + 1 :]
    return data


def copy_watchdog_dumps(paths: Iterable[str], into: Path) -> list[str]:
    """Copy the newest :data:`MAX_WATCHDOG_DUMPS` of vLLM's watchdog dump files ``paths`` (from
    its log lines, oldest first) into ``into``, each cut to its last
    :data:`MAX_WATCHDOG_DUMP_BYTES` and redacted line by line like the journal. What could not
    be copied (another mount namespace, not the watchdog's name, gone) is said in
    ``into/ERROR.txt``. Returns the names copied."""
    newest = list(dict.fromkeys(reversed([p for p in paths if p])))[:MAX_WATCHDOG_DUMPS]
    into.mkdir(parents=True, exist_ok=True)
    copied: list[str] = []
    errors: list[str] = []
    for p in reversed(newest):
        name = Path(p).name
        if not WATCHDOG_DUMP_NAME.fullmatch(name):
            errors.append(f"{redact_text(p)}: not named as vLLM's watchdog names a dump, not read")
            continue
        try:
            data = _read_tail(p, MAX_WATCHDOG_DUMP_BYTES)
        except OSError as e:
            errors.append(f"{redact_text(p)}: {redact_text(str(e.strerror or e))}")
            continue
        text = data.decode("utf-8", errors="replace")
        (into / name).write_text(
            "".join(redact_text(line) + "\n" for line in text.splitlines()), encoding="utf-8"
        )
        copied.append(name)
    if errors:
        (into / "ERROR.txt").write_text("".join(e + "\n" for e in errors))
    return copied
