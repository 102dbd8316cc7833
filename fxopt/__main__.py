"""``python -m fxopt``: the same as the ``fxopt`` command."""

import sys

from fxopt.cli import main

sys.exit(main())
