"""diff_graphs / render_diff: classification against ground truth, and the drawing.

Ground truth is written by hand for every stock pass and for rewrites made the way users
make them outside fxopt (on a deepcopy, with or without provenance). Expectations name
*before*-side nodes for removed/changed (names the capture chose, stable across pass
implementations) and after-side names only for nodes a test creates itself.
"""

from __future__ import annotations

import copy
import operator
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from fxopt.visualize import diff_graphs, render_diff
from fxopt.visualize.diff import CHANGED, REWIRED, UNCHANGED, GraphDiff

import fxopt
from fxopt.models import demo_model
from fxopt.provenance import record_replacement
from fxopt.registry import BUILTIN_PASSES

SVG = "{http://www.w3.org/2000/svg}"


@dataclass
class Expect:
    removed: set[str] = field(default_factory=set)         # before names
    changed: set[str] = field(default_factory=set)         # before names of changed nodes
    added: set[str] | None = None                          # after names (exact), if given
    added_ops: dict[str, int] | None = None                # op -> count of added nodes
    rewired_into: set[str] | None = None                   # users whose edge was rewired
    removed_edges: set[tuple[str, str]] | None = None


# --- capture helpers ----------------------------------------------------------------------


def pass_diff(model: nn.Module | Callable, passes, inputs) -> tuple[fx.Graph, fx.GraphModule]:
    """Run a stock pass for real; the before-snapshot the manager kept of its first
    change, and the result (a pass that is a sequence, like ``fold_conv_bn``'s rules then
    ``constant_fold``, is diffed as a whole)."""
    if not isinstance(model, nn.Module):
        model = fx.symbolic_trace(model)
    gm = fxopt.optimize(model.eval(), passes=passes, example_inputs=inputs)
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    assert records and records[0].name in passes, f"expected {passes} to change, got {[r.name for r in records]}"
    return records[0].before.build(), gm


