"""Alert rules as data: what a rule is, the signals it may name, and the rules file.

Where it sits: read once when the guardian starts (and on SIGHUP), before any tick; the
rules it returns are what ``core/alerting.evaluate`` moves through pending → firing →
resolved every tick. :func:`parse_rules` turns a rules YAML file (``vllm_guardian/defaults/
rules.yaml``, an operator's ``alerting.rules_file``) into :class:`Rule`\\ s, reporting every
mistake with its key path and line; the YAML is read by the config loader
(``config.parse_document``), so the pure core holds no YAML parser. A rule may name a signal
only if the guardian produces it: the names come from the fields of ``ServiceSignals``
(each numeric field is a signal by itself), the sources' health, vLLM's log events and the
policy's published values, and a signal's unit is the one its name says.

No I/O, no clock, no logging.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import string
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_guardian.config import Report, _bounds, parse_document
from vllm_guardian.core.signal_records import ServiceSignals
from vllm_guardian.model import Cause, LogEventKind, Severity, SourceKind

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
    key path (``rules[3].signal``) and line. The YAML itself is read by the config loader
    (``config.parse_document``); this module only says what a valid rule is."""
    rules: list[Rule] = []

    def check(parsed: _RulesFile, report: Report) -> None:
        seen: dict[str, int] = {}
        for i, spec in enumerate(parsed.rules):

            def err(key: str, message: str, i: int = i) -> None:
                report(("rules", i, key) if key else ("rules", i), message)

            rule = _to_rule(spec, err)
            if spec.name in seen:
                err(
                    "name", f"duplicate rule name {spec.name!r} (first at rules[{seen[spec.name]}])"
                )
            seen.setdefault(spec.name, i)
            if rule is not None:
                rules.append(rule)

    parse_document(_RulesFile, text, filename, check)
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
