"""Capture helpers for the pattern tests: the four ways users get graphs."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

CAPTURES = ("symbolic_trace", "dynamo", "export", "make_fx")


def capture(model: nn.Module, inputs: tuple, how: str) -> tuple[fx.GraphModule, tuple]:
    """``model`` as a GraphModule, and the arguments that graph takes for ``inputs``:
    torch level (``symbolic_trace``, ``dynamo``) or ATen level (``export``, ``make_fx``)."""
    if how == "symbolic_trace":
        return fx.symbolic_trace(model), inputs
    if how == "export":
        return torch.export.export(model, inputs).module(), inputs
    if how == "make_fx":
        return make_fx(model)(*inputs), inputs
    if how == "dynamo":
        return dynamo_graph(model, inputs)
    raise ValueError(how)


def dynamo_graph(model: nn.Module, inputs: tuple) -> tuple[fx.GraphModule, tuple]:
    """The torch-level graph Dynamo hands a backend (parameters arrive as placeholders),
    with the arguments Dynamo called it with."""
    graphs: list[tuple[fx.GraphModule, tuple]] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append((gm, tuple(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    (result,) = graphs
    return result


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics and affine parameters, so BN is no identity in eval."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if m.track_running_stats:
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.data.copy_(torch.rand(m.num_features, generator=g) * 0.4 - 0.2)
    return model


def ops(gm: fx.GraphModule) -> list[str]:
    """A readable list of what the graph calls (for structural assertions)."""
    names = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            names.append(str(getattr(n.target, "__name__", n.target)))
        elif n.op == "call_module":
            names.append(type(gm.get_submodule(n.target)).__name__)
    return names
