"""``vllm-guardian restart SERVICE`` and ``vllm-guardian relaunch SERVICE --set k=v``.

Where it sits: a client of the running daemon's control socket. The daemon runs the command
through the same phases as its own actions (``core/phases.py``: close the front door, drain,
restart, wait for the GPU memory and for ready, open), audited with who asked; this module
checks the flags before anything is sent (whitelisted and range-checked: a bad one is exit 2
with nothing written), then follows the action phase by phase until it ends.

``--set`` takes vLLM's own flag names with underscores or dashes (``max_num_seqs=64`` or
``--max-num-seqs=64``); switches take no value (``enforce_eager``). ``--reset`` goes back to the
operator's base flags (the unit's own ``ExecStart``): every rung and every ``--set`` cleared.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_guardian.actuators import flags as flagsfile

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def parse_set(item: str) -> tuple[str, str]:
    """``max_num_seqs=64`` → (``--max-num-seqs``, ``64``); raises ValueError saying why."""
    name, sep, value = item.partition("=")
    flag = "--" + name.strip().lstrip("-").replace("_", "-")
    if flag not in flagsfile.FLAGS:
        allowed = ", ".join(sorted(f[2:].replace("-", "_") for f in flagsfile.FLAGS))
        raise ValueError(
            f"{name.strip()!r} is not a flag the guardian may set (allowed: {allowed})"
        )
    value = value.strip() if sep else ""
    problem = flagsfile.FLAGS[flag](value)
    if problem:
        raise ValueError(f"{flag} {value!r}: {problem}")
    return flag, value


def who() -> str:
    user = os.environ.get("SUDO_USER") or getpass.getuser()
    return f"{user} (uid {os.getuid()}) via the CLI"


def build_parser(command: str) -> argparse.ArgumentParser:
    text = {
        "restart": "drain and restart a vLLM service with its current flags, through the front door",
        "relaunch": "set whitelisted flags and relaunch through the same drain (or --reset)",
    }[command]
    epilog = None
    if command == "relaunch":
        # Read from the whitelist itself, so the help cannot list a flag the guardian refuses.
        rows = [
            f"  {flag[2:].replace('-', '_'):<26} {check}" for flag, check in flagsfile.FLAGS.items()
        ]
        epilog = "the flags --set may change (whitelisted, range-checked):\n" + "\n".join(rows)
    ap = argparse.ArgumentParser(
        prog=f"vllm-guardian {command}",
        description=text,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("service", help="the service's name in the guardian's config")
    ap.add_argument(
        "-c",
        "--config",
        default="/etc/vllm-guardian/config.yaml",
        help="the guardian's config, read for its control socket "
        "(default /etc/vllm-guardian/config.yaml)",
    )
    ap.add_argument("--socket", help="control socket path (default: <runtime_dir>/control.sock)")
    if command == "relaunch":
        ap.add_argument(
            "--set",
            dest="sets",
            action="append",
            default=[],
            metavar="FLAG=VALUE",
            help="e.g. max_num_seqs=64 (repeatable; whitelisted, range-checked)",
        )
        ap.add_argument("--reset", action="store_true", help="back to the operator's base flags")
    ap.add_argument(
        "--force", action="store_true", help="act although the circuit breaker is latched"
    )
    ap.add_argument("--no-wait", action="store_true", help="start it and return")
    ap.add_argument(
        "--timeout-seconds", type=float, default=3600.0, help="how long to follow it (default 1 h)"
    )
    return ap


def main(argv: Sequence[str], socket_path: Callable[[str, str | None], Path]) -> int:
    """``vllm-guardian restart|relaunch``; ``socket_path(config, --socket)`` is the command line's
    own resolver, passed in so that this module does not import the one that dispatches to it."""
    from vllm_guardian.lowio.control import ControlError, request  # noqa: PLC0415

    command, rest = argv[0], list(argv[1:])
    args = build_parser(command).parse_args(rest)
    sets: list[tuple[str, str]] = []
    for item in getattr(args, "sets", []):
        try:
            sets.append(parse_set(item))
        except ValueError as e:
            print(f"vllm-guardian {command}: {e}; nothing written", file=sys.stderr)
            return EXIT_USAGE
    if command == "relaunch" and not sets and not args.reset:
        print(
            f"vllm-guardian {command}: nothing to change: give --set FLAG=VALUE or --reset "
            "(or use `vllm-guardian restart`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    path = socket_path(args.config, args.socket)
    payload: dict[str, Any] = {
        "cmd": command,
        "service": args.service,
        "sets": sets,
        "reset": bool(getattr(args, "reset", False)),
        "force": args.force,
        "who": who(),
    }
    try:
        reply = request(path, payload)
    except ControlError as e:
        print(f"vllm-guardian {command}: {e}", file=sys.stderr)
        return EXIT_FAIL
    if not reply.get("ok"):
        print(f"vllm-guardian {command}: {reply.get('error')}", file=sys.stderr)
        return EXIT_FAIL
    action_id = int(reply["action_id"])
    print(f"{args.service}: action {action_id} started: {reply.get('reason')}", flush=True)
    if args.no_wait:
        return EXIT_OK
    return follow(path, args.service, action_id, args.timeout_seconds)


def follow(path: Path, service: str, action_id: int, timeout_seconds: float) -> int:
    """Print each decision of the action as it happens; the exit code says how it ended."""
    from vllm_guardian.lowio.control import ControlError, request  # noqa: PLC0415

    shown = 0
    deadline = time.monotonic() + timeout_seconds
    start = time.monotonic()
    while time.monotonic() < deadline:
        try:
            reply = request(path, {"cmd": "action", "service": service, "action_id": action_id})
        except ControlError as e:
            print(f"  (lost the guardian: {e}; the action goes on without us)", file=sys.stderr)
            return EXIT_FAIL
        decisions = reply.get("decisions") or []
        for d in decisions[shown:]:
            phase = f"{d['phase']}: " if d.get("phase") else ""
            print(f"  +{time.monotonic() - start:5.0f}s {d['what']:<7} {phase}{d['reason']}",
                  flush=True)  # fmt: skip
        shown = len(decisions)
        ended = [d for d in decisions if d["what"] in ("result", "latch")]
        if ended:
            return EXIT_OK if ended[-1].get("ok") is True else EXIT_FAIL
        time.sleep(0.5)
    print(f"  still running after {timeout_seconds:.0f}s; follow it with `vllm-guardian status`")
    return EXIT_FAIL
