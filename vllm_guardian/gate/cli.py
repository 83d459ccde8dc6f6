"""``vllm-guardian gate``: run one admission gate in front of one vLLM server.

From the guardian's config (what the unit ``vllm-guardian-gate@NAME.service`` runs): the
service's ``gate:`` section gives the settings, its ``url`` the upstream, the guardian's
``listen`` the ``/ready/<service>`` to follow::

    vllm-guardian gate -c /etc/vllm-guardian/config.yaml --service vllm

Ad hoc, from flags only (the guardian on its default address, vLLM on :8000, clients on :8001)::

    vllm-guardian gate --listen 127.0.0.1:8001 --upstream http://127.0.0.1:8000 \\
        --guardian http://127.0.0.1:9469 --service vllm

With both, a flag given on the command line overrides the config's value.

Runs on uvloop when it is importable, on asyncio's loop if not. Under systemd (``Type=notify``)
it sends ``READY=1`` once it listens, ``WATCHDOG=1`` from its event loop (a wedged loop stops
them and systemd restarts it) and a ``STATUS=`` line. SIGTERM and SIGINT stop it: queued
requests are answered 503, in-flight ones get ``--shutdown-timeout`` seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from vllm_guardian.config import (
    CONTINUATION_ROUTES,
    ConfigInvalid,
    SplitLimits,
    check_fallback_url,
    load_config,
    workers_problem,
)
from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.compiled import COMPILED_MODULES, compiled_modules
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings, split_settings
from vllm_guardian.gate.supervisor import RETIRE_SIGNAL, CannotListen, Supervisor, hold_port
from vllm_guardian.gate.workers import (
    DEFAULT_WORKERS_CAP,
    default_workers,
    end_with_parent,
    host_cpus,
)
from vllm_guardian.sources.gate import connect_host

log = logging.getLogger("vllm_guardian.gate")


# The flags' defaults (also the config's GateConfig defaults, tested to agree).
DEFAULTS: dict[str, Any] = {
    "listen": ("127.0.0.1", 8001),
    "guardian": None,
    "service": "vllm",
    "max_queue": 1024,
    "max_queued_tokens": 1_000_000,
    "max_wait": 60.0,
    "restart_extra_wait": 30.0,
    "release_rate": 50.0,
    "release_burst": 8,
    "per_key_share": 0.0,
    "key_header": "Authorization",
    "known_keys_sha256": (),
    "trust_key_header": "off",
    "retry_after": 2,
    "kv_admission": "off",
    "kv_reserve": 0.05,
    "default_output_tokens": 256,
    "max_body_bytes": 32 * 1024 * 1024,
    "body_timeout": 30.0,
    "body_min_rate": 1024,
    "body_budget_bytes": 256 * 1024 * 1024,
    "poll_interval": 0.1,
    "kv_poll_interval": 0.5,
    "stall_hold": 10.0,
    "take_back_hung": "off",
    "metrics_path": "/metrics",
    "shutdown_timeout": 5.0,
    "continuation": "on",
    "max_continuations": 1,
    "continuation_off_routes": (),
    "fallback_url": None,
    "fallback_after": 10.0,
    "log_level": "INFO",
    "workers": 1,
    "worker_of": None,
    "control_dir": None,
}


class UsageError(Exception):
    """Bad flags or config for the gate: one line that says what is wrong (exit 2)."""


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT")
    return text.rstrip("/")


def _shown(key: str) -> str:
    """A flag's default as its help states it: from DEFAULTS, so the text cannot drift."""
    value = DEFAULTS[key]
    if key == "listen":
        return f"{value[0]}:{value[1]}"
    if key.endswith("_bytes"):
        return f"{value // (1024 * 1024)} MiB"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    # Defaults are SUPPRESS: only the flags actually given reach the namespace, so a flag can
    # override the config while an absent one leaves the config's value (DEFAULTS otherwise).
    ap = argparse.ArgumentParser(
        prog="vllm-guardian gate",
        description="An admission gate in front of one vLLM server: holds requests in a bounded "
        "queue while the guardian gates the service, and across restarts. Settings come from the "
        "service's gate: section in the guardian's config (-c, --service) or from the flags; a "
        "flag given overrides the config.",
        argument_default=argparse.SUPPRESS,
    )
    ap.add_argument(
        "-c",
        "--config",
        help="the guardian's config; the gate of --service is read from its gate: section",
    )
    ap.add_argument(
        "--listen",
        type=_host_port,
        help=f"HOST:PORT (default {_shown('listen')})",
    )
    ap.add_argument(
        "--upstream",
        type=_url,
        help="vLLM's base URL, e.g. http://127.0.0.1:8000 (with -c: the service's url)",
    )
    ap.add_argument(
        "--guardian",
        type=_url,
        help="the guardian's listen URL, e.g. http://127.0.0.1:9469 (default: follow vLLM's /health only; with -c: the config's listen)",
    )
    ap.add_argument(
        "--service",
        help=f"the service's name in the guardian's config (default {_shown('service')})",
    )
    q = ap.add_argument_group("queue")
    q.add_argument(
        "--max-queue",
        type=int,
        help=f"requests waiting at most (default {_shown('max_queue')}; 0: refuse at once while closed)",
    )
    q.add_argument(
        "--max-queued-tokens",
        type=int,
        help=f"estimated prompt tokens waiting at most (default {_shown('max_queued_tokens')})",
    )
    q.add_argument(
        "--max-wait",
        type=float,
        help=f"seconds a request waits at most before its 503 (default {_shown('max_wait')})",
    )
    q.add_argument(
        "--restart-extra-wait",
        type=float,
        help="seconds longer a request held while the guardian restarts or relaunches vLLM may "
        "wait, never past the client's own timeout "
        f"(default {_shown('restart_extra_wait')}; 0: no longer)",
    )
    q.add_argument(
        "--release-rate",
        type=float,
        help=f"queued requests released per second at most (default {_shown('release_rate')}; 0: no limit)",
    )
    q.add_argument(
        "--release-burst",
        type=int,
        help=f"of which this many at once (default {_shown('release_burst')})",
    )
    q.add_argument(
        "--per-key-share",
        type=float,
        help=f"share of the queue one key may hold, 0..1 (default {_shown('per_key_share')}; 0: off); over it: 429",
    )
    q.add_argument(
        "--key-header",
        help=f"the header that names a client for --per-key-share (default {_shown('key_header')})",
    )
    q.add_argument(
        "--known-key-sha256",
        dest="known_keys_sha256",
        action="append",
        metavar="HEX",
        help="SHA-256 of a --key-header value that is a client of its own (repeat it); every "
        "other request counts as one client together",
    )
    q.add_argument(
        "--trust-key-header",
        choices=("on", "off"),
        help="every --key-header value is a client of its own: only when a proxy in front "
        f"authenticates clients and sets that header itself (default {_shown('trust_key_header')})",
    )
    q.add_argument(
        "--retry-after",
        type=int,
        help=f"Retry-After seconds on the gate's 503 and 429 (default {_shown('retry_after')})",
    )
    k = ap.add_argument_group("KV-need admission")
    k.add_argument(
        "--kv-admission",
        choices=("on", "off"),
        help=f"admit a request only if prompt + max_tokens fits in the free KV pool (default {_shown('kv_admission')}; needs vLLM's cache_config_info)",
    )
    k.add_argument(
        "--kv-reserve",
        type=float,
        help=f"share of the pool kept free (default {_shown('kv_reserve')})",
    )
    k.add_argument(
        "--default-output-tokens",
        type=int,
        help=f"output tokens assumed when a request sets no max_tokens (default {_shown('default_output_tokens')})",
    )
    o = ap.add_argument_group("other")
    o.add_argument(
        "--max-body-bytes",
        type=int,
        help=f"largest request body (default {_shown('max_body_bytes')}; over it: 413)",
    )
    o.add_argument(
        "--body-timeout",
        type=float,
        help=f"seconds a request body may take to arrive whole (default {_shown('body_timeout')}; past it: 408)",
    )
    o.add_argument(
        "--body-min-rate",
        type=int,
        help=f"bytes/s a request body must keep up over each 5 s (default {_shown('body_min_rate')}; 0: none; below it: 408)",
    )
    o.add_argument(
        "--body-budget-bytes",
        type=int,
        help=f"bytes of request bodies held at once, all requests together (default {_shown('body_budget_bytes')}, at "
        "least --max-body-bytes); a body that would pass it waits up to 2 s, then gets 503",
    )
    o.add_argument(
        "--poll-interval",
        type=float,
        help=f"seconds between polls of /ready and /health (default {_shown('poll_interval')})",
    )
    o.add_argument(
        "--kv-poll-interval",
        type=float,
        help=f"seconds between reads of vLLM's /metrics (default {_shown('kv_poll_interval')})",
    )
    o.add_argument(
        "--stall-hold",
        type=float,
        help="hold new requests when requests are in vLLM and it made no progress (no token "
        "counted, no KV block taken or freed, no preemption) for this many seconds: a hung "
        f"engine (default {_shown('stall_hold')}; 0: off)",
    )
    o.add_argument(
        "--take-back-hung",
        choices=("on", "off"),
        help="while --stall-hold holds, close the upstream connections of the requests the hung "
        "engine holds and send them again (or continue them) once it is served again: "
        f"experimental (default {_shown('take_back_hung')}; docs/gate.md, 'Across a hang')",
    )
    o.add_argument(
        "--metrics-path",
        help=f"where the gate serves its own metrics (default {_shown('metrics_path')}; vLLM's /metrics is then reached on vLLM itself)",
    )
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        help=f"seconds in-flight requests get on SIGTERM (default {_shown('shutdown_timeout')})",
    )
    o.add_argument(
        "--continuation",
        choices=("on", "off"),
        help=f"continue a streamed /v1/completions or /v1/chat/completions the upstream cuts, on the next ready server (default {_shown('continuation')})",
    )
    o.add_argument(
        "--max-continuations",
        type=int,
        help=f"continuations of one request at most (default {_shown('max_continuations')})",
    )
    o.add_argument(
        "--continuation-off-route",
        dest="continuation_off_routes",
        action="append",
        choices=CONTINUATION_ROUTES,
        help="do not continue the streams of this route while --continuation is on (repeat it)",
    )
    o.add_argument(
        "--fallback-url",
        help="another replica of the same model (e.g. its Kubernetes Service): a continuation "
        "or a held completion that waited --fallback-after for this server goes there "
        "instead (default: none, off)",
    )
    o.add_argument(
        "--fallback-after",
        type=float,
        help="seconds a continuation or a held completion waits for this server before "
        f"the fallback (default {_shown('fallback_after')})",
    )
    o.add_argument(
        "--workers",
        type=int,
        help="worker processes on the listen port, each with an even share of the limits "
        f"(default {_shown('workers')}: one per CPU this process may use, at most "
        f"{DEFAULT_WORKERS_CAP}; 1: one process; docs/gate.md, 'More than one core')",
    )
    # Set by the parent on the workers it starts (gate/supervisor.py), not by hand.
    o.add_argument("--worker-of", help=argparse.SUPPRESS)
    o.add_argument("--control-dir", help=argparse.SUPPRESS)
    o.add_argument("--log-level", help="DEBUG, INFO (default), WARNING, ERROR")
    return ap  # fmt: skip


