"""PyTorch's own rewriter suite (``test/fx/test_subgraph_rewriter.py``), re-expressed with
``fxopt.patterns``: one counterpart per upstream test, named after it, with upstream's
models, patterns and replacements and the outcome upstream asserts.

Functional tests (29) run through ``replace_pattern`` / ``replace_pattern_with_filters``,
fxopt's drop-ins with torch's signatures and return types; where upstream compares against
a reference, the counterpart also checks that the rewritten graph calls the reference's
ops and computes its outputs on fresh random inputs (two draws). Differences:

- ``..._placeholder_matching``: the graph keeps its in-place ``x += 3`` where the reference
  has ``x + 3``: same outputs, so ops are compared by what was removed.
- ``..._nodes_with_kwargs``, ``..._local_revert``: the parameters are initialized (upstream
  leaves ``torch.empty``) so the outputs can be compared with eager.
- ``..._replaces_referenced_submodules``, ``test_replace_pattern_with_callback``: also
  through the native API (``fp.replace`` with a module replacement, ``fp.rule(...,
  replacement_callback=...)``), plus a replacement calling a submodule the target lacks;
  ``test_native_replacement_callback_chooses_per_match`` is the native callback's own.

``meta['val']`` tests (upstream's latest revision), through ``replace_pattern``;
``..._populates_shape_changing_...`` and ``..._populates_common_...`` through
``fp.replace`` too (the values come from the core, not the shim).
Assertions on torch's private helpers (``_copy_meta_val``, ``_is_safe_meta_value``,
``_is_safe_meta_propagation_target``, ``_meta_execution_context``) are replaced by the
behaviour they guard, asserted through ``replace_pattern`` or
``fxopt.patterns.meta.propagate_meta``. Differences, on purpose
(docs/replace_pattern.md):

- ``..._preserves_preannotated_replacement_meta_val``,
  ``..._preserves_unsupported_preannotated_meta_val``: a value annotated on a replacement
  node is recomputed from the matched inputs where fxopt can (upstream keeps it even when
  stale); it is kept only where the node cannot be evaluated.
- ``..._meta_copy_does_not_mutate_existing_meta_val``: an in-place replacement that would
  write into the caller's input is refused (upstream rewrites); where it writes into the
  match's own tensor, the rewrite happens and the new node gets the written value.
- ``..._meta_execution_context_is_serialized``: concurrent rewrites sharing one fake mode,
  which must find the mode's settings as they were.

Tests of an earlier upstream revision that the latest merged or replaced keep their names
(``..._populates_builtin/_call_method/_torch_function/_slice_replacement_meta_val`` are in
``..._populates_common/_getitem_...``; ``..._does_not_run_python_defined_aten_fake`` is
``..._builtin_fake``): ``..._recomputes_preannotated_replacement_meta_val``,
``..._meta_copy_preserves_container_aliases``,
``..._meta_copy_does_not_run_custom_scalar_meta_value``,
``..._meta_copy_does_not_read_custom_class_descriptor``,
``..._meta_copy_snapshots_immutable_collections``,
``..._meta_copy_does_not_trust_jit_builtin_registry``.
"""

from __future__ import annotations

import collections
import operator
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import fxopt.patterns as fp
import pytest
import torch
from fxopt.patterns import replace_pattern, replace_pattern_with_filters
from fxopt.patterns.meta import propagate_meta
from torch._library.simple_registry import singleton as simple_registry
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import symbolic_trace
from torch.fx.annotate import annotate
from torch.fx.experimental.rewriter import RewritingTracer
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._python_dispatch import TorchDispatchMode

from fxopt.errors import PatternError


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


def _calls(gm: torch.fx.GraphModule) -> collections.Counter:
    """The ops a graph's outputs depend on, with multiplicity: its structure up to order
    and names (dead code, which torch.fx's rewriter leaves too, is not counted)."""
    live: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output" or any(user in live for user in node.users):
            live.add(node)
    return collections.Counter((n.op, n.target) for n in live if n.op.startswith("call_"))


