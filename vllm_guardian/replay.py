"""``vllm-guardian replay RECORDING -c CONFIG``: a past incident through today's rules and policy.

The flight recorder keeps every tick's snapshot. Replay feeds them, in order, through the same
pure functions the daemon runs (``derive`` → ``alerting.evaluate`` → ``policy.decide``) with the
given config's rules and policy, and prints what would have been decided. Nothing is executed:
each action is taken to succeed at the next recorded tick (as a dry run reports it), so an
operator can try a new threshold or ladder on a real incident before arming it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_guardian.actuators.alerts import load_rules
from vllm_guardian.config import Config, ConfigInvalid, load_config
from vllm_guardian.core import alerting, policy
from vllm_guardian.core.signals import derive
from vllm_guardian.daemon import history_span_seconds
from vllm_guardian.model import Action, ActionKind, ActionResult, Snapshot
from vllm_guardian.recorder import RecordError, read_records, snapshot_from_record, to_jsonable


@dataclass(frozen=True)
class ReplayLine:
    time_seconds: float
    kind: str  # decision | transition | error
    body: dict[str, Any]


def replay(snapshots: Iterable[Snapshot], cfg: Config) -> Iterator[ReplayLine]:
    rules = load_rules(cfg.alerting)
    names = tuple(s.name for s in cfg.services)
    settings = policy.PolicySettings(cfg.policy, names, {r.name: r.signal for r in rules})
    state = policy.initial_state(names)
    alerts: dict[alerting.AlertKey, Any] = {}
    history: collections.deque[Snapshot] = collections.deque()
    pending: list[Action] = []
    span = history_span_seconds(cfg)
    for snap in snapshots:
        now = snap.time_seconds
        results = tuple(
            ActionResult(
                a.id, a.service, a.kind, True, False, "replay: assumed to succeed", now, True
            )
            for a in pending
            if a.kind is not ActionKind.ESCALATE
        )
        snap = replace(snap, action_results=results)
        history.append(snap)
        while len(history) > 1 and history[0].time_seconds < now - span:
            history.popleft()
        signals = derive(list(history), cfg.services, cfg.signals)
        values = alerting.signal_values(
            signals, snap, policy.published_signals(state, now, cfg.policy)
        )
        alerts, transitions = alerting.evaluate(rules, alerts, values, now)
        for t in transitions:
            yield ReplayLine(now, "transition", to_jsonable(t))
        out = policy.decide(
            state, list(alerting.firing(alerts.values())), snap, signals, now, settings
        )
        state = out.state
        pending = list(out.actions)
        for d in out.decisions:
            yield ReplayLine(now, "decision", to_jsonable(d))


def load_snapshots(path: str) -> Iterator[Snapshot | RecordError]:
    for rec in read_records(path):
        if isinstance(rec, RecordError):
            yield rec
            continue
        try:
            yield snapshot_from_record(rec)
        except (KeyError, TypeError, ValueError) as e:
            yield RecordError(path, 0, f"not a flight record: {e}")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="vllm-guardian replay", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "recording", help="a flight.jsonl (rotated siblings are read too, oldest first)"
    )
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--transitions", action="store_true", help="also show alert transitions")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        load_rules(cfg.alerting)
    except ConfigInvalid as e:
        print(e, file=sys.stderr)
        return 2
    errors: list[RecordError] = []

    def good() -> Iterator[Snapshot]:
        for item in load_snapshots(args.recording):
            if isinstance(item, RecordError):
                errors.append(item)
            else:
                yield item

    n = 0
    for line in replay(good(), cfg):
        if line.kind == "transition" and not args.transitions:
            continue
        n += 1
        if args.json:
            print(json.dumps({"kind": line.kind, **line.body}))
        elif line.kind == "decision":
            b = line.body
            print(f"{b['time_seconds']:.0f} {b['service']} {b['what']:<10} {b['reason']}")
        else:
            a = line.body["alert"]
            print(
                f"{line.time_seconds:.0f} {a['service']} alert {a['name']} {line.body['previous']} → {line.body['current']}"
            )
    for bad in errors[:10]:
        print(f"{bad.file}:{bad.line}: skipped: {bad.message}", file=sys.stderr)
    if n == 0:
        print(
            "no decisions: with this config the guardian would have done nothing", file=sys.stderr
        )
    return 0
