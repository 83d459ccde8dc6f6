"""``scripts/gpu-check``: the GPU-facing parts of the guardian, measured on a real card.

Steps, each with a pass / fail / n/a verdict and its numbers (docs/gpu-check.md says how to
read them): the NVML source's reading of a process holding a known amount, and its cost per
tick; the allocator plugin's figures against ``torch.cuda.memory_stats()`` under a fragmenting
workload, and whether ``expandable_segments`` strands less (the fragmentation lever's
premise); a real CUDA OOM through the log matcher; a growing neighbour against the exhaustion
forecast; how long a SIGKILLed process's memory takes to come back. The report goes to
``OUTDIR/gpu-check.json`` and ``OUTDIR/gpu-check.md``.

Exit status: 0 every step that applies passed; 1 one failed or could not run; 2 no GPU (or no
torch with CUDA) here, said in one line.
"""
