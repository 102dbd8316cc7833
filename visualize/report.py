"""The HTML report of an optimize run: one self-contained page, readable offline.

Per pass: its statistics and time, the diff of what it did as inline SVG, and the
memory-plan chart when the pass produced a plan. The "after" of a changing pass is the
"before" snapshot of the next changing pass, or the final graph. Everything is inlined
(CSS, SVG; no script, no fonts or libraries from the network), so the file can be
mailed or attached to a bug. A graph that cannot be drawn (no renderer, a renderer
error) is listed as a table of its nodes instead (:mod:`.listing`), never dropped and never
fatal; without a renderer, one line at the top says how to get one.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxopt.errors import RendererNotFoundError, RenderError
from fxopt.optimize import report_of
from fxopt.report import PassRecord, Report

from .diff import GraphDiff, diff_graphs, diff_to_dot
from .graph import to_dot
from .labels import safe_repr
from .listing import diff_listing, graph_listing
from .memory import human_bytes, is_memory_plan, memory_plan_svg
from .renderer import find_renderer, run_renderer

_SVG_START = re.compile(r"<svg\b")

_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #111827; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin: 0; }
.fx-summary { color: #374151; margin-bottom: 16px; }
table.fx-passes { border-collapse: collapse; margin: 8px 0 24px; font-size: 13px; }
table.fx-passes th, table.fx-passes td { border-bottom: 1px solid #e5e7eb; padding: 4px 10px; text-align: left; }
table.fx-passes td.num { text-align: right; font-variant-numeric: tabular-nums; }
section.fx-pass { border: 1px solid #e5e7eb; border-radius: 8px; padding: 12px 16px; margin: 14px 0; }
section.fx-pass.fx-unchanged { color: #6b7280; }
.fx-meta { font-size: 13px; margin: 6px 0; } .fx-meta b { color: #374151; }
.fx-figure { overflow: auto; max-height: 900px; border-top: 1px dashed #e5e7eb; margin-top: 8px; padding-top: 8px; }
.fx-figure svg { max-width: 100%; height: auto; }
.fx-warning { background: #fef3c7; border: 1px solid #f59e0b; padding: 8px 12px; border-radius: 6px; }
table.fx-listing { border-collapse: collapse; font-size: 12px; font-family: monospace; }
table.fx-listing th, table.fx-listing td { border-bottom: 1px solid #e5e7eb; padding: 2px 8px; text-align: left; vertical-align: top; }
.fx-depth-1 { margin-left: 24px; } .fx-depth-2 { margin-left: 48px; } .fx-depth-3 { margin-left: 72px; }
"""


def _inline_svg(svg: str) -> str:
    """An SVG document as an element for HTML: without its XML prolog and doctype."""
    match = _SVG_START.search(svg)
    return svg[match.start():] if match else html.escape(svg)


def _changing_leaves(report: Report) -> list[PassRecord]:
    return [r for _, r in report.walk() if r.before is not None and not r.children]


