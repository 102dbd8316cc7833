"""Deliberately broken passes: the detection-power benchmark of fxopt.testing.

Each is the kind of bug a real rewrite has: a fold with the wrong epsilon, swapped
operands, a dropped bias, an in-place write into an input, the wrong ``cat`` axis, a
reshape that keeps the element count but not the meaning, a DCE that forgets in-place
ops, a CSE that ignores mutation, a constant folder that bakes in the example input...
They are plain functions (``fxopt.optimize`` wraps them) or Pass subclasses, rewrite
the torch-level graphs ``symbolic_trace`` gives, and record provenance like real passes.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.provenance import record_replacement

BROKEN: dict[str, Any] = {}


def broken(fn: Callable) -> Callable:
    BROKEN[fn.__name__] = fn
    return fn


# --- helpers --------------------------------------------------------------------------


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _nodes(gm: fx.GraphModule, predicate: Callable[[fx.Node], bool]) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if predicate(n)]


def _replace(gm: fx.GraphModule, node: fx.Node, target: Any, args: tuple, kwargs: dict | None = None,
             op: str = "call_function", name: str = "broken") -> fx.Node:
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node(op, target, args, kwargs or {})
    node.replace_all_uses_with(new)
    record_replacement(new, [node], name)
    gm.graph.erase_node(node)
    return new


def _attach(gm: fx.GraphModule, module: nn.Module, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.add_module(name, module)
    return name


def _targets(*targets: Any) -> Callable[[fx.Node], bool]:
    def match(node: fx.Node) -> bool:
        try:
            return node.op in ("call_function", "call_method") and node.target in targets
        except TypeError:
            return False

    return match


def _of_type(gm: fx.GraphModule, kind: type) -> Callable[[fx.Node], bool]:
    return lambda n: isinstance(_module(gm, n), kind)


def _retarget(gm: fx.GraphModule, match: Callable[[fx.Node], bool], target: Any) -> None:
    for node in _nodes(gm, match):
        node.target = target


def _set_arg(node: fx.Node, index: int, value: Any) -> None:
    args = list(node.args)
    args[index] = value
    node.args = tuple(args)


# --- conv + batch norm folding, wrong in six ways -------------------------------------


def _fold_conv_bn(gm: fx.GraphModule, *, eps: float | None = None, use_mean: bool = True,
                  use_shift: bool = True, take_sqrt: bool = True, keep_conv_bias: bool = True,
                  axis: int = 0) -> None:
    for bn_node in _nodes(gm, _of_type(gm, nn.BatchNorm2d)):
        conv_node = bn_node.args[0]
        conv = _module(gm, conv_node) if isinstance(conv_node, fx.Node) else None
        if not isinstance(conv, nn.Conv2d) or len(conv_node.users) != 1:
            continue
        bn = _module(gm, bn_node)
        var = bn.running_var + (bn.eps if eps is None else eps)
        scale = bn.weight / (var.sqrt() if take_sqrt else var)
        if axis == 1 and conv.in_channels != conv.out_channels:
            continue
        fused = copy.deepcopy(conv)
        shape = [1] * 4
        shape[axis] = -1
        bias = conv.bias if conv.bias is not None and keep_conv_bias else torch.zeros_like(bn.running_mean)
        mean = bn.running_mean if use_mean else torch.zeros_like(bn.running_mean)
        with torch.no_grad():
            fused.weight = nn.Parameter(conv.weight * scale.reshape(shape))
            fused.bias = nn.Parameter((bias - mean) * scale + (bn.bias if use_shift else 0))
        conv_node.target = _attach(gm, fused, "fused_conv")
        bn_node.replace_all_uses_with(conv_node)
        record_replacement(conv_node, [bn_node], "fold_conv_bn")
        gm.graph.erase_node(bn_node)


@broken
def fold_bn_wrong_eps(gm):
    _fold_conv_bn(gm, eps=1e-3)


@broken
def fold_bn_ignores_running_mean(gm):
    _fold_conv_bn(gm, use_mean=False)


@broken
def fold_bn_divides_by_variance(gm):
    _fold_conv_bn(gm, take_sqrt=False)


@broken
def fold_bn_drops_shift(gm):
    _fold_conv_bn(gm, use_shift=False)


@broken
def fold_bn_drops_conv_bias(gm):
    _fold_conv_bn(gm, keep_conv_bias=False)


@broken
def fold_bn_scales_input_channels(gm):
    _fold_conv_bn(gm, axis=1)


# --- module-level rewrites -------------------------------------------------------------


@broken
def batchnorm_as_identity(gm):
    for node in _nodes(gm, _of_type(gm, nn.BatchNorm2d)):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


@broken
def batchnorm_wrong_eps(gm):
    for node in _nodes(gm, _of_type(gm, nn.BatchNorm2d)):
        bn = copy.deepcopy(_module(gm, node))
        bn.eps = 1e-3
        node.target = _attach(gm, bn, "bn_eps")


@broken
def layernorm_wrong_eps(gm):
    for node in _nodes(gm, _of_type(gm, nn.LayerNorm)):
        ln = copy.deepcopy(_module(gm, node))
        ln.eps = 1e-3
        node.target = _attach(gm, ln, "ln_eps")


@broken
def layernorm_drops_affine(gm):
    for node in _nodes(gm, _of_type(gm, nn.LayerNorm)):
        ln = _module(gm, node)
        _replace(gm, node, F.layer_norm, (node.args[0], ln.normalized_shape, None, None, ln.eps))


@broken
def linear_drops_bias(gm):
    for node in _nodes(gm, _of_type(gm, nn.Linear)):
        lin = _module(gm, node)
        if lin.bias is not None:
            with gm.graph.inserting_before(node):
                w = gm.graph.get_attr(f"{node.target}.weight")
            _replace(gm, node, F.linear, (node.args[0], w))


@broken
def linear_transposed_weight(gm):
    for node in _nodes(gm, _of_type(gm, nn.Linear)):
        lin = _module(gm, node)
        if lin.in_features == lin.out_features:
            with gm.graph.inserting_before(node):
                w = gm.graph.get_attr(f"{node.target}.weight")
                wt = gm.graph.call_method("t", (w,))
                b = gm.graph.get_attr(f"{node.target}.bias") if lin.bias is not None else None
            _replace(gm, node, F.linear, (node.args[0], wt, b))


@broken
def conv_drops_bias(gm):
    for node in _nodes(gm, _of_type(gm, nn.Conv2d)):
        conv = _module(gm, node)
        if conv.bias is not None:
            stripped = copy.deepcopy(conv)
            stripped.bias = None
            node.target = _attach(gm, stripped, "conv_nobias")


@broken
def conv_flipped_kernel(gm):
    for node in _nodes(gm, _of_type(gm, nn.Conv2d)):
        conv = copy.deepcopy(_module(gm, node))
        if conv.kernel_size[1] > 1:
            conv.weight = nn.Parameter(conv.weight.detach().flip(-1))
            node.target = _attach(gm, conv, "conv_flip")


@broken
def conv_wrong_padding(gm):
    for node in _nodes(gm, _of_type(gm, nn.Conv2d)):
        conv = copy.deepcopy(_module(gm, node))
        if conv.padding != (0, 0):
            conv.padding = (0, 0)
            node.target = _attach(gm, conv, "conv_pad")


@broken
def conv_transpose_drops_bias(gm):
    for node in _nodes(gm, _of_type(gm, nn.ConvTranspose2d)):
        conv = copy.deepcopy(_module(gm, node))
        conv.bias = None
        node.target = _attach(gm, conv, "convt_nobias")


@broken
def relu_module_dropped(gm):
    for node in _nodes(gm, _of_type(gm, nn.ReLU)):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


@broken
def relu_becomes_leaky(gm):
    for node in _nodes(gm, _targets(F.relu, torch.relu)):
        _replace(gm, node, F.leaky_relu, (node.args[0], 0.1))


@broken
def eval_dropout_becomes_scaling(gm):
    """Old-style inference dropout: scales by (1 - p), which nn.Dropout never does in eval."""
    for node in _nodes(gm, _of_type(gm, nn.Dropout)):
        _replace(gm, node, operator.mul, (node.args[0], 1 - _module(gm, node).p))


@broken
def tanh_becomes_sigmoid(gm):
    for node in _nodes(gm, _of_type(gm, nn.Tanh)):
        _replace(gm, node, torch.sigmoid, (node.args[0],))


@broken
def gelu_tanh_approximation(gm):
    for node in _nodes(gm, _targets(F.gelu)):
        node.kwargs = {**node.kwargs, "approximate": "tanh"}


@broken
def gelu_becomes_relu(gm):
    _retarget(gm, _targets(F.gelu), F.relu)


@broken
def maxpool_becomes_avgpool(gm):
    _retarget(gm, _targets(F.max_pool2d), F.avg_pool2d)


@broken
def interpolate_bilinear(gm):
    for node in _nodes(gm, _targets(F.interpolate)):
        node.kwargs = {**node.kwargs, "mode": "bilinear"}


# --- arithmetic -------------------------------------------------------------------------


@broken
def swap_sub_operands(gm):
    for node in _nodes(gm, _targets(operator.sub, torch.sub)):
        _replace(gm, node, node.target, (node.args[1], node.args[0]))


@broken
def add_becomes_sub(gm):
    _retarget(gm, _targets(operator.add, torch.add), operator.sub)


@broken
def mul_becomes_add(gm):
    _retarget(gm, _targets(operator.mul), operator.add)


@broken
def div_becomes_mul(gm):
    _retarget(gm, _targets(operator.truediv), operator.mul)


@broken
def drops_residual_add(gm):
    for node in _nodes(gm, _targets(operator.add)):
        if all(isinstance(a, fx.Node) for a in node.args):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


@broken
def attention_scale_without_sqrt(gm):
    for node in _nodes(gm, _targets(operator.pow)):
        if node.args[1] == 0.5:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


@broken
def amax_drops_keepdim(gm):
    """(b, h, t, t).amax(-1) without keepdim broadcasts along the wrong axis."""
    for node in _nodes(gm, _targets("amax", torch.amax)):
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "keepdim"}
        node.args = node.args[:2]


@broken
def sum_becomes_mean(gm):
    _retarget(gm, _targets("sum"), "mean")


@broken
def sigmoid_becomes_tanh(gm):
    for node in _nodes(gm, _targets("sigmoid", torch.sigmoid)):
        node.target = "tanh" if node.op == "call_method" else torch.tanh


@broken
def mean_over_wrong_dims(gm):
    for node in _nodes(gm, _targets("mean")):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim == (2, 3):
            node.args, node.kwargs = (node.args[0],), {**node.kwargs, "dim": (1, 2)}


# --- softmax and attention --------------------------------------------------------------


@broken
def softmax_wrong_dim(gm):
    for node in _nodes(gm, _targets(torch.softmax, F.softmax, "softmax")):
        node.kwargs = {**node.kwargs, "dim": -2}


@broken
def log_softmax_becomes_softmax(gm):
    _retarget(gm, _targets(torch.log_softmax), torch.softmax)


@broken
def mask_fill_value_zero(gm):
    for node in _nodes(gm, _targets("masked_fill")):
        _set_arg(node, 2, 0.0)


@broken
def mask_inverted(gm):
    _retarget(gm, _targets(operator.eq), operator.ne)


@broken
def sdpa_drops_causal_mask(gm):
    for node in _nodes(gm, _targets(F.scaled_dot_product_attention)):
        node.kwargs = {**node.kwargs, "is_causal": False}


@broken
def swaps_query_and_key(gm):
    for node in _nodes(gm, lambda n: n.target is operator.getitem and n.args[1] in (0, 1)):
        source = node.args[0]
        if isinstance(source, fx.Node) and source.target == "chunk":
            _set_arg(node, 1, 1 - node.args[1])


# --- shapes -------------------------------------------------------------------------------


@broken
def reshape_heads_wrong(gm):
    """view(b, t, heads, d) becomes view(b, heads, t, d): same size, scrambled meaning."""
    for node in _nodes(gm, _targets("view")):
        if len(node.args) == 5:
            x, b, t, h, d = node.args
            node.args = (x, b, h, t, d)


@broken
def transpose_wrong_dims(gm):
    for node in _nodes(gm, _targets("transpose", torch.transpose)):
        if node.args[1:] == (1, 2):
            node.args = (node.args[0], 2, 3)


@broken
def permute_wrong_order(gm):
    for node in _nodes(gm, _targets("permute")):
        dims = list(node.args[1:])
        if len(dims) > 2:
            dims[-1], dims[-2] = dims[-2], dims[-1]
            node.args = (node.args[0], *dims)


@broken
def flatten_wrong_start(gm):
    for node in _nodes(gm, _targets("flatten", torch.flatten)):
        if len(node.args) > 1 and node.args[1] > 0:
            _set_arg(node, 1, node.args[1] - 1)


@broken
def cat_wrong_axis(gm):
    for node in _nodes(gm, _targets(torch.cat)):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        node.args, node.kwargs = (node.args[0],), {"dim": dim - 1}


@broken
def cat_reversed_order(gm):
    for node in _nodes(gm, _targets(torch.cat)):
        _set_arg(node, 0, list(reversed(node.args[0])))


@broken
def slice_off_by_one(gm):
    for node in _nodes(gm, _targets(operator.getitem)):
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        shifted = tuple(slice(s.start + 1 if s.start else 1, s.stop + 1 if isinstance(s.stop, int) else s.stop)
                        if isinstance(s, slice) and s.stop is not None else s for s in items)
        if shifted != items:
            _set_arg(node, 1, shifted if isinstance(index, tuple) else shifted[0])


@broken
def swaps_outputs(gm):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [a for a in output.all_input_nodes]
    if len(leaves) >= 2:
        a, b = leaves[:2]
        output.args = fx.map_arg(output.args, lambda n: b if n is a else a if n is b else n)


@broken
def output_becomes_zeros(gm):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first = output.all_input_nodes[0]
    with gm.graph.inserting_before(output):
        zeros = gm.graph.call_function(torch.zeros_like, (first,))
    output.args = fx.map_arg(output.args, lambda n: zeros if n is first else n)


# --- mutation -------------------------------------------------------------------------


_INPLACE = {operator.mul: "mul_", operator.add: "add_", F.relu: "relu_", torch.relu: "relu_"}


@broken
def inplace_on_an_input(gm):
    """Computes ``x * s`` as ``x.mul_(s)``: the output is right, the caller's ``x`` is not."""
    for node in _nodes(gm, lambda n: n.op == "call_function" and n.target in _INPLACE):
        if isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
            _replace(gm, node, _INPLACE[node.target], node.args, op="call_method")
            return


