"""Secret redaction for everything the guardian shows or records (pure, no I/O).

The unit source reads vLLM's command line from /proc and the logs source keeps matched log
lines; both end up in snapshots, the flight recorder, ``status`` output and alerts, so any
secret in them must be gone before they leave the source. :func:`redact_argv` handles an
argument vector (``--api-key VALUE`` spans two items), :func:`redact_text` free text (a log
line, one argv item). Every secret is replaced by :data:`REDACTED`; the shape of the text
around it is kept so a human can still read what was configured.

What counts as a secret, and why:

* flags (``--flag value`` and ``--flag=value``) and ``NAME=value`` assignments whose name has
  a part that *is* a secret word (key, token, secret, password, passwd, credential). Whole
  parts, not substrings, because vLLM is full of names like ``--max-num-batched-tokens``,
  ``--tokenizer`` and ``--kv-cache-dtype`` that are not secrets; parts that merely *describe*
  a secret (``--ssl-keyfile``, ``--api-key-file``, ``--eos-token-id``) are paths or numbers and
  are kept, because the guardian needs them to explain a configuration;
* quoted dict/JSON keys with such names (vLLM logs ``non-default args: {'api_key': ...}``);
* the password in URL userinfo, a secret query parameter's value (``?token=``, ``&sig=``,
  ``X-Amz-Signature=``; the parameters around it stay), the path of a webhook whose path is its
  secret (Slack ``hooks.slack.com/services/…``, Discord, Microsoft Teams: the host stays);
* ``Authorization:``, ``Cookie:``/``Set-Cookie:`` and API-key header values, ``Bearer``
  tokens, and tokens recognisable by their prefix (Hugging Face ``hf_…``, OpenAI-style
  ``sk-…``, GitHub ``ghp_…``/``github_pat_…``, Slack ``xoxb-…``, GitLab ``glpat-…``).

A name part that *is* one of the short words ``pwd``, ``sig``, ``signature`` or
``passphrase`` is a secret too (``pwd=``, ``&sig=``): whole parts only, since ``sig`` inside a
word (``design``, ``sigterm``) is not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

REDACTED = "***"

_SECRET_WORDS = ("password", "passwd", "credential", "secret", "token", "key")
# Secret only as a whole name part (as substrings they are everywhere: "design", "signal").
_SECRET_PARTS = frozenset({"pwd", "sig", "signature", "passphrase"})

# Name parts that contain a secret word but name something else.
_BENIGN_PARTS = frozenset(
    {
        "tokens",  # --max-num-batched-tokens, --max-tokens: counts
        "tokenizer", "tokenizers", "tokenize", "tokenized", "tokenization",
        "detokenize", "detokenizer", "detokenization",
        "keyfile", "keystore", "keyring",  # --ssl-keyfile: a path
        "keyword", "keywords", "monkey", "hotkey",
    }
)  # fmt: skip

# A secret word followed by one of these names a property of the secret, not the secret:
# --api-key-file (a path), --eos-token-id (a number), --token-budget, --secret-name.
_QUALIFIERS_AFTER = frozenset(
    {
        "id", "ids", "file", "path", "dir", "len", "length", "size", "limit", "limits",
        "threshold", "budget", "count", "type", "dtype", "mode", "format", "name", "env",
        "header", "prefix", "rate",
    }
)  # fmt: skip

# ...and one preceded by these is a switch or a count: --allow-credentials (CORS, a boolean
# that could be followed by the positional model name), --max-token, --num-key.
_QUALIFIERS_BEFORE = frozenset(
    {"max", "min", "num", "allow", "use", "no", "skip", "enable", "disable", "is", "has"}
)

# vLLM's --api-key takes several keys (nargs="+"): every value up to the next flag is a key,
# exactly as argparse would read it.
_MULTI_VALUE_FLAGS = frozenset({"api-key"})


def is_secret_name(name: str) -> bool:
    """Whether a flag or variable name (``--hf-token``, ``VLLM_API_KEY``) carries a secret."""
    parts = [p for p in re.split(r"[-_.]+", name.strip("-").lower()) if p]
    for i, part in enumerate(parts):
        if part in _BENIGN_PARTS or not (
            part in _SECRET_PARTS or any(w in part for w in _SECRET_WORDS)
        ):
            continue
        if i + 1 < len(parts) and parts[i + 1] in _QUALIFIERS_AFTER:
            continue
        if i > 0 and parts[i - 1] in _QUALIFIERS_BEFORE:
            continue
        return True
    return False


# --- patterns --------------------------------------------------------------------------------

_QUOTED = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"
# A bare value ends at whitespace, a quote or punctuation that closes the surrounding syntax.
_BARE = r"[^\s'\",;)}\]]+"

# --flag=value or --flag value (a value after a space never starts with '-').
_FLAG = re.compile(
    rf"(?P<flag>--[A-Za-z][\w.-]*)"
    rf"(?:(?P<eq>=)(?P<v1>{_QUOTED}|{_BARE})|(?P<sp>[ \t]+)(?P<v2>{_QUOTED}|(?!-){_BARE}))"
)
# --api-key k1 k2 …: nargs="+", every value up to the next flag (as argparse reads it).
_MULTI_FLAG = re.compile(
    rf"(?P<flag>--api[-_]key)(?P<values>(?:[ \t]+(?:{_QUOTED}|(?!-){_BARE}))+)", re.IGNORECASE
)
_MULTI_VALUE = re.compile(rf"{_QUOTED}|{_BARE}")
# NAME=value (shell, env files, Python reprs like ``api_key=...``).
# A Python list (``api_key=['a', 'b']``) is one value. A name after ``?``/``&`` is a URL's query
# parameter: _QUERY's, whose value ends at the next ``&``.
_ASSIGN = re.compile(
    rf"(?<![\w.?&-])(?P<name>[A-Za-z_][A-Za-z0-9_.]*)=(?P<value>{_QUOTED}|\[[^\]]*\]|{_BARE})"
)
# The same assignment seen without consuming its value: a second pass finds a secret whose
# opening quote the first pass took as the closing quote of an earlier, unbalanced value
# (`X=" export VLLM_API_KEY="x"`: X's value is `" export VLLM_API_KEY="`, and x was left).
_ASSIGN_AT = re.compile(
    rf"(?<![\w.?&-])(?P<name>[A-Za-z_][A-Za-z0-9_.]*)=(?=(?P<value>{_QUOTED}|\[[^\]]*\]|{_BARE}))"
)
# ?token=…&a=b, &sig=…, ?X-Amz-Signature=…: a query parameter's value ends at '&' or '#'.
_QUERY = re.compile(r"(?P<pre>[?&](?P<name>[A-Za-z_][\w.-]*)=)(?P<value>[^&#\s'\"<>]*)")
# Webhooks whose path is the secret: https://hooks.slack.com/services/T…/B…/XXXX.
_SECRET_PATH = re.compile(
    r"(?P<pre>\bhttps?://(?:hooks\.slack\.com/(?:services|workflows|triggers)/"
    r"|(?:[\w-]+\.)?discord(?:app)?\.com/api/webhooks/"
    r"|[\w.-]*webhook\.office\.com/webhookb2/))(?P<path>[^\s'\"?#<>]+)",
    re.IGNORECASE,
)
# 'api_key': 'x' / "hf_token": "x" / 'api_key': ['a', 'b'] (dict reprs and JSON). A value
# that is itself a mapping is not consumed here: its own keys are looked at in turn, so a secret
# that is the first key of a nested object ({"extra_config": {"password": …}}) is found.
_DICT_ITEM = re.compile(
    rf"(?P<q>['\"])(?P<name>[A-Za-z_][\w.-]*)(?P=q)(?P<sep>\s*:\s*)"
    rf"(?P<value>{_QUOTED}|\[[^\]]*\]|[^\s,{{}}\[\]]+)"
)
# {token: x, key: y}: unquoted keys in a flow mapping (YAML, some loggers).
_FLOW_ITEM = re.compile(
    rf"(?P<pre>[{{,][ \t]*)(?P<name>[A-Za-z_][\w.-]*)(?P<sep>[ \t]*:[ \t]*)"
    rf"(?P<value>{_QUOTED}|\[[^\]]*\]|[^\s,{{}}\[\]]+)"
)
# A secret key whose value is a whole mapping: {"token": {"value": …}}; the mapping is cut out
# by counting braces (_secret_mappings), since a regular expression cannot.
_SECRET_MAPPING_KEY = re.compile(r"(?P<q>['\"]?)(?P<name>[A-Za-z_][\w.-]*)(?P=q)\s*:\s*\{")
# scheme://user:password@host; the password may itself contain '@' or ':' (greedy to the
# last '@' before the path).
_USERINFO = re.compile(r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*):(?P<pw>[^\s/?#]*)@")
# Authorization: <scheme> <credentials>, as a header or in a dict repr.
_AUTH_HEADER = re.compile(
    r"(?P<pre>\b(?:(?:proxy-)?authorization|x-api-key|api-key|x-auth-token)['\"]?\s*[:=]\s*['\"]?"
    r"(?:(?:bearer|basic|token|digest|apikey)\s+)?)(?P<cred>[^\s'\",;]+)",
    re.IGNORECASE,
)
# Cookie: a=1; b=2: the whole value (every cookie may be a session), to the line's end or quote.
_COOKIE_HEADER = re.compile(
    r"(?P<pre>\b(?:set-)?cookie['\"]?\s*:\s*['\"]?)(?P<cred>[^\r\n'\"]+)", re.IGNORECASE
)
_BEARER = re.compile(r"(?P<pre>\bbearer\s+)(?P<cred>[^\s'\",;]+)", re.IGNORECASE)
_KNOWN_TOKENS = re.compile(
    r"\bhf_[A-Za-z0-9]{20,}|\bsk-[A-Za-z0-9_-]{20,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{22,}"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}|\bglpat-[A-Za-z0-9_-]{20,}"
)


# Values that say "no secret configured"; keeping them tells a reader that none was set.
_NOT_SET = frozenset({"None", "null", "[]", "''", '""'})


def _quote_like(value: str) -> str:
    """The replacement for ``value``, keeping its quotes so a dict repr stays readable."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return f"{value[0]}{REDACTED}{value[0]}"
    if value.startswith("["):
        return f"[{REDACTED}]"
    return REDACTED


