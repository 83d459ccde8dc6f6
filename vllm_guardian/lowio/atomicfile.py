"""Replace a file atomically: write a temporary file beside it, fsync, rename over it.

Where it sits: under every writer of a file another process reads while it changes: the
flags file vLLM's unit reads at start, the policy state a restarted guardian reads, the twin's
GPU state file the NVML source reads. A reader sees the old file or the new one, never half.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Atomically replace ``path`` with ``data`` (file mode ``mode``); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
