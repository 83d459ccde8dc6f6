"""The gate's progress watch: a hung engine (requests in it, no progress: core/progress.py)
holds new requests at the gate instead of sending them in to wait for their timeout.

The pure watch against a table of readings on a fake clock and against the real vLLM 0.32
series of one long prompt alone and of a stopped engine core; then a real gate in front of the
scriptable stub serving real vLLM 0.32 /metrics captures, frozen (hung) and moving.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import requests

from tests.conftest import VLLM_FIXTURES as FIXTURES
from tests.expositions import captured_series
from tests.hostile import wait_for
from tests.test_gate_support import GateThread, Stub
from vllm_guardian.config import PolicyConfig, SignalsConfig
from vllm_guardian.core.progress import ProgressReading
from vllm_guardian.gate.progress import (
    GIVEN_UP_MIN_SECONDS,
    UNANSWERED_FORGET_SECONDS,
    EngineMark,
    ProgressWatch,
    Unanswered,
    abandoned,
    still_unanswered,
    why_send_again,
)
from vllm_guardian.model import EngineMetrics, VllmScrape
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics


def reading(
    tokens: float, inside: float, *, kv: float = 0.5, preempted: float = 0
) -> ProgressReading:
    """A reading of one engine: tokens generated, requests running, KV usage, preemptions."""
    e = EngineMetrics(
        "m",
        "0",
        requests_running=inside,
        requests_waiting=0.0,
        prompt_tokens_total=0.0,
        generation_tokens_total=tokens,
        kv_cache_usage_ratio=kv,
        preemptions_total=preempted,
    )
    r = ProgressReading.of(VllmScrape((e,), True, 1.0, 1))
    assert r is not None
    return r


R = reading
# (time, reading or None for no reading)
Readings = list[tuple[float, ProgressReading | None]]

CASES: list[tuple[str, Readings, bool]] = [
    ("tokens move every reading", [(0, R(100, 4)), (5, R(150, 4)), (11, R(200, 4))], False),
    ("frozen with requests inside for the hold", [(0, R(100, 4)), (5, R(100, 4)), (10, R(100, 4))], True),
    ("frozen, but not yet for the whole hold", [(0, R(100, 4)), (5, R(100, 4)), (9.9, R(100, 4))], False),
    ("frozen and idle: nothing to process", [(0, R(100, 0)), (20, R(100, 0))], False),
    ("idle, then requests arrive and nothing moves", [(0, R(100, 0)), (3, R(100, 2)), (13, R(100, 2))], True),
    ("a restarted process counts from zero: progress", [(0, R(900, 3)), (10, R(0, 3)), (15, R(0, 3))], False),
    ("hung, then tokens move again: reopens", [(0, R(100, 4)), (12, R(100, 4)), (13, R(101, 4))], False),
    ("no reading forgets: never held on missing data", [(0, R(100, 4)), (10, None)], False),
    ("after a gap, frozen counts from the first new reading", [(0, R(100, 4)), (5, None), (6, R(100, 4)), (15, R(100, 4))], False),
    ("after a gap, the hold is counted again in full", [(0, R(100, 4)), (5, None), (6, R(100, 4)), (16, R(100, 4))], True),
    ("a long prefill: token counters flat, KV usage rising",
     [(0, R(100, 1, kv=0.1)), (5, R(100, 1, kv=0.4)), (10, R(100, 1, kv=0.7)), (15, R(100, 1, kv=0.9))], False),
    ("thrash: token counters flat, preemptions rising",
     [(0, R(100, 9, kv=1.0, preempted=3)), (5, R(100, 9, kv=1.0, preempted=8)), (10, R(100, 9, kv=1.0, preempted=12))], False),
    ("thrash that stops: frozen for the hold after the last preemption",
     [(0, R(100, 9, preempted=3)), (5, R(100, 9, preempted=8)), (15, R(100, 9, preempted=8))], True),
]  # fmt: skip


@pytest.mark.parametrize(("case", "readings", "held"), CASES, ids=[c[0] for c in CASES])
def test_the_watch_holds_only_a_hung_engine(case: str, readings: Readings, held: bool) -> None:
    watch = ProgressWatch(hold_after_seconds=10)
    for now, r in readings:
        watch.observe(now, r)
    reason = watch.stalled()
    assert (reason is not None) == held, reason
    if held:
        assert "no progress" in (reason or "")


CAPTURED = [
    # the real vLLM 0.32 series: held at some reading?, the longest hold asked for (s)
    ("long_prefill", False, 0.0),  # one 20,480-token prompt alone: 15.5 s of prefill
    ("hang", True, 11.5),  # EngineCore stopped (SIGSTOP) for 12 s mid-prefill
]


@pytest.mark.parametrize(("series", "ever", "quiet"), CAPTURED, ids=[c[0] for c in CAPTURED])
def test_the_watch_over_the_captured_series(series: str, ever: bool, quiet: float) -> None:
    watch = ProgressWatch(hold_after_seconds=10)
    held = []
    for r in captured_series(series):
        watch.observe(r.t_seconds, ProgressReading.of(parse_vllm_metrics(r.text, len(r.text))))
        held.append(watch.stalled())
    assert any(h is not None for h in held) is ever, held
    if ever:
        last = [h for h in held if h is not None][-1]
        assert f"no progress for {quiet:.0f} s" in last, last


def test_a_hold_of_zero_turns_the_watch_off() -> None:
    watch = ProgressWatch(hold_after_seconds=0)
    for now in (0, 100, 1000):
        watch.observe(now, R(100, 8))
    assert watch.stalled() is None


@pytest.mark.parametrize(
    ("capture", "tokens", "inside"),
    [("metrics-under-load-02.prom", 4701 + 7745, 31), ("metrics-idle.prom", 0, 0)],
)
def test_a_reading_from_a_real_capture(capture: str, tokens: float, inside: float) -> None:
    text = (FIXTURES / capture).read_text()
    r = ProgressReading.of(parse_vllm_metrics(text, len(text)))
    assert r is not None
    assert r.requests_in_engine == inside
    (e,) = r.engines
    assert e.values[3] + e.values[4] == tokens  # prompt + generation (MARK_FIELDS)


def test_an_exposition_without_the_counters_is_no_reading() -> None:
    text = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3\n'
    assert ProgressReading.of(parse_vllm_metrics(text, len(text))) is None


# --- a real gate ------------------------------------------------------------------------------


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


def status(g: GateThread) -> dict[str, object]:
    body: dict[str, object] = requests.get(g.url + "/gate/status", timeout=60).json()
    return body


def test_a_hung_engine_holds_new_requests_and_a_moving_one_releases_them(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_guardian.gate")
    stub.metrics_text = (FIXTURES / "metrics-under-load-02.prom").read_text()  # frozen: hung
    g = GateThread(stub.url)
    g.gate.follower.progress.hold_after_seconds = 0.5  # type: ignore[union-attr]
    try:
        seen = wait_for(
            lambda: ((s := status(g))["open"] is False and "no progress" in str(s["reason"]), s),
            "the gate holds new requests: 31 requests in vLLM and no progress",
        )
        print(seen)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                requests.post, g.url + "/v1/echo", json={"prompt": "hi", "max_tokens": 1},
                timeout=60,
            )  # fmt: skip
            wait_for(lambda: (status(g)["queue_depth"] == 1, status(g)), "the request is held")
            assert stub.calls.get("/v1/echo", 0) == 0, "nothing was sent into the hung engine"
            # The engine moves again (a later capture: more tokens processed): released.
            stub.metrics_text = (FIXTURES / "metrics-under-load-05.prom").read_text()
            assert held.result(timeout=60).status_code == 200
        assert stub.calls["/v1/echo"] == 1
        assert status(g)["open"] is True
        said = [r.getMessage() for r in caplog.records if r.name == "vllm_guardian.gate"]
        assert any("holding new requests: vLLM made no progress" in m for m in said), said
        assert any(m.startswith("gate open") for m in said), said
    finally:
        g.stop()


def test_an_upstream_without_metrics_is_served_on_its_health(stub: Stub) -> None:
    g = GateThread(stub.url)  # the stub answers /metrics with 404
    g.gate.follower.progress.hold_after_seconds = 0.2  # type: ignore[union-attr]
    try:
        wait_for(lambda: (stub.calls.get("/metrics", 0) >= 5, stub.calls), "five /metrics reads")
        assert status(g)["open"] is True
        r = requests.post(g.url + "/v1/echo", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    finally:
        g.stop()


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/sse"], ids=["continued stream (relay)", "bytes as they come"]
)
def test_a_request_sent_and_not_yet_answered_is_counted(stub: Stub, path: str) -> None:
    """The gate's status says how many requests it sent to vLLM have had no byte of their
    answer yet, and the oldest's age: with vLLM's engine idle by its metrics, the requests that
    never reached it (core/progress.py, unreached_seconds). The stream's headers came at once;
    only its body counts as an answer."""
    g = GateThread(stub.url)
    try:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                requests.post, g.url + path, json={"prompt": "hi", "max_tokens": 1, "stream": True},
                headers={"X-Stub-Hold-Body": "1"}, timeout=60,
            )  # fmt: skip
            seen = wait_for(
                lambda: (
                    (s := status(g))["unanswered"] == 1
                    and float(s["oldest_unanswered_seconds"]) >= 0.3,  # type: ignore[arg-type]
                    s,
                ),
                "one request unanswered for 0.3 s",
            )
            print(seen)
            stub.set_release()
            answer = sent.result(timeout=60)
            assert answer.status_code == 200 and b"[DONE]" in answer.content, answer.content
        done = status(g)
        assert (done["unanswered"], done["oldest_unanswered_seconds"]) == (0, 0.0), done
    finally:
        g.stop()


# --- a request its client gave up on, before vLLM answered --------------------------------------

IDLE_R = R(100, 0, kv=0.0)
SENT = Unanswered(10.0, EngineMark.of(IDLE_R, 0), IDLE_R)
BLIND = Unanswered(10.0, EngineMark(None, None, 0), None)  # sent with no reading of /metrics
# (what was kept, seconds since its send, /health failures since, the reading now, kept still?)
FORGET: list[tuple[str, Unanswered, float, int, ProgressReading | None, bool]] = [
    ("idle and frozen: still unreached", SENT, 60, 0, IDLE_R, True),
    ("no reading now: not forgotten on missing data", SENT, 60, 0, None, True),
    ("just at the bound", SENT, UNANSWERED_FORGET_SECONDS, 0, IDLE_R, True),
    ("past the bound: forgotten without news", SENT, UNANSWERED_FORGET_SECONDS + 1, 0, IDLE_R, False),
    ("/health failed since: a restarted engine", SENT, 60, 1, IDLE_R, False),
    ("another process (its start time)", SENT, 60, 0, replace(IDLE_R, process_start_time_seconds=2.0), False),
    ("the engine moved since: a request reached it (KV usage)", SENT, 60, 0, R(100, 0, kv=0.01), False),
    ("the engine generated tokens since", SENT, 60, 0, R(101, 0, kv=0.0), False),
    ("sent with no reading: only a restart or the bound tell", BLIND, 60, 0, R(101, 0), True),
    ("sent with no reading, /health failed since", BLIND, 60, 1, R(101, 0), False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "kept", "age", "failures", "now_reading", "still"), FORGET, ids=[c[0] for c in FORGET]
)
def test_a_given_up_request_counts_until_the_engine_is_seen_to_take_requests(
    case: str,
    kept: Unanswered,
    age: float,
    failures: int,
    now_reading: ProgressReading | None,
    still: bool,
) -> None:
    mark = EngineMark.of(now_reading, failures)
    got = still_unanswered(kept, kept.sent_at + age, mark, now_reading)
    assert got == (kept if still else None)


LATER = replace(SENT, sent_at=SENT.sent_at + 5)
MIN = GIVEN_UP_MIN_SECONDS
# (what was kept, the request given up, when it was given up, what is kept then)
GIVEN_UP: list[tuple[str, Unanswered | None, Unanswered, float, Unanswered | None]] = [
    ("the first", None, LATER, LATER.sent_at + MIN, LATER),
    ("an earlier one replaces a later", LATER, SENT, SENT.sent_at + MIN, SENT),
    ("a later one does not replace an earlier", SENT, LATER, LATER.sent_at + MIN, SENT),
    ("given up too soon: vLLM may not have handed it to its engine yet", None, SENT, SENT.sent_at + MIN - 0.1, None),
    ("given up too soon keeps what was kept", LATER, SENT, SENT.sent_at + 1, LATER),
    ("sent with no reading: reached and dropped cannot be told from never reached", None, BLIND, BLIND.sent_at + 60, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "kept", "given_up", "at", "now_kept"), GIVEN_UP, ids=[c[0] for c in GIVEN_UP]
)
def test_the_earliest_request_given_up_after_a_while_is_kept(
    case: str, kept: Unanswered | None, given_up: Unanswered, at: float, now_kept: Unanswered | None
) -> None:
    assert abandoned(kept, given_up, at) == now_kept
    assert still_unanswered(None, 100.0, SENT.engine, IDLE_R) is None


def test_the_bound_outlasts_the_guardians_wait_and_ends_within_its_cooldown() -> None:
    """Long enough for the guardian to act on the hang (its stall wait, then its first
    backoff), short enough that an age the gate failed to tie to the old engine is gone before
    the cooldown after a restart ends (no second restart for it)."""
    policy, signals = PolicyConfig(), SignalsConfig()
    assert signals.stall_seconds + policy.backoff_initial_seconds < UNANSWERED_FORGET_SECONDS
    assert policy.cooldown_seconds > UNANSWERED_FORGET_SECONDS


IDLE = (FIXTURES / "metrics-idle.prom").read_text()  # nothing running or waiting, frozen


def _abandon(g: GateThread, stub: Stub, after_seconds: float = 0.0) -> None:
    """One client sends a request the stub never answers (``/v1/hold``: no head, no body,
    as vLLM whose engine never gets it) and gives up once the stub has had it for
    ``after_seconds``, as a client's timeout does; the gate then closes its upstream
    connection."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    before = stub.calls.get("/v1/hold", 0)
    with socket.create_connection(("127.0.0.1", g.gate.port), timeout=60) as client:
        client.sendall(
            b"POST /v1/hold HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(
            lambda: (stub.calls.get("/v1/hold", 0) > before and stub.active == 1, stub.calls),
            "the request reached the upstream",
        )
        wait_for(
            lambda: (
                float(status(g)["oldest_unanswered_seconds"]) >= after_seconds,  # type: ignore[arg-type]
                status(g),
            ),
            f"the request unanswered for {after_seconds} s",
        )
    wait_for(lambda: (stub.active == 0, stub.active), "the gate gave the request up upstream")


