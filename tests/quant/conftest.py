"""Every quantization test draws its random weights and data from one seed, whatever ran
before it on the same worker. FXOPT_TEST_SEED picks another seed, to check that no
threshold holds only by the luck of one draw."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(int(os.environ.get("FXOPT_TEST_SEED", "0")))


def _int4_by_hand(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 of a ``[N, K]`` weight in plain torch, written apart from fxopt's
    packing code: per group of ``group_size`` along K, scale = absmax / 7, values rounded
    and clamped to -7..7. Returns ``(values [N, K] float32, scales [N, K/group_size])``."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(-1) / 7
    values = torch.clamp(torch.round(groups / scales[..., None]), -7, 7)
    return values.reshape(n, k), scales


@pytest.fixture
def int4_by_hand():
    """An independent int4 quantizer to check fxopt's int4 weights against."""
    return _int4_by_hand
