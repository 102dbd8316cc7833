"""Per-match callbacks and match records; in-place soundness of user patterns; bad input
(typed errors naming the rule and argument, the graph left as it was)."""

from __future__ import annotations

import operator

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.errors import PatternError, RuleError

from .conftest import ops


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.LeakyReLU(0.2)
        self.b = nn.LeakyReLU(0.05)

    def forward(self, x):
        return self.a(x) + self.b(x)


def leaky(x, slope):
    return F.leaky_relu(x, slope)


def leaky_by_hand(x, slope):
    return torch.where(x > 0, x, x * slope)


def test_callback_sees_nodes_literals_and_modules_and_may_veto() -> None:
    seen = []

    def only_steep(m: fp.Match) -> bool:
        (node,) = m.body
        seen.append((node.target, m["slope"], type(m.module("leaky_relu")).__name__))
        return m["slope"] > 0.1

    gm = fx.symbolic_trace(Acts())
    r = fp.rule(leaky, leaky_by_hand, callback=only_steep)
    assert fp.replace(gm, r) == 1
    assert sorted(seen) == [("a", 0.2, "LeakyReLU"), ("b", 0.05, "LeakyReLU")]
    assert ops(gm).count("LeakyReLU") == 1 and "where" in ops(gm)
    x = torch.randn(64)
    torch.testing.assert_close(gm(x), Acts()(x))
    assert "callback only_steep vetoed the match" in fp.explain(gm, r)


def test_rule_pass_records_its_matches_in_the_report() -> None:
    fp.register_rules("test_leaky_by_hand", [fp.rule(leaky, leaky_by_hand, name="leaky")],
                      "leaky_relu spelled with where", replace=True)
    gm = fxopt.optimize(fx.symbolic_trace(Acts()), passes=["test_leaky_by_hand"])
    (record,) = fxopt.report_of(gm).find("test_leaky_by_hand")
    assert record.stats["leaky"] == 2
    matched = sorted(names for _, names, _ in record.stats["matches"])
    assert matched == [("a",), ("b",)]
    new_nodes = {n.name for n in gm.graph.nodes}
    assert all(set(new) <= new_nodes for _, _, new in record.stats["matches"])


def test_fold_constants_runs_through_the_manager() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["fold_conv_bn"])
    names = [r.name for _, r in fxopt.report_of(gm).walk()]
    assert names.count("fold_conv_bn") == 2 and "constant_fold" in names  # the sequence, its rules, the fold
    (fold,) = fxopt.report_of(gm).find("constant_fold")
    assert fold.stats["folded"] >= 2
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


# --- in-place soundness ------------------------------------------------------------------

def test_inplace_pattern_does_not_match_out_of_place_code() -> None:
    class M(nn.Module):
        def forward(self, x):
            return (x * 2) + 1

    def pattern(t):
        return t.add_(1)

    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, pattern, lambda t: t - 1) == 0
    assert "writes in place" in fp.explain(gm, pattern)
    assert fp.replace_pattern(gm, pattern, lambda t: t - 1) == []
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), x * 2 + 1)


def test_inplace_replacement_never_writes_into_the_callers_input() -> None:
    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x) + torch.relu(x * 3)

    def pattern(t):
        return torch.relu(t)

    def in_place(t):
        return t.relu_()

    gm = fx.symbolic_trace(M())
    assert fp.replace(gm, pattern, in_place) == 1  # into x * 3 (fresh, the match's own), not into x
    x = torch.randn(16)
    before = x.clone()
    torch.testing.assert_close(gm(x), M()(before))
    torch.testing.assert_close(x, before)
    assert "would write into argument 't'" in fp.explain(gm, fp.rule(pattern, in_place))
    assert len(fp.replace_pattern(fx.symbolic_trace(M()), pattern, in_place)) == 1


