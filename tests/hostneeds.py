"""What a test needs from the host, and what happens when the host lacks it.

A test that needs a real tool (promtool, Alertmanager, gcc, systemd-nspawn, helm, npm, a
library extra) skips with a reason that says what is missing, why the test needs it and how CI
gets it, so a developer's quick run on a bare laptop still works. Under
``VLLM_GUARDIAN_REQUIRE_TOOLS`` (set by ``scripts/test``, which installs every tool) the same
absence fails: in CI a missing tool must never turn a test into a silent skip.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def required() -> bool:
    """True where every tool must be present (CI, ``scripts/test``)."""
    return bool(os.environ.get("VLLM_GUARDIAN_REQUIRE_TOOLS"))


def cannot_run(why: str) -> NoReturn:
    """This host cannot run the test: a failure where tools are required, else a skip."""
    if required():
        pytest.fail(f"{why} [VLLM_GUARDIAN_REQUIRE_TOOLS is set]")
    pytest.skip(why)


def tool(name: str, why: str, *aliases: str) -> str:
    """The path of the executable ``name`` (or one of ``aliases``), or :func:`cannot_run`."""
    for candidate in (name, *aliases):
        path = shutil.which(candidate)
        if path is not None:
            return path
    cannot_run(f"{name} not installed: {why}")
