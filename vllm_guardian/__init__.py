"""vllm-guardian: keeps vLLM inference servers alive (observe → decide → act, once per tick)."""

__version__ = "0.1.0"