def by_hand(fn: Callable | nn.Module, edit: Callable[[fx.Graph], None]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A rewrite made the way a user makes one: on a deepcopy of a traced graph."""
    before = fx.symbolic_trace(fn)
    after = copy.deepcopy(before)
    edit(after.graph)
    after.graph.lint()
    after.recompile()
    return before, after


def node(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.name == name)


# --- small models -------------------------------------------------------------------------


class Dead(nn.Module):
    def forward(self, x):
        unused = x.sum(dim=1)  # noqa: F841
        also = torch.cos(x) * 2  # noqa: F841
        return x.relu()


class InplaceUnused(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.add_(1)
        z = x.sin()  # noqa: F841
        return y


class Twice(nn.Module):
    def forward(self, x):
        return x.mean(1) + x.mean(1)


class Const(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * (torch.sigmoid(self.p) * 2.0)


class DropMod(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(x.relu()).neg()


def drop_fn(x):
    return F.dropout(x.relu(), 0.5, training=False).neg()


class Ident(nn.Module):
    def __init__(self):
        super().__init__()
        self.ident = nn.Identity()

    def forward(self, x):
        return self.ident(x.relu()).neg()


def noop_cast(x):
    return x.relu().float().neg()


def same_reshape(x):
    return x.relu().reshape(2, 4).neg()


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.lin = nn.Linear(4, 5)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        z = torch.relu(y + x.mean(1, keepdim=True))
        return torch.relu(self.lin(z.mean((2, 3))))


def conv_bn_relu() -> nn.Module:
    torch.manual_seed(0)
    return ConvBnRelu().eval()


X24 = (torch.randn(2, 4),)
IMG = (torch.randn(2, 3, 8, 8),)


# --- scenarios: stock passes ----------------------------------------------------------------

CLEANUPS = ["remove_dropout", "eliminate_identity", "constant_fold", "cse", "dce"]


def demo_pipeline_step(name: str) -> tuple:
    """One step of a cleanup pipeline: its before is the snapshot, its after the next one's."""
    model, inputs = demo_model()
    gm = fxopt.optimize(model, CLEANUPS, example_inputs=inputs)
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    i = next(i for i, r in enumerate(records) if r.name == name)
    after = records[i + 1].before.build() if i + 1 < len(records) else gm
    return records[i].before.build(), after


def inplace_case() -> tuple:
    """Which ops become in-place is the inplace pass's business (its rules evolve): the
    truth is the set of nodes it says it rewrote, each a one-for-one replacement, plus the
    dtype guard it adds whenever it converts anything."""
    before, after = pass_diff(conv_bn_relu(), ["inplace"], IMG)
    rewritten = [n for n in after.graph.nodes if n.meta.get("fxopt.created_by") == "inplace"]
    assert rewritten and all(len(n.meta["fxopt.replaces"]) == 1 for n in rewritten)
    return before, after, Expect(changed={n.meta["fxopt.replaces"][0] for n in rewritten},
                                 added={"check_input_dtypes"})


STOCK: dict[str, Callable[[], tuple]] = {
    "dce": lambda: (*pass_diff(Dead(), ["dce"], X24), Expect(removed={"sum_1", "cos", "mul"})),
    "dce keeps in-place writes": lambda: (*pass_diff(InplaceUnused(), ["dce"], X24), Expect(removed={"sin"})),
    "cse": lambda: (*pass_diff(Twice(), ["cse"], X24),
                    Expect(removed={"mean_1"}, rewired_into=set(),
                           removed_edges={("x", "mean_1"), ("mean_1", "add")})),
    "constant_fold": lambda: (*pass_diff(Const(), ["constant_fold"], X24),
                              # p: the parameter it folded away is dropped, not left dead
                              Expect(removed={"sigmoid", "p"}, changed={"mul"}, added=set())),
    "remove_dropout module": lambda: (*pass_diff(DropMod(), ["remove_dropout"], X24),
                                      Expect(removed={"drop"}, rewired_into={"neg"})),
    "remove_dropout functional": lambda: (*pass_diff(drop_fn, ["remove_dropout"], X24),
                                          Expect(removed={"dropout"}, rewired_into={"neg"})),
    "eliminate_identity module": lambda: (*pass_diff(Ident(), ["eliminate_identity"], X24),
                                          Expect(removed={"ident"}, rewired_into={"neg"})),
    "eliminate_identity cast": lambda: (*pass_diff(noop_cast, ["eliminate_identity"], X24),
                                        Expect(removed={"float_1"}, rewired_into={"neg"})),
    "eliminate_identity reshape": lambda: (*pass_diff(same_reshape, ["eliminate_identity"], X24),
                                           Expect(removed={"reshape"}, rewired_into={"neg"})),
    "demo: remove_dropout": lambda: (*demo_pipeline_step("remove_dropout"),
                                     Expect(removed={"drop"}, rewired_into={"head"})),
    "demo: eliminate_identity": lambda: (*demo_pipeline_step("eliminate_identity"),
                                         Expect(removed={"identity", "float_1"}, rewired_into={"add", "head"})),
    "demo: constant_fold": lambda: (*demo_pipeline_step("constant_fold"),
                                    # class_scale: the parameter it folded away is dropped, not
                                    # left dead for dce
                                    Expect(removed={"sigmoid", "class_scale"}, changed={"mul"},
                                           added=set())),
    "demo: cse": lambda: (*demo_pipeline_step("cse"),
                          Expect(removed={"mean_1", "head_1"}, rewired_into={"add_1"})),
    "demo: dce": lambda: (*demo_pipeline_step("dce"), Expect(removed={"sum_1"})),
    "fold_conv_bn": lambda: (*pass_diff(conv_bn_relu(), ["fold_conv_bn"], IMG),
                             Expect(removed={"conv", "bn"}, rewired_into={"relu"})),
    "fuse_conv_bn_relu": lambda: (*pass_diff(conv_bn_relu(), ["fuse_conv_bn_relu"], IMG),
                                  Expect(removed={"conv", "bn", "relu"}, rewired_into={"add"})),
    "fuse_add_relu": lambda: (*pass_diff(conv_bn_relu(), ["fuse_add_relu"], IMG),
                              Expect(removed={"add", "relu_1"}, added_ops={"call_function": 1},
                                     rewired_into={"mean_1"})),
    "fuse_linear_relu": lambda: (*pass_diff(conv_bn_relu(), ["fuse_linear_relu"], IMG),
                                 Expect(removed={"lin", "relu_2"}, rewired_into={"output"})),
    "inplace": lambda: inplace_case(),
    "insert_observers": lambda: (*pass_diff(conv_bn_relu(), ["insert_observers"], IMG),
                                 Expect(changed={"conv", "lin"}, added_ops={"call_module": 2},
                                        rewired_into={"conv", "lin"})),
    "quantize": lambda: (*pass_diff(conv_bn_relu(), ["quantize"], IMG),
                         Expect(changed={"conv", "lin"}, rewired_into={"conv2d", "int8_weight_only_linear_default"})),
}


# --- scenarios: rewrites by hand ------------------------------------------------------------


def _relu_neg(x):
    return torch.relu(x + 1).neg()


def relu_to_gelu(record: bool) -> Callable[[fx.Graph], None]:
    def edit(g: fx.Graph) -> None:
        relu = node(g, "relu")
        with g.inserting_after(relu):
            gelu = g.call_function(F.gelu, relu.args)
        relu.replace_all_uses_with(gelu)
        if record:
            record_replacement(gelu, [relu], "my_pass")
        g.erase_node(relu)
    return edit


def set_target(g: fx.Graph) -> None:
    node(g, "relu").target = torch.sigmoid


def swap_args(g: fx.Graph) -> None:
    sub = node(g, "sub")
    sub.args = (sub.args[1], sub.args[0])


def _sub(x, y):
    return torch.sub(x, y).relu()


def const_arg(value):
    def edit(g: fx.Graph) -> None:
        add = node(g, "add")
        add.args = (add.args[0], value)
    return edit


def insert_abs(g: fx.Graph) -> None:
    relu, x = node(g, "relu"), node(g, "add")
    with g.inserting_before(relu):
        a = g.call_function(torch.abs, (x,))
    relu.replace_input_with(x, a)


def _mul_add_relu(x):
    return torch.relu(torch.add(torch.mul(x, 2), 1))


def fused(x):
    return torch.relu(x * 2 + 1)


def fuse_by_hand(record: bool) -> Callable[[fx.Graph], None]:
    def edit(g: fx.Graph) -> None:
        mul, add = node(g, "mul"), node(g, "add")
        with g.inserting_after(add):
            f = g.call_function(fused, (mul.args[0],))
        add.replace_all_uses_with(f)
        if record:
            record_replacement(f, [mul, add], "fuse")
        g.erase_node(add)
        g.erase_node(mul)
    return edit


def _ln(x):
    return F.layer_norm(x, (4,)).neg()


def decompose(record: bool) -> Callable[[fx.Graph], None]:
    def edit(g: fx.Graph) -> None:
        ln = node(g, "layer_norm")
        x = ln.args[0]
        with g.inserting_after(ln):
            mean = g.call_method("mean", (x, -1), {"keepdim": True})
            with g.inserting_after(mean):
                centred = g.call_function(operator.sub, (x, mean))
            with g.inserting_after(centred):
                var = g.call_method("var", (x, -1), {"keepdim": True, "unbiased": False})
            with g.inserting_after(var):
                out = g.call_function(operator.truediv, (centred, var))
        ln.replace_all_uses_with(out)
        if record:
            for piece in (mean, centred, var, out):
                record_replacement(piece, [ln], "decompose")
        g.erase_node(ln)
    return edit


def erase_dead(g: fx.Graph) -> None:
    g.erase_node(node(g, "sin"))


def _with_dead(x):
    y = x.sin()  # noqa: F841
    return x.relu()


def reorder(g: fx.Graph) -> None:
    node(g, "cos").prepend(node(g, "sin"))


def _two(x):
    a = x.cos()
    b = x.sin()
    return a + b


def rename_all(change: str | None) -> Callable[[fx.Graph], None]:
    def edit(g: fx.Graph) -> None:
        for i, n in enumerate(g.nodes):
            if n.op not in ("placeholder", "output"):
                n.name = f"v{i}"  # a graph rebuilt elsewhere: fresh names
            if n.op == "call_method" and n.target == "cos" and change:
                n.target = change
    return edit


def nested_kwargs(g: fx.Graph) -> None:
    s = node(g, "sum_1")
    s.kwargs = {"dim": (0, 1), "keepdim": True}


def _sum(x):
    return x.sum(dim=(0,), keepdim=True).relu()


def read_other_input(g: fx.Graph) -> None:
    mul = node(g, "mul")
    mul.args = (node(g, "y"), 2)


def _xy(x, y):
    return torch.mul(x, 2) + y


def return_earlier(g: fx.Graph) -> None:
    out = node(g, "output")
    out.args = (node(g, "relu"),)


def _earlier(x):
    return torch.relu(x) * 2


def swap_attr(g: fx.Graph) -> None:
    node(g, "p").target = "q"


class TwoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(4))
        self.q = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x + self.p + self.q


