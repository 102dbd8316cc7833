"""The report's first view of a diff, in a real headless Chromium (through playwright): a
tall graph's diff opens on its change with the labels readable, and the whole graph is one
key (or one button) away. Screenshots of both views are left in the test's tmp_path."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from fxopt.visualize import write_report

import fxopt

#: the smallest label text of a changed node must be at least this tall on screen (CSS px)
READABLE_PX = 10
#: the changed node's centre must be this close to the drawing's centre (share of its size)
CENTRED = 0.1


class Tall(nn.Module):
    """A chain of 181 nodes with a dropout in the middle: a column of nodes thousands of
    points tall, so fitting it to the page shrinks its text to a speck."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(90):
            if i == 45:
                x = self.drop(x)
            x = torch.sin(x) * 0.9
        return x


def wait_frames(page) -> None:
    """svg-pan-zoom writes its transform on the next animation frame."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def node_text_heights(page, figure: str, name: str) -> list[float]:
    """On-screen heights (CSS px) of the text lines of the node drawn with ``name``."""
    return page.evaluate("""([figure, name]) => {
        const node = [...document.querySelectorAll(figure + ' g.node')].find(
            g => g.querySelector('text') && g.querySelector('text').textContent.trim() === name);
        return [...node.querySelectorAll('text')].map(t => t.getBoundingClientRect().height);
    }""", [figure, name])


def node_box(page, figure: str, name: str) -> dict[str, float]:
    return page.evaluate("""([figure, name]) => {
        const node = [...document.querySelectorAll(figure + ' g.node')].find(
            g => g.querySelector('text') && g.querySelector('text').textContent.trim() === name);
        const r = node.getBoundingClientRect();
        return {x: r.x, y: r.y, width: r.width, height: r.height};
    }""", [figure, name])


def rect(page, selector: str) -> dict[str, float]:
    return page.evaluate("""(s) => { const r = document.querySelector(s).getBoundingClientRect();
        return {x: r.x, y: r.y, width: r.width, height: r.height}; }""", selector)


def inside(inner: dict[str, float], outer: dict[str, float], slack: float = 2) -> bool:
    return (inner["x"] >= outer["x"] - slack and inner["y"] >= outer["y"] - slack
            and inner["x"] + inner["width"] <= outer["x"] + outer["width"] + slack
            and inner["y"] + inner["height"] <= outer["y"] + outer["height"] + slack)


def test_a_tall_diff_opens_on_its_change_readable_with_the_whole_graph_one_key_away(
        renderer, playwright_browser, tmp_path: Path) -> None:
    model = Tall().eval()
    gm = fxopt.optimize(model, passes=["remove_dropout"], example_inputs=(torch.randn(4),))
    (record,) = fxopt.report_of(gm).records
    before = list(record.before.nodes)
    assert len(before) >= 150
    (removed,) = {n.name for n in before} - {n.name for n in gm.graph.nodes}  # the dropout, mid-chain
    assert 0.4 < [n.name for n in before].index(removed) / len(before) < 0.6

    path = write_report(gm, tmp_path / "report.html", focus=None)  # draw every node
    page = playwright_browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(5000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    figure = "#pass-0 .fx-zoom"
    page.locator(figure).scroll_into_view_if_needed()
    wait_frames(page)
    page.screenshot(path=tmp_path / "changes.png")

    # opened on the change: readable, and in the middle of the drawing (and of the window)
    heights = node_text_heights(page, figure, removed)
    assert len(heights) >= 3 and min(heights) >= READABLE_PX, heights
    box, frame = node_box(page, figure, removed), rect(page, figure)
    assert inside(box, frame) and inside(box, {"x": 0, "y": 0, "width": 1400, "height": 900})
    assert abs(box["x"] + box["width"] / 2 - (frame["x"] + frame["width"] / 2)) < CENTRED * frame["width"]
    assert abs(box["y"] + box["height"] / 2 - (frame["y"] + frame["height"] / 2)) < CENTRED * frame["height"]
    button = page.locator(f"{figure} .fx-whole-button")
    assert button.is_visible() and "whole graph" in button.text_content()

    # key f: the whole drawing fits in its box (and there, the text is far too small to read)
    page.keyboard.press("f")
    wait_frames(page)
    page.screenshot(path=tmp_path / "whole.png")
    drawing = rect(page, f"{figure} .svg-pan-zoom_viewport")
    assert inside(drawing, rect(page, figure)), (drawing, rect(page, figure))
    assert drawing["height"] > 0.9 * rect(page, figure)["height"]  # fitted, not shrunk further
    assert max(node_text_heights(page, figure, removed)) < READABLE_PX / 2
    assert "changes" in button.text_content()

    # f again, then the button: back on the change, and the whole graph again
    page.keyboard.press("f")
    wait_frames(page)
    assert min(node_text_heights(page, figure, removed)) >= READABLE_PX
    assert inside(node_box(page, figure, removed), rect(page, figure))
    button.click()
    wait_frames(page)
    assert inside(rect(page, f"{figure} .svg-pan-zoom_viewport"), rect(page, figure))
    assert problems == []
    page.close()
