"""The twin's command line: ``serve`` (a simulated ``vllm serve``) and ``load``.

``main(argv)`` is what ``python -m vllm_guardian.sim`` and ``vllm-guardian sim`` call.
The environment is read here, once (PYTORCH_CUDA_ALLOC_CONF), and passed down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Sequence

from vllm_guardian.sim.engine import Proc
from vllm_guardian.sim.flags import FlagError, parse_serve_args
from vllm_guardian.sim.load import OutcomeKind, RequestOutcome, plan_requests, run_load
from vllm_guardian.sim.scenarios import SCENARIOS
from vllm_guardian.sim.server import Twin
from vllm_guardian.sim.timeline import TimelineError
from vllm_guardian.sim.vllm_log import LogWriter

PROG = "python -m vllm_guardian.sim"


def serve(argv: Sequence[str], prog: str = PROG) -> int:
    log = LogWriter(os.getpid())
    try:
        opts = parse_serve_args(argv, os.environ, prog=f"{prog} serve")
    except (FlagError, ValueError) as exc:
        # vLLM fails the same way: a ValueError traceback from config validation, status 1.
        log.raw("Traceback (most recent call last):")
        log.raw(f"ValueError: {exc}")
        return 1
    try:
        twin = Twin(opts, log)
    except TimelineError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    return twin.run()


def load(argv: Sequence[str], prog: str = PROG) -> int:
    p = argparse.ArgumentParser(
        prog=f"{prog} load",
        description="A seeded load against a vLLM (or the twin) for one scenario; prints one "
        "outcome per request.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="steady")
    p.add_argument("--speed", type=float, default=1.0, help="the twin's --sim-speed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument(
        "--max-duration-seconds",
        type=float,
        default=60.0,
        help="the window in which requests are sent; each request sent then gets its whole "
        "time bound (30 s) to finish",
    )
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--outcomes", default=None, help="write one JSON line per request here")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=64,
        help="requests the client holds open at once; the rest wait client-side, unseen by vLLM",
    )
    ns = p.parse_args(list(argv))
    if ns.max_in_flight < 1:
        p.error("--max-in-flight must be at least 1")
    profile = SCENARIOS[ns.scenario].load
    plan = plan_requests(profile, ns.seed, ns.max_requests, ns.max_duration_seconds * ns.speed)
    # Outcomes are written as requests finish (not at the end), so a watcher such as the demo
    # can count them live and a run stopped early still leaves what it saw.
    with contextlib.ExitStack() as stack:
        fh = stack.enter_context(open(ns.outcomes, "w", encoding="utf-8")) if ns.outcomes else None
        lock = threading.Lock()

        def record(o: RequestOutcome) -> None:
            if fh is not None:
                with lock:
                    fh.write(o.to_json() + "\n")
                    fh.flush()

        try:
            result = run_load(
                ns.url.rstrip("/"),
                plan,
                model=ns.model,
                speed=ns.speed,
                stream=not ns.no_stream,
                max_duration_seconds=ns.max_duration_seconds,
                max_in_flight=ns.max_in_flight,
                on_outcome=record,
            )
        except ValueError as exc:
            print(f"load: {exc}", file=sys.stderr)
            return 2
        for o in result.outcomes:
            if o.kind is OutcomeKind.NOT_SENT:
                record(o)
    print(json.dumps(result.summary(), sort_keys=True))
    return 0


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """``prog`` is how the user called it (``vllm-guardian sim`` or ``python -m ...sim``), so
    the usage lines name a command that exists."""
    usage = (
        f"usage: {prog} {{serve,load}} ...\n\n"
        "The vLLM twin: a simulated vLLM 0.32 that fails the way vLLM fails (docs/twin.md), "
        "and its load generator.\n\n"
        f"commands:\n  serve  the twin ({prog} serve --help)\n"
        f"  load   its load generator ({prog} load --help)"
    )
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return serve(rest, prog)
    if command == "load":
        return load(rest, prog)
    print(f"{usage}\nunknown command: {command}", file=sys.stderr)
    return 2


__all__ = ["Proc", "main"]
