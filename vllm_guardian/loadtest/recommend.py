"""From the steps' figures to a verdict and the flags to set, each with its reason. Pure.

* The **knee** is the first step where the KV pool saturated: preemptions appeared or KV usage
  reached the gate's high watermark. Beyond it the load is over one replica's capacity: the
  verdict says by how much (the peak concurrency ÷ the requests of the largest measured size
  that the pool holds under the high watermark, ``core/levers.py``) and how many replicas
  would carry it, or shedding at the gate. ``--max-num-seqs`` is never lowered for it (a cap
  below what the pool hosts costs throughput: 5-34 % measured on vLLM 0.32, docs/capacity.md);
  one set below what the pool hosts is raised to it.
* **Device-memory** trouble (headroom under the floor, its forecast, an OOM line) is a
  different pressure (the physical GPU, not the pool): ``--max-num-batched-tokens`` comes
  down (the prefill workspace grows with the tokens batched in one step) and
  ``--gpu-memory-utilization`` comes down until the floor is free again. Steps are the guardian
  policy's, read through the lever table (``core/levers.py``) under the given ``PolicyConfig``:
  shipped, factor 0.5 with a 2048 floor for batched tokens, 0.05 with a 0.70 floor for
  utilization.
* With the pool as the only limit and spare headroom above twice the floor, utilization may go
  up (a larger pool moves the knee up), at most one policy step.
* The gate's watermarks stay at the policy's 0.90/0.80 unless preemptions began below the
  high one; then the high watermark goes 5 points under where they began.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.budget import LaunchFlags, default_max_num_batched_tokens
from vllm_guardian.core.levers import LOW_CAP_COSTS, Lever, lever_spec, sequences_hosted

from .profile import Limits
from .results import StepResult

GIB = 1024**3
# Most vLLM deployments stay at or under this; above it the non-KV headroom is a sliver.
MAX_RECOMMENDED_UTILIZATION = 0.95
DEVICE_LIMITS = frozenset({"gpu_headroom", "oom", "headroom_forecast"})


class Action(StrEnum):
    SET = "set"
    LOWER = "lower"
    RAISE = "raise"
    KEEP = "keep"


@dataclass(frozen=True)
class Recommendation:
    flag: str  # e.g. "--max-num-seqs", or "policy.kv_high_watermark_ratio"
    action: Action
    value: str | None  # what to set; None: keep the current value / unknown
    reason: str


@dataclass(frozen=True)
class Verdict:
    passed: bool  # every step held every limit and the profile ran to its end
    summary: str
    best_step: int | None  # index of the highest step that held every limit
    knee_step: int | None
    recommendations: tuple[Recommendation, ...]


def _gib(v: float) -> str:
    return f"{v / GIB:.2f} GiB"


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0%}"


def find_knee(results: Sequence[StepResult], high_watermark: float) -> StepResult | None:
    for r in results:
        if (r.preemptions_per_second or 0.0) > 0.0 or (r.kv_usage_peak_ratio or 0.0) >= (
            high_watermark
        ):
            return r
    return None


def best_step(results: Sequence[StepResult]) -> StepResult | None:
    held = [r for r in results if r.held]
    return held[-1] if held else None


def _device_trouble(results: Sequence[StepResult], stop_reason: str | None) -> bool:
    if stop_reason and stop_reason.startswith("headroom_forecast"):
        return True
    return any(k in DEVICE_LIMITS for r in results for k, _ in r.violations)


def _min_headroom(results: Sequence[StepResult]) -> int | None:
    values = [r.gpu_headroom_min_bytes for r in results if r.gpu_headroom_min_bytes is not None]
    return min(values) if values else None


def recommend(
    results: Sequence[StepResult],
    flags: LaunchFlags,
    limits: Limits,
    *,
    stop_reason: str | None = None,
    completed: bool = True,
    policy: PolicyConfig | None = None,
) -> Verdict:
    policy = policy or PolicyConfig()
    high, low = policy.kv_high_watermark_ratio, policy.kv_low_watermark_ratio
    knee = find_knee(results, high)
    best = best_step(results)
    device = _device_trouble(results, stop_reason)
    recs = (
        _max_num_seqs(results, flags, knee, device, high),
        _max_num_batched_tokens(results, flags, device, policy),
        _utilization(results, flags, limits, knee, device, policy),
        *_watermarks(results, high, low),
    )
    passed = completed and bool(results) and all(r.held for r in results) and not stop_reason
    if passed:
        summary = f"PASS: every step held every limit, up to {results[-1].label}"
    elif not results:
        summary = f"NOT RUN: {stop_reason or 'no step ran'}"
    else:
        where = f"after {best.label}" if best is not None else "at the first step"
        summary = f"STOPPED {where}: {stop_reason or 'a limit broke'}"
    return Verdict(
        passed,
        summary,
        best.index if best is not None else None,
        knee.index if knee is not None else None,
        recs,
    )


def _max_num_seqs(
    results: Sequence[StepResult],
    flags: LaunchFlags,
    knee: StepResult | None,
    device: bool,
    high: float,
) -> Recommendation:
    flag = "--max-num-seqs"
    current = flags.max_num_seqs
    now = f" (now {current})" if current is not None else ""
    capacity = next((r.kv_capacity_tokens for r in results if r.kv_capacity_tokens), None)
    largest = max((r.request_tokens_max or 0 for r in results), default=0)
    pool_seqs = sequences_hosted(capacity, largest, high)
    pool_text = (
        f"the pool's {capacity} tokens hold {pool_seqs} requests of up to {largest} tokens "
        f"(prompt + output) under the {high:.0%} watermark"
        if pool_seqs is not None
        else "the pool's size is unknown (no cache_config_info in /metrics)"
    )
    if knee is not None and knee.concurrency is not None:
        # KV thrash is a capacity problem (docs/capacity.md): say by how much the load
        # exceeded one replica and what would carry it; never a lower cap as the fix.
        hosted = pool_seqs or _held_concurrency(results, knee)
        peak = max((r.concurrency or 0 for r in results), default=0) or knee.concurrency
        over = (
            f"at {peak} concurrent requests the load is over capacity by {peak / hosted:.2f}x: "
            f"{math.ceil(peak / hosted)} replica(s) (add {math.ceil(peak / hosted) - 1}) or shed "
            "at the gate"
            if hosted
            else "saturated; capacity not measurable from this data: add replicas or shed at "
            "the gate"
        )
        raise_it = current is not None and pool_seqs is not None and current < pool_seqs
        return Recommendation(
            flag,
            Action.RAISE if raise_it else Action.KEEP,
            str(pool_seqs) if raise_it else (str(current) if current is not None else None),
            f"the KV pool saturated at {knee.label} (KV peak {_pct(knee.kv_usage_peak_ratio)}, "
            f"{knee.preemptions_per_second or 0:.2f} preemptions/s); {over}; {pool_text}{now}; "
            f"{LOW_CAP_COSTS}",
        )
    if device:
        return Recommendation(
            flag,
            Action.KEEP,
            None,
            "the run stopped on device memory, not on the KV pool: concurrency is not the "
            f"lever here (see --max-num-batched-tokens and --gpu-memory-utilization){now}",
        )
    last = results[-1] if results else None
    peak_kv = _pct(last.kv_usage_peak_ratio) if last else "?"
    return Recommendation(
        flag,
        Action.KEEP,
        None,
        f"the pool did not saturate up to {last.label if last else 'the end'} (KV peak {peak_kv}); "
        f"{pool_text}{now}",
    )


def _held_concurrency(results: Sequence[StepResult], knee: StepResult) -> int | None:
    """The highest concurrency that held below the knee: what one replica carries, measured."""
    held = [r.concurrency for r in results if r.held and r.concurrency is not None]
    below = [c for c in held if c < (knee.concurrency or 0)]
    return max(below) if below else None


def _max_num_batched_tokens(
    results: Sequence[StepResult], flags: LaunchFlags, device: bool, policy: PolicyConfig
) -> Recommendation:
    flag = "--max-num-batched-tokens"
    total = next((r.gpu_memory_total_bytes for r in results if r.gpu_memory_total_bytes), None)
    current = flags.max_num_batched_tokens
    source = "set"
    if current is None and total is not None:
        current, source = default_max_num_batched_tokens(total), "vLLM's default for this card"
    longest = max((r.request_tokens_max or 0 for r in results), default=0)
    headroom = _min_headroom(results)
    if device:
        why = (
            f"GPU memory ran short (least headroom {_gib(headroom)})"
            if headroom is not None
            else "GPU memory ran short (an OOM line)"
        )
        tail = (
            "; the prefill workspace grows with the tokens batched in one step, so a smaller "
            "batch keeps it inside the headroom (long prompts get a longer TTFT)"
        )
        if current is None:
            return Recommendation(flag, Action.LOWER, None, f"{why}: halve it{tail}")
        value = int(lever_spec(Lever.MAX_NUM_BATCHED_TOKENS).lowered(current, 1, policy))
        return Recommendation(
            flag, Action.LOWER, str(value), f"{why} with {current} ({source}){tail}"
        )
    reason = "no step came near the headroom floor"
    if headroom is not None:
        reason += f" (least headroom {_gib(headroom)})"
    if longest:
        reason += f" with requests of up to {longest} tokens"
    return Recommendation(flag, Action.KEEP, str(current) if current else None, reason)


def _utilization(
    results: Sequence[StepResult],
    flags: LaunchFlags,
    limits: Limits,
    knee: StepResult | None,
    device: bool,
    policy: PolicyConfig,
) -> Recommendation:
    flag = "--gpu-memory-utilization"
    lever = lever_spec(Lever.GPU_MEMORY_UTILIZATION)
    policy_step = lever.step_size(policy)
    current = flags.gpu_memory_utilization_ratio or next(
        (r.gpu_memory_utilization_ratio for r in results if r.gpu_memory_utilization_ratio),
        None,
    )
    total = next((r.gpu_memory_total_bytes for r in results if r.gpu_memory_total_bytes), None)
    headroom = _min_headroom(results)
    floor = limits.gpu_headroom_floor_bytes
    if device:
        if current is None:
            return Recommendation(
                flag, Action.LOWER, None, "must come down: GPU memory ran short (value unknown)"
            )
        if headroom is not None and total and headroom < floor:
            # At least one policy step: a smaller --max-num-batched-tokens (recommended with
            # it) shrinks the activation budget vLLM profiles and hands it to the KV pool, so
            # the headroom does not grow by itself.
            step = max(policy_step, math.ceil(100 * (floor - headroom) / total) / 100)
            why = (
                f"headroom {_gib(headroom)} fell under the floor {_gib(floor)} "
                f"({_gib(floor - headroom)} short); at least one policy step, since a smaller "
                "batch hands its activation budget to the KV pool"
            )
        else:
            step = policy_step
            why = "GPU memory ran short; one policy step down leaves room for the peak"
        value = max(lever.floor(policy), round(current - step, 2))
        return Recommendation(
            flag, Action.LOWER, f"{value:.2f}", f"must come down from {current:.2f}: {why}"
        )
    if knee is not None and current is not None and headroom is not None and total:
        spare = headroom - 2 * floor
        step = min(policy_step, math.floor(100 * spare / total) / 100)
        if step >= 0.01 and current + step <= MAX_RECOMMENDED_UTILIZATION:
            return Recommendation(
                flag,
                Action.RAISE,
                f"{current + step:.2f}",
                f"the KV pool was the limit ({knee.label}) while at least {_gib(headroom)} stayed "
                f"free (floor {_gib(floor)}): a larger pool moves the knee up; run the "
                "loadtest again after the change",
            )
    now = f"{current:.2f}" if current is not None else None
    if headroom is None:
        return Recommendation(flag, Action.KEEP, now, "GPU memory was not watched")
    return Recommendation(
        flag,
        Action.KEEP,
        now,
        f"least headroom {_gib(headroom)} stayed above the floor {_gib(floor)}"
        + ("" if knee is not None else " and the pool was not the limit"),
    )


def _watermarks(
    results: Sequence[StepResult], high: float, low: float
) -> tuple[Recommendation, Recommendation]:
    onset_values = [
        r.kv_usage_peak_ratio
        for r in results
        if (r.preemptions_per_second or 0) > 0 and r.kv_usage_peak_ratio is not None
    ]
    onset = min(onset_values) if onset_values else None
    if onset is not None and onset < high:
        new_high = max(0.10, math.floor(20 * (onset - 0.05)) / 20)
        new_low = max(0.05, round(new_high - (high - low), 2))
        reason = (
            f"preemptions began at KV usage {onset:.0%}, under the {high:.0%} high watermark: "
            "the gate must close before the pool thrashes"
        )
        return (
            Recommendation(
                "policy.kv_high_watermark_ratio", Action.LOWER, f"{new_high:.2f}", reason
            ),
            Recommendation(
                "policy.kv_low_watermark_ratio",
                Action.LOWER,
                f"{new_low:.2f}",
                "the same band below the high watermark, so the gate does not flap",
            ),
        )
    reason = (
        f"preemptions began only at KV usage {onset:.0%}, at or above the high watermark: "
        "the gate closes first"
        if onset is not None
        else "no preemption was seen: the policy's defaults stand"
    )
    return (
        Recommendation("policy.kv_high_watermark_ratio", Action.KEEP, f"{high:.2f}", reason),
        Recommendation(
            "policy.kv_low_watermark_ratio", Action.KEEP, f"{low:.2f}", "the band below it"
        ),
    )
