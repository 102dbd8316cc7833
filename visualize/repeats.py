"""A large diff drawn by kind of rewrite: one example of each kind, with its context, its
count ("×2048"), and the list of where each one happened.

The focus view (:func:`.diff.diff_view`) keeps a few hops around *every* change, which on
a graph where a pass rewrote every block is the whole graph again. Here the drawing holds
one island per group (:mod:`.islands`), at most :data:`DRAWN_NODES` nodes in all, so
Graphviz lays out a few hundred nodes whatever the size of the graph; the kinds that do
not fit are listed, not drawn.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .diff import DiffItems, add_edges, legend
from .graph import DotBuilder
from .islands import Group, Rewrites

#: the most nodes a grouped drawing holds (the first kind is drawn whatever its size, cut to this)
DRAWN_NODES = 300


@dataclass
class Grouped:
    """A diff's rewrites grouped: the drawing of the first ``drawn`` groups, and all of them."""

    rewrites: Rewrites
    groups: list[Group]
    drawn: int
    dot: str

    @property
    def rewrites_count(self) -> int:
        return len(self.rewrites.islands)


def group_diff(items: DiffItems, hops: int, *, id_prefix: str = "", title: str = "diff",
               rankdir: str = "TB", hub_degree: int = 16) -> Grouped:
    """Group the rewrites of ``items``' diff and draw one example of each kind that fits."""
    rewrites = Rewrites(items, hops, hub_degree)
    groups = rewrites.groups()
    picked: list[tuple[int, list[str]]] = []
    total = 0
    for i, g in enumerate(groups):
        keys = g.islands[0].keys
        if picked and total + len(keys) > DRAWN_NODES:
            break
        picked.append((i, keys[:DRAWN_NODES]))
        total += len(picked[-1][1])
    shown = {key for _, keys in picked for key in keys}
    builder = DotBuilder(title, id_prefix, rankdir)
    builder.dot.graph_attr["pack"] = "true"
    for i, keys in picked:
        example = groups[i].islands[0]
        cluster = f"kind {i + 1}: ×{len(groups[i].islands)}, drawn: {rewrites.where(example)}"
        for key in keys:
            if key not in builder.ids:  # context shared by two examples is drawn once
                builder.add(items.item(key, shown, (cluster,)))
    add_edges(builder, items.view.edges)
    note = (f"{len(rewrites.islands)} rewrites of {len(groups)} kinds; one of each kind drawn "
            f"with {hops} hops of context")
    dot = builder.source(True, [legend(items.diff, note, id_prefix)])
    return Grouped(rewrites, groups, len(picked), dot)


def where_listing(grouped: Grouped, anchor: str) -> str:
    """Each kind of rewrite, its count, and where each one happened (folded lists)."""
    out = []
    for i, g in enumerate(grouped.groups):
        drawn = "drawn above" if i < grouped.drawn else "not drawn"
        rows = "".join(f"<li>{html.escape(grouped.rewrites.where(island))}</li>" for island in g.islands)
        out.append(f'<details class="fx-kind" id="{anchor}-kind-{i + 1}"><summary>kind {i + 1}: '
                   f'<b>×{len(g.islands)}</b> ({drawn}), first at '
                   f"{html.escape(grouped.rewrites.where(g.islands[0]))}</summary>"
                   f'<ol class="fx-where">{rows}</ol></details>')
    return '<div class="fx-kinds">' + "".join(out) + "</div>"
