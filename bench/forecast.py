"""Acting before the crash, measured: the guardian's pure core armed on the twin's engine, in
simulated time.

Run: .venv/bin/python bench/forecast.py [--minutes 30] [--seeds 0,1,2] [--scenarios a,b]

Each run drives the twin's deterministic engine (``vllm_guardian.sim.engine``) with its
scenario's seeded load, and every 2 simulated seconds does what the daemon does: build the
snapshot its sources would read (the GPU state with the step in flight, the allocator plugin's
record, /metrics gauges, /health, the unit, vLLM's error log lines) and run the daemon's pure
``core.step.step`` (signals with the exhaustion forecast, the shipped rules, the armed policy
with its phases). Its calls are executed the way the executor does (the bundle and the flags
file at once, the restart stops the engine and starts it with the action's flags and
environment), their results observed on the next tick; the gate holds new requests while the
front door is closed and releases them when it opens. Without a guardian
("unguarded") a supervisor restarts the engine with the same flags after it dies.

Unlike the twin's server, the neighbour of ``noisy_neighbour`` is a separate process: it keeps
growing across vLLM restarts (the server twin restarts it with vLLM).

Reported per run: CUDA OOMs, requests failed (in flight at an OOM, dropped by a drain, or
refused while nothing listened), the guardian's actions, forecast gates and exhaustion alerts
with their time (simulated seconds after vLLM first became ready), and the lead time of the
first pre-emptive step (a pre-emptive action or a gate the forecast closed) over the unguarded
run's first OOM. Simulated time is exact; nothing here reads a clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_guardian.actuators.alerts import default_rules_text  # noqa: E402
from vllm_guardian.config import Config, PolicyConfig, ServiceConfig, SignalsConfig  # noqa: E402
from vllm_guardian.core.alert_rules import parse_rules  # noqa: E402
from vllm_guardian.core.driver import Driver  # noqa: E402
from vllm_guardian.formats.allocator_format import AllocatorStats  # noqa: E402
from vllm_guardian.formats.vllm_log_format import match_line  # noqa: E402
from vllm_guardian.model import (  # noqa: E402
    AlertState,
    AllocatorProcess,
    AllocatorReading,
    CacheConfig,
    EngineMetrics,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthProbe,
    HealthState,
    LogEvent,
    LogReading,
    Op,
    OpResult,
    ServiceSnapshot,
    Snapshot,
    SourceKind,
    SourceStatus,
    UnitState,
    VllmScrape,
)
from vllm_guardian.sim.engine import EnginePhase, SimEngine  # noqa: E402
from vllm_guardian.sim.flags import parse_serve_args  # noqa: E402
from vllm_guardian.sim.load import plan_requests  # noqa: E402
from vllm_guardian.sim.scenarios import SCENARIOS  # noqa: E402
from vllm_guardian.sim.vllm_log import format_line  # noqa: E402

TICK = 2.0
SUPERVISOR_RESTART_SECONDS = 5.0  # systemd RestartSec=5
EXHAUSTION_RULES = ("VllmGpuHeadroomExhaustionSoon", "VllmGpuNeighbourExhaustionSoon")


@dataclass
class Result:
    scenario: str
    seed: int
    operator: str
    minutes: float
    ooms: int = 0
    first_oom_seconds: float | None = None
    failed: int = 0
    served: int = 0
    actions: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, reason)
    exhaustion_alerts: list[tuple[float, str]] = field(default_factory=list)
    forecast_gates: list[tuple[float, str]] = field(default_factory=list)  # (t, reason)

    @property
    def first_preemptive_seconds(self) -> float | None:
        """The first pre-emptive step: a pre-emptive action, or the gate the forecast closed."""
        steps = [t for t, _, r in self.actions if r.startswith("pre-emptive")]
        steps += [t for t, _ in self.forecast_gates]
        return min(steps, default=None)


class Service:
    """One vLLM service: its current engine process, the neighbour, the gate's held requests."""

    def __init__(self, scenario: str, seed: int) -> None:
        self.scenario = scenario
        self.seed = seed
        self.engine: SimEngine | None = None
        self.offset = 0.0  # global time at which the current engine process started
        self.gen = 0
        self.flags: tuple[tuple[str, str], ...] = ()
        self.env: tuple[tuple[str, str], ...] = ()
        self.neighbour_since: float | None = None  # global time the neighbour's clock started
        self.ooms = 0
        self.failed = 0
        self.served = 0
        self.new_logs: list[LogEvent] = []

    def argv(self) -> list[str]:
        out = ["--sim-scenario", self.scenario, "--sim-seed", str(self.seed)]
        for k, v in self.flags:
            out += [k, v]
        return out

    def start(self, t: float) -> None:
        opts = parse_serve_args(self.argv(), dict(self.env))
        e = SimEngine(opts.model, opts.engine, opts.scenario, opts.gpu_memory_bytes, self.seed)
        nb = opts.scenario.neighbour
        if nb is not None and nb.start_seconds is not None:
            svc = self

            def other_bytes(local_t: float) -> int:
                if svc.neighbour_since is None:
                    if e.ready_at is None or local_t < e.ready_at:
                        return 0
                    svc.neighbour_since = svc.offset + e.ready_at
                g = svc.offset + local_t - svc.neighbour_since - (nb.start_seconds or 0.0)
                if g < 0:
                    return 0
                grown = nb.initial_bytes + nb.growth_bytes_per_second * g
                return int(min(float(nb.max_bytes or nb.initial_bytes), grown))

            e.other_bytes = other_bytes  # type: ignore[method-assign]
        self.engine, self.offset = e, t
        self.gen += 1

    @property
    def pid(self) -> int:
        return 10_000 + self.gen

    def advance(self, t: float) -> None:
        e = self.engine
        if e is None:
            return
        deltas = e.advance(t - self.offset)
        for d in deltas:
            if d.error is not None:
                self.failed += 1
            elif d.finish_reason is not None:
                self.served += 1
        for ev in e.take_logs():
            m = match_line(format_line(ev, self.pid, self.offset + ev.sim_seconds))
            if m is not None:
                kind, details = m
                self.new_logs.append(
                    LogEvent(kind, self.offset + ev.sim_seconds, ev.message[:300], details)
                )
                if ev.message.startswith("torch.OutOfMemoryError"):
                    self.ooms += 1

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.phase is EnginePhase.READY

    def idle(self) -> bool:
        e = self.engine
        return e is None or e.num_unfinished == 0

    def stop(self) -> None:
        if self.engine is not None and self.engine.phase in (EnginePhase.READY, EnginePhase.HUNG):
            self.failed += len(self.engine.abort_all())
        self.engine = None


