"""Source: vLLM's ``/health`` and an optional deep probe (a real 1-token completion).

Where it sits: collect stage of the tick, one collector per service. ``/health`` answers 200
while the engine lives, 503 once it is dead (vLLM ≥ 0.11; 500 before), and the port refuses
connections while the model loads and after the server exits (vllm-surface.md §2). Each of
those is an *observation*: the source is up whenever it could classify the answer.

``/health`` misses a hung engine (the API server still answers). The stall signature — requests
waiting, no tokens generated — is derived from metrics history in ``core/signals.py``; the
deep probe here is the other, opt-in, way to catch it, rate-limited to one generation per
``deep_probe_interval_seconds``.
"""

from __future__ import annotations

import requests

from vllm_guardian.clock import Clock
from vllm_guardian.config import HealthSourceConfig, ServiceConfig
from vllm_guardian.model import DeepProbe, HealthProbe, HealthState, Reading, SourceKind


def classify_status(status_code: int) -> HealthState:
    if status_code == 200:
        return HealthState.UP
    if status_code in (500, 503):
        return HealthState.ENGINE_DEAD
    return HealthState.ERROR


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
        self._session = requests.Session()
        self._session.trust_env = False
        self._last_deep_monotonic: float | None = None
        self._last_deep: DeepProbe | None = None

    def collect(self) -> Reading:
        url = self._base + "/health"
        start = self._clock.monotonic()
        try:
            resp = self._session.get(
                url, timeout=(self._cfg.timeout_seconds, self._cfg.timeout_seconds)
            )
            latency = self._clock.monotonic() - start
            resp.close()
        except requests.exceptions.ConnectTimeout:
            probe = HealthProbe(
                HealthState.TIMEOUT,
                None,
                None,
                f"no connection within {self._cfg.timeout_seconds:g}s",
            )
            return Reading(self.kind, self.service, probe)
        except requests.exceptions.Timeout:
            probe = HealthProbe(
                HealthState.TIMEOUT, None, None, f"no answer within {self._cfg.timeout_seconds:g}s"
            )
            return Reading(self.kind, self.service, probe)
        except requests.exceptions.ConnectionError as e:
            if "refused" in str(e).lower():
                probe = HealthProbe(HealthState.REFUSED, None, None, "connection refused")
            else:
                probe = HealthProbe(HealthState.ERROR, None, None, _short(e))
            return Reading(self.kind, self.service, probe)
        except requests.exceptions.RequestException as e:
            probe = HealthProbe(HealthState.ERROR, None, None, _short(e))
            return Reading(self.kind, self.service, probe)
        state = classify_status(resp.status_code)
        deep = self._deep_probe() if state is HealthState.UP and self._cfg.deep_probe else None
        error = None if state is HealthState.UP else f"HTTP {resp.status_code}"
        return Reading(
            self.kind, self.service, HealthProbe(state, resp.status_code, latency, error, deep)
        )

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
            models = self._session.get(self._base + "/v1/models", timeout=timeout)
            data = models.json().get("data") or []
            if models.status_code != 200 or not data:
                return DeepProbe(False, None, models.status_code, "GET /v1/models gave no model")
            model = str(data[0].get("id"))
            resp = self._session.post(
                self._base + "/v1/completions",
                json={"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0},
                timeout=timeout,
            )
            latency = self._clock.monotonic() - start
            ok = resp.status_code == 200 and bool(resp.json().get("choices"))
            err = None if ok else f"HTTP {resp.status_code}"
            return DeepProbe(ok, latency, resp.status_code, err)
        except requests.exceptions.Timeout:
            return DeepProbe(False, None, None, f"no completion within {timeout:g}s")
        except (requests.exceptions.RequestException, ValueError, AttributeError) as e:
            return DeepProbe(False, None, None, _short(e))

    def close(self) -> None:
        self._session.close()


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:197] + "..."
