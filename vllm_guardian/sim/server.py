"""The twin's HTTP server and lifecycle: vLLM's OpenAI API on top of ``SimEngine``.

The main thread owns the lifecycle: it advances the engine to ``(now − start) × speed``
simulated seconds every few milliseconds, hands token deltas to the request handlers, writes
logs and the GPU state file, and handles SIGTERM/SIGINT. The HTTP server is one asyncio event
loop (aiohttp) on a second thread: a request is a coroutine waiting on its delta queue, not a
thread, so thousands in flight (``kv_thrash``) cost sockets rather than threads; the deltas of
one tick reach their queues in one hand-over to that loop. Like vLLM 0.32 (measured on its CPU):
the port is bound but not listening during start-up (connection refused); ``/health`` is 200,
and 503 once the engine is dead, after which the watchdog exits the process within 5 simulated
seconds (status ``--sim-exit-code``, 0 by default as in vLLM; ``--sim-exit-hold-file`` holds
that exit until its file exists, so a test can look at the dead engine); on SIGTERM with
``--shutdown-timeout N`` in-flight requests run for up to N simulated seconds while new ones
get HTTP 500 and ``/health`` stays 200; with 0 they end at once with ``finish_reason: abort``.
Requests still running when a drain times out are cut without ``[DONE]`` (vLLM leaves them
hanging until the client gives up; the twin closes them so it can exit).

The scenario's clock: with ``--sim-epoch`` or a ``--sim-timeline-file`` that holds an epoch,
the engine is told where the scenario's zero lies on its own clock, so one-off faults keep their
place across restarts; the main loop appends every new fault to the timeline file. The
twin-only ``GET /sim/clock`` answers the simulated time and a few counters, so tests can wait on
simulated rather than wall time.
"""

from __future__ import annotations

import asyncio
import enum
import faulthandler
import http
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
import zlib
from types import FrameType
from typing import Any

from aiohttp import web
from prometheus_client.core import Metric

from vllm_guardian.formats import allocator_format as fmt
from vllm_guardian.formats.gpu_state_format import StateDevice, StateProcess, StateXid, build_state
from vllm_guardian.lowio.atomicfile import write_atomic
from vllm_guardian.sim.engine import (
    ENGINE_DEAD_MESSAGE,
    VLLM_VERSION,
    EnginePhase,
    LogEvent,
    Proc,
    RequestDelta,
    SimEngine,
)
from vllm_guardian.sim.exposition import (
    HttpStats,
    VllmView,
    cache_config_labels,
    make_registry,
    render_metrics,
    vllm_families,
)
from vllm_guardian.sim.flags import ServeOptions
from vllm_guardian.sim.gpu_state import (
    read_previous_xids,
    write_state_atomically,
)
from vllm_guardian.sim.scenarios import FaultKind
from vllm_guardian.sim.scheduler import FinishReason
from vllm_guardian.sim.timeline import FaultEntry, Timeline, read_timeline, write_timeline
from vllm_guardian.sim.vllm_log import LogWriter

TICK_SECONDS = 0.005
SHUTDOWN_MESSAGE = "cannot schedule new futures after shutdown"
# Tokens the chat template adds: per message, and once for the assistant turn.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_PROMPT = 2
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Deltas that end a stream without [DONE] (a drain that timed out).
_CUT = RequestDelta("", 0, None, "cut")
ROUTES = (
    ("/health", "GET"),
    ("/load", "GET"),
    ("/metrics", "GET"),
    ("/ping", "GET"),
    ("/ping", "POST"),
    ("/version", "GET"),
    ("/v1/models", "GET"),
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
)


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {"message": message, "type": err_type, "param": param, "code": status}
        }


# vllm/exceptions.py QueueOverflowError (0.32): the 503 of --max-num-queued-reqs.
QUEUE_FULL_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)


def too_long_error(max_model_len: int, prompt_tokens: int) -> ApiError:
    value = min(prompt_tokens, max_model_len + 1)
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains at least {value} input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={value})",
        "BadRequestError",
        "input_tokens",
    )


# The twin's vocabulary: a word's id is a hash of it above the special ids; a list-of-ids prompt
# is its ids as they are, so a continuation's prompt (the prompt's ids, then the generated ids)
# is the same sequence the first request saw, and shares its prefix-cache blocks.
VOCAB_SIZE = 32_000
SPECIAL_IDS = 256
CHAT_MESSAGE_ID = 3  # the chat template's per-message tokens
CHAT_ASSISTANT_ID = 4  # the assistant turn's tokens (the generation prompt)
GENERATED_TOKEN_ID = 5674  # every generated token: its text is _TOKEN_TEXT


def word_id(word: str) -> int:
    return SPECIAL_IDS + zlib.crc32(word.encode()) % (VOCAB_SIZE - SPECIAL_IDS)


