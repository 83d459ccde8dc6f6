"""``vllm-guardian install | uninstall``: put the guardian's systemd files in place, or take them out.

What ``install [--unit vllm.service] [--dry-run] [--prefix /]`` writes (paths under ``--prefix``):

===========================================================  ==========================================
``/etc/systemd/system/vllm-guardian.service``                the guardian, hardened, ``Type=notify``
``/etc/systemd/system/vllm-guardian-gate@.service``          the admission gate, one instance per service
``/etc/systemd/system/vllm-guardian-gate@<svc>.service.d/``  the gate of <svc> starts after its vLLM unit
``/etc/systemd/system/<unit>.d/vllm-guardian.conf``          drop-in for the operator's vLLM unit
``/etc/polkit-1/rules.d/50-vllm-guardian.rules``             the guardian may restart only those units
``/etc/sysusers.d/vllm-guardian.conf``                       the guardian's system user
``/etc/vllm-guardian/config.yaml``                           a minimal config (each service gated), only if none exists
===========================================================  ==========================================

then creates the user (``systemd-sysusers``; in an offline root ``--root=PREFIX``, or, without
systemd-sysusers, left to the root's first boot), runs ``systemctl daemon-reload`` (only when the
prefix is ``/``: an offline root has no manager to reload), warns when the units could not run
this venv (under ``/home`` or ``/tmp``, which their sandbox hides) and prints the one command left,
which enables the guardian and the gate of every service with a ``gate:`` section in the config
(the one written, or the one already there).
``--dry-run`` prints every file and command instead. ``uninstall`` removes the same files
(never the config or the state in ``/var/lib/vllm-guardian``) and reloads.

The templates live here, so a pip-installed guardian can install itself; the files under the
repository's ``systemd/`` are these templates rendered for ``vllm.service`` and are tested to
be equal to them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from vllm_guardian.config import ConfigInvalid, parse_config

USER = "vllm-guardian"
GUARDIAN_UNIT = "vllm-guardian.service"
GATE_TEMPLATE = "vllm-guardian-gate@.service"
DEFAULT_EXEC = "/opt/vllm-guardian/bin/vllm-guardian"
DEFAULT_UNIT = "vllm.service"
SYSUSERS_PATH = "/etc/sysusers.d/vllm-guardian.conf"
CONFIG_PATH = "/etc/vllm-guardian/config.yaml"
STATE_DIR = "/var/lib/vllm-guardian"
# systemd's own unit-name alphabet; nothing else reaches a file we write or a polkit rule.
# Not starting with '-': systemctl would read such a name as an option.
_UNIT = re.compile(r"^[A-Za-z0-9:_.\\][A-Za-z0-9:_.\\-]*(@[A-Za-z0-9:_.\\-]*)?\.service$")

# The sandbox both units share (the kernel, namespaces, system calls, address families) and
# their [Install] section; each unit sets its own file-system and device access above it.
_SANDBOX_AND_INSTALL = """\
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM
# AF_NETLINK: glibc's getaddrinfo(AI_ADDRCONFIG) asks the kernel which addresses exist.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK

[Install]
WantedBy=multi-user.target
"""


GUARDIAN_SERVICE = (
    """\
