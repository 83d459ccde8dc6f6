"""``vllm-guardian replay RECORDING [-c CONFIG]``: a past incident through today's rules and policy.

The flight recorder keeps every tick's snapshot. Replay feeds them, in order, to the same tick
driver the daemon runs (``core/driver.py``: the settings built from the config, the history
window, then the pure ``core/step.step``: signals → alerts → policy, with the phases of an
action) with the given config, and prints what would have been decided, phase by phase.
Nothing is executed. The blocking calls an action asks for (bundle, flags file, restart) get
their results from the recording when it holds them (a guardian that acted recorded each call's
result in the next snapshot), matched by service and call in order; a recording without any (an
observing or dry-run guardian) has each call succeed at the next recorded tick. The operator's
commands (pause, resume, restart, relaunch) are in the recording too, each in the snapshot of
the tick after it, and are applied again where the daemon took them. Everything else an action
waits for (the drain, the old instance's GPU memory, readiness) is read from the recorded
snapshots, so an operator can try a new threshold or ladder on a real incident before arming it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_guardian.actuators.alerts import load_rules
from vllm_guardian.config import DEFAULT_CONFIG_PATH, Config, ConfigInvalid, load_config
from vllm_guardian.core.driver import Driver
from vllm_guardian.formats.recorder import (
    RecordError,
    read_records,
    snapshot_from_record,
    to_jsonable,
)
from vllm_guardian.model import OpRequest, OpResult, Snapshot


@dataclass(frozen=True)
class ReplayLine:
    time_seconds: float
    kind: str  # decision | transition | error
    body: dict[str, Any]


def replay(snapshots: Iterable[Snapshot], cfg: Config) -> Iterator[ReplayLine]:
    snaps = list(snapshots)
    recorded = any(s.op_results for s in snaps)
    # Settings, window and step as the daemon builds them (a fleet guardian's permit included).
    driver = Driver.for_config(cfg, load_rules(cfg.alerting))
    pending: list[OpRequest] = []  # calls the replayed policy asked for, not yet answered
    for snap in snaps:
        now = snap.time_seconds
        # The operator's commands came between the last tick and this one: applied again
        # first, as the daemon applied them, their calls then answered like the policy's.
        for cmd in snap.commands:
            out = driver.command(cmd)
            pending.extend(out.ops)
            for d in out.decisions:
                yield ReplayLine(cmd.time_seconds, "decision", to_jsonable(d))
        results, pending = _answer(pending, snap, recorded)
        fx = driver.tick(replace(snap, op_results=results), now)
        for t in (*fx.transitions, *fx.inhibited):  # inhibited: its alert's inhibited_by is set
            yield ReplayLine(now, "transition", to_jsonable(t))
        pending.extend(fx.ops)
        for d in fx.decisions:
            yield ReplayLine(now, "decision", to_jsonable(d))


def _answer(
    pending: list[OpRequest], snap: Snapshot, recorded: bool
) -> tuple[tuple[OpResult, ...], list[OpRequest]]:
    """This tick's results for the replayed calls: the recording's own (by service and call,
    in order) or, for a recording that holds none, success."""
    if not recorded:
        done = tuple(
            OpResult(r.action_id, r.service, r.op, True, False, "replay: assumed to succeed",
                     snap.time_seconds - 1e-3)
            for r in pending
        )  # fmt: skip
        return done, []
    out: list[OpResult] = []
    left = list(pending)
    for got in snap.op_results:
        match = next((r for r in left if r.service == got.service and r.op is got.op), None)
        if match is None:
            continue
        left.remove(match)
        out.append(replace(got, action_id=match.action_id))
    return tuple(out), left


def load_snapshots(path: str) -> Iterator[Snapshot | RecordError]:
    for rec in read_records(path):
        if isinstance(rec, RecordError):
            yield rec
            continue
        try:
            yield snapshot_from_record(rec)
        except (KeyError, TypeError, ValueError) as e:
            yield RecordError(path, 0, f"not a flight record: {e}")


def iso(unix_seconds: float) -> str:
    """A record's time as people read it: ISO 8601 in UTC, to the second (``--json`` keeps the
    Unix seconds)."""
    return dt.datetime.fromtimestamp(unix_seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-guardian replay",
        description="A past incident through today's rules and policy: a flight recording fed "
        "to the same step the daemon runs, printing what would have been decided, phase by "
        "phase. Nothing is executed.",
    )
    ap.add_argument(
        "recording", help="a flight.jsonl (rotated siblings are read too, oldest first)"
    )
    ap.add_argument(
        "-c",
        "--config",
        default=DEFAULT_CONFIG_PATH,
        help=f"the config whose rules and policy decide (default {DEFAULT_CONFIG_PATH}, as for "
        "restart and relaunch)",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line (times as Unix seconds: time_seconds)",
    )
    ap.add_argument("--transitions", action="store_true", help="also show alert transitions")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        load_rules(cfg.alerting)
    except ConfigInvalid as e:
        print(e, file=sys.stderr)
        if args.config == DEFAULT_CONFIG_PATH and not Path(args.config).exists():
            print(
                "vllm-guardian replay: give the config to decide with: -c CONFIG", file=sys.stderr
            )
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
            phase = f"{b['phase']}: " if b.get("phase") else ""
            print(f"{iso(b['time_seconds'])} {b['service']} {b['what']:<10} {phase}{b['reason']}")
        else:
            a = line.body["alert"]
            print(
                f"{iso(line.time_seconds)} {a['service']} alert {a['name']} {line.body['previous']} → {line.body['current']}"
            )
    for bad in errors[:10]:
        print(f"{bad.file}:{bad.line}: skipped: {bad.message}", file=sys.stderr)
    if n == 0:
        print(
            "no decisions: with this config the guardian would have done nothing", file=sys.stderr
        )
    return 0