# Clients give up after this; the gate counts a request given up after 0.2 s (5 s by default:
# gate/progress.py, GIVEN_UP_MIN_SECONDS).
PATIENCE = 0.3


def _gate_reading_metrics(stub: Stub, **proxy: object) -> GateThread:
    """A gate that counts requests given up after 0.2 s, once it has a reading of /metrics."""
    g = GateThread(stub.url, proxy={"given_up_min_seconds": 0.2, **proxy})
    follower = g.gate.follower
    assert follower is not None
    wait_for(lambda: (follower.progress.last is not None, stub.calls), "a reading of /metrics")
    return g


def test_a_request_given_up_at_once_says_nothing_about_the_engine(stub: Stub) -> None:
    """A client that cancels at once may leave before vLLM's API server hands its request to
    the engine: on an idle, working server nothing shows it, and it must not read as a hang."""
    stub.metrics_text = IDLE
    g = GateThread(stub.url)  # requests given up within 5 s do not count
    try:
        wait_for(lambda: (g.gate.follower.progress.last is not None, stub.calls), "a reading")  # type: ignore[union-attr]
        _abandon(g, stub)
        after = [status(g)["oldest_unanswered_seconds"] for _ in range(5)]
        assert after == [0.0] * 5, after
    finally:
        g.stop()


