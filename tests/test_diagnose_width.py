"""``diagnose`` fits its report to the terminal, or to 80 columns into a pipe, and never cuts a
word: a path or a number split at the edge cannot be pasted or read ("free 70.0 GiB of 8").

Every bundle under tests/fixtures/bundles is rendered at several widths: each line fits unless
it is one word longer than the width (left whole), and the words are the words of the same
report laid out on one unbounded line each. Then the command itself, into a pipe and in a
pseudo-terminal 120 columns wide.
"""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from vllm_guardian.diagnose.analyze import analyze
from vllm_guardian.diagnose.bundle import read_bundle
from vllm_guardian.diagnose.report import render_text

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = ROOT / "tests" / "fixtures" / "bundles"
NAMES = sorted(p.name for p in BUNDLES.iterdir() if p.is_dir() and p.name != "golden")
# A bundle directory whose path alone is longer than a narrow terminal.
LONG = "incident-" + "x" * 70 + "-20261122T030102Z-7-relaunch"


def overflowing(text: str, width: int) -> list[str]:
    """Lines wider than ``width`` that are not a single word (the one excuse for overflowing);
    the environment file's lines are pasted as they are."""
    return [
        line
        for line in text.splitlines()
        if len(line) > width and len(line.split()) > 1 and "VLLM_GUARDIAN_ARGS=" not in line
    ]


def words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("width", [60, 80, 120])
@pytest.mark.parametrize("name", NAMES)
def test_every_line_fits_and_no_word_is_cut(name: str, width: int) -> None:
    report = analyze(read_bundle(BUNDLES / name))
    text = render_text(report, width=width)
    unbounded = render_text(report, width=100_000)
    assert overflowing(text, width) == [], text
    assert words(text) == words(unbounded), text


def test_a_path_longer_than_the_width_stays_whole(tmp_path: Path) -> None:
    bundle = tmp_path / LONG
    shutil.copytree(BUNDLES / "concurrency_overcommit", bundle)
    text = render_text(analyze(read_bundle(bundle)), width=80)
    assert any(str(bundle) in line for line in text.splitlines()), text
    assert overflowing(text, 80) == [], text


def run_diagnose(bundle: Path, columns: int | None) -> str:
    """``vllm-guardian diagnose --bundle`` into a pipe (``columns`` None) or a pseudo-terminal
    of that many columns; what it printed."""
    argv = [sys.executable, "-m", "vllm_guardian", "diagnose", "--bundle", str(bundle), "-q"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None)
    if columns is None:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode in (0, 1), proc.stderr
        return proc.stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    with subprocess.Popen(argv, env=env, stdout=follower, stderr=subprocess.PIPE) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.slow
def test_the_command_fits_a_pipe_and_a_wide_terminal(tmp_path: Path) -> None:
    bundle = tmp_path / LONG
    shutil.copytree(BUNDLES / "concurrency_overcommit", bundle)
    piped = run_diagnose(bundle, None)
    wide = run_diagnose(bundle, 120)
    print(piped, wide, sep="\n----\n")
    assert overflowing(piped, 80) == [] and overflowing(wide, 120) == []
    assert words(piped) == words(wide)
    assert max(len(line) for line in wide.splitlines()) > 80  # the terminal's width is used
    assert any(str(bundle) in line for line in piped.splitlines())