@broken
def inplace_before_a_later_use(gm):
    """Writes in place into a value that a later node still reads."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in _nodes(gm, lambda n: n.op == "call_function" and n.target in _INPLACE):
        source = node.args[0]
        if isinstance(source, fx.Node) and source.op != "placeholder" and \
                any(order[u] > order[node] for u in source.users):
            _replace(gm, node, _INPLACE[node.target], node.args, op="call_method")


@broken
def copy_becomes_add(gm):
    _retarget(gm, _targets("copy_"), "add_")


@broken
def dce_forgets_inplace(gm):
    """torch's own Graph.eliminate_dead_code drops in-place ops whose result is unused."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("call_function", "call_method") and not node.users:
            gm.graph.erase_node(node)


@broken
def cse_ignores_mutation(gm):
    """Merges identical computations even when an in-place write lies between them."""
    seen: dict[Any, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or str(node.target).endswith("_"):
            continue
        key = (node.op, node.target, node.args, tuple(node.kwargs.items()))
        try:
            twin = seen.setdefault(key, node)
        except TypeError:
            continue
        if twin is not node:
            node.replace_all_uses_with(twin)
            record_replacement(twin, [node], "cse_ignores_mutation")
            gm.graph.erase_node(node)


class FoldExampleInputs(fxopt.Pass):
    """Constant-folds everything, *placeholders included*, using the example inputs:
    right on those inputs, wrong on any other."""

    name = "fold_example_inputs"

    def run(self, gm, ctx):
        if ctx.example_inputs is None:
            return False
        result = fx.Interpreter(gm).run(*ctx.example_inputs)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        flat, spec = torch.utils._pytree.tree_flatten(result)
        with gm.graph.inserting_before(output):
            nodes = []
            for i, value in enumerate(flat):
                gm.register_buffer(f"_baked_{i}", value.detach().clone())
                nodes.append(gm.graph.get_attr(f"_baked_{i}"))
        output.args = (torch.utils._pytree.tree_unflatten(nodes, spec),)
        for node in reversed(list(gm.graph.nodes)):
            if node.op not in ("output", "placeholder", "get_attr") and not node.users:
                gm.graph.erase_node(node)
        return True


BROKEN["fold_example_inputs"] = FoldExampleInputs()


@broken
def expand_becomes_zero_padding(gm):
    for node in _nodes(gm, _targets("expand")):
        with gm.graph.inserting_after(node):
            padded = gm.graph.call_function(F.pad, (node, (0, 0, 0, 1)))
        with gm.graph.inserting_after(padded):
            trimmed = gm.graph.call_function(operator.getitem, (padded, slice(1, None)))
        node.replace_all_uses_with(trimmed, delete_user_cb=lambda u, keep=padded: u is not keep)


@broken
def std_epsilon_in_layernorm(gm):
    """Rewrites layer_norm into primitives, but adds eps to the std instead of the variance."""
    for node in _nodes(gm, _of_type(gm, nn.LayerNorm)):
        ln = _module(gm, node)
        x = node.args[0]
        with gm.graph.inserting_before(node):
            mean = gm.graph.call_method("mean", (x, -1), {"keepdim": True})
            centered = gm.graph.call_function(operator.sub, (x, mean))
            std = gm.graph.call_method("std", (x, -1), {"keepdim": True, "correction": 0})
            normed = gm.graph.call_function(operator.truediv, (centered, gm.graph.call_function(
                operator.add, (std, math.sqrt(ln.eps) * 100))))
            w = gm.graph.get_attr(f"{node.target}.weight")
            b = gm.graph.get_attr(f"{node.target}.bias")
            out = gm.graph.call_function(operator.add, (gm.graph.call_function(operator.mul, (normed, w)), b))
        node.replace_all_uses_with(out)
        record_replacement(out, [node], "decompose_layer_norm")
        gm.graph.erase_node(node)