# vllm-guardian: watches the vLLM services on this host and heals memory pressure.
# Installed by `vllm-guardian install`; local changes belong in
# /etc/systemd/system/vllm-guardian.service.d/*.conf (systemctl edit vllm-guardian).
[Unit]
Description=vLLM Guardian (observes vLLM, GPUs and units; heals memory pressure)
Documentation=https://github.com/vllm-guardian/vllm-guardian/blob/main/docs/runbook.md
After=network-online.target {units}
Wants=network-online.target
# The guardian keeps vLLM alive; if it crash-loops, stop and let a person look.
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
# READY=1 after the first full tick, WATCHDOG=1 every tick, a STATUS= line, STOPPING=1.
Type=notify
NotifyAccess=main
# Ticks every 2 s (interval_seconds); 30 s without one means a wedged daemon. A tick that
# could not save the policy state or write its decisions sends no ping either.
WatchdogSec=30s
# systemd's default soft limit is 1,024 descriptors. Each listener caps its own connections
# (/metrics 64, the control socket 16), so this is headroom, not a target.
LimitNOFILE=65536
# Ten times the default weight: a host whose CPUs vLLM (or a neighbour) saturates otherwise
# kept the guardian off them for many seconds. It uses a few percent of a core, so this buys
# promptness, not vLLM's CPU.
CPUWeight=1000
ExecStart={exec} run -c {config}
# SIGHUP reloads the config; a bad new config is refused and the old one keeps running.
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=5s
TimeoutStartSec=60s
TimeoutStopSec=30s

User={user}
Group={user}
# Read the vLLM unit's journal (also granted by sysusers.d; explicit for hand-made users).
SupplementaryGroups=systemd-journal
# /run/vllm-guardian (control socket), /var/lib/vllm-guardian (state, flight record, the
# <service>.env flags files the vLLM units read), /etc/vllm-guardian (config, read-only).
RuntimeDirectory=vllm-guardian
RuntimeDirectoryMode=0750
StateDirectory=vllm-guardian
StateDirectoryMode=0750
ConfigurationDirectory=vllm-guardian
ConfigurationDirectoryMode=0755
UMask=0027

# Hardening. What the guardian still needs: NVML (/dev/nvidiactl, /dev/nvidia<N>), the system
# bus (systemctl show/restart, allowed by the polkit rule), journalctl, /proc/<pid>/cmdline of
# the vLLM processes (other users' cmdlines are readable without ProtectProc=invisible), and
# loopback/LAN HTTP to vLLM, Alertmanager and webhooks.
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=no
DevicePolicy=closed
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-caps r
"""
    + _SANDBOX_AND_INSTALL
)

GATE_SERVICE = (
    """\
# vllm-guardian's admission gate for one service: %i is the service's name in the guardian's
# config, whose gate: section holds the settings (listen address, queue, KV admission, rates).
# Installed by `vllm-guardian install`; one instance per gated service:
#   systemctl enable --now vllm-guardian-gate@<service>.service
# Clients order themselves After=vllm-guardian-gate@<service>.service: READY=1 is sent once the
# gate listens. Local changes: systemctl edit vllm-guardian-gate@<service>.
[Unit]
Description=vLLM Guardian admission gate for %i (holds requests across restarts and pressure)
Documentation=https://github.com/vllm-guardian/vllm-guardian/blob/main/docs/gate.md
# The guardian's drop-in per instance (vllm-guardian-gate@<service>.service.d) adds After= the
# vLLM unit. Neither is required: the gate holds requests while vLLM or the guardian is away.
After=network-online.target {guardian}
Wants=network-online.target
StartLimitIntervalSec=60
StartLimitBurst=20

[Service]
# READY=1 once it listens, WATCHDOG=1 from its event loop, a STATUS= line, STOPPING=1.
Type=notify
NotifyAccess=main
# The gate's loop beats every few seconds; 10 s without a beat means a wedged loop: restart.
WatchdogSec=10s
# The number of worker processes is the gate: section's `workers` (1 by default; 0: one per CPU
# this unit may use, at most 4; CPUAffinity=, AllowedCPUs= and CPUQuota= count). With more than one, the main
# process is their parent: it alone talks to systemd (NotifyAccess=main), and SIGHUP to it
# (systemctl kill -s HUP --kill-whom=main) replaces the workers one at a time.
ExecStart={exec} gate -c {config} --service %i
# SIGTERM to the parent alone: it stops its workers, each draining; SIGKILL to all at the end.
KillMode=mixed
# Clients reconnect to a restarted gate; a gate that is not running refuses them all.
Restart=always
RestartSec=1s
TimeoutStartSec=30s
# SIGTERM: queued requests get 503 at once, in-flight ones the gate's shutdown_timeout_seconds.
TimeoutStopSec=15s
# Two descriptors per request in flight (client and vLLM), and requests held by the hundred.
LimitNOFILE=65536
# Ten times the default weight: on a host whose CPUs vLLM saturated, every other process was
# kept off them for up to 50 s at a time, and a starved gate answers nothing (nor pings the
# watchdog). It uses a few percent of a core: this buys promptness, not vLLM's CPU.
CPUWeight=1000

