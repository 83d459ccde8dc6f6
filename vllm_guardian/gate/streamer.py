"""The continuing relay's steady state: a streamed answer's events relayed from the upstream
connection's callbacks, without a task switch per event.

Where it sits: :class:`~vllm_guardian.gate.relay.ContinuingRelay` hands a committed stream to a
:class:`Streamer` (``UpstreamResponse.stream``) and waits once, for the :class:`Stop` that says
why the stream came back to it: an event it must act on (``[DONE]``, a cut, vLLM's abort), the
body's end, a client that reads slower than the upstream writes, or one that left. Each read is
cut into events, each common token chunk read for its ids (``StreamState.relay_common``, else
``on_event``) and what the client gets written to its transport at once, one write per read.
The hot path of every token a user receives, in its own module so that it stays small.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from vllm_guardian.gate.continuation import Kind, SseSplitter, Step, StreamState
from vllm_guardian.gate.http1 import StreamResponse
from vllm_guardian.gate.upstream import UpstreamError, UpstreamResponse


@dataclass(frozen=True)
class Stop:
    """Why :class:`Streamer` handed the stream back to the relay's coroutine."""

    step: Step | None = None  # an event that is not relayed as it is ([DONE] written already)
    rest: list[bytes] = field(default_factory=list)  # the events after it in the same read
    ended: bool = False  # the body ended, or the connection failed, without [DONE]
    drain: bool = False  # the client's connection is full: wait for it (the upstream paused)
    client_gone: bool = False
    error: Exception | None = None  # raised reading an event: the relay raises it


class Streamer:
    """The relay's steady state, in the upstream connection's callbacks: each read's events
    through :meth:`StreamState.on_event` and straight to the client's transport, framed as
    the server frames them, one write per read. No future, task switch or await per event: the
    coroutine waits once, for the event or condition that needs it (:class:`Stop`)."""

    def __init__(
        self,
        state: StreamState,
        splitter: SseSplitter,
        up: UpstreamResponse,
        resp: StreamResponse,
    ) -> None:
        self.state = state
        self.splitter = splitter
        self.up = up
        self.resp = resp
        self.stopped: asyncio.Future[Stop] = asyncio.get_running_loop().create_future()

    def body(self, data: bytes) -> None:
        if self.stopped.done():
            return
        try:
            events = self.splitter.feed(data)
            if len(events) == 1:  # one whole event a read, as vLLM writes them: no lists
                common = self.state.relay_common(events[0])
                if common is not None:
                    if common and not self._write(common):
                        return
                    self._after_write()
                    return
            self._events(events)
        except Exception as e:
            # Raised here, in the upstream's callback, the loop would close that connection and
            # the relay would take it for a cut (and continue the stream against a healthy
            # engine); raised in the relay, it ends the exchange as any error of the gate's does.
            self._stop(Stop(error=e))

    def _events(self, events: list[bytes]) -> None:
        state = self.state
        out: list[bytes] = []
        for i, event in enumerate(events):
            common = state.relay_common(event)
            if common is not None:
                if common:
                    out.append(common)
                continue
            step = state.on_event(event)
            if step.kind is Kind.RELAY:
                if step.data:
                    out.append(step.data)
                continue
            if step.kind is Kind.DONE:
                out.append(step.data)  # written with the events before it
            self._stop(Stop(step=step, rest=events[i + 1 :]), out)
            return
        if out and not self._write(out[0] if len(out) == 1 else b"".join(out)):
            return
        self._after_write()

    def _after_write(self) -> None:
        if self.splitter.overflowing:
            self._stop(Stop())
        elif self.resp.writing_paused:
            self.up.pause()
            self._stop(Stop(drain=True))

    def end(self, error: UpstreamError | None) -> None:
        if not self.stopped.done():
            self.stopped.set_result(Stop(ended=True))

    def _write(self, data: bytes) -> bool:
        try:
            self.resp.write_nowait(data)
        except ConnectionResetError:
            self._stop(Stop(client_gone=True))
            return False
        return True

    def _stop(self, stop: Stop, out: list[bytes] | None = None) -> None:
        """Hand the stream back; ``out`` (the events before the one that stops it, and
        ``[DONE]``) is written first."""
        if out and not self._write(b"".join(out)):
            return
        self.up.unstream()
        if not self.stopped.done():
            self.stopped.set_result(stop)