def _guardian_url(listen: tuple[str, int]) -> str:
    """The URL to reach the guardian's listener from this host (a wildcard means loopback)."""
    host = connect_host(listen[0])
    return f"http://[{host}]:{listen[1]}" if ":" in host else f"http://{host}:{listen[1]}"


def values_from_config(path: str, service: str) -> dict[str, Any]:
    """The flags' values for ``service`` from the guardian's config (raises UsageError)."""
    try:
        cfg = load_config(path)
    except ConfigInvalid as e:
        raise UsageError(f"the config is invalid:\n{e}") from None
    svc = cfg.service(service)
    if svc is None:
        names = ", ".join(s.name for s in cfg.services)
        raise UsageError(f"{path} has no service {service!r} (its services: {names})")
    g = svc.gate
    if g is None:
        raise UsageError(
            f"service {service!r} in {path} has no gate: section (add one, docs/gate.md)"
        )
    return {
        "listen": g.listen_address,
        "upstream": svc.url.rstrip("/"),
        "guardian": _guardian_url(cfg.listen_address) if g.follow_guardian else None,
        "service": svc.name,
        "max_queue": g.max_queue_requests,
        "max_queued_tokens": g.max_queued_tokens,
        "max_wait": g.max_wait_seconds,
        "restart_extra_wait": g.restart_extra_wait_seconds,
        "release_rate": g.release_rate_per_second,
        "release_burst": g.release_burst,
        "per_key_share": g.per_key_share_ratio,
        "key_header": g.key_header,
        "known_keys_sha256": g.known_keys_sha256,
        "trust_key_header": "on" if g.trust_key_header else "off",
        "retry_after": g.retry_after_seconds,
        "kv_admission": "on" if g.kv_admission else "off",
        "kv_reserve": g.kv_reserve_ratio,
        "default_output_tokens": g.default_output_tokens,
        "max_body_bytes": g.max_body_bytes,
        "body_timeout": g.body_timeout_seconds,
        "body_min_rate": g.body_min_rate_bytes_per_second,
        "body_budget_bytes": g.body_budget_bytes,
        "poll_interval": g.poll_interval_seconds,
        "kv_poll_interval": g.kv_poll_interval_seconds,
        "stall_hold": g.stall_hold_seconds,
        "take_back_hung": "on" if g.take_back_hung else "off",
        "metrics_path": g.metrics_path,
        "shutdown_timeout": g.shutdown_timeout_seconds,
        "continuation": "on" if g.continuation else "off",
        "max_continuations": g.max_continuations,
        "continuation_off_routes": g.continuation_off_routes,
        "fallback_url": g.fallback_url,
        "fallback_after": g.fallback_after_seconds,
        "workers": g.workers,
    }


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """DEFAULTS, then the config's gate section (with -c), then the flags given."""
    given = dict(vars(args))
    values = dict(DEFAULTS)
    config = given.pop("config", None)
    if config is not None:
        values.update(values_from_config(config, given.get("service", DEFAULTS["service"])))
    values.update(given)
    if values.get("upstream") is None:
        raise UsageError("--upstream is required without -c CONFIG")
    return argparse.Namespace(**values)


