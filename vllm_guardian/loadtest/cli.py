"""``vllm-guardian loadtest``: prove a vLLM configuration holds at peak, and say what to set.

Exit codes: 0 every step held every limit; 1 the run stopped on a limit, an error or Ctrl-C
(the partial report is printed); 2 bad usage, profile or prompts file, or a public URL without
the confirmation flag; 3 the server did not answer before any load was sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import yaml

from vllm_guardian.config import ConfigInvalid, parse_bytes

from .profile import (
    MAX_CONCURRENCY,
    FilePrompt,
    Profile,
    PromptsInvalid,
    Reach,
    check,
    classify_url,
    doubling_ramp,
    load_profile,
    load_prompts,
    parse_profile,
    with_overrides,
)
from .recommend import Verdict, recommend
from .report import LiveDisplay, render, to_json, write_chart
from .runner import RunState, Unreachable, preflight, run_loadtest, server_info

EXIT_PASS, EXIT_STOPPED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def _ramp(text: str) -> tuple[int, ...]:
    """``double`` or ``double:64`` (1, 2, 4, … up to 64) or a list ``1,4,16``."""
    if text.startswith("double"):
        _, _, top = text.partition(":")
        return doubling_ramp(int(top) if top else 64)
    try:
        steps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give concurrencies like 1,2,4,8 or 'double[:MAX]'"
        ) from None
    if not steps or any(not 1 <= s <= MAX_CONCURRENCY for s in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies 1..{MAX_CONCURRENCY}")
    return steps


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices like 0,1") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-guardian loadtest",
        description="Load a vLLM server step by step while watching it with the guardian's "
        "sources; stop before harm; report the highest step that held and the flags to set.",
    )
    ap.add_argument("--url", help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--profile", help="a YAML load profile (docs/loadtest.md)")
    # Elsewhere -c is the guardian's config; here it was the profile. Kept, with a warning.
    ap.add_argument(
        "-c", "--config", dest="config_alias", metavar="PROFILE", help="deprecated: use --profile"
    )
    ap.add_argument("--model", help="the model name to request (default: the server's first)")
    g = ap.add_argument_group("load shape (flags override the profile)")
    g.add_argument(
        "--ramp",
        nargs="?",
        const="double",
        type=_ramp,
        help="concurrency steps: 1,2,4,8 or 'double[:MAX]' (default 1, 2, 4, … 64)",
    )
    g.add_argument("--concurrency", type=int, help="one closed-loop step at this concurrency")
    g.add_argument("--rate", type=float, help="one open-loop step at this many requests/s")
    g.add_argument("--step-seconds", "--duration", type=float, help="seconds per step")
    g.add_argument("--prompt-tokens", help="MIN-MAX (or N) prompt tokens")
    g.add_argument("--output-tokens", help="MIN-MAX (or N) output tokens")
    g.add_argument("--prompts-file", help='JSON lines of real prompts: {"prompt": ...}')
    g.add_argument("--shared-prefix-ratio", type=float, help="0..1 of each prompt shared")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT)")
    g.add_argument("--request-timeout", type=float, help="seconds before a request is an error")
    g.add_argument("--seed", type=int)
    lim = ap.add_argument_group("limits (a step that breaks one ends the run)")
    lim.add_argument("--slo-ttft-p99", type=float, help="seconds")
    lim.add_argument("--slo-e2e-p99", type=float, help="seconds")
    lim.add_argument("--max-error-ratio", type=float, help="default 0.01")
    lim.add_argument("--max-preemptions-per-second", type=float, help="default 0.5")
    lim.add_argument("--gpu-headroom-floor", type=_bytes, help="e.g. 2GiB (default 1GiB)")
    w = ap.add_argument_group("watching")
    w.add_argument("--interval", type=float, help="seconds between samples (default 1)")
    w.add_argument("--gpu-backend", choices=("nvml", "file", "none"))
    w.add_argument(
        "--gpu-state-file", help="the twin's GPU state file (implies --gpu-backend file)"
    )
    w.add_argument("--gpus", type=_gpus, help="GPU indices the server uses (default: all)")
    w.add_argument("--log-file", help="the server's log file, for OOM lines")
    w.add_argument("--unit", help="the server's systemd unit, for OOM lines in its journal")
    w.add_argument(
        "--server-args",
        help="the server's vLLM flags, quoted (default: read from the local process)",
    )
    o = ap.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--chart", type=Path, help="write a PNG chart here (needs matplotlib)")
    o.add_argument("--quiet", action="store_true", help="no live progress line")
    ap.add_argument(
        "--allow-public-url",
        action="store_true",
        help="confirm loading a URL that is neither loopback nor a private address",
    )
    return ap


def _range(text: str | None, what: str) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--{what}: {text!r} is not MIN-MAX or N") from None
    return a, b


def build_profile(args: argparse.Namespace) -> Profile:
    """Profile file (if any) + flags, checked. Raises ConfigInvalid or ValueError."""
    base = load_profile(args.profile) if args.profile else Profile()
    p_min, p_max = _range(args.prompt_tokens, "prompt-tokens")
    o_min, o_max = _range(args.output_tokens, "output-tokens")
    shape_given = any(x is not None for x in (args.ramp, args.concurrency, args.rate))
    gpu_backend = args.gpu_backend or ("file" if args.gpu_state_file else None)
    profile = with_overrides(
        base,
        url=args.url,
        model=args.model,
        load__step_seconds=args.step_seconds,
        load__prompt_tokens_min=p_min,
        load__prompt_tokens_max=p_max,
        load__output_tokens_min=o_min,
        load__output_tokens_max=o_max,
        load__prompts_file=args.prompts_file,
        load__shared_prefix_ratio=args.shared_prefix_ratio,
        load__stream=False if args.no_stream else None,
        load__request_timeout_seconds=args.request_timeout,
        load__seed=args.seed,
        limits__p99_ttft_seconds=args.slo_ttft_p99,
        limits__p99_e2e_seconds=args.slo_e2e_p99,
        limits__error_ratio=args.max_error_ratio,
        limits__preemptions_per_second=args.max_preemptions_per_second,
        limits__gpu_headroom_floor_bytes=args.gpu_headroom_floor,
        watch__interval_seconds=args.interval,
        watch__gpu_backend=gpu_backend,
        watch__gpu_state_file=args.gpu_state_file,
        watch__gpus=args.gpus,
        watch__log_file=args.log_file,
        watch__unit=args.unit,
    )
    ld = profile.load
    if shape_given:
        # A shape on the command line replaces the profile's, whichever kind it was.
        ld = replace(ld, ramp=args.ramp, concurrency=args.concurrency, rate_per_second=args.rate)
    elif ld.ramp is None and ld.concurrency is None and ld.rate_per_second is None:
        ld = replace(ld, ramp=doubling_ramp(64))
    profile = replace(profile, load=ld)
    _check_bounds(profile)
    return check(profile, args.profile or "<flags>")


def _check_bounds(profile: Profile) -> None:
    """Flag values go through the same bounds as the profile's keys (one loader, one set of
    messages): the merged profile is written back to YAML and parsed."""
    parse_profile(yaml.safe_dump(_plain(profile)), "<flags>")


def _plain(profile: Profile) -> dict[str, object]:
    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if v is not None}
        if isinstance(x, tuple | list):
            return [strip(v) for v in x]
        return x

    d = strip(dataclasses.asdict(profile))
    assert isinstance(d, dict)
    return d


def _print_invalid(e: ConfigInvalid, err: TextIO) -> None:
    n = len(e.errors)
    print(f"{e.filename}: {n} error{'s' if n != 1 else ''}:", file=err)
    for item in e.errors:
        print("  " + item.format(e.filename), file=err)


def main(
    argv: Sequence[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    args = build_parser().parse_args(argv)
    if args.config_alias is not None:
        print(
            "vllm-guardian loadtest: -c/--config is deprecated here (elsewhere it is the "
            "guardian's config): use --profile",
            file=err,
        )
        if args.profile is None:
            args.profile = args.config_alias
        elif args.profile != args.config_alias:
            print("vllm-guardian loadtest: give the profile once: --profile", file=err)
            return EXIT_USAGE
    try:
        profile = build_profile(args)
    except ConfigInvalid as e:
        _print_invalid(e, err)
        return EXIT_USAGE
    except ValueError as e:
        print(f"vllm-guardian loadtest: {e}", file=err)
        return EXIT_USAGE
    if profile.url is None:
        print("vllm-guardian loadtest: give --url (or url: in the profile)", file=err)
        return EXIT_USAGE
    url = profile.url.rstrip("/")
    try:
        reach = classify_url(url)
    except ValueError as e:
        print(f"vllm-guardian loadtest: {e}", file=err)
        return EXIT_UNREACHABLE
    if reach is Reach.PUBLIC:
        print(
            f"WARNING: {url} is neither loopback nor a private address. A loadtest pushes a "
            "server until it breaks a limit: only point it at a server you own, outside "
            "production traffic.",
            file=err,
        )
        if not args.allow_public_url:
            print("refusing without --allow-public-url", file=err)
            return EXIT_USAGE
    prompts: tuple[FilePrompt, ...] | None = None
    if profile.load.prompts_file:
        try:
            prompts = load_prompts(profile.load.prompts_file)
        except PromptsInvalid as e:
            print(f"{e.filename}: the prompts file cannot be used:", file=err)
            for problem in e.problems:
                print(f"  {problem}", file=err)
            return EXIT_USAGE
    try:
        model = preflight(url, profile.model)
    except Unreachable as e:
        print(f"vllm-guardian loadtest: {e}", file=err)
        return EXIT_UNREACHABLE
    server_args = shlex.split(args.server_args) if args.server_args else None
    server = server_info(url, model, server_args)
    display = LiveDisplay(err, quiet=args.quiet or args.json)
    state = run_loadtest(url, profile, server, prompts, progress=display)
    display.done()
    verdict = verdict_of(state)
    if args.json:
        out.write(to_json(state, verdict) + "\n")
    else:
        out.write(render(state, verdict) + "\n")
    if args.chart is not None:
        chart_problem = write_chart(state.results, args.chart)
        print(chart_problem or f"chart: {args.chart}", file=err)
    return EXIT_PASS if verdict.passed else EXIT_STOPPED


def verdict_of(state: RunState) -> Verdict:
    ran_all = len(state.results) == len(state.profile.steps()) and not state.interrupted
    return recommend(
        state.results,
        state.server.flags,
        state.profile.limits,
        stop_reason=state.stop_reason,
        completed=ran_all,
    )


if __name__ == "__main__":
    sys.exit(main())
