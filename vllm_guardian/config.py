"""YAML configuration → frozen settings, with every error reported at once with its key and line.

The schema *is* the dataclasses below: each field's type says what YAML value it takes, its
default is the shipped default (the comment beside it says why), and ``metadata`` carries the
bounds. :func:`load_config` walks the YAML node tree (so it knows line numbers), collects
every unknown key, wrong type and bad value, and raises :class:`ConfigInvalid` listing all
of them. Nothing here does I/O except reading the one file it is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from vllm_guardian.lowio.redact import redact_text

DEFAULT_CONFIG_PATH = "/etc/vllm-guardian/config.yaml"

_MIB = 1024 * 1024


def _bounds(
    lo: float | None = None,
    hi: float | None = None,
    *,
    check: Callable[[Any], str | None] | None = None,
) -> dict[str, Any]:
    return {"min": lo, "max": hi, "check": check}


# --- checks for single values ----------------------------------------------------------------

_SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Not starting with '-': systemctl and journalctl would read such a name as an option.
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@\\][A-Za-z0-9:_.@\\-]*\.(service|scope)$")


def _check_service_name(v: str) -> str | None:
    if not _SERVICE_NAME.match(v):
        return "must be 1-63 characters of letters, digits, '_', '.', '-', starting alphanumeric"
    return None


def _check_url(v: str) -> str | None:
    try:
        parts = urlsplit(v)
    except ValueError as e:  # "http://[::1:8000": an unclosed IPv6 bracket
        return f"is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// base URL with a host, e.g. http://127.0.0.1:8000"
    if parts.query or parts.fragment:
        return "must be a base URL without query or fragment"
    try:
        _ = parts.port
    except ValueError:
        return "has an invalid port"
    return None


def _check_unit(v: str) -> str | None:
    if v.startswith("-"):
        return "must not start with '-' (systemctl would read it as an option)"
    if not _UNIT_NAME.match(v):
        return "must be a systemd unit name ending in .service, e.g. vllm.service"
    return None


def _check_path(v: str) -> str | None:
    if not v.strip():
        return "must not be empty"
    if "\0" in v:
        return "must not contain a NUL character"
    return None


def _check_gpu_backend(v: str) -> str | None:
    return None if v in ("nvml", "file") else "must be 'nvml' or 'file'"


def parse_listen(v: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port). Raises ValueError with a readable reason."""
    m = re.fullmatch(r"\[(?P<h6>[^\]]+)\]:(?P<p6>\d+)|(?P<h>[^:\[\]]+):(?P<p>\d+)", v)
    if not m:
        raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9469")
    host = m.group("h6") or m.group("h")
    port = int(m.group("p6") or m.group("p"))
    if not 0 <= port <= 65535:
        raise ValueError("port must be 0..65535")
    if m.group("h6"):
        ipaddress.IPv6Address(host)  # raises ValueError
    return host, port


def _check_listen(v: str) -> str | None:
    try:
        parse_listen(v)
    except ValueError as e:
        return str(e)
    return None


def check_fallback_url(v: str) -> str | None:
    """The gate's fallback upstream (gate.fallback_url, --fallback-url): an http:// or
    https:// base URL with a host, and nothing a request could be steered by or that would
    leak: no credentials (the gate never sends URL userinfo; a header carries a key), no query
    or fragment. The problem says nothing of the value: it may hold a secret."""
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        return "is not a URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (user:password@): the gate forwards the client's own"
    if parts.query or parts.fragment:
        return "must be a base URL, without a query or fragment"
    return None


# --- the schema ------------------------------------------------------------------------------


def _check_metrics_path(v: str) -> str | None:
    if not v.startswith("/") or any(c.isspace() for c in v):
        return "must be a path starting with '/', e.g. /metrics"
    return None


def _check_sha256(v: str) -> str | None:
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        return "must be a SHA-256 digest: 64 lowercase hex digits (sha256sum's output)"
    return None


# The routes whose streams the gate continues (gate/continuation.py's paths).
CONTINUATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _check_continuation_route(v: str) -> str | None:
    if v not in CONTINUATION_ROUTES:
        return f"must be one of {', '.join(CONTINUATION_ROUTES)}"
    return None


