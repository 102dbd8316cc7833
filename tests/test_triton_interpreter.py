"""Each interpreter test module (tests/triton_interpreter.py) run in a child pytest with
``TRITON_INTERPRET=1``: it passes, and at least one of its tests ran (a child that skipped
everything would pass too)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .triton_interpreter import MODULES, cannot_interpret

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(cannot_interpret() is not None, reason=str(cannot_interpret()))
@pytest.mark.parametrize("module", MODULES)
def test_the_modules_kernels_pass_in_the_interpreter(module):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", module],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\b[1-9]\d* passed", summary) and "skipped" not in summary, tail
