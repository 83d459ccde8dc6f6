"""What the demo prints: event lines into a pipe, a screen in a terminal, every line within the
width and no word cut, repeated decisions collapsed, and a summary whose incidents are the
alerts people were told about.

The frames are built by hand, as the demo's loop builds them from the guardian once a second:
two minutes of a run are 120 frames, shown in milliseconds.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.core import policy
from vllm_guardian.model import ActionKind
from vllm_guardian.tools.demo import DemoReport, _log_to, _Output, alerts_in_flight, summary
from vllm_guardian.tools.demo_view import (
    AlertShown,
    Decision,
    EventLog,
    Frame,
    collapse,
    fill_all,
    screen,
)

T0 = 1_795_700_000.0
# Reasons as the policy writes them: long, with numbers and units that must stay whole.
LONG_REASON = (
    "relaunch: pre-emptive: pid 4194301 (command unknown, cgroup unknown) exhausts the GPU in "
    "~6s, before it has grown past 5.96 GiB in use; writing the flags file written by the guardian"
)
PATH = "/tmp/vllm-guardian-demo-abcdefgh/state/bundles/20261126T143412Z-vllm-relaunch.tar.gz"
SUPPRESSED = Decision(
    T0 + 3, "suppressed", "concurrency_overcommit: evidence not yet enough to act"
)
STATUS = (
    "vLLM   health up          KV  93%  running 64  waiting 210  preempt/s 2.5  tok/s 2096",
    "GPU    vLLM 72.4 GiB  budget 73.6 GiB  others 0.0 GiB  free 7.6 GiB",
    "Load   capacity: no estimate (not_saturated): requests waited in only 6% of the window "
    "(90% needed): a server that keeps up with what arrives cannot tell its capacity",
    "Guard  /ready 200 (open)  flags: operator baseline  breaker: ok",
)


def frame(second: int, **kw: Any) -> Frame:
    base: dict[str, Any] = {
        "title": "vllm-guardian demo — scenario steady (twin at 4× speed)   [....] Ctrl-C stops",
        "time_seconds": T0 + second,
        "elapsed_seconds": float(second),
        "started": True,
        "health": "up",
        "status": STATUS,
        "ready": "200 (open)",
        "gate": "open",
        "gate_line": "Gate   open  in flight 3  queued 0  held 0  retried 0  refused 0",
        "requests": {"ok": 10 * second},
    }
    return Frame(**{**base, **kw})


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def words(text: str) -> set[str]:
    return set(text.split())


def assert_fits(lines: list[str], width: int, source: str) -> None:
    """Every line within ``width``, unless it is one word that cannot be cut (a path), and every
    word of ``source`` whole in the output."""
    for line in lines:
        assert len(line) <= width or len(line.split()) == 1, f"{len(line)} > {width}: {line!r}"
    missing = words(source) - words("\n".join(lines))
    assert not missing, f"cut or lost: {sorted(missing)}"


def test_a_piped_demo_prints_event_lines_not_screens() -> None:
    """Two minutes of a quiet run: the header, one line per change, a status line every 15 s."""
    out = Pipe()
    shown = _Output(out, quiet=False)
    for second in range(120):
        shown.show(frame(second, decisions=(SUPPRESSED,) if second >= 3 else ()))
    text = out.getvalue()
    assert "\x1b[" not in text, "a pipe gets no escape codes"
    lines = text.splitlines()
    assert len(lines) <= 20, "\n".join(lines)
    assert sum("scenario steady" in line for line in lines) == 1, text
    assert sum("decision suppressed" in line for line in lines) == 1, text


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({"health": "loading"}, {"health": "up"}, "vLLM health up (was loading)"),
        ({}, {"ready": "503 (kv pressure)"}, "/ready/vllm 503 (kv pressure)"),
        ({}, {"gate": "HOLDING (restart)"}, "gate HOLDING (restart)"),
        ({}, {"alerts": (AlertShown("VllmKvCacheSaturated", "firing"),)},
         "alert VllmKvCacheSaturated firing"),
        ({"alerts": (AlertShown("VllmKvCacheSaturated", "firing"),)}, {},
         "alert VllmKvCacheSaturated resolved"),
        ({}, {"alerts": (AlertShown("VllmEngineDead", "firing", "action 2 restarting"),)},
         "alert VllmEngineDead firing (not notified, held: action 2 restarting)"),
        ({}, {"decisions": (Decision(T0 + 1, "action", "restart: engine hung"),)},
         "decision action: restart: engine hung"),
    ],
    ids=["health", "ready", "gate", "alert fires", "alert resolves", "alert held", "decision"],
)  # fmt: skip
def test_each_change_is_one_event_line(
    before: dict[str, Any], after: dict[str, Any], expected: str
) -> None:
    log = EventLog()
    log.lines(frame(1, **before), 200)
    lines = log.lines(frame(2, **after), 200)
    assert any(line.endswith(expected) for line in lines), lines
    assert log.lines(frame(3, **after), 200) == [], "an unchanged frame prints nothing"


FORECAST = (
    "gpu_memory_overcommit: pid 4194301 is growing on the GPU: page; GPU 0: free-memory floor "
    "12.95 GiB falling {rate} MiB/s: exhausted in ~{left} s"
)


def test_a_run_of_the_same_decision_is_one_line_with_a_count() -> None:
    """The same decision again, as the policy logs it anew each time a number in it moves."""
    again = tuple(
        Decision(T0 + i, "suppressed", FORECAST.format(rate=365.4 + i / 10, left=35 - i))
        for i in range(30)
    )
    other = Decision(T0 + 40, "suppressed", "gpu_memory_overcommit: evidence not yet enough")
    runs = collapse((*again, other))
    assert [(r.first.what, r.count) for r in runs] == [("suppressed", 30), ("suppressed", 1)]
    shown = screen(frame(50, decisions=(*again, other)), 120)
    assert sum("is growing" in line for line in shown) == 1, shown
    assert any("(x30 until" in line for line in shown), shown
    assert any("~6 s" in line for line in shown), "the screen shows the latest numbers"
    log = EventLog()
    piped = log.lines(frame(1, decisions=again), 120)
    piped += log.lines(frame(2, decisions=(*again, other)), 120)
    assert sum("is growing" in line for line in piped) == 1, piped
    assert any("the same again, 30 in all" in line for line in piped), piped


def test_the_guardians_log_goes_to_a_file_for_the_run(tmp_path: Path) -> None:
    """Its journal-style lines (an alert's every label) would break the screen or the events."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    detach = _log_to(tmp_path / "guardian.log")
    logging.getLogger("vllm_guardian.actuators.alert_log").info("alert alertname=VllmEngineDead")
    detach()
    assert "alertname=VllmEngineDead" in (tmp_path / "guardian.log").read_text()
    assert (root.level, root.handlers) == (level, handlers)


@pytest.mark.parametrize("width", [40, 80, 120])
def test_the_screen_and_the_events_fit_the_width_without_cutting_a_word(width: int) -> None:
    decisions = (Decision(T0, "action", LONG_REASON), Decision(T0 + 1, "phase", f"bundle {PATH}"))
    f = frame(20, decisions=decisions)
    source = " ".join([*STATUS, LONG_REASON, PATH])
    assert_fits(screen(f, width), width, source)
    assert_fits(EventLog().lines(f, width), width, " ".join([LONG_REASON, PATH, STATUS[0]]))


def test_a_terminal_gets_the_screen_repainted() -> None:
    out = Terminal()
    shown = _Output(out, quiet=False)
    for second in range(3):
        shown.show(frame(second))
    assert out.getvalue().count("\x1b[H\x1b[2J") == 3


def transition(name: str, current: str, inhibited_by: str | None = None) -> dict[str, Any]:
    alert = {"name": name, "summary": f"{name} summary", "inhibited_by": inhibited_by}
    return {"decisions": [{"transition": {"alert": alert, "current": current}}]}


@pytest.mark.parametrize(
    ("records", "fired", "held"),
    [
        ([transition("VllmEngineDead", "pending", "start-up: the guardian started vLLM"),
          transition("VllmEngineDead", "firing", "start-up: the guardian started vLLM"),
          transition("VllmEngineDead", "inactive", "start-up: the guardian started vLLM")],
         [], {"VllmEngineDead": "start-up: the guardian started vLLM"}),
        ([transition("VllmEngineDead", "firing", "action 1 awaiting_ready")],
         [], {"VllmEngineDead": "action 1 awaiting_ready"}),
        # The start-up grace ran out: held, then told once the window closed badly.
        ([transition("VllmEngineDead", "firing", "start-up: the guardian started vLLM"),
          transition("VllmEngineDead", "firing")], ["VllmEngineDead"], {}),
        ([transition("VllmKvCacheSaturated", "pending"), transition("VllmKvCacheSaturated", "firing"),
          transition("VllmKvCacheSaturated", "firing")], ["VllmKvCacheSaturated"], {}),
    ],
    ids=["first load", "planned relaunch", "held then told", "a real incident"],
)  # fmt: skip
def test_the_summary_counts_as_incidents_only_the_alerts_people_were_told_about(
    records: list[dict[str, Any]], fired: list[str], held: dict[str, str]
) -> None:
    seen = alerts_in_flight(records)
    assert (seen.fired, seen.held) == (fired, held)
    report = DemoReport("steady", Path("/tmp/x"), alerts_fired=seen.fired, alerts_held=seen.held)
    text = "\n".join(summary(report))
    incidents = re.search(r"Incidents \(alerts that fired\): (.*)", text)
    assert incidents is not None and incidents.group(1) == (", ".join(fired) or "none"), text


def test_the_summary_fits_80_columns_without_cutting_a_word() -> None:
    action = policy.Decision(
        T0, "vllm", policy.DecisionKind.ACTION, LONG_REASON,
        action_id=1, action_kind=ActionKind.RELAUNCH,
    )  # fmt: skip
    result = replace(action, what=policy.DecisionKind.RESULT, reason="relaunch ok: " + LONG_REASON)
    report = DemoReport(
        "noisy_neighbour",
        Path(PATH),
        actions=[action],
        decisions=[action, result],
        requests={"ok": 594, "error": 3},
        gate_url="http://127.0.0.1:41753",
        gate={
            "held_total": 12,
            "longest_wait_seconds": 31.5,
            "retried_total": 2,
            "rejected_total": 0,
        },
    )
    assert_fits(fill_all(summary(report), 80), 80, " ".join([LONG_REASON, PATH]))


@pytest.mark.parametrize(
    ("requests_by_kind", "longest_wait_seconds", "explained"),
    [
        ({"ok": 469, "timeout": 43}, 40.7, True),  # held past the client's 30 s: said why
        ({"ok": 500, "timeout": 3}, 12.0, False),  # not held that long: not the hold's doing
        ({"ok": 512}, 40.7, False),
    ],
    ids=["held past the client's wait", "short holds", "no timeouts"],
)
def test_the_summary_says_when_timeouts_gave_up_while_the_gate_held_them(
    requests_by_kind: dict[str, int], longest_wait_seconds: float, explained: bool
) -> None:
    report = DemoReport(
        "prefill_burst", Path(PATH), requests=requests_by_kind, gate_url="http://127.0.0.1:1",
        gate={"held_total": 114, "longest_wait_seconds": longest_wait_seconds},
    )  # fmt: skip
    text = "\n".join(summary(report))
    line = re.search(r"The (\d+) timeouts gave up while held: .* up to ([\d.]+) s", text)
    assert (line is not None) == explained, text
    if line is not None:
        assert (int(line.group(1)), float(line.group(2))) == (
            requests_by_kind["timeout"],
            longest_wait_seconds,
        )
        assert "waits 30 s" in text
