"""``python -m vllm_guardian.gate`` = ``vllm-guardian gate``."""

import sys

from vllm_guardian.gate.cli import main

sys.exit(main())
