"""An open-loop load generator for the twin (or a real vLLM), loopback only.

``plan_requests`` turns a ``LoadProfile`` into a seeded, bounded list of arrivals (Poisson, plus
bursts) with prompt/output lengths and shared prefixes; it is pure, so the simulation tests feed
the same plan straight into the engine. ``run_load`` sends that plan over HTTP on its schedule,
whether or not earlier requests have finished (open loop), from one asyncio event loop (aiohttp)
rather than a thread per request, so thousands in flight cost sockets, not threads; it records
every request's outcome: ok, HTTP error, error event in the stream, connection error, latency,
tokens. The window (``max_duration_seconds``) bounds when requests are *sent*; every request
sent gets its whole ``request_timeout_seconds`` to finish, so the run ends after the window once
the last answer is in, and a healthy server fails none. ``send_one`` is the same request,
blocking (``requests``), for callers that hold their own threads (the load test). Each planned
request may say whether it streams (``PlannedRequest.stream``; None: the run's default). It
refuses any host that is not a loopback address.

Prompts are made of whitespace-separated words and the twin counts one token per word, so a
planned prompt of N tokens is N tokens on the twin.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import requests

from vllm_guardian.sim.scenarios import LoadProfile


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_seconds: float  # simulated seconds after the load starts
    prompt: str
    prompt_tokens: int
    max_tokens: int
    burst: bool = False
    stream: bool | None = None  # None: the run's default


# How long a request of this load waits for its answer: the default of requests' own clients,
# shorter than what the gate may hold a request for (OpenAI's SDKs wait 600 s).
REQUEST_TIMEOUT_SECONDS = 30.0


class OutcomeKind(enum.Enum):
    OK = "ok"
    HTTP_ERROR = "http_error"
    STREAM_ERROR = "stream_error"  # HTTP 200, then an error event (engine death)
    INCOMPLETE = "incomplete"  # the stream ended without [DONE]
    CONNECTION_ERROR = "connection_error"
    TIMEOUT = "timeout"  # no answer within the request's own time bound
    # HTTP 200 with finish_reason "abort": vLLM aborted the request (its shutdown, an engine
    # abort) and answered it empty or cut: no answer, whatever the status says.
    ABORTED = "aborted"
    NOT_SENT = "not_sent"  # the window closed before its arrival


@dataclass(frozen=True)
class RequestOutcome:
    index: int
    kind: OutcomeKind
    scheduled_seconds: float  # real seconds after the start
    latency_seconds: float | None
    ttft_seconds: float | None
    http_status: int | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    error: str | None
    # Real seconds after the start when the answer ended; on a busy client a request can be
    # sent later than scheduled, so this is not always scheduled + latency.
    ended_seconds: float | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["kind"] = self.kind.value
        return json.dumps(d, sort_keys=True)


@dataclass(frozen=True)
class LoadResult:
    outcomes: tuple[RequestOutcome, ...]
    duration_seconds: float

    def count(self, kind: OutcomeKind) -> int:
        return sum(1 for o in self.outcomes if o.kind is kind)

    def summary(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k.value: self.count(k) for k in OutcomeKind}
        out["completion_tokens"] = sum(o.completion_tokens for o in self.outcomes)
        out["duration_seconds"] = round(self.duration_seconds, 3)
        return out


def _prompt(rng: random.Random, index: int, n_tokens: int, profile: LoadProfile) -> str:
    shared = int(n_tokens * profile.shared_prefix_ratio)
    words: list[str] = []
    if shared:
        k = rng.randrange(max(1, profile.num_shared_prefixes))
        words.extend(f"p{k}w{i}" for i in range(shared))
    words.extend(f"r{index}w{i}" for i in range(n_tokens - shared))
    return " ".join(words)


def plan_requests(
    profile: LoadProfile, seed: int, max_requests: int, duration_seconds: float
) -> list[PlannedRequest]:
    """Seeded arrivals within ``duration_seconds`` (simulated), at most ``max_requests``."""
    rng = random.Random(seed)  # noqa: S311 (reproducible traffic, not security)
    arrivals: list[tuple[float, bool]] = []
    t = 0.0
    if profile.rate_per_second > 0:
        while len(arrivals) < max_requests:
            t += rng.expovariate(profile.rate_per_second)
            if t >= duration_seconds:
                break
            arrivals.append((t, False))
    if profile.burst_size > 0:
        b = profile.burst_start_seconds
        while b < duration_seconds:
            arrivals.extend((b, True) for _ in range(profile.burst_size))
            if profile.burst_interval_seconds <= 0:
                break
            b += profile.burst_interval_seconds
    arrivals.sort(key=lambda a: a[0])
    out = []
    for index, (at, burst) in enumerate(arrivals[:max_requests]):
        lo, hi = (
            (profile.burst_prompt_tokens_min, profile.burst_prompt_tokens_max)
            if burst
            else (profile.prompt_tokens_min, profile.prompt_tokens_max)
        )
        n = rng.randint(lo, hi)
        max_tokens = rng.randint(profile.output_tokens_min, profile.output_tokens_max)
        out.append(PlannedRequest(index, at, _prompt(rng, index, n, profile), n, max_tokens, burst))
    return out


def require_loopback(base_url: str) -> None:
    """Raise ValueError unless the URL's host resolves to a loopback address."""
    host = urlsplit(base_url).hostname
    if not host:
        raise ValueError(f"{base_url!r}: no host")
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{base_url!r}: cannot resolve {host!r}") from exc
    if not addr.is_loopback:
        raise ValueError(f"{base_url!r}: the load generator only talks to loopback addresses")


