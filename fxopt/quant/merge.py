"""``merge_sibling_linears``: one quantized linear instead of several that read the same input.

Llama's gate and up projections (and attention's q, k and v) multiply one activation by
different weights. At small batch each is a GEMV bound by memory bandwidth, so what costs
is the number of launches and each kernel's ramp-up and drain, not the arithmetic:
concatenated along the output channels, the weights are read by one kernel with twice
the programs in flight, and the input is read once::

    g = int8_weight_only_linear(x, w_g, s_g, None)       y = int8_weight_only_linear(
    u = int8_weight_only_linear(x, w_u, s_u, None)   ->        x, cat(w_g, w_u), cat(s_g, s_u), None)
                                                          g = y.narrow(-1, 0, N_g)
                                                          u = y.narrow(-1, N_g, N_u)

The outputs become views of the merged result, which Inductor reads in place (the
SiLU-gated product that consumes them stays one pointwise kernel, or with
``fuse_swiglu`` moves into the GEMV itself). Quantized linears
are merged when they are the same op, read the same input node, agree on every other
argument (``dynamic_min_tokens``, ``group_size``) and have constant weights, scales and
biases (``get_attr`` nodes: what ``quantize`` emits). Per-channel (and per-group)
scales concatenate like the weights, so the merged op computes exactly what the
siblings did; a missing bias among biased siblings becomes zeros.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.graph_utils import drop_unused_attributes, fetch_attr, fresh_attr_name
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.quant.ops import ops
from fxopt.registry import register_pass

#: mergeable op -> positions of (weight, scale, bias) in its arguments (input first)
MERGEABLE: dict[Any, tuple[int, int, int]] = {
    ops.int8_weight_only_linear.default: (1, 2, 3),
    ops.int8_linear.default: (1, 2, 3),
    ops.int8_dynamic_linear.default: (1, 2, 3),
    ops.int4_weight_only_linear.default: (1, 2, 4),
}


def _constant(node: Any) -> bool:
    return node is None or (isinstance(node, fx.Node) and node.op == "get_attr")


def sibling_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Groups (in graph order, two or more each) of mergeable linears that may be merged."""
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in MERGEABLE or node.kwargs:
            continue
        w_i, s_i, b_i = MERGEABLE[node.target]
        if not all(_constant(node.args[i]) for i in (w_i, s_i, b_i)):
            continue
        others = tuple(a for i, a in enumerate(node.args) if i not in (0, w_i, s_i, b_i))
        groups[(node.target, node.args[0], others)].append(node)
    return [g for g in groups.values() if len(g) > 1]


@register_pass
class MergeSiblingLinears(Pass):
    """Merge quantized linears that read the same input into one, on concatenated weights.

    Run it after ``quantize``. Each merged group becomes one op whose output is split back
    with ``narrow`` views; see fxopt.quant.merge for the conditions.
    """

    name = "merge_sibling_linears"
    options = {
        "max_group": Option(int, 8, "merge at most this many siblings into one op"),
    }
    after = ("quantize",)
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        merged = 0
        for group in sibling_groups(gm):
            for start in range(0, len(group), self.options["max_group"]):
                chunk = group[start:start + self.options["max_group"]]
                if len(chunk) > 1:
                    _merge(gm, chunk, self.name)
                    merged += len(chunk)
        if merged:
            drop_unused_attributes(gm)  # the per-linear weights: not carried twice
        return PassResult(merged > 0, {"merged_linears": merged})