def _check(traced, reference, *shapes, same_ops: bool = True) -> None:
    """``traced`` is a well-formed graph that calls ``reference``'s ops and computes its
    outputs on fresh random inputs of ``shapes`` (two draws)."""
    traced.graph.lint()
    if same_ops:
        assert _calls(traced) == _calls(reference)
    for _ in range(2):
        inputs = [torch.randn(shape) for shape in shapes]
        assert_equal(traced(*inputs), reference(*inputs))


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
    _check(traced, symbolic_trace(comparison), (1, 3))


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
    _check(traced, symbolic_trace(comparison), (1, 3))


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
    _check(traced, symbolic_trace(comparison), (1, 5))
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
    _check(traced, symbolic_trace(comparison), (1, 3))


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
    _check(traced, symbolic_trace(comparison), (1, 3), (1, 3), (1, 3))


def test_subgraph_rewriter_graph_argument_order():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.mm(x, y)

    def pattern(x, y):
        return torch.mm(x, y)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, pattern)
    _check(traced, symbolic_trace(pattern), (3, 4), (4, 5))


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
    _check(traced, symbolic_trace(comparison), (4, 4), (4, 4))


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
    _check(traced, symbolic_trace(comparison), (3, 4))


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
    _check(traced, symbolic_trace(replacement), (3, 4))


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
    _check(traced, symbolic_trace(comparison), (3, 4))


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
    assert res == []
    _check(traced, symbolic_trace(M()), (2, 3), (2, 3), (2, 3), (4, 4), (2, 3))


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
    _check(traced, symbolic_trace(comparison), (3, 4), same_ops=False)
    assert not any(n.target in ("dequantize", torch.sigmoid, "to") for n in traced.graph.nodes)


class _ReferencedSubmodules(torch.nn.Module):
    def __init__(self, act_name: str) -> None:
        super().__init__()
        self.sigmoid = torch.nn.Sigmoid()
        self.act_name = act_name
        setattr(self, act_name, torch.nn.ReLU())

    def forward(self, x):
        x = x + 1
        return getattr(self, self.act_name)(self.sigmoid(x))


@pytest.mark.parametrize("api", ["replace_pattern", "native"])
@pytest.mark.parametrize("act_name", ["submod", "act"], ids=["target_has_submod", "target_lacks_submod"])
def test_subgraph_rewriter_replaces_referenced_submodules(api, act_name):
    """Upstream's case (the target has ``submod``), and one where the replacement calls a
    submodule the target does not have: it is copied in."""

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

    traced = symbolic_trace(_ReferencedSubmodules(act_name))
    replacement = Replacement()
    if api == "native":
        assert fp.replace(traced, Pattern(), replacement) == 1
    else:
        assert len(replace_pattern(traced, Pattern(), replacement)) == 1
    # the native API installs the replacement's own module, under a fresh name if taken
    _check(traced, symbolic_trace(Comparison()), (3, 4), same_ops=api == "replace_pattern")
    called = [traced.get_submodule(n.target) for n in traced.graph.nodes if n.op == "call_module"]
    assert [type(m) for m in called] == [torch.nn.Tanh, torch.nn.ReLU]
    assert called[0] is traced.get_submodule("tanh")
    assert called[1] is not replacement.submod  # a copy, as torch.fx makes
    with pytest.raises(AttributeError, match="has no attribute"):
        traced.get_submodule("sigmoid")
    if api == "replace_pattern" or act_name == "act":
        assert called[1] is traced.get_submodule("submod")


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
    _check(traced, symbolic_trace(comparison), (3, 4))


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
    _check(traced, symbolic_trace(comparison), (3, 4))


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
    _check(traced, symbolic_trace(comparison), (3, 4))


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
    _check(traced, symbolic_trace(comparison), (3, 4), (3, 4))


def test_subgraph_rewriter_with_unused_args():
    class M(torch.nn.Module):
        def forward(self, x, y, z):
            return x + y

    def comparison(x1, x2, x3):
        return x1 - x2

    traced = symbolic_trace(M())
    replace_pattern(traced, lambda x, y: x + y, lambda x, y: x - y)
    assert len([n for n in traced.graph.nodes if n.op == "placeholder"]) == 3
    _check(traced, symbolic_trace(comparison), (3, 4), (3, 4), (3, 4))


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
    _check(traced, symbolic_trace(replacement), (3, 4))


