"""Alert sink: Alertmanager's v2 API (``POST /api/v2/alerts``), the way Prometheus feeds it.

Where it sits: the act stage of the tick, on its own worker thread under
``actuators/alerts.AlertDispatcher``. Alertmanager holds an alert only until its ``endsAt``,
so, like Prometheus, this sink sends every firing alert when it starts firing and again every
``resend_seconds``, each time with ``endsAt`` four resend periods ahead (a guardian that dies
stops renewing them and Alertmanager resolves them itself). A resolved alert is sent once
with ``endsAt`` = the time it resolved. Pending alerts are not sent. A failed POST is retried
on the next tick (nothing is marked sent until Alertmanager said 2xx). Never raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import requests

from vllm_guardian.actuators.webhook import iso8601, starts_at
from vllm_guardian.core.alerting import AlertKey, SinkResult, Transition
from vllm_guardian.lowio.redact import redact_text, redact_url_in
from vllm_guardian.model import Alert, AlertState

EVALUATOR = "guardian"
# Prometheus's own factor: endsAt = now + 4 × resend interval for a firing alert.
ENDS_AT_RESENDS = 4
# A resolved alert that could not be delivered is retried this long, then given up
# (Prometheus keeps resolved alerts 15 minutes for the same reason).
RESOLVED_RETENTION_SECONDS = 15 * 60.0


def am_alert(
    a: Alert, ends_at: float, runbook_base: str, generator_url: str | None = None
) -> dict[str, Any]:
    labels = {"alertname": a.name, "severity": a.severity.value}
    if a.service:
        labels["service"] = a.service
    if a.cause is not None:
        labels["cause"] = a.cause.value
    labels.update({k: v for k, v in a.labels if v})
    # The shipped Prometheus rules use the same alertname for the same condition with
    # evaluator="prometheus": Alertmanager tells the two apart by this (examples/alertmanager.yml
    # inhibits Prometheus's copy while the guardian's fires).
    labels["evaluator"] = EVALUATOR
    annotations = {"summary": a.summary}
    if a.runbook:
        annotations["runbook_url"] = runbook_base + a.runbook
    if a.value is not None:
        annotations["value"] = f"{a.value:g}"
    if a.stale:
        annotations["stale"] = "true: the signal is missing; state held, not resolved"
    out: dict[str, Any] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": iso8601(starts_at(a)),
        "endsAt": iso8601(ends_at),
    }
    if generator_url:
        out["generatorURL"] = generator_url
    return out


class AlertmanagerSink:
    name = "alertmanager"
    wants_state = True  # re-sends firing alerts even in ticks without transitions

    def __init__(
        self,
        base_url: str,
        timeout_seconds: float,
        resend_seconds: float,
        runbook_base: str = "docs/runbook.md",
        session: requests.Session | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/api/v2/alerts"
        self.target = redact_text(self.url)  # what logs and results show (userinfo, ?token=)
        self.timeout_seconds = timeout_seconds
        self.resend_seconds = resend_seconds
        self.runbook_base = runbook_base
        self.session = session or requests.Session()
        self._sent: dict[AlertKey, float] = {}  # firing alert → last time Alertmanager took it
        self._resolved: dict[AlertKey, tuple[Alert, float]] = {}  # to send: (alert, resolved at)

    def deliver(
        self, transitions: Sequence[Transition], alerts: Sequence[Alert], now: float
    ) -> list[SinkResult]:
        for t in transitions:
            key = t.alert.key
            if t.resolved:
                self._resolved[key] = (t.alert, now)
                self._sent.pop(key, None)
            elif t.current is AlertState.FIRING:
                self._resolved.pop(key, None)
                self._sent.pop(key, None)  # new: send now, whatever the resend clock says
        for key, (_, at) in list(self._resolved.items()):
            if now - at > RESOLVED_RETENTION_SECONDS:
                del self._resolved[key]
        live = {a.key for a in alerts if a.state is AlertState.FIRING}
        for key in list(self._sent):
            if key not in live:  # dropped without a transition (e.g. a reload): stop renewing
                del self._sent[key]
        due = [
            a
            for a in alerts
            if a.state is AlertState.FIRING
            and (a.key not in self._sent or now - self._sent[a.key] >= self.resend_seconds)
        ]
        resolved = list(self._resolved.values())
        if not due and not resolved:
            return []
        ends = now + ENDS_AT_RESENDS * self.resend_seconds
        body = [am_alert(a, ends, self.runbook_base) for a in due]
        body += [am_alert(a, at, self.runbook_base) for a, at in resolved]
        result = self.post(body)
        if result.ok:
            for a in due:
                self._sent[a.key] = now
            for a, _ in resolved:
                self._resolved.pop(a.key, None)
        return [result]

    def post(self, body: list[dict[str, Any]]) -> SinkResult:
        start = time.monotonic()
        try:
            resp = self.session.post(
                self.url,
                json=body,
                timeout=self.timeout_seconds,
                headers={"User-Agent": "vllm-guardian"},
            )
            text = resp.text[:200]
            resp.close()
        except requests.RequestException as e:
            error = redact_url_in(str(e), self.url)
            took = time.monotonic() - start
            return SinkResult(self.name, self.target, False, len(body), took, error=error)
        except Exception as e:  # never raise into the tick, whatever the library does
            error = redact_url_in(repr(e), self.url)
            took = time.monotonic() - start
            return SinkResult(self.name, self.target, False, len(body), took, error=error)
        ok = 200 <= resp.status_code < 300
        return SinkResult(
            self.name,
            self.target,
            ok,
            len(body),
            time.monotonic() - start,
            resp.status_code,
            None if ok else f"HTTP {resp.status_code}: {redact_text(text)}",
        )

    def close(self) -> None:
        self.session.close()
