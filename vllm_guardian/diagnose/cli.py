"""``vllm-guardian diagnose`` and ``vllm-guardian plan``.

Exit codes: 0 healthy, 1 a finding (any other verdict), 2 a usage error (bad arguments, a
path that is not a bundle, a model config that cannot be read).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_guardian.actuators.alerts import load_rules
from vllm_guardian.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigInvalid,
    NvmlSourceConfig,
    PolicyConfig,
    ServiceConfig,
    SignalsConfig,
    load_config,
)
from vllm_guardian.core import observations
from vllm_guardian.core.budget import (
    DTYPE_BYTES,
    Deployment,
    ModelConfigError,
    model_shape,
    parse_human_int,
)
from vllm_guardian.diagnose.analyze import analyze, plan_report
from vllm_guardian.diagnose.bundle import BundleError, read_bundle, write_bundle
from vllm_guardian.diagnose.gather import GatherOptions, gather
from vllm_guardian.diagnose.report import WIDTH, Report, render_text, to_json

EXIT_USAGE = 2
GIB = 1024**3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _diagnose_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="vllm-guardian diagnose",
        description="Which known vLLM memory failure this is, the evidence, and the flags to relaunch with.",
    )
    p.add_argument(
        "-c", "--config", help=f"guardian config (default {DEFAULT_CONFIG_PATH} when it exists)"
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument("--service", help="the service of the config to diagnose (default: the first)")
    who.add_argument("--url", help="vLLM's base URL, without a config (e.g. http://127.0.0.1:8000)")
    p.add_argument("--bundle", help="re-analyse a saved bundle (a directory or a .tar.gz)")
    p.add_argument(
        "--unit", help="the systemd unit (default: found from the process on the URL's port)"
    )
    p.add_argument("--log-file", help="read vLLM's log from this file instead of the journal")
    p.add_argument(
        "--gpu-state-file", help="read GPUs from this state file (the twin) instead of NVML"
    )
    p.add_argument("--model-config", help="the model's config.json (or its directory)")
    p.add_argument(
        "--interval", type=float, default=5.0, help="seconds between the two /metrics scrapes (5)"
    )
    p.add_argument(
        "--journal-minutes", type=float, default=10.0, help="how much journal to read (10)"
    )
    p.add_argument(
        "--save-bundle", help="also write what was gathered as a bundle (dir or .tar.gz)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON (docs/bundle.md)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="every piece of evidence and problem"
    )
    return p


def text_width() -> int:
    """The terminal's width (COLUMNS first, as every tool), or 80 when the report goes to a pipe
    or a file; never under 40, where a report cannot be read."""
    if not sys.stdout.isatty():
        return WIDTH
    return max(40, shutil.get_terminal_size((WIDTH, 24)).columns)


def _emit(report: Report, as_json: bool, verbose: bool) -> int:
    if as_json:
        print(json.dumps(to_json(report), indent=2))
    else:
        sys.stdout.write(render_text(report, verbose, text_width()))
    return report.exit_code


def _read_config(path: str) -> tuple[Config, observations.Thresholds] | None:
    """The config at ``path`` and the thresholds of its rule set (shipped rules + ``rules_file``:
    one classifier's numbers), or None after saying what is wrong with either."""
    try:
        cfg = load_config(path)
        rules = load_rules(cfg.alerting)
    except ConfigInvalid as e:
        print(f"vllm-guardian diagnose: {path}: {e}", file=sys.stderr)
        return None
    except OSError as e:
        print(f"vllm-guardian diagnose: {path}: {e.strerror or e}", file=sys.stderr)
        return None
    where = cfg.alerting.rules_file
    return cfg, observations.thresholds_from_rules(
        rules, f"the shipped rules and {where}" if where else "the shipped rules"
    )


def diagnose(argv: Sequence[str]) -> int:
    try:
        args = _diagnose_parser().parse_args(list(argv))
    except SystemExit as e:  # --help (0) or a usage error (2): an exit code, not an exit
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.interval < 0 or args.interval > 60:
        print("vllm-guardian diagnose: --interval must be within 0..60 s", file=sys.stderr)
        return EXIT_USAGE
    if args.bundle:
        if args.url or args.service or args.save_bundle:
            print(
                "vllm-guardian diagnose: --bundle takes no --url/--service/--save-bundle",
                file=sys.stderr,
            )
            return EXIT_USAGE
        thresholds = observations.Thresholds()
        policy: PolicyConfig | None = None
        signals: SignalsConfig | None = None
        if args.config:
            read = _read_config(args.config)
            if read is None:
                return EXIT_USAGE
            policy, thresholds, signals = read[0].policy, read[1], read[0].signals
        try:
            bundle = read_bundle(args.bundle)
        except BundleError as e:
            print(f"vllm-guardian diagnose: {e}", file=sys.stderr)
            return EXIT_USAGE
        return _emit(
            analyze(bundle, "bundle", thresholds, policy, signals), args.json, args.verbose
        )
    nvml = NvmlSourceConfig()
    socket: str | None = None
    thresholds = observations.Thresholds()  # --url alone: the shipped rules' numbers
    policy = None  # --url alone: the shipped policy's levers
    svc: ServiceConfig
    config_path = args.config or (
        DEFAULT_CONFIG_PATH if not args.url and Path(DEFAULT_CONFIG_PATH).exists() else None
    )
    if config_path:
        read = _read_config(config_path)
        if read is None:
            return EXIT_USAGE
        cfg, thresholds = read
        policy = cfg.policy
        found = cfg.service(args.service) if args.service else cfg.services[0]
        if found is None:
            names = ", ".join(s.name for s in cfg.services)
            print(
                f"vllm-guardian diagnose: no service {args.service!r} (have: {names})",
                file=sys.stderr,
            )
            return EXIT_USAGE
        svc, nvml = found, cfg.sources.nvml
        socket = str(Path(cfg.runtime_dir) / "control.sock")
    elif args.url:
        if not args.url.startswith(("http://", "https://")):
            print(
                "vllm-guardian diagnose: --url must start with http:// or https://", file=sys.stderr
            )
            return EXIT_USAGE
        svc = ServiceConfig(name=args.service or "vllm", url=args.url)
        default_socket = Path("/run/vllm-guardian/control.sock")
        socket = str(default_socket) if default_socket.exists() else None
    else:
        print(
            f"vllm-guardian diagnose: give --url, --bundle or a config (-c; {DEFAULT_CONFIG_PATH} does not exist)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.unit:
        svc = ServiceConfig(
            name=svc.name, url=svc.url, unit=args.unit, gpus=svc.gpus, log_file=svc.log_file
        )
    if args.log_file:
        svc = ServiceConfig(
            name=svc.name, url=svc.url, unit=svc.unit, gpus=svc.gpus, log_file=args.log_file
        )
    if args.gpu_state_file:
        nvml = NvmlSourceConfig(backend="file", state_file=args.gpu_state_file)
    opts = GatherOptions(
        interval_seconds=args.interval,
        journal_minutes=args.journal_minutes,
        nvml=nvml,
        control_socket=socket,
        model_config=args.model_config,
    )

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"diagnose: {msg}…", file=sys.stderr, flush=True)

    bundle = gather(svc, opts, progress)
    if args.save_bundle:
        try:
            saved = write_bundle(bundle, args.save_bundle)
            progress(f"bundle saved to {saved}")
        except OSError as e:
            print(f"vllm-guardian diagnose: cannot save the bundle: {e}", file=sys.stderr)
    return _emit(analyze(bundle, "live", thresholds, policy), args.json, args.verbose)


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="vllm-guardian plan",
        description="The KV budget of a deployment before it exists, and the verdict it would get.",
    )
    p.add_argument("--model", required=True, help="the model's config.json (or its directory)")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, GiB")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1)")
    p.add_argument("--gpu-memory-utilization", type=float, help="default 0.92")
    p.add_argument("--max-model-len", help="default: the model's max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *sorted(k for k in DTYPE_BYTES if k.startswith("fp8"))],
    )
    p.add_argument("--kv-cache-memory-bytes", help="pin the KV pool (e.g. 20G)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--request-tokens", type=float, help="typical (p95) prompt + output tokens per request"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        help="also show the largest max_model_len for this many sequences",
    )
    p.add_argument("--json", action="store_true")
    return p


