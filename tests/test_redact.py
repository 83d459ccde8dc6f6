"""Secret redaction: table-driven cases, false positives on real vLLM logs, a property test."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_guardian.redact import REDACTED, is_secret_name, redact_argv, redact_text

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # flags, both forms
        ("vllm serve m --api-key sekret --port 8000", "vllm serve m --api-key *** --port 8000"),
        ("vllm serve m --api-key=sekret", "vllm serve m --api-key=***"),
        ("--hf-token hf_notreallyatoken", "--hf-token ***"),
        ("--hf_token=abc", "--hf_token=***"),
        ("--db-password 'two words'", "--db-password '***'"),
        ('--client-secret="x y"', '--client-secret="***"'),
        ("--aws-credential abc", "--aws-credential ***"),
        ("--passwd=abc", "--passwd=***"),
        ("--apikey abc", "--apikey ***"),
        # --hf-token without a value (vLLM then uses the cached login): nothing to hide
        ("--hf-token --model m", "--hf-token --model m"),
        # not secrets: counts, paths, switches, tokenizer names
        ("--max-num-batched-tokens 8192", "--max-num-batched-tokens 8192"),
        (
            "--tokenizer meta/llama --tokenizer-mode auto",
            "--tokenizer meta/llama --tokenizer-mode auto",
        ),
        ("--kv-cache-dtype fp8", "--kv-cache-dtype fp8"),
        ("--ssl-keyfile /etc/tls/key.pem", "--ssl-keyfile /etc/tls/key.pem"),
        ("--api-key-file /run/secrets/k", "--api-key-file /run/secrets/k"),
        ("--allow-credentials model", "--allow-credentials model"),
        ("--return-tokens-as-token-ids", "--return-tokens-as-token-ids"),
        ("--eos-token-id 2", "--eos-token-id 2"),
        ("--max-tokens 16", "--max-tokens 16"),
        ("--skip-tokenizer-init", "--skip-tokenizer-init"),
        # env-style assignments
        ("HF_TOKEN=hf_abc vllm serve m", "HF_TOKEN=*** vllm serve m"),
        ("VLLM_API_KEY=abc", "VLLM_API_KEY=***"),
        ('export OPENAI_API_KEY="sk abc"', 'export OPENAI_API_KEY="***"'),
        (
            "HUGGING_FACE_HUB_TOKEN=x; AWS_SECRET_ACCESS_KEY=y",
            "HUGGING_FACE_HUB_TOKEN=***; AWS_SECRET_ACCESS_KEY=***",
        ),
        ("TOKENIZERS_PARALLELISM=false", "TOKENIZERS_PARALLELISM=false"),
        (
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ),
        (
            "max_num_batched_tokens=8192, tokenizer='/m'",
            "max_num_batched_tokens=8192, tokenizer='/m'",
        ),
        ("hf_token=None", "hf_token=None"),
        # URL userinfo: the user stays, the password goes (even one with '@' in it)
        ("https://user:pass@host:8000/v1", "https://user:***@host:8000/v1"),
        ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("https://u:p@ss@host/x", "https://u:***@host/x"),
        ("https://host:8000/v1 and http://user@host", "https://host:8000/v1 and http://user@host"),
        # Authorization headers and bearer tokens
        ("Authorization: Bearer abc.def-ghi", "Authorization: Bearer ***"),
        ("authorization: Basic dXNlcjpwYXNz", "authorization: Basic ***"),
        ("{'Authorization': 'Bearer abc'}", "{'Authorization': 'Bearer ***'}"),
        ('-H "Authorization: Bearer $KEY"', '-H "Authorization: Bearer ***"'),
        ("got bearer abc123 from client", "got bearer *** from client"),
        # tokens recognised by their shape
        ("token hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789 in text", "token *** in text"),
        ("key sk-proj-abcdefghijklmnopqrstuvwx end", "key *** end"),
        # dict reprs and JSON: vLLM logs "non-default args: {...}" at startup
        (
            "non-default args: {'model': 'm', 'api_key': ['k1', 'k2'], 'hf_token': 'x', 'port': 8000}",
            "non-default args: {'model': 'm', 'api_key': [***], 'hf_token': '***', 'port': 8000}",
        ),
        ('{"password": "p", "user": "u"}', '{"password": "***", "user": "u"}'),
        ("{'api_key': None}", "{'api_key': None}"),
        # nothing to do
        ("", ""),
        (
            "Engine 000: Avg prompt throughput: 1.4 tokens/s",
            "Engine 000: Avg prompt throughput: 1.4 tokens/s",
        ),
    ],
)
def test_redact_text(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["vllm", "serve", "m", "--api-key", "sekret", "--port", "8000"],
            ("vllm", "serve", "m", "--api-key", "***", "--port", "8000"),
        ),
        (["vllm", "serve", "m", "--api-key=sekret"], ("vllm", "serve", "m", "--api-key=***")),
        # --api-key takes several keys (nargs="+"): all of them are secrets
        (
            ["vllm", "serve", "m", "--api-key", "k1", "k2", "--port", "1"],
            ("vllm", "serve", "m", "--api-key", "***", "***", "--port", "1"),
        ),
        (["x", "--hf-token", "t1", "positional"], ("x", "--hf-token", "***", "positional")),
        (["x", "--hf-token", "--port", "1"], ("x", "--hf-token", "--port", "1")),
        (["x", "--api-key"], ("x", "--api-key")),
        (["env", "HF_TOKEN=abc", "vllm"], ("env", "HF_TOKEN=***", "vllm")),
        (
            ["x", "--ssl-keyfile", "/k.pem", "--tokenizer", "t"],
            ("x", "--ssl-keyfile", "/k.pem", "--tokenizer", "t"),
        ),
        (["x", "--max-num-batched-tokens", "8192"], ("x", "--max-num-batched-tokens", "8192")),
        (
            ["x", "--kv-transfer-config", '{"url": "http://u:pw@h"}'],
            ("x", "--kv-transfer-config", '{"url": "http://u:***@h"}'),
        ),
        (["x", "--password", "-5"], ("x", "--password", "***")),  # a negative number is a value
        ([], ()),
    ],
)
def test_redact_argv(argv: list[str], expected: tuple[str, ...]) -> None:
    assert redact_argv(argv) == expected


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("--api-key", True), ("--hf-token", True), ("HF_TOKEN", True), ("VLLM_API_KEY", True),
        ("--secret", True), ("DB_PASSWORD", True), ("--credentials", True), ("--access-token", True),
        ("--kv-cache-dtype", False), ("--max-num-batched-tokens", False), ("--tokenizer", False),
        ("--ssl-keyfile", False), ("--allow-credentials", False), ("--keep-alive", False),
        ("--disable-log-requests", False), ("--model", False), ("--eos-token-id", False),
    ],
)  # fmt: skip
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


@pytest.mark.parametrize("name", ["server-startup-run1-cold.log", "shutdown-log-lines.txt"])
def test_real_vllm_logs_have_no_false_positives(name: str) -> None:
    """Real vLLM lines (engine config dumps with tokenizer=..., KV sizes, routes) survive."""
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        assert redact_text(line) == line


_SECRET = st.text(
    alphabet=st.sampled_from(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.~+/=!%^&@:"
    ),
    min_size=8,
    max_size=40,
).filter(lambda s: not s.startswith("-"))
_TEMPLATES = (
    "vllm serve m --api-key {s} --port 8000",
    "vllm serve m --api-key={s}",
    "--hf-token {s}",
    "--client-secret='{s}'",
    "HF_TOKEN={s} vllm serve m",
    'export VLLM_API_KEY="{s}"',
    "OPENAI_API_KEY={s}",
    "Authorization: Bearer {s}",
    "{{'api_key': '{s}', 'port': 8000}}",
    '{{"hf_token": "{s}"}}',
)
_FILLER = st.text(alphabet=st.sampled_from("abc XYZ 012 -=:/,'\""), max_size=30)


@settings(max_examples=300, deadline=None)
@given(secret=_SECRET, template=st.sampled_from(_TEMPLATES), before=_FILLER, after=_FILLER)
def test_secret_never_survives_redact_text(
    secret: str, template: str, before: str, after: str
) -> None:
    body = template.format(s=secret)
    assume(all(secret not in part for part in (before, after, template)))
    if template.startswith(("HF_TOKEN", "OPENAI", "export")):
        before = before.rstrip("_") + " " if before else ""  # keep the variable name whole
    if "'" in template or '"' in template:
        assume("'" not in secret and '"' not in secret)
    text = f"{before}{body} {after}"
    out = redact_text(text)
    assert secret not in out
    assert REDACTED in out


@settings(max_examples=200, deadline=None)
@given(
    secret=_SECRET.filter(
        lambda s: ":" not in s and "/" not in s and "?" not in s and "#" not in s
    ),
    user=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
)
def test_url_password_never_survives(secret: str, user: str) -> None:
    out = redact_text(f"connect https://{user}:{secret}@db.example:5432/x now")
    assert secret not in out
    assert out == f"connect https://{user}:***@db.example:5432/x now"


@settings(max_examples=200, deadline=None)
@given(
    secret=_SECRET,
    flag=st.sampled_from(["--api-key", "--hf-token", "--password", "--client-secret"]),
    prefix=st.lists(
        st.sampled_from(["vllm", "serve", "m", "--port", "8000", "--enforce-eager"]), max_size=4
    ),
)
def test_secret_never_survives_redact_argv(secret: str, flag: str, prefix: list[str]) -> None:
    assume(all(secret not in p for p in [*prefix, flag, "--max-num-seqs"]))
    out = redact_argv([*prefix, flag, secret, "--max-num-seqs", "8"])
    assert all(secret not in item for item in out)
    out_eq = redact_argv([*prefix, f"{flag}={secret}"])
    assert all(secret not in item for item in out_eq)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_redact_text_is_idempotent(text: str) -> None:
    once = redact_text(text)
    assert redact_text(once) == once


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('Environment="HF_TOKEN=abc"', 'Environment="HF_TOKEN=***"'),
        ("CMD='HF_TOKEN=abc vllm serve m'", "CMD='HF_TOKEN=*** vllm serve m'"),
        ('--cmd "vllm serve m --api-key abc"', '--cmd "vllm serve m --api-key ***"'),
        ("{'cmd': 'vllm --api-key=abc'}", "{'cmd': 'vllm --api-key=***'}"),
    ],
)
def test_secrets_nested_in_quoted_values(text: str, expected: str) -> None:
    assert redact_text(text) == expected
