"""Hypothesis strategies: random valid FX graphs, inputs for them, and pass pipelines.

``fx_graphs`` builds a ``torch.fx.Graph`` node by node instead of generating Python and
tracing it (that is what makes it fast: no tracer, no shape propagation). While
building it tracks, for every value, its shape, an interval bounding its elements,
whether it is contiguous, and which values share its storage. An op is only applied
where it is valid (shapes match, a view is taken of a contiguous tensor, an in-place
write never hits a graph input, a constant, or an expanded tensor) and where it keeps
values finite (``exp`` of bounded values, ``log`` and ``rsqrt`` of values bounded away
from zero, division by values bounded away from zero); otherwise the always-valid
``relu`` is used instead, so no draw is ever rejected. Shrinking follows the draws:
fewer ops, earlier op kinds (simple elementwise ones first), earlier operands.

Every node gets ``meta['val']`` (a tensor on the ``meta`` device: shape and dtype), so
:func:`inputs_for` and :func:`fxopt.testing.random_inputs` can draw inputs, and the
minimizer can cut the graph anywhere.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from fxopt.testing.inputs import input_specs

#: values are kept within this magnitude, so fp16 cannot overflow and tolerances mean something
LIMIT = 1e4
#: graph inputs are standard normal: |x| <= 6 except with probability ~2e-9 per element
INPUT_BOUND = 6.0


@dataclass
class _Value:
    node: fx.Node
    shape: tuple[int, ...]
    lo: float
    hi: float
    group: int  # values sharing a storage share a group
    contiguous: bool = True

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Builder:
    """The graph under construction and what is known about each of its values."""

    def __init__(self, choices: bytes, dtype: torch.dtype, seed: int):
        self.choices = choices
        self.position = 0
        self.dtype = dtype
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.values: list[_Value] = []
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.external: set[int] = set()  # groups of inputs and constants: never written
        self.expanded: set[int] = set()  # groups holding an expanded tensor: never written
        self._groups = 0

    # -- creating nodes ----------------------------------------------------------------
    def _meta(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device="meta")

    def new_group(self) -> int:
        self._groups += 1
        return self._groups

    def placeholder(self, shape: tuple[int, ...]) -> _Value:
        node = self.graph.placeholder(f"x{len([v for v in self.values if v.node.op == 'placeholder'])}")
        node.meta["val"] = self._meta(shape)
        group = self.new_group()
        self.external.add(group)
        value = _Value(node, shape, -INPUT_BOUND, INPUT_BOUND, group)
        self.values.append(value)
        return value

    def constant(self, shape: Sequence[int], lo: float = -1.0, hi: float = 1.0,
                 dtype: torch.dtype | None = None, data: torch.Tensor | None = None) -> fx.Node:
        """A ``get_attr`` of a new buffer, uniform in ``[lo, hi]`` (or ``data``)."""
        name = f"c{len(self.root._buffers)}"
        if data is None:
            data = (torch.rand(tuple(shape), generator=self.generator) * (hi - lo) + lo).to(dtype or self.dtype)
        self.root.register_buffer(name, data)
        node = self.graph.get_attr(name)
        node.meta["val"] = self._meta(data.shape, data.dtype)
        return node

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, *, shape: Sequence[int],
             lo: float, hi: float, op: str = "call_function", alias: _Value | None = None,
             inputs: Iterable[_Value] = (), contiguous: bool | None = None) -> _Value | None:
        """A new node and its value; None (and no node) if its values could exceed LIMIT."""
        if not -LIMIT <= lo <= hi <= LIMIT:
            return None
        create = self.graph.call_method if op == "call_method" else self.graph.call_function
        node = create(target, args, kwargs or {})
        shape = tuple(shape)
        node.meta["val"] = self._meta(shape)
        inputs = list(inputs) or ([alias] if alias else [])
        if contiguous is None:
            contiguous = all(v.contiguous for v in inputs)
        value = _Value(node, shape, lo, hi, alias.group if alias else self.new_group(), contiguous)
        self.values.append(value)
        return value

    def write(self, value: _Value, lo: float, hi: float) -> None:
        """An in-place write into ``value``'s storage: every alias may now hold [lo, hi]."""
        for other in self.values:
            if other.group == value.group:
                other.lo, other.hi = min(other.lo, lo), max(other.hi, hi)

    def writable(self, value: _Value) -> bool:
        return value.group not in self.external and value.group not in self.expanded

    # -- drawing -------------------------------------------------------------------------
    # Choices are read from one byte string that hypothesis draws for the whole graph,
    # _CHUNK bytes per op (a byte past an op's chunk reads as 0). One draw per graph
    # instead of one per choice is what makes generation fast (a hypothesis draw costs
    # about as much as building a node), and it shrinks well: deleting a chunk deletes
    # one op, and zeroed bytes mean first options (relu, the latest value, small sizes).
    def start_op(self, index: int) -> None:
        self.position, self.end = index * _CHUNK, (index + 1) * _CHUNK

    def integer(self, lo: int, hi: int) -> int:
        byte = self.choices[self.position] if self.position < min(self.end, len(self.choices)) else 0
        self.position += 1
        return lo + byte % (hi - lo + 1)

    def flag(self) -> bool:
        return self.integer(0, 1) == 1

    def pick(self, candidates: Sequence[_Value]) -> _Value:
        return candidates[self.integer(0, len(candidates) - 1)]

    def permutation(self, n: int) -> list[int]:
        items = list(range(n))
        for i in range(n - 1):
            j = self.integer(i, n - 1)
            items[i], items[j] = items[j], items[i]
        return items


_CHUNK = 16


# --- interval arithmetic ----------------------------------------------------------------


