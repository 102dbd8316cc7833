"""PassManager: transactions, fixpoints, analysis caching, verification, hooks, inputs."""

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.models import demo_model


def _traced_demo():
    model, inputs = demo_model()
    return model, fx.symbolic_trace(model), inputs


def _state(gm: fx.GraphModule):
    """Everything a failing pass must leave untouched, compared bit for bit."""
    return (
        gm.code,
        str(gm.graph),
        [(n.name, n.op, str(n.target), dict(n.meta)) for n in gm.graph.nodes],
        {k: v.clone() for k, v in gm.state_dict().items()},
        sorted(name for name, _ in gm.named_modules()),
        {name: type(m) for name, m in gm.named_modules()},
    )


def _assert_same_state(a, b):
    code_a, graph_a, nodes_a, sd_a, mods_a, types_a = a
    code_b, graph_b, nodes_b, sd_b, mods_b, types_b = b
    assert code_a == code_b and graph_a == graph_b and mods_a == mods_b and types_a == types_b
    assert [n[:3] for n in nodes_a] == [n[:3] for n in nodes_b]
    assert sd_a.keys() == sd_b.keys()
    for key in sd_a:
        assert torch.equal(sd_a[key], sd_b[key]), key


class _HalfRewriteThenFail(fxopt.Pass):
    """Rewrites part of the graph, swaps a module, adds an attribute, then raises."""

    name = "half_rewrite"

    def run(self, gm, ctx):
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        with gm.graph.inserting_after(relu):
            neg = gm.graph.call_function(operator.neg, (relu,))
        relu.replace_all_uses_with(neg)
        neg.args = (relu,)
        gm.stem = nn.Conv2d(3, 16, 1)
        gm.head.weight = nn.Parameter(torch.zeros_like(gm.head.weight))
        gm.register_buffer("extra", torch.ones(3))
        gm.recompile()
        raise RuntimeError("boom halfway")


def test_failing_pass_leaves_graph_code_modules_and_params_bit_identical():
    model, gm, inputs = _traced_demo()
    before = _state(gm)
    expected = gm(*inputs)
    manager = fxopt.PassManager([_HalfRewriteThenFail(), "dce"])
    with pytest.raises(fxopt.PassError) as info:
        manager.run(gm)
    assert info.value.pass_name == "half_rewrite" and "boom halfway" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    _assert_same_state(before, _state(gm))
    assert not hasattr(gm, "extra")
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_optimize_never_touches_the_users_graph_even_on_failure():
    model, gm, inputs = _traced_demo()
    before = _state(gm)
    with pytest.raises(fxopt.PassError):
        fxopt.optimize(gm, passes=["remove_dropout", "cse", _HalfRewriteThenFail()])
    _assert_same_state(before, _state(gm))
    ok = fxopt.optimize(gm, example_inputs=inputs)
    _assert_same_state(before, _state(gm))
    assert len(ok.graph.nodes) < len(gm.graph.nodes)


def test_pass_writing_into_a_parameter_is_rolled_back_and_reported():
    model, gm, inputs = _traced_demo()
    before = _state(gm)

    def corrupt(g):
        with torch.no_grad():
            g.head.weight.mul_(2)

    with pytest.raises(fxopt.PassContractError, match="head.weight.*in place"):
        fxopt.PassManager([corrupt]).run(gm)
    _assert_same_state(before, _state(gm))


def test_verification_names_the_first_pass_that_breaks_equivalence_and_rolls_it_back():
    model, gm, inputs = _traced_demo()

    def swap_add_for_sub(g):
        for node in g.graph.nodes:
            if node.target is operator.add:
                node.target = operator.sub
                return

    before = _state(gm)
    manager = fxopt.PassManager(["remove_dropout", swap_add_for_sub, "dce"], verify=True)
    with pytest.raises(fxopt.VerificationError) as info:
        manager.run(gm, inputs)
    assert info.value.pass_name == "swap_add_for_sub"
    assert "not equivalent" in str(info.value)
    # remove_dropout committed; the broken pass did not
    assert not any(n.target is operator.sub for n in gm.graph.nodes)
    assert len(gm.graph.nodes) == len(before[2]) - 1


