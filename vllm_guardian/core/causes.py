"""What the guardian knows about each cause, as one row per cause. Pure data.

Where it sits: a leaf of the pure core. Read by ``core/diagnosis.py`` (the ranking's
tie-break, which causes are ever a verdict, which evidence a model that cannot fit explains),
``core/ladder.py`` (the lever a cause moves, whether it escalates and with what sentence,
whether it crashes the engine, how many episodes before the lever steps) and
``diagnose/recommend.py`` (which remedy it writes). Adding a cause is a member of
:class:`~vllm_guardian.model.Cause` and a row here; ``tests/test_causes.py`` fails when a
member has no row, so a forgotten row is a failed test, not a ``KeyError`` in a production tick.

The two kinds of pressure (``docs/design.md``) are a column: KV-cache pressure lives inside
the memory vLLM reserved and never crashes the engine (vLLM preempts and queues), so it is
answered at the gate and with capacity, not with a restart; device-memory pressure lives
outside the reservation (activations, the allocator, other processes on the card) and ends
in a CUDA OOM, so it is answered with a lever and, on a crash, at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from vllm_guardian.core.levers import Lever
from vllm_guardian.model import Cause


class Pressure(StrEnum):
    """Where the memory ran out (``docs/design.md``, "Two kinds of pressure")."""

    KV_CACHE = "kv_cache"  # inside vLLM's reservation: the KV pool is full
    DEVICE_MEMORY = "device_memory"  # outside it: activations, the allocator, other processes
    NONE = "none"  # not a memory cause: a dead engine, a failed GPU, nothing wrong


class Remedy(StrEnum):
    """What ``vllm-guardian diagnose`` recommends; ``diagnose/recommend.py`` has one writer per
    member (its test checks that every member has one)."""

    RESERVE_LESS = "reserve_less"  # a lower --gpu-memory-utilization
    SHORTEN_MAX_MODEL_LEN = "shorten_max_model_len"  # what the KV pool can hold
    ADD_CAPACITY = "add_capacity"  # replicas or shed at the gate; never a lower --max-num-seqs
    SMALLER_PREFILL = "smaller_prefill"  # a lower --max-num-batched-tokens
    EXPANDABLE_SEGMENTS = "expandable_segments"  # the allocator grows segments in place
    MAKE_IT_FIT = "make_it_fit"  # more GPUs, a shorter context, a smaller dtype
    RESTART = "restart"  # drain and restart: no flag helps
    RESET_GPU = "reset_gpu"  # a person resets or replaces the GPU; no restart
    NOTHING = "nothing"  # no failure to fix


@dataclass(frozen=True)
class CauseSpec:
    """One cause: how it ranks, what the ladder does about it, what ``diagnose`` says."""

    cause: Cause
    # Lower is more specific: between two equally convincing causes, the more specific one
    # names the lever (a fragmentation OOM is also "memory overcommit", but only the former
    # says which lever helps).
    specificity: int
    pressure: Pressure
    lever: Lever | None  # the ladder's lever for it; None: a restart, an escalation or nothing
    # It kills the engine (a CUDA OOM, a dead process): one unambiguous event is acted on at
    # once, without waiting for repeats, and inside the cooldown when the instance our last
    # action started dies early.
    crashes: bool
    # Why restarting cannot fix it, as the breaker's latch sentence; None: the ladder acts.
    escalation: str | None
    # Naming it says the replica is already down (a dead or hung engine): acting needs no
    # fleet permit and the restart is not a voluntary interruption.
    already_down: bool
    # Drain and restart on the first episode; the lever waits for ``episodes_to_step``.
    # Otherwise evidence that is not a crash waits for the episodes and then steps the lever.
    restart_first: bool
    # Pressure episodes before the lever steps; None: the operator's
    # ``policy.pressure_events_to_relaunch``.
    episodes_to_step: int | None
    # It can be the verdict. A low prefix-cache hit rate is measured to be harmless, so it is
    # named only to say "no"; "healthy" is what is left when nothing ranks.
    verdict: bool
    # When the model cannot fit the card at all, evidence for this cause is that instead.
    explained_by_misfit: bool
    remedy: Remedy


CAUSES: Mapping[Cause, CauseSpec] = {
    spec.cause: spec
    for spec in (
        CauseSpec(
            Cause.GPU_HARDWARE_FAULT,
            specificity=0,
            pressure=Pressure.NONE,
            lever=None,
            crashes=False,
            escalation="GPU hardware fault: the GPU needs a reset; restarting vLLM would crash-loop",
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=False,
            remedy=Remedy.RESET_GPU,
        ),
        CauseSpec(
            Cause.MODEL_DOES_NOT_FIT,
            specificity=1,
            pressure=Pressure.DEVICE_MEMORY,
            lever=None,
            crashes=False,
            escalation="the model does not fit this GPU at these settings; no flag saves it",
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=False,
            remedy=Remedy.MAKE_IT_FIT,
        ),
        CauseSpec(
            Cause.ALLOCATOR_FRAGMENTATION,
            specificity=2,
            pressure=Pressure.DEVICE_MEMORY,
            lever=Lever.EXPANDABLE_SEGMENTS,
            crashes=True,
            escalation=None,
            already_down=False,
            # A drain and restart gives the stranded segments back; only a repeat earns
            # expandable segments.
            restart_first=True,
            episodes_to_step=2,
            verdict=True,
            explained_by_misfit=False,
            remedy=Remedy.EXPANDABLE_SEGMENTS,
        ),
        CauseSpec(
            Cause.PREFILL_BURST,
            specificity=3,
            pressure=Pressure.DEVICE_MEMORY,
            lever=Lever.MAX_NUM_BATCHED_TOKENS,
            crashes=True,
            escalation=None,
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=True,
            remedy=Remedy.SMALLER_PREFILL,
        ),
        CauseSpec(
            Cause.KV_CACHE_BLOWOUT,
            specificity=4,
            pressure=Pressure.KV_CACHE,
            lever=None,
            crashes=False,
            escalation=(
                "max_model_len exceeds what the KV pool holds; lowering it changes what users "
                "can send"
            ),
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=True,
            remedy=Remedy.SHORTEN_MAX_MODEL_LEN,
        ),
        CauseSpec(
            Cause.CONCURRENCY_OVERCOMMIT,
            specificity=5,
            pressure=Pressure.KV_CACHE,
            # Only through the guarded relaunch (``core/ladder.py``'s ``_concurrency_relaunch``): a cap
            # below what the pool hosts costs throughput (``core/levers.py``).
            lever=Lever.MAX_NUM_SEQS,
            crashes=False,
            escalation=None,
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=True,
            remedy=Remedy.ADD_CAPACITY,
        ),
        CauseSpec(
            Cause.ENGINE_INPUT_HANG,
            # More specific than a dead engine: it says where the requests are lost.
            specificity=6,
            pressure=Pressure.NONE,
            lever=None,
            # Not a crash: the evidence is a wait (the gate's oldest unanswered request), so a
            # restarted instance that hangs again waits out the cooldown like a stall.
            crashes=False,
            escalation=None,
            already_down=True,
            restart_first=True,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=False,
            remedy=Remedy.RESTART,
        ),
        CauseSpec(
            Cause.ENGINE_DEAD,
            specificity=7,
            pressure=Pressure.NONE,
            lever=None,
            crashes=True,
            escalation=None,
            already_down=True,
            restart_first=True,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=False,
            remedy=Remedy.RESTART,
        ),
        CauseSpec(
            Cause.GPU_MEMORY_OVERCOMMIT,
            specificity=8,
            pressure=Pressure.DEVICE_MEMORY,
            lever=Lever.GPU_MEMORY_UTILIZATION,
            crashes=True,
            escalation=None,
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=True,
            explained_by_misfit=True,
            remedy=Remedy.RESERVE_LESS,
        ),
        CauseSpec(
            Cause.PREFIX_CACHE_WASTE,
            specificity=9,
            pressure=Pressure.KV_CACHE,
            # V1's cached blocks are evictable: no flag frees memory here.
            lever=None,
            crashes=False,
            escalation=None,
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=False,
            explained_by_misfit=False,
            remedy=Remedy.NOTHING,
        ),
        CauseSpec(
            Cause.HEALTHY,
            specificity=10,
            pressure=Pressure.NONE,
            lever=None,
            crashes=False,
            escalation=None,
            already_down=False,
            restart_first=False,
            episodes_to_step=None,
            verdict=False,
            explained_by_misfit=False,
            remedy=Remedy.NOTHING,
        ),
    )
}


def cause_spec(cause: Cause) -> CauseSpec:
    """The row for ``cause`` (every member has one: ``tests/test_causes.py``)."""
    return CAUSES[cause]
