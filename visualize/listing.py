"""Graphs and diffs as HTML tables: what the report shows when nothing can draw them.

A reader without Graphviz still needs to see what a pass did, and raw DOT is hard to read, so
each graph becomes a node table (name, op, target, arguments, shape) in graph order, and
a diff lists only the nodes it added, removed or changed, coloured like the drawing.
"""

from __future__ import annotations

import html
from collections.abc import Iterable

import torch
import torch.fx as fx

from . import labels
from .diff import ADDED, NODE_STYLE, REMOVED, UNCHANGED, GraphDiff
from .graph import GraphLike, as_graph

_HEAD = ("name", "op", "target", "arguments", "shape")


def _row(node: fx.Node, root: torch.nn.Module | None, status: str | None) -> str:
    cells = [node.name, node.op, "" if node.op in ("placeholder", "output") else
             labels.target_text(node, root), labels.args_text(node),
             labels.value_text(labels.meta_value(node))]
    if status is None:
        return "<tr>" + "".join(f"<td>{html.escape(labels.clean(c, 200))}</td>" for c in cells) + "</tr>"
    fill = NODE_STYLE[status][0]
    return (f'<tr class="fx-diff-{status}" style="background:{fill}"><td>{status}</td>'
            + "".join(f"<td>{html.escape(labels.clean(c, 200))}</td>" for c in cells) + "</tr>")


def _table(rows: Iterable[str], with_status: bool) -> str:
    head = (("status",) if with_status else ()) + _HEAD
    return ('<table class="fx-listing"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def graph_listing(graph: GraphLike) -> str:
    """Every node of ``graph`` as one table row, in graph order."""
    g, root = as_graph(graph)
    return _table((_row(n, root, None) for n in g.nodes), with_status=False)


def diff_listing(diff: GraphDiff) -> str:
    """The added and changed nodes of ``diff`` in after-graph order, then the removed ones in
    before-graph order, and how many were left unchanged."""
    rows = []
    for node in diff.after.nodes:
        status = diff.after_status[node.name]
        if status != UNCHANGED:
            rows.append(_row(node, diff.after_root, status))
    removed = [n for n in diff.before.nodes if diff.before_status.get(n.name) == REMOVED]
    rows += [_row(n, diff.before_root, REMOVED) for n in removed]
    unchanged = len(diff.unchanged)
    if not rows:
        return f'<p class="fx-listing-note">No node changed ({unchanged} unchanged).</p>'
    note = (f'<p class="fx-listing-note">{len(diff.added)} {ADDED}, {len(removed)} {REMOVED}, '
            f"{len(diff.changed)} changed; {unchanged} unchanged nodes not listed.</p>")
    return note + _table(rows, with_status=True)
