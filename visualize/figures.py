"""Drawings and assets of fxopt's HTML pages (the report, the profile page): a graph drawn
as an inline, zoomable SVG, or a table of its nodes when it cannot be drawn; the CSS and
scripts shipped in the package."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

from fxopt.errors import RendererNotFoundError, RenderError

from .renderer import find_renderer, run_renderer

_SVG_START = re.compile(r"<svg\b")
_SVG_HEIGHT = re.compile(r'<svg\b[^>]*?\sheight="([\d.]+)pt"')
#: the tallest a drawing's box starts (it zooms inside, and can be resized)
MAX_FIGURE_PX = 720


def asset(name: str) -> str:
    """A file shipped in the package (see pyproject's package-data)."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def script(source: str) -> str:
    """``source`` as an inline script: a ``</script`` inside would end the element early."""
    return "<script>" + re.sub(r"</(script)", r"<\\/\1", source, flags=re.IGNORECASE) + "</script>"


class Figures:
    """Draws the figures of one page; looks the renderer up once."""

    def __init__(self, renderer: Any, timeout: float | None):
        self.renderer, self.timeout = renderer, timeout
        try:
            find_renderer(renderer)
            self.missing_renderer: str | None = None
        except RendererNotFoundError as exc:
            self.missing_renderer = str(exc)

    def figure(self, dot: str, what: str, listing: Callable[[], str] | None = None) -> str:
        """The drawing of ``dot``, zoomable; when it cannot be drawn, ``listing()`` (a table
        of its nodes), or a line saying why for drawings whose content a table on the page
        already lists (the profile's heat maps)."""
        if self.missing_renderer is None:
            try:
                svg = run_renderer(dot, "svg", self.renderer, self.timeout).decode("utf-8")
                return zoomable(_inline_svg(svg))
            except RenderError as exc:
                reason = f'<p class="fx-warning">The {html.escape(what)} could not be drawn: {html.escape(str(exc))}</p>'
        else:
            reason = ""  # said once, at the top of the page
        body = listing() if listing else f'<p class="fx-note">The {html.escape(what)} is not drawn (no renderer).</p>'
        return f'<div class="fx-figure">{reason}{body}</div>'


def _inline_svg(svg: str) -> str:
    """An SVG document as an element for HTML: without its XML prolog and doctype."""
    match = _SVG_START.search(svg)
    return svg[match.start():] if match else html.escape(svg)


def zoomable(svg: str) -> str:
    """An inline SVG in a box that svg-pan-zoom drives, as tall as the drawing up to a limit."""
    match = _SVG_HEIGHT.search(svg)
    height = min(float(match.group(1)) * 4 / 3 + 8, MAX_FIGURE_PX) if match else MAX_FIGURE_PX
    return f'<div class="fx-figure fx-zoom" style="height: {max(height, 120):.0f}px">{svg}</div>'
