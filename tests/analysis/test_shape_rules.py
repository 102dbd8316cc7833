"""fxopt's shape rules (fxopt/analysis/shape_rules.py) against torch's FakeTensor propagation.

The rules are a second source of truth for what torch computes, so each one is checked on
random calls: every spelling (function, method, module, in-place), random shapes, dtypes,
broadcasting, layouts (contiguous, channels-last, permuted, sliced, expanded) and
arguments (stride, padding, dilation, groups, ceil_mode, dims...). Where the rules give a
value it must equal the FakeTensor run's in shape, strides, dtype, storage offset,
``requires_grad``, ``tensor_meta``, and in which values share a storage or are the very same
tensor. Where FakeTensor propagation fails (torch rejects the call) the rules must decline
too. Declining (no rule) is allowed elsewhere, but each family must take the cheap path on
the common calls, counted per family, so a rule that declines everything fails here.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import fxopt.compile.fused_ops  # noqa: F401 - torch.ops.fxopt.*
from fxopt.analysis.shape_rules import contiguous_strides
from fxopt.analysis.shapes import propagate_meta_values, propagate_shapes

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# --- building one-op graphs ------------------------------------------------------------

class Case:
    """A graph of one call (plus its inputs' placeholders) and the example inputs."""

    def __init__(self, op: str, target: Any, args: tuple, kwargs: dict | None = None,
                 module: nn.Module | None = None):
        root = nn.Module()
        graph = fx.Graph()
        self.inputs: list[Any] = []

        def place(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                self.inputs.append(value)
                return graph.placeholder(f"x{len(self.inputs)}")
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(place(v) for v in value)
            return value

        args, kwargs = place(args), {k: place(v) for k, v in (kwargs or {}).items()}
        if module is not None:
            root.add_module("m", module)
            target = "m"
        out = graph.create_node(op, target, args, kwargs)
        graph.output(out)
        self.gm = fx.GraphModule(root, graph)
        self.text = f"{op} {getattr(target, '__name__', target)} {self.describe(args)} {kwargs}"

    def to(self, device: torch.device) -> Case:
        """The same call on ``device`` (inputs and module); layouts ``Tensor.to`` keeps."""
        self.inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in self.inputs]
        self.gm.to(device)
        return self

    def describe(self, args: Any) -> str:
        return ", ".join(f"{tuple(t.shape)}@{t.stride()}:{t.dtype}" for t in self.inputs)


def layout(shape: tuple[int, ...], dtype: torch.dtype, rng: random.Random, kind: str | None = None) -> torch.Tensor:
    """A random tensor of ``shape`` in one of the layouts the rules must get right."""
    kinds = ["contiguous", "permuted", "sliced", "expanded"] + (["channels_last"] * 2 if len(shape) == 4 else [])
    kind = kind or rng.choice(kinds)
    make = (lambda s: torch.randn(s).to(dtype)) if dtype.is_floating_point else \
        (lambda s: torch.randint(0, 5, s).to(dtype))
    if kind == "channels_last" and len(shape) == 4:
        return make(shape).contiguous(memory_format=torch.channels_last)
    if kind == "permuted" and len(shape) >= 2:
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        inverse = [perm.index(i) for i in range(len(shape))]
        return make(tuple(shape[p] for p in perm)).permute(inverse)
    if kind == "sliced" and len(shape) >= 1:
        return make((*shape[:-1], shape[-1] * 2))[..., ::2]
    if kind == "expanded" and len(shape) >= 2 and shape[0] > 1:
        return make((1, *shape[1:])).expand(shape)
    return make(shape)


class Gen:
    """A family's source of randomness: ``rng``, and tensors in random layouts, or all
    contiguous (``kind``)."""

    def __init__(self, seed: str, kind: str | None = None):
        self.rng, self.kind = random.Random(seed), kind

    def t(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return layout(shape, dtype, self.rng, self.kind)


def values_of(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.nodes]


def copy_graph(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def run_case(case: Case) -> bool:
    """Compare the rules with FakeTensor propagation; True if the rules gave values."""
    fake_gm = case.gm
    cheap_gm = fx.GraphModule(case.gm, copy_graph(case.gm.graph))  # the same modules, its own nodes
    try:
        propagate_shapes(fake_gm, SimpleNamespace(example_inputs=tuple(case.inputs), meta_values=False,
                                                  fake_state=None))
        torch_error = None
    except Exception as exc:  # torch rejects this call
        torch_error = exc
    took = propagate_meta_values(cheap_gm, tuple(case.inputs))
    if torch_error is not None:
        assert not took, f"the rules accept what torch rejects ({torch_error}): {case.text}"
        return False
    if not took:
        assert all("val" not in n.meta for n in cheap_gm.graph.nodes), "a declined graph was changed"
        return False
    fake, cheap = values_of(fake_gm), values_of(cheap_gm)
    for f, c, node in zip(fake, cheap, cheap_gm.graph.nodes):
        assert_same_value(f, c, f"{node.name} of {case.text}")
        fake_meta, cheap_meta = fake_gm.graph.find_nodes(op=node.op, target=node.target)[0].meta, node.meta
        assert fake_meta.get("tensor_meta") == cheap_meta.get("tensor_meta"), f"tensor_meta of {node.name}: {case.text}"
    assert_same_sharing(fake, cheap, case.text)
    return True


def assert_same_value(fake: Any, cheap: Any, where: str) -> None:
    if isinstance(fake, torch.Tensor):
        assert type(cheap) is torch.Tensor and cheap.is_meta, where
        got = (tuple(cheap.shape), cheap.stride(), cheap.dtype, cheap.storage_offset(), cheap.requires_grad)
        want = (tuple(fake.shape), fake.stride(), fake.dtype, fake.storage_offset(), fake.requires_grad)
        assert got == want, f"{where}: rules {got}, torch {want}"
    elif isinstance(fake, (tuple, list)):
        assert type(cheap) is type(fake) and len(cheap) == len(fake), where
        for f, c in zip(fake, cheap):
            assert_same_value(f, c, where)
    else:
        assert cheap == fake and type(cheap) is type(fake), f"{where}: rules {cheap!r}, torch {fake!r}"


def assert_same_sharing(fake: list[Any], cheap: list[Any], where: str) -> None:
    """Which node values share a storage, and which are the very same tensor."""
    def leaves(values: list[Any]) -> list[Any]:
        return [v for v in values if isinstance(v, torch.Tensor)]

    f, c = leaves(fake), leaves(cheap)
    assert len(f) == len(c), where
    for i in range(len(f)):
        for j in range(i):
            same_storage = (StorageWeakRef(f[i].untyped_storage()) == StorageWeakRef(f[j].untyped_storage()),
                            StorageWeakRef(c[i].untyped_storage()) == StorageWeakRef(c[j].untyped_storage()))
            assert same_storage[0] == same_storage[1], f"storage sharing of values {j} and {i}: {where}"
            assert (f[i] is f[j]) == (c[i] is c[j]), f"identity of values {j} and {i}: {where}"


# --- the families of calls --------------------------------------------------------------

def shape(rng: random.Random, ndim: int | None = None, low: int = 1, high: int = 5) -> tuple[int, ...]:
    return tuple(rng.randint(low, high) for _ in range(ndim if ndim is not None else rng.randint(1, 4)))


ACTIVATIONS = [  # (function spellings, method, module, extra positional scalars)
    ((torch.relu, F.relu), "relu", nn.ReLU, ()),
    ((F.relu6,), None, nn.ReLU6, ()),
    ((F.hardtanh,), None, nn.Hardtanh, (-0.5, 0.5)),
    ((torch.sigmoid, F.sigmoid), "sigmoid", nn.Sigmoid, ()),
    ((torch.tanh, F.tanh), "tanh", nn.Tanh, ()),
    ((F.silu,), None, nn.SiLU, ()),
    ((F.hardswish,), None, nn.Hardswish, ()),
    ((F.hardsigmoid,), None, nn.Hardsigmoid, ()),
    ((F.leaky_relu,), None, nn.LeakyReLU, (0.2,)),
    ((F.elu,), None, nn.ELU, (0.5,)),
    ((F.gelu,), None, nn.GELU, ()),
]
INPLACE = [(torch.relu_, "relu_"), (F.relu_, None), (torch.sigmoid_, "sigmoid_"), (torch.tanh_, "tanh_"),
           (F.hardtanh_, None), (F.leaky_relu_, None), (F.elu_, None)]


def activation_case(g: Gen) -> Case:
    rng = g.rng
    functions, method, module, scalars = rng.choice(ACTIVATIONS)
    dtype = rng.choice((*FLOATS, torch.int32) if rng.random() < 0.2 else FLOATS)
    x = g.t(shape(rng), dtype)
    form = rng.choice(["function", "method", "module", "inplace", "flag"])
    if form == "method" and method:
        return Case("call_method", method, (x,))
    if form == "module" and module:
        return Case("call_module", None, (x,), module=module(inplace=True) if rng.random() < 0.3 and
                    "inplace" in module.__init__.__code__.co_varnames else module())
    if form == "inplace":
        fn, name = rng.choice(INPLACE)
        return Case("call_method", name, (x,)) if name and rng.random() < 0.5 else Case("call_function", fn, (x,))
    fn = rng.choice(functions)
    if form == "flag" and fn.__module__ == "torch.nn.functional" and "inplace" in fn.__code__.co_varnames:
        return Case("call_function", fn, (x, *scalars), {"inplace": True})
    return Case("call_function", fn, (x, *scalars))


BINARY = [(operator.add, "add", torch.add), (operator.sub, "sub", torch.sub), (operator.mul, "mul", torch.mul),
          (operator.truediv, "div", torch.div)]
INPLACE_BINARY = [(operator.iadd, "add_"), (operator.isub, "sub_"), (operator.imul, "mul_"), (operator.itruediv, "div_")]


def broadcast_pair(g: Gen) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rng = g.rng
    out = shape(rng, rng.randint(1, 4))
    other = list(out)
    for i in range(len(other)):
        if rng.random() < 0.4:
            other[i] = 1
    other = other[rng.randint(0, len(other)):] if rng.random() < 0.3 else other
    if rng.random() < 0.1:  # shapes that do not broadcast
        other = [o + 1 for o in other] or [2]
    return (out, tuple(other)) if rng.random() < 0.5 else (tuple(other), out)


def binary_case(g: Gen) -> Case:
    rng = g.rng
    fn, method, torch_fn = rng.choice(BINARY)
    a_shape, b_shape = broadcast_pair(g)
    dtypes = (*FLOATS, torch.int64, torch.int32, torch.bool, torch.uint8)
    a = g.t(a_shape, rng.choice(dtypes))
    b: Any = g.t(b_shape, rng.choice(dtypes)) if rng.random() < 0.7 else \
        rng.choice([2, 0.5, True, torch.tensor(3.0), torch.tensor(2)])
    if rng.random() < 0.2:
        a, b = b, a
    form = rng.choice(["operator", "method", "torch", "alpha", "inplace"])
    if form == "inplace" and isinstance(a, torch.Tensor):
        op, name = rng.choice(INPLACE_BINARY)
        return Case("call_method", name, (a, b)) if rng.random() < 0.5 else Case("call_function", op, (a, b))
    if form == "method" and isinstance(a, torch.Tensor):
        return Case("call_method", method, (a, b))
    if form == "alpha" and method in ("add", "sub"):
        return Case("call_function", torch_fn, (a, b), {"alpha": rng.choice([2, 0.5])})
    return Case("call_function", fn if form == "operator" else torch_fn, (a, b))


def conv_case(g: Gen) -> Case:
    rng = g.rng
    spatial = rng.choice([2, 2, 2, 1, 3])
    transposed = rng.random() < 0.2
    groups = rng.choice([1, 1, 2, 3])
    cin = groups * rng.randint(1, 3)
    cout = groups * rng.randint(1, 3)
    kernel = tuple(rng.randint(1, 3) for _ in range(spatial))
    stride = tuple(rng.randint(1, 2) for _ in range(spatial))
    dilation = tuple(rng.randint(1, 2) for _ in range(spatial))
    padding: Any = tuple(rng.randint(0, 2) for _ in range(spatial))
    dtype = rng.choice((torch.float32, torch.float32, torch.float64, torch.bfloat16))
    x = g.t((rng.randint(1, 3), cin if rng.random() < 0.95 else cin + 1, *shape(rng, spatial, 1, 7)), dtype)
    if transposed:
        output_padding = tuple(rng.randint(0, s - 1) for s in stride)
        module = getattr(nn, f"ConvTranspose{spatial}d")(cin, cout, kernel, stride, padding, output_padding,
                                                         groups, rng.random() < 0.5, dilation).to(dtype)
    else:
        if rng.random() < 0.2:
            padding = rng.choice(["same", "valid"])
            stride = (1,) * spatial if padding == "same" else stride
        module = getattr(nn, f"Conv{spatial}d")(cin, cout, kernel, stride, padding, dilation, groups,
                                                rng.random() < 0.5).to(dtype)
    if rng.random() < 0.2 and spatial == 2:
        module = module.to(memory_format=torch.channels_last)
    form = rng.choice(["module", "function", "aten"])
    if form == "module":
        return Case("call_module", None, (x,), module=module)
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if form == "aten" or transposed:
        pad = list(padding) if isinstance(padding, tuple) else [0] * spatial
        if isinstance(padding, str) and padding == "same":
            return Case("call_function", torch.ops.aten.convolution.default,
                        (x, weight, bias, list(stride), [d * (k - 1) // 2 for d, k in zip(dilation, kernel)],
                         list(dilation), False, [0] * spatial, groups))
        out_pad = list(getattr(module, "output_padding", (0,) * spatial))
        return Case("call_function", torch.ops.aten.convolution.default,
                    (x, weight, bias, list(stride), pad, list(dilation), transposed, out_pad, groups))
    return Case("call_function", getattr(F, f"conv{spatial}d"), (x, weight, bias, stride, padding, dilation, groups))


def fused_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64))
    kind = rng.choice(["add_relu", "conv_bias_relu", "conv_bias_add_relu", "linear_relu"])
    if kind == "add_relu":
        a_shape, b_shape = broadcast_pair(g)
        return Case("call_function", torch.ops.fxopt.add_relu.default,
                    (g.t(a_shape, dtype), g.t(b_shape, dtype)))
    if kind == "linear_relu":
        x = g.t(shape(rng, rng.randint(1, 3)), dtype)
        w = torch.randn(rng.randint(1, 4), x.shape[-1], dtype=dtype)
        return Case("call_function", torch.ops.fxopt.linear_relu.default, (x, w, torch.randn(w.shape[0], dtype=dtype)))
    x = g.t((2, 4, rng.randint(3, 6), rng.randint(3, 6)), dtype)
    w = torch.randn(6, 4, 3, 3, dtype=dtype)
    stride, padding = [rng.randint(1, 2)] * 2, [rng.randint(0, 1)] * 2
    if kind == "conv_bias_relu":
        return Case("call_function", torch.ops.fxopt.conv_bias_relu.default,
                    (x, w, torch.randn(6, dtype=dtype), stride, padding, [1, 1], 1))
    out = [(n + 2 * padding[0] - 3) // stride[0] + 1 for n in x.shape[2:]]
    z = g.t((2, 6, *out), dtype)
    return Case("call_function", torch.ops.fxopt.conv_bias_add_relu.default,
                (x, w, torch.randn(6, dtype=dtype), z, 1.0, stride, padding, [1, 1], 1))


def norm_case(g: Gen) -> Case:
    rng = g.rng
    kind = rng.choice([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
    c = rng.randint(1, 4)
    ndim = {nn.BatchNorm1d: rng.choice([2, 3]), nn.BatchNorm2d: 4, nn.BatchNorm3d: 5}[kind]
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16))
    x = g.t((rng.randint(1, 3), c, *shape(rng, ndim - 2)), dtype)
    module = kind(c, affine=rng.random() < 0.8).eval()
    if rng.random() < 0.5:
        return Case("call_module", None, (x,), module=module)
    return Case("call_function", F.batch_norm, (x, module.running_mean, module.running_var, module.weight,
                                                module.bias, False, 0.1, 1e-5))


def pool_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64))
    x = g.t((rng.randint(1, 2), rng.randint(1, 3), rng.randint(2, 9), rng.randint(2, 9)), dtype)
    kind = rng.choice(["max", "avg", "adaptive"])
    if kind == "adaptive":
        size = rng.choice([1, 2, (3, None), (2, 1), 5])
        return Case("call_module", None, (x,), module=nn.AdaptiveAvgPool2d(size)) if rng.random() < 0.5 else \
            Case("call_function", F.adaptive_avg_pool2d, (x, size))
    k = rng.randint(1, 3)
    stride, padding, ceil = rng.choice([None, 1, 2, 3]), rng.randint(0, k // 2 + (rng.random() < 0.1)), rng.random() < 0.5
    if kind == "max":
        dilation = rng.randint(1, 2)
        module = nn.MaxPool2d(k, stride, padding, dilation, ceil_mode=ceil)
        args = (x, k, stride, padding, dilation, ceil)
        fn = F.max_pool2d
    else:
        module = nn.AvgPool2d(k, stride, padding, ceil_mode=ceil)
        args, fn = (x, k, stride, padding, ceil), F.avg_pool2d
    return Case("call_module", None, (x,), module=module) if rng.random() < 0.5 else Case("call_function", fn, args)


def linear_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64))
    x = g.t(shape(rng, rng.randint(1, 3)), dtype)
    features = x.shape[-1] if rng.random() < 0.95 else x.shape[-1] + 1
    module = nn.Linear(features, rng.randint(1, 4), bias=rng.random() < 0.7).to(dtype)
    form = rng.choice(["module", "function", "mm"])
    if form == "module":
        return Case("call_module", None, (x,), module=module)
    if form == "mm":
        return Case("call_function", torch.mm, (x, g.t((x.shape[-1], 3), dtype)))
    return Case("call_function", F.linear, (x, module.weight.detach(), None if module.bias is None else module.bias.detach()))


