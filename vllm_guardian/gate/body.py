"""Request bodies: read under a deadline and a rate floor, and held within a gate-wide budget.

Where it sits: the proxy (``proxy.py``) reads every request's body here before anything else,
and keeps it in memory until its exchange ends (a held request is sent later, possibly twice).
Without bounds a client could announce a body and never send it (holding its connection and
its handler for ever), or many clients could each send most of a large body and stop (the gate
held 1.2 GB for 40 unfinished 30 MiB bodies). Here:

* **deadline**: the whole body within ``timeout_seconds`` of the start of its read, else
  408 (``body_timeout``);
* **rate floor**: in every window of ``rate_window_seconds`` at least
  ``min_rate_bytes_per_second`` × the window must arrive (unless the body ends), else 408
  (``body_too_slow``): a body trickled in to stay under the deadline is cut within a window;
* **budget**: the bytes of every body held by the gate at once — being read, queued, being
  sent — stay within :class:`BodyBudget`'s capacity. Room is reserved before each read (at
  most :data:`READ_BYTES`) and given back when the exchange ends; a read that finds no room
  waits, first come first served, up to ``budget_wait_seconds`` (that wait is not counted
  against the client's deadline or rate), then the request gets 503 (``body_budget``);
* **size**: more than ``max_bytes`` is 413 (``too_large``), before reading when
  ``Content-Length`` says so.

What the budget counts is the bodies' bytes. Python's ``bytearray`` may hold up to an eighth
more while a body grows, and the server buffers up to 128 KiB per connection ahead of a read
(``http1.BUFFER_BYTES``).
"""

from __future__ import annotations

import asyncio
import collections
import enum
from dataclasses import dataclass
from typing import Protocol

from vllm_guardian.gate.http1 import BodyError
from vllm_guardian.gate.metrics import GateMetrics

# What one read takes at most, and so what one read reserves of the budget.
READ_BYTES = 64 * 1024


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 32 * 1024 * 1024
    timeout_seconds: float = 30.0
    min_rate_bytes_per_second: int = 1024  # 0: no floor
    rate_window_seconds: float = 5.0
    budget_wait_seconds: float = 2.0


class BodyRefusal(enum.StrEnum):
    """Why a body was not read; the values are ``rejected_total``'s reasons."""

    TOO_LARGE = "too_large"
    TIMEOUT = "body_timeout"
    TOO_SLOW = "body_too_slow"
    BUDGET = "body_budget"


