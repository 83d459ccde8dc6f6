"""``/ready/<service>``'s answer: what the exposition writes, the gate's follower reads back."""

from __future__ import annotations

import pytest

from vllm_guardian.formats.ready_format import ReadyAnswer, encode, encode_unknown, reason_of


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (ReadyAnswer("vllm", True, "open"), 200),
        (ReadyAnswer("vllm", False, "KV cache usage 95% at or above 90%"), 503),
        (ReadyAnswer("a/b", False, 'quoted "reason" ünïcode'), 503),
    ],
    ids=["open", "held", "odd text"],
)
def test_the_reason_written_is_the_reason_read(answer: ReadyAnswer, status: int) -> None:
    assert answer.status == status
    assert reason_of(encode(answer), "closed") == answer.reason


@pytest.mark.parametrize(
    "body",
    [b"", b"<html>502 Bad Gateway</html>", b"[1]", b'{"ready": false}', encode_unknown("x")],
    ids=["empty", "a proxy's page", "not an object", "no reason", "unknown service"],
)
def test_a_body_that_is_not_an_answer_reads_as_the_default(body: bytes) -> None:
    assert reason_of(body, "closed") == "closed"
