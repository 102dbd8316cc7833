"""Matching semantics: commutativity, literals (exact, wildcard, captured), constraints,
module identity by type, multi-output patterns, overlaps, acyclicity, metadata and
provenance of new nodes."""

from __future__ import annotations

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.errors import PatternError
from fxopt.provenance import PROVENANCE_KEY

from .conftest import ops


def test_commutative_ops_match_in_either_order() -> None:
    def pattern(x, y, z):
        return x * y + z

    def replacement(x, y, z):
        return torch.addcmul(z, x, y)

    class M(nn.Module):
        def forward(self, a, b, c):
            return (c + b * a) + (a * c + b)  # both operand orders of both ops

    gm = fx.symbolic_trace(M())
    a, b, c = (torch.randn(5) for _ in range(3))
    assert fp.replace(gm, pattern, replacement) == 2
    assert ops(gm).count("addcmul") == 2
    torch.testing.assert_close(gm(a, b, c), M()(a, b, c))


def test_sub_is_not_commutative() -> None:
    def pattern(x, y):
        return torch.relu(x - y)

    class M(nn.Module):
        def forward(self, a):
            return torch.relu(a - 1.0)  # the literal sits where the pattern wants y: fine

    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, pattern, lambda x, y: torch.clamp_min(x - y, 0)) == 1
    gm2 = fx.symbolic_trace(type("N", (nn.Module,), {"forward": lambda s, a: torch.relu(1.0 - a)})())
    assert fp.replace(gm2, lambda x: torch.relu(x - 1.0), lambda x: torch.clamp_min(x - 1.0, 0)) == 0


def test_literals_exact_wildcard_and_captured() -> None:
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.six = nn.ReLU6()

        def forward(self, x):
            return self.six(x) + F.hardtanh(x, -2.0, 2.0) + F.leaky_relu(x, 0.3)

    x = torch.randn(64) * 4
    # exact: hardtanh(0, 6) is ReLU6 whatever the spelling; (-2, 2) is not
    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, lambda t: F.hardtanh(t, 0.0, 6.0), lambda t: torch.clamp(t, 0.0, 6.0)) == 1
    torch.testing.assert_close(gm(x), M()(x))
    # wildcard: any bounds
    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, lambda t: F.hardtanh(t, fp.ANY, fp.ANY), lambda t: t * 1.0) == 2
    # captured: the slope is a pattern argument, handed to the replacement
    gm = fx.symbolic_trace(M())

    def leaky(t, slope):
        return F.leaky_relu(t, slope)

    def where(t, slope):
        return torch.where(t > 0, t, t * slope)

    assert fp.replace(gm, leaky, where) == 1
    assert "where" in ops(gm) and "leaky_relu" not in ops(gm)
    torch.testing.assert_close(gm(x), M()(x))


def test_constraints_on_dtype_shape_and_use() -> None:
    class M(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y), torch.relu(x.double() + y.double())

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    gm = fxopt.optimize(fx.symbolic_trace(M()), passes=[], example_inputs=(x, y))  # meta['val']
    fp_fused = fp.rule(lambda a, b: torch.relu(a + b), lambda a, b: torch.ops.fxopt.add_relu(a, b),
                       a=fp.dtype_in(torch.float32), b=fp.rank(2))
    assert fp.replace(gm, fp_fused) == 1
    assert "explain" and "dtype_in" in fp.explain(gm, fp_fused)
    torch.testing.assert_close(gm(x, y), M()(x, y))

    class Shared(nn.Module):
        def forward(self, x, y):
            s = x * 2
            return torch.relu(s + y) + s

    gm = fx.symbolic_trace(Shared())
    single = fp.rule(lambda a, b: torch.relu(a + b), lambda a, b: torch.ops.fxopt.add_relu(a, b),
                     where=fp.single_use("a"))
    assert fp.replace(gm, single) == 0
    assert "single_use(a)" in fp.explain(gm, single)


