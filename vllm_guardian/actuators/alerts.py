"""Alert delivery: fans each tick's alert transitions out to the configured sinks.

Where it sits: the act stage of the tick, right after ``core/alerting.evaluate``. The log sink
runs inline (the journal is the record that must not be skipped); every webhook and the
Alertmanager sink run on a worker thread of their own (each request bounded by
``alerting.timeout_seconds``), and :meth:`AlertDispatcher.dispatch` never waits for them, as
Prometheus's notifier queues and returns. A sink still busy from an earlier tick is not started
again: this tick's transitions wait in its bounded backlog and go out with its next delivery,
and its result is reported by the call after it finished. Nothing here raises.

Also here, because it reads files: :func:`load_rules`, the shipped rules plus the operator's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Protocol

from vllm_guardian.actuators.alert_log import AlertLogSink
from vllm_guardian.actuators.alertmanager import AlertmanagerSink
from vllm_guardian.actuators.webhook import WebhookSink
from vllm_guardian.config import AlertingConfig, read_text
from vllm_guardian.core.alert_rules import Rule, merge_rules, parse_rules
from vllm_guardian.core.alerting import SinkResult, Transition, sort_alerts
from vllm_guardian.lowio.clock import Clock
from vllm_guardian.model import Alert

log = logging.getLogger("vllm_guardian.alerts")

# Transitions held for a busy sink; beyond this the oldest are dropped (and counted): a
# receiver that is down for hours must not grow the guardian's memory.
MAX_BACKLOG_TRANSITIONS = 1000


class Sink(Protocol):
    name: str
    wants_state: bool  # deliver every tick (re-sends), not only when something changed

    def deliver(
        self, transitions: Sequence[Transition], alerts: Sequence[Alert], now: float
    ) -> list[SinkResult]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Batch:
    transitions: tuple[Transition, ...]
    alerts: tuple[Alert, ...]
    now: float


@dataclass
class _Slot:
    sink: Sink
    target: str
    pool: ThreadPoolExecutor | None  # None: runs inline
    future: Future[list[SinkResult]] | None = None
    backlog: list[_Batch] = field(default_factory=list)
    dropped: int = 0
    ok: bool | None = None  # last outcome, for logging only when it changes


def _run(sink: Sink, batches: Sequence[_Batch]) -> list[SinkResult]:
    out: list[SinkResult] = []
    # A state-keeping sink needs only the newest alert table, but every transition.
    for i, b in enumerate(batches):
        last = i == len(batches) - 1
        if b.transitions or (last and sink.wants_state):
            try:
                out.extend(sink.deliver(b.transitions, b.alerts, b.now))
            except Exception as e:  # the sinks do not raise; this keeps it true
                log.exception("alert sink %s raised", sink.name)
                out.append(SinkResult(sink.name, "", False, len(b.transitions), error=repr(e)))
    return out


class AlertDispatcher:
    def __init__(
        self,
        cfg: AlertingConfig,
        clock: Clock,
        sinks: Sequence[tuple[Sink, str]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.dropped_total = 0  # transitions dropped from a full backlog, ever
        if sinks is None:
            # Each target is what the sink's results name (redacted: a webhook's URL is often
            # its secret); the log below matches results to their sink by it.
            built: list[tuple[Sink, str]] = [(AlertLogSink(), "log")]
            for u in cfg.webhooks:
                hook = WebhookSink(u, cfg.timeout_seconds)
                built.append((hook, hook.target))
            if cfg.alertmanager_url:
                am = AlertmanagerSink(cfg.alertmanager_url, cfg.timeout_seconds, cfg.resend_seconds)
                built.append((am, am.target))
            sinks = built
        self.slots = [
            _Slot(
                sink,
                target,
                None
                if isinstance(sink, AlertLogSink)
                else ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"alert-{sink.name}"),
            )
            for sink, target in sinks
        ]

    def dispatch(
        self,
        transitions: Sequence[Transition],
        alerts: Sequence[Alert],
        now: float | None = None,
    ) -> list[SinkResult]:
        """Queue this tick's transitions (and, to Alertmanager, what is due for re-sending) and
        return at once: the log sink's result, and the results of deliveries that finished since
        the last call. Each sink sends on a thread of its own, one batch at a time; what arrives
        meanwhile waits in a bounded backlog (the oldest dropped first, counted)."""
        when = self.clock.time() if now is None else now
        batch = _Batch(tuple(transitions), sort_alerts(alerts), when)
        results: list[SinkResult] = []
        for slot in self.slots:
            if slot.pool is None:
                results.extend(_run(slot.sink, [batch]))
                continue
            if slot.future is not None and not slot.future.done():
                self._queue(slot, batch)
                queued = sum(len(b.transitions) for b in slot.backlog)
                results.append(
                    SinkResult(
                        slot.sink.name,
                        slot.target,
                        False,
                        0,
                        error=f"still sending from an earlier tick; {queued} transition(s) queued",
                    )
                )
                continue
            if slot.future is not None:  # finished after an earlier tick stopped waiting
                results.extend(slot.future.result())
                slot.future = None
            batches = [*slot.backlog, batch]
            slot.backlog = []
            if not any(b.transitions for b in batches) and not slot.sink.wants_state:
                continue
            slot.future = slot.pool.submit(_run, slot.sink, batches)
        # Never waited on (Prometheus's notifier queues too): a started delivery's result is
        # collected by a later call, so a receiver that hangs never delays a tick.
        for slot in self.slots:
            if slot.dropped:
                self.dropped_total += slot.dropped
                results.append(
                    SinkResult(
                        slot.sink.name,
                        slot.target,
                        False,
                        slot.dropped,
                        error=f"backlog full: {slot.dropped} transition(s) dropped",
                    )
                )
                slot.dropped = 0
        self._log(results)
        return results

    def queued(self) -> int:
        """Transitions waiting for a busy sink."""
        return sum(len(b.transitions) for slot in self.slots for b in slot.backlog)

    def _queue(self, slot: _Slot, batch: _Batch) -> None:
        slot.backlog.append(batch)
        total = sum(len(b.transitions) for b in slot.backlog)
        while total > MAX_BACKLOG_TRANSITIONS and len(slot.backlog) > 1:
            old = slot.backlog.pop(0)
            slot.dropped += len(old.transitions)
            total -= len(old.transitions)

    def _log(self, results: Sequence[SinkResult]) -> None:
        for slot in self.slots:
            mine = [
                r for r in results if r.sink == slot.sink.name and r.target in ("", slot.target)
            ]
            if not mine:
                continue
            ok = all(r.ok for r in mine)
            if not ok and slot.ok is not False:
                bad = next(r for r in mine if not r.ok)
                log.warning("alert sink %s %s failing: %s", slot.sink.name, slot.target, bad.error)
            elif ok and slot.ok is False:
                log.info("alert sink %s %s delivering again", slot.sink.name, slot.target)
            slot.ok = ok

    def close(self) -> None:
        for slot in self.slots:
            if slot.pool is not None:
                slot.pool.shutdown(wait=False, cancel_futures=True)
            slot.sink.close()


def default_rules_text() -> str:
    return (files("vllm_guardian") / "defaults" / "rules.yaml").read_text(encoding="utf-8")


def load_rules(cfg: AlertingConfig) -> tuple[Rule, ...]:
    """The shipped rules (unless ``default_rules: false``) with ``rules_file`` on top.
    Raises ConfigInvalid listing every error in the operator's file."""
    base = parse_rules(default_rules_text(), "vllm_guardian/defaults/rules.yaml")
    base = base if cfg.default_rules else ()
    if cfg.rules_file is None:
        return base
    text = read_text(cfg.rules_file)
    return merge_rules(base, parse_rules(text, cfg.rules_file))
