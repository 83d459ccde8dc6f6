"""vLLM-down alerts during the guardian's own restart: evaluated, shown, never delivered.

A restart or relaunch of a real model takes minutes (the model loads), and ``VllmEngineDead``
(``vllm_up == 0`` for 60 s, critical) would page the on-call person for something the guardian
did on purpose and is watching. Each case drives the daemon's tick driver (``core/driver.py``:
the window, then the pure ``core/step.step``) tick by tick on a fake clock (sources at their
parsing boundary, the blocking calls answered by hand) and reads its effects: ``transitions``
is what the shell delivers to the sinks, ``inhibited`` what it holds back, ``alerts`` what
status and the exposition show, ``firing`` what the policy read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tests.conftest import read_fixture
from vllm_guardian.actuators.alert_log import AlertLogSink
from vllm_guardian.actuators.alerts import AlertDispatcher, default_rules_text
from vllm_guardian.config import parse_config
from vllm_guardian.core import alert_rules, inhibition, policy
from vllm_guardian.core import step as core_step
from vllm_guardian.core.alerting import SinkResult, Transition
from vllm_guardian.core.driver import Driver
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import (
    ActionKind,
    Alert,
    AlertState,
    Cause,
    HealthProbe,
    HealthState,
    LogReading,
    Op,
    OpResult,
    Reading,
    Severity,
    SourceKind,
    SourceStatus,
    UnitState,
)
from vllm_guardian.shell.daemon import assemble
from vllm_guardian.shell.healing import Healing
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics

T0 = 1_000_000.0
TICK = 5.0
CONFIG = """
state_dir: /nonexistent/state
runtime_dir: /nonexistent/run
interval_seconds: 5
services:
  - name: vllm
    url: http://127.0.0.1:9
{command}
policy:
  dry_run: false
  backend: {backend}
  drain_timeout_seconds: 30
  vram_release_timeout_seconds: 60
  ready_timeout_seconds: {ready}
  startup_grace_seconds: 600
