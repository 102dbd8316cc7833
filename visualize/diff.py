"""Before/after diffs of a rewrite: which nodes were added, removed, changed, rewired.

Pairing a node after a rewrite with the node it was before goes in this order:

1. **Name.** fx never reuses a name within a graph, and a rewrite done in place
   (every fxopt pass; most hand-written ones on a copy) keeps the names of the nodes it
   does not replace, so a same-named node is the same node.
2. **Provenance.** ``meta['fxopt.replaces']`` (:mod:`fxopt.provenance`) lists the
   original nodes a new node stands for; a removed node is *stood in for* by the after
   node whose origins contain all of its own.
3. **Redirected uses** (structural fallback, for rewrites that record no provenance):
   if a removed node's users now read some other node in the same argument slot, that
   node stands in for it — that is what ``replace_all_uses_with`` leaves behind.
4. A new node that stands in for exactly one removed node (and is its only stand-in)
   is that node, rewritten: ``relu -> gelu``, ``mul -> folded constant``. A node that
   stands in for several (a fusion) is *added*, and they are *removed*.
5. Leftover new and removed nodes with the same op, target and (paired) inputs, or
   failing that the same inputs, are paired too (a graph rebuilt with fresh names).

A paired node is **changed** when its op, target or constant arguments differ, or it
reads an input that neither is the pairing of its old input nor stands in for it;
reading a stand-in (the consumer of a removed dropout now reads the dropout's input)
leaves the node *unchanged* and shows up as a **rewired** edge instead.
"""

from __future__ import annotations

import os
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxopt.provenance import PROVENANCE_KEY, origins

from . import labels
from .graph import DotBuilder, GraphLike, Item, as_graph, module_path
from .renderer import emit

ADDED, REMOVED, CHANGED, UNCHANGED = "added", "removed", "changed", "unchanged"
KEPT, REWIRED = "kept", "rewired"

#: fill and border of each node status, and colour of each edge status
NODE_STYLE = {
    UNCHANGED: ("#ffffff", "#9ca3af"), CHANGED: ("#fde68a", "#b45309"),
    ADDED: ("#bbf7d0", "#15803d"), REMOVED: ("#fecaca", "#b91c1c"),
}
EDGE_STYLE = {KEPT: "#9ca3af", REWIRED: "#2563eb", ADDED: "#15803d", REMOVED: "#dc2626"}


@dataclass
class GraphDiff:
    """How two graphs relate, node by node and edge by edge (see the module doc).

    Node names on the *after* side key ``after_status`` (unchanged/changed/added),
    names on the *before* side key ``before_status`` (unchanged/changed/removed).
    Edges are ``(source, user)`` name pairs: ``edges`` holds the after graph's
    (kept/rewired/added), ``removed_edges`` the before graph's that are gone.
    """

    before: fx.Graph
    after: fx.Graph
    before_root: torch.nn.Module | None
    after_root: torch.nn.Module | None
    after_status: dict[str, str]
    before_status: dict[str, str]
    #: after name -> before name, for unchanged and changed nodes
    pairs: dict[str, str]
    #: after name -> how it was paired: 'name', 'provenance', 'uses' or 'structure'
    paired_by: dict[str, str]
    #: removed before name -> the after nodes that stand in for it
    replaced_by: dict[str, list[str]]
    edges: dict[tuple[str, str], str]
    removed_edges: set[tuple[str, str]] = field(default_factory=set)

    def _after(self, status: str) -> set[str]:
        return {n for n, s in self.after_status.items() if s == status}

    @property
    def added(self) -> set[str]:
        return self._after(ADDED)

    @property
    def changed(self) -> set[str]:
        return self._after(CHANGED)

    @property
    def unchanged(self) -> set[str]:
        return self._after(UNCHANGED)

    @property
    def removed(self) -> set[str]:
        return {n for n, s in self.before_status.items() if s == REMOVED}

    def edges_with(self, status: str) -> set[tuple[str, str]]:
        if status == REMOVED:
            return set(self.removed_edges)
        return {e for e, s in self.edges.items() if s == status}

    def summary(self) -> dict[str, int]:
        counts = {s: len(self._after(s)) for s in (ADDED, CHANGED, UNCHANGED)}
        counts[REMOVED] = len(self.removed)
        for status in (KEPT, REWIRED, ADDED):
            counts[f"edges_{status}"] = len(self.edges_with(status))
        counts["edges_removed"] = len(self.removed_edges)
        return counts

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.removed_edges
                    or any(s != KEPT for s in self.edges.values()))

    def __str__(self) -> str:
        s = self.summary()
        return (f"{s['added']} added, {s['removed']} removed, {s['changed']} changed, "
                f"{s['unchanged']} unchanged nodes; {s['edges_rewired']} edges rewired")


