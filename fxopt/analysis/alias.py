"""Alias and mutation facts, by storage.

Two nodes alias when their (fake) tensors share a storage: views, reshapes that did not
copy, ``getitem`` of ``split``/``chunk``, ``contiguous()`` of a contiguous tensor. That
is decided by the FakeTensor run itself rather than by a table of view ops, so it is
right for ops we have never heard of; the op-facts model adds what a fake run cannot
show (``wait_tensor``'s result is its input's buffer; an unknown op may return an input). Mutation facts come from
:func:`fxopt.analysis.ops.mutated_inputs` (op schemas and torch-level spellings).

Storages that outlive the graph run are *external*: those of graph inputs (``inputs``)
and those of parameters, buffers and constants (``constants``), including the ones a
``call_module`` node reaches only inside its module. The ``saved_for_backward``
analysis says which nodes' storages autograd keeps for the backward pass, found by
running the graph on fake tensors under ``saved_tensors_hooks``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map

from fxopt.analysis.fake_lock import fake_mode_lock
from fxopt.analysis.ops import mutated_inputs, unseen_aliases
from fxopt.analysis.registry import register_analysis
from fxopt.analysis.shapes import call_module_on_copies, symbolic_dispatch


def traced_value(node: fx.Node) -> Any:
    """The value tracing recorded for ``node``: ``meta['val']``, else Dynamo's
    ``example_value`` (None when neither is there)."""
    return node.meta.get("val", node.meta.get("example_value"))


def written_storages(graph: fx.Graph) -> set[StorageWeakRef] | None:
    """Storages any node writes in place, whatever its kind of call (running statistics
    included); None if some written value is unknown."""
    written: set = set()
    for node in graph.nodes:
        for target in mutated_inputs(node):
            value = traced_value(target)
            if value is None:
                return None
            written |= storages_of(value)
    return written


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
    #: storages of graph inputs (placeholders): the caller sees writes to them
    inputs: set[StorageWeakRef] = field(default_factory=set)
    #: storages of parameters, buffers and constants (get_attr and module internals)
    constants: set[StorageWeakRef] = field(default_factory=set)

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
    mode = ctx.analysis("shapes")
    info = AliasInfo()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        found = storages_of(node.meta.get("val"))
        # what FakeTensor cannot show: wait_tensor returns its input's buffer, an unknown
        # op may return any of its inputs, and a node without a value may be anything
        may_share = unseen_aliases(node) if "val" in node.meta else node.all_input_nodes
        for source in may_share:
            found = found | info.storages.get(source, set())
        info.storages[node] = found
        for s in found:
            info.nodes_of[s].append(node)
        if node.op == "placeholder":
            info.inputs |= found
        elif node.op == "get_attr":
            info.constants |= found
    # the fake run converted each parameter/buffer once (memoized), so converting again
    # yields the very fake tensor the ops saw: a module output that is its own weight
    # (or a view of it) shares that storage
    if mode is not None:
        for tensor in (*gm.parameters(), *gm.buffers()):
            info.constants |= storages_of(mode.from_tensor(tensor, static_shapes=True))
    info.external = info.inputs | info.constants
    for node in gm.graph.nodes:
        written = set()
        for target in mutated_inputs(node):
            written |= info.storages.get(target, set())
        if written:
            info.writes[node] = written
    return info


class _SavedTensorRecorder(fx.Interpreter):
    """Runs a graph on fake tensors with grad on, noting which nodes' storages autograd saves."""

    def __init__(self, gm: fx.GraphModule, mode: Any):
        super().__init__(gm, garbage_collect_values=False)
        self.mode = mode
        self.owner: dict[StorageWeakRef, tuple[fx.Node, int]] = {}
        self.saved: dict[tuple[fx.Node, int], set[fx.Node]] = {}
        self.pending: list[StorageWeakRef] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pending.append(StorageWeakRef(tensor.untyped_storage()))
        return tensor

    def run_node(self, node: fx.Node) -> Any:
        self.pending = []
        result = super().run_node(node)
        if node.op in ("placeholder", "get_attr"):
            result = tree_map(self._trainable, result)
        for position, leaf in enumerate(tree_leaves(result)):
            if isinstance(leaf, torch.Tensor):
                self.owner.setdefault(StorageWeakRef(leaf.untyped_storage()), (node, position))
        # resolved after the node ran: an op may save its own result (sigmoid, relu, exp)
        for s in self.pending:
            owner = self.owner.get(s)
            if owner is not None:
                self.saved.setdefault(owner, set()).add(node)
        return result

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # parameters are trained; buffers (running statistics) never carry gradients
        return call_module_on_copies(self.fetch_attr(target), args, kwargs, self._trainable, self._fake)

    def _fake(self, x: torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, FakeTensor) else self.mode.from_tensor(x, static_shapes=True)

    def _trainable(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            x = self.mode.from_tensor(x, static_shapes=True)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
            # an inference tensor cannot require grad: a normal copy stands in for it
            x = (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)
        return x


@register_analysis("saved_for_backward")
def saved_for_backward(gm: fx.GraphModule, ctx: Any) -> dict[tuple[fx.Node, int], set[fx.Node]] | None:
    """Which storages autograd saves for backward when the graph runs with grad on.

    Keys are ``(node, leaf)``: the ``leaf``-th tensor of ``node``'s value (in pytree
    order) created the storage; values are the nodes whose backward keeps it.

    Every floating-point input is made to require grad, so the answer covers any way the
    graph may be differentiated. ``None`` means the fake run failed: callers must then
    assume that anything may be saved.
    """
    mode = ctx.analysis("shapes")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    recorder = _SavedTensorRecorder(gm, mode)
    inputs = [p.meta.get("val") for p in placeholders]
    try:
        with fake_mode_lock(mode), mode, torch.enable_grad(), symbolic_dispatch(inputs), \
                torch.autograd.graph.saved_tensors_hooks(recorder._pack, lambda t: t):
            recorder.run(*inputs, enable_io_processing=False)
    except Exception:
        return None
    return recorder.saved
