"""The flags each lever's rung stands for: the operator's baseline, a rung's value, whether one
more rung changes anything, and the flags and environment a relaunch writes.

Read by the ladder (``core/ladder.py``), the pre-emptive stage (``core/preemptive.py``) and
operator commands; the levers themselves are described in ``core/levers.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.budget import parse_launch_flags
from vllm_guardian.core.levers import (
    LEVERS,
    Baseline,
    Lever,
    Step,
    lever_spec,
)
from vllm_guardian.core.policy_state import ServiceState
from vllm_guardian.core.signals import ServiceSignals


def default_baseline(
    signals: ServiceSignals | None, cmdline: Sequence[str] | None, gpu_total_bytes: int = 0
) -> Baseline:
    """The operator's values, one per lever with a value: from the command line when set
    there, else what vLLM reports it runs with, else vLLM's default for the card's memory size
    (each lever's row in ``core/levers.py`` says where to look and holds the defaults)."""
    total = max((g.total_bytes or 0 for g in signals.gpus), default=0) if signals else 0
    total = total or gpu_total_bytes
    # The one launch-flag reader (core/budget.py), with argparse's semantics as vLLM has them:
    # the last occurrence wins and ``8k`` is 8000.
    flags = parse_launch_flags(cmdline or ())
    values: dict[str, Any] = {
        spec.baseline_field: spec.operator_value(flags, signals, total)
        for spec in LEVERS.values()
        if spec.baseline_field is not None
    }
    return Baseline(**values)


def lever_value(lever: Lever, rung: int, base: Baseline, p: PolicyConfig) -> str | None:
    """The flag value at ``rung`` (0 = the operator's baseline: no guardian flag)."""
    if rung <= 0:
        return None
    spec = lever_spec(lever)
    if spec.step is Step.SWITCH:  # on: its variable's value, or a flag that takes none
        return spec.env[1] if spec.env is not None else ""
    return spec.text(spec.lowered(spec.base_value(base), rung, p))


def nearest_seqs_rung(
    target: float, below: float, base: Baseline, p: PolicyConfig
) -> tuple[int, int] | None:
    """The max_num_seqs rung whose value is nearest ``target`` while staying under ``below``
    (what the pool admits anyway: a cap at or above it changes nothing, so the relaunch would
    be a pure restart). ``(rung, value)``; None when no rung under ``below`` lies within 15 %
    of the target (a cap below what the pool hosts costs throughput: docs/capacity.md)."""
    best: tuple[int, int] | None = None
    rung = 1
    while True:
        value = int(lever_value(Lever.MAX_NUM_SEQS, rung, base, p) or base.max_num_seqs)
        if value < below and (best is None or abs(value - target) < abs(best[1] - target)):
            best = (rung, value)
        if value <= p.max_num_seqs_floor or value < 0.5 * target or rung > 64:
            break
        rung += 1
    if best is None or abs(best[1] - target) > 0.15 * target:
        return None
    return best


def can_step_down(lever: Lever, rung: int, base: Baseline, p: PolicyConfig) -> bool:
    """Whether one more rung changes anything (floors reached, or a switch already on)."""
    spec = lever_spec(lever)
    if spec.step is Step.SWITCH:
        return rung == 0
    now = lever_value(lever, rung, base, p)
    nxt = lever_value(lever, rung + 1, base, p)
    if now is None:
        return nxt is not None and float(nxt) < spec.base_value(base)
    return nxt is not None and float(nxt) < float(now)


def flags_for(
    rungs: Mapping[Lever, int], base: Baseline, p: PolicyConfig
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The complete guardian-owned flags and environment for these rungs."""
    flags: list[tuple[str, str]] = []
    env: list[tuple[str, str]] = []
    for lever in Lever:
        value = lever_value(lever, rungs.get(lever, 0), base, p)
        if value is None:
            continue
        spec = lever_spec(lever)
        if spec.env is not None:
            # Whoever starts vLLM merges these into the operator's own setting
            # (actuators/flags.merged_env).
            env.append((spec.env[0], value))
            env.extend((name, value) for name in spec.env_also)
        if spec.flag is not None:
            flags.append((spec.flag, value))
        flags.extend(spec.companions)
    return tuple(flags), tuple(env)


def service_flags(
    s: ServiceState, base: Baseline, p: PolicyConfig
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The rungs' flags with the operator's own on top; a lever the policy has lowered since
    (rung > 0) is the rung's value, computed from a baseline that took the operator's value."""
    flags, env = flags_for(dict(s.levels.rungs), base, p)
    mine = {f for f, _ in flags}
    merged = tuple((f, v) for f, v in s.levels.operator_flags if f not in mine) + flags
    return merged, env


def describe_flags(flags: Sequence[tuple[str, str]], env: Sequence[tuple[str, str]]) -> str:
    parts = [f"{f} {v}".strip() for f, v in flags] + [f"{k}={v}" for k, v in env]
    return " ".join(parts)


def set_time(
    pairs: tuple[tuple[Lever, float], ...], lever: Lever, value: float
) -> tuple[tuple[Lever, float], ...]:
    d = dict(pairs)
    d[lever] = value
    return tuple(sorted(d.items()))


def restore_levels(s: ServiceState) -> ServiceState:
    """A wait for a permit ended without one: the levels vLLM still runs with, back."""
    b = s.levels_before
    if b is None:
        return s
    return replace(s, levels=b, levels_before=None)


def set_rung(s: ServiceState, lever: Lever, rung: int) -> ServiceState:
    d = dict(s.levels.rungs)
    if rung > 0:
        d[lever] = rung
    else:
        d.pop(lever, None)
    return replace(s, levels=replace(s.levels, rungs=tuple(sorted(d.items()))))
