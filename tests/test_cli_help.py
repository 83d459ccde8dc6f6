"""Every subcommand answers ``--help`` with exit 0 and no traceback, as a fresh install runs it.

Each runs in a subprocess of its own (``python -m vllm_guardian``), so a module-level import of
a library the install does not bring (aiohttp for the gate, once an extra) fails here as it
would for a user. The list comes from the parser itself plus the commands dispatched before it,
so a new subcommand is covered without touching this file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guardian.cli import build_parser

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
