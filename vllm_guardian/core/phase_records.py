"""The records of an action's phases (``core/phases.py`` moves them on): the phases, their
time limits, what a phase reads of the tick (:class:`Seen`), the action's progress kept in the
service's state (:class:`ActionProgress`), and what one tick's advance returns. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vllm_guardian.config import PolicyConfig
from vllm_guardian.model import ActionKind, Cause, Op, OpRequest

# A restart call that has not returned this long after its own timeout is a lost call.
RESTART_CALL_MARGIN_SECONDS = 60.0
# A fleet permit that was refused ("not now") is asked for again after this.
PERMIT_RETRY_SECONDS = 15.0
# One try for a permit is a few API calls.
PERMIT_CALL_TIMEOUT_SECONDS = 30.0


class Phase(StrEnum):
    # A voluntary action (no crash) with fleet.permit: lease first waits for one of the fleet's
    # permits (core/permit.py); the front door stays open meanwhile. Released when it ends.
    AWAITING_PERMIT = "awaiting_permit"
    PREPARING = "preparing"  # the bundle is captured and (relaunch) the flags file written
    AWAITING_SELF_RESTART = "awaiting_self_restart"  # vLLM died: its supervisor may restart it
    DRAINING = "draining"  # front door closed: waiting for the requests in flight to finish
    RESTARTING = "restarting"  # the restart call is running
    AWAITING_VRAM = "awaiting_vram"  # the old instance's GPU memory must be freed
    AWAITING_READY = "awaiting_ready"  # /health 200 and a fresh scrape after the restart


# The front door is closed and the instance that was running when the action began is still
# the one vLLM's logs speak of. (AWAITING_PERMIT is not here: it still serves, and a crash
# while it waits for a permit is news.)
BEFORE_RESTART = frozenset({Phase.PREPARING, Phase.DRAINING, Phase.RESTARTING})


def phase_limit_seconds(
    phase: Phase, p: PolicyConfig, permit_timeout_seconds: float | None = None
) -> float:
    """How long an action may stay in ``phase``: its deadline is this after it entered it.
    The one table: :func:`start` and :func:`advance` set deadlines from it, and a restored
    action's deadline is bounded by it (a saved state from a clock that ran ahead)."""
    if phase is Phase.AWAITING_PERMIT:
        return permit_timeout_seconds or 0.0
    if phase is Phase.PREPARING:
        return p.bundle_timeout_seconds + 10.0
    if phase in (Phase.AWAITING_SELF_RESTART, Phase.AWAITING_VRAM):
        return p.vram_release_timeout_seconds
    if phase is Phase.DRAINING:
        return p.drain_timeout_seconds
    if phase is Phase.RESTARTING:  # the call's own timeout, then a lost call
        return p.drain_timeout_seconds + p.ready_timeout_seconds + RESTART_CALL_MARGIN_SECONDS
    return p.ready_timeout_seconds  # AWAITING_READY


@dataclass(frozen=True)
class Seen:
    """What this tick shows of one service, as far as the phases care."""

    time_seconds: float
    in_flight: float | None  # requests still being served (None: nothing to wait for / unknown)
    # "gate" (the front door's own count) | "vllm" (running + waiting; with why, when a
    # configured gate did not answer) | "" (nothing to count)
    in_flight_from: str
    health_up: bool | None
    listening: bool | None  # False: nothing answers on vLLM's port (exited, or starting)
    main_pid: int | None
    gpu_pids: frozenset[int] | None  # pids holding memory on the GPUs (None: cannot tell)
    metrics_up: bool
    stalled: bool = False  # requests in the engine and no progress (core/progress.py): hung
    engine_dead: bool = False  # /health answers 503 (a slow /health under load is not this)
    # services[].gpu_memory_by_device (a pod): NVML's pids are the host's, never vLLM's main
    # pid, so the old instance's memory is waited for on the service's devices instead:
    # (GPU index, the host pids NVML shows holding memory on it; None: it would not say).
    # None: NVML was not read this tick.
    by_device: bool = False
    device_pids: tuple[tuple[int, tuple[int, ...] | None], ...] | None = None
    # When vLLM's main process started (the snapshot's clock; None: unknown). A relaunch's
    # flags reach only a process started after its flags file was written.
    main_started_seconds: float | None = None


@dataclass(frozen=True)
class ActionProgress:
    """A restart or relaunch under way. Persisted with the policy state, so a guardian that is
    restarted mid-action finds it again (``orphaned``) instead of deciding it a second time."""

    action_id: int
    kind: ActionKind
    cause: Cause | None
    reason: str
    phase: Phase
    phase_since: float
    deadline: float
    started_seconds: float
    flags: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    old_pid: int | None = None  # vLLM's main pid when the action began
    waiting_ops: tuple[Op, ...] = ()  # calls asked for and not yet reported
    ready_after: float = 0.0  # only a scrape newer than this shows the new instance
    notes: tuple[str, ...] = ()  # what happened so far, for the result's detail
    operator: str | None = None  # who asked, when an operator command started it
    orphaned: bool = False  # the guardian restarted while this was under way
    permit_held: bool = False  # a fleet permit was granted: released when the action ends
    permit_retry_at: float = 0.0  # AWAITING_PERMIT: when to ask again after a "not now"
    permit_reason: str = ""  # AWAITING_PERMIT: why the last try was refused
    # A permit held: when to renew it (an action may outlast its Lease); None: never.
    permit_renew_at: float | None = None
    # When the guardian's restart call began: vLLM is down on purpose from here until it is
    # ready (core/inhibition.py holds the vLLM-down alerts meanwhile). None: not restarted by
    # the guardian (yet), e.g. its supervisor restarted it after a crash.
    stopped_seconds: float | None = None
    # By device (a pod): what each of the service's GPUs held when the restart was asked for:
    # the old instance (every process on a pod's GPU is its vLLM). AWAITING_VRAM waits until
    # none of those pids is left on its device. None: waits by ``old_pid`` (a host).
    old_device_pids: tuple[tuple[int, tuple[int, ...] | None], ...] | None = None
    # When the relaunch's flags file was written (the call's finish time); None: not yet.
    flags_written_seconds: float | None = None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    terminal: bool
    detail: str


@dataclass(frozen=True)
class Move:
    """One phase change, for the audit log."""

    phase: Phase
    why: str


@dataclass(frozen=True)
class Advance:
    progress: ActionProgress | None  # None once the action has ended
    moves: tuple[Move, ...]
    ops: tuple[OpRequest, ...]
    outcome: Outcome | None
