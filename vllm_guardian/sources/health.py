"""Source: vLLM's ``/health`` and an optional deep probe (a real 1-token completion).

Where it sits: collect stage of the tick, one collector per service. ``/health`` answers 200
while the engine lives, 503 once it is dead (vLLM ≥ 0.11; 500 before), and the port refuses
connections while the model loads and after the server exits. Each of
those is an *observation*: the source is up whenever it could classify the answer.

``/health`` misses a hung engine (the API server still answers). The stall signature — requests
in the engine, no progress (``core/progress.py``) — is derived from metrics history; the
deep probe here is the other, opt-in, way to catch it, rate-limited to one generation per
``deep_probe_interval_seconds``.
"""

from __future__ import annotations

import json

from vllm_guardian.config import HealthSourceConfig, ServiceConfig
from vllm_guardian.lowio import httpget
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.model import DeepProbe, HealthProbe, HealthState, Reading, SourceKind

# /health answers with an empty body; its status is the answer. A body past this is not read.
HEALTH_MAX_BODY_BYTES = 64 * 1024
# /v1/models and a 1-token completion: a few KiB; a MiB is a broken (or hostile) server.
DEEP_MAX_BODY_BYTES = 1024 * 1024


# vLLM's elastic EP ScalingMiddleware (vllm/entrypoints/serve/elastic_ep/middleware.py, 0.32)
# answers every request, /health included, with 503 and this JSON while /scale_elastic_ep runs.
ELASTIC_EP_SCALING_ERROR = "The model is currently scaling. Please try again later."
# How the probe's error says so (kept in the incident bundle's health.json, read by diagnose).
SCALING_ERROR_PREFIX = "elastic EP scaling"


def classify_status(status_code: int, body: bytes = b"") -> HealthState:
    """/health's answer: 200 up; 503 (500 before 0.11) a dead engine, except the 503 of elastic
    EP's scaling, told by its body (a dead engine's 503 has none)."""
    if status_code == 200:
        return HealthState.UP
    if status_code == 503 and body and _elastic_ep_scaling(body):
        return HealthState.SCALING
    if status_code in (500, 503):
        return HealthState.ENGINE_DEAD
    return HealthState.ERROR


