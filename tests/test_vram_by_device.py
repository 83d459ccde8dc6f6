"""The wait for the old instance's GPU memory in a pod: by device, not by the old main pid.

On a host the action waits until vLLM's old main pid no longer holds memory on any GPU. In a
pod (``services[].gpu_memory_by_device``) NVML names processes by their host pids, which the
container's pid namespace hides: the old main pid (the container's 7, or none at all when the
unit source is off, as the Helm chart has it) is never among them, so the wait ended at once
while the old instance still held the pod's GPU. The wait is on the service's devices instead:
the processes NVML showed on each of them when the restart was asked for are the old instance
(every process on a pod's GPU is its vLLM), and the memory is free once none of them is left.

Each case is the real path on virtual time: a :class:`Snapshot` as the NVML source reports it,
``policy.seen`` (what the phases read of it), ``phases.advance``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_guardian.config import PolicyConfig
from vllm_guardian.core import phases, policy
from vllm_guardian.core.phases import Phase
from vllm_guardian.core.signals import ServiceGpuSignals, ServiceSignals
from vllm_guardian.model import (
    ActionKind,
    Cause,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthState,
    Op,
    OpResult,
    ServiceSnapshot,
    Snapshot,
    UnitState,
)

GIB = 1024**3
P = PolicyConfig(
    drain_timeout_seconds=30,
    vram_release_timeout_seconds=20,
    ready_timeout_seconds=100,
    bundle_timeout_seconds=10,
)
OLD, NEW = 48213, 48990  # host pids of the old and the new engine core: invisible in the pod
OLD_WORKER = 48240  # a second GPU's worker of the old instance (tensor parallel)
ANOTHER_POD = 51000  # on a GPU of the host that is not this service's


@dataclass(frozen=True)
class Tick:
    """What NVML shows on each device (index → host pids; None: the driver would not say),
    whether the restart call returned this tick, and where the action must be after it."""

    t: float
    devices: dict[int, tuple[int, ...] | None]
    restarted: bool = False
    expect: Phase | str = ""  # a phase, or "ok"/"failed"
    words: str = ""  # in the last move's reason or the outcome's detail


def _snapshot(x: Tick, main_pid: int | None) -> Snapshot:
    devices = tuple(
        GpuDevice(
            i, f"GPU-{i}", "H100", 80 * GIB, 70 * GIB if pids else 0, 10 * GIB,
            processes=None if pids is None else tuple(GpuProcess(p, 35 * GIB) for p in pids),
        )
        for i, pids in sorted(x.devices.items())
    )  # fmt: skip
    unit = (
        None
        if main_pid is None
        else UnitState(None, None, None, None, main_pid, None, None, None, None, None, (main_pid,))
    )
    return Snapshot(x.t, (ServiceSnapshot("vllm", unit=unit),), GpuReading(devices))


def _signals(gpus: tuple[int, ...], by_device: bool, up: bool) -> ServiceSignals:
    return ServiceSignals(
        "vllm",
        HealthState.UP if up else HealthState.REFUSED,
        up,
        up,
        True,
        requests_running=0.0,
        gpus=tuple(ServiceGpuSignals(g, None, None, None, None, None) for g in gpus),
        gpu_memory_by_device=by_device,
    )


# The service's GPUs (what core/signals found: with gpus auto in a pod, every GPU it sees),
# whether memory is attributed by device, vLLM's main pid as the guardian sees it, the ticks.
CASES = [
    ("pod: the old engine core still holds the GPU after the restart returned",
     (0,), True, None, [
        Tick(1, {0: (OLD,)}, expect=Phase.RESTARTING),
        Tick(5, {0: (OLD, NEW)}, restarted=True, expect=Phase.AWAITING_VRAM),
        Tick(8, {0: (OLD, NEW)}, expect=Phase.AWAITING_VRAM),
        Tick(9, {0: (NEW,)}, expect=Phase.AWAITING_READY, words="GPU 0"),
        Tick(12, {0: (NEW,)}, expect="ok"),
    ]),
    ("pod, the main pid found by its port (the container's pid 7): still by device",
     (0,), True, 7, [
        Tick(1, {0: (OLD,)}, expect=Phase.RESTARTING),
        Tick(5, {0: (OLD, NEW)}, restarted=True, expect=Phase.AWAITING_VRAM),
        Tick(9, {0: (NEW,)}, expect=Phase.AWAITING_READY),
    ]),
    ("pod: the old instance never lets go of its second GPU: failed, naming it",
     (0, 1), True, None, [
        Tick(1, {0: (OLD,), 1: (OLD_WORKER,)}, expect=Phase.RESTARTING),
        Tick(5, {0: (NEW,), 1: (OLD_WORKER, NEW)}, restarted=True, expect=Phase.AWAITING_VRAM),
        Tick(26, {0: (NEW,), 1: (OLD_WORKER, NEW)}, expect="failed",
             words=f"GPU 1 (host pid {OLD_WORKER})"),
    ]),
    ("pod: a GPU of the host that is not the service's is not waited on",
     (0,), True, None, [
        Tick(1, {0: (OLD,), 1: (ANOTHER_POD,)}, expect=Phase.RESTARTING),
        Tick(5, {0: (NEW,), 1: (ANOTHER_POD,)}, restarted=True, expect=Phase.AWAITING_READY),
    ]),
    ("pod: the driver would not list the device's processes: not waited on, and said",
     (0,), True, None, [
        Tick(1, {0: None}, expect=Phase.RESTARTING),
        Tick(5, {0: None}, restarted=True, expect=Phase.AWAITING_READY, words="not visible"),
    ]),
    ("host: by the old main pid, as before",
     (0,), False, OLD, [
        Tick(1, {0: (OLD,)}, expect=Phase.RESTARTING),
        Tick(5, {0: (OLD, NEW)}, restarted=True, expect=Phase.AWAITING_VRAM),
        Tick(9, {0: (NEW,)}, expect=Phase.AWAITING_READY, words="free"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "gpus", "by_device", "main_pid", "ticks"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_the_vram_wait(
    name: str,
    gpus: tuple[int, ...],
    by_device: bool,
    main_pid: int | None,
    ticks: list[Tick],
) -> None:
    a: phases.ActionProgress | None
    a, _ = phases.start(1, "vllm", ActionKind.RESTART, Cause.ENGINE_DEAD, "test", (), (),
                        main_pid, 0.0, P)  # fmt: skip
    bundle = [OpResult(1, "vllm", Op.BUNDLE, True, False, "/b", 0.5)]
    for i, x in enumerate(ticks):
        assert a is not None, f"{name}: the action ended before t={x.t}"
        results = bundle if i == 0 else []
        if x.restarted:
            results = [OpResult(1, "vllm", Op.RESTART, True, False, "restarted", x.t - 0.5)]
        # vLLM answers before the restart and once it is ready; loading in between.
        up = i == 0 or x.expect == "ok"
        seen = policy.seen(_snapshot(x, main_pid), _signals(gpus, by_device, up), "vllm")
        adv = phases.advance(a, "vllm", seen, results, x.t, P)
        if isinstance(x.expect, Phase):
            assert adv.outcome is None, f"t={x.t}: ended: {adv.outcome}"
            assert adv.progress is not None and adv.progress.phase is x.expect, (
                f"t={x.t}: in {adv.progress.phase if adv.progress else None}, moves {adv.moves}"
            )
            if x.words:
                assert any(x.words in m.why for m in adv.moves), adv.moves
        else:
            assert adv.outcome is not None, f"t={x.t}: still {adv.progress}"
            assert adv.outcome.ok is (x.expect == "ok"), adv.outcome
            assert x.words in adv.outcome.detail, adv.outcome.detail
        a = adv.progress


def test_what_the_wait_reads_in_a_pod_comes_from_the_signals_as_the_chart_configures_them() -> None:
    """The chart's service (gpus auto, gpu_memory_by_device, the unit source off, so no main
    pid): the signals name every GPU the pod sees as the service's, and ``policy.seen`` reads
    the host pids on each of them, where the by-process view found none of them."""
    from vllm_guardian.config import ServiceConfig, SignalsConfig
    from vllm_guardian.core.signals import derive_service

    snap = _snapshot(Tick(1, {0: (OLD,), 1: (OLD_WORKER, NEW)}), main_pid=None)
    pod = ServiceConfig(name="vllm", gpu_memory_by_device=True)
    sig = derive_service([snap], pod, SignalsConfig())
    assert [g.gpu for g in sig.gpus] == [0, 1] and sig.gpu_memory_by_device
    seen = policy.seen(snap, sig, "vllm")
    assert (seen.by_device, seen.device_pids) == (True, ((0, (OLD,)), (1, (OLD_WORKER, NEW))))
    host = derive_service([snap], ServiceConfig(name="vllm"), SignalsConfig())
    assert host.gpus == () and policy.seen(snap, host, "vllm").device_pids is None
