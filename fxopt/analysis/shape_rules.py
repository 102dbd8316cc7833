"""Shapes without a fake mode: fxopt's own rules for the ops of conv nets, MLPs and transformers.

Why: torch's ``FakeTensorMode()`` imports ``torch._dynamo`` in its constructor, and so do
torch's Python meta kernels (``add``, ``relu``, ``mean``, ``cat`` on meta tensors run refs
wrapped in ``torch._disable_dynamo``); the first meta convolution imports sympy. That is
about a second of CPU, which the first ``fxopt.optimize`` of a process paid for its shapes
alone (bench/startup.py). For a graph made only of the ops below, :func:`evaluate` gives
each node the value a FakeTensor run would give it, as a ``meta``-device tensor made by
C++ code only (``torch.empty_strided``, ``view``, ``expand``): the same shape, strides,
dtype and storage offset, and the same storage sharing (a view is a view of its input's
meta tensor; an op that returns its input returns that very tensor). The one difference
is the device: values are on ``meta``, and the real device is the graph's one device
(:class:`Env`), which the rules use where torch's answer depends on it.

Every rule is a second source of truth for what torch computes, so
``tests/analysis/test_shape_rules.py`` checks each one against FakeTensor propagation on
random shapes, strides, dtypes and arguments. A rule that is not sure of torch's answer
(a layout it does not model, an argument form it does not know, inputs torch would
reject) raises :class:`NoRule`, and the caller propagates the whole graph with
FakeTensors instead, which also gives torch's own error for bad inputs.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Env", "NoRule", "evaluate", "meta_copy"]


class NoRule(Exception):
    """This op, or this call of it, has no rule here: propagate with FakeTensors."""


@dataclass(frozen=True)
class Env:
    """What the rules know beyond their arguments: the one device of the graph's tensors."""

    device: torch.device


_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_DTYPES = _FLOATING | {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
_CL = torch.channels_last


def _require(condition: bool, why: str) -> None:
    if not condition:
        raise NoRule(why)


def _tensor(env: Env, t: Any) -> torch.Tensor:
    """``t`` if it is a tensor the rules model: a plain, non-empty strided tensor of a real
    dtype, on the graph's device (or a meta value of this propagation)."""
    _require(type(t) in (torch.Tensor, nn.Parameter), "not a plain tensor")
    _require(t.layout is torch.strided and not t.is_quantized and not t.is_nested, "not a strided tensor")
    _require(t.device.type == "meta" or t.device == env.device, "a tensor on another device")
    _require(t.dtype in _DTYPES and not t.is_conj() and not t.is_neg(), "an unmodelled dtype")
    _require(t.numel() > 0, "an empty tensor")
    if 1 in t.shape:
        # torch's kernels disagree on the strides of size-1 dims unless they are contiguous
        # ones, or channels-last ones of a tensor that is not contiguous as well (otherwise
        # which of the two layouts an output takes depends on the kernel's path)
        strides = t.stride()
        _require(strides == contiguous_strides(t.shape) or
                 (t.dim() == 4 and strides == _channels_last_strides(t.shape) and not t.is_contiguous()),
                 "odd strides of a size-1 dim")
    return t


def _maybe_tensor(env: Env, t: Any) -> torch.Tensor | None:
    return None if t is None else _tensor(env, t)


def meta_copy(env: Env, t: Any) -> torch.Tensor:
    """A meta tensor with the shape, strides, dtype and ``requires_grad`` of the real tensor
    ``t`` (what ``FakeTensorMode.from_tensor`` keeps): a plain tensor of the graph's device
    with storage offset 0."""
    _tensor(env, t)
    _require(not t.is_meta and t.storage_offset() == 0, "a meta tensor, or one with a storage offset")
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta",
                               requires_grad=t.requires_grad)


