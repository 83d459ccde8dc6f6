"""The decide-and-act half of the tick: alerts, the policy, and the actuators that carry it out.

Where it sits: the daemon calls :meth:`Healing.run` after signals are derived. In order:

1. evaluate the alert rules (``core/alerting.py``, pure) with the policy's own figures of the
   previous tick (budget left, breaker) as extra signals, and send the transitions to the sinks;
2. ``core/policy.decide`` (pure) turns firing alerts, log lines and signals into decisions and
   actions;
3. the executor starts the actions in the background (their results come back through
   :meth:`take_results` into the next snapshot); the audit log records every decision;
4. the admission gate is published to ``/ready/<service>`` (in dry-run it stays open and says
   what it would do);
5. the policy state is saved atomically, so rungs, budget and breaker survive a restart of the
   guardian. A corrupt state file is set aside with a warning, never fatal.

Operator commands (pause, resume) arrive from the control socket thread; a lock serialises them
with the tick.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_guardian.actuators.alerts import AlertDispatcher, load_rules
from vllm_guardian.actuators.audit import AuditLog
from vllm_guardian.actuators.bundle import BundleWriter
from vllm_guardian.actuators.executor import ActionExecutor, Observation, RestartBackend
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.actuators.systemd import SystemdBackend
from vllm_guardian.clock import Clock
from vllm_guardian.config import Config
from vllm_guardian.core import alerting, policy
from vllm_guardian.core.signals import Signals
from vllm_guardian.model import (
    ActionKind,
    ActionResult,
    Alert,
    AlertState,
    GateState,
    HealthState,
    Snapshot,
)
from vllm_guardian.recorder import from_jsonable, to_jsonable

log = logging.getLogger("vllm_guardian.healing")

STATE_FORMAT = 1


@dataclass(frozen=True)
class HealingView:
    """What the exposition and `status` show of the decide-and-act half."""

    alerts: tuple[Alert, ...]
    state: policy.PolicyState
    dry_run: bool
    actions_total: tuple[
        tuple[tuple[str, str, str, bool], int], ...
    ]  # (service, action, result, dry) → n
    budget: int
    budget_window_seconds: float


def load_state(path: Path) -> policy.PolicyState | None:
    """The saved policy state, or None. A corrupt file is renamed aside, never fatal."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {raw.get('format')!r}")
        state: policy.PolicyState = from_jsonable(policy.PolicyState, raw["state"])
        return state
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        aside = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        log.warning(
            "policy state %s is unreadable (%s): set aside as %s; starting fresh", path, e, aside
        )
        return None


