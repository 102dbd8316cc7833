"""Rendering one graph: nodes as labelled tables, module clusters, colour overlays.

The DOT is built with the ``graphviz`` package (it quotes attributes); labels come from
:mod:`fxopt.visualize.labels`. Node ids in the DOT are generated (``n0``, ``n1``...)
so that no node name ever has to be a DOT identifier. Nodes carry ``class`` attributes
into the SVG (``fx_node fx_op_call_function``; diffs add ``fx_diff_added``...,
``fx_edge_rewired``...) for CSS and for tests to select on; they use underscores because
Graphviz writes a ``-`` in a class as ``&#45;``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import graphviz
import torch
import torch.fx as fx

from fxopt.snapshot import GraphSnapshot

from . import labels
from .renderer import emit

GraphLike = fx.GraphModule | fx.Graph | GraphSnapshot | torch.export.ExportedProgram


def as_graph(graph: GraphLike) -> tuple[fx.Graph, torch.nn.Module | None]:
    """The fx.Graph behind a GraphModule, Graph, snapshot or ExportedProgram, and its module."""
    if isinstance(graph, torch.export.ExportedProgram):
        graph = graph.graph_module
    if isinstance(graph, fx.GraphModule):
        return graph.graph, graph
    if isinstance(graph, fx.Graph):
        return graph, graph.owning_module
    if isinstance(graph, GraphSnapshot):
        return graph.build(), None
    raise TypeError(f"expected a GraphModule, fx.Graph, GraphSnapshot or ExportedProgram, "
                    f"got {type(graph).__name__}")


def module_path(node: fx.Node) -> tuple[str, ...]:
    """The submodule a node belongs to, as path components (``('block', '0')``).

    From ``nn_module_stack`` (symbolic_trace, export, Dynamo); a ``call_module`` node
    belongs to its parent (it *is* the call of its own module), and a ``get_attr`` of
    ``block.0.weight`` to ``block.0``.
    """
    return scope_of(node.op, node.target, node.meta)


def scope_of(op: str, target: Any, meta: Mapping[str, Any]) -> tuple[str, ...]:
    """:func:`module_path` from a node's fields (a snapshot keeps them, not the nodes)."""
    stack = meta.get("nn_module_stack")
    path = ""
    if isinstance(stack, dict) and stack:
        entry = list(stack.values())[-1]
        path = str(entry[0] if isinstance(entry, tuple) else entry)
        if op == "call_module" and path == str(target):
            path = path.rpartition(".")[0]
    elif op == "get_attr" and isinstance(target, str):
        path = target.rpartition(".")[0]
    for prefix in ("L['self'].", "L['self']", "L__self__.", "L__self__", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return tuple(p for p in path.split(".") if p)


@dataclass
class Item:
    """One box in the picture: a graph node, a collapsed module or a removed node."""

    key: str
    label: str
    path: tuple[str, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)


class DotBuilder:
    """Accumulates boxes and arrows, then emits DOT with nested module clusters."""

    def __init__(self, title: str = "fx", id_prefix: str = "", rankdir: str = "TB"):
        self.prefix = id_prefix
        self.items: list[Item] = []
        self.ids: dict[str, str] = {}
        self.edges: list[tuple[str, str, dict[str, str]]] = []
        self.clusters: list[tuple[str, ...]] = []
        self.dot = graphviz.Digraph(
            name=title,
            graph_attr={"rankdir": rankdir, "id": f"{id_prefix}graph", "fontname": "Helvetica",
                        "nodesep": "0.25", "ranksep": "0.35"},
            node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                       "fontsize": "11", "margin": "0.06,0.03", "penwidth": "1"},
            edge_attr={"color": "#6b7280", "arrowsize": "0.6"},
        )

    def add(self, item: Item) -> str:
        dot_id = f"{self.prefix}n{len(self.items)}"
        self.ids[item.key] = dot_id
        self.items.append(item)
        return dot_id

    def edge(self, src: str, dst: str, **attrs: str) -> None:
        if src in self.ids and dst in self.ids:
            self.edges.append((self.ids[src], self.ids[dst], attrs))

    def source(self, clusters: bool = True, extra: Iterable[str] = ()) -> str:
        """The DOT text; ``extra`` lines (a legend) go in as they are."""
        tree: dict[tuple[str, ...], list[Item]] = {(): []}
        for item in self.items:
            tree.setdefault(item.path if clusters else (), []).append(item)
        for path in list(tree):  # every ancestor of a populated module is a cluster too
            for depth in range(1, len(path)):
                tree.setdefault(path[:depth], [])
        self._emit_cluster(self.dot, (), tree)
        for i, (src, dst, attrs) in enumerate(self.edges):
            self.dot.edge(src, dst, id=f"{self.prefix}e{i}", **attrs)
        self.dot.body.extend(f"\t{line}\n" for line in extra)
        return self.dot.source

    def _emit_cluster(self, graph: graphviz.Digraph, path: tuple[str, ...],
                      tree: dict[tuple[str, ...], list[Item]]) -> None:
        for item in tree[path]:
            graph.node(self.ids[item.key], label=item.label, **item.attrs)
        for child in sorted(p for p in tree if len(p) == len(path) + 1 and p[:len(path)] == path):
            cid = f"{self.prefix}c{len(self.clusters)}"
            self.clusters.append(child)
            with graph.subgraph(name=f"cluster_{cid}") as sub:
                sub.attr(id=cid, label=labels.table([(labels.html_text(".".join(child), 60), "note")]),
                         labeljust="l", style="rounded,dashed", color="#9ca3af", fontsize="10")
                self._emit_cluster(sub, child, tree)


# --- overlays ---------------------------------------------------------------------------

