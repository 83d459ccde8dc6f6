"""The package's build, for what pyproject.toml cannot say: with ``VLLM_GUARDIAN_COMPILE=1`` the
gate's request and event path (``vllm_guardian/gate/compiled.py``) is compiled by mypyc into C
extension modules, which need a C compiler and Python's headers where it is built (docs/gate.md,
"A compiled gate"). Without it the package is pure Python, as always."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from setuptools import setup


def compiled_sources() -> list[str]:
    """The files of ``COMPILED_MODULES``, read from the module's text (the package itself is
    not importable while it is being built)."""
    tree = ast.parse(Path("vllm_guardian/gate/compiled.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPILED_MODULES" for t in node.targets
        ):
            return [m.replace(".", "/") + ".py" for m in ast.literal_eval(node.value)]
    raise SystemExit("setup.py: no COMPILED_MODULES in vllm_guardian/gate/compiled.py")


# Compiled when something is built (a wheel, build_ext), not while setuptools only asks for the
# requirements or the metadata (egg_info, dist_info), before mypy is installed for the build.
BUILDING = {"bdist_wheel", "build", "build_ext"}  # never editable_wheel: see build_backend

ext_modules = []
if os.environ.get("VLLM_GUARDIAN_COMPILE") == "1" and BUILDING & set(sys.argv[1:]):
    from mypyc.build import mypycify  # the build's requirement when compiling (build_backend)

    ext_modules = mypycify(compiled_sources(), opt_level="3")
setup(ext_modules=ext_modules)
