"""Run a test module's Triton kernels in Triton's interpreter, on CPU tensors, or skip it.

A test module calls :func:`use_interpreter` at its top, before it imports anything that
imports triton: the interpreter is switched on by an environment variable that triton reads
when it is imported and when kernels launch, and which stays set for the process. So the
module is skipped where that cannot be done safely: without triton (CI's CPU torch has
none), with a numpy too new for the interpreter, on a machine with a CUDA device (the
variable would send every later kernel of the process to the interpreter; the GPU tests run
the kernels there), or once triton was imported in compiled mode (importing torch's op
libraries does that where triton is installed: run such a file with ``TRITON_INTERPRET=1``
in the environment).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch


def use_interpreter() -> None:
    """Switch Triton's interpreter on for this process, or skip the calling module."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("triton's interpreter needs numpy < 2.3", allow_module_level=True)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA device is present: the interpreter tests run on CPU machines", allow_module_level=True)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was already imported in compiled mode in this process", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
