"""The GPU source: what the host's NVIDIA GPUs hold and which processes hold it, once per tick.

Where it sits: in the observe step of a tick the daemon calls :meth:`NvmlCollector.collect`
from a worker thread; the :class:`~vllm_guardian.model.GpuReading` it returns becomes
``Snapshot.gpus``, which the pure core reads for device-memory pressure, hardware faults
(XID, remapped rows, retired pages) and "is the memory actually free" after a restart.

Two backends sit behind one small interface (:class:`_Backend`), chosen by
``sources.nvml.backend``:

- ``nvml``: the driver through pynvml (nvidia-ml-py). This is the only module that imports
  pynvml (an import-linter contract enforces it).
- ``file``: the JSON state file the vLLM twin writes (docs/gpu-state-file.md), so the demo,
  tests and benchmarks run everything above the backend without a GPU.

Both return the same reading; the collector then fills each GPU process's ``name``,
``cgroup`` and ``ancestors`` from ``/proc`` so the core can attribute it to a service.

What is read when (``nvml`` backend): a GPU's handle, UUID and name, and the driver's
version, do not change within an NVML session (the driver fixes its devices' indices at init),
so they are read once per session and device, and again when the device count changes or a
call on the device fails; memory, utilisation, temperature, power, remapped rows, retired
pages and the process lists (what the policy reads) are read on every tick, as are the XID
events. The staleness this allows is none that a decision reads: the core keys devices by
index, never by UUID or name; a GPU that fails keeps its last UUID and name in its reading.

Nothing here raises into the tick: every failure becomes a ``failed(...)`` Reading with an
error and a hint a person can act on, and a GPU that cannot be read is listed with its
``error`` set while the other GPUs keep reporting.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pynvml

from vllm_guardian.config import NvmlSourceConfig
from vllm_guardian.formats.gpu_state_format import (
    StateFileError,
    merge_process,
    parse_state_file,
)
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.lowio.procfs import is_weight_cache_command, parse_cgroup, parse_ppid
from vllm_guardian.model import (
    GpuDevice,
    GpuProcess,
    GpuReading,
    Reading,
    SourceKind,
    XidEvent,
)
from vllm_guardian.sources.base import failed

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# The daemon passes Config.interval_seconds; this is that setting's default, for callers
# (tests, tools) that build a collector without a full config.
DEFAULT_INTERVAL_SECONDS = 2.0
# The twin rewrites its file every interval; three missed rewrites means it has stopped.
STALE_AFTER_INTERVALS = 3
# A real state file is a few KiB; this only stops a runaway or wrong file from eating memory.
MAX_STATE_FILE_BYTES = 4 * 1024 * 1024
# An XID storm can queue many events; drain a bounded number per tick so one collect
# cannot spin, and leave the rest for the next tick.
MAX_EVENTS_PER_COLLECT = 256
# Deeper process trees than this do not occur in practice; the bound guards against a
# /proc that changes under us into a loop.
MAX_ANCESTORS = 64


# --- pure helpers (unit-tested without I/O) ---------------------------------------------------


# --- process attribution from /proc ----------------------------------------------------------


def _read_small(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            data = f.read(64 * 1024)  # stat/comm/cgroup are tiny; never read a huge file
    except OSError:
        return None  # gone, another PID namespace, or no permission: not an error
    return data.decode("utf-8", errors="replace")


class _ProcReader:
    """Fills name, cgroup and ancestors of GPU processes from a /proc tree.

    NVML reports host pids; when the guardian runs in another PID namespace, or a process
    exits between the NVML call and this read, the fields stay None/() silently.
    """

    def __init__(self, proc_root: Path) -> None:
        self._root = proc_root

    def attribute(self, reading: GpuReading) -> GpuReading:
        cache: dict[int, GpuProcess] = {}
        devices = []
        for d in reading.devices:
            if d.processes is None:
                devices.append(d)
                continue
            procs = tuple(self._describe(p, cache) for p in d.processes)
            devices.append(_replace_processes(d, procs))
        return GpuReading(
            devices=tuple(devices),
            driver_version=reading.driver_version,
            xid_events=reading.xid_events,
        )

    def _describe(self, p: GpuProcess, cache: dict[int, GpuProcess]) -> GpuProcess:
        known = cache.get(p.pid)
        if known is None:
            ancestors = self.ancestors(p.pid)
            known = GpuProcess(
                pid=p.pid,
                used_memory_bytes=None,
                name=self.name(p.pid),
                cgroup=self.cgroup(p.pid),
                ancestors=ancestors,
                weight_cache=any(self.weight_cache(a) for a in (p.pid, *ancestors) if a != 1),
            )
            cache[p.pid] = known
        return GpuProcess(
            pid=p.pid,
            used_memory_bytes=p.used_memory_bytes,
            name=known.name,
            cgroup=known.cgroup,
            ancestors=known.ancestors,
            weight_cache=known.weight_cache,
        )

    def name(self, pid: int) -> str | None:
        text = _read_small(self._root / str(pid) / "comm")
        if text is None:
            return None
        return text.rstrip("\n") or None

    def weight_cache(self, pid: int) -> bool:
        """Whether ``pid`` is vLLM's weight-cache launcher (``vllm preload``): its children
        hold the weights (they have no title of their own), so the daemon is told by it."""
        text = _read_small(self._root / str(pid) / "cmdline")
        return text is not None and is_weight_cache_command(text)

    def cgroup(self, pid: int) -> str | None:
        text = _read_small(self._root / str(pid) / "cgroup")
        return parse_cgroup(text) if text is not None else None

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """The ppid chain, nearest first. It ends with 1 when it reaches init, so a process
        reparented to init (an orphaned worker still holding VRAM) shows as ``(1,)``."""
        chain: list[int] = []
        seen = {pid}
        current = pid
        for _ in range(MAX_ANCESTORS):
            text = _read_small(self._root / str(current) / "stat")
            ppid = parse_ppid(text) if text is not None else None
            if ppid is None or ppid == 0 or ppid in seen:
                break
            chain.append(ppid)
            if ppid == 1:
                break
            seen.add(ppid)
            current = ppid
        return tuple(chain)


def _replace_processes(d: GpuDevice, procs: tuple[GpuProcess, ...]) -> GpuDevice:
    return GpuDevice(
        index=d.index,
        uuid=d.uuid,
        name=d.name,
        memory_total_bytes=d.memory_total_bytes,
        memory_used_bytes=d.memory_used_bytes,
        memory_free_bytes=d.memory_free_bytes,
        utilization_ratio=d.utilization_ratio,
        temperature_celsius=d.temperature_celsius,
        power_watts=d.power_watts,
        processes=procs,
        remapped_rows_pending=d.remapped_rows_pending,
        remapped_rows_failed=d.remapped_rows_failed,
        retired_pages_pending=d.retired_pages_pending,
        error=d.error,
    )


# --- backends --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Failure:
    error: str
    hint: str | None


class _Backend(Protocol):
    def read(self) -> GpuReading | _Failure: ...

    def close(self) -> None: ...


class _FileBackend:
    """Reads the twin's JSON state file; remembers the XID seq per device between reads."""

    def __init__(self, cfg: NvmlSourceConfig, clock: Clock, interval_seconds: float) -> None:
        self._path = Path(cfg.state_file) if cfg.state_file else None
        self._clock = clock
        self._max_age_seconds = STALE_AFTER_INTERVALS * interval_seconds
        self._xid_seq: dict[str, int] = {}

    def read(self) -> GpuReading | _Failure:
        if self._path is None:
            return _Failure(
                "sources.nvml.backend is 'file' but no state file is configured",
                "set sources.nvml.state_file to the path the vLLM twin writes",
            )
        try:
            with self._path.open("rb") as f:
                data = f.read(MAX_STATE_FILE_BYTES + 1)
        except FileNotFoundError:
            return _Failure(
                f"GPU state file {self._path} does not exist",
                "start the vLLM twin (it writes this file) or fix sources.nvml.state_file",
            )
        except OSError as e:
            return _Failure(
                f"cannot read GPU state file {self._path}: {e.strerror or e}",
                "check that the guardian's user may read the file and its directory",
            )
        if len(data) > MAX_STATE_FILE_BYTES:
            return _Failure(
                f"GPU state file {self._path} is larger than {MAX_STATE_FILE_BYTES} bytes",
                "sources.nvml.state_file points at the wrong file",
            )
        result = parse_state_file(
            data.decode("utf-8", errors="replace"),
            self._clock.time(),
            max_age_seconds=self._max_age_seconds,
            last_xid_seq=self._xid_seq,
        )
        if isinstance(result, StateFileError):
            return _Failure(f"GPU state file {self._path}: {result.error}", result.hint)
        self._xid_seq = dict(result.xid_seq)
        return result.reading

    def close(self) -> None:
        pass


