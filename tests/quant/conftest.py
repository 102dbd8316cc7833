"""Every quantization test draws its random weights and data from one seed, whatever ran
before it on the same worker. FXOPT_TEST_SEED picks another seed, to check that no
threshold holds only by the luck of one draw."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(int(os.environ.get("FXOPT_TEST_SEED", "0")))
