"""The fxopt Dynamo backend on Inductor's CPU code generation: freezing, training graphs,
graph breaks, dynamic shapes, soundness of freezing around writes."""

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.testing import assert_equivalent


class ConvNet(nn.Module):
    """Conv-BN-ReLU, dropout, and a scale that depends only on a parameter: constant
    folding can only remove it once parameters are constants."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 4)
        self.gate = nn.Parameter(torch.randn(4))
        with torch.no_grad():  # non-trivial statistics, so a wrong fold would show
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.drop(x.mean((2, 3)))
        return self.head(x) * (torch.sigmoid(self.gate) * 2)


def test_backend_is_registered_under_its_name():
    assert "fxopt" in torch._dynamo.list_backends()


def test_inference_graph_freezes_weights_so_weight_passes_apply():
    model = ConvNet().eval()
    reports = []
    compiled = torch.compile(model, backend="fxopt", options={"reports": reports})
    assert_equivalent(model, compiled, (torch.randn(2, 3, 8, 8),))
    assert_equivalent(model, compiled, (torch.randn(2, 3, 8, 8),))

    (graph,) = reports
    assert not graph.training and graph.fallback is None
    assert any("conv_parameters_weight" in name for name in graph.frozen)
    assert any("running_mean" in name for name in graph.frozen)
    # with constant weights the passes could fold BatchNorm into the conv and evaluate
    # the parameter-only subexpression ahead of time; dropout is gone
    for gone in ("batch_norm", "sigmoid", "dropout"):
        assert gone not in graph.code, gone
    assert "_folded" in graph.code
    placeholders = [line for line in graph.code.splitlines() if line.startswith("def forward")]
    assert "parameters" not in placeholders[0] and "buffers" not in placeholders[0]


class Bottleneck(nn.Module):
    """torchvision's residual spelling, which Dynamo keeps as written: ``out += identity``
    (an in-place add) then an in-place ReLU module. With ``leak`` the program reads the sum
    again after the ReLU wrote into it, which a fused op would not reproduce."""

    def __init__(self, leak: bool):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.leak = leak
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        y = self.relu(out)
        return y * 2 - out if self.leak else y


@pytest.mark.parametrize("leak", [False, True])
def test_in_place_residual_fuses_only_when_the_writes_stay_invisible(leak):
    model = Bottleneck(leak).eval()
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    assert_equivalent(model, compiled, (torch.randn(2, 4, 6, 6),))
    (graph,) = reports
    assert ("conv_bias_add_relu" in graph.code) is not leak, graph.code
    assert ("+=" in graph.code) is leak, graph.code


def test_training_graph_is_left_to_autograd():
    model = ConvNet().train()
    model.drop.p = 0.0  # deterministic, so gradients compare exactly
    reference = copy.deepcopy(model)
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    x = torch.randn(4, 3, 8, 8)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()

    (graph,) = reports
    assert graph.training and graph.frozen == []
    skipped = {r.name: r.skipped for _, r in graph.report.walk() if r.skipped}
    assert "inference-only" in skipped["constant_fold"]
    assert "training graph" in skipped["freeze_parameters"]
    assert "sigmoid" in graph.code  # the parameter still gets its gradient through it
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    # BatchNorm's running statistics were updated exactly as in eager
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)


class BrokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x) * torch.tanh(self.b.bias).sum()


def test_graph_breaks_compile_each_graph():
    model = BrokenNet().eval()
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    assert_equivalent(model, compiled, (torch.randn(5, 6),))
    assert len(reports) == 2
    assert all(g.frozen and g.fallback is None for g in reports)
    assert "tanh" not in reports[1].code  # computed from a frozen bias ahead of time


class FlattenNet(nn.Module):
    """Shape-dependent code: a flatten through view, a reshape that is an identity only
    for this layout, and a size-derived scale."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        y = self.conv(x)
        y = y.reshape(y.shape[0], 4, 5, 5)
        flat = y.view(y.shape[0], -1) / y.shape[0]
        return self.head(flat)


def test_dynamic_shapes_one_graph_serves_every_batch_size():
    model = FlattenNet().eval()
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports}, dynamic=True)
    # (batch 1 would recompile under plain Inductor too: Dynamo specializes sizes 0 and 1)
    for batch in (3, 8, 5, 12):
        assert_equivalent(model, compiled, (torch.randn(batch, 2, 5, 5),))
    # nothing a pass did specialized the graph to a batch size: no recompile happened
    assert len(reports) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert re.search(r"def forward\(self, s\d+ : torch.SymInt", reports[0].code)  # batch size