def _initialized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its ``torch.empty`` parameters drawn, so outputs can be compared."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model


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

    model = _initialized(M())
    traced = symbolic_trace(model)
    matches = replace_pattern(traced, pattern, replacement)
    assert len(matches) == 1
    assert any(node.target is wrapped_gemm_bias_mul for node in traced.graph.nodes)
    _check(traced, model, (4, 128), same_ops=False)


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

    model = _initialized(M())
    traced = symbolic_trace(model)
    matches = replace_pattern(traced, gemm_bias_mul_pattern_with_c, gemm_bias_mul_replacement_with_c)
    assert len(matches) == 2
    assert sum(node.target is wrapped_gemm_bias_mul_with_c for node in traced.graph.nodes) == 2
    _check(traced, model, (4, 128), (4, 128), same_ops=False)


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


def _replace_once(api, gm, pattern, replacement) -> None:
    """One rewrite through torch.fx's entry point or fxopt's own."""
    if api == "native":
        assert fp.replace(gm, pattern, replacement) == 1
    else:
        assert len(replace_pattern(gm, pattern, replacement)) == 1


@pytest.mark.parametrize("api", ["replace_pattern", "native"])
def test_replace_pattern_populates_shape_changing_replacement_meta_val(api):
    gm = _export(_Relu(), torch.randn(2, 3))
    _replace_once(api, gm, _relu, lambda x: aten.reshape.default(x, [6]))
    val = _node(gm, aten.reshape.default).meta.get("val")
    assert isinstance(val, torch.Tensor) and val.shape == torch.Size([6])
    # a view of the input, as FakeTensor propagation gives: it shares the input's storage
    input_val = _placeholders(gm)[0].meta["val"]
    assert val.untyped_storage()._cdata == input_val.untyped_storage()._cdata


@pytest.mark.parametrize("api", ["replace_pattern", "native"])
def test_replace_pattern_populates_common_replacement_meta_val(api):
    cases = [(lambda x: x * x, operator.mul, [2, 3]),
             (lambda x: torch.mul(x, x), torch.mul, [2, 3]),
             (lambda x: aten.mul(x, x), aten.mul, [2, 3]),
             (lambda x: torch.ops.prims.mul.default(x, x), torch.ops.prims.mul.default, [2, 3]),
             (lambda x: torch.ops.prims.mul(x, x), torch.ops.prims.mul, [2, 3]),
             (lambda x: x.relu(), "relu", [2, 3]),
             (lambda x: x.add(x), "add", [2, 3]),
             (lambda x: x.reshape(3, 2), "reshape", [3, 2]),
             (lambda x: x.view(3, 2), "view", [3, 2]),
             (lambda x: torch.relu(x), torch.relu, [2, 3]),
             (lambda x: torch.cat((x, x), dim=0), torch.cat, [4, 3]),
             (lambda x: torch.reshape(x, (3, 2)), torch.reshape, [3, 2]),
             (lambda x: torch.stack((x, x), dim=0), torch.stack, [2, 2, 3]),
             (lambda x: torch.sin(x), torch.sin, [2, 3])]
    for replacement, target, shape in cases:
        gm = _export(_Neg(), torch.randn(2, 3))
        _replace_once(api, gm, _neg, replacement)
        val = _node(gm, target).meta.get("val")
        assert isinstance(val, torch.Tensor) and val.shape == torch.Size(shape), target


def test_replace_pattern_populates_getitem_replacement_meta_val():
    for replacement in (lambda x: aten.max.dim(x, 1)[0], lambda x: x[:, 0]):
        gm = _export(_Relu(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _relu, replacement)) == 1
        val = _node(gm, operator.getitem).meta.get("val")
        assert isinstance(val, torch.Tensor) and val.shape == torch.Size([2])


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
    # the latest revision's case: a plain attribute, annotated, then rebound
    root = torch.nn.Module()
    root.count = 2
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    count = graph.get_attr("count")
    graph.output(graph.call_function(operator.add, (x, count)))
    replacement_gm = torch.fx.GraphModule(root, graph)
    count.meta["val"] = 2
    replacement_gm.count = 3
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = torch.ones(2)
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    assert _node(gm, "count").meta["val"] == 3
    assert_equal(gm(torch.ones(2)), torch.full((2,), 4.0))


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
    # nested deeper than Python's recursion limit: skipped too, the rewrite still happens
    deep = [torch.randn(2, 3)]
    for _ in range(5000):
        deep = [deep]
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = deep
    assert len(replace_pattern(gm, _relu, _neg)) == 1
    assert "val" not in _node(gm, aten.neg.default).meta