class _LibraryMissing(Exception):
    pass


# NVML answers these when a query does not apply to this GPU or driver: the value is absent.
_ABSENT = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
    }
)
# These mean the whole device is unreadable: nothing from it this tick can be trusted.
_DEVICE_FATAL = frozenset(
    {
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_RESET_REQUIRED,
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    }
)

_INIT_HINTS: dict[int, str] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "NVML library not found: install the NVIDIA driver or set sources.nvml.library_path"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded: check `nvidia-smi`, `lsmod | grep nvidia` "
        "and the kernel log"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "the guardian's user may not open /dev/nvidia*: check the device permissions "
        "(or the unit's DeviceAllow=)"
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the loaded kernel driver are different versions "
        "(driver upgraded without a reboot?): reboot or reload the nvidia module"
    ),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (
        "the NVML library is older than nvidia-ml-py expects: update the NVIDIA driver"
    ),
}
_DEFAULT_HINT = "check that `nvidia-smi` works on this host"


def _nvml_hint(e: pynvml.NVMLError) -> str:
    return _INIT_HINTS.get(int(e.value), _DEFAULT_HINT)


def _text(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def _address(handle: Any) -> int | None:
    """A device handle's pointer value, which identifies the GPU for the process lifetime."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value is not None else None


class _DeviceFault(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _NvmlBackend:
    """The driver through pynvml, with init retried under exponential backoff.

    pynvml keeps the loaded library and a function-pointer cache in module globals; one
    guardian process holds one collector, so this backend owns them.
    """

    def __init__(self, cfg: NvmlSourceConfig, clock: Clock, interval_seconds: float) -> None:
        self._library_path = cfg.library_path
        self._clock = clock
        self._interval_seconds = interval_seconds
        self._retry_max_seconds = cfg.init_retry_max_seconds
        self._initialized = False
        self._event_set: Any = None
        self._registered: set[int] = set()  # handle addresses already offered to the event set
        # What does not change within a session (see _read_device): per index, the handle,
        # UUID and name; the device count they were read under; the driver's version.
        self._static: dict[int, tuple[Any, str, str]] = {}
        self._static_count: int | None = None
        self._driver: str | None = None
        # Whether the driver has nvmlDeviceGetMemoryInfo_v2; None until the first read says.
        self._memory_v2: bool | None = None
        self._init_failures = 0
        self._next_init_monotonic: float | None = None
        self._last_init_failure: _Failure | None = None

    # -- session ---------------------------------------------------------------------------

    def read(self) -> GpuReading | _Failure:
        if not self._initialized:
            failure = self._init()
            if failure is not None:
                return failure
        return self._read_devices()

    def _init(self) -> _Failure | None:
        now = self._clock.monotonic()
        if (
            self._next_init_monotonic is not None
            and self._last_init_failure is not None
            and now < self._next_init_monotonic
        ):
            return self._backing_off(self._last_init_failure, self._next_init_monotonic - now)
        try:
            self._load_library()
            pynvml.nvmlInit()
        except _LibraryMissing as e:
            return self._init_failed(
                now, _Failure(str(e), _INIT_HINTS[pynvml.NVML_ERROR_LIBRARY_NOT_FOUND])
            )
        except OSError as e:
            path = self._library_path
            return self._init_failed(
                now,
                _Failure(
                    f"cannot load NVML library {path}: {e}",
                    "sources.nvml.library_path must point at the driver's libnvidia-ml.so.1 "
                    "for this architecture",
                ),
            )
        except pynvml.NVMLError as e:
            return self._init_failed(now, _Failure(f"NVML init failed: {e}", _nvml_hint(e)))
        self._initialized = True
        self._init_failures = 0
        self._next_init_monotonic = None
        self._last_init_failure = None
        self._registered.clear()
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            # Without an event set XIDs cannot be seen; the rest still works.
            log.warning("NVML event set unavailable, XID events will not be reported: %s", e)
            self._event_set = None
        return None

    def _load_library(self) -> None:
        if self._library_path is None:
            return  # pynvml loads libnvidia-ml.so.1 from the loader path (and retries if absent)
        path = self._library_path
        if "/" in path and not Path(path).exists():
            raise _LibraryMissing(f"NVML library not found at {path} (sources.nvml.library_path)")
        with pynvml.libLoadLock:
            current = pynvml.nvmlLib
            if current is None or getattr(current, "_name", None) != path:
                pynvml.nvmlLib = ctypes.CDLL(path)
                # pynvml caches function pointers of the library it loaded first; they
                # would call into the old one.
                pynvml._nvmlGetFunctionPointer_cache.clear()

    def _init_failed(self, now: float, failure: _Failure) -> _Failure:
        self._init_failures += 1
        # Doubling from the tick interval: the first retry is on the next tick, then ever
        # less often, so a host without a driver does not pay for a failing init each tick.
        delay = min(
            self._interval_seconds * 2 ** (self._init_failures - 1), self._retry_max_seconds
        )
        self._next_init_monotonic = now + delay
        self._last_init_failure = failure
        return self._backing_off(failure, delay)

    def _backing_off(self, failure: _Failure, remaining_seconds: float) -> _Failure:
        at = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._clock.time() + remaining_seconds)
        )
        return _Failure(f"{failure.error}; next init retry at {at}", failure.hint)

    def _end_session(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as e:
                log.debug("nvmlEventSetFree: %s", e)
            self._event_set = None
        if self._initialized:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as e:
                log.debug("nvmlShutdown: %s", e)
        self._initialized = False
        self._registered.clear()
        self._static.clear()
        self._static_count = None
        self._driver = None
        self._memory_v2 = None  # a reloaded driver may be another version

    def close(self) -> None:
        self._end_session()

    # -- one reading -----------------------------------------------------------------------

    def _read_devices(self) -> GpuReading | _Failure:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as e:
            # The session is unusable (driver unloaded, version mismatch): start over; the
            # next collect re-initialises and backs off if that fails.
            self._end_session()
            return _Failure(f"NVML device count failed: {e}", _nvml_hint(e))
        if count != self._static_count:  # a GPU came or went: read every device afresh
            self._static.clear()
            self._static_count = count
        driver = self._driver
        if driver is None:
            try:
                driver = self._driver = _text(pynvml.nvmlSystemGetDriverVersion())
            except pynvml.NVMLError:
                driver = None
        devices: list[GpuDevice] = []
        by_address: dict[int, int] = {}
        for index in range(count):
            device, handle = self._read_device(index)
            devices.append(device)
            if handle is not None:
                addr = _address(handle)
                if addr is not None:
                    by_address[addr] = index
                if device.error is None:
                    self._register(handle, addr)
        return GpuReading(
            devices=tuple(devices), driver_version=driver, xid_events=self._drain(by_address)
        )

    def _read_device(self, index: int) -> tuple[GpuDevice, Any]:
        """One GPU's reading. Its handle, UUID and name are read once per session and index
        (NVML fixes both for a session) and again after the device count changes or any call
        on the device fails; everything else is read every tick."""
        static = self._static.get(index)
        uuid: str | None = None
        name: str | None = None
        if static is not None:
            handle, uuid, name = static
        else:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as e:
                return _unreadable(index, None, None, str(e)), None
        try:
            if static is None:
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                name = _text(pynvml.nvmlDeviceGetName(handle))
                self._static[index] = (handle, uuid, name)
            mem_total, mem_used, mem_free = self._memory(handle)
            util = self._optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
            temp = self._optional(
                pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
            )
            power_mw = self._optional(pynvml.nvmlDeviceGetPowerUsage, handle)
            remap = self._optional(pynvml.nvmlDeviceGetRemappedRows, handle)
            retired = self._optional(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            processes = self._processes(handle)
        except pynvml.NVMLError as e:
            self._static.pop(index, None)
            return _unreadable(index, uuid, name, str(e)), handle
        except _DeviceFault as e:
            self._static.pop(index, None)
            return _unreadable(index, uuid, name, e.message), handle
        device = GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=mem_total,
            memory_used_bytes=mem_used,
            memory_free_bytes=mem_free,
            utilization_ratio=int(util.gpu) / 100.0 if util is not None else None,
            temperature_celsius=float(temp) if temp is not None else None,
            power_watts=int(power_mw) / 1000.0 if power_mw is not None else None,
            processes=processes,
            remapped_rows_pending=bool(remap[2]) if remap is not None else None,
            remapped_rows_failed=bool(remap[3]) if remap is not None else None,
            retired_pages_pending=(
                int(retired) == pynvml.NVML_FEATURE_ENABLED if retired is not None else None
            ),
        )
        return device, handle

    def _memory(self, handle: Any) -> tuple[int, int, int]:
        """A GPU's (total, used, free) bytes as CUDA counts them, which is what vLLM sizes its
        pool from (``gpu_memory_utilization`` × cudaMemGetInfo's total).

        NVML's v1 call counts the driver's own reservation as used and in the total (480 MiB
        on an H100 80GB, driver 580: v1 said 503,316,480 bytes used on an empty card); v2
        reports it apart, and v2's total − reserved and used equal CUDA's exactly (measured,
        bench/results/gpu/). Drivers before R510 lack v2: then v1, as it is.
        """
        if self._memory_v2 is not False:
            try:
                m2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            except (
                pynvml.NVMLError_FunctionNotFound,
                pynvml.NVMLError_NotSupported,
                pynvml.NVMLError_ArgumentVersionMismatch,
            ):
                self._memory_v2 = False
            else:
                self._memory_v2 = True
                return int(m2.total) - int(m2.reserved), int(m2.used), int(m2.free)
        m = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(m.total), int(m.used), int(m.free)

    @staticmethod
    def _optional(fn: Callable[..., Any], *args: Any) -> Any:
        """A value this GPU may not have: None when NVML says it does not apply.

        A device-fatal error (GPU lost, reset required) makes the whole device unreadable;
        any other error leaves just this value absent, so one odd sensor does not hide the
        memory numbers the policy depends on.
        """
        try:
            return fn(*args)
        except pynvml.NVMLError as e:
            if int(e.value) in _DEVICE_FATAL:
                raise _DeviceFault(str(e)) from None
            if int(e.value) not in _ABSENT:
                log.debug("%s failed: %s", getattr(fn, "__name__", fn), e)
            return None

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...] | None:
        lists = [
            self._optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle),
            self._optional(pynvml.nvmlDeviceGetGraphicsRunningProcesses, handle),
        ]
        if all(entries is None for entries in lists):
            return None  # the driver would not say (e.g. no permission, vGPU)
        by_pid: dict[int, GpuProcess] = {}
        for entries in lists:
            for p in entries or ():
                pid = int(p.pid)
                used = int(p.usedGpuMemory) if p.usedGpuMemory is not None else None
                by_pid[pid] = merge_process(by_pid.get(pid), GpuProcess(pid, used))
        return tuple(by_pid[pid] for pid in sorted(by_pid))

    # -- XID events ------------------------------------------------------------------------

    def _register(self, handle: Any, addr: int | None) -> None:
        if self._event_set is None or addr is None or addr in self._registered:
            return
        try:
            pynvml.nvmlDeviceRegisterEvents(
                handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set
            )
        except pynvml.NVMLError as e:
            if int(e.value) not in _ABSENT:
                return  # e.g. the GPU is lost right now: try again on a later tick
            log.info("GPU %s does not report XID events: %s", addr, e)
        self._registered.add(addr)

    def _drain(self, by_address: Mapping[int, int]) -> tuple[XidEvent, ...]:
        if self._event_set is None:
            return ()
        events: list[XidEvent] = []
        for _ in range(MAX_EVENTS_PER_COLLECT):
            try:
                # Timeout 0: never block the tick; whatever is queued is taken now.
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as e:
                if int(e.value) != pynvml.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", e)
                break
            if int(data.eventType) != pynvml.nvmlEventTypeXidCriticalError:
                continue
            index = self._event_gpu_index(data.device, by_address)
            if index is None:
                log.warning("XID %d on a GPU NVML cannot name; dropped", int(data.eventData))
                continue
            # The v2 event carries no timestamp: the time is when the guardian saw it.
            events.append(XidEvent(index, int(data.eventData), self._clock.time()))
        return tuple(events)

    @staticmethod
    def _event_gpu_index(handle: Any, by_address: Mapping[int, int]) -> int | None:
        addr = _address(handle)
        if addr is not None and addr in by_address:
            return by_address[addr]
        try:
            return int(pynvml.nvmlDeviceGetIndex(handle))
        except pynvml.NVMLError:
            return None


def _unreadable(index: int, uuid: str | None, name: str | None, error: str) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_bytes=None,
        memory_used_bytes=None,
        memory_free_bytes=None,
        error=error,
    )


# --- the collector ---------------------------------------------------------------------------


class NvmlCollector:
    """The host's GPU source (``service=None``): one per guardian, whatever the backend.

    ``interval_seconds`` is the daemon's tick interval: the NVML backend's init backoff
    starts from it, and the file backend calls a file older than three intervals stale.
    """

    kind: SourceKind = SourceKind.NVML

    def __init__(
        self,
        cfg: NvmlSourceConfig,
        clock: Clock,
        proc_root: Path = Path("/proc"),
        *,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        self.service: str | None = None
        self.timeout_seconds: float = cfg.timeout_seconds
        self._enabled = cfg.enabled
        self._procs = _ProcReader(proc_root)
        self._backend: _Backend = (
            _FileBackend(cfg, clock, interval_seconds)
            if cfg.backend == "file"
            else _NvmlBackend(cfg, clock, interval_seconds)
        )
        # collect() runs on a worker thread and close() on the main one at shutdown.
        self._lock = threading.Lock()
        self._closed = False

    def collect(self) -> Reading:
        if not self._enabled:
            return failed(self.kind, None, "the GPU source is disabled (sources.nvml.enabled)")
        with self._lock:
            if self._closed:
                return failed(self.kind, None, "the GPU source is closed")
            try:
                result = self._backend.read()
                if isinstance(result, _Failure):
                    return failed(self.kind, None, result.error, result.hint)
                return Reading(
                    source=self.kind, service=None, payload=self._procs.attribute(result)
                )
            except Exception as e:
                # A bug here must cost one observation, never the tick.
                log.exception("GPU source failed")
                return failed(
                    self.kind,
                    None,
                    f"GPU source failed unexpectedly: {type(e).__name__}: {e}",
                    "this is a bug in vllm-guardian: please report it with the log",
                )

    def close(self) -> None:
        # A collect stuck in the driver must not hang shutdown: give up on a clean release.
        if not self._lock.acquire(timeout=self.timeout_seconds):
            return
        try:
            if not self._closed:
                self._closed = True
                self._backend.close()
        finally:
            self._lock.release()