def module_to_function(g: fx.Graph) -> None:
    act = node(g, "act")
    with g.inserting_after(act):
        fn = g.call_function(torch.relu, act.args)
    act.replace_all_uses_with(fn)
    g.erase_node(act)


class ActMod(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x).neg()


def x2_to_xplusx(g: fx.Graph) -> None:
    mul = node(g, "mul")
    x = mul.args[0]
    with g.inserting_after(mul):
        add = g.call_function(operator.add, (x, x))
    mul.replace_all_uses_with(add)
    record_replacement(add, [mul], "strength_reduce")
    g.erase_node(mul)


def _x2(x):
    return (x * 2).neg()


def cse_by_hand(g: fx.Graph) -> None:
    first, second = node(g, "mean"), node(g, "mean_1")
    second.replace_all_uses_with(first)
    record_replacement(first, [second], "my_cse")
    g.erase_node(second)


def drop_branch(g: fx.Graph) -> None:
    out = node(g, "output")
    out.args = (node(g, "cos"),)
    g.erase_node(node(g, "add"))
    g.erase_node(node(g, "sin"))


def nothing(g: fx.Graph) -> None:
    pass


HAND: dict[str, Callable[[], tuple]] = {
    "relu->gelu, no provenance": lambda: (*by_hand(_relu_neg, relu_to_gelu(False)),
                                          Expect(changed={"relu"}, added=set(), rewired_into=set())),
    "relu->gelu, provenance": lambda: (*by_hand(_relu_neg, relu_to_gelu(True)),
                                       Expect(changed={"relu"}, added=set(), rewired_into=set())),
    "target changed in place": lambda: (*by_hand(_relu_neg, set_target), Expect(changed={"relu"})),
    "arguments swapped": lambda: (*by_hand(_sub, swap_args), Expect(changed={"sub"}, rewired_into=set(),
                                                                    removed_edges=set())),
    "constant argument changed": lambda: (*by_hand(_relu_neg, const_arg(2)), Expect(changed={"add"})),
    "0.0 becomes -0.0": lambda: (*by_hand(lambda x: (x + 0.0).relu(), const_arg(-0.0)), Expect(changed={"add"})),
    "1 becomes 1.0": lambda: (*by_hand(_relu_neg, const_arg(1.0)), Expect(changed={"add"})),
    "node inserted on an edge": lambda: (*by_hand(_relu_neg, insert_abs),
                                         Expect(changed={"relu"}, added={"abs_1"}, rewired_into={"relu"},
                                                removed_edges={("add", "relu")})),
    "fusion, provenance": lambda: (*by_hand(_mul_add_relu, fuse_by_hand(True)),
                                   Expect(removed={"mul", "add"}, added={"fused"}, rewired_into={"relu"})),
    "fusion, no provenance": lambda: (*by_hand(_mul_add_relu, fuse_by_hand(False)),
                                      Expect(removed={"mul"}, changed={"add"}, added=set(), rewired_into={"fused"})),
    "decomposition, provenance": lambda: (*by_hand(_ln, decompose(True)),
                                          Expect(removed={"layer_norm"}, added_ops={"call_method": 2, "call_function": 2},
                                                 rewired_into={"neg"})),
    "decomposition, no provenance": lambda: (*by_hand(_ln, decompose(False)),
                                             Expect(changed={"layer_norm"}, added_ops={"call_method": 2, "call_function": 1},
                                                    rewired_into={"truediv"})),
    "dead node erased": lambda: (*by_hand(_with_dead, erase_dead), Expect(removed={"sin"})),
    "independent nodes reordered": lambda: (*by_hand(_two, reorder), Expect()),
    "all nodes renamed": lambda: (*by_hand(_two, rename_all(None)), Expect(added=set())),
    "renamed, one op changed": lambda: (*by_hand(_two, rename_all("tan")), Expect(changed={"cos"}, added=set())),
    "nested kwargs changed": lambda: (*by_hand(_sum, nested_kwargs), Expect(changed={"sum_1"})),
    "reads another input": lambda: (*by_hand(_xy, read_other_input),
                                    Expect(changed={"mul"}, rewired_into={"mul"}, removed_edges={("x", "mul")})),
    "output returns an earlier node": lambda: (*by_hand(_earlier, return_earlier),
                                               Expect(changed={"output"}, rewired_into={"output"},
                                                      removed_edges={("mul", "output")})),
    "get_attr retargeted": lambda: (*by_hand(TwoParams(), swap_attr), Expect(changed={"p"})),
    "module call -> function": lambda: (*by_hand(ActMod(), module_to_function),
                                        Expect(changed={"act"}, added=set(), rewired_into=set())),
    "x*2 -> x+x with provenance": lambda: (*by_hand(_x2, x2_to_xplusx), Expect(changed={"mul"}, added=set())),
    "cse by hand, provenance": lambda: (*by_hand(Twice(), cse_by_hand),
                                        Expect(removed={"mean_1"}, rewired_into=set())),
    "branch dropped, output rewired": lambda: (*by_hand(_two, drop_branch),
                                               Expect(removed={"add", "sin"}, rewired_into={"output"})),
    "nothing changed": lambda: (*by_hand(_two, nothing), Expect()),
}


