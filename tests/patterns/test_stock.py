"""The stock rules on models with random BN statistics: numerical equivalence, what
they fold and fuse, and what they must leave alone; at torch level and ATen level."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.compile import fused_ops
from fxopt.models import mobilenet_v2, resnet18

from .conftest import capture, ops, randomize_bn

FOLD = ["fold_conv_bn"]
FUSE = ["fold_conv_bn", "fuse_conv_bn_relu", "fuse_add_relu", "fuse_linear_relu"]


def _optimize(gm: fx.GraphModule, args: tuple, passes: list[str]) -> fx.GraphModule:
    return fxopt.optimize(gm, passes=passes, example_inputs=args)


def _bn_ops(gm: fx.GraphModule) -> int:
    return sum("batch_norm" in name.lower() or "batchnorm" in name.lower() for name in ops(gm))


def _fresh(args: tuple) -> tuple:
    return tuple(torch.randn_like(a) if a.is_floating_point() and a.dim() >= 2 and not isinstance(a, nn.Parameter)
                 else a for a in args)


class ConvBN(nn.Module):
    def __init__(self, conv: nn.Module, bn: nn.Module, relu: bool = False):
        super().__init__()
        self.conv, self.bn, self.relu = conv, bn, relu

    def forward(self, x):
        y = self.bn(self.conv(x))
        return F.relu(y) if self.relu else y


CASES = {
    "conv1d": (lambda: ConvBN(nn.Conv1d(3, 6, 3), nn.BatchNorm1d(6)), (2, 3, 10)),
    "conv2d": (lambda: ConvBN(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)), (2, 3, 8, 8)),
    "conv3d": (lambda: ConvBN(nn.Conv3d(3, 6, 3), nn.BatchNorm3d(6)), (2, 3, 5, 5, 5)),
    "conv2d_nobias_grouped": (lambda: ConvBN(nn.Conv2d(4, 8, 3, bias=False, groups=2, stride=2),
                                             nn.BatchNorm2d(8)), (2, 4, 9, 9)),
    "conv_transpose2d": (lambda: ConvBN(nn.ConvTranspose2d(3, 6, 3, stride=2, output_padding=1),
                                        nn.BatchNorm2d(6)), (2, 3, 5, 5)),
    "affine_false": (lambda: ConvBN(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6, affine=False)), (2, 3, 8, 8)),
    "linear_bn1d": (lambda: ConvBN(nn.Linear(5, 7), nn.BatchNorm1d(7)), (4, 5)),
    "conv_bn_relu": (lambda: ConvBN(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), relu=True), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["symbolic_trace", "export", "make_fx"])
def test_fold_conv_bn_is_equivalent(case: str, how: str) -> None:
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = randomize_bn(make()).eval()
    x = torch.randn(shape)
    gm, args = capture(model, (x,), how)
    expected = gm(*args)
    out = _optimize(gm, args, FUSE)
    assert _bn_ops(out) == 0, ops(out)
    torch.testing.assert_close(out(*args), expected, rtol=1e-4, atol=1e-5)
    fresh = torch.randn(shape)
    torch.testing.assert_close(out(fresh), model(fresh), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["conv2d", "conv_bn_relu", "linear_bn1d"])
def test_dynamo_graph_with_parameters_as_placeholders(case: str) -> None:
    make, shape = CASES[case]
    model = randomize_bn(make()).eval()
    gm, args = capture(model, (torch.randn(shape),), "dynamo")
    gm.eval()  # a GraphModule starts in training mode: inference-only passes would skip it
    assert any(n.op == "placeholder" and "weight" in n.name for n in gm.graph.nodes)
    expected = gm(*args)
    out = _optimize(gm, args, FUSE)
    assert _bn_ops(out) == 0, ops(out)
    torch.testing.assert_close(out(*args), expected, rtol=1e-4, atol=1e-5)


class Untouchable(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, track_running_stats=kind != "no_running_stats")
        self.convt = nn.ConvTranspose2d(4, 4, 3, groups=2)
        self.bnt = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        if self.kind == "conv_output_reused":
            return self.bn(y) + y
        if self.kind == "grouped_transpose":
            return self.bnt(self.convt(y))
        return self.bn(y)


@pytest.mark.parametrize("kind", ["training", "no_running_stats", "conv_output_reused", "grouped_transpose"])
def test_left_alone(kind: str) -> None:
    model = randomize_bn(Untouchable(kind))
    model.train(kind == "training")
    gm = fx.symbolic_trace(model)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    before = _bn_ops(gm)
    out = fxopt.optimize(gm, passes=FOLD, example_inputs=(x,))
    assert _bn_ops(out) == before == 1
    if kind != "training":  # a training-mode run would update the statistics again
        torch.testing.assert_close(out(x), expected)


class SharedWeight(nn.Module):
    """One conv (one weight) feeding two different BatchNorms."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.bn1, self.bn2 = nn.BatchNorm2d(5), nn.BatchNorm2d(5)
        self.other = nn.Conv2d(3, 5, 3)
        self.other.weight = self.conv.weight  # the same Parameter in two modules

    def forward(self, x):
        return self.bn1(self.conv(x)) + self.bn2(self.other(x)) + self.bn2(self.conv(x * 2))


