"""Alert sink: a generic JSON webhook, one POST per alert transition.

Where it sits: the act stage of the tick; ``actuators/alerts.AlertDispatcher`` runs it on its
own worker thread so a slow receiver costs the tick at most ``alerting.timeout_seconds``.
The body is a flat JSON object (``payload``) that chat bridges and scripts can read without
knowing Alertmanager's format. Never raises: every outcome is a :class:`SinkResult`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import requests

from vllm_guardian.core.alerting import SinkResult, Transition
from vllm_guardian.lowio.redact import redact_text, redact_url_in
from vllm_guardian.model import Alert


def iso8601(t: float) -> str:
    """Unix seconds → RFC 3339 UTC with milliseconds, as Alertmanager and most receivers read."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def payload(t: Transition, now: float) -> dict[str, Any]:
    a = t.alert
    return {
        "version": 1,
        "source": "vllm-guardian",
        "status": "resolved" if t.resolved else t.current.value,
        "previous": t.previous.value,
        "alertname": a.name,
        "service": a.service,
        "labels": dict(a.labels),
        "severity": a.severity.value,
        "cause": a.cause.value if a.cause else None,
        "value": a.value,
        "stale": a.stale,
        "summary": a.summary,
        "runbook": a.runbook,
        "startsAt": iso8601(starts_at(a)),
        "endsAt": iso8601(now) if t.resolved else None,
        "time": iso8601(now),
    }


def starts_at(a: Alert) -> float:
    return a.firing_since_seconds if a.firing_since_seconds is not None else a.active_since_seconds


class WebhookSink:
    name = "webhook"
    wants_state = False  # only transitions matter; nothing is re-sent

    def __init__(
        self, url: str, timeout_seconds: float, session: requests.Session | None = None
    ) -> None:
        self.url = url
        # What logs and results show: a webhook's URL often is its secret (a Slack path, a
        # ?token=), and requests' errors quote it (redact.redact_url_in).
        self.target = redact_text(url)
        self.timeout_seconds = timeout_seconds
        self.session = session or requests.Session()

    def deliver(
        self, transitions: Sequence[Transition], alerts: Sequence[Alert], now: float
    ) -> list[SinkResult]:
        return [self.post(t, now) for t in transitions]

    def post(self, t: Transition, now: float) -> SinkResult:
        start = time.monotonic()
        try:
            resp = self.session.post(
                self.url,
                json=payload(t, now),
                timeout=self.timeout_seconds,
                headers={"User-Agent": "vllm-guardian"},
            )
            resp.close()
        except requests.RequestException as e:
            error = redact_url_in(_reason(e), self.url)
            return SinkResult(
                self.name, self.target, False, 1, time.monotonic() - start, error=error
            )
        except Exception as e:  # never raise into the tick, whatever the library does
            error = redact_url_in(repr(e), self.url)
            return SinkResult(
                self.name, self.target, False, 1, time.monotonic() - start, error=error
            )
        ok = 200 <= resp.status_code < 300
        return SinkResult(
            self.name,
            self.target,
            ok,
            1,
            time.monotonic() - start,
            resp.status_code,
            None if ok else f"HTTP {resp.status_code}",
        )

    def close(self) -> None:
        self.session.close()


def _reason(e: requests.RequestException) -> str:
    if isinstance(e, requests.Timeout):
        return f"timed out: {e}"
    if isinstance(e, requests.ConnectionError):
        return f"cannot connect: {e}"
    return f"{type(e).__name__}: {e}"