class BodyRefused(Exception):
    def __init__(self, refusal: BodyRefusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.message = message


class BodyMalformed(Exception):
    """The body's framing or encoding is broken (a bad chunk, gzip that is not gzip)."""


class NoRoom(Exception):
    """:meth:`BodyBudget.take` found no room within its wait."""


class BodyBudget:
    """The bytes of request bodies the gate holds at once, within ``capacity_bytes``.

    :meth:`take` reserves (waiting first come, first served when there is no room),
    :meth:`give` returns. ``held_bytes`` is what is reserved now, ``peak_bytes`` the most ever
    reserved at once (``vllm_guardian_gate_body_bytes`` follows ``held_bytes``)."""

    def __init__(self, capacity_bytes: int, metrics: GateMetrics) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        metrics.body_bytes.set_function(lambda: self.held_bytes)  # read when scraped

    def try_take(self, n: int) -> bool:
        """Reserve ``n`` bytes if they are free now and nobody waits before; whether it did."""
        if not self._waiters and self.held_bytes + n <= self.capacity_bytes:
            self._add(n)
            return True
        return False

    async def take(self, n: int, wait_seconds: float) -> float:
        """Reserve ``n`` bytes; the seconds it waited for them. Raises :class:`NoRoom` when
        there is none within ``wait_seconds``."""
        if self.try_take(n):
            return 0.0
        if n > self.capacity_bytes:
            raise NoRoom
        loop = asyncio.get_running_loop()
        started = loop.time()
        entry = (n, loop.create_future())
        self._waiters.append(entry)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
            # comes in the turn the room does (tests/test_gate_cancel.py).
            async with asyncio.timeout(wait_seconds):
                await asyncio.shield(entry[1])
        except TimeoutError:
            if not entry[1].done():  # (granted in the same instant: keep it)
                self._forget(entry)
                raise NoRoom from None
        except asyncio.CancelledError:
            if entry[1].done():
                self.give(n)
            else:
                self._forget(entry)
            raise
        return loop.time() - started

    def give(self, n: int) -> None:
        self.held_bytes -= n
        self._grant()

    def _add(self, n: int) -> None:
        self.held_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _forget(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        self._waiters.remove(entry)
        entry[1].cancel()
        self._grant()  # the next in line may fit now

    def _grant(self) -> None:
        while self._waiters:
            n, future = self._waiters[0]
            if self.held_bytes + n > self.capacity_bytes:
                return
            self._waiters.popleft()
            self._add(n)
            future.set_result(None)


class HeldBody:
    """A body read whole, and its share of the budget until :meth:`release`."""

    def __init__(self, data: bytearray, budget: BodyBudget) -> None:
        self.data = data
        self._budget = budget
        self._held = len(data)

    def release(self) -> None:
        held, self._held = self._held, 0
        if held:
            self._budget.give(held)


class BodyStream(Protocol):
    """A request's body as the server hands it over (``http1.RequestBody``)."""

    def read_nowait(self, n: int) -> bytes: ...

    async def read(self, n: int) -> bytes: ...

    def at_eof(self) -> bool: ...


async def read_body(
    stream: BodyStream, content_length: int | None, limits: BodyLimits, budget: BodyBudget
) -> HeldBody:
    """The whole body, within ``limits`` and ``budget`` (see the module's docstring). Raises
    :class:`BodyRefused` or :class:`BodyMalformed`; either way nothing stays reserved."""
    if content_length is not None and content_length > limits.max_bytes:
        raise BodyRefused(
            BodyRefusal.TOO_LARGE,
            f"request body larger than the gate's limit of {limits.max_bytes} bytes",
        )
    data = bytearray()
    reserved = 0  # of the budget: len(data) plus the read in progress
    # A small body is usually all in the server's buffer with its head: taken in one piece, no
    # wait, no timer. What is not there yet is read below, as any body is.
    if (
        content_length is not None
        and 0 < content_length <= READ_BYTES
        and budget.try_take(content_length)
    ):
        try:
            first = stream.read_nowait(content_length)
        except BodyError as e:
            budget.give(content_length)
            raise BodyMalformed(str(e)) from None
        except BaseException:
            budget.give(content_length)
            raise
        # Whole only when nothing follows: the server decodes a compressed body as it reads,
        # and more bytes come out than its Content-Length counts.
        if len(first) == content_length and stream.at_eof():
            return HeldBody(bytearray(first), budget)
        budget.give(content_length - len(first))
        data += first
        reserved = len(first)
    loop = asyncio.get_running_loop()
    try:
        now = loop.time()
        deadline = now + limits.timeout_seconds
        window_start, window_bytes = now, 0
        floor = limits.min_rate_bytes_per_second
        while True:
            if content_length is not None and len(data) <= content_length:
                want = min(READ_BYTES, max(1, content_length - len(data)))
            else:  # no length, or a decoded body longer than it: up to the limit
                want = min(READ_BYTES, limits.max_bytes + 1 - len(data))
            try:
                waited = await budget.take(want, limits.budget_wait_seconds)
            except NoRoom:
                raise BodyRefused(
                    BodyRefusal.BUDGET,
                    f"the gate's request body budget ({budget.capacity_bytes} bytes, all "
                    "requests together) is full; try again",
                ) from None
            reserved += want
            deadline += waited  # the gate's wait is not the client's
            window_start += waited
            now = loop.time()
            wait = deadline - now
            if floor > 0:
                wait = min(wait, window_start + limits.rate_window_seconds - now)
            chunk: bytes | None
            try:
                async with asyncio.timeout(max(0.0, wait)):
                    chunk = await stream.read(want)
            except TimeoutError:
                chunk = None
            except BodyError as e:
                raise BodyMalformed(str(e)) from None
            got = len(chunk) if chunk else 0
            budget.give(want - got)
            reserved -= want - got
            if chunk == b"":
                return HeldBody(data, budget)  # the end: ``reserved`` is now len(data)
            if chunk:
                data += chunk
                window_bytes += got
                if len(data) > limits.max_bytes:
                    raise BodyRefused(
                        BodyRefusal.TOO_LARGE,
                        f"request body larger than the gate's limit of {limits.max_bytes} bytes",
                    )
            now = loop.time()
            if chunk is None and now >= deadline:
                raise BodyRefused(
                    BodyRefusal.TIMEOUT,
                    f"the request body did not arrive within {limits.timeout_seconds:g} s",
                )
            # A body all there is done, however late the loop saw it: the floor cuts a trickle.
            whole = content_length is not None and len(data) >= content_length
            if floor > 0 and not whole and now >= window_start + limits.rate_window_seconds:
                if window_bytes < floor * limits.rate_window_seconds:
                    raise BodyRefused(
                        BodyRefusal.TOO_SLOW,
                        f"the request body arrived slower than {floor} bytes/s "
                        f"(measured over {limits.rate_window_seconds:g} s)",
                    )
                window_start, window_bytes = now, 0
    except BaseException:
        if reserved:
            budget.give(reserved)
        raise
