"""The reverse proxy: every path of vLLM's API, passed through, with admission for the work.

One exchange, in order:

1. the request body is read (``body.py``): at most ``max_body_bytes`` (413 past it, before
   reading it when ``Content-Length`` says so), whole within ``body_timeout_seconds`` and no
   slower than the rate floor (408), within the gate-wide body budget (503). It is kept in
   memory on purpose: a held request must be sent later, possibly twice, and its prompt is
   what the KV estimate reads. Once it is read the connection counts as busy (until then the
   connection guard may close it to make room: ``connections.py``);
2. a POST (work for vLLM) goes through :class:`~vllm_guardian.gate.admission.Admission`: it
   waits in the FIFO queue while the gate is closed or the KV pool is short, or gets an honest
   503 (+ ``Retry-After``) / 429 in OpenAI's error shape. GETs (``/health``, ``/v1/models``,
   ``/metrics`` …) pass straight through: they cost vLLM nothing and must tell the truth;
3. the request goes upstream with the client's headers (``Authorization`` included) minus the
   hop-by-hop ones, through the keep-alive pool of ``upstream.py``; bodies are neither decoded
   nor re-encoded;
4. nothing is sent to the client until the upstream's first body bytes (or its end) arrive.
   Until then a failed exchange — refused, reset, or vLLM's "going away" 500 (``cannot schedule
   new futures after shutdown``, ``EngineDeadError``): the request never ran, or its answer was
   never sent — is retried once, at the head of the queue, so it waits for the new instance. A
   unary request is answered whole or not at all, so this covers it entirely; that includes
   vLLM's answer to a unary completion it aborted as it shut down (HTTP 200, ``finish_reason:
   "abort"``: not an answer), which the proxy reads whole before committing. Past the one
   retry the client gets that answer as vLLM sent it. After that the
   answer is committed and streamed chunk by chunk as it arrives, at the client's pace
   (``write`` waits for the socket, so a slow client slows the upstream read instead of
   filling memory). A streamed completion or chat completion the upstream cuts after that is continued
   where the client's text ends (``relay.py``, ``continuation.py``) unless the request is one a
   continuation cannot serve honestly; any other stream the upstream cuts is cut for the
   client too, never replayed;
5. while the follower's progress watch sees the engine hung, the exchanges it could still save
   (not answered yet and not retried yet; a continued stream with continuations left) are
   taken back: their upstream connection is closed (``UpstreamPool.take_back``), which vLLM
   reads as an abort, and they go the way of 4, waiting at the head of the queue for the
   restarted engine (the follower keeps the gate closed until the engine is a new one, or the
   same one generates again: ``follower.py``);
6. a client that goes away cancels the handler (``http1.py``): a queued request
   leaves the queue; a forwarded one has its upstream connection closed, which is how vLLM
   learns to abort it and free its KV blocks.

vLLM's own answers, errors included, go back untouched: status, reason, headers (less
hop-by-hop) and bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from multidict import CIMultiDict

from vllm_guardian.gate import continuation
from vllm_guardian.gate.admission import Admission, Cost, Rejected, Ticket, cost_of
from vllm_guardian.gate.body import (
    BodyBudget,
    BodyLimits,
    BodyMalformed,
    BodyRefusal,
    BodyRefused,
    HeldBody,
    read_body,
)
from vllm_guardian.gate.continuation import Outcome, Plan, Refusal
from vllm_guardian.gate.follower import Follower
from vllm_guardian.gate.gone import ClientGone
from vllm_guardian.gate.http1 import (
    Request,
    Response,
    StreamResponse,
    json_response,
    openai_error,
)
from vllm_guardian.gate.metrics import CONTENT_TYPE, GateMetrics
from vllm_guardian.gate.progress import (
    GIVEN_UP_MIN_SECONDS,
    UNANSWERED_FORGET_SECONDS,
    Unanswered,
    abandoned,
    still_unanswered,
)
from vllm_guardian.gate.relay import FALLBACK_HEADER, ContinuingRelay, Fallback, RelaySettings
from vllm_guardian.gate.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from vllm_guardian.lowio.redact import redact_text

log = logging.getLogger("vllm_guardian.gate")

# RFC 9110 §7.6.1 hop-by-hop fields, plus what the proxy itself frames or negotiates. Names
# listed in a request's own ``Connection`` header are deliberately NOT removed: that would let a
# client strip ``Authorization`` (or anything else) on its way to vLLM.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
        "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    }
)  # fmt: skip
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
# vLLM's answers that mean "this server is going away, or its engine died under the request":
# a request without an answer yet is safe to send once more to the next instance.
DYING_MARKERS = tuple(m.encode() for m in continuation.DYING_MARKERS)
DYING_BODY_MAX_BYTES = 64 * 1024
# What a relayed stream carries when vLLM ended it without serving it: its error event for a
# dead engine, or its chunk with finish_reason "abort" (counted as a cut the gate refused).
CUT_MARKERS = (*DYING_MARKERS, continuation.ABORT_MARKER)
# A unary answer to a completion is read whole up to this before a byte of it goes to the
# client, to tell vLLM's aborted answer (HTTP 200, finish_reason "abort") from an answer.
# vLLM writes a unary answer at once, whole; a longer one is relayed unread (an aborted
# answer that long had tokens, and is passed on as vLLM sent it).
UNARY_CHECK_MAX_BYTES = 1024 * 1024
UNARY_PATHS = (continuation.COMPLETIONS_PATH, continuation.CHAT_PATH)
# POSTs vLLM's API server answers without its engine: neither their loss nor their answer
# says anything about the engine's input (oldest_unanswered_seconds).
API_SERVER_ONLY_PATHS = frozenset({"/tokenize", "/detokenize"})
STATUS_PATH = "/gate/status"
# The one client every request without a vouched-for key counts as (no header value can hold a
# newline, so no client can name it).
UNKNOWN_KEY = "\n(unknown)"
# How long the client itself waits, in seconds, as OpenAI's SDKs (Python, Node) say it on every
# request: the total, and the Python SDK's read timeout (the wait for the first answer bytes,
# which is what a held request spends). The wait for a restart never goes past the shorter.
CLIENT_TIMEOUT_HEADERS = ("X-Stainless-Timeout", "X-Stainless-Read-Timeout")


def client_timeout_seconds(headers: Mapping[str, str]) -> float | None:
    """The shortest positive, finite timeout the client's headers say; None when they say
    none (or only what is not a number: ignored, never trusted to lengthen a wait)."""
    found: list[float] = []
    for name in CLIENT_TIMEOUT_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if 0 < value < float("inf"):
            found.append(value)
    return min(found, default=None)


@dataclass(frozen=True)
class ProxySettings:
    upstream: str
    service: str = "vllm"
    max_body_bytes: int = 32 * 1024 * 1024
    default_output_tokens: int = 256
    key_header: str = "Authorization"
    metrics_path: str = "/metrics"
    connect_timeout_seconds: float = 5.0
    # A request body must arrive whole within body_timeout_seconds of its head, and at no less
    # than body_min_rate_bytes_per_second over each body_rate_window_seconds (0: no floor);
    # else 408. All bodies held at once (being read, queued or being sent) stay within
    # body_budget_bytes: a read that would pass it waits up to body_budget_wait_seconds for
    # room, then gets 503 (gate/body.py).
    body_timeout_seconds: float = 30.0
    body_min_rate_bytes_per_second: int = 1024
    body_rate_window_seconds: float = 5.0
    body_budget_bytes: int = 256 * 1024 * 1024
    body_budget_wait_seconds: float = 2.0
    # Who counts as one client for the per-key share (Limits.per_key_share_ratio): a value of
    # key_header whose SHA-256 (hex) is listed here is a client of its own; with
    # trust_key_header every value is (an auth proxy in front sets the header, the operator
    # vouches for it). Every other request — no header, or a value not vouched for — counts as
    # one client, UNKNOWN_KEY: a fresh value per request cannot buy a fresh share.
    known_keys_sha256: frozenset[str] = frozenset()
    trust_key_header: bool = False

    @property
    def body_limits(self) -> BodyLimits:
        return BodyLimits(
            max_bytes=self.max_body_bytes,
            timeout_seconds=self.body_timeout_seconds,
            min_rate_bytes_per_second=self.body_min_rate_bytes_per_second,
            rate_window_seconds=self.body_rate_window_seconds,
            budget_wait_seconds=self.body_budget_wait_seconds,
        )

    # A streamed completion or chat completion the upstream cuts is continued (relay.py), at
    # most this often; not at all when off, or on a route listed in continuation_off_routes.
    continuation: bool = True
    continuation_off_routes: frozenset[str] = frozenset()
    max_continuations: int = 1
    # While a cut stream waits for the server: an SSE comment this often.
    keepalive_comment_seconds: float = 5.0
    # A request taken back from a hung engine waits this much longer than max_wait_seconds:
    # the time the guardian would still have left it in the engine before its restart cut it
    # (its stall wait is three times the gate's hold: the CLI sets twice the hold). Taken back
    # sooner, it must not time out sooner.
    taken_back_extra_wait_seconds: float = 0.0
    # A request sent to vLLM that ended with no answer counts in oldest_unanswered_seconds
    # until vLLM answers, moves or is a new engine, at most this long (gate/progress.py).
    unanswered_forget_seconds: float = UNANSWERED_FORGET_SECONDS
    # ... if it was out at least this long (gate/progress.py, GIVEN_UP_MIN_SECONDS).
    given_up_min_seconds: float = GIVEN_UP_MIN_SECONDS
    # Another replica of the same model, from the operator's config only (None: off); a
    # continuation, or a held completion or chat completion that continuation would not
    # refuse, that waited fallback_after_seconds for this server is sent there instead, once
    # (refused or answered 5xx there: it waits on here, within max_wait_seconds).
    fallback_url: str | None = None
    fallback_after_seconds: float = 10.0


class _UpstreamBroke(Exception):
    """The upstream failed before the answer was committed (nothing sent to the client)."""

    def __init__(
        self, phase: str, detail: str, *, taken_back: bool = False, timed_out: bool = False
    ) -> None:
        super().__init__(detail)
        self.phase = phase
        self.taken_back = taken_back
        self.timed_out = timed_out  # a connect that timed out (UpstreamError.timed_out)


class MalformedSink(Protocol):
    """Where the proxy reports a malformed body (connections.MalformedRequests)."""

    def note(self, phase: str, peer: str | None, detail: str) -> None: ...


@dataclass(frozen=True)
class _Exchange:
    """One client request as the proxy sends it upstream (again, after a failure)."""

    request: Request
    target: str
    headers: CIMultiDict[str]
    body: bytes | bytearray
    plan: Plan | Refusal | None
    wait_again: Callable[[float], Awaitable[None]]


@dataclass
class _Hold:
    """The exchange's admission ticket, replaced when it waits again (a retry, a cut)."""

    ticket: Ticket | None = None