"""
DEAD = "VllmEngineDead"
METRICS_DOWN = "VllmGuardianMetricsSourceDown"


@dataclass
class World:
    """What vLLM looks like this tick, and the guardian's pure step over it."""

    backend: str = "systemd"
    ready_timeout_seconds: float = 900.0
    extra_rules: str = ""  # an operator's rules file, on top of the shipped rules
    metrics: str = "metrics-idle.prom"  # what vLLM's /metrics shows while it listens
    health: HealthState | None = HealthState.UP  # None: refused (not listening)
    pid: int = 100
    now: float = T0
    results: list[OpResult] = field(default_factory=list)
    fx: list[core_step.Effects] = field(default_factory=list)

    def __post_init__(self) -> None:
        command = "    command: [vllm, serve, m]" if self.backend == "process" else ""
        cfg = parse_config(
            CONFIG.format(command=command, backend=self.backend, ready=self.ready_timeout_seconds)
        )
        self.cfg = cfg
        rules = alert_rules.merge_rules(
            alert_rules.parse_rules(default_rules_text(), "rules.yaml"),
            alert_rules.parse_rules(self.extra_rules, "extra.yaml") if self.extra_rules else (),
        )
        self.driver = Driver.for_config(cfg, rules)

    @property
    def state(self) -> core_step.TickState:
        return self.driver.state

    @state.setter
    def state(self, state: core_step.TickState) -> None:
        self.driver.state = state

    def readings(self) -> list[Reading]:
        out: list[Reading] = []
        if self.health is None:
            out.append(Reading(SourceKind.VLLM_METRICS, "vllm", None, "connection refused"))
            out.append(
                Reading(SourceKind.HEALTH, "vllm",
                        HealthProbe(HealthState.REFUSED, None, None, "connection refused"))
            )  # fmt: skip
        else:
            out.append(
                Reading(SourceKind.VLLM_METRICS, "vllm",
                        parse_vllm_metrics(read_fixture(self.metrics)))
            )  # fmt: skip
            code = 200 if self.health is HealthState.UP else 503
            out.append(Reading(SourceKind.HEALTH, "vllm", HealthProbe(self.health, code, 0.01)))
        pid = self.pid if self.health is not None else None
        unit = UnitState("vllm.service", "active", "running", "success", pid, 0, 0, None, None,
                         ("vllm", "serve", "m"), (pid,) if pid else ())  # fmt: skip
        out.append(Reading(SourceKind.UNIT, "vllm", unit))
        out.append(Reading(SourceKind.LOGS, "vllm", LogReading((), (), 0)))
        return out

    def tick(self, seconds: float = TICK) -> core_step.Effects:
        self.now += seconds
        readings = self.readings()
        statuses = [
            SourceStatus(r.source, r.service, r.payload is not None and r.error is None, 0.001,
                         r.error)
            for r in readings
        ]  # fmt: skip
        results, self.results = self.results, []
        snap = assemble(self.now, ["vllm"], readings, statuses, results)
        fx = self.driver.tick(snap, self.now)
        self.fx.append(fx)
        for req in fx.ops:  # the bundle, flags and permit calls answer by the next tick
            if req.op is not Op.RESTART:
                self.results.append(
                    OpResult(req.action_id, req.service, req.op, True, False, "ok", self.now)
                )
        return fx

    def operator_restart(self) -> int:
        out = policy.operator_action(
            self.state.policy, "vllm", ActionKind.RESTART, (), False, "test", False, self.now,
            self.driver.settings.policy,
        )  # fmt: skip
        assert out.actions, out.decisions
        self.state = replace(self.state, policy=out.state)
        for req in out.ops:
            self.results.append(
                OpResult(req.action_id, req.service, req.op, True, False, "ok", self.now)
            )
        return out.actions[0].id

    def restart_returns(self, action_id: int) -> None:
        """The restart call returns: the old process is gone, the new one loads its model."""
        self.pid += 1
        self.health = None
        self.results.append(
            OpResult(action_id, "vllm", Op.RESTART, True, False, "restarted", self.now)
        )

    def run_until(self, phase: str, limit: int = 20) -> None:
        for _ in range(limit):
            a = self.state.policy.service("vllm").action
            if a is not None and a.phase.value == phase:
                return
            self.tick()
        raise AssertionError(f"never reached {phase}: {self.state.policy.service('vllm')}")

    # --- what the effects said, over the whole run --------------------------------------------

    def delivered(self, name: str) -> list[tuple[str, str]]:
        return [
            (t.previous.value, t.current.value)
            for fx in self.fx
            for t in fx.transitions
            if t.alert.name == name
        ]

    def held(self, name: str) -> list[str]:
        return [
            t.alert.inhibited_by or ""
            for fx in self.fx
            for t in fx.inhibited
            if t.alert.name == name
        ]

    def fired(self, name: str) -> bool:
        return any(
            a.name == name and a.state is AlertState.FIRING for fx in self.fx for a in fx.alerts
        )


def planned_restart(w: World, load_ticks: int) -> int:
    """Serving vLLM; an operator's restart: drain, restart, then ``load_ticks`` of model load."""
    for _ in range(3):
        w.tick()
    action = w.operator_restart()
    w.run_until("restarting")
    w.restart_returns(action)
    w.tick()
    for _ in range(load_ticks):
        w.tick()
    return action


def test_a_planned_restart_with_a_long_model_load_does_not_page() -> None:
    w = World()
    action = planned_restart(w, load_ticks=60)  # 300 s of model load: VllmEngineDead's for is 60 s
    assert w.fired(DEAD), "the alert is evaluated as usual"
    shown = next(a for a in w.fx[-1].alerts if a.name == DEAD)
    # Firing, inhibited or not: the policy reads every firing alert (core/step.py).
    assert shown.state is AlertState.FIRING
    assert shown.inhibited_by == f"action {action} awaiting_ready", shown
    assert w.delivered(DEAD) == [], "nothing reaches the sinks"
    assert w.delivered(METRICS_DOWN) == []
    assert set(w.held(DEAD)) == {f"action {action} awaiting_ready"}, w.held(DEAD)
    # vLLM is ready: the action succeeds and the alert resolves, silently (never announced).
    w.health = HealthState.UP
    fx = w.tick()
    assert [r.ok for r in fx.results] == [True]
    assert w.delivered(DEAD) == []
    assert [(t.alert.name, t.resolved) for t in fx.inhibited if t.alert.name == DEAD] == [
        (DEAD, True)
    ]
    assert not any(a.name == DEAD for a in fx.alerts)


