"""Actuator: runs the blocking calls an action is made of, and reports how each ended.

Where it sits: the act stage. The policy's phases (``core/phases.py``) ask for three kinds of
call (``model.Op``): capture the incident bundle, write the guardian-owned flags file, restart
vLLM through its backend (systemd or the process manager). ``start`` returns at once; each call
runs in a thread of its own, and its :class:`~vllm_guardian.model.OpResult` comes back through
``take_results`` into the next snapshot, where the policy reads it. Nothing here waits on
vLLM, drains, or decides: every wait is a phase of the core, so it is audited, recorded and
replayable.

Nothing here raises into the daemon; every failure is an ``OpResult`` with ``ok=False``
(``terminal`` when retrying cannot help: rejected flags, no backend).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.model import Op, OpRequest, OpResult

log = logging.getLogger("vllm_guardian.executor")


class RestartBackend(Protocol):
    def restart(self, timeout_seconds: float, drain: bool = True) -> tuple[bool, bool, str]:
        """(ok, terminal, detail); never raises. ``drain=False``: nothing in flight can finish
        (a hung or dead engine), so the stop need not wait for a drain."""
        ...


class PermitBackend(Protocol):
    """The fleet permit (fleet.permit: lease; actuators/k8s_permit.py)."""

    def acquire(self, now: float, timeout_seconds: float) -> tuple[bool, bool, str]:
        """One try, ended within ``timeout_seconds``: (granted, terminal, detail); never
        raises."""
        ...

    def release_all(self, now: float, timeout_seconds: float) -> tuple[bool, bool, str]: ...


Bundle = Callable[[OpRequest], str | None]


class OpRunner:
    def __init__(
        self,
        clock: Clock,
        state_dir: Path,
        backends: dict[str, RestartBackend],
        capture_bundle: Bundle | None = None,
        permits: PermitBackend | None = None,
    ) -> None:
        self.clock = clock
        self.state_dir = state_dir
        self.backends = backends
        self.capture_bundle = capture_bundle
        self.permits = permits
        self._results: queue.SimpleQueue[OpResult] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self, req: OpRequest) -> None:
        t = threading.Thread(
            target=self._run, args=(req,), name=f"op-{req.action_id}-{req.op.value}", daemon=True
        )
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def take_results(self) -> tuple[OpResult, ...]:
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

    def _run(self, req: OpRequest) -> None:
        try:
            ok, terminal, detail = self._execute(req)
        except Exception as e:  # a bug must become a result, not a silent thread death
            log.exception("%s of action %d failed unexpectedly", req.op.value, req.action_id)
            ok, terminal, detail = False, False, f"internal error: {type(e).__name__}: {e}"
        log.log(
            logging.INFO if ok else logging.ERROR,
            "%s: action %d %s %s: %s",
            req.service,
            req.action_id,
            req.op.value,
            "done" if ok else "FAILED",
            detail,
        )
        self._results.put(
            OpResult(req.action_id, req.service, req.op, ok, terminal, detail, self.clock.time())
        )

    def _execute(self, req: OpRequest) -> tuple[bool, bool, str]:
        if req.op is Op.WRITE_FLAGS:
            try:
                content = flagsfile.validate(req.flags, req.env)
                flagsfile.write(flagsfile.path_for(self.state_dir, req.service), content)
            except flagsfile.FlagsRejected as e:
                return False, True, f"flags rejected: {e}"
            except OSError as e:
                return False, False, f"cannot write the flags file: {e}"
            return True, False, "flags file written"
        if req.op is Op.BUNDLE:
            if self.capture_bundle is None:
                return True, False, "not captured (no bundle writer)"
            where = self.capture_bundle(req)
            return (True, False, where) if where else (False, False, "no bundle (see the log)")
        if req.op in (Op.PERMIT, Op.RELEASE_PERMIT):
            if self.permits is None:
                return False, True, "no fleet permit backend (fleet.permit is not lease here)"
            # The call's timeout bounds the try, so its thread ends within the phase that asked
            # (0: none given).
            budget = req.timeout_seconds if req.timeout_seconds > 0 else math.inf
            if req.op is Op.PERMIT:
                return self.permits.acquire(self.clock.time(), budget)
            return self.permits.release_all(self.clock.time(), budget)
        backend = self.backends.get(req.service)
        if backend is None:
            return False, True, "no restart backend for this service (unit or command missing)"
        return backend.restart(req.timeout_seconds, drain=req.drain)
