"""`python -m mlx_moe_fix status|demo`: the console script, where it is not on PATH."""

import sys

from .cli import main

sys.exit(main())
