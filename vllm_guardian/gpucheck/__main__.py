"""``python -m vllm_guardian.gpucheck OUTDIR``: what ``scripts/gpu-check`` runs."""

from __future__ import annotations

import sys

from vllm_guardian.gpucheck.cli import main

sys.exit(main(sys.argv[1:]))
