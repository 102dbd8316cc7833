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
from fxopt.patterns import replace_pattern, replace_pattern_with_filters
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import symbolic_trace
from torch.fx.annotate import annotate
from torch.fx.experimental.rewriter import RewritingTracer


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


# --- meta['val'] on replacement nodes --------------------------------------------------------

aten = torch.ops.aten


def _export(model, *inputs, **kwargs):
    return torch.export.export(model, inputs, **kwargs).graph_module


class _Relu(torch.nn.Module):
    def forward(self, x):
        return aten.relu.default(x)


class _Neg(torch.nn.Module):
    def forward(self, x):
        return aten.neg.default(x)


class _Div(torch.nn.Module):
    def forward(self, x, y):
        return aten.div.Tensor(x, y)


class _Add(torch.nn.Module):
    def forward(self, x, y):
        return aten.add.Tensor(x, y)


def _relu(x):
    return aten.relu.default(x)


def _neg(x):
    return aten.neg.default(x)


def _add(x, y):
    return aten.add.Tensor(x, y)


def _node(gm, target):
    return next(node for node in gm.graph.nodes if node.target == target)


def _placeholders(gm):
    return [node for node in gm.graph.nodes if node.op == "placeholder"]


def test_replace_pattern_populates_replacement_output_meta_val():
    gm = _export(_Div(), torch.randn(4), torch.randn(4))
    matches = replace_pattern(gm, lambda x, y: aten.div.Tensor(x, y), lambda x, y: aten.mul.Tensor(x, y))
    assert len(matches) == 1
    nodes = [node for node in gm.graph.nodes if node.target == aten.mul.Tensor]
    assert len(nodes) == 1
    val = nodes[0].meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([4]) and val.dtype == torch.float32


def test_replace_pattern_populates_shape_changing_replacement_meta_val():
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, lambda x: aten.reshape.default(x, [6]))) == 1
    val = _node(gm, aten.reshape.default).meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([6])


def test_replace_pattern_populates_builtin_replacement_meta_val():
    def operator_replacement(x, y):
        return x * y

    def torch_replacement(x, y):
        return torch.mul(x, y)

    def packet_replacement(x, y):
        return aten.mul(x, y)

    for replacement, target in [(operator_replacement, operator.mul), (torch_replacement, torch.mul),
                                (packet_replacement, aten.mul)]:
        gm = _export(_Div(), torch.randn(4), torch.randn(4))
        assert len(replace_pattern(gm, lambda x, y: aten.div.Tensor(x, y), replacement)) == 1
        val = _node(gm, target).meta.get("val")
        assert isinstance(val, torch.Tensor) and val.shape == torch.Size([4]), replacement.__name__


def test_replace_pattern_populates_getitem_replacement_meta_val():
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, lambda x: aten.max.dim(x, 1)[0])) == 1
    val = _node(gm, operator.getitem).meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([2])


def test_replace_pattern_populates_slice_replacement_meta_val():
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, lambda x: x[:, 0])) == 1
    val = _node(gm, operator.getitem).meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([2])


def test_replace_pattern_populates_call_method_replacement_meta_val():
    cases = [(lambda x: x.relu(), "relu", [2, 3]), (lambda x: x.add(x), "add", [2, 3]),
             (lambda x: x.reshape(3, 2), "reshape", [3, 2]), (lambda x: x.view(3, 2), "view", [3, 2])]
    for replacement, target, shape in cases:
        gm = _export(_Neg(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _neg, replacement)) == 1
        val = _node(gm, target).meta.get("val")
        assert isinstance(val, torch.Tensor) and val.shape == torch.Size(shape), target


