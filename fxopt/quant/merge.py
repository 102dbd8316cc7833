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
SiLU-gated product that consumes them stays one pointwise kernel). Quantized linears
are merged when they are the same op, read the same input node, agree on every other
argument (``dynamic_min_tokens``, ``group_size``) and have constant weights, scales and
biases (``get_attr`` nodes: what ``quantize`` emits). Per-channel (and per-group)
scales concatenate like the weights, so the merged op computes exactly what the
siblings did; a missing bias among biased siblings becomes zeros.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from fxopt.graph_utils import fetch_attr, fresh_attr_name
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
        replaced: set[str] = set()
        for group in sibling_groups(gm):
            for start in range(0, len(group), self.options["max_group"]):
                chunk = group[start:start + self.options["max_group"]]
                if len(chunk) > 1:
                    replaced |= _merge(gm, chunk, self.name)
                    merged += len(chunk)
        _drop_unused_constants(gm, replaced)
        return PassResult(merged > 0, {"merged_linears": merged})


def _merge(gm: fx.GraphModule, group: list[fx.Node], pass_name: str) -> set[str]:
    """Replace ``group`` by one op; return the targets of the constants it no longer reads."""
    first = group[0]
    w_i, s_i, b_i = MERGEABLE[first.target]
    old = {n.args[i].target for n in group for i in (w_i, s_i, b_i) if n.args[i] is not None}
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
    return old


def _constant_node(gm: fx.GraphModule, name: str, value: torch.Tensor) -> fx.Node:
    name = fresh_attr_name(gm, name)
    gm.register_buffer(name, value)
    return gm.graph.get_attr(name)


def _drop_unused_constants(gm: fx.GraphModule, targets: set[str]) -> None:
    """Remove the now-unused get_attr nodes of ``targets`` and the buffers of ``gm`` that
    nothing reads any more, so the model does not carry each weight twice (a constant
    also read elsewhere, e.g. a shared weight, stays)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in targets and not node.users:
            gm.graph.erase_node(node)
    still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    own = dict(gm.named_buffers(recurse=False))
    for name in sorted(targets - still_read):
        if name in own:
            delattr(gm, name)
