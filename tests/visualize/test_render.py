"""render(): nasty labels, shapes from meta (or none), clusters, collapsing, overlays,
output formats, and the errors when no renderer is there."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from fxopt.visualize import render, to_dot
from fxopt.visualize.labels import WORD_JOINER
from torch.fx.passes.shape_prop import ShapeProp

from fxopt.errors import FxoptError, RendererNotFoundError, RenderError
from fxopt.models import demo_model

SVG = "{http://www.w3.org/2000/svg}"
NASTY = 'we{i}rd|<na>"me"&amp; \\N \\\\G \\l'


def svg_texts(svg: str) -> list[str]:
    """The text of every <text> element, as a browser would show it."""
    root = ET.fromstring(svg.encode("utf-8"))
    return ["".join(t.itertext()).replace(WORD_JOINER, "") for t in root.iter(f"{SVG}text")]


def svg_nodes(svg: str, cls: str = "fx_node") -> list[ET.Element]:
    root = ET.fromstring(svg.encode("utf-8"))
    return [g for g in root.iter(f"{SVG}g") if cls in g.get("class", "").split()]


def combine(x, spec=None, **extra):
    """A user function with nested keyword arguments."""
    return x


class Weird(torch.nn.Module):
    def forward(self, x):
        return x * 2


def nasty_graph() -> fx.GraphModule:
    """einsum equations, quantization parameters, nested kwargs and {}|<>"& everywhere."""
    root = torch.nn.Module()
    root.add_module("blk{a|b}<c>", Weird())
    root.register_buffer("p<&>", torch.ones(2, 2))
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    e = g.call_function(torch.einsum, ("ij,jk->ik", a, b))
    q = g.call_function(torch.quantize_per_tensor, (e, 0.1, 128, torch.quint8))
    dq = g.call_method("dequantize", (q,))
    m = g.call_module("blk{a|b}<c>", (dq,))
    p = g.get_attr("p<&>")
    c = g.call_function(combine, (m,), {"spec": {"a": [1, {"b": (2, "x<y>&z")}], "c|d": "{}", "e": -0.0},
                                        "eq": "bij,bjk->bik", "nl": "line\nbreak\ttab\x07bell"})
    s = g.call_function(torch.add, (c, p))
    g.output(s)
    gm = fx.GraphModule(root, g)
    s.name = NASTY  # fx keeps names identifier-like; a user (or a bad pass) may not
    ShapeProp(gm).propagate(torch.randn(2, 3), torch.randn(3, 2))
    return gm


def test_nasty_labels_render_and_read_back_exactly(renderer: str) -> None:
    gm = nasty_graph()
    svg = render(gm, "svg")
    texts = "".join(svg_texts(svg))  # long argument lists wrap: read lines back joined
    assert NASTY in texts
    for expected in ("ij,jk->ik", "'bij,bjk->bik'", "torch.quint8", "0.1, 128",
                     "{'a': [1, {'b': (2, 'x<y>&z')}]", "'c|d': '{}'", "'e': -0.0",
                     "blk{a|b}<c> (Weird)", "p<&>", "\\x07bell", "\\nbreak"):
        assert expected in texts, expected
    assert len(svg_nodes(svg)) == len(gm.graph.nodes)
    # quantized values keep their dtype in the shape row
    assert "quint8[2, 2]" in texts


def test_png_and_dot_outputs(renderer: str, tmp_path: Path) -> None:
    gm = nasty_graph()
    png = render(gm, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render(gm, "png")[:4] == b"\x89PNG"
    dot = render(gm, tmp_path / "g.dot").read_text()
    assert dot == render(gm, "dot") == to_dot(gm)
    assert dot.startswith("digraph")
    # the DOT text alone is enough for any renderer to draw the same picture later
    redrawn = subprocess.run([renderer, "-Tsvg"], input=dot.encode(), capture_output=True, check=True).stdout
    assert NASTY in "\n".join(svg_texts(redrawn.decode()))


def test_shapes_come_from_meta_and_their_absence_is_fine(renderer: str) -> None:
    model, inputs = demo_model()
    traced = fx.symbolic_trace(model)  # no meta: no shapes
    texts = svg_texts(render(traced, "svg"))
    assert not any("f32[" in t for t in texts)
    assert any(t.startswith("stem (Conv2d)") for t in texts)
    program = torch.export.export(model, inputs)
    for exported in (program, program.module()):  # an ExportedProgram, and its GraphModule
        texts = svg_texts(render(exported, "svg"))
        assert "f32[2, 16, 32, 32]" in texts and "f32[2, 3, 32, 32]" in texts


def test_meta_with_junk_never_breaks_a_label(renderer: str) -> None:
    class Hostile:
        def __repr__(self):
            raise RuntimeError("no repr for you")

        @property
        def shape(self):
            raise RuntimeError("no shape either")

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,), {"junk": Hostile()})
    g.output(y)
    x.meta["val"] = Hostile()
    y.meta["tensor_meta"] = ("not", "a", "tensor")
    y.meta["nn_module_stack"] = {"k": ("a|b<>.c&d", object)}
    texts = "\n".join(svg_texts(render(g, "svg")))
    assert "<unprintable Hostile: RuntimeError>" in texts
    assert "a|b<>" in texts  # the cluster of the module path


