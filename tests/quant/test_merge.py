"""merge_sibling_linears on CPU: the merged graph computes what the siblings did, has one
quantized op per group of siblings, and carries no weight twice."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.quant as fq
from fxopt.quant.merge import MERGEABLE
from fxopt.quant.ops import ops


class GatedMLP(nn.Module):
    """Llama's MLP block: the gate and up projections read the same normalized input."""

    def __init__(self, d: int = 64, hidden: int = 128):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class QKV(nn.Module):
    """Three projections of one input; v has no bias, and k is also applied to a second input."""

    def __init__(self, d: int = 48):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, 32), nn.Linear(d, 16, bias=False)

    def forward(self, x, other):
        return self.q(x).sum(-1) + self.k(x).sum(-1) + self.v(x).sum(-1) + self.k(other).sum(-1)


def _count(gm: fx.GraphModule, targets) -> int:
    return sum(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def _merge(gm, example_inputs, **options):
    return fxopt.optimize(gm, [fxopt.get_pass_class("merge_sibling_linears")(**options)],
                          example_inputs=example_inputs)


def _buffer_bytes(gm: fx.GraphModule) -> int:
    return sum(b.numel() * b.element_size() for b in gm.buffers())


@pytest.mark.parametrize("mode,options", [("int8_weight_only", {}),
                                          ("int8_weight_only", {"dynamic_min_tokens": 4}),
                                          ("int8_dynamic", {}),
                                          ("int4_weight_only", {"group_size": 32})])
def test_gated_mlp_merges_gate_and_up(mode, options):
    model = nn.Sequential(GatedMLP(), GatedMLP()).eval()
    x = torch.randn(3, 64)
    # the quantize pass alone: no other pass (e.g. an activation fusion) between it and the merge
    q = fxopt.optimize(model, [fq.Quantize(mode=mode, **options)], example_inputs=(x,))
    before = {k: v.clone() for k, v in q.state_dict().items()}
    merged = _merge(q, (x,))
    targets = set(MERGEABLE)
    assert _count(q, targets) == 6 and _count(merged, targets) == 4
    assert _count(merged, {torch.narrow}) == 4
    # nothing carried twice, and the input model is left exactly as it was
    assert _buffer_bytes(merged) == _buffer_bytes(q)
    assert all(torch.equal(before[k], v) for k, v in q.state_dict().items())
    for m in (1, 2, 5, 9):  # both sides of dynamic_min_tokens
        xs = torch.randn(m, 64)
        torch.testing.assert_close(merged(xs), q(xs), rtol=1e-5, atol=1e-5)


def test_merged_weights_are_the_siblings_concatenated():
    model = GatedMLP().eval()
    x = torch.randn(2, 64)
    q = fq.quantize_model(model, (x,), "int8_weight_only")
    merged = _merge(q, (x,))
    (op,) = [n for n in merged.graph.nodes if n.target is ops.int8_weight_only_linear.default
             and n.args[1].target != "down_weight_int8"]
    w = getattr(merged, op.args[1].target)
    assert torch.equal(w, torch.cat([q.gate_weight_int8, q.up_weight_int8]))
    assert not hasattr(merged, "gate_weight_int8") and not hasattr(merged, "up_weight_int8")
    assert hasattr(merged, "down_weight_int8")


def test_qkv_missing_bias_becomes_zeros_and_shared_weight_stays():
    model = QKV().eval()
    x, other = torch.randn(4, 48), torch.randn(4, 48)
    q = fq.quantize_model(model, (x, other), "int8_weight_only")
    merged = _merge(q, (x, other))
    # q, k, v on x merge into one op; k on `other` stays, reading k's own int8 weight
    assert _count(q, {ops.int8_weight_only_linear.default}) == 4
    assert _count(merged, {ops.int8_weight_only_linear.default}) == 2
    lone = [n for n in merged.graph.nodes if n.target is ops.int8_weight_only_linear.default
            and n.args[0].name == "other"]
    assert len(lone) == 1 and hasattr(merged, lone[0].args[1].target)
    bias = [n for n in merged.graph.nodes if n.op == "get_attr" and "merged_bias" in n.target]
    assert len(bias) == 1 and torch.equal(getattr(merged, bias[0].target)[-16:], torch.zeros(16))
    xs, os_ = torch.randn(7, 48), torch.randn(7, 48)
    torch.testing.assert_close(merged(xs, os_), q(xs, os_), rtol=1e-5, atol=1e-5)


def test_max_group_limits_merges():
    model = QKV().eval()
    x = torch.randn(2, 48)
    q = fq.quantize_model(model, (x, x), "int8_weight_only")
    merged = _merge(q, (x, x), max_group=2)
    # q, k (merged) + v alone (a chunk of one) + k on `other`
    assert _count(merged, {ops.int8_weight_only_linear.default}) == 3


def _by_hand(dynamic_tokens: tuple[int, int], weight_is_input: bool = False) -> fx.GraphModule:
    """Two int8_linear siblings on one input, built directly."""
    root = nn.Module()
    for name in ("w1", "w2"):
        root.register_buffer(name, torch.randint(-127, 128, (8, 16), dtype=torch.int8))
        root.register_buffer(f"{name}_s", torch.rand(8) / 100)
    g = fx.Graph()
    x = g.placeholder("x")
    w_in = g.placeholder("w_in") if weight_is_input else None
    outs = []
    for i, name in enumerate(("w1", "w2")):
        w = w_in if (weight_is_input and i == 1) else g.get_attr(name)
        outs.append(g.call_function(ops.int8_linear.default,
                                    (x, w, g.get_attr(f"{name}_s"), None, dynamic_tokens[i])))
    g.output(g.call_function(torch.add, tuple(outs)))
    return fx.GraphModule(root, g).eval()


@pytest.mark.parametrize("tokens,weight_is_input", [((4, 8), False), ((4, 4), True)])
def test_siblings_that_differ_are_not_merged(tokens, weight_is_input):
    gm = _by_hand(tokens, weight_is_input)
    inputs = (torch.randn(3, 16),) + ((torch.randint(-127, 128, (8, 16), dtype=torch.int8),)
                                      if weight_is_input else ())
    merged = _merge(gm, inputs)
    assert _count(merged, {ops.int8_linear.default}) == 2
    record = fxopt.report_of(merged).records[-1]
    assert record.skipped is None and not record.changed


def test_same_arguments_merge_by_hand():
    gm = _by_hand((4, 4))
    merged = _merge(gm, (torch.randn(3, 16),))
    assert _count(merged, {ops.int8_linear.default}) == 1
    for m in (2, 6):
        x = torch.randn(m, 16)
        torch.testing.assert_close(merged(x), gm(x), rtol=1e-5, atol=1e-5)


def _fuse(gm, example_inputs):
    return fxopt.optimize(gm, ["merge_sibling_linears", "fuse_swiglu"], example_inputs=example_inputs)


def test_swiglu_fuses_into_one_op_per_block():
    model = nn.Sequential(GatedMLP(), GatedMLP()).eval()
    x = torch.randn(3, 64)
    q = fq.quantize_model(model, (x,), "int8_weight_only")
    fused = _fuse(q, (x,))
    assert _count(fused, {ops.int8_weight_only_swiglu.default}) == 2
    assert _count(fused, {ops.int8_weight_only_linear.default}) == 2  # the down projections
    assert _count(fused, {torch.narrow, F.silu}) == 0
    assert _buffer_bytes(fused) == _buffer_bytes(q)
    for m in (1, 4, 9):
        xs = torch.randn(m, 64)
        torch.testing.assert_close(fused(xs), q(xs), rtol=1e-5, atol=1e-5)


class UpFirst(GatedMLP):
    """The up projection computed first: the merged weight's first half is not the gate."""

    def forward(self, x):
        u = self.up(x)
        return self.down(F.silu(self.gate(x)) * u)


class GateReused(GatedMLP):
    """The gate's output is also read outside the SwiGLU product."""

    def forward(self, x):
        g = self.gate(x)
        return self.down(F.silu(g) * self.up(x)) + g.sum(-1, keepdim=True)


@pytest.mark.parametrize("cls", [UpFirst, GateReused])
def test_swiglu_needs_the_exact_pattern(cls):
    model = cls().eval()
    x = torch.randn(2, 64)
    q = fq.quantize_model(model, (x,), "int8_weight_only")
    fused = _fuse(q, (x,))
    assert _count(fused, {ops.int8_weight_only_swiglu.default}) == 0
    assert _count(fused, {torch.narrow}) == 2  # merged, not fused
    xs = torch.randn(5, 64)
    torch.testing.assert_close(fused(xs), q(xs), rtol=1e-5, atol=1e-5)
