"""The twin speaks what the gate's continuation needs, as vLLM 0.32 does (its completion and
chat serving code): a list of token ids as ``prompt``; ``return_token_ids`` (the prompt's ids on
the first chunk, each chunk's generated ids in ``token_ids``, ``null`` when not asked); and
``continue_final_message`` / ``add_generation_prompt`` for chat.

A twin start (about 3 s) is the slow part: two tests, one start each."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import Starter
from tests.sim.twinproc import TwinProc, sse

pytestmark = pytest.mark.slow


@pytest.fixture
def twin_ready(twin: Starter) -> TwinProc:
    t = twin("--sim-model", "tiny", "--served-model-name", "tiny", "--max-model-len", "4096",
             "--sim-speed", "10")  # fmt: skip
    t.wait_ready()
    return t


def events(t: TwinProc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = t.post(path, {"model": "tiny", "stream": True, **body}, stream=True)
    assert resp.status_code == 200, resp.text
    got = list(sse(resp))
    assert got[-1] == "[DONE]", got
    return [e for e in got if isinstance(e, dict)]


def text_of(chunks: list[dict[str, Any]], chat: bool) -> str:
    key = "delta" if chat else None
    out = ""
    for c in chunks:
        for ch in c["choices"]:
            out += (ch[key].get("content") or "") if key else ch["text"]
    return out


def test_completions_token_ids_and_a_continuation_from_them(twin_ready: TwinProc) -> None:
    t = twin_ready
    plain = events(t, "/v1/completions", {"prompt": "a b c", "max_tokens": 6})
    # Without the flag both fields are there, null (vLLM serialises them on every chunk).
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in plain)
    assert all(c["choices"][0]["token_ids"] is None for c in plain)

    chunks = events(t, "/v1/completions", {"prompt": "a b c", "max_tokens": 6,
                                           "return_token_ids": True,
                                           "stream_options": {"include_usage": True}})  # fmt: skip
    tokens = [c for c in chunks if c["choices"]]
    prompt = tokens[0]["choices"][0]["prompt_token_ids"]
    assert isinstance(prompt, list) and len(prompt) == 3
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in tokens[1:])  # once only
    generated = [i for c in tokens for i in c["choices"][0]["token_ids"]]
    assert len(generated) == 6 and chunks[-1]["usage"]["completion_tokens"] == 6

    # The same prompt as ids is the same prompt; ids plus the first two generated ids, with
    # max_tokens lowered by them, give the rest of the uncut text.
    as_ids = events(t, "/v1/completions", {"prompt": prompt, "max_tokens": 6})
    assert text_of(as_ids, chat=False) == text_of(tokens, chat=False)
    rest = events(t, "/v1/completions", {"prompt": [*prompt, *generated[:2]], "max_tokens": 4,
                                         "return_token_ids": True,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    assert rest[-1]["usage"]["prompt_tokens"] == 5
    first_two = "".join(c["choices"][0]["text"] for c in tokens[:2])
    assert first_two + text_of(rest, chat=False) == text_of(tokens, chat=False)
    assert [i for c in rest if c["choices"] for i in c["choices"][0]["token_ids"]] == generated[2:]


def test_chat_token_ids_and_continue_final_message(twin_ready: TwinProc) -> None:
    t = twin_ready
    user = [{"role": "user", "content": "a b c"}]
    chunks = events(t, "/v1/chat/completions", {"messages": user, "max_tokens": 5,
                                                "return_token_ids": True,
                                                "stream_options": {"include_usage": True}})  # fmt: skip
    role, tokens = chunks[0], [c for c in chunks[1:] if c["choices"]]
    # Chat carries the prompt's ids beside the choices, on the role chunk only.
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert isinstance(role["prompt_token_ids"], list)
    assert all("prompt_token_ids" not in c for c in tokens)
    assert [len(c["choices"][0]["token_ids"]) for c in tokens] == [1] * 5
    whole = text_of(tokens, chat=True)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(role["prompt_token_ids"])

    # The conversation plus the partial assistant message, left open, goes on where it was.
    partial = "".join(c["choices"][0]["delta"]["content"] for c in tokens[:2])
    cont = events(t, "/v1/chat/completions", {
        "messages": [*user, {"role": "assistant", "content": partial}], "max_tokens": 3,
        "continue_final_message": True, "add_generation_prompt": False,
        "stream_options": {"include_usage": True}})  # fmt: skip
    assert partial + text_of(cont[1:], chat=True) == whole
    # Its prompt is the uncut one's followed by the two generated tokens.
    assert cont[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"] + 2

    both = t.post("/v1/chat/completions", {"model": "tiny", "messages": user,
                                           "continue_final_message": True})  # fmt: skip
    assert both.status_code == 400
    assert (
        "Cannot set both `continue_final_message` and `add_generation_prompt`"
        in (both.json()["error"]["message"])
    )

    # Unary answers carry the ids too, when asked.
    comp = t.post("/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2,
                                      "return_token_ids": True}).json()  # fmt: skip
    assert comp["choices"][0]["prompt_token_ids"] == [7, 8, 9]
    assert len(comp["choices"][0]["token_ids"]) == 2
    chat = t.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "x"}]}).json()  # fmt: skip
    assert chat["prompt_token_ids"] is None and chat["choices"][0]["token_ids"] is None
