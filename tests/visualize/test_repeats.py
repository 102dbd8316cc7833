"""What keeps a large report small, without a browser: a diff's changes split into one
island per rewrite and grouped by what they draw but for names, and the final graph's
scopes (every node once, no level over CHUNK boxes, repeated blocks sharing one drawing).

Expected rewrites come from the graphs and from provenance (which original nodes each new
node stands for), not from the report's own classification."""

from __future__ import annotations

import torch
import torch.fx as fx
from fxopt.visualize.diff import REMOVED, DiffItems, diff_graphs, diff_view
from fxopt.visualize.islands import Rewrites
from fxopt.visualize.names import Shape, blank
from fxopt.visualize.outline import build_outline
from fxopt.visualize.scopes import CHUNK, Scope, origin_scopes, scope_tree

import fxopt
from fxopt.models import dropout_stack
from fxopt.provenance import PROVENANCE_KEY

from .test_report_large import PASSES

BLOCKS = 100


def optimized(blocks: int = BLOCKS) -> fx.GraphModule:
    return fxopt.optimize(dropout_stack(blocks), passes=PASSES, example_inputs=(torch.randn(2, 8),))


def pass_diffs(gm: fx.GraphModule):
    records = fxopt.report_of(gm).records
    graphs = [r.before.build() for r in records] + [gm.graph]
    return [(r.name, diff_graphs(graphs[i], graphs[i + 1]), graphs[i + 1]) for i, r in enumerate(records)]


def test_each_rewrite_is_one_island_and_repeats_group() -> None:
    for name, diff, after in pass_diffs(optimized()):
        rewrites = Rewrites(DiffItems(diff, diff_view(diff, 2)), hops=1)
        cores = [{key[2:] for key in island.core} for island in rewrites.islands]
        if name == "remove_dropout":  # each removed dropout on its own
            expected = [{n} for n in sorted(diff.removed)]
        else:  # each new node with the nodes it replaced (provenance) and its new weights
            made = [n for n in after.nodes if n.meta.get("fxopt.created_by") == name]
            expected = [{n.name, *(o for o in n.meta[PROVENANCE_KEY] if o in diff.removed),
                         *(i.name for i in n.all_input_nodes if i.op == "get_attr" and i.name in diff.added)}
                        for n in made]
        assert sorted(map(sorted, cores)) == sorted(map(sorted, expected)), name
        assert len(rewrites.islands) == BLOCKS, name
        groups = rewrites.groups()
        # the middle blocks draw alike; only the first and last block may differ (they read
        # the input, or feed the output)
        assert sum(len(g.islands) for g in groups) == BLOCKS and len(groups) <= 3, name
        assert max(len(g.islands) for g in groups) >= BLOCKS - 2, name
        for island in rewrites.islands:  # context: unchanged nodes only, next to the rewrite
            assert all(rewrites.view.status[k] not in (REMOVED,) for k in island.context)
            assert all(rewrites.view.adjacency[k] & set(island.core) for k in island.context)


def test_shapes_differ_by_more_than_names_only_when_the_text_does() -> None:
    known = {"relu_5", "relu_6", "blocks.5.act", "blocks.6.act", "x"}

    def shape(*texts: str) -> tuple:
        s = Shape()
        for text in texts:
            s.add(blank(text, known))
        return s.shape

    assert shape("relu_5 = blocks.5.act(x)") == shape("relu_6 = blocks.6.act(x)")
    assert shape("relu_5 = blocks.5.act(x)") != shape("relu_5 = blocks.5.gelu(x)")  # not a name
    assert shape("relu_5(relu_5)") != shape("relu_5(relu_6)")  # the same name twice is one slot
    assert shape("a", "b") != shape("ab")
    # a Sequential's children are numbers: "0.lin" is a name like "blocks.0.lin"
    numbered = {"0.lin", "1.lin"}
    assert blank("0.lin (Linear)", numbered)[1] == ("0.lin",)


def every_node(scope: Scope) -> list[fx.Node]:
    return list(scope.nodes())


def test_scopes_hold_every_node_once_in_small_levels() -> None:
    gm = optimized(300)
    first = fxopt.report_of(gm).records[0].before.build()
    tree = scope_tree(gm.graph, origin_scopes(first))
    assert sorted(n.name for n in every_node(tree)) == sorted(n.name for n in gm.graph.nodes)
    stack = [tree]
    while stack:
        scope = stack.pop()
        assert len(scope.entries) <= CHUNK
        stack += [e for e in scope.entries if isinstance(e, Scope)]
    # a fused node sits in the block its origins came from (fx names block k's linear_relu_k)
    blocks = [e for e in tree.entries if isinstance(e, Scope) and e.path == ("blocks",)]
    assert len(blocks) == 1
    found = {}
    stack = [blocks[0]]
    while stack:
        scope = stack.pop()
        if not scope.chunk and len(scope.path) == 2:
            found[scope.path[1]] = {n.name for n in every_node(scope)}
        stack += [e for e in scope.entries if isinstance(e, Scope)]
    assert len(found) == 300
    assert {"linear_relu_7", "add_relu_7", "blocks_7_lin_weight", "blocks_7_lin_bias"} == found["7"]


def test_repeated_levels_share_one_drawing_with_their_own_names() -> None:
    gm = optimized(300)
    first = fxopt.report_of(gm).records[0].before.build()
    outline = build_outline(gm.graph, gm, scope_tree(gm.graph, origin_scopes(first)))
    assert len(outline.dots) <= 10 < len(outline.levels)
    assert all(len(dot) > 0 for dot in outline.dots)
    by_title = {lv.title.split(" ")[0]: lv for lv in outline.levels}
    seven, eight = by_title["blocks.7"], by_title["blocks.8"]
    assert seven.drawing == eight.drawing
    assert "linear_relu_7" in seven.names and "linear_relu_8" in eight.names
    assert len(seven.names) == len(eight.names)
    # the drawing is laid out with the longest names that use it
    made_with = outline.levels[outline.drawn_with[seven.drawing]]
    assert sum(map(len, made_with.names)) >= max(sum(map(len, lv.names)) for lv in outline.levels
                                                 if lv.drawing == seven.drawing)
