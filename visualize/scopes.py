"""A graph's nodes arranged by module scope, for the whole-graph view of a large graph.

A node's scope is its module (:func:`.graph.module_path`: ``nn_module_stack``, or the
qualified name of a call_module / get_attr target). Nodes a pass created carry no
``nn_module_stack``; they take the scope their origins had in the graph as captured
(provenance, ``meta['fxopt.replaces']``: the deepest scope all their origins share), so a
fused ``linear_relu_5`` sits in ``blocks.5`` with the nodes it replaced.

A scope with more than :data:`CHUNK` entries (its own nodes and child scopes, in graph
order) shows them in runs of consecutive entries (*chunks*): 2,048 blocks become 64 runs
of 32, and those 2 runs of 32 runs, so that no drawing holds more than :data:`CHUNK`
boxes and each level opens in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch.fx as fx

from fxopt.provenance import PROVENANCE_KEY

from .graph import scope_of

#: the most boxes one level of the view draws
CHUNK = 32

Path = tuple[str, ...]


@dataclass
class Scope:
    """A module (or a run of a module's entries): what it holds, in graph order."""

    path: Path
    #: its own nodes and child scopes (or chunks), in order of their first node
    entries: list[fx.Node | Scope] = field(default_factory=list)
    #: every node inside, at any depth
    size: int = 0
    #: a run of its parent's entries rather than a module (``title`` says which)
    chunk: bool = False

    @property
    def name(self) -> str:
        if self.chunk:
            first, last = _bounds(self)
            return f"{first} … {last}"
        return ".".join(self.path) or "(top level)"

    def nodes(self) -> Iterable[fx.Node]:
        """Every node inside, in graph order within each entry."""
        for entry in self.entries:
            if isinstance(entry, Scope):
                yield from entry.nodes()
            else:
                yield entry


def _bounds(chunk: Scope) -> tuple[str, str]:
    def end(entry: fx.Node | Scope, last: bool) -> str:
        if isinstance(entry, fx.Node):
            return entry.name
        if entry.chunk:
            return _bounds(entry)[1 if last else 0]
        return ".".join(entry.path)

    return end(chunk.entries[0], False), end(chunk.entries[-1], True)


def origin_scopes(captured: fx.Graph) -> dict[str, Path]:
    """Node name -> scope, in the graph as captured (the first snapshot of the run)."""
    return {node.name: scope_of(node.op, node.target, node.meta) for node in captured.nodes}


def _common(paths: list[Path]) -> Path:
    first = paths[0]
    depth = len(first)
    for path in paths[1:]:
        depth = min(depth, len(path))
        for i in range(depth):
            if path[i] != first[i]:
                depth = i
                break
    return first[:depth]


def node_scope(node: fx.Node, origins: Mapping[str, Path]) -> Path:
    """The scope a node is drawn in (see the module doc)."""
    path = scope_of(node.op, node.target, node.meta)
    if path or node.op in ("placeholder", "output"):
        return path
    if node.op == "call_module" and isinstance(node.target, str):
        return tuple(p for p in node.target.split(".")[:-1])
    known = [origins[name] for name in node.meta.get(PROVENANCE_KEY, ()) if name in origins]
    return _common(known) if known else ()


def scope_tree(graph: fx.Graph, origins: Mapping[str, Path] | None = None) -> Scope:
    """The root scope of ``graph``, its modules nested, long entry lists chunked."""
    root = Scope(())
    scopes: dict[Path, Scope] = {(): root}
    for node in graph.nodes:
        path = node_scope(node, origins or {})
        scope = scopes.get(path)
        if scope is None:  # create it and any missing ancestor, each listed in its parent
            for depth in range(1, len(path) + 1):
                if path[:depth] not in scopes:
                    child = scopes[path[:depth]] = Scope(path[:depth])
                    scopes[path[:depth - 1]].entries.append(child)
            scope = scopes[path]
        scope.entries.append(node)
        for depth in range(len(path) + 1):
            scopes[path[:depth]].size += 1
    for scope in scopes.values():
        scope.entries = _chunked(scope)
    return root


def _chunked(scope: Scope) -> list[fx.Node | Scope]:
    entries = scope.entries
    while len(entries) > CHUNK:
        runs = []
        for i in range(0, len(entries), CHUNK):
            part = entries[i:i + CHUNK]
            size = sum(e.size if isinstance(e, Scope) else 1 for e in part)
            runs.append(Scope(scope.path, part, size, chunk=True) if len(part) > 1 else part[0])
        entries = runs
    return entries