def test_replace_pattern_meta_copy_does_not_inspect_custom_metaclass():
    accesses = 0

    class CustomMeta(type):
        def __getattribute__(cls, name):
            nonlocal accesses
            accesses += 1
            return super().__getattribute__(name)

        def __eq__(cls, other):
            nonlocal accesses
            accesses += 1
            return super().__eq__(other)

        def __hash__(cls):
            nonlocal accesses
            accesses += 1
            return super().__hash__()

    class CustomValue(metaclass=CustomMeta):
        pass

    value = CustomValue()
    accesses = 0
    node = _mul_after_custom_placeholder_meta(lambda i: value)
    assert accesses == 0 and "val" not in node.meta


def test_replace_pattern_meta_copy_does_not_inspect_custom_target():
    accesses = 0

    class CustomTarget:
        @property
        def __name__(self):
            nonlocal accesses
            accesses += 1
            return "sin"

        def __hash__(self):
            nonlocal accesses
            accesses += 1
            return id(self)

        def __call__(self, x):
            return x

    class CustomMethod(str):
        __slots__ = ()

        def __hash__(self):
            nonlocal accesses
            accesses += 1
            return super().__hash__()

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.randn(2, 3)
    function = graph.create_node("call_function", CustomTarget(), (x,), name="custom_function")
    method = graph.create_node("call_method", CustomMethod("relu"), (x,), name="custom_method")
    graph.output((function, method))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    accesses = 0
    propagate_meta(gm, [function, method])  # what a rewrite runs on the nodes it created
    assert accesses == 0
    assert "val" not in function.meta and "val" not in method.meta


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


def test_replace_pattern_preserves_preannotated_replacement_meta_val():
    """Differs on purpose: upstream keeps the annotated (2, 3) on a (4, 5) node; fxopt
    computes the node's value from the matched input and keeps an annotation only where
    it cannot (``..._preserves_unsupported_preannotated_meta_val``)."""
    replacement_gm = symbolic_trace(_neg)
    with FakeTensorMode() as mode:
        annotated = mode.from_tensor(torch.empty(2, 3))
    _node(replacement_gm, aten.neg.default).meta["val"] = annotated
    gm = _export(_Relu(), torch.randn(4, 5))
    assert len(replace_pattern(gm, _relu, replacement_gm)) == 1
    val = _node(gm, aten.neg.default).meta.get("val")
    assert val is not annotated and isinstance(val, FakeTensor) and val.shape == torch.Size([4, 5])


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


def test_replace_pattern_meta_copy_disables_ambient_dispatch_modes():
    calls = []

    class RecordingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    def replacement(x):
        value = aten.neg.default(x)
        return torch.ops.prims.mul.default(value, x).relu()

    gm = _export(_Relu(), torch.randn(2, 3))
    sentinel = torch.ones(1)
    with RecordingMode():
        matches = replace_pattern(gm, _relu, replacement)
        assert calls == []
        aten.neg.default(sentinel)
    assert len(matches) == 1
    assert calls == [aten.neg.default]
    for target in (aten.neg.default, torch.ops.prims.mul.default, "relu"):
        assert isinstance(_node(gm, target).meta.get("val"), FakeTensor)
    gm = _export(_Relu(), torch.randn(2, 3))
    with FakeTensorMode():
        assert len(replace_pattern(gm, _relu, replacement)) == 1
    assert isinstance(_node(gm, aten.neg.default).meta.get("val"), FakeTensor)


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
    # the latest revision annotates a node fxopt can evaluate: differs on purpose, the
    # annotation (not even a value) gives way to the computed one
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    replacement = graph.call_function(aten.neg.default, (x,))
    graph.output(replacement)
    replacement.meta["val"] = object()
    gm = _export(_Relu(), torch.randn(4, 5))
    assert len(replace_pattern(gm, _relu, graph)) == 1
    val = _node(gm, aten.neg.default).meta["val"]
    assert isinstance(val, FakeTensor) and val.shape == torch.Size([4, 5])


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


