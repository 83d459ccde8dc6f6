"""A missing tool skips a test on a developer's machine and fails it in CI (tests/hostneeds.py)."""

from __future__ import annotations

import sys

import pytest
from _pytest.outcomes import Failed, Skipped

from tests import hostneeds

ABSENT = "no-such-tool-for-vllm-guardian"


@pytest.mark.parametrize(
    ("require", "outcome"),
    [("", Skipped), ("1", Failed)],
    ids=["developer machine: skip", "CI (VLLM_GUARDIAN_REQUIRE_TOOLS): fail"],
)
def test_a_missing_tool(monkeypatch: pytest.MonkeyPatch, require: str, outcome: type) -> None:
    monkeypatch.setenv("VLLM_GUARDIAN_REQUIRE_TOOLS", require)
    with pytest.raises(outcome) as caught:
        hostneeds.tool(ABSENT, "it checks the thing (apt-get install thing)")
    assert f"{ABSENT} not installed: it checks the thing" in str(caught.value)


def test_a_present_tool_or_its_alias_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_GUARDIAN_REQUIRE_TOOLS", "1")
    assert hostneeds.tool("sh", "a shell").endswith("/sh")
    assert hostneeds.tool(ABSENT, "python under another name", sys.executable).endswith(
        sys.executable.rsplit("/", 1)[1]
    )