def settings_from_args(args: argparse.Namespace) -> GateSettings:
    """Settings from the parsed command line (after :func:`resolve`); raises UsageError."""
    args = resolve(args)
    host, port = args.listen
    for name, value in (("--max-queue", args.max_queue), ("--max-queued-tokens", args.max_queued_tokens),
                        ("--release-burst", args.release_burst), ("--max-body-bytes", args.max_body_bytes)):  # fmt: skip
        if value < 0:
            raise UsageError(f"{name} must be >= 0")
    if not 0 <= args.per_key_share <= 1 or not 0 <= args.kv_reserve < 1:
        raise UsageError("--per-key-share and --kv-reserve are ratios in [0, 1)")
    if args.max_wait <= 0 or args.poll_interval <= 0 or args.kv_poll_interval <= 0:
        raise UsageError("--max-wait and the poll intervals must be > 0")
    if args.stall_hold < 0:
        raise UsageError("--stall-hold must be >= 0 (0: off)")
    if args.restart_extra_wait < 0:
        raise UsageError("--restart-extra-wait must be >= 0 (0: no longer)")
    known = frozenset(k.lower() for k in args.known_keys_sha256)
    if any(not re.fullmatch(r"[0-9a-f]{64}", k) for k in known):
        raise UsageError("--known-key-sha256 takes a SHA-256 digest: 64 hex digits")
    trust = args.trust_key_header == "on"
    if trust and known:
        raise UsageError("--trust-key-header on and --known-key-sha256 exclude each other")
    if args.per_key_share > 0 and not (trust or known):
        raise UsageError(
            "--per-key-share needs --known-key-sha256 or --trust-key-header on: without either "
            "every request counts as one client"
        )
    if args.body_timeout <= 0 or args.body_min_rate < 0:
        raise UsageError("--body-timeout must be > 0 and --body-min-rate >= 0 (0: no floor)")
    if args.body_budget_bytes < args.max_body_bytes:
        raise UsageError(
            f"--body-budget-bytes ({args.body_budget_bytes}) must be at least --max-body-bytes "
            f"({args.max_body_bytes}): a body of the largest size allowed must fit"
        )
    if args.max_continuations < 0:
        raise UsageError("--max-continuations must be >= 0")
    if args.fallback_url is not None and (problem := check_fallback_url(args.fallback_url)):
        raise UsageError(f"--fallback-url {problem}")  # not the value: it may hold a secret
    if args.fallback_after < 0:
        raise UsageError("--fallback-after must be >= 0")
    return GateSettings(
        proxy=ProxySettings(
            upstream=args.upstream,
            service=args.service,
            max_body_bytes=args.max_body_bytes,
            body_timeout_seconds=args.body_timeout,
            body_min_rate_bytes_per_second=args.body_min_rate,
            body_budget_bytes=args.body_budget_bytes,
            default_output_tokens=args.default_output_tokens,
            key_header=args.key_header,
            known_keys_sha256=known,
            trust_key_header=trust,
            metrics_path=args.metrics_path,
            continuation=args.continuation == "on",
            max_continuations=args.max_continuations,
            continuation_off_routes=frozenset(args.continuation_off_routes),
            fallback_url=args.fallback_url.rstrip("/") if args.fallback_url else None,
            fallback_after_seconds=args.fallback_after,
            # The guardian's stall wait (signals.stall_seconds, 30 s) is three holds (10 s).
            taken_back_extra_wait_seconds=2 * args.stall_hold,
        ),
        listen_host=host,
        listen_port=port,
        guardian=args.guardian,
        limits=Limits(
            max_queue_requests=args.max_queue,
            max_queued_tokens=args.max_queued_tokens,
            max_wait_seconds=args.max_wait,
            release_rate_per_second=args.release_rate,
            release_burst=max(1, args.release_burst),
            per_key_share_ratio=args.per_key_share,
            kv_admission=args.kv_admission == "on",
            kv_reserve_ratio=args.kv_reserve,
            retry_after_seconds=args.retry_after,
            restart_extra_wait_seconds=args.restart_extra_wait,
        ),
        poll_interval_seconds=args.poll_interval,
        kv_poll_interval_seconds=args.kv_poll_interval,
        stall_hold_seconds=args.stall_hold,
        take_back_hung=args.take_back_hung == "on",
        shutdown_timeout_seconds=args.shutdown_timeout,
    )


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 (a dependency, except on Windows)
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Notifier:
    """sd_notify for the gate: silent without NOTIFY_SOCKET; the watchdog period from systemd."""

    def __init__(self) -> None:
        self._impl: Any = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify  # noqa: PLC0415  # only under systemd

            self._impl = sdnotify.SystemdNotifier()
        usec = os.environ.get("WATCHDOG_USEC", "")
        wpid = os.environ.get("WATCHDOG_PID")
        ours = not wpid or wpid == str(os.getpid())
        self.watchdog_seconds = (
            int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and ours else None
        )

    def notify(self, state: str) -> None:
        if self._impl is not None:
            self._impl.notify(state)