def _chat_prompt_ids(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "BadRequestError", "messages")
    # vLLM's ChatCompletionRequest validator, with its message.
    cont = bool(body.get("continue_final_message"))
    if cont and body.get("add_generation_prompt", True):
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "BadRequestError",
        )
    ids: list[int] = []
    for i, m in enumerate(messages):
        content = m.get("content", "") if isinstance(m, dict) else ""
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if cont and i == len(messages) - 1:
            # The final message left open: its header is the generation prompt and nothing
            # ends it, so the prompt is the uncut one's followed by the message's ids.
            ids.extend([CHAT_ASSISTANT_ID] * CHAT_TOKENS_PER_PROMPT)
        else:
            ids.extend([CHAT_MESSAGE_ID] * CHAT_TOKENS_PER_MESSAGE)
        ids.extend(_text_ids(str(content or "")))
    if body.get("add_generation_prompt", True):
        ids.extend([CHAT_ASSISTANT_ID] * CHAT_TOKENS_PER_PROMPT)
    return ids


def _text_ids(text: str) -> list[int]:
    # The generated text (" tok" per token) reads back as the generated ids, so a chat
    # continuation through a partial assistant message sees the ids it generated.
    return [GENERATED_TOKEN_ID if w == _TOKEN_TEXT.strip() else word_id(w) for w in text.split()]


