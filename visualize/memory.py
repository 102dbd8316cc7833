"""The memory-plan chart: every planned buffer as a box over time at its arena offset.

A plan (``plan_memory``'s ``PassRecord.stats["plan"]``) has ``arena_bytes``,
``lower_bound_bytes`` and ``buffers`` with ``name, start, end, offset, size``, where
``[start, end]`` is the closed range of program points the buffer is live
(:mod:`fxopt.analysis.liveness`). Reading it this way (duck typing) keeps this module
independent of the planner. The SVG is written by hand: it is a few rectangles, and the
report must work offline, with no charting library.
"""

from __future__ import annotations

import html
import zlib
from typing import Any

_WIDTH, _HEIGHT, _LEFT, _TOP, _BOTTOM, _RIGHT = 900, 360, 70, 30, 40, 20


def is_memory_plan(value: Any) -> bool:
    return all(hasattr(value, a) for a in ("arena_bytes", "lower_bound_bytes", "buffers"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _colour(name: str) -> str:
    hue = zlib.crc32(name.encode("utf-8", "replace")) % 360
    return f"hsl({hue}, 60%, 62%)"


def memory_plan_svg(plan: Any, title: str = "memory plan") -> str:
    """An inline SVG of ``plan``: x is the program point, y the offset in the arena."""
    buffers = list(plan.buffers)
    arena = max(int(plan.arena_bytes), max((b.offset + b.size for b in buffers), default=0), 1)
    last = max((b.end for b in buffers), default=0) + 1
    first = min((b.start for b in buffers), default=0)
    span = max(last - first, 1)
    inner_w, inner_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x(t: float) -> float:
        return _LEFT + (t - first) / span * inner_w

    def y(offset: float) -> float:
        return _TOP + inner_h - offset / arena * inner_h

    esc = html.escape
    parts = [
        f'<svg class="fx-memory-plan" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-label="{esc(title)}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f'<text x="{_LEFT}" y="16" font-weight="bold">{esc(title)}: arena '
        f'{esc(human_bytes(arena))}, lower bound {esc(human_bytes(plan.lower_bound_bytes))}, '
        f'{len(buffers)} buffers</text>',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{inner_w}" height="{inner_h}" fill="#f9fafb" stroke="#d1d5db"/>',
    ]
    for b in buffers:
        x0, x1 = x(b.start), x(b.end + 1)
        y1, y0 = y(b.offset), y(b.offset + b.size)
        tip = (f"{b.name}: {human_bytes(b.size)} at offset {b.offset}, "
               f"live [{b.start}, {b.end}]")
        parts.append(
            f'<rect class="fx-buffer" x="{x0:.2f}" y="{y0:.2f}" width="{max(x1 - x0, 0.5):.2f}" '
            f'height="{max(y1 - y0, 0.5):.2f}" fill="{_colour(str(b.name))}" stroke="#374151" '
            f'stroke-width="0.4"><title>{esc(tip)}</title></rect>')
    bound = y(plan.lower_bound_bytes)
    parts.append(f'<line class="fx-lower-bound" x1="{_LEFT}" x2="{_LEFT + inner_w}" y1="{bound:.2f}" '
                 f'y2="{bound:.2f}" stroke="#dc2626" stroke-dasharray="6 4"/>'
                 f'<text x="{_LEFT + inner_w - 4}" y="{bound - 4:.2f}" text-anchor="end" '
                 f'fill="#dc2626">lower bound</text>')
    for i in range(5):  # y axis: offsets
        off = arena * i / 4
        parts.append(f'<text x="{_LEFT - 6}" y="{y(off) + 4:.2f}" text-anchor="end">'
                     f'{esc(human_bytes(off))}</text>')
    for i in range(6):  # x axis: program points
        t = first + span * i / 5
        parts.append(f'<text x="{x(t):.2f}" y="{_HEIGHT - _BOTTOM + 16}" text-anchor="middle">{t:.0f}</text>')
    parts.append(f'<text x="{_LEFT + inner_w / 2}" y="{_HEIGHT - 6}" text-anchor="middle" '
                 'fill="#6b7280">program point (node index); height: bytes at their arena offset</text>')
    parts.append("</svg>")
    return "\n".join(parts)