def test_replace_pattern_populates_torch_function_replacement_meta_val():
    cases = [(lambda x: torch.relu(x), torch.relu, [2, 3]),
             (lambda x: torch.cat((x, x), dim=0), torch.cat, [4, 3]),
             (lambda x: torch.reshape(x, (3, 2)), torch.reshape, [3, 2]),
             (lambda x: torch.stack((x, x), dim=0), torch.stack, [2, 2, 3]),
             (lambda x: torch.sin(x), torch.sin, [2, 3])]
    for replacement, target, shape in cases:
        gm = _export(_Neg(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _neg, replacement)) == 1
        val = _node(gm, target).meta.get("val")
        assert isinstance(val, torch.Tensor) and val.shape == torch.Size(shape), target


def test_replace_pattern_populates_get_attr_replacement_meta_val():
    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("offset", torch.ones(2, 3))

        def forward(self, x):
            return aten.add.Tensor(x, self.offset)

    def numel_filter(match, original_graph, pattern_graph):
        val = match.returning_nodes[0].meta.get("val")
        return isinstance(val, torch.Tensor) and val.numel() == 6

    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, Replacement())) == 1
    assert isinstance(_node(gm, "offset").meta.get("val"), torch.Tensor)
    assert isinstance(_node(gm, aten.add.Tensor).meta.get("val"), torch.Tensor)
    matches = replace_pattern_with_filters(gm, _add, lambda x, y: aten.mul.Tensor(x, y), [numel_filter])
    assert len(matches) == 1


class _MmWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.full((3, 4), 7.0))

    def forward(self, x):
        return aten.mm.default(x, self.weight)


def test_replace_pattern_meta_copy_prefers_destination_get_attr():
    gm = symbolic_trace(_Relu())
    gm.register_buffer("weight", torch.full((3, 5), 2.0))
    original_weight = gm.weight
    _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
    replacement_gm = symbolic_trace(_MmWeight())
    with FakeTensorMode() as mode:
        _node(replacement_gm, "weight").meta["val"] = mode.from_tensor(replacement_gm.weight)
        _node(replacement_gm, aten.mm.default).meta["val"] = mode.from_tensor(torch.empty(2, 4))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    assert gm.weight is original_weight
    assert _node(gm, "weight").meta["val"].shape == torch.Size([3, 5])
    assert _node(gm, aten.mm.default).meta["val"].shape == torch.Size([2, 5])
    assert gm(torch.ones(2, 3)).shape == torch.Size([2, 5])


def test_replace_pattern_meta_copy_recomputes_rebound_get_attr():
    replacement_gm = symbolic_trace(_MmWeight())
    with FakeTensorMode() as mode:
        _node(replacement_gm, "weight").meta["val"] = mode.from_tensor(torch.empty(3, 4))
        _node(replacement_gm, aten.mm.default).meta["val"] = mode.from_tensor(torch.empty(2, 4))
    replacement_gm.weight = torch.full((3, 5), 2.0)
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    assert _node(gm, "weight").meta["val"].shape == torch.Size([3, 5])
    assert _node(gm, aten.mm.default).meta["val"].shape == torch.Size([2, 5])
    assert gm(torch.ones(2, 3)).shape == torch.Size([2, 5])


def test_replace_pattern_meta_copy_invalidates_raw_graph_get_attr():
    gm = symbolic_trace(_Relu())
    gm.register_buffer("weight", torch.full((3, 5), 2.0))
    _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    mm = graph.call_function(aten.mm.default, (x, weight))
    graph.output(mm)
    with FakeTensorMode() as mode:
        weight.meta["val"] = mode.from_tensor(torch.empty(3, 4))
        mm.meta["val"] = mode.from_tensor(torch.empty(2, 4))
    assert len(replace_pattern(gm, _relu, graph)) == 1
    assert _node(gm, "weight").meta["val"].shape == torch.Size([3, 5])
    assert _node(gm, aten.mm.default).meta["val"].shape == torch.Size([2, 5])
    assert gm(torch.ones(2, 3)).shape == torch.Size([2, 5])


