"""PyTorch's own rewriter suite (test/fx/test_subgraph_rewriter.py), ported to
``fxopt.patterns.replace_pattern``: same case names, same models, patterns and
replacements, same assertions (outputs, match counts, replacement nodes, ``meta['val']``).
Assertions on torch's private helpers (``subgraph_rewriter._copy_meta_val`` and the like)
are replaced by the behaviour they guard, asserted through the public entry point."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from fxopt.patterns import replace_pattern
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import symbolic_trace
from torch.fx.annotate import annotate
from torch.fx.experimental.rewriter import RewritingTracer

replace_pattern_with_filters = replace_pattern


def assert_equal(a, b) -> None:
    torch.testing.assert_close(a, b)


@torch.fx.wrap
def wrapped_gemm_bias_mul(a, b, bias):
    lin_res = torch.nn.functional.linear(a, b, bias=bias)
    mul_res = lin_res * a
    return lin_res, mul_res


@torch.fx.wrap
def wrapped_gemm_bias_mul_with_c(a, b, bias, c):
    lin_res = torch.nn.functional.linear(a, b, bias=bias)
    mul_res = lin_res * c
    return lin_res, mul_res


_side_effect_replacement_call_count = 0


@torch.fx.wrap
def side_effect_replacement(x):
    global _side_effect_replacement_call_count
    _side_effect_replacement_call_count += 1
    return x


def _check(traced, fn, comparison_fn, *inputs):
    traced.graph.lint()
    assert_equal(comparison_fn(*inputs), traced.forward(*inputs))


def test_subgraph_rewriter_preserves_logic():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    def pattern(x):
        return torch.neg(x) + torch.relu(x)

    def comparison(x):
        val = torch.neg(x) + torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, pattern)
    _check(traced, None, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_with_oneliner_pattern():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x)
            return torch.add(val, val)

    def comparison(x):
        val = torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x: torch.neg(x), lambda x: torch.relu(x))
    _check(traced, None, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_with_trivial_replacement():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x)
            val = torch.add(val, val)
            return torch.add(val, val)

    def pattern(x):
        return torch.add(x, x)

    def replacement(x):
        return x

    def comparison(x):
        return torch.neg(x)

    traced = symbolic_trace(M())
    matches = replace_pattern_with_filters(traced, pattern, replacement, [])
    _check(traced, None, symbolic_trace(comparison), torch.randn(1, 5))
    assert len(matches) == 2 and len(matches[1].replacements) == 0


def test_subgraph_rewriter_single_pattern_match():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    def comparison(x):
        val = torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x: torch.neg(x) + torch.relu(x), lambda x: torch.relu(x))
    _check(traced, None, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_multiple_pattern_match():
    class M(torch.nn.Module):
        def forward(self, x, w1, w2):
            m1 = torch.cat([w1, w2]).sum()
            m2 = torch.cat([w1, w2]).sum()
            return x + torch.max(m1) + torch.max(m2)

    def pattern(w1, w2):
        return torch.cat([w1, w2]).sum()

    def replacement(w1, w2):
        return torch.stack([w1, w2])

    def comparison(x, w1, w2):
        m1 = torch.stack([w1, w2])
        m2 = torch.stack([w1, w2])
        return x + torch.max(m1) + torch.max(m2)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, None, symbolic_trace(comparison), torch.rand(1, 3), torch.rand(1, 3), torch.rand(1, 3))


def test_subgraph_rewriter_graph_argument_order():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.mm(x, y)

    def pattern(x, y):
        return torch.mm(x, y)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, pattern)
    _check(traced, None, symbolic_trace(pattern), torch.randn(3, 4), torch.randn(4, 5))


def test_subgraph_rewriter_correct_output_replacement():
    class M(torch.nn.Module):
        def forward(self, x, y):
            val = torch.neg(y) + torch.relu(x)
            return torch.add(val, val)

    def comparison(x, y):
        val = torch.neg(y) + torch.neg(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x: torch.relu(x), lambda x: torch.neg(x))
    _check(traced, None, symbolic_trace(comparison), torch.randn(4, 4), torch.randn(4, 4))


def test_subgraph_rewriter_traced_as_callable():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    class Pattern(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x) + torch.relu(x)

    class Replacement(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x)

    def comparison(x):
        val = torch.sigmoid(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, symbolic_trace(Pattern()), symbolic_trace(Replacement()))
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_pattern_is_entire_graph():
    class M(torch.nn.Module):
        def forward(self, x):
            a = torch.neg(x)
            return torch.add(a, a)

    def pattern(x):
        a = torch.neg(x)
        return torch.add(a, a)

    def replacement(x):
        a = torch.sigmoid(x)
        return torch.cat([a, a])

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, None, symbolic_trace(replacement), torch.randn(3, 4))


def test_subgraph_rewriter_pattern_output_pattern_node_can_have_users_that_are_not_matched():
    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            return torch.neg(y) - y

    def comparison(x):
        y = torch.sigmoid(x)
        return torch.neg(y) - y

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x: torch.relu(x), lambda x: torch.sigmoid(x))
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_internal_pattern_nodes_cannot_have_users_that_are_not_matched():
    class M(torch.nn.Module):
        def forward(self, x, w1, w2, b1, b2):
            m0 = torch.cat([w1, w2])  # noqa: F841
            m1 = torch.cat([w1, w2])
            m2 = torch.cat([x, b2])
            t0 = torch.addmm(b1, m1, m2.t())  # noqa: F841
            t1 = torch.sum(w1, 1)
            t2 = torch.addmm(b1, m1, m2.t())
            return torch.sum(t1), torch.sum(t2)

    def pattern(x, w1, w2, b1, b2):
        m1 = torch.cat([w1, w2])
        m2 = torch.cat([x, b2])
        return torch.addmm(b1, m1, m2.t())

    def replacement(x, w1, w2, b1, b2):
        return torch.cat([x, w1, w2])

    traced = symbolic_trace(M())
    res = replace_pattern(traced, pattern, replacement)
    traced.graph.lint()
    assert res == []


def test_subgraph_rewriter_placeholder_matching():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dtype = torch.float16

        def forward(self, x):
            x += 3
            x = x.dequantize()
            x = torch.sigmoid(x)
            dtype = self.dtype
            x = x.to(dtype)
            return x

    def pattern(x):
        x = x.dequantize()
        x = torch.sigmoid(x)
        x = x.to(torch.float16)
        return x

    def comparison(x):
        return x + 3

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, lambda x: x)
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replaces_referenced_submodules():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            x = x + 1
            return self.submod(self.sigmoid(x))

    class Pattern(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            return self.submod(self.sigmoid(x))

    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tanh = torch.nn.Tanh()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            return self.submod(self.tanh(x))

    class Comparison(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tanh = torch.nn.Tanh()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            x = x + 1
            return self.submod(self.tanh(x))

    traced = symbolic_trace(M())
    x = torch.randn(3, 4)
    replace_pattern(traced, Pattern(), Replacement())
    traced.graph.lint()
    assert_equal(Comparison()(x), traced.forward(x))
    traced.get_submodule("tanh")
    with pytest.raises(AttributeError, match="has no attribute"):
        traced.get_submodule("sigmoid")
    assert type(traced.get_submodule("submod")) is torch.nn.ReLU


def test_subgraph_rewriter_annotations_int():
    class M1(torch.nn.Module):
        def forward(self, x):
            y: int = x
            return torch.add(x, y)

    class M2(torch.nn.Module):
        def forward(self, x):
            y = annotate(x, int)
            return torch.add(x, y)

    graph = RewritingTracer().trace(M1())
    symbolic_traced = symbolic_trace(M2())
    for n, m in zip(symbolic_traced.graph.nodes, graph.nodes):
        if n.op == "placeholder":
            assert n.type is int and m.type is int


def test_subgraph_rewriter_replace_consecutive_submodules():
    def f(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return torch.sigmoid(x)

    def comparison(x):
        x = torch.exp(x)
        x = torch.exp(x)
        return torch.exp(x)

    traced = symbolic_trace(f)
    replace_pattern(traced, lambda x: torch.sigmoid(x), lambda x: torch.exp(x))
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_with_overlapping_matches():
    def f(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return torch.sigmoid(x)

    def pattern(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return x

    def comparison(x):
        x = torch.neg(x)
        return torch.neg(x)

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, lambda x: torch.neg(x))
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replace_with_multiple_outputs():
    def f(x):
        y = torch.sigmoid(x)
        z = torch.relu(x)
        return y + z

    def pattern(a):
        b = torch.sigmoid(a)
        c = torch.relu(a)
        return b, c

    def replacement(x):
        return torch.exp(x), torch.abs(x)

    def comparison(x):
        y = torch.exp(x)
        z = torch.abs(x)
        return y + z

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replace_with_duplicated_outputs():
    def f(x1, x2):
        x = x1 - x2
        y = torch.sigmoid(x)
        z = torch.relu(x)
        return y + z

    def pattern(a1, a2):
        a = a1 - a2
        b = torch.sigmoid(a)
        c = torch.relu(a)
        return b, c, a

    def replacement(x1, x2):
        y1 = torch.exp(x1)
        y2 = torch.abs(x2)
        return y2, y2, y1

    def comparison(x1, x2):
        y2 = torch.abs(x2)
        return y2 + y2

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4), torch.randn(3, 4))


def test_subgraph_rewriter_with_unused_args():
    class M(torch.nn.Module):
        def forward(self, x, y, z):
            return x + y

    def comparison(x1, x2, x3):
        return x1 - x2

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x, y: x + y, lambda x, y: x - y)
    assert len([n for n in traced.graph.nodes if n.op == "placeholder"]) == 3
    _check(traced, None, symbolic_trace(comparison), torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))


def test_subgraph_rewriter_with_unused_results():
    class M(torch.nn.Module):
        def forward(self, x, y, cache):
            m = torch.mul(x, y)
            n = cache.index_copy(0, torch.tensor([0]), m)
            p = torch.ops.aten.copy.default(cache, n)
            q = torch.ops.aten.copy_.default(cache, p)  # noqa: F841
            u = torch.relu(cache)
            return u

    def pattern(self_tensor, src_tensor):
        p = torch.ops.aten.copy.default(self_tensor, src_tensor)
        q = torch.ops.aten.copy_.default(self_tensor, p)
        return q

    def replacement(self_tensor, src_tensor):
        q = torch.ops.aten.copy_.default(self_tensor, src_tensor)
        return q

    def comparison(x, y, cache):
        m = torch.mul(x, y)
        n = cache.index_copy(0, torch.tensor([0]), m)
        q = torch.ops.aten.copy_.default(cache, n)  # noqa: F841
        u = torch.relu(cache)
        return u

    traced = symbolic_trace(M())
    comparison_fn = symbolic_trace(comparison)
    assert len(replace_pattern(traced, pattern, replacement)) == 1
    traced.graph.lint()
    x, y, cache = torch.randn(1, 8), torch.randn(1, 8), torch.randn(2, 8)
    ref_outs = comparison_fn(x, y, cache)
    test_outs = traced.forward(x.clone(), y.clone(), cache.clone())
    assert_equal(ref_outs, test_outs)


def test_subgraph_rewriter_call_method():
    class M(torch.nn.Module):
        def forward(self, x):
            x = x.dequantize()
            x = x.sigmoid()
            x = x.to(torch.float16)
            return x

    def pattern(x):
        x = x.dequantize()
        x = x.sigmoid()
        x = x.to(torch.float16)
        return x

    def replacement(x):
        return x

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, None, symbolic_trace(replacement), torch.randn(3, 4))


def test_subgraph_rewriter_nodes_with_kwargs():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0 = torch.nn.Parameter(torch.empty([128, 128]))
            self.b0 = torch.nn.Parameter(torch.empty([128]))

        def forward(self, in0):
            lin_res = torch.nn.functional.linear(in0, self.w0, bias=self.b0)
            mul_res = in0 * lin_res
            sum_res = mul_res + in0
            return sum_res

    def pattern(a, b, bias):
        lin_res = torch.nn.functional.linear(a, b, bias=bias)
        mul_res = a * lin_res
        return lin_res, mul_res

    def replacement(a, b, bias):
        lin_res, mul_res = wrapped_gemm_bias_mul(a, b, bias)
        return lin_res, mul_res

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, pattern, replacement)
    assert len(matches) == 1
    assert any(node.target is wrapped_gemm_bias_mul for node in traced.graph.nodes)


def test_subgraph_rewriter_local_revert():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(5):
                setattr(self, f"w{i}", torch.nn.Parameter(torch.empty([128, 128])))
                setattr(self, f"b{i}", torch.nn.Parameter(torch.empty([128])))

        def forward(self, in0, in1):
            lin_res_1 = torch.nn.functional.linear(in1, self.w0, bias=self.b0)
            lin_res_2 = torch.nn.functional.linear(lin_res_1, self.w1, bias=self.b1)
            # potential match at anchor 1
            mul_res_1 = in1 * lin_res_2
            sum_res_1 = mul_res_1 + in1
            lin_res_3 = torch.nn.functional.linear(sum_res_1, self.w2, bias=self.b2)
            sigmoid_res_1 = torch.sigmoid(lin_res_3)
            # potential match at anchor 2
            mul_res_2 = lin_res_3 * sigmoid_res_1
            lin_res_4 = torch.nn.functional.linear(in0, self.w3, bias=self.b3)
            lin_res_5 = torch.nn.functional.linear(lin_res_4, self.w4, bias=self.b4)
            # potential match at anchor 3
            mul_res_3 = in0 * lin_res_5
            sum_res_2 = mul_res_3 + in0
            return torch.cat([mul_res_2, sum_res_2], dim=1)

    def gemm_bias_mul_pattern_with_c(a, b, bias, c):
        lin_res = torch.nn.functional.linear(a, b, bias=bias)
        mul_res = c * lin_res
        return lin_res, mul_res

    def gemm_bias_mul_replacement_with_c(a, b, bias, c):
        lin_res, mul_res = wrapped_gemm_bias_mul_with_c(a, b, bias, c)
        return lin_res, mul_res

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, gemm_bias_mul_pattern_with_c, gemm_bias_mul_replacement_with_c)
    assert len(matches) == 2
    assert sum(node.target is wrapped_gemm_bias_mul_with_c for node in traced.graph.nodes) == 2


def _replacement_nodes_match(traced, matches, targets) -> int:
    in_graph = [node for node in traced.graph.nodes if node.target in targets]
    in_res = [r for m in matches for r in m.replacements]
    assert in_graph == in_res
    return len(in_graph)


def test_replace_pattern_with_filters():
    class M(torch.nn.Module):
        def forward(self, x, scale, zero_point):
            # Match, second input to add is a scalar
            x = x.dequantize()
            x = torch.add(x, 2)
            x = x.relu()
            x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)

            y = x + 1
            # NOT a match, second input to add is NOT a scalar
            x = x.dequantize()
            x = torch.add(x, y)
            x = x.relu()
            x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
            return x

    def BinaryOpScalarReLUPattern(x, num, scale, zero_point):
        x = x.dequantize()
        x = torch.add(x, num)
        x = x.relu()
        x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
        return x

    def BinaryOpScalarReLUReplacement(x, num, scale, zero_point):
        return torch.mul(x, num)

    def second_input_is_scalar(match, original_graph, pattern_graph):
        input_idx = 0
        for node in pattern_graph.nodes:
            if node.op == "placeholder":
                if input_idx == 1:
                    num_node = node
                input_idx += 1
        return isinstance(match.nodes_map[num_node], (int, float))

    traced = symbolic_trace(M())
    matches = replace_pattern_with_filters(traced, BinaryOpScalarReLUPattern, BinaryOpScalarReLUReplacement, None)
    assert len(matches) == 2
    assert _replacement_nodes_match(traced, matches, {torch.mul}) == 2

    traced = symbolic_trace(M())
    matches = replace_pattern_with_filters(traced, BinaryOpScalarReLUPattern, BinaryOpScalarReLUReplacement,
                                           [second_input_is_scalar])
    assert len(matches) == 1
    assert _replacement_nodes_match(traced, matches, {torch.mul}) == 1
