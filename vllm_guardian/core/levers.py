"""The levers the ladder moves (one :class:`LeverSpec` row each), how many sequences a KV
pool hosts, and what a ``--max-num-seqs`` below that costs. Pure.

Where it sits: a leaf of the pure core, read by the policy (the guarded concurrency relaunch),
``diagnose`` (its recommendation for KV thrash) and ``loadtest`` (its ``--max-num-seqs`` line):
the one home of the "sequences the pool hosts" arithmetic, so the three say the same number.

What was measured (vLLM 0.32 V1 under thrash; the study: ``docs/capacity.md``):

* vLLM V1 admits a request only when the blocks of its prompt are free, so at most
  ``usable blocks ÷ blocks per prompt`` requests run at once (:func:`admission_limit`); the
  peak running count seen under thrash is the same figure, read from outside.
* What the pool *hosts* at real lengths is ``pool tokens ÷ tokens per finished sequence``
  (:func:`sequences_hosted`); under thrash the median running count is that number, measured.
* A cap at ≈ 1.0× hosted gained 2–3 % throughput; 0.8× gained nothing; 0.4–0.5× lost
  16–34 %. Recompute after preemptions was 5–8 % of engine time: the ceiling of any gain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from vllm_guardian.config import PolicyConfig

GIB = 1024**3


class Lever(StrEnum):
    """What the ladder can change about how vLLM is launched, one rung at a time."""

    MAX_NUM_SEQS = "max_num_seqs"
    MAX_NUM_BATCHED_TOKENS = "max_num_batched_tokens"
    GPU_MEMORY_UTILIZATION = "gpu_memory_utilization"
    EXPANDABLE_SEGMENTS = "expandable_segments"


class Step(StrEnum):
    """How a lever moves one rung down (multiplicative decrease, with a floor, as AIMD)."""

    MULTIPLY = "multiply"  # value × factor per rung, not below the floor (integers)
    SUBTRACT = "subtract"  # value − step per rung, not below the floor (ratios)
    SWITCH = "switch"  # one rung: on


@dataclass(frozen=True)
class Baseline:
    """The operator's own values, before the guardian changed anything."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float


@dataclass(frozen=True)
class LeverSpec:
    """One lever: what it writes, how it steps and which of the operator's policy settings
    bound it. Read by the policy (rungs, flags, operator relaunches), ``diagnose``/``plan``
    (the values it recommends) and checked against the flags whitelist
    (``actuators/flags.py``) and the twin's parser by ``tests/test_levers.py``."""

    lever: Lever
    flag: str | None  # the vLLM flag it sets (a switch: a flag without a value)
    env: tuple[str, str] | None  # (variable, value) that a switch sets instead of a flag
    # Flags written beside it: smaller prefill chunks only help with chunked prefill on.
    companions: tuple[tuple[str, str], ...]
    step: Step
    baseline_field: str | None  # the :class:`Baseline` field holding the operator's value
    # The ``policy.`` settings (PolicyConfig fields) that bound it: the factor (MULTIPLY) or
    # the step (SUBTRACT) per rung, and the floor.
    step_setting: str | None
    floor_setting: str | None
    # Where the operator's value comes from when the guardian first sees vLLM, first found
    # wins: the ``LaunchFlags`` field its command line sets (``core/budget.py``), the
    # ``ServiceSignals`` field where vLLM reports the value it runs with, and vLLM's own
    # default by the card's memory: ((from bytes, value), ...), largest first.
    launch_field: str | None = None
    reported_field: str | None = None
    vllm_default: tuple[tuple[int, float], ...] = ()
    # Other variables given the same value as ``env``: torch reads one of
    # PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, and which one wins when both are set
    # depends on its version (torch 2.11 on an H100 and 2.13 on CPU obeyed the CUDA one:
    # bench/results/gpu/), so the lever sets both.
    env_also: tuple[str, ...] = ()

    def step_size(self, p: PolicyConfig) -> float:
        assert self.step_setting is not None, self.lever
        return float(getattr(p, self.step_setting))

    def floor(self, p: PolicyConfig) -> float:
        assert self.floor_setting is not None, self.lever
        return float(getattr(p, self.floor_setting))

    def lowered(self, value: float, rungs: int, p: PolicyConfig) -> float:
        """``value`` moved ``rungs`` rungs down, not below the floor."""
        if self.step is Step.MULTIPLY:
            return max(self.floor(p), float(int(value * self.step_size(p) ** rungs)))
        return max(self.floor(p), round(value - self.step_size(p) * rungs, 4))

    def parse(self, text: str) -> int | float:
        """A value of the flag, as the :class:`Baseline` field holds it."""
        return int(text) if self.step is Step.MULTIPLY else float(text)

    def rebased(self, base: Baseline, text: str) -> Baseline:
        """``base`` with the operator's new value of this lever's flag."""
        assert self.baseline_field is not None, self.lever
        change: dict[str, Any] = {self.baseline_field: self.parse(text)}
        return replace(base, **change)

    def operator_value(self, launch: object, reported: object, gpu_total_bytes: int) -> float:
        """The operator's value (see ``launch_field``), typed as its :class:`Baseline` field."""
        given = getattr(launch, self.launch_field) if self.launch_field else None
        seen = getattr(reported, self.reported_field) if reported and self.reported_field else None
        default = next(v for least, v in self.vllm_default if gpu_total_bytes >= least)
        value = given or seen or default
        return int(value) if self.step is Step.MULTIPLY else float(value)

    def text(self, value: float) -> str:
        """The value as the flag takes it."""
        return str(int(value)) if self.step is Step.MULTIPLY else f"{value:g}"

    def base_value(self, base: Baseline) -> float:
        assert self.baseline_field is not None, self.lever
        return float(getattr(base, self.baseline_field))