def reduction_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((*FLOATS, torch.int32, torch.bool))
    x = g.t(shape(rng), dtype)
    name = rng.choice(["mean", "sum"])
    ndim = x.dim()
    dim: Any = rng.choice([rng.randrange(-ndim, ndim), tuple(rng.sample(range(ndim), rng.randint(1, ndim))), None])
    kwargs: dict[str, Any] = {"keepdim": rng.random() < 0.5} if dim is not None else {}
    if rng.random() < 0.2:
        kwargs["dtype"] = rng.choice((torch.float64, torch.float32))
    args = (x,) if dim is None else (x, dim)
    return Case("call_method", name, args, kwargs) if rng.random() < 0.5 else \
        Case("call_function", getattr(torch, name), args, kwargs)


def shape_ops_case(g: Gen) -> Case:
    rng = g.rng
    x = g.t(shape(rng, rng.randint(1, 4)), rng.choice((torch.float32, torch.float16)))
    kind = rng.choice(["view", "reshape", "flatten", "flatten_module", "cat", "cast", "to", "contiguous",
                       "dropout", "identity", "size", "shape"])
    if kind in ("view", "reshape"):
        sizes = [x.numel()] if rng.random() < 0.3 else [x.shape[0], -1]
        if rng.random() < 0.5:
            return Case("call_method", kind, (x, *sizes))
        return Case("call_function", torch.reshape, (x, sizes)) if kind == "reshape" else Case("call_method", kind, (x, sizes))
    if kind in ("flatten", "flatten_module"):
        start = rng.randrange(x.dim())
        end = rng.randrange(start, x.dim())
        if kind == "flatten_module":
            return Case("call_module", None, (x,), module=nn.Flatten(start, end))
        return Case("call_function", torch.flatten, (x, start, end)) if rng.random() < 0.5 else \
            Case("call_method", "flatten", (x, start))
    if kind == "cat":
        d = rng.randrange(x.dim())
        parts = [x] + [g.t(tuple(rng.randint(1, 3) if i == d else n for i, n in enumerate(x.shape)), x.dtype)
                       for _ in range(rng.randint(0, 2))]
        return Case("call_function", torch.cat, (parts,), {"dim": d})
    if kind == "cast":
        return Case("call_method", rng.choice(["float", "half", "double", "bfloat16"]), (x,))
    if kind == "to":
        return Case("call_method", "to", (x, rng.choice((torch.float32, torch.float16, torch.int64))))
    if kind == "contiguous":
        return Case("call_method", "contiguous", (x,))
    if kind == "dropout":
        return Case("call_module", None, (x,), module=nn.Dropout(0.3).eval()) if rng.random() < 0.5 else \
            Case("call_function", F.dropout, (x, 0.3, False))
    if kind == "identity":
        return Case("call_module", None, (x,), module=nn.Identity())
    if kind == "size":
        return Case("call_method", "size", (x, rng.randrange(x.dim()))) if rng.random() < 0.5 else \
            Case("call_method", "size", (x,))
    return Case("call_function", getattr, (x, "shape"))


