"""Helpers for the `vllm` tier: where the real vLLM is, how to launch it, clients, clean-up.

Everything here runs in the test process (the daemon's .venv); vLLM itself runs from the venv
``scripts/vllm-setup`` builds outside the repository (the recipe is its comments).

Process hygiene: every vLLM process a test starts carries ``VLLM_GUARDIAN_TIER_RUN=<run id>`` in
its environment, and every vLLM is a session leader (the test's Popen and the guardian's process
manager both start a new session). EngineCore and its Worker rename themselves, which hides the
marker in /proc/<pid>/environ, but they stay in vLLM's session, also when the Worker is
reparented to PID 1 after EngineCore dies: a :class:`Census` records the sessions of marked
processes while the run lasts, so :func:`sweep` finds and kills all of them, whichever
supervisor started them, and :func:`leftovers` proves none is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import requests

VERSION = "0.32.0"
CACHE = Path(os.environ.get("VLLM_GUARDIAN_CI_CACHE", "/var/cache/vllm-guardian-ci"))
VENV = Path(os.environ.get("VLLM_GUARDIAN_VLLM_VENV", str(CACHE / f"vllm-{VERSION}")))
MODEL_NAME = "tiny-llama"
# How often a wait polls a real vLLM (its /health, the guardian beside it): a check costs a
# request to a server whose timings the tests measure.
POLL_SECONDS = 0.5
MARKER = "VLLM_GUARDIAN_TIER_RUN"
# Its sitecustomize asks Linux for the AMX tile state in every vLLM process the tier starts.
AMX_SITE = Path(__file__).resolve().parent / "amx"
# The test-only fault plugin (a vLLM general plugin found through its dist-info on the path).
FAULTS_SITE = Path(__file__).resolve().parent / "faults"
HERE = Path(__file__).parent


def vllm_venv_or_skip() -> Path:
    """The vLLM venv; a skip saying how to get it, or a failure where CI requires it."""
    ok = (VENV / ".vllm-guardian-complete").is_file() and (VENV / "bin" / "vllm").is_file()
    if not ok:
        why = (
            f"no vLLM {VERSION} venv at {VENV}: run scripts/vllm-setup (about 2-3 minutes, "
            "2.5 GB) or set VLLM_GUARDIAN_VLLM_VENV"
        )
        if os.environ.get("VLLM_GUARDIAN_REQUIRE_VLLM"):
            pytest.fail(f"{why} (VLLM_GUARDIAN_REQUIRE_VLLM is set)")
        pytest.skip(why)
    return VENV


def build_model(venv: Path, out: Path) -> float:
    """Build the tiny model with the vLLM venv's Python; returns the seconds it took."""
    start = time.monotonic()
    subprocess.run(
        [str(venv / "bin" / "python"), str(HERE / "tinymodel.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return time.monotonic() - start


def host_lock() -> IO[str]:
    """An exclusive lock on this host's vLLM tier (released when the file is closed)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    fh = (CACHE / "vllm-tier.lock").open("w")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return fh


def logging_config(path: Path) -> Path:
    """vLLM's own logging set-up plus a route for the ``vllm_guardian`` logger.

    vLLM configures only its ``vllm`` logger; the allocator plugin logs to ``vllm_guardian.plugin``,
    which has no handler inside vLLM, so its INFO lines would be dropped (Python's last-resort
    handler prints WARNING and above only). This file (``VLLM_LOGGING_CONFIG_PATH``) keeps vLLM's
    format and sends both loggers to the same stream.
    """
    fmt = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    cfg = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": fmt,
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            "vllm_guardian": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        },
    }
    path.write_text(json.dumps(cfg, indent=2))
    return path


# A Unix socket's path is at most 107 bytes (sun_path); vLLM names each of its ZMQ IPC sockets
# "<VLLM_RPC_BASE_PATH>/<uuid4>", 37 more.
SOCKET_PATH_MAX = 107


def rpc_dir(workdir: Path) -> Path:
    """Where a vLLM of the tier puts its ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``): the test's
    own directory, so the sockets of a vLLM that was killed go with it. vLLM's default is the
    temporary directory, where every killed one left its sockets (~70 a tier run; 1,800 had
    collected on one host). A directory too deep for vLLM's socket names gets a short one."""
    d = workdir / "rpc"
    if len(os.fsencode(d)) + 37 > SOCKET_PATH_MAX:
        d = Path(tempfile.mkdtemp(prefix="vg-rpc-"))
    d.mkdir(exist_ok=True)
    return d


def vllm_env(run_id: str, workdir: Path, faults: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every vLLM the tier starts; ``faults`` arms the test-only fault plugin
    (faults/vllm_guardian_faults.py: its variables), which is on the path only then."""
    env = {
        MARKER: run_id,
        "VLLM_HOST_IP": "127.0.0.1",  # else the internal ZMQ queue binds the machine's address
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; --num-gpu-blocks-override shrinks it further
        "VLLM_CPU_OMP_THREADS_BIND": "auto",  # 2 cores: inference on one, the API server on the other
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # A warm cache saves ~10 s per start; it lives beside the venv, not in the repository.
        "VLLM_CACHE_ROOT": str(CACHE / f"vllm-{VERSION}-cache"),
        "PYTHONUNBUFFERED": "1",  # the guardian's log source must see lines as they happen
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config(workdir / "vllm-logging.json")),
        "VLLM_GUARDIAN_ALLOCATOR_DIR": str(workdir / "allocator"),
        "VLLM_RPC_BASE_PATH": str(rpc_dir(workdir)),
        # Each process asks for the AMX tile state before vLLM's bf16 attention kernel runs a
        # tile instruction; without it, on an AMX CPU, the worker dies of SIGILL (amx/sitecustomize.py).
        "PYTHONPATH": str(AMX_SITE),
    }
    if faults:
        env["PYTHONPATH"] = os.pathsep.join((str(AMX_SITE), str(FAULTS_SITE)))
        env.update(faults)
    return env


def serve_command(
    venv: Path, model: Path, port: int, env: dict[str, str], extra: Sequence[str] = ()
) -> list[str]:
    """``env K=V ... vllm serve``: env(1) execs, so the pid the supervisor holds is vLLM's."""
    return [
        "/usr/bin/env",
        *(f"{k}={v}" for k, v in sorted(env.items())),
        str(venv / "bin" / "vllm"),
        "serve",
        str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", MODEL_NAME,
        "--dtype", "bfloat16",
        "--enforce-eager",
        *extra,
    ]  # fmt: skip


# --- processes -----------------------------------------------------------------------------


def _environ_has(pid: str, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _state(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def session_id_of(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])


def marked(run_id: str) -> list[int]:
    """Live (not zombie) processes whose /proc/<pid>/environ shows this run's marker.

    Not every process of the run: vLLM renames EngineCore and its Worker (setproctitle), and the
    rename overwrites the memory /proc/<pid>/environ reads, so the marker vanishes from them
    while they run. :class:`Census` finds those through their session.
    """
    needle = f"{MARKER}={run_id}".encode()
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _environ_has(p, needle) and _state(p) not in ("Z", "X", "?")
    ]


class Census:
    """Every process of one run, the renamed ones included, as long as the run lasts.

    Every vLLM the tier starts (directly, or through the guardian's process manager) is a
    session leader carrying the marker, and EngineCore and its Worker stay in its session, also
    after they lose the marker to their rename and after a dead parent leaves them to PID 1. The
    census records, twice a second, the session of every marked process that leads one; a
    member of the run is then any live process that is marked or in one of those sessions.
    Never the test process's own session: a CI rehearsal lost its runner (scripts/test, and
    .ci/run above it) when a marked helper inside pytest's session made that session a target.
    """

    def __init__(self, run_id: str, every_seconds: float = 0.5) -> None:
        self.run_id = run_id
        self.sessions: set[int] = set()
        self._every = every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm-census", daemon=True)

    def start(self) -> Census:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Census:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def look(self) -> None:
        # Only the sessions that a marked process leads: a vLLM is started as a session
        # leader. A marked process inside someone else's session (a short helper the test
        # ran with the marker in its environment) must never make that session, which may be
        # pytest's own and its callers' (scripts/test, CI), a target of the sweep.
        own = os.getsid(0)
        for pid in marked(self.run_id):
            sid = session_id_of(str(pid))
            if sid is not None and sid == pid and sid > 1 and sid != own:
                self.sessions.add(sid)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.look()
            self._stop.wait(self._every)

    def members(self) -> list[int]:
        self.look()
        found = set(marked(self.run_id))
        for p in os.listdir("/proc"):
            if (
                p.isdigit()
                and session_id_of(p) in self.sessions
                and _state(p) not in ("Z", "X", "?")
            ):
                found.add(int(p))
        found.discard(os.getpid())  # never this test process, whatever its session
        return sorted(found)


def in_session(sid: int) -> list[int]:
    """Live (not zombie) processes of the session ``sid``: what is left of a vLLM the process
    manager started (a session leader) once it is gone, its renamed EngineCore included."""
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and session_id_of(p) == sid and _state(p) not in ("Z", "X", "?")
    ]


def _members(run_id: str, census: Census | None) -> list[int]:
    return census.members() if census is not None else marked(run_id)


def sweep(run_id: str, census: Census | None = None) -> list[str]:
    """SIGKILL every live process of this run (by its marker and, given a census, its sessions;
    never by name); says which."""
    out = []
    for pid in _members(run_id, census):
        out.append(f"{pid} {' '.join(cmdline(pid))[:80]}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return out


def leftovers(run_id: str, wait_seconds: float = 10.0, census: Census | None = None) -> list[int]:
    deadline = time.monotonic() + wait_seconds
    while True:
        left = _members(run_id, census)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live process below ``pid``, with its command line (vLLM renames its processes,
    and the rename overwrites the memory /proc/<pid>/environ shows, so the marker cannot find
    EngineCore or its Worker while they run; the process tree can)."""
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child[0])
    return out


def lower_engine_priority(api_server_pid: int, nice: int = 19) -> list[str]:
    """Every thread of the processes below vLLM's API server (EngineCore, its Worker) at
    ``nice``: says which.

    On a GPU host the engine's step runs on the GPU and the API server has a core to itself. On
    two shared cores, with one taken by another process, the tiny model's engine steps faster
    than the API server can hand it requests and take its outputs: vLLM then ran one or two
    sequences a step while 24 clients had requests out (all six closed loops of two
    CI rehearsals beside a CPU hog, 1.0-2.6 sequences a step against ~5). Behind the API server
    and the clients, the engine takes the CPU they leave, and the load that reaches it is the
    load the test sent. A nice value is per thread on Linux, so each thread is reniced; threads
    made later inherit their creator's.
    """
    done = []
    for pid, cmd in descendants(api_server_pid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        done.append(f"{pid} {cmd[:40]}")
    return done


def children(pid: int) -> list[tuple[int, str]]:
    """Direct children of ``pid`` with their command lines (vLLM renames its processes)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(p), cmd))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


# --- HTTP ----------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen[Any], timeout_seconds: float) -> None:
    """SIGTERM a process the tier started in its own session, and everything in its group;
    SIGKILL the group if it has not exited within ``timeout_seconds``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # a proxy from the environment must never sit on loopback
    return s


def healthy(url: str) -> bool:
    try:
        return session().get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def prompt_ids(n: int, seed: int) -> list[int]:
    """A prompt as token ids: exactly ``n`` tokens on vLLM and on the twin alike."""
    rnd = random.Random(seed)
    return [rnd.randrange(16, 4000) for _ in range(n)]


@dataclass
class StreamResult:
    status: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0


def stream_completion(
    url: str,
    prompt: list[int],
    max_tokens: int,
    model: str = MODEL_NAME,
    timeout: float = 180,
    stream: bool = True,
    first_token: threading.Event | None = None,
) -> StreamResult:
    """One completion; ``stream=False`` spares the API server (one core here) the per-token
    events, so its /metrics stays responsive while the engine is under pressure.
    ``first_token`` is set when a streamed token arrives: the request is in the engine, seen
    by the client itself (the server's /metrics can answer too late to show it)."""
    r = StreamResult(started=time.monotonic())
    try:
        with session().post(
            url + "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,  # random weights: exact lengths only this way
                "stream": stream,
            },
            stream=stream,
            timeout=(5, timeout),
        ) as resp:
            r.status = resp.status_code
            if not stream:
                body = resp.json()
                if resp.status_code == 200:
                    r.done = True
                    r.chunks = int(body["usage"]["completion_tokens"])
                    r.finish_reason = body["choices"][0].get("finish_reason")
                else:
                    r.error = json.dumps(body)[:300]
                r.ended = time.monotonic()
                return r
            if resp.status_code != 200:
                # An error answer to a streamed request (a request that reached the API server
                # after its engine died gets a 500) has no events: its body is the reason.
                r.error = resp.text[:300]
                r.ended = time.monotonic()
                return r
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    r.done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    r.error = json.dumps(event["error"])[:300]
                    continue
                r.chunks += 1
                if first_token is not None:
                    first_token.set()
                r.finish_reason = event["choices"][0].get("finish_reason") or r.finish_reason
    except (requests.RequestException, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"[:300]
    r.ended = time.monotonic()
    return r


@dataclass
class TextStream:
    """A streamed completion as a client assembles it."""

    status: int | None = None
    text: str = ""
    events: int = 0  # data events with choices
    ids: set[str] = field(default_factory=set)  # every chunk's id
    created: set[int] = field(default_factory=set)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    keepalives: int = 0
    errors: list[str] = field(default_factory=list)
    done: bool = False
    failure: str | None = None
    ended: float = 0.0  # time.monotonic() when it ended
    # (n, call): the reader calls ``call`` once, right after the n-th event, in its own thread
    on_event: tuple[int, Callable[[], None]] | None = None


def stream_text(url: str, body: dict[str, object], into: TextStream, timeout: float = 600) -> None:
    """Read one streamed completion into ``into`` as it arrives (a test watches its progress
    from another thread)."""
    r = into
    try:
        with session().post(
            url + "/v1/completions", json=body, stream=True, timeout=(5, timeout)
        ) as resp:
            r.status = resp.status_code
            for line in resp.iter_lines():
                if line.startswith(b": keep-alive"):
                    r.keepalives += 1
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    r.done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    r.errors.append(json.dumps(event["error"])[:300])
                    continue
                r.ids.add(event["id"])
                r.created.add(event["created"])
                if event.get("usage") is not None and not event["choices"]:
                    r.usage = event["usage"]
                for choice in event["choices"]:
                    r.text += choice["text"]
                    r.finish_reason = choice.get("finish_reason") or r.finish_reason
                    r.events += 1
                    if r.on_event is not None and r.events == r.on_event[0]:
                        r.on_event[1]()
    except (requests.RequestException, ValueError) as e:
        r.failure = f"{type(e).__name__}: {e}"[:300]
    r.ended = time.monotonic()


def burst(
    url: str,
    n: int,
    prompt_tokens: int,
    max_tokens: int,
    model: str = MODEL_NAME,
    seed: int = 0,
    stream: bool = True,
    first_token: threading.Event | None = None,
) -> list[StreamResult]:
    """``n`` concurrent completions (bounded: one thread each, all joined); ``first_token`` is
    set when any of them streams its first token."""
    results = [StreamResult() for _ in range(n)]

    def one(i: int) -> None:
        results[i] = stream_completion(
            url,
            prompt_ids(prompt_tokens, seed + i),
            max_tokens,
            model,
            stream=stream,
            first_token=first_token,
        )

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


@dataclass
class Sampler:
    """Polls a server's /metrics in a thread; keeps (time, {sample: value}) for chosen samples."""

    url: str
    names: tuple[str, ...] = (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    )
    every: float = 0.5
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        s = session()
        while not self._stop.is_set():
            with contextlib.suppress(requests.RequestException):
                text = s.get(self.url + "/metrics", timeout=10).text
                self.samples.append((time.monotonic(), scalar_samples(text, self.names)))
            self._stop.wait(self.every)

    @contextlib.contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=15)

    def series(self, name: str) -> list[float]:
        return [v[name] for _, v in self.samples if name in v]


def scalar_samples(text: str, names: Sequence[str]) -> dict[str, float]:
    """The first sample of each named family (unlabelled-or-any-labels), as floats."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names and name not in out:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out
