"""A vLLM-shaped ``/v1/completions`` on 127.0.0.1 whose streams a test can cut.

What matters for continuation is shaped as vLLM 0.32 shapes it (its completion serving code):

* a deterministic "model": the next token is a function of the whole sequence (prompt and
  output alike), as a temperature-0 model's is, so a continuation whose prompt is the prompt's
  ids plus the ids delivered reproduces the uncut output;
* a byte vocabulary in which some tokens are the first and some the second byte of a two-byte
  character, decoded as vLLM's detokenizer does: a token that ends inside a character adds no
  text until the next completes it, and each request's decoder starts fresh (a continuation
  primed with half a character loses it: the hazard the gate must avoid);
* chunks serialised like pydantic's ``model_dump_json(exclude_unset=True)``: ``logprobs``,
  ``stop_reason``, ``prompt_token_ids`` and ``token_ids`` present (``null`` unless
  ``return_token_ids``), the prompt's ids in the first chunk only, ``usage`` per chunk with
  ``continuous_usage_stats``, a usage chunk with ``include_usage``, ``system_fingerprint`` on
  the last of them, then ``data: [DONE]``;
  ``id`` is ``cmpl-<request_id>`` and ``created`` is derived from it;
* ``/detokenize``, ``/health`` (a test takes it down), and vLLM's error event and its 500 for a
  dead engine;
* ``/v1/chat/completions`` streams as vLLM's chat serving writes them: a role chunk first (the
  prompt's ids beside the choices with ``return_token_ids``, ``prompt_text: null``), then one
  ``delta.content`` per chunk with ``token_ids`` in the choice, ``stop_reason`` on the last;
  the prompt is a template's ids around each message's; ``reasoning_chunks`` makes the first
  chunks ``delta.reasoning`` (a server with a reasoning parser). No max means up to the
  context's end (``MAX_MODEL_LEN``, also in ``/v1/models``), as vLLM's chat reads it; a
  completion's ``max_tokens`` is cut down to what the context has left, as vLLM's is.

A test scripts the next requests' fates with :meth:`FakeCompletions.cut_next`.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.test_gate_support import LoopThread

VOCAB = 64
BOS = 1
EOS = 2
LEAD, FOLLOW = b"\xc3", b"\xa9"  # "é" in two tokens
DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
MAX_MODEL_LEN = 128
FINGERPRINT = "vllm-0.32.0-0123abcd"  # on the last chunk (the usage chunk, when there is one)
MESSAGE, ASSISTANT = 3, 4  # the chat template's ids: a message's start, the assistant turn


def piece(t: int) -> bytes:
    if t in (BOS, EOS):
        return b""  # special: skipped
    if t % 13 == 5:
        return LEAD
    if t % 13 == 6:
        return FOLLOW
    return f" w{t}".encode()


def next_token(seq: list[int]) -> int:
    if seq and piece(seq[-1]) == LEAD:
        return 6  # the character's second byte
    tail = seq[-3:]
    return (sum((i + 3) * x for i, x in enumerate(tail)) * 31 + len(seq) * 7) % VOCAB


def tokenize(text: str) -> list[int]:
    return [BOS] + [10 + zlib.crc32(w.encode()) % 50 for w in text.split()]


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    """The fake's chat template: BOS, each message's start and ids, the assistant turn (a
    part that is not text is one word, as a media placeholder)."""
    ids = [BOS]
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "<media>")) for p in content)
        ids += [MESSAGE, *tokenize(content)[1:]]
    return [*ids, ASSISTANT]


@dataclass(frozen=True)
class CutSpec:
    after_events: int  # chunks written before the cut (0: none)
    # reset | close (clean end, no [DONE]) | error_event | abort (vLLM's answer to a request
    # it aborts as it shuts down: HTTP 200, ``finish_reason: "abort"``, then [DONE])
    how: str = "reset"
    down: bool = False  # /health answers 503 from the cut on, until heal()


@dataclass
class FakeCompletions:
    tokens_per_chunk: int = 1
    healthy: bool = True
    token_ids_known: bool = True  # False: return_token_ids is ignored (an older server)
    reasoning_chunks: int = 0  # chat: the first chunks are reasoning, not content
    models_answer: bool = True  # False: /v1/models answers 503 (a server going down)
    paths: list[str] = field(default_factory=list)  # of the generation requests, in order
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of the same requests
    detokenized: list[list[int]] = field(default_factory=list)
    _cuts: list[CutSpec | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lt = LoopThread("fake-vllm")
        self.port = self.lt.run(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def stop(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.close()

    def reset(self, tokens_per_chunk: int = 1) -> None:
        self.tokens_per_chunk = tokens_per_chunk
        self.healthy = True
        self.token_ids_known = True
        self.reasoning_chunks = 0
        self.models_answer = True
        self.paths.clear()
        self.bodies.clear()
        self.headers.clear()
        self.detokenized.clear()
        self._cuts.clear()

    def cut_next(self, *specs: CutSpec | None) -> None:
        """The next requests' fates, in order (None: served whole); later ones are whole."""
        self._cuts.extend(specs)

    def heal(self) -> None:
        self.healthy = True

    # --- what an uncut run produces (for the tests' expectations) ---------------------------------

    @staticmethod
    def generate(prompt_ids: list[int], n: int) -> list[int]:
        seq = list(prompt_ids)
        for _ in range(n):
            seq.append(next_token(seq))
        return seq[len(prompt_ids) :]

    # --- the server ----------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=200 if self.healthy else 503)
        if request.path == "/detokenize":
            doc = await request.json()
            self.detokenized.append(list(doc["tokens"]))
            text = b"".join(piece(t) for t in doc["tokens"]).decode("utf-8", "replace")
            return web.json_response({"prompt": text})
        if request.path == "/v1/models" and not self.models_answer:
            return web.Response(status=503)
        if request.path == "/v1/models":
            card = {"id": "tiny", "object": "model", "max_model_len": MAX_MODEL_LEN}
            return web.json_response({"object": "list", "data": [card]})
        chat = request.path == "/v1/chat/completions"
        if request.path in ("/v1/completions", "/v1/chat/completions") and request.method == "POST":
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            self.paths.append(request.path)
            cut = self._cuts.pop(0) if self._cuts else None
            if not self.healthy:
                return _dead_500()
            if body.get("stream"):
                return await self._stream(request, body, cut, chat)
            return await self._unary(request, body, cut)
        return web.json_response({"detail": "Not Found"}, status=404)

    @staticmethod
    def _prompt_ids(body: dict[str, Any]) -> list[int]:
        prompt = body["prompt"]
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one's choice only
        return tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    @staticmethod
    def _ids(body: dict[str, Any]) -> tuple[str, int]:
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        return f"cmpl-{rid}", 1_700_000_000 + zlib.crc32(rid.encode()) % 1_000_000

    async def _unary(
        self, request: web.Request, body: dict[str, Any], cut: CutSpec | None
    ) -> web.StreamResponse:
        if cut is not None:
            if cut.down:
                self.healthy = False
            if cut.how == "error_event":
                return _dead_500()
            if cut.how == "abort":  # no token yet: vLLM's unary answer is empty
                cid, created = self._ids(body)
                aborted = {
                    "id": cid, "object": "text_completion", "created": created, "model": "tiny",
                    "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
                    "usage": _usage(len(self._prompt_ids(body)), 0),
                }  # fmt: skip
                return web.json_response(aborted)
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("fake: dies before answering")
        prompt = self._prompt_ids(body)
        out = self.generate(prompt, int(body.get("max_tokens", 16)))
        cid, created = self._ids(body)
        text = b"".join(piece(t) for t in out).decode("utf-8", "replace")
        answer = {
            "id": cid, "object": "text_completion", "created": created, "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": _usage(len(prompt), len(out)),
        }  # fmt: skip
        return web.json_response(answer)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], cut: CutSpec | None, chat: bool
    ) -> web.StreamResponse:
        if chat:
            prompt = chat_prompt(body["messages"])
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            max_tokens = MAX_MODEL_LEN - len(prompt) if max_tokens is None else max_tokens
        else:
            prompt = self._prompt_ids(body)
            max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens > MAX_MODEL_LEN:
            return web.json_response({"error": {"message": "max_tokens", "code": 400}}, status=400)
        out = self.generate(prompt, min(max_tokens, MAX_MODEL_LEN - len(prompt)))
        ids_back = bool(body.get("return_token_ids")) and self.token_ids_known
        opts = body.get("stream_options") or {}
        cid, created = self._ids(body)
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            cid = "chat" + cid
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        events = 0
        if chat:
            role = {"id": cid, "object": obj, "created": created, "model": "tiny",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt if ids_back else None, "prompt_text": None}  # fmt: skip
            await resp.write(b"data: " + _compact(role) + b"\n\n")
            events += 1
        for start in range(0, len(out), self.tokens_per_chunk):
            if cut is not None and events == cut.after_events:
                return await self._cut(
                    request,
                    resp,
                    cut,
                    (cid, obj, created, chat, ids_back, len(prompt), start, opts),
                )
            group = out[start : start + self.tokens_per_chunk]
            text = "".join(decoder.decode(piece(t)) for t in group)
            done = start + len(group) == len(out)
            choice: dict[str, Any]
            if chat:
                kind = "reasoning" if start < self.reasoning_chunks else "content"
                choice = {"index": 0, "delta": {kind: text}, "logprobs": None,
                          "finish_reason": "length" if done else None}  # fmt: skip
                if done:
                    choice["stop_reason"] = None
                choice["token_ids"] = group if ids_back else None
            else:
                choice = {
                    "index": 0, "text": text, "logprobs": None,
                    "finish_reason": "length" if done else None, "stop_reason": None,
                    "prompt_token_ids": prompt if ids_back and start == 0 else None,
                    "token_ids": group if ids_back else None,
                }  # fmt: skip
            chunk: dict[str, Any] = {
                "id": cid, "object": obj, "created": created, "model": "tiny",
                "choices": [choice],
            }  # fmt: skip
            if opts.get("continuous_usage_stats"):
                chunk["usage"] = _usage(len(prompt), start + len(group))
            if done and not opts.get("include_usage"):
                chunk["system_fingerprint"] = FINGERPRINT
            await resp.write(b"data: " + _compact(chunk) + b"\n\n")
            events += 1
            await asyncio.sleep(0)
        if cut is not None and events == cut.after_events:
            return await self._cut(
                request, resp, cut, (cid, obj, created, chat, ids_back, len(prompt), len(out), opts)
            )
        if opts.get("include_usage"):
            final = {
                "id": cid, "object": obj, "created": created, "model": "tiny",
                "choices": [], "usage": _usage(len(prompt), len(out)),
                "system_fingerprint": FINGERPRINT,
            }  # fmt: skip
            await resp.write(b"data: " + _compact(final) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _cut(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        cut: CutSpec,
        at: tuple[str, str, int, bool, bool, int, int, dict[str, Any]],
    ) -> web.StreamResponse:
        if cut.down:
            self.healthy = False
        if cut.how == "abort":
            await resp.write(_aborted(*at))
            await resp.write_eof()
            return resp
        if cut.how == "error_event":
            err = {"error": {"message": DEAD, "type": "InternalServerError", "param": None,
                             "code": 500}}  # fmt: skip
            await resp.write(b"data: " + _compact(err) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if cut.how == "close":
            await resp.write_eof()
            return resp
        assert request.transport is not None
        request.transport.abort()
        return resp


def _aborted(
    cid: str,
    obj: str,
    created: int,
    chat: bool,
    ids_back: bool,
    prompt: int,
    tokens: int,
    opts: dict[str, Any],
) -> bytes:
    """The end vLLM writes to a stream it aborts (its shutdown): a last chunk with no token
    and ``finish_reason: "abort"``, the usage chunk when asked for, ``[DONE]``."""
    choice: dict[str, Any]
    if chat:
        choice = {"index": 0, "delta": {"content": ""}, "logprobs": None,
                  "finish_reason": "abort", "stop_reason": None,
                  "token_ids": [] if ids_back else None}  # fmt: skip
    else:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "abort",
                  "stop_reason": None, "prompt_token_ids": None,
                  "token_ids": [] if ids_back else None}  # fmt: skip
    last: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": "tiny",
                            "choices": [choice]}  # fmt: skip
    if opts.get("continuous_usage_stats"):
        last["usage"] = _usage(prompt, tokens)
    out = b"data: " + _compact(last) + b"\n\n"
    if opts.get("include_usage"):
        final = {"id": cid, "object": obj, "created": created, "model": "tiny", "choices": [],
                 "usage": _usage(prompt, tokens), "system_fingerprint": FINGERPRINT}  # fmt: skip
        out += b"data: " + _compact(final) + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}  # fmt: skip


def _compact(doc: object) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _dead_500() -> web.Response:
    err = {"error": {"message": DEAD, "type": "InternalServerError", "param": None, "code": 500}}
    return web.Response(status=500, body=_compact(err), content_type="application/json")