def test_replace_pattern_meta_copy_does_not_read_destination_descriptor():
    descriptor_accesses = 0
    gm = symbolic_trace(_Relu())
    gm_type = type(gm)

    def read_danger(self):
        nonlocal descriptor_accesses
        descriptor_accesses += 1
        return torch.ones(2, 3)

    gm_type.danger = property(read_danger)
    try:
        _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
        graph = torch.fx.Graph()
        graph.placeholder("x")
        graph.output(graph.get_attr("danger"))
        assert len(replace_pattern(gm, _relu, graph)) == 1
        assert descriptor_accesses == 0
        assert "val" not in _node(gm, "danger").meta
    finally:
        del gm_type.danger


def test_replace_pattern_meta_copy_invalidates_destination_call_module():
    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 4)

        def forward(self, x):
            return torch.sin(self.linear(x))

    gm = symbolic_trace(_Relu())
    destination_linear = torch.nn.Linear(3, 5)
    gm.add_module("linear", destination_linear)
    _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
    replacement_gm = symbolic_trace(Replacement())
    with FakeTensorMode() as mode:
        for node in replacement_gm.graph.nodes:
            if node.target == "linear" or node.target == torch.sin:
                node.meta["val"] = mode.from_tensor(torch.empty(2, 4))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    assert gm.linear is destination_linear
    assert "val" not in _node(gm, "linear").meta
    assert "val" not in _node(gm, torch.sin).meta
    assert gm(torch.ones(2, 3)).shape == torch.Size([2, 5])


def test_replace_pattern_meta_copy_invalidates_call_module_inputs():
    class Consumer(torch.nn.Module):
        def forward(self, x, weight):
            return aten.mm.default(x, weight)

    consumer = Consumer()
    gm = symbolic_trace(_Relu())
    gm.register_buffer("weight", torch.full((3, 5), 2.0))
    gm.add_module("consumer", consumer)
    _placeholders(gm)[0].meta["val"] = torch.ones(2, 3)
    root = torch.nn.Module()
    root.register_buffer("weight", torch.full((3, 4), 7.0))
    root.add_module("consumer", consumer)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    call_module = graph.call_module("consumer", (x, weight))
    sin = graph.call_function(torch.sin, (call_module,))
    graph.output(sin)
    replacement_gm = torch.fx.GraphModule(root, graph)
    with FakeTensorMode() as mode:
        weight.meta["val"] = mode.from_tensor(torch.empty(3, 4))
        call_module.meta["val"] = mode.from_tensor(torch.empty(2, 4))
        sin.meta["val"] = mode.from_tensor(torch.empty(2, 4))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    assert _node(gm, "weight").meta["val"].shape == torch.Size([3, 5])
    assert "val" not in _node(gm, "consumer").meta
    assert "val" not in _node(gm, torch.sin).meta
    assert gm(torch.ones(2, 3)).shape == torch.Size([2, 5])


def test_replace_pattern_populates_parameter_meta_val():
    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return aten.mm.default(x, self.weight)

    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, Replacement())) == 1
    assert isinstance(_node(gm, "weight").meta.get("val"), FakeTensor)
    mm_val = _node(gm, aten.mm.default).meta.get("val")
    assert isinstance(mm_val, FakeTensor) and mm_val.shape == torch.Size([2, 4])


def test_replace_pattern_populates_real_tensor_meta_val():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    gm = symbolic_trace(_Add())
    placeholders = _placeholders(gm)
    placeholders[0].meta["val"], placeholders[1].meta["val"] = x, y
    assert len(replace_pattern(gm, _add, lambda x, y: aten.mul.Tensor(x, y))) == 1
    val = _node(gm, aten.mul.Tensor).meta.get("val")
    assert isinstance(val, FakeTensor) and val.shape == torch.Size([2, 3]) and val.dtype == torch.float32
    assert placeholders[0].meta["val"] is x  # placeholders' meta never changes