def plan(argv: Sequence[str]) -> int:
    try:
        args = _plan_parser().parse_args(list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    path = Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"vllm-guardian plan: {path}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not isinstance(cfg, dict):
        print(f"vllm-guardian plan: {path}: not a JSON object", file=sys.stderr)
        return EXIT_USAGE
    index_total = None
    index = path.parent / "model.safetensors.index.json"
    if index.is_file():
        try:
            meta = json.loads(index.read_text(encoding="utf-8")).get("metadata", {})
            index_total = int(meta["total_size"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            index_total = None
    try:
        shape = model_shape(
            cfg, index_total, name=str(cfg.get("_name_or_path") or path.parent.name)
        )
    except ModelConfigError as e:
        print(f"vllm-guardian plan: {path}: {e}", file=sys.stderr)
        return EXIT_USAGE
    problems = []
    if not 1 <= args.gpu_memory_gib <= 4096:
        problems.append("--gpu-memory-gib must be within 1..4096")
    if args.tp < 1:
        problems.append("--tp must be ≥ 1")
    util = args.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        problems.append("--gpu-memory-utilization must be within (0, 1]")
    mml = parse_human_int(args.max_model_len) if args.max_model_len else None
    if args.max_model_len and not mml:
        problems.append(f"--max-model-len {args.max_model_len!r} is not a number")
    kvb = parse_human_int(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None
    if args.kv_cache_memory_bytes and not kvb:
        problems.append(f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes!r} is not a size")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "concurrency"):
        v = getattr(args, name)
        if v is not None and v < 1:
            problems.append(f"--{name.replace('_', '-')} must be ≥ 1")
    if problems:
        for msg in problems:
            print(f"vllm-guardian plan: {msg}", file=sys.stderr)
        return EXIT_USAGE
    d = Deployment(
        gpu_memory_total_bytes=int(args.gpu_memory_gib * GIB),
        gpu_memory_utilization_ratio=util,
        tensor_parallel_size=args.tp,
        max_model_len=mml,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=kvb,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager or None,
    )
    report = plan_report(shape, d, args.request_tokens, args.concurrency, origin=str(path))
    return _emit(report, args.json, verbose=True)


def main(argv: Sequence[str]) -> int:
    """``argv[0]`` is ``diagnose`` or ``plan`` (as dispatched by ``vllm_guardian.tools.cli``)."""
    args = list(argv)
    if args and args[0] == "plan":
        return plan(args[1:])
    if args and args[0] == "diagnose":
        return diagnose(args[1:])
    return diagnose(args)