def _fresh(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _channels_last_strides(shape: Sequence[int]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _contiguous(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return _fresh(shape, contiguous_strides(shape), dtype)


def _is_channels_last(t: torch.Tensor) -> bool:
    """``suggest_memory_format(t) == channels_last`` (torch's stride heuristic) for 4-d
    tensors; 5-d ones must be contiguous (channels-last-3d heuristics are not modelled)."""
    _require(t.dim() != 5 or t.is_contiguous(), "a non-contiguous 5-d tensor")
    if t.dim() != 4:
        return False
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    smallest = 0
    for d in (1, 3, 2, 0):
        if strides[d] < smallest:
            return False
        if d == 0 and smallest == strides[1]:
            return False
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _dense_layout(t: torch.Tensor) -> torch.memory_format:
    """The memory format of a contiguous or channels-last tensor (others are refused)."""
    if t.is_contiguous():
        return torch.contiguous_format
    _require(t.dim() == 4 and t.is_contiguous(memory_format=_CL), "a layout neither contiguous nor channels-last")
    return _CL


def _like(t: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, layout: torch.memory_format) -> torch.Tensor:
    if layout is _CL and len(shape) == 4:
        return _fresh(shape, _channels_last_strides(shape), dtype)
    return _contiguous(shape, dtype)


# --- elementwise: broadcasting, type promotion, TensorIterator's output strides ---------

def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            if size != 1:
                _require(out[i] in (1, size), "shapes that do not broadcast")
                out[i] = size
    return tuple(out)


def _dense_strides(t: torch.Tensor) -> bool:
    """torch's ``is_non_overlapping_and_dense`` for concrete sizes."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=_CL)):
        return True
    if t.dim() == 1:
        return t.stride(0) == 1
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=operator.itemgetter(1)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _elementwise(env: Env, operands: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor for an elementwise op of ``operands`` (tensors and Python numbers), laid
    out as torch lays it out where that is certain: TensorIterator's fast setups for one
    tensor (contiguous, channels-last, any other dense layout), and FakeTensor's fast
    binary path for several (all contiguous, or all channels-last, one of full shape;
    a number stands for a 0-d tensor, which is contiguous only). Other layouts are
    refused."""
    tensors = [_tensor(env, t) for t in operands if isinstance(t, torch.Tensor)]
    _require(bool(tensors), "no tensor operand")
    shape = _broadcast(*(t.shape for t in tensors))
    if len(operands) == 1:
        (x,) = tensors
        if x.is_contiguous():
            return _contiguous(shape, dtype)
        if x.dim() == 4 and x.is_contiguous(memory_format=_CL):
            return _fresh(shape, _channels_last_strides(shape), dtype)
        _require(_dense_strides(x), "a layout with gaps or overlaps")
        return _fresh(shape, x.stride(), dtype)
    _require(any(tuple(t.shape) == shape for t in tensors), "operands that all broadcast")
    if all(t.is_contiguous() for t in tensors):
        return _contiguous(shape, dtype)
    _require(len(tensors) == len(operands) and len(shape) == 4
             and all(t.is_contiguous(memory_format=_CL) for t in tensors), "operands of mixed layouts")
    return _fresh(shape, _channels_last_strides(shape), dtype)


def _number(x: Any) -> bool:
    return type(x) in (int, float, bool)


def _operand(env: Env, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _tensor(env, x)
    _require(_number(x), "an operand that is neither a tensor nor a number")
    return x


def _promoted(a: Any, b: Any, *, to_float: bool = False) -> torch.dtype:
    """Type promotion of two operands (``torch.result_type``, C++); ``to_float`` for true
    division, whose integer results become the default float dtype."""
    _require(isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor), "no tensor operand")
    dtype = torch.result_type(a, b)
    if to_float and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    _require(dtype in _DTYPES, "an unmodelled result dtype")
    return dtype


def _arith(name: str) -> Callable[..., Any]:
    """``add``/``sub`` (with ``alpha``), ``mul``, ``div`` (true division only): FakeTensor's
    fast binary ops."""
    def rule(env: Env, input: Any, other: Any, *, alpha: Any = 1, rounding_mode: Any = None) -> torch.Tensor:  # noqa: A002
        a, b = _operand(env, input), _operand(env, other)
        dtype = _promoted(a, b, to_float=name == "div")
        _require(dtype is not torch.bool or name in ("add", "mul"), f"{name} of booleans")
        _require(alpha == 1 or (name in ("add", "sub") and _number(alpha)
                                and (dtype.is_floating_point or type(alpha) is int)), "an unmodelled alpha")
        _require(rounding_mode is None, "division with a rounding mode")
        return _elementwise(env, (a, b), dtype)
    return rule


def _inplace_binary(rule: Callable[..., Any]) -> Callable[..., Any]:
    """``a += b`` and ``a.add_(b)``: ``a`` itself, when the result fits it."""
    def inplace(env: Env, input: Any, other: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002
        _require(isinstance(input, torch.Tensor), "an in-place op on a number")
        out = rule(env, input, other, **kwargs)
        _require(tuple(out.shape) == tuple(input.shape), "an in-place result of another shape")
        _require(torch.can_cast(out.dtype, input.dtype), "an in-place result of another dtype")
        return input
    return inplace


def _activation(env: Env, input: Any, inplace: Any = False, *scalars: Any) -> torch.Tensor:  # noqa: A002
    """An elementwise op of one floating-point tensor that keeps its dtype; ``inplace=True``
    returns the input itself."""
    x = _tensor(env, input)
    _require(x.dtype in _FLOATING, "an unmodelled dtype")
    _require(all(_number(v) for v in scalars) and type(inplace) is bool, "an unmodelled argument")
    return x if inplace else _elementwise(env, (x,), x.dtype)


def relu(env: Env, input: Any, inplace: Any = False) -> torch.Tensor:  # noqa: A002
    """``relu``, and every activation whose only other argument is ``inplace`` (``relu6``,
    ``silu``, ``hardswish``, ``hardsigmoid``, and ``sigmoid``/``tanh`` without it)."""
    return _activation(env, input, inplace)


def hardtanh(env: Env, input: Any, min_val: Any = -1.0, max_val: Any = 1.0, inplace: Any = False) -> torch.Tensor:  # noqa: A002
    return _activation(env, input, inplace, min_val, max_val)


def leaky_relu(env: Env, input: Any, negative_slope: Any = 0.01, inplace: Any = False) -> torch.Tensor:  # noqa: A002
    return _activation(env, input, inplace, negative_slope)


def elu(env: Env, input: Any, alpha: Any = 1.0, inplace: Any = False) -> torch.Tensor:  # noqa: A002
    return _activation(env, input, inplace, alpha)


def gelu(env: Env, input: Any, approximate: str = "none") -> torch.Tensor:  # noqa: A002
    _require(approximate in ("none", "tanh"), "an unknown gelu approximation")
    return _activation(env, input)


def _inplace(rule: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.relu_(x)``, ``x.relu_()``: the input itself."""
    def inplace(env: Env, input: Any, *args: Any) -> torch.Tensor:  # noqa: A002
        return rule(env, input, *args, inplace=True)
    return inplace


# --- convolution ------------------------------------------------------------------------

def _ints(value: Any, n: int, what: str) -> list[int]:
    if type(value) is int:
        return [value] * n
    _require(isinstance(value, (list, tuple, torch.Size)) and all(type(v) is int for v in value), f"a {what} of non-ints")
    values = list(value)
    if len(values) == 1:
        values *= n
    _require(len(values) == n, f"a {what} of the wrong length")
    return values


def convolution(env: Env, input: Any, weight: Any, bias: Any, stride: Any, padding: Any,  # noqa: A002
                dilation: Any, transposed: bool, output_padding: Any, groups: int) -> torch.Tensor:
    """``aten.convolution``: the output of every backend is contiguous when neither input
    nor weight is channels-last (channels-last formats depend on the backend torch picks:
    refused)."""
    x, w, b = _tensor(env, input), _tensor(env, weight), _maybe_tensor(env, bias)
    _require(w.dim() in (3, 4, 5) and x.dim() == w.dim(), "an unbatched or mismatched convolution")
    _require(x.dtype in _FLOATING and x.dtype == w.dtype and (b is None or b.dtype == x.dtype), "mixed dtypes")
    _require(not _is_channels_last(x) and not _is_channels_last(w), "a channels-last convolution")
    _require(type(groups) is int and groups > 0 and type(transposed) is bool, "bad groups")
    spatial = w.dim() - 2
    stride, dilation = _ints(stride, spatial, "stride"), _ints(dilation, spatial, "dilation")
    padding, output_padding = _ints(padding, spatial, "padding"), _ints(output_padding, spatial, "output padding")
    _require(min(stride) > 0 and min(dilation) > 0 and min(padding) >= 0 and min(output_padding) >= 0, "bad geometry")
    kernel = w.shape[2:]
    if transposed:
        _require(x.shape[1] == w.shape[0] and w.shape[0] % groups == 0, "channels that do not match")
        out_channels = w.shape[1] * groups
        _require(all(op < max(s, d) for op, s, d in zip(output_padding, stride, dilation)), "bad output padding")
        sizes = [(n - 1) * s - 2 * p + d * (k - 1) + op + 1
                 for n, k, s, p, d, op in zip(x.shape[2:], kernel, stride, padding, dilation, output_padding)]
    else:
        _require(x.shape[1] == w.shape[1] * groups and w.shape[0] % groups == 0, "channels that do not match")
        out_channels = w.shape[0]
        sizes = [(n + 2 * p - d * (k - 1) - 1) // s + 1
                 for n, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation)]
        _require(all(n + 2 * p >= d * (k - 1) + 1 for n, k, p, d in zip(x.shape[2:], kernel, padding, dilation)),
                 "a kernel larger than the padded input")
    _require(b is None or tuple(b.shape) == (out_channels,), "a bias of the wrong shape")
    _require(all(n > 0 for n in sizes), "an empty output")
    return _contiguous((x.shape[0], out_channels, *sizes), x.dtype)


def _conv(spatial: int, transposed: bool = False) -> Callable[..., Any]:
    """``F.conv{1,2,3}d`` / ``F.conv_transpose{1,2,3}d`` in terms of :func:`convolution`."""
    if transposed:
        def conv_transpose(env: Env, input: Any, weight: Any, bias: Any = None, stride: Any = 1,  # noqa: A002
                           padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                           dilation: Any = 1) -> torch.Tensor:
            _require(_tensor(env, weight).dim() == spatial + 2, "a weight of the wrong rank")
            return convolution(env, input, weight, bias, stride, padding, dilation, True, output_padding, groups)
        return conv_transpose

    def conv(env: Env, input: Any, weight: Any, bias: Any = None, stride: Any = 1,  # noqa: A002
             padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor:
        w = _tensor(env, weight)
        _require(w.dim() == spatial + 2, "a weight of the wrong rank")
        if padding == "valid":
            padding = 0
        elif padding == "same":  # torch pads the input (one more on the right where the total is odd)
            _require(all(s == 1 for s in _ints(stride, spatial, "stride")), "padding='same' with a stride")
            dil = _ints(dilation, spatial, "dilation")
            padded = convolution(env, input, weight, bias, stride, [(d * (k - 1) + 1) // 2 for d, k in
                                                                    zip(dil, w.shape[2:])], dilation, False, 0, groups)
            return _contiguous((*padded.shape[:2], *_tensor(env, input).shape[2:]), padded.dtype)
        return convolution(env, input, weight, bias, stride, padding, dilation, False, 0, groups)
    return conv


# --- normalization, pooling, linear algebra, reductions ---------------------------------

def batch_norm(env: Env, input: Any, running_mean: Any, running_var: Any, weight: Any = None,  # noqa: A002
               bias: Any = None, training: bool = False, momentum: Any = 0.1, eps: Any = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` in inference (``training=False``, running statistics given)."""
    _require(training is False, "batch norm in training")
    x = _tensor(env, input)
    _require(x.dim() >= 2 and x.dtype in _FLOATING, "an unmodelled batch norm input")
    _require(running_mean is not None and running_var is not None, "batch norm without running statistics")
    for t in (running_mean, running_var, weight, bias):
        if t is not None:
            t = _tensor(env, t)
            _require(tuple(t.shape) == (x.shape[1],) and t.dtype in _FLOATING, "statistics of the wrong shape")
    if env.device.type == "cuda":
        # cuDNN's kernel, which CUDA picks for most inputs, lays its output out by
        # suggest_memory_format (contiguous or channels-last), not by the input's strides:
        # only the layouts where both kernels agree are modelled
        return _like(x, x.shape, x.dtype, _dense_layout(x))
    _require(_dense_strides(x), "a layout with gaps or overlaps")
    return _fresh(x.shape, x.stride(), x.dtype)  # empty_like: the input's own strides


def _pool_size(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's ``pooling_output_shape``."""
    size = (n + 2 * p - d * (k - 1) - 1 + ((s - 1) if ceil_mode else 0)) // s + 1
    if ceil_mode and (size - 1) * s >= n + p:
        size -= 1
    return size


def _pool(env: Env, input: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any,  # noqa: A002
          ceil_mode: Any) -> torch.Tensor:
    x = _tensor(env, input)
    _require(x.dim() == 4 and x.dtype in _FLOATING, "an unmodelled pooling input")
    kernel = _ints(kernel_size, 2, "kernel size")
    stride = kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _ints(stride, 2, "stride")
    padding, dilation = _ints(padding, 2, "padding"), _ints(dilation, 2, "dilation")
    _require(type(ceil_mode) is bool and min(kernel) > 0 and min(stride) > 0 and min(dilation) > 0, "bad geometry")
    _require(all(0 <= p <= k // 2 for p, k in zip(padding, kernel)), "padding beyond half the kernel")
    sizes = [_pool_size(n, k, s, p, d, ceil_mode)
             for n, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation)]
    _require(all(n > 0 for n in sizes), "an empty output")
    return _like(x, (*x.shape[:2], *sizes), x.dtype, _dense_layout(x))


def max_pool2d(env: Env, input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,  # noqa: A002
               dilation: Any = 1, ceil_mode: bool = False, return_indices: bool = False) -> torch.Tensor:
    _require(return_indices is False, "max pooling with indices")
    return _pool(env, input, kernel_size, stride, padding, dilation, ceil_mode)


def avg_pool2d(env: Env, input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,  # noqa: A002
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Any = None) -> torch.Tensor:
    _require(divisor_override is None or type(divisor_override) is int, "a bad divisor")
    return _pool(env, input, kernel_size, stride, padding, 1, ceil_mode)


def adaptive_avg_pool2d(env: Env, input: Any, output_size: Any) -> torch.Tensor:  # noqa: A002
    x = _tensor(env, input)
    _require(x.dim() == 4 and x.dtype in _FLOATING and x.is_contiguous(), "an unmodelled pooling input")
    if type(output_size) is int:
        output_size = (output_size, output_size)
    _require(isinstance(output_size, (list, tuple)) and len(output_size) == 2, "a bad output size")
    sizes = [n if s is None else s for n, s in zip(x.shape[2:], output_size)]
    _require(all(type(s) is int and s > 0 for s in sizes), "a bad output size")
    return _contiguous((*x.shape[:2], *sizes), x.dtype)


def linear(env: Env, input: Any, weight: Any, bias: Any = None) -> torch.Tensor:  # noqa: A002
    x, w, b = _tensor(env, input), _tensor(env, weight), _maybe_tensor(env, bias)
    _require(x.dim() >= 1 and w.dim() == 2 and x.shape[-1] == w.shape[1], "shapes that do not multiply")
    _require(x.dtype in _FLOATING and x.dtype == w.dtype and (b is None or b.dtype == x.dtype), "mixed dtypes")
    _require(b is None or tuple(b.shape) == (w.shape[0],), "a bias of the wrong shape")
    _require(x.is_contiguous(), "a non-contiguous input")
    return _contiguous((*x.shape[:-1], w.shape[0]), x.dtype)


def mm(env: Env, input: Any, mat2: Any) -> torch.Tensor:  # noqa: A002
    a, b = _tensor(env, input), _tensor(env, mat2)
    _require(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], "shapes that do not multiply")
    _require(a.dtype in _FLOATING and a.dtype == b.dtype, "mixed dtypes")
    return _contiguous((a.shape[0], b.shape[1]), a.dtype)


def _dims(value: Any, ndim: int) -> list[int]:
    dims = [value] if type(value) is int else value
    _require(isinstance(dims, (list, tuple)) and all(type(d) is int for d in dims), "dims that are not ints")
    _require(all(-max(ndim, 1) <= d < max(ndim, 1) for d in dims), "a dim out of range")
    out = [d % max(ndim, 1) for d in dims]
    _require(len(set(out)) == len(out), "a repeated dim")
    return out


def _reduction(*, mean: bool) -> Callable[..., Any]:
    def rule(env: Env, input: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:  # noqa: A002
        x = _tensor(env, input)
        _require(x.is_contiguous() and type(keepdim) is bool, "an unmodelled reduction")
        _require(dtype is None or dtype in _DTYPES, "an unmodelled dtype")
        if dtype is not None:
            out_dtype = dtype
        elif mean:
            _require(x.dtype in _FLOATING, "mean of integers")
            out_dtype = x.dtype
        else:
            out_dtype = x.dtype if x.dtype in _FLOATING else torch.int64
        _require(not mean or out_dtype in _FLOATING, "mean to a non-float dtype")
        dims = list(range(x.dim())) if dim is None or (isinstance(dim, (list, tuple)) and not dim) \
            else _dims(dim, x.dim())
        shape = [1 if i in dims else n for i, n in enumerate(x.shape) if keepdim or i not in dims]
        return _contiguous(shape, out_dtype)
    return rule


def cat(env: Env, tensors: Any, dim: int = 0) -> torch.Tensor:
    _require(isinstance(tensors, (list, tuple)) and len(tensors) > 0, "cat of no tensors")
    ts = [_tensor(env, t) for t in tensors]
    first = ts[0]
    _require(all(t.dim() == first.dim() and t.dtype == first.dtype for t in ts), "mixed ranks or dtypes")
    _require(all(t.is_contiguous() for t in ts), "a non-contiguous input")
    (d,) = _dims(dim, first.dim())
    _require(all(t.shape[:d] == first.shape[:d] and t.shape[d + 1:] == first.shape[d + 1:] for t in ts),
             "shapes that do not concatenate")
    shape = list(first.shape)
    shape[d] = sum(t.shape[d] for t in ts)
    return _contiguous(shape, first.dtype)


# --- views and casts ---------------------------------------------------------------------

def _view_of(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A view of the contiguous meta value ``x`` (``Tensor.view``, C++ on meta tensors)."""
    _require(x.device.type == "meta" and x.is_contiguous(), "a view of a non-contiguous value")
    with torch.no_grad():
        return x.view(tuple(shape))


def _resolved(shape: Sequence[int], numel: int) -> list[int]:
    _require(all(type(s) is int for s in shape), "a shape of non-ints")
    sizes = list(shape)
    unknown = [i for i, s in enumerate(sizes) if s == -1]
    _require(len(unknown) <= 1 and all(s > 0 or s == -1 for s in sizes), "a bad shape")
    known = 1
    for s in sizes:
        known *= s if s != -1 else 1
    if unknown:
        _require(numel % known == 0, "a shape that does not fit")
        sizes[unknown[0]] = numel // known
    _require(known * (sizes[unknown[0]] if unknown else 1) == numel, "a shape that does not fit")
    return sizes


def view(env: Env, input: Any, *shape: Any) -> torch.Tensor:  # noqa: A002
    """``x.view(2, -1)``, ``x.view((2, -1))``, ``x.reshape(...)``, ``torch.reshape(x, shape)``
    of a contiguous value: a view."""
    x = _tensor(env, input)
    if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
        shape = tuple(shape[0])
    return _view_of(x, _resolved(shape, x.numel()))


def flatten(env: Env, input: Any, start_dim: int = 0, end_dim: int = -1) -> torch.Tensor:  # noqa: A002
    x = _tensor(env, input)
    _require(x.dim() > 0, "flatten of a 0-d tensor")
    start, end = _dims(start_dim, x.dim())[0], _dims(end_dim, x.dim())[0]
    _require(start <= end, "flatten with start after end")
    if start == end:
        return x  # torch returns the input itself
    merged = 1
    for n in x.shape[start:end + 1]:
        merged *= n
    return _view_of(x, (*x.shape[:start], merged, *x.shape[end + 1:]))


def _cast(dtype: torch.dtype) -> Callable[..., Any]:
    def cast(env: Env, input: Any, memory_format: Any = torch.preserve_format) -> torch.Tensor:  # noqa: A002
        return _to(env, input, dtype, memory_format=memory_format)
    return cast


def _to(env: Env, x: Any, dtype: Any, *, memory_format: Any = torch.preserve_format, copy: bool = False,
        non_blocking: bool = False) -> torch.Tensor:
    x = _tensor(env, x)
    _require(dtype in _DTYPES and memory_format is torch.preserve_format and copy is False
             and type(non_blocking) is bool, "an unmodelled cast")
    if dtype == x.dtype:
        return x  # torch returns the input itself
    return _like(x, x.shape, dtype, _dense_layout(x))


def to(env: Env, input: Any, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002
    """``x.to(dtype)`` / ``x.to(dtype=...)``; moves to a device are refused."""
    if args:
        _require(len(args) == 1 and isinstance(args[0], torch.dtype) and "dtype" not in kwargs, "a move")
        kwargs["dtype"] = args[0]
    _require("dtype" in kwargs and set(kwargs) <= {"dtype", "memory_format", "copy", "non_blocking"}, "a move")
    return _to(env, input, **kwargs)


def contiguous(env: Env, input: Any, memory_format: Any = torch.contiguous_format) -> torch.Tensor:  # noqa: A002
    x = _tensor(env, input)
    _require(memory_format is torch.contiguous_format, "an unmodelled memory format")
    return x if x.is_contiguous() else _contiguous(x.shape, x.dtype)


def dropout(env: Env, input: Any, p: Any = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:  # noqa: A002
    """Dropout in inference returns its input itself."""
    _require(training is False and _number(p) and type(inplace) is bool, "dropout in training")
    return _tensor(env, input)


def size(env: Env, input: Any, dim: Any = None) -> Any:  # noqa: A002
    x = _tensor(env, input)
    return x.shape if dim is None else x.shape[_dims(dim, x.dim())[0]]


def dim(env: Env, input: Any) -> int:  # noqa: A002
    return _tensor(env, input).dim()


def _getattr(env: Env, obj: Any, name: Any) -> Any:
    _require(isinstance(obj, torch.Tensor) and name in ("shape", "ndim", "dtype"), "an unmodelled attribute")
    return getattr(_tensor(env, obj), name)


def _getitem(env: Env, obj: Any, index: Any) -> Any:
    _require(type(obj) in (tuple, torch.Size) and type(index) is int, "indexing a tensor")
    return obj[index]


# --- transformers: matmuls, norms, attention, softmax, embeddings, views ---------------

def matmul(env: Env, input: Any, other: Any) -> torch.Tensor:  # noqa: A002
    """``torch.matmul`` of operands of two or more dims: torch folds or batches them into
    ``mm``/``bmm``, whose outputs are contiguous. A matrix times a batch is refused (torch
    computes it transposed, with transposed strides)."""
    a, b = _tensor(env, input), _tensor(env, other)
    _require(a.dim() >= 2 and b.dim() >= 2 and (a.dim() >= b.dim() or a.dim() >= 3), "an unmodelled matmul rank")
    _require(a.dtype in _FLOATING and a.dtype == b.dtype, "mixed dtypes")
    _require(a.shape[-1] == b.shape[-2], "shapes that do not multiply")
    batch = _broadcast(a.shape[:-2], b.shape[:-2])
    return _contiguous((*batch, a.shape[-2], b.shape[-1]), a.dtype)


def bmm(env: Env, input: Any, mat2: Any) -> torch.Tensor:  # noqa: A002
    a, b = _tensor(env, input), _tensor(env, mat2)
    _require(a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1],
             "shapes that do not multiply")
    _require(a.dtype in _FLOATING and a.dtype == b.dtype, "mixed dtypes")
    return _contiguous((a.shape[0], a.shape[1], b.shape[2]), a.dtype)


def _normalized(env: Env, x: torch.Tensor, normalized_shape: Any, *affine: Any) -> None:
    """Checks of a layer or RMS norm: the trailing dims and the affine tensors' shapes."""
    shape = [normalized_shape] if type(normalized_shape) is int else normalized_shape
    _require(isinstance(shape, (list, tuple, torch.Size)) and all(type(n) is int for n in shape), "a bad shape")
    _require(0 < len(shape) <= x.dim() and tuple(x.shape[x.dim() - len(shape):]) == tuple(shape),
             "a normalized shape that does not end the input's")
    for t in affine:
        if t is not None:
            t = _tensor(env, t)
            _require(tuple(t.shape) == tuple(shape) and t.dtype == x.dtype, "an affine tensor of the wrong shape")


def layer_norm(env: Env, input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,  # noqa: A002
               eps: Any = 1e-5, cudnn_enable: Any = True) -> torch.Tensor:
    """``F.layer_norm`` and ``aten.layer_norm`` of a contiguous input: a contiguous output."""
    x = _tensor(env, input)
    _require(x.dtype in _FLOATING and x.is_contiguous() and _number(eps), "an unmodelled layer norm input")
    _normalized(env, x, normalized_shape, weight, bias)
    return _contiguous(x.shape, x.dtype)


def rms_norm(env: Env, input: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> torch.Tensor:  # noqa: A002
    x = _tensor(env, input)
    _require(x.dtype in _FLOATING and x.is_contiguous() and (eps is None or _number(eps)),
             "an unmodelled RMS norm input")
    _normalized(env, x, normalized_shape, weight)
    return _contiguous(x.shape, x.dtype)


def softmax(env: Env, input: Any, dim: Any, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:  # noqa: A002
    """``softmax``/``log_softmax`` over a given dim of a contiguous floating-point input."""
    x = _tensor(env, input)
    _require(x.dtype in _FLOATING and x.is_contiguous(), "an unmodelled softmax input")
    _require(dtype is None or dtype in _FLOATING, "an unmodelled dtype")
    _dims(dim, x.dim())
    return _contiguous(x.shape, x.dtype if dtype is None else dtype)


def _aten_softmax(env: Env, input: Any, dim: Any, half_to_float: Any) -> torch.Tensor:  # noqa: A002
    _require(half_to_float is False, "softmax to float")
    return softmax(env, input, dim)


def _tensor_softmax(env: Env, input: Any, dim: Any, dtype: Any = None) -> torch.Tensor:  # noqa: A002
    return softmax(env, input, dim, dtype=dtype)


def scaled_dot_product_attention(env: Env, query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: Any = 0.0, is_causal: Any = False, scale: Any = None,
                                 enable_gqa: Any = False) -> torch.Tensor:
    """SDPA without a mask or dropout, on the CPU: FakeTensor propagation runs the math
    path's decomposition (whatever kernel the real tensors would pick), whose output is laid
    out like the query. Other devices are refused: their kernel choice, and so the layout, differs."""
    q, k, v = _tensor(env, query), _tensor(env, key), _tensor(env, value)
    _require(env.device.type == "cpu", "attention off the CPU")
    _require(attn_mask is None and dropout_p == 0.0 and enable_gqa is False and type(is_causal) is bool
             and (scale is None or _number(scale)), "an unmodelled attention call")
    _require(q.dtype in _FLOATING and q.dtype == k.dtype == v.dtype, "mixed dtypes")
    _require(q.dim() >= 3 and q.dim() == k.dim() == v.dim(), "an unmodelled rank")
    _require(q.shape[:-2] == k.shape[:-2] == v.shape[:-2], "batch dims that differ")
    _require(q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2], "shapes that do not attend")
    shape = (*q.shape[:-1], v.shape[-1])
    if q.is_contiguous():
        return _contiguous(shape, q.dtype)
    # heads transposed in all three ((b, h, l, e) over (b, l, h, e), as transformers make
    # them): the decomposition's output is laid out like the query
    _require(v.shape[-1] == q.shape[-1] and all(_dense_strides(t) and t.stride(-1) == 1 and
                                                _stride_order(t) == _stride_order(q) for t in (q, k, v)),
             "an unmodelled layout")
    return _fresh(shape, q.stride(), q.dtype)


def _stride_order(t: torch.Tensor) -> list[int]:
    """The dims from outermost to innermost (ties by position)."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def embedding(env: Env, input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None,  # noqa: A002
              norm_type: Any = 2.0, scale_grad_by_freq: Any = False, sparse: Any = False) -> torch.Tensor:
    """``F.embedding``: rows of ``weight`` gathered into a new contiguous tensor."""
    idx, w = _tensor(env, input), _tensor(env, weight)
    _require(idx.dtype in (torch.int64, torch.int32) and w.dim() == 2 and max_norm is None, "an unmodelled embedding")
    _require(padding_idx is None or type(padding_idx) is int, "a bad padding index")
    return _contiguous((*idx.shape, w.shape[1]), w.dtype)


def _aten_embedding(env: Env, weight: Any, indices: Any, padding_idx: Any = -1, scale_grad_by_freq: Any = False,
                    sparse: Any = False) -> torch.Tensor:
    return embedding(env, indices, weight, padding_idx)


def _apply_view(env: Env, view: Callable[..., Any], input: Any, args: tuple, kwargs: dict) -> Any:  # noqa: A002
    """``view(input, *args, **kwargs)`` on the meta value itself: torch's own C++ view code, so
    shapes, strides, offsets and the shared storage are exactly a FakeTensor run's."""
    x = _tensor(env, input)
    _require(x.device.type == "meta", "a view of a tensor that is not a value of this propagation")
    _require(all(isinstance(a, (int, list, tuple, torch.Size)) for a in (*args, *kwargs.values())),
             "an unmodelled argument")
    with torch.no_grad():
        return view(x, *args, **kwargs)


def _meta_view(name: str) -> Callable[..., Any]:
    """The view method ``name`` (``transpose``, ``permute``, ``split``...) of the meta value."""
    def rule(env: Env, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        return _apply_view(env, getattr(torch.Tensor, name), input, args, kwargs)
    return rule


#: ATen view ops by ``name`` or ``name.overload``
_ATEN_VIEWS = ("transpose.int", "permute", "unsqueeze", "t", "squeeze.dim", "expand", "select.int", "slice.Tensor",
               "split.Tensor", "split_with_sizes", "chunk", "narrow", "unbind.int")


def _aten_view(name: str) -> Callable[..., Any]:
    """The ATen view op ``name``, called on the meta value (C++ view kernels)."""
    packet, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")

    def rule(env: Env, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        return _apply_view(env, op, input, args, kwargs)
    return rule


def _ints_op(op: Callable[[Any, Any], Any], tensor_rule: Callable[..., Any] | None) -> Callable[..., Any]:
    """``operator.X`` of two ints (sizes read off a shape: ``d // heads``), else the tensor rule."""
    def rule(env: Env, a: Any, b: Any, **kwargs: Any) -> Any:
        if type(a) is int and type(b) is int and not kwargs:
            return op(a, b)
        _require(tensor_rule is not None, "an operation on non-integers")
        return tensor_rule(env, a, b, **kwargs)
    return rule


def _guards_fn(env: Env, *args: Any) -> None:
    """torch.export's input-guard call (``_guards_fn``): returns nothing."""


# --- fxopt's own fused ops: their fake kernels are these compositions (fxopt.compile.fused_ops) --

_ADD, _SUB, _MUL, _DIV = _arith("add"), _arith("sub"), _arith("mul"), _arith("div")


def _add_relu(env: Env, a: Any, b: Any) -> torch.Tensor:
    return relu(env, _ADD(env, a, b))


def _conv_bias_relu(env: Env, x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                    groups: int) -> torch.Tensor:
    return relu(env, convolution(env, x, weight, bias, stride, padding, dilation, False, [0], groups))


def _conv_bias_add_relu(env: Env, x: Any, weight: Any, bias: Any, z: Any, alpha: Any, stride: Any,
                        padding: Any, dilation: Any, groups: int) -> torch.Tensor:
    out = convolution(env, x, weight, bias, stride, padding, dilation, False, [0], groups)
    return relu(env, _ADD(env, out, z, alpha=alpha))


def _linear_relu(env: Env, x: Any, weight: Any, bias: Any) -> torch.Tensor:
    return relu(env, linear(env, x, weight, bias))


def _linear_gelu(env: Env, x: Any, weight: Any, bias: Any) -> torch.Tensor:
    return gelu(env, linear(env, x, weight, bias))


# --- the tables --------------------------------------------------------------------------

_SUM, _MEAN = _reduction(mean=False), _reduction(mean=True)
#: activations by name: torch.X, F.X, Tensor.X where they exist; X_ is the in-place form
_ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "relu": relu, "relu6": relu, "sigmoid": relu, "tanh": relu, "silu": relu, "hardswish": relu,
    "hardsigmoid": relu, "hardtanh": hardtanh, "leaky_relu": leaky_relu, "elu": elu,
}

#: call_function targets, by identity: (the callable, its rule)
_FUNCTIONS: dict[int, tuple[Any, Callable[..., Any]]] = {}


def _functions(rule: Callable[..., Any], *targets: Any) -> None:
    for target in targets:
        if target is not None:
            _FUNCTIONS[id(target)] = (target, rule)


for _name, _rule in _ACTIVATIONS.items():
    _functions(_rule, getattr(torch, _name, None), getattr(F, _name, None))
    _functions(_inplace(_rule), getattr(torch, _name + "_", None), getattr(F, _name + "_", None))
_functions(gelu, F.gelu)
_functions(_ints_op(operator.add, _ADD), operator.add)
_functions(_ints_op(operator.sub, _SUB), operator.sub)
_functions(_ints_op(operator.mul, _MUL), operator.mul)
_functions(_ints_op(operator.floordiv, None), operator.floordiv)
_functions(_ADD, torch.add)
_functions(_SUB, torch.sub)
_functions(_MUL, torch.mul)
_functions(_DIV, operator.truediv, torch.div)
_functions(_inplace_binary(_ADD), operator.iadd)
_functions(_inplace_binary(_SUB), operator.isub)
_functions(_inplace_binary(_MUL), operator.imul)
_functions(_inplace_binary(_DIV), operator.itruediv)
_functions(convolution, torch.convolution)
for _spatial in (1, 2, 3):
    _functions(_conv(_spatial), getattr(F, f"conv{_spatial}d"))
    _functions(_conv(_spatial, transposed=True), getattr(F, f"conv_transpose{_spatial}d"))
_functions(batch_norm, F.batch_norm)
_functions(max_pool2d, F.max_pool2d)
_functions(avg_pool2d, F.avg_pool2d)
_functions(adaptive_avg_pool2d, F.adaptive_avg_pool2d)
_functions(linear, F.linear)
_functions(mm, torch.mm)
_functions(_SUM, torch.sum)
_functions(_MEAN, torch.mean)
_functions(cat, torch.cat)
_functions(view, torch.reshape)
_functions(flatten, torch.flatten)
_functions(dropout, F.dropout)
_functions(matmul, torch.matmul, operator.matmul)
_functions(bmm, torch.bmm)
_functions(layer_norm, F.layer_norm)
_functions(rms_norm, getattr(F, "rms_norm", None))
_functions(softmax, F.softmax, F.log_softmax)
_functions(_tensor_softmax, torch.softmax, torch.log_softmax)
_functions(scaled_dot_product_attention, F.scaled_dot_product_attention)
_functions(embedding, F.embedding)
#: views computed by torch's C++ view code on the meta value (``_meta_view``)
_VIEWS = ("transpose", "permute", "unsqueeze", "squeeze", "t", "split", "chunk", "narrow", "select",
          "expand", "unbind")
for _view in _VIEWS:
    _functions(_meta_view(_view), getattr(torch, _view, None))
_functions(_getattr, builtins.getattr)
_functions(_getitem, operator.getitem)

#: call_method targets, by name (methods ``torch.Tensor`` has)
_METHODS: dict[str, Callable[..., Any]] = {
    **{name: rule for name, rule in _ACTIVATIONS.items() if hasattr(torch.Tensor, name)},
    **{name + "_": _inplace(rule) for name, rule in _ACTIVATIONS.items() if hasattr(torch.Tensor, name + "_")},
    "add": _ADD, "sub": _SUB, "mul": _MUL, "div": _DIV,
    "add_": _inplace_binary(_ADD), "sub_": _inplace_binary(_SUB), "mul_": _inplace_binary(_MUL),
    "div_": _inplace_binary(_DIV),
    "sum": _SUM, "mean": _MEAN, "view": view, "reshape": view, "flatten": flatten,
    "float": _cast(torch.float32), "half": _cast(torch.float16), "double": _cast(torch.float64),
    "bfloat16": _cast(torch.bfloat16), "to": to, "contiguous": contiguous, "size": size, "dim": dim,
    "matmul": matmul, "bmm": bmm, "softmax": _tensor_softmax, "log_softmax": _tensor_softmax,
    **{name: _meta_view(name) for name in _VIEWS},
}

#: ATen and fxopt ops by qualified name (``.default``, or the packet of an op with no other
#: overload), or by ``name.overload`` for the others
_OVERLOADS: dict[str, Callable[..., Any]] = {
    "aten::convolution": convolution,
    "aten::linear": linear, "aten::matmul": matmul, "aten::mm": mm, "aten::bmm": bmm,
    "aten::layer_norm": layer_norm, "aten::rms_norm": rms_norm,
    "aten::softmax.int": _tensor_softmax, "aten::log_softmax.int": _tensor_softmax,
    "aten::_softmax": _aten_softmax, "aten::_log_softmax": _aten_softmax,
    "aten::scaled_dot_product_attention": scaled_dot_product_attention,
    "aten::embedding": _aten_embedding,
    "aten::gelu": gelu, "aten::silu": relu, "aten::relu": relu, "aten::sigmoid": relu, "aten::tanh": relu,
    "aten::add.Tensor": _ADD, "aten::sub.Tensor": _SUB, "aten::mul.Tensor": _MUL, "aten::div.Tensor": _DIV,
    "aten::add.Scalar": _ADD, "aten::mul.Scalar": _MUL,
    "aten::cat": cat, "aten::view": view, "aten::reshape": view, "aten::_unsafe_view": view,
    "aten::dropout": dropout,
    **{f"aten::{name}": _aten_view(name) for name in _ATEN_VIEWS},
    "fxopt::add_relu": _add_relu,
    "fxopt::conv_bias_relu": _conv_bias_relu,
    "fxopt::conv_bias_add_relu": _conv_bias_add_relu,
    "fxopt::linear_relu": _linear_relu,
    "fxopt::linear_gelu": _linear_gelu,
}

_CONVS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCH_NORM_RANKS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_MODULE_ACTIVATIONS: dict[type, Callable[..., Any]] = {
    nn.ReLU: relu, nn.ReLU6: relu, nn.Sigmoid: relu, nn.Tanh: relu, nn.SiLU: relu, nn.Hardswish: relu,
    nn.Hardsigmoid: relu, nn.Hardtanh: relu, nn.LeakyReLU: relu, nn.ELU: relu,
}
_RMS_NORM = getattr(nn, "RMSNorm", None)
_MODULE_KINDS = frozenset({*_CONVS, *_CONV_TRANSPOSES, *_BATCH_NORM_RANKS, *_DROPOUTS, *_MODULE_ACTIVATIONS,
                           nn.GELU, nn.Linear, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten,
                           nn.Identity, nn.LayerNorm, nn.Embedding, nn.Softmax, nn.LogSoftmax,
                           *([_RMS_NORM] if _RMS_NORM is not None else [])})
#: torch.export's ``_guards_fn`` (a module class torch keeps private), by qualified name
_GUARDS_FN = "torch.export._unlift.GuardsFn"


def _is_guards_fn(kind: type) -> bool:
    return f"{kind.__module__}.{kind.__qualname__}" == _GUARDS_FN


def _module_rule(env: Env, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A ``torch.nn`` module call, as the functional call its ``forward`` makes."""
    kind = type(module)
    if _is_guards_fn(kind):
        return _guards_fn(env, *args)
    _require(kind in _MODULE_KINDS, f"no rule for {kind.__name__}")
    _require(not (module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
                  or nn.modules.module._global_forward_pre_hooks), "a module with hooks")
    _require(not kwargs and len(args) == 1, "a module called with more than its input")
    x = _tensor(env, args[0])
    if kind in _CONVS:
        _require(module.padding_mode == "zeros", "a padding mode other than zeros")
        return _conv(_CONVS[kind])(env, x, module.weight, module.bias, module.stride, module.padding,
                                   module.dilation, module.groups)
    if kind in _CONV_TRANSPOSES:
        _require(module.padding_mode == "zeros", "a padding mode other than zeros")
        return convolution(env, x, module.weight, module.bias, module.stride, module.padding, module.dilation,
                           True, module.output_padding, module.groups)
    if kind in _BATCH_NORM_RANKS:
        _require(not module.training and module.track_running_stats, "batch norm in training")
        _require(x.dim() in _BATCH_NORM_RANKS[kind], "an input of the wrong rank")
        return batch_norm(env, x, module.running_mean, module.running_var, module.weight, module.bias)
    if kind in _DROPOUTS:
        _require(not module.training, "dropout in training")
        return x
    if kind is nn.Linear:
        return linear(env, x, module.weight, module.bias)
    if kind is nn.MaxPool2d:
        return max_pool2d(env, x, module.kernel_size, module.stride, module.padding, module.dilation,
                          module.ceil_mode, module.return_indices)
    if kind is nn.AvgPool2d:
        return avg_pool2d(env, x, module.kernel_size, module.stride, module.padding, module.ceil_mode,
                          module.count_include_pad, module.divisor_override)
    if kind is nn.AdaptiveAvgPool2d:
        return adaptive_avg_pool2d(env, x, module.output_size)
    if kind is nn.Flatten:
        return flatten(env, x, module.start_dim, module.end_dim)
    if kind is nn.Identity:
        return x
    if kind is nn.LayerNorm:
        return layer_norm(env, x, module.normalized_shape, module.weight, module.bias, module.eps)
    if kind is _RMS_NORM:
        return rms_norm(env, x, module.normalized_shape, module.weight, module.eps)
    if kind is nn.Embedding:
        _require(module.max_norm is None, "an embedding with a max norm")
        return embedding(env, x, module.weight, module.padding_idx)
    if kind in (nn.Softmax, nn.LogSoftmax):
        _require(module.dim is not None, "a softmax over an implicit dim")
        return softmax(env, x, module.dim)
    if kind is nn.GELU:
        return gelu(env, x, module.approximate)
    return _MODULE_ACTIVATIONS[kind](env, x, bool(getattr(module, "inplace", False)))


def has_rule(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s op has a rule at all (its arguments are judged by :func:`evaluate`)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target in _METHODS
    if node.op == "call_module":
        try:
            kind = type(gm.get_submodule(node.target))
        except AttributeError:
            return False
        return kind in _MODULE_KINDS or _is_guards_fn(kind)
    return node.op == "call_function" and _function_rule(node.target) is not None




def _function_rule(target: Any) -> Callable[..., Any] | None:
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
        return _OVERLOADS.get(name if target._overloadname == "default" else f"{name}.{target._overloadname}")
    if isinstance(target, torch._ops.OpOverloadPacket):  # one overload only: no resolution by arguments
        rule = _OVERLOADS.get(target._qualified_op_name)
        return rule if rule is not None and target.overloads() == ["default"] else None
    entry = _FUNCTIONS.get(id(target))
    return entry[1] if entry is not None and entry[0] is target else None


def evaluate(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict, env: Env) -> Any:
    """The value of ``node`` (not a placeholder) for argument values ``args``/``kwargs``
    (its arguments with every node replaced by that node's value); :class:`NoRule` when
    there is no rule for this call."""
    try:
        if node.op == "get_attr":
            return meta_copy(env, _attribute(gm, node.target))
        if node.op == "call_module":
            return _module_rule(env, gm.get_submodule(node.target), args, kwargs)
        if node.op == "call_method":
            rule = _METHODS.get(node.target) if isinstance(node.target, str) else None
        elif node.op == "call_function":
            rule = _function_rule(node.target)
        else:
            raise NoRule(f"a {node.op} node")
        if rule is None:
            raise NoRule(f"no rule for {node.target}")
        return rule(env, *args, **kwargs)
    except (TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        # arguments the rule's signature does not take, or that torch's own checks refuse
        raise NoRule(f"{type(exc).__name__}: {exc}") from exc


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
