"""The twin's simulated GPU, published as the JSON state file of docs/gpu-state-file.md.

The guardian's GPU source reads this file through its ``file`` backend instead of NVML. The
document itself (``build_state``, pure) and its reader live in ``gpu_state_format.py``, the
format's one module; ``write_state_atomically`` replaces ``PATH`` atomically (atomicfile.py),
so a reader never sees half a file.
XID events already in an existing file are kept: a GPU's error history outlives the process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_guardian.formats.gpu_state_format import (
    StateXid,
)
from vllm_guardian.lowio.atomicfile import write_atomic


def read_previous_xids(path: Path) -> tuple[StateXid, ...]:
    """XID events recorded by an earlier run (empty when there is no readable file)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        events = doc["devices"][0]["xid_events"]
        return tuple(
            StateXid(int(e["seq"]), int(e["xid"]), float(e["time_seconds"])) for e in events
        )
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ()


def write_state_atomically(path: Path, state: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(state, sort_keys=True).encode(), 0o644)
