"""The gate continues a streamed completion the upstream cut (gate/relay.py, continuation.py).

Against a vLLM-shaped upstream on loopback (tests/fake_completions.py) whose "model" is
deterministic, as a temperature-0 one is: a cut stream, continued, must read to the client
exactly as the uncut stream vLLM sends directly, byte for byte once the gate's keep-alive
comments are taken out (same ``id`` and ``created``, no text missing or twice, usage counted
once). Requests a continuation cannot serve honestly are cut as before, and every decision is
counted.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import requests
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fake_completions import (
    FINGERPRINT,
    MAX_MODEL_LEN,
    CutSpec,
    FakeCompletions,
    chat_prompt,
    piece,
    tokenize,
)
from tests.support import wait_for
from tests.test_gate_support import LoopThread
from vllm_guardian.gate.admission import Limits, cost_of
from vllm_guardian.gate.continuation import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Complete,
    Continue,
    Kind,
    Plan,
    Refusal,
    SseSplitter,
    Step,
    StreamState,
    body_json,
    fallback_allowed,
    plan,
    plan_of,
)
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import Gate, GateSettings

PROMPT = "the quick brown fox jumps"
KEEPALIVE = b": keep-alive\n\n"


class GateOn:
    """One gate, on its own loop, in front of the fake."""

    def __init__(self, upstream: str, **proxy: Any) -> None:
        limits = replace(Limits(), max_wait_seconds=proxy.pop("max_wait_seconds", 60.0),
                         release_rate_per_second=0)  # fmt: skip
        self.lt = LoopThread("gate")
        self.gate = Gate(
            GateSettings(
                proxy=ProxySettings(upstream=upstream, keepalive_comment_seconds=0.05, **proxy),
                listen_port=0,
                limits=limits,
                poll_interval_seconds=0.02,
                suspect_seconds=0.2,
                stall_hold_seconds=0,
                shutdown_timeout_seconds=1.0,
            )
        )
        self.lt.run(self.gate.start())
        self.url = f"http://127.0.0.1:{self.gate.port}"

    def metric(self, outcome: str, reason: str) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        m = re.search(
            rf'vllm_guardian_gate_continuations_total\{{outcome="{outcome}",reason="{reason}",'
            rf'service="vllm"\}} (\S+)',
            text,
        )
        assert m is not None, f"no continuations_total{{{outcome},{reason}}}"
        return float(m.group(1))

    def idle(self) -> bool:
        p, a = self.gate.proxy, self.gate.admission
        assert p is not None and a is not None
        return p.open_exchanges == 0 and a.in_flight == 0 and a.queue_depth == 0

    def stop(self) -> None:
        self.lt.run(self.gate.stop())
        self.lt.close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCompletions]:
    f = FakeCompletions()
    yield f
    f.stop()


@pytest.fixture
def gates(fake: FakeCompletions) -> Iterator[Callable[..., GateOn]]:
    fake.reset()
    made: list[GateOn] = []

    def make(**proxy: Any) -> GateOn:
        g = GateOn(fake.url, **proxy)
        made.append(g)
        wait_for(lambda: g.gate.admission is not None and g.gate.admission.open, "gate open")
        return g

    yield make
    fake.heal()
    for g in made:
        wait_for(g.idle, "the gate to hold nothing")
        g.stop()


def body(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "stream": True,
                           "request_id": "r1"}  # fmt: skip
    doc.update(kw)
    return {k: v for k, v in doc.items() if v is not None}


class Read:
    """A client's streamed read: every byte, and whether the connection was cut."""

    def __init__(
        self,
        url: str,
        doc: dict[str, Any],
        on_bytes: Callable[[bytes], None] = lambda _: None,
        path: str = "/v1/completions",
    ) -> None:
        self.data = b""
        self.cut = False
        with requests.post(f"{url}{path}", json=doc, stream=True, timeout=60) as r:
            self.status = r.status_code
            try:
                for chunk in r.iter_content(chunk_size=None):
                    self.data += chunk
                    on_bytes(self.data)
            except requests.exceptions.ChunkedEncodingError:
                self.cut = True

    @property
    def events(self) -> list[bytes]:
        return [e + b"\n\n" for e in self.data.split(b"\n\n") if e]

    def without_keepalives(self) -> bytes:
        return self.data.replace(KEEPALIVE, b"")

    def text(self) -> str:
        out = ""
        for e in self.events:
            if e.startswith(b"data: {"):
                doc = json.loads(e[6:])
                out += "".join(c["text"] for c in doc.get("choices", []))
        return out


def direct(fake: FakeCompletions, doc: dict[str, Any], path: str = "/v1/completions") -> bytes:
    return requests.post(f"{fake.url}{path}", json=doc, timeout=30).content


def heal_on_keepalive(fake: FakeCompletions) -> Callable[[bytes], None]:
    """Brings /health back once the client has seen the gate's keep-alive, and checks that
    nothing was sent upstream while it waited."""

    def on(data: bytes) -> None:
        if KEEPALIVE in data and not fake.healthy:
            assert len(fake.bodies) == 1, fake.bodies  # held, not sent to a sick server
            fake.heal()

    return on


# --- streams through the gate, uncut ----------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"return_token_ids": True},
    ],
    ids=["plain", "usage", "continuous_usage", "client_token_ids"],
)
def test_an_uncut_stream_is_what_vllm_sends(
    gates: Callable[..., GateOn], fake: FakeCompletions, extra: dict[str, Any]
) -> None:
    g = gates()
    expected = direct(fake, body(**extra))
    got = Read(g.url, body(**extra))
    assert (got.status, got.cut) == (200, False)
    assert got.data == expected
    sent = fake.bodies[-1]
    assert sent["return_token_ids"] is True  # the gate asks for the ids ...
    if "return_token_ids" not in extra:  # ... and gives the client what it asked for
        assert b'"token_ids":[' not in got.data and b'"prompt_token_ids":[' not in got.data