class _Page:
    """Builds the page; remembers whether a renderer exists so it is looked up once."""

    def __init__(self, gm: fx.GraphModule, report: Report, renderer: Any, focus: Any, timeout: float | None):
        self.gm, self.report = gm, report
        self.renderer, self.focus, self.timeout = renderer, focus, timeout
        try:
            find_renderer(renderer)
            self.missing_renderer: str | None = None
        except RendererNotFoundError as exc:
            self.missing_renderer = str(exc)
        leaves = _changing_leaves(report)
        self.after_of = {id(r): (r.after or (leaves[i + 1].before if i + 1 < len(leaves) else gm))
                         for i, r in enumerate(leaves)}

    def figure(self, dot: str, what: str, listing: Callable[[], str]) -> str:
        """The drawing of ``dot``; when it cannot be drawn, ``listing()`` (a node table)."""
        if self.missing_renderer is not None:  # said once, at the top of the page
            return f'<div class="fx-figure">{listing()}</div>'
        try:
            svg = run_renderer(dot, "svg", self.renderer, self.timeout).decode("utf-8")
            return f'<div class="fx-figure">{_inline_svg(svg)}</div>'
        except RenderError as exc:
            return (f'<div class="fx-figure"><p class="fx-warning">The {html.escape(what)} could not '
                    f"be drawn: {html.escape(str(exc))}</p>{listing()}</div>")

    def sections(self) -> Iterator[str]:
        for index, (depth, record) in enumerate(self.report.walk()):
            yield self.section(index, depth, record)

    def section(self, index: int, depth: int, r: PassRecord) -> str:
        status = "skipped" if r.skipped else ("changed" if r.changed else "unchanged")
        out = [f'<section class="fx-pass fx-{status} fx-depth-{min(depth, 3)}" id="pass-{index}" '
               f'data-pass="{html.escape(r.name)}">',
               f"<h2>{index + 1}. {html.escape(r.name)} <small>({status})</small></h2>",
               f'<div class="fx-meta"><b>time</b> {r.seconds * 1e3:.2f} ms &nbsp; <b>nodes</b> '
               f"{r.nodes_before} → {r.nodes_after}"
               + (f" &nbsp; <b>rounds</b> {r.rounds}" if r.rounds is not None else "") + "</div>"]
        if r.skipped:
            out.append(f'<div class="fx-meta">{html.escape(r.skipped)}</div>')
        out += [f'<div class="fx-warning">{html.escape(w)}</div>' for w in r.warnings]
        plans = []
        if r.stats:
            items = []
            for key, value in r.stats.items():
                if is_memory_plan(value):
                    plans.append((key, value))
                    value = (f"arena {human_bytes(value.arena_bytes)}, lower bound "
                             f"{human_bytes(value.lower_bound_bytes)}, {len(list(value.buffers))} buffers")
                else:
                    value = safe_repr(value, 300)
                items.append(f"<b>{html.escape(str(key))}</b> {html.escape(value)}")
            out.append('<div class="fx-meta fx-stats">' + " &nbsp; ".join(items) + "</div>")
        if r.before is not None and not r.children:
            diff = diff_graphs(r.before, self.after_of[id(r)])
            out.append(f'<div class="fx-meta fx-diff-summary">{html.escape(str(diff))}</div>')
            out.append(self.diff_figure(diff, index))
        for key, plan in plans:
            out.append(f'<div class="fx-figure fx-memory">{memory_plan_svg(plan, f"{r.name}: {key}")}</div>')
        out.append("</section>")
        return "\n".join(out)

    def diff_figure(self, diff: GraphDiff, index: int) -> str:
        dot = diff_to_dot(diff, focus=self.focus, id_prefix=f"p{index}_", title=f"pass{index}")
        return self.figure(dot, "diff", lambda: diff_listing(diff))

    def table(self) -> str:
        rows = []
        for index, (depth, r) in enumerate(self.report.walk()):
            changed = "skipped" if r.skipped else ("yes" if r.changed else "no")
            rows.append(f'<tr><td>{"&nbsp;" * 4 * depth}<a href="#pass-{index}">{html.escape(r.name)}</a></td>'
                        f'<td class="num">{r.seconds * 1e3:.2f}</td><td class="num">{r.nodes_before}</td>'
                        f'<td class="num">{r.nodes_after}</td><td>{changed}</td></tr>')
        return ('<table class="fx-passes"><thead><tr><th>pass</th><th>ms</th><th>nodes before</th>'
                "<th>nodes after</th><th>changed</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")

    def page(self, title: str) -> str:
        report = self.report
        first = report.records[0].nodes_before if report.records else len(self.gm.graph.nodes)
        summary = (f"{len(report.records)} passes, {report.total_seconds * 1e3:.1f} ms, "
                   f"{first} → {len(self.gm.graph.nodes)} nodes"
                   + (", verified after each pass" if report.verified else ""))
        head = [f"<h1>{html.escape(title)}</h1>", f'<div class="fx-summary">{html.escape(summary)}</div>']
        if self.missing_renderer:
            head.append(f'<p class="fx-warning" id="no-renderer">Graphs are listed as tables: '
                        f"{html.escape(self.missing_renderer)}</p>")
        head += [f'<div class="fx-warning">{html.escape(w)}</div>' for w in report.warnings]
        final = ""
        if len(self.gm.graph.nodes) <= 400:
            final = ('<details id="final-graph"><summary>final graph</summary>'
                     + self.figure(to_dot(self.gm, id_prefix="final_"), "final graph",
                                 lambda: graph_listing(self.gm)) + "</details>")
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
                + "\n".join(head) + self.table() + "\n".join(self.sections()) + final
                + "\n</body></html>\n")


def report_html(gm: fx.GraphModule, *, title: str | None = None, renderer: str | os.PathLike | None = None,
                focus: int | str | None = 2, timeout: float | None = 120) -> str:
    """The HTML report of the fxopt run that produced ``gm`` (see :func:`write_report`)."""
    report = report_of(gm)
    title = title or "fxopt report"
    return _Page(gm, report, renderer, focus, timeout).page(title)


def write_report(gm: fx.GraphModule, path: str | os.PathLike, **options: Any) -> Path:
    """Write the per-pass HTML report of the run that produced ``gm`` to ``path``.

    ``gm`` is what ``fxopt.optimize`` returned (the report is ``fxopt.report_of(gm)``).
    Options: ``title``, ``renderer``, ``focus`` (of each diff; see ``render_diff``),
    ``timeout`` (seconds per drawing). Without a renderer the page still gets written,
    with node tables in place of pictures and one line saying how to get a renderer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(gm, **options), encoding="utf-8")
    return path
