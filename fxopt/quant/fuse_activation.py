"""``fuse_int8_activation``: the activation after an int8 dynamic linear runs in its GEMM's epilogue.

::

    y = int8_dynamic_linear(x, w, s, b)           y = int8_dynamic_linear(x, w, s, b, "gelu")
    z = F.gelu(y)                          ->

Why: the dynamic linear is an opaque op (a Triton GEMM on CUDA, see
``fxopt.quant.int8_mm``), so Inductor cannot fuse the activation into it and would run
it as one more pass over the output. In a ViT's MLP that pass costs as much as a tenth
of the model (the ``[tokens, 3072]`` hidden activation, read and written in bf16). In
the epilogue it is a few instructions on values already in registers, computed in fp32
before the cast (at least as accurate as the unfused model).

Fused: ReLU, exact (erf) GELU and SiLU, as functions (``F.relu``, ``torch.relu``,
``F.gelu``, ``F.silu``, the aten ops) or modules (``nn.ReLU``, ``nn.GELU``, ``nn.SiLU``),
when the activation is the linear's only user and no other dynamic linear reads the same
input (see ``_has_sibling``). GELU's tanh approximation is left alone.

In ``fxopt.quant.accuracy_report`` a fused layer's row is named after the activation node
and compares the fused output with the float model's activation output; the next
layer's row then also carries this layer's error (its input is no longer a node the
report can reset to the float value), so it reads lower, never higher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.pass_protocol import Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.quant.ops import ops
from fxopt.quant.passes import SITE_KEY
from fxopt.registry import register_pass

aten = torch.ops.aten

_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu", torch.relu: "relu", aten.relu.default: "relu",
    F.gelu: "gelu", torch._C._nn.gelu: "gelu", aten.gelu.default: "gelu",
    F.silu: "silu", aten.silu.default: "silu",
}
_MODULES: dict[type, str] = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu"}


def activation_of(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The epilogue activation that ``node`` computes from its first input, or None."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        kind = _FUNCTIONS[node.target]
        names = ("approximate",) if kind == "gelu" else ("inplace",)
        if len(node.args) > 1 + len(names):
            return None
        extra = dict(zip(names, node.args[1:])) | dict(node.kwargs)
    elif node.op == "call_module" and type(gm.get_submodule(node.target)) in _MODULES:
        module = gm.get_submodule(node.target)
        kind = _MODULES[type(module)]
        extra = {"approximate": module.approximate} if kind == "gelu" else {}
        if node.kwargs or len(node.args) != 1:
            return None
    else:
        return None
    if kind == "gelu" and extra.pop("approximate", "none") != "none":
        return None
    extra.pop("inplace", None)  # in place on a value nobody else reads: same result
    return None if extra else kind


def _has_sibling(node: fx.Node) -> bool:
    """Whether another dynamic linear reads ``node``'s input (Llama's gate and up): left to
    ``merge_sibling_linears``, since one GEMM over both weights beats an epilogue on one."""
    return any(u is not node and u.target is node.target for u in node.args[0].users)


@register_pass
class FuseInt8Activation(Pass):
    """Move ReLU / GELU / SiLU after an int8 dynamic linear into its GEMM epilogue."""

    name = "fuse_int8_activation"
    preserves = ("shapes",)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        fused: dict[str, int] = {}
        for node in list(gm.graph.nodes):
            if (node.op != "call_function" or node.target is not ops.int8_dynamic_linear.default
                    or len(node.args) != 4 or node.kwargs or len(node.users) != 1):
                continue
            (act,) = node.users
            kind = activation_of(act, gm)
            if kind is None or act.args[0] is not node or _has_sibling(node):
                continue
            with gm.graph.inserting_before(act):
                new = gm.graph.call_function(ops.int8_dynamic_linear.default, (*node.args, kind))
            new.meta.update({k: v for k, v in act.meta.items() if k in ("val", "tensor_meta")})
            if SITE_KEY in node.meta:  # the accuracy report compares it with the float activation
                new.meta[SITE_KEY] = act.name
            act.replace_all_uses_with(new)
            record_replacement(new, [node, act], self.name)
            gm.graph.erase_node(act)
            gm.graph.erase_node(node)
            fused[kind] = fused.get(kind, 0) + 1
        return PassResult(bool(fused), {"fused": fused})
