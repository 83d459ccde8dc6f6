import sys

from vllm_guardian.cli import main

sys.exit(main())
