"""``python -m mlx_redrafter.cli``."""

import sys

from . import main

sys.exit(main())