def snapshot(svc: Service, t: float, results: tuple[OpResult, ...], log_counts: dict) -> Snapshot:  # type: ignore[type-arg]
    e = svc.engine
    cmd = ("vllm", "serve", "model", *(x for kv in svc.flags for x in kv))
    statuses = tuple(
        SourceStatus(k, None if k is SourceKind.NVML else "vllm", True, 0.01) for k in SourceKind
    )
    for ev in svc.new_logs:
        log_counts[ev.kind] = log_counts.get(ev.kind, 0) + 1
    logs = LogReading(tuple(sorted(log_counts.items())), tuple(svc.new_logs), 0)
    svc.new_logs = []
    if e is None or e.phase is EnginePhase.FAILED_STARTUP:
        health = HealthProbe(HealthState.REFUSED, None, None, "refused")
        unit = UnitState(
            "vllm.service", "activating", "auto-restart", None, None, None, None, None, None, cmd
        )
        return Snapshot(t, (ServiceSnapshot("vllm", health=health, unit=unit, logs=logs),),
                        gpu_reading(svc, t), statuses, (), results)  # fmt: skip
    unit = UnitState(
        "vllm.service",
        "active",
        "running",
        "success",
        svc.pid,
        svc.gen - 1,
        None,
        None,
        None,
        cmd,
        (svc.pid,),
    )
    if e.phase is EnginePhase.STARTING:
        health = HealthProbe(HealthState.REFUSED, None, None, "refused")
        return Snapshot(t, (ServiceSnapshot("vllm", health=health, unit=unit, logs=logs),),
                        gpu_reading(svc, t), statuses, (), results)  # fmt: skip
    dead = e.phase is EnginePhase.DEAD
    health = HealthProbe(
        HealthState.ENGINE_DEAD if dead else HealthState.UP, 503 if dead else 200, 0.01
    )
    st = e.stats
    plan = e.plan
    cc = CacheConfig(plan.num_gpu_blocks if plan else None, e.cfg.block_size, e.cfg.gpu_memory_utilization,
                     None, None, e.cfg.enable_prefix_caching)  # fmt: skip
    eng = EngineMetrics("m", "0", requests_running=st.num_requests_running, requests_waiting=st.num_requests_waiting,
                        kv_cache_usage_ratio=st.kv_cache_usage_ratio, preemptions_total=st.num_preemptions,
                        prompt_tokens_total=st.prompt_tokens, generation_tokens_total=st.generation_tokens,
                        cache_config=cc)  # fmt: skip
    scrape = VllmScrape((eng,), True, svc.offset, 1)
    alloc = None
    rec: AllocatorStats | None = e.allocator_stats(
        svc.pid, t, TICK, dict(svc.env).get("PYTORCH_CUDA_ALLOC_CONF")
    )
    if rec is not None and not dead:
        alloc = AllocatorReading((AllocatorProcess(svc.pid, (rec,)),))
    ss = ServiceSnapshot("vllm", vllm=scrape, health=health, unit=unit, logs=logs, allocator=alloc)
    return Snapshot(t, (ss,), gpu_reading(svc, t), statuses, (), results)


