"""Asks Linux for the AMX tile state at the start of every Python process of a vLLM the tier runs.

On a CPU with AMX (Sapphire Rapids and later; the tier's hosts have had both kinds), a process
must ask the kernel for the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM) before it runs
a tile instruction, or it dies of SIGILL. vLLM 0.32's bf16 CPU attention kernel ("amx" ISA,
chosen when the block size is a multiple of 32) runs them without asking; whether its worker
survives depends on whether oneDNN asked first, which it does for a large enough matmul. A
fresh server whose first request was a 3-token prompt lost its worker every time ("Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)"). torch's own ``torch.cpu._init_amx()`` asks;
on a CPU without AMX it does nothing.

Python imports ``sitecustomize`` at start-up from ``sys.path``: the tier puts this directory on
the ``PYTHONPATH`` of the vLLMs it starts (tests/vllm_tier/support.py: ``vllm_env``), never on
the guardian's. vLLM's processes import torch anyway, so importing it here costs nothing extra.
"""

from __future__ import annotations

import sys

try:
    import torch

    torch.cpu._init_amx()
except Exception as e:  # a tier without torch (never) or an older torch: say so, carry on
    print(f"tests/vllm_tier/amx/sitecustomize.py: cannot ask for AMX: {e!r}", file=sys.stderr)