def test_module_clusters_and_collapsing(renderer: str) -> None:
    model, inputs = demo_model()
    gm = torch.export.export(model, inputs).module()
    svg = render(gm, "svg")
    clusters = {svg_texts_of(g)[0] for g in svg_nodes(svg, "cluster")}
    assert {"block", "block.0", "block.4", "stem", "head"} <= clusters
    full = len(svg_nodes(svg))
    collapsed = render(gm, "svg", collapse_depth=0)
    boxes = svg_nodes(collapsed, "fx_collapsed")
    names = {svg_texts_of(g)[0] for g in boxes}
    assert {"block", "stem", "bn", "head"} <= names
    inside_block = sum(1 for n in gm.graph.nodes if n.meta.get("nn_module_stack") and any(
        v[0].startswith("block") for v in n.meta["nn_module_stack"].values()))
    assert len(svg_nodes(collapsed)) < full - inside_block + 1
    assert "conv2d_1" not in "\n".join(svg_texts(collapsed))  # inside block.0: collapsed


def svg_texts_of(g: ET.Element) -> list[str]:
    return ["".join(t.itertext()).replace(WORD_JOINER, "") for t in g.iter(f"{SVG}text")]


def test_overlay_colours_follow_the_values(renderer: str) -> None:
    model, _ = demo_model()
    gm = fx.symbolic_trace(model)
    nodes = list(gm.graph.nodes)
    overlay = {n: float(i) for i, n in enumerate(nodes)}
    svg = render(gm, "svg", overlay=overlay, overlay_title="ms", clusters=False)
    fills = {}
    for g in svg_nodes(svg):
        name = svg_texts_of(g)[0].split(" ")[0]
        shape = next(c for c in g.iter() if c.tag in (f"{SVG}path", f"{SVG}polygon"))
        fills[name] = shape.get("fill")
    assert fills[nodes[0].name] == "#ffffff"
    assert fills[nodes[-1].name] == "#dc2626"
    reds = [int(fills[n.name][3:5], 16) for n in nodes]  # green channel falls as values rise
    assert reds == sorted(reds, reverse=True)
    assert "ms: 3" in "\n".join(svg_texts(svg))


def test_asking_for_a_missing_renderer_is_a_typed_error_and_keeps_the_dot(tmp_path: Path) -> None:
    gm = nasty_graph()
    with pytest.raises(RendererNotFoundError, match="pip install graphviz-pure") as info:
        render(gm, tmp_path / "out.svg", renderer="/nonexistent/dot")
    assert isinstance(info.value, FxoptError)
    kept = Path(info.value.dot_path)
    assert kept == tmp_path / "out.dot" and kept.read_text() == to_dot(gm)
    assert not (tmp_path / "out.svg").exists()


@pytest.mark.skipif(bool(__import__("shutil").which("dot")), reason="a system dot is installed here")
def test_system_dot_only_when_present(tmp_path: Path) -> None:
    with pytest.raises(RendererNotFoundError, match="renderer 'dot' not found"):
        render(nasty_graph(), tmp_path / "g.png", renderer="dot")
    assert (tmp_path / "g.dot").exists()


def test_renderer_outside_path_is_found_by_its_resolved_location(renderer: str, tmp_path: Path) -> None:
    """A venv's bin is often not on PATH: graphviz-pure must still be found and run."""
    script = ("import sys, torch.fx as fx; from fxopt.visualize import render, find_renderer;"
              "g = fx.Graph(); g.output(g.placeholder('x'));"
              f"render(g, {str(tmp_path / 'g.svg')!r}); print(find_renderer())")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    env.pop("FXOPT_DOT", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == renderer and (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")


def test_unknown_output_format_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match=r"\.svg, \.png, \.dot"):
        render(nasty_graph(), tmp_path / "g.jpg")
