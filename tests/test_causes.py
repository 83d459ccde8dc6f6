"""The cause table (core/causes.py) is total and says what the code does.

A cause added to the ``Cause`` enum without a row fails here, not as a ``KeyError`` in the
first production tick that names it; a remedy without a writer in ``diagnose`` fails here too.
"""

from __future__ import annotations

import inspect

import pytest

from vllm_guardian.actuators.alerts import default_rules_text
from vllm_guardian.core import diagnosis, observations
from vllm_guardian.core.alert_rules import parse_rules
from vllm_guardian.core.causes import CAUSES, Pressure, Remedy, cause_spec
from vllm_guardian.core.levers import Lever
from vllm_guardian.diagnose.recommend import REMEDIES
from vllm_guardian.model import Cause


@pytest.mark.parametrize("cause", list(Cause), ids=str)
def test_every_cause_has_a_row_filed_under_its_own_name(cause: Cause) -> None:
    assert cause in CAUSES, f"{cause!r} has no CauseSpec row in core/causes.py"
    assert cause_spec(cause).cause is cause


def test_every_remedy_has_a_writer_in_diagnose() -> None:
    missing = set(Remedy) - set(REMEDIES)
    assert not missing, f"diagnose/recommend.py has no writer for {sorted(missing)}"


def test_specificity_orders_the_causes_without_ties() -> None:
    ranks = [s.specificity for s in CAUSES.values()]
    assert len(set(ranks)) == len(ranks), f"two causes share a specificity: {ranks}"


# What each row promises, one line per cause: the lever, whether it escalates (no restart),
# whether it crashes the engine, and which kind of pressure it is.
EXPECTED = [
    # cause,                          lever,                         escalates, crashes, pressure
    (Cause.GPU_HARDWARE_FAULT,        None,                          True,  False, Pressure.NONE),
    (Cause.MODEL_DOES_NOT_FIT,        None,                          True,  False, Pressure.DEVICE_MEMORY),
    (Cause.ALLOCATOR_FRAGMENTATION,   Lever.EXPANDABLE_SEGMENTS,     False, True,  Pressure.DEVICE_MEMORY),
    (Cause.PREFILL_BURST,             Lever.MAX_NUM_BATCHED_TOKENS,  False, True,  Pressure.DEVICE_MEMORY),
    (Cause.KV_CACHE_BLOWOUT,          None,                          True,  False, Pressure.KV_CACHE),
    (Cause.CONCURRENCY_OVERCOMMIT,    Lever.MAX_NUM_SEQS,            False, False, Pressure.KV_CACHE),
    (Cause.ENGINE_INPUT_HANG,         None,                          False, False, Pressure.NONE),
    (Cause.ENGINE_DEAD,               None,                          False, True,  Pressure.NONE),
    (Cause.GPU_MEMORY_OVERCOMMIT,     Lever.GPU_MEMORY_UTILIZATION,  False, True,  Pressure.DEVICE_MEMORY),
    (Cause.PREFIX_CACHE_WASTE,        None,                          False, False, Pressure.KV_CACHE),
    (Cause.HEALTHY,                   None,                          False, False, Pressure.NONE),
]  # fmt: skip


@pytest.mark.parametrize(("cause", "lever", "escalates", "crashes", "pressure"), EXPECTED, ids=str)
def test_the_row_says_what_the_guardian_does(
    cause: Cause, lever: Lever | None, escalates: bool, crashes: bool, pressure: Pressure
) -> None:
    spec = cause_spec(cause)
    assert (spec.lever, spec.escalation is not None, spec.crashes, spec.pressure) == (
        lever,
        escalates,
        crashes,
        pressure,
    )


def test_kv_pressure_never_crashes_the_engine() -> None:
    # vLLM preempts and queues when its KV pool is full; the ladder's KV branch relies on it.
    kv = [s.cause for s in CAUSES.values() if s.pressure is Pressure.KV_CACHE and s.crashes]
    assert kv == []


def test_a_cause_that_is_never_a_verdict_recommends_nothing() -> None:
    for spec in CAUSES.values():
        if not spec.verdict:
            assert spec.remedy is Remedy.NOTHING, spec.cause
            assert spec.lever is None and spec.escalation is None, spec.cause


def test_the_table_above_states_every_cause() -> None:
    stated = [row[0] for row in EXPECTED]
    assert len(stated) == len(set(stated)), "a cause is stated twice"
    assert set(stated) == set(CAUSES), f"not stated: {sorted(set(CAUSES) - set(stated))}"


@pytest.mark.parametrize("cause", [c for c, spec in CAUSES.items() if spec.verdict], ids=str)
def test_every_cause_that_can_be_a_verdict_has_evidence(cause: Cause) -> None:
    # A row nothing ever names is a cause the guardian can never find: the evidence is a
    # shipped rule with ``cause:`` (a firing alert is evidence), or a branch of the log or
    # signal evidence in core/diagnosis.py or core/observations.py that names the member.
    # The branches are code, so the check reads their source for the member's name.
    by_rules = {r.cause for r in parse_rules(default_rules_text(), "rules.yaml")}
    branches = inspect.getsource(diagnosis) + inspect.getsource(observations)
    assert cause in by_rules or f"Cause.{cause.name}" in branches, (
        f"{cause} can be a verdict but no shipped rule names it (cause: {cause.value}) and no "
        "evidence branch in core/diagnosis.py or core/observations.py does"
    )
