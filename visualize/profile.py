"""The profile on the graph: a heat map of node time/memory and the live-memory curve.

:func:`profile_section` is the report's "profile" section (``fxopt.optimize(...,
profile=fxopt.profile)`` puts a before/after profile in the report); :func:`profile_html` is a page
of its own for a single :class:`~fxopt.profiling.Profile` (``fxopt profile --report``).
The heat map is the graph drawn with :func:`~fxopt.visualize.graph.to_dot`'s overlay
(node colour = share of the time, or of the bytes allocated, with a legend); the curve is
hand-written SVG like the memory-plan chart: measured live bytes per node (and the peak
inside each node), the liveness analysis's prediction and ``plan_memory``'s arena.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from .figures import Figures, asset
from .graph import to_dot
from .memory import human_bytes

_WIDTH, _HEIGHT, _LEFT, _TOP, _BOTTOM, _RIGHT = 900, 300, 80, 30, 44, 20
#: graphs larger than this are drawn with their modules collapsed
_COLLAPSE_ABOVE = 400

Figure = Callable[[str, str], str]


def heat_map_dot(profile: Any, metric: str = "time", id_prefix: str = "heat_") -> str:
    """The DOT of the profiled graph coloured by ``metric`` ("time" or "memory") share."""
    gm = profile.graph_module
    big = len(gm.graph.nodes) > _COLLAPSE_ABOVE
    title = "% of time" if metric == "time" else "% of bytes allocated"
    return to_dot(gm, overlay=profile.overlay(metric), overlay_title=title, overlay_format="{:.1f}",
                  collapse_depth=1 if big else None, id_prefix=id_prefix, show_args=False)


def memory_curve_svg(profile: Any, title: str = "live memory") -> str:
    """Inline SVG: live bytes over the node order, measured and predicted."""
    names = [n.name for n in profile.nodes]
    live = [n.live_bytes for n in profile.nodes]
    peak = [n.peak_bytes for n in profile.nodes]
    predicted = profile.predicted_bytes if profile.predicted_bytes and len(profile.predicted_bytes) == len(names) else None
    top = max([*peak, *(predicted or []), profile.arena_bytes or 0, 1])
    count = max(len(names), 1)
    inner_w, inner_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x(i: float) -> float:
        return _LEFT + i / count * inner_w

    def y(b: float) -> float:
        return _TOP + inner_h - b / top * inner_h

    def steps(values: list[int]) -> str:
        return " ".join(f"{x(i):.1f},{y(v):.1f} {x(i + 1):.1f},{y(v):.1f}" for i, v in enumerate(values))

    esc = html.escape
    parts = [
        f'<svg class="fx-memory-curve" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="{esc(title)}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f'<text x="{_LEFT}" y="16" font-weight="bold">{esc(title)}: measured peak '
        f'{esc(human_bytes(profile.peak_bytes))}'
        + (f", predicted {esc(human_bytes(max(predicted)))}" if predicted else "")
        + (f", arena {esc(human_bytes(profile.arena_bytes))}" if profile.arena_bytes else "") + "</text>",
        f'<rect x="{_LEFT}" y="{_TOP}" width="{inner_w}" height="{inner_h}" fill="#f9fafb" stroke="#d1d5db"/>',
        f'<polyline class="fx-peak" fill="none" stroke="#fca5a5" stroke-width="1" points="{steps(peak)}"/>',
        f'<polyline class="fx-measured" fill="none" stroke="#dc2626" stroke-width="1.5" points="{steps(live)}"/>',
    ]
    if predicted:
        parts.append(f'<polyline class="fx-predicted" fill="none" stroke="#2563eb" stroke-width="1.2" '
                     f'stroke-dasharray="5 3" points="{steps(predicted)}"/>')
    if profile.arena_bytes:
        a = y(profile.arena_bytes)
        parts.append(f'<line class="fx-arena" x1="{_LEFT}" x2="{_LEFT + inner_w}" y1="{a:.1f}" y2="{a:.1f}" '
                     'stroke="#059669" stroke-dasharray="2 3"/>')
    for i, name in enumerate(names):  # hover targets
        tip = f"{name}: live {human_bytes(live[i])}, peak {human_bytes(peak[i])}" + (
            f", predicted {human_bytes(predicted[i])}" if predicted else "")
        parts.append(f'<rect x="{x(i):.1f}" y="{_TOP}" width="{max(inner_w / count, 0.5):.2f}" '
                     f'height="{inner_h}" fill="transparent"><title>{esc(tip)}</title></rect>')
    for i in range(5):
        b = top * i / 4
        parts.append(f'<text x="{_LEFT - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{esc(human_bytes(b))}</text>')
    legend = [("#dc2626", "measured, after each node"), ("#fca5a5", "measured peak inside the node"),
              ("#2563eb", "liveness prediction"), ("#059669", "plan_memory arena")]
    for i, (colour, label) in enumerate(legend):
        lx = _LEFT + i * 200
        parts.append(f'<line x1="{lx}" x2="{lx + 18}" y1="{_HEIGHT - 12}" y2="{_HEIGHT - 12}" stroke="{colour}" '
                     f'stroke-width="2"/><text x="{lx + 22}" y="{_HEIGHT - 8}">{esc(label)}</text>')
    parts.append(f'<text x="{_LEFT + inner_w / 2}" y="{_HEIGHT - 26}" text-anchor="middle" fill="#6b7280">'
                 f"node order (0 … {len(names) - 1})</text></svg>")
    return "\n".join(parts)


def profile_section(profile: Any, figure: Figure, title: str = "profile", diff: Any = None) -> str:
    """The report section: summary, hotspot table, heat maps, memory curve."""
    esc = html.escape
    out = [f'<section class="fx-profile" id="profile"><h2>{esc(title)}</h2>',
           f'<pre class="fx-profile-table">{esc(profile.table(top=15))}</pre>']
    if diff is not None:
        out.append(f'<pre class="fx-profile-diff">{esc(diff.table())}</pre>')
    if profile.graph_module is not None:
        out.append('<details open class="fx-heat fx-heat-time"><summary>graph coloured by share of time'
                   "</summary>" + figure(heat_map_dot(profile, "time", "heat_t_"), "time heat map") + "</details>")
        out.append('<details class="fx-heat fx-heat-memory"><summary>graph coloured by share of bytes '
                   "allocated</summary>" + figure(heat_map_dot(profile, "memory", "heat_m_"), "memory heat map")
                   + "</details>")
    out.append(f'<div class="fx-figure fx-memory">{memory_curve_svg(profile)}</div></section>')
    return "\n".join(out)


def profile_html(profile: Any, *, title: str = "fxopt profile", renderer: Any = None,
                 timeout: float | None = 120) -> str:
    """A self-contained page for one profile (heat maps, tables, memory curve)."""
    body = profile_section(profile, Figures(renderer, timeout).figure, title)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{asset('report.css')}</style></head><body>\n{body}\n</body></html>\n")