def test_an_action_that_fails_its_deadline_delivers_the_firing_alert_at_once() -> None:
    w = World(ready_timeout_seconds=120)
    planned_restart(w, load_ticks=10)  # 50 s: still pending, held
    assert w.delivered(DEAD) == []
    for _ in range(20):
        fx = w.tick()
        if fx.results:
            break
    assert [r.ok for r in fx.results] == [False], "not ready within 120 s"
    # The tick the action ends: the alert (firing since minutes) goes out now, no second `for`.
    assert [(t.alert.name, t.previous.value, t.current.value) for t in fx.transitions
            if t.alert.name == DEAD] == [(DEAD, "inactive", "firing")]  # fmt: skip
    shown = next(a for a in fx.alerts if a.name == DEAD)
    assert shown.inhibited_by is None
    assert w.delivered(DEAD) == [("inactive", "firing")]
    # From here it is an ordinary alert: its resolution is delivered too.
    w.health = HealthState.UP
    w.tick()
    assert w.delivered(DEAD) == [("inactive", "firing"), ("firing", "inactive")]


def test_an_alert_active_before_the_action_is_not_hidden() -> None:
    """A dead engine (503) pages; the guardian's restart of it hides nothing."""
    w = World()
    w.tick()
    w.health = HealthState.ENGINE_DEAD
    for _ in range(14):  # 70 s: VllmEngineDead fires, and the policy restarts the engine
        w.tick()
    assert ("pending", "firing") in w.delivered(DEAD), w.delivered(DEAD)
    a = w.state.policy.service("vllm").action
    assert a is not None, "the policy restarts a dead engine"
    w.run_until("restarting")
    w.restart_returns(a.action_id)
    for _ in range(30):
        w.tick()
    assert w.held(DEAD) == []
    w.health = HealthState.UP
    w.tick()
    assert w.delivered(DEAD)[-1] == ("firing", "inactive")


@pytest.mark.parametrize(
    ("backend", "held"),
    [
        ("process", True),  # the guardian started vLLM: its first model load is its own doing
        ("systemd", False),  # systemd started it: the guardian did not, and says so
    ],
)
def test_the_first_model_load_after_a_start_the_guardian_made(backend: str, held: bool) -> None:
    w = World(backend=backend, health=None)
    for _ in range(30):  # 150 s of model load from the guardian's first tick
        w.tick()
    assert w.fired(DEAD)
    if held:
        assert w.delivered(DEAD) == []
        assert set(w.held(DEAD)) == {"start-up: the guardian started vLLM"}
    else:
        assert ("pending", "firing") in w.delivered(DEAD)
    w.health = HealthState.UP
    w.tick()
    assert not w.fired(DEAD) or all(a.name != DEAD for a in w.fx[-1].alerts)
    assert len(w.delivered(DEAD)) == (0 if held else 3)


def test_the_start_up_grace_ends_and_a_load_that_never_finishes_pages() -> None:
    w = World(backend="process", health=None)
    for _ in range(int(600 / TICK) - 1):
        w.tick()
    assert w.delivered(DEAD) == []
    w.tick()
    w.tick()
    assert w.delivered(DEAD) == [("inactive", "firing")]


def test_the_policy_reads_an_inhibited_alert_as_evidence() -> None:
    """Only delivery is inhibited: an engine that answers 503 during its first start (a real
    death, not a load) is restarted on VllmEngineDead while that alert is still held."""
    w = World(backend="process", health=None)
    w.tick()
    w.health = HealthState.ENGINE_DEAD
    for _ in range(16):
        w.tick()
    assert w.delivered(DEAD) == [] and w.held(DEAD), (w.delivered(DEAD), w.held(DEAD))
    started = [a for fx in w.fx for a in fx.actions]
    assert [a.kind for a in started] == [ActionKind.RESTART], started
    assert started[0].cause is Cause.ENGINE_DEAD and DEAD in started[0].evidence


