"""The HTML report of an optimize run: one self-contained page, readable offline.

Per pass: its statistics and time, the diff of what it did as inline SVG, and the
memory-plan chart when the pass produced a plan. The "after" of a changing pass is the
"before" snapshot of the next changing pass, or the final graph. Everything is inlined
(CSS, SVG, and the script: the vendored svg-pan-zoom and our glue, ``report.js``; no
fonts or libraries from the network), so the file can be mailed or attached to a bug.
A graph that cannot be drawn (no renderer, a renderer error) is listed as a table of
its nodes instead (:mod:`.listing`), never dropped and never fatal; without a renderer,
one line at the top says how to get one.

Made for graphs of tens of thousands of nodes: every drawing zooms and pans, a search
box finds nodes by name or op, a diff of a large graph draws only the changes and their
neighbourhood (``focus``) or, when that is still too much, one example of each kind of
rewrite and where each happened (:mod:`.repeats`), the final graph of a large graph opens
module by module (:mod:`.outline`), and a sidebar lists the passes with prev/next-change
buttons. Graphviz never gets more than a few hundred nodes at once. The page is a list of :class:`Section` s, one method of :class:`_Page` each:
a new kind of section is one more method and one more line in :meth:`_Page.sections`.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxopt.errors import RenderError
from fxopt.optimize import report_of
from fxopt.report import PassRecord, Report
from fxopt.snapshot import GraphSnapshot

from .diff import DiffItems, GraphDiff, diff_graphs, diff_to_dot, diff_view
from .figures import Figures, asset, script
from .graph import to_dot
from .labels import safe_repr
from .listing import diff_listing, graph_listing
from .memory import human_bytes, is_memory_plan, memory_plan_svg
from .outline import build_outline, outline_html
from .profile import profile_section
from .repeats import group_diff, where_listing
from .scopes import origin_scopes, scope_tree

#: graphs up to this many nodes get a drawing of the final graph at the end of the page
FINAL_GRAPH_NODES = 400
#: a focused diff that would still draw more nodes than this is drawn by kind of rewrite
GROUP_ABOVE = 1000
#: and each example of a kind of rewrite is drawn with this many hops around it (``focus="auto"``)
GROUP_HOPS = 1


@dataclass
class Section:
    """One part of the page: its sidebar entry and its HTML, a ``<section id=anchor>``.

    ``status`` ('changed', 'unchanged', 'skipped' or '') marks the sidebar entry (and is
    a class of the section: prev/next-change stop at ``fx-changed`` ones); ``depth``
    indents nested passes.
    """

    anchor: str
    title: str
    html: str
    status: str = ""
    depth: int = 0


def _changing_leaves(report: Report) -> list[PassRecord]:
    return [r for _, r in report.walk() if r.before is not None and not r.children]


class _Page:
    """Builds the page; remembers whether a renderer exists so it is looked up once."""

    def __init__(self, gm: fx.GraphModule, report: Report, title: str, renderer: Any, focus: Any,
                 timeout: float | None):
        self.gm, self.report, self.title = gm, report, title
        self.focus = focus
        self.figures = Figures(renderer, timeout)
        self.built: dict[int, fx.Graph] = {}
        leaves = _changing_leaves(report)
        self.after_of = {id(r): (leaves[i + 1].before if i + 1 < len(leaves) else gm)
                         for i, r in enumerate(leaves)}

    # --- the sections, in page order -------------------------------------------------------

    def sections(self) -> list[Section]:
        return [self.overview(), *self.profile(), *self.passes(), *self.final_graph()]

    def profile(self) -> list[Section]:
        """``optimize(..., profile=fxopt.profile)``: the measured before/after, heat map, memory curve."""
        diff = self.report.profile
        if diff is None:
            return []
        return [Section("profile", "profile", profile_section(diff.after, self.figures.figure,
                                                              "profile after the passes", diff))]

    def overview(self) -> Section:
        """Title, totals, warnings and the table of passes."""
        report = self.report
        first = report.records[0].nodes_before if report.records else len(self.gm.graph.nodes)
        summary = (f"{len(report.records)} passes, {report.total_seconds * 1e3:.1f} ms, "
                   f"{first} → {len(self.gm.graph.nodes)} nodes"
                   + (", verified after each pass" if report.verified else ""))
        out = [f"<h1>{html.escape(self.title)}</h1>", f'<div class="fx-summary">{html.escape(summary)}</div>']
        if self.figures.missing_renderer:
            out.append(f'<p class="fx-warning" id="no-renderer">Graphs are listed as tables: '
                       f"{html.escape(self.figures.missing_renderer)}</p>")
        out += [f'<div class="fx-warning">{html.escape(w)}</div>' for w in report.warnings]
        out.append(self.table())
        return Section("overview", "overview", '<section id="overview">' + "\n".join(out) + "</section>")

    def passes(self) -> Iterator[Section]:
        """One section per pass (nested passes follow their parent)."""
        for index, (depth, record) in enumerate(self.report.walk()):
            status = "skipped" if record.skipped else ("changed" if record.changed else "unchanged")
            yield Section(f"pass-{index}", f"{index + 1}. {record.name}",
                          self.pass_section(index, depth, record, status), status, depth)

    def final_graph(self) -> list[Section]:
        """The optimized graph: drawn whole and folded away up to FINAL_GRAPH_NODES nodes;
        above that, by module, one level at a time (:mod:`.outline`)."""
        nodes = len(self.gm.graph.nodes)
        if nodes > FINAL_GRAPH_NODES:
            text = ('<h2>final graph, by module</h2><p class="fx-note">The final graph has '
                    f"{nodes} nodes. Drawn here is one level of modules; click a module (a blue box) "
                    "to open it below, and a module in that to go deeper.</p>" + self.outline())
        else:
            text = ('<details id="final-graph"><summary>final graph</summary>'
                    + self.figures.figure(to_dot(self.gm, id_prefix="final_"), "final graph",
                                 lambda: graph_listing(self.gm)) + "</details>")
        return [Section("final", "final graph", f'<section id="final">{text}</section>')]

    def outline(self) -> str:
        """The final graph by module; a line saying why when it cannot be drawn."""
        if self.figures.missing_renderer:
            return '<p class="fx-note">The final graph is not drawn (no renderer).</p>'
        first = next((r.before for _, r in self.report.walk() if r.before is not None), None)
        tree = scope_tree(self.gm.graph, origin_scopes(self.graph(first)) if first is not None else {})
        try:
            return outline_html(build_outline(self.gm.graph, self.gm, tree), self.figures.renderer,
                                self.figures.timeout)
        except RenderError as exc:
            return f'<p class="fx-warning">The final graph could not be drawn: {html.escape(str(exc))}</p>'

    # --- the parts of a pass section -------------------------------------------------------

    def pass_section(self, index: int, depth: int, r: PassRecord, status: str) -> str:
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
            diff = diff_graphs(self.graph(r.before), self.graph(self.after_of[id(r)]))
            out.append(f'<div class="fx-meta fx-diff-summary">{html.escape(str(diff))}</div>')
            out.append(self.diff_figure(diff, index))
        for key, plan in plans:
            out.append(f'<div class="fx-figure fx-memory">{memory_plan_svg(plan, f"{r.name}: {key}")}</div>')
        out.append("</section>")
        return "\n".join(out)

    def graph(self, graph: GraphSnapshot | fx.GraphModule) -> fx.Graph | fx.GraphModule:
        """A snapshot rebuilt once: the "after" of one diff is the "before" of the next."""
        if not isinstance(graph, GraphSnapshot):
            return graph
        if id(graph) not in self.built:
            self.built[id(graph)] = graph.build()
        return self.built[id(graph)]

    def diff_figure(self, diff: GraphDiff, index: int) -> str:
        view = diff_view(diff, self.focus)
        if view.hops is not None and len(view.shown) > GROUP_ABOVE:
            return self.grouped_figure(DiffItems(diff, view), index)
        note = ""
        if view.hidden:
            note = (f'<p class="fx-note fx-collapsed-note">Unchanged regions collapsed: drawn are the '
                    f"changes and {view.hops} hops around them, {len(view.shown)} of "
                    f"{len(view.status)} nodes (<code>write_report(gm, path, focus=None)</code> "
                    "draws them all).</p>")
        dot = diff_to_dot(diff, focus=self.focus, id_prefix=f"p{index}_", title=f"pass{index}")
        return note + self.figures.figure(dot, "diff", lambda: diff_listing(diff))

    def grouped_figure(self, items: DiffItems, index: int) -> str:
        """A diff whose changes and their context are too many to draw: one example of each
        kind of rewrite, its count, and where each happened (:mod:`.repeats`)."""
        hops = GROUP_HOPS if self.focus == "auto" else items.view.hops
        grouped = group_diff(items, hops, id_prefix=f"p{index}_", title=f"pass{index}")
        kinds = len(grouped.groups)
        note = (f'<p class="fx-note fx-grouped-note">{grouped.rewrites_count} rewrites of {kinds} '
                f"kind{'s' if kinds != 1 else ''}: drawn is one of each kind"
                + (f" (the first {grouped.drawn}; the others are listed)" if grouped.drawn < kinds else "")
                + f" with {hops} hop{'s' if hops != 1 else ''} around it, and listed below is where each happened "
                "(<code>write_report(gm, path, focus=None)</code> draws every node).</p>")
        figure = self.figures.figure(grouped.dot, "diff", lambda: diff_listing(items.diff))
        return note + figure + where_listing(grouped, f"pass-{index}")

    def table(self) -> str:
        rows = []
        for index, (depth, r) in enumerate(self.report.walk()):
            changed = "skipped" if r.skipped else ("yes" if r.changed else "no")
            rows.append(f'<tr><td>{"&nbsp;" * 4 * depth}<a href="#pass-{index}">{html.escape(r.name)}</a></td>'
                        f'<td class="num">{r.seconds * 1e3:.2f}</td><td class="num">{r.nodes_before}</td>'
                        f'<td class="num">{r.nodes_after}</td><td>{changed}</td></tr>')
        return ('<table class="fx-passes"><thead><tr><th>pass</th><th>ms</th><th>nodes before</th>'
                "<th>nodes after</th><th>changed</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")

    # --- the page ----------------------------------------------------------------------------

    def page(self) -> str:
        sections = self.sections()
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{asset('report.css')}</style></head>"
                f'<body>\n<div id="fx-layout">{_sidebar(sections)}<main>\n'
                + "\n".join(s.html for s in sections) + "\n</main></div>\n"
                + script(asset("vendor/svg-pan-zoom.min.js")) + "\n" + script(asset("report.js"))
                + "\n</body></html>\n")


def _sidebar(sections: list[Section]) -> str:
    """Search box, prev/next-change buttons, and one entry per section."""
    items = "".join(f'<li class="fx-{s.status or "part"} fx-depth-{min(s.depth, 3)}">'
                    f'<a href="#{s.anchor}" title="{html.escape(s.title)}">{html.escape(s.title)}</a></li>'
                    for s in sections)
    return ('<nav id="fx-toc"><input id="fx-search" type="search" placeholder="find a node: name or op" '
            'autocomplete="off" aria-label="find a node by name or op"><span id="fx-search-count"></span>'
            '<div class="fx-buttons"><button id="fx-prev" type="button" title="previous pass that changed '
            'the graph (p)">◀ prev change</button><button id="fx-next" type="button" title="next pass '
            'that changed the graph (n)">next change ▶</button></div>'
            f"<ol>{items}</ol>"
            '<div class="fx-keys">Drag to pan, wheel to zoom. A diff opens on its changes. Keys: '
            "/ search, Enter next match, n / p next / previous change, f whole graph / changes."
            "</div></nav>")


def report_html(gm: fx.GraphModule, *, title: str | None = None, renderer: str | os.PathLike | None = None,
                focus: int | str | None = "auto", timeout: float | None = 120) -> str:
    """The HTML report of the fxopt run that produced ``gm`` (see :func:`write_report`)."""
    report = report_of(gm)
    return _Page(gm, report, title or "fxopt report", renderer, focus, timeout).page()


def write_report(gm: fx.GraphModule, path: str | os.PathLike, **options: Any) -> Path:
    """Write the per-pass HTML report of the run that produced ``gm`` to ``path``.

    ``gm`` is what ``fxopt.optimize`` returned (the report is ``fxopt.report_of(gm)``).
    Options: ``title``, ``renderer``, ``focus`` (of each diff, see ``render_diff``: the
    default ``"auto"`` collapses the unchanged regions of graphs above 150 nodes, ``None``
    draws everything, ``k`` keeps k hops around the changes), ``timeout`` (seconds per
    drawing). The page zooms and pans, searches nodes, and navigates pass by pass
    (docs/report.md). Without a renderer the page still gets written,
    with node tables in place of pictures and one line saying how to get a renderer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(gm, **options), encoding="utf-8")
    return path
