"""What surrounds ``core/step.step`` each tick, in one place: the settings built from the config,
the history window and the state one tick hands the next. Pure: time is an argument.

Where it sits: every runner of the tick holds one :class:`Driver` and hands it each snapshot
(the daemon through ``healing.py``, ``replay``, the virtual-time harness, the inhibition tests,
``bench/forecast.py``). They differ only in where the snapshot comes from and what they do with
the :class:`~vllm_guardian.core.step.Effects`; the settings, the window and the step are the
same, so a recording replayed with the daemon's config meets the daemon's decisions (a fleet
guardian's permit phase included).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import replace

from vllm_guardian.config import Config
from vllm_guardian.core import alert_rules, policy
from vllm_guardian.core.step import (
    Effects,
    StepSettings,
    TickState,
    command,
    initial,
    settings_for,
    step,
)
from vllm_guardian.model import OperatorCommand, Snapshot


def settings_from_config(cfg: Config, rules: Sequence[alert_rules.Rule]) -> StepSettings:
    """The step's settings from a config and its loaded rules: the only place they are built."""
    lease = cfg.fleet.permit == "lease"
    permit = cfg.fleet.wait_timeout_seconds if lease else None
    # Renewed three times per Lease duration: a renewal lost to a slow API server still
    # leaves two before a guardian mid-action loses its permit to another replica.
    renew = cfg.fleet.lease_ttl_seconds / 3 if lease else None
    return settings_for(
        rules,
        policy.PolicySettings(
            cfg.policy,
            tuple(s.name for s in cfg.services),
            {r.name: r.signal for r in rules},
            permit_timeout_seconds=permit,
            permit_renew_seconds=renew,
            commands=policy.commands_of(cfg),
        ),
        cfg.services,
        cfg.signals,
    )


def history_span_seconds(cfg: Config) -> float:
    """How far back the window reaches: the longest signal window, and two ticks to spare."""
    s = cfg.signals
    return max(
        s.rate_window_seconds,
        s.quantile_window_seconds,
        s.slope_window_seconds,
        2 * s.stall_seconds,
        s.capacity_window_seconds,
        s.forecast_window_seconds,
    ) + (2 * cfg.interval_seconds)


def remember(history: collections.deque[Snapshot], snapshot: Snapshot, span_seconds: float) -> None:
    """Append ``snapshot`` (the newest) and drop what fell out of the window the signals need
    (keeping at least the newest)."""
    history.append(snapshot)
    now = snapshot.time_seconds
    while len(history) > 1 and history[0].time_seconds < now - span_seconds:
        history.popleft()


class Driver:
    """The history window and the tick state, stepped one snapshot at a time.

    ``history`` may be shared with a caller that also observes without deciding (the daemon's
    drain at shutdown); the driver is the only one that steps.
    """

    def __init__(
        self,
        settings: StepSettings,
        span_seconds: float,
        state: TickState,
        history: collections.deque[Snapshot] | None = None,
    ) -> None:
        self.settings = settings
        self.span_seconds = span_seconds
        self.state = state
        self.history: collections.deque[Snapshot] = (
            history if history is not None else collections.deque()
        )
        self._commands: list[OperatorCommand] = []  # taken since the last tick, in order

    @classmethod
    def for_config(
        cls,
        cfg: Config,
        rules: Sequence[alert_rules.Rule],
        history: collections.deque[Snapshot] | None = None,
    ) -> Driver:
        """A driver for ``cfg`` and its loaded rules, from the initial state (a new run)."""
        settings = settings_from_config(cfg, rules)
        state = initial([s.name for s in cfg.services])
        return cls(settings, history_span_seconds(cfg), state, history)

    def observe(self, snapshot: Snapshot) -> None:
        """Into the window, without deciding."""
        remember(self.history, snapshot, self.span_seconds)

    def command(self, cmd: OperatorCommand) -> policy.PolicyOutput:
        """An operator's command, applied now (``core/step.command``) and kept for the next
        snapshot."""
        self.state, out = command(self.state, cmd, self.settings)
        self._commands.append(cmd)
        return out

    def tick(self, snapshot: Snapshot, now: float) -> Effects:
        """One tick: ``snapshot`` into the window, with the commands taken since the last tick
        (``history[-1]`` is the snapshot to record), then the step at ``now``. The snapshot
        stays in the window even if the step raises (the daemon goes on observing)."""
        if self._commands:
            snapshot = replace(snapshot, commands=tuple(self._commands))
            self._commands = []
        self.observe(snapshot)
        self.state, fx = step(self.state, list(self.history), now, self.settings)
        return fx

    def reconfigure(self, settings: StepSettings, span_seconds: float) -> None:
        """A reloaded config's settings; the window is trimmed at the next snapshot."""
        self.settings = settings
        self.span_seconds = span_seconds
