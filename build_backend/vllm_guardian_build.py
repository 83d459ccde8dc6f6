"""setuptools' build backend, plus what compiling the gate needs among the build's requirements
when it is asked for (``VLLM_GUARDIAN_COMPILE=1``, setup.py): mypy (its mypyc) and, since mypyc
type-checks the modules it compiles against what they import, the package's own dependencies
and the type stubs its checks use. A pure build needs only setuptools."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403 (the backend's other hooks, unchanged)

MYPYC = "mypy>=2.4"
STUBS = ("types-PyYAML", "types-requests")


def _compiling() -> bool:
    return os.environ.get("VLLM_GUARDIAN_COMPILE") == "1"


def _compile_requires() -> list[str]:
    project = tomllib.loads(Path("pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [MYPYC, *STUBS, *project["dependencies"]] if _compiling() else []


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return [*build_meta.get_requires_for_build_wheel(config_settings), *_compile_requires()]


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    if _compiling():
        # Built in place, the compiled modules would sit beside their sources and shadow every
        # later edit of them.
        raise SystemExit(
            "VLLM_GUARDIAN_COMPILE=1 compiles a regular install, not an editable one "
            "(for a checkout: scripts/compile-gate DIR)"
        )
    return build_meta.get_requires_for_build_editable(config_settings)