def test_replace_pattern_populates_symbolic_scalar_meta_val():
    def replacement(x):
        size = aten.sym_size.int(x, 0)
        return aten.view.default(x, [size, -1])

    gm = _export(_Relu(), torch.randn(3, 4), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    assert len(replace_pattern(gm, _relu, replacement)) == 1
    assert type(_node(gm, aten.sym_size.int).meta.get("val")) is torch.SymInt
    view_val = _node(gm, aten.view.default).meta.get("val")
    assert isinstance(view_val, FakeTensor)
    assert type(view_val.shape[0]) is torch.SymInt and view_val.shape[1] == 4


def _mul_after_custom_placeholder_meta(value_for, replacement=lambda x, y: x * y, target=operator.mul):
    gm = _export(_Add(), torch.randn(4), torch.randn(4))
    for i, node in enumerate(_placeholders(gm)):
        value = value_for(i)
        if value is not None:
            node.meta["val"] = value
    assert len(replace_pattern(gm, _add, replacement)) == 1
    return _node(gm, target)


def test_replace_pattern_meta_copy_does_not_run_custom_meta_value():
    calls = 0

    class CustomMeta:
        def __mul__(self, other):
            nonlocal calls
            calls += 1
            return self

        __rmul__ = __mul__

    node = _mul_after_custom_placeholder_meta(lambda i: CustomMeta())
    assert calls == 0 and "val" not in node.meta


def test_replace_pattern_meta_copy_skips_cyclic_metadata():
    cyclic_meta = [torch.randn(2, 3)]
    cyclic_meta.append(cyclic_meta)
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = cyclic_meta
    assert len(replace_pattern(gm, _relu, _neg)) == 1
    assert "val" not in _node(gm, aten.neg.default).meta


def test_replace_pattern_meta_copy_does_not_run_custom_scalar_meta_value():
    calls = 0

    class CustomInt(int):
        def __mul__(self, other):
            nonlocal calls
            calls += 1
            return self

        __rmul__ = __mul__

    node = _mul_after_custom_placeholder_meta(lambda i: CustomInt(2) if i == 1 else None,
                                              replacement=lambda x, y: y * x)
    assert calls == 0 and "val" not in node.meta


def test_replace_pattern_meta_copy_does_not_read_custom_class_descriptor():
    accesses = 0

    class SpoofedClass:
        @property
        def __class__(self):
            nonlocal accesses
            accesses += 1
            return torch.Tensor

    node = _mul_after_custom_placeholder_meta(lambda i: SpoofedClass())
    assert accesses == 0 and "val" not in node.meta


def test_replace_pattern_meta_copy_does_not_run_tensor_subclass():
    calls = 0

    class CustomTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_subclass(cls, elem, elem.requires_grad)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            nonlocal calls
            calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    values = [CustomTensor(torch.randn(4)) for _ in range(2)]
    calls = 0
    node = _mul_after_custom_placeholder_meta(lambda i: values[i])
    assert calls == 0 and "val" not in node.meta


def test_replace_pattern_meta_copy_does_not_run_tuple_subclass():
    calls = 0

    class max(tuple):  # noqa: A001 - torch's test spoofs torch.return_types.max
        __module__ = "torch.return_types"
        __slots__ = ()

        def __new__(cls, values, indices):
            nonlocal calls
            calls += 1
            return tuple.__new__(cls, (values, indices))

    gm = symbolic_trace(type("M", (torch.nn.Module,), {"forward": lambda self, x: x + 1})())
    _placeholders(gm)[0].meta["val"] = max(torch.randn(4), torch.zeros(4, dtype=torch.long))
    calls = 0
    assert len(replace_pattern(gm, lambda x: x + 1, lambda x: x[0])) == 1
    assert calls == 0 and "val" not in _node(gm, operator.getitem).meta


def test_replace_pattern_meta_copy_skips_unsafe_call_method():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_method("__getattribute__", (x, "relu")))
    gm = _export(_Neg(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _neg, graph)) == 1
    assert "val" not in _node(gm, "__getattribute__").meta


def test_replace_pattern_meta_copy_skips_non_tensor_method():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_method("sym_size", (x, 0)))
    gm = symbolic_trace(_Neg())
    _placeholders(gm)[0].meta["val"] = torch.randn(2, 3)
    assert len(replace_pattern(gm, _neg, graph)) == 1
    assert "val" not in _node(gm, "sym_size").meta


