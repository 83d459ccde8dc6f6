"""Expositions built from the real vLLM capture: multi-engine (data parallel) variants."""

from __future__ import annotations


def multi_engine(text: str, engines: int) -> str:
    """Repeat every ``engine="0"`` series for engines 0..N-1, grouped per engine like vLLM does."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        per_engine = [line for line in block if 'engine="0"' in line]
        others = [line for line in block if 'engine="0"' not in line]
        out.extend(others)
        for i in range(engines):
            out.extend(line.replace('engine="0"', f'engine="{i}"') for line in per_engine)
        block.clear()

    for line in text.splitlines():
        if line.startswith("#"):
            if block:
                flush()
            out.append(line)
        else:
            block.append(line)
    if block:
        flush()
    return "\n".join(out) + "\n"