def test_verification_tolerates_reassociation_but_not_a_wrong_constant():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    x = (torch.randn(4, 8),)

    def scale(eps):
        def rewrite(g):
            out = next(n for n in g.graph.nodes if n.op == "output")
            src = out.args[0]
            with g.graph.inserting_before(out):
                scaled = g.graph.call_function(operator.mul, (src, 1.0 + eps))
            out.args = (scaled,)
        rewrite.__name__ = f"scale_{eps}"
        return rewrite

    fxopt.PassManager([scale(1e-7)], verify=True).run(gm, x)
    with pytest.raises(fxopt.VerificationError, match="scale_0.01"):
        fxopt.PassManager([scale(1e-2)], verify=True).run(gm, x)


class _CountDown(fxopt.Pass):
    """Changes the graph a fixed number of times, then reports no change."""

    name = "count_down"

    def __init__(self, times: int):
        super().__init__()
        self.left = times

    def run(self, gm, ctx):
        if self.left == 0:
            return False
        self.left -= 1
        return True


def test_fixpoint_stops_when_nothing_changes_and_reports_rounds():
    gm = fx.symbolic_trace(nn.ReLU())
    report = fxopt.PassManager([fxopt.Fixpoint([_CountDown(2), "dce"], max_rounds=10)]).run(gm)
    (record,) = report.records
    assert record.rounds == 3  # two changing rounds, one quiet round
    assert not record.warnings and not report.warnings


def test_fixpoint_bound_is_respected_and_warned_about():
    gm = fx.symbolic_trace(nn.ReLU())
    with pytest.warns(UserWarning, match="bound of 4 rounds"):
        report = fxopt.PassManager([fxopt.Fixpoint([_CountDown(100)], max_rounds=4)]).run(gm)
    assert report.records[0].rounds == 4
    assert any("bound of 4" in w for w in report.warnings)
    assert "4 rounds" in report.table()


class _NeedsShapes(fxopt.Pass):
    name = "needs_shapes"
    requires = ("shapes", "topo")

    def __init__(self, change: bool, preserves=()):
        super().__init__()
        self.change = change
        self.preserves = preserves

    def run(self, gm, ctx):
        assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")
        return self.change


def test_analyses_are_cached_and_invalidated_unless_preserved():
    model, gm, inputs = _traced_demo()
    manager = fxopt.PassManager([
        _NeedsShapes(change=False),
        _NeedsShapes(change=False),  # cached: no recomputation
        _NeedsShapes(change=True, preserves=("shapes",)),  # topo invalidated, shapes kept
        _NeedsShapes(change=False),
        _NeedsShapes(change=True),  # both invalidated
        _NeedsShapes(change=False),
    ])
    counts = {}

    class Spy(fxopt.Instrumentation):
        def after_pass(self, pass_, g, ctx, record):
            counts.setdefault("log", []).append(dict(ctx.analyses.compute_counts))

    manager.hooks.append(Spy())
    manager.run(gm, inputs)
    log = counts["log"]
    assert log[1] == {"shapes": 1, "topo": 1}
    assert log[3] == {"shapes": 1, "topo": 2}
    assert log[5] == {"shapes": 2, "topo": 3}


def test_hooks_see_every_leaf_pass_with_counts():
    model, gm, inputs = _traced_demo()
    seen = []

    class Recorder(fxopt.Instrumentation):
        def before_pass(self, pass_, g, ctx):
            seen.append(("before", pass_.name, len(g.graph.nodes)))

        def after_pass(self, pass_, g, ctx, record):
            seen.append(("after", pass_.name, record.nodes_before, record.nodes_after, record.changed))

    fxopt.PassManager(["remove_dropout", fxopt.Fixpoint(["cse", "dce"], max_rounds=3)],
                      hooks=[Recorder()]).run(gm)
    names = [s[1] for s in seen if s[0] == "after"]
    assert names[0] == "remove_dropout" and names[1:3] == ["cse", "dce"]
    first = next(s for s in seen if s[0] == "after")
    assert first[2] - first[3] == 1 and first[4] is True