class PaddedNet(nn.Module):
    """A pad before a convolution: ``F.pad``'s C++ kernel reads sizes as ints."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        return self.conv(F.pad(x, [1, 1, 1, 1])).relu() + 1


def test_ops_whose_kernels_read_sizes_as_ints_do_not_pin_the_batch():
    """fxopt's fake runs used to call ``F.pad``'s C++ kernel on a symbolic batch, which
    guarded the batch to its traced value: Dynamo compiled a graph for every batch size
    (4 for 4 sizes, where plain Inductor compiles 2: the first static, then one dynamic)."""
    model = PaddedNet().eval()
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    for batch in (2, 5, 3, 7):
        assert_equivalent(model, compiled, (torch.randn(batch, 2, 6, 6),))
    assert len(reports) == 2 and all(r.fallback is None for r in reports)
    assert re.search(r"def forward\(self, s\d+ : torch.SymInt", reports[1].code)  # the batch, symbolic


def bake_sizes(gm):
    """Replaces symbolic sizes by their current values: int() of a SymInt makes Dynamo
    guard on that value, so the baked graph is only ever used where it is right."""
    for node in list(gm.graph.find_nodes(op="placeholder")):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            def bake(n, node=node, concrete=int(value)):
                return concrete if n is node else n

            for user in list(node.users):
                user.args = torch.fx.map_arg(user.args, bake)
                user.kwargs = torch.fx.map_arg(user.kwargs, bake)


def test_a_pass_that_bakes_in_a_size_gets_a_guard_not_a_wrong_answer():
    model = FlattenNet().eval()
    reports = []
    compiled = fxopt.compile(model, passes=[bake_sizes], options={"reports": reports}, dynamic=True)
    for batch in (3, 5, 3):
        assert_equivalent(model, compiled, (torch.randn(batch, 2, 5, 5),))
    assert len(reports) == 2  # batch 5 failed the guard and recompiled; batch 3 reused its graph
    size = re.search(r"def forward\(self, (s\d+) : torch.SymInt", reports[0].code).group(1)
    assert reports[0].code.count(size) == 1  # the symbolic size is an input nothing uses


class CountingNet(nn.Module):
    """Writes a buffer in place and runs BatchNorm in training mode without autograd: the
    written buffers must stay inputs, or the model's state would silently stop changing."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.bn(self.lin(x)) + self.calls


def test_written_buffers_are_not_frozen():
    model = CountingNet().train()
    reference = copy.deepcopy(model)
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(6, 4)
            torch.testing.assert_close(compiled(x), reference(x))
    (graph,) = reports
    assert any("lin_parameters_weight" in name for name in graph.frozen)
    assert not any("calls" in n or "running" in n for n in graph.frozen)
    assert model.calls.item() == 2
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)