def status_line(gate: Gate) -> str:
    return merged_status_line(gate.proxy.status() if gate.proxy is not None else {})


def merged_status_line(st: Mapping[str, object]) -> str:
    """systemd's STATUS= line from a status document (one gate's, or the workers' sum)."""
    state = "open" if st.get("open") else f"held ({st.get('reason', '?')})"
    line = f"{state}; in flight {st.get('in_flight', 0)}, queued {st.get('queue_depth', 0)}"
    if "workers" in st:
        line += f"; workers {st.get('workers_answered')}/{st.get('workers')}"
    return line[:400]


async def _heartbeat(gate: Gate, notifier: _Notifier) -> None:
    """WATCHDOG=1 and STATUS= from the event loop itself: a wedged loop stops both, and
    systemd's WatchdogSec= restarts the gate."""
    period = notifier.watchdog_seconds / 3 if notifier.watchdog_seconds else 5.0
    while True:
        msgs = [f"STATUS={status_line(gate)}"]
        if notifier.watchdog_seconds:
            msgs.append("WATCHDOG=1")
        notifier.notify("\n".join(msgs))
        await asyncio.sleep(min(period, 5.0))


# Young-generation collections at most every this many surviving container objects (Python's
# default is 700): at tens of thousands of events a second the default runs one every few
# events, and each promotes live per-stream objects towards the full collections that stalled
# every stream for tens of milliseconds at a few thousand streams.
GC_GEN0_THRESHOLD = 20_000