User={user}
Group={user}
UMask=0077

# Hardening. The gate needs only to read the config and to speak TCP to clients, vLLM and the
# guardian (loopback or LAN): no devices, no bus, no journal, no other process.
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
DevicePolicy=closed
PrivateUsers=yes
ProtectProc=invisible
ProcSubset=pid
"""
    + _SANDBOX_AND_INSTALL
)

GATE_DROPIN = """\
# Installed by `vllm-guardian install` for the gate of service {service}; removed by uninstall.
[Unit]
# Started after vLLM's unit (the gate holds requests while vLLM loads its model).
After={unit}
"""

VLLM_DROPIN = """\
# Installed by `vllm-guardian install` for {unit}; removed by `vllm-guardian uninstall`.
[Unit]
# Stop restarting only after this many tries in the window; the guardian has its own budget.
StartLimitIntervalSec=600
StartLimitBurst=10

[Service]
# The flags the guardian chose (VLLM_GUARDIAN_ARGS=...), appended to ExecStart as
# $VLLM_GUARDIAN_ARGS: argparse keeps the last occurrence, so they override the base flags.
# "-": no file (nothing chosen yet) is fine, the variable is then empty.
EnvironmentFile=-{state}/{service}.env
# SIGTERM to the API server only: vLLM drains (--shutdown-timeout) and stops its own workers,
# which treat a SIGTERM of their own as fatal. The rest of the cgroup is killed after the timeout.
KillMode=mixed
# Above the drain: the guardian's policy.drain_timeout_seconds (120 s) when vLLM drains itself
# (--shutdown-timeout), plus worker teardown and releasing VRAM.
TimeoutStopSec=180s
# Model load and CUDA-graph capture take minutes on large models.
TimeoutStartSec=20min
# vLLM can exit 0 after its engine dies, so on-failure is not enough.
Restart=always
RestartSec=10s
# The guardian's allocator plugin (loaded by vLLM when vllm-guardian is installed in vLLM's
# Python environment; with VLLM_PLUGINS set, add vllm_guardian to it) writes torch's
# allocator stats here. A runtime directory of this unit: vLLM's user can write it, it is
# emptied when vLLM stops, and its default mode 0755 lets the guardian read it.
RuntimeDirectory=vllm-guardian-allocator/{service}
Environment=VLLM_GUARDIAN_ALLOCATOR_DIR=/run/vllm-guardian-allocator/{service}
"""

VLLM_EXAMPLE = """\
# Example vLLM unit for use with vllm-guardian. Adapt ExecStart's base flags; keep
# $VLLM_GUARDIAN_ARGS last so the guardian's flags win. The guardian's drop-in
# (vllm.service.d/vllm-guardian.conf) adds EnvironmentFile=, KillMode=, timeouts and Restart=.
[Unit]
Description=vLLM OpenAI-compatible server
After=network-online.target nvidia-persistenced.service
Wants=network-online.target

[Service]
Type=exec
User=vllm
Group=vllm
SupplementaryGroups=video
Environment=HF_HOME=/var/lib/vllm/hf
Environment=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
StateDirectory=vllm
ExecStart=/opt/vllm/bin/vllm serve meta-llama/Meta-Llama-3-8B-Instruct \\
    --host 127.0.0.1 --port 8000 \\
    --gpu-memory-utilization 0.90 --max-model-len 8192 \\
    --shutdown-timeout 60 \\
    $VLLM_GUARDIAN_ARGS

