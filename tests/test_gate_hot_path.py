"""The relay's per-event shortcuts do exactly what the general code does.

Each event of a streamed answer passes two shortcuts on the gate's hot path: the upstream's
one-whole-chunk de-chunking (``UpstreamResponse._one_chunk`` before ``_parse_chunks``) and the
common token chunk read without building a step (``StreamState.relay_common`` before
``on_event``). Both must give what the general code gives, byte for byte and in the stream's
state, or decline. Checked here on vLLM-shaped streams (tests/fake_completions.py: completions
and chat, ids asked for or not, several tokens a chunk, a character split across tokens,
usage chunks, reasoning) and on hand-made framings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from multidict import CIMultiDict

from tests.fake_completions import FakeCompletions
from vllm_guardian.gate.continuation import Plan, SseSplitter, StreamState, plan
from vllm_guardian.gate.upstream import UpstreamPool, UpstreamResponse, _Conn, _Link

PROMPT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCompletions]:
    f = FakeCompletions()
    yield f
    f.stop()


STREAMS: list[tuple[str, str, dict[str, Any], int, int]] = [
    # id, path, the client's request fields, tokens per chunk, reasoning chunks
    ("plain", "/v1/completions", {}, 1, 0),
    ("client_ids", "/v1/completions", {"return_token_ids": True}, 1, 0),
    ("usage", "/v1/completions", {"stream_options": {"include_usage": True}}, 1, 0),
    ("continuous_usage", "/v1/completions",
     {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 1, 0),
    ("three_a_chunk", "/v1/completions", {}, 3, 0),
    ("chat", "/v1/chat/completions", {}, 1, 0),
    ("chat_client_ids", "/v1/chat/completions", {"return_token_ids": True}, 2, 0),
    ("chat_reasoning", "/v1/chat/completions", {}, 1, 4),
]  # fmt: skip


def snapshot(st: StreamState) -> tuple[object, ...]:
    return (st.id, st.created, st.model, st.prompt_ids, list(st.token_ids), st.settled,
            st.last_text_tokens, st.finish_reason, st.usage_seen, st.unreadable,
            st.ids_missing, st.unhonest, list(st._pending))  # fmt: skip


@pytest.mark.parametrize(
    ("path", "fields", "per_chunk", "reasoning"),
    [s[1:] for s in STREAMS],
    ids=[s[0] for s in STREAMS],
)
def test_the_common_event_shortcut_relays_what_on_event_relays(
    fake: FakeCompletions, path: str, fields: dict[str, Any], per_chunk: int, reasoning: int
) -> None:
    fake.reset(tokens_per_chunk=per_chunk)
    fake.reasoning_chunks = reasoning
    doc: dict[str, Any] = {"model": "tiny", "max_tokens": 60, "stream": True, **fields}
    if path.endswith("chat/completions"):
        doc["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        doc["prompt"] = PROMPT
    p = plan(path, json.dumps(doc).encode(), enabled=True)
    assert isinstance(p, Plan)
    upstream = requests.post(f"{fake.url}{path}", data=p.upstream_body, timeout=30).content
    events = SseSplitter(2**24).feed(upstream)
    assert len(events) > 20

    general, shortcut = StreamState(p), StreamState(p)
    taken = 0
    for event in events:
        expected = general.on_event(event)
        got = shortcut.relay_common(event)
        if got is None:
            step = shortcut.on_event(event)
            assert (step.kind, step.data) == (expected.kind, expected.data), event
        else:
            taken += 1
            assert got == expected.data, event
        assert snapshot(shortcut) == snapshot(general), event
    # The shortcut carries the stream (every token chunk past the first), unless every chunk
    # has usage in it, which the stream's state keeps.
    if "continuous_usage_stats" in json.dumps(fields):
        assert taken == 0
    else:
        assert taken >= len(events) - 4 - reasoning


def response(chunked: bool = True) -> UpstreamResponse:
    """An answer's body state with no connection behind it (only its parsing is used)."""
    r = UpstreamResponse.__new__(UpstreamResponse)
    r.chunked = chunked
    r._raw, r._chunk_left, r._crlf_due, r._trailers = b"", 0, False, False
    r._eof, r._keep = False, True
    return r


@pytest.mark.parametrize(
    "data",
    [
        b"e\r\ndata: [DONE]\n\n\r\n",
        b"E\r\ndata: [DONE]\n\n\r\n",
        b"5\r\nhello\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",  # the last chunk with it
        b"5\r\nhello\r\n3\r\nabc\r\n",  # two chunks in one read
        b"5\r\nhel",  # part of a chunk
        b"5\r\nhello",  # its CRLF not yet
        b"5;ext=1\r\nhello\r\n",  # an extension
        b"0\r\n\r\n",  # the end
        b" 5 \r\nhello\r\n",
        b"6\r\nhello\r\n",  # a size that does not match: the walk decides
        b"zz\r\nhello\r\n",  # malformed
        b"-5\r\nhello\r\n",
        b"5\r\nhelloXY",  # no CRLF after the data
    ],
)
@pytest.mark.python_only
def test_the_one_chunk_shortcut_gives_what_the_chunk_walk_gives(data: bytes) -> None:
    walked, short = response(), response()
    walked._raw = data
    try:
        expected: bytes | str = walked._parse_chunks()
    except ValueError:
        expected = "ValueError"
    got = short._one_chunk(data)
    if got is None:
        return  # declined: the walk handles it
    assert got == expected
    assert (short._raw, short._chunk_left, short._crlf_due, short._trailers, short._eof) == (
        walked._raw, walked._chunk_left, walked._crlf_due, walked._trailers, walked._eof,
    )  # fmt: skip