def matmul_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16))
    n, k, m = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 5)
    batch = shape(rng, rng.randint(0, 2))
    kind = rng.choice(["matmul", "matmul", "bmm", "aten_bmm", "aten_mm", "aten_matmul"])
    if kind in ("bmm", "aten_bmm"):
        b = rng.randint(1, 3)
        a, c = g.t((b, n, k), dtype), g.t((b, k if rng.random() < 0.95 else k + 1, m), dtype)
        if kind == "aten_bmm":
            return Case("call_function", torch.ops.aten.bmm.default, (a, c))
        return Case("call_method", "bmm", (a, c)) if rng.random() < 0.5 else Case("call_function", torch.bmm, (a, c))
    if kind == "aten_mm":
        return Case("call_function", torch.ops.aten.mm.default, (g.t((n, k), dtype), g.t((k, m), dtype)))
    a_shape = (*batch, n, k)
    b_batch = rng.choice([batch, batch[1:], (), tuple(1 for _ in batch)])
    b_shape = (*b_batch, k if rng.random() < 0.95 else k + 1, m)
    if rng.random() < 0.1 and g.kind is None:  # a matrix times a batch: torch transposes, the rules decline
        a_shape, b_shape = (n, k), (*batch, k, m)
    a, c = g.t(a_shape, dtype), g.t(b_shape, dtype)
    if kind == "aten_matmul":
        return Case("call_function", torch.ops.aten.matmul.default, (a, c))
    form = rng.choice(["torch", "operator", "method"])
    if form == "method":
        return Case("call_method", "matmul", (a, c))
    return Case("call_function", torch.matmul if form == "torch" else operator.matmul, (a, c))


