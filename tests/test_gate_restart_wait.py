"""A request held across the guardian's restart: its wait is extended while the guardian's
``/ready`` says a restart or relaunch is in progress, by at most
``restart_extra_wait_seconds`` and never past the client's own timeout.

Before, a request the gate's stall hold held 20 s before the guardian restarted a hung engine
ran out of ``max_wait_seconds`` about a second before the new engine was ready, and got 503.
These drive the admission itself on short real waits; each condition is an ordering of timers
on one event loop (a timeout fires before a later sleep ends), not a race with the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import requests
from multidict import CIMultiDict

from tests.support import wait_for
from tests.test_gate_support import GateThread, Stub
from vllm_guardian.core import policy
from vllm_guardian.core.phases import ActionProgress, Phase
from vllm_guardian.core.policy import ServiceState
from vllm_guardian.formats.ready_format import (
    ReadyAnswer,
    encode,
    reason_of,
    restart_in_progress_of,
)
from vllm_guardian.gate.admission import Admission, Cost, Limits, Rejected, RejectReason
from vllm_guardian.gate.metrics import GateMetrics
from vllm_guardian.gate.proxy import client_timeout_seconds
from vllm_guardian.model import ActionKind, GateState
from vllm_guardian.shell.healing import with_restarts

MAX_WAIT_SECONDS = 0.3
COST = Cost(10, 10)


def _admission(restart_extra_wait_seconds: float) -> Admission:
    limits = Limits(
        max_wait_seconds=MAX_WAIT_SECONDS,
        restart_extra_wait_seconds=restart_extra_wait_seconds,
        release_rate_per_second=0.0,
    )
    return Admission(limits, GateMetrics("vllm"))


async def _held(
    restart: bool, extra: float, client_timeout: float | None, then: str
) -> tuple[str, float]:
    """One request held by a closed gate while a restart is (or is not) in progress; past its
    max_wait, ``then`` happens: "open" (the new engine is ready) or "restart_ends" (the
    restart is over and the gate stays closed) or "nothing". Returns what it got and how long
    it waited (loop time)."""
    a = _admission(extra)
    a.start()
    a.set_state(False, "guardian: restart in progress")
    a.set_restart_in_progress(restart)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.create_task(a.acquire("k", COST, client_timeout_seconds=client_timeout))
    await asyncio.sleep(MAX_WAIT_SECONDS + 0.2)  # its max_wait has run out by now
    if then == "open" and not task.done():
        a.set_state(True, "open")
    elif then == "restart_ends":
        a.set_restart_in_progress(False)
    try:
        async with asyncio.timeout(30.0):
            await task
        got = "admitted"
    except Rejected as r:
        got = "rejected" if r.reason is RejectReason.WAIT_TIMEOUT else r.reason.value
    finally:
        await a.stop()
    return got, loop.time() - t0


@pytest.mark.parametrize(
    ("restart", "extra", "client_timeout", "then", "expect"),
    [
        (True, 60.0, None, "open", "admitted"),
        (False, 60.0, None, "open", "rejected"),
        (True, 0.0, None, "open", "rejected"),
        (True, 60.0, 0.4, "nothing", "rejected"),
        (True, 60.0, 0.2, "open", "rejected"),
        (True, 60.0, 120.0, "open", "admitted"),
        (True, 60.0, None, "restart_ends", "rejected"),
    ],
    ids=[
        "restart in progress: waits on past max_wait for the new engine",
        "no restart: max_wait as before",
        "extension off",
        "never past the client's timeout",
        "a client timeout under max_wait: no extension, max_wait as before",
        "a longer client timeout: extended",
        "the restart ends and the gate stays closed: the extension ends",
    ],
)
def test_a_held_request_waits_through_the_restart(
    restart: bool, extra: float, client_timeout: float | None, then: str, expect: str
) -> None:
    got, waited = asyncio.run(_held(restart, extra, client_timeout, then))
    assert got == expect, f"waited {waited:.2f} s"
    if got == "rejected":
        assert waited < extra / 2 or extra == 0.0, f"waited {waited:.2f} s: the extension's bound"


@pytest.mark.parametrize(
    ("headers", "expect"),
    [
        ({}, None),
        ({"X-Stainless-Timeout": "600"}, 600.0),
        ({"X-Stainless-Timeout": "600", "X-Stainless-Read-Timeout": "45.5"}, 45.5),
        ({"X-Stainless-Timeout": "soon"}, None),
        ({"X-Stainless-Timeout": "-1"}, None),
        ({"X-Stainless-Timeout": "inf"}, None),
        ({"X-Stainless-Timeout": "nan"}, None),
    ],
    ids=["unsaid", "total", "the shorter", "not a number", "negative", "infinite", "nan"],
)
def test_the_client_timeout_read_from_its_headers(
    headers: dict[str, str], expect: float | None
) -> None:
    assert client_timeout_seconds(CIMultiDict(headers)) == expect


def _service(name: str, action: ActionProgress | None) -> ServiceState:
    return replace(policy.initial_state((name,), None, restarted=False).services[0], action=action)


def _action(phase: Phase) -> ActionProgress:
    return ActionProgress(1, ActionKind.RESTART, None, "hung", phase, 0.0, 100.0, 0.0)


@pytest.mark.parametrize(
    ("action", "expect"),
    [
        (None, False),
        (_action(Phase.AWAITING_PERMIT), False),
        (_action(Phase.DRAINING), True),
        (_action(Phase.AWAITING_READY), True),
    ],
    ids=["no action", "waiting for its permit: door open", "draining", "awaiting ready"],
)
def test_ready_says_when_a_restart_is_in_progress(
    action: ActionProgress | None, expect: bool
) -> None:
    state = replace(
        policy.initial_state(("vllm",), None, restarted=False),
        services=(_service("vllm", action),),
    )
    gates = with_restarts((("vllm", GateState(False, "vLLM is not up (down)")),), state)
    answer = ReadyAnswer("vllm", False, gates["vllm"].reason, gates["vllm"].restart_in_progress)
    assert restart_in_progress_of(encode(answer)) is expect
    assert reason_of(encode(answer), "closed") == "vLLM is not up (down)"


def test_a_request_held_through_a_restart_is_served_by_the_new_engine(stub: Stub) -> None:
    """A real gate following the stub as its guardian: vLLM down and a restart in progress
    past the request's max_wait; the new engine comes up and serves it (before: 503)."""
    gate = GateThread(stub.url, guardian=stub.url, max_wait_seconds=0.5,
                      restart_extra_wait_seconds=60.0, release_rate_per_second=0)  # fmt: skip
    try:
        wait_for(lambda: gate.gate.admission is not None and gate.gate.admission.open, "open")
        stub.healthy, stub.ready, stub.restarting = False, False, True
        admission = gate.gate.admission
        assert admission is not None
        wait_for(lambda: admission.restart_in_progress, "the follower to read the restart")
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(requests.post, f"{gate.url}/v1/echo", data=b"{}", timeout=60)
            wait_for(
                lambda: admission.queue_depth == 1 and admission.oldest_wait_seconds > 1.0,
                "the request held past its max_wait",
                seen=lambda: (admission.queue_depth, answer.done()),
            )
            stub.healthy, stub.ready, stub.restarting = True, True, False
            assert answer.result(timeout=60).status_code == 200
    finally:
        gate.stop()
        stub.reset()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()