def test_replace_pattern_meta_copy_does_not_run_python_defined_builtin_fake():
    calls = 0
    for namespace in ("aten", "prims"):
        qualname = f"{namespace}::_subgraph_rewriter_test_custom"
        with torch.library._scoped_library(namespace, "FRAGMENT") as lib:
            torch.library.define(qualname, "(Tensor x) -> Tensor", lib=lib)

            @torch.library.register_fake(qualname, lib=lib)
            def custom_replacement_fake(x):
                nonlocal calls
                calls += 1
                return x.clone()

            packet = getattr(torch.ops, namespace)._subgraph_rewriter_test_custom
            for replacement, target in [(lambda x: packet.default(x), packet.default),  # noqa: B023
                                        (lambda x: packet(x), packet)]:  # noqa: B023
                gm = _export(_Relu(), torch.randn(2, 3))
                assert len(replace_pattern(gm, _relu, replacement)) == 1
                assert calls == 0 and "val" not in _node(gm, target).meta, (namespace, target)


def test_replace_pattern_meta_copy_skips_registered_aten_fake():
    lookup = "get" if hasattr(simple_registry, "get") else "find"  # torch 2.11's registry has only find
    real_lookup = getattr(simple_registry, lookup)
    fake_entry = mock.Mock()
    fake_entry.fake_impl.kernel = object()
    registered = {"aten::neg", "aten::mul.Scalar"}
    with mock.patch.object(simple_registry, lookup,
                           side_effect=lambda qualname: fake_entry if qualname in registered else real_lookup(qualname)):
        for replacement, target in ((lambda x: aten.neg.default(x), aten.neg.default), (lambda x: x.neg(), "neg"),
                                    (lambda x: aten.mul(x, x), aten.mul)):
            gm = _export(_Relu(), torch.randn(2, 3))
            assert len(replace_pattern(gm, _relu, replacement)) == 1
            node = _node(gm, target)
            if target == aten.mul:  # the overload that runs, mul.Tensor, has no Python fake kernel
                assert isinstance(node.meta.get("val"), FakeTensor)
            else:
                assert "val" not in node.meta, target


