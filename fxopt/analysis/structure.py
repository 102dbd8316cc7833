"""Structural analyses: topological index and def-use chains."""

from __future__ import annotations

import torch.fx as fx

from fxopt.analysis.registry import register_analysis


@register_analysis("topo")
def topological_index(gm: fx.GraphModule, ctx: object) -> dict[fx.Node, int]:
    """Position of each node in the graph's (topological) order."""
    return {node: i for i, node in enumerate(gm.graph.nodes)}


@register_analysis("users")
def def_use(gm: fx.GraphModule, ctx: object) -> dict[fx.Node, list[fx.Node]]:
    """Each node's users in program order (fx keeps them as an unordered dict)."""
    order = topological_index(gm, ctx)
    return {node: sorted(node.users, key=order.__getitem__) for node in gm.graph.nodes}
