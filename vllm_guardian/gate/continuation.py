"""Continuing a streamed ``/v1/completions`` or ``/v1/chat/completions`` after the upstream
cut it: the decisions, no I/O.

Where it sits: :mod:`vllm_guardian.gate.relay` reads the upstream's SSE events and writes them
to the client; this module decides what each event becomes and, at a cut, whether and how the
stream goes on. The proxy asks :func:`plan` once per request.

How a continuation stays exact:

* the request goes upstream with ``return_token_ids: true``: vLLM then puts the prompt's token
  ids in the first chunk and each chunk's generated ids in ``token_ids``. The gate keeps them
  and turns both fields back to ``null`` before the client sees them (what vLLM sends without
  the flag), unless the client asked for them itself;
* after a cut, the continuation's prompt is the prompt's ids plus the ids already *settled*
  (those whose text the client has), ``max_tokens`` and ``min_tokens`` lowered by them. vLLM
  takes a list of ids as the prompt without tokenizing it, so the model sees the same context;
* vLLM holds back the text of a token that ends inside a multi-byte character (the decoder
  waits for the rest). A chunk with ids and no text is therefore held by the gate until the
  chunk with its text, and at a cut its ids are rolled back: the client never saw them, and a
  continuation primed with half a character would lose it. When the last chunk with text
  carried several tokens, the relay asks vLLM's ``/detokenize`` whether they end inside a
  character (:func:`tail_is_settled`), and does not continue if they do;
* the continuation's chunks get the first answer's ``id`` and ``created``; ``prompt_token_ids``
  is stripped; usage counts the prompt once and every completion token;
* a chat stream is continued the same way, token-level: its role chunk carries the prompt's ids
  (the chat template applied), and the continuation is a ``/v1/completions`` of those ids and
  the ids delivered, whose chunks are written back as the chat's. A partial assistant message
  (``continue_final_message``) would be tokenised again, and its ids are not the ones the
  model generated (docs/gate.md has the measurement).

Requests whose continuation could not be honest are refused (:class:`Refusal`), and their
stream is relayed byte for byte, cut where the upstream cuts it, as before.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# vLLM 0.32's CompletionRequest.max_tokens when the request leaves it out.
SCHEMA_DEFAULT_MAX_TOKENS = 16
# vLLM's messages when the engine died under a request (also the proxy's retry markers).
DYING_MARKERS = (
    "cannot schedule new futures after shutdown",
    "EngineDeadError",
    "EngineCore encountered an issue",
)
# vLLM's finish_reason for a request it aborted (its shutdown, an engine stopping): answered
# with HTTP 200, but not an answer. As vLLM serialises it (compact JSON).
ABORT_FINISH = "abort"
ABORT_MARKER = b'"finish_reason":"abort"'
# The decoder's stand-in for bytes that do not make a whole character yet.
REPLACEMENT_CHARACTER = "\ufffd"
# How many settled ids /detokenize is asked about: a character is at most 4 bytes, a token at
# least one, so 4 ids before a chunk's own reach back to the start of any character it ends in.
TAIL_CONTEXT_TOKENS = 4
# What keeps an event off the common path (_token_chunk), found in one pass: usage, the
# prompt's ids, an error.
_KEPT_KEYS = re.compile(rb'"(?:usage":\{|prompt_token_ids":\[|error")')


class Refusal(enum.StrEnum):
    """Why a stream is not continued (the ``reason`` of ``outcome="refused"``)."""

    DISABLED = "disabled"
    UNPARSEABLE = "unparseable"  # not a JSON object, or a field of the wrong type
    PROMPT_SHAPE = "prompt_shape"  # several prompts, embeddings, a suffix, no prompt
    SEVERAL_CHOICES = "n"
    BEST_OF = "best_of"
    BEAM_SEARCH = "beam_search"
    ECHO = "echo"
    LOGPROBS = "logprobs"
    STRUCTURED_OUTPUT = "structured_output"
    # Stop strings: vLLM holds back text that may begin one, and a stop string across the cut
    # would not be seen.
    STOP_STRINGS = "stop_strings"
    # Penalties, bad words, repetition detection, thinking budgets: they read the tokens
    # generated so far, which a continuation sees as prompt.
    OUTPUT_HISTORY = "output_history"
    KV_TRANSFER = "kv_transfer"
    # Chat: tools the model may call (a call's arguments are parsed across the whole output),
    # or content that is not text (its prompt ids stand for media a token prompt cannot carry).
    TOOLS = "tools"
    MEDIA = "media"
    # Decided at the cut:
    UNREADABLE_STREAM = "unreadable_stream"  # an event the gate could not read
    # Text without ids: the upstream ignores return_token_ids (an older server).
    NO_TOKEN_IDS = "no_token_ids"  # noqa: S105 (a label value, not a secret)
    UNSETTLED_TEXT = "unsettled_text"  # a relayed chunk whose last text is still held back
    NO_TOKENS_LEFT = "no_tokens_left"
    # A chat request without a max: its continuation needs the server's max_model_len
    # (``/v1/models``), and the server did not say.
    NO_CONTEXT_LENGTH = "no_context_length"
    # Chat streams that already emitted what a continuation cannot take up where it stopped.
    TOOL_CALLS = "tool_calls"
    REASONING = "reasoning"


class Outcome(enum.StrEnum):
    CONTINUED = "continued"  # a continuation's answer started
    FALLBACK = "fallback"  # ...on the fallback replica (ProxySettings.fallback_url)
    COMPLETED = "completed"  # the cut came after the last token: the gate ended the stream
    REFUSED = "refused"
    FAILED = "failed"


class Failure(enum.StrEnum):
    EXHAUSTED = "max_continuations"
    WAIT_TIMEOUT = "wait_timeout"  # or any other refusal of the admission's wait
    UPSTREAM_ANSWER = "upstream_answer"  # the continuation was answered with an error
    CLIENT_GONE = "client_gone"


class Cut(enum.StrEnum):
    """How the upstream broke a stream (the ``reason`` of ``continued`` and ``completed``)."""

    CONNECTION = "connection"  # reset or closed before ``[DONE]``
    ERROR_EVENT = "error_event"  # vLLM's error event for a dead engine
    HANG = "hang"  # taken back by the gate from a hung engine (its progress watch)
    # vLLM's own end for a request it aborted (its shutdown): a last chunk with
    # ``finish_reason: "abort"`` before ``[DONE]``, HTTP 200 all the same
    ABORT = "abort"


@dataclass(frozen=True)
class Plan:
    """A streamed completion the gate can continue: the client's request, read once."""

    request: Mapping[str, Any]
    upstream_body: bytes  # the client's body with ``return_token_ids: true``
    wants_token_ids: bool  # the client asked for ``return_token_ids`` itself
    include_usage: bool
    chat: bool = False  # a ``/v1/chat/completions`` stream (continued through /v1/completions)


