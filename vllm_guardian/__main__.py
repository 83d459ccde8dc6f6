import sys

from vllm_guardian.tools.cli import main

sys.exit(main())