def _merge(gm: fx.GraphModule, group: list[fx.Node], pass_name: str) -> None:
    """Replace ``group`` by one op."""
    first = group[0]
    w_i, s_i, b_i = MERGEABLE[first.target]
    weights = [fetch_attr(gm, n.args[w_i].target) for n in group]
    scales = [fetch_attr(gm, n.args[s_i].target) for n in group]
    biases = [fetch_attr(gm, n.args[b_i].target) if n.args[b_i] is not None else None for n in group]
    sizes = [w.shape[0] for w in weights]
    graph = gm.graph
    with graph.inserting_before(first):
        args = list(first.args)
        args[w_i] = _constant_node(gm, f"{first.name}_merged_weight", torch.cat(weights))
        args[s_i] = _constant_node(gm, f"{first.name}_merged_scale", torch.cat(scales))
        present = [b for b in biases if b is not None]
        if present:
            filled = [b if b is not None else present[0].new_zeros(n) for b, n in zip(biases, sizes)]
            args[b_i] = _constant_node(gm, f"{first.name}_merged_bias", torch.cat(filled))
        out = graph.call_function(first.target, tuple(args))
    val = first.meta.get("val")
    if isinstance(val, torch.Tensor):
        out.meta["val"] = val.new_empty((*val.shape[:-1], sum(sizes)))
    record_replacement(out, group, pass_name)
    offset = 0
    anchor = out
    for node, size in zip(group, sizes):
        with graph.inserting_after(anchor):
            part = graph.call_function(torch.narrow, (out, -1, offset, size))
        anchor = part
        offset += size
        if "val" in node.meta:
            part.meta["val"] = node.meta["val"]
        record_replacement(part, [node], pass_name)
        node.replace_all_uses_with(part)
        graph.erase_node(node)


def _constant_node(gm: fx.GraphModule, name: str, value: torch.Tensor) -> fx.Node:
    name = fresh_attr_name(gm, name)
    gm.register_buffer(name, value)
    return gm.graph.get_attr(name)


_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
_SILU = (F.silu, torch.ops.aten.silu.default)


@register_pass
class FuseSwiGLU(Pass):
    """Compute ``silu(gate) * up`` inside a merged int8 weight-only linear: one kernel.

    Matches ``mul(silu(y.narrow(-1, 0, N)), y.narrow(-1, N, N))`` where ``y`` is an
    ``int8_weight_only_linear`` with 2N output channels read by nothing else (what
    ``merge_sibling_linears`` makes of Llama's gate and up projections) and replaces it
    with ``int8_weight_only_swiglu``: no ``[.., 2N]`` intermediate, no pointwise kernel.
    """

    name = "fuse_swiglu"
    after = ("merge_sibling_linears",)
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        fused = 0
        for node in list(gm.graph.nodes):
            match = _swiglu_match(gm, node)
            if match is None:
                continue
            linear, dead = match
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(ops.int8_weight_only_swiglu.default, linear.args)
            if "val" in node.meta:
                out.meta["val"] = node.meta["val"]
            record_replacement(out, [node, *dead], self.name)
            node.replace_all_uses_with(out)
            for old in (node, *dead):
                gm.graph.erase_node(old)
            fused += 1
        return PassResult(fused > 0, {"fused": fused})


def _narrow_of(node: Any) -> tuple[fx.Node, int, int] | None:
    """(source, start, length) of ``torch.narrow(source, -1, start, length)``, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.narrow):
        return None
    source, dim, start, length = node.args
    val = source.meta.get("val")
    last = dim == -1 or (isinstance(val, torch.Tensor) and dim == val.dim() - 1)
    return (source, start, length) if last and isinstance(start, int) and isinstance(length, int) else None


def _swiglu_match(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """For ``mul(silu(gate half), up half)`` of one weight-only linear: (the linear, the
    nodes the fused op makes dead, users first), else None."""
    if node.op != "call_function" or node.target not in _MUL or len(node.args) != 2 or node.kwargs:
        return None
    for act, up in (node.args, node.args[::-1]):
        if not (isinstance(act, fx.Node) and act.op == "call_function" and act.target in _SILU
                and not act.kwargs.get("inplace", False) and len(act.users) == 1):
            continue
        gate, up_part = _narrow_of(act.args[0]), _narrow_of(up)
        if gate is None or up_part is None or gate[0] is not up_part[0]:
            continue
        linear, n = gate[0], gate[2]
        if not (linear.op == "call_function" and linear.target is ops.int8_weight_only_linear.default
                and gate[1] == 0 and up_part[1:] == (n, n) and len(linear.users) == 2
                and len(act.args[0].users) == 1 and len(up.users) == 1 and act.args[0] is not up):
            continue
        w = linear.args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr" and fetch_attr(gm, w.target).shape[0] == 2 * n:
            return linear, [act, act.args[0], up, linear]
    return None