@pytest.mark.python_only
def test_the_one_chunk_shortcut_takes_an_event_as_vllm_writes_it() -> None:
    event = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"x","token_ids":[5]}]}\n\n'
    assert response()._one_chunk(b"%x\r\n%b\r\n" % (len(event), event)) == event
    mid = response()
    mid._chunk_left = 3  # inside a chunk: never
    assert mid._one_chunk(b"5\r\nhello\r\n") is None


class _Transport:
    """Enough of a transport for an upstream connection nobody writes to."""

    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.ended: list[object] = []

    def body(self, data: bytes) -> None:
        self.got.append(data)

    def end(self, error: object) -> None:
        self.ended.append(error)


@pytest.mark.parametrize(
    ("arrives", "kept"),
    [([b"hel", b"lo"], True), ([b"helloEXTRA"], False), ([b"hel", b"loEXTRA"], False)],
    ids=["exact", "more_at_once", "more_after"],
)
def test_a_streamed_answer_followed_by_bytes_it_did_not_announce_is_not_kept(
    arrives: list[bytes], kept: bool
) -> None:
    async def scenario() -> tuple[list[bytes], list[object], int, bool]:
        pool = UpstreamPool("http://127.0.0.1:1")
        link = _Link(asyncio.get_running_loop())
        transport = _Transport()
        link.connection_made(transport)  # type: ignore[arg-type]
        up = UpstreamResponse(pool, _Conn(link), 200, "OK", CIMultiDict({"Content-Length": "5"}),
                              head_request=False)  # fmt: skip
        sink = _Sink()
        up.stream(sink)
        for piece in arrives:
            link.data_received(piece)
        up.release()
        return sink.got, sink.ended, pool.idle_connections, transport.closed

    got, ended, idle, closed = asyncio.run(scenario())
    assert (b"".join(got), ended) == (b"hello", [None])
    assert (idle, closed) == ((1, False) if kept else (0, True))


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/completions", True), ("/v1/chat/completions", True), ("/v1/completions", False)],
)
def test_a_requests_body_is_read_as_json_once_on_its_way(
    fake: FakeCompletions, monkeypatch: pytest.MonkeyPatch, path: str, stream: bool
) -> None:
    """Its cost, its stream's plan and its fallback all read one parse of the client's body."""
    from tests.support import wait_for
    from tests.test_gate_support import GateThread

    fake.reset()
    fields = (
        {"messages": [{"role": "user", "content": PROMPT}]}
        if "chat" in path
        else {"prompt": PROMPT}
    )
    body = json.dumps({"model": "m", **fields, "stream": stream, "max_tokens": 4}).encode()
    reads: list[int] = []
    real_loads = json.loads

    def counting(s: str | bytes | bytearray, *args: Any, **kwargs: Any) -> Any:
        if isinstance(s, bytes | bytearray) and s == body:
            reads.append(1)
        return real_loads(s, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    gate = GateThread(fake.url, proxy={"fallback_url": fake.url, "fallback_after_seconds": 60})
    try:
        adm = gate.gate.admission
        wait_for(lambda: adm is not None and adm.open, "the gate open")
        with requests.post(gate.url + path, data=body, stream=True, timeout=60) as r:
            text = r.content.decode()
        done = "data: [DONE]" in text if stream else '"choices"' in text
        assert r.status_code == 200 and done, (r.status_code, text[-400:])
    finally:
        gate.stop()
    assert len(reads) == 1, f"the client's body was parsed {len(reads)} times"


# --- the admission: no dispatcher wake-up for nothing ------------------------------------------


@pytest.mark.python_only  # reads the admission's wake-up event
def test_a_release_wakes_the_dispatcher_only_when_a_request_waits() -> None:
    """Every request's release used to wake the admission's dispatcher task, a task switch
    and a new future a request, with nothing queued for it to hand a grant to. A release
    with a request queued still hands the freed room on to it."""
    from vllm_guardian.gate.admission import Admission, Cost, Limits
    from vllm_guardian.gate.metrics import GateMetrics

    async def run() -> tuple[bool, bool, bool]:
        cost = Cost(600, 400)
        a = Admission(
            Limits(kv_admission=True, kv_reserve_ratio=0.0, release_rate_per_second=0.0),
            GateMetrics("vllm"),
        )
        a.start()
        a.set_state(True, "open")
        a.set_kv(1500, 0.0, "test")
        await asyncio.sleep(0)
        first = await a.acquire("k", cost)  # admitted at once: nothing queued
        await asyncio.sleep(0)  # the dispatcher takes the wake-up of set_kv
        a.release(first)
        woken_for_nothing = a._wake.is_set()
        first = await a.acquire("k", cost)
        second = asyncio.ensure_future(a.acquire("k", cost))  # 2,000 tokens do not fit 1,500
        await asyncio.sleep(0.05)
        held = not second.done()
        a.release(first)
        async with asyncio.timeout(30.0):
            a.release(await second)
        await a.stop()
        return woken_for_nothing, held, second.done()

    woken_for_nothing, held, admitted = asyncio.run(run())
    assert (woken_for_nothing, held, admitted) == (False, True, True)