def _rule(name: str, signal: str, cause: Cause | None) -> alert_rules.Rule:
    return alert_rules.Rule(
        name, signal, "==", 0, "bool", 60, 0, Severity.CRITICAL, cause, "s", "#x"
    )


@pytest.mark.parametrize(
    ("rule", "inhibited"),
    [
        (_rule("AnyName", "vllm_up", None), True),  # chosen by signal, not by name
        (_rule("VllmEngineDead", "kv_cache_usage_ratio", None), False),
        (_rule("X", "source_up.vllm_metrics", None), True),  # /metrics refused while it loads
        (_rule("X", "source_up.health", None), True),
        (_rule("X", "metrics_up", None), True),
        (_rule("X", "stalled", Cause.ENGINE_DEAD), True),  # chosen by cause
        (_rule("X", "log_events.engine_dead", Cause.ENGINE_DEAD), True),
        (_rule("X", "log_events.cuda_oom", None), False),  # an OOM during a load is news
        (_rule("X", "source_up.nvml", None), False),
        (_rule("X", "xid_reset_class", Cause.GPU_HARDWARE_FAULT), False),
    ],
)
def test_which_rules_a_planned_restart_inhibits(rule: alert_rules.Rule, inhibited: bool) -> None:
    assert inhibition.inhibitable(rule) is inhibited


def test_shipped_rules_that_are_inhibited() -> None:
    rules = alert_rules.parse_rules(default_rules_text(), "rules.yaml")
    assert sorted(r.name for r in rules if inhibition.inhibitable(r)) == [
        "VllmEngineDead",
        "VllmEngineDeathLogged",
        "VllmEngineStalled",
        "VllmGuardianHealthSourceDown",
        "VllmGuardianMetricsSourceDown",
        "VllmWorkerDiedLogged",
    ]


HELD_LONG = """
rules:
  - name: ServiceUnreachable
    signal: vllm_up
    op: "=="
    threshold: 0
    unit: bool
    for_seconds: 30
    keep_firing_for_seconds: 120
    severity: critical
    summary: "{service} unreachable"
    runbook: "#engine-dead"
"""


def test_a_held_alert_still_kept_firing_after_a_good_restart_resolves_unannounced() -> None:
    """An operator's rule on the same signal with keep_firing_for: the restart succeeded, the
    alert lingers two minutes more and resolves; the sinks hear nothing of it."""
    w = World(extra_rules=HELD_LONG)
    planned_restart(w, load_ticks=20)
    assert w.fired("ServiceUnreachable") and w.delivered("ServiceUnreachable") == []
    w.health = HealthState.UP
    fx = w.tick()
    assert [r.ok for r in fx.results] == [True]
    still = next(a for a in fx.alerts if a.name == "ServiceUnreachable")
    assert still.state is AlertState.FIRING and still.inhibited_by is not None
    for _ in range(30):
        w.tick()
    assert not any(a.name == "ServiceUnreachable" for a in w.fx[-1].alerts)
    assert w.delivered("ServiceUnreachable") == []
    assert ("firing", "inactive") in [
        (t.previous.value, t.current.value)
        for fx in w.fx
        for t in fx.inhibited
        if t.alert.name == "ServiceUnreachable"
    ]


def test_the_window_says_whether_vllm_was_serving_when_the_guardian_took_it_down() -> None:
    """vllm_guardian_vllm_down_expected (what the Prometheus rules join on) is 1 only for a
    vLLM the guardian took down while it served: a dead engine it restarts still pages there."""
    planned = World()
    planned_restart(planned, load_ticks=2)
    assert [(x.reason.split()[0], x.planned) for x in planned.fx[-1].windows] == [("action", True)]
    dead = World()
    dead.tick()
    dead.health = HealthState.ENGINE_DEAD
    for _ in range(14):
        dead.tick()
    a = dead.state.policy.service("vllm").action
    assert a is not None
    dead.run_until("restarting")
    dead.restart_returns(a.action_id)
    dead.tick()
    assert [x.planned for x in dead.fx[-1].windows] == [False]