[Install]
WantedBy=multi-user.target
"""

POLKIT_RULE = """\
// Installed by `vllm-guardian install`: the guardian's user may start, stop and restart the
// named vLLM units through systemd, and nothing else (no other unit, no enable/disable, no
// daemon-reload, no other polkit action).
polkit.addRule(function(action, subject) {{
    if (action.id != "org.freedesktop.systemd1.manage-units" || subject.user != "{user}") {{
        return polkit.Result.NOT_HANDLED;
    }}
    var units = [{units}];
    var verbs = ["start", "stop", "restart", "try-restart"];
    if (units.indexOf(action.lookup("unit")) >= 0 && verbs.indexOf(action.lookup("verb")) >= 0) {{
        return polkit.Result.YES;
    }}
    return polkit.Result.NOT_HANDLED;
}});
"""

SYSUSERS = """\
# The guardian's system user (systemd-sysusers); in systemd-journal to read vLLM's journal.
u {user} - "vLLM Guardian" {state} /usr/sbin/nologin
m {user} systemd-journal
"""

CONFIG = """\
# Written by `vllm-guardian install`; every key and its default: examples/config.yaml.
# Check with: vllm-guardian check-config -c {config}
# Clients send their requests to each service's gate (gate.listen; 0.0.0.0:PORT to serve other
# hosts), which holds them while vLLM restarts or is under pressure, not to vLLM's own port.
interval_seconds: 2
listen: 127.0.0.1:9469
services:
{services}"""


@dataclass(frozen=True)
class File:
    """One file the installer owns: where it goes (without prefix), its text, its mode."""

    path: str
    text: str
    mode: int = 0o644


def service_name(unit: str) -> str:
    """The guardian's service name for a unit: ``vllm.service`` → ``vllm``, ``vllm@a.service`` → ``vllm-a``."""
    stem = unit.removesuffix(".service").replace("@", "-")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", stem).strip("-.") or "vllm"


def gate_unit(service: str) -> str:
    """The gate's unit for a service: an instance of the template."""
    return GATE_TEMPLATE.replace("@", f"@{service}")


def render(
    units: Sequence[str],
    exec_path: str = DEFAULT_EXEC,
    gated: Sequence[tuple[str, str | None]] = (),
) -> list[File]:
    """Every file ``install`` writes for these vLLM units (the config is handled apart).
    ``gated``: (service, its vLLM unit or None) for each service with a ``gate:`` section."""
    files = [
        File(
            f"/etc/systemd/system/{GUARDIAN_UNIT}",
            GUARDIAN_SERVICE.format(
                units=" ".join(units), exec=exec_path, config=CONFIG_PATH, user=USER
            ),
        ),
        File(
            f"/etc/systemd/system/{GATE_TEMPLATE}",
            GATE_SERVICE.format(
                guardian=GUARDIAN_UNIT, exec=exec_path, config=CONFIG_PATH, user=USER
            ),
        ),
        File(
            "/etc/polkit-1/rules.d/50-vllm-guardian.rules",
            # JSON string literals are JavaScript ones: a backslash in a systemd-escaped name
            # (vllm\x2da.service) stays a backslash, a quote could never end the string.
            POLKIT_RULE.format(user=USER, units=", ".join(json.dumps(u) for u in units)),
        ),
        File(SYSUSERS_PATH, SYSUSERS.format(user=USER, state=STATE_DIR)),
    ]
    files += [
        File(
            f"/etc/systemd/system/{u}.d/vllm-guardian.conf",
            VLLM_DROPIN.format(unit=u, state=STATE_DIR, service=service_name(u)),
        )
        for u in units
    ]
    files += [
        File(
            f"/etc/systemd/system/{gate_unit(svc)}.d/vllm-guardian.conf",
            GATE_DROPIN.format(service=svc, unit=unit),
        )
        for svc, unit in gated
        if unit is not None
    ]
    return files