def check(diff: GraphDiff, e: Expect) -> None:
    before = {n.name for n in diff.before.nodes}
    after = {n.name for n in diff.after.nodes}
    assert set(diff.before_status) == before and set(diff.after_status) == after
    assert diff.removed == e.removed
    changed_before = {diff.pairs[a] for a in diff.changed}
    assert changed_before == e.changed
    for a, b in diff.pairs.items():  # a pairing is one-to-one and statuses agree
        assert diff.before_status[b] == diff.after_status[a] in (CHANGED, UNCHANGED)
    assert len(set(diff.pairs.values())) == len(diff.pairs)
    added = diff.added
    if e.added is not None:
        assert added == e.added
    if e.added_ops is not None:
        ops: dict[str, int] = {}
        for n in diff.after.nodes:
            if n.name in added and n.op != "get_attr":
                ops[n.op] = ops.get(n.op, 0) + 1
        assert ops == e.added_ops
    if e.rewired_into is not None:
        assert {d for _, d in diff.edges_with(REWIRED)} == e.rewired_into
    if e.removed_edges is not None:
        assert diff.removed_edges == e.removed_edges
    # every edge of the after graph is classified, and kept edges really existed before
    before_edges = {(s.name, n.name) for n in diff.before.nodes for s in n.all_input_nodes}
    for (s, d), status in diff.edges.items():
        if status == "kept":
            assert (diff.pairs[s], diff.pairs[d]) in before_edges