def _sse_events(resp: requests.Response) -> Iterator[str]:
    for raw in resp.iter_lines():
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if line.startswith("data: "):
            yield line[6:]


def _body(planned: PlannedRequest, model: str, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "prompt": planned.prompt,
        "max_tokens": planned.max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }


class _Answer:
    """What one request's answer has shown so far (tokens, the first token's time, the finish
    reason), read the same way by the blocking and the event-loop sender."""

    def __init__(
        self, planned: PlannedRequest, scheduled_seconds: float, load_start: float | None
    ) -> None:
        self.planned = planned
        self.scheduled_seconds = scheduled_seconds
        self.load_start = load_start
        self.start = time.monotonic()
        self.ttft: float | None = None
        self.tokens = 0
        self.finish: str | None = None
        self.done = False  # a stream's [DONE] came

    def unary(self, data: Any) -> None:
        self.tokens = int(data["usage"]["completion_tokens"])
        self.finish = data["choices"][0]["finish_reason"]

    def event(self, event: str) -> str | None:
        """One SSE event's data; the message of an error event, else None."""
        if event == "[DONE]":
            self.done = True
            return None
        chunk = json.loads(event)
        if "error" in chunk:
            return str(chunk["error"].get("message"))
        choice = chunk["choices"][0]
        if choice.get("text"):
            self.tokens += 1
            if self.ttft is None:
                self.ttft = time.monotonic() - self.start
        self.finish = choice.get("finish_reason") or self.finish
        return None

    def kind(self) -> OutcomeKind:
        """A whole answer's kind: OK, unless vLLM ended it with finish_reason "abort"."""
        return OutcomeKind.ABORTED if self.finish == "abort" else OutcomeKind.OK

    def outcome(self, kind: OutcomeKind, status: int | None, error: str | None) -> RequestOutcome:
        now = time.monotonic()
        p = self.planned
        return RequestOutcome(
            p.index, kind, self.scheduled_seconds, now - self.start, self.ttft, status,
            p.prompt_tokens, self.tokens, self.finish, error,
            None if self.load_start is None else now - self.load_start,
        )  # fmt: skip


def send_one(
    base_url: str,
    planned: PlannedRequest,
    model: str,
    stream: bool,
    timeout_seconds: float,
    scheduled_seconds: float,
    load_start: float | None = None,
) -> RequestOutcome:
    """One request; ``load_start`` (monotonic) dates its end relative to the load's start."""
    answer = _Answer(planned, scheduled_seconds, load_start)
    outcome = answer.outcome
    try:
        with requests.post(
            f"{base_url}/v1/completions",
            json=_body(planned, model, stream),
            stream=stream,
            timeout=timeout_seconds,
        ) as resp:
            if resp.status_code != 200:
                return outcome(OutcomeKind.HTTP_ERROR, resp.status_code, resp.text[:500])
            if not stream:
                answer.unary(resp.json())
                return outcome(answer.kind(), 200, None)
            for event in _sse_events(resp):
                error = answer.event(event)
                if error is not None:
                    return outcome(OutcomeKind.STREAM_ERROR, 200, error)
                if answer.done:
                    break
            kind = answer.kind() if answer.done else OutcomeKind.INCOMPLETE
            return outcome(kind, 200, None)
    except requests.exceptions.ChunkedEncodingError as exc:
        return outcome(OutcomeKind.INCOMPLETE, 200, type(exc).__name__)
    except (requests.Timeout, requests.ConnectionError) as exc:
        # A read timeout inside a stream surfaces as a ConnectionError wrapping ReadTimeoutError.
        timed_out = isinstance(exc, requests.Timeout) or "timed out" in str(exc)
        kind = OutcomeKind.TIMEOUT if timed_out else OutcomeKind.CONNECTION_ERROR
        return outcome(kind, None, type(exc).__name__)


