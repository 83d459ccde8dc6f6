"""Alert rules as data, evaluated every tick with Prometheus semantics.

Where it sits: the second pure stage of the tick, between ``core/signals`` and
``core/policy``. :func:`signal_values` flattens the tick's :class:`Signals` (plus source health
from the :class:`Snapshot` and the values the policy publishes) into named numbers per
service and per GPU; :func:`evaluate` moves each rule's alerts through inactive → pending →
firing → resolved and returns the new alert table with the transitions the sinks announce
(``actuators/alerts.py``). :func:`parse_rules` turns a rules YAML file into :class:`Rule`\\ s,
reporting every mistake with its key path and line.

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

import dataclasses
import math
import operator
import re
import string
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import yaml

from vllm_guardian.config import ConfigError, ConfigInvalid, _bounds, _Loader, yaml_error
from vllm_guardian.core.signals import ServiceSignals, Signals
from vllm_guardian.model import (
    Alert,
    AlertState,
    Cause,
    LogEventKind,
    Severity,
    Snapshot,
    SourceKind,
)

GIB = 1024**3

# Reset-class XIDs (NVIDIA's XID catalog: 48 DBE, 79 fell off the bus, 95 uncontained ECC,
# 119 GSP RPC timeout): the GPU needs a reset, a vLLM restart would crash-loop.
RESET_CLASS_XIDS = frozenset({48, 79, 95, 119})

OPS: Mapping[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
# "multiple": a ratio of two rates that may exceed 1 (capacity_demand_ratio: demand ÷ served).
UNITS = ("ratio", "bytes", "seconds", "per_second", "count", "bool", "multiple")
SCOPES = ("service", "gpu")

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (service, labels): labels () for the service, (("gpu","N"),)
Values = Mapping[SeriesKey, Mapping[str, float | None]]
AlertKey = tuple[str, str | None, Labels]


@dataclass(frozen=True)
class Rule:
    """One alert rule: ``signal op threshold`` held for ``for_seconds`` fires the alert."""

    name: str  # CamelCase alertname, e.g. VllmKvCacheSaturated
    signal: str
    op: str
    threshold: float
    unit: str  # ratio | bytes | seconds | per_second | count | bool: how values are shown
    for_seconds: float
    keep_firing_for_seconds: float
    severity: Severity
    cause: Cause | None  # the cause this rule is evidence for
    summary: str  # template: {service} {value} {threshold} {gpu}
    runbook: str  # anchor in docs/runbook.md, e.g. #kv-cache-saturated
    scope: str = "service"  # service | gpu (one alert per GPU of the service)
    optional: bool = False  # the signal may not exist yet: absent, never stale

    def holds(self, value: float) -> bool:
        return OPS[self.op](value, self.threshold)


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


# --- signal names --------------------------------------------------------------------------


def _numeric_fields(cls: type[Any]) -> tuple[tuple[str, bool], ...]:
    """(name, is_bool) for every field typed bool, int or float (optionally ``| None``)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        args = set(typing.get_args(hints[f.name])) - {type(None)} or {hints[f.name]}
        if args <= {bool, int, float}:
            out.append((f.name, args == {bool}))
    return tuple(out)


SERVICE_FIELDS = _numeric_fields(ServiceSignals)
# Per GPU of the service (scope: gpu), named like their service-wide sums so rules read alike.
GPU_SIGNALS = (
    "service_memory_bytes",
    "other_processes_memory_bytes",
    "memory_budget_bytes",
    "memory_over_budget_bytes",
    "headroom_bytes",
    "memory_total_bytes",
    "xid_reset_class",
    # torch's allocator on this GPU, from the in-vLLM plugin (core/allocator.py).
    "allocator_reserved_bytes",
    "allocator_allocated_bytes",
    "allocator_unallocated_bytes",
    "allocator_fragmentation_ratio",
    "allocator_retries_per_second",
    "allocator_recent_ooms",
)
SERVICE_SIGNALS = frozenset(
    [name for name, _ in SERVICE_FIELDS]
    + [f"source_up.{k.value}" for k in SourceKind]
    + [f"log_events.{k.value}" for k in LogEventKind]
    + ["xid_reset_class"]
)
_POLICY_SIGNAL = re.compile(r"^policy\.[a-z][a-z0-9_]*$")
_BOOL_SIGNALS = frozenset(
    [name for name, is_bool in SERVICE_FIELDS if is_bool]
    + [f"source_up.{k.value}" for k in SourceKind]
)


