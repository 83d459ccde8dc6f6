"""The in-vLLM plugin: publishes PyTorch's CUDA allocator stats for the guardian to read.

vLLM runs every ``vllm.general_plugins`` entry point in its API server, its engine core and
each GPU worker (before ``init_device``); ours is :func:`register`. It is idle unless
``VLLM_GUARDIAN_ALLOCATOR_DIR`` names a directory (the guardian's vLLM drop-in sets it) and,
when enabled, starts one daemon thread that waits until this process has initialised CUDA and
then writes one JSON file per device every few seconds (format:
:mod:`vllm_guardian.formats.allocator_format`). ``VLLM_PLUGINS`` allow-lists name it ``vllm_guardian``.

Importing this package does nothing and imports no torch: vLLM loads plugins before the
worker sets its device, and touching CUDA then would create a context on the wrong GPU.
"""

from __future__ import annotations

from vllm_guardian.plugin.publisher import register

__all__ = ["register"]