def _answered(up: UpstreamResponse | None) -> bool:
    """vLLM answers the request, the first byte of a 200 body in: its engine took it (an
    error is the API server's own, or a dead engine's)."""
    return up is not None and up.status == 200 and up.body_started


def _request_headers(request: Request) -> CIMultiDict[str]:
    """The client's headers as they go upstream: hop-by-hop ones, the length (the pool sets it)
    and the coding of a body the server decoded (http1.py) left out."""
    headers = _forward_headers(request.headers, REQUEST_DROP)
    if request.decoded:
        headers.popall("Content-Encoding")
    return headers


def _forward_headers(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in drop:
            out.add(k, v)
    return out


class GateProxy:
    def __init__(
        self,
        settings: ProxySettings,
        admission: Admission,
        follower: Follower,
        pool: UpstreamPool,
        metrics: GateMetrics,
        malformed: MalformedSink,
        fallback_pool: UpstreamPool | None = None,
        loop_lag: Callable[[], float] = lambda: 0.0,
        busy_share: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.s = settings
        self.loop_lag = loop_lag  # the largest recent lag of this loop (gate/looplag.py)
        self.busy_share = busy_share  # the share of its core this process keeps busy (idem)
        # The fallback replica (ProxySettings.fallback_url), named in logs without secrets.
        self.fallback = (
            Fallback(fallback_pool, redact_text(settings.fallback_url or ""))
            if fallback_pool is not None
            else None
        )
        self.malformed = malformed
        self.admission = admission
        self.follower = follower
        self.pool = pool
        self.metrics = metrics
        self.open_exchanges = 0
        # Requests sent to vLLM and not yet answered with a byte of body, by attempt: when
        # they were sent (perf_counter), and their answer once its head came. The status's
        # oldest_unanswered_seconds: vLLM idle by its metrics while this grows is a request
        # that never reached its engine (core/progress.py, unreached_seconds). The third: the
        # request as work for the engine (None: a GET, or a POST vLLM's API server answers
        # alone), what _abandoned keeps if it ends without an answer.
        self._sent: dict[int, tuple[float, UpstreamResponse | None, Unanswered | None]] = {}
        # The earliest request sent that ended with no answer (its client gave up): the age
        # goes on from its send, whatever the clients' timeouts (gate/progress.py).
        self._abandoned: Unanswered | None = None
        self._sent_ids = itertools.count()
        self.bodies = BodyBudget(settings.body_budget_bytes, metrics)
        self._body_limits = settings.body_limits

    async def handle(
        self, request: Request, body_read: Callable[[], None] = lambda: None
    ) -> Response:
        """One exchange; ``body_read`` is called once the request's body is in (the connection
        guard's cue that this connection is now busy, not waiting for its client)."""
        path = request.path
        if request.method == "GET" and path == self.s.metrics_path:
            return Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
        if request.method == "GET" and path == STATUS_PATH:
            return json_response(self.status())
        self.open_exchanges += 1
        try:
            try:
                held = await self._read_body(request)
            except ClientGone:
                # Nothing to answer and no one to answer it: the connection is closed.
                resp = Response(status=400)
                resp.force_close()
                return resp
            except BodyRefused as refused:
                return self._refuse_body(refused)
            except BodyMalformed as malformed:
                # (Named apart: compiled by mypyc, one name is one type in the whole function.)
                self.malformed.note("body", request.remote, str(malformed))
                resp = openai_error(
                    400, "the gate could not read the request body", "BadRequestError"
                )
                resp.force_close()
                return resp
            body_read()
            try:
                return await self._exchange(request, held.data)
            finally:
                held.release()
        finally:
            self.open_exchanges -= 1

    async def _read_body(self, request: Request) -> HeldBody:
        if not request.body_exists:
            return HeldBody(bytearray(), self.bodies)
        length = request.content_length
        if request.expects_continue() and (length is None or length <= self._body_limits.max_bytes):
            # RFC 9110 §10.1.1: told before the gate waits for the body. A body over the limit
            # gets its 413 instead, unsent. The Expect header itself is not forwarded
            # (REQUEST_DROP).
            request.send_continue()
        return await read_body(request.content, length, self._body_limits, self.bodies)

    def _refuse_body(self, e: BodyRefused) -> Response:
        self.metrics.rejected.labels(e.refusal.value).inc()
        if e.refusal is BodyRefusal.BUDGET:
            resp = openai_error(
                503, e.message, "ServiceUnavailableError",
                retry_after_seconds=self.admission.limits.retry_after_seconds,
            )  # fmt: skip
        elif e.refusal is BodyRefusal.TOO_LARGE:
            resp = openai_error(413, e.message, "BadRequestError")
        else:
            resp = openai_error(408, e.message, "RequestTimeoutError")
        resp.force_close()  # the rest of the body is not read: the connection cannot be reused
        return resp

    def client_key(self, value: str | None) -> str:
        """The client a request counts as for the per-key share (see ProxySettings)."""
        if value is None:
            return UNKNOWN_KEY
        if self.s.trust_key_header:
            return value
        if self.s.known_keys_sha256:
            digest = hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()
            if digest in self.s.known_keys_sha256:
                return value
        return UNKNOWN_KEY

    def status(self) -> dict[str, object]:
        """``GET /gate/status``: what the guardian's gate source reads (docs/gate.md, "Status")."""
        a, m = self.admission, self.metrics
        return {
            "service": self.s.service,
            "open": a.open,
            "reason": a.reason,
            "queue_depth": a.queue_depth,
            "queued_tokens": a.queued_tokens,
            "in_flight": a.in_flight,
            "kv_committed_tokens": a.committed_tokens,
            "kv_capacity_tokens": a.kv_capacity_tokens,
            "kv_capacity_source": a.kv_capacity_source,
            "open_exchanges": self.open_exchanges,
            "upstream_healthy": self.follower.upstream_healthy,
            "guardian_ready": self.follower.guardian_ready,
            "oldest_wait_seconds": round(a.oldest_wait_seconds, 3),
            **self._unanswered(),
            "longest_wait_seconds": round(a.longest_wait_seconds, 3),
            "loop_lag_max_seconds": round(self.loop_lag(), 3),
            "cpu_busy_share": None if (busy := self.busy_share()) is None else round(busy, 3),
            "arrived_total": m.total("arrived"),
            "admitted_total": m.total("admitted"),
            "held_total": m.total("held"),
            "retried_total": m.total("retried"),
            "rejected_total": m.total("rejected"),
            "continued_total": m.continuations("continued"),
            "continuations_failed_total": m.continuations("failed"),
        }

    def _unanswered(self) -> dict[str, object]:
        """How many requests sent to vLLM have no byte of their answer yet, and the oldest's
        age in seconds (0 when none); the age counts from the earliest request that ended
        without an answer too, while nothing since says the engine's input works (forgotten
        here when something does: gate/progress.py, still_unanswered)."""
        now = time.perf_counter()
        if any(w is not None and _answered(up) for _, up, w in self._sent.values()):
            self._abandoned = None
        self._abandoned = still_unanswered(
            self._abandoned,
            now,
            self.follower.engine_mark(),
            self.follower.progress.last,
            self.s.unanswered_forget_seconds,
        )
        ages = [now - t for t, up, _ in self._sent.values() if up is None or not up.body_started]
        oldest = max(ages, default=0.0)
        if self._abandoned is not None:
            oldest = max(oldest, now - self._abandoned.sent_at)
        return {
            "unanswered": len(ages),
            "oldest_unanswered_seconds": round(oldest, 3),
        }

    async def _exchange(self, request: Request, body: bytes | bytearray) -> Response:
        started = time.perf_counter()
        hold = _Hold()
        cost: Cost | None = None
        key = self.client_key(request.headers.get(self.s.key_header))
        client_timeout = client_timeout_seconds(request.headers)
        arrived = time.monotonic()
        overhead = 0.0
        stream_plan: Plan | Refusal | None = None
        elsewhere: UpstreamResponse | None = None
        if request.method == "POST":
            try:
                doc = continuation.body_json(body)  # read once: the cost, the plan, the fallback
                cost = cost_of(body, doc, self.s.default_output_tokens)
                self.metrics.arrived.inc()
            except RecursionError:  # json's own limit, or the walk over the prompt
                self.metrics.rejected.labels("too_deep").inc()
                return openai_error(
                    400, "request JSON nested too deeply for the gate to read", "BadRequestError"
                )
            path = request.path
            stream_plan = continuation.plan_of(
                path,
                body,
                doc,
                enabled=self.s.continuation and path not in self.s.continuation_off_routes,
            )
            if isinstance(stream_plan, Plan):
                body = stream_plan.upstream_body
            overhead += time.perf_counter() - started
            try:
                elsewhere = await self._admit(
                    hold, key, cost, client_timeout, request, body, doc, stream_plan
                )
            except Rejected as r:
                return openai_error(
                    r.status,
                    r.message,
                    "RateLimitError" if r.status == 429 else "ServiceUnavailableError",
                    retry_after_seconds=r.retry_after_seconds,
                )
            except asyncio.CancelledError:
                self.metrics.client_disconnect("queued")
                raise
            started = time.perf_counter()
        headers = _request_headers(request)
        target = request.target

        async def wait_again(extra_wait_seconds: float = 0.0) -> None:
            """Wait for the next instance like a new arrival, but first in line."""
            assert cost is not None
            if hold.ticket is not None:
                self.admission.release(hold.ticket)
                hold.ticket = None
            left = None if client_timeout is None else client_timeout - (time.monotonic() - arrived)
            hold.ticket = await self.admission.acquire(
                key,
                cost,
                front=True,
                extra_wait_seconds=extra_wait_seconds,
                client_timeout_seconds=left,
            )

        exchange = _Exchange(request, target, headers, body, stream_plan, wait_again)
        try:
            retried = False
            while True:
                try:
                    if elsewhere is not None:  # the fallback took it: its answer is relayed
                        up, elsewhere = elsewhere, None
                        return await self._send(exchange, started, overhead, True, up)
                    return await self._send(exchange, started, overhead, retried)
                except _UpstreamBroke as e:
                    if e.timed_out and cost is not None:
                        # vLLM accepts late (busy), it did not break: the request waits its
                        # turn again, first in line, for as long as a held one may wait; the
                        # gate stays open and the one retry is kept for a real failure.
                        self.metrics.connect_timeouts.inc()
                        waited = time.monotonic() - arrived
                        if waited >= self.admission.limits.max_wait_seconds:
                            return openai_error(
                                503,
                                f"vLLM did not accept a connection within {waited:.0f} s",
                                "ServiceUnavailableError",
                                retry_after_seconds=self.admission.limits.retry_after_seconds,
                            )
                        extra_wait = 0.0
                    else:
                        self.metrics.upstream_error(e.phase)
                        self.follower.suspect(f"{e.phase}: {e}")
                        if retried or cost is None:
                            return openai_error(502, f"the upstream failed: {e}", "BadGatewayError")
                        retried = True
                        self.metrics.retried.inc()
                        extra_wait = self.s.taken_back_extra_wait_seconds if e.taken_back else 0.0
                    try:
                        await wait_again(extra_wait)
                    except Rejected as r:
                        return openai_error(
                            r.status, r.message, "ServiceUnavailableError",
                            retry_after_seconds=r.retry_after_seconds,
                        )  # fmt: skip
                    started, overhead = time.perf_counter(), 0.0
        finally:
            if hold.ticket is not None:
                self.admission.release(hold.ticket)

    async def _admit(
        self,
        hold: _Hold,
        key: str,
        cost: Cost,
        client_timeout: float | None,
        request: Request,
        body: bytes | bytearray,
        doc: object | None,
        plan: Plan | Refusal | None,
    ) -> UpstreamResponse | None:
        """The admission's wait (its ticket in ``hold``; raises ``Rejected``). With a
        fallback, a completion or chat completion continuation would not refuse that has
        waited ``fallback_after_seconds`` is offered there once while it keeps its place in
        the queue: the fallback's answer when it took it (anything but a 5xx), else None once
        this server admits it."""
        acquiring = self.admission.acquire(key, cost, client_timeout_seconds=client_timeout)
        if (
            self.fallback is None
            or FALLBACK_HEADER in request.headers  # a gate's fallback already: not again
            or not continuation.fallback_allowed(request.path, doc, plan)
        ):
            hold.ticket = await acquiring  # no task of its own on the hot path
            return None
        waiting = asyncio.ensure_future(acquiring)
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self.s.fallback_after_seconds)
            if not done:
                elsewhere = await self._on_fallback(request, body)
                if elsewhere is not None:
                    return elsewhere
            hold.ticket = await waiting
            return None
        finally:
            # Nothing awaited here: a client leaving in this turn would lose the fallback's
            # answer (not returned, so never released) and a grant made meanwhile.
            if not waiting.done():
                waiting.cancel()  # it leaves the queue (Admission.acquire gives back a grant)
            elif not waiting.cancelled() and waiting.exception() is None and hold.ticket is None:
                # Granted, and not taken: the fallback answered, or this client left as the
                # grant came.
                self.admission.release(waiting.result())

    async def _on_fallback(
        self, request: Request, body: bytes | bytearray
    ) -> UpstreamResponse | None:
        """A held request sent whole to the fallback: its answer, or None (refused, broken,
        5xx: logged, and the request waits on for this server)."""
        assert self.fallback is not None
        request_id = request.headers.get("X-Request-Id", "(no X-Request-Id)")
        try:
            up = await self.fallback.pool.request(
                request.method,
                request.target,
                [*_request_headers(request).items(), (FALLBACK_HEADER, "1")],
                body,
            )
        except UpstreamError as e:
            why = f"{e.phase}: {e}"
        else:
            if up.status < 500:
                self.metrics.fallback("sent")
                log.warning(
                    "gate: request %s held %g s for this server; sent to the fallback %s",
                    request_id, self.s.fallback_after_seconds, self.fallback.shown,
                )  # fmt: skip
                return up
            try:
                answer = await up.read_at_most(DYING_BODY_MAX_BYTES)
                why = f"answered {up.status}: {answer[:200].decode('utf-8', 'replace')}"
            except UpstreamError as e:
                why = f"answered {up.status}, then {e.phase}: {e}"
            finally:
                up.release()  # also when the client leaves meanwhile
        self.metrics.fallback("refused")
        log.warning(
            "gate: request %s: the fallback %s did not take it (%s); it waits on for this server",
            request_id, self.fallback.shown, why,
        )  # fmt: skip
        return None

    async def _send(
        self,
        ex: _Exchange,
        started: float,
        overhead: float,
        retried: bool,
        up: UpstreamResponse | None = None,
    ) -> Response:
        sent = next(self._sent_ids)
        sent_at = time.perf_counter()
        work: Unanswered | None = None
        if (
            up is None  # the fallback's answer says nothing of this engine
            and ex.request.method == "POST"
            and ex.request.path not in API_SERVER_ONLY_PATHS
        ):
            work = Unanswered(sent_at, self.follower.engine_mark(), self.follower.progress.last)
        self._sent[sent] = (sent_at, None, work)
        reached = True
        try:
            return await self._send_once(ex, started, overhead, sent, retried, up)
        except _UpstreamBroke as e:
            reached = e.phase != "connect"  # refused or not accepted: vLLM never had it
            raise
        finally:
            _, answer, _ = self._sent.pop(sent)
            if work is not None:
                if _answered(answer):
                    self._abandoned = None  # the engine's input works
                elif reached and (answer is None or not answer.body_started):
                    self._abandoned = abandoned(
                        self._abandoned, work, time.perf_counter(), self.s.given_up_min_seconds
                    )

    async def _send_once(
        self,
        ex: _Exchange,
        started: float,
        overhead: float,
        sent: int,
        retried: bool,
        up: UpstreamResponse | None = None,
    ) -> Response:
        """Send the exchange to this server, or relay ``up`` (the fallback's answer)."""
        request = ex.request
        pre_send = overhead + time.perf_counter() - started
        if up is None:
            try:
                up = await self.pool.request(
                    request.method,
                    ex.target,
                    ex.headers.items(),
                    ex.body if ex.body or request.body_exists else None,
                    # Until its answer is committed, a hung engine's exchange is sent again.
                    saveable=request.method == "POST" and not retried,
                )
            except UpstreamError as e:
                raise _UpstreamBroke(
                    e.phase, str(e), taken_back=e.taken_back, timed_out=e.timed_out
                ) from None
        t_sent, _, work = self._sent[sent]
        self._sent[sent] = (t_sent, up, work)
        if (
            isinstance(ex.plan, Plan)
            and up.status == 200
            and up.headers.get("Content-Type", "").startswith("text/event-stream")
        ):
            return await self._relay(ex, ex.plan, up)
        try:
            try:
                if up.status == 500:
                    first = await up.read_at_most(DYING_BODY_MAX_BYTES)
                    if any(m in first for m in DYING_MARKERS):
                        raise _UpstreamBroke(
                            "before_first_byte", first.decode("utf-8", "replace")[:200]
                        )
                elif (
                    up.status == 200
                    and request.method == "POST"
                    and request.path in UNARY_PATHS
                    and up.headers.get("Content-Type", "").startswith("application/json")
                ):
                    first = await up.read_at_most(UNARY_CHECK_MAX_BYTES)
                    if (
                        not retried
                        and len(first) < UNARY_CHECK_MAX_BYTES
                        and continuation.aborted_answer(first)
                    ):
                        raise _UpstreamBroke("aborted", first.decode("utf-8", "replace")[:200])
                else:
                    first = await up.read()
            except UpstreamError as e:
                raise _UpstreamBroke(
                    "before_first_byte", str(e), taken_back=up.taken_back
                ) from None
            t_first = time.perf_counter()
            up.set_saveable(False)  # committed: a hang cuts it only if the engine's restart does
            resp = self._answer_for(up)
            if up.content_length is not None:
                resp.content_length = up.content_length
            try:
                # Headers go out with the first body bytes, in one write (http1.py).
                await resp.prepare(request)
                if first:
                    await resp.write(first)
                # The gate's own time: before the upstream call, and from the first bytes to
                # their write (the wait for the upstream in between is not the gate's).
                self.metrics.overhead_seconds.observe(pre_send + time.perf_counter() - t_first)
                refused = ex.plan if isinstance(ex.plan, Refusal) else None
                if refused is not None and any(m in first for m in CUT_MARKERS):
                    # vLLM's error event for a dead engine (or its abort) came with the first
                    # bytes.
                    self.metrics.continuation(Outcome.REFUSED.value, refused.value)
                    refused = None
                while True:
                    try:
                        chunk = await up.read()
                    except UpstreamError:
                        # Cut mid-answer: the client's answer is cut too (never replayed).
                        self.metrics.upstream_error("streaming")
                        if refused is not None:
                            self.metrics.continuation(Outcome.REFUSED.value, refused.value)
                        if request.transport is not None:
                            request.transport.close()
                        return resp
                    if not chunk:
                        break
                    if refused is not None and any(m in chunk for m in CUT_MARKERS):
                        # vLLM's error event for a dead engine (or its abort chunk), passed on
                        # as it came.
                        self.metrics.continuation(Outcome.REFUSED.value, refused.value)
                        refused = None
                    await resp.write(chunk)
                await resp.write_eof()
            except asyncio.CancelledError:
                self.metrics.client_disconnect("streaming")
                raise
            except ConnectionResetError:  # the client left mid-answer: counted, no traceback
                self.metrics.client_disconnect("streaming")
                if request.transport is not None:
                    request.transport.close()
            return resp
        finally:
            # Releasing a finished answer keeps the connection for reuse; closing one that is
            # not finished (client gone, upstream cut) tells vLLM to abort the request.
            up.release()

    async def _relay(self, ex: _Exchange, p: Plan, up: UpstreamResponse) -> Response:
        """A stream the gate continues after a cut (relay.py); a failure before its first
        event is the proxy's to retry, like any other."""
        relay = ContinuingRelay(
            plan=p,
            settings=RelaySettings(
                self.s.max_continuations,
                self.s.keepalive_comment_seconds,
                self.s.taken_back_extra_wait_seconds,
                self.s.fallback_after_seconds,
            ),
            request=ex.request,
            target=ex.target,
            headers=ex.headers,
            pool=self.pool,
            follower=self.follower,
            metrics=self.metrics,
            wait_ready=ex.wait_again,
            response_factory=self._answer_for,
            # A gate's fallback already (it came from another gate): not again.
            fallback=self.fallback if FALLBACK_HEADER not in ex.request.headers else None,
        )
        try:
            return await relay.run(up)
        except UpstreamError as e:
            raise _UpstreamBroke(e.phase, str(e), taken_back=e.taken_back) from None

    @staticmethod
    def _answer_for(up: UpstreamResponse) -> StreamResponse:
        return StreamResponse(
            status=up.status,
            reason=up.reason,
            headers=_forward_headers(up.headers, RESPONSE_DROP),
        )