# --- classification -----------------------------------------------------------------------


def _slots(node: fx.Node) -> dict[tuple, Any]:
    """Every leaf of a node's args and kwargs by its position (``('a', 0, 1)``, ``('k', 'dim')``)."""
    out: dict[tuple, Any] = {}

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, (tuple, list)):
            out[path + ("#",)] = (type(value).__name__, len(value))
            for i, v in enumerate(value):
                walk(v, path + (i,))
        elif isinstance(value, dict):
            out[path + ("#",)] = ("dict", tuple(map(str, value)))
            for k, v in value.items():
                walk(v, path + (str(k),))
        elif isinstance(value, slice):
            walk((value.start, value.stop, value.step), path + ("slice",))
        else:
            out[path] = value

    walk(tuple(node.args), ("a",))
    walk(dict(node.kwargs), ("k",))
    return out


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)  # nan == nan, 0.0 != -0.0
    if isinstance(a, torch.Tensor):
        try:
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        except Exception:
            return False
    try:
        return bool(a == b)
    except Exception:
        return False


class _Matcher:
    """One classification run; see the module docstring for the order of the rules."""

    def __init__(self, before: fx.Graph, after: fx.Graph):
        self.before, self.after = before, after
        self.b2a: dict[fx.Node, fx.Node] = {}
        self.a2b: dict[fx.Node, fx.Node] = {}
        self.how: dict[fx.Node, str] = {}
        self.standins: dict[fx.Node, list[fx.Node]] = defaultdict(list)

    def pair(self, a: fx.Node, b: fx.Node, how: str) -> None:
        self.a2b[a], self.b2a[b], self.how[a] = b, a, how

    def removed(self) -> Iterator[fx.Node]:
        return (b for b in self.before.nodes if b not in self.b2a)

    def run(self) -> None:
        by_name = {n.name: n for n in self.before.nodes}
        for a in self.after.nodes:
            b = by_name.get(a.name)
            if b is not None:
                self.pair(a, b, "name")
        self._provenance_standins()
        self._redirected_standins()
        self._pair_sole_standins()
        self._pair_by_structure()

    def _provenance_standins(self) -> None:
        index: dict[str, list[fx.Node]] = defaultdict(list)
        for b in self.removed():
            for name in origins(b):
                index[name].append(b)
        for a in self.after.nodes:
            if PROVENANCE_KEY not in a.meta:
                continue
            # a node that absorbed others (CSE's survivor) lists only them, not itself
            mine = {*a.meta[PROVENANCE_KEY], a.name}
            for b in {b for name in mine for b in index.get(name, ())}:
                if set(origins(b)) <= mine and a not in self.standins[b]:
                    self.standins[b].append(a)

    def _redirected_standins(self) -> None:
        for b in list(self.removed()):
            if self.standins.get(b):
                continue
            for user in b.users:
                user_after = self.b2a.get(user)
                if user_after is None:
                    continue
                now = _slots(user_after)
                for slot, value in _slots(user).items():
                    s = now.get(slot)
                    if value is b and isinstance(s, fx.Node) and s not in self.standins[b]:
                        self.standins[b].append(s)

    def _pair_sole_standins(self) -> None:
        stands_for: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for b, nodes in self.standins.items():
            for a in nodes:
                stands_for[a].append(b)
        for a, bs in stands_for.items():
            if a in self.a2b or len(bs) != 1 or bs[0] in self.b2a:
                continue
            new_standins = [s for s in self.standins[bs[0]] if s not in self.a2b]
            if new_standins == [a]:
                how = "provenance" if PROVENANCE_KEY in a.meta else "uses"
                self.pair(a, bs[0], how)

    def _pair_by_structure(self) -> None:
        left_b = [b for b in self.removed() if not self.standins.get(b)]
        taken = {a for nodes in self.standins.values() for a in nodes}
        left_a = [a for a in self.after.nodes if a not in self.a2b and a not in taken]
        if not left_b or not left_a:
            return
        for exact in (True, False):
            candidates: dict[Any, list[fx.Node]] = defaultdict(list)
            for b in left_b:
                if b not in self.b2a:
                    candidates[self._key(b, exact, before=True)].append(b)
            for a in left_a:
                if a in self.a2b:
                    continue
                found = candidates.get(self._key(a, exact, before=False), [])
                free = [b for b in found if b not in self.b2a]
                if len(found) == 1 and free:
                    self.pair(a, free[0], "structure")

    def _key(self, node: fx.Node, exact: bool, before: bool) -> Any:
        def ref(n: fx.Node) -> Any:
            if before:
                return n.name
            b = self.a2b.get(n)
            return b.name if b is not None else ("new", n.name)

        refs = tuple((slot, ref(v)) for slot, v in _slots(node).items() if isinstance(v, fx.Node))
        if not exact:
            return (node.op, refs) if refs else ("no inputs", id(node))
        consts = tuple((slot, labels.safe_repr(v)) for slot, v in _slots(node).items()
                       if not isinstance(v, fx.Node))
        return (node.op, labels.target_text(node), refs, consts)

    def same_content(self, b: fx.Node, a: fx.Node) -> bool:
        same_target = _same_leaf(a.target, b.target) or str(a.target) == str(b.target)
        return (a.op == b.op and same_target and self._same_args(b.args, a.args)
                and self._same_args(b.kwargs, a.kwargs))

    def _same_args(self, old: Any, new: Any) -> bool:
        """Equal argument structures, where an old node ref may be its pairing or a stand-in."""
        if isinstance(old, fx.Node):
            return isinstance(new, fx.Node) and (self.b2a.get(old) is new or new in self.standins.get(old, ()))
        if isinstance(old, (tuple, list)):
            return (type(old) is type(new) and len(old) == len(new)
                    and all(self._same_args(x, y) for x, y in zip(old, new)))
        if isinstance(old, dict):
            return (isinstance(new, dict) and old.keys() == new.keys()
                    and all(self._same_args(v, new[k]) for k, v in old.items()))
        if isinstance(old, slice):
            return isinstance(new, slice) and self._same_args((old.start, old.stop, old.step),
                                                              (new.start, new.stop, new.step))
        return not isinstance(new, fx.Node) and _same_leaf(old, new)


