"""Cheap snapshots of a GraphModule, for rollback and for before/after diffs.

Copying a graph with ``Graph.graph_copy`` costs about as much as a cheap pass, which
would make transactions expensive. Instead a snapshot records, per node, the immutable
pieces fx keeps anyway (op, target, args, kwargs, name, type) plus a shallow copy of
``meta`` — O(n) tuple building, no node creation. Only a rollback (rare) or a diff
(on demand) pays for rebuilding a graph from the records.

Module state is snapshotted as shallow copies of every submodule's ``__dict__``, and
parameter/buffer *data* is protected by version counters: passes create new tensors
rather than writing into existing ones, and the manager checks that they did.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

# Node fields a rebuild needs. They are read column by column with attrgetter/map, so the
# per-node work stays in C and a snapshot allocates no per-node objects besides metadata
# copies: this runs before every pass, and allocations here feed Python's cyclic GC, whose
# full collections over a large graph cost more than the snapshot itself.
_FIELDS = ("op", "target", "_args", "_kwargs", "name", "type")
_META = operator.attrgetter("meta")
_NO_META: dict = {}


def _copy_meta(meta: dict) -> dict:
    return meta.copy() if meta else _NO_META


@dataclass
class GraphSnapshot:
    """The structure of a graph at one moment; can rebuild an equal graph later."""

    nodes: list[fx.Node]
    #: one list per entry of _FIELDS, aligned with ``nodes``
    columns: tuple[list[Any], ...]
    metas: list[dict]
    codegen: Any
    tracer_cls: Any
    tracer_extras: Any

    @classmethod
    def take(cls, graph: fx.Graph) -> GraphSnapshot:
        nodes = list(graph.nodes)
        return cls(
            nodes=nodes,
            columns=tuple(list(map(operator.attrgetter(f), nodes)) for f in _FIELDS),
            metas=list(map(_copy_meta, map(_META, nodes))),
            codegen=graph._codegen,
            tracer_cls=getattr(graph, "_tracer_cls", None),
            tracer_extras=getattr(graph, "_tracer_extras", None),
        )

    def __len__(self) -> int:
        return len(self.nodes)

    def restore_meta(self) -> None:
        """Put back every recorded node's metadata (the nodes themselves are unchanged)."""
        for node, meta in zip(self.nodes, self.metas):
            node.meta = dict(meta)

    def build(self, owning_module: fx.GraphModule | None = None) -> fx.Graph:
        """A new graph with the recorded nodes, names and metadata."""
        graph = fx.Graph(owning_module, self.tracer_cls, self.tracer_extras)
        graph._codegen = self.codegen
        env: dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, name, type_, meta in zip(self.nodes, *self.columns, self.metas):
            new = graph.create_node(
                op, target, fx.map_arg(args, env.__getitem__), fx.map_arg(kwargs, env.__getitem__),
                name=name, type_expr=type_,
            )
            new.meta = dict(meta)
            env[node] = new
        return graph

    def to_graph_module(self, root: torch.nn.Module) -> fx.GraphModule:
        """A GraphModule over ``root``'s attributes with the recorded graph (for diffs).

        ``root`` must hold every attribute the recorded graph names: passes delete the
        weights they fold away (:func:`fxopt.graph_utils.drop_unused_attributes`), so an
        early snapshot rebuilds over the model given to the run, not over its result."""
        return fx.GraphModule(root, self.build())


class ModuleState:
    """Shallow copies of every submodule's attributes, plus tensor version counters."""

    def __init__(self, gm: fx.GraphModule):
        self.dicts = [(m, _copy_module_dict(m.__dict__)) for m in gm.modules()]
        # inference tensors have no version counter (and cannot be written outside
        # inference_mode), so they are not tracked
        self.versions = {id(t): (name, t, t._version) for name, t in _tensors(gm) if not t.is_inference()}

    def restore(self) -> None:
        for module, saved in self.dicts:
            module.__dict__.clear()
            module.__dict__.update(_copy_module_dict(saved))

    def mutated_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors (by qualified name) whose data was written since the snapshot."""
        return [(name, t) for name, t, version in self.versions.values() if t._version != version]


def _copy_module_dict(d: dict) -> dict:
    out = dict(d)
    for key in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        if key in out:
            out[key] = type(out[key])(out[key])
    return out


def _tensors(gm: fx.GraphModule):
    """Every tensor the module tree holds: parameters, buffers and plain attributes."""
    for prefix, module in gm.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                yield dot + key, value
        for key, value in {**module._parameters, **module._buffers}.items():
            if value is not None:
                yield dot + key, value


class TensorBackup:
    """A copy of parameter/buffer data, used only if a pass wrote into them in place.

    Taken once per run, and skipped above ``limit_bytes`` (a pass that then mutates a
    parameter is still reported, but its data cannot be restored).
    """

    def __init__(self, gm: fx.GraphModule, limit_bytes: int):
        tensors = {id(t): t for _, t in _tensors(gm)}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        self.enabled = total <= limit_bytes
        with torch.no_grad():
            self.copies = {i: t.detach().clone() for i, t in tensors.items()} if self.enabled else {}

    def restore(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        if not self.enabled:
            return False
        with torch.no_grad():
            for _, t in tensors:
                saved = self.copies.get(id(t))
                if saved is None:
                    return False
                t.copy_(saved)
        return True
