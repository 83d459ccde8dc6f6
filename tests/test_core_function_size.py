"""No function in the pure core is longer than a screen: a newcomer reads each decision whole.

Ruff's C901 holds the core's functions to 15 branches (pyproject.toml); this holds them to
:data:`MAX_LINES` lines, from ``def`` to the last line, docstring included. The table of
exceptions is empty: split a function that grows past it rather than adding a row.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).parent.parent / "vllm_guardian" / "core"
MAX_LINES = 80
# "module.py:function" → why it may be longer. Empty on purpose.
EXCEPTIONS: dict[str, str] = {}


def long_functions() -> list[str]:
    found = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            name = f"{path.name}:{node.name}"
            if lines > MAX_LINES and name not in EXCEPTIONS:
                found.append(f"{name} ({lines} lines)")
    return found


def test_no_core_function_is_longer_than_a_screen() -> None:
    assert CORE.is_dir()
    assert long_functions() == [], f"longer than {MAX_LINES} lines: split them"
