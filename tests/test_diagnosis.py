"""Cause classification: OOM lines by their numbers, ranking, and what is never a verdict."""

from __future__ import annotations

import pytest

from vllm_guardian.core.diagnosis import (
    Evidence,
    actionable,
    classify_oom,
    evidence_from_logs,
    rank,
    verdict,
)
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.formats.vllm_log_format import match_line
from vllm_guardian.model import Cause, HealthState, LogEvent, LogEventKind

GIB = 1024**3


def oom(tried: float, unalloc: float | None = None) -> LogEvent:
    details = [("tried_bytes", str(int(tried * GIB)))]
    if unalloc is not None:
        details.append(("reserved_unallocated_bytes", str(int(unalloc * GIB))))
    return LogEvent(LogEventKind.CUDA_OOM, 0.0, "CUDA out of memory", tuple(details))


def sig(others_gib: float | None) -> ServiceSignals:
    others = None if others_gib is None else int(others_gib * GIB)
    return ServiceSignals(
        "vllm", HealthState.UP, True, True, True, other_processes_memory_bytes=others
    )


OOMS = [
    # tried GiB, reserved-unallocated GiB, other processes GiB, cause
    (0.5, 4.0, 0.0, Cause.ALLOCATOR_FRAGMENTATION),
    (6.0, 8.0, None, Cause.ALLOCATOR_FRAGMENTATION),  # the memory exists, fragmented
    (0.5, 0.1, 6.0, Cause.GPU_MEMORY_OVERCOMMIT),  # another tenant took it
    (6.0, 0.1, 0.0, Cause.PREFILL_BURST),  # one big activation allocation
    (0.2, None, None, Cause.GPU_MEMORY_OVERCOMMIT),  # no other evidence
]


@pytest.mark.parametrize(("tried", "unalloc", "others", "cause"), OOMS)
def test_oom_classification(tried, unalloc, others, cause):
    e = classify_oom(oom(tried, unalloc), sig(others))
    assert e.cause is cause and e.unambiguous


def test_engine_death_joins_the_cause_the_logs_give():
    evidence = [
        *evidence_from_logs(
            [oom(6.0), LogEvent(LogEventKind.ENGINE_DEAD, 0.0, "EngineDeadError")], None
        ),
        Evidence(Cause.ENGINE_DEAD, "VllmEngineDead", "health 503", unambiguous=True),
    ]
    findings = rank(evidence)
    assert [f.cause for f in findings] == [Cause.PREFILL_BURST]
    assert findings[0].evidence[0].name == "log:cuda_oom"  # the cause's own evidence first


def test_a_gpu_hardware_error_line_outranks_everything():
    line = "(EngineCore_DP0 pid=7) ERROR 11-22 01:56:48 [core.py:1007] RuntimeError: CUDA error: uncorrectable ECC error encountered"
    kind, _ = match_line(line) or (None, None)
    assert kind is LogEventKind.GPU_HARDWARE_ERROR
    ev = evidence_from_logs(
        [
            LogEvent(LogEventKind.GPU_HARDWARE_ERROR, 0.0, line),
            LogEvent(LogEventKind.ENGINE_FATAL, 0.0, "EngineCore encountered a fatal error."),
        ],
        None,
    )
    assert verdict(rank(ev)) is Cause.GPU_HARDWARE_FAULT


def test_prefix_cache_waste_is_never_a_verdict():
    ev = [Evidence(Cause.PREFIX_CACHE_WASTE, "LowHitRate", "hit rate 0.0", unambiguous=True)]
    assert rank(ev) == () and verdict(rank(ev)) is Cause.HEALTHY


def test_actionable_needs_one_unambiguous_or_two_independent():
    one = rank([Evidence(Cause.GPU_MEMORY_OVERCOMMIT, "OverBudget", "x")])[0]
    two = rank(
        [
            Evidence(Cause.GPU_MEMORY_OVERCOMMIT, "OverBudget", "x"),
            Evidence(Cause.GPU_MEMORY_OVERCOMMIT, "OtherProcesses", "y"),
        ]
    )[0]
    same_twice = rank([Evidence(Cause.GPU_MEMORY_OVERCOMMIT, "OverBudget", "x")] * 2)[0]
    assert (actionable(one), actionable(two), actionable(same_twice)) == (False, True, False)


STARTUP = [
    # PyTorch held GiB, asked GiB, card GiB, other tenants GiB → cause
    (131.4, 52.2, 80, 0.0, Cause.MODEL_DOES_NOT_FIT),  # Llama-3-70B at TP 1 on one 80 GiB card
    (40.0, 2.0, 80, 30.0, Cause.GPU_MEMORY_OVERCOMMIT),  # another tenant holds 30 GiB
    (60.0, 4.0, 80, 0.0, Cause.GPU_MEMORY_OVERCOMMIT),  # it fits; the profile run collided
]


@pytest.mark.parametrize(("held", "asked", "card", "others", "cause"), STARTUP)
def test_an_oom_while_starting_asks_whether_the_model_fits(held, asked, card, others, cause):
    ev = LogEvent(
        LogEventKind.CUDA_OOM,
        0.0,
        "CUDA out of memory",
        (
            ("tried_bytes", str(int(asked * GIB))),
            ("allocated_bytes", str(int(held * GIB))),
            ("total_bytes", str(int(card * GIB))),
        ),
    )
    failed = LogEvent(LogEventKind.STARTUP_FAILED, 0.0, "EngineCore failed to start.")
    (found,) = [
        e for e in evidence_from_logs([ev, failed], sig(others)) if e.name == "log:cuda_oom"
    ]
    assert found.cause is cause