def test_replace_pattern_recomputes_preannotated_replacement_meta_val():
    replacement_gm = symbolic_trace(_neg)
    with FakeTensorMode() as mode:
        stale = mode.from_tensor(torch.empty(2, 3))
    _node(replacement_gm, aten.neg.default).meta["val"] = stale
    gm = _export(_Relu(), torch.randn(4, 5))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    copied = _node(gm, aten.neg.default)
    assert copied.meta.get("val") is not stale and copied.meta["val"].shape == torch.Size([4, 5])


def test_replace_pattern_replaces_none_replacement_meta_val():
    replacement_gm = symbolic_trace(lambda x: aten.reshape.default(x, [6]))
    _node(replacement_gm, aten.reshape.default).meta["val"] = None
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    val = _node(gm, aten.reshape.default).meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([6])


def test_replace_pattern_with_filters_populates_returning_node_meta_val():
    def numel_filter(match, original_graph, pattern_graph):
        val = match.returning_nodes[0].meta.get("val")
        return isinstance(val, torch.Tensor) and val.numel() == 4

    gm = _export(_Div(), torch.randn(4), torch.randn(4))
    matches = replace_pattern_with_filters(gm, lambda x, y: aten.div.Tensor(x, y),
                                           lambda x, y: aten.mul.Tensor(x, y), [numel_filter])
    assert len(matches) == 1
    mul_node = matches[0].replacements[0]
    assert mul_node.target == aten.mul.Tensor and isinstance(mul_node.meta.get("val"), torch.Tensor)
    matches = replace_pattern_with_filters(gm, lambda x, y: aten.mul.Tensor(x, y), _add, [numel_filter])
    assert len(matches) == 1
    add_node = matches[0].replacements[0]
    assert add_node.target == aten.add.Tensor and isinstance(add_node.meta.get("val"), torch.Tensor)


def test_replace_pattern_meta_copy_does_not_run_wrapped_replacement():
    global _side_effect_replacement_call_count
    _side_effect_replacement_call_count = 0
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, lambda x: side_effect_replacement(x))) == 1
    assert _side_effect_replacement_call_count == 0
    (node,) = [n for n in gm.graph.nodes if n.target == side_effect_replacement]
    assert "val" not in node.meta


def test_replace_pattern_meta_copy_does_not_trust_jit_builtin_registry():
    count = 0

    def side_effect(x):
        nonlocal count
        count += 1
        return x

    builtin_table = torch.jit._builtins._get_builtin_table()
    torch.jit._builtins._register_builtin(side_effect, "aten::sin")
    try:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(side_effect, (x,)))
        gm = _export(_Relu(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _relu, graph)) == 1
        assert count == 0 and "val" not in _node(gm, side_effect).meta
    finally:
        builtin_table.pop(id(side_effect), None)


def test_replace_pattern_preserves_unsupported_preannotated_meta_val():
    def custom_replacement(x):
        return x

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    replacement = graph.call_function(custom_replacement, (x,))
    graph.output(replacement)
    annotated = torch.empty(4, 5)
    replacement.meta["val"] = annotated
    gm = _export(_Relu(), torch.randn(4, 5))
    assert len(replace_pattern(gm, _relu, graph)) == 1
    assert _node(gm, custom_replacement).meta["val"] is annotated


def test_replace_pattern_meta_copy_does_not_run_custom_op_fake():
    calls = 0
    with torch.library._scoped_library("subgraph_rewriter_test", "FRAGMENT") as lib:
        torch.library.define("subgraph_rewriter_test::custom_replacement", "(Tensor x) -> Tensor", lib=lib)

        @torch.library.impl("subgraph_rewriter_test::custom_replacement", "CPU", lib=lib)
        def custom_replacement_cpu(x):
            return x.clone()

        @torch.library.register_fake("subgraph_rewriter_test::custom_replacement", lib=lib)
        def custom_replacement_fake(x):
            nonlocal calls
            calls += 1
            return x.clone()

        op = torch.ops.subgraph_rewriter_test.custom_replacement.default
        gm = _export(_Relu(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _relu, lambda x: op(x))) == 1
        assert calls == 0 and "val" not in _node(gm, op).meta


