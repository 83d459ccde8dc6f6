"""The vLLM twin: a simulated vLLM 0.32 server that fails the way vLLM fails.

``python -m vllm_guardian.sim serve [vllm flags] [--sim-* flags]`` starts it. The simulation
core (``modelspec``, ``profiling``, ``scheduler``, ``memory``, ``stats``, ``engine``,
``scenarios``) is deterministic and driven by a time argument; the shell (``server``,
``vllm_log``, ``gpu_state``, ``cli``) maps it onto real time scaled by ``--sim-speed``.
See docs/twin.md for the model and its formulas.
"""
