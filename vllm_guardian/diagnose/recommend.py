"""The fix: which flags to change, old → new, with one line of reasoning each.

One rule per cause, each on the lever that cause moves (docs/capacity.md for KV pressure):
KV-pool pressure is a capacity problem, answered with admission at the gate and replicas (by
how much: ``core/capacity.py``), never a lower ``--max-num-seqs`` (measured: it costs
throughput) nor a lower utilization (it shrinks the pool);
device-memory pressure with a lower ``--gpu-memory-utilization`` / ``--max-num-batched-tokens``
or ``expandable_segments``; a hardware fault with *no* restart. The output is both a
ready-to-paste command line and the guardian's environment file (``actuators/flags.py``
renders it, so only whitelisted flags with valid values appear there).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.budget import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Deployment,
    KvBudget,
    LaunchFlags,
    ModelShape,
    StartupSizing,
    default_max_num_batched_tokens,
    fit_options,
)
from vllm_guardian.core.capacity import CapacityEstimate, CapacityState
from vllm_guardian.core.causes import Remedy, cause_spec
from vllm_guardian.core.levers import LOW_CAP_COSTS, Lever, lever_spec, sequences_hosted
from vllm_guardian.diagnose.report import EnvChange, FlagChange, Recommendation, gib
from vllm_guardian.model import Cause

GIB = 1024**3
# Left free below what another process already holds when lowering the utilization: the CUDA
# context and a monitoring tool's allocation appear after vLLM measured free memory.
UTILIZATION_MARGIN_BYTES = GIB // 2
# The step, factor and floor of each flag are the ladder's (core/levers.py), under the
# operator's policy settings: diagnose never recommends a lever below the guardian's floor.
_UTILIZATION = lever_spec(Lever.GPU_MEMORY_UTILIZATION)
_BATCHED_TOKENS = lever_spec(Lever.MAX_NUM_BATCHED_TOKENS)


@dataclass(frozen=True)
class Context:
    verdict: Cause
    flags: LaunchFlags
    cmdline: tuple[str, ...] | None
    budget: KvBudget | None = None
    model: ModelShape | None = None
    sizing: StartupSizing = field(default_factory=StartupSizing)
    gpu_total_bytes: int | None = None
    gpu_free_bytes: int | None = None  # at start-up (the "Free memory on device" line) or now
    other_processes_bytes: int | None = None
    reported_utilization: float | None = None  # cache_config_info
    reported_max_num_seqs: int | None = None
    running_requests: float | None = None
    pool_tokens: int | None = None  # the pool as vLLM reports it (or the budget's)
    p95_request_tokens: float | None = None
    hardware_gpus: tuple[int, ...] = ()
    capacity: CapacityEstimate | None = None  # over the observed window (core/capacity.py)
    planned_concurrency: int | None = None  # `plan --concurrency`: requests at once to size for
    # The operator's policy settings (the config's ``policy:``; the shipped ones without one):
    # each lever's step and floor.
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def _fmt_ratio(v: float) -> str:
    return f"{v:.2f}"


def _floor2(v: float) -> float:
    return math.floor(v * 100 + 1e-9) / 100


def recommend(c: Context) -> Recommendation:
    rule = REMEDIES[cause_spec(c.verdict).remedy]
    if rule is None:
        return Recommendation("Nothing to change: no failure with evidence.")
    summary, changes, env, actions = rule(c)
    return _finish(c, summary, changes, env, actions)


_Out = tuple[str, list[FlagChange], list[EnvChange], list[str]]


def _flag(flag: str, old: object, new: str, reason: str) -> FlagChange:
    return FlagChange(
        flag,
        None if old is None else str(old),
        new,
        reason,
        guardian_may_set=flag in flagsfile.FLAGS,
    )


def _current_util(c: Context) -> float:
    return (
        c.flags.gpu_memory_utilization_ratio
        or c.reported_utilization
        or (c.budget.gpu_memory_utilization_ratio if c.budget else None)
        or DEFAULT_GPU_MEMORY_UTILIZATION
    )


def _overcommit(c: Context) -> _Out:
    old = _current_util(c)
    changes: list[FlagChange] = []
    total = c.gpu_total_bytes
    free = c.gpu_free_bytes
    if free is None and total is not None and c.other_processes_bytes is not None:
        free = total - c.other_processes_bytes
    floor = _UTILIZATION.floor(c.policy)
    below_floor: float | None = None
    if total and free is not None and free < old * total + UTILIZATION_MARGIN_BYTES:
        fits = _floor2((free - UTILIZATION_MARGIN_BYTES) / total)
        new = max(floor, fits)
        below_floor = fits if fits < floor else None
        reason = (
            f"asks for {gib(old * total)} of the {gib(total, 0)} card, but only {gib(free)} is "
            f"free beside other processes; {new:.2f} asks for {gib(new * total)}"
        )
    else:
        new = max(floor, _floor2(old - _UTILIZATION.step_size(c.policy)))
        reason = f"leaves {gib((1 - new) * total) if total else 'more'} for what vLLM's profile does not count"
    if new < old:
        changes.append(_flag("--gpu-memory-utilization", _fmt_ratio(old), _fmt_ratio(new), reason))
    actions = [
        "find who else holds memory on the card (nvidia-smi) and move it, or keep the lower reservation"
    ]
    if below_floor is not None:
        actions.append(
            f"fitting beside the other processes takes {below_floor:.2f}, below the floor "
            f"{floor:.2f} (policy.{_UTILIZATION.floor_setting}): the guardian will not go "
            "lower; move the other process, or lower the floor where a smaller KV pool is "
            "acceptable"
        )
    if c.sizing.recommended_kv_cache_memory_bytes:
        kv = c.sizing.recommended_kv_cache_memory_bytes
        actions.append(
            f"or pin the KV size vLLM measured on its last good start: --kv-cache-memory-bytes {kv} ({gib(kv, 2)})"
        )
    return (
        "Reserve less of the card: the reservation collides with memory others hold.",
        changes,
        [],
        actions,
    )


def _blowout(c: Context) -> _Out:
    b = c.budget
    old = c.flags.max_model_len or (b.max_model_len if b else None)
    fit = c.sizing.estimated_max_model_len
    if fit is None and b is not None and b.pool_tokens > 0:
        fit = b.largest_max_model_len(1)
    changes: list[FlagChange] = []
    if fit is not None and fit > 0 and (old is None or fit < old):
        changes.append(
            _flag(
                "--max-model-len",
                old,
                str(fit),
                f"the KV pool holds {fit:,} tokens: the longest sequence it can serve",
            )
        )
    actions = [
        "or halve KV bytes with --kv-cache-dtype fp8 (numerics change), or add GPUs (--tensor-parallel-size)"
    ]
    return (
        "Shorten max_model_len to what the KV pool can hold (user-visible: longer prompts get 400).",
        changes,
        [],
        actions,
    )


def concurrency_advice(
    capacity: CapacityEstimate | None,
    hosted: int | None,
    hosted_why: str,
    max_num_seqs: int | None = None,
) -> tuple[str, list[str]]:
    """KV thrash, said the same way by diagnose, plan and loadtest: over capacity by X× (or
    not measurable, and why), add N replicas or shed at the gate, and what a lower
    ``--max-num-seqs`` would cost. Never a lower ``--max-num-seqs`` as the fix: a cap below what
    the pool hosts costs throughput (docs/capacity.md)."""
    if capacity is not None and capacity.demand_ratio is not None:
        n = capacity.replicas_needed or 1
        summary = (
            f"Over capacity by {capacity.demand_ratio:.2f}x: KV thrash is a capacity problem. "
            f"Run {n} replica(s) (add {max(0, n - 1)}) or shed at the gate."
        )
        first = [capacity.line()]
    else:
        why = f": {capacity.reason}" if capacity is not None else ""
        lead = (
            "Saturated (KV thrash); "
            if capacity is None or capacity.state is not CapacityState.NO_DATA
            else ""
        )
        summary = (
            f"{lead}capacity not measurable from this data{why}. KV thrash is a capacity "
            "problem: add replicas or shed at the gate."
        )
        summary = summary[0].upper() + summary[1:]
        first = []
    pool = (
        f"the pool hosts about {hosted} sequences ({hosted_why})"
        if hosted
        else "what the pool hosts is the median running count under thrash"
    )
    cap = f" (now {max_num_seqs})" if max_num_seqs else ""
    actions = [
        *first,
        "shed at the gate: the guardian's /ready/<service> and admission gate hold new work "
        "while the pool is full (per-key shares keep one tenant from starving the rest); or "
        "add replicas (scale on vllm_guardian_capacity_demand_ratio: docs/capacity.md)",
        f"keep --max-num-seqs{cap} at or above what the pool hosts: {pool}; {LOW_CAP_COSTS}",
        "do not restart or relaunch for it: no flag on one server removes the queueing",
        "do not lower --gpu-memory-utilization: it shrinks the KV pool",
    ]
    return summary, actions


def _concurrency(c: Context) -> _Out:
    b = c.budget
    old = c.flags.max_num_seqs or c.reported_max_num_seqs or (b.max_num_seqs if b else None)
    pool = c.pool_tokens or (b.pool_tokens if b else None)
    # What the pool hosts: the larger of its size at the p95 request length (conservative: real
    # requests are shorter on average) and the running count under thrash (one reading).
    readings: list[tuple[int, str]] = []
    by_size = sequences_hosted(pool, c.p95_request_tokens)
    if by_size is not None and c.p95_request_tokens:
        readings.append((by_size, f"{pool:,} tokens ÷ the p95 request {c.p95_request_tokens:,.0f}"))
    if c.running_requests:
        readings.append((int(c.running_requests), "requests running under thrash"))
    hosted = max((n for n, _ in readings), default=None)
    why = "; ".join(f"{n}: {text}" for n, text in readings)
    summary, actions = concurrency_advice(c.capacity, hosted, why, old)
    if c.planned_concurrency and hosted:
        n = math.ceil(c.planned_concurrency / hosted)
        actions.insert(
            0,
            f"for {c.planned_concurrency} concurrent requests: {c.planned_concurrency} ÷ {hosted} "
            f"sequences per replica = {n} replica(s), or shed the rest at the gate",
        )
    return summary, [], [], actions


def _prefill(c: Context) -> _Out:
    total = c.gpu_total_bytes
    old = c.flags.max_num_batched_tokens or (c.budget.max_num_batched_tokens if c.budget else None)
    if old is None and total:
        old = default_max_num_batched_tokens(total)
    changes = []
    if old is not None:
        new = int(_BATCHED_TOKENS.lowered(old, 1, c.policy))
        if new < old:
            changes.append(
                _flag(
                    "--max-num-batched-tokens",
                    old,
                    str(new),
                    "smaller prefill chunks: the attention workspace of a step grows with it and the profile run never sees long-context chunks",
                )
            )
    if c.flags.enable_chunked_prefill is False:
        changes.append(
            _flag("--enable-chunked-prefill", "off", "", "split long prompts across steps")
        )
    return (
        "Batch fewer prompt tokens per step: a burst of long prompts overflowed the card.",
        changes,
        [],
        [],
    )


def _fragmentation(c: Context) -> _Out:
    # Both names: torch parses one, and which one wins when both are set depends on its
    # version (torch 2.13 parses PYTORCH_CUDA_ALLOC_CONF; other versions PYTORCH_ALLOC_CONF).
    env = [
        EnvChange(
            name,
            None,
            "expandable_segments:True",
            "lets the allocator grow segments instead of stranding reserved blocks"
            + " (set both names alike: which one torch reads depends on its version; keep "
            "any other allocator keys you set, comma-separated)",
        )
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    ]
    actions = [
        "drain and restart vLLM to give the fragmented memory back (the guardian does this at rung 3)"
    ]
    return "Fragmentation, not load: reserved memory sits unallocated.", [], env, actions


def _does_not_fit(c: Context) -> _Out:
    changes: list[FlagChange] = []
    actions: list[str] = []
    if c.model is not None and c.gpu_total_bytes:
        d = Deployment(
            gpu_memory_total_bytes=c.gpu_total_bytes,
            gpu_memory_utilization_ratio=_current_util(c),
            tensor_parallel_size=c.flags.tensor_parallel_size,
            max_model_len=c.flags.max_model_len,
            max_num_seqs=c.flags.max_num_seqs,
            max_num_batched_tokens=c.flags.max_num_batched_tokens,
            kv_cache_dtype=c.flags.kv_cache_dtype,
            block_size=c.flags.block_size,
            enforce_eager=c.flags.enforce_eager,
        )
        for opt in fit_options(c.model, d):
            actions.append(
                f"{opt.change}: leaves {gib(opt.kv_pool_bytes)} KV = {opt.pool_tokens:,} tokens per GPU"
            )
        if actions:
            first = fit_options(c.model, d)[0]
            for flag, value in first.flags:
                old = c.flags.tensor_parallel_size if flag == "--tensor-parallel-size" else None
                changes.append(_flag(flag, old, value, f"makes it fit: {first.change}"))
    if not actions:
        actions.append("a larger GPU, more GPUs (--tensor-parallel-size) or a quantized checkpoint")
    return (
        "The model does not fit on this card at this precision: no memory flag saves it.",
        changes,
        [],
        actions,
    )


def _engine_dead(c: Context) -> _Out:
    actions = [
        "drain and restart vLLM (the guardian does this at rung 3); no flag change helps a dead or hung engine",
        "if it exited with status 0, the unit needs Restart=always: Restart=on-failure never fires",
    ]
    return "The engine died or hung: restart it; the journal above says why.", [], [], actions


def _hardware(c: Context) -> _Out:
    gpus = ", ".join(str(g) for g in c.hardware_gpus) or "the service's GPU"
    actions = [
        "do NOT restart vLLM: it would crash-loop on a failed GPU",
        f"drain the node, then reset GPU {gpus} (nvidia-smi -r -i N, or reboot) and check nvidia-smi -q -d ECC,ROW_REMAPPER",
        "if the XID recurs after a reset, replace the GPU",
    ]
    return "The GPU failed (XID/ECC): escalate to a person, no restart.", [], [], actions


# One writer per remedy (the cause table, ``core/causes.py``, says which remedy a cause gets);
# None: nothing to change. A remedy without a writer fails ``tests/test_causes.py``.
REMEDIES: Mapping[Remedy, Callable[[Context], _Out] | None] = {
    Remedy.RESERVE_LESS: _overcommit,
    Remedy.SHORTEN_MAX_MODEL_LEN: _blowout,
    Remedy.ADD_CAPACITY: _concurrency,
    Remedy.SMALLER_PREFILL: _prefill,
    Remedy.EXPANDABLE_SEGMENTS: _fragmentation,
    Remedy.MAKE_IT_FIT: _does_not_fit,
    Remedy.RESTART: _engine_dead,
    Remedy.RESET_GPU: _hardware,
    Remedy.NOTHING: None,
}


def command_line(
    cmdline: Sequence[str] | None, changes: Sequence[FlagChange], model: str | None
) -> str | None:
    """The launch command with each changed flag replaced where it was, else appended."""
    if not changes:
        return None
    argv = list(cmdline) if cmdline else ["vllm", "serve", model or "MODEL"]
    for ch in changes:
        new = [ch.flag] + ([ch.new] if ch.new else [])
        replaced = False
        out: list[str] = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if a == ch.flag or a.startswith(ch.flag + "="):
                if not replaced:
                    out += new
                    replaced = True
                takes_value = bool(ch.new) and a == ch.flag
                i += 2 if takes_value else 1
                continue
            out.append(a)
            i += 1
        if not replaced:
            out += new
        argv = out
    return shlex.join(argv)


def env_file(changes: Sequence[FlagChange], env: Sequence[EnvChange]) -> str | None:
    allowed = [(c.flag, c.new) for c in changes if c.guardian_may_set]
    env_pairs = [(e.name, e.new) for e in env if e.name in flagsfile.ENV]
    if not allowed and not env_pairs:
        return None
    try:
        return flagsfile.render(flagsfile.validate(allowed, env_pairs))
    except flagsfile.FlagsRejected as e:  # a value outside the whitelist's range
        return f"# not writable by the guardian: {e}\n"


def _finish(
    c: Context, summary: str, changes: list[FlagChange], env: list[EnvChange], actions: list[str]
) -> Recommendation:
    for ch in changes:
        if not ch.guardian_may_set:
            actions.append(
                f"{ch.flag} is not a flag the guardian sets: change it in the vLLM unit itself"
            )
    return Recommendation(
        summary=summary,
        flags=tuple(changes),
        env=tuple(env),
        actions=tuple(actions),
        command_line=command_line(c.cmdline, changes, c.flags.model),
        env_file=env_file(changes, env),
    )
