"""The spelling matrix: one pattern matches every spelling of relu(a + b), at torch
level (symbolic_trace, Dynamo) and ATen level (export, make_fx); in-place spellings
only where the write is invisible."""

from __future__ import annotations

import operator

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt.compile.fused_ops  # noqa: F401

from .conftest import CAPTURES, capture


def pattern(x, y):
    return torch.relu(x + y)


def replacement(x, y):
    return torch.ops.fxopt.add_relu(x, y)


RELU = {
    "torch.relu": torch.relu,
    "F.relu": F.relu,
    "method": lambda t: t.relu(),
    "module": nn.ReLU(),
    "aten": torch.ops.aten.relu.default,
    "torch.relu_": torch.relu_,
    "F.relu(inplace)": lambda t: F.relu(t, inplace=True),
    "module(inplace)": nn.ReLU(inplace=True),
    "method relu_": lambda t: t.relu_(),
}
ADD = {
    "+": operator.add,
    "torch.add": torch.add,
    "method": lambda a, b: a.add(b),
    "aten": torch.ops.aten.add.Tensor,
    "swapped": lambda a, b: b + a,
    "kwargs": lambda a, b: torch.add(input=a, other=b),
}


class AddRelu(nn.Module):
    def __init__(self, relu: str, add: str):
        super().__init__()
        self.add_name, self.relu_name = add, relu
        self.act = RELU[relu] if isinstance(RELU[relu], nn.Module) else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = ADD[self.add_name](x * 2, y)  # x * 2 keeps an in-place relu off the graph input
        return self.act(s) if self.act is not None else RELU[self.relu_name](s)


class IaddRelu(nn.Module):
    """``+=`` on a fresh tensor, then ReLU: sound, since nothing else sees the write."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = x * 2
        s += y
        return torch.relu(s)


def _check(model: nn.Module, how: str) -> None:
    inputs = (torch.randn(3, 5), torch.randn(3, 5))
    gm, args = capture(model, inputs, how)
    expected = gm(*args)
    assert fp.replace(gm, pattern, replacement) == 1
    names = [str(n.target) for n in gm.graph.nodes if n.op != "placeholder"]
    assert not any("relu" in t and "fxopt" not in t for t in names), names
    assert any("fxopt.add_relu" in t for t in names), names
    torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)
    fresh = (torch.randn(3, 5), torch.randn(3, 5))
    if how != "dynamo":
        torch.testing.assert_close(gm(*fresh), model(*fresh), rtol=0, atol=0)


@pytest.mark.parametrize("relu", list(RELU))
@pytest.mark.parametrize("how", ["symbolic_trace", "export", "make_fx"])
def test_every_relu_spelling(relu: str, how: str) -> None:
    _check(AddRelu(relu, "+"), how)


@pytest.mark.parametrize("add", list(ADD))
@pytest.mark.parametrize("how", ["symbolic_trace", "export", "make_fx"])
def test_every_add_spelling(add: str, how: str) -> None:
    _check(AddRelu("F.relu", add), how)


@pytest.mark.parametrize("how", CAPTURES)
def test_iadd_on_a_fresh_tensor(how: str) -> None:
    _check(IaddRelu(), how)


@pytest.mark.parametrize("relu, add", [("module(inplace)", "+"), ("method", "torch.add"),
                                       ("torch.relu_", "method")])
def test_dynamo_graphs(relu: str, add: str) -> None:
    _check(AddRelu(relu, add), "dynamo")


PATTERN_SPELLINGS = {
    "F.relu/torch.add": lambda x, y: F.relu(torch.add(x, y)),
    "methods": lambda x, y: x.add(y).relu(),
    "module": lambda x, y: nn.ReLU()(x + y),
    "aten": lambda x, y: torch.ops.aten.relu.default(torch.ops.aten.add.Tensor(x, y)),
    "swapped": lambda x, y: torch.relu(y + x),
}


@pytest.mark.parametrize("spelling", list(PATTERN_SPELLINGS))
@pytest.mark.parametrize("how", ["symbolic_trace", "make_fx"])
def test_every_pattern_spelling(spelling: str, how: str) -> None:
    def pat(x, y):
        return PATTERN_SPELLINGS[spelling](x, y)

    for relu in ("torch.relu", "module(inplace)", "aten"):
        gm, args = capture(AddRelu(relu, "torch.add"), (torch.randn(4), torch.randn(4)), how)
        expected = gm(*args)
        assert fp.replace(gm, pat, replacement) == 1, (spelling, relu)
        torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)


class WritesVisibleInput(nn.Module):
    """``x.add_(y)`` writes into the caller's tensor: replacing it would drop that write."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.add_(y))


class InplaceReluOnSharedSum(nn.Module):
    """The sum is read again after the in-place ReLU: it must see the ReLU'd values."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = x + y
        r = torch.relu_(s)
        return r * 2 + s


class WriteBetween(nn.Module):
    """x is written between the add and the ReLU: the fused op, placed at the ReLU, would
    read the new x."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x * 1
        s = x + y
        x.mul_(3)
        return torch.relu(s) + x


@pytest.mark.parametrize("model", [WritesVisibleInput(), InplaceReluOnSharedSum(), WriteBetween()],
                         ids=lambda m: type(m).__name__)
def test_unsound_inplace_spellings_do_not_match(model: nn.Module) -> None:
    gm = fx.symbolic_trace(model)
    x, y = torch.randn(6), torch.randn(6)
    expected = model(x.clone(), y)
    assert fp.replace(gm, pattern, replacement) == 0
    assert "no match" in fp.explain(gm, pattern) or "but" in fp.explain(gm, pattern)
    torch.testing.assert_close(gm(x.clone(), y), expected)


def test_replace_pattern_contrast() -> None:
    """What the issue contrasts with: torch.fx's replace_pattern sees one spelling only."""
    matched_fx = matched_fp = 0
    for relu in ("F.relu", "method", "module", "aten", "F.relu(inplace)"):
        gm = fx.symbolic_trace(AddRelu(relu, "+"))
        matched_fx += len(fx.subgraph_rewriter.replace_pattern(gm, pattern, replacement))
        matched_fp += fp.replace(fx.symbolic_trace(AddRelu(relu, "+")), pattern, replacement)
    assert (matched_fx, matched_fp) == (0, 5)


class InplaceReluThroughView(nn.Module):
    """relu_ on a view writes into the caller's tensor even though the view is matched."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu_(x.view(-1)) * 2


def test_inplace_write_through_a_matched_view_is_refused() -> None:
    def view_relu(t):
        return torch.relu(t.view(-1))

    gm = fx.symbolic_trace(InplaceReluThroughView())
    assert fp.replace(gm, view_relu, lambda t: torch.clamp_min(t.reshape(-1), 0)) == 0
    x = torch.randn(2, 3)
    expected_x = x.clone().relu_()
    gm(x)
    torch.testing.assert_close(x, expected_x)  # the write still reaches the caller
