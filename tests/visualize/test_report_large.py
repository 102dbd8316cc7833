"""The report of a 10,242-node graph, used in headless Chromium (through playwright): every
pass's diff is drawn, lists every rewrite it made, and is reached by "next change"; the
final graph opens module by module down to one block, which shows that block's own nodes.

The model is a stack of 2,048 small blocks (linear, ReLU, dropout, residual add, ReLU),
optimized with remove_dropout, fuse_add_relu and fuse_linear_relu, which rewrite every
block. What each pass erased and created comes from the graphs themselves (Node identity
between snapshots); the names the fused nodes get are fx's (``linear_relu_k`` is block k's).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from fxopt.visualize import write_report

import fxopt
from fxopt.models import dropout_stack

BLOCKS = 2048
PASSES = ["remove_dropout", "fuse_add_relu", "fuse_linear_relu"]
#: the report's budget on this graph (issue 39): the file must stay mailable
MAX_BYTES = 10_000_000


@pytest.fixture(scope="module")
def stack() -> fx.GraphModule:
    gm = fxopt.optimize(dropout_stack(BLOCKS), passes=PASSES, example_inputs=(torch.randn(2, 8),))
    assert fxopt.report_of(gm).records[0].nodes_before == 5 * BLOCKS + 2
    return gm


def changes(gm: fx.GraphModule) -> list[tuple[str, set[str], set[str]]]:
    """(pass, names it erased, names it created) for each changing pass, by Node identity."""
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    out = []
    for i, r in enumerate(records):
        after = records[i + 1].before.nodes if i + 1 < len(records) else list(gm.graph.nodes)
        before = list(r.before.nodes)
        erased = {n.name for n in before if n not in set(after)}
        created = {n.name for n in after if n not in set(before)}
        out.append((r.name, erased, created))
    return out


def wait_frames(page) -> None:
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def texts(locator) -> list[str]:
    return [t.strip() for t in locator.locator("text").all_text_contents()]


def open_box(page, pick) -> list[str]:
    """Click the module box of the last open level that ``pick(texts of the box)`` accepts;
    the texts of the level it opens."""
    level = page.locator(".fx-level").last
    boxes = level.locator("g.node.fx_scope")
    chosen = [i for i in range(boxes.count()) if pick(texts(boxes.nth(i)))]
    assert len(chosen) == 1, [texts(boxes.nth(i)) for i in range(boxes.count())]
    count = page.locator(".fx-level").count()
    # a box may lie outside the part of a tall level in view: dispatch the click it would get
    boxes.nth(chosen[0]).dispatch_event("click")
    wait_frames(page)
    assert page.locator(".fx-level").count() == count + 1
    return texts(page.locator(".fx-level").last)


def holds(block: int):
    """Accepts the box of module ``blocks`` and of a run ``blocks.A … blocks.B`` around ``block``."""
    def pick(lines: list[str]) -> bool:
        bounds = re.fullmatch(r"blocks\.(\d+) … blocks\.(\d+)", lines[0])
        return bool(bounds) and int(bounds[1]) <= block <= int(bounds[2])
    return pick


def test_report_of_10k_nodes_draws_every_diff_and_opens_by_module(
        stack, renderer, playwright_browser, tmp_path: Path) -> None:
    path = write_report(stack, tmp_path / "report.html")
    assert path.stat().st_size <= MAX_BYTES
    page = playwright_browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(10_000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    walk = list(fxopt.report_of(stack).walk())
    truth = changes(stack)
    assert [name for name, _, _ in truth] == PASSES

    for name, erased, created in truth:
        section = f"pass-{next(i for i, (_, r) in enumerate(walk) if r.name == name)}"
        # drawn: a picture, not the table a failed drawing leaves; what it marks removed
        # and added is what the pass erased and created
        figure = page.locator(f"#{section} .fx-zoom")
        assert figure.count() == 1 and figure.locator("svg").count() == 1, name
        drawn = page.evaluate("""(id) => [...document.querySelectorAll('#' + id + ' .fx-zoom g.node.fx_node')]
            .map(g => [g.querySelector('text').textContent.trim(), g.getAttribute('class')])""", section)
        removed = {n for n, c in drawn if "fx_diff_removed" in c}
        added = {n for n, c in drawn if "fx_diff_added" in c}
        assert removed | added and removed <= erased and added <= created, name
        # every rewrite listed where it happened: each erased and created node exactly once
        listed = page.eval_on_selector_all(f"#{section} .fx-where li", "els => els.map(e => e.textContent)")
        names = [n.strip() for item in listed for n in item.split(": ", 1)[1].split(",")]
        assert sorted(names) == sorted(erased | created), name
        assert len(listed) == BLOCKS  # one rewrite per block, each pass
        counts = page.eval_on_selector_all(f"#{section} .fx-kind summary b", "els => els.map(e => e.textContent)")
        assert sum(int(c.lstrip("×")) for c in counts) == BLOCKS

    # navigable: "next change" lands on each pass in turn, and its drawing opens on a change
    page.evaluate("window.scrollTo(0, 0)")
    for index, (_, record) in enumerate(walk):
        if not record.changed:
            continue
        page.click("#fx-next")
        wait_frames(page)
        section = page.locator(f"#pass-{index}")
        assert abs(section.bounding_box()["y"]) < 2, record.name
        figure = section.locator(".fx-zoom")
        page.wait_for_selector(f"#pass-{index} .svg-pan-zoom_viewport", state="attached")
        wait_frames(page)
        frame = figure.bounding_box()
        changed = section.locator("g.node.fx_diff_removed, g.node.fx_diff_added, g.node.fx_diff_changed")
        boxes = [changed.nth(i).bounding_box() for i in range(changed.count())]
        assert any(frame["x"] <= b["x"] + b["width"] / 2 <= frame["x"] + frame["width"]
                   and frame["y"] <= b["y"] + b["height"] / 2 <= frame["y"] + frame["height"]
                   for b in boxes), record.name

    # the final graph by module: the top level holds the stack; open it down to block 1234
    page.locator("#final .fx-level").first.scroll_into_view_if_needed()
    assert page.locator(".fx-level").count() == 1
    seen = open_box(page, lambda lines: lines[0] == "blocks")
    while not any(t == "blocks.1234" for t in seen):
        seen = open_box(page, holds(1234))
    seen = open_box(page, lambda lines: lines[0] == "blocks.1234")
    # block 1234's own nodes (the fused ones carry fx's names), the weights' module, and
    # what it reads from block 1233; nothing of any other block
    assert {"linear_relu_1234", "add_relu_1234", "blocks.1234.lin", "add_relu_1233"} <= set(seen)
    others = {t for t in seen if re.search(r"\d+", t) and "1234" not in t and "1233" not in t}
    assert not {t for t in others if re.fullmatch(r"(linear|add)_relu_\d+|blocks\.\d+.*", t)}, others
    seen = open_box(page, lambda lines: lines[0] == "blocks.1234.lin")
    assert {"blocks_1234_lin_weight", "blocks_1234_lin_bias"} <= set(seen)
    # search finds a node of a block no level shows yet: it opens the levels down to it
    page.locator(".fx-level").first.locator("g.node.fx_scope").first.dispatch_event("click")
    assert page.evaluate("q => fxReport.search(q)", "linear_relu_1500") == 1
    wait_frames(page)
    current = page.locator("g.node.fx-current")
    assert current.locator("text").first.text_content().strip() == "linear_relu_1500"
    level = current.locator("xpath=ancestor::div[@class='fx-level']")
    assert level.locator(".fx-level-title").text_content().startswith("blocks.1500 ")
    # a module of an earlier level opens in place of what was open below it
    page.locator(".fx-level").first.locator("g.node.fx_scope").first.dispatch_event("click")
    wait_frames(page)
    assert page.locator(".fx-level").count() == 2
    assert problems == []
    page.close()
