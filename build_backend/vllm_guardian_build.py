"""setuptools' build backend, plus mypy (its mypyc) among the build's requirements when the
gate is compiled (``VLLM_GUARDIAN_COMPILE=1``, setup.py): a pure build needs only setuptools."""

from __future__ import annotations

import os
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403 (the backend's other hooks, unchanged)

MYPYC = "mypy>=2.4"


def _with_mypyc(hook: Any, config_settings: dict[str, Any] | None) -> list[str]:
    # setuptools runs setup.py to find its requirements, before mypy is there: told so, setup.py
    # leaves the compiled modules out of that run.
    os.environ["VLLM_GUARDIAN_REQUIRES_ONLY"] = "1"
    try:
        requires: list[str] = hook(config_settings)
    finally:
        del os.environ["VLLM_GUARDIAN_REQUIRES_ONLY"]
    return [*requires, MYPYC] if os.environ.get("VLLM_GUARDIAN_COMPILE") == "1" else requires


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _with_mypyc(build_meta.get_requires_for_build_wheel, config_settings)


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _with_mypyc(build_meta.get_requires_for_build_editable, config_settings)
