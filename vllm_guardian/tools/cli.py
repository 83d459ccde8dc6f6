"""The ``vllm-guardian`` command: run | check-config | status | sim.

Exit codes: 0 success, 1 runtime failure, 2 invalid config or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vllm_guardian import __version__
from vllm_guardian.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigInvalid,
    PolicyConfig,
    load_config,
    read_text,
)

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


def _setup_logging(verbose: bool) -> None:
    # Under systemd the journal adds the time; elsewhere a person reading a terminal wants it.
    fmt = (
        "%(levelname)s %(message)s"
        if os.environ.get("JOURNAL_STREAM")
        else "%(asctime)s %(levelname)s %(message)s"
    )
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stderr
    )


def _load(path: str) -> Config | None:
    try:
        return load_config(path)
    except ConfigInvalid as e:
        n = len(e.errors)
        print(f"{path}: {n} error{'s' if n != 1 else ''}:", file=sys.stderr)
        for err in e.errors:
            print("  " + err.format(e.filename), file=sys.stderr)
        return None


def missing_files(cfg: Config) -> list[str]:
    """Files the config names that this user cannot read now. Not errors: a log file may appear
    when vLLM first starts, and the source reports itself down until then; but a typo in a path
    would leave the guardian half blind without a word, so check-config says it."""
    named = [
        (f"services[{i}].log_file", s.log_file, "the logs source")
        for i, s in enumerate(cfg.services)
    ]
    nvml = cfg.sources.nvml
    if nvml.enabled and nvml.backend == "file":
        named.append(("sources.nvml.state_file", nvml.state_file, "the GPU source"))
    out = []
    for key, path, source in named:
        if path is None:
            continue
        if not os.path.exists(path):
            out.append(f"{key}: {path} does not exist: {source} reports itself down until it does")
        elif not os.access(path, os.R_OK):
            out.append(f"{key}: {path} is not readable by this user: {source} cannot read it")
    return out


def _named_rules_file(path: str) -> str | None:
    """``alerting.rules_file`` as written in a config that did not validate, or None."""
    # Composed, not loaded: a bad tag (!!int abc) raises in YAML's constructors, not here.
    try:
        node = yaml.compose(read_text(path), Loader=yaml.SafeLoader)
    except (ConfigInvalid, yaml.YAMLError, RecursionError):
        return None
    for key in ("alerting", "rules_file"):
        if not isinstance(node, yaml.MappingNode):
            return None
        node = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":str") and node.value:
        return str(node.value)
    return None


def _print_rules_errors(e: ConfigInvalid) -> None:
    print(f"{e.filename}: {len(e.errors)} error(s) in alert rules:", file=sys.stderr)
    for err in e.errors:
        print("  " + err.format(e.filename), file=sys.stderr)


def _error_docs(e: ConfigInvalid) -> list[dict[str, Any]]:
    return [
        {"file": e.filename, "line": err.line, "key": err.path, "message": err.message}
        for err in e.errors
    ]


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a config and its rules file; every error at once. With ``--json`` the same as
    one object (docs/cli.md): text for people on stdout/stderr, the object for scripts."""
    from vllm_guardian.lowio.redact import redact_text  # noqa: PLC0415

    doc: dict[str, Any] = {
        "schema": "vllm-guardian/check-config",
        "schema_version": 1,
        "config": args.config,
        "ok": False,
        "errors": [],
        "warnings": [],
    }

    def emit(code: int) -> int:
        if args.json:
            print(json.dumps(doc, indent=2))
        return code

    try:
        cfg = load_config(args.config)
    except ConfigInvalid as e:
        doc["errors"] = _error_docs(e)
        if not args.json:
            n = len(e.errors)
            print(f"{args.config}: {n} error{'s' if n != 1 else ''}:", file=sys.stderr)
            for err in e.errors:
                print("  " + err.format(e.filename), file=sys.stderr)
        # The rules file is checked too, so one run shows every error in both files.
        named = _named_rules_file(args.config)
        if named is not None:
            from vllm_guardian.core.alert_rules import parse_rules  # noqa: PLC0415

            try:
                parse_rules(read_text(named), named)
            except ConfigInvalid as e:
                doc["errors"] += _error_docs(e)
                if not args.json:
                    _print_rules_errors(e)
        return emit(EXIT_CONFIG)
    from vllm_guardian.actuators.alerts import load_rules  # noqa: PLC0415

    try:
        rules = load_rules(cfg.alerting)
    except ConfigInvalid as e:
        doc["errors"] = _error_docs(e)
        if not args.json:
            _print_rules_errors(e)
        return emit(EXIT_CONFIG)
    doc["warnings"] = missing_files(cfg)
    # URLs are shown redacted: user:password, ?token=, a webhook whose path is its secret.
    sinks = ["log"] + [f"webhook {redact_text(u)}" for u in cfg.alerting.webhooks]
    if cfg.alerting.alertmanager_url:
        sinks.append(f"alertmanager {redact_text(cfg.alerting.alertmanager_url)}")
    doc.update(
        ok=True,
        listen=cfg.listen,
        alert_rules=len(rules),
        dry_run=cfg.policy.dry_run,
        alert_sinks=sinks,
        services=[
            {
                "name": s.name,
                "url": redact_text(s.url),
                "gate_listen": s.gate.listen if s.gate is not None else None,
            }
            for s in cfg.services
        ],
    )
    if args.json:
        return emit(EXIT_OK)
    for warning in doc["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    names = ", ".join(s.name for s in cfg.services)
    mode = "dry-run (decides, does not act)" if cfg.policy.dry_run else "armed"
    print(
        f"{args.config}: OK ({len(cfg.services)} service(s): {names}; listen {cfg.listen}; "
        f"{len(rules)} alert rules; policy {mode})"
    )
    for svc in doc["services"]:
        if svc["gate_listen"] is not None:
            print(
                f"  gate for {svc['name']}: clients on {svc['gate_listen']} -> {svc['url']} "
                f"(vllm-guardian-gate@{svc['name']}.service)"
            )
        else:
            print(f"  {svc['name']}: no gate: section, clients reach {svc['url']} directly")
    print(f"  alert sinks: {', '.join(sinks)}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    cfg = _load(args.config)
    if cfg is None:
        return EXIT_CONFIG
    from vllm_guardian.shell.daemon import Guardian  # noqa: PLC0415  # keeps check-config light
    from vllm_guardian.shell.instancelock import AlreadyRunning, acquire  # noqa: PLC0415

    # Before anything is read, started or unlinked: a second guardian on these directories
    # would take over the first one's control socket, vLLM and pid files.
    try:
        held = acquire(Path(cfg.state_dir), Path(cfg.runtime_dir))
    except AlreadyRunning as e:
        logging.getLogger("vllm_guardian").error("cannot start: %s", e)
        return EXIT_FAIL
    try:
        guardian = Guardian(cfg, config_path=args.config)
        try:
            return guardian.run()
        except OSError as e:
            logging.getLogger("vllm_guardian").error("cannot start: %s", e)
            return EXIT_FAIL
    finally:
        held.release()


def _socket_path(args: argparse.Namespace) -> Path:
    return socket_path(args.config, args.socket)


def socket_path(config: str, explicit: str | None) -> Path:
    """The control socket: ``--socket``, else the config's ``runtime_dir``, else the default."""
    if explicit:
        return Path(explicit)
    if Path(config).exists():
        cfg = _load(config)
        if cfg is not None:
            return Path(cfg.runtime_dir) / "control.sock"
    return Path("/run/vllm-guardian/control.sock")


def _fmt_bytes(v: Any) -> str:
    return "?" if v is None else f"{v / 1024**3:.1f} GiB"


def _fmt(v: Any, pattern: str = "{:.0f}") -> str:
    return "?" if v is None else pattern.format(v)


def _capacity_line(data: Any) -> str:
    """The over-capacity estimate as one line (core/capacity.py), from its JSON form."""
    from vllm_guardian.core.capacity import CapacityEstimate  # noqa: PLC0415
    from vllm_guardian.formats.recorder import from_jsonable  # noqa: PLC0415

    try:
        est: CapacityEstimate = from_jsonable(CapacityEstimate, data)
    except (KeyError, TypeError, ValueError):
        return "capacity: unreadable estimate in the status reply"
    return est.line()


def _budget_window(st: dict[str, Any]) -> tuple[float, str]:
    """The restart budget's window (policy.restart_budget_window_seconds), in seconds and as
    words; a guardian from before its status said the window: the default, said to be it."""
    said = st.get("restart_budget_window_seconds")
    default = said is None
    w = PolicyConfig().restart_budget_window_seconds if said is None else float(said)
    if w % 3600 == 0:
        words = f"{w / 3600:.0f} h"
    elif w % 60 == 0:
        words = f"{w / 60:.0f} min"
    else:
        words = f"{w:g} s"
    return w, words + (" (the default window)" if default else "")


def render_status(st: dict[str, Any]) -> str:
    lines = [f"vllm-guardian {st.get('version', '?')}"]
    if not st.get("signals"):
        lines.append("no tick completed yet")
        return "\n".join(lines)
    for svc in st["signals"]["services"]:
        lines.append(f"service {svc['service']}: health={svc.get('health_state') or '?'}")
        kv = svc.get("kv_cache_usage_ratio")
        lines.append(
            f"  KV {('?' if kv is None else f'{100 * kv:.0f}%')}  running {_fmt(svc.get('requests_running'))}"
            f"  waiting {_fmt(svc.get('requests_waiting'))}"
            f"  preemptions/s {_fmt(svc.get('preemptions_per_second'), '{:.2f}')}"
            f"  tokens/s {_fmt(svc.get('generation_tokens_per_second'), '{:.1f}')}"
        )
        by_device = " (by device: NVML's host pids are not visible here)"
        lines.append(
            f"  GPU memory{by_device if svc.get('gpu_memory_by_device') else ''}:"
            f" service {_fmt_bytes(svc.get('service_memory_bytes'))}"
            f"  budget {_fmt_bytes(svc.get('memory_budget_bytes'))}"
            f"  others {_fmt_bytes(svc.get('other_processes_memory_bytes'))}"
            f"  free {_fmt_bytes(svc.get('headroom_bytes'))}"
        )
        if svc.get("capacity"):
            lines.append("  " + _capacity_line(svc["capacity"]))
        if svc.get("stalled"):
            lines.append(
                f"  STALLED: requests in the engine, no progress for {svc['stall_seconds']:.0f}s"
            )
    for gpu in st.get("gpus") or []:
        lines.append(
            f"gpu {gpu['index']} {gpu.get('name') or ''}: used {_fmt_bytes(gpu.get('memory_used_bytes'))}"
            f" of {_fmt_bytes(gpu.get('memory_total_bytes'))}"
            + (f"  ERROR {gpu['error']}" if gpu.get("error") else "")
        )
    for svc in (st.get("policy") or {}).get("services", []):
        name = svc["service"]
        gate = (st.get("gates") or {}).get(name) or {}
        levels = svc.get("levels") or {}
        rungs = (
            ", ".join(f"{lv} rung {r}" for lv, r in levels.get("rungs", [])) or "operator baseline"
        )
        budget = st.get("restart_budget")
        now = st.get("time") or 0
        window, window_said = _budget_window(st)
        used = len([t for t in svc.get("restarts", []) if now - t < window])
        state = (
            "PAUSED"
            if svc.get("paused")
            else (
                "BREAKER LATCHED: " + str(svc.get("breaker_reason"))
                if svc.get("breaker_latched")
                else "acting"
            )
        )
        lines.append(f"policy {name}: {state}{' (dry-run)' if st.get('dry_run') else ''}")
        action = svc.get("action")
        if action:
            lines.append(
                f"  action {action['action_id']} ({action['kind']}) in {action['phase']} for "
                f"{now - action['phase_since']:.0f}s, deadline in {action['deadline'] - now:.0f}s"
                + (f", asked by {action['operator']}" if action.get("operator") else "")
            )
        lines.append(
            f"  /ready: {'200' if gate.get('ready', True) else '503'} ({gate.get('reason', '?')})  flags: {rungs}"
        )
        lines.append(
            f"  restarts in the last {window_said}: {used} of {budget}"
            + (
                f"  cooldown {cooldown - now:.0f}s"
                if (cooldown := (svc.get("hold_off") or {}).get("cooldown_until", 0)) > now
                else ""
            )
        )
    recent = st.get("recent_decisions") or []
    if recent:
        lines.append("last decisions:")
    for d in recent[-5:]:
        t = time.strftime("%H:%M:%S", time.localtime(d["time_seconds"]))
        lines.append(
            f"  {t} {d['service']} {d['what']}: {d['reason']}{' (dry-run)' if d.get('dry_run') else ''}"
        )
    for a in st.get("alerts") or []:
        lines.append(
            f"alert {a['name']} [{a['service']}] {a['state']}{' (stale)' if a.get('stale') else ''}"
            + (f" (inhibited by {a['inhibited_by']})" if a.get("inhibited_by") else "")
            + f": {a.get('summary', '')}"
        )
    down = [s for s in st.get("sources", []) if not s["up"]]
    for s in down:
        where = s["source"] + (f" [{s['service']}]" if s.get("service") else "")
        hint = f" — {s['hint']}" if s.get("hint") else ""
        lines.append(f"source {where} DOWN: {s.get('error')}{hint}")
    if not down:
        lines.append("all sources up")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from vllm_guardian.lowio.control import ControlError, request  # noqa: PLC0415

    if args.watch:
        from vllm_guardian.tools.status_watch import watch  # noqa: PLC0415

        path = _socket_path(args)
        return watch(
            lambda: request(path, {"cmd": "status"}), render_status, sys.stdout,
            args.interval, (ControlError,), refreshes=args.count,
        )  # fmt: skip
    try:
        st = request(_socket_path(args), {"cmd": "status"})
    except ControlError as e:
        print(f"vllm-guardian status: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(json.dumps(st, indent=2) if args.json else render_status(st))
    return EXIT_OK


def cmd_control(args: argparse.Namespace) -> int:
    """pause | resume [SERVICE]: maintenance without the guardian acting, and the one way to
    clear a latched breaker."""
    from vllm_guardian.lowio.control import ControlError, request  # noqa: PLC0415

    try:
        reply = request(_socket_path(args), {"cmd": args.command, "service": args.service})
    except ControlError as e:
        reply = {"ok": False, "error": str(e)}
    changed = reply.get("changed") or []
    if args.json:  # the fields of docs/cli.md, whatever the guardian's reply holds besides
        doc = {
            "command": args.command,
            "service": args.service,
            "ok": bool(reply.get("ok")),
            "changed": list(changed) if reply.get("ok") else [],
            "error": None if reply.get("ok") else str(reply.get("error")),
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK if reply.get("ok") else EXIT_FAIL
    if not reply.get("ok"):
        print(f"vllm-guardian {args.command}: {reply.get('error')}", file=sys.stderr)
        return EXIT_FAIL
    what = {"pause": "paused (observing and alerting only)", "resume": "acting again"}[args.command]
    print(
        f"{', '.join(changed)}: {what}"
        if changed
        else f"nothing to change: already {args.command}d"
    )
    return EXIT_OK


def cmd_sim(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from vllm_guardian.sim.cli import main as sim_main  # noqa: PLC0415  # the twin, on demand

    return sim_main(list(rest), prog="vllm-guardian sim")


PAUSE_TEXT = {
    "pause": "Maintenance: the guardian keeps observing, exporting and alerting, starts no new "
    "action and holds the gate open; an action under way runs to its end. Saved in the policy "
    "state, so it lasts across guardian restarts until resume.",
    "resume": "Act again after pause, and clear a latched circuit breaker: the one way to say "
    "'go on' after the guardian stopped itself.",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-guardian",
        description="Keeps vLLM inference servers alive.",
        epilog="Each command has its own help: vllm-guardian COMMAND --help.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "-c",
            "--config",
            default=DEFAULT_CONFIG_PATH,
            help=f"config file (default {DEFAULT_CONFIG_PATH})",
        )

    r = sub.add_parser(
        "run",
        help="run the daemon",
        description="Run the guardian: watch every service of the config each tick, export "
        "/metrics, fire alerts and heal (what systemd's vllm-guardian.service runs).",
    )
    with_config(r)
    r.add_argument("-v", "--verbose", action="store_true")
    c = sub.add_parser(
        "check-config",
        help="validate a config file and report every error",
        description="Validate a config (and its rules_file) and report every error at once as "
        "file:line: key.path: why. Exit 0 valid, 2 invalid.",
    )
    with_config(c)
    c.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object (ok, errors, warnings, services; docs/cli.md)",
    )
    s = sub.add_parser(
        "status",
        help="show what the running daemon sees",
        description="What the running guardian sees and is doing, per service, read over its "
        "control socket.",
    )
    with_config(s)
    s.add_argument("--socket", help="control socket path (default: <runtime_dir>/control.sock)")
    s.add_argument("--json", action="store_true", help="print the raw status as JSON")
    s.add_argument(
        "--watch",
        action="store_true",
        help="refresh until Ctrl-C (exit 130): the screen repainted in a terminal, each refresh "
        "printed into a pipe; a guardian that does not answer is shown as such and asked again",
    )
    s.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    s.add_argument(
        "--count", type=int, help="with --watch: stop after this many refreshes (default: never)"
    )
    for name, text in (
        ("pause", "stop acting (maintenance): observe and alert only"),
        ("resume", "act again, and clear a latched circuit breaker"),
    ):
        cp = sub.add_parser(name, help=text, description=PAUSE_TEXT[name])
        with_config(cp)
        cp.add_argument("service", nargs="?", help="one service (default: all)")
        cp.add_argument(
            "--socket", help="control socket path (default: <runtime_dir>/control.sock)"
        )
        cp.add_argument(
            "--json",
            action="store_true",
            help="print the result as one JSON object (ok, changed, error; docs/cli.md)",
        )
    sub.add_parser(
        "restart",
        help="drain and restart a service through the front door",
        add_help=False,
    )
    sub.add_parser(
        "relaunch",
        help="apply whitelisted flags without dropping a request",
        add_help=False,
    )
    sub.add_parser(
        "replay", help="a flight recording through a config's rules and policy", add_help=False
    )
    sub.add_parser("sim", help="the vLLM twin", add_help=False)
    sub.add_parser(
        "demo",
        help="the guardian against the built-in vLLM twin",
        add_help=False,
    )
    sub.add_parser(
        "loadtest",
        help="a synthetic peak, watched and stopped before harm",
        add_help=False,
    )
    sub.add_parser(
        "gate",
        help="the admission gate in front of one vLLM (unit vllm-guardian-gate@NAME)",
        add_help=False,
    )
    sub.add_parser(
        "diagnose",
        help="one-command incident report, live or from a bundle",
        add_help=False,
    )
    sub.add_parser(
        "plan",
        help="the KV budget of a deployment before it exists",
        add_help=False,
    )
    sub.add_parser(
        "install",
        help="write the systemd units, the vLLM drop-in, the polkit rule and the user",
        add_help=False,
    )
    sub.add_parser(
        "uninstall",
        help="remove what install wrote (the config and the state stay)",
        add_help=False,
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        return cmd_sim(argparse.Namespace(), argv[1:])
    if argv and argv[0] in ("restart", "relaunch"):
        from vllm_guardian.tools.operator import main as operator_main  # noqa: PLC0415

        return operator_main(argv, socket_path)
    if argv and argv[0] == "replay":
        from vllm_guardian.tools.replay import main as replay_main  # noqa: PLC0415

        return replay_main(argv[1:])
    if argv and argv[0] == "demo":
        from vllm_guardian.tools.demo import main as demo_main  # noqa: PLC0415

        return demo_main(argv[1:])
    if argv and argv[0] == "loadtest":
        from vllm_guardian.loadtest.cli import main as loadtest_main  # noqa: PLC0415

        return loadtest_main(argv[1:])
    if argv and argv[0] == "gate":
        from vllm_guardian.gate.cli import main as gate_main  # noqa: PLC0415

        return gate_main(argv[1:])
    if argv and argv[0] in ("diagnose", "plan"):
        from vllm_guardian.diagnose.cli import main as diagnose_main  # noqa: PLC0415

        return diagnose_main(argv)
    if argv and argv[0] in ("install", "uninstall"):
        from vllm_guardian.tools.install import main as install_main  # noqa: PLC0415

        return install_main(argv)
    args = build_parser().parse_args(argv)
    handlers = {
        "run": cmd_run,
        "check-config": cmd_check_config,
        "status": cmd_status,
        "pause": cmd_control,
        "resume": cmd_control,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