def test_report_is_reachable_and_keeps_snapshots_of_changes():
    model, gm, inputs = _traced_demo()
    out = fxopt.optimize(gm, example_inputs=inputs)
    report = fxopt.report_of(out)
    assert [r.name for r in report.records] == list(fxopt.DEFAULT_PIPELINE)
    dropout = report.find("remove_dropout")[0]
    assert dropout.changed and dropout.before is not None
    # over the input: the result no longer holds the weights that later passes folded away
    rebuilt = dropout.before.to_graph_module(gm)
    assert any(n.op == "call_module" and n.target == "drop" for n in rebuilt.graph.nodes)
    assert not any(n.op == "call_module" and n.target == "drop" for n in out.graph.nodes)
    unchanged = [r for r in report.records if not r.changed]
    assert all(r.before is None for r in unchanged)


def test_inference_only_passes_are_skipped_on_training_graphs():
    model, inputs = demo_model()
    model.train()
    gm = fx.symbolic_trace(model)
    out = fxopt.optimize(gm, passes=["constant_fold", "cse"])
    fold = fxopt.report_of(out).find("constant_fold")[0]
    assert fold.skipped and "training" in fold.skipped
    assert "skipped" in fxopt.report_of(out).table()
    assert not any(n.op == "get_attr" and "folded" in str(n.target) for n in out.graph.nodes)


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ((), "takes 1 input(s) (x), got 0"),
        ((torch.randn(2, 3, 32, 32), torch.randn(1)), "takes 1 input(s) (x), got 2"),
        ((torch.randn(2, 4, 32, 32),), "do not fit the graph"),
        ((torch.randn(2, 3, 32),), "do not fit the graph"),
    ],
)
def test_bad_example_inputs_are_rejected_before_any_pass(inputs, fragment):
    model, gm, _ = _traced_demo()
    before = _state(gm)
    ran = []
    with pytest.raises(fxopt.InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fxopt.PassManager([lambda g: ran.append(1)]).run(gm, inputs)
    assert ran == []
    _assert_same_state(before, _state(gm))
    assert all("val" not in n.meta for n in gm.graph.nodes)


def test_exported_graph_inputs_are_checked_against_their_metadata():
    model, inputs = demo_model()
    gm = torch.export.export(model, inputs).module()
    with pytest.raises(fxopt.InputError, match="dtype torch.float64"):
        fxopt.optimize(gm, example_inputs=(inputs[0].double(),))
    with pytest.raises(fxopt.InputError, match=r"shape \(4, 3, 32, 32\)"):
        fxopt.optimize(gm, example_inputs=(torch.randn(4, 3, 32, 32),))


def test_verify_without_inputs_is_an_input_error():
    model, gm, _ = _traced_demo()
    with pytest.raises(fxopt.InputError, match="verify=True needs example_inputs"):
        fxopt.optimize(gm, verify=True)


def test_conditional_runs_children_only_when_the_predicate_holds():
    model, gm, inputs = _traced_demo()

    def has_dropout(g, ctx):
        return any(n.op == "call_module" and n.target == "drop" for n in g.graph.nodes)

    pipeline = [fxopt.Conditional(has_dropout, ["remove_dropout"], name="if dropout"),
                fxopt.Conditional(has_dropout, ["remove_dropout"], name="if dropout again")]
    report = fxopt.PassManager(pipeline).run(gm)
    first, second = report.records
    assert first.changed and first.children[0].name == "remove_dropout"
    assert second.skipped == "condition is false" and not second.children


def test_function_pass_returning_a_new_graph_module_is_adopted_in_place():
    model, gm, inputs = _traced_demo()
    expected = gm(*inputs)

    def retrace(g):
        new = fx.GraphModule(g, copy.deepcopy(g.graph))
        drop = next(n for n in new.graph.nodes if n.target == "drop")
        drop.replace_all_uses_with(drop.args[0])
        new.graph.erase_node(drop)
        new.recompile()
        return new

    report = fxopt.PassManager([retrace]).run(gm)
    assert report.records[0].name == "retrace" and report.records[0].changed
    assert not any(n.target == "drop" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_a_pass_that_misreports_changed_is_still_recompiled():
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Dropout().eval()))

    class Liar(fxopt.Pass):
        name = "liar"

        def run(self, g, ctx):
            drop = next(n for n in g.graph.nodes if n.op == "call_module" and n.target == "1")
            drop.replace_all_uses_with(drop.args[0])
            g.graph.erase_node(drop)
            return False

    report = fxopt.PassManager([Liar()]).run(gm)
    assert report.records[0].changed
    assert "getattr(self, \"1\")" not in gm.code


