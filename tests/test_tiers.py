"""The two phases of scripts/test: the real vLLM tier runs alone, everything else on workers.

scripts/test selects the phases by the ``vllm`` marker, so a tier module without it would run
beside other tests on a worker (its measurements need the host to itself), and a marked test
outside the tier would run twice or never where the tier is skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _marks_vllm(path: Path) -> bool:
    """Whether the module sets ``pytestmark`` to (a list holding) ``pytest.mark.vllm``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "pytest.mark.vllm" in ast.unparse(node.value)
    return False


def test_every_tier_module_is_marked_vllm() -> None:
    tier = sorted((TESTS / "vllm_tier").glob("test_*.py"))
    assert tier, "no tier modules found"
    assert [p.name for p in tier if not _marks_vllm(p)] == []


def test_no_module_outside_the_tier_is_marked_vllm() -> None:
    outside = [
        p
        for p in sorted(TESTS.rglob("test_*.py"))
        if "vllm_tier" not in p.parts
        and p.name != Path(__file__).name
        and "mark.vllm" in p.read_text()
    ]
    assert [str(p.relative_to(TESTS)) for p in outside] == []
