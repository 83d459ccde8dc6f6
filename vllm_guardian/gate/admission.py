"""Admission: the bounded FIFO queue in front of vLLM, and the KV-need estimate behind it.

Where it sits: the proxy (``proxy.py``) asks :meth:`Admission.acquire` before it forwards a
request that costs vLLM work (a POST) and calls :meth:`Admission.release` when the exchange
ends; the follower (``follower.py``) opens and closes it from the guardian's ``/ready`` and
vLLM's own ``/health`` and ``/metrics``. No HTTP library here: asyncio and arithmetic only.

The rules, in the order they apply:

* while the gate is open, the queue is empty and the request's KV need fits, it goes through at
  once (the fast path; nothing is counted against the release rate);
* otherwise it waits in one FIFO queue, bounded by request count, by queued prompt tokens and
  per key (fairness: one client cannot take more than its share of the queue; who counts as
  one client is the proxy's ``client_key``); past a bound it
  is refused at once (503, or 429 for the per-key bound);
* a dispatcher releases the head of the queue, in order, while the gate is open and the head's
  KV need fits, at most ``release_rate_per_second`` (with a small burst) so that a reopening
  does not itself flood vLLM; a request that waits longer than ``max_wait_seconds`` is refused
  (503 + Retry-After). A request held while the guardian's ``/ready`` says a restart or
  relaunch is in progress (``set_restart_in_progress``, from the follower) waits on past it,
  by at most ``restart_extra_wait_seconds`` and never past the client's own timeout, for as
  long as the restart lasts or the reopened gate releases the queue: a restart takes about
  as long as ``max_wait_seconds`` and a request held before it began ran out just before the
  new engine was ready;
* in-flight requests are never touched: closing the gate only stops new admissions.

KV-need admission: a request's need is its estimated prompt tokens plus its ``max_tokens`` (or
a default), times ``n``. It is admitted when the pool's used part — the larger of what vLLM
reports and what the gate itself has in flight — plus the need stays within the pool minus a
reserve. One request of the gate's own is always let through when none is in flight, so a need
larger than the pool reaches vLLM and gets vLLM's own answer instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_guardian.gate.continuation import body_json
from vllm_guardian.gate.metrics import GateMetrics

log = logging.getLogger("vllm_guardian.gate")

# A request waiting past max_wait_seconds for a restart checks this often whether the restart
# still holds it (over, with the gate closed for another reason: it is refused then).
EXTENSION_RECHECK_SECONDS = 0.25


@dataclass(frozen=True)
class Limits:
    max_queue_requests: int = 1024
    max_queued_tokens: int = 1_000_000
    max_wait_seconds: float = 60.0
    release_rate_per_second: float = 50.0
    release_burst: int = 8
    # 0 turns fairness off; 0.25 lets one client hold at most a quarter of the queue.
    per_key_share_ratio: float = 0.0
    kv_admission: bool = False  # the config's default and why: config.GateConfig
    kv_reserve_ratio: float = 0.05
    retry_after_seconds: int = 2
    # How much longer than max_wait_seconds a request held during the guardian's restart may
    # wait (0: not at all); the config's default and why: config.GateConfig.
    restart_extra_wait_seconds: float = 30.0


@dataclass(frozen=True)
class Cost:
    """What a request is expected to cost vLLM, in tokens."""

    prompt_tokens: int
    output_tokens: int

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class RejectReason(enum.StrEnum):
    QUEUE_FULL = "queue_full"
    TOKENS_FULL = "queued_tokens_full"
    KEY_LIMIT = "per_key_limit"
    WAIT_TIMEOUT = "wait_timeout"
    SHUTDOWN = "shutdown"


class Rejected(Exception):
    """Raised by :meth:`Admission.acquire`: the request gets an honest answer instead."""

    def __init__(self, reason: RejectReason, message: str, retry_after_seconds: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_seconds = retry_after_seconds

    @property
    def status(self) -> int:
        return 429 if self.reason is RejectReason.KEY_LIMIT else 503


@dataclass
class Ticket:
    """One admitted request's hold on the KV budget; given back by :meth:`Admission.release`."""

    kv_tokens: int
    released: bool = False


@dataclass
class _Waiter:
    key: str
    cost: Cost
    future: asyncio.Future[Ticket]
    enqueued_monotonic: float
    extended: bool = False  # waited past max_wait_seconds for a restart