def test_replace_pattern_meta_copy_skips_python_dispatch_overrides():
    """The checks of :func:`_check_meta_copy_skips_python_dispatch_overrides`, in a child
    process: overriding ``aten::neg``'s Meta kernel outlives the scoped library that made it
    where ``neg`` had not run under a fake mode before (FakeTensor's ``neg`` then returns its
    input for the rest of the process), and no test may leave the process changed."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('suite', {__file__!r})\n"
            "suite = importlib.util.module_from_spec(spec)\n"
            "sys.modules['suite'] = suite\n"
            "spec.loader.exec_module(suite)\n"
            "suite._check_meta_copy_skips_python_dispatch_overrides()\n"
            "print('checked')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["checked"], out.stdout[-2000:] + out.stderr[-4000:]


def _check_meta_copy_skips_python_dispatch_overrides():
    calls = 0

    def evil(*args, **kwargs):
        nonlocal calls
        calls += 1
        return args[-1]

    gm = _export(_Relu(), torch.randn(2, 3))
    with torch.library._scoped_library("aten", "IMPL") as lib:
        lib.impl("neg", evil, "Meta", allow_override=True)
        torch.library.register_torch_dispatch(aten.neg.default, FakeTensorMode, evil, lib=lib)
        assert len(replace_pattern(gm, _relu, lambda x: x.neg())) == 1
    assert calls == 0 and "val" not in _node(gm, "neg").meta
    # each override alone is refused too
    for register in (lambda lib: lib.impl("neg", evil, "Meta", allow_override=True),
                     lambda lib: torch.library.register_torch_dispatch(aten.neg.default, FakeTensorMode, evil,
                                                                       lib=lib)):
        gm = _export(_Relu(), torch.randn(2, 3))
        with torch.library._scoped_library("aten", "IMPL") as lib:
            register(lib)
            assert len(replace_pattern(gm, _relu, lambda x: aten.neg.default(x))) == 1
        assert calls == 0 and "val" not in _node(gm, aten.neg.default).meta

    class DerivedFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal calls
            if func == aten.sin.default:
                calls += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    gm = symbolic_trace(_Relu())
    with DerivedFakeMode() as mode:
        _placeholders(gm)[0].meta["val"] = mode.from_tensor(torch.randn(2, 3))
    with torch.library._scoped_library("aten", "IMPL") as lib:
        torch.library.register_torch_dispatch(aten.sin.default, DerivedFakeMode, evil, lib=lib)
        assert len(replace_pattern(gm, _relu, lambda x: torch.sin(x))) == 1
    assert calls == 0 and "val" not in _node(gm, torch.sin).meta
    # without overrides, the same replacement gets its value
    gm = _export(_Relu(), torch.randn(2, 3))
    assert len(replace_pattern(gm, _relu, lambda x: x.neg())) == 1
    assert isinstance(_node(gm, "neg").meta.get("val"), FakeTensor)


def test_replace_pattern_meta_copy_skips_python_tensor_method():
    calls = 0

    def evil(self):
        nonlocal calls
        calls += 1
        return self

    original = torch.Tensor.neg
    torch.Tensor.neg = evil
    try:
        gm = _export(_Relu(), torch.randn(2, 3))
        assert len(replace_pattern(gm, _relu, lambda x: x.neg())) == 1
    finally:
        torch.Tensor.neg = original
    assert calls == 0 and "val" not in _node(gm, "neg").meta


def test_replace_pattern_meta_copy_skips_data_dependent_op():
    for replacement, target in ((lambda x: aten.nonzero.default(x), aten.nonzero.default),
                                (lambda x: aten.view.default(x, [2, -1]), aten.view.default),
                                (lambda x: aten.item.default(x), aten.item.default)):
        gm = _export(_Relu(), torch.randn(4, 3), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=3, max=8)}})
        fake_mode = _placeholders(gm)[0].meta["val"].fake_mode
        shape_env = fake_mode.shape_env
        before = (list(shape_env.pending_fresh_unbacked_symbols), shape_env.counter["ignored_backward_guard"],
                  dict(shape_env.var_to_range))
        assert len(replace_pattern(gm, _relu, replacement)) == 1
        assert before == (list(shape_env.pending_fresh_unbacked_symbols),
                          shape_env.counter["ignored_backward_guard"], dict(shape_env.var_to_range))
        assert fake_mode.allow_fallback_kernels
        assert "val" not in _node(gm, target).meta, target
    # static shapes: nonzero's output shape depends on the data
    gm = symbolic_trace(_Relu())
    _placeholders(gm)[0].meta["val"] = torch.randn(2, 3)
    assert len(replace_pattern(gm, _relu, lambda x: aten.nonzero.default(x))) == 1
    assert "val" not in _node(gm, aten.nonzero.default).meta


def test_replace_pattern_meta_without_error_on_new_guards(monkeypatch):
    """fxopt's own: torch 2.11's ShapeEnv has no ``error_on_new_guards`` (a frozen one only
    logs the guards it ignores); values that need a new guard are still refused, and the
    rest still computed, with the environment left as it was."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.delattr(ShapeEnv, "error_on_new_guards", raising=False)  # torch 2.11 has none anyway
    batch = {"x": {0: torch.export.Dim("batch", min=3, max=8)}}
    gm = _export(_Relu(), torch.randn(4, 3), dynamic_shapes=batch)
    shape_env = _placeholders(gm)[0].meta["val"].fake_mode.shape_env
    monkeypatch.delattr(shape_env, "_error_on_new_guards", raising=False)  # nor this flag
    before = (shape_env.counter["ignored_backward_guard"], dict(shape_env.var_to_range), shape_env.frozen)
    assert len(replace_pattern(gm, _relu, lambda x: aten.view.default(x, [2, -1]))) == 1
    assert "val" not in _node(gm, aten.view.default).meta
    assert before == (shape_env.counter["ignored_backward_guard"], dict(shape_env.var_to_range), shape_env.frozen)
    assert "_check_frozen" not in vars(shape_env)
    gm = _export(_Relu(), torch.randn(4, 3), dynamic_shapes=batch)
    assert len(replace_pattern(gm, _relu, lambda x: aten.neg.default(x))) == 1
    new, old = _node(gm, aten.neg.default).meta["val"], _placeholders(gm)[0].meta["val"]
    assert new.shape[0].node.expr == old.shape[0].node.expr and new.shape[1] == 3


def test_replace_pattern_meta_copy_disables_fallback_kernels():
    gm = _export(_Relu(), torch.randn(2, 3))
    fake_mode = _placeholders(gm)[0].meta["val"].fake_mode
    with mock.patch("torch._subclasses.fake_tensor.run_fallback_kernel") as fallback:
        assert len(replace_pattern(gm, _relu, lambda x: aten._foobar.default(x, False, False))) == 1
    fallback.assert_not_called()
    assert fake_mode.allow_fallback_kernels
    assert "val" not in _node(gm, aten._foobar.default).meta


