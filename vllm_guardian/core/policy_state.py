"""The policy's records: the state kept per service between ticks, the settings, and what one
tick of ``core/policy.decide`` returns (the decisions of the audit log, the actions, the ops).

Pure data, read and written by every stage of the policy; the state is saved after each tick
(``statefile.py``), so a field added here needs a default a saved state can do without.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vllm_guardian.config import Config, PolicyConfig
from vllm_guardian.core import phases
from vllm_guardian.core.diagnosis import (
    Evidence,
)
from vllm_guardian.core.levers import (
    Baseline,
    Lever,
)
from vllm_guardian.model import (
    Action,
    ActionKind,
    ActionResult,
    Cause,
    OpRequest,
)


@dataclass(frozen=True)
class LogItem:
    """One log line's evidence, held until an action consumes it or it ages out."""

    cause: Cause
    name: str
    sentence: str
    seen_at: float
    agreed: tuple[str, ...] = ()  # the structural failures that agreed with it; () not yet

    def evidence(self) -> Evidence:
        return Evidence(self.cause, self.name, self.sentence, unambiguous=True)


@dataclass(frozen=True)
class Levels:
    """What vLLM runs with, as far as the policy sets it (``ServiceState.levels``): the rungs
    and what pins them, the operator's flags and baseline. A relaunch changes them before it
    restarts anything; the levels before are kept while its wait for a fleet permit lasts
    (``ServiceState.levels_before``), and restored when the wait ends without one."""

    rungs: tuple[tuple[Lever, int], ...] = ()
    last_step_up: tuple[tuple[Lever, float], ...] = ()
    pinned_until: tuple[tuple[Lever, float], ...] = ()
    # Flags an operator set with `vllm-guardian relaunch --set` (whitelisted, validated by the
    # shell before they get here); `--reset` clears them and every rung.
    operator_flags: tuple[tuple[str, str], ...] = ()
    baseline: Baseline | None = None


class FrontDoorHolder(StrEnum):
    """Who holds the front door closed (``FrontDoor.holder``): each opens only what it
    closed."""

    KV_PRESSURE = "kv_pressure"  # KV cache usage at the high watermark (core/tracking.py)
    FORECAST = "forecast"  # the exhaustion forecast (core/preemptive.py)
    ACTION = "action"  # a restart or relaunch of ours under way (core/acting.py)


@dataclass(frozen=True)
class FrontDoor:
    """The service's front door (``/ready/<service>`` and the gate): open, or held closed by
    one holder, and why. Read by ``core/step.py`` for the gate's state; written by who closes
    it and, when it ends, by what they hold it for."""

    holder: FrontDoorHolder | None = None  # None: open
    reason: str = "open"  # for a person; code reads ``holder``
    closed_at: float | None = None  # when KV pressure or the forecast last closed it

    @property
    def open(self) -> bool:
        return self.holder is None

    def opened(self, reason: str = "open") -> FrontDoor:
        return replace(self, holder=None, reason=reason)

    def closed(self, holder: FrontDoorHolder, reason: str, at: float | None = None) -> FrontDoor:
        """Closed by ``holder``; ``at``: the time the KV gate's minimum closed time runs from
        (None: kept)."""
        return FrontDoor(holder, reason, self.closed_at if at is None else at)


@dataclass(frozen=True)
class HoldOff:
    """What holds the next action off: the cooldown after one that worked (lagging counters
    must not trigger a second), the backoff after one that failed (doubling). Written when an
    action ends (``core/acting.finish``); read by the ladder and the pre-emptive stage."""

    cooldown_until: float = 0.0
    backoff_until: float = 0.0
    backoff_seconds: float = 0.0
    # The backoff follows a wait for a fleet permit that restarted nothing: it holds voluntary
    # actions only (a crash is acted on at once).
    backoff_voluntary_only: bool = False


@dataclass(frozen=True)
class ServiceState:
    service: str
    front_door: FrontDoor = FrontDoor()
    paused: bool = False
    breaker_latched: bool = False
    breaker_reason: str | None = None
    action: phases.ActionProgress | None = None  # the restart or relaunch under way
    hold_off: HoldOff = HoldOff()  # the cooldown after an action, the backoff after a failure
    restarts: tuple[float, ...] = ()  # guardian restarts/relaunches, for the budget
    early_failures: int = 0
    ready_since: float | None = None  # when our last action left the service ready
    started_seconds: float | None = None  # when the current vLLM process started (as seen)
    main_pid: int | None = None
    # The rungs, what pins them, the operator's flags and baseline: what vLLM runs with.
    levels: Levels = Levels()
    episodes: tuple[tuple[Cause, float], ...] = ()  # pressure episodes: (cause, start)
    active_causes: tuple[Cause, ...] = ()
    last_pressure_seconds: float | None = None
    last_note: str = ""  # the last "nothing done because ..." decision, to log it once
    # Instant evidence (log lines) not yet acted on, each with the structural signals that
    # agreed with it (core/diagnosis.corroborated): only those count. (A state file saved before
    # this field has `pending` instead, plain tuples: ignored on load, as nothing agreed then.)
    log_items: tuple[LogItem, ...] = ()
    # The structural failures seen last (core/diagnosis.structural_failures) and when.
    structural: tuple[str, ...] = ()
    structural_at: float | None = None
    watch_since: float | None = None  # the guardian's first look at this service
    # Since when the exhaustion forecast has named its current cause (preemptive_action).
    forecast_since: float | None = None
    # Pre-emptive actions taken: (cause, time), for "came back soon after the last one".
    forecast_actions: tuple[tuple[Cause, float], ...] = ()
    seen_up: bool = False  # /health has answered 200 at least once since then
    down_since: float | None = None  # when /health stopped answering 200
    # vLLM's running count while concurrency_overcommit is active, (time, running), within the
    # pressure window: its median is what the pool hosts (a single reading is noise: 1-7 and
    # 3-28 in the measured runs).
    running_samples: tuple[tuple[float, float], ...] = ()
    # The levels before the action waiting for a fleet permit changed them (None: no wait).
    levels_before: Levels | None = None

    def rung(self, lever: Lever) -> int:
        return dict(self.levels.rungs).get(lever, 0)

    @property
    def in_flight(self) -> int | None:
        """The id of the action under way, if any."""
        return self.action.action_id if self.action is not None else None


