"""Regression tests for the wrong-result classes the op-facts model fixes (issue #13).

Each case runs eager and the optimized program on the same inputs and compares outputs
*and* side effects: input and buffer contents, running statistics, a call log of wrapped
functions, random draws (same seed). Each failed before fxopt.analysis.ops existed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.analysis.ops import facts

CALL_LOG: list[str] = []


def logged(x):
    """A wrapped function with an effect outside any tensor."""
    CALL_LOG.append("logged")
    return x + 1


def noisy(x):
    """A wrapped random function."""
    return x + torch.rand_like(x)


torch.fx.wrap("logged")
torch.fx.wrap("noisy")


def run_both(model: nn.Module, gm: fx.GraphModule, *inputs: torch.Tensor):
    """Eager and optimized, each on its own copy of the model state and inputs, same seed."""
    results = []
    for program in (model, gm):
        state = copy.deepcopy(model.state_dict())
        args = [t.clone() for t in inputs]
        CALL_LOG.clear()
        torch.manual_seed(0)
        out = program(*args)
        after = {k: v.clone() for k, v in (program.state_dict().items())}
        results.append((out, args, after, list(CALL_LOG)))
        model.load_state_dict(state)
    return results


def assert_same_effects(model, gm, *inputs):
    (out_e, args_e, state_e, log_e), (out_o, args_o, state_o, log_o) = run_both(model, gm, *inputs)
    torch.testing.assert_close(out_o, out_e)
    for a, b in zip(args_o, args_e):
        torch.testing.assert_close(a, b)
    for key in ("running_mean", "running_var"):
        mine = {k: v for k, v in state_o.items() if k.endswith(key)}
        theirs = {k: v for k, v in state_e.items() if k.endswith(key)}
        assert mine.keys() == theirs.keys()
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], msg=f"{k} differs from eager")
    assert log_o == log_e


# --- dce keeps training-mode batch norm --------------------------------------------------


class UnusedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        self.bn(x)  # result unused: only the running statistics change
        F.batch_norm(x, self.bn.running_mean, self.bn.running_var, training=True)
        return x * 2


def test_dce_keeps_training_batch_norm_module_and_functional():
    model = UnusedBN().train()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["dce"])
    kinds = {n.op for n in gm.graph.nodes if n.target in ("bn", F.batch_norm)}
    assert kinds == {"call_module", "call_function"}
    # optimize shares the parameter tensors with the model: compare on fresh copies
    x = torch.randn(4, 3, 5, 5)
    eager, optimized = copy.deepcopy(model), copy.deepcopy(model)
    eager(x)
    fxopt.optimize(fx.symbolic_trace(optimized), passes=["dce"])(x)
    torch.testing.assert_close(optimized.bn.running_mean, eager.bn.running_mean)


def test_dce_keeps_aten_native_batch_norm_in_training():
    def fn(x, mean, var):
        torch.ops.aten.native_batch_norm.default(x, None, None, mean, var, True, 0.1, 1e-5)
        return x * 2

    gm = make_fx(fn)(torch.randn(4, 3), torch.zeros(3), torch.ones(3))
    out = fxopt.optimize(gm, passes=["dce"])
    assert any(n.target is torch.ops.aten.native_batch_norm.default for n in out.graph.nodes)
    x, mean, var = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    out(x, mean, var)
    assert not torch.equal(mean, torch.zeros(3))


# --- cse never merges random modules in training ---------------------------------------


class TwiceRandom(nn.Module):
    def __init__(self, inner: nn.Module, unpack: bool):
        super().__init__()
        self.inner, self.unpack = inner, unpack

    def forward(self, x):
        a = self.inner(x, x, x)[0] if self.unpack == "mha" else self.inner(x)
        b = self.inner(x, x, x)[0] if self.unpack == "mha" else self.inner(x)
        if self.unpack == "lstm":
            a, b = a[0], b[0]
        return a - b


@pytest.mark.parametrize("kind", ["dropout", "mha", "encoder_layer", "lstm"])
def test_cse_never_merges_random_modules_in_training(kind):
    inner = {"dropout": lambda: nn.Dropout(0.5),
             "mha": lambda: nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True),
             "encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5,
                                                                 batch_first=True),
             "lstm": lambda: nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True)}[kind]()
    model = TwiceRandom(inner, kind).train()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["cse", "dce"])
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == 2
    x = torch.randn(2, 5, 8)
    torch.manual_seed(0)
    expected = model(x)
    torch.manual_seed(0)
    torch.testing.assert_close(gm(x), expected)
    assert expected.abs().sum() > 0  # two draws differ: the case can catch a merge


def test_cse_merges_the_same_modules_in_eval():
    model = TwiceRandom(nn.Dropout(0.5), "dropout").eval()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["cse", "dce"])
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == 1


# --- custom ops and wrapped functions: unknown means effectful ----------------------------

_LIB = torch.library.Library("fxopt_test_facts", "DEF")
_LIB.define("bump(Tensor(a!) x) -> ()")
_LIB.define("bump.scaled(Tensor(a!) x, float s) -> ()")
_LIB.define("jitter(Tensor x) -> Tensor")


def _bump(x, s=1.0):
    x.add_(s)


_LIB.impl("bump", _bump, "CPU")
_LIB.impl("bump.scaled", _bump, "CPU")
_LIB.impl("jitter", lambda x: x + torch.rand_like(x), "CPU")
# returns its input although its schema says nothing of aliasing; its fake says "fresh"
_LIB.define("passthrough(Tensor x) -> Tensor")
_LIB.impl("passthrough", lambda x: x, "CPU")
torch.library.register_fake("fxopt_test_facts::passthrough", lambda x: torch.empty_like(x),
                            lib=_LIB)


class CustomOps(nn.Module):
    def forward(self, x):
        y = x * 1
        torch.ops.fxopt_test_facts.bump(y)  # the packet, not an overload
        torch.ops.fxopt_test_facts.bump.scaled(y, 2.0)
        a = torch.ops.fxopt_test_facts.jitter(x)
        b = torch.ops.fxopt_test_facts.jitter(x)
        torch.ops.fxopt_test_facts.jitter(x)  # unused, but draws random numbers
        return y, a - b, torch.rand_like(x)  # draws after the unused jitter: order matters


def test_custom_ops_through_packet_and_overload_are_never_dropped_or_merged():
    model = CustomOps()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["cse", "dce"])
    assert sum("fxopt_test_facts" in str(n.target) for n in gm.graph.nodes) == 5
    assert_same_effects(model, gm, torch.randn(6))


class Wrapped(nn.Module):
    def forward(self, x):
        logged(x)  # result unused: the call itself is the point
        return noisy(x) - noisy(x)


def test_wrapped_functions_are_unknown_until_declared():
    model = Wrapped()
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["cse", "dce"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(noisy) == 2
    assert_same_effects(model, gm, torch.randn(5))


def test_declared_pure_functions_are_optimized():
    def double(x):
        return x * 2

    fxopt.declare_op(double, pure=True)
    g = fx.Graph()
    x = g.placeholder("x")
    a, b = g.call_function(double, (x,)), g.call_function(double, (x,))
    g.call_function(double, (x,))  # unused
    g.output(g.call_function(torch.add, (a, b)))
    gm = fxopt.optimize(fx.GraphModule(nn.Module(), g), passes=["cse", "dce"])
    assert [n.target for n in gm.graph.nodes].count(double) == 1
    inp = torch.randn(3)
    torch.testing.assert_close(gm(inp), inp * 4)


def test_declare_op_rejects_contradictions_and_non_ops():
    with pytest.raises(ValueError, match="pure"):
        fxopt.declare_op(logged, pure=True, random=True)
    with pytest.raises(TypeError, match="declare_op"):
        fxopt.declare_op(42, pure=True)


def test_user_leaf_modules_and_hooked_modules_are_unknown():
    class Leaf(nn.Module):
        def forward(self, x):
            return x + 1

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaf, self.lin = Leaf(), nn.Linear(3, 3)

        def forward(self, x):
            return self.leaf(x) + self.lin(x)

    tracer = type("T", (fx.Tracer,), {"is_leaf_module": lambda self, m, q: isinstance(m, (Leaf, nn.Linear))})()
    model = Model()
    gm = fx.GraphModule(model, tracer.trace(model))
    by_target = {n.target: facts(n) for n in gm.graph.nodes if n.op == "call_module"}
    assert by_target["leaf"].unknown and by_target["lin"].pure
    model.lin.register_forward_hook(lambda *a: None)
    assert facts(next(n for n in gm.graph.nodes if n.target == "lin")).unknown


# --- constant_fold never folds a value the graph writes ---------------------------------


class WritesFolded(nn.Module):
    def __init__(self):
        super().__init__()
        # a parameter (symbolic_trace turns a buffer used in arithmetic into a traced constant)
        self.table = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x):
        bias = self.table * 2  # constant-looking, but written below (T5's position bias)
        bias += x.sum()
        return x + bias


def test_constant_fold_never_folds_a_value_written_in_place():
    model = WritesFolded().eval()
    x = torch.randn(4, 4)
    for passes in (["constant_fold"], fxopt.DEFAULT_PIPELINE):
        gm = fxopt.optimize(fx.symbolic_trace(model), passes=passes, example_inputs=(x,),
                            verify=True)
        first, second = gm(x.clone()), gm(x.clone())
        torch.testing.assert_close(first, model(x))
        torch.testing.assert_close(second, model(x))  # no drift from call to call


# --- inplace: dtype-specialized graphs are guarded ------------------------------------------


class Promotes(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return torch.relu(x * 2 + self.b)


def test_inplace_guards_the_dtypes_it_specialized_for():
    model = Promotes()
    x = torch.randn(4)
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["inplace"], example_inputs=(x,))
    assert fxopt.report_of(gm).records[0].stats["converted"] >= 1
    torch.testing.assert_close(gm(x.clone()), model(x))
    with pytest.raises(fxopt.InputError, match=r"'x' is torch.float16.*'inplace'.*float32"):
        gm(x.half())


class ThroughUnknown(nn.Module):
    def forward(self, x):
        return torch.sigmoid(torch.ops.fxopt_test_facts.passthrough.default(x))


def test_inplace_never_writes_through_an_unknown_op_into_the_callers_input():
    model = ThroughUnknown()
    x = torch.randn(6)
    gm = fxopt.optimize(fx.symbolic_trace(model), passes=["inplace"], example_inputs=(x,))
    assert_same_effects(model, gm, x)


# --- facts at ATen level agree with torch-level ----------------------------------------------


def test_export_training_graph_facts():
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Dropout()).train()
    ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
    found = {str(n.target): facts(n) for n in ep.graph.nodes if n.op == "call_function"}
    assert found["aten.conv2d.default"].pure and found["aten.relu.default"].pure
    bn = next(f for t, f in found.items() if "batch_norm" in t)
    assert bn.stateful or bn.writes
    assert any(f.random for t, f in found.items() if "dropout" in t)


class NoGradBranch(nn.Module):
    """The same linear inside and outside ``torch.no_grad()``: Dynamo's graph has both,
    separated by ``torch._C._set_grad_enabled`` calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            frozen = self.linear(x)
        return self.linear(x) * frozen


def test_cse_never_merges_across_a_grad_mode_switch():
    graphs: list[tuple[fx.GraphModule, list]] = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    model = NoGradBranch()
    torch.compile(model, backend=grab, fullgraph=True)(torch.randn(2, 4))
    gm, example_inputs = graphs[0]
    optimized = fxopt.optimize(copy.deepcopy(gm), passes=["cse", "dce"], example_inputs=example_inputs)
    linears = [n for n in optimized.graph.nodes if n.target is F.linear]
    assert len(linears) == 2, "the no_grad linear and the grad linear were merged"

    x = torch.randn(2, 4)
    args = [x if a.shape == x.shape and not isinstance(a, nn.Parameter) else a for a in example_inputs]
    (expected,), (got,) = gm(*args), optimized(*args)
    assert got.requires_grad and expected.requires_grad
    torch.testing.assert_close(got, expected)
    weight = next(a for a in args if isinstance(a, nn.Parameter) and a.dim() == 2)
    (g_expected,) = torch.autograd.grad(expected.sum(), weight)
    (g_got,) = torch.autograd.grad(got.sum(), weight)
    torch.testing.assert_close(g_got, g_expected)