def test_modules_holding_inference_tensors_can_be_optimized():
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(4))

        def forward(self, x):
            return x * self.table + x * self.table

    with torch.inference_mode():
        model = WithTable()
    gm = fx.symbolic_trace(model)
    out = fxopt.optimize(gm, passes=["cse", "dce"])
    assert fxopt.report_of(out).find("cse")[0].changed
    x = torch.randn(4)
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


def test_values_of_a_fresh_capture_are_adopted_once_then_propagated():
    """VALUES_CURRENT (set by the compile backend on Dynamo's graphs) makes the first shape
    analysis take the recorded values as they are; after a change it propagates again."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.analysis.shapes import VALUES_CURRENT

    gm = make_fx(lambda x: torch.relu(x) * 2, tracing_mode="fake")(torch.randn(3, 4))
    relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
    planted = relu.meta["val"].new_empty(7)  # a value propagation would never give it
    relu.meta["val"] = planted
    gm.meta[VALUES_CURRENT] = True
    seen = []

    class Look(fxopt.Pass):
        name = "look"
        requires = ("shapes",)

        def __init__(self, change: bool):
            super().__init__()
            self.change = change

        def run(self, g, ctx):
            seen.append(tuple(next(n for n in g.graph.nodes if "relu" in str(n.target)).meta["val"].shape))
            if self.change:
                g.graph.call_function(operator.add, (1, 1))  # dead, but a change
            return fxopt.PassResult(self.change)

    fxopt.PassManager([Look(True), Look(False)]).run(gm, (torch.randn(3, 4),))
    assert seen == [(7,), (3, 4)]
    assert VALUES_CURRENT not in gm.meta


def test_values_from_mixed_fake_modes_are_propagated_not_adopted():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.analysis.shapes import VALUES_CURRENT

    gm = make_fx(lambda x: torch.relu(x) * 2)(torch.randn(3, 4))  # real tracing: mixed modes
    gm.meta[VALUES_CURRENT] = True
    out = fxopt.optimize(gm, passes=["eliminate_identity"], example_inputs=(torch.randn(3, 4),))
    x = torch.randn(3, 4)
    torch.testing.assert_close(out(x), torch.relu(x) * 2)


def test_passes_and_rewrites_leave_the_collector_alone_while_they_run():
    """The cyclic collector is process-wide: neither the manager nor a rule rewrite may
    disable or freeze it, not even while they run (another thread would see it)."""
    import gc

    from fxopt.patterns import RulePass, rule

    seen = []

    def probe(m) -> bool:  # asked during matching, i.e. in the middle of the rewrite
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return True

    before = (gc.isenabled(), gc.get_freeze_count())
    _, gm, inputs = _traced_demo()
    relu_twice = rule(lambda x: torch.relu(x), lambda x: torch.relu(torch.relu(x)), name="probe", where=probe)
    probe_pass = type("ProbePass", (RulePass,), {"name": "probe_pass", "rules": (relu_twice,)})
    fxopt.PassManager(["cse", probe_pass(), "dce"]).run(gm, inputs)
    assert seen, "the rule never matched: the probe saw nothing"
    assert set(seen) == {before}
    assert (gc.isenabled(), gc.get_freeze_count()) == before
