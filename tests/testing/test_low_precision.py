"""The equivalence check in half precision: changes that rounding hides (relu against
leaky_relu(0.001), exact against tanh gelu, a LayerNorm epsilon) are caught in float16
and bfloat16, while identity-preserving passes over the zoo raise no false alarm."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.errors import EquivalenceError
from fxopt.optimize import DEFAULT_PIPELINE
from fxopt.testing import assert_equivalent, check_pass
from fxopt.testing.zoo import ZOO

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUSIONS = ["fold_conv_bn", "fuse_conv_bn_relu", "fuse_add_relu", "fuse_linear_relu"]


class Act(nn.Module):
    """One activation or norm, alone or between two linear layers."""

    def __init__(self, kind: str, deep: bool):
        super().__init__()
        self.kind, self.deep = kind, deep
        self.a, self.b, self.norm = nn.Linear(64, 64), nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, x):
        if self.deep:
            x = self.a(x)
        if self.kind == "relu":
            x = F.relu(x)
        elif self.kind == "gelu":
            x = F.gelu(x)
        else:
            x = F.layer_norm(x, (64,), self.norm.weight, self.norm.bias, 1e-5)
        return self.b(x) if self.deep else x


def _leaky(node):
    if node.target is F.relu:
        node.target, node.args = F.leaky_relu, (node.args[0], 0.001)


def _tanh_gelu(node):
    if node.target is F.gelu:
        node.kwargs = {"approximate": "tanh"}


def _ln_eps(node):
    if node.target is F.layer_norm:
        node.args = (*node.args[:4], 1e-3)


BAD = {"relu": _leaky, "gelu": _tanh_gelu, "layer_norm": _ln_eps}


def _rewritten(gm: fx.GraphModule, change) -> fx.GraphModule:
    out = fxopt.optimize(gm, [])  # a copy sharing the tensors, as a pass's result would be
    for node in out.graph.nodes:
        change(node)
    out.recompile()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deep", [False, True], ids=["alone", "between_linears"])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_changes_hidden_by_rounding_are_caught(kind, deep, dtype):
    torch.manual_seed(0)
    gm = fx.symbolic_trace(Act(kind, deep).to(dtype))
    bad = _rewritten(gm, BAD[kind])
    assert str(bad.code) != str(gm.code)
    x = (torch.randn(16, 64).to(dtype),)
    assert_equivalent(gm, _rewritten(gm, lambda n: None), x)  # the unchanged copy passes
    with pytest.raises(EquivalenceError):
        assert_equivalent(gm, bad, x)


def test_a_pass_creating_a_wrong_constant_is_caught_in_bfloat16():
    """A folded constant off by less than a bfloat16 rounding step: the float64 twin shows it."""
    def scale_linear(gm):
        for mod in gm.modules():
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(mod.weight.detach() * (1 + 1e-3))
                return gm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(torch.bfloat16)
    with pytest.raises(EquivalenceError, match="float64"):
        check_pass([scale_linear], model, (torch.randn(16, 64, dtype=torch.bfloat16),))


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(64, 64), nn.BatchNorm1d(64)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.bn.running_mean.uniform_(-0.2, 0.2)
        self.bn.weight.data.uniform_(0.5, 1.5)
        self.bn.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x):
        return self.bn(self.lin(x))


def _folded(m: LinearBN, dtype, weight_error: float) -> fx.GraphModule:
    """``m`` folded into one Linear (computed in float64, then rounded to ``dtype``), its
    weight scaled by ``1 + weight_error``."""
    s = m.bn.weight.double() / torch.sqrt(m.bn.running_var.double() + m.bn.eps)
    lin = nn.Linear(64, 64)
    lin.weight.data = (m.lin.weight.double() * s[:, None] * (1 + weight_error)).float()
    lin.bias.data = ((m.lin.bias.double() - m.bn.running_mean.double()) * s + m.bn.bias.double()).float()
    return fx.symbolic_trace(nn.Sequential(lin).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_per_element_bound_catches_a_folded_weight_four_ulps_off(dtype):
    """A rewrite holding new constants is judged by the per-element bound alone (no exact
    float64 run): a correct fold passes, a weight off by 4 machine epsilons of the dtype is
    caught. With LOW_PRECISION_ERROR_FACTOR at 32 or more this is missed (measured)."""
    torch.manual_seed(0)
    m = LinearBN().eval()
    gm = fx.symbolic_trace(m.to(dtype))
    x = (torch.randn(32, 64, dtype=dtype),)
    assert_equivalent(gm, _folded(m, dtype, 0.0), x)
    with pytest.raises(EquivalenceError, match="float64 result"):
        assert_equivalent(gm, _folded(m, dtype, 4 * torch.finfo(dtype).eps), x)


def test_explicit_tolerances_still_mean_what_they_say():
    gm = fx.symbolic_trace(Act("relu", True).to(torch.bfloat16))
    x = (torch.randn(16, 64, dtype=torch.bfloat16),)
    assert_equivalent(gm, _rewritten(gm, _leaky), x, rtol=5e-2, atol=5e-2)


def _sweep_cases(large: bool):
    for name, case in ZOO.items():
        if ("large" in case.tags) != large:
            continue
        for dtype in case.dtypes:
            for label, passes in [("default", list(DEFAULT_PIPELINE)), ("fusions", FUSIONS)]:
                if not large and label == "fusions" and dtype is not torch.bfloat16:
                    continue  # CI: the fusions once; the slow sweep runs every combination
                yield pytest.param(name, dtype, passes, id=f"{name}-{str(dtype)[6:]}-{label}")


def _check_zoo(name, dtype, passes):
    instance = ZOO[name].instantiate(dtype)
    check_pass(passes, instance)


@pytest.mark.parametrize(("name", "dtype", "passes"), list(_sweep_cases(large=False)))
def test_identity_preserving_passes_raise_no_false_alarm(name, dtype, passes):
    _check_zoo(name, dtype, passes)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype", "passes"), list(_sweep_cases(large=True)))
def test_identity_preserving_passes_raise_no_false_alarm_on_full_models(name, dtype, passes):
    _check_zoo(name, dtype, passes)
