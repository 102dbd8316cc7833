"""The dtype guard passes put in a graph they specialized to its example inputs' dtypes
(``fxopt.compile.guards``): every tensor input checked, inputs that are no tensor let
through, one guard however many passes ask."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.compile.guards import add_dtype_guard, check_input_dtypes


class TwoInputs(nn.Module):
    """``x * 2`` may be computed in place (into the temporary) only while no promotion
    happens: ``inplace`` specializes the graph to both inputs' dtypes."""

    def forward(self, x, y):
        return torch.relu(x * 2 + y)


def _guards(gm):
    return [n for n in gm.graph.nodes if n.target is check_input_dtypes]


def test_every_tensor_input_is_guarded_not_only_the_first():
    x, y = torch.randn(5), torch.randn(5)
    gm = fxopt.optimize(fx.symbolic_trace(TwoInputs()), passes=["inplace"], example_inputs=(x, y))
    assert fxopt.report_of(gm).records[0].stats["converted"] >= 1
    torch.testing.assert_close(gm(x, y), TwoInputs()(x, y))
    with pytest.raises(fxopt.InputError, match=r"input 'y' is torch.float64.*'inplace'.*float32"):
        gm(x, y.double())
    with pytest.raises(fxopt.InputError, match=r"input 'x' is torch.float16"):
        gm(x.half(), y)


def test_the_guard_is_inserted_once_after_the_placeholders():
    gm = fx.symbolic_trace(TwoInputs())
    fxopt.optimize(gm, passes=[], example_inputs=(torch.randn(3), torch.randn(3)), inplace=True)  # meta['val']
    add_dtype_guard(gm, "first")
    add_dtype_guard(gm, "second")
    (guard,) = _guards(gm)
    assert guard.kwargs["pass_name"] == "first" and guard.kwargs["expected"] == (torch.float32, torch.float32)
    assert [n.op for n in gm.graph.nodes][:3] == ["placeholder", "placeholder", "call_function"]
    gm.graph.lint()


def test_inputs_that_are_no_tensor_pass_the_guard():
    """An optional input called with None, or a Python number, where the graph was
    specialized for a tensor: the dtype guard has nothing to compare and lets it through;
    an input specialized as no tensor (expected None) is never checked."""
    check_input_dtypes(None, 2.0, torch.zeros(1, dtype=torch.int64), expected=(torch.float32, torch.float32, None),
                       names=("mask", "scale", "ids"), pass_name="p")
    with pytest.raises(fxopt.InputError, match="'b' is torch.float16"):
        check_input_dtypes(None, torch.zeros(1, dtype=torch.half), expected=(torch.float32, torch.float32),
                           names=("a", "b"), pass_name="p")