def gpu_reading(svc: Service, t: float) -> GpuReading:
    e = svc.engine
    total = 80 * 2**30
    procs: list[GpuProcess] = []
    other = 0
    if e is not None:
        mem = e.sampled_breakdown()
        own = e.startup_process_bytes() if mem is None else mem.process_bytes
        if e.phase in (EnginePhase.DEAD, EnginePhase.FAILED_STARTUP):
            own = 0
        other = e.other_bytes(e.now)
        total = e.gpu_total_bytes
        if own:
            procs.append(GpuProcess(svc.pid, own, "vllm", "/system.slice/vllm.service"))
    nb = SCENARIOS[svc.scenario].neighbour
    if nb is not None and other:
        procs.append(
            GpuProcess(nb.pid, other, "python3 train.py", "/user.slice/user-1000.slice/job.scope")
        )
    used = min(total, sum(p.used_memory_bytes or 0 for p in procs))
    return GpuReading(
        (GpuDevice(0, "GPU-sim-0", "Sim H100", total, used, total - used, processes=tuple(procs)),)
    )


def run(scenario: str, seed: int, minutes: float, guarded: bool) -> Result:
    res = Result(scenario, seed, "guardian" if guarded else "unguarded", minutes)
    svc = Service(scenario, seed)
    svc.start(0.0)
    plan = plan_requests(SCENARIOS[scenario].load, seed, 1_000_000, minutes * 60.0)
    held: list = []  # type: ignore[type-arg]
    cfg = Config(
        services=(ServiceConfig(name="vllm"),),
        interval_seconds=TICK,
        policy=PolicyConfig(dry_run=False, backend="process"),
        signals=SignalsConfig(),
    )
    # The daemon's tick driver: settings from the config, its history window, its state.
    driver = Driver.for_config(cfg, parse_rules(default_rules_text(), "defaults"))
    log_counts: dict = {}  # type: ignore[type-arg]
    op_results: tuple[OpResult, ...] = ()
    next_flags: tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] | None = None
    restart_at: float | None = None  # the supervisor (systemd Restart=always, RestartSec=5)
    first_ready: float | None = None
    i = 0
    t = 0.0
    end = None
    while True:
        t += TICK
        svc.advance(t)
        if first_ready is None and svc.ready:
            first_ready = t
            end = t + minutes * 60.0
        if end is not None and t > end:
            break
        if t > 3600 * 24:
            break
        # Arrivals (relative to the first readiness, like the load generator). The gate holds
        # new requests while the policy keeps the front door closed; without a guardian nothing
        # holds them.
        if first_ready is not None:
            while i < len(plan) and first_ready + plan[i].at_seconds <= t:
                held.append(plan[i])
                i += 1
        if not guarded or driver.state.policy.service("vllm").front_door.open:
            if svc.ready:
                e = svc.engine
                assert e is not None
                for p in held:
                    e.add_request(f"r{p.index}", p.prompt.split(), p.max_tokens)
                held = []
            elif not guarded:
                svc.failed += len(held)  # nothing listening, no gate: connection refused
                held = []
        # A dead engine exits; its supervisor starts it again.
        e = svc.engine
        if e is not None and e.exit_due() and restart_at is None:
            restart_at = t + SUPERVISOR_RESTART_SECONDS
            svc.engine = None
        if restart_at is not None and t >= restart_at:
            svc.start(t)
            restart_at = None
        if not guarded:
            continue
        # The guardian's tick: the same pure step the daemon and `replay` run.
        snap = snapshot(svc, t, op_results, log_counts)
        fx = driver.tick(snap, t)
        since_ready = t - (first_ready or 0.0)
        for tr in fx.transitions:
            if tr.current is AlertState.FIRING and tr.alert.name in EXHAUSTION_RULES:
                res.exhaustion_alerts.append((since_ready, tr.alert.name))
        for d in fx.decisions:
            # The forecast's gate names the forecast as its evidence (the KV gate its gauge).
            if d.what == "gate" and "forecast" in d.evidence:
                res.forecast_gates.append((since_ready, d.reason))
        for a in fx.actions:
            res.actions.append((since_ready, a.kind.value, a.reason))
        # The executor's calls run between this tick and the next, which sees their results.
        done: list[OpResult] = []
        for o in fx.ops:
            if o.op is Op.WRITE_FLAGS:
                next_flags = (o.flags, o.env)
            elif o.op is Op.RESTART:
                svc.stop()
                if next_flags is not None:
                    svc.flags, svc.env = next_flags
                svc.start(t)
                restart_at = None
            done.append(OpResult(o.action_id, o.service, o.op, True, False, "done", t))
        op_results = tuple(done)
    res.ooms = svc.ooms
    res.failed = svc.failed
    res.served = svc.served
    return res


