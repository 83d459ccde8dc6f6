"""One tick in one place: the daemon and ``replay`` run the same tick driver (``core/driver.py``).

A real :class:`~vllm_guardian.shell.daemon.Guardian` (sources at the boundary scripted, a restart
backend that brings vLLM back with a new pid, a fake clock) lives through a prefill OOM: it
relaunches with fewer batched tokens, phase by phase. Its flight record is then replayed with the
same config; replay must produce exactly the daemon's decisions, each phase at the tick it
happened. The fake clock makes every phase land on a known tick; the restart call is a real
thread (the test waits for it before the next tick, as the daemon would see it a tick later).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_fixture
from vllm_guardian.actuators import audit
from vllm_guardian.config import Config, parse_config
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.policy import DecisionKind
from vllm_guardian.formats.recorder import read_records, snapshot_from_record
from vllm_guardian.lowio.clock import FakeClock
from vllm_guardian.model import (
    ActionKind,
    HealthProbe,
    HealthState,
    LogEvent,
    LogEventKind,
    LogReading,
    Reading,
    SourceKind,
    UnitState,
)
from vllm_guardian.shell.daemon import Guardian
from vllm_guardian.shell.healing import Healing
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics
from vllm_guardian.tools.replay import replay

GIB = 1024**3
CONFIG = """
state_dir: {d}/state
runtime_dir: {d}/run
interval_seconds: 2
services:
  - name: vllm
    url: http://127.0.0.1:9
recorder:
  path: {d}/flight.jsonl
policy:
  dry_run: false
  cooldown_seconds: 60
  drain_timeout_seconds: 30
  ready_timeout_seconds: 120