def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    """The twin's tokenizer: one token per whitespace-separated word (a word's id is
    :func:`word_id`); a prompt given as ids is taken as it is, as vLLM takes it."""
    if chat:
        return _chat_prompt_ids(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_ids(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return list(prompt)
    raise ApiError(
        400, "prompt must be a string or a list of token ids", "BadRequestError", "prompt"
    )


class Twin:
    """One simulated ``vllm serve`` process."""

    def __init__(self, opts: ServeOptions, log: LogWriter) -> None:
        self.opts = opts
        self.log = log
        self.pid = os.getpid()
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        # Raises TimelineError for a file that is not a timeline (the caller reports it).
        self.epoch = opts.epoch_unix_seconds
        if self.epoch is None and opts.timeline_file is not None:
            self.epoch = read_timeline(opts.timeline_file).epoch_unix_seconds
        self.engine = SimEngine(
            opts.model,
            opts.engine,
            opts.scenario,
            opts.gpu_memory_bytes,
            opts.seed,
            scenario_zero_seconds=None
            if self.epoch is None
            else (self.epoch - self.wall0) * opts.speed,
            fault_every_seconds=opts.fault_every_seconds,
        )
        self._faults_written = 0
        # vLLM's system_fingerprint (--fingerprint-mode full, one GPU): its version and 8 hex
        # of its config's hash, here of the served model's name.
        name = opts.engine.served_model_name
        self.fingerprint = f"vllm-{VLLM_VERSION}-{zlib.crc32(name.encode()):08x}"
        self.lock = threading.Lock()
        self.lifecycle = Lifecycle.STARTING
        self.streams: dict[str, asyncio.Queue[RequestDelta]] = {}
        # The hang watchdog (--watchdog-config): the hang last dumped for, the dumps' number.
        self._watchdog_dumped: float | None = None
        self._watchdog_seq = 0
        # vllm:admission_rejections_total by reason (the API server's, like vLLM's).
        self.admission_rejections = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        # The HTTP server's event loop (its own thread): deltas reach the streams through it.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.http_stats = HttpStats(self.wall0)
        self.registry = make_registry(self._metric_families)
        self.server_load = 0
        self.ids = itertools.count()
        self.signal_received: int | None = None
        self.drain_deadline_sim: float | None = None
        self.ready_wall: float | None = None
        self.previous_xids: tuple[StateXid, ...] = ()
        if opts.gpu_state_file is not None:
            self.previous_xids = read_previous_xids(opts.gpu_state_file)
        self._last_gpu_write = -1e9
        self._last_allocator_write = -1e9
        self._last_busy = (0.0, 0.0)
        self._xids_written = 0

    # ---------------------------------------------------------------- time and ticking

    def sim_now(self) -> float:
        return (time.monotonic() - self.t0) * self.opts.speed

    def wall_of(self, sim_seconds: float) -> float:
        return self.wall0 + sim_seconds / self.opts.speed

    def tick(self) -> None:
        with self.lock:
            deltas = self.engine.advance(self.sim_now())
            logs = self.engine.take_logs() + self.watchdog_events()
            self._dispatch(deltas)
        self.log.write(logs, time.time())

    def watchdog_events(self) -> list[LogEvent]:
        """vLLM 0.33's hang watchdog (--watchdog-config): a hung engine core feeds it no more;
        once its timeout has passed it appends every thread's stack to its dump file (here the
        twin's own threads, through faulthandler as vLLM does) and logs where, at INFO, once
        per hang (vllm/utils/watch_dog.py)."""
        if self.opts.watchdog is None or self.engine.phase is not EnginePhase.HUNG:
            return []
        timeout, dump_dir = self.opts.watchdog
        hung = max(
            (f.sim_seconds for f in self.engine.faults if f.kind is FaultKind.HANG), default=None
        )
        if hung is None or hung == self._watchdog_dumped or self.engine.now - hung < timeout:
            return []
        self._watchdog_dumped = hung
        self._watchdog_seq += 1
        path = dump_dir / f"VLLM_STACK_DUMP_for_engine_0_{self.pid}.log"
        try:
            dump_dir.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(
                    f"\nCall stack dump #{self._watchdog_seq} at {time.ctime()} due to feed "
                    "timeout\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.write("\n" + "=" * 64 + "\n")
        except OSError as e:
            message = f"[Watchdog]Failed to dump stack trace to {path}: {e}"
            return [LogEvent(self.engine.now, Proc.ENGINE_CORE, "WARNING", "watch_dog.py:124",
                             message)]  # fmt: skip
        message = f"[Watchdog]Dumped stack to {path} due to feed timeout"
        return [LogEvent(self.engine.now, Proc.ENGINE_CORE, "INFO", "watch_dog.py:117", message)]

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        out: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]] = []
        for d in deltas:
            q = self.streams.get(d.request_id)
            if q is None:
                continue
            out.append((q, d))
            if d.finish_reason is not None or d.error is not None:
                del self.streams[d.request_id]
        self._deliver(out)

    def _deliver(self, items: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]) -> None:
        """Hand deltas to their streams on the server's loop: one wake-up per batch, from
        any thread (the main loop's tick, or a handler's submit on the loop itself). Without an
        HTTP server (the virtual-time tests drive the twin in one thread), they are queued at
        once."""
        if not items:
            return
        if self.loop is None:
            _put_all(items)
        else:
            self.loop.call_soon_threadsafe(_put_all, items)

    # ---------------------------------------------------------------- requests

    def submit(
        self, body: dict[str, Any], chat: bool
    ) -> tuple[str, list[int], asyncio.Queue[RequestDelta]]:
        """Validate and queue a request; returns (id, the prompt's ids, its delta queue)."""
        cfg = self.opts.engine
        if self.lifecycle in (Lifecycle.DRAINING, Lifecycle.STOPPING):
            raise ApiError(500, SHUTDOWN_MESSAGE, "InternalServerError")
        if self.engine.death is not None:
            raise ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        model = body.get("model")
        if model is not None and model != cfg.served_model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        limit = cfg.max_num_queued_reqs
        if limit is not None:
            with self.lock:
                if len(self.streams) + 1 > limit:
                    # vLLM 0.32's AsyncLLM admission check: QueueOverflowError, counted by
                    # reason in vllm:admission_rejections_total.
                    self.admission_rejections["max_num_queued_reqs"] += 1
                    raise ApiError(503, QUEUE_FULL_MESSAGE, "Service Unavailable")
        ids = prompt_ids(body, chat)
        max_tokens_raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens_raw is not None and (
            not isinstance(max_tokens_raw, int) or max_tokens_raw < 1
        ):
            raise ApiError(400, "max_tokens must be at least 1", "BadRequestError", "max_tokens")
        if max_tokens_raw is not None and max_tokens_raw > cfg.max_model_len:
            raise ApiError(
                400,
                f"max_tokens={max_tokens_raw} cannot be greater than max_model_len="
                f"{cfg.max_model_len}. Please request fewer output tokens. "
                f"(parameter=max_tokens, value={max_tokens_raw})",
                "BadRequestError",
                "max_tokens",
            )
        if len(ids) >= cfg.max_model_len:
            raise too_long_error(cfg.max_model_len, len(ids))
        room = cfg.max_model_len - len(ids)
        if max_tokens_raw is None:
            max_tokens = room if chat else DEFAULT_COMPLETION_MAX_TOKENS
        else:
            max_tokens = max_tokens_raw
        max_tokens = min(max_tokens, room)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        q: asyncio.Queue[RequestDelta] = asyncio.Queue()
        with self.lock:
            # Catch the engine up before the new request joins, and hand what those steps
            # produced to their streams: dropping these deltas lost tokens, and a finish among
            # them left its stream waiting forever (seen as hung requests behind the gate,
            # whose releases arrive just as other requests finish).
            self._dispatch(self.engine.advance(self.sim_now()))
            if self.engine.death is not None:
                raise ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
            self.streams[rid] = q
            # The engine's prefix cache hashes the prompt: its ids, as vLLM's does.
            words = [str(t) for t in ids]
            self.engine.add_request(rid, words, max_tokens, bool(body.get("ignore_eos", False)))
        return rid, ids, q

    def abort(self, rid: str) -> None:
        with self.lock:
            self.streams.pop(rid, None)
            self.engine.abort_request(rid)

    # ---------------------------------------------------------------- GPU state

    def gpu_reading(self) -> StateDevice:
        e = self.engine
        mem = e.sampled_breakdown()  # a sample catches the step in flight: activation peaks show
        processes = []
        if e.phase in (EnginePhase.READY, EnginePhase.HUNG, EnginePhase.DEAD) and mem is not None:
            own = mem.process_bytes if e.phase is not EnginePhase.DEAD else 0
            others = mem.other_processes_bytes
        else:
            own = e.startup_process_bytes() if e.phase is EnginePhase.STARTING else 0
            others = e.other_bytes(e.now)
        if own:
            processes.append(StateProcess(self.pid, own))
        nb = self.opts.scenario.neighbour
        if nb is not None and others:
            processes.append(StateProcess(nb.pid, others))
        busy, at = self._last_busy
        elapsed = e.now - at
        util = (e.busy_seconds - busy) / elapsed if elapsed > 0 else 0.0
        self._last_busy = (e.busy_seconds, e.now)
        if e.phase is EnginePhase.HUNG:
            util = 1.0  # a hung kernel keeps the SMs busy
        xids = (
            *self.previous_xids,
            *(
                StateXid(len(self.previous_xids) + x.seq, x.xid, self.wall_of(x.sim_seconds))
                for x in e.xid_events
            ),
        )
        return StateDevice(e.gpu_total_bytes, tuple(processes), util, xids)

    # ---------------------------------------------------------------- the run's timeline

    def write_timeline(self) -> None:
        """Record the epoch (once known) and the faults this process met since the last call."""
        path = self.opts.timeline_file
        zero = self.engine.scenario_zero
        if path is None or zero is None:
            return
        new = self.engine.faults[self._faults_written :]
        current = read_timeline(path)
        if current.epoch_unix_seconds is not None and not new:
            return
        epoch = current.epoch_unix_seconds
        if epoch is None:
            epoch = self.epoch if self.epoch is not None else self.wall_of(zero)
        added = tuple(FaultEntry(f.kind.value, self.wall_of(f.sim_seconds), self.pid) for f in new)
        write_timeline(path, Timeline(epoch, (*current.faults, *added)))
        self._faults_written += len(new)

    def clock_view(self) -> dict[str, Any]:
        """``GET /sim/clock``: the simulated time and counters (twin-only)."""
        with self.lock:
            e = self.engine
            return {
                "sim_seconds": e.now,
                "scenario_seconds": e.scenario_seconds,
                "speed": self.opts.speed,
                "phase": e.phase.value,
                "requests_finished": sum(e.stats.request_success.values()),
                "faults": [
                    {
                        "kind": f.kind.value,
                        "scenario_seconds": f.sim_seconds - (e.scenario_zero or 0.0),
                    }
                    for f in e.faults
                ],
            }

    def write_gpu_state(self, force: bool = False, process_gone: bool = False) -> None:
        path = self.opts.gpu_state_file
        if path is None:
            return
        now = time.monotonic()
        new_xid = len(self.engine.xid_events) != self._xids_written
        if (
            not force
            and not new_xid
            and now - self._last_gpu_write < self.opts.gpu_state_interval_seconds
        ):
            return
        with self.lock:
            reading = self.gpu_reading()
            self._xids_written = len(self.engine.xid_events)
        if process_gone:
            reading = StateDevice(
                reading.total_bytes,
                tuple(p for p in reading.processes if p.pid != self.pid),
                0.0,
                reading.xid_events,
            )
        write_state_atomically(path, build_state(reading, time.time()))
        self._last_gpu_write = now

    def write_allocator_stats(self) -> None:
        """Publish the engine's allocator stats as the in-vLLM plugin does (allocator_format).

        Like the plugin, nothing removes the file when the process ends: the guardian's source
        drops files of dead pids.
        """
        out = self.opts.allocator_dir
        if out is None:
            return
        path = out / fmt.file_name(self.pid, 0)
        interval = self.opts.allocator_interval_seconds or self.opts.gpu_state_interval_seconds
        now = time.monotonic()
        if now - self._last_allocator_write < interval:
            return
        with self.lock:
            if self.engine.phase is EnginePhase.DEAD:
                return  # a dead process publishes nothing more; its last file goes stale
            rec = self.engine.allocator_stats(self.pid, time.time(), interval, self.opts.alloc_conf)
        if rec is None:
            return
        write_atomic(path, fmt.encode(rec), 0o644)
        self._last_allocator_write = now

    # ---------------------------------------------------------------- metrics

    def metrics_text(self) -> str:
        return render_metrics(self.registry)

    def _metric_families(self) -> list[Metric]:
        """``vllm:*`` and ``http_*`` for a scrape (the registry's collector calls it), read under
        the lock the engine and the HTTP handlers update them under."""
        with self.lock:
            view = None
            e = self.engine
            if not self.opts.disable_log_stats and e.plan is not None:
                st = e.stats
                view = VllmView(
                    model_name=self.opts.engine.served_model_name,
                    running=st.num_requests_running,
                    waiting=st.num_requests_waiting,
                    kv_cache_usage_ratio=st.kv_cache_usage_ratio,
                    counters={
                        "prefix_cache_queries": st.prefix_cache_queries,
                        "prefix_cache_hits": st.prefix_cache_hits,
                        "num_preemptions": st.num_preemptions,
                        "prompt_tokens": st.prompt_tokens,
                        "prompt_tokens_local_compute": st.prompt_tokens_local_compute,
                        "prompt_tokens_local_cache_hit": st.prompt_tokens_local_cache_hit,
                        "generation_tokens": st.generation_tokens,
                    },
                    request_success=dict(st.request_success),
                    admission_rejections=dict(self.admission_rejections),
                    histograms=st.histograms,
                    cache_labels=cache_config_labels(
                        self.opts.engine,
                        e.plan,
                        any(k == "block_size" for k, _ in self.opts.non_default_args),
                    ),
                    created_unix_seconds=self.ready_wall or self.wall0,
                    sleep_level=e.sleep_level,
                )
            return [*(vllm_families(view) if view is not None else []), *self.http_stats.families()]

    # ---------------------------------------------------------------- lifecycle

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_received = signum

    def run(self) -> int:
        opts = self.opts
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        host = opts.host if opts.host is not None else "0.0.0.0"  # noqa: S104 (vLLM's default)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server: _Server | None = None
        self.log.info(
            Proc.API_SERVER,
            "api_utils.py:286",
            f"non-default args: {dict(opts.non_default_args)}",
            time.time(),
        )
        try:
            # Bound but not listening: connections are refused until the engine is ready.
            sock.bind((host, opts.port))
            while True:
                self.tick()
                e = self.engine
                if len(e.faults) != self._faults_written:
                    self.write_timeline()
                if e.phase is EnginePhase.FAILED_STARTUP:
                    self.write_gpu_state(force=True, process_gone=True)
                    return 1
                if self.lifecycle is Lifecycle.STARTING and e.phase is not EnginePhase.STARTING:
                    server = self._start_serving(sock)
                if self.signal_received is not None:
                    code = self._shutdown()
                    if code is not None:
                        return code
                if e.exit_due() and self._exit_released():
                    self._watchdog_exit()
                    forced = opts.scenario.forced_exit_code
                    return forced if forced is not None else opts.exit_code
                self.write_gpu_state()
                self.write_allocator_stats()
                time.sleep(TICK_SECONDS)
        finally:
            self.lifecycle = Lifecycle.STOPPING
            if server is not None:
                server.stop()
            sock.close()
            if (
                opts.gpu_state_file is not None
                and self.engine.phase is not EnginePhase.FAILED_STARTUP
            ):
                self.write_gpu_state(force=True, process_gone=True)

    def _exit_released(self) -> bool:
        """The watchdog's exit may go ahead: no ``--sim-exit-hold-file``, or it exists."""
        hold = self.opts.exit_hold_file
        return hold is None or hold.exists()

    def _start_serving(self, sock: socket.socket) -> _Server:
        now = time.time()
        host, port = sock.getsockname()[:2]
        self.log.info(
            Proc.API_SERVER, "entry.py:140", f"Starting vLLM server on http://{host!s}:{port}", now
        )
        self.log.info(Proc.API_SERVER, "launcher.py:186", "Available routes are:", now)
        for path, method in ROUTES:
            self.log.info(
                Proc.API_SERVER, "launcher.py:195", f"Route: {path}, Methods: {method}", now
            )
        server = _Server(self, sock)
        self.log.raw(f"INFO:     Started server process [{self.pid}]")
        self.log.raw("INFO:     Waiting for application startup.")
        self.log.raw("INFO:     Application startup complete.")
        self.lifecycle = Lifecycle.SERVING
        self.ready_wall = now
        self.write_gpu_state(force=True)
        self.write_timeline()
        return server

    def _shutdown(self) -> int | None:
        """Handle SIGTERM/SIGINT; returns the exit status once the drain is over."""
        now = time.time()
        timeout = self.opts.shutdown_timeout_seconds
        mode = "drain" if timeout > 0 else "abort"
        if self.lifecycle is Lifecycle.STARTING:
            return 0
        if self.lifecycle is Lifecycle.SERVING:
            self.lifecycle = Lifecycle.DRAINING
            self.log.info(
                Proc.API_SERVER, "launcher.py:254", "[shutdown] API server: shutdown triggered", now
            )
            self.log.info(
                Proc.API_SERVER,
                "launcher.py:270",
                f"[shutdown] API server: stopping engine client mode={mode} timeout={timeout}s",
                now,
            )
            self.log.info(
                Proc.ENGINE_CORE,
                "core.py:1454",
                "[shutdown] EngineCore: trigger received signal=SIGTERM",
                now,
            )
            self.log.info(
                Proc.ENGINE_CORE,
                "core.py:1635",
                f"[shutdown] EngineCore: start mode={mode} timeout={timeout}s",
                now,
            )
            with self.lock:
                n = self.engine.num_unfinished
                self.drain_deadline_sim = self.engine.now + timeout
                if timeout == 0:
                    self.log.info(
                        Proc.ENGINE_CORE,
                        "core.py:1644",
                        f"[shutdown] EngineCore: aborting in-flight requests count={n}",
                        now,
                    )
                    self._dispatch(self.engine.abort_all())
                else:
                    self.log.info(
                        Proc.ENGINE_CORE,
                        "core.py:1655",
                        f"[shutdown] EngineCore: draining in-flight requests count={n} timeout={timeout}s",
                        now,
                    )
        with self.lock:
            unfinished = self.engine.num_unfinished
            timed_out = (
                self.drain_deadline_sim is not None and self.engine.now >= self.drain_deadline_sim
            )
            if unfinished and timed_out:
                self._deliver([(self.streams.pop(rid), _CUT) for rid in list(self.streams)])
                self.log.warning(
                    Proc.API_SERVER,
                    "utils.py:648",
                    "[shutdown] Process manager: force killing remaining processes count=1",
                    now,
                )
            elif unfinished and self.engine.death is None:
                return None
        self._wait_for_streams()
        self.log.info(
            Proc.ENGINE_CORE,
            "core.py:1666",
            "[shutdown] EngineCore: request processing complete; starting resource teardown",
            now,
        )
        self.log.info(
            Proc.API_SERVER,
            "launcher.py:304",
            "[shutdown] API server: shutting down FastAPI HTTP server",
            now,
        )
        self.log.raw("INFO:     Shutting down")
        self.log.raw("INFO:     Waiting for application shutdown.")
        self.log.raw("INFO:     Application shutdown complete.")
        self.log.raw(f"INFO:     Finished server process [{self.pid}]")
        return 0

    def _wait_for_streams(self, limit_seconds: float = 2.0) -> None:
        """Give request handlers a moment to write their last chunk before the process ends."""
        deadline = time.monotonic() + limit_seconds
        while time.monotonic() < deadline:
            with self.lock:
                if self.server_load == 0:
                    return
            time.sleep(0.01)

    def _watchdog_exit(self) -> None:
        now = time.time()
        self.log.info(
            Proc.API_SERVER, "launcher.py:254", "[shutdown] API server: shutdown triggered", now
        )
        self._wait_for_streams()
        self.log.raw("INFO:     Shutting down")
        self.log.raw("INFO:     Waiting for application shutdown.")
        self.log.raw("INFO:     Application shutdown complete.")
        self.log.raw(f"INFO:     Finished server process [{self.pid}]")