def first_oom(scenario: str, seed: int, minutes: float) -> float | None:
    """Simulated seconds after readiness of the unguarded run's first OOM."""
    svc = Service(scenario, seed)
    svc.start(0.0)
    plan = plan_requests(SCENARIOS[scenario].load, seed, 1_000_000, minutes * 60.0)
    e = svc.engine
    assert e is not None
    e.advance(e.startup_seconds)
    t0 = e.ready_at
    assert t0 is not None
    for p in plan:
        e.advance(t0 + p.at_seconds)
        if e.phase is EnginePhase.DEAD:
            break
        e.add_request(f"r{p.index}", p.prompt.split(), p.max_tokens)
    return None if e.death is None else e.death.sim_seconds - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--scenarios", default="fragmentation_creep,noisy_neighbour,steady,prefix_cache_waste"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for scenario in args.scenarios.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            oom_at = first_oom(scenario, seed, args.minutes)
            for guarded in (False, True):
                r = run(scenario, seed, args.minutes, guarded)
                pre = r.first_preemptive_seconds
                lead = oom_at - pre if oom_at is not None and pre is not None else None
                row = {
                    "scenario": scenario, "seed": seed, "operator": r.operator,
                    "sim_minutes": args.minutes, "cuda_ooms": r.ooms, "failed": r.failed, "served": r.served,
                    "unguarded_first_oom_s": oom_at, "first_preemptive_action_s": pre, "lead_time_s": lead,
                    "actions": [f"{t:.0f}s {k}: {reason[:160]}" for t, k, reason in r.actions],
                    "exhaustion_alerts": [f"{t:.0f}s {n}" for t, n in r.exhaustion_alerts],
                    "forecast_gates": [f"{t:.0f}s {reason[:120]}" for t, reason in r.forecast_gates],
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text(
            markdown(rows, " ".join(argv if argv is not None else sys.argv[1:]))
        )
    return 0


def markdown(rows: list[dict], args: str) -> str:  # type: ignore[type-arg]
    def n(v: float | None) -> str:
        return "" if v is None else f"{v:.0f}"

    out = [
        "# Acting before the crash: the forecast on the twin",
        "",
        f"`.venv/bin/python bench/forecast.py {args}` — the armed core (signals, forecast, shipped "
        "rules, policy with its phases) on the twin's engine in simulated time; times are "
        "simulated seconds after vLLM first became ready. Lead: the unguarded run's first OOM "
        "minus the guardian's first pre-emptive step (a pre-emptive action, or the gate the "
        "forecast closed).",
        "",
        "| scenario | seed | operator | CUDA OOMs | failed | served | first OOM | first pre-emptive step | lead | actions | forecast gates | exhaustion alerts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        guarded = r["operator"] == "guardian"
        out.append(
            f"| {r['scenario']} | {r['seed']} | {r['operator']} | {r['cuda_ooms']} | {r['failed']} "
            f"| {r['served']} | {'' if guarded else n(r['unguarded_first_oom_s'])} "
            f"| {n(r['first_preemptive_action_s'])} | {n(r['lead_time_s'])} | {len(r['actions'])} "
            f"| {len(r['forecast_gates'])} | {len(r['exhaustion_alerts'])} |"
        )
    out += ["", "## What the guardian did (first seed of each scenario)", ""]
    seen: set[str] = set()
    for r in rows:
        if r["operator"] != "guardian" or r["scenario"] in seen:
            continue
        seen.add(r["scenario"])
        out.append(f"**{r['scenario']}** (seed {r['seed']}):")
        out += [f"- {x}" for x in r["forecast_gates"] + r["actions"] + r["exhaustion_alerts"]] or [
            "- nothing"
        ]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