def _mul_interval(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def _monotone(fn: Callable[[float], float]) -> Callable[[float, float], tuple[float, float]]:
    return lambda lo, hi: (fn(lo), fn(hi))


def _power(base: float, n: int) -> float:
    """``base ** n`` for ``base >= 0``, or ``inf`` where that exceeds :data:`LIMIT` (such a
    bound only needs to be rejected). Decided in logs: ``**`` on floats raises
    OverflowError past ~1e308, and raised while drawing it would fail the user's test."""
    if base > 1 and n * math.log(base) > math.log(LIMIT):
        return math.inf
    return base ** n


def _away_from_zero(v: _Value, margin: float) -> bool:
    return v.lo >= margin or v.hi <= -margin


# --- op kinds ---------------------------------------------------------------------------
# Each op kind is a function (builder, operand) -> new value, or None when it does not
# apply to that operand (the builder then falls back to relu).

OpBuilder = Callable[[_Builder, _Value], "_Value | None"]
OPS: dict[str, OpBuilder] = {}


def _op(name: str) -> Callable[[OpBuilder], OpBuilder]:
    def register(fn: OpBuilder) -> OpBuilder:
        OPS[name] = fn
        return fn

    return register


def _unary(name: str, targets: Sequence[Any], transfer: Callable[[float, float], tuple[float, float]],
           applies: Callable[[_Value], bool] = lambda v: True) -> None:
    """An elementwise op; ``targets`` are spellings of it (torch.x, F.x, a method name)."""

    def build(b: _Builder, x: _Value) -> _Value | None:
        if not applies(x):
            return None
        target = targets[b.integer(0, len(targets) - 1)] if len(targets) > 1 else targets[0]
        lo, hi = transfer(x.lo, x.hi)
        op = "call_method" if isinstance(target, str) else "call_function"
        return b.call(target, (x.node,), shape=x.shape, lo=lo, hi=hi, op=op, inputs=[x])

    OPS[name] = build


def _gelu_like(floor: float) -> Callable[[float, float], tuple[float, float]]:
    return lambda lo, hi: (floor if lo < 0 else 0.0, max(hi, 0.0))


_unary("relu", [torch.relu, F.relu, "relu"], lambda lo, hi: (max(lo, 0.0), max(hi, 0.0)))
_unary("neg", [torch.neg, operator.neg], lambda lo, hi: (-hi, -lo))
_unary("sigmoid", [torch.sigmoid, "sigmoid"], _monotone(lambda t: 0.5 * (1 + math.tanh(t / 2))))
_unary("tanh", [torch.tanh, "tanh"], _monotone(math.tanh))
_unary("gelu", [F.gelu], _gelu_like(-0.17))
_unary("silu", [F.silu], _gelu_like(-0.28))
_unary("mish", [F.mish], _gelu_like(-0.31))
_unary("abs", [torch.abs, "abs"], lambda lo, hi: (0.0 if lo < 0 < hi else min(abs(lo), abs(hi)),
                                                    max(abs(lo), abs(hi))))
_unary("exp", [torch.exp], _monotone(math.exp), lambda v: v.hi <= 8)
_unary("log", [torch.log], _monotone(math.log), lambda v: v.lo >= 1e-3)
_unary("sqrt", [torch.sqrt], _monotone(math.sqrt), lambda v: v.lo >= 0)
_unary("rsqrt", [torch.rsqrt], lambda lo, hi: (1 / math.sqrt(hi), 1 / math.sqrt(lo)), lambda v: v.lo >= 1e-2)
_unary("reciprocal", [torch.reciprocal], lambda lo, hi: (1 / hi, 1 / lo), lambda v: _away_from_zero(v, 0.1))
_unary("sin", [torch.sin], lambda lo, hi: (-1.0, 1.0))
_unary("cos", [torch.cos], lambda lo, hi: (-1.0, 1.0))
_unary("square", [torch.square], lambda lo, hi: (0.0 if lo < 0 < hi else min(lo * lo, hi * hi),
                                                  max(lo * lo, hi * hi)), lambda v: v.bound <= 100)
_unary("softplus", [F.softplus], _monotone(lambda t: max(t, 0.0) + math.log1p(math.exp(-abs(t)))))
_unary("elu", [F.elu], _monotone(lambda t: t if t > 0 else math.expm1(t)))
_unary("leaky_relu", [F.leaky_relu], _monotone(lambda t: t if t > 0 else 0.01 * t))
_unary("hardtanh", [F.hardtanh], _monotone(lambda t: min(max(t, -1.0), 1.0)))
_unary("erf", [torch.erf], _monotone(math.erf))
_unary("atan", [torch.atan], _monotone(math.atan))
_unary("clone", [torch.clone, "clone"], lambda lo, hi: (lo, hi))


@_op("dropout_eval")
def _dropout(b: _Builder, x: _Value) -> _Value:
    return b.call(F.dropout, (x.node,), {"p": 0.5, "training": False}, shape=x.shape, lo=x.lo, hi=x.hi, inputs=[x])


@_op("clamp")
def _clamp(b: _Builder, x: _Value) -> _Value:
    lo, hi = -b.integer(0, 3) * 0.5, b.integer(1, 4) * 0.5
    return b.call(torch.clamp, (x.node, lo, hi), shape=x.shape, lo=max(min(x.lo, hi), lo),
                  hi=min(max(x.hi, lo), hi), inputs=[x])


@_op("scalar_arith")
def _scalar_arith(b: _Builder, x: _Value) -> _Value:
    kind = b.integer(0, 3)
    c = [0.5, 1.5, 2.0, -1.0, 3.0][b.integer(0, 4)]
    if kind == 0:
        return b.call(operator.add, (x.node, c), shape=x.shape, lo=x.lo + c, hi=x.hi + c, inputs=[x])
    if kind == 1:
        return b.call(operator.mul, (x.node, c), shape=x.shape, lo=min(x.lo * c, x.hi * c),
                      hi=max(x.lo * c, x.hi * c), inputs=[x])
    if kind == 2:
        return b.call(operator.sub, (c, x.node), shape=x.shape, lo=c - x.hi, hi=c - x.lo, inputs=[x])
    return b.call(operator.truediv, (x.node, c), shape=x.shape, lo=min(x.lo / c, x.hi / c),
                  hi=max(x.lo / c, x.hi / c), inputs=[x])


# binary elementwise ops with broadcasting --------------------------------------------


def _broadcastable_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _second_operand(b: _Builder, x: _Value, lo: float = -1.0, hi: float = 1.0,
                    accept: Callable[[_Value], bool] = lambda v: True) -> tuple[fx.Node, float, float, bool]:
    """Another value broadcastable to ``x``'s shape, or a new constant of such a shape."""
    candidates = [v for v in b.values if _broadcastable_to(v.shape, x.shape) and accept(v)]
    if candidates and b.flag():
        other = b.pick(candidates)
        return other.node, other.lo, other.hi, other.contiguous
    rank = b.integer(0, x.rank)
    shape = [d if b.flag() else 1 for d in x.shape[x.rank - rank:]]
    return b.constant(shape, lo, hi), lo, hi, True


def _binary(name: str, targets: Sequence[Any], transfer: Callable[[tuple, tuple], tuple[float, float]],
            second: tuple[float, float] = (-1.0, 1.0), accept: Callable[[_Value], bool] = lambda v: True) -> None:
    def build(b: _Builder, x: _Value) -> _Value:
        node, lo, hi, contiguous = _second_operand(b, x, *second, accept=accept)
        target = targets[b.integer(0, len(targets) - 1)] if len(targets) > 1 else targets[0]
        out_lo, out_hi = transfer((x.lo, x.hi), (lo, hi))
        op = "call_method" if isinstance(target, str) else "call_function"
        return b.call(target, (x.node, node), shape=x.shape, lo=out_lo, hi=out_hi, op=op,
                      contiguous=x.contiguous and contiguous)

    OPS[name] = build


_binary("add", [operator.add, torch.add, "add"], lambda a, c: (a[0] + c[0], a[1] + c[1]))
_binary("sub", [operator.sub, torch.sub, "sub"], lambda a, c: (a[0] - c[1], a[1] - c[0]))
_binary("mul", [operator.mul, torch.mul, "mul"], _mul_interval)
_binary("div", [operator.truediv, torch.div], lambda a, c: _mul_interval(a, (1 / c[1], 1 / c[0])),
        second=(0.5, 2.0), accept=lambda v: v.lo >= 0.5)
_binary("maximum", [torch.maximum], lambda a, c: (max(a[0], c[0]), max(a[1], c[1])))
_binary("minimum", [torch.minimum], lambda a, c: (min(a[0], c[0]), min(a[1], c[1])))
_binary("atan2", [torch.atan2], lambda a, c: (-math.pi, math.pi))


@_op("where")
def _where(b: _Builder, x: _Value) -> _Value:
    other, lo, hi, contiguous = _second_operand(b, x)
    cond = b.graph.call_function(torch.gt, (x.node, 0.0))
    cond.meta["val"] = b._meta(x.shape, torch.bool)
    return b.call(torch.where, (cond, x.node, other), shape=x.shape, lo=min(x.lo, lo), hi=max(x.hi, hi),
                  contiguous=x.contiguous and contiguous)


# shape ops ---------------------------------------------------------------------------


def _new_shape(b: _Builder, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The same number of elements, laid out differently (merged, split or unit dims)."""
    kind = b.integer(0, 3)
    if kind == 0 or not shape:
        return (math.prod(shape),)
    if kind == 1 and len(shape) >= 2:
        i = b.integer(0, len(shape) - 2)
        return (*shape[:i], shape[i] * shape[i + 1], *shape[i + 2:])
    if kind == 2:
        i = b.integer(0, len(shape) - 1)
        factor = next((f for f in (2, 3) if shape[i] % f == 0 and shape[i] > f), None)
        if factor:
            return (*shape[:i], factor, shape[i] // factor, *shape[i + 1:])
    i = b.integer(0, len(shape))
    return (*shape[:i], 1, *shape[i:])


@_op("reshape")
def _reshape(b: _Builder, x: _Value) -> _Value:
    shape = _new_shape(b, x.shape)
    spelled = list(shape)
    if shape and b.flag():
        spelled[b.integer(0, len(shape) - 1)] = -1
    if b.flag():
        return b.call(torch.reshape, (x.node, tuple(spelled)), shape=shape, lo=x.lo, hi=x.hi,
                      alias=x, contiguous=x.contiguous)
    return b.call("reshape", (x.node, *spelled), shape=shape, lo=x.lo, hi=x.hi, op="call_method",
                  alias=x, contiguous=x.contiguous)


@_op("view")
def _view(b: _Builder, x: _Value) -> _Value | None:
    if not x.contiguous:
        return None
    shape = _new_shape(b, x.shape)
    return b.call("view", (x.node, *shape), shape=shape, lo=x.lo, hi=x.hi, op="call_method", alias=x)


@_op("permute")
def _permute(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    dims = b.permutation(x.rank)
    shape = tuple(x.shape[d] for d in dims)
    if b.flag():
        return b.call(torch.permute, (x.node, tuple(dims)), shape=shape, lo=x.lo, hi=x.hi, alias=x, contiguous=False)
    return b.call("permute", (x.node, *dims), shape=shape, lo=x.lo, hi=x.hi, op="call_method",
                  alias=x, contiguous=False)


@_op("transpose")
def _transpose(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    i, j = b.integer(0, x.rank - 1), b.integer(0, x.rank - 1)
    shape = list(x.shape)
    shape[i], shape[j] = shape[j], shape[i]
    return b.call(torch.transpose, (x.node, i, j - x.rank), shape=shape, lo=x.lo, hi=x.hi, alias=x,
                  contiguous=x.contiguous and i == j)


@_op("flatten")
def _flatten(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    start = b.integer(0, x.rank - 2)
    shape = (*x.shape[:start], math.prod(x.shape[start:]))
    return b.call(torch.flatten, (x.node, start), shape=shape, lo=x.lo, hi=x.hi, alias=x)


@_op("unsqueeze")
def _unsqueeze(b: _Builder, x: _Value) -> _Value | None:
    if x.rank >= 4:
        return None
    i = b.integer(0, x.rank)
    return b.call(torch.unsqueeze, (x.node, i), shape=(*x.shape[:i], 1, *x.shape[i:]), lo=x.lo, hi=x.hi, alias=x)


@_op("squeeze")
def _squeeze(b: _Builder, x: _Value) -> _Value | None:
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    if not ones:
        return None
    i = ones[b.integer(0, len(ones) - 1)]
    return b.call("squeeze", (x.node, i), shape=(*x.shape[:i], *x.shape[i + 1:]), lo=x.lo, hi=x.hi,
                  op="call_method", alias=x)


@_op("expand")
def _expand(b: _Builder, x: _Value) -> _Value | None:
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    if not ones or x.numel > 64:
        return None
    shape = list(x.shape)
    for i in ones:
        shape[i] = b.integer(1, 4)
    b.expanded.add(x.group)
    return b.call("expand", (x.node, *shape), shape=shape, lo=x.lo, hi=x.hi, op="call_method",
                  alias=x, contiguous=False)


@_op("cat")
def _cat(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    fits = [v for v in b.values if v.rank == x.rank
            and all(s == t for k, (s, t) in enumerate(zip(v.shape, x.shape)) if k != dim)]
    parts = [x]
    for _ in range(b.integer(1, 2)):
        parts.append(b.pick(fits))
    size = sum(v.shape[dim] for v in parts)
    shape = (*x.shape[:dim], size, *x.shape[dim + 1:])
    if math.prod(shape) > 4096:
        return None
    return b.call(torch.cat, ([v.node for v in parts], dim), shape=shape, lo=min(v.lo for v in parts),
                  hi=max(v.hi for v in parts), inputs=parts)


def _getitem(b: _Builder, parts: fx.Node, index: int, x: _Value, shape: tuple[int, ...], dim: int) -> _Value:
    """Element ``index`` of a split/chunk along ``dim``: a view, contiguous only along dim 0."""
    return b.call(operator.getitem, (parts, index), shape=shape, lo=x.lo, hi=x.hi, alias=x,
                  contiguous=x.contiguous and dim == 0)


@_op("split")
def _split(b: _Builder, x: _Value) -> _Value | None:
    dims = [i for i, d in enumerate(x.shape) if d >= 2]
    if not dims:
        return None
    dim = dims[b.integer(0, len(dims) - 1)]
    size = b.integer(1, x.shape[dim] - 1)
    sizes = [size] * (x.shape[dim] // size) + ([x.shape[dim] % size] if x.shape[dim] % size else [])
    parts = b.graph.call_function(torch.split, (x.node, size, dim))
    parts.meta["val"] = tuple(b._meta((*x.shape[:dim], s, *x.shape[dim + 1:])) for s in sizes)
    index = b.integer(0, len(sizes) - 1)
    return _getitem(b, parts, index, x, tuple(parts.meta["val"][index].shape), dim)


@_op("chunk")
def _chunk(b: _Builder, x: _Value) -> _Value | None:
    dims = [i for i, d in enumerate(x.shape) if d % 2 == 0]
    if not dims:
        return None
    dim = dims[b.integer(0, len(dims) - 1)]
    parts = b.graph.call_method("chunk", (x.node, 2, dim))
    half = (*x.shape[:dim], x.shape[dim] // 2, *x.shape[dim + 1:])
    parts.meta["val"] = (b._meta(half), b._meta(half))
    return _getitem(b, parts, b.integer(0, 1), x, half, dim)


@_op("slice")
def _slice(b: _Builder, x: _Value) -> _Value | None:
    dims = [i for i, d in enumerate(x.shape) if d >= 2]
    if not dims:
        return None
    dim = dims[b.integer(0, len(dims) - 1)]
    start = b.integer(0, x.shape[dim] - 1)
    stop = b.integer(start + 1, x.shape[dim])
    index = (*[slice(None)] * dim, slice(start, stop))
    shape = (*x.shape[:dim], stop - start, *x.shape[dim + 1:])
    return b.call(operator.getitem, (x.node, index), shape=shape, lo=x.lo, hi=x.hi, alias=x,
                  contiguous=x.contiguous and dim == 0)


@_op("narrow")
def _narrow(b: _Builder, x: _Value) -> _Value | None:
    dims = [i for i, d in enumerate(x.shape) if d >= 2]
    if not dims:
        return None
    dim = dims[b.integer(0, len(dims) - 1)]
    length = b.integer(1, x.shape[dim] - 1)
    start = b.integer(0, x.shape[dim] - length)
    shape = (*x.shape[:dim], length, *x.shape[dim + 1:])
    return b.call(torch.narrow, (x.node, dim, start, length), shape=shape, lo=x.lo, hi=x.hi, alias=x,
                  contiguous=x.contiguous and dim == 0)


@_op("select")
def _select(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    dim = b.integer(0, x.rank - 1)
    index = b.integer(0, x.shape[dim] - 1)
    return b.call("select", (x.node, dim, index), shape=(*x.shape[:dim], *x.shape[dim + 1:]), lo=x.lo,
                  hi=x.hi, op="call_method", alias=x, contiguous=x.contiguous and dim == 0)


@_op("flip")
def _flip(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    return b.call(torch.flip, (x.node, (b.integer(0, x.rank - 1),)), shape=x.shape, lo=x.lo, hi=x.hi, inputs=[x])


@_op("roll")
def _roll(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    return b.call(torch.roll, (x.node, b.integer(1, 3), dim), shape=x.shape, lo=x.lo, hi=x.hi, inputs=[x])


@_op("repeat")
def _repeat(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0 or x.numel > 256:
        return None
    reps = [1] * x.rank
    reps[b.integer(0, x.rank - 1)] = 2
    shape = tuple(d * r for d, r in zip(x.shape, reps))
    return b.call("repeat", (x.node, *reps), shape=shape, lo=x.lo, hi=x.hi, op="call_method", contiguous=True)


@_op("contiguous")
def _contiguous(b: _Builder, x: _Value) -> _Value:
    return b.call("contiguous", (x.node,), shape=x.shape, lo=x.lo, hi=x.hi, op="call_method",
                  alias=x if x.contiguous else None, contiguous=True)


@_op("cast_noop")
def _cast_noop(b: _Builder, x: _Value) -> _Value:
    """``x.to(its own dtype)``: returns ``x`` itself (what eliminate_identity removes)."""
    return b.call("to", (x.node, b.dtype), shape=x.shape, lo=x.lo, hi=x.hi, op="call_method", alias=x)


@_op("index_select")
def _index_select(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    count = b.integer(1, 4)
    index = torch.randint(0, x.shape[dim], (count,), generator=b.generator)
    node = b.constant(index.shape, data=index)
    return b.call(torch.index_select, (x.node, dim, node), shape=(*x.shape[:dim], count, *x.shape[dim + 1:]),
                  lo=x.lo, hi=x.hi, inputs=[x])


# linear algebra ----------------------------------------------------------------------


def _weight(b: _Builder, shape: Sequence[int], fan_in: int) -> fx.Node:
    scale = 1 / math.sqrt(max(fan_in, 1))
    return b.constant(shape, -scale, scale)


@_op("matmul")
def _matmul(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    k = x.shape[-1]
    fits = [v for v in b.values if v.rank == 2 and v.shape[0] == k and x.rank >= 1]
    if fits and b.flag():
        w = b.pick(fits)
        node, bound, n = w.node, w.bound, w.shape[1]
    else:
        n = b.integer(1, 8)
        node, bound = _weight(b, (k, n), k), 1 / math.sqrt(k)
    out = k * x.bound * bound
    target = [operator.matmul, torch.matmul][b.integer(0, 1)]
    shape = (*x.shape[:-1], n) if x.rank > 1 else (n,)
    return b.call(target, (x.node, node), shape=shape, lo=-out, hi=out, contiguous=True)


@_op("bmm")
def _bmm(b: _Builder, x: _Value) -> _Value | None:
    if x.rank != 3:
        return None
    batch, _, k = x.shape
    n = b.integer(1, 6)
    w = _weight(b, (batch, k, n), k)
    out = math.sqrt(k) * x.bound
    return b.call(torch.bmm, (x.node, w), shape=(batch, x.shape[1], n), lo=-out, hi=out, contiguous=True)


@_op("linear")
def _linear(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    k, n = x.shape[-1], b.integer(1, 8)
    args: tuple = (x.node, _weight(b, (n, k), k))
    if b.flag():
        args += (b.constant((n,), -0.5, 0.5),)
    out = math.sqrt(k) * x.bound + 0.5
    return b.call(F.linear, args, shape=(*x.shape[:-1], n), lo=-out, hi=out, contiguous=True)


@_op("addmm")
def _addmm(b: _Builder, x: _Value) -> _Value | None:
    if x.rank != 2:
        return None
    k, n = x.shape[1], b.integer(1, 8)
    bias = b.constant((n,), -0.5, 0.5)
    out = math.sqrt(k) * x.bound + 0.5
    return b.call(torch.addmm, (bias, x.node, _weight(b, (k, n), k)), shape=(x.shape[0], n), lo=-out,
                  hi=out, contiguous=True)


@_op("conv")
def _conv(b: _Builder, x: _Value) -> _Value | None:
    if x.rank not in (3, 4) or x.shape[1] > 16:
        return None
    c = x.shape[1]
    depthwise = b.flag()
    out_c = c if depthwise else b.integer(1, 8)
    kernel = 1 if min(x.shape[2:]) < 3 else [1, 3][b.integer(0, 1)]
    groups = c if depthwise else 1
    fan_in = (c // groups) * kernel ** (x.rank - 2)
    weight = _weight(b, (out_c, c // groups, *[kernel] * (x.rank - 2)), fan_in)
    bias = b.constant((out_c,), -0.5, 0.5) if b.flag() else None
    conv = F.conv1d if x.rank == 3 else F.conv2d
    out = math.sqrt(fan_in) * x.bound + 0.5
    return b.call(conv, (x.node, weight, bias), {"padding": kernel // 2, "groups": groups},
                  shape=(x.shape[0], out_c, *x.shape[2:]), lo=-out, hi=out, contiguous=True)


# normalization -------------------------------------------------------------------------


@_op("layer_norm")
def _layer_norm(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    n = x.shape[-1]
    affine = b.flag()
    weight = b.constant((n,), 0.5, 1.5) if affine else None
    bias = b.constant((n,), -0.2, 0.2) if affine else None
    out = math.sqrt(n) * 1.5 + 0.2
    return b.call(F.layer_norm, (x.node, (n,), weight, bias, 1e-5), shape=x.shape, lo=-out, hi=out, contiguous=True)


@_op("group_norm")
def _group_norm(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    c = x.shape[1]
    groups = next(g for g in (2, 1) if c % g == 0)
    n = c // groups * math.prod(x.shape[2:])
    if n < 2:
        return None  # group_norm rejects groups of a single value
    out = math.sqrt(n) + 0.2
    return b.call(F.group_norm, (x.node, groups, b.constant((c,), 0.5, 1.5), b.constant((c,), -0.2, 0.2)),
                  shape=x.shape, lo=-out * 1.5, hi=out * 1.5, contiguous=True)


@_op("batch_norm")
def _batch_norm(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2:
        return None
    c = x.shape[1]
    mean, var = b.constant((c,), -0.5, 0.5), b.constant((c,), 0.5, 2.0)
    weight, bias = b.constant((c,), 0.5, 1.5), b.constant((c,), -0.2, 0.2)
    out = (x.bound + 0.5) / math.sqrt(0.5) * 1.5 + 0.2
    return b.call(F.batch_norm, (x.node, mean, var, weight, bias, False, 0.1, 1e-5), shape=x.shape,
                  lo=-out, hi=out, inputs=[x])


@_op("normalize")
def _normalize(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    if x.shape[dim] * x.bound ** 2 > LIMIT:
        return None  # the squared norm could overflow fp16
    # eps=1e-12 (the default) is 0 in fp16, and relu makes all-zero rows: 0/0
    return b.call(F.normalize, (x.node,), {"dim": dim, "eps": 1e-3}, shape=x.shape, lo=-1.0, hi=1.0,
                  inputs=[x])


@_op("softmax")
def _softmax(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    target = [torch.softmax, F.softmax][b.integer(0, 1)]
    return b.call(target, (x.node, b.integer(0, x.rank - 1)), shape=x.shape, lo=0.0, hi=1.0, inputs=[x])


@_op("log_softmax")
def _log_softmax(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    low = x.lo - x.hi - math.log(x.shape[dim])
    return b.call(torch.log_softmax, (x.node, dim), shape=x.shape, lo=low, hi=0.0, inputs=[x])


# reductions ----------------------------------------------------------------------------


def _reduction(name: str, target: Any, transfer: Callable[[_Value, int], tuple[float, float]],
               extra: dict[str, Any] | None = None,
               applies: Callable[[_Value, int], bool] = lambda v, n: True) -> None:
    def build(b: _Builder, x: _Value) -> _Value | None:
        if x.rank == 0:
            return None
        dim = b.integer(0, x.rank - 1)
        if not applies(x, x.shape[dim]):
            return None
        keep = b.flag()
        shape = (*x.shape[:dim], *([1] if keep else []), *x.shape[dim + 1:])
        lo, hi = transfer(x, x.shape[dim])
        op = "call_method" if isinstance(target, str) else "call_function"
        return b.call(target, (x.node,), {"dim": dim, "keepdim": keep, **(extra or {})}, shape=shape,
                      lo=lo, hi=hi, op=op, inputs=[x])

    OPS[name] = build


_reduction("sum", torch.sum, lambda x, n: (x.lo * n if x.lo < 0 else x.lo, x.hi * n if x.hi > 0 else x.hi))
_reduction("mean", "mean", lambda x, n: (x.lo, x.hi))
_reduction("amax", torch.amax, lambda x, n: (x.lo, x.hi))
_reduction("amin", torch.amin, lambda x, n: (x.lo, x.hi))
_reduction("var", torch.var, lambda x, n: (0.0, (x.hi - x.lo) ** 2), {"correction": 0})
_reduction("std", torch.std, lambda x, n: (0.0, x.hi - x.lo), {"correction": 0})
_reduction("vector_norm", torch.linalg.vector_norm, lambda x, n: (0.0, math.sqrt(n) * x.bound))
_reduction("logsumexp", torch.logsumexp, lambda x, n: (x.lo, x.hi + math.log(n)))
_reduction("prod", torch.prod, lambda x, n: (-_power(x.bound, n), _power(x.bound, n)),
           applies=lambda x, n: _power(x.bound, n) <= LIMIT)


@_op("cumsum")
def _cumsum(b: _Builder, x: _Value) -> _Value | None:
    if x.rank == 0:
        return None
    dim = b.integer(0, x.rank - 1)
    n = x.shape[dim]
    return b.call(torch.cumsum, (x.node, dim), shape=x.shape, lo=min(x.lo, x.lo * n), hi=max(x.hi, x.hi * n),
                  inputs=[x])


@_op("pool")
def _pool(b: _Builder, x: _Value) -> _Value | None:
    if x.rank != 4 or min(x.shape[2:]) < 2:
        return None
    target = [F.max_pool2d, F.avg_pool2d][b.integer(0, 1)]
    shape = (*x.shape[:2], x.shape[2] // 2, x.shape[3] // 2)
    return b.call(target, (x.node, 2), shape=shape, lo=x.lo, hi=x.hi, contiguous=True)


@_op("adaptive_avg_pool")
def _adaptive_pool(b: _Builder, x: _Value) -> _Value | None:
    if x.rank != 4:
        return None
    return b.call(F.adaptive_avg_pool2d, (x.node, 1), shape=(*x.shape[:2], 1, 1), lo=x.lo, hi=x.hi, contiguous=True)


# in place ------------------------------------------------------------------------------


def _inplace(name: str, method: str, make_args: Callable[[_Builder], tuple],
             transfer: Callable[[_Value, tuple], tuple[float, float]]) -> None:
    def build(b: _Builder, x: _Value) -> _Value | None:
        if not b.writable(x):
            return None
        args = make_args(b)
        lo, hi = transfer(x, args)
        result = b.call(method, (x.node, *args), shape=x.shape, lo=lo, hi=hi, op="call_method", alias=x)
        if result is not None:
            b.write(x, lo, hi)
        return result

    OPS[name] = build


_inplace("add_", "add_", lambda b: ([0.5, -1.0, 2.0][b.integer(0, 2)],), lambda x, a: (x.lo + a[0], x.hi + a[0]))
_inplace("mul_", "mul_", lambda b: ([0.5, -2.0, 1.5][b.integer(0, 2)],),
         lambda x, a: (min(x.lo * a[0], x.hi * a[0]), max(x.lo * a[0], x.hi * a[0])))
_inplace("relu_", "relu_", lambda b: (), lambda x, a: (max(x.lo, 0.0), max(x.hi, 0.0)))
_inplace("clamp_", "clamp_", lambda b: (-1.0, 1.0), lambda x, a: (max(min(x.lo, 1.0), -1.0), min(max(x.hi, -1.0), 1.0)))


# duplicates, for common-subexpression elimination to find ---------------------------


@_op("duplicate")
def _duplicate(b: _Builder, x: _Value) -> _Value | None:
    """Re-emit the node that computed ``x`` (same target and arguments)."""
    node = x.node
    if node.op not in ("call_function", "call_method") or str(node.target).endswith("_") or \
            not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    create = b.graph.call_method if node.op == "call_method" else b.graph.call_function
    copy = create(node.target, node.args, dict(node.kwargs))
    copy.meta["val"] = node.meta["val"]
    value = _Value(copy, x.shape, x.lo, x.hi, x.group if _aliases(b, x) else b.new_group(), x.contiguous)
    b.values.append(value)
    return value


def _aliases(b: _Builder, x: _Value) -> bool:
    """Whether ``x`` shares its storage with an input of its node (a view)."""
    sources = {v.group for v in b.values if v.node in x.node.all_input_nodes}
    return x.group in sources


#: every op kind ``fx_graphs`` can emit, simplest first (shrinking prefers earlier ones)
OP_KINDS: tuple[str, ...] = tuple(OPS)


# effects (opt in with ``fx_graphs(effects=True)``) ------------------------------------
# What real programs do and the equivalence of outputs alone does not see: writes into
# inputs and buffers, running statistics, random draws, calls with effects outside any
# tensor, custom ops that mutate, collectives. A pass must preserve all of them.

#: calls of :func:`logged_call`, in order: a wrapped function's effect outside tensors
CALL_LOG: list[float] = []


def logged_call(x: torch.Tensor) -> torch.Tensor:
    """An ``fx.wrap``'d function with an effect (it appends to :data:`CALL_LOG`)."""
    CALL_LOG.append(float(x.sum()))
    return x + 1.0


torch.fx.wrap("logged_call")

_FUZZ_LIB = torch.library.Library("fxopt_fuzz", "DEF")
_FUZZ_LIB.define("scale_(Tensor(a!) x, float s) -> ()")
_FUZZ_LIB.define("scale_.twice(Tensor(a!) x) -> ()")


def _scale_kernel(x: torch.Tensor, s: float = 2.0) -> None:
    x.mul_(s)


_FUZZ_LIB.impl("scale_", _scale_kernel, "CompositeExplicitAutograd")
_FUZZ_LIB.impl("scale_.twice", _scale_kernel, "CompositeExplicitAutograd")


@_op("batch_norm_train")
def _batch_norm_train(b: _Builder, x: _Value) -> _Value | None:
    if x.rank < 2 or x.numel // x.shape[1] < 2:
        return None  # training batch norm needs more than one value per channel
    c = x.shape[1]
    mean, var = b.constant((c,), -0.5, 0.5), b.constant((c,), 0.5, 2.0)
    out = math.sqrt(x.numel // c) + 0.2  # |(x - mean) / std| <= sqrt(n - 1)
    return b.call(F.batch_norm, (x.node, mean, var), {"training": True, "momentum": 0.1, "eps": 1e-3},
                  shape=x.shape, lo=-out, hi=out, inputs=[x])


@_op("dropout_train")
def _dropout_train(b: _Builder, x: _Value) -> _Value | None:
    return b.call(F.dropout, (x.node,), {"p": 0.5, "training": True}, shape=x.shape,
                  lo=min(2 * x.lo, 0.0), hi=max(2 * x.hi, 0.0), inputs=[x])


@_op("logged_call")
def _logged_call(b: _Builder, x: _Value) -> _Value | None:
    return b.call(logged_call, (x.node,), shape=x.shape, lo=x.lo + 1, hi=x.hi + 1, inputs=[x])


@_op("custom_op_write")
def _custom_op_write(b: _Builder, x: _Value) -> _Value | None:
    """A mutating custom op through its packet or an overload; its ``()`` result is unused."""
    if not b.writable(x) or x.bound * 2 > LIMIT:
        return None
    target = [torch.ops.fxopt_fuzz.scale_, torch.ops.fxopt_fuzz.scale_.default,
              torch.ops.fxopt_fuzz.scale_.twice][b.integer(0, 2)]
    args = (x.node,) if target is torch.ops.fxopt_fuzz.scale_.twice else (x.node, 2.0)
    node = b.graph.call_function(target, args)
    node.meta["val"] = None
    b.write(x, min(2 * x.lo, x.lo), max(2 * x.hi, x.hi))
    return x


@_op("input_write")
def _input_write(b: _Builder, x: _Value) -> _Value | None:
    """``x.add_(0.5)`` on a graph input or a buffer, directly or through a chain of views
    of one (a view shares its base's group): the caller sees the write."""
    targets = [v for v in b.values if v.group in b.external and v.group not in b.expanded]
    if not targets:
        return None
    target = b.pick(targets)
    result = b.call("add_", (target.node, 0.5), shape=target.shape, lo=target.lo + 0.5,
                    hi=target.hi + 0.5, op="call_method", alias=target)
    if result is not None:
        b.write(target, target.lo + 0.5, target.hi + 0.5)
    return result


@_op("buffer_write")
def _buffer_write(b: _Builder, x: _Value) -> _Value | None:
    """A buffer read, then written in place (a value constant folding must not freeze)."""
    data = (torch.rand(x.shape, generator=b.generator) - 0.5).to(b.dtype)
    node = b.constant(x.shape, data=data)
    buffer = _Value(node, x.shape, -0.5, 0.5, b.new_group())
    b.values.append(buffer)
    doubled = b.call(operator.mul, (node, 2.0), shape=x.shape, lo=-1.0, hi=1.0, inputs=[buffer])
    if doubled is None or x.bound > LIMIT - 1:
        return doubled
    b.call("add_", (node, x.node), shape=x.shape, lo=-0.5 + x.lo, hi=0.5 + x.hi, op="call_method",
           alias=buffer)
    b.write(buffer, -0.5 + min(x.lo, 0.0), 0.5 + max(x.hi, 0.0))
    return doubled


def single_process_group() -> str | None:
    """The name of a one-rank gloo process group (created on first use), or None where
    torch.distributed is unavailable: enough to put real collectives in a graph."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD.group_name


@_op("all_reduce")
def _all_reduce(b: _Builder, x: _Value) -> _Value | None:
    group = single_process_group()
    if group is None:
        return None
    c10d = torch.ops._c10d_functional
    reduced = b.call(c10d.all_reduce.default, (x.node, "sum", group), shape=x.shape, lo=x.lo,
                     hi=x.hi, inputs=[x])
    if reduced is None:
        return None
    return b.call(c10d.wait_tensor.default, (reduced.node,), shape=x.shape, lo=x.lo, hi=x.hi,
                  alias=reduced)


#: the effectful op kinds (not in :data:`OP_KINDS`: graphs with them are not pure functions)
EFFECT_KINDS: tuple[str, ...] = tuple(k for k in OPS if k not in OP_KINDS)


# --- strategies -------------------------------------------------------------------------


_SEED = st.integers(0, 2**16)


def build_graph(choices: bytes, seed: int = 0, *, dtype: torch.dtype = torch.float32,
                ops: Iterable[str] | None = None, max_inputs: int = 3) -> fx.GraphModule:
    """The graph that ``choices`` describe: the first ``_CHUNK`` bytes choose the inputs,
    each further chunk one op. Deterministic; :func:`fx_graphs` draws the bytes.

    ``gm.meta['fxopt.op_kinds']`` lists the op kind each chunk became (``relu`` where the
    drawn kind did not apply).
    """
    kinds = list(OP_KINDS if ops is None else ops)
    unknown = sorted(set(kinds) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op kinds {unknown}; known: {', '.join(OPS)}")
    b = _Builder(choices, dtype, seed)
    b.start_op(0)
    for _ in range(b.integer(1, max_inputs)):
        b.placeholder(tuple(b.integer(1, 6) for _ in range(b.integer(1, 4))))
    applied = []
    for index in range(1, max(len(choices) // _CHUNK, 1)):
        b.start_op(index)
        kind = kinds[b.integer(0, len(kinds) - 1)]
        operand = b.values[-1] if not b.flag() else b.pick(b.values)
        if OPS[kind](b, operand) is None:
            kind = "relu"
            OPS[kind](b, operand)
        applied.append(kind)
    sinks = [v for v in b.values if not v.node.users and v.node.op != "placeholder"]
    dead = random.Random(seed)  # which unused values stay dead code (for dce to find)
    outputs = [sinks[-1]] + [v for v in sinks[:-1] if dead.random() < 0.7] if sinks else [b.values[0]]
    b.graph.output(tuple(v.node for v in outputs))
    gm = fx.GraphModule(b.root, b.graph)
    gm.meta["fxopt.op_kinds"] = applied
    return gm


@st.composite
def fx_graphs(draw: Callable[[st.SearchStrategy], Any], min_ops: int = 1, max_ops: int = 20, *,
              dtype: torch.dtype = torch.float32, ops: Iterable[str] | None = None,
              max_inputs: int = 3, effects: bool = False) -> fx.GraphModule:
    """Random valid GraphModules of ``min_ops``..``max_ops`` ops drawn from ``ops``
    (default: all of :data:`OP_KINDS`, plus :data:`EFFECT_KINDS` with ``effects=True``)
    over 1..``max_inputs`` inputs of ``dtype``.

    Outputs are a tuple of some of the values nothing else uses (the rest is dead code
    on purpose); parameters are buffers read with ``get_attr``. Draw inputs with
    :func:`inputs_for`.
    """
    if ops is None and effects:
        ops = OP_KINDS + EFFECT_KINDS
    if ops is not None:
        unknown = sorted(set(ops) - set(OPS))
        if unknown:
            raise ValueError(f"unknown op kinds {unknown}; known: {', '.join(OPS)}")
    choices = draw(st.binary(min_size=_CHUNK * (min_ops + 1), max_size=_CHUNK * (max_ops + 1)))
    return build_graph(choices, draw(_SEED), dtype=dtype, ops=ops, max_inputs=max_inputs)


def inputs_for(gm: fx.GraphModule) -> st.SearchStrategy[tuple[Any, ...]]:
    """Finite inputs for ``gm``, drawn from its placeholders' ``meta['val']``; raises
    :class:`~fxopt.errors.InputError` naming the placeholder when that is impossible."""
    specs = input_specs(gm)

    def make(seed: int) -> tuple[Any, ...]:
        generator = torch.Generator().manual_seed(seed)
        return tuple(spec.make(generator) for spec in specs)

    return st.integers(0, 2**32 - 1).map(make)


def pipelines(passes: Sequence[str] | None = None, min_size: int = 1,
              max_size: int = 4) -> st.SearchStrategy[list[str]]:
    """Lists of registered pass names (default: every registered pass), for properties
    of pass order: idempotence (``p`` then ``p`` equals ``p``), commutation, and
    equivalence of every pipeline."""
    if passes is None:
        from fxopt.registry import registered_passes

        passes = sorted(registered_passes())
    return st.lists(st.sampled_from(list(passes)), min_size=min_size, max_size=max_size)