def test_an_inplace_spelling_whose_write_is_visible_is_not_rewritten() -> None:
    """An out-of-place pattern matches ``relu_`` only where the write is invisible: not into
    a value returned (``s``) or the caller's input (``a``)."""
    class M(nn.Module):
        def forward(self, a, b):
            s = a + b
            s.relu_()
            return s, a.relu_()

    gm = fx.symbolic_trace(M())
    why = fp.explain(gm, lambda x: torch.relu(x))
    assert "'relu_' writes in place into node 'add'" in why
    assert "'relu__1' writes in place into node 'a'" in why
    assert fp.replace(gm, lambda x: torch.relu(x), lambda x: torch.clamp_min(x, 0)) == 0
    a, b = torch.randn(8), torch.randn(8)
    expected = M()(a.clone(), b)
    got = gm(a, b)
    torch.testing.assert_close(got, expected)


def test_a_form_spanning_two_nodes_is_rewritten_only_when_its_pieces_are_unused() -> None:
    """``getitem(native_batch_norm(...), 0)`` reads as ``batch_norm``: the rewrite removes
    the ``native_batch_norm`` too, so another user of it (the saved mean) refuses the match."""
    aten = torch.ops.aten

    def build(use_mean: bool) -> fx.GraphModule:
        graph = fx.Graph()
        x, w, b, rm, rv = (graph.placeholder(n) for n in ("x", "w", "b", "rm", "rv"))
        stats = graph.call_function(aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5))
        out = graph.call_function(aten.relu.default, (graph.call_function(operator.getitem, (stats, 0)),))
        graph.output((out, graph.call_function(operator.getitem, (stats, 1))) if use_mean else out)
        return fx.GraphModule(nn.Module(), graph)

    def pattern(x, w, b, rm, rv):
        return torch.relu(F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5))

    def replacement(x, w, b, rm, rv):
        return torch.clamp_min(F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5), 0)

    used = build(use_mean=True)
    assert "'_native_batch_norm_legit_no_training_default' (part of 'getitem') is also used by 'getitem_1'" in \
        fp.explain(used, pattern)
    assert fp.replace(used, pattern, replacement) == 0
    unused = build(use_mean=False)
    assert fp.replace(unused, pattern, replacement) == 1
    assert not any("native_batch_norm" in str(n.target) for n in unused.graph.nodes)
    inputs = (torch.randn(2, 3, 4), torch.rand(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5)
    torch.testing.assert_close(unused(*inputs), build(use_mean=False)(*inputs))


# --- bad input ----------------------------------------------------------------------------

def test_a_constraint_that_raises_names_the_rule_and_argument_and_leaves_the_graph() -> None:
    def broken(value):
        raise ZeroDivisionError("boom")

    class M(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y) + torch.relu(y + x)

    gm = fx.symbolic_trace(M())
    before = str(gm.graph)
    r = fp.rule(lambda a, b: torch.relu(a + b), lambda a, b: torch.ops.fxopt.add_relu(a, b),
                name="fused", b=broken)
    with pytest.raises(RuleError, match=r"rule 'fused': constraint broken on argument 'b' raised ZeroDivisionError"):
        fp.replace(gm, r)
    assert str(gm.graph) == before


def test_a_filter_that_raises_leaves_the_graph() -> None:
    class M(nn.Module):
        def forward(self, x):
            return torch.neg(x) + torch.neg(x * 2)

    calls = []

    def second_fails(match, graph, pattern_graph):
        calls.append(match)
        if len(calls) == 2:
            raise KeyError("nope")
        return True

    gm = fx.symbolic_trace(M())
    before = str(gm.graph)
    with pytest.raises(RuleError, match="callback raised KeyError"):
        fp.replace_pattern_with_filters(gm, lambda x: torch.neg(x), lambda x: torch.relu(x), [second_fails])
    assert str(gm.graph) == before and len(calls) == 2


def test_replace_pattern_bad_input_is_typed() -> None:
    gm = fx.symbolic_trace(nn.ReLU())
    before = str(gm.graph)

    def untraceable(x):
        return torch.relu(x) if x.sum() > 0 else x

    with pytest.raises(PatternError, match="cannot trace pattern untraceable"):
        fp.replace_pattern(gm, untraceable, lambda x: x)
    with pytest.raises(PatternError, match=r"replacement .*takes 2 argument\(s\), the pattern 1"):
        fp.replace_pattern(gm, lambda x: torch.relu(x), lambda x, y: x + y)
    with pytest.raises(PatternError, match="give a replacement"):
        fp.replace_pattern(gm, lambda x: torch.relu(x))
    assert str(gm.graph) == before