def tame_collector() -> None:
    """Once the gate is up: what start-up allocated (modules, settings, the server) is moved
    out of the collector's sight, so a full collection walks only the live requests' objects;
    and the young generation is sized for the hot path."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def _serve(settings: GateSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    retire = asyncio.Event()
    if settings.control_dir is not None:  # a worker: its parent's reload retires it
        loop.add_signal_handler(RETIRE_SIGNAL, retire.set)
    gate = Gate(settings)
    notifier = _Notifier()
    try:
        await gate.start()
    except OSError as e:
        await gate.stop()
        raise UsageError(
            f"cannot listen on {settings.listen_host}:{settings.listen_port}: {e.strerror or e}"
        ) from None
    tame_collector()
    compiled = compiled_modules()
    log.info(
        "gate for %s on %s:%d -> %s (guardian %s); %s",
        settings.proxy.service, settings.listen_host, gate.port, settings.proxy.upstream,
        settings.guardian or "none",
        f"compiled: {len(compiled)} of {len(COMPILED_MODULES)} modules of its request path"
        if compiled else "runs as Python (not compiled)",
    )  # fmt: skip
    notifier.notify(f"READY=1\nSTATUS={status_line(gate)}")
    beat = loop.create_task(_heartbeat(gate, notifier), name="gate-heartbeat")
    try:
        await _until_stopped(gate, stop, retire)
    finally:
        notifier.notify("STOPPING=1")
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await gate.stop()


def worker_count(args: argparse.Namespace, settings: GateSettings) -> int:
    """How many workers (after :func:`resolve`): ``--workers``/``workers``, or from the host
    when 0; raises UsageError when the limits cannot be split that far."""
    lim, proxy = settings.limits, settings.proxy
    limits = SplitLimits(
        max_queue_requests=lim.max_queue_requests,
        max_queued_tokens=lim.max_queued_tokens,
        body_budget_bytes=proxy.body_budget_bytes,
        max_body_bytes=proxy.max_body_bytes,
        kv_admission=lim.kv_admission,
    )

    n = int(args.workers)
    if n < 0:
        raise UsageError("--workers must be >= 0 (0: from the host)")
    if n == 0:
        if not hasattr(socket, "SO_REUSEPORT"):
            return 1
        return default_workers(host_cpus(), limits)
    if n > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise UsageError("--workers above 1 needs SO_REUSEPORT (Linux)")
    if why := workers_problem(n, limits):
        raise UsageError(f"--workers {n}: {why}")
    return n


def _as_worker(args: argparse.Namespace, settings: GateSettings) -> GateSettings:
    """A worker's settings: its share of the limits (gate/workers.py)."""
    parts = str(args.worker_of).split("/")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or args.control_dir is None:
        raise UsageError(
            "--worker-of takes I/N/PARENT with --control-dir (set by the gate's parent)"
        )
    index, n, parent = (int(p) for p in parts)
    # The parent's own SIGHUP replaces the workers; a worker is never reloaded in place.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    end_with_parent(parent)
    return dataclasses.replace(
        split_settings(settings, index, n), control_dir=args.control_dir, workers=n
    )


