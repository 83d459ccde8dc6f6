"""The outcome benchmark: what happens to users' requests under three operators, on the vLLM twin.

Run: .venv/bin/python bench/outcome.py [--quick] [--speed 4] [--duration 90] [--scenarios a,b]

For each failure scenario and a ``steady`` control, the same seeded load runs against the twin
under:

* **unguarded** — the twin under a supervisor that restarts it like systemd ``Restart=always``;
* **threshold sidecar** — the runbook pattern: poll ``/metrics`` every 30 s, count an event when
  KV usage > 0.95 or waiting > 2 × running, and after 3 events in 5 minutes wait up to 60 s for
  running requests to reach 0, then restart with the same flags;
* **vllm-guardian** — its shipped rules and policy defaults, armed (``dry_run: false``).

The twin runs ``--speed`` times faster than real time, so every operator's clock (the sidecar's
intervals, the guardian's tick, windows, ``for`` durations, cooldowns, timeouts) is divided by
the same factor: each sees the incident at the pace it would in production.

Reported per scenario and operator: requests sent, failed (HTTP, stream or connection error,
timeout), failed %, downtime (seconds ``/health`` did not answer 200 after first becoming ready),
goodput (generated tokens per second of successful requests), p99 latency of successful requests,
actions taken and final flags. Written to ``bench/results/outcome.md`` (+ ``outcome.json`` and
``outcome.png`` when matplotlib is installed). Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_guardian.actuators import flags as flagsfile  # noqa: E402
from vllm_guardian.actuators.alerts import default_rules_text  # noqa: E402
from vllm_guardian.actuators.procmgr import Supervisor  # noqa: E402
from vllm_guardian.config import PolicyConfig, SignalsConfig, parse_config  # noqa: E402
from vllm_guardian.core.alerting import parse_rules  # noqa: E402
from vllm_guardian.daemon import Guardian  # noqa: E402
from vllm_guardian.demo import free_port  # noqa: E402
from vllm_guardian.sim.load import OutcomeKind, RequestOutcome, plan_requests, run_load  # noqa: E402
from vllm_guardian.sim.scenarios import SCENARIOS  # noqa: E402
from vllm_guardian.sources.vllm_metrics import parse_vllm_metrics  # noqa: E402

FAILURES = ("prefill_burst", "kv_thrash", "fragmentation_creep", "noisy_neighbour", "exit_zero_death", "engine_hang",
            "prefix_cache_waste")  # fmt: skip
ALL = (*FAILURES, "steady")
QUICK = ("prefill_burst", "exit_zero_death", "steady")
OPERATORS = ("unguarded", "sidecar", "guardian")
SEED = 7
FAILED = {OutcomeKind.HTTP_ERROR, OutcomeKind.STREAM_ERROR, OutcomeKind.INCOMPLETE, OutcomeKind.CONNECTION_ERROR,
          OutcomeKind.TIMEOUT}  # fmt: skip


@dataclasses.dataclass
class Row:
    scenario: str
    operator: str
    sent: int = 0
    failed: int = 0
    downtime_seconds: float = 0.0
    goodput_tokens_per_second: float = 0.0
    p99_latency_seconds: float | None = None
    actions: list[str] = dataclasses.field(default_factory=list)
    final_flags: str = ""

    @property
    def failed_pct(self) -> float:
        return 100.0 * self.failed / self.sent if self.sent else 0.0


def twin_command(scenario: str, port: int, speed: float, gpu_state: Path) -> list[str]:
    return [
        sys.executable, "-m", "vllm_guardian.sim", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "bench", "--shutdown-timeout", "10", "--sim-scenario", scenario,
        "--sim-speed", f"{speed:g}", "--sim-seed", str(SEED), "--sim-gpu-state-file", str(gpu_state),
        "--sim-gpu-state-interval-seconds", f"{max(0.25, 1.0 / speed):g}",
    ]  # fmt: skip


class HealthWatch:
    """Polls /health; downtime counts from the first 200 on."""

    def __init__(self, url: str, period: float) -> None:
        self.url = url + "/health"
        self.period = period
        self.down = 0.0
        self._up_once = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                ok = requests.get(self.url, timeout=self.period).status_code == 200
            except requests.RequestException:
                ok = False
            now = time.monotonic()
            if ok:
                self._up_once = True
            elif self._up_once:
                self.down += now - last
            last = now
            self._stop.wait(self.period)

    def __enter__(self) -> HealthWatch:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=5)


class Sidecar:
    """The runbook's threshold sidecar, with its clock divided by the twin's speed."""

    def __init__(self, url: str, sup: Supervisor, speed: float) -> None:
        self.url = url
        self.sup = sup
        self.poll = 30.0 / speed
        self.window = 300.0 / speed
        self.wait = 60.0 / speed
        self.events: collections.deque[float] = collections.deque()
        self.actions: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            text = requests.get(self.url + "/metrics", timeout=5).text
        except requests.RequestException:
            return None
        engines = parse_vllm_metrics(text).engines
        if not engines:
            return None
        kv = max(e.kv_cache_usage_ratio or 0.0 for e in engines)
        return (
            kv,
            sum(e.requests_waiting or 0 for e in engines),
            sum(e.requests_running or 0 for e in engines),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            s = self._sample()
            now = time.monotonic()
            if s is not None and (s[0] > 0.95 or s[1] > 2 * s[2]):
                self.events.append(now)
            while self.events and now - self.events[0] > self.window:
                self.events.popleft()
            if len(self.events) >= 3:
                deadline = time.monotonic() + self.wait
                while time.monotonic() < deadline and not self._stop.is_set():
                    s = self._sample()
                    if s is None or s[2] <= 0:
                        break
                    time.sleep(0.2)
                self.sup.restart()
                self.actions.append("restart (same flags)")
                self.events.clear()

    def __enter__(self) -> Sidecar:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=30)


def _scale_fields(obj: Any, speed: float, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name.endswith("_seconds") and f.name not in names:
            lo = f.metadata.get("min")
            v = max(lo if lo is not None else 0.0, v / speed)
        if isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def guardian_config(
    workdir: Path, url: str, port: int, command: list[str], gpu_state: Path, speed: float
) -> Any:
    """The shipped defaults, armed, every time constant divided by the twin's speed."""
    rules = parse_rules(default_rules_text(), "defaults")
    scaled = [
        {k: v for k, v in dataclasses.asdict(r).items() if k != "optional" or v}
        | {"for_seconds": r.for_seconds / speed, "keep_firing_for_seconds": r.keep_firing_for_seconds / speed,
           "severity": r.severity.value, "cause": r.cause.value if r.cause else None}
        for r in rules
    ]  # fmt: skip
    for r in scaled:
        if r["cause"] is None:
            del r["cause"]
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"rules": scaled}, sort_keys=False))
    policy = _scale_fields(PolicyConfig(), speed, ()) | {"dry_run": False, "backend": "process"}
    signals = _scale_fields(SignalsConfig(), speed, ())
    cfg = {
        "interval_seconds": max(0.1, 2.0 / speed),
        "listen": f"127.0.0.1:{port}",
        "runtime_dir": str(workdir / "run"),
        "state_dir": str(workdir / "state"),
        "recorder": {"path": None},
        "services": [
            {"name": "vllm", "url": url, "command": command, "log_file": str(workdir / "vllm.log")}
        ],
        "sources": {"nvml": {"backend": "file", "state_file": str(gpu_state)}},
        "signals": signals,
        "alerting": {"default_rules": False, "rules_file": str(workdir / "rules.yaml")},
        "policy": policy,
    }
    return parse_config(json.dumps(cfg), str(workdir / "config.yaml"))


