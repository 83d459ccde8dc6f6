"""The logs source: the signature matcher on exact vLLM lines, dedup, framing, file following with
rotation and truncation, and a fake journalctl run as a real subprocess."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import wait_for
from vllm_guardian.config import LogsSourceConfig, ServiceConfig
from vllm_guardian.formats.vllm_log_format import CONTINUED, match_line, parse_size_bytes
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import LogEventKind, LogReading, Reading
from vllm_guardian.sources.logs import (
    DEDUP_WINDOW_SECONDS,
    FILE_SLICE_BYTES,
    EventCounter,
    FileFollower,
    LineSplitter,
    LogsCollector,
    parse_journal_line,
    split_message,
)

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
K = LogEventKind
GiB = 2**30
MiB = 2**20

OOM_21 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total "
    "capacity of 93.02 GiB of which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in "
    "use. Of the allocated memory 90.63 GiB is allocated by PyTorch, and 120.54 MiB is reserved "
    "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
OOM_20 = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 "
    "GiB total capacity; 14.24 GiB already allocated; 3.75 MiB free; 14.72 GiB reserved in total "
    "by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)


def _b(x: float, unit: int) -> str:
    return str(int(x * unit))


OOM_20_DETAILS = {
    "tried_bytes": _b(20, MiB),
    "gpu": "0",
    "total_bytes": _b(15.78, GiB),
    "free_bytes": _b(3.75, MiB),
    "allocated_bytes": _b(14.24, GiB),
    "reserved_bytes": _b(14.72, GiB),
    "reserved_unallocated_bytes": str(int(14.72 * GiB) - int(14.24 * GiB)),
}
# vLLM 0.32's header on the engine core's and a worker's lines (vllm/logger.py; every line of a
# record, a traceback's included, carries it): the signature bodies below are read under it.
ENGINE = "(EngineCore_DP0 pid=4120) ERROR 11-22 00:07:30 [core.py:1007] "
WORKER = "(Worker pid=4121) ERROR 11-22 00:07:30 [multiproc_executor.py:1063] "


def api(msg: str, src: str = "serving.py:274", level: str = "ERROR") -> str:
    return f"(APIServer pid=4119) {level} 11-22 00:07:30 [{src}] {msg}"


def model_error(model: str) -> str:
    """vLLM 0.32's line for a request naming a model it does not serve, as it prints it (the
    chat, responses and batch handlers: ``logger.error("Error with model %s", error)``; the
    error's repr quotes the request's ``model`` with its newlines escaped)."""
    return api(
        "Error with model error=ErrorInfo(message='The model `"
        + model.encode("unicode_escape").decode("ascii")
        + "` does not exist. Valid aliases: tiny-llama.', type='NotFoundError', param='model', "
        "code=404)"
    )


# Text a client can put in a request: each is a signature the guardian acts on.
HOSTILE_TEXT = [
    OOM_21,
    "GPU has fallen off the bus",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "EngineCore encountered a fatal error.",
    "ValueError: No available memory for the cache blocks.",
    "Worker proc VllmWorker-0 died unexpectedly (exit code: -9)",
    "TimeoutError: RPC call to execute_model timed out.",
]
# Headers a request can spell out in its text.
FAKE_HEADERS = [
    ENGINE,
    WORKER,
    "(VllmWorker-0 pid=7) ",
    "(APIServer pid=4119) ERROR 11-22 00:07:30 [async_llm.py:906] ",
    "\n" + ENGINE,
    "\u2028" + ENGINE,
    "\x00" + ENGINE,
]
# Lines a client shapes, in the formats vLLM 0.32 writes them: none is evidence.
HOSTILE_LINES = [
    # a request's `model` in the API server's ERROR line
    *(model_error(t) for t in HOSTILE_TEXT),
    # ... with a header for the engine core or a worker in front of the text
    *(model_error(h + t) for h in FAKE_HEADERS for t in HOSTILE_TEXT[:3]),
    # the serving code's own traceback quoting a request: every line under its header
    api("Error in preprocessing prompt inputs", "serving.py:301"),
    api("Traceback (most recent call last):", "serving.py:301"),
    *(api("ValueError: " + t, "serving.py:301") for t in HOSTILE_TEXT),
    # the same with VLLM_LOGGING_LEVEL=DEBUG, which puts a path in the header
    api("ValueError: " + OOM_21, "entrypoints/openai/chat_completion/serving.py:274"),
    # the engine client's file, but not a death: from the API server only deaths count
    api(OOM_21, "async_llm.py:906"),
    # bare: uvicorn's traceback of an exception in the API server, anything printed
    "Traceback (most recent call last):",
    *HOSTILE_TEXT,
    # a header that does not start the line: what a request put after a NUL byte or a
    # line separator, or a journal entry that continues a cut line (vllm_log_format.CONTINUED)
    *(lead + ENGINE + OOM_21 for lead in (" ", "x", "\u2028", "\x00", "… ")),
    # a request id or header value a client chose, in the request logger (INFO) and in uvicorn's
    # access log
    api(
        "Received request chatcmpl-" + OOM_21 + ": params: SamplingParams(n=1)",
        "logger.py:40",
        "INFO",
    ),
    '(APIServer pid=4119) INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 404',
    # the engine core's input dump on a fatal error copies the requests (stop strings, ids)
    "(EngineCore_DP0 pid=4120) ERROR 11-22 00:07:30 [dump_input.py:79] Dumping scheduler output "
    "for model execution: SchedulerOutput(scheduled_new_reqs=[NewRequestData(req_id=chatcmpl-1,"
    "sampling_params=SamplingParams(n=1, stop=['" + OOM_21 + "'])])",
    # the API server's coloured header, and one a request wrote in colour mid-line
    "\x1b[0;36m(APIServer pid=4119)\x1b[0;0m \x1b[31mERROR\x1b[0m \x1b[90m11-22 00:07:30\x1b[0m "
    "\x1b[90m[serving.py:274]\x1b[0m Error with model " + OOM_21,
    "x\x1b[0;36m" + ENGINE + OOM_21,
    # an engine process's INFO line
    "(EngineCore_DP0 pid=4120) INFO 11-22 00:07:30 [core.py:1007] " + OOM_21,
]


MATCH_CASES: list[tuple[str, tuple[LogEventKind, dict[str, str]] | None]] = [
    # 6b runtime CUDA OOM, torch >= 2.1 (with the worker's process prefix)
    (
        "(VllmWorker-0 pid=2752205) " + OOM_21,
        (
            K.CUDA_OOM,
            {
                "tried_bytes": _b(1.25, GiB),
                "gpu": "1",
                "total_bytes": _b(93.02, GiB),
                "free_bytes": _b(1.18, GiB),
                "allocated_bytes": _b(90.63, GiB),
                "reserved_unallocated_bytes": _b(120.54, MiB),
            },
        ),
    ),
    # torch 2.1's "capacty" typo, the older class path and "0 bytes" free
    (
        ENGINE
        + "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has "
        "a total capacty of 79.15 GiB of which 0 bytes is free. Including non-PyTorch memory, this "
        "process has 79.14 GiB memory in use. Of the allocated memory 77.10 GiB is allocated by "
        "PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated.",
        (
            K.CUDA_OOM,
            {
                "tried_bytes": _b(512, MiB),
                "gpu": "0",
                "total_bytes": _b(79.15, GiB),
                "free_bytes": "0",
                "allocated_bytes": _b(77.10, GiB),
                "reserved_unallocated_bytes": _b(1.02, GiB),
            },
        ),
    ),
    # torch <= 2.0: reserved in total - allocated = reserved but unallocated
    (ENGINE + OOM_20, (K.CUDA_OOM, OOM_20_DETAILS)),
    # VLLM_LOGGING_LEVEL=DEBUG puts a path in the header
    (
        "(EngineCore_DP0 pid=4120) ERROR 11-22 00:07:30 [v1/engine/core.py:1007] " + OOM_20,
        (K.CUDA_OOM, OOM_20_DETAILS),
    ),
    # the same OOM as EngineCore re-raises it from the worker's reply
    (
        ENGINE
        + "RuntimeError: Worker failed with error 'CUDA out of memory. Tried to allocate 1.25 GiB. "
        "GPU 1 has a total capacity of 93.02 GiB of which 1.18 GiB is free.', please check the "
        "stack trace above for the root cause",
        (
            K.CUDA_OOM,
            {
                "tried_bytes": _b(1.25, GiB),
                "gpu": "1",
                "total_bytes": _b(93.02, GiB),
                "free_bytes": _b(1.18, GiB),
            },
        ),
    ),
    # non-caching-allocator OOMs
    (WORKER + "RuntimeError: CUDA error: out of memory", (K.NON_TORCH_OOM, {"source": "cuda"})),
    (
        WORKER
        + "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        (K.NON_TORCH_OOM, {"source": "cublas"}),
    ),
    # NCCL's own WARN line is C output, bare; the exception the worker then logs quotes it
    # ("Last error:" and the line, under the worker's header)
    (WORKER + "Cuda failure 'out of memory'", (K.NON_TORCH_OOM, {"source": "nccl"})),
    (
        WORKER + "enqueue.cc:1000 NCCL WARN Cuda failure 2 'out of memory'",
        (K.NON_TORCH_OOM, {"source": "nccl"}),
    ),
    # 6a start-up sizing
    (
        ENGINE + "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
        "reservation on the CPU backend, despite its name). See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
        (K.NO_KV_CACHE_MEMORY, {}),
    ),
    (
        ENGINE
        + "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 "
        "GiB KV cache is needed, which is larger than the available KV cache memory (9.34 GiB). "
        "Based on the available memory, the estimated maximum model length is 76480. Try "
        "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
        "engine.",
        (
            K.MAX_SEQ_LEN_EXCEEDS_KV,
            {
                "max_model_len": "131072",
                "estimated_max_model_len": "76480",
                "needed_kv_cache_bytes": _b(16.0, GiB),
                "available_kv_cache_bytes": _b(9.34, GiB),
            },
        ),
    ),
    (
        ENGINE
        + "ValueError: To serve at least one request with the model's max seq len (32768), (4 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (2.5 GiB). Based on "
        "the available memory, the estimated maximum model length is 20480. Try increasing …",
        (
            K.MAX_SEQ_LEN_EXCEEDS_KV,
            {
                "max_model_len": "32768",
                "estimated_max_model_len": "20480",
                "needed_kv_cache_bytes": _b(4, GiB),
                "available_kv_cache_bytes": _b(2.5, GiB),
            },
        ),
    ),
    (
        ENGINE
        + "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (20000). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine.",
        (K.MAX_SEQ_LEN_EXCEEDS_KV, {"max_model_len": "32768", "estimated_max_model_len": "20000"}),
    ),
    (
        WORKER
        + "ValueError: Free memory on device cuda:0 (16.9/79.18 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 71.26 GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes.",
        (
            K.FREE_MEMORY_BELOW_UTILIZATION,
            {
                "device": "cuda:0",
                "free_bytes": _b(16.9, GiB),
                "total_bytes": _b(79.18, GiB),
                "gpu_memory_utilization": "0.9",
                "requested_bytes": _b(71.26, GiB),
            },
        ),
    ),
    (
        WORKER
        + "ValueError: Free memory on device (16.9/79.18 GiB) on startup is less than the engine's "
        "budget after excluding external process's weights",
        (
            K.FREE_MEMORY_BELOW_UTILIZATION,
            {"free_bytes": _b(16.9, GiB), "total_bytes": _b(79.18, GiB)},
        ),
    ),
    (
        WORKER
        + "AssertionError: Error in memory profiling. Initial free memory 70.5 GiB, current free "
        "memory 72.1 GiB. This happens when other processes sharing the same container release GPU "
        "memory while vLLM is profiling during initialization.",
        (
            K.MEMORY_PROFILING_ERROR,
            {"initial_free_bytes": _b(70.5, GiB), "current_free_bytes": _b(72.1, GiB)},
        ),
    ),
    (
        "(EngineCore_DP0 pid=4120) ERROR 05-19 10:00:00 [core.py:708] EngineCore failed to start.",
        (K.STARTUP_FAILED, {}),
    ),
    (
        "(VllmWorker-0 pid=4121) ERROR 05-19 10:00:00 [multiproc_executor.py:953] WorkerProc "
        "failed to start.",
        (K.STARTUP_FAILED, {}),
    ),
    # 6b/6c engine death
    (
        "(EngineCore_DP0 pid=4120) ERROR 11-22 00:09:18 [core.py:1050] EngineCore encountered a "
        "fatal error.",
        (K.ENGINE_FATAL, {}),
    ),
    # the API server's engine client, on its engine's death (the traceback under "AsyncLLM
    # output_handler failed.", and its shutdown notice)
    (
        "(APIServer pid=4119) ERROR 11-22 00:07:30 [async_llm.py:906] "
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
        "trace (above) for the root cause.",
        (K.ENGINE_DEAD, {"signature": "EngineDeadError"}),
    ),
    (
        "(APIServer pid=11273) WARNING 11-22 00:09:23 [core_client.py:812] [shutdown] MPClient: "
        "engine core exited unexpectedly; starting cleanup",
        (K.ENGINE_DEAD, {"signature": "engine core exited unexpectedly"}),
    ),
    (
        "(APIServer pid=4119) ERROR 04-20 10:00:00 [core_client.py:500] Engine core proc "
        "EngineCore_0 died unexpectedly, shutting down client.",
        (K.ENGINE_DEAD, {"signature": "Engine core proc EngineCore_0 died unexpectedly"}),
    ),
    (
        "(EngineCore_DP0 pid=4120) ERROR 11-22 00:09:18 [multiproc_executor.py:200] Worker proc "
        "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.",
        (K.WORKER_DIED, {"worker": "VllmWorker-0", "exit_code": "-9"}),
    ),
    (
        "(EngineCore_DP0 pid=4120) ERROR 05-19 10:00:00 [multiproc_executor.py:1] Worker proc "
        "VllmWorker-1 died unexpectedly, shutting down executor.",
        (K.WORKER_DIED, {"worker": "VllmWorker-1"}),
    ),
    (
        ENGINE + "RayWorkerProc rank=3 died unexpectedly, shutting down executor.",
        (K.WORKER_DIED, {"worker": "3"}),
    ),
    (
        ENGINE + "TimeoutError: RPC call to execute_model timed out.",
        (K.EXECUTE_TIMEOUT, {"method": "execute_model"}),
    ),
    # VLLM_LOGGING_COLOR=1 (vLLM's ColoredFormatter): colours around the header's parts
    (
        "\x1b[0;36m(EngineCore_DP0 pid=4120)\x1b[0;0m \x1b[31mERROR\x1b[0m \x1b[90m11-22 00:07:30"
        "\x1b[0m \x1b[90m[core.py:1007]\x1b[0m " + OOM_20,
        (K.CUDA_OOM, OOM_20_DETAILS),
    ),
    # vLLM before 0.11 put the process in front of a child's raw output instead
    ("(VllmWorker-0 pid=7) " + OOM_20, (K.CUDA_OOM, OOM_20_DETAILS)),
    # 6d V0 preemption warning (V0's lines name no process: its scheduler's file does)
    (
        "WARNING 12-27 10:00:00 scheduler.py:1560] Sequence group cmpl-5f1a-0 is preempted by "
        "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. This can affect "
        "the end-to-end performance. Increase gpu_memory_utilization or tensor_parallel_size to "
        "provide more KV cache memory. total_num_cumulative_preemption=51",
        (K.PREEMPTION, {"mode": "recompute", "total_cumulative": "51"}),
    ),
    # not events
    # V0's engine lived in the API server's process and its lines name none: its deaths are
    # read from /health and the exit, not from text in the server's log
    (
        "vllm.engine.async_llm_engine.AsyncEngineDeadError: Background loop is not running. If it "
        "was running, inspect the output to find the stacktrace of the error that caused the "
        "background loop to stop (AsyncEngineDeadError).",
        None,
    ),
    (
        "CRITICAL 12-27 10:00:00 launcher.py:99] MQLLMEngine is already dead, terminating server "
        "process",
        None,
    ),
    # the API server's uncaught exception at exit, bare; "EngineCore failed to start." in the
    # engine core's own lines is the evidence
    (
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore_DP0': 1}",
        None,
    ),
    # NCCL's WARN line itself: C output, bare, like anything printed around vLLM's logger
    ("host:123:456 [0] NCCL INFO include/alloc.h:48 NCCL WARN Cuda failure 'out of memory'", None),
    # a header without a process (a version that did not name it): the API server's and the
    # engine's lines look the same, so neither is evidence
    ("ERROR 05-19 10:00:00 [multiproc_executor.py:1] WorkerProc failed to start.", None),
    ("ERROR 05-19 10:00:00 [core.py:1] " + OOM_20, None),
    (
        "(APIServer pid=1) INFO 11-22 00:01:43 [loggers.py:335] Engine 000: Avg prompt throughput: "
        "828.3 tokens/s, Avg generation throughput: 1717.4 tokens/s, Running: 32 reqs, Waiting: 0 "
        "reqs, Preemptions: 12, GPU KV cache usage: 99.5%, Prefix cache hit rate: 0.0%",
        None,
    ),
    # user text in an INFO line must not fake an OOM
    (
        "(APIServer pid=1) INFO 11-22 00:01:43 [logger.py:40] Received request cmpl-1: prompt: "
        "'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB. EngineDeadError'",
        None,
    ),
    (
        "(EngineCore pid=1) INFO 05-19 10:00:00 [gpu_worker.py:1] Free memory on device (70.1/79.2 "
        "GiB) on startup. Desired GPU memory utilization is (0.9, 71.3 GiB). Actual usage is ...",
        None,
    ),
    (
        "(APIServer pid=11273) WARNING 11-22 00:09:23 [utils.py:653] [shutdown] Process manager: "
        "force killing remaining process EngineCore pid 11972",
        None,
    ),
    # uvicorn's access log (INFO) carries the path a client chose: any client that reaches
    # vLLM's port must not be able to fake an engine death or an OOM (a restart, a relaunch,
    # the restart budget spent, then the breaker latched)
    ('INFO:     10.0.0.7:51234 - "GET /EngineDeadError HTTP/1.1" 404 Not Found', None),
    ('INFO:     10.0.0.7:51234 - "GET /CUBLAS_STATUS_ALLOC_FAILED HTTP/1.1" 404 Not Found', None),
    (
        'INFO:     10.0.0.7:51234 - "POST /v1/completions?x=torch.OutOfMemoryError:%20CUDA%20out'
        '%20of%20memory.%20Tried%20to%20allocate HTTP/1.1" 400 Bad Request',
        None,
    ),
    (
        '(APIServer pid=7) INFO:     10.0.0.7:51234 - "GET /engine%20core%20exited%20unexpectedly'
        ' HTTP/1.1" 404 Not Found',
        None,
    ),
    ('DEBUG:    10.0.0.7:51234 - "GET /EngineDeadError HTTP/1.1" 404 Not Found', None),
    # ... and uvicorn's ERROR lines and the bare traceback under them ("Exception in ASGI
    # application": an exception in the API server, whose message a request can shape)
    ("ERROR:    Exception in ASGI application", None),
    (
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
        "trace (above) for the root cause.",
        None,
    ),
    ("", None),
    *((line, None) for line in HOSTILE_LINES),
]


@pytest.mark.parametrize(("line", "expected"), MATCH_CASES)
def test_match_line(line: str, expected: tuple[LogEventKind, dict[str, str]] | None) -> None:
    got = match_line(line)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got[0] is expected[0]
        assert dict(got[1]) == expected[1]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1.25 GiB", int(1.25 * GiB)),
        ("0 bytes", 0),
        ("120.54 MiB", int(120.54 * MiB)),
        ("3 KiB", 3072),
        ("x", None),
    ],
)
def test_parse_size_bytes(text: str, value: int | None) -> None:
    assert parse_size_bytes(text) == value


@pytest.mark.parametrize("name", ["server-startup-run1-cold.log", "shutdown-log-lines.txt"])
def test_real_vllm_logs_have_no_events(name: str) -> None:
    """A healthy start-up and orderly shutdowns (incl. force-killing a worker at the end of a
    drain) are not failures."""
    counter = EventCounter(recent_events=50)
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        counter.feed(line, float(i))
    reading = counter.take()
    assert reading.recent == ()
    assert all(n == 0 for _, n in reading.counts)
    assert reading.lines_total == len(lines)


def test_one_oom_traceback_counts_once() -> None:
    """Worker traceback, EngineCore's re-raise and fatal error, an EngineDeadError per request,
    as vLLM 0.32 writes them: every line of a record under its header."""
    worker = "(Worker pid=7) ERROR 05-19 10:00:00 [multiproc_executor.py:1063] "
    core = "(EngineCore_DP0 pid=6) ERROR 05-19 10:00:00 [core.py:1512] "
    client = "(APIServer pid=5) ERROR 05-19 10:00:00 [async_llm.py:906] "
    lines = [
        worker + "WorkerProc hit an exception.",
        worker + "Traceback (most recent call last):",
        worker + '  File "/x/gpu_model_runner.py", line 1, in execute_model',
        worker + OOM_21,
        core + "EngineCore encountered a fatal error.",
        core + "Traceback (most recent call last):",
        core + "RuntimeError: Worker failed with error 'CUDA out of memory. Tried to allocate "
        "1.25 GiB. GPU 1 has a total capacity of 93.02 GiB of which 1.18 GiB is free.'",
        client + "AsyncLLM output_handler failed.",
    ] + [
        client + "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
        "See stack trace (above) for the root cause."
    ] * 5
    counter = EventCounter(recent_events=50)
    for i, line in enumerate(lines):
        counter.feed(line, 1000.0 + i * 0.1)
    reading = counter.take()
    assert reading.count(K.CUDA_OOM) == 1
    assert reading.count(K.ENGINE_FATAL) == 1
    assert reading.count(K.ENGINE_DEAD) == 1
    assert [e.kind for e in reading.recent] == [K.CUDA_OOM, K.ENGINE_FATAL, K.ENGINE_DEAD]
    assert dict(reading.recent[0].details)["gpu"] == "1"
    assert reading.lines_total == len(lines)

    # The same OOM after the window (the restarted engine died again) is a new incident; so is
    # one on another GPU inside the window.
    counter.feed(worker + OOM_21, 1000.0 + DEDUP_WINDOW_SECONDS + 5)
    counter.feed(
        worker + OOM_21.replace("GPU 1 has", "GPU 2 has"), 1000.0 + DEDUP_WINDOW_SECONDS + 5.1
    )
    again = counter.take()
    assert again.count(K.CUDA_OOM) == 3
    assert len(again.recent) == 2


def test_each_preemption_warning_counts() -> None:
    counter = EventCounter(recent_events=50)
    for i, total in enumerate((1, 51, 101)):
        counter.feed(
            f"WARNING 12-27 10:00:0{i} scheduler.py:1560] Sequence group {i} is preempted by "
            f"PreemptionMode.SWAP mode because there is not enough KV cache space. "
            f"total_num_cumulative_preemption={total}",
            float(i),
        )
    assert counter.take().count(K.PREEMPTION) == 3


def test_recent_is_capped_redacted_and_truncated() -> None:
    counter = EventCounter(recent_events=3)
    for i in range(5):
        counter.feed(f"{ENGINE}TimeoutError: RPC call to m{i} timed out.", i * 100.0)
    long_line = (
        "(EngineCore_DP0 pid=6) ERROR 05-19 10:00:00 [core.py:1] EngineCore failed to start. "
        "cmd: vllm serve m "
        "--api-key sekret " + "x" * 2000
    )
    counter.feed(long_line, 1000.0)
    reading = counter.take()
    assert reading.count(K.EXECUTE_TIMEOUT) == 5
    assert len(reading.recent) == 3  # the newest three
    assert [dict(e.details).get("method") for e in reading.recent] == ["m3", "m4", None]
    msg = reading.recent[-1].message
    assert "sekret" not in msg
    assert "--api-key ***" in msg
    assert len(msg) <= 500
    assert counter.take().recent == ()  # handed out once
    assert set(dict(reading.counts)) == set(LogEventKind)  # every kind, zeros included


def test_line_splitter() -> None:
    s = LineSplitter(max_line_bytes=10)
    assert s.feed(b"ab") == []
    assert s.feed(b"c\r\nde") == ["abc"]
    assert s.feed(b"f\n") == ["def"]
    # a long line is cut at 10 bytes, once, and its rest dropped
    assert s.feed(b"0123456789ABC") == ["0123456789"]
    assert s.feed(b"DEF\nok\n") == ["ok"]
    assert s.feed(b"\xff\n") == ["\ufffd"]
    assert s.feed(b"tail") == []
    assert s.flush() == ["tail"]
    assert s.flush() == []


def test_parse_journal_line() -> None:
    e = parse_journal_line(
        json.dumps({"MESSAGE": "hello", "__REALTIME_TIMESTAMP": "1700000000123456"})
    )
    assert e is not None
    assert e.message == "hello"
    assert e.time_seconds == pytest.approx(1700000000.123456)
    assert e.cursor is None
    e = parse_journal_line(json.dumps({"MESSAGE": None, "__CURSOR": "s=ab;i=2f"}))
    assert e is not None
    assert (e.message, e.cursor) == (None, "s=ab;i=2f")  # a null message still moves the cursor
    for bad in ("", 7, None):
        e = parse_journal_line(json.dumps({"MESSAGE": "x", "__CURSOR": bad}))
        assert e is not None
        assert e.cursor is None, bad
    raw = list(b"\x1b[31mERROR\x1b[0m caf\xc3\xa9 \xff")
    e = parse_journal_line(json.dumps({"MESSAGE": raw}))
    assert e is not None
    assert e.message == "\x1b[31mERROR\x1b[0m café \ufffd"
    assert e.time_seconds is None
    e = parse_journal_line(json.dumps({"MESSAGE": None, "__REALTIME_TIMESTAMP": "x"}))
    assert e is not None
    assert e.message is None
    assert e.time_seconds is None
    assert parse_journal_line(b"not json") is None
    assert parse_journal_line(b"[1, 2]") is None


# --- the collector, following a file ----------------------------------------------------------


class Gathered:
    """Sums what successive collect() calls hand out, as the daemon would see it."""

    def __init__(self, collector: LogsCollector) -> None:
        self.collector = collector
        self.events: list[tuple[LogEventKind, str]] = []
        self.last: Reading | None = None
        self.reading: LogReading | None = None

    def poll(self) -> Reading:
        self.last = self.collector.collect()
        if isinstance(self.last.payload, LogReading):
            self.reading = self.last.payload
            self.events += [(e.kind, e.message) for e in self.last.payload.recent]
        return self.last

    def has(self, n: int) -> Callable[[], bool]:
        return lambda: self.poll() is not None and len(self.events) >= n


OOM_LINE = (
    ENGINE
    + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {n} MiB. GPU 0 has a total capacity of 80 GiB of which 0 bytes is free.\n"
)


@pytest.fixture
def file_collector(tmp_path: Path) -> Iterator[tuple[Path, LogsCollector, FakeClock]]:
    log = tmp_path / "vllm.log"
    log.write_text(OOM_LINE.format(n=1) + "an old line\n")
    clock = FakeClock()
    svc = ServiceConfig(name="a", log_file=str(log), unit="vllm.service")  # the file wins
    collector = LogsCollector(svc, LogsSourceConfig(max_line_bytes=1024), clock)
    yield log, collector, clock
    collector.close()


def test_file_starts_at_end_and_reads_complete_lines(
    file_collector: tuple[Path, LogsCollector, FakeClock],
) -> None:
    log, collector, clock = file_collector
    g = Gathered(collector)
    with log.open("a") as f:
        f.write(OOM_LINE.format(n=2))
        f.write(ENGINE + "TimeoutError: RPC call to execute_model timed ")  # incomplete: not yet
        f.flush()
        wait_for(g.has(1), "1 event(s)", seen=lambda: g.events)
        time.sleep(0.4)
        assert g.poll().payload is not None
        assert len(g.events) == 1  # the old OOM was before the guardian started
        f.write("out.\n")
    wait_for(g.has(2), "2 event(s)", seen=lambda: g.events)
    assert [k for k, _ in g.events] == [K.CUDA_OOM, K.EXECUTE_TIMEOUT]
    assert g.reading is not None
    assert g.reading.lines_total == 2
    assert g.reading.recent[-1].time_seconds == clock.time()


def test_file_rotation_by_rename_and_truncation(
    file_collector: tuple[Path, LogsCollector, FakeClock],
) -> None:
    log, collector, _ = file_collector
    g = Gathered(collector)
    with log.open("a") as f:
        f.write(OOM_LINE.format(n=3))
    wait_for(g.has(1), "1 event(s)", seen=lambda: g.events)
    # rename rotation: the writer still has the old file open and finishes a line there first
    old = log.with_suffix(".log.1")
    with log.open("a") as writer:
        os.rename(log, old)
        writer.write(OOM_LINE.format(n=4))
    log.write_text(OOM_LINE.format(n=5))
    wait_for(g.has(3), "3 event(s)", seen=lambda: g.events)
    # truncation (copytruncate): start over at the beginning
    log.write_text("")
    time.sleep(0.4)
    log.write_text(OOM_LINE.format(n=6))
    wait_for(g.has(4), "4 event(s)", seen=lambda: g.events)
    tried = [m.split("allocate ")[1].split(" MiB")[0] for _, m in g.events]
    assert tried == ["3", "4", "5", "6"]


def test_file_missing_then_appears(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    collector = LogsCollector(
        ServiceConfig(name="a", log_file=str(log)), LogsSourceConfig(), FakeClock()
    )
    try:
        g = Gathered(collector)
        wait_for(lambda: g.poll().error is not None, "an error", seen=lambda: g.last)
        assert g.last is not None
        assert "does not exist" in (g.last.error or "")
        assert "log_file" in (g.last.hint or "")
        log.write_text(ENGINE + "TimeoutError: RPC call to x timed out.\n")  # read from its start
        wait_for(g.has(1), "1 event(s)", seen=lambda: g.events)
    finally:
        collector.close()
        collector.close()  # idempotent


def test_long_lines_are_truncated(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    collector = LogsCollector(
        ServiceConfig(name="a", log_file=str(log)),
        LogsSourceConfig(max_line_bytes=1024),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        with log.open("a") as f:
            f.write(
                ENGINE
                + "EngineCore encountered a fatal error. "
                + "y" * 5000
                + " EngineDeadError\n"
            )
            f.write(ENGINE + "TimeoutError: RPC call to execute_model timed out.\n")
        wait_for(g.has(2), "2 event(s)", seen=lambda: g.events)
        # the tail beyond 1024 bytes (with "EngineDeadError") was never seen
        assert [k for k, _ in g.events] == [K.ENGINE_FATAL, K.EXECUTE_TIMEOUT]
    finally:
        collector.close()


def test_no_unit_and_no_file(tmp_path: Path) -> None:
    collector = LogsCollector(ServiceConfig(name="a"), LogsSourceConfig(), FakeClock())
    reading = collector.collect()
    assert reading.payload is None
    assert "services[].unit" in (reading.hint or "")
    collector.close()


def test_collect_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    collector = LogsCollector(
        ServiceConfig(name="a", log_file=str(log)), LogsSourceConfig(), FakeClock()
    )
    try:
        wait_for(lambda: collector.collect().payload is not None, "a reading")

        def boom() -> LogReading:
            raise RuntimeError("surprise")

        monkeypatch.setattr(collector._counter, "take", boom)
        reading = collector.collect()
        assert reading.payload is None
        assert "surprise" in (reading.error or "")
    finally:
        collector.close()


# --- the collector, following the journal through a fake journalctl ---------------------------


def _entry(message: str | list[int], ts_us: int) -> str:
    return json.dumps({"MESSAGE": message, "__REALTIME_TIMESTAMP": str(ts_us), "_PID": "7"})


def _fake_journalctl(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "journalctl"
    path.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{tmp_path}/args"\n'
        f'echo "${{GUARD_PREFIX:-none}}" > "{tmp_path}/prefix"\n'
        f'echo $$ >> "{tmp_path}/spawns"\n'
        f"{body}\n"
    )
    path.chmod(0o755)
    return path


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_journal_follow_with_fake_journalctl(tmp_path: Path) -> None:
    entries = tmp_path / "entries.jsonl"
    oom = OOM_LINE.format(n=7).strip()
    entries.write_text(
        "\n".join(
            [
                _entry(
                    "(APIServer pid=5) INFO 05-19 10:00:00 [api_server.py:1] Starting vLLM",
                    1_700_000_000_000_000,
                ),
                _entry(list(oom.encode()), 1_700_000_001_500_000),  # MESSAGE as bytes
                _entry(
                    ENGINE
                    + "EngineCore encountered a fatal error.\n"
                    + api("vllm.v1.engine.exceptions.EngineDeadError: x", "async_llm.py:906"),
                    1_700_000_002_000_000,
                ),
                "not json",
            ]
        )
        + "\n"
    )
    journalctl = _fake_journalctl(tmp_path, f'cat "{entries}"\nexec sleep 60')
    svc = ServiceConfig(name="a", unit="vllm.service")
    collector = LogsCollector(
        svc,
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
        journal_argv_prefix=["env", "GUARD_PREFIX=yes"],
    )
    try:
        g = Gathered(collector)
        wait_for(g.has(3), "3 event(s)", seen=lambda: g.events)
        assert [k for k, _ in g.events] == [K.CUDA_OOM, K.ENGINE_FATAL, K.ENGINE_DEAD]
        assert (tmp_path / "args").read_text().splitlines() == [
            "-f",
            "-o",
            "json",
            "--all",
            "-n",
            "0",
            "--unit=vllm.service",
        ]
        assert (tmp_path / "prefix").read_text().strip() == "yes"
        pid = int((tmp_path / "spawns").read_text().split()[0])
        assert _alive(pid)
    finally:
        collector.close()
    assert not _alive(pid)
    collector.close()


def test_journal_event_time_comes_from_the_journal(tmp_path: Path) -> None:
    entries = tmp_path / "entries.jsonl"
    entries.write_text(
        _entry(ENGINE + "TimeoutError: RPC call to execute_model timed out.", 1_700_000_001_500_000)
        + "\n"
    )
    journalctl = _fake_journalctl(tmp_path, f'cat "{entries}"\nexec sleep 60')
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        got: list[float] = []

        def seen() -> bool:
            payload = collector.collect().payload
            if isinstance(payload, LogReading):
                got.extend(e.time_seconds for e in payload.recent)
            return bool(got)

        wait_for(seen, "an event")
        assert got == [pytest.approx(1_700_000_001.5)]
    finally:
        collector.close()


def _cut_entry(message: str, ts_us: int, line_break: str | None) -> str:
    doc = {"MESSAGE": message, "__REALTIME_TIMESTAMP": str(ts_us), "_TRANSPORT": "stdout"}
    if line_break is not None:
        doc["_LINE_BREAK"] = line_break
    return json.dumps(doc)


# Journal entries a client shapes (a request's text in an API server line), then an engine OOM
# the collector must still read: (name, entries before it, how many events before it).
JOURNAL_HOSTILITY = [
    # journald splits a stream at newlines only; str.splitlines would also split at U+2028,
    # U+0085, \x1c and form feeds, and the header after one would start a line
    *(
        (
            f"a header after {sep!r} in one MESSAGE",
            [_cut_entry(api("x" + sep + OOM_LINE.format(n=1).strip()), 1, None)],
        )
        for sep in ("\u2028", "\u2029", "\x85", "\x1c", "\x1e", "\x0b", "\x0c")
    ),
    # a NUL byte ends a journal entry (_LINE_BREAK=nul): what follows it is the same line
    (
        "a header after a NUL byte",
        [
            _cut_entry(api("Error with model x"), 1, "nul"),
            _cut_entry(OOM_LINE.format(n=1).strip(), 2, None),
        ],
    ),
    # a line longer than journald's LineMax goes on in the next entry
    (
        "a header past LineMax",
        [
            _cut_entry(api("Error with model " + "x" * 100), 1, "line-max"),
            _cut_entry(OOM_LINE.format(n=1).strip(), 2, None),
        ],
    ),
    # ... also when the cut entry is too long to parse: its raw JSON says it was cut
    (
        "a header past LineMax, after an entry too long to parse",
        [
            _cut_entry(api("Error with model " + "x" * 200_000), 1, "line-max"),
            _cut_entry(OOM_LINE.format(n=1).strip(), 2, None),
        ],
    ),
]


@pytest.mark.parametrize(
    ("name", "entries"), JOURNAL_HOSTILITY, ids=[x[0] for x in JOURNAL_HOSTILITY]
)
def test_a_header_inside_a_request_line_is_not_a_line(
    tmp_path: Path, name: str, entries: list[str]
) -> None:
    real = _cut_entry(OOM_LINE.format(n=2).strip(), 3, None)
    feed = tmp_path / "entries.jsonl"
    feed.write_text("\n".join([*entries, real]) + "\n")
    journalctl = _fake_journalctl(tmp_path, f'cat "{feed}"\nexec sleep 60')
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        wait_for(g.has(1), "1 event", seen=lambda: g.events)
        time.sleep(0.3)
        g.poll()
        # Only the engine's own line: the one after the hostile entries, read as usual.
        assert [m for _, m in g.events] == [OOM_LINE.format(n=2).strip()], name
    finally:
        collector.close()


def test_split_message() -> None:
    assert split_message("a\nb\r\n", False) == ["a", "b"]
    assert split_message("", False) == [""]
    assert split_message("a\u2028b\x85c", False) == ["a\u2028b\x85c"]
    assert split_message("(EngineCore pid=1) x", True) == [CONTINUED + "(EngineCore pid=1) x"]
    e = parse_journal_line(json.dumps({"MESSAGE": "x", "_LINE_BREAK": "nul"}))
    assert e is not None and e.cut and e.line_break == "nul"
    for brk, cut in (("line-max", True), ("eof", False), ("pid-change", False), (None, False)):
        e = parse_journal_line(json.dumps({"MESSAGE": "x", "_LINE_BREAK": brk}))
        assert e is not None and e.cut is cut, brk


def test_journalctl_missing(tmp_path: Path) -> None:
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(tmp_path / "no-journalctl")),
        FakeClock(),
    )
    try:
        wait_for(lambda: collector.collect().error is not None, "an error")
        reading = collector.collect()
        assert reading.payload is None
        assert "not found" in (reading.error or "")
        assert "sources.logs.journalctl" in (reading.hint or "")
    finally:
        collector.close()


def test_journalctl_exits_and_is_restarted(tmp_path: Path) -> None:
    journalctl = _fake_journalctl(
        tmp_path,
        "echo 'Failed to add filter for units: No data available' >&2\nexit 1",
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        wait_for(lambda: collector.collect().error is not None, "an error")
        reading = collector.collect()
        assert reading.payload is None
        assert "exited with status 1" in (reading.error or "")
        assert "No data available" in (reading.error or "")
        assert "systemd-journal" in (reading.hint or "")
        # restarted with backoff (1 s, then 2 s)
        wait_for(lambda: len((tmp_path / "spawns").read_text().split()) >= 2, "a second spawn")
    finally:
        collector.close()


def test_journalctl_that_cannot_read_the_journal(tmp_path: Path) -> None:
    journalctl = _fake_journalctl(
        tmp_path,
        "echo 'Hint: You are currently not seeing messages from other users and the system.' >&2\n"
        "echo \"      Users in groups 'adm', 'systemd-journal' can see all messages.\" >&2\n"
        "exec sleep 60",
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        wait_for(lambda: collector.collect().error is not None, "an error")
        reading = collector.collect()
        assert "cannot read the system journal" in (reading.error or "")
        assert "systemd-journal" in (reading.hint or "")
    finally:
        collector.close()


def test_close_stops_journalctl_children(tmp_path: Path) -> None:
    # Not exec: the shell's child holds stdout; close() must stop the whole group. The child
    # says when SIGTERM reaches it (a SIGKILL, which close() sends only if SIGTERM did not
    # work, cannot be caught): a condition, not a measure of how long close() took. It also
    # says when its trap is set: a SIGTERM sent before that kills it by default, unrecorded,
    # which on a busy host made this test fail without close() being wrong.
    termed = tmp_path / "termed"
    trapped = tmp_path / "trapped"
    child_body = f'trap "echo TERM > {termed}; exit 0" TERM; echo $$ > {trapped}; sleep 60 & wait'
    journalctl = _fake_journalctl(tmp_path, f"sh -c '{child_body}' &\nwait")
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    wait_for(
        lambda: trapped.exists() and trapped.read_text().strip() != "",
        "the child to set its SIGTERM trap",
    )
    child = int(trapped.read_text())
    t0 = time.monotonic()
    collector.close()
    print(f"close() took {time.monotonic() - t0:.2f} s")
    wait_for(lambda: not _alive(child), "the child to exit")
    assert termed.exists(), "the shell's child never got SIGTERM: only the shell was signalled"


# --- a restarted journalctl resumes after the last entry it handed over ----------------------


def _cursor_entry(message: str, ts_us: int, cursor: str) -> str:
    return json.dumps({"MESSAGE": message, "__REALTIME_TIMESTAMP": str(ts_us), "__CURSOR": cursor})


def _journalctl_by_run(tmp_path: Path, by_args: str, first_run: str, later_runs: str) -> Path:
    """A fake journalctl that appends its arguments (one run a line) to ``runs``, then runs
    ``by_args`` (a ``case "$*"`` body chosen on them), then ``first_run`` on its first run and
    ``later_runs`` after."""
    path = tmp_path / "journalctl"
    path.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/runs"\n'
        f'case "$*" in\n{by_args}\nesac\n'
        f'if [ "$(wc -l < "{tmp_path}/runs")" -eq 1 ]; then\n{first_run}\nfi\n'
        f"{later_runs}\n"
    )
    path.chmod(0o755)
    return path


def _runs(tmp_path: Path) -> list[str]:
    runs = tmp_path / "runs"
    return runs.read_text().splitlines() if runs.exists() else []


def test_restarted_journalctl_resumes_after_the_last_entry(tmp_path: Path) -> None:
    """journalctl exits (journald restarted, a crash); whatever the unit logged before it is
    running again is read from the entry after the last one handed over, not lost to ``-n 0``.
    Here the OOM is logged in that gap: a journalctl started with ``-n 0`` never prints it."""
    first = tmp_path / "first.jsonl"
    first.write_text(
        _cursor_entry(
            "(APIServer pid=5) INFO 05-19 10:00:00 [api_server.py:1] Starting vLLM",
            1_700_000_000_000_000,
            "s=1;i=1",
        )
        + "\n"
    )
    gap = tmp_path / "gap.jsonl"
    gap.write_text(
        _cursor_entry(OOM_LINE.format(n=9).strip(), 1_700_000_001_000_000, "s=1;i=2") + "\n"
    )
    now = tmp_path / "now.jsonl"
    now.write_text(
        _cursor_entry(
            "(APIServer pid=5) INFO 05-19 10:00:05 [api_server.py:1] still serving",
            1_700_000_005_000_000,
            "s=1;i=3",
        )
        + "\n"
    )
    journalctl = _journalctl_by_run(
        tmp_path,
        f'  *"--after-cursor=s=1;i=1"*) cat "{gap}" "{now}"; exec sleep 60 ;;',
        f'  cat "{first}"; exit 1',
        f'cat "{now}"; exec sleep 60',  # from now on (-n 0): the gap is behind it
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        # Two lines read: the first run's, then the second run's first (the OOM when it resumes
        # after the cursor, the line logged now when it starts from now).
        wait_for(
            lambda: g.poll() is not None and g.reading is not None and g.reading.lines_total >= 2,
            "2 lines",
            seen=lambda: (g.reading, _runs(tmp_path)),
        )
        runs = _runs(tmp_path)
        assert [k for k, _ in g.events] == [K.CUDA_OOM], (g.events, runs)
        assert runs[0] == "-f -o json --all -n 0 --unit=vllm.service", runs
        assert runs[1] == "-f -o json --all --after-cursor=s=1;i=1 --unit=vllm.service", runs
    finally:
        collector.close()


def test_a_cursor_journalctl_rejects_is_dropped(tmp_path: Path) -> None:
    """A cursor journalctl cannot seek to (a journal vacuumed or replaced) must not keep every
    restart failing: a run started from a cursor that hands over no entry is followed by one
    started from now, as at the guardian's start."""
    first = tmp_path / "first.jsonl"
    first.write_text(_cursor_entry("a line", 1_700_000_000_000_000, "s=1;i=1") + "\n")
    journalctl = _journalctl_by_run(
        tmp_path,
        '  *--after-cursor=*) echo "Failed to seek to cursor: Invalid argument" >&2; exit 1 ;;',
        f'  cat "{first}"; exit 1',
        "exec sleep 60",
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        # Restarts back off 1 s, then 2 s: the third run starts about 3 s in.
        wait_for(lambda: len(_runs(tmp_path)) >= 3, "3 runs", seen=lambda: _runs(tmp_path))
        runs = _runs(tmp_path)
        assert runs[1] == "-f -o json --all --after-cursor=s=1;i=1 --unit=vllm.service", runs
        assert runs[2] == "-f -o json --all -n 0 --unit=vllm.service", runs
    finally:
        collector.close()


# --- journalctl's output: entries split across writes, bursts, exits ------------------------


def _step_journalctl(tmp_path: Path, steps: list[str]) -> Path:
    """A fake journalctl that runs ``steps`` in turn (shell), each after the test creates
    ``go-N``, and creates ``done-N`` after each; it then stays (a journal followed)."""
    body = []
    for i, step in enumerate(steps):
        body.append(f'while [ ! -e "{tmp_path}/go-{i}" ]; do sleep 0.02; done')
        body.append(step)
        body.append(f'touch "{tmp_path}/done-{i}"')
    path = tmp_path / "journalctl"
    path.write_text("#!/bin/sh\n" + "\n".join(body) + "\nexec sleep 60\n")
    path.chmod(0o755)
    return path


def _run_step(tmp_path: Path, i: int) -> None:
    (tmp_path / f"go-{i}").touch()
    wait_for((tmp_path / f"done-{i}").exists, f"done-{i}")


def _following(collector: LogsCollector) -> None:
    """Wait until the collector holds the journalctl it started."""
    wait_for(lambda: collector._proc is not None, "journalctl")  # a test looks inside


def _printf(tmp_path: Path, name: str, data: str) -> str:
    """A step that writes ``data`` (no newline added) to stdout."""
    (tmp_path / name).write_text(data)
    return f'cat "{tmp_path / name}"'


def test_an_entry_split_across_ticks_is_read_whole(tmp_path: Path) -> None:
    """journalctl writes an entry in two parts with a tick in between: the first part waits for
    the rest; it is neither parsed alone (a line that cannot be matched) nor lost."""
    oom = _entry(OOM_LINE.format(n=3).strip(), 1_700_000_001_000_000)
    cut = len(oom) // 2
    journalctl = _step_journalctl(
        tmp_path,
        [_printf(tmp_path, "a", oom[:cut]), _printf(tmp_path, "b", oom[cut:] + "\n")],
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        _following(collector)
        _run_step(tmp_path, 0)
        g.poll()  # the first half is in the pipe now
        assert g.reading is not None
        assert (g.reading.lines_total, g.events) == (0, [])
        _run_step(tmp_path, 1)
        wait_for(
            lambda: g.poll() is not None and g.reading is not None and g.reading.lines_total >= 1,
            "1 line",
            seen=lambda: g.reading,
        )
        assert (g.reading.lines_total, [k for k, _ in g.events]) == (1, [K.CUDA_OOM])
    finally:
        collector.close()


def test_an_entry_too_long_is_counted_once_across_reads(tmp_path: Path) -> None:
    """An entry at least 8 × max_line_bytes + 64 KiB long cannot be parsed: it counts as one
    line, however many reads and ticks it spans, and the entry after it is read as usual."""
    cfg = LogsSourceConfig(max_line_bytes=1024)
    limit = 8 * 1024 + 64 * 1024
    # An OOM padded past the limit: read whole, it would count as an OOM.
    huge = _entry(OOM_LINE.format(n=99) + "x" * (2 * limit), 1_700_000_000_000_000) + "\n"
    oom = _entry(OOM_LINE.format(n=4).strip(), 1_700_000_001_000_000) + "\n"
    third = len(huge) // 3
    journalctl = _step_journalctl(
        tmp_path,
        [
            _printf(tmp_path, "h1", huge[:third]),
            _printf(tmp_path, "h2", huge[third : 2 * third]),
            _printf(tmp_path, "h3", huge[2 * third :] + oom),
        ],
    )
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl), max_line_bytes=cfg.max_line_bytes),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        _following(collector)
        for i in range(3):
            _run_step(tmp_path, i)
            g.poll()
        wait_for(
            lambda: g.poll() is not None and g.reading is not None and g.reading.lines_total >= 2,
            "2 lines",
            seen=lambda: g.reading,
        )
        assert g.reading is not None
        assert g.reading.lines_total == 2
        assert [m for _, m in g.events] == [OOM_LINE.format(n=4).strip()]
    finally:
        collector.close()


