"""Faults for the real vLLM tier, raised where a GPU would raise them and left to vLLM's own
error handling (test and benchmark code only; never installed, never in the product).

vLLM loads this as a general plugin (the entry point in the dist-info beside this file) in
every one of its processes, but only when a test puts this directory on PYTHONPATH
(``tests/vllm_tier/support.py``'s ``vllm_env(faults=...)``); it does nothing unless one of
these is set:

``VLLM_GUARDIAN_FAULT_OOM_ABOVE_TOKENS=N``
    A model step that schedules more than N tokens raises ``torch.OutOfMemoryError`` with
    CUDA's own message text, from the model runner's ``execute_model`` in the worker: the
    activations of a prefill burst that do not fit. A lower ``--max-num-batched-tokens`` (with
    chunked prefill) genuinely cures it; a plain restart does not.
``VLLM_GUARDIAN_FAULT_HANG_FILE=PATH``
    Once PATH exists, the engine core's next step blocks for good: the busy loop stops while
    the API server still answers ``/health``. A file holding a pid hangs only the engine core
    with that pid: a one-off hang, which a restarted engine (another pid) does not meet again,
    as a real hang is cured by the restart; an empty file hangs every engine core. After the
    pid, ``key=value`` words make the hang wait for a batch (one line, e.g.
    ``4242 running=4 tokens=32 step_ms=20 stop``):

    - ``running=N``, ``tokens=K``: the hang comes at the first step with at least N requests
      running, each with at least K tokens generated (a test that needs requests in flight
      at the hang cannot catch that moment from outside: a small model on a CPU finishes a
      request in about a second);
    - ``step_ms=M``: until then each step first sleeps M ms (a slower card), so requests sent
      a second apart by clients on a busy host are in the engine together;
    - ``stop``: the engine core stops itself (SIGSTOP, every thread, as ``kill -STOP`` from
      outside would) instead of blocking its busy loop.

    At the hang, ``PATH.hung`` gets one JSON line: the time, and the requests running with the
    tokens each had generated.
``VLLM_GUARDIAN_FAULT_DIE_FILE=PATH``
    Once PATH exists, the engine core's next step raises ``RuntimeError``: an unexpected
    exception in the busy loop.

The patches are applied when vLLM imports the module that holds the method (an import hook),
so the API server never imports the model runner on our account.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

OOM_ABOVE = "VLLM_GUARDIAN_FAULT_OOM_ABOVE_TOKENS"
HANG_FILE = "VLLM_GUARDIAN_FAULT_HANG_FILE"
DIE_FILE = "VLLM_GUARDIAN_FAULT_DIE_FILE"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # the CPU runner inherits execute_model
CORE_MODULE = "vllm.v1.engine.core"

# torch 2.11's text for a CUDA OOM, as an H100 printed it (bench/results/gpu/h100-run1.json),
# with the sizes of this step.
OOM_TEXT = (
    "CUDA out of memory. Tried to allocate {tried:.2f} GiB. GPU 0 has a total capacity of "
    "79.18 GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, this process has "
    "{used:.2f} GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by "
    "PyTorch, and 312.00 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# What one scheduled token's activations cost on the imagined card (a 7-8B model's prefill).
ACTIVATION_BYTES_PER_TOKEN = 2 * 1024 * 1024


def oom_message(tokens: int) -> str:
    gib = 1 << 30
    return OOM_TEXT.format(
        tried=tokens * ACTIVATION_BYTES_PER_TOKEN / gib,
        free=1.07,
        used=78.11,
        allocated=76.83,
    )


def _wrap_execute_model(module: ModuleType, limit: int) -> None:
    import torch

    runner = module.GPUModelRunner
    original = runner.execute_model

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        if tokens > limit:
            raise torch.OutOfMemoryError(oom_message(tokens))
        return original(self, scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model


class Hang:
    """What the hang file asks of this process (its module docstring: the words)."""

    def __init__(self, words: list[str]) -> None:
        options = dict(w.partition("=")[::2] for w in words)
        self.running = int(options.get("running") or 0)
        self.tokens = int(options.get("tokens") or 0)
        self.step_seconds = int(options.get("step_ms") or 0) / 1000
        self.stop = "stop" in options

    def due(self, running: list[Any]) -> bool:
        """The batch it waits for is running (always, with no ``running=``)."""
        return len(running) >= self.running and all(
            r.num_output_tokens >= self.tokens for r in running
        )


def _hang_for_me(hang: Path) -> Hang | None:
    """The hang the file asks of this process: it exists and names this process, or no
    process (empty, or words only)."""
    try:
        words = hang.read_text().split()
    except OSError:
        return None
    if words and words[0].isdigit():
        if words[0] != str(os.getpid()):
            return None
        words = words[1:]
    return Hang(words)


def _record_hang(hang: Path, running: list[Any]) -> None:
    record = {
        "time": time.time(),
        "pid": os.getpid(),
        "running": [
            {"id": str(r.request_id), "output_tokens": int(r.num_output_tokens)} for r in running
        ],
    }
    hang.with_name(hang.name + ".hung").write_text(json.dumps(record) + "\n")


def _wrap_step(module: ModuleType, hang: Path | None, die: Path | None) -> None:
    core = module.EngineCore
    original = core.step

    def step(self: Any) -> Any:
        if die is not None and die.exists():
            raise RuntimeError(f"vllm-guardian test fault: {die} exists")
        if hang is not None and (asked := _hang_for_me(hang)) is not None:
            running = list(getattr(self.scheduler, "running", []))
            if not asked.due(running):
                time.sleep(asked.step_seconds)
                return original(self)
            _record_hang(hang, running)
            if asked.stop:
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread, until SIGCONT or SIGKILL
            # The engine core's thread stops here for good, unless the test then asks it to
            # die (one server shows both: a hang, then an unexpected exception).
            while die is None or not die.exists():
                time.sleep(0.2)
            raise RuntimeError(f"vllm-guardian test fault: {die} exists")
        return original(self)

    core.step = step


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``patch(module)`` right after vLLM imports the module named ``name``."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._patch = patch
        self._loader: importlib.abc.Loader | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name or self._loader is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._loader is not None
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._loader is not None
        self._loader.exec_module(module)
        self._patch(module)


def _when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


_armed: set[str] = set()  # vLLM may call its plugins more than once in a process


def register() -> None:
    """vLLM's entry point: arm what the environment asks for, once per process."""
    if "armed" in _armed:
        return
    _armed.add("armed")
    limit = os.environ.get(OOM_ABOVE)
    if limit:
        n = int(limit)
        _when_imported(RUNNER_MODULE, lambda m: _wrap_execute_model(m, n))
    hang = os.environ.get(HANG_FILE)
    die = os.environ.get(DIE_FILE)
    if hang or die:
        _when_imported(
            CORE_MODULE,
            lambda m: _wrap_step(m, Path(hang) if hang else None, Path(die) if die else None),
        )