# --- cut, then continued -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cut", "extra"),
    [
        (CutSpec(7, "reset", down=True), {"stream_options": {"include_usage": True}}),
        (CutSpec(7, "error_event", down=True), {"stream_options": {"include_usage": True}}),
        (CutSpec(12, "close"), {}),
        (CutSpec(9, "reset"), {"stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}),
        (CutSpec(1, "error_event"), {"max_tokens": None}),  # vLLM's default max_tokens: 16
    ],
    ids=["reset_down", "error_event_down", "close", "continuous_usage", "default_max"],
)  # fmt: skip
def test_a_cut_stream_is_continued_as_one_uncut_stream(
    gates: Callable[..., GateOn], fake: FakeCompletions, cut: CutSpec, extra: dict[str, Any]
) -> None:
    g = gates()
    expected = direct(fake, body(**extra))
    fake.bodies.clear()
    fake.cut_next(cut)
    got = Read(g.url, body(**extra), heal_on_keepalive(fake))
    print(got.data.decode(errors="replace")[-600:])
    assert (got.status, got.cut) == (200, False)
    assert KEEPALIVE in got.data  # the client heard from the gate while it waited
    assert got.without_keepalives() == expected
    # The continuation: the prompt's ids and the ids delivered, max_tokens lowered by them.
    assert len(fake.bodies) == 2
    first, cont = fake.bodies
    delivered = FakeCompletions.generate(tokenize(PROMPT), cut.after_events)
    assert cont["prompt"] == tokenize(PROMPT) + delivered
    assert cont["max_tokens"] == first.get("max_tokens", 16) - len(delivered)
    assert cont["return_token_ids"] is True and cont["request_id"] == "r1-cont1"
    reason = "error_event" if cut.how == "error_event" else "connection"
    assert g.metric("continued", reason) == 1


def test_text_held_back_at_the_cut_is_regenerated_not_lost(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    """A token ending inside a character has no text yet: rolled back, not put in the prompt
    (a continuation primed with half a character would lose it)."""
    g = gates()
    out = FakeCompletions.generate(tokenize(PROMPT), 40)
    after = next(i + 1 for i, t in enumerate(out) if piece(t) == b"\xc3")  # cut after a LEAD
    expected = direct(fake, body())
    fake.bodies.clear()
    fake.cut_next(CutSpec(after, "reset"))
    got = Read(g.url, body())
    assert got.without_keepalives() == expected
    assert fake.bodies[1]["prompt"] == tokenize(PROMPT) + out[: after - 1]
    assert fake.bodies[1]["max_tokens"] == 40 - (after - 1)


def _chunks(n_tokens: int, per: int) -> list[list[int]]:
    out = FakeCompletions.generate(tokenize(PROMPT), n_tokens)
    return [out[i : i + per] for i in range(0, n_tokens, per)]


def test_several_tokens_a_chunk_are_checked_with_detokenize(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    fake.reset(tokens_per_chunk=3)
    g = gates()
    chunks = _chunks(39, 3)
    # A chunk that ends on a whole character: vLLM's /detokenize says so, the stream goes on.
    ok = next(i + 1 for i, c in enumerate(chunks) if i > 0 and piece(c[-1]).startswith(b" "))
    expected = direct(fake, body(max_tokens=39))
    fake.bodies.clear()
    fake.cut_next(CutSpec(ok, "reset"))
    got = Read(g.url, body(max_tokens=39))
    assert got.without_keepalives() == expected
    assert fake.detokenized and fake.detokenized[-1][-1] == chunks[ok - 1][-1]
    # A chunk with text that ends inside a character: its last text is still held back, and
    # which ids carry it cannot be told: not continued, cut as before.
    bad = next(
        i + 1
        for i, c in enumerate(chunks)
        if piece(c[-1]) == b"\xc3" and any(piece(t).startswith(b" ") for t in c)
    )
    fake.bodies.clear()
    fake.cut_next(CutSpec(bad, "reset"))
    got = Read(g.url, body(max_tokens=39))
    assert got.cut and len(fake.bodies) == 1
    assert g.metric("refused", "unsettled_text") == 1


def test_a_client_that_asked_for_token_ids_gets_each_once(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    doc = body(return_token_ids=True, stream_options={"include_usage": True})
    expected = direct(fake, doc)
    fake.cut_next(CutSpec(10, "reset"))
    got = Read(g.url, doc)
    assert got.without_keepalives() == expected
    chunks = [json.loads(e[6:]) for e in got.events if e.startswith(b"data: {")]
    firsts = [c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"]]
    assert firsts[0] == tokenize(PROMPT) and not any(firsts[1:])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == FakeCompletions.generate(tokenize(PROMPT), 40)


def test_a_cut_after_the_last_token_is_ended_by_the_gate(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    doc = body(max_tokens=12, stream_options={"include_usage": True})
    expected = direct(fake, doc)
    fake.bodies.clear()
    fake.cut_next(CutSpec(12, "reset"))  # every chunk sent, the usage chunk and [DONE] not
    got = Read(g.url, doc)
    # The usage chunk is the gate's own: vLLM's system_fingerprint rides on that chunk only,
    # so the gate never saw it. Everything else is what vLLM would have sent.
    assert got.data == expected.replace(
        b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"', b""
    )
    assert len(fake.bodies) == 1
    assert g.metric("completed", "connection") == 1


# --- not continued -------------------------------------------------------------------------------


REFUSED = [
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"logprobs": 1}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_output"),
    ({"guided_json": {"type": "object"}}, "structured_output"),
    ({"stop": ["w9"]}, "stop_strings"),
    ({"frequency_penalty": 0.5}, "output_history"),
    ({"bad_words": ["w3"]}, "output_history"),
    ({"prompt": ["one", "two"]}, "prompt_shape"),
    ({"suffix": "end"}, "prompt_shape"),
    ({"min_tokens": "few"}, "unparseable"),
]


@pytest.mark.parametrize(("extra", "reason"), REFUSED, ids=[r for _, r in REFUSED])
@pytest.mark.parametrize("how", ["reset", "error_event"])
def test_a_stream_continuation_cannot_serve_is_cut_as_before(
    gates: Callable[..., GateOn], fake: FakeCompletions, extra: dict[str, Any], reason: str,
    how: str,
) -> None:  # fmt: skip
    g = gates()
    fake.cut_next(CutSpec(5, how))
    got = Read(g.url, body(**extra))
    assert len(fake.bodies) == 1
    assert "return_token_ids" not in fake.bodies[0]  # the body went as the client sent it
    if how == "reset":
        assert got.cut
    else:  # vLLM's own error event and [DONE], as without the gate
        assert not got.cut
        assert (
            got.events[-2].startswith(b'data: {"error"') and got.events[-1] == b"data: [DONE]\n\n"
        )
    assert KEEPALIVE not in got.data
    assert g.metric("refused", reason) == 1


COMPLETIONS, CHAT_ROUTE = "/v1/completions", "/v1/chat/completions"
OFF = [  # (the gate's settings, the route a cut stream took, continued)
    ({"continuation": False}, COMPLETIONS, False),
    ({"continuation": False}, CHAT_ROUTE, False),
    ({"continuation_off_routes": frozenset({CHAT_ROUTE})}, CHAT_ROUTE, False),
    ({"continuation_off_routes": frozenset({CHAT_ROUTE})}, COMPLETIONS, True),
    ({"continuation_off_routes": frozenset({COMPLETIONS})}, COMPLETIONS, False),
    ({"continuation_off_routes": frozenset({COMPLETIONS})}, CHAT_ROUTE, True),
]


@pytest.mark.parametrize(("settings", "path", "continued"), OFF)
def test_switched_off_globally_or_for_its_route_a_cut_stream_is_cut(
    gates: Callable[..., GateOn], fake: FakeCompletions, settings: dict[str, Any], path: str,
    continued: bool,
) -> None:  # fmt: skip
    g = gates(**settings)
    fake.cut_next(CutSpec(5, "reset"))
    got = Read(g.url, chat_body() if path == CHAT_ROUTE else body(), path=path)
    if continued:
        assert not got.cut and len(fake.bodies) == 2
        assert g.metric("continued", "connection") == 1
    else:
        assert got.cut and len(fake.bodies) == 1 and "return_token_ids" not in fake.bodies[0]
        assert g.metric("refused", "disabled") == 1


def test_at_most_max_continuations(gates: Callable[..., GateOn], fake: FakeCompletions) -> None:
    g = gates(max_continuations=1)
    fake.cut_next(CutSpec(5, "reset"), CutSpec(5, "error_event"))
    got = Read(g.url, body())
    assert len(fake.bodies) == 2
    # The second cut was vLLM's error event: the client gets it, as without the gate.
    assert not got.cut and got.events[-2].startswith(b'data: {"error"')
    assert g.metric("continued", "connection") == 1
    assert g.metric("failed", "max_continuations") == 1
    # Two allowed: the same cuts, and the stream completes.
    g2 = gates(max_continuations=2)
    expected = direct(fake, body())
    fake.bodies.clear()
    fake.cut_next(CutSpec(5, "reset"), CutSpec(5, "error_event"))
    got = Read(g2.url, body())
    assert got.without_keepalives() == expected and len(fake.bodies) == 3
    third = fake.bodies[2]
    delivered = len(third["prompt"]) - len(tokenize(PROMPT))
    assert delivered >= 8 and third["max_tokens"] == 40 - delivered
    assert third["request_id"] == "r1-cont2"


def test_no_ready_server_within_the_wait(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates(max_wait_seconds=0.3)
    fake.cut_next(CutSpec(5, "error_event", down=True))
    got = Read(g.url, body())
    assert len(fake.bodies) == 1
    assert KEEPALIVE in got.data
    assert got.events[-2].startswith(b'data: {"error"') and got.events[-1] == b"data: [DONE]\n\n"
    assert g.metric("failed", "wait_timeout") == 1


def test_a_client_leaving_while_the_gate_waits_leaves_nothing(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    fake.cut_next(CutSpec(5, "reset", down=True))
    s = socket.create_connection(("127.0.0.1", g.gate.port), timeout=10)
    raw = json.dumps(body()).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    seen = b""
    while KEEPALIVE not in seen:
        chunk = s.recv(65536)
        assert chunk, seen
        seen += chunk
    s.close()
    wait_for(lambda: g.metric("failed", "client_gone") == 1, "the wait to end")
    wait_for(g.idle, "the gate to hold nothing")
    assert len(fake.bodies) == 1


# --- chat streams ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]


def chat_body(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40,
                           "stream": True, "request_id": "c1", "temperature": 0}  # fmt: skip
    doc.update(kw)
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(
    ("cut", "extra"),
    [
        (None, {"stream_options": {"include_usage": True}}),
        (CutSpec(7, "reset", down=True), {"stream_options": {"include_usage": True}}),
        (CutSpec(7, "error_event", down=True), {}),
        (CutSpec(1, "close"), {"stream_options": {"include_usage": True}}),  # after the role chunk
        (CutSpec(9, "reset"), {"stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}),
        (CutSpec(5, "reset"), {"max_tokens": None, "max_completion_tokens": 30}),
        (CutSpec(5, "reset"), {"max_tokens": None}),  # up to the context's end
        (CutSpec(5, "reset"), {"return_token_ids": True}),
    ],
    ids=["uncut", "reset_down", "error_event_down", "after_role", "continuous_usage",
         "max_completion_tokens", "no_max", "client_token_ids"],
)  # fmt: skip
def test_a_cut_chat_stream_is_continued_token_exact_as_one_uncut_stream(
    gates: Callable[..., GateOn], fake: FakeCompletions, cut: CutSpec | None,
    extra: dict[str, Any],
) -> None:  # fmt: skip
    """A chat stream goes on as a completion of the chat's own prompt ids and the ids
    delivered; the client reads the chat stream vLLM sends uncut, byte for byte."""
    g = gates()
    doc = chat_body(**extra)
    expected = direct(fake, doc, CHAT)
    fake.bodies.clear()
    fake.paths.clear()
    if cut is not None:
        fake.cut_next(cut)
    got = Read(g.url, doc, heal_on_keepalive(fake), path=CHAT)
    assert (got.status, got.cut) == (200, False)
    assert got.without_keepalives() == expected, got.data.decode()[-800:]
    if cut is None:
        assert fake.paths == [CHAT] and fake.bodies[0]["return_token_ids"] is True
        return
    assert fake.paths == [CHAT, "/v1/completions"]
    cont = fake.bodies[1]
    delivered = FakeCompletions.generate(chat_prompt(MESSAGES), cut.after_events - 1)
    assert cont["prompt"] == chat_prompt(MESSAGES) + delivered
    asked = extra.get("max_completion_tokens", extra.get("max_tokens", 40))
    assert cont["max_tokens"] == (MAX_MODEL_LEN if asked is None else asked - len(delivered))
    assert "messages" not in cont and "max_completion_tokens" not in cont
    assert cont["temperature"] == 0 and cont["request_id"] == "c1-cont1"
    reason = "error_event" if cut.how == "error_event" else "connection"
    assert g.metric("continued", reason) == 1
    # What the guardian (and the demo's summary) reads: the gate's status.
    status = requests.get(f"{g.url}/gate/status", timeout=5).json()
    assert (status["continued_total"], status["continuations_failed_total"]) == (1, 0)


CHAT_REFUSED = [
    ({"n": 2}, "n"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "media"),
    ({"stop": ["w9"]}, "stop_strings"),
    ({"echo": True}, "echo"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "reason"), CHAT_REFUSED, ids=[r for _, r in CHAT_REFUSED])
def test_a_chat_stream_continuation_cannot_serve_is_cut_as_before(
    gates: Callable[..., GateOn], fake: FakeCompletions, extra: dict[str, Any], reason: str
) -> None:
    g = gates()
    fake.cut_next(CutSpec(5, "reset"))
    got = Read(g.url, chat_body(**extra), path=CHAT)
    assert got.cut and len(fake.bodies) == 1
    assert "return_token_ids" not in fake.bodies[0]  # the body went as the client sent it
    assert g.metric("refused", reason) == 1


def test_a_chat_stream_that_emitted_reasoning_is_not_continued(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    """A completion would read the reasoning as text: the stream is cut as before."""
    g = gates()
    fake.reasoning_chunks = 3
    fake.cut_next(CutSpec(6, "reset"))
    got = Read(g.url, chat_body(), path=CHAT)
    assert got.cut and len(fake.bodies) == 1
    assert g.metric("refused", "reasoning") == 1


# --- a unary request the upstream died under -------------------------------------------------------


@pytest.mark.parametrize("how", ["reset", "error_event"])
def test_a_unary_completion_the_upstream_died_under_is_sent_again_whole(
    gates: Callable[..., GateOn], fake: FakeCompletions, how: str
) -> None:
    g = gates()
    doc = body(stream=None)
    expected = requests.post(f"{fake.url}/v1/completions", json=doc, timeout=30).json()
    fake.bodies.clear()
    fake.cut_next(CutSpec(0, how, down=True))
    threading.Timer(0.5, fake.heal).start()  # the next instance comes up; the gate waits for it
    r = requests.post(f"{g.url}/v1/completions", json=doc, timeout=60)
    assert r.status_code == 200 and r.json() == expected
    assert fake.bodies == [doc, doc]  # whole, the client's own body both times


# --- the pieces (pure) ---------------------------------------------------------------------------


def test_the_upstream_body_gains_return_token_ids_and_nothing_else() -> None:
    raw = b' {"prompt": "hi",  "stream": true, "temperature": 0.70}'
    p = plan("/v1/completions", raw, enabled=True)
    assert isinstance(p, Plan) and not p.wants_token_ids
    assert (
        p.upstream_body
        == b' {"return_token_ids":true,"prompt": "hi",  "stream": true, "temperature": 0.70}'
    )
    asked = plan("/v1/completions", b'{"prompt": "hi", "stream": true, "return_token_ids": true}',
                 enabled=True)  # fmt: skip
    assert isinstance(asked, Plan) and asked.wants_token_ids
    declined = plan("/v1/completions", b'{"prompt": "hi", "stream": true, "return_token_ids": false}',
                    enabled=True)  # fmt: skip
    assert isinstance(declined, Plan) and json.loads(declined.upstream_body)["return_token_ids"]
    # A lone surrogate is valid JSON (an escape) and no UTF-8: written again as an escape, the
    # same request to vLLM, not an exception (which was the client's 500).
    lone = plan("/v1/completions", b'{"prompt": "a\\ud800", "stream": true, "return_token_ids": null}',
                enabled=True)  # fmt: skip
    assert isinstance(lone, Plan), lone
    assert json.loads(lone.upstream_body) == {
        "prompt": "a\ud800",
        "stream": True,
        "return_token_ids": True,
    }
    assert plan("/v1/chat/completions", b'{"stream": true}', enabled=True) is Refusal.UNPARSEABLE
    for path, raw in [("/v1/chat/completions", b'{"messages": []}'),
                      ("/v1/completions", b'{"prompt": "hi"}'),
                      ("/v1/completions", b'{"prompt": "hi", "stream": false}'),
                      ("/v1/completions", b'"stream"')]:  # fmt: skip
        assert plan(path, raw, enabled=True) is None, (path, raw)


def _chunk(
    ids: list[int], text: str, prompt: list[int] | None = None, finish: str | None = None
) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids}  # fmt: skip
    doc = {"id": "cmpl-a", "object": "text_completion", "created": 5, "model": "m",
           "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def test_the_state_settles_only_what_has_text() -> None:
    p = plan(
        "/v1/completions", json.dumps(body(max_tokens=10, min_tokens=4)).encode(), enabled=True
    )
    assert isinstance(p, Plan)
    st = StreamState(p)
    for ev in (_chunk([7], " a", prompt=[1, 2]), _chunk([8, 9], " b c"), _chunk([5], "")):
        st.on_event(ev)
    d = st.decide()
    assert isinstance(d, Continue)
    assert (d.settled_tokens, d.rolled_back_tokens) == (3, 1)
    sent = json.loads(d.body)
    assert sent["prompt"] == [1, 2, 7, 8, 9] and sent["max_tokens"] == 7 and sent["min_tokens"] == 1
    assert d.check_tail == (7, 8, 9)  # the settling chunk had two ids: asked about
    st.begin_continuation(d.settled_tokens)
    # The continuation's chunks read as the first's: its id, created, no prompt ids.
    relayed = st.on_event(_chunk([4], " d", prompt=[1, 2, 7, 8, 9], finish="length").replace(
        b"cmpl-a", b"cmpl-b"))  # fmt: skip
    doc = json.loads(relayed.data[6:])
    assert doc["id"] == "cmpl-a" and doc["choices"][0]["prompt_token_ids"] is None
    assert doc["choices"][0]["token_ids"] is None
    assert isinstance(st.decide(), Complete)


@pytest.mark.parametrize(
    ("key", "value"),
    [("created", 1700000000.5), ("created", "1700000000"), ("id", 7), ("model", ["m"])],
)
def test_a_first_chunk_s_odd_id_created_or_model_is_kept_as_it_came(
    key: str, value: object
) -> None:
    """What a stream's first chunk says of itself is repeated to the client as it came (a
    continuation's chunks get it back), whatever JSON it is: not a reason to give the stream up
    (compiled, a narrower type on these attributes failed on such a value, and the stream was
    not continued)."""
    p = plan("/v1/completions", json.dumps(body(max_tokens=10)).encode(), enabled=True)
    assert isinstance(p, Plan)
    first = _chunk([7], " a", prompt=[1, 2])
    doc = json.loads(first[6:])
    doc[key] = value
    st = StreamState(p)
    st.on_event(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")
    st.on_event(_chunk([8], " b"))
    assert not st.unreadable
    assert (st.id, st.created, st.model)[["id", "created", "model"].index(key)] == value
    assert isinstance(st.decide(), Continue)


def test_a_continuation_keeps_a_lone_surrogate_the_client_sent() -> None:
    """Valid JSON that no UTF-8 carries ("\\ud800") in a field the continuation sends again:
    written as an escape, the same request, not an exception at the cut."""
    p = plan("/v1/completions", json.dumps(body(max_tokens=10, user="x\ud800")).encode(),
             enabled=True)  # fmt: skip
    assert isinstance(p, Plan)
    st = StreamState(p)
    st.on_event(_chunk([7], " a", prompt=[1, 2]))
    d = st.decide()
    assert isinstance(d, Continue), d
    assert json.loads(d.body)["user"] == "x\ud800"


def _chat_chunk(delta: str, ids: list[int] | None = None, finish: str | None = None) -> bytes:
    choice = (f'{{"index":0,{delta},"logprobs":null,"finish_reason":'
              f'{json.dumps(finish)}' + (f',"token_ids":{json.dumps(ids)}' if ids is not None else "") + "}")  # fmt: skip
    return (b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":5,"model":"m",'
            b'"choices":[' + choice.encode() + b'],"usage":null}\n\n')  # fmt: skip


# The events a stream's hot path reads from its bytes, and their neighbours it must leave to the
# full decoding: after a first chunk, each event, for a completion and for a chat stream.
COMPLETION_EVENTS = [
    ("text and an id", _chunk([8], " b")),
    ("two ids", _chunk([8, 9], " b c")),
    ("ids and no text yet (held back)", _chunk([5], "")),
    ("then the text that settles them", _chunk([6], "é")),
    ("no ids", _chunk([], " x")),
    ("an empty id list with a space", _chunk([], " x").replace(b"[]", b"[ ]")),
    ("two ids with a space", _chunk([8, 9], " b c").replace(b"[8,9]", b"[8, 9]")),
    ("a key's pattern inside the text", _chunk([3], '"token_ids":[1],"finish_reason":null')),
    ("an id that is no number", _chunk([8], " b").replace(b"[8]", b'["8"]')),
    ("a second choice", _chunk([4], " y").replace(b'"stop_reason"', b'"index":1,"stop_reason"')),
    ("spaces (not compact)", _chunk([4], " y").replace(b'"finish_reason":null', b'"finish_reason": null')),
    ("usage", _chunk([4], " y").replace(b'"model":"m"', b'"model":"m","usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}')),
    ("the last one", _chunk([2], " z", finish="length")),
]  # fmt: skip
CHAT_EVENTS = [
    ("content and an id", _chat_chunk('"delta":{"content":" b"}', [8])),
    ("ids and no content yet (held back)", _chat_chunk('"delta":{"content":""}', [5])),
    ("null content", _chat_chunk('"delta":{"content":null}', [6])),
    ("then its text", _chat_chunk('"delta":{"content":"é"}', [7])),
    ("no delta content", _chat_chunk('"delta":{}', [9])),
    ("content with spaces", _chat_chunk('"delta":{"content": "x"}', [9])),
    ("a tool call", _chat_chunk('"delta":{"tool_calls":[{"index":0}]}', [4])),
    ("reasoning", _chat_chunk('"delta":{"reasoning_content":"hm"}', [3])),
    ("the last one", _chat_chunk('"delta":{"content":"."}', [2], finish="stop")),
]  # fmt: skip


@pytest.mark.parametrize("entry", ["on_event", "relay_common"])
@pytest.mark.parametrize("wants_ids", [False, True], ids=["ids stripped", "client's ids"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.python_only
def test_reading_a_token_chunk_from_its_bytes_does_what_decoding_it_does(
    chat: bool, wants_ids: bool, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``on_event`` (the payload cut out of the event) and ``relay_common`` (the relay's
    hot path: the event's own bytes), the same as decoding each event in full."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = body(max_tokens=10, return_token_ids=True if wants_ids else None)
    if chat:
        req = {k: v for k, v in req.items() if k != "prompt"}
        req["messages"] = [{"role": "user", "content": "hi"}]
    p = plan(path, json.dumps(req).encode(), enabled=True)
    assert isinstance(p, Plan)
    first = _chat_chunk('"delta":{"role":"assistant","content":""}', []) if chat else _chunk([7], " a", prompt=[1, 2])  # fmt: skip
    events = CHAT_EVENTS if chat else COMPLETION_EVENTS

    def run() -> tuple[list[Any], tuple[Any, ...]]:
        st = StreamState(p)
        out = []
        for i, ev in enumerate([first, *(e for _, e in events)]):
            common = st.relay_common(ev) if entry == "relay_common" and i else None
            step = st.on_event(ev) if common is None else Step(Kind.RELAY, common)
            out.append((step.kind, [json.loads(e[6:]) for e in step.data.split(b"\n\n") if e]))
        return out, (st.token_ids, st.settled, st.last_text_tokens, st.unhonest, st.usage_seen,
                     st.finish_reason, st.take_pending())  # fmt: skip

    read_from_bytes: list[bool] = []
    real = StreamState._token_chunk

    def spy(self: StreamState, raw: bytes, payload: bytes) -> Any:
        step = real(self, raw, payload)
        read_from_bytes.append(step is not None)
        return step

    monkeypatch.setattr(StreamState, "_token_chunk", spy)
    fast = run()
    # The plain token chunks took the byte path (the first chunk is always decoded).
    plain = 8 if not chat else 5
    if entry == "on_event":  # (relay_common's declined events are tried twice)
        assert read_from_bytes[1:] == [True] * plain + [False] * (len(events) - plain)
    monkeypatch.setattr(StreamState, "_token_chunk", lambda *_: None)
    assert fast == run()


FIRST_CHUNK = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{'
    b'"index":0,"text":"","logprobs":null,"finish_reason":null,"prompt_token_ids":[1,2],'
    b'"token_ids":[]}]}\n\n'
)
ODD_EVENTS = [
    # Text that decodes to a lone surrogate: the chunk cannot be written again as UTF-8.
    ("lone_surrogate", "/v1/completions", False,
     b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{'
     b'"index":0,"text":"\\ud800","logprobs":null,"finish_reason":"length",'
     b'"token_ids":[5]}]}\n\n'),
    # A continuation's chunk for a chat stream whose choice is not an object.
    ("chat_choice_not_an_object", "/v1/chat/completions", True,
     b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
     b'"choices":[1]}\n\n'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "continuing", "event"), [e[1:] for e in ODD_EVENTS], ids=[e[0] for e in ODD_EVENTS]
)
def test_an_event_the_gate_cannot_rewrite_is_passed_on_as_it_came(
    path: str, continuing: bool, event: bytes
) -> None:
    doc: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 9}
    doc.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else
               {"prompt": "hi"})  # fmt: skip
    p = plan(path, json.dumps(doc).encode(), enabled=True)
    assert isinstance(p, Plan)
    st = StreamState(p)
    if "chat" not in path:
        st.on_event(FIRST_CHUNK)
    st.continuing = continuing
    step = st.on_event(event)
    assert (step.kind, step.data, st.unreadable) == (Kind.RELAY, event, True)


def test_sse_events_are_cut_where_they_end() -> None:
    sp = SseSplitter(100)
    assert sp.feed(b"data: 1\n\nda") == [b"data: 1\n\n"]
    assert sp.feed(b"ta: 2\n\n: c\n\n") == [b"data: 2\n\n", b": c\n\n"]
    assert not sp.overflowing
    sp.feed(b"x" * 200)
    assert sp.overflowing and sp.take_rest() == b"x" * 200


def test_every_refusal_has_its_series() -> None:
    from vllm_guardian.gate.metrics import GateMetrics

    text = GateMetrics("vllm").render().decode()
    for r in Refusal:
        assert f'outcome="refused",reason="{r.value}"' in text, r


# --- the switch ------------------------------------------------------------------------------------


def test_the_config_keys_and_the_flags_agree_and_reach_the_proxy(tmp_path: Any) -> None:
    from vllm_guardian.config import ConfigInvalid, GateConfig, parse_config
    from vllm_guardian.gate import cli as gate_cli

    assert GateConfig().max_continuations == gate_cli.DEFAULTS["max_continuations"] == 1
    assert ("on" if GateConfig().continuation else "off") == gate_cli.DEFAULTS["continuation"]
    head = "services:\n  - name: vllm\n    url: http://127.0.0.1:8000\n    gate:\n"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(head + "      continuation: false\n      max_continuations: 3\n")
    s = gate_cli.settings_from_args(gate_cli.build_parser().parse_args(["-c", str(cfg)]))
    assert (s.proxy.continuation, s.proxy.max_continuations) == (False, 3)
    s = gate_cli.settings_from_args(
        gate_cli.build_parser().parse_args(["-c", str(cfg), "--continuation", "on"])
    )
    assert (s.proxy.continuation, s.proxy.max_continuations) == (True, 3)
    cfg.write_text(head + "      continuation_off_routes: [/v1/chat/completions]\n")
    s = gate_cli.settings_from_args(gate_cli.build_parser().parse_args(["-c", str(cfg)]))
    assert s.proxy.continuation_off_routes == {"/v1/chat/completions"}
    flags = ["-c", str(cfg), "--continuation-off-route", "/v1/completions"]
    s = gate_cli.settings_from_args(gate_cli.build_parser().parse_args(flags))
    assert s.proxy.continuation_off_routes == {"/v1/completions"}  # the flags replace the key
    # A request taken back from a hung engine waits the rest of the guardian's stall wait too.
    assert s.proxy.taken_back_extra_wait_seconds == 2 * gate_cli.DEFAULTS["stall_hold"]
    for text, line, key in [
        ("      max_continuations: -1\n", 5, "max_continuations"),
        ("      continuation: maybe\n", 5, "continuation"),
        ("      continuation_off_routes: [/v1/embeddings]\n", 5, "continuation_off_routes[0]"),
    ]:
        with pytest.raises(ConfigInvalid) as e:
            parse_config(head + text, "c.yaml")
        found = [(err.line, err.path) for err in e.value.errors]
        assert (line, f"services[0].gate.{key}") in found, found


def test_a_cut_before_the_first_event_is_the_ordinary_retry_counted_once(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    expected = direct(fake, body())
    fake.bodies.clear()
    fake.cut_next(CutSpec(0, "error_event"))
    got = Read(g.url, body())
    assert got.data == expected and len(fake.bodies) == 2
    assert fake.bodies[1] == fake.bodies[0]  # sent again whole, as it was
    text = requests.get(f"{g.url}/metrics", timeout=5).text
    assert 'vllm_guardian_gate_retried_total{service="vllm"} 1.0' in text
    assert 'upstream_errors_total{phase="before_first_byte",service="vllm"} 1.0' in text
    assert 'upstream_errors_total{phase="streaming",service="vllm"} 0.0' in text
    assert g.metric("continued", "error_event") == 0


def test_an_upstream_that_sends_no_token_ids_is_not_continued(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    """An older vLLM: text without ids. Sending the request again whole would
    repeat the text the client has."""
    fake.token_ids_known = False
    g = gates()
    fake.cut_next(CutSpec(5, "reset"))
    got = Read(g.url, body())
    assert got.cut and len(fake.bodies) == 1
    assert g.metric("refused", "no_token_ids") == 1


# --- vLLM's aborted answer (HTTP 200, finish_reason "abort") is a cut, not an answer ------------
#
# vLLM shutting down (a restart's SIGTERM) answers what it aborts with a 200: a stream whose last
# chunk says ``finish_reason: "abort"`` before ``[DONE]``, a unary answer with no token.


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (COMPLETIONS, {}),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}),
        (COMPLETIONS, {"return_token_ids": True}),
        (CHAT_ROUTE, {"stream_options": {"include_usage": True}}),
    ],
    ids=["plain", "usage", "client_token_ids", "chat"],
)
def test_an_aborted_stream_is_continued_as_one_uncut_stream(
    gates: Callable[..., GateOn], fake: FakeCompletions, path: str, extra: dict[str, Any]
) -> None:
    """The abort chunk (and the usage that follows it) never reaches the client: it reads the
    uncut stream, ending with the real finish."""
    g = gates()
    doc = chat_body(**extra) if path == CHAT_ROUTE else body(**extra)
    expected = direct(fake, doc, path)
    fake.bodies.clear()
    fake.cut_next(CutSpec(7, "abort", down=True))
    got = Read(g.url, doc, heal_on_keepalive(fake), path=path)
    print(got.data.decode(errors="replace")[-600:])
    assert (got.status, got.cut) == (200, False)
    assert b'"abort"' not in got.data
    assert got.without_keepalives() == expected
    assert len(fake.bodies) == 2
    assert g.metric("continued", "abort") == 1


def test_a_stream_aborted_before_its_first_token_is_sent_again_whole(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    expected = direct(fake, body())
    fake.bodies.clear()
    fake.cut_next(CutSpec(0, "abort"))
    got = Read(g.url, body())
    assert got.data == expected and len(fake.bodies) == 2
    assert fake.bodies[1] == fake.bodies[0]
    text = requests.get(f"{g.url}/metrics", timeout=5).text
    assert 'vllm_guardian_gate_retried_total{service="vllm"} 1.0' in text


@pytest.mark.parametrize(
    "settings",
    [{"max_continuations": 1}, {"continuation": False},
     {"continuation_off_routes": frozenset({COMPLETIONS})}],
    ids=["past_max_continuations", "off", "off_for_its_route"],
)  # fmt: skip
def test_an_abort_the_gate_does_not_continue_reaches_the_client_as_vllm_sent_it(
    gates: Callable[..., GateOn], fake: FakeCompletions, settings: dict[str, Any]
) -> None:
    """Never a stream that looks complete: the client sees ``finish_reason: "abort"``, then
    the usage chunk it asked for and ``[DONE]``, as vLLM wrote them."""
    g = gates(**settings)
    doc = body(stream_options={"include_usage": True})
    cuts = [CutSpec(5, "abort")]
    if "max_continuations" in settings:
        cuts.insert(0, CutSpec(5, "reset"))
    fake.cut_next(*cuts)
    got = Read(g.url, doc)
    assert (got.status, got.cut) == (200, False)
    chunks = [json.loads(e[6:]) for e in got.events if e.startswith(b"data: {")]
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    assert got.events[-1] == b"data: [DONE]\n\n"
    assert b'"token_ids":[' not in got.data  # the ids the gate asked for stay the gate's
    if "max_continuations" in settings:
        assert len(fake.bodies) == 2
        assert g.metric("failed", "max_continuations") == 1
        settled = len(fake.bodies[1]["prompt"]) - len(tokenize(PROMPT))
        # Counted once over both answers: what the first settled, five of the second.
        assert chunks[-1]["usage"]["completion_tokens"] == settled + 5
    else:
        assert len(fake.bodies) == 1
        assert g.metric("refused", "disabled") == 1


def test_an_aborted_unary_completion_is_sent_again_whole(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    g = gates()
    doc = body(stream=None)
    expected = requests.post(f"{fake.url}/v1/completions", json=doc, timeout=30).json()
    fake.bodies.clear()
    fake.cut_next(CutSpec(0, "abort", down=True))
    threading.Timer(0.5, fake.heal).start()  # the next instance comes up; the gate waits for it
    r = requests.post(f"{g.url}/v1/completions", json=doc, timeout=60)
    assert r.status_code == 200 and r.json() == expected
    assert fake.bodies == [doc, doc]
    text = requests.get(f"{g.url}/metrics", timeout=5).text
    assert 'vllm_guardian_gate_retried_total{service="vllm"} 1.0' in text
    assert 'upstream_errors_total{phase="aborted",service="vllm"} 1.0' in text


def test_a_unary_completion_aborted_twice_gets_vllms_answer(
    gates: Callable[..., GateOn], fake: FakeCompletions
) -> None:
    """Past the one retry the client gets vLLM's own aborted answer, not a 502: it says
    what happened."""
    g = gates()
    doc = body(stream=None)
    fake.cut_next(CutSpec(0, "abort"), CutSpec(0, "abort"))
    r = requests.post(f"{g.url}/v1/completions", json=doc, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
    assert len(fake.bodies) == 2


def test_an_abort_chunk_is_a_cut_of_its_own() -> None:
    p = plan("/v1/completions", json.dumps(body()).encode(), enabled=True)
    assert isinstance(p, Plan)
    st = StreamState(p)
    assert st.on_event(_chunk([11], " w11", prompt=[1, 2])).kind is Kind.RELAY
    step = st.on_event(_chunk([], "", finish="abort"))
    assert step.kind is Kind.ABORT and b'"finish_reason":"abort"' in step.data
    assert b'"token_ids":null' in step.data  # as vLLM writes it for a client without ids
    assert st.finish_reason is None
    decision = st.decide()
    assert isinstance(decision, Continue) and decision.settled_tokens == 1


# --- any body a client may send -----------------------------------------------------------------

# Lone surrogates (valid JSON as escapes, no UTF-8), astral and combining characters, escapes
# and whitespace, often; any other character too.
# (Joined from a list: st.text() leaves surrogates out.)
_TEXT = st.lists(
    st.sampled_from(["a", " ", "\n", "é", "\u0301", "\ud800", "\udfff", "😀", "\\", '"'])
    | st.characters(codec=None, exclude_categories=()),
    max_size=8,
).map("".join)
_LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _TEXT
_JSON = st.recursive(
    _LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": _LEAF, "content": _LEAF | st.lists(st.fixed_dictionaries({"text": _LEAF}))}
    ),
    max_size=3,
)
_FIELDS = ["prompt", "messages", "stream", "return_token_ids", "n", "max_tokens",
           "max_completion_tokens", "min_tokens", "stream_options", "input", "content", "role",
           "text", "stop", "response_format", "tools", "echo", "logprobs"]  # fmt: skip
# Values as the fields hold them (a string, a number, messages) more often than nested JSON;
# a third of the bodies streamed (the plan's paths).
_REQUEST = st.dictionaries(st.sampled_from(_FIELDS), _LEAF | _MESSAGES | _JSON, max_size=6)
_BODY = _REQUEST | _REQUEST.map(lambda d: {**d, "stream": True}) | _JSON


@settings(max_examples=400, deadline=None)
@example(doc={"prompt": "a\ud800", "stream": True, "return_token_ids": None},
         path=COMPLETIONS_PATH, ascii_only=True)  # fmt: skip
@example(doc={"messages": [{"role": "user", "content": "\udfff"}], "stream": True,
              "return_token_ids": False}, path=CHAT_PATH, ascii_only=True)  # fmt: skip
@given(doc=_BODY, path=st.sampled_from([COMPLETIONS_PATH, CHAT_PATH, "/v1/embeddings"]),
       ascii_only=st.booleans())  # fmt: skip
def test_whatever_json_a_client_sends_the_gate_reads_without_an_exception(
    doc: object, path: str, ascii_only: bool
) -> None:
    """The gate's reads of a body before it goes upstream (its cost, its stream's plan, the
    fallback's check) end in a decision for any JSON at all, strings no UTF-8 carries
    included: an exception there was the client's 500."""
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    parsed = body_json(raw)
    cost_of(raw, parsed, 16)
    p = plan_of(path, raw, parsed, enabled=True)
    fallback_allowed(path, parsed, p)
    if isinstance(p, Plan):
        assert json.loads(p.upstream_body)["return_token_ids"] is True


# --- whatever vLLM sends back ------------------------------------------------------------------

_CHOICE_KEYS = ["index", "text", "delta", "content", "role", "token_ids", "prompt_token_ids",
                "finish_reason", "stop_reason", "logprobs", "tool_calls", "reasoning_content"]  # fmt: skip
_ID = st.lists(st.integers(-5, 2**40) | _LEAF, max_size=3)
_CHOICE = st.dictionaries(st.sampled_from(_CHOICE_KEYS), _LEAF | _ID | _JSON, max_size=6)
_CHUNK = st.fixed_dictionaries(
    {"id": _LEAF, "choices": st.lists(_CHOICE | _LEAF, max_size=2)},
    optional={"created": _LEAF, "model": _LEAF, "usage": _LEAF | _JSON, "error": _LEAF | _JSON},
)
_EVENT = (
    _CHUNK.map(lambda d: b"data: " + json.dumps(d).encode() + b"\n\n")
    | _CHUNK.map(
        lambda d: (
            b"data: " + json.dumps(d, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n\n"
        )
    )
    | st.binary(max_size=40).map(lambda b: b"data: " + b + b"\n\n")
    | st.sampled_from([b"data: [DONE]\n\n", b": keep-alive\n\n", b"event: x\n\n"])
)


@settings(max_examples=300, deadline=None)
@given(
    path=st.sampled_from([COMPLETIONS_PATH, CHAT_PATH]),
    asked_ids=st.booleans(),
    events=st.lists(_EVENT, max_size=8),
    cut_after=st.integers(0, 8),
)
def test_whatever_events_vllm_sends_the_relay_reads_without_an_exception(
    path: str, asked_ids: bool, events: list[bytes], cut_after: int
) -> None:
    """Each event gives a step (relayed, held back, the end, a cut) and a cut a decision, for
    any chunk at all: an exception there ended the client's stream as a failure of the gate."""
    fields = (
        {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT_PATH else {"prompt": "hi"}
    )
    raw = json.dumps({**fields, "stream": True, "return_token_ids": asked_ids}).encode()
    p = plan(path, raw, enabled=True)
    assert isinstance(p, Plan), p
    state = StreamState(p)
    for i, event in enumerate(events):
        if i == cut_after:
            decision = state.decide()
            if isinstance(decision, Continue):
                state.begin_continuation(decision.settled_tokens)
        if state.relay_common(event) is None:
            step = state.on_event(event)
            assert isinstance(step.kind, Kind) and isinstance(step.data, bytes), step
    state.decide(max_model_len=64)
    state.take_pending()
