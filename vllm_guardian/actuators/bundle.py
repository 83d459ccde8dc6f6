"""Actuator: the incident bundle, captured before every disruptive action.

Where it sits: the first step of a restart or relaunch (``actuators/executor.py``). It writes
what the on-call person (and ``vllm-guardian diagnose --bundle``) needs to know what was going
on just before the guardian acted, in the bundle format of ``docs/bundle.md``:
``manifest.json``, ``metrics/<unix>.prom`` (a fresh scrape), ``health.json``, ``gpus.json``,
``cmdline.txt`` (secrets already redacted), ``unit.json``, ``journal.log`` (the matched log
lines the guardian saw), ``flight.jsonl`` (the recent ticks) and ``action.json``.

Time-boxed by ``policy.bundle_timeout_seconds``; a failure to capture never blocks the action.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from vllm_guardian import httpget
from vllm_guardian.config import ServiceConfig
from vllm_guardian.core.signals import belongs_to
from vllm_guardian.model import Action, GpuDevice, Snapshot, UnitState, XidEvent
from vllm_guardian.recorder import to_jsonable
from vllm_guardian.redact import redact_text

log = logging.getLogger("vllm_guardian.bundle")

Context = Callable[[str], tuple[ServiceConfig | None, Sequence[Snapshot]]]


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
                }
                for p in d.processes or ()
            ],
            "xid_events": [
                {"xid": e.xid, "unix_time": e.time_seconds} for e in xids if e.gpu_index == d.index
            ],
        }
        for d in devices
    ]


class BundleWriter:
    def __init__(
        self,
        root: Path,
        context: Context,
        timeout_seconds: float,
        keep: int = 50,
        read_metrics: Callable[[ServiceConfig], bytes | None] | None = None,
    ) -> None:
        self.root = root
        self.context = context
        self.timeout_seconds = timeout_seconds
        self.keep = keep
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
        (path / "metrics").mkdir(parents=True, exist_ok=True)
        manifest = {
            "format": 1,
            "created": dt.datetime.fromtimestamp(now, dt.UTC).isoformat(),
            "service": action.service,
        }
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (path / "action.json").write_text(json.dumps(to_jsonable(action), indent=2) + "\n")
        if svc is not None and self.read_metrics is not None:
            body = self.read_metrics(svc)
            if body is None:
                (path / "metrics" / "ERROR.txt").write_text("GET /metrics: no answer\n")
            else:
                (path / "metrics" / f"{int(now)}.prom").write_bytes(body)
        elif svc is not None:
            try:
                resp = httpget.fetch(
                    svc.url.rstrip("/") + "/metrics",
                    deadline_seconds=min(5.0, self.timeout_seconds),
                    max_body_bytes=32 * 1024 * 1024,
                    oversize=httpget.Oversize.TRUNCATE,
                )
                if resp.status == 200:
                    (path / "metrics" / f"{int(now)}.prom").write_bytes(resp.body)
                if resp.truncated:
                    (path / "metrics" / "ERROR.txt").write_text(
                        "/metrics body over 32 MiB: cut there\n"
                    )
            except httpget.HttpGetError as e:  # names the URL, which may carry user:password
                (path / "metrics" / "ERROR.txt").write_text(f"{redact_text(str(e))}\n")
        latest = history[-1] if history else None
        ss = latest.service(action.service) if latest is not None else None
        if ss is not None and ss.health is not None:
            h = ss.health
            health = {
                "status_code": h.status_code,
                "error": redact_text(h.error) if h.error else h.error,
                "latency_seconds": h.latency_seconds,
            }
            (path / "health.json").write_text(json.dumps(health) + "\n")
        if ss is not None and ss.unit is not None:
            if ss.unit.cmdline:
                (path / "cmdline.txt").write_text("\n".join(ss.unit.cmdline) + "\n")
            (path / "unit.json").write_text(json.dumps(unit_document(ss.unit)) + "\n")
        if latest is not None and latest.gpus is not None:
            xids = [e for snap in history if snap.gpus is not None for e in snap.gpus.xid_events]
            doc = gpus_document(latest.gpus.devices, ss.unit if ss is not None else None, xids)
            (path / "gpus.json").write_text(json.dumps(doc, indent=2) + "\n")
        lines = [
            ev.message
            for snap in history
            if (s := snap.service(action.service)) is not None and s.logs is not None
            for ev in s.logs.recent
        ]
        (path / "journal.log").write_text("".join(line + "\n" for line in lines))
        with (path / "flight.jsonl").open("w") as fh:
            for snap in history[-300:]:
                fh.write(json.dumps({"snapshot": to_jsonable(snap)}, separators=(",", ":")) + "\n")
        self._prune()
        return path

    def _prune(self) -> None:
        bundles = sorted(
            (p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for old in bundles[: max(0, len(bundles) - self.keep)]:
            for f in sorted(old.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            old.rmdir()