def diff_graphs(before: GraphLike, after: GraphLike) -> GraphDiff:
    """Classify every node and edge of a rewrite ``before -> after`` (see the module doc).

    ``before`` and ``after`` are GraphModules, fx Graphs or ``GraphSnapshot`` s (what
    ``fxopt.report_of(gm).records[i].before`` holds).
    """
    b_graph, b_root = as_graph(before)
    a_graph, a_root = as_graph(after)
    m = _Matcher(b_graph, a_graph)
    m.run()
    after_status, before_status, pairs = {}, {}, {}
    for a in a_graph.nodes:
        b = m.a2b.get(a)
        if b is None:
            after_status[a.name] = ADDED
            continue
        status = UNCHANGED if m.same_content(b, a) else CHANGED
        after_status[a.name] = before_status[b.name] = status
        pairs[a.name] = b.name
    replaced_by = {}
    for b in m.removed():
        before_status[b.name] = REMOVED
        replaced_by[b.name] = [a.name for a in m.standins.get(b, ())]
    edges: dict[tuple[str, str], str] = {}
    for a in a_graph.nodes:
        b = m.a2b.get(a)
        old_inputs = set(b.all_input_nodes) if b is not None else set()
        for source in a.all_input_nodes:
            if b is None:
                edges[(source.name, a.name)] = ADDED
            else:
                edges[(source.name, a.name)] = KEPT if m.a2b.get(source) in old_inputs else REWIRED
    removed_edges = set()
    for b in b_graph.nodes:
        a = m.b2a.get(b)
        new_inputs = set(a.all_input_nodes) if a is not None else set()
        for source in b.all_input_nodes:
            if m.b2a.get(source) not in new_inputs:
                removed_edges.add((source.name, b.name))
    return GraphDiff(b_graph, a_graph, b_root, a_root, after_status, before_status, pairs,
                     {a.name: how for a, how in m.how.items()},
                     replaced_by, edges, removed_edges)


# --- drawing ------------------------------------------------------------------------------


def _focus(adjacency: dict[str, set[str]], seeds: set[str], hops: int, hub_degree: int) -> set[str]:
    """``seeds`` plus everything within ``hops`` steps, except hubs (more than
    ``hub_degree`` neighbours) that are not themselves changed: a placeholder read by a
    thousand nodes, or the output, would tie every change into one sprawling layout."""
    shown = set(seeds)
    frontier = deque((s, 0) for s in seeds)
    while frontier:
        key, depth = frontier.popleft()
        if depth >= hops:
            continue
        for other in adjacency[key]:
            if other not in shown and len(adjacency[other]) <= hub_degree:
                shown.add(other)
                frontier.append((other, depth + 1))
    return shown