LEVERS: Mapping[Lever, LeverSpec] = {
    spec.lever: spec
    for spec in (
        LeverSpec(
            Lever.MAX_NUM_SEQS,
            flag="--max-num-seqs",
            env=None,
            companions=(),
            step=Step.MULTIPLY,
            baseline_field="max_num_seqs",
            step_setting="max_num_seqs_factor_ratio",
            floor_setting="max_num_seqs_floor",
            launch_field="max_num_seqs",
            # vLLM 0.33's API server: 1024 on a GPU of 70 GiB or more, 256 below.
            vllm_default=((70 * GIB, 1024), (0, 256)),
        ),
        LeverSpec(
            Lever.MAX_NUM_BATCHED_TOKENS,
            flag="--max-num-batched-tokens",
            env=None,
            companions=(("--enable-chunked-prefill", ""),),
            step=Step.MULTIPLY,
            baseline_field="max_num_batched_tokens",
            step_setting="max_num_batched_tokens_factor_ratio",
            floor_setting="max_num_batched_tokens_floor",
            launch_field="max_num_batched_tokens",
            # vLLM 0.33's API server: 16384 from 160 GiB, 8192 from 70 GiB, 2048 below.
            vllm_default=((160 * GIB, 16384), (70 * GIB, 8192), (0, 2048)),
        ),
        LeverSpec(
            Lever.GPU_MEMORY_UTILIZATION,
            flag="--gpu-memory-utilization",
            env=None,
            companions=(),
            step=Step.SUBTRACT,
            baseline_field="gpu_memory_utilization",
            step_setting="gpu_memory_utilization_step_ratio",
            floor_setting="gpu_memory_utilization_floor_ratio",
            launch_field="gpu_memory_utilization_ratio",
            reported_field="gpu_memory_utilization_ratio",  # from vllm:cache_config_info
            vllm_default=((0, 0.92),),
        ),
        LeverSpec(
            Lever.EXPANDABLE_SEGMENTS,
            flag=None,
            env=("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
            companions=(),
            step=Step.SWITCH,
            baseline_field=None,
            step_setting=None,
            floor_setting=None,
            env_also=("PYTORCH_CUDA_ALLOC_CONF",),
        ),
    )
}


def lever_spec(lever: Lever) -> LeverSpec:
    """The row for ``lever`` (every member has one: ``tests/test_levers.py``)."""
    return LEVERS[lever]


def lever_of_flag(flag: str) -> Lever | None:
    """The lever that writes ``flag``; None for a flag no lever owns."""
    return next((s.lever for s in LEVERS.values() if s.flag == flag), None)


# The sentence every surface uses (diagnose, plan, loadtest, the policy's audit line).
LOW_CAP_COSTS = (
    "a --max-num-seqs below what the pool hosts costs throughput (measured on vLLM 0.32: "
    "-5 to -13 % at 0.8x hosted, -16 to -34 % at 0.4-0.5x; at 1.0x at most +2-3 %)"
)


def sequences_hosted(
    pool_tokens: float | None, tokens_per_sequence: float | None, usage_ratio: float = 1.0
) -> int | None:
    """Sequences of ``tokens_per_sequence`` (prompt + output) that ``usage_ratio`` of a pool of
    ``pool_tokens`` holds at once; None when either size is unknown or not positive."""
    if not pool_tokens or not tokens_per_sequence or pool_tokens <= 0 or tokens_per_sequence <= 0:
        return None
    return max(0, math.floor(usage_ratio * pool_tokens / tokens_per_sequence))


def admission_limit(usable_blocks: int | None, blocks_per_prompt: int | None) -> int | None:
    """The most requests vLLM V1 runs at once: it admits one only when its prompt's blocks are
    free. None when unknown."""
    if not usable_blocks or not blocks_per_prompt or usable_blocks <= 0 or blocks_per_prompt <= 0:
        return None
    return usable_blocks // blocks_per_prompt


def median(values: Sequence[float]) -> float | None:
    """The median (mean of the middle two for an even count); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2.0


def mean_context_tokens(
    kv_usage_ratio: float | None, pool_tokens: float | None, running: float | None
) -> float | None:
    """Tokens held per running sequence: the KV pool's used tokens ÷ the running count."""
    if kv_usage_ratio is None or not pool_tokens or not running or running <= 0:
        return None
    return kv_usage_ratio * pool_tokens / running


def recompute_share(
    preemptions_per_second: float | None,
    mean_context: float | None,
    tokens_per_second: float | None,
) -> float | None:
    """The share of forwarded tokens spent recomputing preempted sequences, estimated as
    ``preemptions/s × mean context tokens ÷ tokens/s`` (a preempted sequence is recomputed from
    its start on V1). None when any input is unknown or there is no throughput to compare."""
    if preemptions_per_second is None or mean_context is None or not tokens_per_second:
        return None
    if tokens_per_second <= 0:
        return None
    return max(0.0, preemptions_per_second) * mean_context / tokens_per_second
