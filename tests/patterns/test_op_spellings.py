"""Every activation and normalization module of ``torch.nn`` against its other spellings.

For each op: a pattern written as the module (parameter-free modules) and one written as
the functional form match, once, the module call, the functional call and the Tensor
method, captured at torch level (``symbolic_trace``) and ATen level (``make_fx``); a
module with a different attribute value does not match; the rewrite computes the same
numbers. In-place spellings (``inplace=True``) match only where the write is invisible.
The list is checked against ``torch.nn``'s own, so a module torch adds shows up here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

X = (2, 4, 3, 6)  # NCHW, last dimension 6 (the normalized shape)
BOTH, TORCH = ("symbolic_trace", "make_fx"), ("symbolic_trace",)


@dataclass
class Op:
    module: Callable[[], nn.Module]
    functional: Callable[..., torch.Tensor]
    method: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: the same module with another attribute value: must not match
    other: Callable[[], nn.Module] | None = None
    captures: tuple[str, ...] = BOTH
    #: parameters of the module, as extra pattern arguments in this order
    params: tuple[str, ...] = ()


ACTIVATIONS = {
    "ReLU": Op(nn.ReLU, F.relu, lambda t: t.relu()),
    "ReLU6": Op(nn.ReLU6, F.relu6, other=lambda: nn.Hardtanh(0.0, 5.0)),
    "Hardtanh": Op(lambda: nn.Hardtanh(-2.0, 3.0), lambda t: F.hardtanh(t, -2.0, 3.0),
                   other=lambda: nn.Hardtanh(-2.0, 4.0)),
    "LeakyReLU": Op(lambda: nn.LeakyReLU(0.2), lambda t: F.leaky_relu(t, 0.2),
                    other=lambda: nn.LeakyReLU(0.3)),
    "GELU": Op(lambda: nn.GELU(approximate="tanh"), lambda t: F.gelu(t, approximate="tanh"),
               other=nn.GELU),
    "SiLU": Op(nn.SiLU, F.silu),
    "Mish": Op(nn.Mish, F.mish),
    "Sigmoid": Op(nn.Sigmoid, lambda t: torch.sigmoid(t), lambda t: t.sigmoid()),
    "Tanh": Op(nn.Tanh, lambda t: torch.tanh(t), lambda t: t.tanh()),
    "Softmax": Op(lambda: nn.Softmax(dim=1), lambda t: F.softmax(t, dim=1), lambda t: t.softmax(1),
                  other=lambda: nn.Softmax(dim=2)),
    "LogSoftmax": Op(lambda: nn.LogSoftmax(dim=1), lambda t: F.log_softmax(t, 1),
                     lambda t: t.log_softmax(1), other=lambda: nn.LogSoftmax(dim=3)),
    "ELU": Op(lambda: nn.ELU(alpha=0.5), lambda t: F.elu(t, alpha=0.5), other=nn.ELU),
    "CELU": Op(lambda: nn.CELU(alpha=0.5), lambda t: F.celu(t, 0.5), other=nn.CELU),
    "SELU": Op(nn.SELU, F.selu, other=nn.ELU),
    "Hardswish": Op(nn.Hardswish, F.hardswish),
    "Hardsigmoid": Op(nn.Hardsigmoid, F.hardsigmoid),
    "Softplus": Op(lambda: nn.Softplus(beta=2.0), lambda t: F.softplus(t, beta=2.0), other=nn.Softplus),
    "Softshrink": Op(lambda: nn.Softshrink(0.3), lambda t: F.softshrink(t, 0.3), other=nn.Softshrink),
    "Hardshrink": Op(lambda: nn.Hardshrink(0.3), lambda t: F.hardshrink(t, 0.3),
                     lambda t: t.hardshrink(0.3), other=nn.Hardshrink),
    "LogSigmoid": Op(nn.LogSigmoid, F.logsigmoid),
    "Threshold": Op(lambda: nn.Threshold(0.1, 20.0), lambda t: F.threshold(t, 0.1, 20.0),
                    other=lambda: nn.Threshold(0.1, 10.0)),
    "GLU": Op(lambda: nn.GLU(dim=1), lambda t: F.glu(t, 1), other=lambda: nn.GLU(dim=3)),
    "PReLU": Op(nn.PReLU, F.prelu, params=("weight",), captures=TORCH),
    # decomposed by make_fx into several ATen ops: matched at torch level
    "Softsign": Op(nn.Softsign, F.softsign, captures=TORCH),
    "Tanhshrink": Op(nn.Tanhshrink, F.tanhshrink, captures=TORCH),
    "RReLU": Op(lambda: nn.RReLU(0.1, 0.3).eval(), lambda t: F.rrelu(t, 0.1, 0.3, training=False),
                other=lambda: nn.RReLU(0.1, 0.4).eval(), captures=TORCH),
}
NORMALIZATIONS = {
    "LayerNorm": Op(lambda: nn.LayerNorm(6, eps=1e-3), lambda t, w, b: F.layer_norm(t, (6,), w, b, 1e-3),
                    other=lambda: nn.LayerNorm(6, eps=1e-5), params=("weight", "bias")),
    "GroupNorm": Op(lambda: nn.GroupNorm(2, 4, eps=1e-3), lambda t, w, b: F.group_norm(t, 2, w, b, 1e-3),
                    other=lambda: nn.GroupNorm(4, 4, eps=1e-3), params=("weight", "bias")),
    "RMSNorm": Op(lambda: nn.RMSNorm(6, eps=1e-3), lambda t, w: F.rms_norm(t, (6,), w, 1e-3),
                  other=lambda: nn.RMSNorm(6, eps=1e-4), params=("weight",), captures=TORCH),
    "BatchNorm2d": Op(lambda: nn.BatchNorm2d(4).eval(),
                      lambda t, w, b, m, v: F.batch_norm(t, m, v, w, b, False, 0.1, 1e-5),
                      other=lambda: nn.BatchNorm2d(4, eps=1e-3).eval(),
                      params=("weight", "bias", "running_mean", "running_var")),
}
#: torch.nn modules of those two families that are not one op with a functional twin
NOT_ONE_OP = {
    "MultiheadAttention": "attention: several ops", "Softmax2d": "softmax over dim -3 only",
    "Softmin": "F.softmin traces as softmax(-x): write that", "LocalResponseNorm": "a composite",
    "CrossMapLRN2d": "a composite", "InstanceNorm1d": "F.instance_norm traces through",
    "InstanceNorm2d": "idem", "InstanceNorm3d": "idem", "BatchNorm1d": "as BatchNorm2d",
    "BatchNorm3d": "as BatchNorm2d", "SyncBatchNorm": "distributed", "LazyBatchNorm1d": "lazy",
    "LazyBatchNorm2d": "lazy", "LazyBatchNorm3d": "lazy", "LazyInstanceNorm1d": "lazy",
    "LazyInstanceNorm2d": "lazy", "LazyInstanceNorm3d": "lazy",
}
OPS = {**ACTIVATIONS, **NORMALIZATIONS}


class Apply(nn.Module):
    """``f(x * 2)``: the multiplication keeps in-place spellings off the graph input."""

    def __init__(self, f: Callable, fresh: bool = True):
        super().__init__()
        self.f, self.fresh = f, fresh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x * 2 if self.fresh else x)


def _randomized(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            tensor.data.copy_(torch.rand(tensor.shape, generator=g) + 0.5)
    return module


def _spellings(op: Op) -> dict[str, nn.Module]:
    module = _randomized(op.module())
    found = {"module": Apply(module)}
    if not op.params:
        found["functional"] = Apply(op.functional)
    if op.method is not None:
        found["method"] = Apply(op.method)
    return found


def _patterns(op: Op) -> dict[str, Callable]:
    found = {"functional pattern": _with_names(op.functional, 1 + len(op.params))}
    if not op.params:
        module = op.module()
        found["module pattern"] = lambda t: module(t)
    return found


def _graph(model: nn.Module, how: str) -> fx.GraphModule:
    return fx.symbolic_trace(model) if how == "symbolic_trace" else make_fx(model)(torch.randn(X))


def test_the_lists_cover_torch_nn() -> None:
    activations = set(nn.modules.activation.__all__)
    norms = {name for name in dir(nn) if name.endswith("Norm") or "Norm" in name and name[-2:] in ("1d", "2d", "3d")
             or name in ("LocalResponseNorm", "CrossMapLRN2d")}
    assert activations | norms <= set(OPS) | set(NOT_ONE_OP), sorted((activations | norms) - set(OPS) - set(NOT_ONE_OP))


@pytest.mark.parametrize("name", list(OPS))
def test_each_spelling_matches_each_other(name: str) -> None:
    op = OPS[name]
    for how in op.captures:
        for spelling, model in _spellings(op).items():
            for pattern_name, pattern in _patterns(op).items():
                gm = _graph(model, how)
                assert len(fp.find_matches(gm, pattern)) == 1, (how, spelling, pattern_name, fp.explain(gm, pattern))
                x = torch.randn(X)
                expected = model(x)
                assert fp.replace(gm, pattern, _tripled(pattern, 1 + len(op.params))) == 1, (how, spelling)
                torch.testing.assert_close(gm(x), expected * 3.0)


def _tripled(pattern: Callable, arity: int) -> Callable:
    """``pattern(...) * 3``, taking the pattern's arguments (see :func:`_with_names`)."""
    return _with_names(lambda *args: pattern(*args) * 3.0, arity)