class Recording(AlertLogSink):
    """A sink that runs inline (as the log sink does) and keeps what it was given."""

    wants_state = True  # like Alertmanager's: handed the firing alerts every tick

    def __init__(self) -> None:
        super().__init__()
        self.transitions: list[tuple[str, str]] = []
        self.firing: list[str] = []

    def deliver(
        self, transitions: Sequence[Transition], alerts: Sequence[Alert], now: float
    ) -> list[SinkResult]:
        self.transitions += [(t.alert.name, t.current.value) for t in transitions]
        self.firing += [a.name for a in alerts]
        return []


def test_the_shell_hands_the_sinks_nothing_inhibited(tmp_path: Path) -> None:
    """healing.py applies what the step's effects say: the sinks get the delivered transitions
    and, to re-send, only the firing alerts that are not inhibited."""
    w = World()
    planned_restart(w, load_ticks=20)
    assert w.fired(DEAD)
    cfg = parse_config(
        CONFIG.replace("/nonexistent", str(tmp_path)).format(
            command="", backend="systemd", ready=900
        )
    )
    clock = FakeClock(T0)
    sink = Recording()
    dispatcher = AlertDispatcher(cfg.alerting, clock, sinks=[(sink, "recording")])
    healing = Healing(cfg, clock, backends={}, dispatcher=dispatcher)
    try:
        for fx in w.fx:  # the calls were answered by the test's world: only the alerts here
            healing._apply(replace(fx, ops=(), actions=(), results=()))
    finally:
        healing.close()
    assert DEAD not in [n for n, _ in sink.transitions], sink.transitions
    assert DEAD not in sink.firing
    assert METRICS_DOWN not in [n for n, _ in sink.transitions]
    # What the exposition's vllm_guardian_vllm_down_expected reads.
    assert [(x.service, x.reason, x.planned) for x in healing.view().windows] == [
        ("vllm", "action 1 awaiting_ready", True)
    ]


def test_status_says_why_an_alert_is_not_delivered() -> None:
    from vllm_guardian.formats.recorder import to_jsonable
    from vllm_guardian.tools.cli import render_status

    w = World()
    planned_restart(w, load_ticks=20)
    fx = w.fx[-1]
    st = {"ok": True, "time": w.now, "signals": to_jsonable(fx.signals), "sources": [],
          "alerts": to_jsonable(fx.alerts)}  # fmt: skip
    lines = [x for x in render_status(st).splitlines() if x.startswith(f"alert {DEAD}")]
    assert lines == [
        f"alert {DEAD} [vllm] firing (inhibited by action 1 awaiting_ready): "
        "vllm: /health has not answered 200 for a minute"
    ], render_status(st)


def test_down_in_the_snapshot_of_the_tick_that_restarts_is_not_the_restarts_doing() -> None:
    """The tick that makes the restart call read its snapshot before deciding: vLLM already
    refusing there died by itself (an exit 0 while draining), and that still pages."""
    w = World(metrics="metrics-pressure-07.prom")  # 5 running, 27 waiting: the drain waits
    for _ in range(3):
        w.tick()
    w.operator_restart()
    w.tick()  # the bundle answers: draining
    assert w.state.policy.service("vllm").action.phase.value == "draining"  # type: ignore[union-attr]
    w.health = None  # vLLM exits on its own: the drain sees nothing listening and restarts
    for _ in range(3):
        w.tick()
        a = w.state.policy.service("vllm").action
        if a is not None and a.phase.value == "restarting":
            break
    a = w.state.policy.service("vllm").action
    assert a is not None and a.phase.value == "restarting", w.state.policy.service("vllm")
    assert a.stopped_seconds == w.now
    for _ in range(14):  # the restart call never returns here; vLLM stays down 70 s
        w.tick()
    assert ("pending", "firing") in w.delivered(DEAD), (w.delivered(DEAD), w.held(DEAD))
    assert [x.planned for x in w.fx[-1].windows] == [False]
