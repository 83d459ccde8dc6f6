"""The allocator publisher: a daemon thread per vLLM process, and the entry point that starts it.

Safety rules, each for a reason:

* Nothing at import time, and no ``torch.cuda`` call until CUDA is initialised in the process
  (``torch.cuda.is_initialized()`` is a Python flag, no driver call): vLLM loads plugins before
  ``init_device`` and before forking, and an early CUDA call would create a context on the
  wrong device or poison a later fork.
* torch is taken from ``sys.modules``, never imported here: a process that has not imported it
  (the API server before it does) owns no CUDA memory, and importing torch costs seconds.
* A torch built without CUDA or ROCm can never publish: one log line, and the thread ends.
* ``torch.cuda.memory_stats(device)`` reads the caching allocator's host-side counters: no
  device synchronisation, no context switch, nothing on the model's hot path. The largest free
  block would need ``memory_snapshot()``, which walks every segment under the allocator's lock,
  so it is not published.
* Bounded work per interval: at most :data:`MAX_DEVICES` stats calls and small file writes.
* Every exception is caught and logged once (by type); the plugin never makes vLLM fail.
* vLLM may fork its engine core from the API server; the child inherits vLLM's "plugins
  loaded" flag but not our thread, so an at-fork hook starts a fresh publisher in the child.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from vllm_guardian.formats import allocator_format as fmt

log = logging.getLogger("vllm_guardian.plugin")

MAX_DEVICES = 64  # bounded work per interval; no host has more GPUs per process
MAX_CLEANUP_FILES = 1024  # at start, leftovers of dead processes examined at most


class Backend(Protocol):
    """What the publisher asks of torch (the GPU boundary; tests inject their own)."""

    def capable(self) -> bool:
        """This build can ever have a device allocator (CUDA or ROCm)."""
        ...

    def ready(self) -> bool:
        """CUDA is initialised in this process."""
        ...

    def device_count(self) -> int: ...

    def memory_stats(self, device: int) -> Mapping[str, Any]: ...


class TorchBackend:
    """The real one: the torch module this process already imported."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def capable(self) -> bool:
        version = self._torch.version
        return bool(getattr(version, "cuda", None) or getattr(version, "hip", None))

    def ready(self) -> bool:
        return bool(self._torch.cuda.is_initialized())

    def device_count(self) -> int:
        return int(self._torch.cuda.device_count())

    def memory_stats(self, device: int) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._torch.cuda.memory_stats(device)
        return stats


def loaded_torch() -> Backend | None:
    """The torch backend once this process has imported torch, else None (never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None  # not imported, or half-way through its own import
    return TorchBackend(torch)


def _process_name() -> str | None:
    """vLLM's process title (``VLLM::EngineCore``, ``VLLM::Worker_TP1``), for people reading files."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()[:4096]
    except OSError:
        return None
    first = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
    return first[:64] or None