def test_a_burst_larger_than_the_pipe_is_read_whole(tmp_path: Path) -> None:
    """Far more than a pipe holds between two ticks: journalctl waits on the pipe, nothing is
    lost, every entry is counted once (distinct OOMs are distinct incidents)."""
    n = 3000
    burst = "".join(
        _entry(OOM_LINE.format(n=i + 1).strip(), 1_700_000_000_000_000 + i) + "\n" for i in range(n)
    )
    assert len(burst) > 4 * 65536
    journalctl = _step_journalctl(tmp_path, [_printf(tmp_path, "burst", burst)])
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl), recent_events=n),
        FakeClock(),
    )
    try:
        g = Gathered(collector)
        _following(collector)
        (tmp_path / "go-0").touch()
        wait_for(
            lambda: g.poll() is not None and g.reading is not None and g.reading.lines_total >= n,
            f"{n} lines",
            seen=lambda: g.reading.lines_total if g.reading else None,
        )
        assert g.reading is not None
        assert g.reading.lines_total == n
        assert dict(g.reading.counts)[K.CUDA_OOM] == n
        assert [m for _, m in g.events] == [OOM_LINE.format(n=i + 1).strip() for i in range(n)]
    finally:
        collector.close()


def test_journalctl_exiting_mid_entry(tmp_path: Path) -> None:
    """journalctl writes an entry and half of the next, then exits: the entry is read, the half
    counts as one line that cannot be matched, and the source says journalctl exited."""
    oom = _entry(OOM_LINE.format(n=5).strip(), 1_700_000_001_000_000) + "\n"
    half = _entry(OOM_LINE.format(n=6).strip(), 1_700_000_002_000_000)[:100]
    journalctl = _fake_journalctl(
        tmp_path,
        f'[ -e "{tmp_path}/ran" ] && exec sleep 60\n'  # a restart stays up
        f'touch "{tmp_path}/ran"\ncat "{tmp_path / "out"}"\nexit 3',
    )
    (tmp_path / "out").write_text(oom + half)
    collector = LogsCollector(
        ServiceConfig(name="a", unit="vllm.service"),
        LogsSourceConfig(journalctl=str(journalctl)),
        FakeClock(),
    )
    try:
        wait_for(lambda: collector.collect().error is not None, "an error")
        assert "exited with status 3" in (collector.collect().error or "")
        # Up again after the restart: what the first run wrote is handed out.
        got: list[LogReading] = []

        def up() -> bool:
            payload = collector.collect().payload
            if isinstance(payload, LogReading):
                got.append(payload)
            return bool(got)

        wait_for(up, "a reading")
        assert got[0].lines_total == 2
        assert [e.message for e in got[0].recent] == [OOM_LINE.format(n=5).strip()]
    finally:
        collector.close()


