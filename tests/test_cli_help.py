"""Every subcommand answers ``--help`` with exit 0 and no traceback, as a fresh install runs it.

Each runs in a subprocess of its own (``python -m vllm_guardian``), so a module-level import of
a library the install does not bring (aiohttp for the gate, once an extra) fails here as it
would for a user. The list comes from the parser itself plus the commands dispatched before it,
so a new subcommand is covered without touching this file.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guardian.actuators import flags as flagsfile
from vllm_guardian.config import GateConfig
from vllm_guardian.gate.cli import build_parser as gate_parser
from vllm_guardian.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent

# Dispatched before the main parser (their own parsers), or nested one level down.
EXTRA = [["install"], ["uninstall"], ["sim", "serve"], ["sim", "load"], ["diagnose"], ["plan"]]


def subcommands() -> list[list[str]]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    names = [[name] for a in actions for name in a.choices]
    return [[], *names, *(e for e in EXTRA if e not in names)]


@pytest.mark.slow
@pytest.mark.parametrize("argv", subcommands(), ids=lambda a: " ".join(a) or "(top)")
def test_every_subcommand_answers_help(argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_guardian", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"vllm-guardian {' '.join(argv)} --help -> {proc.returncode}\n{out}"
    )
    assert "Traceback" not in out, out
    assert "usage:" in out.lower(), out


def test_the_list_covers_the_gate_and_the_installer() -> None:
    flat = [" ".join(a) for a in subcommands()]
    for name in ("run", "check-config", "gate", "demo", "install", "sim serve"):
        assert name in flat, flat


# --- what the help says (in-process: argparse's text, no subprocess per command) --------------


def help_text(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """``vllm-guardian ARGV --help`` as a user reads it, at a fixed width."""
    monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


COMMANDS = [a for a in subcommands() if a]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_says_what_it_does(argv: list[str], monkeypatch) -> None:
    """A description between the usage and the first list of arguments."""
    text = help_text(argv, monkeypatch)
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith(f"usage: vllm-guardian {' '.join(argv)}"), usage  # its own name
    description = rest.split("\n\n", 1)[0]
    assert not description.startswith(("positional arguments:", "options:")), text
    assert len(description.split()) >= 5, description


@pytest.mark.parametrize("argv", [[], *COMMANDS], ids=lambda a: " ".join(a) or "(top)")
def test_no_markup_leaks_into_help(argv: list[str], monkeypatch) -> None:
    """Docstrings are reST; help is read in a terminal, where ``x`` is noise."""
    text = help_text(argv, monkeypatch)
    assert "`" not in text, text


GATE = GateConfig()


@pytest.mark.parametrize(
    ("flag", "default"),
    [
        ("--max-queue", GATE.max_queue_requests),
        ("--max-queued-tokens", GATE.max_queued_tokens),
        ("--max-wait", f"{GATE.max_wait_seconds:g}"),
        ("--release-rate", f"{GATE.release_rate_per_second:g}"),
        ("--release-burst", GATE.release_burst),
        ("--retry-after", GATE.retry_after_seconds),
        ("--kv-admission", "on" if GATE.kv_admission else "off"),
        ("--kv-reserve", f"{GATE.kv_reserve_ratio:g}"),
        ("--default-output-tokens", GATE.default_output_tokens),
        ("--body-timeout", f"{GATE.body_timeout_seconds:g}"),
        ("--stall-hold", f"{GATE.stall_hold_seconds:g}"),
        ("--listen", GATE.listen),
    ],
)
def test_gate_help_states_the_configs_defaults(flag: str, default: object) -> None:
    """``--max-queue`` said 256 where the config's default is 1024."""
    action = next(a for a in gate_parser()._actions if flag in a.option_strings)
    assert action.help is not None and f"(default {default}" in action.help, action.help


@pytest.mark.parametrize("command", ["restart", "relaunch", "replay"])
def test_config_flag_is_explained(command: str, monkeypatch) -> None:
    text = help_text([command], monkeypatch)
    after = text.split("-c CONFIG, --config CONFIG", 1)[1].split("\n  -", 1)[0]
    assert "config" in after, text


def test_relaunch_help_lists_the_whitelist(monkeypatch) -> None:
    text = help_text(["relaunch"], monkeypatch)
    for flag, check in flagsfile.FLAGS.items():
        name = flag[2:].replace("-", "_")
        assert re.search(rf"^  {name}\s+{re.escape(str(check))}$", text, re.M), (name, text)


def test_plan_reports_as_plan(tmp_path, capsys) -> None:
    """``plan`` headed its report ``vllm-guardian diagnose:``."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,'
        ' "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,'
        ' "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}'
    )
    main(["plan", "--model", str(model), "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert out.startswith("vllm-guardian plan: "), out