def gate_port(units: Sequence[str], index: int) -> int:
    """The written config's gate ports: right after the vLLM ports (vLLM :8000, gate :8001)."""
    return 8000 + len(units) + index


def render_config(units: Sequence[str]) -> str:
    services = "".join(
        f"  - name: {service_name(u)}\n    url: http://127.0.0.1:{8000 + i}\n    unit: {u}\n"
        f"    gate:\n      listen: 127.0.0.1:{gate_port(units, i)}\n"
        for i, u in enumerate(units)
    )
    return CONFIG.format(config=CONFIG_PATH, services=services)


def gated_services(
    config_text: str, filename: str
) -> tuple[list[tuple[str, str | None, str]], str | None]:
    """(service, vLLM unit, gate listen) for each service with a ``gate:`` section, and a
    warning when the config cannot be read (then no gate is set up)."""
    try:
        cfg = parse_config(config_text, filename)
    except ConfigInvalid as e:
        return [], f"{filename} is invalid, so no gate is set up from it:\n{e}"
    return [(s.name, s.unit, s.gate.listen) for s in cfg.services if s.gate is not None], None


def _under(prefix: Path, path: str) -> Path:
    return prefix / path.lstrip("/")


def _live(prefix: Path) -> bool:
    """Whether the prefix is the running system (then systemd is told about the change)."""
    return prefix.resolve() == Path("/")


def _exec_path() -> str:
    """The vllm-guardian executable beside this Python (a venv's bin/), else the default."""
    candidate = Path(sys.executable).with_name("vllm-guardian")
    return str(candidate) if candidate.is_file() else DEFAULT_EXEC


# What the units' sandbox hides from the service (ProtectHome=yes, PrivateTmp=yes in both).
_HIDDEN_DIRS = (
    ("/home", "ProtectHome=yes"),
    ("/root", "ProtectHome=yes"),
    ("/run/user", "ProtectHome=yes"),
    ("/tmp", "PrivateTmp=yes"),  # noqa: S108 (a path compared, not a file made)
    ("/var/tmp", "PrivateTmp=yes"),  # noqa: S108
)


def sandbox_warning(executable: str) -> str | None:
    """Why the units cannot run ``executable`` (a venv under /home or /tmp), or None."""
    path = PurePath(executable)
    for directory, setting in _HIDDEN_DIRS:
        if path.is_relative_to(directory):
            return (
                f"{executable} is under {directory}, which the units' {setting} hides from "
                "them: vllm-guardian.service would fail to start. Install into a venv outside "
                "it (python3 -m venv /opt/vllm-guardian) and run install from there"
            )
    return None


def _run(cmd: list[str], dry_run: bool) -> bool:
    print("+ " + " ".join(cmd))
    if dry_run:
        return True
    exe = shutil.which(cmd[0])
    if exe is None:
        print(f"vllm-guardian install: {cmd[0]} not found on PATH", file=sys.stderr)
        return False
    try:
        done = subprocess.run(
            [exe, *cmd[1:]], check=False, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"vllm-guardian install: {cmd[0]} failed: {e}", file=sys.stderr)
        return False
    if done.returncode != 0:
        err = (done.stderr or done.stdout).strip()
        print(f"vllm-guardian install: {cmd[0]} exited {done.returncode}: {err}", file=sys.stderr)
        return False
    return True


def _unit_warnings(prefix: Path, unit: str) -> list[str]:
    """Look for the operator's vLLM unit and check that it appends $VLLM_GUARDIAN_ARGS."""
    for d in ("etc/systemd/system", "usr/local/lib/systemd/system", "lib/systemd/system"):
        path = prefix / d / unit
        if path.is_file():
            text = path.read_text(errors="replace")
            if "$VLLM_GUARDIAN_ARGS" not in text and "${VLLM_GUARDIAN_ARGS}" not in text:
                return [
                    f"{path}: ExecStart does not end with $VLLM_GUARDIAN_ARGS, so the guardian's "
                    "flags will not reach vLLM (see systemd/vllm.service in the repository)"
                ]
            return []
    return [f"{unit} not found under {prefix}: install it (example: systemd/vllm.service)"]