# --- a flood in front of an OOM ----------------------------------------------------------------

# What floods vLLM's log in practice: uvicorn's access log and the API server's INFO lines.
FLOOD = (
    'INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n',
    api("Received request chatcmpl-1: prompt: 'hi'", "logger.py:39", "INFO") + "\n",
    "(EngineCore_DP0 pid=4120) INFO 11-22 00:07:30 [loggers.py:123] Engine 000: throughput\n",
)
FLOOD_LINES = 1_000_000


def test_lines_that_cannot_be_evidence_are_skipped_before_any_regex() -> None:
    counter = EventCounter(16)
    for line in FLOOD:
        counter.feed(line.rstrip("\n"), 1000.0)
    counter.feed("… " + ENGINE + OOM_21, 1000.0)  # continues a cut line: text
    counter.feed(WORKER + OOM_21, 1000.0)
    reading = counter.take()
    assert (reading.lines_total, reading.lines_skipped) == (5, 4)
    assert [e.kind for e in reading.recent] == [K.CUDA_OOM]


def test_a_file_backlog_is_read_in_bounded_slices(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    follower = FileFollower(log, max_line_bytes=1024)
    with log.open("a") as f:
        for i in range(FLOOD_LINES // 10):
            f.write(FLOOD[i % 3])
        f.write(WORKER + OOM_21 + "\n")
    size = log.stat().st_size
    shortest = min(len(x) for x in FLOOD)
    polls, oom_at = 0, None
    while oom_at is None:
        lines = follower.poll(FILE_SLICE_BYTES)
        polls += 1
        # Bounded work and memory per slice: never more lines than fit in the slice.
        assert len(lines) <= FILE_SLICE_BYTES // shortest + 1
        if any("OutOfMemoryError" in ln for ln in lines):
            oom_at = polls
        else:  # what the source's hint reports while it catches up
            assert follower.behind and follower.backlog_bytes() > 0
        assert polls <= -(-size // FILE_SLICE_BYTES) + 1
    assert oom_at >= 2  # the file was larger than a slice: it took several
    follower.close()


def test_an_oom_behind_a_million_line_flood_reaches_a_tick(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    collector = LogsCollector(
        ServiceConfig(name="a", log_file=str(log)), LogsSourceConfig(), FakeClock()
    )
    g = Gathered(collector)
    try:
        with log.open("a") as f:
            f.writelines(FLOOD[i % 3] for i in range(FLOOD_LINES))
            f.write(WORKER + OOM_21 + "\n")
        wait_for(g.has(1), "the OOM", timeout_seconds=120, seen=lambda: g.reading)
        assert [k for k, _ in g.events] == [K.CUDA_OOM]
        assert g.reading is not None
        assert g.reading.lines_total == FLOOD_LINES + 1
        # The regex saw one line: the OOM. Every flood line was dropped by its first characters.
        assert g.reading.lines_skipped == FLOOD_LINES
    finally:
        collector.close()
