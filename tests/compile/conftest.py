"""Shared set-up for the torch.compile backend tests: a clean Dynamo state per test.

Compiles on CPU take seconds each, so the models stay tiny and each test compiles as
few graphs as it can.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
