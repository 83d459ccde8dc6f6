"""The lever table (core/levers.py) is total, and what it writes is what every other part takes.

A lever added to the ``Lever`` enum without a row fails here; so does a row whose flag the
flags whitelist (actuators/flags.py) would refuse at any rung the ladder can reach, or the twin
cannot parse, or whose settings name no ``policy.`` key. ``diagnose`` reads the same steps and
floors, under the operator's settings.
"""

from __future__ import annotations

import dataclasses

import pytest

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.config import PolicyConfig
from vllm_guardian.core.budget import LaunchFlags
from vllm_guardian.core.levers import LEVERS, Baseline, Lever, Step, lever_of_flag, lever_spec
from vllm_guardian.core.policy import can_step_down, default_baseline, flags_for, lever_value
from vllm_guardian.core.signals import ServiceSignals
from vllm_guardian.diagnose.recommend import Context, recommend
from vllm_guardian.model import Cause
from vllm_guardian.sim.flags import parse_serve_args

GIB = 1024**3
POLICY = PolicyConfig()
# vLLM's own defaults on a card under 70 GiB (core/policy.default_baseline, from each row, so
# a new lever's field is filled without an edit here), with 8192 batched tokens.
BASE = dataclasses.replace(default_baseline(None, ()), max_num_batched_tokens=2048 * 4)


@pytest.mark.parametrize("lever", list(Lever), ids=str)
def test_every_lever_has_a_row_filed_under_its_own_name(lever: Lever) -> None:
    assert lever in LEVERS, f"{lever!r} has no LeverSpec row in core/levers.py"
    assert lever_spec(lever).lever is lever


@pytest.mark.parametrize("lever", list(Lever), ids=str)
def test_the_row_names_real_settings_and_a_real_baseline_field(lever: Lever) -> None:
    spec = lever_spec(lever)
    policy_keys = {f.name for f in dataclasses.fields(PolicyConfig)}
    base_keys = {f.name for f in dataclasses.fields(Baseline)}
    if spec.step is Step.SWITCH:  # one thing switched on: a variable or a flag
        assert (spec.env is None) != (spec.flag is None), spec
        return
    assert spec.flag is not None and lever_of_flag(spec.flag) is lever
    assert spec.step_setting in policy_keys, spec.step_setting
    assert spec.floor_setting in policy_keys, spec.floor_setting
    assert spec.baseline_field in base_keys, spec.baseline_field


def _every_rung(lever: Lever) -> list[dict[Lever, int]]:
    """Rungs from the first to the floor (a switch: its one rung)."""
    out, rung = [], 1
    while True:
        out.append({lever: rung})
        if not can_step_down(lever, rung, BASE, POLICY):
            return out
        rung += 1


@pytest.mark.parametrize("lever", list(Lever), ids=str)
def test_the_whitelist_takes_every_rung_down_to_the_floor(lever: Lever) -> None:
    for rungs in _every_rung(lever):
        flags, env = flags_for(rungs, BASE, POLICY)
        flagsfile.validate(flags, env)  # raises FlagsRejected on anything it would not write


@pytest.mark.parametrize("lever", list(Lever), ids=str)
def test_the_twin_parses_what_the_lever_writes(lever: Lever) -> None:
    flags, env = flags_for({lever: 1}, BASE, POLICY)
    argv = [x for flag, value in flags for x in (flag, value) if x]
    opts = parse_serve_args(argv, dict(env))
    # The twin's engine names each setting as the lever does.
    assert hasattr(opts.engine, lever.value), f"the twin's EngineConfig has no {lever.value}"
    seen = getattr(opts.engine, lever.value)
    expected = lever_value(lever, 1, BASE, POLICY)
    assert expected is not None
    want: object = True if lever_spec(lever).step is Step.SWITCH else float(expected)
    assert seen == want, (lever, seen, want)


def _overcommit(policy: PolicyConfig, free_gib: float) -> tuple[str | None, tuple[str, ...]]:
    """diagnose's recommendation for a card with ``free_gib`` free beside another process."""
    rec = recommend(
        Context(
            verdict=Cause.GPU_MEMORY_OVERCOMMIT,
            flags=LaunchFlags(gpu_memory_utilization_ratio=0.92),
            cmdline=None,
            gpu_total_bytes=80 * GIB,
            gpu_free_bytes=int(free_gib * GIB),
            policy=policy,
        )
    )
    new = next((f.new for f in rec.flags if f.flag == "--gpu-memory-utilization"), None)
    return new, rec.actions


# (the operator's floor, free GiB of 80, what diagnose recommends, whether it says "below")
FLOORS = [
    (0.70, 70.0, "0.86", False),  # (70 − 0.5) / 80, above the floor
    (0.70, 40.0, "0.70", True),  # fitting needs 0.49: the shipped floor holds, and it says so
    (0.50, 40.0, "0.50", True),  # the floor diagnose had of its own: 0.49 is below it too
    (0.40, 40.0, "0.49", False),  # an operator who lowered the floor gets the fit
    (0.90, 70.0, "0.90", True),  # an operator's higher floor is honoured
]


@pytest.mark.parametrize(("floor", "free_gib", "new", "says_below"), FLOORS)
def test_diagnose_lowers_the_utilization_no_further_than_the_operators_floor(
    floor: float, free_gib: float, new: str, says_below: bool
) -> None:
    policy = dataclasses.replace(POLICY, gpu_memory_utilization_floor_ratio=floor)
    got, actions = _overcommit(policy, free_gib)
    assert got == new
    assert any("below the floor" in a for a in actions) is says_below, actions


# (command line, GPU memory, what vLLM reports, the baseline the policy starts from: the
# fields these rows are about; another lever's field holds its own default)
BASELINES = [
    (
        (),
        80 * GIB,
        None,
        {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.92},
    ),
    (
        (),
        40 * GIB,
        None,
        {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.92},
    ),
    (
        (),
        192 * GIB,
        None,
        {"max_num_seqs": 1024, "max_num_batched_tokens": 16384, "gpu_memory_utilization": 0.92},
    ),
    (
        (),
        40 * GIB,
        0.85,
        {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.85},
    ),
    (
        ("vllm", "serve", "m", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.8"),
        80 * GIB,
        0.85,
        {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.8},
    ),
    (
        ("vllm", "serve", "m", "--max-num-batched-tokens", "4k"),
        40 * GIB,
        None,
        {"max_num_seqs": 256, "max_num_batched_tokens": 4000, "gpu_memory_utilization": 0.92},
    ),
]


@pytest.mark.parametrize(("cmdline", "total", "reported", "want"), BASELINES)
def test_the_baseline_is_the_command_line_then_what_vllm_reports_then_its_default(
    cmdline: tuple[str, ...], total: int, reported: float | None, want: dict[str, float]
) -> None:
    sig = None
    if reported is not None:
        sig = dataclasses.replace(
            ServiceSignals("vllm", None, None, False, None), gpu_memory_utilization_ratio=reported
        )
    got = default_baseline(sig, cmdline, total)
    assert {name: getattr(got, name) for name in want} == want
    for spec in LEVERS.values():  # typed as the flag takes it: counts whole, ratios not
        if spec.baseline_field is not None:
            kind = int if spec.step is Step.MULTIPLY else float
            assert type(getattr(got, spec.baseline_field)) is kind, spec.lever
