"""The relay of a streamed completion or chat completion that the gate continues after a cut.

Where it sits: :class:`~vllm_guardian.gate.proxy.GateProxy` hands it the upstream's answer
(200, ``text/event-stream``) when :func:`~vllm_guardian.gate.continuation.plan` said the stream
can be continued; :mod:`~vllm_guardian.gate.continuation` decides what each event becomes and
what follows a cut. This module does the I/O, in order:

1. events are read as they arrive, rewritten (the ids the gate asked for are stripped) and
   written to the client at its pace, like the byte relay;
2. at a cut (the connection reset or closed before ``[DONE]``, vLLM's error event for a
   dead engine, or its chunk with ``finish_reason: "abort"``: vLLM shutting down answers what
   it aborts with a 200 and that chunk, which is not the stream's end) the client's connection
   stays open: an SSE comment (``: keep-alive``) goes out
   at once and every ``keepalive_comment_seconds`` while the gate waits for the server to be
   ready, exactly as a held request waits (the proxy's ``wait_ready``: the admission queue, at
   its head, within ``max_wait_seconds``);
3. the continuation is sent, and its events are relayed as the same stream; a second cut is
   handled the same way, up to ``max_continuations``;
4. when the gate gives up (refused, past ``max_continuations``, no ready server within the wait,
   an error answer), the client gets what it would have had without the gate's help: vLLM's
   error event and ``[DONE]`` when that was the cut, vLLM's abort chunk (its usage chunk) and
   ``[DONE]`` when that was, a cut connection otherwise.

A hung engine's streams are cut by the gate itself: while the follower's progress watch holds,
the pool closes the connection of every answer marked saveable (``UpstreamPool.take_back``),
here one with a continuation left; the cut is then handled as above and counted as ``hang``.

A cut before anything reached the client is left to the proxy's retry (``UpstreamError``), as
for any other request. Every decision is counted in ``continuations_total{outcome, reason}``
and logged with the request's id (its ``X-Request-Id``, else one the gate makes) and the
stream's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn

from multidict import CIMultiDict

from vllm_guardian.gate.admission import Rejected
from vllm_guardian.gate.continuation import (
    Complete,
    Continue,
    Cut,
    Failure,
    Kind,
    Outcome,
    Plan,
    Refusal,
    SseSplitter,
    Step,
    StreamState,
    dying_message,
    tail_is_settled,
)
from vllm_guardian.gate.follower import Follower
from vllm_guardian.gate.http1 import Request, StreamResponse
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.streamer import Stop, Streamer
from vllm_guardian.gate.upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger("vllm_guardian.gate")

KEEPALIVE = b": keep-alive\n\n"
# On what a gate sends to its fallback replica: a gate that gets it never sends it to a
# fallback again. In a pod the fallback is the model's Service, which may route back to this
# pod's gate or to another gate with a fallback: each would pass it on every
# fallback_after_seconds, for ever, without it.
FALLBACK_HEADER = "X-Vllm-Guardian-Fallback"
DONE = b"data: [DONE]\n\n"
# One event held whole at most: the first chunk carries the prompt's ids (~6 bytes a token).
MAX_EVENT_BYTES = 16 * 1024 * 1024
# A continuation's error answer, or /detokenize's: read this much at most.
SMALL_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True)
class RelaySettings:
    max_continuations: int = 1
    keepalive_comment_seconds: float = 5.0
    taken_back_extra_wait_seconds: float = 0.0  # ProxySettings'
    fallback_after_seconds: float = 10.0  # ProxySettings'


@dataclass(frozen=True)
class Fallback:
    """Another replica of the same model (ProxySettings.fallback_url): its pool, and how the
    logs name it (redacted)."""

    pool: UpstreamPool
    shown: str


class _GaveUp(Exception):
    """The stream ends here; what the client gets was written already."""


class ContinuingRelay:
    """One client's streamed completion, across as many upstream answers as it takes."""

    def __init__(
        self,
        *,
        plan: Plan,
        settings: RelaySettings,
        request: Request,
        target: str,
        headers: CIMultiDict[str],
        pool: UpstreamPool,
        follower: Follower,
        metrics: GateMetrics,
        wait_ready: Callable[[float], Awaitable[None]],
        response_factory: Callable[[UpstreamResponse], StreamResponse],
        fallback: Fallback | None = None,
    ) -> None:
        self.fallback = fallback
        self.state = StreamState(plan)
        self.s = settings
        self.request = request
        self.target = target
        self.headers = headers
        self.pool = pool
        self.follower = follower
        self.metrics = metrics
        self.wait_ready = wait_ready
        self._response_factory = response_factory
        self.resp: StreamResponse | None = None
        self.request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]

    async def run(self, up: UpstreamResponse) -> StreamResponse:
        """Relay ``up`` (and what follows it) to the client. Raises ``UpstreamError`` when the
        upstream failed before a byte reached the client (the proxy retries those)."""
        first = up
        try:
            while True:
                try:
                    cut, held = await self._pump(up, first)
                finally:
                    up.release()
                if cut is None:
                    assert self.resp is not None
                    await self.resp.write_eof()
                    return self.resp
                if self.resp is None:  # the proxy counts it, and retries it whole
                    raise UpstreamError(
                        "aborted" if cut is Cut.ABORT else "before_first_byte",
                        "the upstream cut the stream before its first event"
                        if held is None
                        else held.decode("utf-8", "replace")[:200],
                        taken_back=up.taken_back,
                    )
                self.metrics.upstream_error("streaming")
                self.follower.suspect(f"streaming: {cut.value}")
                if cut is Cut.CONNECTION and up.taken_back:
                    cut = Cut.HANG
                try:
                    up = await self._next(cut, held)
                except _GaveUp:
                    return self.resp
        except asyncio.CancelledError:
            self.metrics.client_disconnect("streaming")
            raise
        except ConnectionResetError:  # the client left mid-answer: counted, no traceback
            self.metrics.client_disconnect("streaming")
            self._close_client()
            assert self.resp is not None
            return self.resp

    # --- one upstream answer -----------------------------------------------------------------

    async def _pump(
        self, up: UpstreamResponse, first: UpstreamResponse
    ) -> tuple[Cut | None, bytes | None]:
        """Relay one answer's events: (None, None) once ``[DONE]`` is written, else how it
        was cut and, for vLLM's error event, that event (for its abort, that chunk and what
        followed it before ``[DONE]``)."""
        splitter = SseSplitter(MAX_EVENT_BYTES)
        while True:
            direct = self._direct_writer()
            if direct is not None:
                # Committed to the client: its events go out from the upstream's callbacks.
                stop = await self._stream(up, splitter, direct)
                if stop.error is not None:
                    raise stop.error
                if stop.client_gone:
                    raise ConnectionResetError("the client's connection is closed")
                if stop.drain:
                    await direct.drain()  # the client reads slower than the upstream writes
                    up.resume()
                    continue
                if stop.step is None:
                    if stop.ended:
                        return Cut.CONNECTION, None  # without [DONE]; a partial event is dropped
                    self.state.unreadable = True  # overflowing: not SSE as vLLM writes it
                    await self._write(splitter.take_rest(), first)
                    continue
                if stop.step.kind is Kind.DONE:  # written with the events before it
                    await self._drain(up)
                    return None, None
                return await self._stopped(stop.step, stop.rest, up, splitter, first, [])
            try:
                data = await up.read()
            except UpstreamError:
                return Cut.CONNECTION, None
            if not data:
                return Cut.CONNECTION, None  # ended without [DONE]; a partial event is dropped
            # What one read brought goes to the client in one write (one chunk, one syscall).
            out: list[bytes] = []
            events = splitter.feed(data)
            for i, event in enumerate(events):
                step = self.state.on_event(event)
                if step.kind is not Kind.RELAY:
                    return await self._stopped(step, events[i + 1 :], up, splitter, first, out)
                if step.data:
                    out.append(step.data)
            if out:
                await self._write(out[0] if len(out) == 1 else b"".join(out), first)
            if splitter.overflowing:  # not SSE as vLLM writes it: passed on as it is
                self.state.unreadable = True
                await self._write(splitter.take_rest(), first)

    async def _stopped(
        self,
        step: Step,
        rest: list[bytes],
        up: UpstreamResponse,
        splitter: SseSplitter,
        first: UpstreamResponse,
        out: list[bytes],
    ) -> tuple[Cut | None, bytes | None]:
        """An event that ends the answer (``[DONE]``, vLLM's error event, its abort chunk),
        with ``out`` (the events before it, not written yet) and ``rest`` (the ones after it
        in the same read)."""
        if step.kind is Kind.DONE:
            out.append(step.data)
        if out:
            await self._write(b"".join(out), first)
        if step.kind is Kind.CUT:
            return Cut.ERROR_EVENT, step.data
        if step.kind is Kind.ABORT:
            return Cut.ABORT, step.data + await self._after_abort(up, splitter, rest)
        await self._drain(up)
        return None, None

    def _direct_writer(self) -> StreamResponse | None:
        """The client's answer once events may go to it from the upstream's callbacks: its
        head went out, and no length frames its body."""
        resp = self.resp
        if resp is None or resp.content_length is not None:
            return None
        return resp

    async def _stream(
        self, up: UpstreamResponse, splitter: SseSplitter, resp: StreamResponse
    ) -> Stop:
        """Relay events from the upstream's callbacks until one the relay must act on."""
        streamer = Streamer(self.state, splitter, up, resp)
        up.stream(streamer)
        try:
            return await streamer.stopped
        finally:
            if not streamer.stopped.done():  # cancelled: the client left
                up.unstream()

    async def _after_abort(
        self, up: UpstreamResponse, splitter: SseSplitter, events: list[bytes]
    ) -> bytes:
        """What vLLM writes after its abort chunk, up to ``[DONE]`` (the usage chunk, when
        asked for): held with it, for a client that gets the abort as vLLM sent it."""
        tail: list[bytes] = []
        size = 0
        while True:
            for event in events:
                if event.strip() == DONE.strip():
                    await self._drain(up)
                    return b"".join(tail)
                data = self.state.on_event(event).data
                tail.append(data)
                size += len(data)
            if size > SMALL_ANSWER_BYTES:
                return b"".join(tail)
            try:
                data = await up.read()
            except UpstreamError:
                return b"".join(tail)
            if not data:
                return b"".join(tail)
            events = splitter.feed(data)

    @staticmethod
    async def _drain(up: UpstreamResponse) -> None:
        """Read the answer's end (the last chunk's frame), so its connection is reused."""
        try:
            for _ in range(4):
                if not await up.read():
                    return
        except UpstreamError:
            return

    async def _write(self, data: bytes, first: UpstreamResponse) -> None:
        if self.resp is None:
            self.resp = self._response_factory(first)
            await self.resp.prepare(self.request)
            # Committed: from now a hang takes it back only to continue it.
            first.set_saveable(self.state.continuations < self.s.max_continuations)
        await self.resp.write(data)

    # --- after a cut -------------------------------------------------------------------------

    async def _next(self, cut: Cut, held: bytes | None) -> UpstreamResponse:
        """The next answer to relay; raises :class:`_GaveUp` when there is none."""
        st = self.state
        try:
            while True:
                max_model_len = None
                if st.needs_context_length:
                    max_model_len = await self._max_model_len()
                    if max_model_len is None and self.fallback is not None:
                        # This server is down: the fallback serves the same model.
                        max_model_len = await self._max_model_len(self.fallback.pool)
                decision = st.decide(max_model_len)
                if isinstance(decision, Refusal):
                    await self._give_up(Outcome.REFUSED, decision, held)
                if isinstance(decision, Complete):
                    await self._complete(cut, decision)
                assert isinstance(decision, Continue)
                if st.continuations >= self.s.max_continuations:
                    await self._give_up(Outcome.FAILED, Failure.EXHAUSTED, held)
                try:
                    elsewhere = await self._wait_ready_telling_the_client(
                        self.s.taken_back_extra_wait_seconds if cut is Cut.HANG else 0.0,
                        decision,
                    )
                except Rejected:
                    await self._give_up(Outcome.FAILED, Failure.WAIT_TIMEOUT, held)
                if elsewhere is not None:
                    assert self.fallback is not None
                    st.continuations += 1
                    st.begin_continuation(decision.settled_tokens)
                    self._count(Outcome.FALLBACK, cut)
                    log.warning(
                        "gate: request %s (stream %s): the upstream cut it (%s) after %d "
                        "tokens and was not ready within %g s; continued on the fallback %s "
                        "(%d of at most %d)",
                        self.request_id, st.id, cut.value, decision.settled_tokens,
                        self.s.fallback_after_seconds, self.fallback.shown, st.continuations,
                        self.s.max_continuations,
                    )  # fmt: skip
                    return elsewhere
                if decision.check_tail and not await self._tail_settled(decision.check_tail):
                    await self._give_up(Outcome.REFUSED, Refusal.UNSETTLED_TEXT, held)
                st.continuations += 1
                up = await self._send(
                    decision.path or self.target,
                    decision.body,
                    saveable=st.continuations < self.s.max_continuations,
                )
                if up is None:
                    continue  # the server broke again before answering: decided anew
                if up.status == 200:
                    st.begin_continuation(decision.settled_tokens)
                    self._count(Outcome.CONTINUED, cut)
                    log.info(
                        "gate: request %s (stream %s): the upstream cut it (%s) after %d "
                        "tokens; continued (%d of at most %d), %d unsettled tokens regenerated",
                        self.request_id, st.id, cut.value, decision.settled_tokens,
                        st.continuations, self.s.max_continuations, decision.rolled_back_tokens,
                    )  # fmt: skip
                    return up
                answer = await _read_small(up)
                up.release()
                if up.status == 500 and dying_message(answer.decode("utf-8", "replace")):
                    self.follower.suspect("a continuation answered 500: the engine is dying")
                    continue
                log.warning(
                    "gate: request %s (stream %s): its continuation was answered %d: %s",
                    self.request_id, st.id, up.status, answer[:200].decode("utf-8", "replace"),
                )  # fmt: skip
                await self._give_up(Outcome.FAILED, Failure.UPSTREAM_ANSWER, held)
        except (asyncio.CancelledError, ConnectionResetError):
            self._count(Outcome.FAILED, Failure.CLIENT_GONE)
            raise

    async def _wait_ready_telling_the_client(
        self, extra_wait_seconds: float, decision: Continue
    ) -> UpstreamResponse | None:
        """The admission's wait (raises ``Rejected``), with a comment to the client now and
        every ``keepalive_comment_seconds``: its connection and its proxies see a live stream.
        With a fallback, once ``fallback_after_seconds`` have passed, the continuation is
        offered there while it keeps its place in the queue: the fallback's answer (200) when
        it took it, else None once this server is ready."""
        assert self.resp is not None
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(self.wait_ready(extra_wait_seconds))
        fallback_at = (
            loop.time() + self.s.fallback_after_seconds if self.fallback is not None else None
        )
        try:
            await self.resp.write(KEEPALIVE)
            while True:
                timeout = self.s.keepalive_comment_seconds
                if fallback_at is not None:
                    timeout = min(timeout, max(0.0, fallback_at - loop.time()))
                done, _ = await asyncio.wait({waiting}, timeout=timeout)
                if done:
                    waiting.result()
                    return None
                if fallback_at is not None and loop.time() >= fallback_at:
                    fallback_at = None  # offered once; refused, it waits on here
                    elsewhere = await self._on_fallback(decision)
                    if elsewhere is not None:
                        return elsewhere
                    continue
                await self.resp.write(KEEPALIVE)
        finally:
            # Nothing awaited here: a client leaving in this turn would lose the fallback's
            # answer (not returned, so never released). The wait's own grant is in the
            # exchange's hold (wait_ready), or given back by the admission when cancelled.
            if not waiting.done():
                waiting.cancel()
            elif not waiting.cancelled():
                waiting.exception()  # seen: a rejection after the fallback took it is no error

    async def _on_fallback(self, decision: Continue) -> UpstreamResponse | None:
        """The continuation sent to the fallback: its answer when 200, else None (logged; the
        stream waits on for this server)."""
        assert self.fallback is not None
        pool, shown = self.fallback.pool, self.fallback.shown
        why = ""
        try:
            if decision.check_tail and not await self._tail_settled(decision.check_tail, pool):
                why = "its /detokenize did not settle the text's end"
            else:
                up = await pool.request(
                    "POST",
                    decision.path or self.target,
                    [*self.headers.items(), (FALLBACK_HEADER, "1")],
                    decision.body,
                    saveable=self.state.continuations + 1 < self.s.max_continuations,
                )
                if up.status == 200:
                    return up
                try:
                    answer = await _read_small(up)
                finally:
                    up.release()  # also when it breaks, or the client leaves, meanwhile
                why = f"answered {up.status}: {answer[:200].decode('utf-8', 'replace')}"
        except UpstreamError as e:
            why = f"{e.phase}: {e}"
        log.warning(
            "gate: request %s (stream %s): the fallback %s did not take its continuation (%s); "
            "it waits on for this server",
            self.request_id, self.state.id, shown, why,
        )  # fmt: skip
        return None

    async def _send(self, path: str, body: bytes, *, saveable: bool) -> UpstreamResponse | None:
        try:
            return await self.pool.request(
                "POST", path, self.headers.items(), body, saveable=saveable
            )
        except UpstreamError as e:
            if e.timed_out:  # a busy vLLM accepts late: not a reason to hold the gate
                self.metrics.connect_timeouts.inc()
            else:
                self.metrics.upstream_error(e.phase)
                self.follower.suspect(f"{e.phase}: {e}")
            return None

    async def _max_model_len(self, pool: UpstreamPool | None = None) -> int | None:
        """The served model's ``max_model_len`` from vLLM's ``/v1/models`` (on ``pool``, this
        server's by default; None when it cannot be had), for a chat stream with no max of its
        own."""
        headers = []
        auth = self.headers.get("Authorization")
        if auth is not None:
            headers.append(("Authorization", auth))
        model = self.state.plan.request.get("model")
        try:
            up = await (pool or self.pool).request("GET", "/v1/models", headers, None)
            try:
                status, answer = up.status, await _read_small(up)
            finally:
                up.release()
            cards = json.loads(answer).get("data") if status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            return None
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and (model is None or card.get("id") == model):
                value = card.get("max_model_len")
                return value if isinstance(value, int) and value > 0 else None
        return None

    async def _tail_settled(self, ids: tuple[int, ...], pool: UpstreamPool | None = None) -> bool:
        """vLLM's ``/detokenize`` of the last settled ids (on ``pool``, this server's by
        default): False when they end inside a character, or when the answer cannot be had
        (not continued: it might have)."""
        doc: dict[str, object] = {"tokens": list(ids)}
        model = self.state.plan.request.get("model")
        if isinstance(model, str):
            doc["model"] = model
        headers = [("Content-Type", "application/json")]
        auth = self.headers.get("Authorization")
        if auth is not None:
            headers.append(("Authorization", auth))
        try:
            up = await (pool or self.pool).request(
                "POST", "/detokenize", headers, json.dumps(doc).encode()
            )
            try:
                status, answer = up.status, await _read_small(up)
            finally:
                up.release()
            text = json.loads(answer).get("prompt") if status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            text = None
        return isinstance(text, str) and tail_is_settled(text)

    async def _complete(self, cut: Cut, decision: Complete) -> NoReturn:
        assert self.resp is not None
        await self.resp.write(decision.data)
        await self.resp.write_eof()
        self._count(Outcome.COMPLETED, cut)
        log.info(
            "gate: request %s (stream %s): the upstream cut it (%s) after its last token; "
            "the gate ended it",
            self.request_id, self.state.id, cut.value,
        )  # fmt: skip
        raise _GaveUp

    async def _give_up(
        self, outcome: Outcome, reason: Refusal | Failure, held: bytes | None
    ) -> NoReturn:
        """The client gets what it would have had without continuation; raises _GaveUp."""
        self._count(outcome, reason)
        log.warning(
            "gate: request %s (stream %s): the upstream cut it after %d tokens; not continued "
            "(%s: %s)",
            self.request_id, self.state.id, len(self.state.token_ids), outcome.value,
            reason.value,
        )  # fmt: skip
        assert self.resp is not None
        held_back = self.state.take_pending()
        if held is not None:
            await self.resp.write(held_back + held + DONE)
            await self.resp.write_eof()
        else:
            if held_back:
                await self.resp.write(held_back)
            self._close_client()
        raise _GaveUp

    def _count(self, outcome: Outcome, reason: Refusal | Failure | Cut) -> None:
        self.metrics.continuation(outcome.value, reason.value)

    def _close_client(self) -> None:
        if self.request.transport is not None:
            self.request.transport.close()


async def _read_small(up: UpstreamResponse) -> bytes:
    return (await up.read_at_most(SMALL_ANSWER_BYTES))[:SMALL_ANSWER_BYTES]
