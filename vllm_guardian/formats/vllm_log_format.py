"""vLLM's log vocabulary: what a line of vLLM's log means, and nothing about reading it.

Pure (no I/O, no clock): the header vLLM puts at the start of every line and its JSON records,
which process and logger are the engine's own (:func:`line_origin`), the failure signatures
(:func:`match_line`: CUDA OOMs and the sizes in their message, start-up sizing failures,
engine death, hung workers, V0 preemption warnings), and the start-up line that sizes the KV
pool (:data:`KV_POOL_LINE`). The logs source (``sources/logs.py``) feeds it the lines it
follows and counts what it matches; ``diagnose``, the GPU check and the benchmarks read saved
logs with it.

Which lines are evidence (a client must not be able to write one):

* Only where vLLM reports its own failures: the engine core and its workers. vLLM 0.32 writes
  every line of a log record, a traceback's included, as ``(NAME pid=N) LEVEL MM-DD HH:MM:SS
  [file.py:N] …`` (vllm/logger.py's format; its NewLineFormatter repeats that header on every
  line of a multi-line record). NAME is the process: ``EngineCore``, ``EngineCore_DP0``,
  ``Worker``, ``Worker_TP1``, ``VllmWorker-0`` (:data:`ENGINE_PROCESS`). The API server
  (``APIServer``, ``ApiServer_0``) logs request text at ERROR (``Error with model …`` quotes
  the request's ``model`` field, its serving loggers quote prompts), so its lines are never
  evidence, except the engine client's account of its engine's death (:data:`ENGINE_CLIENT`).
  A line without the header (uvicorn's output, a bare traceback, anything printed around the
  logger) cannot be told apart from request text and is never evidence; nor is a header that
  does not start the line (text a request put in the middle of an API server line). vLLM
  versions that prefixed a child's raw output (``(VllmWorker-0 pid=7) Traceback …``, before
  the header carried the process) are read the same way: the process decides.
* vLLM's ``--logging-config.formatter json`` writes each record as one JSON object per line
  (``levelname``, ``name``: the logger, ``processName`` and ``vllm_process_name``: the
  process, ``message``, ``exc_info``: its traceback). The same rule applies to it: the process
  and the logger's module decide, exactly as the header's process and file do, and only the
  record's ``message`` and ``exc_info`` are read, never another field. A record must start the
  line; the access log stays text and is never read.
* Lines logged at INFO or DEBUG are never matched: every signature is logged at WARNING or
  above or is part of an ERROR record's traceback.
* A line that continues one the journal cut (``_LINE_BREAK=nul`` or ``line-max`` on the entry
  before: a NUL byte in a request's text, or a line over journald's LineMax) does not start a
  line: it is read with :data:`CONTINUED` in front, so a header in it is text, not a header.
* V0 (no process in its lines; the engine shared the API server's process) has one source
  left: its scheduler's preemption warnings. Its OOMs and engine deaths are no longer read from
  its log: /health, the process and NVML say those.
* Xids come from NVML (sources/nvml.py) with their own rules; a kernel line quoted in vLLM's
  log is text like any other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum

from vllm_guardian.model import LogEventKind

Details = tuple[tuple[str, str], ...]

# vLLM's header: "(NAME pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] msg" (0.32; the file is a
# relative path when VLLM_LOGGING_LEVEL=DEBUG). Older versions had no process in it, and V0 no
# brackets around the file.
LOG_PREFIX = re.compile(
    r"^(?:\((?P<proc>[^\s()]+) pid=(?P<pid>\d+)\) )?(?P<lvl>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \[?(?P<src>[^\]\s]+):\d+\]? (?P<msg>.*)$"
)
# Colours (vLLM's ColoredFormatter, when forced or on a terminal): around the header's parts.
_SGR = re.compile(r"\x1b\[[0-9;]*m")
# A process prefix alone: vLLM before 0.11 prefixed everything a child process wrote.
_PROC_PREFIX = re.compile(r"^\((?P<proc>[^\s()]+) pid=\d+\) (?P<msg>.*)$")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO"})
# The processes where vLLM reports its own failures: the engine core (EngineCore,
# EngineCore_DP0; EngineCore_0 before 0.10) and its workers (Worker, Worker_TP1_EP1 once named,
# VllmWorker-0 before; VllmWorkerProcess in V0; RayWorkerProc).
ENGINE_PROCESS = re.compile(
    r"(?:EngineCore|Worker|VllmWorker|VllmWorkerProcess|RayWorkerProc)(?:[-_][A-Za-z0-9_-]+)?"
)
# The API server's engine client (vllm/v1/engine/async_llm.py, core_client.py) reports its
# engine's death: EngineDeadError under "AsyncLLM output_handler failed.", "engine core exited
# unexpectedly". From the API server, only that, and only from those files.
ENGINE_CLIENT = frozenset({"async_llm.py", "core_client.py"})
# Engine-process files that copy a request into the log: the input dump of a fatal error
# (vllm/logging_utils/dump_input.py: request ids, sampling parameters, stop strings).
_REQUEST_ECHO = frozenset({"dump_input.py"})
# V0's scheduler (no process in V0's lines): its preemption warnings only.
_V0_SCHEDULER = "scheduler.py"
# What vLLM's engine core logs at start-up about its KV pool (vllm/v1/core/kv_cache_utils.py:
# "%s KV cache size: %s tokens, Maximum concurrency for …", GPU or CPU).
KV_POOL_LINE = "KV cache size: "
# In front of a journal entry that continues a line the journal cut: it does not start a line.
CONTINUED = "… "

_SIZE = r"[\d.]+ ?(?:bytes|[KMGTP]i?B|B)"
_SIZE_PARTS = re.compile(r"([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB|PiB|KB|MB|GB|TB|PB)")
_SIZE_FACTORS = {
    "bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
}  # fmt: skip


def parse_size_bytes(text: str) -> int | None:
    """torch's ``format_size`` output ('1.25 GiB', '0 bytes') → bytes."""
    m = _SIZE_PARTS.fullmatch(text.strip())
    if not m:
        return None
    try:
        return int(float(m.group(1)) * _SIZE_FACTORS[m.group(2)])
    except ValueError:
        return None