def run_one(scenario: str, operator: str, speed: float, duration: float) -> Row:
    row = Row(scenario, operator)
    with tempfile.TemporaryDirectory(prefix=f"outcome-{scenario}-{operator}-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gpu_state = workdir / "gpu.json"
        command = twin_command(scenario, port, speed, gpu_state)
        guardian: Guardian | None = None
        loop: threading.Thread | None = None
        sup: Supervisor | None = None
        if operator == "guardian":
            cfg = guardian_config(workdir, url, free_port(), command, gpu_state, speed)
            guardian = Guardian(cfg)
            loop = threading.Thread(
                target=guardian.run, kwargs={"install_signals": False}, daemon=True
            )
            loop.start()
        else:
            sup = Supervisor(
                "vllm", command, workdir / "vllm.env", workdir / "vllm.log", stop_timeout_seconds=15
            )
            sup.start()
        sidecar = Sidecar(url, sup, speed) if operator == "sidecar" and sup is not None else None
        plan = plan_requests(SCENARIOS[scenario].load, SEED, 100_000, duration * speed)
        outcomes: list[RequestOutcome] = []
        try:
            if sidecar is not None:
                sidecar.__enter__()
            with HealthWatch(url, 0.25) as watch:
                # Wait for the first start (the load begins when vLLM is ready, for every operator).
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    try:
                        if requests.get(url + "/health", timeout=1).status_code == 200:
                            break
                    except requests.RequestException:
                        pass
                    time.sleep(0.2)
                result = run_load(
                    url, plan, model="bench", speed=speed, max_duration_seconds=duration,
                    request_timeout_seconds=30, stream=False,  # unary: the 2-core host serves the load
                )  # fmt: skip
                outcomes = list(result.outcomes)
            row.downtime_seconds = watch.down
        finally:
            if sidecar is not None:
                sidecar.__exit__()
                row.actions = list(sidecar.actions)
            if guardian is not None and loop is not None:
                guardian.request_stop()
                loop.join(timeout=60)
                audit = workdir / "state" / "audit.jsonl"
                if audit.exists():
                    for line in audit.read_text().splitlines():
                        d = json.loads(line)
                        if d["what"] == "action":
                            row.actions.append(d["reason"].split(";")[0])
                content = flagsfile.read(workdir / "state" / "vllm.env")
                row.final_flags = (
                    " ".join([*content.argv, *(f"{k}={v}" for k, v in content.env)])
                    if content
                    else ""
                )
            if sup is not None:
                sup.stop()
    sent = [o for o in outcomes if o.kind is not OutcomeKind.NOT_SENT]
    ok = [o for o in sent if o.kind is OutcomeKind.OK]
    row.sent = len(sent)
    row.failed = sum(1 for o in sent if o.kind in FAILED)
    row.goodput_tokens_per_second = sum(o.completion_tokens for o in ok) / duration
    lat = sorted(o.latency_seconds for o in ok if o.latency_seconds is not None)
    row.p99_latency_seconds = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
    return row


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        "# Outcome benchmark",
        "",
        f"`.venv/bin/python bench/outcome.py {' '.join(args.argv)}` — seed {SEED}, twin speed {args.speed:g}×, "
        f"{args.duration:g} s of load per run (= {args.duration * args.speed:g} simulated seconds).",
        "",
        "| scenario | operator | sent | failed | failed % | downtime s | goodput tok/s | p99 s | actions | final flags |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        p99 = f"{r.p99_latency_seconds:.2f}" if r.p99_latency_seconds is not None else "–"
        acts = "; ".join(r.actions) if r.actions else "–"
        lines.append(
            f"| {r.scenario} | {r.operator} | {r.sent} | {r.failed} | {r.failed_pct:.1f} | {r.downtime_seconds:.1f} "
            f"| {r.goodput_tokens_per_second:.0f} | {p99} | {acts} | {r.final_flags or '–'} |"
        )
    lines += ["", "Goal (P4): in every failure scenario the guardian's failed requests ≤ 10 % of unguarded and",
              "≤ 25 % of the threshold sidecar; goodput in `steady` ≥ 90 % of unguarded.", ""]  # fmt: skip
    by = {(r.scenario, r.operator): r for r in rows}
    for s in sorted({r.scenario for r in rows}, key=ALL.index):
        g, u, c = by.get((s, "guardian")), by.get((s, "unguarded")), by.get((s, "sidecar"))
        if not (g and u and c):
            continue
        if s == "steady":
            ratio = (
                g.goodput_tokens_per_second / u.goodput_tokens_per_second
                if u.goodput_tokens_per_second
                else 0
            )
            lines.append(
                f"- steady: guardian goodput {100 * ratio:.0f} % of unguarded — {'met' if ratio >= 0.9 else 'MISSED'}"
            )
            continue
        met_u = g.failed <= 0.10 * u.failed if u.failed else g.failed == 0
        met_c = g.failed <= 0.25 * c.failed if c.failed else g.failed == 0
        lines.append(f"- {s}: guardian {g.failed} failed vs unguarded {u.failed} and sidecar {c.failed} — "
                     f"{'met' if met_u and met_c else 'MISSED'}")  # fmt: skip
    return "\n".join(lines) + "\n"


def chart(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    scenarios = [s for s in ALL if any(r.scenario == s for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    for i, op in enumerate(OPERATORS):
        vals = [
            next((r.failed_pct for r in rows if r.scenario == s and r.operator == op), 0.0)
            for s in scenarios
        ]
        ax.bar([x + (i - 1) * width for x in range(len(scenarios))], vals, width, label=op)
    ax.set_xticks(range(len(scenarios)), scenarios, rotation=20, ha="right")
    ax.set_ylabel("failed requests (%)")
    ax.set_title("Failed requests per scenario and operator (vLLM twin, same seeded load)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help=f"{', '.join(QUICK)} only, short runs (CI smoke)"
    )
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=None, help="real seconds of load per run")
    ap.add_argument("--scenarios", default=None, help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    scenarios = args.scenarios.split(",") if args.scenarios else list(QUICK if args.quick else ALL)
    args.duration = args.duration or (25.0 if args.quick else 60.0)
    rows: list[Row] = []
    for s in scenarios:
        for op in OPERATORS:
            t = time.monotonic()
            r = run_one(s, op, args.speed, args.duration)
            rows.append(r)
            print(f"{s:<20} {op:<10} sent {r.sent:5d} failed {r.failed:5d} ({r.failed_pct:5.1f} %) "
                  f"down {r.downtime_seconds:5.1f}s goodput {r.goodput_tokens_per_second:7.0f} tok/s "
                  f"actions {len(r.actions)}  [{time.monotonic() - t:.0f}s]", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    md = markdown(rows, args)
    (args.out / f"outcome{suffix}.md").write_text(md)
    (args.out / f"outcome{suffix}.json").write_text(
        json.dumps([dataclasses.asdict(r) for r in rows], indent=1)
    )
    if chart(rows, args.out / f"outcome{suffix}.png"):
        print(f"chart: {args.out / f'outcome{suffix}.png'}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