def transformer_norm_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16, torch.float16))
    x = g.t(shape(rng, rng.randint(1, 4), 1, 6), dtype)
    trailing = x.shape[-rng.randint(1, x.dim()):]
    if rng.random() < 0.05:
        trailing = (*trailing[:-1], trailing[-1] + 1)
    kind = rng.choice(["layer_norm", "rms_norm"])
    affine = rng.random() < 0.7
    if kind == "layer_norm":
        module = nn.LayerNorm(trailing, elementwise_affine=affine, bias=rng.random() < 0.7).to(dtype)
        weight, bias = module.weight, module.bias
    else:
        module = nn.RMSNorm(trailing, elementwise_affine=affine).to(dtype)
        weight, bias = module.weight, None
    weight = None if weight is None else weight.detach()
    bias = None if bias is None else bias.detach()
    form = rng.choice(["module", "function", "aten"])
    if form == "module":
        return Case("call_module", None, (x,), module=module)
    if kind == "layer_norm":
        if form == "aten":
            return Case("call_function", torch.ops.aten.layer_norm.default, (x, list(trailing), weight, bias, 1e-5, False))
        return Case("call_function", F.layer_norm, (x, trailing, weight, bias))
    if form == "aten":
        return Case("call_function", torch.ops.aten.rms_norm.default, (x, list(trailing), weight, 1e-6))
    return Case("call_function", F.rms_norm, (x, trailing, weight))


