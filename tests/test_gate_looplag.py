"""The gate's own lateness (gate/looplag.py): a gate that answers late because its loop was late
says so, in ``/gate/status``, in its ``/metrics`` and in its log.

Why it exists: in the real-engine overload the guardian found the gate's status unanswered
within 1 s in most ticks, and nothing could say whether the gate or the host was to blame.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import requests
from prometheus_client import CollectorRegistry, Histogram

from tests.hostile import wait_for
from tests.test_gate_support import GateThread, Stub
from vllm_guardian.gate.looplag import LAG_BUCKETS, LoopLag


def _lag(**kw: float) -> LoopLag:
    h = Histogram("lag_seconds", "test", buckets=LAG_BUCKETS, registry=CollectorRegistry())
    return LoopLag(h, clock=lambda: 0.0, **kw)


@pytest.mark.parametrize(
    ("lags", "at", "expected"),
    [
        ([], 0.0, 0.0),  # nothing seen: no lag
        ([(1.0, 0.002)], 1.0, 0.002),
        ([(1.0, 2.5), (2.0, 0.01), (3.0, 0.02)], 3.0, 2.5),  # the largest, not the last
        ([(1.0, 2.5), (2.0, 0.01), (3.0, 0.02)], 61.5, 0.02),  # 2.5 s left the minute
        ([(1.0, 0.3), (2.0, 0.9), (3.0, 0.1)], 62.5, 0.1),  # ...and so did 0.9 s
        ([(1.0, -0.001)], 1.0, 0.0),  # woke early (clock granularity): not negative
    ],
    ids=["none", "one", "largest", "expired", "expired-later", "early"],
)
def test_the_status_figure_is_the_largest_lag_of_the_last_minute(
    lags: list[tuple[float, float]], at: float, expected: float
) -> None:
    lag = _lag(window_seconds=60.0)
    for now, seconds in lags:
        lag.observe(seconds, now, 0.0)
    assert lag.max_seconds(at) == expected


@pytest.mark.parametrize(
    ("lag_seconds", "cpu_seconds", "says"),
    [
        (2.0, 1.9, "the loop was busy"),
        (2.0, 0.05, "the process was not running (the host's CPUs taken) or blocked"),
        (0.5, 0.5, None),  # under warn_seconds: counted, not logged
    ],
    ids=["busy", "descheduled", "small"],
)
def test_a_late_loop_is_logged_with_the_cpu_it_used(
    caplog: pytest.LogCaptureFixture, lag_seconds: float, cpu_seconds: float, says: str | None
) -> None:
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    _lag(warn_seconds=1.0).observe(lag_seconds, 10.0, cpu_seconds)
    lines = [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]
    if says is None:
        assert lines == []
    else:
        assert len(lines) == 1 and says in lines[0], lines
        assert f"{lag_seconds:.1f} s late" in lines[0], lines


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.stop()


def test_a_stalled_gate_reports_its_stall_in_status_metrics_and_log(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    """The gate's loop blocks for 1.5 s (as a blocking call or a descheduled process does); the
    next status read shows it, the histogram counts it, and the log names it."""
    caplog.set_level(logging.WARNING, "vllm_guardian.gate")
    g = GateThread(stub.url)
    try:
        before = requests.get(g.url + "/gate/status", timeout=60).json()
        print("before:", before["loop_lag_max_seconds"])
        g.lt.loop.call_soon_threadsafe(time.sleep, 1.5)
        doc: dict[str, object] = {}

        def stall_seen() -> tuple[bool, object]:
            nonlocal doc
            doc = requests.get(g.url + "/gate/status", timeout=60).json()
            return float(doc["loop_lag_max_seconds"]) >= 1.3, doc["loop_lag_max_seconds"]  # type: ignore[arg-type]

        wait_for(stall_seen, "the status to report the stall")
        text = requests.get(g.url + "/metrics", timeout=60).text
        over_one = [
            line
            for line in text.splitlines()
            if line.startswith("vllm_guardian_gate_loop_lag_seconds_bucket") and 'le="1.0"' in line
        ]
        count = [
            line
            for line in text.splitlines()
            if line.startswith("vllm_guardian_gate_loop_lag_seconds_count")
        ]
        print(over_one, count)
        assert float(count[0].split()[-1]) > float(over_one[0].split()[-1]), (over_one, count)
        warned = [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]
        assert warned and "not running" in warned[0], warned  # time.sleep uses no CPU
    finally:
        g.stop()
