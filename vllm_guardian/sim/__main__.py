"""``python -m vllm_guardian.sim``: the twin's command line (see ``cli.main``)."""

from __future__ import annotations

from vllm_guardian.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
