"""A replacement may write in place only into tensors it creates: its arguments are the
caller's (graph inputs, parameters, values read after the match)."""

from __future__ import annotations

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.errors import PatternError
from fxopt.testing import assert_equivalent


def pattern(t):
    return torch.relu(t + 1)


def writes_argument(t):
    return torch.relu_(t.add_(1))


def writes_a_view_of_argument(t):
    return torch.relu(t + 1) + t[0].add_(0) * 0


def writes_argument_by_flag(t):
    return F.relu(t, inplace=True) + 1


def writes_own_tensor(t):
    return torch.relu_(t + 1)


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x + 1) * x


@pytest.mark.parametrize("replacement", [writes_argument, writes_a_view_of_argument,
                                         writes_argument_by_flag])
def test_a_replacement_writing_the_callers_tensor_is_refused(replacement):
    with pytest.raises(PatternError, match="writes in place into"):
        fp.rule(pattern, replacement)


def test_a_replacement_writing_its_own_tensor_is_applied_and_leaves_the_input_alone():
    gm = fx.symbolic_trace(Model())
    original = fx.symbolic_trace(Model())
    assert fp.replace(gm, pattern, writes_own_tensor) == 1
    assert any(n.target is torch.relu_ for n in gm.graph.nodes)
    x = torch.randn(8)
    assert_equivalent(original, gm, (x,))  # also checks the input's contents afterwards