# --- estimating a request's cost from its body ----------------------------------------------


def _text_tokens(text: str) -> int:
    # No tokenizer here on purpose (the gate must stay light): ~4 bytes per token for English
    # BPE vocabularies, never fewer tokens than words. An over-estimate only admits later.
    # surrogatepass: a lone surrogate (valid JSON, "\ud800") counts as its 3 bytes, not an error.
    return max(len(text.split()), math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4))


# A prompt is text, ids, or a list of either (vLLM's batch form): nested deeper than this it is
# no prompt vLLM reads, and the gate answers 400 for it (RecursionError, as for JSON nested past
# json's own limit) instead of walking it as deep as the interpreter's recursion limit lets it.
MAX_PROMPT_DEPTH = 16


def _prompt_tokens(value: Any, depth: int = 0) -> int:
    if isinstance(value, str):
        return _text_tokens(value)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # token ids
        if depth >= MAX_PROMPT_DEPTH:
            raise RecursionError(f"a prompt nested more than {MAX_PROMPT_DEPTH} lists deep")
        return sum(_prompt_tokens(v, depth + 1) for v in value)
    return 0


def _message_tokens(messages: Any) -> int:
    total = 0
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        total += 4  # role and separators, as chat templates add them
        content = m.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _text_tokens(part["text"])
    return total + 2 if total else 0


def estimate_cost(body: bytes | bytearray, default_output_tokens: int) -> Cost:
    """:func:`cost_of` a body not read yet."""
    return cost_of(body, body_json(body), default_output_tokens)


def cost_of(body: bytes | bytearray, doc: object | None, default_output_tokens: int) -> Cost:
    """Prompt tokens estimated from an OpenAI-style JSON body (``doc``: as
    :func:`~vllm_guardian.gate.continuation.body_json` read it), plus the output it may
    produce."""
    if not isinstance(doc, dict):
        return Cost(_text_tokens(body.decode("utf-8", "replace")) if body else 0, 0)
    prompt = _prompt_tokens(doc.get("prompt")) + _message_tokens(doc.get("messages"))
    prompt += _prompt_tokens(doc.get("input"))
    raw_max = doc.get("max_completion_tokens", doc.get("max_tokens"))
    output = raw_max if isinstance(raw_max, int) and raw_max >= 0 else default_output_tokens
    n = doc.get("n")
    copies = n if isinstance(n, int) and 1 <= n <= 128 else 1
    return Cost(prompt, output * copies)


# --- the queue --------------------------------------------------------------------------------


