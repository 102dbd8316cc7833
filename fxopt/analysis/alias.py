"""Alias and mutation facts, by storage.

Two nodes alias when their (fake) tensors share a storage: views, reshapes that did not
copy, ``getitem`` of ``split``/``chunk``, ``contiguous()`` of a contiguous tensor. That
is decided by the FakeTensor run itself rather than by a table of view ops, so it is
right for ops we have never heard of. Mutation facts come from
:func:`fxopt.analysis.effects.mutated_inputs` (op schemas and torch-level spellings).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxopt.analysis.effects import mutated_inputs
from fxopt.analysis.manager import register_analysis


def storages_of(value: Any) -> set[StorageWeakRef]:
    """The storages of every tensor inside ``value`` (a tensor or a nested structure)."""
    return {
        StorageWeakRef(t.untyped_storage())
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor)
    }


@dataclass
class AliasInfo:
    """Which storages each node's value lives in, and who reads or writes each storage."""

    storages: dict[fx.Node, set[StorageWeakRef]] = field(default_factory=dict)
    nodes_of: dict[StorageWeakRef, list[fx.Node]] = field(default_factory=lambda: defaultdict(list))
    #: node -> storages it writes in place
    writes: dict[fx.Node, set[StorageWeakRef]] = field(default_factory=dict)
    #: storages that belong to graph inputs, parameters, buffers or constants
    external: set[StorageWeakRef] = field(default_factory=set)

    def may_alias(self, a: fx.Node, b: fx.Node) -> bool:
        return bool(self.storages.get(a, set()) & self.storages.get(b, set()))

    def aliases(self, node: fx.Node) -> list[fx.Node]:
        """All nodes whose value shares a storage with ``node``'s (``node`` included)."""
        out: dict[fx.Node, None] = {}
        for s in self.storages.get(node, ()):
            out.update(dict.fromkeys(self.nodes_of[s]))
        return list(out)


@register_analysis("alias")
def alias_analysis(gm: fx.GraphModule, ctx: Any) -> AliasInfo:
    """Storage-level aliasing of every node; needs (and triggers) the shapes analysis."""
    ctx.analysis("shapes")
    info = AliasInfo()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        found = storages_of(node.meta.get("val"))
        info.storages[node] = found
        for s in found:
            info.nodes_of[s].append(node)
        if node.op in ("placeholder", "get_attr"):
            info.external |= found
    for node in gm.graph.nodes:
        written = set()
        for target in mutated_inputs(node):
            written |= info.storages.get(target, set())
        if written:
            info.writes[node] = written
    return info
