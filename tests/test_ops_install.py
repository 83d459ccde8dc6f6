"""``vllm-guardian install | uninstall`` into a temporary prefix, with fake systemctl/sysusers on PATH."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests import hostneeds
from vllm_guardian.config import load_config
from vllm_guardian.tools import cli, install

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """systemctl and systemd-sysusers that log their argv; exit status from FAKE_RC."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("systemctl", "systemd-sysusers"):
        tool = bin_dir / name
        tool.write_text(
            f'#!/bin/sh\necho "{name} $*" >> {log}\n'
            'if [ -n "$FAKE_RC" ]; then echo "boom" >&2; exit "$FAKE_RC"; fi\n'
        )
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_install_writes_everything_and_names_the_one_command(tmp_path, fake_tools, capsys):
    prefix = tmp_path / "root"
    prefix.mkdir()
    assert cli.main(["install", "--prefix", str(prefix)]) == 0
    out = capsys.readouterr().out
    for f in install.render(["vllm.service"], gated=[("vllm", "vllm.service")]):
        assert (prefix / f.path.lstrip("/")).read_text() == f.text
    cfg = load_config(str(prefix / "etc/vllm-guardian/config.yaml"))  # valid as written
    assert [(s.name, s.unit) for s in cfg.services] == [("vllm", "vllm.service")]
    gate = cfg.services[0].gate
    assert gate is not None and gate.listen == "127.0.0.1:8001"  # vLLM :8000, its gate :8001
    assert (prefix / "etc/systemd/system/vllm-guardian-gate@.service").is_file()
    dropin = prefix / "etc/systemd/system/vllm-guardian-gate@vllm.service.d/vllm-guardian.conf"
    assert "After=vllm.service" in dropin.read_text()
    assert "  systemctl enable --now vllm-guardian.service vllm-guardian-gate@vllm.service\n" in out
    assert "Clients of vllm: send requests to its gate at 127.0.0.1:8001." in out
    assert "not reloading systemd" in out  # an offline root has no manager to reload
    assert calls(fake_tools) == [
        # The name, not the path: systemd-sysusers 252 opens an absolute path on the host,
        # newer ones under --root; a bare name is looked up in the root's sysusers.d by both.
        f"systemd-sysusers --root={prefix} vllm-guardian.conf"
    ]


def test_install_keeps_an_existing_config_and_handles_several_units(tmp_path, fake_tools, capsys):
    prefix = tmp_path / "root"
    conf = prefix / "etc/vllm-guardian/config.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text("# mine\n")
    argv = ["install", "--prefix", str(prefix), "--unit", "vllm-a.service", "--unit", "b.service"]
    assert install.main(argv) == 0
    assert conf.read_text() == "# mine\n"
    captured = capsys.readouterr()
    assert "kept" in captured.out
    rule = (prefix / "etc/polkit-1/rules.d/50-vllm-guardian.rules").read_text()
    assert 'var units = ["vllm-a.service", "b.service"];' in rule
    dropin = prefix / "etc/systemd/system/b.service.d/vllm-guardian.conf"
    assert "EnvironmentFile=-/var/lib/vllm-guardian/b.env" in dropin.read_text()
    unit = (prefix / "etc/systemd/system/vllm-guardian.service").read_text()
    assert "After=network-online.target vllm-a.service b.service" in unit
    # "# mine" names no service: no gate is set up, and install says so.
    assert not list((prefix / "etc/systemd/system").glob("vllm-guardian-gate@?*.service.d"))
    assert "is invalid, so no gate is set up from it" in captured.err
    assert "No service has a gate: section" in captured.out


def test_gates_follow_the_existing_config(tmp_path, fake_tools, capsys):
    prefix = tmp_path / "root"
    conf = prefix / "etc/vllm-guardian/config.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text(
        "services:\n"
        "  - {name: a, url: 'http://127.0.0.1:8000', unit: a.service,"
        " gate: {listen: '0.0.0.0:9000'}}\n"
        "  - {name: b, url: 'http://127.0.0.1:8001', unit: b.service}\n"
        "  - {name: c, url: 'http://127.0.0.1:8002', gate: {listen: '127.0.0.1:9002'}}\n"
    )
    argv = ["install", "--prefix", str(prefix), "--unit", "a.service", "--unit", "b.service"]
    assert install.main(argv) == 0
    out = capsys.readouterr().out
    system = prefix / "etc/systemd/system"
    assert sorted(p.name for p in system.glob("vllm-guardian-gate@*")) == [
        "vllm-guardian-gate@.service",
        "vllm-guardian-gate@a.service.d",  # c has no unit to order after: the template is enough
    ]
    assert (
        "After=a.service"
        in (system / "vllm-guardian-gate@a.service.d/vllm-guardian.conf").read_text()
    )
    assert (
        "  systemctl enable --now vllm-guardian.service vllm-guardian-gate@a.service"
        " vllm-guardian-gate@c.service\n" in out
    )
    assert "Clients of a: send requests to its gate at 0.0.0.0:9000." in out


