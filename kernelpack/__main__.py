"""``python -m kernelpack``: the CLI, for environments whose scripts directory is not on PATH."""

import sys

from .cli import main

sys.exit(main())
