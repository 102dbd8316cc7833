"""``pad_group_width``: grouped convolutions widened per group with zeros, where timing says so."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.graph_utils import fetch_attr
from fxopt.passes.group_width import PadGroupWidth, decisions


class RegNetBlock(nn.Module):
    """regnet's Y block in small: 1x1 conv, BN, ReLU, grouped 3x3 conv (``width`` channels per
    group), BN, ReLU, squeeze-excitation, 1x1 conv."""

    def __init__(self, groups: int = 2, width: int = 24, stride: int = 1):
        super().__init__()
        c = groups * width
        self.a = nn.Sequential(nn.Conv2d(16, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, stride, 1, groups=groups, bias=True), nn.BatchNorm2d(c), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, c, 1),
                                nn.Sigmoid())
        self.c = nn.Conv2d(c, 16, 1)
        for bn in (self.a[1], self.b[1]):  # statistics of a trained net, not the identity
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = self.b(self.a(x))
        return self.c(y * self.se(y))


def _grouped(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "convolution" in str(n.target)
            and n.args[8] > 1]


def _optimize(model, x, options):
    return fxopt.optimize(make_fx(model)(x), passes=["fold_conv_bn", f"pad_group_width{{{options}}}"],
                          example_inputs=(x,))


@pytest.mark.parametrize("stride", [1, 2])
def test_each_group_is_padded_to_32_channels_and_the_function_is_the_same(stride):
    model = RegNetBlock(stride=stride).eval()
    x = torch.randn(2, 16, 10, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = _optimize(model, x, "device=cpu,dtypes=all,decide=always")
    (conv,) = _grouped(out)
    weight, bias = fetch_attr(out, conv.args[1].target), fetch_attr(out, conv.args[2].target)
    assert weight.shape == (64, 32, 3, 3) and bias.shape == (64,)
    for g in range(2):  # the real channels where they were, zeros around them
        real = weight[32 * g:32 * g + 24, :24]
        assert real.abs().sum() > 0 and not weight[32 * g + 24:32 * g + 32].any()
        assert not weight[32 * g:32 * g + 24, 24:].any() and not bias[32 * g + 24:32 * (g + 1)].any()
    for _ in range(3):  # fresh inputs
        x = torch.randn(2, 16, 10, 10)
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_rewritten_graph_holds_only_ops_the_replay_knows_to_be_pure():
    """The backend replays a graph as CUDA graphs only where every node is known pure: the
    pad and the cut are stock torch ops (a Python helper in the graph cost regnet its replay
    on an H200: 7.39 ms plain launches against 4.04 ms)."""
    from fxopt.analysis import ops

    model = RegNetBlock().eval()
    x = torch.randn(2, 16, 10, 10)
    out = _optimize(model, x, "device=cpu,dtypes=all,decide=always")
    assert _grouped(out) and any("group_padded" in str(n.target) for n in out.graph.nodes)
    for node in out.graph.nodes:
        if node.op in ("call_function", "call_method"):
            facts = ops.facts(node)
            assert not (facts.unknown or facts.random or facts.stateful or facts.collective), (node, facts.reason)
    assert {n.target for n in out.graph.nodes if n.op == "call_function"} >= {torch.unflatten, torch.flatten,
                                                                            torch.narrow, F.pad}


def test_a_graph_compiled_for_varying_batch_sizes_is_padded_and_right_at_every_batch():
    """Through ``backend="fxopt"`` with a symbolic batch (``mark_dynamic``): the pass times
    at the traced batch and the padded graph computes the model at other batches too."""
    torch._dynamo.reset()
    model = RegNetBlock(width=20).eval()  # a shape of its own: decisions are per process
    reports, timed = [], []

    def timer(fn, device, reps):
        timed.append(fn.__name__)
        return {"padded": 1.0, "plain": 2.0}[fn.__name__]

    pass_ = PadGroupWidth(timer=timer, device="cpu", dtypes="all")
    compiled = torch.compile(model, backend="fxopt", options={"passes": [pass_], "reports": reports})
    with torch.no_grad():
        for batch in (4, 7, 2):
            x = torch.randn(batch, 16, 8, 8)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (graph,) = reports  # one graph for every batch
    # the backend's own pad_group_width (for CUDA weights) ran too and changed nothing
    (record,) = [r for _, r in graph.report.walk() if r.name == "pad_group_width" and r.changed]
    assert record.stats == {"convolutions": 1} and timed == ["plain", "padded"] * 3
    assert any(k[0] == "cpu" and k[1] == (4, 40, 8, 8) for k in decisions())  # timed at the traced batch


def test_convolutions_it_cannot_or_need_not_widen_are_left_alone():
    x = torch.randn(2, 16, 8, 8)
    for model in (RegNetBlock(groups=2, width=32),  # aligned already
                  RegNetBlock(groups=48, width=1),  # depthwise: 32 times the work
                  RegNetBlock(groups=1, width=24)):  # not grouped
        out = _optimize(model.eval(), x, "device=cpu,dtypes=all,decide=always")
        assert not any("group_padded" in str(n.target) for n in out.graph.nodes)
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
    out = _optimize(RegNetBlock().eval(), x, "device=cpu,dtypes=all,decide=never")
    assert not any("group_padded" in str(n.target) for n in out.graph.nodes)
    out = _optimize(RegNetBlock().eval(), x, "decide=always")  # weights on the CPU, the pass's device cuda
    assert not any("group_padded" in str(n.target) for n in out.graph.nodes)


def test_the_decision_is_the_faster_best_round_timed_once_per_gpu_and_shape():
    timed = []

    def timer(say):
        """Each form's time per round, in the order the rounds are asked for."""
        rounds = {name: iter(times) for name, times in say.items()}

        def time(fn, device, reps):
            fn()  # runs as it will be timed
            timed.append(fn.__name__)
            return next(rounds[fn.__name__])
        return time

    def run(batch, say):
        model = RegNetBlock().eval()
        x = torch.randn(batch, 16, 8, 8)
        gm = fxopt.optimize(make_fx(model)(x), passes=["fold_conv_bn"], example_inputs=(x,))
        out = fxopt.optimize(gm, passes=[PadGroupWidth(timer=timer(say), device="cpu", dtypes="all")])
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
        return fetch_attr(out, _grouped(out)[0].args[1].target).shape[1]

    # alternating rounds; the padded form's one fast round beats the plain form's best
    assert run(3, {"padded": [5.0, 1.0, 5.0], "plain": [2.0, 2.0, 2.0]}) == 32
    assert timed == ["plain", "padded"] * 3
    assert run(3, {"padded": [9.0] * 3, "plain": [1.0] * 3}) == 32 and len(timed) == 6  # kept, not timed again
    assert run(5, {"padded": [2.0, 1.5, 3.0], "plain": [9.0, 1.4, 9.0]}) == 24 and len(timed) == 12  # another shape
    assert run(6, {"padded": [1.0] * 3, "plain": [1.0] * 3}) == 24  # a tie keeps the convolution as it is
    assert {k[1][0]: v for k, v in decisions().items() if k[0] == "cpu" and k[2] == (48, 24, 3, 3)} == {
        3: True, 5: False, 6: False}