"""


class World:
    """What vLLM looks like this tick; the sources read it, the backend changes it."""

    def __init__(self) -> None:
        self.pid = 100
        self.up = True
        self.logs: tuple[LogEvent, ...] = ()
        self.restarts: list[float] = []
        self.clock: FakeClock | None = None
        self.metrics = "metrics-idle.prom"

    def restart(self, timeout_seconds: float, drain: bool = True) -> tuple[bool, bool, str]:
        assert self.clock is not None
        self.restarts.append(self.clock.time())
        self.pid += 1
        self.up = True
        return True, False, f"restarted (pid {self.pid})"


class Src:
    def __init__(self, kind: SourceKind, world: World) -> None:
        self.kind, self.service, self.timeout_seconds, self.world = kind, "vllm", 5.0, world

    def collect(self) -> Reading:
        w = self.world
        if self.kind is SourceKind.HEALTH:
            state = HealthState.UP if w.up else HealthState.ENGINE_DEAD
            return Reading(self.kind, "vllm", HealthProbe(state, 200 if w.up else 503, 0.01))
        if self.kind is SourceKind.UNIT:
            argv = ("vllm", "serve", "m", "--max-num-batched-tokens", "8192")
            unit = UnitState("vllm.service", "active", "running", "success", w.pid, 0, 0,
                             None, None, argv, (w.pid,))  # fmt: skip
            return Reading(self.kind, "vllm", unit)
        if self.kind is SourceKind.LOGS:
            recent, w.logs = w.logs, ()
            return Reading(self.kind, "vllm", LogReading((), recent, 0))
        if not w.up:
            return Reading(self.kind, "vllm", None, "connection refused")
        return Reading(self.kind, "vllm", parse_vllm_metrics(read_fixture(w.metrics)))

    def close(self) -> None:
        pass


def guardian_on(cfg: Config, clock: FakeClock, world: World) -> Guardian:
    """A guardian over ``world`` (its sources and its restart backend), on ``clock``."""
    kinds = (SourceKind.VLLM_METRICS, SourceKind.HEALTH, SourceKind.UNIT, SourceKind.LOGS)
    g = Guardian(cfg, clock=clock, collectors=[Src(k, world) for k in kinds], healing=False)
    g.healing = Healing(cfg, clock, g.history, backends={"vllm": world})
    return g


def test_replay_of_the_daemons_recording_makes_the_same_decisions_phase_by_phase(
    tmp_path: Path,
) -> None:
    cfg = parse_config(CONFIG.format(d=tmp_path))
    clock = FakeClock()
    world = World()
    world.clock = clock
    g = guardian_on(cfg, clock, world)
    try:
        for i in range(40):
            if i == 10:  # a prefill OOM kills the engine
                world.logs = (
                    LogEvent(
                        LogEventKind.CUDA_OOM,
                        clock.time(),
                        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB.",
                        (("tried_bytes", str(6 * GIB)),),
                    ),
                )
                world.up = False
            g.tick()
            g.healing.runner.join(30)  # a real thread: its result enters the next tick
            clock.advance(2)
    finally:
        g.close()

    records = [r for r in read_records(tmp_path / "flight.jsonl") if isinstance(r, dict)]
    live = [d for r in records for d in r["decisions"] if "transition" not in d]
    replayed = [
        line.body
        for line in replay([snapshot_from_record(r) for r in records], cfg)
        if line.kind == "decision"
    ]
    assert replayed == live, "replay and the daemon disagree:\n" + "\n".join(
        json.dumps(x) for x in [*live, "---", *replayed]
    )
    t0 = clock.time() - 80  # the first tick
    phases_seen = [(d["time_seconds"] - t0, d["phase"]) for d in live if d["what"] == "phase"]
    # The OOM is seen at t=20; the bundle and flags calls answer by the next tick (22), where
    # the drain finds nothing in flight (the engine is dead) and the restart starts; its result
    # arrives at 24, where the old pid is gone (GPU processes not visible) and vLLM is ready.
    assert phases_seen == [
        (20, "preparing"),
        (22, "draining"),
        (22, "restarting"),
        (24, "awaiting_vram"),
        (24, "awaiting_ready"),
    ], phases_seen
    assert [d["what"] for d in live if d["what"] in ("action", "result")] == ["action", "result"]
    result = next(d for d in live if d["what"] == "result")
    assert result["action_kind"] == "relaunch", result
    assert "--max-num-batched-tokens" in result["reason"]  # the new flags, said to a person
    assert len(world.restarts) == 1


def test_a_guardian_killed_mid_action_finds_the_action_again(tmp_path: Path) -> None:
    """kill -9 during a drain: the action was saved with the policy state when it started, so
    the next guardian (a new process: here a new Guardian over the same state directory) goes
    on with it, the same action, once against the budget, instead of deciding it again."""
    cfg = parse_config(CONFIG.format(d=tmp_path))
    clock = FakeClock()
    world = World()
    world.clock = clock
    world.metrics = "metrics-pressure-07.prom"  # 5 running, 27 waiting: the drain must wait
    first = guardian_on(cfg, clock, world)
    first.tick()
    reply = first.healing.control("restart", "vllm", who="test")  # type: ignore[union-attr]
    assert reply["ok"], reply
    for _ in range(3):
        clock.advance(2)
        first.tick()
        first.healing.runner.join(30)  # type: ignore[union-attr]
    phase = first.healing.state.service("vllm").action  # type: ignore[union-attr]
    assert phase is not None and phase.phase.value == "draining", phase
    # kill -9: no close(), no save beyond what each tick saved.
    clock.advance(2)
    second = guardian_on(cfg, clock, world)
    world.metrics = "metrics-idle.prom"  # the requests finish meanwhile
    for _ in range(10):
        second.tick()
        second.healing.runner.join(30)  # type: ignore[union-attr]
        clock.advance(2)
    second.close()
    decisions = audit.read(tmp_path / "state" / "audit.jsonl")
    started = [d for d in decisions if d.what is DecisionKind.ACTION]
    assert [d.action_id for d in started] == [reply["action_id"]], started
    # The second guardian goes on where the first stopped: draining again, for the same action.
    phases = [(d.action_id, d.phase) for d in decisions if d.what is DecisionKind.PHASE]
    assert phases.count((reply["action_id"], Phase.DRAINING)) == 2, phases
    result = [d for d in decisions if d.what is DecisionKind.RESULT]
    assert [(d.action_kind, d.action_id) for d in result] == [
        (ActionKind.RESTART, reply["action_id"])
    ], result
    assert not [d for d in decisions if d.what is DecisionKind.LATCH], decisions
    assert len(world.restarts) == 1
    state = second.healing.state.service("vllm")  # type: ignore[union-attr]
    # Decided once (one "action" record above); an operator's restart does not spend the
    # automatic restart budget at all.
    assert state.restarts == () and state.action is None


def test_an_operators_command_closes_the_front_door_at_once(tmp_path: Path) -> None:
    """/ready/<service> answers 503 from the command on, not from the next tick: the tick after
    the command may wait on the incident bundle's capture, and a client honouring /ready (a
    load balancer, the gate) must not be sent in meanwhile (seen on the real vLLM tier: a
    request sent then got vLLM's 500 at its SIGTERM)."""
    cfg = parse_config(CONFIG.format(d=tmp_path))
    clock = FakeClock()
    world = World()
    world.clock = clock
    g = guardian_on(cfg, clock, world)
    g.tick()
    assert g.healing.gates()["vllm"].ready
    reply = g.healing.control("relaunch", "vllm", sets=[("--max-num-seqs", "24")], who="test")
    assert reply["ok"], reply
    gate = g.healing.gates()["vllm"]
    assert not gate.ready and gate.reason, gate
    # ...and says a restart is in progress: the gate lets what it holds wait longer for it.
    assert gate.restart_in_progress, gate
    g.healing.runner.join(30)
    g.tick()
    under_way = g.healing.state.service("vllm").action is not None
    assert g.healing.gates()["vllm"].restart_in_progress is under_way
    g.close()


FLEET = """
fleet:
  permit: lease
  model: llama
  pdb: llama
  wait_timeout_seconds: 300
  lease_ttl_seconds: 90
"""


class Permits:
    """The fleet permit (actuators/executor.py PermitBackend): granted at the first try."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def acquire(self, now: float, timeout_seconds: float) -> tuple[bool, bool, str]:
        self.asked.append(now)
        return True, False, "permit vllm-guardian-llama-0 granted"

    def release_all(self, now: float, timeout_seconds: float) -> tuple[bool, bool, str]:
        return True, False, "released"


def test_replay_of_a_fleet_guardians_recording_waits_for_the_permit_as_the_daemon_did(
    tmp_path: Path,
) -> None:
    """fleet.permit: lease makes a voluntary action (the step back up after a crash lowered a
    rung) first take a fleet permit. Replay builds its settings from the config as the daemon
    does, so it asks for the permit at the same tick and reads its recorded grant: the same
    decisions, the permit phase included (a replay without the permit would drain at once)."""
    text = (
        CONFIG.format(d=tmp_path).replace("policy:\n", "policy:\n  stable_for_seconds: 30\n")
        + FLEET
    )
    cfg = parse_config(text)
    clock = FakeClock()
    world = World()
    world.clock = clock
    g = guardian_on(cfg, clock, world)
    permits = Permits()
    g.healing.runner.permits = permits  # type: ignore[union-attr]
    try:
        for i in range(80):
            if i == 10:  # a prefill OOM kills the engine: relaunched a rung lower, no permit
                world.logs = (
                    LogEvent(
                        LogEventKind.CUDA_OOM,
                        clock.time(),
                        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB.",
                        (("tried_bytes", str(6 * GIB)),),
                    ),
                )
                world.up = False
            g.tick()
            g.healing.runner.join(30)  # type: ignore[union-attr]
            clock.advance(2)
    finally:
        g.close()

    records = [r for r in read_records(tmp_path / "flight.jsonl") if isinstance(r, dict)]
    live = [d for r in records for d in r["decisions"] if "transition" not in d]
    replayed = [
        line.body
        for line in replay([snapshot_from_record(r) for r in records], cfg)
        if line.kind == "decision"
    ]
    phases = [d["phase"] for d in live if d["what"] == "phase"]
    assert "awaiting_permit" in phases and permits.asked, phases  # the daemon took a permit
    assert replayed == live, "replay and the daemon disagree:\n" + "\n".join(
        json.dumps(x) for x in [*live, "---", *replayed]
    )


def test_replay_applies_the_operators_commands_where_the_daemon_took_them(tmp_path: Path) -> None:
    """pause, resume and restart on the control socket act at once (the front door closes with
    the command) and are kept in the next tick's snapshot, their decisions in its record: replay
    applies them again at the same point, so it meets the daemon's decisions, the operator's
    restart phase by phase included (and a refused command's decision)."""
    cfg = parse_config(CONFIG.format(d=tmp_path))
    clock = FakeClock()
    world = World()
    world.clock = clock
    g = guardian_on(cfg, clock, world)
    healing = g.healing
    assert healing is not None
    commands = {
        3: ("pause", None, {}),
        6: ("resume", None, {}),
        8: ("restart", "vllm", {"who": "alice"}),
        9: ("restart", "vllm", {"who": "bob"}),  # refused: an action is under way
    }
    try:
        for i in range(20):
            g.tick()
            healing.runner.join(30)
            clock.advance(1)
            if i in commands:
                cmd, service, args = commands[i]
                healing.control(cmd, service, **args)
            clock.advance(1)
    finally:
        g.close()

    records = [r for r in read_records(tmp_path / "flight.jsonl") if isinstance(r, dict)]
    live = [d for r in records for d in r["decisions"] if "transition" not in d]
    said = [(d["what"], d["phase"]) for d in live]
    for want in [("pause", None), ("resume", None), ("action", None), ("operator", None),
                 ("phase", "draining"), ("result", None)]:  # fmt: skip
        assert want in said, (want, said)
    replayed = [
        line.body
        for line in replay([snapshot_from_record(r) for r in records], cfg)
        if line.kind == "decision"
    ]
    assert replayed == live, "replay and the daemon disagree:\n" + "\n".join(
        json.dumps(x) for x in [*live, "---", *replayed]
    )
    assert len(world.restarts) == 1