def _gib(text: str) -> str:
    return str(int(float(text) * 2**30))


# CUDA caching-allocator OOM, torch >= 2.1 and <= 2.0 (details are picked one by one below, so
# a variant with an extra clause or a typo like "total capacty" still yields what it has).
_CUDA_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory\. Tried to allocate")
_CUDA_OOM_TEXT = re.compile(r"CUDA out of memory")
_OOM_TRIED = re.compile(rf"Tried to allocate ({_SIZE})")
_OOM_GPU = re.compile(r"GPU (\d+) has a total capac|\(GPU (\d+);")
_OOM_TOTAL = re.compile(rf"total capac\w* of ({_SIZE})|({_SIZE}) total capacity")
_OOM_FREE = re.compile(rf"of which ({_SIZE}) is free|({_SIZE}) free;")
_OOM_ALLOCATED = re.compile(rf"({_SIZE}) is allocated by PyTorch|({_SIZE}) already allocated")
_OOM_RESERVED_UNALLOC = re.compile(rf"({_SIZE}) is reserved by PyTorch but unallocated")
_OOM_RESERVED_TOTAL = re.compile(rf"({_SIZE}) reserved in total by PyTorch")

_NON_TORCH_OOM = (
    (re.compile(r"CUDA error: out of memory"), "cuda"),
    (re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"), "cublas"),
    (re.compile(r"CUDNN_STATUS_ALLOC_FAILED"), "cudnn"),
    (re.compile(r"Cuda failure \d*\s*'out of memory'"), "nccl"),
)

# CUDA errors that mean the GPU itself failed (XID 48/79/95 territory): a restart of vLLM
# cannot help, a GPU reset can. Application faults (illegal address, launch failure) are not here.
_GPU_HARDWARE = re.compile(
    r"uncorrectable ECC error encountered|GPU has fallen off the bus|CUDA error: GPU is lost|"
    r"NVRM: Xid \(PCI:[^)]*\): (?:48|79|95|119)\b"
)
_NO_KV = re.compile(r"No available memory for the cache blocks")
_MAX_SEQ_NEW = re.compile(
    r"To serve at least one request with the models?'s? max seq len \((?P<mml>\d+)\)"
)
_MAX_SEQ_OLD = re.compile(
    r"The models?'s? max seq len \((?P<mml>\d+)\) is larger than the maximum number of tokens "
    r"that can be stored in KV cache \((?P<est>\d+)\)"
)
_MAX_SEQ_EST = re.compile(r"estimated maximum model length is (\d+)")
_MAX_SEQ_NEEDED = re.compile(r"\(([\d.]+) GiB KV cache is needed")
_MAX_SEQ_AVAIL = re.compile(r"available KV cache memory \(([\d.]+) GiB\)")
_FREE_BELOW = re.compile(
    r"Free memory on device\s*(?P<dev>[^\s(]*)\s*\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) "
    r"on startup is less than"
)
_FREE_BELOW_UTIL = re.compile(r"utilization \((?P<util>[\d.]+), (?P<req>[\d.]+) GiB\)")
# With --load-format ipc_cache (vllm/v1/worker/utils.py request_memory, 0.31+): the budget is
# gpu_memory_utilization's share less the weights vLLM's weight-cache daemon holds.
_FREE_BELOW_EXTERNAL = re.compile(
    r"after excluding external process's weights \((?P<util>[\d.]+), (?P<req>[\d.]+) GiB\)"
)
_EXTERNAL_EXCEED = re.compile(
    r"Externally held weights on device\s*(?P<dev>[^\s(]*)\s*\((?P<ext>[\d.]+)/(?P<total>[\d.]+) "
    r"GiB\) exceed the desired GPU memory utilization \((?P<util>[\d.]+), (?P<req>[\d.]+) GiB\)"
)
_PROFILING = re.compile(r"Error in memory profiling\.")
_PROFILING_FREE = re.compile(
    r"Initial free memory (?P<init>[\d.]+) GiB, current free memory (?P<cur>[\d.]+) GiB"
)
_STARTUP_FAILED = re.compile(
    r"EngineCore failed to start|Engine core initialization failed|WorkerProc failed to start"
    r"|Engine process failed to start"
)
_ENGINE_FATAL = re.compile(
    r"EngineCore encountered a fatal error|Engine background task failed|\bExecutor failed\."
)
_ENGINE_DEAD = re.compile(
    r"\b(?P<err>(?:Async|MQ)?EngineDeadError)\b"
    r"|(?P<exited>engine core exited unexpectedly)"
    r"|(?P<proc>Engine core proc(?:ess)? \S+ died unexpectedly)"
    r"|(?P<v0proc>Engine process \(pid \d+\) died)"
    r"|(?P<v0server>(?:AsyncLLMEngine|MQLLMEngine) (?:has failed|is already dead), terminating)"
    r"|(?P<launcher>Process \S+ \(PID: \d+\) died with exit code)"
)
_WORKER_DIED = re.compile(
    r"(?:RayWorkerProc rank=|Worker proc )(?P<worker>\S+) died unexpectedly"
    r"(?: \(exit code: (?P<code>-?\d+)\))?"
)
_EXECUTE_TIMEOUT = re.compile(r"RPC call to (?P<method>\S+?) timed out")
_PREEMPTION = re.compile(
    r"Sequence group (?P<group>\S+) is preempted by PreemptionMode\.(?P<mode>\w+) mode"
)
_PREEMPTION_TOTAL = re.compile(r"total_num_cumulative_preemption=(\d+)")
# vLLM's hang watchdog (vllm/utils/watch_dog.py, 0.33's --watchdog-config): after ``timeout``
# seconds without a feed it appends every thread's stack to its dump file and logs this at
# INFO through the engine's logger. Read at INFO only from the engine core or a worker and
# only as the whole message (a request's text can end an engine's message, never start it).
WATCHDOG_DUMPED = "[Watchdog]Dumped stack to "
_WATCHDOG_DUMP = re.compile(r"\[Watchdog\]Dumped stack to (?P<file>\S+) due to feed timeout")


def _first_group(m: re.Match[str] | None) -> str | None:
    if m is None:
        return None
    return next((g for g in m.groups() if g is not None), None)


def _cuda_oom_details(line: str) -> Details:
    d: list[tuple[str, str]] = []

    def size(key: str, pattern: re.Pattern[str]) -> int | None:
        text = _first_group(pattern.search(line))
        value = parse_size_bytes(text) if text else None
        if value is not None:
            d.append((key, str(value)))
        return value

    size("tried_bytes", _OOM_TRIED)
    gpu = _first_group(_OOM_GPU.search(line))
    if gpu is not None:
        d.append(("gpu", gpu))
    size("total_bytes", _OOM_TOTAL)
    size("free_bytes", _OOM_FREE)
    allocated = size("allocated_bytes", _OOM_ALLOCATED)
    if size("reserved_unallocated_bytes", _OOM_RESERVED_UNALLOC) is None:
        # torch <= 2.0 prints the reserved total; what the allocator holds unused is the rest.
        text = _first_group(_OOM_RESERVED_TOTAL.search(line))
        reserved = parse_size_bytes(text) if text else None
        if reserved is not None:
            d.append(("reserved_bytes", str(reserved)))
            if allocated is not None and reserved >= allocated:
                d.append(("reserved_unallocated_bytes", str(reserved - allocated)))
    return tuple(d)


def _match_body(line: str) -> tuple[LogEventKind, Details] | None:
    # Memory causes first: a line that names one is about memory even if it also says
    # "failed to start" or "engine dead".
    if _CUDA_OOM.search(line) and _CUDA_OOM_TEXT.search(line):
        return LogEventKind.CUDA_OOM, _cuda_oom_details(line)
    for pattern, which in _NON_TORCH_OOM:
        if pattern.search(line):
            return LogEventKind.NON_TORCH_OOM, (("source", which),)
    if _GPU_HARDWARE.search(line):
        return LogEventKind.GPU_HARDWARE_ERROR, ()
    if _NO_KV.search(line):
        return LogEventKind.NO_KV_CACHE_MEMORY, ()
    m = _MAX_SEQ_NEW.search(line)
    if m:
        d = [("max_model_len", m.group("mml"))]
        est = _MAX_SEQ_EST.search(line)
        if est:
            d.append(("estimated_max_model_len", est.group(1)))
        needed = _MAX_SEQ_NEEDED.search(line)
        if needed:
            d.append(("needed_kv_cache_bytes", _gib(needed.group(1))))
        avail = _MAX_SEQ_AVAIL.search(line)
        if avail:
            d.append(("available_kv_cache_bytes", _gib(avail.group(1))))
        return LogEventKind.MAX_SEQ_LEN_EXCEEDS_KV, tuple(d)
    m = _MAX_SEQ_OLD.search(line)
    if m:
        return LogEventKind.MAX_SEQ_LEN_EXCEEDS_KV, (
            ("max_model_len", m.group("mml")),
            ("estimated_max_model_len", m.group("est")),
        )
    m = _FREE_BELOW.search(line)
    if m:
        d = [("free_bytes", _gib(m.group("free"))), ("total_bytes", _gib(m.group("total")))]
        if m.group("dev"):
            d.insert(0, ("device", m.group("dev")))
        util = _FREE_BELOW_UTIL.search(line)
        if util:
            d += [
                ("gpu_memory_utilization", util.group("util")),
                ("requested_bytes", _gib(util.group("req"))),
            ]
        external = _FREE_BELOW_EXTERNAL.search(line)
        if external:
            d += [
                ("gpu_memory_utilization", external.group("util")),
                ("engine_budget_bytes", _gib(external.group("req"))),
                ("external_weights", "true"),
            ]
        return LogEventKind.FREE_MEMORY_BELOW_UTILIZATION, tuple(d)
    m = _EXTERNAL_EXCEED.search(line)
    if m:
        return LogEventKind.EXTERNAL_WEIGHTS_EXCEED_BUDGET, (
            *((("device", m.group("dev")),) if m.group("dev") else ()),
            ("external_weights_bytes", _gib(m.group("ext"))),
            ("total_bytes", _gib(m.group("total"))),
            ("gpu_memory_utilization", m.group("util")),
            ("requested_bytes", _gib(m.group("req"))),
        )
    if _PROFILING.search(line):
        free = _PROFILING_FREE.search(line)
        details: Details = ()
        if free:
            details = (
                ("initial_free_bytes", _gib(free.group("init"))),
                ("current_free_bytes", _gib(free.group("cur"))),
            )
        return LogEventKind.MEMORY_PROFILING_ERROR, details
    if _STARTUP_FAILED.search(line):
        return LogEventKind.STARTUP_FAILED, ()
    if _ENGINE_FATAL.search(line):
        return LogEventKind.ENGINE_FATAL, ()
    m = _ENGINE_DEAD.search(line)
    if m:
        return LogEventKind.ENGINE_DEAD, (("signature", m.group("err") or m.group(0)),)
    m = _WORKER_DIED.search(line)
    if m:
        d = [("worker", m.group("worker").rstrip(","))]
        if m.group("code") is not None:
            d.append(("exit_code", m.group("code")))
        return LogEventKind.WORKER_DIED, tuple(d)
    m = _EXECUTE_TIMEOUT.search(line)
    if m:
        return LogEventKind.EXECUTE_TIMEOUT, (("method", m.group("method")),)
    m = _PREEMPTION.search(line)
    if m:
        d = [("mode", m.group("mode").lower())]
        total = _PREEMPTION_TOTAL.search(line)
        if total:
            d.append(("total_cumulative", total.group(1)))
        return LogEventKind.PREEMPTION, tuple(d)
    return None


class Writer(StrEnum):
    """Who wrote a line, as vLLM's header says (never the text after it)."""

    ENGINE = "engine"  # the engine core or a worker: every signature
    ENGINE_CLIENT = "engine_client"  # the API server's engine client: its engine's death only
    V0_SCHEDULER = "v0_scheduler"  # V0's scheduler: its preemption warnings only


# What each writer other than the engine may report.
_ONLY: dict[Writer, LogEventKind] = {
    Writer.ENGINE_CLIENT: LogEventKind.ENGINE_DEAD,
    Writer.V0_SCHEDULER: LogEventKind.PREEMPTION,
}


@dataclass(frozen=True)
class Origin:
    writer: Writer
    level: str  # "" for a child's raw output (no level in it)
    message: str  # the line after the header
    process: str = ""  # the process vLLM named (EngineCore_DP0, Worker_TP1); "" in V0


# vLLM's ``--logging-config.formatter json`` (vllm/logger.py: python-json-logger's JsonFormatter
# with "%(asctime)s %(levelname)s %(name)s %(processName)s %(process)d %(message)s", plus the
# record factory's ``vllm_process_name``, and ``exc_info`` when the record has a traceback):
# one JSON object per line. Longer records are not read (no signature needs more).
_JSON_RECORD_MAX_CHARS = 64 * 1024


def _json_origin(line: str) -> Origin | None:
    """A JSON record's writer, by the same rule as a text header's: the process vLLM named
    (``vllm_process_name``, else multiprocessing's ``processName``) and the logger's module
    (the header's file). Only the record's own ``message`` and ``exc_info`` are its text: any
    other field (one a request could fill) is never read."""
    if len(line) > _JSON_RECORD_MAX_CHARS or not line.endswith("}"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    proc = record.get("vllm_process_name") or record.get("processName")
    level, logger, message = record.get("levelname"), record.get("name"), record.get("message")
    if not (
        isinstance(proc, str)
        and isinstance(level, str)
        and isinstance(logger, str)
        and isinstance(message, str)
    ):
        return None
    traceback = record.get("exc_info")
    if isinstance(traceback, str) and traceback:
        message = f"{message}\n{traceback}"
    src = f"{logger.rpartition('.')[2]}.py"
    if ENGINE_PROCESS.fullmatch(proc):
        return None if src in _REQUEST_ECHO else Origin(Writer.ENGINE, level, message, proc)
    return Origin(Writer.ENGINE_CLIENT, level, message, proc) if src in ENGINE_CLIENT else None


def display_line(line: str) -> str:
    """``line`` as a person reads it in an event, an alert or a report: a JSON record as the
    text format would have shown it (``(PROC pid=N) LEVEL time [logger] message``), so that
    the message is not cut off behind the record's other fields; any other line as it is."""
    if not line.startswith("{") or _json_origin(line) is None:
        return line
    record = json.loads(line)
    proc = record.get("vllm_process_name") or record.get("processName")
    head = f"({proc} pid={record.get('process')}) {record['levelname']}"
    return f"{head} {record.get('asctime', '')} [{record['name']}] {record['message']}"


def line_origin(line: str) -> Origin | None:
    """Who wrote ``line``, if it is a writer whose lines can be evidence; None for everything
    else (the API server's serving code, uvicorn, bare lines, a header not at the start).
    A line that starts with ``{`` is read as vLLM's JSON log record (:func:`_json_origin`)."""
    if line.startswith("{"):
        return _json_origin(line)
    if "\x1b" in line:
        line = _SGR.sub("", line)  # VLLM_LOGGING_COLOR=1: the header's colours
    m = LOG_PREFIX.match(line)
    if m is not None:
        proc, level, msg = m.group("proc"), m.group("lvl"), m.group("msg")
        src = m.group("src").rpartition("/")[2]
        if proc is None:
            return Origin(Writer.V0_SCHEDULER, level, msg) if src == _V0_SCHEDULER else None
        if ENGINE_PROCESS.fullmatch(proc):
            return None if src in _REQUEST_ECHO else Origin(Writer.ENGINE, level, msg, proc)
        return Origin(Writer.ENGINE_CLIENT, level, msg, proc) if src in ENGINE_CLIENT else None
    m = _PROC_PREFIX.match(line)
    if m is not None and ENGINE_PROCESS.fullmatch(m.group("proc")):
        return Origin(Writer.ENGINE, "", m.group("msg"), m.group("proc"))
    return None


def engine_message(line: str) -> str | None:
    """What the engine core or a worker logged on ``line``, at any level (vLLM's sizing lines
    are INFO); None for a line anyone else wrote."""
    origin = line_origin(line)
    return origin.message if origin is not None and origin.writer is Writer.ENGINE else None


# What a line that can be evidence starts with: a process's "(", a V0 level at WARNING or above,
# or a colour (stripped before the header is read). Everything else is dropped unread.
_EVIDENCE_FIRST = frozenset("(WEC\x1b{")
_QUIET_AFTER_PROCESS = ("INFO ", "DEBUG ")
_PROCESS_END_WITHIN = 128
# A JSON record's level, where vLLM's format puts it (second, after asctime). Only a real key
# reads so: inside a JSON string every '"' is escaped.
_JSON_LEVEL = '"levelname": "'
_JSON_QUIET = ('"levelname": "INFO"', '"levelname": "DEBUG"')


def may_be_evidence(line: str) -> bool:
    """False for a line :func:`match_line` would surely reject, told by its first characters
    (no regex): what does not start like vLLM's header, and a header at INFO or DEBUG. A flood
    of access-log or INFO lines costs a few string operations a line."""
    if not line or line[0] not in _EVIDENCE_FIRST:
        return False
    if line[0] == "(":
        # A process's name has no ") " in it: the first one ends "(NAME pid=N)".
        end = line.find(") ", 1, _PROCESS_END_WITHIN)
        if end > 0 and line.startswith(_QUIET_AFTER_PROCESS, end + 2):
            return WATCHDOG_DUMPED in line
    elif line[0] == "{":
        at = line.find(_JSON_LEVEL, 0, _PROCESS_END_WITHIN)
        if at >= 0 and line.startswith(_JSON_QUIET, at):
            return WATCHDOG_DUMPED in line
    return True


def match_line(line: str) -> tuple[LogEventKind, Details] | None:
    """The vLLM signature on one log line (kind and details), or None.

    ``line`` is one line of vLLM's output (a journal MESSAGE is split at newlines first). Only
    a line vLLM's engine core or a worker wrote counts, told apart by the header vLLM puts at
    the start of every line, never by the text after it (see the module docstring).
    """
    if not may_be_evidence(line):
        return None
    origin = line_origin(line)
    if origin is None:
        return None
    if origin.level in _QUIET_LEVELS:
        return _watchdog_dump(origin)
    only = _ONLY.get(origin.writer)
    # A text line's message is one line; a JSON record's may hold several (a traceback), each
    # the engine's own as the text format's header on every line would say.
    for body in origin.message.split("\n") if "\n" in origin.message else (origin.message,):
        found = _match_body(body)
        if found is not None and (only is None or found[0] is only):
            return found
    return None


def _watchdog_dump(origin: Origin) -> tuple[LogEventKind, Details] | None:
    """The hang watchdog's INFO line, when the engine core or a worker logged it."""
    if origin.writer is not Writer.ENGINE:
        return None
    m = _WATCHDOG_DUMP.fullmatch(origin.message)
    return (LogEventKind.WATCHDOG_DUMP, (("dump_file", m.group("file")),)) if m else None