# -------------------------------------------------------------------- the HTTP server


def _put_all(items: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]) -> None:
    for q, d in items:
        q.put_nowait(d)


class _Cut(Exception):
    """The answer ends here with the connection closed: no terminating chunk, no [DONE]."""


class _Server:
    """The twin's HTTP server: one asyncio event loop (aiohttp) on its own thread, listening on
    the socket ``run`` bound, each connection a coroutine rather than a thread (thousands of
    requests in flight cost sockets, not threads). Handlers wait on their delta queues; the
    engine keeps ticking on the main thread."""

    def __init__(self, twin: Twin, sock: socket.socket) -> None:
        self.twin = twin
        self.loop = asyncio.new_event_loop()
        twin.loop = self.loop
        # aiohttp's own logging (a handler's traceback) must not reach the twin's vLLM log,
        # which the guardian reads.
        aiohttp_log = logging.getLogger("aiohttp")
        aiohttp_log.addHandler(logging.NullHandler())
        aiohttp_log.propagate = False
        app = web.Application(client_max_size=1 << 30)
        handler = _Handler(twin)
        app.router.add_route("*", "/{tail:.*}", handler.handle)
        # uvicorn writes its access line when the response starts, not when it ends: a twin
        # that exits right after a drain's last answer must not lose that answer's line (a
        # test counts vLLM's POST lines against the answers its clients got).
        app.on_response_prepare.append(handler.access)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        # uvicorn listens with a backlog of 2048; a small backlog refuses a burst of
        # connections that vLLM would accept, which made load tests fail where vLLM would not.
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, sock, backlog=2048).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop serving; requests still open end with the process (its exit closes them)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class _Handler:
    """Every route, as vLLM 0.32's API server answers it (bodies, status codes, headers)."""

    def __init__(self, twin: Twin) -> None:
        self.twin = twin

    async def access(self, request: web.Request, response: web.StreamResponse) -> None:
        """The access line, in uvicorn's format, as the response's status line goes out."""
        status = response.status
        phrase = _PHRASES.get(status, "")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        host, port = (peer[0], peer[1]) if peer else ("-", 0)
        self.twin.log.raw(
            f'INFO:     {host}:{port} - "{request.method} {request.raw_path} HTTP/1.1" '
            f"{status} {phrase}"
        )

    def _observe(
        self, request: web.Request, status: int, req_bytes: int, resp_bytes: int, start: float
    ) -> None:
        path = request.raw_path.split("?")[0]
        with self.twin.lock:
            self.twin.http_stats.observe(
                path,
                request.method,
                status,
                req_bytes,
                resp_bytes,
                time.monotonic() - start,
                time.time(),
            )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return self._get(request)
        if request.method == "POST":
            return await self._post(request)
        # Another method on any route: vLLM's router (FastAPI) answers 405.
        return _send(405, json.dumps({"detail": "Method Not Allowed"}).encode())

    def _get(self, request: web.Request) -> web.Response:
        start = time.monotonic()
        path = request.raw_path.split("?")[0]
        twin = self.twin
        if path in ("/health", "/ping"):
            status = 503 if twin.engine.death is not None else 200
            resp = _send(status, b"")
        elif path in ("/metrics", "/metrics/"):
            status = 200
            resp = _send(
                200, twin.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8"
            )
        elif path == "/is_paused" and twin.opts.dev_mode:
            status, resp = 200, _json(200, {"is_paused": twin.engine.paused})
        elif path == "/version":
            status, resp = 200, _json(200, {"version": VLLM_VERSION})
        elif path == "/sim/clock":
            status, resp = 200, _json(200, twin.clock_view())
        elif path == "/load":
            status, resp = (
                200,
                _json(
                    200,
                    {
                        "server_load": twin.server_load
                        if twin.opts.enable_server_load_tracking
                        else 0
                    },
                ),
            )
        elif path == "/v1/models":
            cfg = twin.opts.engine
            card = {
                "id": cfg.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "vllm", "root": cfg.model_path, "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": int(time.time()), "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}],
            }  # fmt: skip
            status, resp = 200, _json(200, {"object": "list", "data": [card]})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            status, resp = 405, _json(405, {"detail": "Method Not Allowed"})
        else:
            status, resp = 404, _json(404, {"detail": "Not Found"})
        self._observe(request, status, 0, _length(resp), start)
        return resp

    async def _post(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        path = request.raw_path.split("?")[0]
        raw = await request.read()
        length = len(raw)
        if path == "/ping":
            status = 503 if self.twin.engine.death is not None else 200
            self._observe(request, status, length, 0, start)
            return _send(status, b"")
        if path in ("/pause", "/resume", "/sleep", "/wake_up") and self.twin.opts.dev_mode:
            # vLLM's (VLLM_SERVER_DEV_MODE=1): mode=keep's freeze for any mode (no abort here).
            with self.twin.lock:
                e = self.twin.engine
                if path == "/pause":
                    e.pause()
                elif path == "/resume":
                    e.resume()
                elif path == "/sleep":
                    e.sleep(int(request.query.get("level", "1")))
                else:
                    e.wake_up()
            said = {"/pause": "paused", "/resume": "resumed", "/sleep": "sleeping"}
            resp = _json(200, {"status": said.get(path, "awake")})
            self._observe(request, 200, length, _length(resp), start)
            return resp
        if path not in ("/v1/completions", "/v1/chat/completions"):
            status = (
                405 if path in ("/health", "/metrics", "/version", "/load", "/v1/models") else 404
            )
            detail = "Method Not Allowed" if status == 405 else "Not Found"
            resp = _json(status, {"detail": detail})
            self._observe(request, status, length, _length(resp), start)
            return resp
        chat = path == "/v1/chat/completions"
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object", "BadRequestError")
            rid, prompt, q = self.twin.submit(body, chat)
        except json.JSONDecodeError as exc:
            err = ApiError(400, f"invalid JSON: {exc}", "BadRequestError")
            resp = _json(400, err.body)
            self._observe(request, 400, length, _length(resp), start)
            return resp
        except ApiError as err:
            resp = _json(err.status, err.body)
            self._observe(request, err.status, length, _length(resp), start)
            return resp
        with self.twin.lock:
            self.twin.server_load += 1
        try:
            if body.get("stream"):
                sresp, n = await self._stream(request, rid, prompt, q, chat, body)
                self._observe(request, 200, length, n, start)
                return sresp
            resp = await self._unary(rid, prompt, q, chat, body.get("return_token_ids") is True)
            await resp.prepare(request)
            await resp.write_eof()
            self._observe(request, resp.status, length, _length(resp), start)
            return resp
        except _Cut:
            # A drain that timed out: the connection just ends (no status line for a unary
            # answer, no terminating chunk and no [DONE] for a stream).
            if request.transport is not None:
                request.transport.abort()
            raise
        except ConnectionError:  # the client went away
            self.twin.abort(rid)
            raise
        finally:
            with self.twin.lock:
                self.twin.server_load -= 1

    # ------------------------------------------------------------ generation

    async def _next(self, q: asyncio.Queue[RequestDelta]) -> RequestDelta:
        # No polling: a drain that timed out delivers _CUT, and once the main loop stops the
        # event loop stops with it (the process is ending; its exit closes what is still open).
        d = await q.get()
        if d is _CUT:
            raise _Cut
        return d

    async def _unary(
        self,
        rid: str,
        prompt: list[int],
        q: asyncio.Queue[RequestDelta],
        chat: bool,
        with_ids: bool,
    ) -> web.Response:
        tokens = 0
        while True:
            d = await self._next(q)
            if d.error is not None:
                err = ApiError(500, d.error, "InternalServerError")
                return _json(500, err.body)
            tokens += d.new_tokens
            if d.finish_reason is not None:
                break
        text = _text(tokens)
        finish = d.finish_reason.value
        prompt_tokens = len(prompt)
        out_ids = [GENERATED_TOKEN_ID] * tokens if with_ids else None
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                 "completion_tokens": tokens, "prompt_tokens_details": None}  # fmt: skip
        model = self.twin.opts.engine.served_model_name
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": finish, "stop_reason": None,
                "token_ids": out_ids,
            }  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None,
                      "prompt_token_ids": prompt if with_ids else None,
                      "token_ids": out_ids}  # fmt: skip
            obj = "text_completion"
        answer = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                  "choices": [choice], "usage": usage,
                  "system_fingerprint": self.twin.fingerprint,
                  "kv_transfer_params": None}  # fmt: skip
        if chat:  # vLLM puts the prompt's ids beside the choices for chat
            answer["prompt_token_ids"] = prompt if with_ids else None
        return _json(200, answer)

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        prompt: list[int],
        q: asyncio.Queue[RequestDelta],
        chat: bool,
        body: dict[str, Any],
    ) -> tuple[web.StreamResponse, int]:
        """vLLM's stream: one event per token, shaped as vLLM 0.32 serialises its chunks. With
        ``return_token_ids`` the prompt's ids ride on the first chunk (beside the choices for
        chat, in the choice for completions) and each chunk's generated ids in its choice's
        ``token_ids``; without it both are ``null``."""
        resp = web.StreamResponse(
            status=200,
            headers={"content-type": "text/event-stream; charset=utf-8", "server": "uvicorn"},
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        model = self.twin.opts.engine.served_model_name
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = 0
        tokens = 0

        async def event(payload: object) -> None:
            nonlocal sent
            # pydantic's model_dump_json, as vLLM serialises a chunk: compact, UTF-8.
            text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            data = f"data: {text}\n\n".encode()
            await resp.write(data)  # one chunk per event, as uvicorn sends them
            sent += len(data)

        with_ids = body.get("return_token_ids") is True
        prompt_pending = with_ids  # the prompt's ids go out once, on the first chunk
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        fingerprint = self.twin.fingerprint

        def chunk(text: str | None, finish: str | None, new_ids: int = 0) -> dict[str, Any]:
            nonlocal prompt_pending
            ids = [GENERATED_TOKEN_ID] * new_ids if with_ids else None
            first_ids = prompt if prompt_pending else None
            prompt_pending = False
            if chat:
                if text is None:  # the role chunk: the prompt's ids beside the choices
                    c: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}  # fmt: skip
                    return {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [c], "prompt_token_ids": first_ids,
                            "prompt_text": None}  # fmt: skip
                c = {"index": 0, "delta": {"content": text}, "logprobs": None,
                     "finish_reason": finish}  # fmt: skip
                if finish is not None:
                    c["stop_reason"] = None
                c["token_ids"] = ids
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish,
                     "stop_reason": None, "prompt_token_ids": first_ids,
                     "token_ids": ids}  # fmt: skip
            out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
            if finish is not None and not include_usage:  # vLLM stamps the last chunk only
                out["system_fingerprint"] = fingerprint
            return out

        if chat:
            await event(chunk(None, None))
        while True:
            d = await self._next(q)
            if d.error is not None:
                await event(
                    {
                        "error": {
                            "message": d.error,
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    }
                )
                break
            for i in range(d.new_tokens):
                last = i == d.new_tokens - 1
                finish = d.finish_reason.value if (last and d.finish_reason is not None) else None
                await event(chunk(_TOKEN_TEXT, finish, 1))
            tokens += d.new_tokens
            if d.finish_reason is not None:
                if d.new_tokens == 0:
                    await event(chunk("", d.finish_reason.value))
                break
        if include_usage:
            await event({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": {"prompt_tokens": len(prompt),
                                   "total_tokens": len(prompt) + tokens,
                                   "completion_tokens": tokens},
                         "system_fingerprint": fingerprint})  # fmt: skip
        data = b"data: [DONE]\n\n"
        await resp.write(data)
        await resp.write_eof()
        return resp, sent + len(data)


_PHRASES = {s.value: s.phrase for s in http.HTTPStatus}


def _send(status: int, body: bytes, content_type: str = "application/json") -> web.Response:
    return web.Response(
        status=status, body=body, headers={"content-type": content_type, "server": "uvicorn"}
    )


def _json(status: int, obj: object) -> web.Response:
    return _send(status, json.dumps(obj).encode())


def _length(resp: web.Response) -> int:
    return len(resp.body) if isinstance(resp.body, bytes) else 0


_TOKEN_TEXT = " tok"  # noqa: S105 (generated text, not a secret)


def _text(tokens: int) -> str:
    return _TOKEN_TEXT * tokens


__all__ = ["FinishReason", "Twin"]
