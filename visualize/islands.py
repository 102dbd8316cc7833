"""The changes of a diff as separate rewrites, and rewrites that repeat grouped.

A pass over a stack of 2,048 blocks makes the same rewrite 2,048 times. Drawing all of
them (with context, 10,000 nodes) takes Graphviz minutes and shows a reader nothing the
first one does not. So the changed nodes are split into *islands*, one per rewrite, and
islands whose drawing would differ only in names (:mod:`.names`) form one group: drawn
once, with its count and the list of where it happened.

What makes one rewrite: a removed node with the nodes that stand in for it
(``GraphDiff.replaced_by``), removed nodes that read each other (the matched pattern),
and new nodes that stand in for nothing (a folded weight's ``get_attr``) with the
changed nodes next to them. Two stand-ins that read each other (``add_relu_6`` reads
``add_relu_5`` through a residual) are two rewrites. An edge rewired between unchanged
nodes is a rewrite of its own when nothing else explains it. Everything here is linear in
the size of the diff.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import labels
from .diff import CHANGED, REWIRED, UNCHANGED, DiffItems, DiffView, GraphDiff
from .graph import module_path
from .names import Shape, blank, graph_names


@dataclass
class Island:
    """One rewrite: its changed nodes (``core``) and unchanged ones around them (``context``),
    as view keys (``"a:name"`` / ``"b:name"``) in drawing order."""

    core: list[str]
    context: list[str] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return self.core + self.context


@dataclass
class Group:
    """Islands that draw the same but for names; ``islands[0]`` is the example drawn."""

    islands: list[Island]


class _Sets:
    """Union-find over view keys."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        root = key
        while self.parent.setdefault(root, root) != root:
            root = self.parent[root]
        while self.parent[key] != root:
            self.parent[key], key = root, self.parent[key]
        return root

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def islands(diff: GraphDiff, view: DiffView, hops: int, hub_degree: int = 16) -> list[Island]:
    """The rewrites of ``diff`` (see the module doc), each with ``hops`` of context, in
    the order of their first node."""
    status, adjacency = view.status, view.adjacency
    order = {f"a:{n.name}": i for i, n in enumerate(diff.after.nodes)}
    order.update((f"b:{n.name}", len(order) + i) for i, n in enumerate(diff.before.nodes))
    core = {key for key, st in status.items() if st != UNCHANGED}
    # anchored: a removed node something stands in for, or a stand-in; those join a
    # rewrite only through replaced_by, the others (loose) through any changed neighbour
    anchored = {f"b:{b}" for b, names in diff.replaced_by.items() if names}
    anchored |= {f"a:{a}" for names in diff.replaced_by.values() for a in names}
    sets = _Sets()
    for key in core:
        sets.find(key)
    for removed, names in diff.replaced_by.items():
        for name in names:
            if f"a:{name}" in core:
                sets.union(f"b:{removed}", f"a:{name}")
    for source, user, st in view.edges:
        if source in core and user in core:
            if source not in anchored or user not in anchored:
                sets.union(source, user)
        elif st == REWIRED and not any(k in core for end in (source, user) for k in adjacency[end]):
            sets.union(source, user)  # a rewiring that no change next to it explains
    members: dict[str, list[str]] = {}
    for key in sorted(sets.parent, key=order.__getitem__):
        members.setdefault(sets.find(key), []).append(key)
    out = [Island(keys) for keys in members.values()]
    for island in out:
        island.context = sorted(_around(view, island.core, hops, hub_degree), key=order.__getitem__)
    return sorted(out, key=lambda i: order[i.core[0]])


def _around(view: DiffView, core: list[str], hops: int, hub_degree: int) -> set[str]:
    """The unchanged nodes within ``hops`` of ``core``, leaving out hubs (as the focus view
    does): the changes of the next rewrite are its own island, not this one's context."""
    adjacency, status = view.adjacency, view.status
    inside, seen = set(core), set(core)
    frontier = deque((key, 0) for key in core)
    while frontier:
        key, depth = frontier.popleft()
        if depth >= hops:
            continue
        for other in adjacency[key]:
            if other not in seen and status[other] == UNCHANGED and len(adjacency[other]) <= hub_degree:
                seen.add(other)
                frontier.append((other, depth + 1))
    return seen - inside


class Rewrites:
    """The islands of one diff and their groups; describes each node once."""

    def __init__(self, items: DiffItems, hops: int, hub_degree: int = 16):
        self.diff, self.view, self.node = items.diff, items.view, items.node
        self.b_nodes = items.b_nodes
        self.islands = islands(self.diff, self.view, hops, hub_degree)
        self._text: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._known = graph_names((self.diff.before, self.diff.after))

    def describe(self, key: str) -> tuple[str, tuple[str, ...]]:
        """What a drawing of the node shows (its label, and what a changed node was), with
        the names blanked out (:func:`.names.blank`)."""
        text = self._text.get(key)
        if text is None:
            node, st = self.node(key), self.view.status[key]
            root = self.diff.after_root if key[0] == "a" else self.diff.before_root
            parts = [st, node.name, node.op, labels.target_text(node, root), labels.args_text(node),
                     labels.value_text(labels.meta_value(node))]
            if st == CHANGED:
                old = self.b_nodes[self.diff.pairs[node.name]]
                parts += [labels.target_text(old, self.diff.before_root), labels.args_text(old)]
            text = self._text[key] = blank("\x02".join(parts), self._known)
        return text

    def groups(self) -> list[Group]:
        """The islands grouped by what their drawings show but for names, in order of first
        appearance."""
        edges: dict[str, list[tuple[str, str]]] = {}
        for source, user, st in self.view.edges:
            edges.setdefault(source, []).append((user, st))
        groups: dict[tuple, Group] = {}
        for island in self.islands:
            keys = island.keys
            index = {key: i for i, key in enumerate(keys)}
            shape = Shape()
            for key in keys:
                shape.add(self.describe(key))
            shape.parts.append((len(island.core), tuple(sorted(
                (index[s], index[u], st) for s in keys for u, st in edges.get(s, ()) if u in index))))
            groups.setdefault(shape.shape, Group([])).islands.append(island)
        return list(groups.values())

    def where(self, island: Island) -> str:
        """Where a rewrite happened: the module of its first changed node that has one (a
        node a pass made may have none), and its changed nodes."""
        paths = (module_path(self.node(key)) for key in island.core)
        scope = ".".join(next((p for p in paths if p), ())) or "(top level)"
        return f"{scope}: " + ", ".join(key[2:] for key in island.core)