def _check_header_name(v: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", v):
        return "must be an HTTP header name, e.g. Authorization"
    return None


@dataclass(frozen=True)
class GateConfig:
    """The admission gate in front of one service (``vllm-guardian gate -c CONFIG --service
    NAME``; docs/gate.md). Each key is the gate's command-line flag of the same meaning."""

    # Where clients connect (--listen). Its own port: vLLM stays on services[].url.
    listen: str = field(default="127.0.0.1:8001", metadata=_bounds(check=_check_listen))
    # Follow the guardian's /ready/<service> (its `listen` above); false: vLLM's /health only.
    follow_guardian: bool = True
    # Requests waiting at most (--max-queue); 0 refuses at once while the gate is closed. Size it
    # to hold what arrives during a restart: peak requests/s × (model load + drain). 256 turned
    # 71 of 1,967 requests into 503s across one pre-emptive restart at 8 req/s (bench/outcome.py,
    # fragmentation_creep); memory is bounded by max_queued_tokens, not by this count.
    max_queue_requests: int = field(default=1024, metadata=_bounds(0, 1_000_000))
    # Estimated prompt tokens waiting at most (--max-queued-tokens).
    max_queued_tokens: int = field(default=1_000_000, metadata=_bounds(0, 10**10))
    # A held request gets its 503 after this long (--max-wait): a restart with model load fits.
    max_wait_seconds: float = field(default=60.0, metadata=_bounds(0.1, 3600))
    # A request held while the guardian's /ready says a restart or relaunch is in progress
    # waits up to this much longer (--restart-extra-wait; 0: not at all), while the restart
    # lasts and the reopened gate releases the queue, never past the client's own timeout
    # (the X-Stainless-Timeout of OpenAI's SDKs). 30 s: a hung engine's new arrivals are held
    # from 10 s after the hang, the guardian restarts it at 30 s and the twin's new engine
    # serves at ~71 s, 1 s after their 60 s ran out (bench/outcome.py, engine_hang); a real
    # model load is longer and varies, and 90 s in all stays under the SDKs' 600 s.
    restart_extra_wait_seconds: float = field(default=30.0, metadata=_bounds(0, 3600))
    # Queued requests released per second once open, in bursts of release_burst (0: no limit),
    # so a reopening does not cause the next spike.
    release_rate_per_second: float = field(default=50.0, metadata=_bounds(0, 100_000))
    release_burst: int = field(default=8, metadata=_bounds(1, 100_000))
    # Fairness: the share of the queue one client may hold (0: off); over it a client gets 429.
    # Needs known_keys_sha256 or trust_key_header: who counts as one client.
    per_key_share_ratio: float = field(default=0.0, metadata=_bounds(0, 1))
    key_header: str = field(default="Authorization", metadata=_bounds(check=_check_header_name))
    # A request whose key_header value has one of these SHA-256 digests (hex, e.g.
    # `printf %s 'Bearer sk-…' | sha256sum`) is a client of its own; every other request (no
    # header, or any other value) counts as one client together, so a fresh value per request
    # buys no fresh share. Digests keep the keys themselves out of this file.
    known_keys_sha256: tuple[str, ...] = field(default=(), metadata=_bounds(check=_check_sha256))
    # Or every value of key_header is a client of its own: only when a proxy in front of the
    # gate authenticates clients and sets that header itself (overwriting a client's own).
    trust_key_header: bool = False
    # Retry-After on the gate's own 503 and 429.
    retry_after_seconds: int = field(default=2, metadata=_bounds(0, 3600))
    # KV-need admission: admit only what fits in the free KV pool, keeping this share free.
    # Off by default: a need of prompt + max_tokens reserved up front held a thrashing twin's
    # pool at 38 % and served 240 requests where the guardian's own KV watermark gate (which
    # the gate follows anyway) served 363 (`vllm-guardian demo --scenario kv_thrash`, 75 s).
    kv_admission: bool = False
    kv_reserve_ratio: float = field(default=0.05, metadata=_bounds(0, 0.99))
    # Output tokens assumed for a request without max_tokens.
    default_output_tokens: int = field(default=256, metadata=_bounds(1, 10**7))
    # Bodies are held in memory (a held request may be sent twice); larger ones get 413.
    max_body_bytes: int = field(default=32 * _MIB, metadata=_bounds(1024, 1024 * _MIB))
    # A body must arrive whole within this long of its head (408 past it): a client that
    # announces a body and sends none held its connection for ever.
    body_timeout_seconds: float = field(default=30.0, metadata=_bounds(1, 3600))
    # ...and at no less than this rate over each 5 s (408 below it; 0: no floor), so a body
    # trickled in to stay under the deadline is cut within 5 s. A real client sends its body
    # at link speed; 1 KiB/s is what a trickle stays under.
    body_min_rate_bytes_per_second: int = field(default=1024, metadata=_bounds(0, 1024 * _MIB))
    # Bodies held at once, all requests together (read, queued, being sent): a body that would
    # pass it waits up to 2 s, then gets 503. At least max_body_bytes; 40 unfinished 30 MiB
    # bodies held a gate at 1.2 GB without it.
    body_budget_bytes: int = field(default=256 * _MIB, metadata=_bounds(1024, 1024**4))
    # Polls of the guardian's /ready and vLLM's /health; reads of vLLM's /metrics.
    poll_interval_seconds: float = field(default=0.1, metadata=_bounds(0.01, 60))
    kv_poll_interval_seconds: float = field(default=0.5, metadata=_bounds(0.05, 600))
    # Requests in vLLM and no progress (core/progress.py) for this long (--stall-hold): hold new
    # requests instead of sending them into a hung engine that still answers /health 200. A
    # third of signals.stall_seconds, after which the guardian restarts it: a false alarm costs
    # held requests latency, not failures (gate/progress.py). 0: off.
    stall_hold_seconds: float = field(default=10.0, metadata=_bounds(0, 3600))
    # While the stall hold holds, close the connections of the requests the hung engine holds
    # and send them again (or continue them) once it serves again (--take-back-hung).
    # Experimental, off: on the real vLLM tier a taken back request was sometimes sent again
    # into the still hung engine before the guardian's restart, and cut a second time by it
    # (docs/gate.md, "Across a hang").
    take_back_hung: bool = False
    # Where the gate serves its own metrics (vLLM's /metrics is then read on vLLM itself).
    metrics_path: str = field(default="/metrics", metadata=_bounds(check=_check_metrics_path))
    # In-flight requests get this long to finish on SIGTERM; queued ones get 503 at once.
    shutdown_timeout_seconds: float = field(default=5.0, metadata=_bounds(0, 3600))
    # A streamed /v1/completions or /v1/chat/completions the upstream cuts (an engine death, a
    # restart) is continued on
    # the next ready server where the client's text ends, at most max_continuations times per
    # request (--continuation, --max-continuations; docs/gate.md, "Continuing a cut stream").
    # One by default: a request that itself kills the engine kills at most one more.
    continuation: bool = True
    max_continuations: int = field(default=1, metadata=_bounds(0, 10))
    # Routes whose streams are not continued while continuation is on for the others
    # (--continuation-off-route): /v1/completions, /v1/chat/completions.
    continuation_off_routes: tuple[str, ...] = field(
        default=(), metadata=_bounds(check=_check_continuation_route)
    )
    # Another replica of the same model (e.g. its Kubernetes Service: --fallback-url), off by
    # default: a continuation, or a held /v1/completions or /v1/chat/completions, that has
    # waited fallback_after_seconds for this server is sent there instead (a continuation at
    # most max_continuations times, never what continuation refuses); refused or answered 5xx
    # there, it waits on for this server within max_wait_seconds (docs/gate.md, "A fallback
    # replica"). Only from this file or the flag, never from a request.
    fallback_url: str | None = field(default=None, metadata=_bounds(check=check_fallback_url))
    # 10 s: a blip (a /health miss, a suspect upstream) passes here first; a restart (30-70 s)
    # does not.
    fallback_after_seconds: float = field(default=10.0, metadata=_bounds(0, 3600))
    # Worker processes on the listen port (--workers; docs/gate.md, "More than one core"), each
    # with an even share of the limits above. 0: one per CPU this process may use (its
    # affinity and its cgroup's CPU limit), at most 4, fewer where the limits cannot be split
    # that far. 1 (the default): one process, no parent; the outcome benchmarks and the real
    # vLLM tier measure that form.
    workers: int = field(default=1, metadata=_bounds(0, 64))

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def split_limits(self) -> SplitLimits:
        return SplitLimits(
            max_queue_requests=self.max_queue_requests,
            max_queued_tokens=self.max_queued_tokens,
            body_budget_bytes=self.body_budget_bytes,
            max_body_bytes=self.max_body_bytes,
            kv_admission=self.kv_admission,
        )


@dataclass(frozen=True)
class SplitLimits:
    """The gate's limits that its worker processes split between them, each an even share
    (the config's ``gate:`` keys, or the settings ``vllm-guardian gate`` resolved)."""

    max_queue_requests: int
    max_queued_tokens: int
    body_budget_bytes: int
    max_body_bytes: int
    kv_admission: bool


def workers_problem(workers: int, limits: SplitLimits) -> str | None:
    """Why the gate's limits cannot be split over ``workers`` processes, or None: each worker
    gets an even share of every limit, so a positive limit needs at least one per worker and
    each worker's body budget must fit a largest body; KV-need admission counts the pool as
    one process's own."""
    if workers <= 1:
        return None
    max_queue_requests, max_queued_tokens = limits.max_queue_requests, limits.max_queued_tokens
    body_budget_bytes, max_body_bytes = limits.body_budget_bytes, limits.max_body_bytes
    if limits.kv_admission:
        return "kv_admission needs workers: 1 (each worker would count the KV pool as its own)"
    for name, value in (("max_queue_requests", max_queue_requests),
                        ("max_queued_tokens", max_queued_tokens)):  # fmt: skip
        if 0 < value < workers:
            return (
                f"{name} ({value}) must be at least workers ({workers}): each worker holds a share"
            )
    if body_budget_bytes // workers < max_body_bytes:
        return (
            f"body_budget_bytes / workers ({_show_bytes(body_budget_bytes // workers)}) must be "
            f"at least max_body_bytes ({_show_bytes(max_body_bytes)}): each worker holds a share"
        )
    return None


@dataclass(frozen=True)
class ServiceConfig:
    """One vLLM server on this host."""

    name: str = field(metadata=_bounds(check=_check_service_name))
    # Base URL; /metrics and /health live under it. vLLM's default port.
    url: str = field(default="http://127.0.0.1:8000", metadata=_bounds(check=_check_url))
    # The systemd unit running it. Without one the guardian finds the process by its port.
    unit: str | None = field(default=None, metadata=_bounds(check=_check_unit))
    # GPU indices the service uses; None ("auto") = the GPUs its processes hold memory on.
    gpus: tuple[int, ...] | None = field(default=None, metadata=_bounds(0, 1023))
    # In a container NVML reports host pids the guardian cannot see, so its processes are not
    # found: true attributes all memory on the service's GPUs (with gpus auto: every GPU the
    # guardian sees, i.e. the pod's own) to the service. The Helm chart sets it.
    gpu_memory_by_device: bool = False
    # A plain log file to follow instead of the unit's journal (vLLM run outside systemd).
    log_file: str | None = None
    # The vLLM command (argument list, no shell) for policy.backend "process": the guardian
    # starts it with the flags file applied and restarts it, as systemd's Restart=always would.
    command: tuple[str, ...] | None = field(default=None, metadata={"unique": False})
    # The admission gate in front of this service (`vllm-guardian gate -c ... --service NAME`,
    # unit vllm-guardian-gate@NAME.service). None: no gate; clients talk to vLLM directly.
    gate: GateConfig | None = None


@dataclass(frozen=True)
class VllmMetricsSourceConfig:
    # vLLM renders /metrics in a few ms; 2 s means the server is in trouble, not slow.
    timeout_seconds: float = field(default=2.0, metadata=_bounds(0.1, 60))
    # A real 8-engine exposition is ~0.3 MiB; 16 MiB stops a runaway body, not a real one.
    max_body_bytes: int = field(default=16 * _MIB, metadata=_bounds(64 * 1024, 1024 * _MIB))


@dataclass(frozen=True)
class HealthSourceConfig:
    # /health is a trivial handler; 2 s without an answer is a hang worth reporting.
    timeout_seconds: float = field(default=2.0, metadata=_bounds(0.1, 60))
    # The deep probe spends a real (1-token) generation, so it is opt-in.
    deep_probe: bool = False
    # One generation a minute is noise next to real traffic and still catches a hung engine.
    deep_probe_interval_seconds: float = field(default=60.0, metadata=_bounds(5, 86400))
    # A 1-token completion queues behind real work; allow for a busy server.
    deep_probe_timeout_seconds: float = field(default=10.0, metadata=_bounds(0.5, 600))


@dataclass(frozen=True)
class NvmlSourceConfig:
    # Off only on hosts without NVIDIA GPUs (the source would report itself down every tick).
    enabled: bool = True
    # "nvml": the driver through nvidia-ml-py. "file": a JSON device-state file that the vLLM
    # twin writes (demo, tests, benchmarks); everything above the backend is the same.
    backend: str = field(default="nvml", metadata=_bounds(check=_check_gpu_backend))
    # The JSON state file read by the "file" backend (docs/gpu-state-file.md).
    state_file: str | None = None
    # Where libnvidia-ml.so.1 is, if not on the loader path (None: let pynvml find it).
    library_path: str | None = None
    # NVML queries take milliseconds; seconds means a wedged driver.
    timeout_seconds: float = field(default=3.0, metadata=_bounds(0.1, 60))
    # After a failed nvmlInit, retry with doubling backoff up to this (the driver may reload).
    init_retry_max_seconds: float = field(default=300.0, metadata=_bounds(1, 86400))


@dataclass(frozen=True)
class UnitSourceConfig:
    enabled: bool = True
    # systemctl is called with an argument list, never through a shell.
    systemctl: str = "systemctl"
    # `systemctl show` answers in milliseconds unless PID 1 is busy.
    timeout_seconds: float = field(default=3.0, metadata=_bounds(0.1, 60))
    # The unit's properties and process tree change at a restart, which is seen at once (the
    # main process gone or replaced, health changed, a log event); this full re-read catches
    # the rest (a reload, a stop in progress, a new worker) within this long. 0: every tick.
    refresh_seconds: float = field(default=30.0, metadata=_bounds(0, 3600))


@dataclass(frozen=True)
class LogsSourceConfig:
    enabled: bool = True
    journalctl: str = "journalctl"
    # vLLM dumps whole configs on fatal errors; cap one line so a dump cannot eat memory.
    max_line_bytes: int = field(default=64 * 1024, metadata=_bounds(1024, 16 * _MIB))
    # Keep this many recent matched events per service for status and diagnose.
    recent_events: int = field(default=50, metadata=_bounds(1, 10000))


@dataclass(frozen=True)
class AllocatorSourceConfig:
    # On by default: without the in-vLLM plugin the directory is absent and the source costs
    # one stat per tick (and reports "no plugin data", not an error).
    enabled: bool = True
    # Where the plugin writes: the vLLM drop-in sets VLLM_GUARDIAN_ALLOCATOR_DIR to
    # <directory>/<service> (a RuntimeDirectory= of the vLLM unit, so vLLM's user can write it
    # and it is emptied when vLLM stops). Files here and one directory level down are read.
    directory: str = field(
        default="/run/vllm-guardian-allocator", metadata=_bounds(check=_check_path)
    )
    # The plugin writes every 5 s; a file untouched for six intervals belongs to a process that
    # stopped publishing (hung or gone), and its numbers no longer describe the allocator.
    stale_seconds: float = field(default=30.0, metadata=_bounds(1, 3600))
    # A host runs a few vLLM processes per GPU; beyond this the directory is not ours: stop.
    max_files: int = field(default=256, metadata=_bounds(1, 100000))
    # Reading a few small files on tmpfs takes milliseconds; longer means a hung filesystem.
    timeout_seconds: float = field(default=2.0, metadata=_bounds(0.1, 60))


@dataclass(frozen=True)
class GateSourceConfig:
    # The gate's GET /gate/status is a dict read on its event loop: 1 s without an answer
    # means a wedged gate (its watchdog restarts it), not a slow one.
    timeout_seconds: float = field(default=1.0, metadata=_bounds(0.1, 60))


@dataclass(frozen=True)
class SourcesConfig:
    vllm_metrics: VllmMetricsSourceConfig = field(default_factory=VllmMetricsSourceConfig)
    health: HealthSourceConfig = field(default_factory=HealthSourceConfig)
    nvml: NvmlSourceConfig = field(default_factory=NvmlSourceConfig)
    unit: UnitSourceConfig = field(default_factory=UnitSourceConfig)
    logs: LogsSourceConfig = field(default_factory=LogsSourceConfig)
    allocator: AllocatorSourceConfig = field(default_factory=AllocatorSourceConfig)
    # Read for every service with a `gate:` section.
    gate: GateSourceConfig = field(default_factory=GateSourceConfig)


@dataclass(frozen=True)
class SignalsConfig:
    # Rates over 30 s: several vLLM stat updates and 15 ticks, short enough to react.
    rate_window_seconds: float = field(default=30.0, metadata=_bounds(2, 3600))
    # Latency quantiles need enough finished requests to mean something.
    quantile_window_seconds: float = field(default=60.0, metadata=_bounds(2, 3600))
    # Headroom slope over 2 min: long enough to ignore one burst, short enough to warn in time.
    slope_window_seconds: float = field(default=120.0, metadata=_bounds(4, 3600))
    # Requests in the engine and no progress (core/progress.py) for this long is a stalled engine.
    stall_seconds: float = field(default=30.0, metadata=_bounds(2, 3600))
    # The over-capacity estimate (core/capacity.py) reads this long: many finished requests and
    # several of vLLM's stat updates; a saturation shorter than this gives no number.
    capacity_window_seconds: float = field(default=120.0, metadata=_bounds(10, 3600))
    # The exhaustion forecast (core/forecast.py): free-memory floors per interval over the
    # window. 5 min of history holds 30 floors: enough for a robust trend, short enough that a
    # trend that began a minute ago dominates it.
    forecast_window_seconds: float = field(default=300.0, metadata=_bounds(1, 86400))
    # One floor per 10 s: five 2 s ticks, so one step's activations never make the floor alone.
    forecast_interval_seconds: float = field(default=10.0, metadata=_bounds(0.05, 3600))
    # Nothing is forecast before 5 floors spanning 40 s: a trend, not a burst.
    forecast_min_intervals: int = field(default=5, metadata=_bounds(3, 10000))
    forecast_min_span_seconds: float = field(default=40.0, metadata=_bounds(0.1, 86400))
    # A reading missing this long breaks the series; an older newest reading is stale.
    forecast_max_gap_seconds: float = field(default=30.0, metadata=_bounds(0.1, 86400))


@dataclass(frozen=True)
class RecorderConfig:
    # One JSON line per tick; None disables the flight recorder.
    path: str | None = field(
        default="/var/lib/vllm-guardian/flight.jsonl", metadata=_bounds(check=_check_path)
    )
    # 64 MiB holds hours of ticks at 2 s for one service; old files rotate out.
    max_bytes: int = field(default=64 * _MIB, metadata=_bounds(64 * 1024, 64 * 1024 * _MIB))
    # Rotated files kept beside the live one.
    backups: int = field(default=3, metadata=_bounds(0, 100))


def _check_http_url(v: str) -> str | None:
    try:
        parts = urlsplit(v)
    except ValueError as e:
        return f"is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL"
    return None


@dataclass(frozen=True)
class AlertingConfig:
    # The shipped rules (vllm_guardian/defaults/rules.yaml) are evaluated unless turned off.
    default_rules: bool = True
    # A YAML file of extra rules (same format); a rule with a shipped rule's name replaces it.
    rules_file: str | None = None
    # Generic JSON webhooks: one POST per alert transition.
    webhooks: tuple[str, ...] = field(default=(), metadata=_bounds(check=_check_http_url))
    # Alertmanager base URL (POST /api/v2/alerts). None: not used.
    alertmanager_url: str | None = field(default=None, metadata=_bounds(check=_check_http_url))
    # Firing alerts are re-sent this often, as Prometheus does, so Alertmanager keeps them.
    resend_seconds: float = field(default=60.0, metadata=_bounds(5, 3600))
    # A sink that does not answer within this is skipped for the tick, never waited on.
    timeout_seconds: float = field(default=5.0, metadata=_bounds(0.1, 60))


def _check_action(v: str) -> str | None:
    return None if v in ("gate", "restart", "relaunch") else "must be gate, restart or relaunch"


def _check_backend(v: str) -> str | None:
    return None if v in ("systemd", "process") else "must be 'systemd' or 'process'"


@dataclass(frozen=True)
class ConcurrencyRelaunchConfig:
    """Whether KV thrash (``concurrency_overcommit``) may relaunch vLLM with a lower
    ``--max-num-seqs``. Off: measured on vLLM 0.32, a cap at about what the
    pool hosts gains at most 2-3 %, one below it costs 5-34 %, and the relaunch itself fails
    requests; the gate and the over-capacity alert are the levers."""

    enabled: bool = False
    # The cap, as a multiple of the median running count over the pressure episodes; the
    # measured optimum is narrow: 1.0x (0.8x already gained nothing).
    target_hosted_ratio: float = field(default=1.0, metadata=_bounds(0.5, 2.0))
    # Running-count samples under pressure needed before the median means anything.
    min_running_samples: int = field(default=10, metadata=_bounds(3, 10000))
    # Only when recompute (preemptions/s x mean context tokens / tokens/s) is at least this
    # share of the forwarded tokens: a restart is only worth what recompute costs (5-8 % of
    # engine time at a 19-21 % token share, measured).
    min_recompute_share_ratio: float = field(default=0.3, metadata=_bounds(0.0, 10.0))


@dataclass(frozen=True)
class PolicyConfig:
    # First-install safety: everything is decided, recorded and exported, nothing executed.
    # Set to false once the audit log shows decisions you agree with.
    dry_run: bool = True
    # With dry_run off, these actions are still only decided and recorded (gate, restart,
    # relaunch): arm the ladder one rung at a time.
    dry_run_actions: tuple[str, ...] = field(default=(), metadata=_bounds(check=_check_action))
    # How the guardian restarts vLLM: "systemd" (systemctl restart UNIT) or "process" (the
    # guardian runs services[].command itself, as the demo does; hosts without systemd).
    backend: str = field(default="systemd", metadata=_bounds(check=_check_backend))
    # Admission gate: /ready/<service> answers 503 above the high watermark and 200 again below
    # the low one; the band keeps it from flapping (as Envoy's overload manager does).
    kv_high_watermark_ratio: float = field(default=0.90, metadata=_bounds(0.05, 1.0))
    kv_low_watermark_ratio: float = field(default=0.80, metadata=_bounds(0.0, 1.0))
    # A closed gate stays closed at least this long: a real vLLM's KV gauge swings between
    # 0.3 and 1.0 under pressure, and a gate that follows every swing flaps (measured, vLLM 0.32).
    gate_min_closed_seconds: float = field(default=10.0, metadata=_bounds(0, 3600))
    # After any action nothing else is done for this long: model load plus warm-up, so lagging
    # counters cannot trigger a second action (both oomds use a cooldown for the same reason).
    cooldown_seconds: float = field(default=600.0, metadata=_bounds(0, 86400))
    # At most this many guardian restarts per window; one more latches the breaker.
    restart_budget: int = field(default=3, metadata=_bounds(1, 100))
    restart_budget_window_seconds: float = field(default=3600.0, metadata=_bounds(60, 7 * 86400))
    # A failure this soon after the service became ready again counts as an early failure; this
    # many early failures in a row mean restarting does not help: latch and escalate. An early
    # crash logged by the new instance is acted on within the cooldown (it is not a lagging
    # counter; waiting leaves vLLM crash-looping with the flags that just failed).
    early_failure_seconds: float = field(default=300.0, metadata=_bounds(0, 86400))
    early_failure_limit: int = field(default=2, metadata=_bounds(1, 100))
    # A failed action waits this long before the next try, doubling up to the maximum.
    backoff_initial_seconds: float = field(default=60.0, metadata=_bounds(1, 86400))
    backoff_max_seconds: float = field(default=1800.0, metadata=_bounds(1, 86400))
    # This many pressure episodes of one cause within the window step its lever down one rung.
    pressure_events_to_relaunch: int = field(default=3, metadata=_bounds(1, 100))
    pressure_window_seconds: float = field(default=3600.0, metadata=_bounds(60, 7 * 86400))
    # After this long with no pressure alert, undo one rung (additive increase)...
    stable_for_seconds: float = field(default=6 * 3600.0, metadata=_bounds(5, 30 * 86400))
    # ...unless the same cause came back within this long of the last step up: then the rung
    # stays pinned for this long.
    pin_seconds: float = field(default=24 * 3600.0, metadata=_bounds(0, 30 * 86400))
    # vLLM refuses connections while it loads the model: not a death for this long after a start.
    startup_grace_seconds: float = field(default=600.0, metadata=_bounds(0, 7200))
    # Drain: stop admitting, wait for running requests to finish, at most this long.
    drain_timeout_seconds: float = field(default=120.0, metadata=_bounds(0, 3600))
    # After a restart: wait for the old instance's GPU memory to be freed, then for /health.
    vram_release_timeout_seconds: float = field(default=120.0, metadata=_bounds(0, 3600))
    ready_timeout_seconds: float = field(default=900.0, metadata=_bounds(10, 7200))
    # Levers (multiplicative decrease, with floors).
    max_num_seqs_factor_ratio: float = field(default=0.75, metadata=_bounds(0.1, 0.99))
    max_num_seqs_floor: int = field(default=8, metadata=_bounds(1, 100000))
    max_num_batched_tokens_factor_ratio: float = field(default=0.5, metadata=_bounds(0.1, 0.99))
    max_num_batched_tokens_floor: int = field(default=2048, metadata=_bounds(16, 10**7))
    gpu_memory_utilization_step_ratio: float = field(default=0.05, metadata=_bounds(0.01, 0.5))
    gpu_memory_utilization_floor_ratio: float = field(default=0.70, metadata=_bounds(0.1, 0.99))
    # Pre-emptive action (policy.preemptive_action): act on an exhaustion forecast whose bound
    # (the latest the card is expected to run out) is within this horizon and names a cause.
    # 10 min: a drain plus a model reload fit in it, and a trend that far out is still sharp.
    forecast_horizon_seconds: float = field(default=600.0, metadata=_bounds(0, 86400))
    # A quiet moment for the pre-emptive drain: the queue empty and at most this many running.
    preemptive_quiet_running: int = field(default=2, metadata=_bounds(0, 100000))
    # A growing neighbour earns a relaunch with a lower --gpu-memory-utilization only after its
    # forecast has stood this long (a short-lived job is not restarted for), or at once when the
    # GPU would run out before then. Meanwhile the neighbour alert pages; nothing is held.
    neighbour_persist_seconds: float = field(default=60.0, metadata=_bounds(0, 86400))
    # The incident bundle captured before a disruptive action must not delay it for longer.
    bundle_timeout_seconds: float = field(default=20.0, metadata=_bounds(1, 600))
    # KV thrash: gate and alert only unless enabled here.
    concurrency_relaunch: ConcurrencyRelaunchConfig = field(
        default_factory=ConcurrencyRelaunchConfig
    )


def _check_permit(v: str) -> str | None:
    return None if v in ("none", "lease") else "must be 'none' or 'lease'"


_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _check_k8s_name(v: str | None) -> str | None:
    if v is None or _K8S_NAME.match(v):
        return None
    return "must be a Kubernetes name: lowercase letters, digits and '-', at most 63"


def _check_optional_url(v: str | None) -> str | None:
    return None if v is None else _check_url(v)


@dataclass(frozen=True)
class FleetConfig:
    # One disruption budget across replicas (docs/kubernetes.md): "none" (one host:
    # every replica acts alone) or "lease" (a voluntary action first takes one of N Lease
    # permits, N and disruptionsAllowed from the PodDisruptionBudget). Only "lease" imports the
    # Kubernetes adapter (the `k8s` extra).
    permit: str = field(default="none", metadata=_bounds(check=_check_permit))
    # The model's name: the Leases are vllm-guardian-<model>-<k>.
    model: str | None = field(default=None, metadata=_bounds(check=_check_k8s_name))
    # The PodDisruptionBudget whose status gates voluntary actions.
    pdb: str | None = field(default=None, metadata=_bounds(check=_check_k8s_name))
    # A dead holder frees its permit after this. A guardian renews the permit it holds every
    # third of this while its action lasts, so an action may outlast it.
    lease_ttl_seconds: float = field(default=900.0, metadata=_bounds(30, 86400))
    # A voluntary action waits this long for a permit, then gives up (audited) until next due.
    wait_timeout_seconds: float = field(default=1800.0, metadata=_bounds(0, 86400))
    # The API server and namespace; null in a pod (the service account's). For tests and
    # guardians outside the cluster.
    api_server: str | None = field(default=None, metadata=_bounds(check=_check_optional_url))
    namespace: str | None = field(default=None, metadata=_bounds(check=_check_k8s_name))


@dataclass(frozen=True)
class Config:
    services: tuple[ServiceConfig, ...] = field(default=(), metadata=_bounds(1, 64))
    # vLLM updates its stats every engine step; 2 s sees a burst build without adding load.
    interval_seconds: float = field(default=2.0, metadata=_bounds(0.1, 3600))
    # /metrics, /healthz, /ready/<service>. Loopback: the exporter is not a public endpoint.
    listen: str = field(default="127.0.0.1:9469", metadata=_bounds(check=_check_listen))
    # Where the control socket lives (systemd RuntimeDirectory=).
    runtime_dir: str = field(default="/run/vllm-guardian", metadata=_bounds(check=_check_path))
    # Where persistent state lives (systemd StateDirectory=).
    state_dir: str = field(default="/var/lib/vllm-guardian", metadata=_bounds(check=_check_path))
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    recorder: RecorderConfig = field(default_factory=RecorderConfig)
    alerting: AlertingConfig = field(default_factory=AlertingConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    def service(self, name: str) -> ServiceConfig | None:
        for s in self.services:
            if s.name == name:
                return s
        return None


# --- loading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigError:
    path: str
    line: int | None
    message: str

    def format(self, filename: str) -> str:
        where = f"{filename}:{self.line}" if self.line is not None else filename
        return f"{where}: {self.path or '(top level)'}: {self.message}"


class ConfigInvalid(Exception):
    """The config has errors; ``errors`` holds every one of them."""

    def __init__(self, filename: str, errors: list[ConfigError]) -> None:
        self.filename = filename
        self.errors = errors
        super().__init__("\n".join(e.format(filename) for e in errors))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_SIZE_FACTORS = {
    None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'16MiB' → 16777216. Raises ValueError."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 2GiB, 1048576)")
    value = float(m.group(1)) * _SIZE_FACTORS[m.group(2)]
    if not math.isfinite(value) or value > 2**63:
        raise ValueError(f"{text!r} is too large")
    return int(value)


class _Loader:
    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def err(self, path: str, node: yaml.Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else None
        self.errors.append(ConfigError(path, line, message))

    def build(self, cls: type[Any], node: yaml.Node | None, path: str) -> Any:
        if node is None:
            return cls()
        if not isinstance(node, yaml.MappingNode):
            self.err(path, node, f"expected a mapping, got {_describe(node)}")
            return None
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            sub = f"{path}.{key}" if path else str(key)
            if key not in fields:
                self.err(sub, key_node, _unknown_key(str(key), fields))
                continue
            if key in seen:
                self.err(sub, key_node, "duplicate key")
                continue
            seen.add(key)
            f = fields[key]
            value = self.value(hints[key], value_node, sub, f)
            if value is not _INVALID:
                values[key] = value
        for name, f in fields.items():
            if (
                name not in seen
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING
            ):
                self.err(f"{path}.{name}" if path else name, node, "required key is missing")
        try:
            return cls(**values)
        except TypeError:
            return None  # a required key was missing or invalid: already reported

    def value(self, tp: Any, node: yaml.Node, path: str, f: dataclasses.Field[Any]) -> Any:
        optional = False
        origin = typing.get_origin(tp)
        if origin in (types.UnionType, typing.Union):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional = len(args) < len(typing.get_args(tp))
            tp = args[0]
            origin = typing.get_origin(tp)
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            if optional:
                return None
            self.err(path, node, "must not be empty")
            return _INVALID
        if dataclasses.is_dataclass(tp):
            built = self.build(typing.cast("type[Any]", tp), node, path)
            return built if built is not None else _INVALID
        if origin is tuple:
            return self.sequence(typing.get_args(tp)[0], node, path, f, optional)
        return self.scalar(tp, node, path, f)

    def sequence(
        self, item_tp: Any, node: yaml.Node, path: str, f: dataclasses.Field[Any], optional: bool
    ) -> Any:
        if optional and isinstance(node, yaml.ScalarNode) and node.value == "auto":
            return None
        if not isinstance(node, yaml.SequenceNode):
            expect = "a list" + (" or 'auto'" if optional else "")
            self.err(path, node, f"expected {expect}, got {_describe(node)}")
            return _INVALID
        items = []
        for i, item in enumerate(node.value):
            sub = f"{path}[{i}]"
            if dataclasses.is_dataclass(item_tp):
                built = self.build(typing.cast("type[Any]", item_tp), item, sub)
                if built is not None:
                    items.append(built)
            else:
                v = self.scalar(item_tp, item, sub, f)
                if v is not _INVALID:
                    items.append(v)
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if dataclasses.is_dataclass(item_tp):  # bounds are on the count
            if lo is not None and len(node.value) < lo:
                self.err(path, node, f"needs at least {lo:g} entr{'y' if lo == 1 else 'ies'}")
            if hi is not None and len(node.value) > hi:
                self.err(path, node, f"takes at most {hi:g} entries")
        elif f.metadata.get("unique", True) and len(set(items)) != len(items):
            self.err(path, node, "has duplicate entries")
        return tuple(items)

    def scalar(self, tp: Any, node: yaml.Node, path: str, f: dataclasses.Field[Any]) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self.err(path, node, f"expected {_type_name(tp)}, got {_describe(node)}")
            return _INVALID
        try:
            raw: Any = yaml.constructor.SafeConstructor().construct_object(node)
        except Exception as e:  # PyYAML's constructors raise all sorts
            # An explicit tag the value does not fit (``!!int abc``, ``!!timestamp x``,
            # ``!!binary`` junk) or one the safe loader does not know (``!!python/...``).
            tag = node.tag.removeprefix("tag:yaml.org,2002:")
            why = getattr(e, "problem", None) or str(e)
            self.err(path, node, f"{node.value!r} is not a valid {tag} ({why})")
            return _INVALID
        value: Any
        if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) > 2**63:
            self.err(path, node, f"{node.value[:20]!r}… is too large")
            return _INVALID
        if tp is bool:
            if not isinstance(raw, bool):
                self.err(path, node, f"expected true or false, got {node.value!r}")
                return _INVALID
            value = raw
        elif tp is int and path.endswith("_bytes") and isinstance(raw, str):
            try:
                value = parse_bytes(raw)
            except ValueError as e:
                self.err(path, node, str(e))
                return _INVALID
        elif tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                self.err(path, node, f"expected an integer, got {node.value!r}")
                return _INVALID
            value = raw
        elif tp is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float) or math.isnan(raw):
                self.err(path, node, f"expected a number, got {node.value!r}")
                return _INVALID
            value = float(raw)
        elif tp is str:
            if not isinstance(raw, str):
                self.err(path, node, f"expected a string, got {node.value!r} (quote it)")
                return _INVALID
            value = raw
        else:  # pragma: no cover - a schema bug, not a user error
            raise TypeError(f"unsupported config type {tp!r} at {path}")
        lo, hi, check = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("check")
        if isinstance(value, int | float) and not isinstance(value, bool):
            show = _show_bytes if path.endswith("_bytes") else _show_number
            if lo is not None and value < lo:
                self.err(path, node, f"must be >= {show(lo)}, got {show(value)}")
                return _INVALID
            if hi is not None and value > hi:
                self.err(path, node, f"must be <= {show(hi)}, got {show(value)}")
                return _INVALID
        if check is not None:
            problem = check(value)
            if problem:
                # Redacted: a URL's credentials or a token must not reach a terminal or a log.
                self.err(path, node, f"{problem} (got {redact_text(repr(node.value))})")
                return _INVALID
        return value


_INVALID = object()


def _show_number(v: float) -> str:
    return f"{v:g}"


def _show_bytes(v: float) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if v >= factor and v % factor == 0:
            return f"{int(v // factor)}{unit}"
    return f"{int(v)}"


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _cross_checks(cfg: Config, root: yaml.Node, loader: _Loader) -> None:
    p = cfg.policy
    if p.kv_low_watermark_ratio >= p.kv_high_watermark_ratio:
        loader.err(
            "policy.kv_low_watermark_ratio",
            _find_key(root, "policy"),
            "must be below policy.kv_high_watermark_ratio",
        )
    if p.backoff_initial_seconds > p.backoff_max_seconds:
        loader.err(
            "policy.backoff_initial_seconds",
            _find_key(root, "policy"),
            "must not exceed policy.backoff_max_seconds",
        )
    if p.backend == "process":
        for i, s in enumerate(cfg.services):
            if not s.command:
                loader.err(
                    f"services[{i}].command",
                    _find(root, "services", i),
                    "required with policy.backend: process",
                )
    if cfg.fleet.permit == "lease":
        fleet = _find_key(root, "fleet")
        for key in ("model", "pdb"):
            # Absent, not merely invalid: an invalid value has its own error already.
            if getattr(cfg.fleet, key) is None and _find_key(fleet, key) is None:
                loader.err(f"fleet.{key}", fleet, "required with fleet.permit: lease")
    names = [s.name for s in cfg.services]
    for i, s in enumerate(cfg.services):
        if names.count(s.name) > 1 and names.index(s.name) != i:
            loader.err(
                f"services[{i}].name",
                _find(root, "services", i),
                f"duplicate service name {s.name!r}",
            )
    urls = [s.url.rstrip("/") for s in cfg.services]
    for i, u in enumerate(urls):
        if urls.count(u) > 1 and urls.index(u) != i:
            loader.err(
                f"services[{i}].url", _find(root, "services", i), f"URL {u} is used by two services"
            )
    _gate_checks(cfg, root, loader)


_WILDCARD = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 (compared, never bound)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _same_socket(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listen addresses would collide (same port, overlapping hosts)."""
    (ha, pa), (hb, pb) = a, b
    if pa != pb or pa == 0:
        return False
    return ha == hb or ha in _WILDCARD or hb in _WILDCARD or (ha in _LOOPBACK and hb in _LOOPBACK)


def _url_socket(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "", port


def _gate_checks(cfg: Config, root: yaml.Node, loader: _Loader) -> None:
    """A gate's listen address must not be vLLM's, the guardian's or another gate's; its body
    budget must hold its largest body."""
    taken: list[tuple[str, tuple[str, int]]] = [("the guardian's listen", cfg.listen_address)]
    taken += [(f"services[{i}].url", _url_socket(s.url)) for i, s in enumerate(cfg.services)]
    for i, s in enumerate(cfg.services):
        if s.gate is None:
            continue
        mine = s.gate.listen_address
        for what, other in taken:
            if _same_socket(mine, other):
                loader.err(
                    f"services[{i}].gate.listen",
                    _find_path(root, "services", i, "gate", "listen"),
                    f"{s.gate.listen} is already {what}'s address; the gate needs a port of its own",
                )
                break
        taken.append((f"services[{i}].gate.listen", mine))
        _gate_key_checks(s.gate, i, root, loader)
        if problem := workers_problem(s.gate.workers, s.gate.split_limits):
            section = _find_path(root, "services", i, "gate")
            loader.err(
                f"services[{i}].gate.workers", _find_key(section, "workers") or section, problem
            )
        if s.gate.body_budget_bytes < s.gate.max_body_bytes:
            section = _find_path(root, "services", i, "gate")
            # The budget's line, or (left at its default) the line that raised max_body_bytes.
            where = _find_key(section, "body_budget_bytes") or _find_key(section, "max_body_bytes")
            loader.err(
                f"services[{i}].gate.body_budget_bytes",
                where or section,
                f"must be at least max_body_bytes ({_show_bytes(s.gate.max_body_bytes)}), "
                f"got {_show_bytes(s.gate.body_budget_bytes)}: a body of the largest size "
                "allowed must fit",
            )


def _gate_key_checks(g: GateConfig, i: int, root: yaml.Node, loader: _Loader) -> None:
    """The per-key share needs to know who a client is, in one way."""
    section = _find_path(root, "services", i, "gate")
    if g.trust_key_header and g.known_keys_sha256:
        loader.err(
            f"services[{i}].gate.trust_key_header",
            _find_key(section, "trust_key_header") or section,
            "and known_keys_sha256 exclude each other: trusting the header makes every value a "
            "client of its own",
        )
    elif g.per_key_share_ratio > 0 and not (g.trust_key_header or g.known_keys_sha256):
        loader.err(
            f"services[{i}].gate.per_key_share_ratio",
            _find_key(section, "per_key_share_ratio") or section,
            "needs known_keys_sha256 or trust_key_header: without either every request counts "
            f"as one client (a fresh {g.key_header} value per request must not buy a fresh share)",
        )


def _find_path(root: yaml.Node | None, *steps: str | int) -> yaml.Node | None:
    """The node at a path of keys and list indices; the deepest one found when it stops early."""
    node = root
    for step in steps:
        nxt: yaml.Node | None = None
        if isinstance(step, int) and isinstance(node, yaml.SequenceNode):
            nxt = node.value[step] if step < len(node.value) else None
        elif isinstance(step, str) and isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == step), None)
        if nxt is None:
            return node
        node = nxt
    return node


def _find_key(root: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if k.value == key:
                return typing.cast(yaml.Node, v)
    return None


def _find(root: yaml.Node, key: str, index: int) -> yaml.Node | None:
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if k.value == key and isinstance(v, yaml.SequenceNode) and index < len(v.value):
                return typing.cast(yaml.Node, v.value[index])
    return None


def parse_config(text: str, filename: str = "<config>") -> Config:
    """Validate YAML text into a Config, or raise ConfigInvalid with every problem found.

    Nothing else escapes: a shape no check foresaw (nesting deeper than Python's recursion
    limit, a value a check cannot handle) is still a ConfigInvalid, never a traceback.
    """
    try:
        return _parse_config(text, filename)
    except ConfigInvalid:
        raise
    except RecursionError:
        raise ConfigInvalid(
            filename, [ConfigError("", None, "nested too deeply to be a guardian config")]
        ) from None
    except Exception as e:  # reported with its reason; check-config exits 2
        raise ConfigInvalid(
            filename, [ConfigError("", None, f"cannot be validated: {type(e).__name__}: {e}")]
        ) from None


def _unknown_key(key: str, known: Iterable[str]) -> str:
    """The key it resembles when there is one (a typo), else every key allowed there."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    return f"unknown key (known keys here: {', '.join(sorted(known))})"


def yaml_error(e: yaml.YAMLError) -> tuple[int | None, str]:
    """A YAML syntax error as one line and its line number: the parser's own text spans several
    lines, quotes the input with a caret and names "<unicode string>"."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return None, f"not valid YAML: {' '.join(str(e).split())}"
    mark = e.problem_mark
    text = f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    if "'\\t'" in (e.problem or ""):  # the parser quotes the character it met
        text += " (a tab: indent with spaces)"
    opened = e.context_mark
    if (
        e.context
        and opened is not None
        and (opened.line, opened.column) != (mark.line, mark.column)
    ):
        what = e.context.removeprefix("while parsing a ").removeprefix("while scanning a ")
        text += f" (in the {what} opened at line {opened.line + 1}, column {opened.column + 1})"
    return mark.line + 1, text


Report = Callable[[tuple[str | int, ...], str], None]
"""Reports a problem at a path of keys and list indices, e.g. ``(("rules", 3, "signal"), why)``."""

_Doc = typing.TypeVar("_Doc")


def parse_document(
    cls: type[_Doc],
    text: str,
    filename: str,
    check: Callable[[_Doc, Report], None] | None = None,
) -> _Doc:
    """A YAML document (a rules file, a load profile) → an instance of the dataclass ``cls``,
    or ConfigInvalid listing every error with its key path and line.

    The walker checks what the dataclass says (keys, types, bounds); ``check`` then checks
    what only the document's own rules know and reports each problem by its path, which is
    turned here into the key path and the line of the node it names (the deepest node that
    exists when the path stops early). The YAML stays in this module: callers, the pure core
    among them, see dataclasses and paths."""
    root = _compose(text, filename)
    loader = _Loader()
    parsed = loader.build(cls, root, "")
    if isinstance(parsed, cls) and check is not None:

        def report(steps: tuple[str | int, ...], message: str) -> None:
            loader.err(_path_text(steps), _find_path(root, *steps), message)

        check(parsed, report)
    if loader.errors or not isinstance(parsed, cls):
        raise ConfigInvalid(filename, sorted(loader.errors, key=lambda e: (e.line or 0, e.path)))
    return parsed


def _compose(text: str, filename: str) -> yaml.Node | None:
    """The YAML node tree (None for an empty document), or ConfigInvalid naming the syntax
    error's line."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        line, message = yaml_error(e)
        raise ConfigInvalid(filename, [ConfigError("", line, message)]) from None


def _path_text(steps: tuple[str | int, ...]) -> str:
    """``("rules", 3, "signal")`` → ``rules[3].signal``, as the walker names paths."""
    out = ""
    for step in steps:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _parse_config(text: str, filename: str) -> Config:
    root = _compose(text, filename)
    loader = _Loader()
    if root is None:
        loader.errors.append(
            ConfigError("services", None, "the config is empty; it needs at least one service")
        )
        raise ConfigInvalid(filename, loader.errors)
    cfg = loader.build(Config, root, "")
    if isinstance(root, yaml.MappingNode) and "services" not in {k.value for k, _ in root.value}:
        loader.err("services", root, "required key is missing: list at least one vLLM service")
    if isinstance(cfg, Config):
        _cross_checks(cfg, root, loader)
    if loader.errors or not isinstance(cfg, Config):
        raise ConfigInvalid(filename, sorted(loader.errors, key=lambda e: (e.line or 0, e.path)))
    return cfg


def read_text(path: str | Path) -> str:
    """A config-like file's text; an unreadable or non-UTF-8 file, or one that is not a regular
    file, is a ConfigInvalid naming it. A FIFO put in its place would block the read until a
    writer came (the main loop, on SIGHUP): it is opened without blocking and refused."""
    p = Path(path)

    def invalid(why: str) -> ConfigInvalid:
        return ConfigInvalid(str(p), [ConfigError("", None, why)])

    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise invalid(f"cannot read: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise invalid(f"not a regular file ({_file_kind(mode)}): refusing to read it")
        with os.fdopen(os.dup(fd), encoding="utf-8") as fh:  # as Path.read_text reads
            return fh.read()
    except OSError as e:
        raise invalid(f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise invalid("not UTF-8 text") from None
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    )  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def load_config(path: str | Path) -> Config:
    return parse_config(read_text(path), str(path))