def _with_names(fn: Callable, arity: int) -> Callable:
    """``fn`` as a function of ``t, a, b, c, d`` (patterns and replacements are traced and
    their arguments matched by name: no ``*args``, no builtins)."""
    by_arity = {1: lambda t: fn(t), 2: lambda t, a: fn(t, a), 3: lambda t, a, b: fn(t, a, b),
                5: lambda t, a, b, c, d: fn(t, a, b, c, d)}
    return by_arity[arity]


@pytest.mark.parametrize("name", [n for n, op in OPS.items() if op.other is not None])
def test_another_attribute_value_does_not_match(name: str) -> None:
    op = OPS[name]
    for how in op.captures:
        gm = _graph(Apply(_randomized(op.other())), how)
        for pattern_name, pattern in _patterns(op).items():
            assert fp.find_matches(gm, pattern) == [], (how, pattern_name)


INPLACE = [name for name, op in ACTIVATIONS.items() if hasattr(op.module(), "inplace")]


@pytest.mark.parametrize("name", INPLACE)
def test_inplace_spellings_match_only_where_the_write_is_invisible(name: str) -> None:
    op = ACTIVATIONS[name]
    module = op.module()
    module.inplace = True
    pattern = _with_names(op.functional, 1)
    for how in op.captures:
        fresh = _graph(Apply(module), how)
        assert len(fp.find_matches(fresh, pattern)) == 1, (how, fp.explain(fresh, pattern))
    # written into the caller's tensor: the out-of-place pattern would drop that write
    visible = fx.symbolic_trace(Apply(module, fresh=False))
    assert fp.find_matches(visible, pattern) == []
    assert fp.replace(visible, pattern, _tripled(pattern, 1)) == 0
    x = torch.randn(X)
    expected = op.functional(x.clone())
    visible(x)
    torch.testing.assert_close(x, expected)  # the caller still sees the write


