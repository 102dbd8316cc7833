"""Moved to :mod:`fxopt.compile.guards`; the old name is the same module, kept because
programs saved as code name ``fxopt.guards.check_input_dtypes``."""

import sys

from fxopt.compile import guards

sys.modules[__name__] = guards
