"""Actuator: runs the policy's actions in the background and reports how they ended.

Where it sits: the act stage. ``submit`` returns at once; the action runs in its own thread
while the daemon keeps ticking (and keeps observing: the drain and the waits below read the
latest tick through ``observe``). Finished actions come back through ``take_results`` and
enter the next snapshot as observations: the policy never assumes success.

A restart or relaunch, in order:

1. capture an incident bundle (time-boxed);
2. relaunch only: write the guardian-owned flags file (whitelisted, validated; a rejected flag
   is a terminal failure and nothing is restarted);
3. drain: the policy has closed ``/ready`` already; wait until vLLM has no running or waiting
   request, at most ``drain_timeout_seconds`` (vLLM ≥ 0.18 with ``--shutdown-timeout`` then
   drains again on the SIGTERM the restart sends);
4. restart through the backend (systemd or the process manager);
5. VRAM gate: wait until no process of the old instance holds memory on the GPUs;
6. wait for ``/health`` 200 and a fresh scrape, at most ``ready_timeout_seconds``.

Dry-run actions are not executed: they report at once, marked ``dry_run``. Nothing here raises
into the daemon; every failure is an :class:`ActionResult`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.clock import Clock
from vllm_guardian.config import PolicyConfig
from vllm_guardian.model import Action, ActionKind, ActionResult

log = logging.getLogger("vllm_guardian.executor")


class RestartBackend(Protocol):
    def restart(self, timeout_seconds: float) -> tuple[bool, bool, str]:
        """(ok, terminal, detail); never raises."""
        ...


@dataclass(frozen=True)
class Observation:
    """What the latest tick saw of one service (fed by the daemon)."""

    time_seconds: float
    running: float | None
    waiting: float | None
    health_up: bool | None
    main_pid: int | None
    gpu_pids: frozenset[int] | None  # pids holding memory on the service's GPUs (None: unknown)
    metrics_up: bool


Observe = Callable[[str], Observation | None]
Bundle = Callable[[Action], str | None]


class ActionExecutor:
    def __init__(
        self,
        clock: Clock,
        policy: PolicyConfig,
        state_dir: Path,
        backends: dict[str, RestartBackend],
        observe: Observe,
        capture_bundle: Bundle | None = None,
        poll_seconds: float = 0.5,
    ) -> None:
        self.clock = clock
        self.policy = policy
        self.state_dir = state_dir
        self.backends = backends
        self.observe = observe
        self.capture_bundle = capture_bundle
        self.poll_seconds = poll_seconds
        self._results: queue.SimpleQueue[ActionResult] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, action: Action) -> None:
        if action.kind is ActionKind.ESCALATE:
            log.error(
                "ESCALATION for %s: %s (evidence: %s)",
                action.service,
                action.reason,
                ", ".join(action.evidence),
            )
            return
        if action.dry_run:
            what = f"dry-run: would {action.kind.value}" + (
                f" with {_describe(action)}" if action.kind is ActionKind.RELAUNCH else ""
            )
            log.warning("%s: %s — %s", action.service, what, action.reason)
            self._results.put(self._result(action, True, False, what))
            return
        t = threading.Thread(
            target=self._run, args=(action,), name=f"action-{action.id}", daemon=True
        )
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def take_results(self) -> tuple[ActionResult, ...]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return tuple(out)

    def busy(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout_seconds: float) -> None:
        for t in self._threads:
            t.join(timeout=timeout_seconds)

    # --- one action ----------------------------------------------------------------------------

    def _result(self, action: Action, ok: bool, terminal: bool, detail: str) -> ActionResult:
        return ActionResult(
            action.id,
            action.service,
            action.kind,
            ok,
            terminal,
            detail,
            self.clock.time(),
            action.dry_run,
        )

    def _run(self, action: Action) -> None:
        try:
            result = self._execute(action)
        except Exception as e:  # an executor bug must become a result, not a silent thread death
            log.exception("action %d failed unexpectedly", action.id)
            result = self._result(action, False, False, f"internal error: {type(e).__name__}: {e}")
        log.log(
            logging.INFO if result.ok else logging.ERROR,
            "%s: action %d %s: %s",
            action.service,
            action.id,
            "done" if result.ok else "FAILED",
            result.detail,
        )
        self._results.put(result)

    def _execute(self, action: Action) -> ActionResult:
        p = self.policy
        backend = self.backends.get(action.service)
        if backend is None:
            return self._result(
                action, False, True, "no restart backend for this service (unit or command missing)"
            )
        # The flags go first: when vLLM is already dying (an OOM), its supervisor's automatic
        # restart (systemd Restart=always, or the process manager) then starts it with them.
        if action.kind is ActionKind.RELAUNCH:
            try:
                content = flagsfile.validate(action.flags, action.env)
                flagsfile.write(flagsfile.path_for(self.state_dir, action.service), content)
            except flagsfile.FlagsRejected as e:
                return self._result(action, False, True, f"flags rejected, nothing restarted: {e}")
            except OSError as e:
                return self._result(action, False, False, f"cannot write the flags file: {e}")
        before = self.observe(action.service)
        bundle = self.capture_bundle(action) if self.capture_bundle is not None else None
        if self._restarted_on_its_own(action.service, before):
            drained, detail = (
                "no drain: vLLM had died",
                "vLLM restarted on its own after dying (no second restart)",
            )
        else:
            drained = self._drain(action.service)
            ok, terminal, detail = backend.restart(
                p.drain_timeout_seconds + p.ready_timeout_seconds
            )
            if not ok:
                return self._result(action, False, terminal, detail)
            released = self._wait_vram(action.service, before)
            if released is not None:
                return self._result(action, False, False, released)
        ready = self._wait_ready(action.service)
        if ready is not None:
            return self._result(action, False, False, ready)
        parts = [detail, drained, "ready"]
        if bundle:
            parts.append(f"bundle {bundle}")
        if action.kind is ActionKind.RELAUNCH:
            parts.insert(0, f"flags now: {_describe(action) or 'the operator baseline'}")
        return self._result(action, True, False, "; ".join(parts))

    def _restarted_on_its_own(self, service: str, before: Observation | None) -> bool:
        """A dead engine that its supervisor brings back (a new main pid within the VRAM-release
        time) needs no second restart: that start already read the flags written above. A
        unit that stays down (Restart=on-failure after exit 0) gets the restart."""
        if before is None or before.health_up is not False or before.main_pid is None:
            return False
        old = before.main_pid

        def new_pid() -> bool:
            o = self.observe(service)
            return o is not None and o.main_pid is not None and o.main_pid != old

        return self._wait(
            self.clock.monotonic() + self.policy.vram_release_timeout_seconds, new_pid
        )

    def _wait(self, deadline: float, check: Callable[[], bool]) -> bool:
        while True:
            if check():
                return True
            if self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(self.poll_seconds)

    def _drain(self, service: str) -> str:
        def idle() -> bool:
            o = self.observe(service)
            if o is None or o.running is None:
                return True  # nothing to wait for: not serving, or not visible
            return (o.running or 0) + (o.waiting or 0) <= 0

        start = self.clock.monotonic()
        if self._wait(start + self.policy.drain_timeout_seconds, idle):
            return f"drained in {self.clock.monotonic() - start:.0f}s"
        return f"drain timed out after {self.policy.drain_timeout_seconds:.0f}s (vLLM's --shutdown-timeout takes over)"

    def _wait_vram(self, service: str, before: Observation | None) -> str | None:
        old = before.main_pid if before is not None else None
        if old is None:
            return None

        def released() -> bool:
            o = self.observe(service)
            if o is None or o.gpu_pids is None:
                return True  # the GPU source cannot tell: do not block on it
            return old not in o.gpu_pids

        if self._wait(self.clock.monotonic() + self.policy.vram_release_timeout_seconds, released):
            return None
        return f"the old instance (pid {old}) still holds GPU memory after {self.policy.vram_release_timeout_seconds:.0f}s"

    def _wait_ready(self, service: str) -> str | None:
        since = self.clock.time()

        def ready() -> bool:
            o = self.observe(service)
            return o is not None and o.time_seconds > since and bool(o.health_up) and o.metrics_up

        if self._wait(self.clock.monotonic() + self.policy.ready_timeout_seconds, ready):
            return None
        return f"not ready within {self.policy.ready_timeout_seconds:.0f}s after the restart"


def _describe(action: Action) -> str:
    parts = [f"{f} {v}".strip() for f, v in action.flags] + [f"{k}={v}" for k, v in action.env]
    return " ".join(parts)