_STRUCTURED = ("structured_outputs", "structural_tag", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")  # fmt: skip
_HISTORY = ("bad_words", "repetition_detection", "thinking_token_budget")
# A chat request's fields that a completion request does not have (vLLM 0.32's
# ChatCompletionRequest less CompletionRequest), and those the two read differently.
_CHAT_ONLY = frozenset(("messages", "add_generation_prompt", "continue_final_message",
                        "chat_template", "chat_template_kwargs", "documents", "include_reasoning",
                        "max_completion_tokens", "media_io_kwargs", "mm_processor_kwargs",
                        "parallel_tool_calls", "reasoning_effort", "return_prompt_text",
                        "tool_choice", "tools", "top_logprobs", "logprobs", "add_special_tokens",
                        "echo", "n"))  # fmt: skip


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _single_prompt(prompt: object) -> bool:
    """One prompt: a string, a list of ids, or a list holding one of either."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(_is_int(t) for t in prompt):
        return True
    if len(prompt) != 1:
        return False
    only = prompt[0]
    return isinstance(only, str) or (
        isinstance(only, list) and bool(only) and all(_is_int(t) for t in only)
    )


def _chat_refusal(req: Mapping[str, Any]) -> Refusal | None:
    """What only a chat request can have that its continuation could not honour."""
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        return Refusal.UNPARSEABLE
    for m in messages:
        if not isinstance(m, dict):
            return Refusal.UNPARSEABLE
        content = m.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return Refusal.MEDIA
    if req.get("tools") and req.get("tool_choice") != "none":
        return Refusal.TOOLS
    if req.get("logprobs") or req.get("top_logprobs"):
        return Refusal.LOGPROBS
    v = req.get("max_completion_tokens")
    if v is not None and (not _is_int(v) or v < 0):
        return Refusal.UNPARSEABLE
    return None


def refusal_of(req: Mapping[str, Any], chat: bool = False) -> Refusal | None:
    """Why a streamed completion (or chat completion) request cannot be continued honestly,
    or None."""
    if chat:
        why = _chat_refusal(req)
        if why is not None:
            return why
    elif not _single_prompt(req.get("prompt")) or req.get("prompt_embeds") or req.get("suffix"):
        return Refusal.PROMPT_SHAPE
    n = req.get("n")
    if n is not None and n != 1:
        return Refusal.SEVERAL_CHOICES
    best_of = req.get("best_of")
    if best_of is not None and best_of != 1:
        return Refusal.BEST_OF
    if req.get("use_beam_search"):
        return Refusal.BEAM_SEARCH
    if req.get("echo"):
        return Refusal.ECHO
    if any(req.get(k) is not None for k in ("prompt_logprobs", "logprob_token_ids")) or (
        not chat and req.get("logprobs") is not None
    ):
        return Refusal.LOGPROBS
    fmt = req.get("response_format")
    if (fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")) or any(
        req.get(k) is not None for k in _STRUCTURED
    ):
        return Refusal.STRUCTURED_OUTPUT
    if req.get("stop"):
        return Refusal.STOP_STRINGS
    if any(req.get(k) for k in ("presence_penalty", "frequency_penalty")) or any(
        req.get(k) for k in _HISTORY
    ):
        return Refusal.OUTPUT_HISTORY
    if req.get("kv_transfer_params") is not None:
        return Refusal.KV_TRANSFER
    for key in ("max_tokens", "min_tokens"):
        v = req.get(key)
        if v is not None and (not _is_int(v) or v < 0):
            return Refusal.UNPARSEABLE
    opts = req.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        return Refusal.UNPARSEABLE
    return None


def body_json(body: bytes | bytearray) -> object | None:
    """A request body read as JSON, once for the whole gate (its cost, its stream's plan, its
    fallback): None when it is empty, not JSON or not UTF-8. Raises RecursionError (json's own
    nesting limit), which the proxy answers with 400."""
    if not body:
        return None
    try:
        doc: object = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc


def plan(path: str, body: bytes | bytearray, *, enabled: bool) -> Plan | Refusal | None:
    """:func:`plan_of` for a body not read yet."""
    try:
        req = body_json(body)
    except RecursionError:
        return None  # not a request vLLM will stream either
    return plan_of(path, body, req, enabled=enabled)


def plan_of(
    path: str, body: bytes | bytearray, req: object | None, *, enabled: bool
) -> Plan | Refusal | None:
    """What the gate does with this request's stream (``req``: ``body`` as
    :func:`body_json` read it): None for anything but a streamed ``/v1/completions`` or
    ``/v1/chat/completions`` (relayed as bytes, nothing to decide), a :class:`Refusal`
    (relayed as bytes; the reason is counted if the upstream cuts it), or a :class:`Plan`."""
    if path not in (COMPLETIONS_PATH, CHAT_PATH) or b'"stream"' not in body:
        return None
    if not isinstance(req, dict) or req.get("stream") is not True:
        return None
    if not enabled:
        return Refusal.DISABLED
    chat = path == CHAT_PATH
    why = refusal_of(req, chat)
    if why is not None:
        return why
    asked = req.get("return_token_ids")
    if asked is True:
        upstream = bytes(body)
    elif asked is None and "return_token_ids" not in req:
        # Inserted after the opening brace: the rest of the client's bytes go as they came.
        start = len(body) - len(body.lstrip())
        upstream = bytes(body[: start + 1]) + b'"return_token_ids":true,' + body[start + 1 :]
    else:
        upstream = _encode_request({**req, "return_token_ids": True})
    opts = req.get("stream_options") or {}
    return Plan(req, upstream, asked is True, bool(opts.get("include_usage")), chat)


def fallback_allowed(path: str, req: object | None, p: Plan | Refusal | None) -> bool:
    """Whether a held request may go to the fallback replica (``req``: its body as
    :func:`body_json` read it): a completion or chat completion that continuation would not
    refuse (a stream the gate plans to continue; a unary one of the same shape), so the
    fallback changes nothing the request asked for."""
    if path not in (COMPLETIONS_PATH, CHAT_PATH) or isinstance(p, Refusal):
        return False
    if isinstance(p, Plan):
        return True
    return (
        isinstance(req, dict)
        and not req.get("stream")
        and refusal_of(req, path == CHAT_PATH) is None
    )


def _encode(doc: object) -> bytes:
    # vLLM's own serialisation (pydantic's model_dump_json): compact, non-ASCII as UTF-8.
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _encode_request(doc: object) -> bytes:
    """A request body for vLLM: :func:`_encode`, or with every non-ASCII character escaped when
    the client's JSON held a lone surrogate ("\\ud800", valid JSON that no UTF-8 carries): the
    same document to vLLM. (An event is not written again then: passed on as it came.)"""
    try:
        return _encode(doc)
    except UnicodeEncodeError:
        return json.dumps(doc, separators=(",", ":")).encode()


def dying_message(message: str) -> bool:
    return any(m in message for m in DYING_MARKERS)


def _aborted(doc: Mapping[str, Any]) -> bool:
    """A chunk or answer in which vLLM ended a choice with ``finish_reason: "abort"``."""
    choices = doc.get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == ABORT_FINISH for c in choices
    )


def aborted_answer(body: bytes) -> bool:
    """A whole unary answer (``/v1/completions``, ``/v1/chat/completions``) in which vLLM
    aborted a choice: HTTP 200, and the request was not served (vLLM shutting down answers
    what it aborts that way, with no token or some)."""
    if b'"abort"' not in body:
        return False  # the common answer: not decoded
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(doc, dict) and _aborted(doc)


# --- one stream's events -----------------------------------------------------------------------


class Kind(enum.Enum):
    RELAY = "relay"  # write ``data`` to the client
    DONE = "done"  # ``data: [DONE]``: write it, the stream is complete
    CUT = "cut"  # vLLM's error event for a dead engine: the attempt is over
    # vLLM's last chunk for a request it aborted: the attempt is over (``data`` is that chunk
    # as the client would have it, held: it reaches the client only if the gate gives up)
    ABORT = "abort"


@dataclass(frozen=True)
class Step:
    kind: Kind
    data: bytes


@dataclass(frozen=True)
class Continue:
    """Send this body as the next attempt."""

    body: bytes
    settled_tokens: int
    rolled_back_tokens: int
    check_tail: tuple[int, ...]  # ids to ask /detokenize about first (empty: nothing to ask)
    path: str | None = None  # where it goes (None: where the client's request went)


@dataclass(frozen=True)
class Complete:
    """Every token is delivered: the gate writes what is missing (usage, ``[DONE]``)."""

    data: bytes


class StreamState:
    """What the client has been sent of one streamed completion, across attempts."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        # As the upstream's JSON carried them (object: whatever it sent is kept and repeated, not
        # judged here; compiled, a narrower type would be a check that fails on an odd value).
        self.id: object = None
        self.created: object = None
        self.model: object = None
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []  # generated ids, this attempt's included
        self.settled = 0  # how many of them the client's text covers
        self.last_text_tokens = 0  # ids in the chunk that settled them (0: none)
        self.finish_reason: object = None  # (as id, above)
        self.usage_seen = False
        self.unreadable = False
        self.ids_missing = False  # text came without its ids
        self.unhonest: Refusal | None = None  # a chat stream emitted tool calls or reasoning
        self.continuations = 0  # continuation requests sent (the relay counts them)
        self.continuing = False  # this attempt is a continuation
        self.base_tokens = 0  # completion tokens before this attempt
        self._pending: list[bytes] = []  # events of ids without text yet, not relayed yet

    # --- events ------------------------------------------------------------------------------

    def on_event(self, raw: bytes) -> Step:
        """One SSE event as the upstream sent it (including its blank line)."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return self._relay(raw)  # comments, other fields: as they came
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return Step(Kind.DONE, self._flush(raw))
        common = self._token_chunk(raw, payload)
        if common is not None:
            return Step(Kind.RELAY, common)
        try:
            doc = json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            self.unreadable = True
            return self._relay(raw)
        if "error" in doc and "choices" not in doc:
            err = doc.get("error")
            message = str(err.get("message", "")) if isinstance(err, dict) else str(err)
            if dying_message(message):
                return Step(Kind.CUT, raw)
            return self._relay(raw)  # vLLM's answer: not the gate's to change
        before = (len(self.token_ids), self.finish_reason)
        try:
            converted = False
            if self.plan.chat and self.continuing:
                # A chat stream's continuation is a completion: its chunks become the chat's.
                doc = _chat_chunk_of(doc)
                converted = True
            aborted = _aborted(doc)
            changed, textless = self._chunk(doc)
            # (UnicodeEncodeError, a ValueError: text with a lone surrogate, "\ud800")
            out = b"data: " + _encode(doc) + b"\n\n" if changed or converted else raw
        except (TypeError, ValueError, AttributeError):
            self.unreadable = True  # not the shape read here: passed on as it came
            return self._relay(raw)
        if aborted:
            # Not the stream's end: a cut. vLLM's abort carries no token; one that did would
            # not be the client's whole text, so the stream is not continued then.
            if len(self.token_ids) != before[0]:
                self.unreadable = True
            self.finish_reason = before[1]
            return Step(Kind.ABORT, out)
        if textless:
            # Ids whose text vLLM still holds back: sent with the text that settles them, so
            # a cut before it rolls them back without the client having seen them.
            self._pending.append(out)
            return Step(Kind.RELAY, b"")
        return self._relay(out)

    def relay_common(self, raw: bytes) -> bytes | None:
        """:meth:`on_event` for the common event (see :meth:`_token_chunk`) written as vLLM
        writes it (``data: {...}`` and its blank line), without building a :class:`Step`: the
        bytes to relay (``b""``: held back for now), or None for any other event (then
        :meth:`on_event`). The relay's hot path: once per token."""
        if not (raw.startswith(b"data: {") and raw.endswith(b"}\n\n")):
            return None
        # The payload's patterns are the same in the whole event: "data: " and the blank
        # line hold none of them.
        return self._token_chunk(raw, raw)

    def _token_chunk(self, raw: bytes, payload: bytes) -> bytes | None:
        """The common event read without decoding it: one choice, its text (or chat content)
        and ids, nothing else the stream keeps (no usage, finish, prompt ids, tool calls,
        reasoning, error), past the first chunk of a first attempt. What :meth:`_chunk` would
        do with it, on the bytes: keep the ids, strip them unless the client asked for them.
        Returns what to relay, held events first (``b""``: held back until text settles it),
        or None: any other event (decoded in full). A key's pattern cannot
        occur inside a JSON string, whose quotes are escaped."""
        if self.id is None or self.continuing:
            return None
        at = payload.find(b'"token_ids":[')
        if (
            at < 0
            or payload.count(b'"index":') != 1
            or b'"finish_reason":null' not in payload
            or _KEPT_KEYS.search(payload)
        ):
            return None
        if self.plan.chat:
            if b'"tool_calls"' in payload or b'"reasoning' in payload:
                return None
            key = payload.find(b'"content":')
            if key >= 0 and payload[key + 10 : key + 11] not in (b'"', b"n"):
                return None  # not compact JSON
            text = key >= 0 and payload[key + 10 : key + 12] not in (b'""', b"nu")
        else:
            key = payload.find(b'"text":"')
            if key < 0:
                return None
            text = payload[key + 8 : key + 9] != b'"'
        end = payload.find(b"]", at)
        listed = payload[at + 13 : end]
        token_ids = self.token_ids
        try:
            token_ids.append(int(listed))  # one token a chunk, vLLM's usual
            n = 1
        except ValueError:
            if b"," in listed:
                try:
                    ids = [int(t) for t in listed.split(b",")]
                except ValueError:
                    return None
            elif listed.strip():
                return None
            else:
                ids = []
            token_ids.extend(ids)
            n = len(ids)
        out = raw
        if not self.plan.wants_token_ids:
            if payload is not raw:  # on_event's: the payload's offsets are not the event's
                at = raw.find(b'"token_ids":[')
                end = raw.find(b"]", at)
            out = raw[: at + 12] + b"null" + raw[end + 1 :]
        if text:
            self.settled = len(token_ids)
            self.last_text_tokens = n
        elif n:
            self._pending.append(out)
            return b""
        return self._flush(out)

    def _relay(self, data: bytes) -> Step:
        return Step(Kind.RELAY, self._flush(data))

    def _flush(self, data: bytes) -> bytes:
        if not self._pending:
            return data
        out = b"".join(self._pending) + data
        self._pending.clear()
        return out

    def take_pending(self) -> bytes:
        """The events held back, for a client whose stream ends here."""
        return self._flush(b"")

    def _chunk(self, doc: dict[str, Any]) -> tuple[bool, bool]:
        """Read one chunk, and make it what the client would have had from one uncut stream.
        (whether it changed, whether it carries ids and no text yet)."""
        changed = textless = False
        chat = self.plan.chat
        if self.id is None:
            self.id, self.created = doc.get("id"), doc.get("created")
        else:  # a continuation's own: the client keeps the first answer's
            for key, mine in (("id", self.id), ("created", self.created)):
                if key in doc and doc[key] != mine:
                    doc[key] = mine
                    changed = True
        self.model = doc.get("model", self.model)
        if chat:  # chat carries the prompt's ids beside the choices, on its role chunk
            changed |= self._prompt_ids(doc)
        choices = doc.get("choices") or []
        if len(choices) > 1:
            raise ValueError("several choices")
        for choice in choices:
            if chat:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls"):
                    self.unhonest = Refusal.TOOL_CALLS
                elif delta.get("reasoning") or delta.get("reasoning_content"):
                    self.unhonest = Refusal.REASONING
                text = delta.get("content")
            else:
                changed |= self._prompt_ids(choice)
                text = choice.get("text")
            ids = choice.get("token_ids")
            if ids is None:
                ids = []
                if text:
                    self.ids_missing = True
            elif not self.plan.wants_token_ids:
                choice["token_ids"] = None
                changed = True
            self.token_ids.extend(int(t) for t in ids)
            if text:
                self.settled = len(self.token_ids)
                self.last_text_tokens = len(ids)
            elif ids and choice.get("finish_reason") is None:
                textless = True
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        usage = doc.get("usage")
        if isinstance(usage, dict):
            if not choices:
                self.usage_seen = True
            if self.continuing:
                self._count_once(usage)
                changed = True
        return changed, textless

    def _prompt_ids(self, holder: dict[str, Any]) -> bool:
        """Keep the prompt's ids from the first answer; strip them where the client would not
        have had them. Whether ``holder`` changed."""
        prompt_ids = holder.get("prompt_token_ids")
        if prompt_ids is None:
            return False
        if self.prompt_ids is None:
            self.prompt_ids = [int(t) for t in prompt_ids]
        if self.continuing or not self.plan.wants_token_ids:
            holder["prompt_token_ids"] = None
            return True
        return False

    def _count_once(self, usage: dict[str, Any]) -> None:
        prompt = len(self.prompt_ids) if self.prompt_ids is not None else usage.get("prompt_tokens")
        prompt = int(prompt or 0)
        completion = self.base_tokens + int(usage.get("completion_tokens") or 0)
        usage["prompt_tokens"] = prompt
        usage["total_tokens"] = prompt + completion
        usage["completion_tokens"] = completion
        # The continuation's cache hits count tokens it read as prompt: not the client's.
        usage.pop("prompt_tokens_details", None)

    # --- at a cut ----------------------------------------------------------------------------

    @property
    def needs_context_length(self) -> bool:
        """A chat request without a max (its continuation asks for the server's
        ``max_model_len``, which vLLM cuts down to what is left of the context)."""
        req = self.plan.request
        return (
            self.plan.chat
            and req.get("max_completion_tokens") is None
            and req.get("max_tokens") is None
        )

    def decide(self, max_model_len: int | None = None) -> Continue | Complete | Refusal:
        """What follows a cut (the attempt's answer is over, ``[DONE]`` not seen).
        ``max_model_len``: the server's, where :attr:`needs_context_length`."""
        if self.unreadable:
            return Refusal.UNREADABLE_STREAM
        if self.ids_missing:
            return Refusal.NO_TOKEN_IDS  # sent again whole, it would repeat the client's text
        if self.unhonest is not None:
            return self.unhonest
        if self.finish_reason is not None:
            return Complete(self._ending())
        if self.plan.chat:
            return self._chat_continuation(max_model_len)
        rolled_back = len(self.token_ids) - self.settled  # held back, never relayed
        req = self.plan.request
        body: dict[str, Any] = dict(req)
        raw_max = req.get("max_tokens", SCHEMA_DEFAULT_MAX_TOKENS)
        if raw_max is not None:
            if raw_max - self.settled <= 0:
                return Refusal.NO_TOKENS_LEFT
            body["max_tokens"] = raw_max - self.settled
        if self.settled == 0 or self.prompt_ids is None:
            if self.settled:
                return Refusal.UNREADABLE_STREAM  # tokens, and no prompt ids to put before them
            return Continue(self.plan.upstream_body, 0, rolled_back, ())
        if _is_int(req.get("min_tokens")):
            body["min_tokens"] = max(0, req["min_tokens"] - self.settled)
        return self._continue_from_ids(body, rolled_back, None)

    def _chat_continuation(self, max_model_len: int | None) -> Continue | Refusal:
        """A chat stream goes on as a ``/v1/completions`` whose prompt is the chat's own prompt
        ids (the template already applied, as the engine saw them) followed by the ids
        delivered: token-exact, where a partial assistant message would be re-tokenised. The
        body is the chat request less what only chat has (the fields of vLLM 0.32's
        ChatCompletionRequest that CompletionRequest lacks) and the fields the two read
        differently (``logprobs``, ``add_special_tokens``, ``max_tokens``'s default)."""
        if self.prompt_ids is None:
            return Refusal.NO_TOKEN_IDS  # the first chunk came without the prompt's ids
        rolled_back = len(self.token_ids) - self.settled
        req = self.plan.request
        body = {k: v for k, v in req.items() if k not in _CHAT_ONLY}
        # vLLM: max_completion_tokens wins; neither means "up to the context's end". A
        # completion reads a null max_tokens as its default (16), but lowers any max up to
        # max_model_len to what the context has left: the server's max_model_len is that end.
        raw_max = req.get("max_completion_tokens")
        if raw_max is None:
            raw_max = req.get("max_tokens")
        if raw_max is None:
            if max_model_len is None:
                return Refusal.NO_CONTEXT_LENGTH
            body["max_tokens"] = max_model_len
        elif not _is_int(raw_max):
            return Refusal.UNPARSEABLE
        elif raw_max - self.settled <= 0:
            return Refusal.NO_TOKENS_LEFT
        else:
            body["max_tokens"] = raw_max - self.settled
        return self._continue_from_ids(body, rolled_back, COMPLETIONS_PATH)

    def _continue_from_ids(
        self, body: dict[str, Any], rolled_back: int, path: str | None
    ) -> Continue:
        req = self.plan.request
        assert self.prompt_ids is not None
        if _is_int(req.get("min_tokens")):
            body["min_tokens"] = max(0, req["min_tokens"] - self.settled)
        body["prompt"] = [*self.prompt_ids, *self.token_ids[: self.settled]]
        body["return_token_ids"] = True
        body.pop("truncate_prompt_tokens", None)  # the prompt's ids are already what was kept
        if isinstance(req.get("request_id"), str):
            body["request_id"] = f"{req['request_id']}-cont{self.continuations + 1}"
        tail: tuple[int, ...] = ()
        if self.last_text_tokens > 1:
            start = max(0, self.settled - self.last_text_tokens - TAIL_CONTEXT_TOKENS)
            tail = tuple(self.token_ids[start : self.settled])
        return Continue(_encode_request(body), self.settled, rolled_back, tail, path)

    def begin_continuation(self, settled: int) -> None:
        """The continuation's answer started: what was rolled back is forgotten."""
        del self.token_ids[settled:]
        self._pending.clear()
        self.settled = settled
        self.base_tokens = settled
        self.last_text_tokens = 1 if settled else 0
        self.finish_reason = None
        self.continuing = True

    def _ending(self) -> bytes:
        """The events an uncut stream would still have sent after its last token."""
        out = b""
        if self.plan.include_usage and not self.usage_seen:
            prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
            completion = len(self.token_ids)
            usage: dict[str, object] = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                "created": self.created,
                "model": self.model, "choices": [],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                          "completion_tokens": completion},
            }  # fmt: skip
            out += b"data: " + _encode(usage) + b"\n\n"
        return out + b"data: [DONE]\n\n"