def _gates(prefix: Path, units: Sequence[str]) -> tuple[list[tuple[str, str | None, str]], bool]:
    """The gated services from the config (written now or already there), and whether it exists."""
    config = _under(prefix, CONFIG_PATH)
    if not config.exists():
        return gated_services(render_config(units), CONFIG_PATH)[0], False
    try:
        text = config.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"warning: cannot read {config} ({e}); no gate is set up", file=sys.stderr)
        return [], True
    gates, warning = gated_services(text, str(config))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return gates, True


def install(units: list[str], prefix: Path, dry_run: bool) -> int:
    live = _live(prefix)
    gates, keep_config = _gates(prefix, units)
    exec_path = _exec_path() if live else DEFAULT_EXEC
    files = render(units, exec_path, [(svc, unit) for svc, unit, _ in gates])
    config = _under(prefix, CONFIG_PATH)
    if not keep_config:
        files.append(File(CONFIG_PATH, render_config(units), 0o644))
    for f in files:
        dest = _under(prefix, f.path)
        if dry_run:
            print(f"--- {dest} (mode {f.mode:04o})\n{f.text}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.write_text(f.text)
        tmp.chmod(f.mode)
        tmp.replace(dest)
        print(f"wrote {dest}")
    if keep_config:
        print(f"kept {config} (already there)")
    ok = True
    if live:
        ok &= _run(["systemd-sysusers", SYSUSERS_PATH], dry_run)
    elif dry_run or shutil.which("systemd-sysusers") is not None:
        # The file's name, not its path: systemd-sysusers 252 opens an absolute path on the
        # host even under --root (and newer ones under the root); a bare name is looked up in
        # the root's sysusers.d by both.
        ok &= _run(["systemd-sysusers", f"--root={prefix}", PurePath(SYSUSERS_PATH).name], dry_run)
    else:
        # An image built without systemd: its systemd-sysusers.service makes the user at boot.
        print(
            f"systemd-sysusers not found: the user {USER} is created from "
            f"{_under(prefix, SYSUSERS_PATH)} when that root first boots"
        )
    if live:
        ok &= _run(["systemctl", "daemon-reload"], dry_run)
    else:
        print(f"not reloading systemd: {prefix} is not the running system")
    for u in units:
        for w in _unit_warnings(prefix, u):
            print(f"warning: {w}", file=sys.stderr)
    sandboxed = sandbox_warning(exec_path)
    if sandboxed is not None:
        print(f"warning: {sandboxed}", file=sys.stderr)
    if not ok:
        return 1
    enable = " ".join([GUARDIAN_UNIT, *(gate_unit(svc) for svc, _, _ in gates)])
    what = "the guardian and its gates" if gates else "the guardian"
    lines = [
        f"\nOne command left (starts {what} now and at boot):",
        f"  systemctl enable --now {enable}",
        f"The drop-in applies to {', '.join(units)} from its next restart.",
    ]
    lines += [
        f"Clients of {svc}: send requests to its gate at {listen}." for svc, _, listen in gates
    ]
    if not gates:
        lines.append(
            "No service has a gate: section, so requests reach vLLM directly and fail while it "
            "restarts; add one (docs/gate.md) and run install again."
        )
    print("\n".join(lines))
    return 0


def uninstall(units: list[str], prefix: Path, dry_run: bool) -> int:
    live = _live(prefix)
    ok = True
    systemd_dir = _under(prefix, "/etc/systemd/system")
    # Every gate instance with our drop-in, and those the config names.
    gates = {
        p.parent.name.removesuffix(".d")
        for p in systemd_dir.glob("vllm-guardian-gate@*.service.d/vllm-guardian.conf")
    }
    config = _under(prefix, CONFIG_PATH)
    if config.is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError):
            gates |= {
                gate_unit(svc)
                for svc, _, _ in gated_services(config.read_text(encoding="utf-8"), str(config))[0]
            }
    if live:
        ok &= _run(["systemctl", "disable", "--now", GUARDIAN_UNIT, *sorted(gates)], dry_run)
    paths = [f.path for f in render(units)]
    dropin_dirs = {str(Path(p).parent) for p in paths if p.endswith(".d/vllm-guardian.conf")}
    # Drop-ins for units installed earlier with another --unit are ours too.
    if systemd_dir.is_dir():
        for extra in sorted(systemd_dir.glob("*.service.d/vllm-guardian.conf")):
            rel = "/" + str(extra.relative_to(prefix))
            if rel not in paths:
                paths.append(rel)
                dropin_dirs.add(str(Path(rel).parent))
    for p in paths:
        dest = _under(prefix, p)
        if not dest.exists():
            continue
        print(f"{'would remove' if dry_run else 'removed'} {dest}")
        if not dry_run:
            dest.unlink()
    for d in sorted(dropin_dirs):
        dest = _under(prefix, d)
        if not dry_run and dest.is_dir() and not any(dest.iterdir()):
            dest.rmdir()
    if live:
        ok &= _run(["systemctl", "daemon-reload"], dry_run)
    print(
        f"kept {_under(prefix, CONFIG_PATH)}, {_under(prefix, STATE_DIR)} and the user {USER} "
        "(remove them by hand if you want them gone)."
    )
    if not ok:
        return 1
    names = " ".join(units)
    print(
        "\nOne command left (restarts vLLM without the guardian's flags and drop-in):\n"
        f"  systemctl restart {names}"
    )
    return 0