def _unanswered_for(g: GateThread, seconds: float) -> dict[str, object]:
    seen = wait_for(
        lambda: (
            (s := status(g))["unanswered"] == 0
            and float(s["oldest_unanswered_seconds"]) >= seconds,  # type: ignore[arg-type]
            s,
        ),
        f"no request alive, and the oldest unanswered age past {seconds} s",
    )
    print(seen)
    assert isinstance(seen, dict)
    return seen


def test_a_request_its_client_gave_up_on_still_counts_until_vllm_answers(stub: Stub) -> None:
    """The hang that looks idle must show whatever the clients' patience: on the real vLLM
    0.32 an engine core blocked while idle, clients with a 30 s timeout, and each request left
    the gate at 30 s, so the oldest unanswered age never reached the guardian's 30 s. A request
    that ended without a byte of its answer counts from its send until vLLM answers one."""
    stub.metrics_text = IDLE
    g = _gate_reading_metrics(stub)
    try:
        _abandon(g, stub, PATIENCE)
        _unanswered_for(g, 1.0)  # on, past the client's patience
        _abandon(g, stub, PATIENCE)  # a later one does not reset the age: the first is older
        first = _unanswered_for(g, 1.5)
        # vLLM answers a request: its engine's input works, the age is forgotten.
        r = requests.post(g.url + "/v1/echo", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        done = status(g)
        assert (done["unanswered"], done["oldest_unanswered_seconds"]) == (0, 0.0), (first, done)
    finally:
        g.stop()


def test_a_restarted_engine_forgets_the_request_given_up_on(stub: Stub) -> None:
    """After the guardian's restart (/health failed, then 200) an idle new engine reports
    nothing unanswered: the given-up request was the old engine's, and must not restart the
    new one again."""
    stub.metrics_text = IDLE
    g = _gate_reading_metrics(stub)
    try:
        _abandon(g, stub, PATIENCE)
        _unanswered_for(g, 0.5)
        _restarted(stub, g)
        wait_for(lambda: (status(g)["upstream_healthy"] is True, status(g)), "/health is back")
        after = [status(g)["oldest_unanswered_seconds"] for _ in range(5)]
        assert after == [0.0] * 5, after
    finally:
        g.stop()


# --- a hung engine's requests, taken back, wait for a new engine ---------------------------------

FROZEN = (FIXTURES / "metrics-under-load-02.prom").read_text()  # 31 requests in vLLM
START = "process_start_time_seconds 1.79530556889e+09"
assert START in FROZEN


def _restarted(stub: Stub, g: GateThread) -> None:
    stub.healthy = False  # the guardian's restart: /health refused or 503, then 200
    wait_for(lambda: (g.gate.follower.upstream_healthy is False, status(g)), "/health failed")  # type: ignore[union-attr]
    stub.healthy = True


def _new_process(stub: Stub, g: GateThread) -> None:
    stub.metrics_text = FROZEN.replace(START, "process_start_time_seconds 1.8e+09")


def _generates(stub: Stub, g: GateThread) -> None:
    # A later capture of the same process: 41,131 tokens generated, not 7,745.
    stub.metrics_text = (FIXTURES / "metrics-under-load-05.prom").read_text()


NEW_ENGINE = [
    ("restarted: /health failed, then answered", _restarted),
    ("a new process: its start time changed", _new_process),
    ("the same engine generated tokens again: a false alarm", _generates),
]


@pytest.mark.parametrize("new_engine", [n for _, n in NEW_ENGINE], ids=[i for i, _ in NEW_ENGINE])
def test_a_taken_back_request_waits_for_a_new_engine_not_for_the_hold_to_end(
    stub: Stub, new_engine: Callable[[Stub, GateThread], None]
) -> None:
    """The hold can end while the engine is still hung (seen on the real vLLM: a request sent
    again into it was lost; here /metrics stops answering, and the watch never holds on
    missing data). What was taken back stays in the gate, the gate closed, until the engine
    it goes to is another one, or the same one generates again. About 1.5 s."""
    g = GateThread(
        stub.url,
        proxy={"taken_back_extra_wait_seconds": 60.0},
        gate={"take_back_hung": True, "stall_hold_seconds": 0.5},
        max_wait_seconds=60.0,
    )
    follower = g.gate.follower
    assert follower is not None
    try:
        with ThreadPoolExecutor(1) as pool:
            try:
                sent = pool.submit(
                    requests.post, g.url + "/v1/hold", json={"prompt": "hi", "max_tokens": 1},
                    timeout=60,
                )  # fmt: skip
                wait_for(lambda: (stub.active == 1, stub.calls), "the request reached the engine")
                stub.metrics_text = FROZEN  # the engine hangs with it
                wait_for(
                    lambda: (follower.taken_back == 1 and status(g)["queue_depth"] == 1, status(g)),
                    "the request taken back, waiting in the gate's queue",
                )
                stub.metrics_text = None  # no reading: the hold ends, the engine is still hung
                polls, reads = follower.polls, stub.calls.get("/metrics", 0)
                seen = wait_for(
                    lambda: (
                        follower.polls >= polls + 10 and stub.calls.get("/metrics", 0) >= reads + 5,
                        (stub.calls, status(g)),
                    ),
                    "ten polls and five /metrics reads after the hold ended",
                )
                print(seen)
                assert stub.calls["/v1/hold"] == 1, "sent again into the hung engine"
                now = status(g)
                assert now["open"] is False and "taken back" in str(now["reason"]), now
                stub.set_release()  # what answers now is the new engine (or the engine again)
                new_engine(stub, g)
                assert sent.result(timeout=60).status_code == 200
            finally:  # a failure above must not leave the client waiting
                stub.set_release()
        assert stub.calls["/v1/hold"] == 2
        wait_for(lambda: (status(g)["open"] is True, status(g)), "the gate open again")
    finally:
        g.stop()


def mark(start: float | None, generated: float | None, failures: int = 0) -> EngineMark:
    return EngineMark(start, generated, failures)


SEND_AGAIN = [  # (taken back from, now, sent again)
    (mark(1.0, 100), mark(1.0, 100), False),  # the same engine, still hung
    (mark(1.0, 100), mark(None, None), False),  # no reading: nothing tells
    (mark(None, None), mark(1.0, 0), False),  # no reading then: nothing to compare
    (mark(1.0, 100), mark(1.0, 100, failures=1), True),  # /health failed since: a restart
    (mark(1.0, 100), mark(2.0, 0), True),  # another process
    (mark(1.0, 100), mark(1.0, 101), True),  # the engine generates again
    (mark(1.0, 100), mark(1.0, 90), False),  # not the same count, not a new process: no sign
]


@pytest.mark.parametrize(("taken_from", "now", "again"), SEND_AGAIN)
def test_what_tells_a_new_engine(taken_from: EngineMark, now: EngineMark, again: bool) -> None:
    assert (why_send_again(taken_from, now) is not None) is again


def test_the_followers_engine_mark_follows_every_poll_it_is_made_of() -> None:
    """The proxy asks for the engine's mark with every request it sends; the follower makes
    it anew only when a poll brought a new reading or counted a /health failure, and never
    answers with a mark older than either."""
    import asyncio

    from vllm_guardian.gate.admission import Admission, Limits
    from vllm_guardian.gate.follower import Follower
    from vllm_guardian.gate.metrics import GateMetrics

    async def run() -> list[tuple[EngineMark, bool]]:
        # (in a loop: the follower's pools are made for the running one)
        f = Follower(
            Admission(Limits(), GateMetrics("vllm")), upstream="http://127.0.0.1:1",
            guardian=None, service="vllm", poll_interval_seconds=1.0,
            kv_poll_interval_seconds=1.0, suspect_seconds=1.0,
        )  # fmt: skip
        seen: list[tuple[EngineMark, bool]] = []
        last: EngineMark | None = None

        def note() -> None:
            nonlocal last
            mark = f.engine_mark()
            seen.append((mark, mark is last))
            last = mark

        note()  # no reading yet
        note()
        f.progress.observe(1.0, R(100, 1))
        note()
        note()
        f.progress.observe(2.0, R(150, 1))
        note()
        f._health_failures += 1  # a poll's count of a refused /health
        note()
        f.progress.observe(3.0, None)  # a poll that could not read /metrics
        note()
        return seen

    seen = asyncio.run(run())
    assert seen == [
        (EngineMark(None, None, 0), False),
        (EngineMark(None, None, 0), True),
        (EngineMark.of(R(100, 1), 0), False),
        (EngineMark.of(R(100, 1), 0), True),
        (EngineMark.of(R(150, 1), 0), False),
        (EngineMark.of(R(150, 1), 1), False),
        (EngineMark(None, None, 1), False),
    ]