class AttentionBlock(nn.Module):
    """torchvision's ViT encoder block: batch-first MultiheadAttention, then an MLP."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        y = self.ln(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        return x + self.mlp(x + y)


def test_backend_freezing_lowers_like_inductors_own_freezing():
    """With no passes, the backend's freezing must reach Inductor as the same ATen program
    as Inductor's freezing; a weight that lost requires_grad once turned the attention's
    projections into expand+bmm instead of one mm."""
    import collections

    model, x = AttentionBlock().eval(), torch.randn(2, 9, 32)
    seen = {}

    def spy(label):
        def look(graph):
            seen[label] = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
        return look

    with torch.no_grad():
        torch._dynamo.reset()
        with torch._inductor.config.patch(freezing=True, post_grad_custom_post_pass=spy("inductor")):
            expected = torch.compile(model)(x)
        torch._dynamo.reset()
        got = fxopt.compile(model, passes=[], options={"inductor": {"post_grad_custom_post_pass": spy("fxopt")}})(x)
    assert seen["fxopt"] == seen["inductor"]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("flag", ["inductor_freezing", "prepare_freezing"])
def test_weights_dynamo_already_froze_still_get_the_layout_passes(flag):
    """A caller that sets the global freezing flag (as benchmarks of Inductor's freezing
    do) makes Dynamo trace weights as graph attributes: nothing is left for the backend to
    freeze, but the weights are constants, so the layout passes still run."""
    model = ConvNet().eval()
    reports = []
    patch = (torch._inductor.config.patch(freezing=True) if flag == "inductor_freezing"
             else torch._dynamo.config.patch(prepare_freezing=True))
    with patch:
        compiled = torch.compile(model, backend="fxopt", options={"reports": reports})
        assert_equivalent(model, compiled, (torch.randn(2, 3, 8, 8),))
    (graph,) = reports
    assert graph.frozen == [] and graph.fallback is None  # Dynamo did the freezing
    ran = {r.name for _, r in graph.report.walk()}
    assert {"pad_conv_channels", "channels_last_weights", "fold_conv_bn"} <= ran, ran
    assert "batch_norm" not in graph.code


def test_fused_convs_leave_pointwise_convolutions_to_inductor_when_it_lowers_them_as_mm():
    """With Inductor's ``conv_1x1_as_mm`` (a user's option) a fused 1x1 conv decomposes, so
    Inductor can make it a matrix product; otherwise it may stay one cuDNN call."""
    from fxopt.compile.fused_ops import inductor_lowers_as_mm
    from fxopt.compile.options import BackendOptions

    user = BackendOptions(inductor={"conv_1x1_as_mm": True})
    assert user.inductor_patches(frozen=True, training=False)["conv_1x1_as_mm"] is True

    pointwise, spatial = torch.empty(8, 4, 1, 1), torch.empty(8, 4, 3, 3)
    one, zero = [1, 1], [0, 0]
    with torch._inductor.config.patch(conv_1x1_as_mm=True):
        assert inductor_lowers_as_mm(pointwise, one, zero, one)
        assert not inductor_lowers_as_mm(spatial, one, one, one)
        assert not inductor_lowers_as_mm(pointwise, [2, 2], zero, one)  # strided: not a plain mm
    with torch._inductor.config.patch(conv_1x1_as_mm=False):
        assert not inductor_lowers_as_mm(pointwise, one, zero, one)


def test_an_empty_pipeline_runs_no_torch_level_pass():
    """``passes=[]`` is no pass, not the default pipeline: batch norm, dropout and the
    parameter-only subexpression the defaults remove stay in the graph."""
    model = ConvNet().eval()
    reports = []
    compiled = fxopt.compile(model, passes=[], options={"reports": reports})
    assert_equivalent(model, compiled, (torch.randn(2, 3, 8, 8),))
    (graph,) = reports
    assert graph.fallback is None and graph.frozen  # frozen all the same: freezing is no pass
    for kept in ("batch_norm", "sigmoid"):
        assert kept in graph.code, kept


def test_the_users_inductor_options_win_over_the_backends_patches():
    """``inductor={...}`` is applied last: a user who turns Inductor's freezing off or
    installs their own post-grad pass gets what they asked for on every graph."""
    from fxopt.compile.options import BackendOptions

    def mine(graph):
        return None

    options = BackendOptions.parse({"inductor": {"freezing": False, "post_grad_custom_post_pass": mine},
                                    "post_grad_post_passes": ["dce"]})
    patches = options.inductor_patches(frozen=True, training=False)
    assert patches["freezing"] is False and patches["post_grad_custom_post_pass"] is mine


def test_frozen_weights_recompile_once_when_a_weight_is_written():
    """Calls run the frozen graph on the kept inputs while the weights' versions are the
    compiled ones; after an in-place write, the graph with weights as inputs is made once
    and runs every later call on all the arguments."""
    from fxopt.compile.freezing import FrozenWeights

    weight = torch.randn(3)
    calls = []

    def frozen(*args):
        calls.append(("frozen", len(args)))
        return args[0] * 2

    def unfrozen(args):
        calls.append(("unfrozen", len(args)))
        return lambda x, w: x * w

    fn = FrozenWeights(frozen, [0], [weight], unfrozen)
    x = torch.randn(3)
    torch.testing.assert_close(fn(x, weight), x * 2)
    with torch.no_grad():
        weight.mul_(3)
    for _ in range(3):
        torch.testing.assert_close(fn(x, weight), x * weight)
    assert calls == [("frozen", 1), ("unfrozen", 2)]


def test_freezing_makes_unwritten_parameters_constants_with_their_values_recorded():
    """``FreezeParameters`` on a graph as Dynamo hands it over (weights as inputs): the
    parameter becomes a ``get_attr`` of that very Parameter carrying its traced value (the
    shape passes read it), the written buffer stays an input, and the graph computes the same."""
    from fxopt.compile.freezing import FreezeParameters, work_copy

    weight, counter = nn.Parameter(torch.randn(4)), torch.zeros(4)
    graph = torch.fx.Graph()
    x, w, c = (graph.placeholder(n) for n in ("x", "w", "c"))
    graph.output(graph.call_function(torch.mul, (graph.call_method("add_", (c, 1.0)), graph.call_function(
        torch.mul, (x, w)))))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for node, value in zip((x, w, c), (torch.randn(4), weight, counter), strict=True):
        node.meta["example_value"] = mode.from_tensor(value)
    work = work_copy(gm)
    result = FreezeParameters([torch.randn(4), weight, counter]).run(work, None)
    assert result.changed and result.stats["inputs_kept"] == [0, 2] and result.stats["frozen"] == ["w"]
    (getter,) = work.graph.find_nodes(op="get_attr")
    assert getattr(work, getter.target) is weight
    assert getter.meta["val"].shape == weight.shape and getter.meta["val"].dtype == weight.dtype
    work.recompile()
    inputs = torch.randn(4)
    want = (counter + 1) * (inputs * weight)
    torch.testing.assert_close(work(inputs, counter.clone()), want.detach())
