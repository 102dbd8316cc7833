"""Per-match callbacks and match records; in-place soundness of user patterns; bad input
(typed errors naming the rule and argument, the graph left as it was)."""

from __future__ import annotations

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