_SCALE = ((255, 255, 255), (253, 186, 116), (220, 38, 38))  # white -> orange -> red


def scale_colour(fraction: float) -> str:
    """A colour on a white-orange-red ramp for ``fraction`` in [0, 1]."""
    f = min(max(fraction, 0.0), 1.0) * (len(_SCALE) - 1)
    i = min(int(f), len(_SCALE) - 2)
    t = f - i
    rgb = [round(a + (b - a) * t) for a, b in zip(_SCALE[i], _SCALE[i + 1])]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _overlay_values(overlay: Mapping[Any, float] | None) -> dict[str, float]:
    if not overlay:
        return {}
    out = {}
    for key, value in overlay.items():
        name = key.name if isinstance(key, fx.Node) else str(key)
        out[name] = float(value)
    return out


def _legend_overlay(title: str, low: float, high: float, fmt: str, prefix: str) -> str:
    stops = "".join(f'<TD BGCOLOR="{scale_colour(i / 4)}" WIDTH="18"> </TD>' for i in range(5))
    label = (f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="2"><TR><TD COLSPAN="5"><B>'
             f'{labels.html_text(title, 40)}</B></TD></TR><TR>{stops}</TR><TR>'
             f'<TD COLSPAN="2" ALIGN="LEFT">{labels.html_text(fmt.format(low))}</TD><TD></TD>'
             f'<TD COLSPAN="2" ALIGN="RIGHT">{labels.html_text(fmt.format(high))}</TD></TR></TABLE>>')
    return f'{prefix}legend [id="{prefix}legend" shape=plaintext style="" label={label}]'


# --- render -------------------------------------------------------------------------------


def to_dot(
    graph: GraphLike,
    *,
    clusters: bool = True,
    collapse_depth: int | None = None,
    overlay: Mapping[Any, float] | None = None,
    overlay_title: str = "value",
    overlay_format: str = "{:.3g}",
    show_args: bool = True,
    label_width: int = 60,
    rankdir: str = "TB",
    id_prefix: str = "",
) -> str:
    """The DOT text of a graph (see :func:`render` for the options)."""
    fx_graph, root = as_graph(graph)
    values = _overlay_values(overlay)
    high = max(values.values(), default=0.0)
    low = min(min(values.values(), default=0.0), 0.0)
    span = (high - low) or 1.0
    builder = DotBuilder(getattr(root, "__class__", type(None)).__name__ if root is not None else "fx",
                         id_prefix, rankdir)
    group_of: dict[fx.Node, str] = {}  # node -> its box (keyed by object: names may repeat)
    groups: dict[tuple[str, ...], list[fx.Node]] = {}
    for node in fx_graph.nodes:
        path = module_path(node)
        if collapse_depth is not None and len(path) > collapse_depth:
            groups.setdefault(path[: collapse_depth + 1], []).append(node)
            group_of[node] = "module:" + ".".join(path[: collapse_depth + 1])
            continue
        rows = labels.node_rows(node, root, label_width, show_args)
        attrs = {"fillcolor": labels.op_colour(node.op), "tooltip": labels.tooltip(node, root),
                 "class": f"fx_node fx_op_{node.op}"}
        if node.name in values:
            value = values[node.name]
            attrs["fillcolor"] = scale_colour((value - low) / span)
            rows.append((labels.html_text(f"{overlay_title}: {overlay_format.format(value)}"), "small"))
        group_of[node] = f"node:{len(group_of)}"
        builder.add(Item(group_of[node], labels.table(rows), path, attrs))
    for path, members in groups.items():
        total = sum(values.get(n.name, 0.0) for n in members)
        rows = [(labels.html_text(".".join(path), label_width), "title"),
                (labels.html_text(f"{len(members)} nodes collapsed"), "note")]
        attrs = {"fillcolor": "#e0e7ff", "class": "fx_collapsed", "style": "rounded,filled,bold",
                 "tooltip": labels.attr_text(", ".join(n.name for n in members))}
        if values:
            attrs["fillcolor"] = scale_colour((total - low) / span)
            rows.append((labels.html_text(f"{overlay_title}: {overlay_format.format(total)}"), "small"))
        builder.add(Item("module:" + ".".join(path), labels.table(rows), path[:-1], attrs))
    seen: set[tuple[str, str]] = set()
    for node in fx_graph.nodes:
        for source in node.all_input_nodes:
            pair = (group_of[source], group_of[node])
            if pair[0] != pair[1] and pair not in seen:
                seen.add(pair)
                builder.edge(*pair)
    extra = [_legend_overlay(overlay_title, low, high, overlay_format, id_prefix)] if values else []
    return builder.source(clusters, extra)


def render(
    graph: GraphLike,
    path_or_format: str | os.PathLike = "svg",
    *,
    format: str | None = None,
    renderer: str | os.PathLike | None = None,
    timeout: float | None = None,
    **options: Any,
) -> str | bytes | Path:
    """Draw a graph: to a ``.svg``/``.png``/``.dot`` path, or return ``"svg"``/``"png"``/``"dot"``.

    Each node shows its name, op, target, arguments and — from ``meta['val']`` or
    ``meta['tensor_meta']`` where present — shape and dtype. Options:
    ``clusters`` (draw the module hierarchy, default True), ``collapse_depth`` (draw
    each submodule deeper than this as one box), ``overlay`` (node or node name ->
    number, drawn as colour, e.g. time or bytes) with ``overlay_title`` and
    ``overlay_format``, ``show_args``, ``label_width``, ``rankdir``.

    Without a Graphviz renderer a :class:`~fxopt.errors.RendererNotFoundError` says
    how to get one, and the DOT text is written next to ``path``.
    """
    return emit(to_dot(graph, **options), path_or_format, format, renderer, timeout)