def save_state(path: Path, state: policy.PolicyState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(
                {"format": STATE_FORMAT, "state": to_jsonable(state)}, fh, separators=(",", ":")
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Healing:
    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        history: Sequence[Snapshot],
        backends: Mapping[str, RestartBackend] | None = None,
        dispatcher: AlertDispatcher | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self._history = history
        self.rules = load_rules(cfg.alerting)
        self.dispatcher = dispatcher or AlertDispatcher(cfg.alerting, clock)
        state_dir = Path(cfg.state_dir)
        self.state_path = state_dir / "policy-state.json"
        self.audit = AuditLog(state_dir / "audit.jsonl")
        names = [s.name for s in cfg.services]
        self.state = policy.initial_state(names, load_state(self.state_path))
        self.alerts: dict[alerting.AlertKey, Alert] = {}
        self.supervisors: dict[str, Supervisor] = {}
        self._lock = threading.RLock()
        self._latest: tuple[Snapshot, Signals] | None = None
        self._actions_total: dict[tuple[str, str, str, bool], int] = {}
        self._saved: policy.PolicyState | None = None
        self.save_error: str | None = None
        self.recent: collections.deque[policy.Decision] = collections.deque(maxlen=20)
        if backends is None:
            backends = self._build_backends()
        self.executor = ActionExecutor(
            clock,
            cfg.policy,
            state_dir,
            dict(backends),
            self.observe,
            BundleWriter(
                state_dir / "bundles", self._bundle_context, cfg.policy.bundle_timeout_seconds
            ),
        )
        self.settings = policy.PolicySettings(
            cfg.policy,
            tuple(names),
            {r.name: r.signal for r in self.rules},
            action_timeout_seconds=3
            * (
                cfg.policy.drain_timeout_seconds
                + cfg.policy.vram_release_timeout_seconds
                + cfg.policy.ready_timeout_seconds
                + cfg.policy.bundle_timeout_seconds
            ),
        )

    def _build_backends(self) -> dict[str, RestartBackend]:
        out: dict[str, RestartBackend] = {}
        for svc in self.cfg.services:
            if self.cfg.policy.backend == "process" and svc.command:
                log_path = (
                    Path(svc.log_file)
                    if svc.log_file
                    else Path(self.cfg.state_dir) / f"{svc.name}.log"
                )
                sup = Supervisor(
                    svc.name,
                    svc.command,
                    Path(self.cfg.state_dir) / f"{svc.name}.env",
                    log_path,
                    stop_timeout_seconds=self.cfg.policy.drain_timeout_seconds + 30,
                )
                self.supervisors[svc.name] = sup
                out[svc.name] = sup
            elif self.cfg.policy.backend == "systemd" and svc.unit:
                out[svc.name] = SystemdBackend(svc.unit, self.cfg.sources.unit.systemctl)
        return out

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for sup in self.supervisors.values():
            sup.start()

    def close(self) -> None:
        for sup in self.supervisors.values():
            sup.stop()
        self.dispatcher.close()

    # --- the executor's view of the latest tick ------------------------------------------------

    def observe(self, service: str) -> Observation | None:
        with self._lock:
            latest = self._latest
        if latest is None:
            return None
        snap, signals = latest
        sig = signals.service(service)
        ss = snap.service(service)
        if sig is None or ss is None:
            return None
        pids: frozenset[int] | None = None
        if snap.gpus is not None:
            pids = frozenset(p.pid for d in snap.gpus.devices for p in d.processes or ())
        return Observation(
            time_seconds=snap.time_seconds,
            running=sig.requests_running,
            waiting=sig.requests_waiting,
            health_up=None if sig.health_state is None else sig.health_state is HealthState.UP,
            main_pid=ss.unit.main_pid if ss.unit is not None else None,
            gpu_pids=pids,
            metrics_up=sig.metrics_up,
        )

    def _bundle_context(self, service: str) -> tuple[Any, Sequence[Snapshot]]:
        return self.cfg.service(service), list(self._history)

    def take_results(self) -> tuple[ActionResult, ...]:
        return self.executor.take_results()

    # --- one tick ------------------------------------------------------------------------------

    def extra_signals(self, now: float) -> dict[tuple[str, str], float | None]:
        return policy.published_signals(self.state, now, self.cfg.policy)

    def run(self, snapshot: Snapshot, signals: Signals, now: float) -> list[dict[str, Any]]:
        with self._lock:
            self._latest = (snapshot, signals)
            values = alerting.signal_values(signals, snapshot, self.extra_signals(now))
            self.alerts, transitions = alerting.evaluate(self.rules, self.alerts, values, now)
            current = alerting.sort_alerts(self.alerts.values())
            try:
                self.dispatcher.dispatch(transitions, alerting.firing(current), now)
            except Exception:  # a sink bug must not stop healing
                log.exception("alert dispatch failed")
            out = policy.decide(
                self.state, list(alerting.firing(current)), snapshot, signals, now, self.settings
            )
            self.state = out.state
            for action in out.actions:
                self.executor.submit(action)
            for r in snapshot.action_results:
                key = (r.service, r.kind.value, "ok" if r.ok else "failed", r.dry_run)
                self._actions_total[key] = self._actions_total.get(key, 0) + 1
            for a in out.actions:
                if a.kind is ActionKind.ESCALATE:
                    key = (a.service, a.kind.value, "ok", a.dry_run)
                    self._actions_total[key] = self._actions_total.get(key, 0) + 1
            self.recent.extend(d for d in out.decisions if d.what != "suppressed")
            if not self.audit.write(out.decisions):
                log.error("%s", self.audit.error)
            for d in out.decisions:
                log.log(
                    logging.WARNING if d.what in ("action", "latch", "gate") else logging.INFO,
                    "policy %s [%s] %s%s",
                    d.what,
                    d.service,
                    d.reason,
                    " (dry-run)" if d.dry_run else "",
                )
            self._save()
            return [to_jsonable(d) for d in out.decisions] + [
                {"transition": to_jsonable(t)} for t in transitions
            ]

    def _save(self) -> None:
        if self.state == self._saved:
            self.save_error = None  # what is on disk is the current state
            return
        try:
            save_state(self.state_path, self.state)
            self._saved = self.state
            self.save_error = None
        except OSError as e:
            self.save_error = f"cannot save the policy state to {self.state_path}: {e}"
            log.error("%s", self.save_error)

    def persist_error(self) -> str | None:
        """Why the last tick's state or decisions are not on disk; None when they are."""
        return self.save_error or self.audit.error

    # --- what others read --------------------------------------------------------------------

    def gates(self, signals: Signals) -> dict[str, GateState]:
        """/ready/<service>: closed when the policy gates it (unless dry-run) or vLLM is not up."""
        out = {}
        with self._lock:
            dry = policy.gate_dry_run(self.cfg.policy)
            for s in self.state.services:
                sig = signals.service(s.service)
                if sig is not None and sig.vllm_up is False:
                    out[s.service] = GateState(False, f"vLLM is not up ({sig.health_state})")
                elif not s.gate_open and not dry:
                    out[s.service] = GateState(False, s.gate_reason)
                elif not s.gate_open:
                    out[s.service] = GateState(True, f"dry-run: would answer 503 ({s.gate_reason})")
                else:
                    out[s.service] = GateState(True, "open")
        return out

    def view(self) -> HealingView:
        with self._lock:
            return HealingView(
                alerts=alerting.sort_alerts(
                    a for a in self.alerts.values() if a.state is not AlertState.INACTIVE
                ),
                state=self.state,
                dry_run=self.cfg.policy.dry_run,
                actions_total=tuple(sorted(self._actions_total.items())),
                budget=self.cfg.policy.restart_budget,
                budget_window_seconds=self.cfg.policy.restart_budget_window_seconds,
            )

    def control(self, cmd: str, service: str | None) -> dict[str, Any]:
        now = self.clock.time()
        if service is not None and service not in self.settings.services:
            return {"ok": False, "error": f"unknown service {service!r}"}
        with self._lock:
            if cmd == "pause":
                self.state, decisions = policy.pause(self.state, service, now)
            elif cmd == "resume":
                self.state, decisions = policy.resume(self.state, service, now)
            else:
                return {"ok": False, "error": f"unknown command {cmd!r}"}
            self.audit.write(decisions)
            self._save()
        for d in decisions:
            log.warning("operator %s [%s]: %s", d.what, d.service, d.reason)
        return {"ok": True, "changed": [d.service for d in decisions]}

    def reload(self, cfg: Config) -> None:
        """Take a new config's rules, sinks and policy settings. Restart backends and the
        process manager stay as they are: changing those needs a guardian restart."""
        rules = load_rules(cfg.alerting)  # raises ConfigInvalid before anything changes
        names = [s.name for s in cfg.services]
        with self._lock:
            self.dispatcher.close()
            self.dispatcher = AlertDispatcher(cfg.alerting, self.clock)
            self.rules = rules
            self.cfg = cfg
            self.executor.policy = cfg.policy
            self.settings = replace(
                self.settings,
                policy=cfg.policy,
                services=tuple(names),
                rule_signals={r.name: r.signal for r in rules},
            )
            self.state = policy.initial_state(names, self.state)
