"""``channels_last_weights``: constant conv weights re-stored channels-last, values intact."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.graph_utils import fetch_attr


class SharedWeightNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        y = y + F.conv2d(x, self.conv.weight, padding=1)  # the same weight, a second conv
        return self.head(y)


def _conv_weights(gm):
    return [fetch_attr(gm, n.args[1].target) for n in gm.graph.nodes
            if n.op == "call_function" and "convolution" in str(n.target)]


def test_constant_conv_weights_become_channels_last_with_equal_values():
    model = SharedWeightNet().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = make_fx(model)(x)  # ATen graph: the weights are get_attr constants
    before = {name: t.clone() for name, t in model.state_dict().items()}
    out = fxopt.optimize(gm, passes=["channels_last_weights{device=cpu,dtypes=all}"], example_inputs=(x,))

    weights = _conv_weights(out)
    assert len(weights) == 3 and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert weights[0] is weights[1]  # a shared weight is converted once
    torch.testing.assert_close(weights[0], model.conv.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out(x), model(x))
    for name, t in model.state_dict().items():  # the user's tensors: same values, same layout
        assert torch.equal(t, before[name]) and t.is_contiguous(), name
    report = fxopt.report_of(out)
    # the 1x1 head weight already is channels-last (its strides fit both layouts)
    assert report.records[-1].stats["weights"] == 1


def test_only_the_requested_device_and_dtypes_are_touched():
    model = SharedWeightNet().eval()
    x = torch.randn(2, 3, 8, 8)
    for passes in ("channels_last_weights", "channels_last_weights{device=cpu}"):  # cuda / half only
        out = fxopt.optimize(make_fx(model)(x), passes=[passes], example_inputs=(x,))
        assert not _conv_weights(out)[0].is_contiguous(memory_format=torch.channels_last)


class Stem(nn.Module):
    def __init__(self, groups: int = 1):
        super().__init__()
        self.rgb = nn.Conv2d(3, 8, 7, stride=2, padding=3)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)  # 2 channels per group
        self.wide = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.wide(F.relu(self.grouped(self.rgb(x))))


def test_rgb_convolutions_are_padded_to_eight_channels():
    model = Stem().eval()
    x = torch.randn(2, 3, 16, 16)
    gm = make_fx(model)(x)
    passes = ["pad_conv_channels{device=cpu,dtypes=all,max_kernel_area=49}"]  # the stem is 7x7
    out = fxopt.optimize(gm, passes=passes, example_inputs=(x,))

    weights = _conv_weights(out)
    assert [tuple(w.shape[:2]) for w in weights] == [(8, 8), (8, 2), (4, 8)]  # only the RGB conv
    torch.testing.assert_close(weights[0][:, :3], model.rgb.weight.detach(), rtol=0, atol=0)
    assert not weights[0][:, 3:].any()
    assert "pad" in [getattr(n.target, "__name__", None) for n in out.graph.nodes]
    for _ in range(3):  # fresh inputs: the padded input channels meet zero weights
        x = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(out(x), model(x))
    assert model.rgb.weight.shape == (8, 3, 7, 7)


def test_large_stems_are_left_unpadded_by_default():
    """A 7x7 stem (resnet50's) ran slower padded on an H100: by default only kernels of at
    most 16 taps are padded."""
    model = Stem().eval()
    x = torch.randn(2, 3, 16, 16)
    out = fxopt.optimize(make_fx(model)(x), passes=["pad_conv_channels{device=cpu,dtypes=all}"],
                         example_inputs=(x,))
    assert [tuple(w.shape[:2]) for w in _conv_weights(out)] == [(8, 3), (8, 2), (4, 8)]
    torch.testing.assert_close(out(x), model(x))


def test_a_padded_stem_keeps_a_symbolic_batch_symbolic():
    """Through ``backend="fxopt"`` at four batch sizes: the stem's pad is recorded under the
    Python dispatcher, so the batch stays symbolic and Dynamo compiles what it compiles
    without fxopt (the first size static, then one dynamic graph). Recorded from outside it,
    ``F.pad``'s kernel read the batch as an int: 4 graphs for 4 sizes."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    reports = []
    compiled = torch.compile(model, backend="fxopt", options={
        "passes": ["pad_conv_channels{device=cpu,dtypes=all}"], "reports": reports})
    with torch.no_grad():
        for batch in (2, 5, 3, 7):
            x = torch.randn(batch, 3, 8, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(reports) == 2
    assert all(any(r.name == "pad_conv_channels" and r.changed for _, r in g.report.walk()) for g in reports)
