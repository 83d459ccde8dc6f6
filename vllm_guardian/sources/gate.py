"""Source: the admission gate's own account of what it holds and forwards (``GET /gate/status``).

Where it sits: collect stage of the tick, one collector per service that has a ``gate:``
section. The gate (``vllm-guardian gate``, its own process and unit) answers a small JSON
document on its listener; this reads the requests it has in flight to vLLM and the ones it
holds, so a drain waits on the gate's real count instead of guessing from vLLM's gauges.

A gate that is down, wedged or answering garbage is an *observation*, not a failure of the
source: the reading is a :class:`GateObservation` with ``reachable=False`` and the reason, and
whoever waits on the gate (the drain) must then act as if there were none. The whole read is
bounded by one total deadline (connect + answer, enforced by :mod:`vllm_guardian.lowio.httpget`),
never raises, and speaks plain HTTP with the standard library's client: the daemon never
imports the gate's aiohttp.
"""

from __future__ import annotations

import json
import math
from typing import Any

from vllm_guardian.config import GateConfig, GateSourceConfig, ServiceConfig
from vllm_guardian.lowio import httpget
from vllm_guardian.model import GateObservation, Reading, SourceKind

STATUS_PATH = "/gate/status"  # vllm_guardian/gate/proxy.py serves it
MAX_BODY_BYTES = 64 * 1024  # the document is a few hundred bytes


def connect_host(host: str) -> str:
    """Where to reach a gate that listens on ``host`` from this machine."""
    if host in ("", "0.0.0.0"):  # noqa: S104 (a wildcard to connect to, not to bind)
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _int(doc: dict[str, Any], key: str) -> int | None:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    return v


def _float(doc: dict[str, Any], key: str) -> float | None:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _bool(doc: dict[str, Any], key: str) -> bool | None:
    v = doc.get(key)
    return v if isinstance(v, bool) else None


def parse_status(body: bytes) -> GateObservation:
    """The gate's status document → an observation; anything unexpected is unreachable."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return GateObservation(False, error="the gate's status is not JSON")
    if not isinstance(doc, dict):
        return GateObservation(False, error="the gate's status is not a JSON object")
    in_flight, queued = _int(doc, "in_flight"), _int(doc, "queue_depth")
    if in_flight is None or queued is None:
        return GateObservation(
            False, error="the gate's status has no in_flight/queue_depth: not a vllm-guardian gate?"
        )
    reason = doc.get("reason")
    return GateObservation(
        reachable=True,
        in_flight=in_flight,
        queued=queued,
        open=_bool(doc, "open"),
        reason=str(reason)[:200] if reason is not None else None,
        upstream_healthy=_bool(doc, "upstream_healthy"),
        guardian_ready=_bool(doc, "guardian_ready"),
        oldest_wait_seconds=_float(doc, "oldest_wait_seconds"),
        arrived_total=_int(doc, "arrived_total"),
        held_total=_int(doc, "held_total"),
        retried_total=_int(doc, "retried_total"),
        rejected_total=_int(doc, "rejected_total"),
        unanswered=_int(doc, "unanswered"),
        oldest_unanswered_seconds=_float(doc, "oldest_unanswered_seconds"),
        loop_lag_max_seconds=_float(doc, "loop_lag_max_seconds"),
        cpu_busy_share=_float(doc, "cpu_busy_share"),
    )


def read_status(host: str, port: int, timeout_seconds: float) -> GateObservation:
    """One ``GET /gate/status`` within ``timeout_seconds`` in all; never raises."""
    h = connect_host(host)
    url = f"http://{f'[{h}]' if ':' in h else h}:{port}{STATUS_PATH}"
    try:
        resp = httpget.fetch(
            url,
            deadline_seconds=timeout_seconds,
            max_body_bytes=MAX_BODY_BYTES,
            headers={"Accept": "application/json"},
        )
    except httpget.HttpGetError as e:
        if e.failure is httpget.Failure.REFUSED:
            return GateObservation(False, error="connection refused: the gate is not running")
        if e.failure in (httpget.Failure.DEADLINE, httpget.Failure.CONNECT_TIMEOUT):
            return GateObservation(False, error=f"no answer within {timeout_seconds:g}s")
        if e.failure is httpget.Failure.TOO_LARGE:
            return GateObservation(False, error="the gate's status is larger than 64 KiB")
        return GateObservation(False, error=e.detail)
    if resp.status != 200:
        return GateObservation(False, error=f"GET {STATUS_PATH} answered HTTP {resp.status}")
    return parse_status(resp.body)


class GateCollector:
    kind = SourceKind.GATE

    def __init__(self, service: ServiceConfig, gate: GateConfig, cfg: GateSourceConfig) -> None:
        self.service: str | None = service.name
        # The daemon's own bound sits a little above the read's, so the read reports first.
        self.timeout_seconds = cfg.timeout_seconds + 0.5
        self._host, self._port = gate.listen_address
        self._timeout = cfg.timeout_seconds

    def collect(self) -> Reading:
        obs = read_status(self._host, self._port, self._timeout)
        if obs.reachable:
            return Reading(self.kind, self.service, obs)
        # The payload still goes into the snapshot (reachable=False is what a drain reads);
        # the error marks the source down, so the log and source_up say the gate is missing.
        return Reading(
            self.kind,
            self.service,
            obs,
            obs.error,
            f"is the gate running? systemctl status vllm-guardian-gate@{self.service}.service",
        )

    def close(self) -> None:
        """Nothing held between reads (one short connection each)."""