def test_dry_run_prints_and_changes_nothing(tmp_path, fake_tools, capsys):
    prefix = tmp_path / "root"
    prefix.mkdir()
    assert install.main(["install", "--dry-run", "--prefix", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert "Type=notify" in out and "polkit.addRule" in out and "KillMode=mixed" in out
    assert "+ systemd-sysusers" in out
    assert list(prefix.iterdir()) == [] and calls(fake_tools) == []


def test_warns_when_the_vllm_unit_does_not_append_the_guardian_args(tmp_path, fake_tools, capsys):
    prefix = tmp_path / "root"
    unit = prefix / "etc/systemd/system/vllm.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/opt/vllm/bin/vllm serve m\n")
    assert install.main(["install", "--prefix", str(prefix)]) == 0
    assert "does not end with $VLLM_GUARDIAN_ARGS" in capsys.readouterr().err
    unit.write_text(install.VLLM_EXAMPLE)
    assert install.main(["install", "--prefix", str(prefix)]) == 0
    assert "VLLM_GUARDIAN_ARGS" not in capsys.readouterr().err


def test_live_root_reloads_systemd_and_reports_a_failure(tmp_path, fake_tools, monkeypatch, capsys):
    prefix = tmp_path / "root"
    prefix.mkdir()
    monkeypatch.setattr(install, "_live", lambda _p: True)
    monkeypatch.setattr(install.os, "geteuid", lambda: 0)
    assert install.main(["install", "--prefix", str(prefix)]) == 0
    assert calls(fake_tools) == [
        "systemd-sysusers /etc/sysusers.d/vllm-guardian.conf",
        "systemctl daemon-reload",
    ]
    # ExecStart points at the vllm-guardian beside this Python when there is one.
    exe = Path(sys.executable).with_name("vllm-guardian")
    unit = (prefix / "etc/systemd/system/vllm-guardian.service").read_text()
    expected = str(exe) if exe.is_file() else install.DEFAULT_EXEC
    assert f"ExecStart={expected} run -c /etc/vllm-guardian/config.yaml" in unit
    capsys.readouterr()
    monkeypatch.setenv("FAKE_RC", "1")
    assert install.main(["install", "--prefix", str(prefix)]) == 1
    captured = capsys.readouterr()
    assert "systemctl exited 1: boom" in captured.err
    assert "One command left" not in captured.out


def test_uninstall_removes_what_install_wrote_and_keeps_config_and_state(
    tmp_path, fake_tools, monkeypatch, capsys
):
    prefix = tmp_path / "root"
    prefix.mkdir()
    assert install.main(["install", "--prefix", str(prefix), "--unit", "a.service"]) == 0
    assert install.main(["install", "--prefix", str(prefix)]) == 0
    state = prefix / "var/lib/vllm-guardian"
    state.mkdir(parents=True)
    (state / "vllm.env").write_text("VLLM_GUARDIAN_ARGS=--max-num-seqs 64\n")
    other = prefix / "etc/systemd/system/vllm.service.d/local.conf"
    other.write_text("[Service]\n")
    monkeypatch.setattr(install, "_live", lambda _p: True)
    monkeypatch.setattr(install.os, "geteuid", lambda: 0)
    fake_tools.unlink()
    assert install.main(["uninstall", "--prefix", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert calls(fake_tools) == [
        # The config install wrote first gates service a; its gate goes with the guardian.
        "systemctl disable --now vllm-guardian.service vllm-guardian-gate@a.service",
        "systemctl daemon-reload",
    ]
    left = sorted(str(p.relative_to(prefix)) for p in prefix.rglob("*") if p.is_file())
    assert left == [
        "etc/systemd/system/vllm.service.d/local.conf",  # not ours: kept
        "etc/vllm-guardian/config.yaml",
        "var/lib/vllm-guardian/vllm.env",
    ]
    assert not (prefix / "etc/systemd/system/a.service.d").exists()  # ours, and now empty
    assert not (prefix / "etc/systemd/system/vllm-guardian-gate@a.service.d").exists()
    assert "systemctl restart vllm.service" in out


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["install", "--unit", "vllm"], 2, "is not a systemd service name"),
        (["install", "--unit", "x.service; rm -rf /"], 2, "is not a systemd service name"),
        (["install", "--unit", 'a"]);polkit.service'], 2, "is not a systemd service name"),
        (["install", "--prefix", "/nonexistent/prefix"], 2, "is not a directory"),
    ],
)
def test_bad_arguments_are_refused(argv, code, message, capsys):
    assert install.main(argv) == code
    assert message in capsys.readouterr().err


def test_live_install_needs_root(monkeypatch, capsys):
    monkeypatch.setattr(install.os, "geteuid", lambda: 1000)
    assert install.main(["install"]) == 1
    assert "needs root" in capsys.readouterr().err