def test_replace_pattern_meta_copy_does_not_run_python_defined_aten_fake():
    calls = 0
    with torch.library._scoped_library("aten", "FRAGMENT") as lib:
        torch.library.define("aten::_subgraph_rewriter_test_custom", "(Tensor x) -> Tensor", lib=lib)

        @torch.library.register_fake("aten::_subgraph_rewriter_test_custom", lib=lib)
        def custom_replacement_fake(x):
            nonlocal calls
            calls += 1
            return x.clone()

        packet = aten._subgraph_rewriter_test_custom
        for replacement, target in [(lambda x: packet.default(x), packet.default), (lambda x: packet(x), packet)]:
            gm = _export(_Relu(), torch.randn(2, 3))
            assert len(replace_pattern(gm, _relu, replacement)) == 1
            assert calls == 0 and "val" not in _node(gm, target).meta


def test_replace_pattern_meta_copy_skips_data_dependent_op():
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = torch.randn(2, 3)
    assert len(replace_pattern(gm, _relu, lambda x: aten.nonzero.default(x))) == 1
    assert "val" not in _node(gm, aten.nonzero.default).meta


def test_replace_pattern_meta_copy_skips_invalid_operator_inputs():
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = torch.randn(4)
    assert len(replace_pattern(gm, _relu, lambda x: torch.reshape(x, (3, 2)))) == 1
    gm.graph.lint()
    assert not any(node.target == aten.relu.default for node in gm.graph.nodes)
    assert "val" not in _node(gm, torch.reshape).meta


def test_replace_pattern_meta_copy_skips_mixed_fake_modes():
    gm = symbolic_trace(_Add())
    for placeholder in _placeholders(gm):
        with FakeTensorMode() as mode:
            placeholder.meta["val"] = mode.from_tensor(torch.randn(4))
    assert len(replace_pattern(gm, _add, lambda x, y: aten.mul.Tensor(x, y))) == 1
    assert "val" not in _node(gm, aten.mul.Tensor).meta


def test_replace_pattern_meta_copy_skips_unsupported_tensor_metadata():
    gm = symbolic_trace(_Relu())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor.*")
        quantized = torch.quantize_per_tensor(torch.randn(2, 3), scale=0.1, zero_point=0, dtype=torch.qint8)
    _placeholders(gm)[0].meta["val"] = quantized
    assert len(replace_pattern(gm, _relu, _neg)) == 1
    assert "val" not in _node(gm, aten.neg.default).meta


def test_replace_pattern_meta_copy_preserves_cross_input_aliases():
    from torch.fx.immutable_collections import immutable_dict

    class M(torch.nn.Module):
        def forward(self, values, key):
            return values[key]

    gm = symbolic_trace(M())
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))
    placeholders = _placeholders(gm)
    placeholders[0].meta["val"] = immutable_dict({fake: fake})
    placeholders[1].meta["val"] = fake
    assert len(replace_pattern(gm, lambda values, key: values[key], lambda values, key: values[key])) == 1
    assert isinstance(_node(gm, operator.getitem).meta.get("val"), FakeTensor)


