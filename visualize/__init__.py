"""fxopt.visualize: draw graphs and before/after diffs with Graphviz; the HTML report.

- :func:`render` — one graph to SVG, PNG or DOT (module clusters, collapsing, overlays);
- :func:`render_diff` / :func:`diff_graphs` — what a rewrite added, removed, changed
  and rewired, drawn in one picture (focus mode for big graphs);
- :func:`write_report` — the per-pass HTML report of an ``fxopt.optimize`` run;
- :func:`memory_plan_svg` — a memory plan's buffers over time at their offsets.
"""

from fxopt.errors import RendererNotFoundError, RenderError

from .diff import GraphDiff, diff_graphs, diff_to_dot, render_diff
from .graph import render, to_dot
from .memory import memory_plan_svg
from .renderer import find_renderer
from .report import report_html, write_report

__all__ = [
    "GraphDiff", "RenderError", "RendererNotFoundError", "diff_graphs", "diff_to_dot",
    "find_renderer", "memory_plan_svg", "render", "render_diff", "report_html", "to_dot",
    "write_report",
]