#: ``focus="auto"`` draws changes and this many hops of context above ``AUTO_FOCUS_NODES``
AUTO_FOCUS_HOPS, AUTO_FOCUS_NODES = 2, 150


@dataclass
class DiffView:
    """What a drawing of a diff shows: the union of both graphs, and the part drawn.

    Keys are ``"a:name"`` (a node of the after graph) and ``"b:name"`` (a removed node).
    ``hops`` is None when everything is drawn, else the context kept around the changes.
    """

    status: dict[str, str]
    edges: list[tuple[str, str, str]]
    adjacency: dict[str, set[str]]
    hops: int | None
    shown: set[str]

    @property
    def hidden(self) -> int:
        """How many nodes the focus left out (unchanged regions collapsed)."""
        return len(self.status) - len(self.shown)


def diff_view(diff: GraphDiff, focus: int | str | None = "auto", hub_degree: int = 16) -> DiffView:
    """Which nodes a drawing of ``diff`` with ``focus`` shows (see :func:`render_diff`)."""
    b2a = {b: a for a, b in diff.pairs.items()}

    def key_of_before(name: str) -> str:
        return f"a:{b2a[name]}" if name in b2a else f"b:{name}"

    edges: list[tuple[str, str, str]] = [(f"a:{s}", f"a:{d}", st) for (s, d), st in diff.edges.items()]
    edges += [(key_of_before(s), key_of_before(d), REMOVED) for s, d in sorted(diff.removed_edges)]
    status = {f"a:{n}": s for n, s in diff.after_status.items()}
    status.update({f"b:{n}": REMOVED for n in diff.removed})
    adjacency: dict[str, set[str]] = {k: set() for k in status}
    for s, d, _ in edges:
        adjacency[s].add(d)
        adjacency[d].add(s)
    if focus == "auto":
        hops = AUTO_FOCUS_HOPS if len(status) > AUTO_FOCUS_NODES else None
    else:
        hops = None if focus is None else int(focus)
    if hops is None:
        shown = set(status)
    else:
        seeds = {k for k, s in status.items() if s != UNCHANGED}
        seeds |= {end for s, d, st in edges if st == REWIRED for end in (s, d)}
        shown = _focus(adjacency, seeds, hops, hub_degree)
    return DiffView(status, edges, adjacency, hops, shown)


def diff_to_dot(
    diff: GraphDiff,
    *,
    focus: int | str | None = "auto",
    clusters: bool = False,
    show_args: bool = True,
    label_width: int = 60,
    rankdir: str = "TB",
    id_prefix: str = "",
    title: str = "diff",
    hub_degree: int = 16,
) -> str:
    """The DOT text of a diff: the union of both graphs, coloured by status, and a legend."""
    view = diff_view(diff, focus, hub_degree)
    builder = DotBuilder(title, id_prefix, rankdir)
    if view.hops is not None:  # scattered changes: lay out each island on its own, then pack
        builder.dot.graph_attr["pack"] = "true"
    items = DiffItems(diff, view, label_width, show_args)
    for key in view.status:  # after order first, then removed nodes: a stable layout
        if key in view.shown:
            builder.add(items.item(key))
    add_edges(builder, view.edges)
    hops, shown, status = view.hops, view.shown, view.status
    note = "" if hops is None else f"focus: changes + {hops} hops, {len(shown)} of {len(status)} nodes shown"
    return builder.source(clusters, [legend(diff, note, id_prefix)])