def known_signal(name: str, scope: str) -> bool:
    if scope == "gpu":
        return name in GPU_SIGNALS
    return name in SERVICE_SIGNALS or bool(_POLICY_SIGNAL.match(name))


def natural_unit(name: str) -> str | None:
    """The unit a signal's name implies (units live in names); None: any (policy values)."""
    if name.startswith("policy."):
        return None
    if name in _BOOL_SIGNALS:
        return "bool"
    for suffix, unit in (
        ("_demand_ratio", "multiple"),
        ("_ratio", "ratio"),
        ("_bytes", "bytes"),
        ("_per_second", "per_second"),
        ("_seconds", "seconds"),
    ):
        if name.endswith(suffix):
            return unit
    if name.startswith("seconds_"):  # seconds_to_headroom_exhaustion
        return "seconds"
    return "count"


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


def merge_rules(base: Sequence[Rule], extra: Sequence[Rule]) -> tuple[Rule, ...]:
    """The shipped rules with an operator's file on top: same name replaces, new ones append."""
    replaced = {r.name: r for r in extra}
    out = [replaced.pop(r.name, r) for r in base]
    return (*out, *(r for r in extra if r.name in replaced))


# --- the rules file ------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Z][A-Za-z0-9]{2,99}$")
_ANCHOR = re.compile(r"^#[a-z0-9][a-z0-9-]*$")
_PLACEHOLDERS = frozenset({"service", "value", "threshold", "gpu", "replicas_needed"})


def _one_of(choices: Iterable[str]) -> Callable[[str], str | None]:
    allowed = tuple(choices)

    def check(v: str) -> str | None:
        return None if v in allowed else f"must be one of {', '.join(allowed)}"

    return check


def _check_name(v: str) -> str | None:
    return None if _NAME.match(v) else "must be a CamelCase alert name, e.g. VllmKvCacheSaturated"


def _check_anchor(v: str) -> str | None:
    return (
        None
        if _ANCHOR.match(v)
        else "must be an anchor in docs/runbook.md, e.g. #kv-cache-saturated"
    )


def _check_summary(v: str) -> str | None:
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
    except ValueError as e:
        return f"is not a valid template: {e}"
    unknown = used - _PLACEHOLDERS
    if unknown:
        return f"uses unknown placeholders {sorted(unknown)} (known: {sorted(_PLACEHOLDERS)})"
    return None


_WEEK = 7 * 86400.0


@dataclass(frozen=True)
class _RuleSpec:
    """The YAML form of a rule (enums as strings so the config walker can check them)."""

    name: str = field(metadata=_bounds(check=_check_name))
    signal: str
    op: str = field(metadata=_bounds(check=_one_of(OPS)))
    unit: str = field(metadata=_bounds(check=_one_of(UNITS)))
    severity: str = field(metadata=_bounds(check=_one_of(s.value for s in Severity)))
    summary: str = field(metadata=_bounds(check=_check_summary))
    runbook: str = field(metadata=_bounds(check=_check_anchor))
    # exactly one of threshold and threshold_bytes ("2GiB" reads better than 2147483648)
    threshold: float | None = None
    threshold_bytes: int | None = field(default=None, metadata=_bounds(0))
    for_seconds: float = field(default=0.0, metadata=_bounds(0, _WEEK))
    keep_firing_for_seconds: float = field(default=0.0, metadata=_bounds(0, _WEEK))
    cause: str | None = field(default=None, metadata=_bounds(check=_one_of(c.value for c in Cause)))
    scope: str = field(default="service", metadata=_bounds(check=_one_of(SCOPES)))
    optional: bool = False


