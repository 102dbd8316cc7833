"""Moved to :mod:`fxopt.compile.gemm_gelu`; the old name is the same module, kept because
``fxopt.gemm_gelu.decisions()`` lists the GEMM's measured choices."""

import sys

from fxopt.compile import gemm_gelu

sys.modules[__name__] = gemm_gelu
