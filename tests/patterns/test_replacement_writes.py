"""A replacement may write in place into its arguments only where the write is invisible:
its arguments are the caller's (graph inputs, parameters, values read after the match)."""

from __future__ import annotations

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

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


class Intermediate(torch.nn.Module):
    """The pattern's argument is a fresh value nothing reads after the match."""

    def forward(self, x):
        return torch.relu(x * 2 + 1)


@pytest.mark.parametrize("replacement", [writes_argument, writes_a_view_of_argument,
                                         writes_argument_by_flag])
def test_a_replacement_never_writes_a_tensor_the_caller_sees(replacement):
    gm = fx.symbolic_trace(Model())  # x is a graph input and read again after the match
    assert fp.replace(gm, pattern, replacement) == 0
    assert_equivalent(fx.symbolic_trace(Model()), gm, (torch.randn(8),))


@pytest.mark.parametrize("replacement", [writes_argument, writes_a_view_of_argument])
def test_a_replacement_may_write_an_argument_nothing_else_sees(replacement):
    gm = fx.symbolic_trace(Intermediate())
    assert fp.replace(gm, pattern, replacement) == 1
    assert_equivalent(fx.symbolic_trace(Intermediate()), gm, (torch.randn(8),))


def test_a_replacement_writing_its_own_tensor_is_applied_and_leaves_the_input_alone():
    gm = fx.symbolic_trace(Model())
    original = fx.symbolic_trace(Model())
    assert fp.replace(gm, pattern, writes_own_tensor) == 1
    assert any(n.target is torch.relu_ for n in gm.graph.nodes)
    x = torch.randn(8)
    assert_equivalent(original, gm, (x,))  # also checks the input's contents afterwards
