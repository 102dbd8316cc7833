"""The whole-graph view of a large graph: its modules one level at a time, each module
opening on click below the level that holds it.

Each level (a module's own nodes and its child modules as boxes, :mod:`.scopes`) is a
small Graphviz drawing; Graphviz never sees more than :data:`.scopes.CHUNK` boxes at once,
and the layout work is linear in the nodes. Levels that draw the same but for names
(block 5 and block 6 of a stack, :mod:`.names`) share one drawing: it is laid out once,
and ``report.js`` writes the other level's names into a copy when it opens. All drawings
go to Graphviz in one run (one DOT input holding every graph).
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxopt.errors import RenderError

from . import labels
from .figures import zoomable
from .graph import DotBuilder, Item
from .names import Shape, blank, graph_names
from .renderer import run_renderer
from .scopes import Scope

_SVG = re.compile(r"<svg\b.*?</svg>", re.DOTALL)


@dataclass
class Level:
    """One level of the view: which drawing shows it, with which names, and the level
    each of its module boxes opens (box index -> level index)."""

    title: str
    drawing: int
    names: list[str]
    opens: dict[int, int] = field(default_factory=dict)


@dataclass
class Outline:
    """Every level of a graph's view, and the DOT of each distinct drawing."""

    levels: list[Level] = field(default_factory=list)
    dots: list[str] = field(default_factory=list)
    #: the level whose names each drawing was laid out with
    drawn_with: list[int] = field(default_factory=list)


class _Builder:
    def __init__(self, graph: fx.Graph, root: torch.nn.Module | None, top: Scope):
        self.root = root
        self.known = graph_names([graph], _scope_names(top))
        self.outline = Outline()
        self.drawings: dict[tuple, int] = {}
        self.widths: list[int] = []  # the length of the names each drawing was laid out with

    def level(self, scope: Scope) -> int:
        """Add the level of ``scope`` and, depth first, those of its boxes; its index."""
        items, edges = self.items(scope)
        shape = Shape()
        for item in items:
            shape.add(blank(item.label, self.known))
            shape.parts.append((item.attrs["class"], ()))
        shape.parts.append(("edges", tuple(edges)))
        key = shape.shape
        index = len(self.outline.levels)
        drawing = self.drawings.setdefault(key, len(self.outline.dots))
        width = sum(map(len, shape.names))
        if drawing == len(self.outline.dots):
            self.outline.dots.append(_dot(items, edges, f"o{drawing}_"))
            self.outline.drawn_with.append(index)
            self.widths.append(width)
        elif width > self.widths[drawing]:
            # a shared drawing is laid out with its longest names (block 2047's, not
            # block 0's): its boxes must be wide enough for any level's names written in
            self.outline.dots[drawing] = _dot(items, edges, f"o{drawing}_")
            self.outline.drawn_with[drawing], self.widths[drawing] = index, width
        self.outline.levels.append(Level(f"{scope.name} ({scope.size} nodes)", drawing, shape.names))
        for j, entry in enumerate(scope.entries):
            if isinstance(entry, Scope):
                self.outline.levels[index].opens[j] = self.level(entry)
        return index

    def items(self, scope: Scope) -> tuple[list[Item], list[tuple[int, int]]]:
        """The boxes of a level (its entries, then the nodes outside it that feed them) and
        the edges between them."""
        items: list[Item] = []
        where: dict[fx.Node, int] = {}
        for j, entry in enumerate(scope.entries):
            if isinstance(entry, Scope):
                items.append(_scope_item(j, entry))
                where.update((node, j) for node in entry.nodes())
            else:
                items.append(self.node_item(j, entry))
                where[entry] = j
        edges: dict[tuple[int, int], None] = {}
        for node, j in list(where.items()):
            for source in node.all_input_nodes:
                i = where.get(source)
                if i is None:  # from outside this level: one box per outside node
                    i = where[source] = len(items)
                    items.append(_outside_item(i, source))
                if i != j:
                    edges[(i, j)] = None
        return items, list(edges)

    def node_item(self, j: int, node: fx.Node) -> Item:
        attrs = {"fillcolor": labels.op_colour(node.op), "class": f"fx_node fx_op_{node.op}"}
        # no argument row (the edges show the inputs): a wrapped row would break names at
        # different places in block 9 and block 10. No tooltip: a shared drawing would show
        # the first block's arguments in every block's tooltip.
        return Item(f"i{j}", labels.table(labels.node_rows(node, self.root, show_args=False)), (), attrs)


def _dot(items: list[Item], edges: list[tuple[int, int]], prefix: str) -> str:
    builder = DotBuilder("level", prefix)
    for j, item in enumerate(items):
        item.attrs["id"] = f"{prefix}box{j}"  # report.js finds which box was clicked
        builder.add(item)
    for source, user in edges:
        builder.edge(items[source].key, items[user].key)
    return builder.source(clusters=False)


def _scope_item(j: int, scope: Scope) -> Item:
    what = "a run of entries" if scope.chunk else "module"
    rows = [(labels.html_text(scope.name, 60), "title"),
            (labels.html_text(f"{scope.size} nodes, {what}: click to open"), "note")]
    attrs = {"fillcolor": "#e0e7ff", "class": "fx_scope", "style": "rounded,filled,bold"}
    return Item(f"i{j}", labels.table(rows), (), attrs)


def _outside_item(j: int, node: fx.Node) -> Item:
    rows = [(labels.html_text(node.name, 60), "small"), (labels.html_text("from outside"), "note")]
    attrs = {"fillcolor": "#f3f4f6", "class": "fx_outside", "style": "rounded,filled,dashed"}
    return Item(f"i{j}", labels.table(rows), (), attrs)


def _scope_names(scope: Scope) -> list[str]:
    out = [".".join(scope.path)] if scope.path else []
    for entry in scope.entries:
        if isinstance(entry, Scope):
            out += _scope_names(entry)
    return out


def build_outline(graph: fx.Graph, root: torch.nn.Module | None, top: Scope) -> Outline:
    """Every level of ``top``'s view, the distinct drawings once each."""
    builder = _Builder(graph, root, top)
    builder.level(top)
    return builder.outline


def outline_html(outline: Outline, renderer: str | os.PathLike | None, timeout: float | None) -> str:
    """The view's element: each distinct drawing (one Graphviz run for all) in a
    ``<template>``, the levels as JSON; ``report.js`` opens the top level."""
    svgs = _SVG.findall(run_renderer("\n".join(outline.dots), "svg", renderer, timeout).decode("utf-8"))
    if len(svgs) != len(outline.dots):
        raise RenderError(f"expected {len(outline.dots)} drawings from one Graphviz run, got {len(svgs)}")
    levels = [[lv.drawing, lv.names, lv.opens, lv.title] for lv in outline.levels]
    data = {"levels": levels, "drawnWith": outline.drawn_with}
    templates = "".join(f'<template data-drawing="{i}">{zoomable(svg)}</template>' for i, svg in enumerate(svgs))
    return (f'<div class="fx-outline" data-outline="{html.escape(json.dumps(data, separators=(",", ":")))}">'
            f'{templates}<div class="fx-levels"></div></div>')