def test_shared_weights_fold_into_separate_tensors_and_stay_intact() -> None:
    model = randomize_bn(SharedWeight()).eval()
    original = model.conv.weight.detach().clone()
    x = torch.randn(2, 3, 8, 8)
    out = fxopt.optimize(model, passes=FOLD, example_inputs=(x,), verify=True)
    assert _bn_ops(out) == 0
    torch.testing.assert_close(out(x), model(x), rtol=1e-4, atol=1e-5)
    assert torch.equal(model.conv.weight, original)  # never written in place
    assert model.other.weight is model.conv.weight


@pytest.mark.parametrize("factory", [resnet18, mobilenet_v2], ids=["resnet18", "mobilenet_v2"])
def test_default_pipeline_on_zoo_models(factory) -> None:
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(1, 3, 64, 64)
    out = fxopt.optimize(model, example_inputs=(x,))
    assert _bn_ops(out) == 0
    torch.testing.assert_close(out(x), model(x), rtol=1e-3, atol=1e-4)
    if factory is resnet18:  # basic blocks: conv+bn+relu and conv+bn+add+relu
        names = ops(out)
        assert names.count("conv_bias_add_relu") == 8 and names.count("conv_bias_relu") == 9, names


def test_fuse_linear_relu_and_add_relu() -> None:
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x, y):
            return F.relu(self.fc(x)) + torch.relu(x + y)

    model = M().eval()
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    out = fxopt.optimize(model, passes=["fuse_linear_relu", "fuse_add_relu"], example_inputs=(x, y))
    assert "linear_relu" in ops(out) and "add_relu" in ops(out) and "relu" not in ops(out)
    torch.testing.assert_close(out(x, y), model(x, y))


def test_inference_only_passes_skip_training_graphs() -> None:
    model = ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), relu=True).train()
    out = fxopt.optimize(model, passes=FUSE, example_inputs=(torch.randn(2, 3, 8, 8),))
    assert _bn_ops(out) == 1


# --- the fused ops themselves --------------------------------------------------------------

def test_fused_ops_cpu_fallbacks_broadcast_and_promote() -> None:
    a, b = torch.randn(4, 1, 5), torch.randn(3, 1)
    torch.testing.assert_close(torch.ops.fxopt.add_relu(a, b), torch.relu(a + b))
    half, full = torch.randn(4, 5, dtype=torch.float16), torch.randn(4, 5)
    promoted = torch.ops.fxopt.add_relu(half, full)
    assert promoted.dtype == torch.float32
    torch.testing.assert_close(promoted, torch.relu(half + full))
    x, w, bias = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    for z in (torch.randn(2, 4, 6, 6), torch.randn(4, 1, 1), torch.randn(2, 4, 6, 6, dtype=torch.float64)):
        torch.testing.assert_close(
            torch.ops.fxopt.conv_bias_add_relu(x, w, bias, z, 0.5, [1, 1], [0, 0], [1, 1], 1),
            fused_ops.conv_bias_add_relu_reference(x, w, bias, z, 0.5, [1, 1], [0, 0], [1, 1], 1))
    xs, wl = torch.randn(2, 3, 5), torch.randn(4, 5)
    torch.testing.assert_close(torch.ops.fxopt.linear_relu(xs, wl, None), F.relu(F.linear(xs, wl)))


def test_inductor_sees_through_fused_ops() -> None:
    """With Inductor's decomposition table the fused ops become plain aten ops again."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b, z):
        y = torch.ops.fxopt.conv_bias_add_relu(x, w, b, z, 1.0, [1, 1], [1, 1], [1, 1], 1)
        return torch.ops.fxopt.add_relu(y, z)

    args = (torch.randn(1, 3, 6, 6), torch.randn(3, 3, 3, 3), torch.randn(3), torch.randn(1, 3, 6, 6))
    traced = make_fx(f, decomposition_table=select_decomp_table())(*args)
    targets = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert not any("fxopt" in t for t in targets), targets
    assert any("convolution" in t for t in targets) and any("relu" in t for t in targets)
    torch.testing.assert_close(traced(*args), f(*args))


class InPlaceResidual(nn.Module):
    """torchvision's Bottleneck spelling: ``out += identity`` then an in-place ReLU module."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.leak = leak

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        y = self.relu(out)
        return y * 2 + out if self.leak else y  # leak: the sum is read after the ReLU wrote it


