"""Test modules whose Triton kernels run in Triton's interpreter, on CPU tensors, in a child process.

Triton reads ``TRITON_INTERPRET`` when it is imported and when kernels launch. A test
process cannot switch it on for one module: the suite's own imports (Inductor's config, from
tests/conftest.py) import triton in compiled mode wherever it is installed, and the variable
would stay set for every later kernel of the process. So each module listed in
:data:`MODULES` calls :func:`use_interpreter` at its top, which skips it in any process
started without ``TRITON_INTERPRET=1``, and tests/test_triton_interpreter.py runs it in a
child pytest started with the variable set. That runs wherever triton is installed: in CI (the
``test`` extra installs torch 2.13's triton, which installs on CPU Linux) and on GPU machines
(the child interprets its own kernels only).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import numpy as np
import pytest

#: the modules run in the interpreter, relative to the repository root
MODULES = ["tests/quant/test_int8_mm.py", "tests/quant/test_triton_kernels.py",
           "tests/patterns/test_gemm_gelu_interpreter.py"]


def _version(text: str) -> tuple[int, int]:
    return tuple(int(p) for p in text.split(".")[:2])  # type: ignore[return-value]


def cannot_interpret() -> str | None:
    """Why the interpreter cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if _version(np.__version__) >= (2, 3) and _version(importlib.metadata.version("triton")) < (3, 7):
        return "the interpreter of triton < 3.7 needs numpy < 2.3"  # 3.7.1 runs under numpy 2.4
    return None


def use_interpreter() -> None:
    """Run the calling module only in a process started with ``TRITON_INTERPRET=1``; skip it
    elsewhere (tests/test_triton_interpreter.py starts that process)."""
    reason = cannot_interpret()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in a child process with TRITON_INTERPRET=1: tests/test_triton_interpreter.py",
                    allow_module_level=True)