def _elastic_ep_scaling(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("error") == ELASTIC_EP_SCALING_ERROR


class HealthCollector:
    kind = SourceKind.HEALTH

    def __init__(self, service: ServiceConfig, cfg: HealthSourceConfig, clock: Clock) -> None:
        self.service: str | None = service.name
        self.timeout_seconds = cfg.timeout_seconds + (
            cfg.deep_probe_timeout_seconds if cfg.deep_probe else 0.0
        )
        self._base = service.url.rstrip("/")
        self._cfg = cfg
        self._clock = clock
        self._last_deep_monotonic: float | None = None
        self._last_deep: DeepProbe | None = None
        self._cancel = httpget.Cancel()
        # One connection kept between /health probes (httpget.KeepAlive: a restarted vLLM's
        # closed connection is dropped or retried once afresh; a hung one is bounded as ever).
        self._keep_alive = httpget.KeepAlive()
        # vLLM serves /is_paused only with VLLM_SERVER_DEV_MODE=1 (beside /pause): False once it
        # answered 404, so a server without it is not asked (and its access log not filled)
        # again until /health says it went away.
        self._pause_route: bool | None = None

    def collect(self) -> Reading:
        url = self._base + "/health"
        start = self._clock.monotonic()
        timeout = self._cfg.timeout_seconds
        try:
            resp = httpget.fetch(
                url,
                cancel=self._cancel,
                keep_alive=self._keep_alive,
                deadline_seconds=0.9 * timeout,  # under the tick's wait: this error shows
                max_body_bytes=HEALTH_MAX_BODY_BYTES,
                oversize=httpget.Oversize.TRUNCATE,
            )
            latency = self._clock.monotonic() - start
        except httpget.HttpGetError as e:
            if e.failure is httpget.Failure.CONNECT_TIMEOUT:
                probe = HealthProbe(
                    HealthState.TIMEOUT, None, None, f"no connection within {timeout:g}s"
                )
            elif e.failure is httpget.Failure.DEADLINE:
                probe = HealthProbe(
                    HealthState.TIMEOUT, None, None, f"no answer within {timeout:g}s"
                )
            elif e.failure is httpget.Failure.REFUSED:
                probe = HealthProbe(HealthState.REFUSED, None, None, "connection refused")
            else:
                probe = HealthProbe(HealthState.ERROR, None, None, e.detail)
            return Reading(self.kind, self.service, probe)
        state = classify_status(resp.status, resp.body)
        paused = self._paused(0.9 * timeout - latency) if state is HealthState.UP else None
        if state is not HealthState.UP:
            self._pause_route = None  # a restarted vLLM may serve /is_paused: ask it again
        deep = self._deep_probe() if state is HealthState.UP and self._cfg.deep_probe else None
        error = None if state is HealthState.UP else f"HTTP {resp.status}"
        if state is HealthState.SCALING:
            error = (
                f"HTTP {resp.status}: {SCALING_ERROR_PREFIX} (vLLM refuses every request until "
                "the data-parallel size has changed): not serving, not dead"
            )
        hint = (
            f"/health sent a body over {HEALTH_MAX_BODY_BYTES} bytes: read that far, judged by "
            "its status"
            if resp.truncated
            else None
        )
        return Reading(
            self.kind,
            self.service,
            HealthProbe(state, resp.status, latency, error, deep, paused),
            hint=hint,
        )

    def _paused(self, left_seconds: float) -> bool | None:
        """vLLM's ``GET /is_paused``: whether an operator paused its scheduler (``/pause``),
        which ``/metrics`` does not show. None when not served or not answered in time (it asks
        the engine core, which a hung engine never answers)."""
        if self._pause_route is False or left_seconds <= 0.05:
            return None
        try:
            resp = httpget.fetch(
                self._base + "/is_paused",
                cancel=self._cancel,
                keep_alive=self._keep_alive,
                deadline_seconds=left_seconds,
                max_body_bytes=HEALTH_MAX_BODY_BYTES,
            )
        except httpget.HttpGetError:
            return None
        if resp.status == 404:
            self._pause_route = False
            return None
        try:
            answer = json.loads(resp.body).get("is_paused") if resp.status == 200 else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            answer = None
        self._pause_route = True
        return answer if isinstance(answer, bool) else None

    def _deep_probe(self) -> DeepProbe | None:
        now = self._clock.monotonic()
        if (
            self._last_deep_monotonic is not None
            and now - self._last_deep_monotonic < self._cfg.deep_probe_interval_seconds
        ):
            return self._last_deep
        self._last_deep_monotonic = now
        self._last_deep = self._run_deep_probe()
        return self._last_deep

    def _run_deep_probe(self) -> DeepProbe:
        timeout = self._cfg.deep_probe_timeout_seconds
        start = self._clock.monotonic()
        try:
            models = httpget.fetch(
                self._base + "/v1/models",
                cancel=self._cancel,
                deadline_seconds=timeout,
                max_body_bytes=DEEP_MAX_BODY_BYTES,
            )
            data = json.loads(models.body).get("data") or []
            if models.status != 200 or not data:
                return DeepProbe(False, None, models.status, "GET /v1/models gave no model")
            model = str(data[0].get("id"))
            left = max(0.1, timeout - (self._clock.monotonic() - start))
            resp = httpget.fetch(
                self._base + "/v1/completions",
                cancel=self._cancel,
                method="POST",
                body=json.dumps(
                    {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
                ).encode(),
                headers={"Content-Type": "application/json"},
                deadline_seconds=left,
                max_body_bytes=DEEP_MAX_BODY_BYTES,
            )
            latency = self._clock.monotonic() - start
            ok = resp.status == 200 and bool(json.loads(resp.body).get("choices"))
            err = None if ok else f"HTTP {resp.status}"
            return DeepProbe(ok, latency, resp.status, err)
        except httpget.HttpGetError as e:
            if e.failure in (httpget.Failure.DEADLINE, httpget.Failure.CONNECT_TIMEOUT):
                return DeepProbe(False, None, None, f"no completion within {timeout:g}s")
            return DeepProbe(False, None, None, _short(e))
        except (ValueError, AttributeError, RecursionError) as e:
            return DeepProbe(False, None, None, _short(e))

    def interrupt(self) -> None:
        """Shutting down: end the fetch in progress now (SIGTERM never waits on vLLM)."""
        self._cancel.cut()
        self._keep_alive.close()

    def close(self) -> None:
        self._cancel.cut()
        self._keep_alive.close()  # the connection kept between probes


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:197] + "..."