@pytest.mark.gpu
def test_gpu_bf16_padded_grouped_convolutions_match_eager_through_the_backend():
    """On CUDA (bf16, channels-last): the widened convolutions compute what eager computes,
    forced on, and through ``backend="fxopt"`` with the timed choice, whichever it is."""
    torch.manual_seed(0)
    model = RegNetBlock().cuda().eval().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(8, 16, 28, 28, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = model.float()(x.float())
        model.to(torch.bfloat16)
        eager_err = ((model(x).float() - want).norm() / want.norm()).item()
        forced = _optimize(model, x, "decide=always")
        assert _grouped(forced) and fetch_attr(forced, _grouped(forced)[0].args[1].target).shape[1] == 32
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxopt")
        for fn in (forced, compiled):
            err = ((fn(x).float() - want).norm() / want.norm()).item()
            assert err <= 2 * eager_err + 1e-3, (err, eager_err)


@pytest.mark.gpu
def test_gpu_bf16_padded_convolutions_with_a_symbolic_batch_match_eager_at_every_batch():
    """On CUDA (bf16, channels-last), ``backend="fxopt"`` with the batch marked dynamic: the
    padded graph (forced: timing is another test's) serves batches 8, 3 and 16 as eager does."""
    torch._dynamo.reset()
    model = RegNetBlock().cuda().eval().to(torch.bfloat16).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model).float()
    reports = []
    compiled = torch.compile(model, backend="fxopt", options={
        "passes": [PadGroupWidth(decide="always")], "reports": reports})
    with torch.no_grad():
        for batch in (8, 3, 16):
            x = torch.randn(batch, 16, 28, 28, device="cuda", dtype=torch.bfloat16).to(
                memory_format=torch.channels_last)
            torch._dynamo.mark_dynamic(x, 0)
            want = reference(x.float())
            eager_err = ((model(x).float() - want).norm() / want.norm()).item()
            err = ((compiled(x).float() - want).norm() / want.norm()).item()
            assert err <= 2 * eager_err + 1e-3, (batch, err, eager_err)
    assert len(reports) == 1 and any(r.name == "pad_group_width" and r.changed for _, r in reports[0].report.walk())
