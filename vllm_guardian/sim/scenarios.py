"""The twin's failure scenarios, each with the cause id the guardian should name.

A scenario is data: vLLM flags it starts with (prepended to the command line, so later flags,
such as the guardian's, win as in argparse), the traffic that provokes it (a ``LoadProfile``
for ``load``), and what happens to the device (another tenant, a hang, a death, an XID).

Two kinds of trouble, timed differently (docs/twin.md):

* **one-off faults** (a hang, an engine death, an XID) are events on the *scenario's*
  timeline: ``fault_schedule`` gives their times in simulated seconds after the scenario's
  zero (the first process's readiness, or ``--sim-epoch``), the same in every process of one
  run, so a restarted twin past a fault's time does not meet it again. ``--sim-fault-every``
  adds seeded recurrences (exponential gaps with that mean) of the same fault;
* **memory-driven failures** (OOMs from a prefill burst, fragmentation, a neighbour) come from
  the process's own state and keep recurring in every process while their cause persists:
  the neighbour's start is counted from each process's readiness.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterator
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class LoadProfile:
    """Open-loop traffic: Poisson arrivals plus optional bursts, in simulated time."""

    rate_per_second: float
    prompt_tokens_min: int
    prompt_tokens_max: int
    output_tokens_min: int
    output_tokens_max: int
    shared_prefix_ratio: float = 0.0
    num_shared_prefixes: int = 4
    burst_size: int = 0
    burst_interval_seconds: float = 0.0
    burst_start_seconds: float = 5.0
    burst_prompt_tokens_min: int = 0
    burst_prompt_tokens_max: int = 0


STEADY_LOAD = LoadProfile(
    rate_per_second=4.0,
    prompt_tokens_min=200,
    prompt_tokens_max=800,
    output_tokens_min=64,
    output_tokens_max=256,
    shared_prefix_ratio=0.3,
)


@dataclass(frozen=True)
class Neighbour:
    """Another process on the GPU: present from the start, or arriving and growing."""

    start_seconds: float | None  # None: already there when the twin starts
    initial_bytes: int
    growth_bytes_per_second: float = 0.0
    max_bytes: int = 0
    pid: int = 4_194_301  # above the usual pid range, so it never names a real process


class FaultKind(enum.Enum):
    """What happened to the engine, in the twin's fault record (``--sim-timeline-file``)."""

    HANG = "hang"
    DEATH = "death"
    XID = "xid"
    OOM = "oom"  # memory-driven: not scheduled, recorded when a step does not fit
    # The engine core's input thread dies (vllm#26139, #47958): requests the API server accepts
    # never reach the scheduler; those already in it finish. /health stays 200.
    INPUT_HANG = "input_hang"
    # An operator's POST /pause?mode=keep, and its /resume: the scheduler freezes with its
    # requests in it; new ones queue before it until the resume.
    PAUSE = "pause"
    RESUME = "resume"
    # An operator's POST /sleep?level=N&mode=keep (it pauses the scheduler first), and the
    # /wake_up and /resume that end it.
    SLEEP = "sleep"
    WAKE = "wake"


@dataclass(frozen=True)
class Scenario:
    name: str
    expected_cause: str
    summary: str
    vllm_args: tuple[str, ...] = ()
    load: LoadProfile = STEADY_LOAD
    # 0: a healthy process's allocator plateaus (steady traffic reuses its split blocks).
    fragmentation_creep_factor: float = 0.0
    neighbour: Neighbour | None = None
    hang_at_seconds: float | None = None
    death_at_seconds: float | None = None
    xid_at_seconds: float | None = None
    xid: int = 48
    input_hang_at_seconds: float | None = None
    pause_at_seconds: float | None = None
    pause_for_seconds: float | None = None  # None: never resumed
    sleep_at_seconds: float | None = None
    sleep_for_seconds: float | None = None  # None: never woken
    sleep_level: int = 1
    # Serve vLLM's development routes (/pause, /resume, /is_paused), as VLLM_SERVER_DEV_MODE=1.
    dev_mode: bool = False
    # exit_zero_death exits 0 whatever --sim-exit-code says (that is the scenario).
    forced_exit_code: int | None = None

    def one_off_faults(self) -> list[tuple[float, FaultKind]]:
        faults = [
            (at, kind)
            for at, kind in (
                (self.hang_at_seconds, FaultKind.HANG),
                (self.death_at_seconds, FaultKind.DEATH),
                (self.xid_at_seconds, FaultKind.XID),
                (self.input_hang_at_seconds, FaultKind.INPUT_HANG),
                (self.pause_at_seconds, FaultKind.PAUSE),
                (
                    None
                    if self.pause_at_seconds is None or self.pause_for_seconds is None
                    else self.pause_at_seconds + self.pause_for_seconds,
                    FaultKind.RESUME,
                ),
                (self.sleep_at_seconds, FaultKind.SLEEP),
                (
                    None
                    if self.sleep_at_seconds is None or self.sleep_for_seconds is None
                    else self.sleep_at_seconds + self.sleep_for_seconds,
                    FaultKind.WAKE,
                ),
            )
            if at is not None
        ]
        return sorted(faults, key=lambda f: f[0])


