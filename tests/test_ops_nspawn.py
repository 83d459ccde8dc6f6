"""The guardian as its hardened unit under a real systemd (PID 1 of a systemd-nspawn container).

A Debian bookworm rootfs (debootstrap, cached under /var/cache/vllm-guardian-ci, ~75 s once)
is booted with a throwaway overlay (``--volatile=overlay``): nothing a test does reaches the
cache. The repository and the venv's site-packages are bound read-only. Inside, the test runs
``vllm-guardian install`` for real (sysusers, polkit rule, drop-in, daemon-reload), starts a
``vllm.service`` running the vLLM twin, then the one command install prints, and checks:
READY (Type=notify reached active), the STATUS= line, the sources the hardened sandbox must
still reach (the unit over D-Bus, the journal, vLLM's cmdline with the guardian's flags),
the polkit rule (the guardian's user may restart vllm.service and nothing else), the
watchdog restarting a frozen guardian; and the admission gate's unit: READY, a completion
proxied through it to the twin, the guardian reading its status, and the watchdog restarting
a gate whose event loop is frozen (SIGSTOP). The container runs with a private network.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import hostneeds
from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLLM_GUARDIAN_CI_CACHE", "/var/cache/vllm-guardian-ci"))
# polkitd needs a logind (libpam-systemd); procps gives /bin/kill for ExecReload.
PACKAGES = "systemd,systemd-sysv,dbus,libpam-systemd,python3,procps,polkitd"
SUITE = "bookworm"
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = SITE / "site-packages"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _tools() -> dict[str, str]:
    found = {t: shutil.which(t) for t in ("systemd-nspawn", "debootstrap", "nsenter")}
    missing = [t for t, p in found.items() if p is None]
    if missing:
        hostneeds.cannot_run(
            f"{', '.join(missing)} not installed: the units are booted in a real systemd "
            "(apt-get install systemd-container debootstrap; scripts/test installs them)"
        )
    if os.geteuid() != 0:
        hostneeds.cannot_run(
            "systemd-nspawn boots the test's Debian only as root (sudo -E scripts/test)"
        )
    return {t: p for t, p in found.items() if p is not None}


def _rootfs(debootstrap: str) -> Path:
    """The cached rootfs for PACKAGES, built once (under a lock) when missing."""
    key = hashlib.sha256(f"{SUITE}:{PACKAGES}".encode()).hexdigest()[:10]
    rootfs = CACHE / f"rootfs-{SUITE}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (rootfs / "usr/lib/systemd/systemd").exists():
            tmp = rootfs.with_name(rootfs.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run(
                [debootstrap, "--variant=minbase", f"--include={PACKAGES}", SUITE, str(tmp)],
                capture_output=True,
                text=True,
                timeout=480,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            tmp.rename(rootfs)
    return rootfs


# Each check runs a process in the container: polled less often than the default.
POLL_SECONDS = 0.2


class Container:
    def __init__(self, nsenter: str, leader: int) -> None:
        self.nsenter = nsenter
        self.leader = leader

    def sh(self, script: str, timeout: float = 60, check: bool = True) -> str:
        proc = subprocess.run(
            [self.nsenter, "-t", str(self.leader), "-a", "/bin/sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, (
                f"{script}\n-> {proc.returncode}\n{proc.stdout}{proc.stderr}"
            )
        return proc.stdout + proc.stderr

    def prop(self, unit: str, name: str) -> str:
        return self.sh(f"systemctl show -p {name} --value {unit}").strip()


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    tools = _tools()
    rootfs = _rootfs(tools["debootstrap"])
    log = tmp_path_factory.mktemp("nspawn") / "nspawn.log"
    name = f"vgci-{uuid.uuid4().hex[:8]}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                tools["systemd-nspawn"], "--quiet", "--register=no", "--keep-unit",
                "--private-network", "--volatile=overlay", "-M", name, "-D", str(rootfs),
                f"--bind-ro={ROOT}:/opt/vllm-guardian-src",
                f"--bind-ro={SITE}:/opt/vllm-guardian-site",
                "-b",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        leader: list[int] = []

        def booted() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            if not leader:
                # The container's init: nspawn's child that runs systemd. Early in the boot
                # nspawn's own transient child is there too; taken for the leader, every nsenter
                # into it failed once it had exited, until the wait ran out (seen in CI).
                kids = subprocess.run(
                    ["pgrep", "-P", str(proc.pid), "-x", "systemd"], capture_output=True,
                    text=True,
                ).stdout.split()  # fmt: skip
                if not kids:
                    return False
                leader.append(int(kids[0]))
            done = subprocess.run(
                [tools["nsenter"], "-t", str(leader[0]), "-a", "systemctl", "is-system-running"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            state = done.stdout.strip()
            states.append(state or f"rc {done.returncode}: {done.stderr.strip()[:200]}")
            if not state:
                leader.clear()  # not the init (gone, or not yet systemd): look again
            return state in ("running", "degraded")

        states: list[str] = []
        wait_for(
            booted,
            "the container to boot",
            60,
            seen=lambda: (leader, states[-3:], log.read_text()[-2000:]),
            every_seconds=POLL_SECONDS,
        )
        yield Container(tools["nsenter"], leader[0])
    finally:
        proc.terminate()  # nspawn halts the container's systemd cleanly on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


PREPARE = r"""
set -e
mkdir -p /opt/vllm-guardian/bin
cat > /opt/vllm-guardian/bin/vllm-guardian <<'WRAPPER'
#!/bin/sh
export PYTHONPATH=/opt/vllm-guardian-src:/opt/vllm-guardian-site
exec /usr/bin/python3 -m vllm_guardian "$@"
WRAPPER
chmod 755 /opt/vllm-guardian/bin/vllm-guardian
# The operator's vLLM unit: the twin, with $VLLM_GUARDIAN_ARGS last as the example has it.
cat > /etc/systemd/system/vllm.service <<'UNIT'
[Service]
Environment=PYTHONPATH=/opt/vllm-guardian-src:/opt/vllm-guardian-site
ExecStart=/usr/bin/python3 -m vllm_guardian.sim serve --host 127.0.0.1 --port 8000 --sim-model tiny --sim-speed 20 --max-num-seqs 256 $VLLM_GUARDIAN_ARGS
UNIT
cat > /etc/systemd/system/other.service <<'UNIT'
[Service]
ExecStart=/bin/sleep infinity
UNIT
systemctl daemon-reload
systemctl start other.service
"""

GATE = "vllm-guardian-gate@vllm.service"
# A completion through the gate (:8001) to the twin (:8000), with the model the twin serves.
THROUGH_THE_GATE = """python3 - <<'PY'
import json, urllib.request as u
base = "http://127.0.0.1:8001"
model = json.load(u.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
req = u.Request(base + "/v1/completions", method="POST",
                data=json.dumps({"model": model, "prompt": "hi", "max_tokens": 4}).encode(),
                headers={"Content-Type": "application/json"})
with u.urlopen(req, timeout=30) as r:
    print(r.status, r.read().decode())
PY"""

HEALTH_THROUGH_THE_GATE = (
    "python3 -c 'import urllib.request as u; "
    'print(u.urlopen("http://127.0.0.1:8001/health", timeout=5).status)\''
)
FETCH_METRICS = (
    "python3 -c 'import urllib.request as u; "
    'print(u.urlopen("http://127.0.0.1:9469/metrics", timeout=5).read().decode())\''
)


def test_hardened_unit_under_real_systemd(container: Container) -> None:
    c = container
    c.sh(PREPARE)
    out = c.sh("/opt/vllm-guardian/bin/vllm-guardian install --unit vllm.service")
    assert "+ systemctl daemon-reload" in out
    one_command = [line.strip() for line in out.splitlines() if line.startswith("  systemctl ")]
    assert one_command == [
        "systemctl enable --now vllm-guardian.service vllm-guardian-gate@vllm.service"
    ], out
    assert "Clients of vllm: send requests to its gate at 127.0.0.1:8001." in out
    assert "systemd-journal" in c.sh("id vllm-guardian")

    # The guardian's flags file, as the policy writes it; the drop-in feeds it to vLLM.
    c.sh(
        "mkdir -p /var/lib/vllm-guardian"
        " && echo 'VLLM_GUARDIAN_ARGS=--max-num-seqs 64' > /var/lib/vllm-guardian/vllm.env"
        " && systemctl start vllm.service"
    )
    t0 = time.monotonic()
    c.sh(one_command[0], timeout=90)  # Type=notify: returns once READY=1 arrived
    ready_s = time.monotonic() - t0
    assert c.prop("vllm-guardian", "ActiveState") == "active"
    assert c.prop("vllm-guardian", "SubState") == "running"
    pid = c.prop("vllm-guardian", "MainPID")
    status = c.sh(f"grep -E '^(Uid|CapBnd|NoNewPrivs|Seccomp):' /proc/{pid}/status")
    uid = c.sh("id -u vllm-guardian").strip()
    assert f"Uid:\t{uid}\t" in status, status
    assert "CapBnd:\t0000000000000000" in status, status
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status, status

    # The STATUS= line shows vLLM up; the sandbox still reaches the bus, journal and /proc.
    wait_for(
        lambda: "vllm: up" in c.prop("vllm-guardian", "StatusText"),
        "STATUS= to show vLLM up",
        60,
        every_seconds=POLL_SECONDS,
    )
    assert 'Status: "vllm: up' in c.sh("systemctl status --no-pager vllm-guardian", check=False)
    metrics = c.sh(FETCH_METRICS)
    for source in ("vllm_metrics", "health", "unit", "logs"):
        assert f'vllm_guardian_source_up{{service="vllm",source="{source}"}} 1.0' in metrics
    assert 'unit="vllm.service"' in metrics
    vllm_pid = c.prop("vllm.service", "MainPID")
    cmdline = c.sh(f"tr '\\0' ' ' < /proc/{vllm_pid}/cmdline")
    assert cmdline.rstrip().endswith("--max-num-seqs 256 --max-num-seqs 64"), cmdline
    assert c.prop("vllm.service", "KillMode") == "mixed"
    assert c.prop("vllm.service", "Restart") == "always"

    # polkit: the guardian's user restarts vllm.service without root, and nothing else.
    c.sh("runuser -u vllm-guardian -- systemctl restart vllm.service")
    assert c.prop("vllm.service", "MainPID") != vllm_pid
    for forbidden in (
        "systemctl restart other.service",
        "systemctl stop other.service",
        "systemctl disable vllm.service",
        "systemctl daemon-reload",
    ):
        out = c.sh(f"runuser -u vllm-guardian -- {forbidden}", check=False)
        assert "Interactive authentication required" in out or "Access denied" in out, out
    assert c.prop("other.service", "ActiveState") == "active"

    # The gate: its own hardened unit, READY once it listens, proxying to vLLM (the twin).
    assert c.prop(GATE, "ActiveState") == "active", c.sh(f"journalctl -u {GATE} --no-pager")
    assert c.prop(GATE, "Type") == "notify" and c.prop(GATE, "Restart") == "always"
    gate_pid = c.prop(GATE, "MainPID")
    status = c.sh(f"grep -E '^(Uid|CapBnd|NoNewPrivs):' /proc/{gate_pid}/status")
    assert f"Uid:\t{uid}\t" in status and "CapBnd:\t0000000000000000" in status, status
    # vLLM was just restarted (polkit above): a GET is never held, so wait for the twin first.
    wait_for(
        lambda: c.sh(HEALTH_THROUGH_THE_GATE, check=False).strip() == "200",
        "vLLM up",
        60,
        every_seconds=POLL_SECONDS,
    )
    answer = c.sh(THROUGH_THE_GATE, timeout=60)
    assert answer.startswith("200 "), answer
    assert '"object": "text_completion"' in answer or '"object":"text_completion"' in answer, answer
    # The guardian reads the gate's status from inside its own sandbox.
    wait_for(
        lambda: 'vllm_guardian_gate_up{service="vllm"} 1.0' in c.sh(FETCH_METRICS),
        "the guardian to see the gate",
        60,
        every_seconds=POLL_SECONDS,
    )
    assert 'vllm_guardian_gate_reported_in_flight{service="vllm"} 0.0' in c.sh(FETCH_METRICS)

    # The watchdog restarts a gate whose event loop is frozen (3 s here, 10 s shipped).
    c.sh(
        f"mkdir -p /etc/systemd/system/{GATE}.d"
        f" && printf '[Service]\\nWatchdogSec=3s\\nTimeoutStopSec=5s\\n'"
        f" > /etc/systemd/system/{GATE}.d/test.conf"
        f" && systemctl daemon-reload && systemctl restart {GATE}"
    )
    frozen_gate = c.prop(GATE, "MainPID")
    c.sh(f"kill -STOP {frozen_gate}")
    wait_for(
        lambda: c.prop(GATE, "NRestarts") == "1",
        "a watchdog restart of the gate",
        60,
        every_seconds=POLL_SECONDS,
    )
    wait_for(
        lambda: c.prop(GATE, "ActiveState") == "active",
        "the gate's restart",
        60,
        every_seconds=POLL_SECONDS,
    )
    assert c.prop(GATE, "MainPID") != frozen_gate
    journal = c.sh(f"journalctl -u {GATE} --no-pager")
    assert "Watchdog timeout (limit 3s)!" in journal, journal[-3000:]
    assert c.sh(THROUGH_THE_GATE, timeout=60).startswith("200 ")

    # The watchdog restarts a frozen guardian (5 s here instead of the shipped 30 s).
    c.sh(
        "mkdir -p /etc/systemd/system/vllm-guardian.service.d"
        " && printf '[Service]\\nWatchdogSec=5s\\n'"
        " > /etc/systemd/system/vllm-guardian.service.d/test.conf"
        " && systemctl daemon-reload && systemctl restart vllm-guardian"
    )
    frozen = c.prop("vllm-guardian", "MainPID")
    c.sh(f"kill -STOP {frozen}")
    wait_for(
        lambda: c.prop("vllm-guardian", "NRestarts") == "1",
        "a watchdog restart",
        40,
        every_seconds=POLL_SECONDS,
    )
    wait_for(
        lambda: c.prop("vllm-guardian", "ActiveState") == "active",
        "the restart",
        40,
        every_seconds=POLL_SECONDS,
    )
    assert c.prop("vllm-guardian", "MainPID") != frozen
    journal = c.sh("journalctl -u vllm-guardian --no-pager")
    assert "Watchdog timeout (limit 5s)!" in journal
    assert "Failed with result 'watchdog'" in journal

    # ExecReload (SIGHUP) keeps it running.
    c.sh("systemctl reload vllm-guardian")
    assert c.prop("vllm-guardian", "ActiveState") == "active"

    # uninstall stops it and takes its files out; config and state stay.
    out = c.sh("/opt/vllm-guardian/bin/vllm-guardian uninstall --unit vllm.service")
    assert "systemctl restart vllm.service" in out
    c.sh("rm -r /etc/systemd/system/vllm-guardian.service.d && systemctl daemon-reload")
    assert c.prop("vllm-guardian", "LoadState") == "not-found"
    c.sh(f"rm -r /etc/systemd/system/{GATE}.d && systemctl daemon-reload")
    assert c.prop(GATE, "LoadState") == "not-found"
    assert c.prop(GATE, "ActiveState") == "inactive"
    assert c.prop("vllm-guardian", "ActiveState") == "inactive"
    left = c.sh(
        "ls /etc/polkit-1/rules.d /etc/sysusers.d /etc/systemd/system /etc/systemd/system/*.d"
        " 2>/dev/null",
        check=False,
    )
    assert "vllm-guardian" not in left.replace("/etc/systemd/system/vllm-guardian.service.d", ""), (
        left
    )
    assert c.sh("ls /etc/vllm-guardian").strip() == "config.yaml"
    print(f"guardian READY {ready_s:.2f}s after `systemctl enable --now`")
