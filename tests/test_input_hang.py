"""A hang that looks idle: requests sent to vLLM never reach its engine.

When vLLM's engine-core input thread dies or blocks (vllm#26139, #47958), the API server keeps
accepting requests and ``/health`` answers 200, but nothing reaches the scheduler: running and
waiting stay 0, and by its metrics the server is idle (the stall signal, which needs requests
in the engine, never fires). Whoever sent the requests sees it: the gate's oldest forwarded
request with no answer (``oldest_unanswered_seconds`` in ``GET /gate/status``).

The signal is ``unreached_seconds``: the shorter of that age and how long the engine has
reported nothing in it (``core/progress.unreached_seconds``); ``input_hung`` past
``signals.stall_seconds``. What must never count: a request the engine holds (a long prefill
moves no token counter, but it is running), an engine asleep or paused by an operator, a
missing gate.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from tests.conftest import VLLM_FIXTURES
from tests.test_signals import derive, engine, snap
from vllm_guardian.core.signals import OperatorHold
from vllm_guardian.model import GateObservation, HealthProbe, HealthState, ServiceSnapshot, Snapshot

# tests.test_signals' config: signals.stall_seconds is 6 s, the bound for input_hung too.


def with_gate(s: Snapshot, gate: GateObservation | None, paused: bool | None = None) -> Snapshot:
    svc = s.services[0]
    health = svc.health
    if paused is not None:
        health = HealthProbe(HealthState.UP, 200, 0.01, paused=paused)
    return replace(s, services=(replace(svc, gate=gate, health=health),))


def gate(age: float | None, unanswered: int = 1, reachable: bool = True) -> GateObservation:
    if not reachable:
        return GateObservation(False, error="connection refused: the gate is not running")
    return GateObservation(
        True,
        in_flight=unanswered,
        queued=0,
        open=True,
        unanswered=unanswered if age is not None else None,
        oldest_unanswered_seconds=age,
    )


def idle(**kw: object) -> dict[str, object]:
    """An engine that reports nothing in it: as vLLM with a dead input thread does."""
    return {"requests_running": 0.0, "requests_waiting": 0.0, "generation_tokens_total": 50.0, **kw}


def timeline(engine_kw: dict[str, object], first_sent_at: float | None = 0.0) -> list[Snapshot]:
    out = []
    for t in range(0, 42, 2):
        g = gate(0.0, unanswered=0) if first_sent_at is None else gate(max(0.0, t - first_sent_at))
        out.append(with_gate(snap(float(t), engine(**engine_kw)), g))
    return out


# (name, ticks every 2 s from 0 to 40 s) -> (unreached_seconds, input_hung, held_by_operator)
CASES = [
    # The hang: a request forwarded at 0, the engine empty throughout: 40 s, hung.
    ("input lost", timeline(idle()), 40.0, True, None),
    # A long prefill: the prompt is in the engine (running 1) while no token moves: never here.
    ("long prefill", timeline(idle(requests_running=1.0)), 0.0, False, None),
    # Queued in the engine (waiting 3): in it, the stall's to judge.
    ("queued in the engine", timeline(idle(requests_waiting=3.0)), 0.0, False, None),
    # Everything answered: nothing unanswered at the gate.
    ("all answered", timeline(idle(), first_sent_at=None), 0.0, False, None),
    # The engine asleep (/sleep): nothing judged.
    ("asleep", timeline(idle(asleep=True)), None, None, OperatorHold.ASLEEP),
]


@pytest.mark.parametrize(
    ("history", "seconds", "hung", "held"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_requests_that_never_reach_the_engine(
    history: list[Snapshot], seconds: float | None, hung: bool | None, held: OperatorHold | None
) -> None:
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung, s.held_by_operator) == (seconds, hung, held)


def test_the_engine_empty_only_lately_counts_from_then() -> None:
    """Requests ran until 36 s (running 1), then the engine read empty: the oldest unanswered
    request is 40 s old, but the engine has read empty only since 38 s: 2 s, under the 6 s bound."""
    history = [
        with_gate(snap(float(t), engine(**idle(requests_running=1.0 if t <= 36 else 0.0))), gate(t))
        for t in range(0, 42, 2)
    ]
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung) == (2.0, False)


def test_a_paused_server_is_never_hung_and_says_so() -> None:
    """/pause (keep): the scheduler frozen, new requests queued before the engine. The engine
    reads empty and the gate waits, exactly as the hang; /is_paused tells them apart."""
    history = [with_gate(s, s.services[0].gate, paused=True) for s in timeline(idle())]
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung) == (None, None)
    assert (s.held_by_operator, s.held_waiting_seconds) == (OperatorHold.PAUSED, 40.0)
    # and a paused engine with requests frozen in it is not stalled either
    frozen = [
        with_gate(s, s.services[0].gate, paused=True)
        for s in timeline(idle(requests_waiting=4.0), first_sent_at=None)
    ]
    s = derive(*frozen)
    assert (s.stall_seconds, s.stalled, s.held_waiting_seconds) == (None, None, 40.0)


@pytest.mark.parametrize(
    "observation",
    [None, gate(None, reachable=False), GateObservation(True, in_flight=1, queued=0)],
    ids=["no gate", "gate unreachable", "an older gate that does not say"],
)
def test_without_a_gate_that_says_nothing_is_judged(observation: GateObservation | None) -> None:
    history = [with_gate(s, observation) for s in timeline(idle())]
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung) == (None, None)


def test_an_unreadable_scrape_ends_what_can_be_vouched_for() -> None:
    history = timeline(idle())
    gap = ServiceSnapshot("vllm", health=history[18].services[0].health, gate=gate(36.0))
    history[18] = replace(history[18], services=(gap,))  # t=36: /metrics unreadable
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung) == (2.0, False)


# --- the real vLLM 0.32, paused -----------------------------------------------------------------

PAUSE_CAPTURE = json.loads((VLLM_FIXTURES / "pause-0.32.json").read_text())


def captured(step: str) -> dict[str, Any]:
    return next(s for s in PAUSE_CAPTURE["steps"] if s["step"] == step)


def test_a_request_sent_to_a_paused_vllm_is_neither_running_nor_waiting() -> None:
    """Measured (tests/vllm_tier/capture_pause.py): a request sent to vLLM 0.32 paused with
    /pause?mode=keep is queued before the scheduler, so the engine reports nothing in it,
    /health answers 200, and the request is unanswered: the input hang's shape exactly. Only
    /is_paused (true) tells them apart, and with it nothing is judged."""
    seen = captured("paused, a second request sent 3 s ago")
    later = captured("paused, 3 s later")
    for s in (seen, later):
        assert s["health"] == 200 and json.loads(s["is_paused"]["body"]) == {"is_paused": True}
        m = s["metrics"]
        assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (0.0, 0.0)
    assert later["metrics"] == seen["metrics"]  # nothing moved
    assert [s["status"] for s in PAUSE_CAPTURE["steps"] if s["step"] == "answers"] == [[200, 200]]

    def tick(t: float, paused: bool | None) -> Snapshot:
        m = later["metrics"]
        e = engine(
            requests_running=m["vllm:num_requests_running"],
            requests_waiting=m["vllm:num_requests_waiting"],
            generation_tokens_total=m["vllm:generation_tokens_total"],
            prompt_tokens_total=m["vllm:prompt_tokens_total"],
            kv_cache_usage_ratio=m["vllm:kv_cache_usage_perc"],
        )
        return with_gate(snap(t, e), gate(t), paused=paused)

    history = [tick(float(t), paused=True) for t in range(0, 42, 2)]
    s = derive(*history)
    assert (s.unreached_seconds, s.input_hung, s.held_by_operator) == (
        None,
        None,
        OperatorHold.PAUSED,
    )
    # Read without /is_paused, the same readings are a hang: why the health source asks it.
    blind = derive(*[tick(float(t), paused=None) for t in range(0, 42, 2)])
    assert (blind.unreached_seconds, blind.input_hung) == (40.0, True)


def test_the_twin_logs_the_pause_as_vllm_does() -> None:
    """The scheduler's line, as the real capture has it (file, line and text)."""
    real = [line for line in PAUSE_CAPTURE["log_lines"] if "pause state" in line]
    assert [line.split("] ", 1)[1] for line in real] == [
        "setting pause state to PAUSED_ALL",
        "setting pause state to UNPAUSED",
    ]
    assert all("[scheduler.py:2756]" in line and "(EngineCore" in line for line in real)
