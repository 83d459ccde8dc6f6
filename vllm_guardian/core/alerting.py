"""Alert rules as data, evaluated every tick with Prometheus semantics.

Where it sits: the second pure stage of the tick, between ``core/signals`` and
``core/policy``. :func:`signal_values` flattens the tick's :class:`Signals` (plus source health
from the :class:`Snapshot` and the values the policy publishes) into named numbers per
service and per GPU; :func:`evaluate` moves each rule's alerts through inactive → pending →
firing → resolved and returns the new alert table with the transitions the sinks announce
(``actuators/alerts.py``). What a rule is, the signals it may name and how a rules file is
read: ``core/alert_rules.py``.

Semantics worth knowing:

* ``for_seconds``: pending until the condition has held that long; 0 fires at once.
* ``keep_firing_for_seconds``: a firing alert resolves only once the condition has been
  false that long, counted from the last evaluation where it held (``Alert.last_true_seconds``).
* Missing data (a ``None`` value, or the service or GPU absent from the values) holds the
  alert's state and marks it ``stale``: a guardian that goes blind must not "recover", and a
  pending alert does not advance to firing on no data. A pending alert fires on the first
  evaluation that sees the condition true again after ``for_seconds``.
* Rules marked ``optional`` may name a signal the guardian does not produce yet (an operator's
  rule written ahead of a feature): while no values carry it, the rule is skipped and nothing
  is marked stale.

No I/O, no clock, no logging: ``now`` is an argument and the result is data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from vllm_guardian.core.alert_rules import SERVICE_FIELDS, Rule
from vllm_guardian.core.signals import Signals
from vllm_guardian.model import Alert, AlertState, LogEventKind, Snapshot, SourceKind

GIB = 1024**3

# Reset-class XIDs (NVIDIA's XID catalog: 48 DBE, 79 fell off the bus, 95 uncontained ECC,
# 119 GSP RPC timeout): the GPU needs a reset, a vLLM restart would crash-loop. The one set:
# the classifier, the ladder and diagnose read it here, so they and the alert cannot disagree.
RESET_CLASS_XIDS = frozenset({48, 79, 95, 119})

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (service, labels): labels () for the service, (("gpu","N"),)
Values = Mapping[SeriesKey, Mapping[str, float | None]]
AlertKey = tuple[str, str | None, Labels]


@dataclass(frozen=True)
class Transition:
    """An alert changed state this evaluation; ``resolved``: it was firing and is gone."""

    alert: Alert
    previous: AlertState
    current: AlertState
    resolved: bool


@dataclass(frozen=True)
class SinkResult:
    """What one delivery to one sink did (the dispatcher logs and exports these)."""

    sink: str  # log | webhook | alertmanager
    target: str  # URL or logger name
    ok: bool
    alerts: int  # how many alerts the delivery carried
    duration_seconds: float = 0.0
    status_code: int | None = None
    error: str | None = None


# --- values --------------------------------------------------------------------------------


def signal_values(
    signals: Signals,
    snapshot: Snapshot,
    extra: Mapping[tuple[str, str], float | None] = MappingProxyType({}),
) -> dict[SeriesKey, dict[str, float | None]]:
    """Every named value rules can read, per (service, labels).

    ``extra`` carries what the policy publishes, keyed by (service, name); the name may be
    given with or without its ``policy.`` prefix.
    """
    out: dict[SeriesKey, dict[str, float | None]] = {}
    policy: dict[str, dict[str, float | None]] = {}
    for (service, name), v in extra.items():
        full = name if name.startswith("policy.") else f"policy.{name}"
        policy.setdefault(service, {})[full] = v
    for s in signals.services:
        values: dict[str, float | None] = {}
        for name, _ in SERVICE_FIELDS:
            v = getattr(s, name)
            values[name] = None if v is None else float(v)
        up = _source_up(snapshot, s.service)
        for kind in SourceKind:
            values[f"source_up.{kind.value}"] = up.get(kind)
        logs_up = up.get(SourceKind.LOGS) == 1.0
        recent = dict(s.recent_log_events)
        for log_kind in LogEventKind:
            values[f"log_events.{log_kind.value}"] = (
                float(recent.get(log_kind, 0)) if logs_up else None
            )
        gpus_seen = snapshot.gpus is not None
        values["xid_reset_class"] = (
            float(sum(n for _, xid, n in s.recent_xid_events if xid in RESET_CLASS_XIDS))
            if gpus_seen
            else None
        )
        values.update(policy.get(s.service, {}))
        out[(s.service, ())] = values
        for g in s.gpus:
            over = (
                max(0, g.service_memory_bytes - g.budget_bytes)
                if g.service_memory_bytes is not None and g.budget_bytes is not None
                else None
            )
            per_gpu: dict[str, int | None] = {
                "service_memory_bytes": g.service_memory_bytes,
                "other_processes_memory_bytes": g.other_memory_bytes,
                "memory_budget_bytes": g.budget_bytes,
                "memory_over_budget_bytes": over,
                "headroom_bytes": g.free_bytes,
                "memory_total_bytes": g.total_bytes,
                "xid_reset_class": sum(
                    n
                    for gpu, xid, n in s.recent_xid_events
                    if gpu == g.gpu and xid in RESET_CLASS_XIDS
                ),
            }
            out[(s.service, (("gpu", str(g.gpu)),))] = {
                k: None if v is None else float(v) for k, v in per_gpu.items()
            }
        for a in s.allocator:
            row = out.setdefault((s.service, (("gpu", str(a.gpu)),)), {})
            row.update(
                allocator_reserved_bytes=float(a.reserved_bytes),
                allocator_allocated_bytes=float(a.allocated_bytes),
                allocator_unallocated_bytes=float(a.unallocated_bytes),
                allocator_fragmentation_ratio=a.fragmentation_ratio,
                allocator_retries_per_second=a.retries_per_second,
                allocator_recent_ooms=None if a.recent_ooms is None else float(a.recent_ooms),
            )
    return out


def _source_up(snapshot: Snapshot, service: str) -> dict[SourceKind, float]:
    """1/0 per source seen for this service; host-wide sources (service None) count for all.
    A source with several statuses is up only if all are."""
    up: dict[SourceKind, float] = {}
    for st in snapshot.sources:
        if st.service is None or st.service == service:
            up[st.source] = min(up.get(st.source, 1.0), 1.0 if st.up else 0.0)
    return up


# --- evaluation ----------------------------------------------------------------------------


def evaluate(
    rules: Sequence[Rule],
    alerts: Mapping[AlertKey, Alert],
    values: Values,
    now: float,
) -> tuple[dict[AlertKey, Alert], tuple[Transition, ...]]:
    """One evaluation of every rule: the new alert table (pending and firing only) and what
    changed. Alerts of rules no longer present are dropped (a firing one as resolved)."""
    out: dict[AlertKey, Alert] = {}
    transitions: list[Transition] = []
    names = {r.name for r in rules}
    for rule in rules:
        mine = {k: a for k, a in alerts.items() if k[0] == rule.name}
        series = _series_for(rule, values)
        if rule.optional and not any(rule.signal in values[k] for k in series):
            out.update(mine)  # the signal does not exist (yet): nothing to say, nothing stale
            continue
        keys = sorted(set(series) | {(a.service or "", a.labels) for a in mine.values()})
        for service, labels in keys:
            key: AlertKey = (rule.name, service, labels)
            row = values.get((service, labels))
            value = row.get(rule.signal) if row is not None else None
            new, change = _step(rule, mine.get(key), service, labels, value, now, row)
            if new is not None:
                out[key] = new
            if change is not None:
                transitions.append(change)
    for key, a in sorted(alerts.items(), key=lambda kv: _alert_sort_key(kv[1])):
        if key[0] not in names:
            transitions.append(_end(a, None))
    return out, tuple(transitions)


def _series_for(rule: Rule, values: Values) -> list[SeriesKey]:
    if rule.scope == "gpu":
        return [k for k in values if any(name == "gpu" for name, _ in k[1])]
    return [k for k in values if k[1] == ()]


def _step(
    rule: Rule,
    alert: Alert | None,
    service: str,
    labels: Labels,
    value: float | None,
    now: float,
    row: Mapping[str, float | None] | None = None,
) -> tuple[Alert | None, Transition | None]:
    if value is None or math.isnan(value):
        # Blind: hold whatever state there is, say so, and never advance or resolve on it.
        if alert is None or alert.stale:
            return alert, None
        return replace(alert, stale=True), None
    gpu = dict(labels).get("gpu", "")
    summary = render_summary(rule, service, value, gpu, row)
    if rule.holds(value):
        if alert is None:
            state = AlertState.FIRING if rule.for_seconds <= 0 else AlertState.PENDING
            new = Alert(
                name=rule.name,
                service=service,
                labels=labels,
                state=state,
                severity=rule.severity,
                cause=rule.cause,
                value=value,
                active_since_seconds=now,
                firing_since_seconds=now if state is AlertState.FIRING else None,
                last_true_seconds=now,
                summary=summary,
                runbook=rule.runbook,
            )
            return new, Transition(new, AlertState.INACTIVE, state, resolved=False)
        fire = (
            alert.state is AlertState.PENDING
            and now - alert.active_since_seconds >= rule.for_seconds
        )
        new = replace(
            alert,
            state=AlertState.FIRING if fire else alert.state,
            firing_since_seconds=now if fire else alert.firing_since_seconds,
            severity=rule.severity,
            cause=rule.cause,
            value=value,
            last_true_seconds=now,
            stale=False,
            summary=summary,
            runbook=rule.runbook,
        )
        if fire:
            return new, Transition(new, AlertState.PENDING, AlertState.FIRING, resolved=False)
        return new, None
    if alert is None:
        return None, None
    if (
        alert.state is AlertState.FIRING
        and now - alert.last_true_seconds < rule.keep_firing_for_seconds
    ):
        return replace(alert, value=value, stale=False, summary=summary), None
    return None, _end(alert, value, summary)


def _end(alert: Alert, value: float | None, summary: str | None = None) -> Transition:
    was = alert.state
    gone = replace(
        alert,
        state=AlertState.INACTIVE,
        value=alert.value if value is None else value,
        stale=False,
        summary=alert.summary if summary is None else summary,
    )
    return Transition(gone, was, AlertState.INACTIVE, resolved=was is AlertState.FIRING)


def render_summary(
    rule: Rule,
    service: str,
    value: float | None,
    gpu: str = "",
    row: Mapping[str, float | None] | None = None,
) -> str:
    """The rule's summary; ``{replicas_needed}`` is the service's capacity estimate (n/a when
    there is none), so an over-capacity alert says both numbers."""
    replicas = (row or {}).get("capacity_replicas_needed")
    return rule.summary.format(
        service=service,
        value=format_value(value, rule.unit),
        threshold=format_value(rule.threshold, rule.unit),
        gpu=gpu,
        replicas_needed=format_value(replicas, "count"),
    )


def format_value(value: float | None, unit: str) -> str:
    """A value as an operator reads it: ratios as %, bytes as GiB, rates per second."""
    if value is None:
        return "n/a"
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "bytes":
        return f"{value / GIB:.2f} GiB"
    if unit == "seconds":
        return f"{value:.0f}s"
    if unit == "per_second":
        return f"{value:.2f}/s"
    if unit == "multiple":
        return f"{value:.2f}x"
    if unit == "bool":
        return "true" if value else "false"
    return f"{value:g}"


def _alert_sort_key(a: Alert) -> tuple[str, str, Labels]:
    return (a.name, a.service or "", a.labels)


def sort_alerts(alerts: Iterable[Alert]) -> tuple[Alert, ...]:
    """A stable order for display and delivery: by name, service, then labels."""
    return tuple(sorted(alerts, key=_alert_sort_key))


def firing(alerts: Mapping[AlertKey, Alert] | Iterable[Alert]) -> tuple[Alert, ...]:
    """The firing alerts, in :func:`sort_alerts` order."""
    items = alerts.values() if isinstance(alerts, Mapping) else alerts
    return sort_alerts(a for a in items if a.state is AlertState.FIRING)