def build_parser(command: str) -> argparse.ArgumentParser:
    verb = "write" if command == "install" else "remove"
    p = argparse.ArgumentParser(
        prog=f"vllm-guardian {command}",
        description=f"{verb.capitalize()} the guardian's systemd unit, the vLLM drop-in, the "
        "polkit rule and the sysusers.d file.",
    )
    p.add_argument(
        "--unit",
        action="append",
        help=f"a vLLM systemd unit the guardian manages (repeatable; default {DEFAULT_UNIT})",
    )
    p.add_argument(
        "--dry-run", action="store_true", help=f"print what would {verb}, change nothing"
    )
    p.add_argument("--prefix", default="/", help="root to install into (default /)")
    return p


def main(argv: list[str]) -> int:
    """``argv`` starts with ``install`` or ``uninstall``. Exit 0 done, 1 a step failed, 2 usage."""
    if not argv or argv[0] not in ("install", "uninstall"):
        print("usage: vllm-guardian install|uninstall [--unit U] [--dry-run]", file=sys.stderr)
        return 2
    command = argv[0]
    args = build_parser(command).parse_args(argv[1:])
    units: list[str] = args.unit or [DEFAULT_UNIT]
    for u in units:
        if not _UNIT.match(u):
            print(
                f"vllm-guardian {command}: --unit {u!r} is not a systemd service name "
                "(e.g. vllm.service)",
                file=sys.stderr,
            )
            return 2
    prefix = Path(args.prefix)
    if not prefix.is_dir():
        print(f"vllm-guardian {command}: --prefix {prefix} is not a directory", file=sys.stderr)
        return 2
    if not args.dry_run and _live(prefix) and os.geteuid() != 0:
        print(f"vllm-guardian {command}: needs root (or --dry-run)", file=sys.stderr)
        return 1
    if command == "install":
        return install(units, prefix, args.dry_run)
    return uninstall(units, prefix, args.dry_run)
