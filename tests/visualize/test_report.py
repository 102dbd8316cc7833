"""The HTML report: its structure, offline self-containment, the memory chart, the CLI,
and what a real headless Chromium shows and logs when it opens it."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import pytest
import torch.fx as fx
from fxopt.visualize import memory_plan_svg, write_report
from fxopt.visualize.memory import is_memory_plan

import fxopt
from fxopt.cli import main
from fxopt.models import demo_model

CLEANUPS = ["remove_dropout", "eliminate_identity", "constant_fold", "cse", "dce"]


@pytest.fixture(scope="module")
def optimized() -> fx.GraphModule:
    model, inputs = demo_model()
    return fxopt.optimize(model, passes=[*CLEANUPS, "plan_memory"], example_inputs=inputs, verify=True)


def plan_of(gm: fx.GraphModule):
    plans = [v for _, r in fxopt.report_of(gm).walk() for v in r.stats.values() if is_memory_plan(v)]
    return plans[0] if plans else None


def sections(page: str) -> list[str]:
    return re.findall(r'<section class="fx-pass[^"]*" id="(pass-\d+)"', page)


def test_report_has_a_section_per_pass_with_stats_time_and_diff(optimized, renderer, tmp_path: Path) -> None:
    page = write_report(optimized, tmp_path / "r.html").read_text()
    records = [r for _, r in fxopt.report_of(optimized).walk()]
    assert len(sections(page)) == len(records)
    changed = [r for r in records if r.before is not None]
    # one inline, zoomable diff per changing pass
    assert len(re.findall(r'class="fx-figure fx-zoom"[^>]*><svg', page)) >= len(changed)
    assert page.count("fx_diff_removed") >= sum(1 for r in changed)  # every cleanup here removes a node
    for r in records:
        assert f'data-pass="{r.name}"' in page
        assert f"{r.seconds * 1e3:.2f} ms" in page
    assert "<b>removed</b> 1" in page  # remove_dropout's statistics


def test_report_is_self_contained(optimized, renderer, tmp_path: Path) -> None:
    page = write_report(optimized, tmp_path / "r.html").read_text()
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert re.findall(r"<script[^>]*>", page) == ["<script>", "<script>"]  # inline: pan-zoom and glue
    external = re.findall(r'(?:src|href)\s*=\s*"(?!#)([^"]*)"', page)
    assert external == []
    # XML namespaces, and svg-pan-zoom's home page in its header comment: names, never fetched
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page)) - {
        "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink", "http://www.w3.org/2000/xmlns/",
        "http://www.w3.org/2001/xml-events", "http://www.w3.org/XML/1998/namespace",
        "https://github.com/bumbu/svg-pan-zoom"}
    assert urls == set()


def test_memory_chart_draws_every_buffer_at_its_offset(optimized, tmp_path: Path) -> None:
    plan = plan_of(optimized)
    assert plan is not None, "plan_memory's report holds no memory plan"
    svg = memory_plan_svg(plan)
    rects = re.findall(r'<rect class="fx-buffer" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg)
    assert len(rects) == len(plan.buffers) > 0
    top = 30 + 290  # the plot's bottom edge: offset 0
    arena = max(plan.arena_bytes, max(b.offset + b.size for b in plan.buffers))
    for buffer, (_, y, _, h) in zip(plan.buffers, rects):
        # bottom of the box sits at the buffer's offset, its height is its size
        assert abs(top - (float(y) + float(h)) - buffer.offset / arena * 290) < 0.6
        assert abs(float(h) - max(buffer.size / arena * 290, 0.5)) < 0.6

    page = write_report(optimized, tmp_path / "r.html").read_text()
    assert page.count('class="fx-buffer"') == len(plan.buffers)


def listed_rows(section: str) -> list[tuple[str, str]]:
    """(status, node name) of each row of a section's node table."""
    return re.findall(r'<tr class="fx-diff-(\w+)"[^>]*><td>\w+</td><td>([^<]*)</td>', section)


def test_without_renderer_the_report_lists_nodes_and_says_once_how_to_get_one(
        optimized, tmp_path: Path) -> None:
    page = write_report(optimized, tmp_path / "r.html", renderer="/nonexistent/dot").read_text()
    banner = re.findall(r'<p class="fx-warning" id="no-renderer">([^\n]*?)</p>', page)
    assert len(banner) == 1 and "pip install graphviz-pure" in banner[0]
    assert page.count("pip install graphviz-pure") == 1
    assert "digraph" not in page and "<svg" not in page.split("fx-memory")[0]
    # remove_dropout's section lists the dropout it removed; the final graph lists every node
    first = page.split('id="pass-0"')[1].split("</section>")[0]
    assert any(status == "removed" and "drop" in name for status, name in listed_rows(first))
    final = page.split('id="final-graph"')[1]
    for node in optimized.graph.nodes:
        assert f"<tr><td>{node.name}</td><td>{node.op}</td>" in final


