"""Live gathering: everything ``diagnose`` needs from a running (or dead) host, as a bundle.

In one go and in parallel, each part under its own timeout: two ``/metrics`` scrapes
``interval`` seconds apart (rates need two), ``/health``, ``/v1/models``, the GPUs and their
processes (NVML, or the twin's GPU state file), the unit's state and the live command line
(found from the process listening on the URL's port when no unit is configured), the last
minutes of the unit's journal (or a log file's tail), the model's ``config.json`` when
``--model`` is a local directory or in the local Hugging Face cache, and the running daemon's
recent ticks over its control socket. A part that fails is a line in ``problems``: with vLLM
down, the journal and the unit's state still tell the story.

Nothing here needs root except what reading another user's journal needs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_guardian.config import (
    NvmlSourceConfig,
    ServiceConfig,
    UnitSourceConfig,
)
from vllm_guardian.core.budget import parse_launch_flags
from vllm_guardian.diagnose.bundle import Bundle, gpus_document, unit_document
from vllm_guardian.formats.gpu_state_format import ParsedStateFile, parse_state_file
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio import httpget
from vllm_guardian.lowio.clock import SystemClock
from vllm_guardian.lowio.control import ControlError, request
from vllm_guardian.lowio.redact import redact_text
from vllm_guardian.model import GpuReading, UnitState
from vllm_guardian.sources.nvml import NvmlCollector
from vllm_guardian.sources.unit import UnitCollector

Progress = Callable[[str], None]
MAX_BODY_BYTES = 32 * 1024 * 1024
JOURNAL_TAIL_BYTES = 8 * 1024 * 1024
_UNIT_IN_CGROUP = re.compile(r"/([^/]+\.service)(?:/|$)")


@dataclass(frozen=True)
class GatherOptions:
    interval_seconds: float = 5.0  # between the two /metrics scrapes
    timeout_seconds: float = 3.0  # per HTTP request
    journal_minutes: float = 10.0
    journalctl: str = "journalctl"
    systemctl: str = "systemctl"
    nvml: NvmlSourceConfig = field(default_factory=NvmlSourceConfig)
    control_socket: str | None = None
    model_config: str | None = None  # a config.json (or its directory) given on the command line


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class _Gatherer:
    def __init__(self, svc: ServiceConfig, opts: GatherOptions, progress: Progress) -> None:
        self.svc = svc
        self.opts = opts
        self.progress = progress
        self.problems: list[str] = []
        self.base = svc.url.rstrip("/")

    def _get(self, path: str) -> httpget.HttpResponse | str:
        """The answer, or why there is none; a body past MAX_BODY_BYTES is cut and reported."""
        try:
            resp = httpget.fetch(
                self.base + path,
                deadline_seconds=self.opts.timeout_seconds,
                max_body_bytes=MAX_BODY_BYTES,
                oversize=httpget.Oversize.TRUNCATE,
            )
        except httpget.HttpGetError as e:
            if e.failure is httpget.Failure.REFUSED:
                return "connection refused"
            if e.failure in (httpget.Failure.DEADLINE, httpget.Failure.CONNECT_TIMEOUT):
                return f"timed out after {self.opts.timeout_seconds:g} s"
            return e.detail
        if resp.truncated:
            self.problems.append(f"{path}: body over {MAX_BODY_BYTES} bytes, read that far")
        return resp

    def metrics(self) -> list[tuple[float, str]]:
        out: list[tuple[float, str]] = []
        for n in (1, 2):
            if n == 2:
                time.sleep(self.opts.interval_seconds)
            self.progress(f"scraping {self.base}/metrics ({n}/2)")
            t = time.time()
            r = self._get("/metrics")
            if isinstance(r, str):
                self.problems.append(f"/metrics: {r} (vLLM down or starting?)")
                return out
            if r.status != 200:
                self.problems.append(f"/metrics: HTTP {r.status}")
                return out
            out.append((round(t, 3), r.body.decode("utf-8", errors="replace")))
        return out

    def health(self) -> dict[str, Any]:
        self.progress(f"probing {self.base}/health")
        t0 = time.monotonic()
        r = self._get("/health")
        if isinstance(r, str):
            return {"status_code": None, "error": r, "latency_seconds": None}
        return {
            "status_code": r.status,
            "error": None,
            "latency_seconds": round(time.monotonic() - t0, 4),
        }

    def models(self) -> dict[str, Any] | None:
        r = self._get("/v1/models")
        if isinstance(r, str) or r.status != 200:
            return None
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(r.body)
            return doc if isinstance(doc, dict) else None
        return None

    def unit(self) -> UnitState | None:
        self.progress("reading the unit and its processes")
        cfg = UnitSourceConfig(systemctl=self.opts.systemctl)
        reading = UnitCollector(self.svc, cfg).collect()
        state = reading.payload if isinstance(reading.payload, UnitState) else None
        if reading.error:
            self.problems.append(f"unit: {reading.error}")
        if state is not None and self.svc.unit is None and state.main_pid:
            unit = unit_of_pid(state.main_pid)
            if unit is not None:
                self.svc = replace(self.svc, unit=unit)
                r2 = UnitCollector(self.svc, cfg).collect()
                if isinstance(r2.payload, UnitState):
                    state = replace(r2.payload, cmdline=r2.payload.cmdline or state.cmdline)
        return state

    def journal(self) -> list[str]:
        if self.svc.log_file:
            self.progress(f"reading {self.svc.log_file}")
            return tail_file(Path(self.svc.log_file), self.problems)
        if not self.svc.unit:
            self.problems.append(
                "journal: no unit known (vLLM not running and no --unit/--log-file)"
            )
            return []
        self.progress(f"reading the journal of {self.svc.unit}")
        argv = [
            self.opts.journalctl, f"--unit={self.svc.unit}", "--since", f"-{int(self.opts.journal_minutes * 60)}s",
            "-o", "cat", "--no-pager", "-q", "--all",
        ]  # fmt: skip
        try:
            p = subprocess.run(argv, capture_output=True, timeout=5.0, check=False)
        except FileNotFoundError:
            self.problems.append(f"journal: {self.opts.journalctl} not found")
            return []
        except subprocess.TimeoutExpired:
            self.problems.append("journal: journalctl took over 5 s")
            return []
        if p.returncode != 0 or b"not seeing messages from other users" in p.stderr:
            self.problems.append(
                "journal: cannot read the unit's journal (run as root or a member of systemd-journal)"
            )
        return whole_lines(p.stdout[-JOURNAL_TAIL_BYTES:], len(p.stdout) > JOURNAL_TAIL_BYTES)

    def gpus(self) -> GpuReading | None:
        self.progress("reading the GPUs")
        cfg = self.opts.nvml
        if cfg.backend == "file" and cfg.state_file:
            try:
                text = Path(cfg.state_file).read_text(encoding="utf-8")
            except OSError as e:
                self.problems.append(f"GPU state file {cfg.state_file}: {e.strerror or e}")
                return None
            now = time.time()
            parsed = parse_state_file(text, now, max_age_seconds=365 * 86400.0)
            if not isinstance(parsed, ParsedStateFile):
                self.problems.append(f"GPU state file: {parsed.error}")
                return None
            reading = parsed.reading
            doc_time = _state_time(text)
            if doc_time is not None and now - doc_time > 10:
                self.problems.append(
                    f"GPU state file last written {now - doc_time:.0f} s ago (its writer has stopped)"
                )
            return reading
        reading2 = NvmlCollector(cfg, SystemClock(), interval_seconds=5.0)
        try:
            r = reading2.collect()
        finally:
            reading2.close()
        if r.error:
            self.problems.append(f"GPUs: {r.error}")
        return r.payload if isinstance(r.payload, GpuReading) else None

    def ticks(self) -> list[dict[str, Any]]:
        path = self.opts.control_socket
        if not path or not Path(path).exists():
            return []
        self.progress("asking the running guardian for its recent ticks")
        try:
            resp = request(
                path, {"cmd": "recent_ticks", "service": self.svc.name}, timeout_seconds=3.0
            )
        except ControlError as e:
            self.problems.append(f"guardian: {e}")
            return []
        ticks = resp.get("ticks")
        if not resp.get("ok") or not isinstance(ticks, list):
            self.problems.append(f"guardian: {resp.get('error') or 'no ticks'}")
            return []
        return [{"snapshot": t} for t in ticks if isinstance(t, dict)]


def _state_time(text: str) -> float | None:
    with contextlib.suppress(ValueError):
        doc = json.loads(text)
        t = doc.get("time_seconds") if isinstance(doc, dict) else None
        return float(t) if isinstance(t, int | float) else None
    return None


def unit_of_pid(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The systemd service a process runs in, from its cgroup path (``…/vllm.service``)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        m = _UNIT_IN_CGROUP.search(line.rsplit(":", 1)[-1])
        if m and not m.group(1).startswith(("user@", "session-")):
            return m.group(1)
    return None


def tail_file(path: Path, problems: list[str]) -> list[str]:
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - JOURNAL_TAIL_BYTES))
            data = fh.read(JOURNAL_TAIL_BYTES)
    except OSError as e:
        problems.append(f"log file {path}: {e.strerror or e}")
        return []
    return whole_lines(data, size > JOURNAL_TAIL_BYTES)


def whole_lines(data: bytes, cut: bool) -> list[str]:
    """Log text as redacted lines, split at newlines only (``str.splitlines`` also splits at
    characters a request's text can carry, U+2028 and the like, and what follows one would
    read as the start of a line). ``cut``: the text is a tail that starts mid-line; that partial
    first line is dropped, it could start anywhere in a line a request wrote."""
    lines = data.decode("utf-8", errors="replace").split("\n")
    if cut:
        lines = lines[1:]
    if lines and lines[-1] == "":
        lines.pop()
    return [redact_text(line.rstrip("\r")) for line in lines]


def hf_cache_dirs() -> list[Path]:
    home = os.environ.get("HF_HOME")
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    out = [Path(hub)] if hub else []
    out.append(Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub")
    return out


def find_model_config(model: str, explicit: str | None = None) -> Path | None:
    """``config.json`` of ``--model``: a local directory, or the newest snapshot in the HF cache."""
    if explicit:
        p = Path(explicit)
        return p / "config.json" if p.is_dir() else p
    p = Path(model)
    if (p / "config.json").is_file():
        return p / "config.json"
    if "/" in model and not model.startswith(("/", ".")):
        entry = "models--" + model.replace("/", "--")
        for cache in hf_cache_dirs():
            snaps = cache / entry / "snapshots"
            if snaps.is_dir():
                found = sorted(snaps.glob("*/config.json"), key=lambda f: f.stat().st_mtime)
                if found:
                    return found[-1]
    return None


def _read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8")[:MAX_BODY_BYTES])
    except (OSError, ValueError) as e:
        problems.append(f"{path}: {e}")
        return None
    return doc if isinstance(doc, dict) else None


def gather(svc: ServiceConfig, opts: GatherOptions, progress: Progress) -> Bundle:
    """Collect a bundle from the live host; finishes in about interval + a few timeouts."""
    g = _Gatherer(svc, opts, progress)
    created = _now_iso()

    def unit_and_journal() -> tuple[UnitState | None, list[str]]:
        state = g.unit()
        return state, g.journal()

    with ThreadPoolExecutor(max_workers=5, thread_name_prefix="diagnose") as pool:
        f_metrics = pool.submit(g.metrics)
        f_health = pool.submit(lambda: (g.health(), g.models()))
        f_unit = pool.submit(unit_and_journal)
        f_gpus = pool.submit(g.gpus)
        f_ticks = pool.submit(g.ticks)
        scrapes = f_metrics.result()
        health, models = f_health.result()
        unit, journal = f_unit.result()
        gpus = f_gpus.result()
        ticks = f_ticks.result()
    cmdline = unit.cmdline if unit is not None else None
    model_config = safetensors = None
    flags = parse_launch_flags(cmdline or ())
    model = flags.model or _served_model(models)
    cfg_path = (
        find_model_config(model or "", opts.model_config) if (model or opts.model_config) else None
    )
    if cfg_path is not None and cfg_path.is_file():
        progress(f"reading {cfg_path}")
        model_config = _read_json(cfg_path, g.problems)
        index = cfg_path.parent / "model.safetensors.index.json"
        if index.is_file():
            safetensors = _read_json(index, g.problems)
    elif opts.model_config:
        g.problems.append(f"--model-config {opts.model_config}: not found")
    unit_doc = unit_document(unit) if unit is not None else None
    gpus_doc = gpus_document(gpus.devices, unit, gpus.xid_events) if gpus is not None else None
    return Bundle(
        origin=svc.url,
        service=svc.name,
        created=created,
        created_seconds=time.time(),
        manifest={"format": 1, "created": created, "service": svc.name},
        scrapes=tuple(scrapes),
        health=health,
        gpus=gpus_doc,
        cmdline=cmdline,
        model_config=model_config,
        safetensors_index=safetensors,
        models=models,
        journal=tuple(journal),
        unit=unit_doc,
        flight=tuple(ticks),
        problems=tuple(g.problems),
    )


def _served_model(models: dict[str, Any] | None) -> str | None:
    data = (models or {}).get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        root = data[0].get("root") or data[0].get("id")
        return root if isinstance(root, str) else None
    return None


def recent_ticks(history: list[Any], service: str | None, limit: int = 300) -> dict[str, Any]:
    """The control command ``recent_ticks``: the daemon's recent snapshots, newest last."""
    snaps = history[-limit:]
    if service:
        snaps = [s for s in snaps if s.service(service) is not None]
    return {"ok": True, "ticks": to_jsonable(snaps)}
