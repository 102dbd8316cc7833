"""Hypothesis fuzzing of node labels: any text a graph can carry renders, and reads back.

Names, targets, arguments, keyword arguments, module paths and metadata are drawn from
all of Unicode (control characters and lone surrogates included) plus the characters
that are syntax somewhere on the way (DOT, HTML-like labels, record labels, XML,
Graphviz escapes). Each example is a graph rendered to SVG by the real renderer; the
SVG must parse and show every node's name as the label code cleaned it. The long
profile (FXOPT_PROFILE=long) renders 10,000 labels; CI renders 600. (Check with
``--hypothesis-show-statistics`` that almost no generated case is invalid.)
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import torch
import torch.fx as fx
from fxopt.visualize import render, render_diff
from fxopt.visualize.labels import WORD_JOINER, clean
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LONG = os.environ.get("FXOPT_PROFILE") == "long"
NODES_PER_GRAPH = 10  # small graphs keep each example within hypothesis's data budget
EXAMPLES = 1000 if LONG else 60  # 1000 x 10 = 10,000 labels; 60 x 10 = 600
SVG = "{http://www.w3.org/2000/svg}"

SYNTAX = list('{}|<>"&\\\'[];=,:.-#%@$') + ["\\N", "\\G", "\\l", "\\\\", "&amp;", "&#92;", "]]>",
                                            "<!--", "-->", "<TABLE>", "\n", "\r", "\t", "\x00",
                                            "\x07", "\ufffe", "\ud800", "𝔘", "🙂", "\u202e", "\u0301"]
text = st.lists(st.one_of(st.sampled_from(SYNTAX), st.characters(blacklist_categories=())),
                max_size=12).map("".join)
leaf = st.one_of(text, st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.none(),
                 st.booleans(), st.sampled_from([torch.float16, torch.quint8, torch.device("cpu")]),
                 st.builds(slice, st.integers(0, 9), st.integers(10, 20)))
nested = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                                                    st.dictionaries(text, inner, max_size=3)),
                      max_leaves=4)
shape = st.lists(st.integers(0, 4096), max_size=5)
OPS = ("call_function", "call_method", "call_module", "get_attr")


def noop(*args, **kwargs):
    return None


@st.composite
def graphs(draw) -> fx.Graph:
    g = fx.Graph()
    nodes = [g.placeholder("x")]
    for _ in range(NODES_PER_GRAPH - 2):  # with the placeholder and the output: NODES_PER_GRAPH labels
        op = draw(st.sampled_from(OPS))
        inputs = draw(st.lists(st.sampled_from(nodes), max_size=3))
        args = (*inputs, *draw(st.lists(nested, max_size=2)))
        kwargs = draw(st.dictionaries(text, nested, max_size=2))
        target = noop if op == "call_function" else draw(text)
        if op == "get_attr":
            args, kwargs = (), {}
        n = g.create_node(op, target, args, kwargs)
        n.name = draw(text) or "_"  # fx sanitizes names; users and bad passes may not
        meta = draw(st.sampled_from(["none", "val", "tuple", "junk", "stack"]))
        if meta == "val":
            n.meta["val"] = torch.empty(draw(shape), dtype=draw(st.sampled_from([torch.float32, torch.int8])),
                                       device="meta")
        elif meta == "tuple":
            n.meta["tensor_meta"] = (draw(nested), torch.empty(2, 3))
        elif meta == "junk":
            n.meta["val"] = draw(nested)
        elif meta == "stack":
            n.meta["nn_module_stack"] = {draw(text): (draw(text), draw(text))}
        nodes.append(n)
    g.output(nodes[-1])
    return g


def shown(svg: str) -> str:
    root = ET.fromstring(svg.encode("utf-8"))
    # the labels put a WORD JOINER after each backslash (see fxopt.visualize.labels)
    return "".join("".join(t.itertext()) for t in root.iter(f"{SVG}text")).replace("\\" + WORD_JOINER, "\\")


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs())
def test_any_label_renders_and_reads_back(renderer: str, graph: fx.Graph) -> None:
    svg = render(graph, "svg")
    assert svg.count('class="node fx_node ') == len(graph.nodes)  # one box each, even for equal names
    text_shown = shown(svg)
    for n in graph.nodes:
        assert clean(n.name, 60) in text_shown


@settings(max_examples=max(EXAMPLES // 5, 5), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs())
def test_any_label_renders_in_a_diff(renderer: str, graph: fx.Graph) -> None:
    after = fx.Graph()
    env = after.graph_copy(graph, {})
    last = next(n for n in reversed(after.nodes) if n.op != "output")
    if last.op != "placeholder":
        last.kwargs = {**last.kwargs, "changed": "<&>"}
    del env
    shown(render_diff(graph, after, "svg"))


def test_a_description_in_angle_brackets_stays_a_quoted_tooltip(renderer: str) -> None:
    """Found by the fuzz test above: a node named ``<!--`` whose target is ``<TABLE>`` has
    the tooltip ``<!-- = get_attr <TABLE>``, which the graphviz package took for an
    HTML-like string and wrote unquoted; the renderer then read an unterminated comment."""
    g = fx.Graph()
    g.placeholder("x")
    node = g.create_node("get_attr", "<TABLE>", (), {})
    node.name = "<!--"
    g.output(node)
    svg = render(g, "svg")
    assert clean("<!--", 60) in shown(svg)
    tooltips = [v for el in ET.fromstring(svg.encode("utf-8")).iter() for v in el.attrib.values()]
    assert any(v.startswith("<!-- = get_attr <TABLE>") for v in tooltips)