def _supervise(argv: Sequence[str], settings: GateSettings, n: int) -> int:
    try:
        held = hold_port(settings.listen_host, settings.listen_port)
    except CannotListen as e:
        print(f"vllm-guardian gate: {e}", file=sys.stderr)
        return 1
    notifier = _Notifier()
    with held:
        sup = Supervisor(
            argv,
            n,
            settings.listen_host,
            int(held.getsockname()[1]),
            shutdown_timeout_seconds=settings.shutdown_timeout_seconds,
            notify=notifier.notify,
            watchdog_seconds=notifier.watchdog_seconds,
            status_line=merged_status_line,
        )
        return sup.run()


async def _until_stopped(gate: Gate, stop: asyncio.Event, retire: asyncio.Event) -> None:
    """Until SIGTERM/SIGINT, or, in a worker, until its parent's reload retired it and it
    holds no request any more (Gate.retire)."""
    stopped = asyncio.ensure_future(stop.wait())
    retired = asyncio.ensure_future(retire.wait())
    try:
        await asyncio.wait({stopped, retired}, return_when=asyncio.FIRST_COMPLETED)
        if retire.is_set() and not stop.is_set():
            log.info("gate worker %d: retiring (a reload): no new connections", os.getpid())
            drained = asyncio.ensure_future(gate.retire())
            await asyncio.wait({stopped, drained}, return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
    finally:
        stopped.cancel()
        retired.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 after SIGTERM/SIGINT, 2 for bad flags or config, 1 when it cannot listen."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        args = resolve(args)
    except UsageError as e:
        print(f"vllm-guardian gate: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=str(args.log_level).upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    try:
        settings = settings_from_args(args)
        if args.worker_of is not None:
            settings = _as_worker(args, settings)
        elif (n := worker_count(args, settings)) > 1:
            return _supervise(argv, settings, n)
    except UsageError as e:
        print(f"vllm-guardian gate: {e}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_serve(settings))
    except UsageError as e:
        print(f"vllm-guardian gate: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
