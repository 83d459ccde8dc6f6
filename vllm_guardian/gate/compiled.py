"""Which of the gate's modules the compiled build compiles, and which of them run compiled now.

The gate's request and event path (the server, the upstream client, the exchange, the relay's
per-event steady state, the token reading, the admission, bodies, connections) is plain typed
Python that mypyc can compile to C extension modules: the package built with
``VLLM_GUARDIAN_COMPILE=1`` carries them (``setup.py``), and Python imports an extension module
ahead of its source. Built without it, or where a module is not compiled, the same code runs as
Python. What it saves, measured beside the gate as Python: docs/benchmarks.md ("The gate
compiled"); what it takes and how to build it: docs/gate.md ("A compiled gate").

Where it is read: ``setup.py`` (at build time, from this file's text: the list below stays a
literal), the gate's start-up log line (``gate/cli.py``), the test suite's compiled run
(``tests/conftest.py``) and ``bench/gate_cpu.py``'s gate-mypyc target.
"""

from __future__ import annotations

import importlib
import importlib.machinery

# Not relay.py (mypyc 2.4 stops on it with an internal error): its per-event part is streamer.py.
COMPILED_MODULES = (
    "vllm_guardian.gate.http1",
    "vllm_guardian.gate.upstream",
    "vllm_guardian.gate.continuation",
    "vllm_guardian.gate.streamer",
    "vllm_guardian.gate.proxy",
    "vllm_guardian.gate.admission",
    "vllm_guardian.gate.body",
    "vllm_guardian.gate.connections",
)


def compiled_modules() -> tuple[str, ...]:
    """Those of :data:`COMPILED_MODULES` that this interpreter imports from an extension module
    (it imports them)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return tuple(
        name
        for name in COMPILED_MODULES
        if (getattr(importlib.import_module(name), "__file__", None) or "").endswith(suffixes)
    )