def _chat_chunk_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A completion chunk as vLLM's chat serving would have written the same tokens."""
    choices = []
    for c in doc.get("choices") or []:
        finish = c.get("finish_reason")
        choice: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": c.get("text")},
                                  "logprobs": None, "finish_reason": finish}  # fmt: skip
        if finish is not None:
            choice["stop_reason"] = c.get("stop_reason")
        choice["token_ids"] = c.get("token_ids")
        choices.append(choice)
    out = {"id": doc.get("id"), "object": "chat.completion.chunk", "created": doc.get("created"),
           "model": doc.get("model"), "choices": choices}  # fmt: skip
    for key in ("usage", "system_fingerprint"):  # the terminal chunk's, in vLLM's order
        if key in doc:
            out[key] = doc[key]
    return out


def tail_is_settled(detokenized: str) -> bool:
    """vLLM's ``/detokenize`` of the last settled ids: False when they end inside a character
    (vLLM's stream still holds that text back)."""
    return not detokenized.endswith(REPLACEMENT_CHARACTER)


class SseSplitter:
    """Cuts a byte stream into SSE events (each with its blank line), as they complete."""

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buf and data.find(b"\n\n") == len(data) - 2:
            return [data]  # one whole event, as vLLM writes them: no copy
        self._buf += data
        events: list[bytes] = []
        start = 0
        while True:
            end = self._buf.find(b"\n\n", start)
            if end < 0:
                break
            events.append(bytes(self._buf[start : end + 2]))
            start = end + 2
        del self._buf[:start]
        return events

    @property
    def overflowing(self) -> bool:
        return len(self._buf) > self._max

    def take_rest(self) -> bytes:
        rest = bytes(self._buf)
        self._buf.clear()
        return rest