@dataclass(frozen=True)
class PolicyState:
    services: tuple[ServiceState, ...] = ()
    next_action_id: int = 1

    def service(self, name: str) -> ServiceState:
        for s in self.services:
            if s.service == name:
                return s
        return ServiceState(name)


@dataclass(frozen=True)
class PolicySettings:
    policy: PolicyConfig
    services: tuple[str, ...]
    rule_signals: Mapping[str, str] = field(default_factory=dict)  # alertname → signal
    # fleet.permit: lease — a voluntary action first waits this long at most for a fleet
    # permit (core/phases.py AWAITING_PERMIT); None: no permit (one host, the default).
    permit_timeout_seconds: float | None = None
    # A permit held is renewed this often while its action lasts (a third of the Lease's
    # duration); None: never.
    permit_renew_seconds: float | None = None
    # The command the guardian starts each service with (the process backend, a pod): the
    # operator's own flags, read before the process's /proc command line, which may show
    # nothing (the process just exited) or the guardian's flags on top.
    commands: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def commands_of(cfg: Config) -> dict[str, tuple[str, ...]]:
    """:attr:`PolicySettings.commands` from the config: the services the guardian starts."""
    if cfg.policy.backend != "process":
        return {}
    return {s.name: tuple(s.command) for s in cfg.services if s.command}


class DecisionKind(StrEnum):
    GATE = "gate"  # the front door closes (KV pressure)
    UNGATE = "ungate"
    ACTION = "action"  # an action starts (or, in dry-run, would)
    PHASE = "phase"  # an action under way moves to its next phase
    RESULT = "result"  # an action ended
    SUPPRESSED = "suppressed"  # evidence seen, nothing done, and why
    LATCH = "latch"  # the breaker latched: a person must `resume`
    STEP_UP = "step_up"
    PAUSE = "pause"
    RESUME = "resume"
    OPERATOR = "operator"  # an operator command, accepted or refused


class Withheld(StrEnum):
    """Why evidence was seen and nothing was done (a SUPPRESSED decision), for code to read:
    the reason text says the same with its figures, for a person."""

    BREAKER_LATCHED = "breaker_latched"  # a person must `resume` first
    EVIDENCE_SHORT = "evidence_short"  # findings, none strong enough to act on yet
    COOLDOWN = "cooldown"  # too soon after the last action
    BACKOFF = "backoff"  # too soon after a failed action
    EPISODES = "episodes"  # fewer episodes than the cause needs before a relaunch
    GATED_ONLY = "gated_only"  # KV pressure: gated and alerted; a relaunch's conditions fail
    AT_FLOOR = "at_floor"  # the lever is already as low as a relaunch would set it
    PINNED = "pinned"  # every lowered lever is pinned: no step up yet
    BUDGET_SPENT = "budget_spent"  # the restart budget is spent (no latch: nothing crashed)
    FORECAST_WAIT = "forecast_wait"  # a forecast whose plan waits (a quiet moment, growth) or pages
    UNCORROBORATED_LOG = "uncorroborated_log"  # a log line alone, held for a signal to agree
    DAEMONIZED = "daemonized"  # the process backend's command left it: restarting cannot help


@dataclass(frozen=True)
class Decision:
    """One line of the audit log: what was decided, why, on what evidence. Code reads the
    fields (``what``, ``action_kind``, ``phase``, ``ok``, ``withheld``, ``cause``), never
    ``reason``, which is written for a person."""

    time_seconds: float
    service: str
    what: DecisionKind
    reason: str
    cause: Cause | None = None
    evidence: tuple[str, ...] = ()
    action_id: int | None = None
    dry_run: bool = False
    phase: phases.Phase | None = None  # for PHASE decisions: the phase entered
    # The kind of the action this decision starts, moves or ends (None: no action, or one this
    # guardian run no longer knows).
    action_kind: ActionKind | None = None
    withheld: Withheld | None = None  # for SUPPRESSED decisions: why nothing was done
    # An action ended (its RESULT, or the LATCH of one that failed for good): did it work.
    ok: bool | None = None


@dataclass(frozen=True)
class PolicyOutput:
    state: PolicyState
    actions: tuple[Action, ...]  # actions started this tick (escalations included)
    decisions: tuple[Decision, ...]
    ops: tuple[OpRequest, ...] = ()  # blocking actuator calls to start
    results: tuple[ActionResult, ...] = ()  # actions that ended this tick
