"""The HTML report of a real model, used in a real headless Chromium (through playwright):
it loads offline with no script errors, zooms and pans, finds nodes, collapses the
unchanged regions of a large diff, navigates pass by pass, and colours the nodes each
pass added, removed and changed. Expected nodes come from the graphs themselves (which
Node objects a pass erased or created), not from the report's own classification."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx
from fxopt.visualize import write_report

import fxopt
from fxopt.testing.zoo import ZOO

PIPELINE = ["fold_conv_bn", "cse", "inplace"]
JS_ERRORS = ("error", "warning", "assert")


@pytest.fixture(scope="module")
def resnet() -> fx.GraphModule:
    """resnet18 captured by torch.export (about 200 ATen-level nodes): big enough that
    fold_conv_bn's diff gets its unchanged regions collapsed."""
    case = ZOO["resnet18"]
    model, inputs = case.model().eval(), case.inputs()
    return fxopt.optimize(torch.export.export(model, inputs), passes=PIPELINE, example_inputs=inputs)


def truth(gm: fx.GraphModule, name: str) -> tuple[set[str], set[str], int]:
    """Names of the nodes pass ``name`` erased and created (by Node identity: the snapshot
    holds the very objects of the graph before it), and the size of before ∪ after."""
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    i = next(i for i, r in enumerate(records) if r.name == name)
    after = records[i + 1].before.nodes if i + 1 < len(records) else list(gm.graph.nodes)
    before = list(records[i].before.nodes)
    erased = {n.name for n in before if n not in set(after)}
    created = {n.name for n in after if n not in set(before)}
    return erased, created, len(after) + len(erased)


def wait_frames(page) -> None:
    """svg-pan-zoom writes its transform on the next animation frame."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def shown(page, section: str) -> dict[str, str]:
    """Node name -> SVG class of every node drawn in a pass section's figure."""
    return page.evaluate("""(id) => Object.fromEntries([...document.querySelectorAll(
        '#' + id + ' .fx-zoom g.node.fx_node')].map(g => [g.querySelector('text').textContent.trim(),
        g.getAttribute('class')]))""", section)


def section_of(gm: fx.GraphModule, name: str) -> str:
    """The section drawing pass ``name``'s diff (a sequence's own step, not the sequence)."""
    index = next(i for i, (_, r) in enumerate(fxopt.report_of(gm).walk())
                 if r.name == name and r.before is not None)
    return f"pass-{index}"


def test_report_of_resnet_in_a_browser(resnet, renderer, playwright_browser, tmp_path: Path) -> None:
    path = write_report(resnet, tmp_path / "report.html")
    page = playwright_browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(5000)  # a missing element fails in seconds, not minutes
    problems: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in JS_ERRORS else None)
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    fold, inplace = section_of(resnet, "fold_conv_bn"), section_of(resnet, "inplace")

    # every pass in the sidebar; the changing ones marked
    walk = list(fxopt.report_of(resnet).walk())
    entries = page.eval_on_selector_all("#fx-toc li", "els => els.map(e => e.className)")
    assert sum("fx-changed" in e for e in entries) == sum(r.changed for _, r in walk)
    # fold_conv_bn is a sequence (its rules, then constant folding): its steps are entries too
    assert {r.name for depth, r in walk if depth == 0 and r.changed} == {"fold_conv_bn", "inplace"}
    assert sum(e.startswith("fx-") and "part" not in e for e in entries) == len(walk)

    # added / removed / changed nodes, against what the passes did to the graph
    erased, created, union = truth(resnet, "fold_conv_bn")
    drawn = shown(page, fold)
    bn_calls = {n for n in erased if n.startswith("batch_norm")}
    assert len(bn_calls) == 20
    for name in bn_calls:  # every BatchNorm is gone, and drawn so
        assert "fx_diff_removed" in drawn[name], (name, drawn.get(name))
    new_convs = {n for n in created if n.startswith("convolution")}
    assert len(new_convs) == 20 and all("fx_diff_added" in drawn[n] for n in new_convs)
    assert all("fx_diff_removed" not in c for n, c in drawn.items() if n not in erased)
    # a diff of this size collapses the unchanged regions, and says so
    assert 0 < len(drawn) < union
    assert page.locator(f"#{fold} .fx-collapsed-note").count() == 1
    rewritten = {n.name for n in resnet.graph.nodes if n.meta.get("fxopt.created_by") == "inplace"}
    assert len(rewritten) == 17  # relu -> relu_, each a one-for-one replacement: changed
    drawn = shown(page, inplace)
    assert all("fx_diff_changed" in drawn[n] for n in rewritten)
    assert not any("fx_diff_changed" in c for n, c in drawn.items() if n not in rewritten)

    # zoom and pan: the mouse wheel over a drawing scales it, the API pans it
    figure = page.locator(f"#{fold} .fx-zoom")
    figure.scroll_into_view_if_needed()
    box = figure.bounding_box()
    viewport = f"#{fold} .svg-pan-zoom_viewport"
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    wait_frames(page)
    before = page.get_attribute(viewport, "transform")
    zoom_before = page.evaluate(f"fxReport.panZoom(document.querySelector('#{fold} .fx-zoom')).getZoom()")
    page.mouse.wheel(0, -400)
    wait_frames(page)
    after = page.get_attribute(viewport, "transform")
    zoom_after = page.evaluate(f"fxReport.panZoom(document.querySelector('#{fold} .fx-zoom')).getZoom()")
    assert after != before and zoom_after > zoom_before * 1.1, (before, after)
    page.evaluate(f"fxReport.panZoom(document.querySelector('#{fold} .fx-zoom')).panBy({{x: 120, y: -80}})")
    wait_frames(page)
    assert page.get_attribute(viewport, "transform") != after

    # search: highlights the node and pans its drawing so the node is in the middle
    target = sorted(rewritten)[3]
    count = page.evaluate("q => fxReport.search(q)", target)
    wait_frames(page)
    current = page.locator("g.node.fx-current")
    assert current.count() == 1 and count >= 1
    assert current.locator("text").first.text_content().strip() == target
    assert "fx-match" in current.get_attribute("class")
    hit, frame = current.bounding_box(), current.locator("xpath=ancestor::div[contains(@class, 'fx-zoom')]").bounding_box()
    assert abs(hit["x"] + hit["width"] / 2 - (frame["x"] + frame["width"] / 2)) < 20
    assert abs(hit["y"] + hit["height"] / 2 - (frame["y"] + frame["height"] / 2)) < 20
    names = page.eval_on_selector_all("g.node.fx-match", "els => els.map(e => e.querySelector('text').textContent)")
    assert len(names) == count and all(target in n for n in names)
    assert page.evaluate("fxReport.search('no_such_node_anywhere')") == 0
    assert page.locator("g.node.fx-match").count() == 0

    # pass-by-pass: "next change" visits every changing pass (a sequence, then its steps)
    # in order; "previous change" goes back
    changing = [f"pass-{i}" for i, (_, r) in enumerate(walk) if r.changed]
    assert fold in changing and changing[-1] == inplace
    page.evaluate("window.scrollTo(0, 0)")
    for section in changing:
        page.click("#fx-next")
        wait_frames(page)
        assert abs(page.locator(f"#{section}").bounding_box()["y"]) < 2, section
    page.click("#fx-prev")
    wait_frames(page)
    assert abs(page.locator(f"#{changing[-2]}").bounding_box()["y"]) < 2

    assert problems == []
    assert requests == [path.resolve().as_uri()]  # offline: nothing fetched but the page
    page.close()