def test_module_attributes_are_literals() -> None:
    """conv.groups / bn.training are arguments of the canonical call: literal constraints."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(4, 4, 3, groups=4)
            self.full = nn.Conv2d(4, 4, 3)

        def forward(self, x):
            return self.dw(x) + self.full(x)

    def depthwise(x, w, b, s, p, d, op):
        return torch.ops.aten.convolution.default(x, w, b, s, p, d, False, op, 4)

    def replacement(x, w, b, s, p, d, op):
        return torch.ops.aten.convolution.default(x, w, b, s, p, d, False, op, 4) * 1.0

    model = M()
    gm = fx.symbolic_trace(model)
    assert fp.replace(gm, depthwise, replacement) == 1
    x = torch.randn(1, 4, 8, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_modules_match_by_type_never_by_attribute_name() -> None:
    class Misnamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Linear(8, 8)  # named conv, is a Linear
            self.linear = nn.Conv1d(8, 8, 1)  # named linear, is a conv

        def forward(self, x):
            return torch.relu(self.conv(x)) + torch.relu(self.linear(x.unsqueeze(-1))).squeeze(-1)

    def conv_relu(x, w, b, s, p, d, op, g):
        return torch.relu(torch.ops.aten.convolution.default(x, w, b, s, p, d, False, op, g))

    def marker(x, w, b, s, p, d, op, g):
        return torch.ops.fxopt.conv_bias_relu(x, w, b, s, p, d, g)

    model = Misnamed()
    gm = fx.symbolic_trace(model)
    assert fp.replace(gm, conv_relu, marker) == 1
    fused = [n for n in gm.graph.nodes if "conv_bias_relu" in str(n.target)]
    assert len(fused) == 1 and fused[0].args[1].target == "linear.weight"
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x))


@torch.fx.wrap
def opaque(t):
    return t * 3


def test_multi_output_pattern() -> None:
    def pattern(x, y):
        s = x + y
        return s, torch.relu(s)

    def replacement(x, y):
        s = x + y
        return s, torch.clamp_min(s, 0)

    class M(nn.Module):
        def forward(self, x, y):
            s = x + y
            r = torch.relu(s)
            return r * s

    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, pattern, replacement) == 1
    assert "relu" not in ops(gm)
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(x, y), M()(x, y))

    class EarlyUse(nn.Module):  # s is read before the ReLU: the replacement goes first
        def forward(self, x, y):
            s = x + y
            t = s * 3
            return torch.relu(s) + t

    gm = fx.symbolic_trace(EarlyUse())
    assert fp.replace(gm, pattern, replacement) == 1
    gm.graph.lint()
    torch.testing.assert_close(gm(x, y), EarlyUse()(x, y))

    class Blocked(nn.Module):  # an unknown call in between: nothing moves across it
        def forward(self, x, y):
            s = x + y
            t = opaque(s)
            return torch.relu(s) + t

    gm = fx.symbolic_trace(Blocked())
    assert fp.replace(gm, pattern, replacement) == 0
    assert "before the last matched node" in fp.explain(gm, pattern)


def test_overlaps_resolve_deterministically() -> None:
    """relu(a + relu(b + c)): the inner match comes first in graph order, the outer one then
    matches on the rewritten inner node; the result is the same every run."""
    class M(nn.Module):
        def forward(self, a, b, c):
            return torch.relu(a + torch.relu(b + c))

    results = []
    for _ in range(3):
        gm = fx.symbolic_trace(M())
        assert fp.replace(gm, lambda x, y: torch.relu(x + y), lambda x, y: torch.ops.fxopt.add_relu(x, y)) == 2
        results.append(str(gm.graph))
    assert len(set(results)) == 1


def test_new_nodes_carry_meta_for_the_real_shapes_and_provenance() -> None:
    class M(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y)

    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    gm = fxopt.optimize(fx.symbolic_trace(M().eval()), passes=["fuse_add_relu"], example_inputs=(x, y))
    (fused,) = [n for n in gm.graph.nodes if "add_relu" in str(n.target)]
    assert tuple(fused.meta["val"].shape) == (7, 3) and fused.meta["val"].dtype == torch.float64
    assert tuple(fused.meta["tensor_meta"].shape) == (7, 3)
    assert set(fused.meta[PROVENANCE_KEY]) == {"add", "relu"}
    assert fused.meta["fxopt.created_by"] == "fuse_add_relu"


def test_rules_register_as_passes_and_run_in_pipelines() -> None:
    rule = fp.rule(lambda x: torch.sigmoid(x) * x, lambda x: F.silu(x), name="silu")
    fp.register_rules("fuse_silu_test", [rule], "x * sigmoid(x) -> silu", replace=True)

    class M(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)  # the other operand order

    x = torch.randn(10)
    gm = fxopt.optimize(M(), passes="fuse_silu_test,dce", example_inputs=(x,), verify=True)
    assert "silu" in ops(gm) and "sigmoid" not in ops(gm)
    assert fxopt.report_of(gm).records[0].stats["silu"] == 1


def test_find_matches_does_not_rewrite() -> None:
    class M(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y) + torch.relu(y + x)

    gm = fx.symbolic_trace(M())
    before = str(gm.graph)
    assert len(fp.find_matches(gm, lambda a, b: torch.relu(a + b))) == 2
    assert str(gm.graph) == before


def test_user_graph_untouched_on_bad_rule() -> None:
    gm = fx.symbolic_trace(type("M", (nn.Module,), {"forward": lambda s, x: torch.relu(x + 1)})())
    before = str(gm.graph)
    with pytest.raises(PatternError):
        fp.replace(gm, lambda x, y: torch.relu(x), lambda x, y: x)
    assert str(gm.graph) == before


def test_explain_names_the_failing_sub_node_argument_and_constraint() -> None:
    class M(nn.Module):
        def forward(self, x, y):
            a = torch.relu(x * y)  # wrong inner op
            s = x + y
            b = torch.relu(s) + s  # the sum is used outside the match
            return a + b + torch.relu(x + 2.0)  # a literal where a tensor is constrained

    gm = fx.symbolic_trace(M())
    r = fp.rule(lambda p, q: torch.relu(p + q), lambda p, q: torch.ops.fxopt.add_relu(p, q),
                q=fp.is_tensor)
    lines = fp.explain(gm, r).splitlines()
    assert len(lines) == 3
    assert "expects `add`" in lines[0] and "`mul`" in lines[0]
    assert "node 'add' (pattern 'add') is also used by 'add_1' outside the match" in lines[1]
    assert "is_tensor" in lines[2] and "2.0" in lines[2]
    assert "is `add`, but the pattern's output is `relu`" in fp.explain(gm, r, "add")
    assert fp.replace(gm, r) == 0