def softmax_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16, torch.float16))
    x = g.t(shape(rng, rng.randint(1, 4)), dtype)
    dim = rng.randrange(-x.dim(), x.dim())
    log = rng.random() < 0.3
    name = "log_softmax" if log else "softmax"
    form = rng.choice(["function", "torch", "method", "module", "aten", "aten_private"])
    if form == "module":
        return Case("call_module", None, (x,), module=(nn.LogSoftmax if log else nn.Softmax)(dim))
    if form == "method":
        return Case("call_method", name, (x, dim))
    if form == "torch":
        return Case("call_function", getattr(torch, name), (x, dim))
    if form == "aten":
        return Case("call_function", getattr(torch.ops.aten, name).int, (x, dim))
    if form == "aten_private":
        return Case("call_function", getattr(torch.ops.aten, "_" + name).default, (x, dim, False))
    kwargs = {"dtype": torch.float64} if rng.random() < 0.2 else {}
    return Case("call_function", getattr(F, name), (x, dim), kwargs)


def attention_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16, torch.float16))
    batch = shape(rng, rng.choice([1, 2, 2]), 1, 3)
    length, source, e = rng.randint(1, 6), rng.randint(1, 6), rng.choice([2, 4, 8])
    ev = e if rng.random() < 0.8 else e * 2
    pick = rng.random()
    if pick < 0.4 and len(batch) == 2 and g.kind is None:  # heads transposed, as a transformer makes them
        q = torch.randn(batch[0], length, batch[1], e).to(dtype).transpose(1, 2)
    elif pick < 0.8:
        q = torch.randn(*batch, length, e).to(dtype)
    else:
        q = g.t((*batch, length, e), dtype)
    ke = e if rng.random() < 0.97 else e + 1
    if pick < 0.4 and len(batch) == 2 and g.kind is None and rng.random() < 0.7:
        k = torch.randn(batch[0], source, batch[1], ke).to(dtype).transpose(1, 2)
        v = torch.randn(batch[0], source, batch[1], ev).to(dtype).transpose(1, 2)
    else:
        k, v = g.t((*batch, source, ke), dtype), g.t((*batch, source, ev), dtype)
    kwargs: dict[str, Any] = {"is_causal": rng.random() < 0.5}
    if rng.random() < 0.3:
        kwargs["scale"] = 0.5
    if rng.random() < 0.1:
        kwargs["attn_mask"] = torch.ones(length, source, dtype=torch.bool)
    if rng.random() < 0.5:
        return Case("call_function", torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
    return Case("call_function", F.scaled_dot_product_attention, (q, k, v), kwargs)


def embedding_case(g: Gen) -> Case:
    rng = g.rng
    dtype = rng.choice((torch.float32, torch.float64, torch.bfloat16))
    rows, dim = rng.randint(2, 8), rng.randint(1, 6)
    idx = torch.randint(0, rows, shape(rng, rng.randint(1, 3)), dtype=rng.choice((torch.int64, torch.int32)))
    module = nn.Embedding(rows, dim, padding_idx=rng.choice([None, 0])).to(dtype)
    form = rng.choice(["module", "function", "aten"])
    if form == "module":
        return Case("call_module", None, (idx,), module=module)
    weight = module.weight.detach()
    if form == "aten":
        return Case("call_function", torch.ops.aten.embedding.default, (weight, idx))
    return Case("call_function", F.embedding, (idx, weight))


def views_case(g: Gen) -> Case:
    rng = g.rng
    x = g.t(shape(rng, rng.randint(2, 4), 1, 6), rng.choice((torch.float32, torch.float16)))
    d = rng.randrange(-x.dim(), x.dim())
    kind = rng.choice(["transpose", "permute", "unsqueeze", "split", "chunk", "cat", "expand", "t", "select"])
    aten = rng.random() < 0.4
    if kind == "transpose":
        other = rng.randrange(x.dim())
        return Case("call_function", torch.ops.aten.transpose.int, (x, d, other)) if aten else \
            Case("call_method", "transpose", (x, d, other))
    if kind == "permute":
        perm = list(range(x.dim()))
        rng.shuffle(perm)
        return Case("call_function", torch.ops.aten.permute.default, (x, perm)) if aten else \
            Case("call_method", "permute", (x, *perm))
    if kind == "unsqueeze":
        return Case("call_function", torch.ops.aten.unsqueeze.default, (x, d)) if aten else \
            Case("call_function", torch.unsqueeze, (x, d))
    if kind == "split":
        size = rng.randint(1, x.shape[d])
        if aten:
            return Case("call_function", torch.ops.aten.split.Tensor, (x, size, d))
        return Case("call_method", "split", (x, size), {"dim": d}) if rng.random() < 0.5 else \
            Case("call_function", torch.split, (x, [x.shape[d]], d))
    if kind == "chunk":
        return Case("call_function", torch.ops.aten.chunk.default, (x, 2, d)) if aten else \
            Case("call_method", "chunk", (x, 2, d))
    if kind == "cat":
        parts = [x, g.t(tuple(rng.randint(1, 3) if i == d % x.dim() else n for i, n in enumerate(x.shape)), x.dtype)]
        return Case("call_function", torch.ops.aten.cat.default, (parts, d))
    if kind == "expand":
        sizes = [n if n != 1 else rng.randint(1, 3) for n in x.shape]
        return Case("call_function", torch.ops.aten.expand.default, (x, sizes)) if aten else \
            Case("call_method", "expand", (x, *sizes))
    if kind == "t":
        y = g.t(shape(rng, 2), x.dtype)
        return Case("call_function", torch.ops.aten.t.default, (y,)) if aten else Case("call_method", "t", (y,))
    index = rng.randrange(x.shape[d])
    return Case("call_function", torch.ops.aten.select.int, (x, d, index)) if aten else \
        Case("call_method", "select", (x, d, index))


def aten_elementwise_case(g: Gen) -> Case:
    rng = g.rng
    a_shape, b_shape = broadcast_pair(g)
    dtype = rng.choice((*FLOATS, torch.int64))
    a, b = g.t(a_shape, dtype), g.t(b_shape, rng.choice((dtype, torch.float32)))
    kind = rng.choice(["add", "sub", "mul", "div", "gelu", "silu", "relu", "view", "reshape"])
    if kind in ("add", "sub", "mul", "div"):
        return Case("call_function", getattr(torch.ops.aten, kind).Tensor, (a, b))
    if kind in ("view", "reshape"):
        return Case("call_function", getattr(torch.ops.aten, kind).default, (a, [-1]))
    x = g.t(a_shape, rng.choice(FLOATS))
    if kind == "gelu":
        return Case("call_function", torch.ops.aten.gelu.default, (x,), {"approximate": rng.choice(["none", "tanh"])})
    return Case("call_function", getattr(torch.ops.aten, kind).default, (x,))


FAMILIES: dict[str, Callable[[Gen], Case]] = {
    "activation": activation_case, "binary": binary_case, "conv": conv_case, "fused": fused_case,
    "norm": norm_case, "pool": pool_case, "linear": linear_case, "reduction": reduction_case,
    "shape_ops": shape_ops_case, "matmul": matmul_case, "transformer_norm": transformer_norm_case,
    "softmax": softmax_case, "attention": attention_case, "embedding": embedding_case, "views": views_case,
    "aten_elementwise": aten_elementwise_case,
}
#: families whose rules decline off the CPU (torch's kernel choice, and so the layout, differs)
CPU_ONLY = {"attention"}
CASES = 150


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rules_agree_with_fake_tensor_propagation(family: str) -> None:
    g = Gen(f"shape-rules-{family}")
    taken = sum(run_case(FAMILIES[family](g)) for _ in range(CASES))
    assert taken >= CASES // 4, f"the rules took only {taken} of {CASES} {family} calls"


def _common(case: Case) -> bool:
    """Floating-point tensors with contiguous strides only (inputs and the module's), a call
    torch accepts."""
    tensors = [x for x in case.inputs if isinstance(x, torch.Tensor)]
    tensors += [t for t in case.gm.parameters()] + [t for t in case.gm.buffers()]
    if not all(t.dtype.is_floating_point and t.stride() == contiguous_strides(t.shape) and t.dim() > 0
               for t in tensors):
        return False
    try:
        propagate_shapes(fx.GraphModule(case.gm, copy_graph(case.gm.graph)),
                         SimpleNamespace(example_inputs=tuple(case.inputs), meta_values=False, fake_state=None))
    except Exception:
        return False
    return True


#: families with no common call as defined here: embeddings take integer indices
NO_FLOAT_ONLY_CALLS = {"embedding"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - NO_FLOAT_ONLY_CALLS))
def test_rules_take_every_common_call(family: str) -> None:
    """Declining is allowed only off the common path: valid calls on contiguous
    floating-point tensors always get their values from the rules."""
    g = Gen(f"common-{family}", kind="contiguous")
    common = 0
    for _ in range(CASES):
        case = FAMILIES[family](g)
        if _common(case):
            common += 1
            assert run_case(case), f"declined a common call: {case.text}"
    assert common >= 10, f"only {common} common {family} calls drawn"


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - CPU_ONLY))
def test_rules_agree_with_fake_tensor_propagation_on_cuda(family: str) -> None:
    """On CUDA torch picks other kernels (cuDNN convolutions, whose layout follows the
    weight's too): the same comparison with every tensor on the GPU."""
    g = Gen(f"shape-rules-cuda-{family}")
    taken = sum(run_case(FAMILIES[family](g).to(torch.device("cuda"))) for _ in range(CASES))
    assert taken >= CASES // 5, f"the rules took only {taken} of {CASES} {family} calls"


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rules_agree_with_fake_tensor_propagation_long(family: str) -> None:
    g = Gen(f"shape-rules-long-{family}")
    for _ in range(20 * CASES):
        run_case(FAMILIES[family](g))


def test_batch_norm_on_cuda_models_only_the_layouts_cudnn_and_native_agree_on():
    """On CUDA, cuDNN's batch norm lays its output out by suggest_memory_format, the native
    kernel by the input's own strides: the rule takes only contiguous and channels-last
    inputs there (where both agree), and keeps a permuted input's strides on the CPU."""
    from fxopt.analysis.shape_rules import Env, NoRule, batch_norm

    stats = [torch.empty(4, device="meta") for _ in range(4)]
    permuted = torch.empty(5, 2, 2, 4, 2, device="meta").permute(4, 3, 2, 1, 0)  # dense, odd order
    assert batch_norm(Env(torch.device("cpu")), permuted, *stats).stride() == permuted.stride()
    with pytest.raises(NoRule):
        batch_norm(Env(torch.device("cuda")), permuted, *stats)
    last = torch.empty(2, 4, 3, 5, device="meta").to(memory_format=torch.channels_last)
    for device in ("cpu", "cuda"):
        assert batch_norm(Env(torch.device(device)), last, *stats).stride() == last.stride()