class DiffItems:
    """The box of each node of a diff's drawing: its label (what a changed node was, what
    stands in for a removed one, how many neighbours are not drawn) and its colours."""

    def __init__(self, diff: GraphDiff, view: DiffView, label_width: int = 60, show_args: bool = True):
        self.diff, self.view = diff, view
        self.label_width, self.show_args = label_width, show_args
        self.a_nodes = {n.name: n for n in diff.after.nodes}
        self.b_nodes = {n.name: n for n in diff.before.nodes}

    def node(self, key: str) -> fx.Node:
        side, name = key.split(":", 1)
        return self.a_nodes[name] if side == "a" else self.b_nodes[name]

    def item(self, key: str, shown: set[str] | None = None, path: tuple[str, ...] | None = None) -> Item:
        """The box of ``key``; ``shown`` (default: the view's) counts the neighbours not drawn,
        ``path`` (default: the node's module) is the cluster it goes in."""
        diff, width = self.diff, self.label_width
        node = self.node(key)
        name = key[2:]
        root = diff.after_root if key[0] == "a" else diff.before_root
        st = self.view.status[key]
        rows = labels.node_rows(node, root, width, self.show_args)
        if st == CHANGED:
            old = self.b_nodes[diff.pairs[name]]
            was = labels.target_text(old, diff.before_root) + (labels.args_text(old) if self.show_args else "")
            rows.append((labels.wrapped("was " + was, width), "was"))
        if st == REMOVED and diff.replaced_by.get(name):
            rows.append((labels.html_text("→ " + ", ".join(diff.replaced_by[name]), width), "note"))
        hidden = len(self.view.adjacency[key] - (self.view.shown if shown is None else shown))
        if hidden:
            rows.append((labels.html_text(f"+{hidden} neighbours not shown"), "note"))
        fill, border = NODE_STYLE[st]
        attrs = {"fillcolor": fill, "color": border, "class": f"fx_node fx_diff_{st}",
                 "tooltip": labels.tooltip(node, root)}
        if st == REMOVED:
            attrs["style"] = "rounded,filled,dashed"
        if st in (ADDED, CHANGED, REMOVED):
            attrs["penwidth"] = "2"
        return Item(key, labels.table(rows), module_path(node) if path is None else path, attrs)


def add_edges(builder: DotBuilder, edges: list[tuple[str, str, str]]) -> None:
    """The diff's edges between drawn boxes, coloured by status (the builder skips the others)."""
    for s, d, st in edges:
        attrs = {"color": EDGE_STYLE[st], "class": f"fx_edge_{st}"}
        if st == REMOVED:
            attrs["style"] = "dashed"
        elif st != KEPT:
            attrs["penwidth"] = "2"
        builder.edge(s, d, **attrs)


def legend(diff: GraphDiff, note: str, prefix: str) -> str:
    counts = diff.summary()
    rows = ['<TR><TD COLSPAN="2" ALIGN="LEFT"><B>legend</B></TD></TR>']
    for st in (ADDED, REMOVED, CHANGED, UNCHANGED):
        fill, border = NODE_STYLE[st]
        rows.append(f'<TR><TD BGCOLOR="{fill}" BORDER="1" COLOR="{border}" WIDTH="24"> </TD>'
                    f'<TD ALIGN="LEFT">{st} node ({counts[st]})</TD></TR>')
    for st in (KEPT, REWIRED, ADDED, REMOVED):
        rows.append(f'<TR><TD><FONT COLOR="{EDGE_STYLE[st]}" POINT-SIZE="14"><B>——→</B></FONT></TD>'
                    f'<TD ALIGN="LEFT">{st} edge ({counts["edges_" + st]})</TD></TR>')
    if note:
        rows.append(f'<TR><TD COLSPAN="2" ALIGN="LEFT"><FONT POINT-SIZE="9">{labels.html_text(note)}'
                    '</FONT></TD></TR>')
    label = '<<TABLE BORDER="1" COLOR="#d1d5db" CELLBORDER="0" CELLSPACING="2">' + "".join(rows) + "</TABLE>>"
    return f'{prefix}legend [id="{prefix}legend" class="fx_legend" shape=plaintext style="" label={label}]'


def render_diff(
    before: GraphLike,
    after: GraphLike,
    path_or_format: str | os.PathLike = "svg",
    *,
    format: str | None = None,
    renderer: str | os.PathLike | None = None,
    timeout: float | None = None,
    **options: Any,
) -> str | bytes | Path:
    """Draw a rewrite ``before -> after`` in one picture, with a legend.

    Nodes are coloured added (green), removed (red, dashed), changed (amber, with what
    they were) or unchanged; edges kept (grey), rewired (blue), added (green) or removed
    (red, dashed). ``focus=k`` draws only the changes and ``k`` hops of context (the
    default ``"auto"`` does that with k=2 above 150 nodes; ``None`` draws everything),
    which is what keeps a 10,000-node graph to a second or two. Other options:
    ``clusters``, ``show_args``, ``label_width``, ``rankdir``. Output as for
    :func:`fxopt.visualize.render`; :func:`diff_graphs` gives the classification itself.
    """
    return emit(diff_to_dot(diff_graphs(before, after), **options), path_or_format, format,
                renderer, timeout)