def test_replace_pattern_meta_execution_context_is_serialized():
    """Rewrites in several threads on graphs whose values share one fake mode (with a
    shape environment): while one computes values, the mode refuses fallback kernels and
    new guards; each must find, and leave, the mode's settings as they were."""
    mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=torch.fx.experimental.symbolic_shapes.ShapeEnv())
    shape_env = mode.shape_env
    graphs = []
    for _ in range(16):
        gm = symbolic_trace(_Relu())
        _placeholders(gm)[0].meta["val"] = mode.from_tensor(torch.randn(2, 3))
        graphs.append(gm)

    def rewrite(gm):
        return len(replace_pattern(gm, _relu, lambda x: aten.mul.Tensor(aten.neg.default(x), x)))

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(rewrite, graphs)) == [1] * len(graphs)
    assert mode.allow_fallback_kernels and not getattr(shape_env, "_error_on_new_guards", False)
    assert not shape_env.frozen and "_check_frozen" not in vars(shape_env)
    for gm in graphs:
        assert isinstance(_node(gm, aten.mul.Tensor).meta.get("val"), FakeTensor)


def test_replace_pattern_meta_copy_skips_invalid_operator_inputs():
    for replacement, target in ((lambda x: torch.reshape(x, (3, 2)), torch.reshape),
                                (lambda x: torch.ops.prims.split_dim.default(x, 5, 2),
                                 torch.ops.prims.split_dim.default)):
        gm = symbolic_trace(_Relu())
        _placeholders(gm)[0].meta["val"] = torch.randn(4)
        assert len(replace_pattern(gm, _relu, replacement)) == 1
        gm.graph.lint()
        assert not any(node.target == aten.relu.default for node in gm.graph.nodes)
        assert "val" not in _node(gm, target).meta, target


def test_replace_pattern_meta_copy_skips_mixed_fake_modes():
    gm = symbolic_trace(_Add())
    for placeholder in _placeholders(gm):
        with FakeTensorMode() as mode:
            placeholder.meta["val"] = mode.from_tensor(torch.randn(4))
    assert len(replace_pattern(gm, _add, lambda x, y: aten.mul.Tensor(x, y))) == 1
    assert "val" not in _node(gm, aten.mul.Tensor).meta


def test_replace_pattern_meta_copy_skips_unsupported_tensor_metadata():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor.*")
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors.*")
        quantized = torch.quantize_per_tensor(torch.randn(2, 3), scale=0.1, zero_point=0, dtype=torch.qint8)
        nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    for unsupported in (quantized, nested):
        gm = symbolic_trace(_Relu())
        _placeholders(gm)[0].meta["val"] = unsupported
        assert len(replace_pattern(gm, _relu, _neg)) == 1
        assert "val" not in _node(gm, aten.neg.default).meta


def test_replace_pattern_meta_copy_preserves_cross_input_aliases():
    class M(torch.nn.Module):
        def forward(self, x):
            return aten.neg.default(x), aten.neg.default(x)

    gm = symbolic_trace(M())
    _placeholders(gm)[0].meta["val"] = torch.randn(2, 3)
    assert len(replace_pattern(gm, _neg, lambda x: aten.view.default(x, [6]))) == 2
    vals = [node.meta["val"] for node in gm.graph.nodes if node.target == aten.view.default]
    assert vals[0].untyped_storage()._cdata == vals[1].untyped_storage()._cdata
    # the earlier revision's case: one fake tensor as a container's key and as an argument

    class Lookup(torch.nn.Module):
        def forward(self, values, key):
            return values[key]

    gm = symbolic_trace(Lookup())
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))
    placeholders = _placeholders(gm)
    placeholders[0].meta["val"] = immutable_dict({fake: fake})
    placeholders[1].meta["val"] = fake
    assert len(replace_pattern(gm, lambda values, key: values[key], lambda values, key: values[key])) == 1
    assert _node(gm, operator.getitem).meta.get("val") is fake