async def _send_one_async(
    session: aiohttp.ClientSession,
    base_url: str,
    planned: PlannedRequest,
    model: str,
    stream: bool,
    timeout_seconds: float,
    scheduled_seconds: float,
    load_start: float,
) -> RequestOutcome:
    """``send_one`` on the event loop: the same body, outcome kinds and time bounds (connect,
    and each read, within ``timeout_seconds``, as ``requests`` bounds them)."""
    answer = _Answer(planned, scheduled_seconds, load_start)
    outcome = answer.outcome
    answered = False  # the status line came: a failure after it is a cut answer
    timeout = aiohttp.ClientTimeout(
        total=None, connect=timeout_seconds, sock_connect=timeout_seconds,
        sock_read=timeout_seconds,
    )  # fmt: skip
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=_body(planned, model, stream), timeout=timeout
        ) as resp:
            answered = True
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                return outcome(OutcomeKind.HTTP_ERROR, resp.status, text[:500])
            if not stream:
                answer.unary(json.loads(await resp.read()))
                return outcome(answer.kind(), 200, None)
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                error = answer.event(line[6:])
                if error is not None:
                    return outcome(OutcomeKind.STREAM_ERROR, 200, error)
                if answer.done:
                    break
            kind = answer.kind() if answer.done else OutcomeKind.INCOMPLETE
            return outcome(kind, 200, None)
    except TimeoutError as exc:  # aiohttp's ServerTimeoutError is one
        return outcome(OutcomeKind.TIMEOUT, None, type(exc).__name__)
    except (aiohttp.ClientError, OSError) as exc:
        # After the status line, a connection that ends early is an answer cut short (as
        # requests' ChunkedEncodingError was); before it, the server was not reached or dropped us.
        # The type and what it says (a reset, a refusal and a close read differently).
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if answered:
            return outcome(OutcomeKind.INCOMPLETE, 200, what)
        return outcome(OutcomeKind.CONNECTION_ERROR, None, what)


def _not_sent(p: PlannedRequest, scheduled_seconds: float) -> RequestOutcome:
    return RequestOutcome(
        p.index, OutcomeKind.NOT_SENT, scheduled_seconds, None, None, None, p.prompt_tokens, 0,
        None, None,
    )  # fmt: skip


async def _run_load_async(
    base_url: str,
    plan: list[PlannedRequest],
    model: str,
    speed: float,
    stream: bool,
    max_duration_seconds: float,
    max_in_flight: int,
    request_timeout_seconds: float,
    stop: threading.Event,
    on_outcome: Callable[[RequestOutcome], None] | None,
) -> LoadResult:
    start = time.monotonic()
    deadline = start + max_duration_seconds
    slots = asyncio.Semaphore(max_in_flight)
    tasks: list[asyncio.Task[RequestOutcome]] = []
    skipped: list[RequestOutcome] = []

    async def one(p: PlannedRequest, streams: bool, scheduled: float) -> RequestOutcome:
        async with slots:  # over max_in_flight, a request waits client-side, unseen by vLLM
            out = await _send_one_async(
                session, base_url, p, model, streams, request_timeout_seconds, scheduled, start
            )
        if on_outcome is not None:
            on_outcome(out)
        return out

    # One connection per request, closed after it (as the thread-per-request client did): a
    # pooled connection to a server that restarted would fail a request the server never saw.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for p in plan:
            due = start + p.at_seconds / speed
            while not stop.is_set() and time.monotonic() < due < deadline:
                # Sleep in short steps so that ``stop`` (a threading.Event) is seen promptly.
                await asyncio.sleep(min(0.05, due - time.monotonic()))
            if due >= deadline or stop.is_set():
                skipped.append(_not_sent(p, due - start))
                continue
            streams = stream if p.stream is None else p.stream
            tasks.append(asyncio.create_task(one(p, streams, due - start)))
        outcomes = await asyncio.gather(*tasks)
    all_outcomes = sorted([*outcomes, *skipped], key=lambda o: o.index)
    return LoadResult(tuple(all_outcomes), time.monotonic() - start)


def run_load(
    base_url: str,
    plan: list[PlannedRequest],
    *,
    model: str,
    speed: float = 1.0,
    stream: bool = True,
    max_duration_seconds: float = 60.0,
    max_in_flight: int = 64,
    request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
    stop: threading.Event | None = None,
    on_outcome: Callable[[RequestOutcome], None] | None = None,
) -> LoadResult:
    """Send ``plan`` open-loop (arrival times divided by ``speed``) for ``max_duration_seconds``,
    then wait for the requests sent, each bounded by ``request_timeout_seconds`` (not by the
    window). ``on_outcome`` is called with each sent request's outcome as soon as it is known.

    The requests run on one asyncio event loop in the calling thread (not a thread each): at
    most ``max_in_flight`` are open at once, the rest wait client-side."""
    require_loopback(base_url)
    run = _run_load_async(
        base_url, plan, model, speed, stream, max_duration_seconds, max_in_flight,
        request_timeout_seconds, stop or threading.Event(), on_outcome,
    )  # fmt: skip
    return asyncio.run(run)
