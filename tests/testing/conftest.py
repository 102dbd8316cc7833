"""Shared set-up for the fxopt.testing suite."""

import sys
from pathlib import Path

import pytest
import torch

# broken_passes.py is a plain module next to the tests (imported by name, and by repros)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="module")
def _one_thread_per_worker():
    """CI runs two workers on two cores: intra-op threads on top only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