class Admission:
    """The gate's state (open or closed, the KV budget) and its FIFO queue."""

    def __init__(
        self,
        limits: Limits,
        metrics: GateMetrics,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self._now = monotonic
        self.open = False
        self.reason = "starting: no answer from the upstream yet"
        self.kv_capacity_tokens: int | None = None
        self.kv_capacity_source: str | None = None
        self.kv_observed_used_tokens = 0.0
        self.committed_tokens = 0
        self.in_flight = 0
        self.longest_wait_seconds = 0.0  # the longest any request has waited, since start
        self._queue: collections.OrderedDict[int, _Waiter] = collections.OrderedDict()
        self._ids = itertools.count()
        self._queued_tokens = 0
        self._per_key: collections.Counter[str] = collections.Counter()
        self._wake = asyncio.Event()
        self._bucket = float(limits.release_burst)
        self._bucket_monotonic = monotonic()
        self._dispatcher: asyncio.Task[None] | None = None
        self._closed = False
        # The guardian's /ready says a restart or relaunch is in progress (the follower sets
        # it), and when one was last seen in progress (None: never).
        self.restart_in_progress = False
        self._restart_seen_monotonic: float | None = None
        metrics.set_open(False)
        # Read when scraped, not set on every change: four gauge writes (each a lock and a
        # check) per request were a tenth of the gate's own CPU on the request path.
        metrics.in_flight.set_function(lambda: self.in_flight)
        metrics.kv_committed_tokens.set_function(lambda: self.committed_tokens)
        metrics.queue_depth.set_function(lambda: len(self._queue))
        metrics.queued_tokens.set_function(lambda: self._queued_tokens)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._dispatcher = asyncio.get_running_loop().create_task(
            self._dispatch(), name="gate-dispatcher"
        )

    async def stop(self) -> None:
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        for w in list(self._queue.values()):
            if not w.future.done():
                w.future.set_exception(
                    Rejected(RejectReason.SHUTDOWN, "the gate is shutting down", 1)
                )
        self._queue.clear()
        self._queued_tokens = 0
        self._per_key.clear()

    # --- written by the follower -------------------------------------------------------------

    def set_state(self, open_: bool, reason: str) -> None:
        if open_ != self.open:
            self.metrics.set_open(open_)
            # Once per change, not per poll: the operator's record of when and why it held.
            if open_:
                log.info("gate open: new requests pass (%d queued are released)", len(self._queue))
            else:
                log.info("gate holding new requests: %s", reason)
        self.open, self.reason = open_, reason
        if open_:
            self._wake.set()

    def set_restart_in_progress(self, on: bool) -> None:
        """Whether the guardian says a restart or relaunch of the service is in progress (its
        ``/ready`` field; False when there is no guardian or it does not answer)."""
        if on:
            self._restart_seen_monotonic = self._now()
        self.restart_in_progress = on

    def set_kv(
        self, capacity_tokens: int | None, used_tokens: float, source: str | None = None
    ) -> None:
        """The KV pool as vLLM's /metrics says it (``source``: where; None with the size when
        nothing says it, as on vLLM's Rust frontend: the KV admission then admits)."""
        self.kv_capacity_tokens = capacity_tokens
        self.kv_capacity_source = source if capacity_tokens is not None else None
        self.kv_observed_used_tokens = used_tokens
        self.metrics.kv_capacity_tokens.set(capacity_tokens or 0)  # its help: 0 is unknown
        self._wake.set()

    # --- used by the proxy -------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def oldest_wait_seconds(self) -> float:
        """How long the request at the head of the queue has waited (0 when none waits)."""
        for w in self._queue.values():
            return max(0.0, self._now() - w.enqueued_monotonic)
        return 0.0

    def kv_fits(self, cost: Cost) -> bool:
        cap = self.kv_capacity_tokens
        if not self.limits.kv_admission or cap is None or self.committed_tokens == 0:
            return True
        used = max(float(self.committed_tokens), self.kv_observed_used_tokens)
        return used + cost.kv_tokens <= cap * (1.0 - self.limits.kv_reserve_ratio)

    async def acquire(
        self,
        key: str,
        cost: Cost,
        *,
        front: bool = False,
        extra_wait_seconds: float = 0.0,
        client_timeout_seconds: float | None = None,
    ) -> Ticket:
        """Wait for admission (FIFO); raises :class:`Rejected` when the request cannot wait.
        ``front`` puts a retried request at the head: it had been admitted once already.
        ``extra_wait_seconds`` lengthens its wait past ``max_wait_seconds`` (a request taken
        back from a hung engine keeps the time it would have waited in there).
        ``client_timeout_seconds``: what the client said it waits from now (None: unsaid); the
        restart's extension never goes past it."""
        if self._closed:
            raise Rejected(RejectReason.SHUTDOWN, "the gate is shutting down", 1)
        if self.open and not self._queue and self.kv_fits(cost):
            self.metrics.admitted.inc()
            return self._grant(cost)
        self._check_bounds(key, cost)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, cost, loop.create_future(), self._now())
        wid = next(self._ids)
        self._queue[wid] = waiter
        if front:
            self._queue.move_to_end(wid, last=False)
        self._queued_tokens += cost.prompt_tokens
        self._per_key[key] += 1
        self.metrics.held.inc()
        self._wake.set()
        max_wait = self.limits.max_wait_seconds + extra_wait_seconds
        longest = max_wait + self.limits.restart_extra_wait_seconds
        if client_timeout_seconds is not None:
            longest = min(longest, max(max_wait, client_timeout_seconds))
        try:
            ticket = await self._wait(waiter, max_wait, longest)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.exception():
                ticket = waiter.future.result()  # granted in the same instant: take it
            else:
                self._remove(wid)
                self.metrics.rejected.labels(RejectReason.WAIT_TIMEOUT.value).inc()
                raise Rejected(
                    RejectReason.WAIT_TIMEOUT,
                    f"the upstream did not accept new requests within {max_wait:g} s"
                    + (" and the restart's extension" if waiter.extended else "")
                    + f" ({self.reason})",
                    self.limits.retry_after_seconds,
                ) from None
        except asyncio.CancelledError:
            # The client went away while queued: it leaves the queue, or gives its grant back.
            # (A rejection that came in the same turn, as the gate stopped, is not raised in
            # place of the cancellation.)
            granted = waiter.future
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release(granted.result())
            else:
                self._remove(wid)
            raise
        finally:
            waited = self._now() - waiter.enqueued_monotonic
            self.metrics.wait_seconds.observe(waited)
            self.longest_wait_seconds = max(self.longest_wait_seconds, waited)
        self.metrics.admitted.inc()
        return ticket

    async def _wait(self, waiter: _Waiter, max_wait: float, longest: float) -> Ticket:
        """The waiter's grant within ``max_wait`` seconds of its arrival, or past it up to
        ``longest`` while a restart it was held during still holds it; else TimeoutError."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # comes in the turn the grant does (tests/test_gate_cancel.py).
        try:
            async with asyncio.timeout(max_wait):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            pass
        while self._restart_holds(waiter) and not waiter.future.done():
            waiter.extended = True
            left = waiter.enqueued_monotonic + longest - self._now()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(min(left, EXTENSION_RECHECK_SECONDS)):
                    return await asyncio.shield(waiter.future)
            except TimeoutError:
                continue
        raise TimeoutError

    def _restart_holds(self, waiter: _Waiter) -> bool:
        """The restart extends this waiter's wait: one was in progress while it waited, and
        it still is, or it ended since it came and the gate is open again, releasing the
        queue."""
        if self.restart_in_progress:
            return True
        seen = self._restart_seen_monotonic
        return self.open and seen is not None and seen >= waiter.enqueued_monotonic

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.committed_tokens -= ticket.kv_tokens
        self.in_flight -= 1
        if self._queue:
            # The freed room may let the head go. With none waiting there is nothing to
            # hand on: no wake-up (a task switch and a new future every request).
            self._wake.set()

    # --- internals ---------------------------------------------------------------------------

    def _check_bounds(self, key: str, cost: Cost) -> None:
        lim = self.limits
        reason: RejectReason | None = None
        if len(self._queue) >= lim.max_queue_requests:
            reason, msg = (
                RejectReason.QUEUE_FULL,
                f"the gate's queue is full ({lim.max_queue_requests} requests waiting)",
            )
        elif self._queue and self._queued_tokens + cost.prompt_tokens > lim.max_queued_tokens:
            reason, msg = (
                RejectReason.TOKENS_FULL,
                f"the gate's queue is full ({self._queued_tokens} prompt tokens waiting)",
            )
        elif lim.per_key_share_ratio > 0:
            share = max(1, int(lim.per_key_share_ratio * lim.max_queue_requests))
            if self._per_key[key] >= share:
                reason, msg = (
                    RejectReason.KEY_LIMIT,
                    f"too many requests of this client waiting (at most {share})",
                )
        if reason is not None:
            self.metrics.rejected.labels(reason.value).inc()
            raise Rejected(reason, msg, lim.retry_after_seconds)

    def _grant(self, cost: Cost) -> Ticket:
        self.committed_tokens += cost.kv_tokens
        self.in_flight += 1
        return Ticket(cost.kv_tokens)

    def _remove(self, wid: int) -> _Waiter | None:
        w = self._queue.pop(wid, None)
        if w is not None:
            self._queued_tokens -= w.cost.prompt_tokens
            self._per_key[w.key] -= 1
            if self._per_key[w.key] <= 0:
                del self._per_key[w.key]
        return w

    def _take_release_token(self) -> float:
        """0 when a release may happen now, else the seconds until one may."""
        rate = self.limits.release_rate_per_second
        if rate <= 0:
            return 0.0
        now = self._now()
        self._bucket = min(
            float(self.limits.release_burst), self._bucket + (now - self._bucket_monotonic) * rate
        )
        self._bucket_monotonic = now
        if self._bucket >= 1.0:
            self._bucket -= 1.0
            return 0.0
        return (1.0 - self._bucket) / rate

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.open and self._queue:
                wid, head = next(iter(self._queue.items()))
                if head.future.done():  # cancelled by its waiter in the meantime
                    self._remove(wid)
                    continue
                if not self.kv_fits(head.cost):
                    break  # a release or a fresher /metrics wakes us
                delay = self._take_release_token()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                self._remove(wid)
                head.future.set_result(self._grant(head.cost))