@dataclass(frozen=True)
class _RulesFile:
    rules: tuple[_RuleSpec, ...] = ()


def parse_rules(text: str, filename: str) -> tuple[Rule, ...]:
    """Rules YAML (``rules: [...]``) → Rules, or ConfigInvalid listing every error with its
    key path (``rules[3].signal``) and line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        line, message = yaml_error(e)
        raise ConfigInvalid(filename, [ConfigError("", line, message)]) from None
    loader = _Loader()
    parsed = loader.build(_RulesFile, root, "")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    items = _items(root)
    for i, spec in enumerate(parsed.rules if isinstance(parsed, _RulesFile) else ()):
        node = items[i] if i < len(items) else None
        path = f"rules[{i}]"

        def err(key: str, message: str, node: yaml.Node | None = node, path: str = path) -> None:
            loader.err(f"{path}.{key}" if key else path, _child(node, key) or node, message)

        rule = _to_rule(spec, err)
        if spec.name in seen:
            err("name", f"duplicate rule name {spec.name!r} (first at rules[{seen[spec.name]}])")
        seen.setdefault(spec.name, i)
        if rule is not None:
            rules.append(rule)
    if loader.errors:
        raise ConfigInvalid(filename, sorted(loader.errors, key=lambda e: (e.line or 0, e.path)))
    return tuple(rules)


def _to_rule(spec: _RuleSpec, err: Callable[[str, str], None]) -> Rule | None:
    ok = True
    if (spec.threshold is None) == (spec.threshold_bytes is None):
        err("threshold", "give exactly one of threshold and threshold_bytes")
        ok = False
    threshold = float(spec.threshold if spec.threshold is not None else spec.threshold_bytes or 0)
    if spec.threshold_bytes is not None and spec.unit != "bytes":
        err("threshold_bytes", f"only for unit bytes (this rule's unit is {spec.unit})")
        ok = False
    if not known_signal(spec.signal, spec.scope):
        if not spec.optional:
            scope = f"{spec.scope} " if spec.scope != "service" else ""
            known = sorted(GPU_SIGNALS if spec.scope == "gpu" else SERVICE_SIGNALS)
            err(
                "signal",
                f"unknown {scope}signal {spec.signal!r} (mark the rule optional: true if it "
                f"comes from a source not installed yet; known: {', '.join(known)}, policy.*)",
            )
            ok = False
    else:
        want = natural_unit(spec.signal)
        if want is not None and spec.unit != want:
            err("unit", f"signal {spec.signal} is in {want}, not {spec.unit}")
            ok = False
    if spec.unit == "ratio" and spec.threshold is not None and not 0.0 <= threshold <= 1.0:
        err("threshold", f"a ratio is between 0 and 1 (write 0.9 for 90%), got {threshold:g}")
        ok = False
    if spec.unit == "bool" and (spec.op not in ("==", "!=") or threshold not in (0.0, 1.0)):
        err("op", "a bool signal is compared with == or != against 0 or 1")
        ok = False
    if "{gpu}" in spec.summary and spec.scope != "gpu":
        err("summary", "{gpu} is only known in rules with scope: gpu")
        ok = False
    if not ok:
        return None
    return Rule(
        name=spec.name,
        signal=spec.signal,
        op=spec.op,
        threshold=threshold,
        unit=spec.unit,
        for_seconds=spec.for_seconds,
        keep_firing_for_seconds=spec.keep_firing_for_seconds,
        severity=Severity(spec.severity),
        cause=Cause(spec.cause) if spec.cause is not None else None,
        summary=spec.summary,
        runbook=spec.runbook,
        scope=spec.scope,
        optional=spec.optional,
    )


def _items(root: yaml.Node | None) -> list[yaml.Node]:
    rules = _child(root, "rules")
    return list(rules.value) if isinstance(rules, yaml.SequenceNode) else []


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return typing.cast(yaml.Node, v)
    return None