def test_replace_pattern_meta_copy_preserves_container_aliases():
    """Earlier revision: a value sharing one container 2**18 ways is walked once per
    container, and what a replacement reads out of it keeps the sharing."""
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))
    value = [fake]
    for _ in range(18):
        value = [value, value]

    class First(torch.nn.Module):
        def forward(self, x):
            return x[0]

    gm = symbolic_trace(First())
    _placeholders(gm)[0].meta["val"] = value
    assert len(replace_pattern(gm, lambda x: x[0], lambda x: x[1])) == 1
    val = _node(gm, operator.getitem).meta["val"]
    assert val[0] is val[1]
    for _ in range(17):
        val = val[0]
    assert val[0] is fake


def test_replace_pattern_meta_copy_snapshots_immutable_collections():
    """Earlier revision: immutable containers keep their types and the aliasing between a
    key and an element."""
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))

    class Lookup(torch.nn.Module):
        def forward(self, values, key):
            return values[key]

    gm = symbolic_trace(Lookup())
    placeholders = _placeholders(gm)
    placeholders[0].meta["val"] = immutable_dict({fake: immutable_list([fake])})
    placeholders[1].meta["val"] = fake
    assert len(replace_pattern(gm, lambda values, key: values[key], lambda values, key: values[key])) == 1
    val = _node(gm, operator.getitem).meta["val"]
    assert type(val) is immutable_list and val[0] is fake


def test_replace_pattern_meta_copy_does_not_mutate_existing_meta_val():
    """Differs on purpose: an in-place replacement that writes into the caller's input is
    refused (upstream rewrites and leaves the new node without a value)."""
    for replacement in (lambda x: aten.transpose_.default(x, 0, 1), lambda x: aten.resize_.default(x, [100])):
        gm = _export(_Relu(), torch.randn(2, 3))
        original_val = _placeholders(gm)[0].meta["val"]
        original_storage_size = original_val.untyped_storage().nbytes()
        assert replace_pattern(gm, _relu, replacement) == []
        assert original_val.shape == torch.Size([2, 3])
        assert original_val.untyped_storage().nbytes() == original_storage_size
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


@pytest.mark.parametrize("api", ["replace_pattern_with_filters", "native"])
def test_replace_pattern_with_callback(api):
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)

    def pattern(x, y):
        return torch.add(x, y)

    def replacement(x, y):
        return torch.sub(torch.mul(x, y), y)

    traced = symbolic_trace(M())
    # the same replacement for every match, a new graph object each time
    if api == "native":
        assert fp.replace(traced, pattern, replacement_callback=lambda m: symbolic_trace(replacement).graph) == 1
        assert sum(n.target in (torch.sub, torch.mul) for n in traced.graph.nodes) == 2
    else:
        matches = replace_pattern_with_filters(
            traced, pattern, replacement_callback=lambda *args: symbolic_trace(replacement).graph)
        assert _replacement_nodes_match(traced, matches, {torch.sub, torch.mul}) == 2
    _check(traced, symbolic_trace(replacement), (3, 4), (3, 4))


def test_native_replacement_callback_chooses_per_match():
    """fxopt's own form of the callback: it sees fxopt's ``Match`` and may return any
    replacement (function, module, graph) whose parameters are pattern arguments."""

    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y) * torch.add(y, y)

    def doubled(x):
        return x * 2

    def difference(x, y):
        return torch.sub(x, torch.neg(y))

    seen = []

    def choose(m):
        seen.append(m.anchor.name)
        return doubled if m["x"] is m["y"] else difference

    rule = fp.rule(lambda x, y: torch.add(x, y), replacement_callback=choose)
    traced = symbolic_trace(M())
    assert fp.replace(traced, rule) == 2 and seen == ["add", "add_1"]
    assert not any(n.target is torch.add for n in traced.graph.nodes)
    assert sum(n.target is torch.sub for n in traced.graph.nodes) == 1
    _check(traced, symbolic_trace(M()), (3, 4), (3, 4), same_ops=False)
    # a replacement that does not fit the pattern is the rule's error; the graph is kept
    traced = symbolic_trace(M())
    before = str(traced.graph)
    with pytest.raises(PatternError, match="does not fit pattern"):
        fp.replace(traced, lambda x, y: torch.add(x, y), replacement_callback=lambda m: lambda z: z)
    assert str(traced.graph) == before
    with pytest.raises(PatternError, match="one of them"):
        fp.rule(lambda x, y: torch.add(x, y), difference, replacement_callback=choose)
