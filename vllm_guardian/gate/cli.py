"""``vllm-guardian gate``: run one admission gate in front of one vLLM server.

Example (the guardian on its default address, vLLM on :8000, clients sent to :8001)::

    vllm-guardian gate --listen 127.0.0.1:8001 --upstream http://127.0.0.1:8000 \\
        --guardian http://127.0.0.1:9469 --service vllm

Runs on uvloop when it is installed (the ``gate`` extra brings it), on asyncio's loop if not.
SIGTERM and SIGINT stop it: queued requests are answered 503, in-flight ones get
``--shutdown-timeout`` seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from vllm_guardian.gate.admission import Limits
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

log = logging.getLogger("vllm_guardian.gate")


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-guardian gate",
        description="An admission gate in front of one vLLM server: holds requests in a bounded "
        "queue while the guardian gates the service, and across restarts.",
    )
    ap.add_argument(
        "--listen",
        type=_host_port,
        default=("127.0.0.1", 8001),
        help="HOST:PORT (default 127.0.0.1:8001)",
    )
    ap.add_argument(
        "--upstream", type=_url, required=True, help="vLLM's base URL, e.g. http://127.0.0.1:8000"
    )
    ap.add_argument(
        "--guardian",
        type=_url,
        help="the guardian's listen URL, e.g. http://127.0.0.1:9469 (default: follow vLLM's /health only)",
    )
    ap.add_argument(
        "--service",
        default="vllm",
        help="the service's name in the guardian's config (default vllm)",
    )
    q = ap.add_argument_group("queue")
    q.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting at most (default 256; 0: refuse at once while closed)",
    )
    q.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1_000_000,
        help="estimated prompt tokens waiting at most (default 1000000)",
    )
    q.add_argument(
        "--max-wait",
        type=float,
        default=60.0,
        help="seconds a request waits at most before its 503 (default 60)",
    )
    q.add_argument(
        "--release-rate",
        type=float,
        default=50.0,
        help="queued requests released per second at most (default 50; 0: no limit)",
    )
    q.add_argument(
        "--release-burst", type=int, default=8, help="of which this many at once (default 8)"
    )
    q.add_argument(
        "--per-key-share",
        type=float,
        default=0.0,
        help="share of the queue one key may hold, 0..1 (default 0: off); over it: 429",
    )
    q.add_argument(
        "--key-header",
        default="Authorization",
        help="the header that names a client for --per-key-share (default Authorization)",
    )
    q.add_argument(
        "--retry-after",
        type=int,
        default=2,
        help="Retry-After seconds on the gate's 503 and 429 (default 2)",
    )
    k = ap.add_argument_group("KV-need admission")
    k.add_argument(
        "--kv-admission",
        choices=("on", "off"),
        default="on",
        help="admit a request only if prompt + max_tokens fits in the free KV pool (on by default; needs vLLM's cache_config_info)",
    )
    k.add_argument(
        "--kv-reserve", type=float, default=0.05, help="share of the pool kept free (default 0.05)"
    )
    k.add_argument(
        "--default-output-tokens",
        type=int,
        default=256,
        help="output tokens assumed when a request sets no max_tokens (default 256)",
    )
    o = ap.add_argument_group("other")
    o.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body (default 32 MiB; over it: 413)",
    )
    o.add_argument(
        "--poll-interval",
        type=float,
        default=0.1,
        help="seconds between polls of /ready and /health (default 0.1)",
    )
    o.add_argument(
        "--kv-poll-interval",
        type=float,
        default=0.5,
        help="seconds between reads of vLLM's /metrics (default 0.5)",
    )
    o.add_argument(
        "--metrics-path",
        default="/metrics",
        help="where the gate serves its own metrics (default /metrics; vLLM's /metrics is then reached on vLLM itself)",
    )
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get on SIGTERM (default 5)",
    )
    o.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="client connections open at once; past it the longest-idle one is closed (default 4096)",
    )
    o.add_argument(
        "--idle-timeout",
        type=float,
        default=15.0,
        help="seconds a connection may sit without a request in progress, its head included (default 15)",
    )
    o.add_argument("--log-level", default="INFO")
    return ap  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> GateSettings:
    host, port = args.listen
    for name, value in (("--max-queue", args.max_queue), ("--max-queued-tokens", args.max_queued_tokens),
                        ("--release-burst", args.release_burst), ("--max-body-bytes", args.max_body_bytes)):  # fmt: skip
        if value < 0:
            raise SystemExit(f"vllm-guardian gate: {name} must be >= 0")
    if not 0 <= args.per_key_share <= 1 or not 0 <= args.kv_reserve < 1:
        raise SystemExit(
            "vllm-guardian gate: --per-key-share and --kv-reserve are ratios in [0, 1)"
        )
    if args.max_connections < 1 or args.idle_timeout <= 0:
        raise SystemExit(
            "vllm-guardian gate: --max-connections must be >= 1 and --idle-timeout > 0"
        )
    if args.max_wait <= 0 or args.poll_interval <= 0 or args.kv_poll_interval <= 0:
        raise SystemExit("vllm-guardian gate: --max-wait and the poll intervals must be > 0")
    return GateSettings(
        proxy=ProxySettings(
            upstream=args.upstream,
            service=args.service,
            max_body_bytes=args.max_body_bytes,
            default_output_tokens=args.default_output_tokens,
            key_header=args.key_header,
            metrics_path=args.metrics_path,
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
        ),
        poll_interval_seconds=args.poll_interval,
        kv_poll_interval_seconds=args.kv_poll_interval,
        max_connections=args.max_connections,
        idle_timeout_seconds=args.idle_timeout,
        shutdown_timeout_seconds=args.shutdown_timeout,
    )


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 (optional: the gate extra brings it)
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(settings: GateSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gate = Gate(settings)
    await gate.start()
    log.info(
        "gate for %s on %s:%d -> %s (guardian %s)",
        settings.proxy.service, settings.listen_host, gate.port, settings.proxy.upstream,
        settings.guardian or "none",
    )  # fmt: skip
    try:
        await stop.wait()
    finally:
        await gate.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    settings = settings_from_args(args)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
