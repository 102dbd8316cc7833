"""``triton_depthwise``: depthwise convolutions run by fxopt's Triton kernel, where timing
says so (the kernel's own numerics: test_depthwise_interpreter.py, and the GPU test here)."""

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.compile import depthwise
from fxopt.passes.depthwise import TritonDepthwise, decisions

OP = torch.ops.fxopt.depthwise_conv2d.default


class MBConv(nn.Module):
    """efficientnet's block in small: 1x1 expansion, BN, SiLU, a depthwise ``k`` x ``k``
    convolution, BN, SiLU, squeeze-excitation, 1x1 projection, and a second depthwise 5x5
    with a bias of its own. ``groups_per_channel`` < 1 makes the first grouped but not
    depthwise; ``dilation`` dilates it."""

    def __init__(self, k: int = 3, stride: int = 1, channels_per_group: int = 1, dilation: int = 1):
        super().__init__()
        c = 24
        self.expand = nn.Sequential(nn.Conv2d(8, c, 1, bias=False), nn.BatchNorm2d(c), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(c, c, k, stride, dilation * (k // 2), dilation=dilation,
                                          groups=c // channels_per_group, bias=False),
                                nn.BatchNorm2d(c), nn.SiLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 4, 1), nn.SiLU(), nn.Conv2d(4, c, 1),
                                nn.Sigmoid())
        self.dw2 = nn.Conv2d(c, c, 5, 1, 2, groups=c)
        self.project = nn.Conv2d(c, 8, 1)
        for bn in (self.expand[1], self.dw[1]):  # statistics of a trained net, not the identity
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = self.dw(self.expand(x))
        return self.project(self.dw2(y * self.se(y)))


def _optimize(model, x, options, timer=None):
    pass_ = (TritonDepthwise(timer=timer, **options) if timer else f"triton_depthwise{{{options}}}")
    gm = fxopt.optimize(make_fx(model)(x), passes=["fold_conv_bn"], example_inputs=(x,))
    return fxopt.optimize(gm, passes=[pass_])


def _replaced(gm):
    return [n for n in gm.graph.nodes if n.target is OP]


def _convolutions(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "convolution" in str(n.target)]


@pytest.mark.parametrize("k,stride", [(3, 1), (3, 2), (5, 2)])
def test_each_depthwise_convolution_becomes_the_op_and_the_function_is_the_same(k, stride):
    model = MBConv(k, stride).eval()
    x = torch.randn(2, 8, 11, 11)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = _optimize(model, x, "device=cpu,dtypes=all,decide=always")
    first, second = _replaced(out)
    assert first.args[3:] == ([stride, stride], [k // 2, k // 2], 0) and first.args[2] is not None  # BN's bias
    assert second.args[3:] == ([1, 1], [2, 2], 0)
    assert len(_convolutions(out)) == 4  # expansion, the SE's two, projection: untouched
    for _ in range(3):  # fresh inputs
        x = torch.randn(2, 8, 11, 11)
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_op_is_known_pure_and_declares_channels_last_output():
    """The backend replays a graph as CUDA graphs only where every node is known pure; the
    fake output's layout is the one the kernel writes."""
    from fxopt.analysis import ops

    model = MBConv().eval()
    x = torch.randn(2, 8, 9, 9)
    out = _optimize(model, x, "device=cpu,dtypes=all,decide=always")
    for node in _replaced(out):
        facts = ops.facts(node)
        assert not (facts.unknown or facts.random or facts.stateful or facts.collective), facts.reason
        assert node.meta["val"].is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 24, 9, 9)
    w, b = torch.randn(24, 1, 3, 3), torch.randn(24)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = OP(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), [2, 2], [1, 1], 0)
    real = OP(x, w, b, [2, 2], [1, 1], 0)
    assert fake.shape == real.shape == (2, 24, 5, 5) and fake.stride() == real.stride()


def test_convolutions_it_cannot_replace_are_left_alone():
    x = torch.randn(2, 8, 8, 8)
    for model in (MBConv(channels_per_group=2), MBConv(dilation=2)):  # grouped, not depthwise; dilated
        out = _optimize(model.eval(), x, "device=cpu,dtypes=all,decide=always")
        assert len(_replaced(out)) == 1  # only dw2
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
    assert not _replaced(_optimize(MBConv().eval(), x, "device=cpu,dtypes=all,decide=never"))
    assert not _replaced(_optimize(MBConv().eval(), x, "decide=always"))  # weights on the CPU, the pass's cuda
    # a symbolic size: no one shape to time
    symbolic = make_fx(MBConv().eval(), tracing_mode="symbolic", _allow_non_fake_inputs=True)(x)
    assert not _replaced(fxopt.optimize(symbolic, passes=["triton_depthwise{device=cpu,dtypes=all,decide=always}"]))


def test_the_choice_is_the_best_round_of_cudnn_and_each_configuration_once_per_shape():
    timed = []

    names = ["cudnn", *map(str, range(len(depthwise.CONFIGS)))]

    def timer(say):
        """Each candidate's time per round; the candidates are asked in ``names``' order
        (checked below). Nothing runs: the kernel needs a GPU here."""
        rounds = {name: iter(times) for name, times in say.items()}

        def time(fn, device, reps):
            timed.append(names[len(timed) % len(names)])
            return next(rounds[timed[-1]])
        return time

    def run(side, times):
        model = MBConv().eval()
        x = torch.randn(2, 8, side, side)
        out = _optimize(model, x, {"device": "cpu", "dtypes": "all"}, timer=timer(dict(zip(names, times))))
        torch.testing.assert_close(out(x), model(x), rtol=1e-5, atol=1e-5)
        return [n.args[5] for n in _replaced(out)]

    # 3 rounds for the 3x3 shape, then 3 for the 5x5: config 2's one fast round beats
    # cuDNN's best round in each
    slow = [9.0] * 6
    assert run(7, [[2.0] * 6, slow, slow, [5.0, 1.0, 5.0] * 2, slow]) == [2, 2]
    assert timed == names * 6  # alternating, every candidate once a round
    assert run(7, [[0.1] * 6] * 5) == [2, 2] and len(timed) == 30  # kept, not timed again
    # another input size: timed again; cuDNN wins a tie and keeps the convolution
    assert run(9, [[1.0] * 6] * 5) == [] and len(timed) == 60
    assert {key[1]: made for key, made in decisions().items() if key[0] == "cpu" and key[2] == (24, 1, 3, 3)
            and key[1][0] == 2} == {(2, 24, 7, 7): "2", (2, 24, 9, 9): "cudnn"}


@pytest.mark.gpu
def test_gpu_bf16_kernel_matches_eager_forced_and_through_the_backend():
    """On CUDA (bf16, channels-last): every configuration on efficientnet's shapes in small,
    the block with the kernel forced, and ``backend="fxopt"`` with the timed choice."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    for c, side, k, stride in ((32, 56, 3, 1), (96, 56, 3, 2), (144, 28, 5, 2), (672, 14, 5, 1)):
        x = torch.randn(4, c, side, side, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        w = torch.randn(c, 1, k, k, device="cuda", dtype=torch.bfloat16) / k
        b = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        want = F.conv2d(x.float(), w.float(), b.float(), stride, k // 2, 1, c)
        for config in depthwise.CONFIGS:
            y = depthwise.run_config(x, w, b, [stride] * 2, [k // 2] * 2, config)
            assert y.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    model = MBConv().cuda().eval().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(8, 8, 28, 28, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = model.float()(x.float())
        model.to(torch.bfloat16)
        eager_err = ((model(x).float() - want).norm() / want.norm()).item()
        forced = _optimize(model, x, "decide=always")
        assert len(_replaced(forced)) == 2
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxopt")
        for fn in (forced, compiled):
            err = ((fn(x).float() - want).norm() / want.norm()).item()
            assert err <= 2 * eager_err + 1e-3, (err, eager_err)
