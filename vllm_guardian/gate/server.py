"""Assembling one gate: settings, the HTTP server, the upstream client, the follower.

:class:`Gate` is what ``vllm-guardian gate`` runs and what the tests start in-process (on a
loop of their own): ``await gate.start()`` binds and begins following the guardian,
``await gate.stop()`` stops accepting, lets nothing dangle (queued requests get 503, open
upstream connections are closed) and returns.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_guardian.gate.admission import Admission, Limits
from vllm_guardian.gate.connections import (
    ConnectionGuard,
    MalformedRequests,
    fit_descriptor_limit,
)
from vllm_guardian.gate.follower import Follower
from vllm_guardian.gate.http1 import HttpServer, Request, Response, json_response
from vllm_guardian.gate.looplag import LoopLag
from vllm_guardian.gate.metrics import CONTENT_TYPE, GateMetrics
from vllm_guardian.gate.proxy import STATUS_PATH, GateProxy, ProxySettings
from vllm_guardian.gate.upstream import UpstreamPool
from vllm_guardian.gate.workers import ControlServer, gate_metrics, gate_status, share

log = logging.getLogger("vllm_guardian.gate")

# A retiring worker looks this often whether its queue is empty.
RETIRE_CHECK_SECONDS = 0.1


@dataclass(frozen=True)
class GateSettings:
    proxy: ProxySettings
    listen_host: str = "127.0.0.1"
    listen_port: int = 8001  # 0: any free port (tests)
    guardian: str | None = None
    limits: Limits = field(default_factory=Limits)
    poll_interval_seconds: float = 0.1
    kv_poll_interval_seconds: float = 0.5
    suspect_seconds: float = 1.0
    # An open gate stays open while /health is silent (no answer in time) for this long: a busy
    # vLLM answers it late while it serves (follower.py).
    health_grace_seconds: float = 3.0
    # Requests in vLLM and no progress this long: hold new ones (gate/progress.py).
    stall_hold_seconds: float = 10.0
    # While it holds, take back what the hung engine holds (follower.py): off by default, see
    # docs/gate.md ("Across a hang").
    take_back_hung: bool = False
    shutdown_timeout_seconds: float = 5.0
    # Client connections open at once (each also holds one to vLLM while busy); past it the
    # longest-idle one is closed. Idle (head not sent yet, or kept alive): closed after this,
    # well past the clients' own keep-alive (aiohttp 15 s, httpx 5 s), so the client closes
    # first and never sends on a connection being closed; nginx waits 60 s for a head too.
    max_connections: int = 4096
    idle_timeout_seconds: float = 60.0
    # Malformed requests: counted, and at most one WARNING line per this long (connections.py).
    malformed_log_interval_seconds: float = 60.0
    # One of several workers on the port (gate/workers.py): the listen socket is bound with
    # SO_REUSEPORT, the worker answers its own status on a unix socket in control_dir, and
    # GET /gate/status answers the sum over the workers. None: the gate is one process.
    control_dir: str | None = None
    workers: int = 1


def split_settings(settings: GateSettings, index: int, workers: int) -> GateSettings:
    """Worker ``index``'s :class:`GateSettings`: even shares of the queue's bounds, the release
    rate and burst, the body budget and the connection cap; everything else as given. The
    per-key share stays a ratio (of the worker's queue)."""
    s, lim = settings, settings.limits
    return replace(
        s,
        limits=replace(
            lim,
            max_queue_requests=share(lim.max_queue_requests, index, workers),
            max_queued_tokens=share(lim.max_queued_tokens, index, workers),
            release_rate_per_second=lim.release_rate_per_second / workers,
            release_burst=max(1, share(lim.release_burst, index, workers)),
        ),
        proxy=replace(s.proxy, body_budget_bytes=share(s.proxy.body_budget_bytes, index, workers)),
        max_connections=max(1, share(s.max_connections, index, workers)),
    )


class Gate:
    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self.metrics = GateMetrics(settings.proxy.service)
        self._server: HttpServer | None = None
        self._listener: asyncio.Server | None = None
        self._pool: UpstreamPool | None = None  # the proxied exchanges
        self._fallback_pool: UpstreamPool | None = None  # ProxySettings.fallback_url's
        self.admission: Admission | None = None
        self.follower: Follower | None = None
        self.proxy: GateProxy | None = None
        self.port = settings.listen_port
        self._control: ControlServer | None = None
        self.loop_lag = LoopLag(self.metrics.loop_lag_seconds)

    async def start(self) -> None:
        s = self.settings
        self.admission = Admission(s.limits, self.metrics)
        self._pool = UpstreamPool(
            s.proxy.upstream,
            connect_timeout_seconds=s.proxy.connect_timeout_seconds,
            on_stale_retry=self.metrics.stale_connections.inc,
        )
        self.follower = Follower(
            self.admission,
            upstream=s.proxy.upstream,
            guardian=s.guardian,
            service=s.proxy.service,
            poll_interval_seconds=s.poll_interval_seconds,
            kv_poll_interval_seconds=s.kv_poll_interval_seconds,
            suspect_seconds=s.suspect_seconds,
            health_grace_seconds=s.health_grace_seconds,
            stall_hold_seconds=s.stall_hold_seconds,
            take_back=self._pool.take_back if s.take_back_hung else None,
            # What a taken back request may wait (proxy.py): the gate holds for it that long.
            take_back_wait_seconds=s.limits.max_wait_seconds
            + s.proxy.taken_back_extra_wait_seconds,
            last_answer_data=lambda: self._pool.last_data_monotonic if self._pool else None,
        )
        malformed = MalformedRequests(self.metrics, s.malformed_log_interval_seconds)
        if s.proxy.fallback_url is not None:
            self._fallback_pool = UpstreamPool(
                s.proxy.fallback_url,
                connect_timeout_seconds=s.proxy.connect_timeout_seconds,
                on_stale_retry=self.metrics.stale_connections.inc,
            )
        self.proxy = GateProxy(
            s.proxy, self.admission, self.follower, self._pool, self.metrics, malformed,
            self._fallback_pool, self.loop_lag.max_seconds, lambda: self.loop_lag.busy_share,
        )  # fmt: skip
        self.loop_lag.start()
        self.admission.start()
        await self.follower.poll_once()  # know the state before the first request
        self.follower.start()
        cap, why = fit_descriptor_limit(s.max_connections)
        if why is not None:
            log.warning("gate: %s", why)
        guard = ConnectionGuard(
            max_connections=cap,
            idle_timeout_seconds=s.idle_timeout_seconds,
            metrics=self.metrics,
        )
        guard.start()
        self._server = HttpServer(
            self.proxy.handle if s.control_dir is None else self._handle_as_worker,
            guard,
            malformed,
            asyncio.get_running_loop(),
        )
        family = socket.AF_INET6 if ":" in s.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if s.control_dir is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((s.listen_host, s.listen_port))
        except OSError:
            sock.close()
            await guard.stop()
            raise
        self.port = int(sock.getsockname()[1])
        self._listener = await asyncio.get_running_loop().create_server(
            self._server, sock=sock, backlog=1024
        )
        if s.control_dir is not None:
            self._control = ControlServer(
                Path(s.control_dir), self.proxy.status, self.metrics.render
            )
            await self._control.start()

    async def _handle_as_worker(
        self, request: Request, body_read: Callable[[], None] = lambda: None
    ) -> Response:
        """A worker's handler: the gate's status and metrics are the workers' sums, the rest is
        the proxy's."""
        if request.method == "GET" and request.path == STATUS_PATH:
            assert self.proxy is not None
            assert self.settings.control_dir is not None
            doc = await gate_status(
                Path(self.settings.control_dir), self.settings.workers, self.proxy.status()
            )
            return json_response(doc)
        if request.method == "GET" and request.path == self.settings.proxy.metrics_path:
            assert self.settings.control_dir is not None
            body = await gate_metrics(Path(self.settings.control_dir), self.metrics.render())
            return Response(body=body, headers={"Content-Type": CONTENT_TYPE})
        assert self.proxy is not None
        return await self.proxy.handle(request, body_read)

    async def retire(self) -> None:
        """A reload's old worker (gate/supervisor.py), before :meth:`stop`: stop taking
        connections (its successor on the port takes them), close each open one once its
        exchange ends, and wait until this worker has no exchange left: what it holds is
        released to vLLM as it would have been (or refused at its own ``max_wait``), what it
        has in flight finishes. At most the longest a held request may wait; what is left then
        gets ``shutdown_timeout_seconds`` from :meth:`stop`, as on SIGTERM."""
        if self._server is None or self._listener is None or self.proxy is None:
            return
        self._listener.close()
        self._server.retire()
        lim = self.settings.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.max_wait_seconds + lim.restart_extra_wait_seconds + 1.0
        while self.proxy.open_exchanges > 0 and loop.time() < deadline:
            await asyncio.sleep(RETIRE_CHECK_SECONDS)

    async def stop(self) -> None:
        await self.loop_lag.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self.admission is not None:
            await self.admission.stop()
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            await self._server.shutdown(self.settings.shutdown_timeout_seconds)
        if self._pool is not None:
            self._pool.close()
        if self._fallback_pool is not None:
            self._fallback_pool.close()
        # Last: a draining worker's in-flight requests stay in its siblings' sum until done.
        if self._control is not None:
            await self._control.stop()

    async def serve_forever(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
