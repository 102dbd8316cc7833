"""Liveness intervals, per node and per storage.

A value is live from the node that defines it to its last reader. Views merge with their
base (they share a storage, so the storage lives until the last use of *any* alias), and
anything the graph returns lives to the end. Memory planning sizes its arena from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxopt.analysis.registry import register_analysis


@dataclass(frozen=True)
class Interval:
    """Live on the closed range of program points ``[start, end]`` (topological indices)."""

    start: int
    end: int

    def overlaps(self, other: Interval) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass
class Liveness:
    nodes: dict[fx.Node, Interval]
    storages: dict[StorageWeakRef, Interval]


@register_analysis("liveness")
def liveness_analysis(gm: fx.GraphModule, ctx: Any) -> Liveness:
    order = ctx.analysis("topo")
    alias = ctx.analysis("alias")
    end = len(order) - 1
    nodes: dict[fx.Node, Interval] = {}
    for node, index in order.items():
        if node.op == "output":
            continue
        last = max((order[u] for u in node.users), default=index)
        if any(u.op == "output" for u in node.users):
            last = end
        nodes[node] = Interval(index, last)
    storages: dict[StorageWeakRef, Interval] = {}
    for node, interval in nodes.items():
        for s in alias.storages.get(node, ()):
            prev = storages.get(s)
            storages[s] = interval if prev is None else Interval(
                min(prev.start, interval.start), max(prev.end, interval.end)
            )
    for s in alias.external:  # inputs and parameters are live for the whole run
        storages[s] = Interval(0, end)
    return Liveness(nodes=nodes, storages=storages)