def test_the_command_line_entry_point(tmp_path, fake_tools):
    prefix = tmp_path / "root"
    prefix.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", "install", "--dry-run", "--prefix", str(prefix)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "systemctl enable --now vllm-guardian.service vllm-guardian-gate@vllm.service"
        in proc.stdout
    )


@pytest.mark.parametrize(
    "units",
    [["vllm\\x2da.service"], ["vllm@a\\x20b.service", "b.service"], ["a\\\\.service"]],
    ids=["escaped-dash", "escaped-space-instance", "backslash"],
)
def test_the_polkit_rule_names_exactly_the_units(tmp_path, fake_tools, units):
    """Unit names were written into the polkit JavaScript unescaped, so a
    systemd-escaped name (``\\x2d``) became another string there and the rule never matched."""
    import json

    prefix = tmp_path / "root"
    prefix.mkdir()
    argv = ["install", "--prefix", str(prefix)]
    for u in units:
        argv += ["--unit", u]
    assert install.main(argv) == 0
    rule = (prefix / "etc/polkit-1/rules.d/50-vllm-guardian.rules").read_text()
    array = rule.split("var units = ", 1)[1].split(";", 1)[0]
    assert json.loads(array) == units  # a JSON array literal is the same JavaScript array


def test_a_unit_name_starting_with_a_dash_is_refused(capsys):
    assert install.main(["install", "--unit=-x.service"]) == 2
    assert "is not a systemd service name" in capsys.readouterr().err


def test_install_into_an_offline_root_creates_the_user_in_that_root(tmp_path, monkeypatch, capsys):
    """``install --prefix DIR`` with the real systemd-sysusers: the user lands in DIR/etc/passwd.
    It exited 1 ("Failed to open '/etc/sysusers.d/vllm-guardian.conf'"): systemd 252 opens an
    absolute config path on the host even under --root."""
    sysusers = hostneeds.tool("systemd-sysusers", "creates the user in the offline root")
    prefix = tmp_path / "root"
    prefix.mkdir()
    monkeypatch.setenv("PATH", str(Path(sysusers).parent))
    code = install.main(["install", "--prefix", str(prefix), "--unit", "vllm.service"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    passwd = (prefix / "etc/passwd").read_text()
    assert any(line.startswith("vllm-guardian:") for line in passwd.splitlines()), passwd
    assert "not reloading systemd" in captured.out


def test_an_offline_root_without_systemd_sysusers_is_skipped_with_a_line(
    tmp_path, monkeypatch, capsys
):
    """An image build without systemd: the user is made at the root's first boot, so install
    says so and succeeds; on the running system the same absence is a failure."""
    empty = tmp_path / "nothing-on-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    prefix = tmp_path / "root"
    prefix.mkdir()
    assert install.main(["install", "--prefix", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert (
        f"systemd-sysusers not found: the user vllm-guardian is created from "
        f"{prefix}/etc/sysusers.d/vllm-guardian.conf when that root first boots" in out
    )


@pytest.mark.parametrize(
    ("executable", "warned"),
    [
        ("/opt/vllm-guardian/bin/vllm-guardian", None),
        ("/usr/local/bin/vllm-guardian", None),
        ("/home/ops/venv/bin/vllm-guardian", "ProtectHome=yes"),
        ("/root/venv/bin/vllm-guardian", "ProtectHome=yes"),
        ("/run/user/1000/venv/bin/vllm-guardian", "ProtectHome=yes"),
        ("/tmp/venv/bin/vllm-guardian", "PrivateTmp=yes"),
        ("/var/tmp/venv/bin/vllm-guardian", "PrivateTmp=yes"),
        ("/homes/venv/bin/vllm-guardian", None),  # a prefix of the name is not the directory
    ],
)
def test_a_venv_the_sandbox_hides_is_warned(executable: str, warned: str | None) -> None:
    warning = install.sandbox_warning(executable)
    if warned is None:
        assert warning is None
    else:
        assert warning is not None and warned in warning and executable in warning


def test_install_warns_when_it_runs_from_a_venv_the_unit_cannot_see(
    tmp_path, fake_tools, monkeypatch, capsys
):
    """The unit's ExecStart is this venv's vllm-guardian on the running system: under /home or
    /tmp the unit cannot start, and install says why before anyone enables it."""
    monkeypatch.setattr(install, "_live", lambda prefix: True)
    monkeypatch.setattr(install, "_exec_path", lambda: "/home/ops/venv/bin/vllm-guardian")
    prefix = tmp_path / "root"
    prefix.mkdir()
    assert install.main(["install", "--dry-run", "--prefix", str(prefix)]) == 0
    err = capsys.readouterr().err
    assert "warning: /home/ops/venv/bin/vllm-guardian" in err and "ProtectHome=yes" in err


def test_install_and_uninstall_are_in_the_top_level_help(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "install" in out.split("positional arguments:", 1)[1]
    assert "uninstall" in out.split("positional arguments:", 1)[1]
