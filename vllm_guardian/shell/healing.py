"""The act half of the tick: apply the effects of the pure ``core/step.step`` in one place.

Where it sits: the daemon collects a snapshot and calls :meth:`Healing.run`, which hands it to
the tick driver (``core/driver.py``: the history window, then ``step``: signals → alerts →
policy → readiness, all pure) and then applies its effects, in order:

1. alert transitions are queued to the sinks (delivery never blocks the tick); those the step
   inhibited (vLLM down because of the guardian's own restart: ``core/inhibition.py``) are not,
   and firing alerts it inhibits are not re-sent to Alertmanager;
2. the blocking calls the phases asked for (bundle, flags file, restart) start in the
   background (``actuators/executor.py``); their results enter the next snapshot;
3. escalations are logged for a person;
4. every decision goes to the audit log and the log;
5. ``/ready/<service>`` answers what the step said (in dry-run it stays open and says what it
   would do);
6. the policy state is saved atomically, so rungs, budget, breaker and an action under way
   survive a restart of the guardian. A corrupt state file is set aside with a warning.

Operator commands (pause, resume, restart, relaunch) arrive from the control socket thread; a
lock serialises them with the tick.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.actuators.alerts import AlertDispatcher, load_rules
from vllm_guardian.actuators.audit import AuditLog
from vllm_guardian.actuators.bundle import BundleWriter
from vllm_guardian.actuators.executor import OpRunner, PermitBackend, RestartBackend
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.actuators.systemd import SystemdBackend
from vllm_guardian.config import Config
from vllm_guardian.core import alerting, inhibition, policy
from vllm_guardian.core import step as core_step
from vllm_guardian.core.driver import Driver, history_span_seconds, settings_from_config
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.signals import Signals
from vllm_guardian.formats.allocator_format import ENV_DIR as ALLOCATOR_ENV_DIR
from vllm_guardian.formats.recorder import to_jsonable
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.model import (
    Action,
    ActionKind,
    Alert,
    AlertState,
    CommandKind,
    GateState,
    OperatorCommand,
    OpRequest,
    OpResult,
    Snapshot,
)
from vllm_guardian.shell.container import container_mode, pod_identity
from vllm_guardian.shell.statefile import load_state, save_state
from vllm_guardian.sources.unit import port_of

log = logging.getLogger("vllm_guardian.shell.healing")

# After its drain, the time vLLM gets to exit (free its GPU memory, end its workers) before the
# process manager's SIGKILL.
VLLM_EXIT_SECONDS = 30.0


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
    # Services whose vLLM is down because of the guardian, as the last step saw them.
    windows: tuple[inhibition.Window, ...] = ()


class Healing:
    def __init__(
        self,
        cfg: Config,
        clock: Clock,
        history: collections.deque[Snapshot] | None = None,
        backends: Mapping[str, RestartBackend] | None = None,
        dispatcher: AlertDispatcher | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.rules = load_rules(cfg.alerting)
        self.dispatcher = dispatcher or AlertDispatcher(cfg.alerting, clock)
        state_dir = Path(cfg.state_dir)
        self.state_path = state_dir / "policy-state.json"
        self.audit = AuditLog(state_dir / "audit.jsonl", identity=pod_identity(os.environ))
        names = [s.name for s in cfg.services]
        # The window (shared with the daemon's, which observes through a drain too), the
        # settings and the state: what surrounds the pure step, built as replay builds it.
        self.driver = Driver.for_config(cfg, self.rules, history)
        self.driver.state = core_step.initial(names, self._restore(self.state_path))
        self.supervisors: dict[str, Supervisor] = {}
        self._lock = threading.RLock()
        self._gates: dict[str, GateState] = {}
        self._windows: tuple[inhibition.Window, ...] = ()
        self._actions_total: dict[tuple[str, str, str, bool], int] = {}
        self._saved: policy.PolicyState | None = None
        self._started: dict[int, Action] = {}  # actions under way, for their bundles
        self.save_error: str | None = None
        self.recent: collections.deque[policy.Decision] = collections.deque(maxlen=20)
        # The decisions of the operator commands taken since the last tick, for its record.
        self._command_records: list[dict[str, Any]] = []
        if backends is None:
            backends = self._build_backends()
        # The recent decisions and alert transitions (JSON, as recorded): the alert and phase
        # lanes of each bundle's incident picture.
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=2000)
        self._bundle_paths: dict[int, str] = {}  # action → its bundle, drawn again at its end
        self.bundles = BundleWriter(
            state_dir / "bundles",
            self._bundle_context,
            cfg.policy.bundle_timeout_seconds,
            events=lambda: list(self._events),
        )
        self.runner = OpRunner(
            clock, state_dir, dict(backends), self._capture_bundle, self._fleet_permits(cfg)
        )
        # Each recent action's decisions, for `vllm-guardian restart|relaunch` to follow.
        self.action_log: collections.OrderedDict[int, list[policy.Decision]] = (
            collections.OrderedDict()
        )

    def _restore(self, path: Path) -> policy.PolicyState | None:
        """The saved state, its times bounded by this clock (a guardian whose clock ran ahead
        saved them: policy.bound_saved_times)."""
        saved = load_state(path)
        if saved is None:
            return None
        bounded, notes = policy.bound_saved_times(saved, self.clock.time(), self.settings.policy)
        if notes:
            log.warning(
                "policy state %s: saved times lie ahead of this clock (the guardian that saved "
                "it ran on a clock ahead?); bounded by now plus their durations: %s",
                path,
                "; ".join(notes),
            )
        return bounded

    @staticmethod
    def _fleet_permits(cfg: Config) -> PermitBackend | None:
        """The Lease adapter, only with fleet.permit: lease (lightkube is imported only here)."""
        f = cfg.fleet
        if f.permit != "lease" or f.model is None or f.pdb is None:
            return None
        try:
            from vllm_guardian.actuators.k8s_permit import LeasePermits  # noqa: PLC0415

            holder = pod_identity(os.environ).get("pod") or os.uname().nodename
            return LeasePermits.connect(
                f.model, f.pdb, holder, f.lease_ttl_seconds, f.api_server, f.namespace
            )
        except Exception as e:  # missing extra, no service account: every permit op says so
            log.error("fleet.permit is lease but the permit adapter cannot start: %s", e)
            return None

    @property
    def settings(self) -> core_step.StepSettings:
        return self.driver.settings

    @property
    def tick_state(self) -> core_step.TickState:
        return self.driver.state

    @tick_state.setter
    def tick_state(self, state: core_step.TickState) -> None:
        self.driver.state = state

    @property
    def state(self) -> policy.PolicyState:
        return self.tick_state.policy

    @property
    def alerts(self) -> Mapping[alerting.AlertKey, Alert]:
        return self.tick_state.alerts

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
                    stop_timeout_seconds=self.cfg.policy.drain_timeout_seconds + VLLM_EXIT_SECONDS,
                    exit_timeout_seconds=VLLM_EXIT_SECONDS,
                    tee_stdout=container_mode(os.environ),
                    extra_env=self._allocator_env(svc.name),
                    on_daemonized=functools.partial(self._audit_daemonized, svc.name),
                    port=port_of(svc.url),
                )
                self.supervisors[svc.name] = sup
                out[svc.name] = sup
            elif self.cfg.policy.backend == "systemd" and svc.unit:
                out[svc.name] = SystemdBackend(svc.unit, self.cfg.sources.unit.systemctl)
        return out

    def _audit_daemonized(self, service: str, notice: str) -> None:
        """The supervisor's thread: its command daemonized and it stopped restarting it."""
        decision = policy.Decision(
            self.clock.time(), service, policy.DecisionKind.SUPPRESSED, notice,
            withheld=policy.Withheld.DAEMONIZED,
        )  # fmt: skip
        if not self.audit.write([decision]):
            log.error("%s", self.audit.error)

    def _allocator_env(self, service: str) -> dict[str, str]:
        """Where the allocator plugin inside the vLLM we start writes: the directory the
        allocator source reads, one level per service (what the systemd drop-in's
        RuntimeDirectory= gives a unit). Created now, so vLLM's first write finds it; if it
        cannot be created, vLLM runs without the plugin's numbers and the warning says why."""
        src = self.cfg.sources.allocator
        if not src.enabled:
            return {}
        directory = Path(src.directory) / service
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("%s: cannot create the allocator directory %s: %s", service, directory, e)
            return {}
        return {ALLOCATOR_ENV_DIR: str(directory)}

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for sup in self.supervisors.values():
            sup.start()

    def close(self, drained_seconds: float = 0.0) -> None:
        """Stop the vLLM this guardian runs: its own drain (the stop timeout), less the time the
        guardian already drained it through the front door (``Guardian.drain_before_stop``), so
        the two together stay within the stop timeout (a pod's grace period), and never less
        than the time vLLM takes to exit."""
        for sup in self.supervisors.values():
            sup.stop(max(VLLM_EXIT_SECONDS, sup.stop_timeout_seconds - drained_seconds))
        self.dispatcher.close()

    # --- what the actuators need ---------------------------------------------------------------

    def _bundle_context(self, service: str) -> tuple[Any, Sequence[Snapshot]]:
        return self.cfg.service(service), list(self.driver.history)

    def _capture_bundle(self, req: OpRequest) -> str | None:
        action = self._started.get(req.action_id) or Action(
            req.action_id, req.service, ActionKind.RESTART, req.cause, req.reason, (), False,
            req.flags, req.env,
        )  # fmt: skip
        where = self.bundles(action)
        if where is not None:
            self._bundle_paths[req.action_id] = where
        return where

    def take_results(self) -> tuple[OpResult, ...]:
        """The blocking calls that finished since the last tick: the next snapshot's
        ``op_results``."""
        return self.runner.take_results()

    # --- one tick ------------------------------------------------------------------------------

    def run(self, snapshot: Snapshot, now: float) -> tuple[Snapshot, Signals, list[dict[str, Any]]]:
        """Hand this tick's ``snapshot`` to the driver (window, then the pure step) and apply
        the effects. Returns the snapshot as stepped (with the operator commands taken since
        the last tick), the derived signals and the tick's records (the commands' decisions,
        then the step's decisions and alert transitions) for the flight recorder."""
        with self._lock:
            fx = self.driver.tick(snapshot, now)
            commands, self._command_records = self._command_records, []
            # Inhibited transitions are recorded too: their alert's inhibited_by says why.
            records = (
                commands
                + [to_jsonable(d) for d in fx.decisions]
                + [{"transition": to_jsonable(t)} for t in (*fx.transitions, *fx.inhibited)]
            )
            self._events.extend(records)  # before _apply: an action's end redraws its picture
            self._apply(fx)
            return self.driver.history[-1], fx.signals, records

    def _apply(self, fx: core_step.Effects) -> None:
        try:  # queued: a slow webhook never delays the tick
            self.dispatcher.dispatch(fx.transitions, fx.notifying, fx.signals.time_seconds)
        except Exception:  # a sink bug must not stop healing
            log.exception("alert dispatch failed")
        for action in fx.actions:
            if action.kind is ActionKind.ESCALATE:
                log.error(
                    "ESCALATION for %s: %s (evidence: %s)",
                    action.service,
                    action.reason,
                    ", ".join(action.evidence),
                )
                self._count(action.service, action.kind.value, True, action.dry_run)
            elif not action.dry_run:
                self._started[action.id] = action
        for req in fx.ops:
            self.runner.start(req)
        for r in fx.results:
            self._started.pop(r.action_id, None)
            if (bundle := self._bundle_paths.pop(r.action_id, None)) is not None:
                self.bundles.redraw(Path(bundle), r.service)
            self._count(r.service, r.kind.value, r.ok, r.dry_run)
        self._audit(fx.decisions)
        self._gates = with_restarts(fx.gates, self.state)
        self._windows = fx.windows
        self._save()

    def _count(self, service: str, kind: str, ok: bool, dry: bool) -> None:
        key = (service, kind, "ok" if ok else "failed", dry)
        self._actions_total[key] = self._actions_total.get(key, 0) + 1

    def _audit(self, decisions: Sequence[policy.Decision]) -> None:
        self.recent.extend(d for d in decisions if d.what is not policy.DecisionKind.SUPPRESSED)
        for d in decisions:
            if d.action_id is None:
                continue
            self.action_log.setdefault(d.action_id, []).append(d)
            self.action_log.move_to_end(d.action_id)
            while len(self.action_log) > 32:
                self.action_log.popitem(last=False)
        if not self.audit.write(decisions):
            log.error("%s", self.audit.error)
        loud = (
            policy.DecisionKind.ACTION,
            policy.DecisionKind.LATCH,
            policy.DecisionKind.GATE,
            policy.DecisionKind.OPERATOR,
        )
        for d in decisions:
            log.log(
                logging.WARNING if d.what in loud else logging.INFO,
                "policy %s [%s] %s%s%s",
                d.what.value,
                d.service,
                f"{d.phase.value}: " if d.phase is not None else "",
                d.reason,
                " (dry-run)" if d.dry_run else "",
            )

    def _save(self) -> None:
        if self.state == self._saved:
            self.save_error = None
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

    def gates(self) -> dict[str, GateState]:
        """/ready/<service> as the last step decided it (what the endpoint answers)."""
        with self._lock:
            return dict(self._gates)

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
                windows=self._windows,
            )

    def control(self, cmd: str, service: str | None, **args: Any) -> dict[str, Any]:
        now = self.clock.time()
        if service is not None and service not in self.settings.policy.services:
            return {"ok": False, "error": f"unknown service {service!r}"}
        if cmd in ("restart", "relaunch"):
            return self._operator(cmd, service, now, args)
        if cmd == "action":
            with self._lock:
                got = self.action_log.get(int(args.get("action_id") or 0), [])
                running = next(
                    (s.action for s in self.state.services if s.action is not None
                     and s.action.action_id == args.get("action_id")),
                    None,
                )  # fmt: skip
                return {
                    "ok": True,
                    "decisions": [to_jsonable(d) for d in got],
                    "phase": running.phase.value if running is not None else None,
                }
        if cmd not in ("pause", "resume"):
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        with self._lock:
            decisions = self._command(OperatorCommand(now, CommandKind(cmd), service)).decisions
            self.audit.write(decisions)
            self._save()
        for d in decisions:
            log.warning("operator %s [%s]: %s", d.what.value, d.service, d.reason)
        return {"ok": True, "changed": [d.service for d in decisions]}

    def _command(self, cmd: OperatorCommand) -> policy.PolicyOutput:
        """Through the driver (the caller holds the lock): applied now, kept in the next
        snapshot, its decisions in the next tick's flight record, so replay applies it again."""
        out = self.driver.command(cmd)
        self._command_records.extend(to_jsonable(d) for d in out.decisions)
        return out

    def _operator(
        self, cmd: str, service: str | None, now: float, args: Mapping[str, Any]
    ) -> dict[str, Any]:
        """`vllm-guardian restart|relaunch SERVICE`: the same phases as the policy's actions."""
        if service is None:
            return {"ok": False, "error": f"{cmd} needs a service"}
        raw = args.get("sets") or []
        try:
            sets = tuple((str(f), str(v)) for f, v in raw)
            content = flagsfile.validate(sets, ())
        except (TypeError, ValueError) as e:  # FlagsRejected is a ValueError
            return {"ok": False, "error": f"flags rejected, nothing written: {e}"}
        if cmd == "restart" and (content.flags or args.get("reset")):
            return {"ok": False, "error": "restart takes no flags: use relaunch"}
        who = str(args.get("who") or "an operator")[:200]
        with self._lock:
            out = self._command(
                OperatorCommand(now, CommandKind(cmd), service, content.flags,
                                bool(args.get("reset")), who, bool(args.get("force")))
            )  # fmt: skip
            s = out.state.service(service)
            if out.actions and not s.front_door.open:
                # The front door closes with the command, not at the next tick: that tick may
                # wait on the bundle's capture, and a client honouring /ready must not be sent
                # in meanwhile (the drain would not count it; vLLM's SIGTERM would fail it).
                self._gates[service] = GateState(False, s.front_door.reason, _restarting(s))
            for action in out.actions:
                self._started[action.id] = action
            for req in out.ops:
                self.runner.start(req)
            self._audit(out.decisions)
            self._save()
        if not out.actions:
            refused = next((d.reason for d in out.decisions), "refused")
            return {"ok": False, "error": refused}
        return {"ok": True, "action_id": out.actions[0].id, "reason": out.actions[0].reason}

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
            self.driver.reconfigure(settings_from_config(cfg, rules), history_span_seconds(cfg))
            self.tick_state = replace(
                self.tick_state, policy=policy.initial_state(names, self.state, restarted=False)
            )


def _restarting(s: policy.ServiceState) -> bool:
    """A restart or relaunch of the service holds its front door (past its fleet permit's
    wait, during which the door stays open)."""
    a = s.action
    return a is not None and a.phase is not Phase.AWAITING_PERMIT


def with_restarts(
    gates: Sequence[tuple[str, GateState]], state: policy.PolicyState
) -> dict[str, GateState]:
    """/ready/<service> as the step decided it, saying where a restart or relaunch is in
    progress (whatever the reason given: "vLLM is not up" while it restarts, too): the gate
    lets the requests it holds then wait longer for the new engine (gate/admission.py)."""
    by_name = {s.service: s for s in state.services}
    out = {}
    for name, gate in gates:
        s = by_name.get(name)
        out[name] = replace(gate, restart_in_progress=s is not None and _restarting(s))
    return out
