"""The fallback replica (ProxySettings.fallback_url): a continuation, or a held completion,
that waited ``fallback_after_seconds`` for this server is sent to another replica of the same
model instead; refused or answered 5xx there, it waits on for this server as before.

Two deterministic vLLM-shaped servers on loopback (tests/fake_completions.py), the same
"model" in each, as two replicas of a temperature-0 model are: a stream cut on the first and
continued on the second reads to the client exactly as the uncut stream (same ``id`` and
``created``). Each wait is on a condition (what the client has read, a counter), never on the
clock; the gate's own times are tenths of a second.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fake_completions import MAX_MODEL_LEN, CutSpec, FakeCompletions, tokenize
from tests.sim import twinproc
from tests.support import wait_for
from tests.test_gate_continuation import (
    CHAT,
    KEEPALIVE,
    PROMPT,
    GateOn,
    Read,
    body,
    chat_body,
    direct,
)
from tests.test_gate_support import refused_url
from vllm_guardian.config import ConfigInvalid, check_fallback_url, parse_config
from vllm_guardian.gate import cli as gate_cli
from vllm_guardian.tools.demo import free_port

FALLBACK_AFTER_SECONDS = 0.1


@pytest.fixture
def local() -> Iterator[FakeCompletions]:
    f = FakeCompletions()
    yield f
    f.stop()


@pytest.fixture
def replica() -> Iterator[FakeCompletions]:
    f = FakeCompletions()
    yield f
    f.stop()


@pytest.fixture
def gates() -> Iterator[Callable[..., GateOn]]:
    made: list[GateOn] = []

    def make(upstream: str, **proxy: Any) -> GateOn:
        proxy.setdefault("fallback_after_seconds", FALLBACK_AFTER_SECONDS)
        g = GateOn(upstream, **proxy)
        made.append(g)
        wait_for(lambda: g.gate.admission is not None and g.gate.admission.open, "gate open")
        return g

    yield make
    for g in made:
        g.stop()


def fallbacks(g: GateOn, result: str) -> float:
    text = requests.get(f"{g.url}/metrics", timeout=5).text
    m = re.search(
        rf'vllm_guardian_gate_fallbacks_total\{{result="{result}",service="vllm"\}} (\S+)', text
    )
    assert m is not None, text
    return float(m.group(1))


# --- a cut stream ------------------------------------------------------------------------------


def test_a_cut_stream_is_continued_on_the_fallback_as_one_uncut_stream(
    gates: Callable[..., GateOn], local: FakeCompletions, replica: FakeCompletions
) -> None:
    g = gates(local.url, fallback_url=replica.url)
    doc = body(stream_options={"include_usage": True})
    expected = direct(local, doc)
    local.bodies.clear()
    local.cut_next(CutSpec(7, "reset", down=True))  # and it never comes back
    got = Read(g.url, doc)
    assert (got.status, got.cut) == (200, False)
    assert got.without_keepalives() == expected  # same id, created, text, usage
    (cont,) = replica.bodies
    delivered = FakeCompletions.generate(tokenize(PROMPT), 7)
    assert cont["prompt"] == tokenize(PROMPT) + delivered
    assert cont["request_id"] == "r1-cont1"
    assert replica.headers[0]["X-Vllm-Guardian-Fallback"] == "1"
    assert g.metric("fallback", "connection") == 1
    assert g.metric("continued", "connection") == 0


@pytest.mark.parametrize("fallback", ["refused", "500"])
def test_a_fallback_that_does_not_take_the_continuation_leaves_it_to_this_server(
    gates: Callable[..., GateOn],
    local: FakeCompletions,
    replica: FakeCompletions,
    fallback: str,
) -> None:
    replica.healthy = False  # vLLM's dead-engine 500 to every request
    url = refused_url() if fallback == "refused" else replica.url
    g = gates(local.url, fallback_url=url)
    doc = body()
    expected = direct(local, doc)
    local.cut_next(CutSpec(5, "reset", down=True))

    def heal_after_the_fallback(data: bytes) -> None:
        # The third keep-alive is written after the fallback was offered (relay.py's loop).
        if data.count(KEEPALIVE) >= 3 and not local.healthy:
            local.heal()

    got = Read(g.url, doc, heal_after_the_fallback)
    assert (got.status, got.cut) == (200, False)
    assert got.without_keepalives() == expected
    assert g.metric("continued", "connection") == 1
    assert g.metric("fallback", "connection") == 0
    assert len(replica.bodies) == (1 if fallback == "500" else 0)


def test_a_chat_stream_without_a_max_reads_the_context_length_from_the_fallback(
    gates: Callable[..., GateOn], local: FakeCompletions, replica: FakeCompletions
) -> None:
    """A chat continuation with no max asks for the server's max_model_len; with this
    server going down, the fallback (the same model) says it."""
    g = gates(local.url, fallback_url=replica.url)
    doc = chat_body(max_tokens=None)
    expected = direct(local, doc, CHAT)
    local.models_answer = False
    local.cut_next(CutSpec(6, "reset", down=True))
    got = Read(g.url, doc, path=CHAT)
    assert (got.status, got.cut) == (200, False)
    assert got.without_keepalives() == expected
    (cont,) = replica.bodies
    assert cont["max_tokens"] == MAX_MODEL_LEN
    assert g.metric("fallback", "connection") == 1


def test_a_stream_continuation_refuses_is_not_sent_to_the_fallback(
    gates: Callable[..., GateOn], local: FakeCompletions, replica: FakeCompletions
) -> None:
    g = gates(local.url, fallback_url=replica.url)
    local.cut_next(CutSpec(5, "reset", down=True))
    got = Read(g.url, body(n=2))
    assert got.cut and replica.bodies == []
    assert g.metric("refused", "n") == 1


# --- a held request ------------------------------------------------------------------------------


def test_a_held_completion_is_sent_whole_to_the_fallback(
    gates: Callable[..., GateOn], local: FakeCompletions, replica: FakeCompletions
) -> None:
    g = gates(local.url, fallback_url=replica.url)
    doc = body(stream=False)
    expected = direct(replica, doc)
    replica.bodies.clear()
    local.healthy = False
    admission = g.gate.admission
    assert admission is not None
    wait_for(lambda: not admission.open, "the gate to close")
    r = requests.post(f"{g.url}/v1/completions", json=doc, timeout=30)
    assert (r.status_code, r.content) == (200, expected)
    assert [b["prompt"] for b in replica.bodies] == [PROMPT]
    assert replica.headers[-1]["X-Vllm-Guardian-Fallback"] == "1"  # no gate sends it on again
    assert fallbacks(g, "sent") == 1 and admission.queue_depth == 0


@pytest.mark.parametrize(
    ("fallback", "doc", "headers"),
    [
        ("500", body(stream=False), {}),
        ("refused", body(stream=False), {}),
        ("up", body(stream=False, n=2), {}),
        ("up", body(stream=False, response_format={"type": "json_object"}), {}),
        ("up", body(stream=False), {"X-Vllm-Guardian-Fallback": "1"}),
    ],
    ids=[
        "fallback answers 500",
        "fallback refuses",
        "n=2 never goes",
        "constrained output never goes",
        "what a gate's fallback sent never goes again (no loop through a Service)",
    ],
)
def test_otherwise_a_held_request_waits_for_this_server(
    gates: Callable[..., GateOn],
    local: FakeCompletions,
    replica: FakeCompletions,
    fallback: str,
    doc: dict[str, Any],
    headers: dict[str, str],
) -> None:
    replica.healthy = fallback != "500"
    g = gates(local.url, fallback_url=refused_url() if fallback == "refused" else replica.url)
    local.healthy = False
    admission = g.gate.admission
    assert admission is not None
    wait_for(lambda: not admission.open, "the gate to close")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            requests.post, f"{g.url}/v1/completions", json=doc, headers=headers, timeout=60
        )
        if fallback == "up":
            wait_for(lambda: admission.oldest_wait_seconds > 3 * FALLBACK_AFTER_SECONDS,
                     "the request held past fallback_after", seen=answer.done)  # fmt: skip
        else:
            wait_for(lambda: fallbacks(g, "refused") == 1, "the fallback's refusal",
                     seen=answer.done)  # fmt: skip
        assert admission.queue_depth == 1  # still in line here
        local.heal()
        r = answer.result(timeout=60)
    assert r.status_code == 200
    assert len(local.bodies) == 1
    assert len(replica.bodies) == (1 if fallback == "500" else 0)


# --- the operator's setting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://vllm.models.svc:8000", True),
        ("https://replica.example/v1base", True),
        ("ftp://replica:21", False),
        ("http://user:s3cret-pass@replica:8000", False),
        ("http://replica:8000/?token=abc", False),
        ("replica:8000", False),
        ("http://replica:99999", False),
    ],
)
def test_the_fallback_url_is_checked_and_never_shown_with_a_secret(url: str, ok: bool) -> None:
    assert (check_fallback_url(url) is None) is ok
    args = gate_cli.build_parser().parse_args(["--upstream", "http://127.0.0.1:8000",
                                               "--fallback-url", url])  # fmt: skip
    if ok:
        settings = gate_cli.settings_from_args(args)
        assert settings.proxy.fallback_url == url.rstrip("/")
    else:
        with pytest.raises(gate_cli.UsageError) as e:
            gate_cli.settings_from_args(args)
        assert "s3cret" not in str(e.value) and "abc" not in str(e.value)


def test_off_by_default() -> None:
    args = gate_cli.build_parser().parse_args(["--upstream", "http://127.0.0.1:8000"])
    assert isinstance(args, argparse.Namespace)
    assert gate_cli.settings_from_args(args).proxy.fallback_url is None


# --- two twins: the local one killed mid-stream -------------------------------------------------


TWIN_ARGS = ("--sim-model", "tiny", "--served-model-name", "tiny", "--max-model-len", "4096",
             "--sim-speed", "10")  # fmt: skip


def chunks_of(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["text"] for doc in chunks for c in doc["choices"])


@pytest.mark.slow
def test_two_twins_the_local_one_killed_the_stream_completes_from_the_other(
    gates: Callable[..., GateOn], tmp_path: Path
) -> None:
    local = twinproc.start(tmp_path, free_port(), *TWIN_ARGS)
    other = twinproc.start(tmp_path, free_port(), *TWIN_ARGS)
    try:
        local.wait_ready()
        other.wait_ready()
        doc = {"model": "tiny", "prompt": "a b c", "max_tokens": 120, "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
        expected = chunks_of(requests.post(f"{other.url}/v1/completions", json=doc,
                                           timeout=60).content)  # fmt: skip
        g = gates(local.url, fallback_url=other.url, fallback_after_seconds=0.5)

        def kill_the_local_one(data: bytes) -> None:
            if local.proc.poll() is None and data.count(b"data: {") >= 10:
                local.proc.kill()  # SIGKILL: the engine and its stream die at once

        got = Read(g.url, doc, kill_the_local_one)
        print(got.data.decode(errors="replace")[-400:])
        assert local.proc.poll() is not None, "the stream ended before the kill"
        assert (got.status, got.cut) == (200, False)
        chunks = chunks_of(got.without_keepalives())
        assert text_of(chunks) == text_of(expected)
        assert {(c["id"], c["created"]) for c in chunks} == {
            (chunks[0]["id"], chunks[0]["created"])
        }
        assert (
            chunks[-1]["usage"]["completion_tokens"] == expected[-1]["usage"]["completion_tokens"]
        )
        assert got.data.endswith(b"data: [DONE]\n\n")
        assert g.metric("fallback", "connection") == 1
    finally:
        twinproc.stop(local)
        twinproc.stop(other)


def test_the_config_keys_reach_the_proxy_and_a_rejected_url_is_not_echoed(tmp_path: Path) -> None:
    head = "services:\n  - name: vllm\n    url: http://127.0.0.1:8000\n    gate:\n"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(head + "      fallback_url: http://vllm.models.svc:8001/\n"
                   "      fallback_after_seconds: 4\n"
                   "      restart_extra_wait_seconds: 45\n")  # fmt: skip
    s = gate_cli.settings_from_args(gate_cli.build_parser().parse_args(["-c", str(cfg)]))
    assert (s.proxy.fallback_url, s.proxy.fallback_after_seconds) == (
        "http://vllm.models.svc:8001",
        4,
    )
    assert s.limits.restart_extra_wait_seconds == 45
    flags = ["-c", str(cfg), "--fallback-after", "2", "--restart-extra-wait", "0"]
    s = gate_cli.settings_from_args(gate_cli.build_parser().parse_args(flags))
    assert (s.proxy.fallback_after_seconds, s.limits.restart_extra_wait_seconds) == (2, 0)
    with pytest.raises(ConfigInvalid) as e:
        parse_config(head + "      fallback_url: http://admin:s3cret-pass@replica:8000\n", "c.yaml")
    assert "fallback_url" in str(e.value) and "s3cret-pass" not in str(e.value), str(e.value)
