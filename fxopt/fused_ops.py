"""Moved to :mod:`fxopt.compile.fused_ops`; the old name is the same module, kept because
``import fxopt.fused_ops`` registers ``torch.ops.fxopt.*``, as readers of saved programs were told."""

import sys

from fxopt.compile import fused_ops

sys.modules[__name__] = fused_ops