def test_a_renderer_that_fails_gets_its_reason_and_the_node_table(optimized, tmp_path: Path) -> None:
    broken = tmp_path / "dot"
    broken.write_text("#!/bin/sh\necho 'syntax error in line 1' >&2\nexit 3\n")
    broken.chmod(0o755)
    page = write_report(optimized, tmp_path / "r.html", renderer=str(broken)).read_text()
    first = page.split('id="pass-0"')[1].split("</section>")[0]
    assert "could not be drawn" in first and "exit code 3" in first and "syntax error" in first
    assert any(status == "removed" for status, _ in listed_rows(first))
    assert 'id="no-renderer"' not in page


def test_cli_demo_and_optimize_write_reports(renderer, tmp_path: Path, capsys) -> None:
    demo = tmp_path / "demo.html"
    assert main(["demo", "--report", str(demo)]) == 0
    assert len(sections(demo.read_text())) >= len(CLEANUPS)
    out = tmp_path / "opt.html"
    assert main(["optimize", "fxopt.models:DemoNet", "--input-shape", "2,3,32,32", "--passes", "cse,dce",
                 "--report", str(out)]) == 0
    assert len(sections(out.read_text())) == 2
    assert f"report written to {out}" in capsys.readouterr().out


def png_size_and_colours(path: Path) -> tuple[int, int, int]:
    """Width, height and the number of distinct colours in the first rows of a PNG
    (8-bit RGB/RGBA, as Chromium writes them), read with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, kind = struct.unpack(">IIBB", data[16:26])
    chunks, pos = b"", 8
    while pos < len(data):
        length, tag = struct.unpack(">I4s", data[pos:pos + 8])
        if tag == b"IDAT":
            chunks += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(chunks)
    channels = {2: 3, 6: 4}[kind]
    stride = width * channels + 1
    rows = [raw[i * stride + 1:(i + 1) * stride] for i in range(min(height, 400))]
    # filter bytes make this approximate, which is fine for "is anything drawn at all"
    colours = {row[i:i + 3] for row in rows for i in range(0, len(row), channels * 7)}
    return width, height, len(colours)


def test_report_in_headless_chromium(optimized, renderer, browser, tmp_path: Path) -> None:
    page = write_report(optimized, tmp_path / "report.html")
    shot = tmp_path / "report.png"
    seen = browser(page, screenshot=shot)
    assert seen.console == [], seen.console
    dom = seen.dom
    records = [r for _, r in fxopt.report_of(optimized).walk()]
    assert len(sections(dom)) == len(records)
    assert dom.count("<svg") >= sum(1 for r in records if r.before is not None)
    assert "fx_legend" in dom and "fx-passes" in dom
    assert dom.count('class="fx-buffer"') == len(plan_of(optimized).buffers) > 0
    width, height, colours = png_size_and_colours(shot)
    assert (width, height) == (1400, 2400) and colours > 20  # a page with content, not a blank


def test_chromium_harness_does_see_console_errors(browser, tmp_path: Path) -> None:
    """The silent-console assertion above means something only if errors are caught."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><p id="x">hi</p><script>console.error("boom"); undefinedFn();</script>')
    seen = browser(page)
    assert '<p id="x">hi</p>' in seen.dom
    assert "boom" in seen.console and any("Uncaught ReferenceError" in m for m in seen.console)


def test_nested_pipeline_diffs_each_pass_against_the_next_changing_one(renderer, tmp_path: Path) -> None:
    model, inputs = demo_model()
    gm = fxopt.optimize(model, passes="remove_dropout,fixpoint{max_rounds=3}(cse,dce)", example_inputs=inputs)
    page = write_report(gm, tmp_path / "r.html").read_text()
    records = [r for _, r in fxopt.report_of(gm).walk()]
    assert len(sections(page)) == len(records) == 6  # the fixpoint and both rounds of its children
    summaries = re.findall(r'fx-diff-summary">([^<]*)<', page)
    # each changing pass's diff shows only its own work: cse merges one node, dce drops one
    assert summaries == [f"0 added, 1 removed, 0 changed, {n} unchanged nodes; {e} edges rewired"
                         for n, e in ((24, 1), (23, 1), (22, 0))]
