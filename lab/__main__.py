"""``python -m lab``: see :mod:`lab.cli`."""

import sys

from .cli import main

sys.exit(main())