# --- pointwise ops: generated from ATen's pointwise tag ---------------------------------

def _pointwise_unary() -> list[str]:
    """Every ATen pointwise op of one tensor and nothing else that torch also spells as a
    function, a method and an in-place method (abs, exp, sigmoid, sqrt, ...)."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket) or "default" not in packet.overloads():
            continue
        op = packet.default
        if torch.Tag.pointwise in op.tags and len(op._schema.arguments) == 1 and all(
                hasattr(owner, spelled) for owner, spelled in
                ((torch, name), (torch.Tensor, name), (torch.Tensor, name + "_"))):
            found.append(name)
    # not float ops; conj_physical of a real tensor is recorded as nothing at all
    return [n for n in found if n not in ("bitwise_not", "logical_not", "conj_physical")]


UNARY = _pointwise_unary()
BINARY = {  # name: the operator spelling, if any
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow": lambda a, b: a ** b, "maximum": None, "minimum": None,
    "atan2": None, "fmod": None, "remainder": lambda a, b: a % b, "hypot": None,
}


def test_the_unary_list_is_generated_and_large() -> None:
    assert len(UNARY) >= 30 and {"exp", "sqrt", "sigmoid", "abs"} <= set(UNARY)


@pytest.mark.parametrize("name", UNARY)
def test_unary_pointwise_spellings(name: str) -> None:
    fn = getattr(torch, name)
    spellings = {"function": lambda t: fn(t), "method": lambda t: getattr(t, name)(),
                 "in-place method on a fresh tensor": lambda t: getattr(t * 1.5, name + "_")()}
    pattern = _with_names(lambda t: getattr(torch.ops.aten, name).default(t), 1)
    x = torch.rand(X) + 0.25  # in every op's domain
    for spelling, f in spellings.items():
        for how in ("symbolic_trace", "make_fx"):
            gm = _graph(Apply(f), how)
            expected = gm(x)
            assert fp.replace(gm, pattern, _tripled(pattern, 1)) == 1, (spelling, how, fp.explain(gm, pattern))
            torch.testing.assert_close(gm(x), expected * 3.0, equal_nan=True)
    # written into the graph input: the out-of-place pattern must not take it
    visible = fx.symbolic_trace(Apply(lambda t: getattr(t, name + "_")(), fresh=False))
    assert fp.find_matches(visible, pattern) == []


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_pointwise_spellings(name: str) -> None:
    fn = getattr(torch, name)
    spellings = {"function": lambda a, b: fn(a, b), "method": lambda a, b: getattr(a, name)(b)}
    if hasattr(torch.Tensor, name + "_"):
        spellings["in-place method on a fresh tensor"] = lambda a, b: getattr(a.clone(), name + "_")(b)
    if BINARY[name] is not None:
        spellings["operator"] = BINARY[name]

    def pattern(t, a):
        return fn(t, a)

    class Two(nn.Module):
        def __init__(self, f: Callable):
            super().__init__()
            self.f = f

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.f(a.clone(), b)

    a, b = torch.rand(X) + 0.25, torch.rand(X) + 0.25
    for spelling, f in spellings.items():
        for how in ("symbolic_trace", "make_fx"):
            model = Two(f)
            gm = fx.symbolic_trace(model) if how == "symbolic_trace" else make_fx(model)(a, b)
            expected = gm(a, b)
            assert fp.replace(gm, pattern, _tripled(pattern, 2)) == 1, (spelling, how, fp.explain(gm, pattern))
            torch.testing.assert_close(gm(a, b), expected * 3.0)


@pytest.mark.parametrize(("target", "args", "kwargs", "writes"), [
    (F.relu, ("x",), {}, False),
    (F.relu, ("x", True), {}, True),  # the flag by position
    (F.relu, ("x", False), {}, False),
    (F.relu, ("x",), {"inplace": True}, True),
    (F.relu, ("x",), {"inplace": False}, False),
    (F.leaky_relu, ("x", 0.1, True), {}, True),
    (torch.relu_, ("x",), {}, True),  # the name
    (torch.relu, ("x",), {}, False),
])
def test_a_layout_that_cannot_write_never_does(target, args, kwargs, writes) -> None:
    """The call plans ask ``spelled_inplace`` only for layouts ``may_spell_inplace``
    allows: a layout it rules out must never write, whatever the values."""
    from fxopt.analysis.ops import may_spell_inplace, op_name, spelled_inplace

    name = op_name(target)
    assert spelled_inplace(target, name, args, kwargs) is writes
    if writes:
        assert may_spell_inplace(target, name, len(args), tuple(kwargs))
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, tuple(x if a == "x" else a for a in args), kwargs)
    assert fp.canon.canonicalize(node).inplace is writes


@pytest.mark.parametrize(("target", "args", "kwargs"), [
    (operator.add, ("x", "y"), {}),
    (torch.add, ("x", "y"), {}),
    (torch.add, ("x", "y"), {"alpha": 2}),
    (torch.relu, ("x",), {}),
    (F.leaky_relu, ("x", 0.2), {}),
    (torch.softmax, ("x", -1), {}),
])
def test_call_plans_bind_like_the_schema(target, args, kwargs) -> None:
    """A call plan (positional arguments then defaults, or a fill per argument) lists the
    same canonical arguments as binding the call to the op's schema directly."""
    from fxopt.patterns.canon import _arguments

    from fxopt.analysis.ops import op_name

    graph = fx.Graph()
    values = {"x": graph.placeholder("x"), "y": graph.placeholder("y")}
    call_args = tuple(values.get(a, a) if isinstance(a, str) else a for a in args)
    node = graph.call_function(target, call_args, kwargs)
    expected = tuple(_arguments(target, op_name(target), call_args, dict(kwargs), False))
    assert fp.canon.canonicalize(node).args == expected