def _alloc_conf(env: Mapping[str, str]) -> str | None:
    # Which name torch reads when both are set depends on its version: torch 2.13 (vLLM 0.32's
    # build, measured) reads PYTORCH_CUDA_ALLOC_CONF and ignores PYTORCH_ALLOC_CONF; some
    # earlier c10 read PYTORCH_ALLOC_CONF first. The guardian's lever sets both alike.
    return env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class Publisher:
    """Writes this process's allocator stats, one file per device, every ``interval_seconds``."""

    def __init__(
        self,
        out_dir: Path,
        interval_seconds: float = fmt.DEFAULT_INTERVAL_SECONDS,
        backend: Callable[[], Backend | None] = loaded_torch,
        *,
        pid: int | None = None,
        time_fn: Callable[[], float] = time.time,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.interval_seconds = interval_seconds
        self.pid = os.getpid() if pid is None else pid
        self._backend_factory = backend
        self._backend: Backend | None = None
        self._time = time_fn
        self._env = os.environ if env is None else env
        self._publishing = False
        self._done = False  # this process can never publish (torch without CUDA)
        self._process_name: str | None = None
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written = 0  # files written since start (for tests and the log)
        self.errors = 0

    # --- one interval -------------------------------------------------------------------------

    def step(self) -> int:
        """Publish once if CUDA is up; returns the number of files written. Never raises."""
        try:
            return self._step()
        except Exception as e:  # the plugin must never take vLLM down
            self.errors += 1
            self._once(
                f"error:{type(e).__name__}",
                logging.WARNING,
                "vllm-guardian allocator plugin: %s: %s (logged once; publishing continues)",
                type(e).__name__,
                e,
                exc_info=True,
            )
            return 0

    def _step(self) -> int:
        if self._done:
            return 0
        if self._backend is None:
            self._backend = self._backend_factory()
            if self._backend is None:
                return 0  # torch not imported yet in this process
            if not self._backend.capable():
                self._done = True
                self._once(
                    "no-cuda",
                    logging.INFO,
                    "vllm-guardian allocator plugin: torch has no CUDA in pid %d: idle",
                    self.pid,
                )
                return 0
        backend = self._backend
        if not backend.ready():
            return 0
        if not self._publishing:
            self._publishing = True
            self._process_name = _process_name()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            self._once(
                "publishing",
                logging.INFO,
                "vllm-guardian allocator plugin: CUDA initialised in pid %d, publishing to %s",
                self.pid,
                self.out_dir,
            )
        now = self._time()
        conf = _alloc_conf(self._env)
        written = 0
        for device in range(min(backend.device_count(), MAX_DEVICES)):
            record = fmt.from_memory_stats(
                backend.memory_stats(device),
                pid=self.pid,
                device=device,
                time_seconds=now,
                interval_seconds=self.interval_seconds,
                alloc_conf=conf,
                process_name=self._process_name,
                cuda_visible_devices=self._env.get("CUDA_VISIBLE_DEVICES"),
            )
            if record is None or record.reserved_peak_bytes <= 0:
                continue  # a device this process never allocated on is another rank's
            self._write(fmt.file_name(self.pid, device), fmt.encode(record))
            written += 1
        self.written += written
        return written

    def _write(self, name: str, data: bytes) -> None:
        """Atomically: readers see the old file or the new one, never half of one."""
        tmp = self.out_dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.out_dir / name)

    def _remove_leftovers(self) -> None:
        """Files of dead processes (a restart without a fresh RuntimeDirectory): ours to clean."""
        with os.scandir(self.out_dir) as it:
            for i, entry in enumerate(it):
                if i >= MAX_CLEANUP_FILES:
                    break
                parsed = fmt.parse_file_name(entry.name)
                if parsed is not None and parsed[0] != self.pid and not _alive(parsed[0]):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _once(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args, exc_info=exc_info)

    # --- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="vllm-guardian-allocator", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._done and not self._stop.is_set():
            self.step()
            self._stop.wait(self.interval_seconds)

    def stop(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# --- the entry point --------------------------------------------------------------------------


class _Process:
    """This process's publisher; state, not an import-time action (nothing starts here)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.publisher: Publisher | None = None
        self.pid: int | None = None
        self.fork_hook = False  # the at-fork hook is installed in this interpreter


_process = _Process()


def _interval(env: Mapping[str, str]) -> float:
    raw = env.get(fmt.ENV_INTERVAL, "").strip()
    if not raw:
        return fmt.DEFAULT_INTERVAL_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 3600:
        log.warning(
            "vllm-guardian allocator plugin: %s=%r is not 0.1..3600 seconds; using %g",
            fmt.ENV_INTERVAL,
            raw,
            fmt.DEFAULT_INTERVAL_SECONDS,
        )
        return fmt.DEFAULT_INTERVAL_SECONDS
    return value


def start(env: Mapping[str, str] | None = None) -> Publisher | None:
    """Start this process's publisher if enabled; idempotent per process. May raise."""
    env = os.environ if env is None else env
    out = env.get(fmt.ENV_DIR, "").strip()
    if not out:
        return None  # not enabled: the plugin is installed but nobody asked for it
    with _process.lock:
        if _process.pid == os.getpid():
            return _process.publisher  # already started (or idle) in this process
        _process.pid = os.getpid()
        if importlib.util.find_spec("torch") is None:
            log.info("vllm-guardian allocator plugin: no torch in pid %d: idle", os.getpid())
            return None
        publisher = Publisher(Path(out), _interval(env), env=env)
        publisher.start()
        _process.publisher = publisher
    log.info(
        "vllm-guardian allocator plugin loaded in pid %d: publishing to %s every %g s once "
        "CUDA is initialised",
        publisher.pid,
        out,
        publisher.interval_seconds,
    )
    if not _process.fork_hook:
        _process.fork_hook = True
        os.register_at_fork(after_in_child=_after_fork)
    return publisher


def _after_fork() -> None:
    # The child has vLLM's "plugins loaded" flag but not our thread: start its own. Another
    # thread may have held the lock at the fork; the child's copy would never be released.
    _process.lock = threading.Lock()
    _process.publisher = _process.pid = None
    with contextlib.suppress(Exception):
        start()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: zero arguments, re-entrant, never raises."""
    try:
        start()
    except Exception as e:
        log.warning(
            "vllm-guardian allocator plugin: not started (%s: %s); vLLM is unaffected",
            type(e).__name__,
            e,
        )