def _inside(value: str) -> str:
    """A value that is not a secret itself, with any secrets inside its quotes or brackets
    redacted.

    ``re.sub`` never rescans what a match consumed, so ``CMD="HF_TOKEN=x vllm serve"``,
    ``--cmd 'vllm --api-key x'`` or ``"a": [{"api_key": "x"}]`` would otherwise hide the inner
    secret from its own pattern.
    """
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return f"{value[0]}{redact_text(value[1:-1])}{value[0]}"
    if len(value) >= 2 and value[0] == "[" and value[-1] == "]":
        return f"[{redact_text(value[1:-1])}]"
    return value


def _secret_mappings(text: str) -> str:
    """``"token": {…}`` → ``"token": {***}`` for a secret key, its braces counted (quotes
    respected), however deep the mapping; an unclosed one is cut to the end of the text."""
    out: list[str] = []
    pos = 0
    for m in _SECRET_MAPPING_KEY.finditer(text):
        if m.start() < pos or not is_secret_name(m.group("name")):
            continue
        depth, i, quote = 1, m.end(), ""
        while i < len(text) and depth:
            c = text[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        out.append(text[pos : m.end()])
        out.append(REDACTED + ("}" if depth == 0 else ""))
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _sub_flag(m: re.Match[str]) -> str:
    secret = is_secret_name(m.group("flag"))
    fix = _quote_like if secret else _inside
    if m.group("eq"):
        return f"{m.group('flag')}={fix(m.group('v1'))}"
    return f"{m.group('flag')}{m.group('sp')}{fix(m.group('v2'))}"


def _sub_assign(m: re.Match[str]) -> str:
    value = m.group("value")
    if not is_secret_name(m.group("name")) or value in _NOT_SET:
        return f"{m.group('name')}={_inside(value)}"
    return f"{m.group('name')}={_quote_like(value)}"


def _secret_assignments(text: str) -> str:
    """Every ``SECRET_NAME=value`` in ``text``, wherever it starts, with its value redacted."""
    out: list[str] = []
    pos = 0
    for m in _ASSIGN_AT.finditer(text):
        value = m.group("value")
        if m.start() < pos or not is_secret_name(m.group("name")) or value in _NOT_SET:
            continue
        out += [text[pos : m.end()], _quote_like(value)]
        pos = m.end() + len(value)
    out.append(text[pos:])
    return "".join(out)


def _sub_query(m: re.Match[str]) -> str:
    value = m.group("value")
    if not value or value == REDACTED or not is_secret_name(m.group("name")):
        return m.group(0)
    return f"{m.group('pre')}{REDACTED}"


def _sub_dict_item(m: re.Match[str]) -> str:
    value = m.group("value")
    secret = is_secret_name(m.group("name")) and value not in _NOT_SET
    q = m.group("q")
    fixed = _quote_like(value) if secret else _inside(value)
    return f"{q}{m.group('name')}{q}{m.group('sep')}{fixed}"


def _sub_flow_item(m: re.Match[str]) -> str:
    value = m.group("value")
    secret = is_secret_name(m.group("name")) and value not in _NOT_SET
    fixed = _quote_like(value) if secret else _inside(value)
    return f"{m.group('pre')}{m.group('name')}{m.group('sep')}{fixed}"


def redact_text(text: str) -> str:
    """Replace every secret in ``text`` by ``***``; everything else is left as it was."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m.group('pre')}:{REDACTED}@", text)
    text = _SECRET_PATH.sub(lambda m: f"{m.group('pre')}{REDACTED}", text)
    text = _QUERY.sub(_sub_query, text)
    text = _COOKIE_HEADER.sub(lambda m: f"{m.group('pre')}{REDACTED}", text)
    text = _AUTH_HEADER.sub(lambda m: f"{m.group('pre')}{REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m.group('pre')}{REDACTED}", text)
    if "{" in text:
        text = _secret_mappings(text)
    text = _DICT_ITEM.sub(_sub_dict_item, text)
    text = _FLOW_ITEM.sub(_sub_flow_item, text)
    text = _MULTI_FLAG.sub(
        lambda m: (
            m.group("flag") + _MULTI_VALUE.sub(lambda v: _quote_like(v.group(0)), m.group("values"))
        ),
        text,
    )
    text = _FLAG.sub(_sub_flag, text)
    text = _ASSIGN.sub(_sub_assign, text)
    text = _secret_assignments(text)
    return _KNOWN_TOKENS.sub(REDACTED, text)


def redact_json(value: Any) -> Any:
    """Every string in a JSON value through :func:`redact_text` (a record's reasons, log lines,
    errors); keys are names the guardian chose and stay."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    if isinstance(value, dict):
        return {k: redact_json(v) for k, v in value.items()}
    return value


def redact_url_in(text: str, url: str) -> str:
    """``text`` (an HTTP library's error about ``url``) without the secrets of ``url``: the
    library quotes the whole URL, or only its path and query (``Max retries exceeded with url:
    /services/T/B/XXXX``), where a host-specific shape (a Slack webhook) is no longer
    recognisable; both are replaced by their redacted forms, then the rest is redacted."""
    shown = redact_text(url)
    if shown != url:
        text = text.replace(url, shown)
        raw, safe = urlsplit(url), urlsplit(shown)
        raw_tail = raw.path + (f"?{raw.query}" if raw.query else "")
        safe_tail = safe.path + (f"?{safe.query}" if safe.query else "")
        if raw_tail not in ("", "/") and raw_tail != safe_tail:
            text = text.replace(raw_tail, safe_tail)
    return redact_text(text)


def _looks_like_flag(item: str) -> bool:
    """An argv item argparse would read as an option rather than as a value."""
    return item.startswith("-") and len(item) > 1 and not re.fullmatch(r"-\d[\d.e+-]*", item)


def redact_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """Redact an argument vector: ``--api-key VALUE`` spans two items, so text rules alone
    would miss it. Each item is then passed through :func:`redact_text` as well (for
    ``--flag=value``, ``HF_TOKEN=…`` after ``env``, URLs with passwords, JSON configs)."""
    out: list[str] = []
    secret_values_left = 0  # how many following items are values of a secret flag
    for item in argv:
        if secret_values_left and not _looks_like_flag(item):
            out.append(REDACTED)
            if secret_values_left > 0:
                secret_values_left -= 1
            continue
        secret_values_left = 0
        if item.startswith("--") and "=" not in item and is_secret_name(item):
            name = item[2:].lower().replace("_", "-")
            secret_values_left = -1 if name in _MULTI_VALUE_FLAGS else 1
        out.append(redact_text(item))
    return tuple(out)