class _Mine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _module_calls() -> dict[str, nn.Module]:
    """Every module of the lists above (and the other attribute values), torch.nn's other
    families, and modules left opaque (a padding mode, a module of the user's)."""
    found = {name: op.module() for name, op in OPS.items()}
    found.update({f"other {name}": op.other() for name, op in OPS.items() if op.other is not None})
    for name in NOT_ONE_OP:
        try:
            found[name] = getattr(nn, name)(*((4,) if "Norm" in name else ()))
        except Exception:
            continue  # needs arguments of its own (MultiheadAttention, ...)
    found.update({
        "Conv2d": nn.Conv2d(4, 4, 3), "ConvTranspose1d": nn.ConvTranspose1d(4, 4, 3),
        "Conv2d reflect": nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
        "Conv2d same": nn.Conv2d(4, 4, 3, padding="same"), "BatchNorm1d train": nn.BatchNorm1d(4),
        "Linear": nn.Linear(6, 6), "Dropout": nn.Dropout(), "Identity": nn.Identity(),
        "Flatten": nn.Flatten(), "Embedding": nn.Embedding(4, 6), "mine": _Mine(),
    })
    return found


@pytest.mark.parametrize("name", list(_module_calls()))
def test_module_ops_cover_every_form(name: str) -> None:
    """The anchor index skips a module call whose type cannot be a rule's anchor op
    (``module_ops``) without canonicalizing it: the op of its form must be among them,
    called with one argument or with a keyword (which leaves it opaque)."""
    from fxopt.patterns.canon import canonicalize, module_ops

    module = _module_calls()[name]
    root = nn.Module()
    root.m = module
    graph = fx.Graph()
    x = graph.placeholder("x")
    calls = [graph.call_module("m", (x,)), graph.call_module("m", (x,), {"extra": 1})]
    graph.output(calls[0])
    fx.GraphModule(root, graph)  # owns the graph: the calls find "m" through it
    ops = module_ops(type(module))
    for call in calls:
        form = canonicalize(call)
        assert ops is None or form.op in ops, (name, form.op, ops)