@pytest.mark.parametrize("how", ["symbolic_trace", "make_fx"])
def test_in_place_residual_add_and_relu_fuse(how: str) -> None:
    model = randomize_bn(InPlaceResidual()).eval()
    x = torch.randn(2, 4, 6, 6)
    gm, args = capture(model, (x,), how)
    out = _optimize(gm, args, FUSE)
    names = ops(out)
    assert names.count("conv_bias_add_relu") == 1, names
    assert not any(n in names for n in ("iadd", "add_.Tensor", "relu", "relu_.default")), names
    fresh = _fresh(args)
    torch.testing.assert_close(out(*fresh), gm(*fresh))


def test_in_place_write_into_an_input_is_never_fused_away() -> None:
    """``a += b`` on a graph input is visible to the caller: relu(a + b) must not become an
    out-of-place fused op, at the end of a chain of in-place writes or not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        a.add_(b)
        return torch.relu(a)

    a, b = torch.randn(3, 5), torch.randn(3, 5)
    gm = make_fx(f)(a.clone(), b)
    out = _optimize(gm, (a.clone(), b), ["fuse_add_relu"])
    assert "add_relu" not in ops(out), ops(out)
    mine, theirs = a.clone(), a.clone()
    torch.testing.assert_close(out(mine, b), f(theirs, b))
    torch.testing.assert_close(mine, theirs)


def test_fused_ops_decompose_even_if_inductor_compiled_before_fxopt_was_imported() -> None:
    """Inductor caches its decomposition table at its first compile; importing fxopt later
    must still put the fused ops' decompositions in the table Inductor uses."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "torch.compile(lambda x: x.relu() + 1)(torch.randn(4))\n"
        "import fxopt.compile.fused_ops\n"
        "from torch._inductor.decomposition import select_decomp_table\n"
        "table = select_decomp_table()\n"
        "assert torch.ops.fxopt.conv_bias_relu.default in table\n"
        "assert torch.ops.fxopt.conv_bias_add_relu.default in table\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d forward, reproduced: a shape assert, the functional batch
    norm, then the activation (symbolic_trace traces into it: it is no torch.nn class)."""

    def __init__(self, num_features: int):
        super().__init__(num_features)
        self.act = nn.ReLU()

    def forward(self, x):
        torch._assert(x.ndim == 4, "expected 4D input")
        factor = 0.0 if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, use_batch_stats, factor, self.eps)
        return self.act(x)


class ConvBNAct(nn.Module):
    def __init__(self, shape_use: str = "ndim"):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, bias=False), BatchNormAct2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.shape_use = shape_use

    def forward(self, x):
        y = self.conv2(self.bn1(self.conv1(x)))
        if self.shape_use == "shape":
            torch._assert(y.shape[0] == x.shape[0], "batch")
        elif self.shape_use == "size":
            return self.bn2(y) * y.size(1)
        elif self.shape_use == "data":
            return self.bn2(y) + y  # a real use of the conv output: no fold
        return self.bn2(y)


@pytest.mark.parametrize("shape_use", ["ndim", "shape", "size", "data"])
def test_fold_conv_bn_keeps_shape_only_uses(shape_use: str) -> None:
    """timm's BatchNormAct2d asserts on x.ndim before its batch norm: a read of the conv
    output's metadata does not block the fold (the folded conv has the same metadata),
    a read of its data does."""
    model = randomize_bn(ConvBNAct(shape_use)).eval()
    x = torch.randn(2, 3, 10, 10)
    gm = _optimize(fx.symbolic_trace(model), (x,), FOLD)
    assert _bn_ops(gm) == (1 if shape_use == "data" else 0)
    gm.graph.lint()
    torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-4)
    if shape_use == "ndim":
        assert "_assert" in ops(gm)  # the check stays (on the folded conv's output)
        (check,) = [n for n in gm.graph.nodes if n.target is torch._assert]
        (ndim,) = check.args[0].all_input_nodes
        assert ndim.args[0].op == "call_function" and "conv" in str(ndim.args[0].target)