def test_replace_pattern_meta_copy_does_not_mutate_existing_meta_val():
    # Differs from torch on purpose: the in-place replacement would write into the
    # caller's input, so fxopt refuses the match (docs/replace_pattern.md).
    gm = _export(_Relu(), torch.randn(2, 3))
    placeholder = _placeholders(gm)[0]
    original_shape = placeholder.meta["val"].shape
    assert replace_pattern(gm, _relu, lambda x: aten.transpose_.default(x, 0, 1)) == []
    assert placeholder.meta["val"].shape == original_shape
    # where the written tensor is the match's own, the rewrite happens, and the value it
    # wrote into keeps its metadata while the new node gets the transposed shape
    class M(torch.nn.Module):
        def forward(self, x):
            return aten.relu.default(aten.mul.Tensor(x, 2.0))

    gm = _export(M(), torch.randn(2, 3))
    doubled = _node(gm, aten.mul.Tensor)
    assert len(replace_pattern(gm, _relu, lambda x: aten.transpose_.default(x, 0, 1))) == 1
    assert doubled.meta["val"].shape == torch.Size([2, 3])
    assert _node(gm, aten.transpose_.default).meta["val"].shape == torch.Size([3, 2])
    x = torch.randn(2, 3)
    (out,) = gm(x)
    assert_equal(out, (x * 2.0).t())


def test_replace_pattern_meta_copy_skips_existing_replacement_node():
    class M(torch.nn.Module):
        def forward(self, x):
            return aten.view.default(x, [6])

    gm = _export(M(), torch.randn(2, 3))
    placeholder = _placeholders(gm)[0]
    original_shape = placeholder.meta["val"].shape
    assert len(replace_pattern(gm, lambda x: aten.view.default(x, [6]), lambda x: x)) == 1
    assert placeholder.meta["val"].shape == original_shape


def test_matching_pattern_with_list_type_arg():
    class M(torch.nn.Module):
        def forward(self, x):
            return aten._reshape_alias_copy.default(x, [1, 2], [3, 4])

    def pattern(x, arg0, arg1):
        return aten._reshape_alias_copy.default(x, arg0, arg1)

    def replacement(x, arg0, arg1):
        return aten._reshape_alias_copy.default(x, arg1, arg0)

    traced = symbolic_trace(M())
    assert len(replace_pattern(traced, pattern, replacement)) == 1
    assert traced.code.strip() == (
        "def forward(self, x):\n"
        "    _reshape_alias_copy_default_1 = torch.ops.aten._reshape_alias_copy.default(x, [3, 4], [1, 2]);"
        "  x = None\n"
        "    return _reshape_alias_copy_default_1")


def test_replacement_with_attrs():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.tensor([1])
            self.b = torch.tensor([2])

        def forward(self, x):
            return x + self.a - self.b

    class Pattern(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.tensor([1])

        def forward(self, x):
            return x + self.a

    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = torch.tensor([3])

        def forward(self, x):
            return x - self.c

    traced = symbolic_trace(M())
    assert len(replace_pattern(traced, Pattern(), Replacement())) == 1
    x = torch.tensor([10])
    assert_equal(traced(x), x - 3 - 2)


def test_matching_variable_arguments():
    class M(torch.nn.Module):
        def forward(self, x):
            return aten.max_pool2d_with_indices.default(x, [2, 2], stride=[2, 2])

    def pattern(x, kernel_size, stride):
        # default padding is [0, 0]
        return aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding=[0, 0])

    traced = symbolic_trace(M())
    assert len(replace_pattern(traced, pattern, pattern)) == 1


def test_replaced_nodes():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)

    def replacement(x, y):
        return torch.sub(torch.mul(x, y), y)

    traced = symbolic_trace(M())
    matches = replace_pattern_with_filters(traced, lambda x, y: torch.add(x, y), replacement)
    assert _replacement_nodes_match(traced, matches, {torch.sub, torch.mul}) == 2


def test_replace_pattern_with_callback():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)

    def pattern(x, y):
        return torch.add(x, y)

    def replacement(x, y):
        return torch.sub(torch.mul(x, y), y)

    traced = symbolic_trace(M())
    # the same replacement for every match, a new graph object each time
    matches = replace_pattern_with_filters(
        traced, pattern, replacement_callback=lambda *args: symbolic_trace(replacement).graph)
    assert _replacement_nodes_match(traced, matches, {torch.sub, torch.mul}) == 2