def fault_schedule(
    scenario: Scenario, seed: int, every_seconds: float | None = None
) -> Iterator[tuple[float, FaultKind]]:
    """The scenario's faults in time order (simulated seconds after the scenario's zero).

    The one-off faults first; with ``every_seconds``, then recurrences of the first one-off
    fault's kind (an engine death where the scenario has none) at exponentially distributed
    gaps of that mean, drawn from ``seed``: every process of a run computes the same times.
    """
    if every_seconds is not None and every_seconds <= 0:
        raise ValueError(f"fault interval must be > 0 seconds, got {every_seconds}")
    one_offs = scenario.one_off_faults()
    yield from one_offs
    if every_seconds is None:
        return
    rng = random.Random(f"faults-{seed}")  # noqa: S311 (a seeded simulation, not security)
    kind = one_offs[0][1] if one_offs else FaultKind.DEATH
    t = one_offs[-1][0] if one_offs else 0.0
    while True:
        t += rng.expovariate(1.0 / every_seconds)
        yield t, kind


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("steady", "healthy", "moderate traffic that the defaults serve without pressure"),
        Scenario(
            "prefill_burst",
            "prefill_burst",
            "bursts of long prompts batched into 16k-token prefill steps at 0.95 utilization: "
            "the unprofiled attention workspace overflows the card",
            vllm_args=("--gpu-memory-utilization", "0.95", "--max-num-batched-tokens", "16384"),
            load=LoadProfile(
                rate_per_second=1.0,
                prompt_tokens_min=100,
                prompt_tokens_max=400,
                output_tokens_min=32,
                output_tokens_max=128,
                burst_size=4,
                burst_interval_seconds=30.0,
                burst_start_seconds=5.0,
                burst_prompt_tokens_min=6500,
                burst_prompt_tokens_max=7800,
            ),
        ),
        Scenario(
            "kv_thrash",
            "concurrency_overcommit",
            "max_num_seqs 1024 over a 4 GiB KV pool: preemptions climb, the queue grows, no crash",
            vllm_args=("--kv-cache-memory-bytes", str(4 * GIB)),
            load=LoadProfile(
                rate_per_second=16.0,
                prompt_tokens_min=800,
                prompt_tokens_max=1200,
                output_tokens_min=600,
                output_tokens_max=1000,
            ),
        ),
        Scenario(
            "fragmentation_creep",
            "allocator_fragmentation",
            "request churn strands allocator blocks (days compressed into minutes) until a "
            "step's activations no longer fit",
            load=LoadProfile(
                rate_per_second=8.0,
                prompt_tokens_min=300,
                prompt_tokens_max=700,
                output_tokens_min=16,
                output_tokens_max=64,
            ),
            fragmentation_creep_factor=100.0,
        ),
        Scenario(
            "noisy_neighbour",
            "gpu_memory_overcommit",
            "another process appears on the GPU and grows until vLLM's next allocation fails",
            neighbour=Neighbour(
                start_seconds=20.0,
                initial_bytes=1 * GIB,
                growth_bytes_per_second=0.1 * GIB,
                max_bytes=12 * GIB,
            ),
        ),
        Scenario(
            "engine_hang",
            "engine_dead",
            "the engine stops stepping: /health stays 200, tokens stop, requests wait",
            hang_at_seconds=30.0,
        ),
        Scenario(
            "engine_input_hang",
            "engine_input_hang",
            "the engine core's input thread dies: /health 200, nothing running or waiting, "
            "new requests never answered",
            input_hang_at_seconds=30.0,
        ),
        Scenario(
            "operator_pause",
            "healthy",
            "negative control: an operator pauses the scheduler (POST /pause?mode=keep) for "
            "two minutes with requests in it, then resumes; not a hang, never restarted",
            pause_at_seconds=30.0,
            pause_for_seconds=120.0,
            dev_mode=True,
        ),
        Scenario(
            "operator_sleep",
            "healthy",
            "negative control: an operator puts vLLM to sleep (POST /sleep?level=1&mode=keep) "
            "for two minutes with requests in it, then wakes it; not a hang, never restarted",
            sleep_at_seconds=30.0,
            sleep_for_seconds=120.0,
            dev_mode=True,
        ),
        Scenario(
            "exit_zero_death",
            "engine_dead",
            "the engine core dies; the server reports 503 and exits with status 0",
            death_at_seconds=30.0,
            forced_exit_code=0,
        ),
        Scenario(
            "prefix_cache_waste",
            "healthy",
            "negative control: prefix caching on, prompts share nothing, hit rate near 0, "
            "nothing is wrong (a low hit rate is measured to be harmless on vLLM 0.32)",
            load=LoadProfile(
                rate_per_second=4.0,
                prompt_tokens_min=200,
                prompt_tokens_max=800,
                output_tokens_min=64,
                output_tokens_max=256,
                shared_prefix_ratio=0.0,
            ),
        ),
        Scenario(
            "startup_overcommit",
            "gpu_memory_overcommit",
            "10 GiB held by another process at start-up: free memory is below the request",
            neighbour=Neighbour(start_seconds=None, initial_bytes=10 * GIB),
        ),
        Scenario(
            "xid_fault",
            "gpu_hardware_fault",
            "an uncorrectable ECC error (XID 48) kills the engine; the XID is in the GPU state",
            xid_at_seconds=30.0,
            xid=48,
        ),
    )
}
