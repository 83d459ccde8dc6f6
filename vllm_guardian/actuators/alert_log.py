"""Alert sink: one structured ``key=value`` line per alert transition through ``logging``.

Where it sits: the act stage of the tick, fed by ``actuators/alerts.AlertDispatcher`` with the
transitions ``core/alerting.evaluate`` returned. Under systemd the lines land in the journal
at a level that matches the news (firing: warning or error, pending and resolved: info), so
``journalctl -u vllm-guardian -p warning`` shows what fired. Never raises.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from vllm_guardian.core.alerting import SinkResult, Transition
from vllm_guardian.model import Alert, AlertState, Severity

_BARE = re.compile(r"^[A-Za-z0-9_.:/#+%-]+$")


def quote(value: object) -> str:
    """A value for a key=value line: bare when safe, else double-quoted with escapes."""
    text = "" if value is None else str(value)
    if text and _BARE.match(text):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def format_transition(t: Transition) -> str:
    a = t.alert
    status = "resolved" if t.resolved else t.current.value
    fields: list[tuple[str, object]] = [
        ("alertname", a.name),
        ("service", a.service),
        *a.labels,
        ("status", status),
        ("from", t.previous.value),
        ("to", t.current.value),
        ("severity", a.severity.value),
        ("cause", a.cause.value if a.cause else "none"),
        ("value", "none" if a.value is None else f"{a.value:g}"),
        ("stale", "true" if a.stale else "false"),
        ("summary", a.summary),
        ("runbook", a.runbook),
    ]
    return "alert " + " ".join(f"{k}={quote(v)}" for k, v in fields if v is not None)


def level(t: Transition) -> int:
    if t.current is AlertState.FIRING:
        return logging.ERROR if t.alert.severity is Severity.CRITICAL else logging.WARNING
    return logging.INFO


class AlertLogSink:
    name = "log"
    wants_state = False

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("vllm_guardian.alerts")

    def deliver(
        self, transitions: Sequence[Transition], alerts: Sequence[Alert], now: float
    ) -> list[SinkResult]:
        return [self.send(transitions)] if transitions else []

    def close(self) -> None:
        pass

    def send(self, transitions: Sequence[Transition]) -> SinkResult:
        try:
            for t in transitions:
                self.logger.log(level(t), "%s", format_transition(t))
        except Exception as e:  # a broken handler must not break the tick
            return SinkResult(self.name, self.logger.name, False, len(transitions), error=str(e))
        return SinkResult(self.name, self.logger.name, True, len(transitions))