SCENARIOS = {**{f"pass {k}": v for k, v in STOCK.items()}, **{f"hand {k}": v for k, v in HAND.items()}}


def test_there_are_at_least_thirty_scenarios() -> None:
    assert len(SCENARIOS) >= 30


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_classification_matches_ground_truth(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized-tensor deprecation warnings
        before, after, expect = SCENARIOS[name]()
    check(diff_graphs(before, after), expect)


#: passes that change neither model on CPU (they need quantized linears, a CUDA device,
#: attention with symbolic sizes, or only annotate): a new pass, or one that stops
#: snapshotting its changes, is not skipped
LEAVE_THE_DEMO_BE = {"channels_last_weights", "defer_sdpa_choice", "fuse_linear_gelu", "fuse_swiglu",
                     "merge_sibling_linears", "pad_conv_channels", "pad_group_width", "plan_memory"}


# fxopt's own passes: registered_passes() also holds what other test modules register,
# which depends on what this worker collected
@pytest.mark.parametrize("pass_name", sorted(BUILTIN_PASSES))
def test_every_registered_pass_is_classified_consistently(pass_name: str) -> None:
    """An oracle that needs no hand-written truth, for passes added after these tests:
    the manager's snapshot holds the very Node objects of the graph before the pass, so
    a node that survived is the same object afterwards, and created or erased nodes are
    known exactly. The classification must agree with that."""
    model, inputs = demo_model() if pass_name not in ("fold_conv_bn", "fuse_conv_bn_relu", "fuse_add_relu",
                                                       "fuse_linear_relu") else (conv_bn_relu(), IMG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = fxopt.optimize(model, passes=[pass_name], example_inputs=inputs)
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    if not records:  # nothing to classify: only for the passes known to leave these models be
        assert pass_name in LEAVE_THE_DEMO_BE, f"{pass_name} left no snapshot of a change to classify"
        assert fxopt.report_of(gm).records[0].nodes_before == len(gm.graph.nodes)
        return
    snapshot = records[0].before
    old_objects = set(snapshot.nodes)  # the Node objects before the pass
    now = set(gm.graph.nodes)
    survivors = {n.name for n in now if n in old_objects}
    created = {n.name for n in now if n not in old_objects}
    erased = {n.name for n in old_objects if n not in now}
    diff = diff_graphs(snapshot, gm)
    assert {a for a, how in diff.paired_by.items() if how == "name"} == survivors
    assert diff.added <= created and diff.removed <= erased
    assert {a for a in created if a in diff.pairs} == created - diff.added
    assert {diff.pairs[a] for a in created if a in diff.pairs} == erased - diff.removed
    built = {n.name: n for n in snapshot.build().nodes}
    for n in gm.graph.nodes:  # a survivor that reads survivors, with the same op and args, is unchanged
        old = built.get(n.name)
        if n in old_objects and all(i in old_objects for i in n.all_input_nodes) and (
                old.op, old.target, _named(old.args), _named(old.kwargs)) == (
                n.op, n.target, _named(n.args), _named(n.kwargs)):
            assert diff.after_status[n.name] == UNCHANGED, n.name


def _named(args):
    return fx.node.map_arg(args, lambda n: n.name)


# --- drawing --------------------------------------------------------------------------------


def svg_classes(svg: str) -> dict[str, list[str]]:
    root = ET.fromstring(svg.encode())
    out: dict[str, list[str]] = {}
    for g in root.iter(f"{SVG}g"):
        for cls in g.get("class", "").split():
            if cls.startswith(("fx_diff_", "fx_edge_")):
                title = g.find(f"{SVG}title")
                out.setdefault(cls, []).append("".join(g.itertext()).strip() if title is None else title.text)
    return out


def test_drawing_shows_every_status_and_a_legend(renderer: str) -> None:
    before, after, _ = HAND["node inserted on an edge"]()
    svg = render_diff(before, after, "svg")
    classes = svg_classes(svg)
    assert len(classes["fx_diff_added"]) == 1 and len(classes["fx_diff_changed"]) == 1
    assert len(classes["fx_diff_unchanged"]) == len(after.graph.nodes) - 2
    assert len(classes["fx_edge_rewired"]) == 1 and len(classes["fx_edge_removed"]) == 1
    assert "fx_legend" in svg
    before, after, _ = HAND["fusion, provenance"]()
    classes = svg_classes(render_diff(before, after, "svg"))
    assert len(classes["fx_diff_removed"]) == 2  # removed nodes are drawn too: both graphs in one view


def chain(n: int) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    for i in range(n):
        x = g.call_function(torch.relu if i % 2 else torch.neg, (x,))
    g.output(x)
    return fx.GraphModule(nn.Module(), g)


def test_focus_draws_changes_plus_k_hops() -> None:
    before = chain(400)
    after = copy.deepcopy(before)
    middle = [n for n in after.graph.nodes][200]
    middle.target = torch.sigmoid
    diff = diff_graphs(before, after)
    assert diff.changed == {middle.name}
    for hops in (1, 3):
        dot = render_diff(before, after, "dot", focus=hops)
        assert dot.count("fx_node") == 2 * hops + 1  # a chain: k before, k after
    full = render_diff(before, after, "dot", focus=None)
    assert full.count("fx_node") == len(after.graph.nodes)
    assert render_diff(before, after, "dot").count("fx_node") == 5  # auto: 2 hops above 150 nodes


def test_unchanged_graph_diff_is_empty_and_still_draws(renderer: str) -> None:
    before, after, _ = HAND["nothing changed"]()
    diff = diff_graphs(before, after)
    assert diff.is_empty and not diff.added and not diff.removed
    assert "unchanged node (" in "".join(ET.fromstring(render_diff(before, after, "svg").encode()).itertext())
