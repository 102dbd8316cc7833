"""Fused inference ops that the stock rules rewrite into: ``torch.ops.fxopt.*``.

Each is a ``torch.library`` operator with three faces:

- **eager, CUDA**: one kernel where one exists: cuDNN's fused conv+bias+ReLU
  (``torch.cudnn_convolution_relu``) and conv+bias+add+ReLU
  (``torch.cudnn_convolution_add_relu``), cuBLASLt's GEMM with a ReLU epilogue
  (``torch._addmm_activation``), a Triton kernel for add+ReLU, and for linear + exact GELU
  a Triton GEMM with the GELU in its epilogue where timing says it wins
  (:mod:`fxopt.compile.gemm_gelu`);
- **eager, elsewhere** (CPU, unsupported dtypes or layouts): the unfused computation done
  in place on the first op's fresh result, which at least saves the intermediate tensor;
- **compiled**: a fake (meta) implementation for shape propagation and a decomposition
  in Inductor's table back to the plain ops, so Inductor sees through the fused op and
  fuses its parts with their neighbours as it would have without fxopt. One exception:
  a convolution is an external kernel to Inductor, which cannot fuse into it, so on CUDA
  (where cuDNN's fused kernel applies) the fused conv ops become ATen's own
  ``cudnn_convolution_relu`` / ``cudnn_convolution_add_relu`` calls and the ReLU/add
  epilogue costs no extra pass over memory. On an H100 that made resnet50 / mobilenet_v3
  1.28x / 1.39x faster than decomposing them (bench/RESULTS.md);
  :func:`set_inductor_keeps_cudnn_fusions` (False) decomposes them too. The other: linear
  + GELU has no decomposition at all, so Inductor calls the op as an external kernel and
  it runs :mod:`fxopt.compile.gemm_gelu`'s measured choice (Inductor's own lowering would be
  cuBLAS and a separate GELU kernel, the very pass over memory the op saves).

Importing this module registers the ops; :mod:`fxopt.patterns.stock` imports it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.ops import declare_op
from fxopt.compile import gemm_gelu
from fxopt.lazy import after_import

_CUDNN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KEEP_CUDNN_IN_INDUCTOR = True


def set_inductor_keeps_cudnn_fusions(keep: bool) -> None:
    """Whether Inductor keeps fused conv ops as one cuDNN call on CUDA (True) or
    decomposes them into convolution + pointwise ops that it fuses itself (False)."""
    global _KEEP_CUDNN_IN_INDUCTOR
    _KEEP_CUDNN_IN_INDUCTOR = keep


# --- reference computations: fake impls, decompositions, and the out-of-place truth -----

def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
          padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    return torch.convolution(x, weight, bias, list(stride), list(padding), list(dilation), False,
                             [0] * len(stride), groups)


def add_relu_reference(a: Tensor, b: Tensor) -> Tensor:
    return torch.relu(torch.add(a, b))


def conv_bias_relu_reference(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                             padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    return torch.relu(_conv(x, weight, bias, stride, padding, dilation, groups))


def conv_bias_add_relu_reference(x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor,
                                 alpha: float, stride: Sequence[int], padding: Sequence[int],
                                 dilation: Sequence[int], groups: int) -> Tensor:
    return torch.relu(torch.add(_conv(x, weight, bias, stride, padding, dilation, groups), z, alpha=alpha))


def linear_relu_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.relu(F.linear(x, weight, bias))


def linear_gelu_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.gelu(F.linear(x, weight, bias))


# --- the ops ------------------------------------------------------------------------------

def add_relu(a: Tensor, b: Tensor) -> Tensor:
    """relu(a + b), with the ReLU applied in place on the sum."""
    return torch.add(a, b).relu_()


def _add_relu_cuda(a: Tensor, b: Tensor) -> Tensor:
    if _triton_applies(a, b):
        return _triton_add_relu(a, b)
    return torch.add(a, b).relu_()


def conv_bias_relu(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                   padding: list[int], dilation: list[int], groups: int) -> Tensor:
    """relu(conv(x, weight, bias)), the ReLU in place on the convolution's output."""
    return _conv(x, weight, bias, stride, padding, dilation, groups).relu_()


def _conv_bias_relu_cuda(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                         padding: list[int], dilation: list[int], groups: int) -> Tensor:
    if _cudnn_applies(x, weight, bias):
        try:
            return torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
        except RuntimeError as exc:  # no fused engine for this configuration in this cuDNN
            _cudnn_unavailable(exc)
    return _conv(x, weight, bias, stride, padding, dilation, groups).relu_()


def conv_bias_add_relu(x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor, alpha: float,
                       stride: list[int], padding: list[int], dilation: list[int], groups: int) -> Tensor:
    """relu(conv(x, weight, bias) + alpha * z), add and ReLU in place on the conv output."""
    return _conv_add_relu_inplace(x, weight, bias, z, alpha, stride, padding, dilation, groups)


def _conv_bias_add_relu_cuda(x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor, alpha: float,
                             stride: list[int], padding: list[int], dilation: list[int],
                             groups: int) -> Tensor:
    if _cudnn_applies(x, weight, bias, z):
        out_shape = conv_bias_relu_fake_shape(x, weight, stride, padding, dilation)
        if tuple(z.shape) == out_shape:
            try:
                return torch.cudnn_convolution_add_relu(x, weight, z, alpha, bias, stride, padding,
                                                        dilation, groups)
            except RuntimeError as exc:
                _cudnn_unavailable(exc)
    return _conv_add_relu_inplace(x, weight, bias, z, alpha, stride, padding, dilation, groups)


def _conv_add_relu_inplace(x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor, alpha: float,
                           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> Tensor:
    out = _conv(x, weight, bias, stride, padding, dilation, groups)
    if torch.broadcast_shapes(out.shape, z.shape) != out.shape or torch.result_type(out, z) != out.dtype:
        return torch.add(out, z, alpha=alpha).relu_()
    return out.add_(z, alpha=alpha).relu_()


def linear_relu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """relu(linear(x, weight, bias)), the ReLU in place on the GEMM's output."""
    return F.linear(x, weight, bias).relu_()


def _linear_relu_cuda(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if bias is not None and x.dim() >= 2 and x.dtype in _CUDNN_DTYPES and x.dtype == weight.dtype == bias.dtype:
        flat = x.reshape(-1, x.shape[-1])
        out = torch._addmm_activation(bias, flat, weight.t())  # cuBLASLt GEMM + bias + ReLU epilogue
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias).relu_()


def conv_bias_relu_fake_shape(x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
                              dilation: Sequence[int]) -> tuple[int, ...]:
    spatial = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    ]
    return (x.shape[0], weight.shape[0], *spatial)


_CUDNN_FUSION_BROKEN = False


def _cudnn_unavailable(exc: Exception) -> None:
    """Fall back to the unfused kernels from now on, and say so once."""
    global _CUDNN_FUSION_BROKEN
    _CUDNN_FUSION_BROKEN = True
    warnings.warn(f"cuDNN's fused convolution kernels failed ({exc}); fxopt's fused conv ops "
                  "run unfused (conv, then in-place add/ReLU) from now on", stacklevel=3)


def _cudnn_applies(x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor | None = None) -> bool:
    """cuDNN's fused kernels: 2-d convolutions, one floating dtype throughout."""
    tensors = [t for t in (x, weight, bias, z) if t is not None]
    return (not _CUDNN_FUSION_BROKEN and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.enabled and x.dim() == 4
            and x.dtype in _CUDNN_DTYPES and all(t.dtype == x.dtype and t.is_cuda for t in tensors))


# Defined with the low-level torch.library API rather than @custom_op: a call then costs
# the dispatcher's few microseconds instead of custom_op's ~30, which matters in eager
# mode where every fused conv is one call.
_LIB = torch.library.Library("fxopt", "DEF")
for _schema, _generic, _cuda, _reference in (
    ("add_relu(Tensor a, Tensor b) -> Tensor", add_relu, _add_relu_cuda, add_relu_reference),
    ("conv_bias_relu(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
     "int[] dilation, int groups) -> Tensor", conv_bias_relu, _conv_bias_relu_cuda,
     conv_bias_relu_reference),
    ("conv_bias_add_relu(Tensor x, Tensor weight, Tensor? bias, Tensor z, float alpha, int[] stride, "
     "int[] padding, int[] dilation, int groups) -> Tensor", conv_bias_add_relu,
     _conv_bias_add_relu_cuda, conv_bias_add_relu_reference),
    ("linear_relu(Tensor x, Tensor weight, Tensor? bias) -> Tensor", linear_relu, _linear_relu_cuda,
     linear_relu_reference),
    # no Inductor decomposition below: it stays one external call (see the module docstring)
    ("linear_gelu(Tensor x, Tensor weight, Tensor? bias) -> Tensor", gemm_gelu.reference,
     gemm_gelu.linear_gelu, linear_gelu_reference),
):
    _name = _schema.split("(")[0]
    _LIB.define(_schema)
    _LIB.impl(_name, _generic, "CompositeExplicitAutograd")
    _LIB.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"fxopt::{_name}", _reference, lib=_LIB)
    declare_op(f"fxopt::{_name}", pure=True)  # the same declaration users make for theirs


# --- add+ReLU as one Triton kernel ----------------------------------------------------------

def _triton_applies(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype and dense layout: then both are walked as flat arrays."""
    dense = a.is_contiguous() or a.is_contiguous(memory_format=torch.channels_last)
    return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and dense
            and a.dtype.is_floating_point and a.numel() > 0 and _triton_kernel() is not None)


@functools.cache
def _triton_kernel():  # noqa: ANN202 - a triton JITFunction, or None without triton
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_relu_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
        out = tl.maximum(a + b, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    return add_relu_kernel


def _triton_add_relu(a: Tensor, b: Tensor) -> Tensor:
    out = torch.empty_like(a)
    n = a.numel()
    block = 4096
    _triton_kernel()[((n + block - 1) // block,)](a, b, out, n, BLOCK=block, num_warps=8)
    return out


# --- Inductor sees through the fused ops --------------------------------------------------

def _suggest_cudnn_memory_format(x: Tensor, weight: Tensor) -> torch.memory_format:
    """The layout cuDNN's fused convolutions write (ATen's ``cudnn_conv_suggest_memory_format``):
    channels-last when the input or the weight is, for 4-d convolutions."""
    from torch._prims_common import suggest_memory_format

    if weight.dim() == 4 and torch.channels_last in (suggest_memory_format(x), suggest_memory_format(weight)):
        return torch.channels_last
    return torch.contiguous_format


def _cudnn_conv_relu_meta(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                          padding: list[int], dilation: list[int], groups: int) -> Tensor:
    shape = conv_bias_relu_fake_shape(x, weight, stride, padding, dilation)
    return x.new_empty(shape).contiguous(memory_format=_suggest_cudnn_memory_format(x, weight))


def _cudnn_conv_add_relu_meta(x: Tensor, weight: Tensor, z: Tensor, alpha: float | None,
                              bias: Tensor | None, stride: list[int], padding: list[int],
                              dilation: list[int], groups: int) -> Tensor:
    return _cudnn_conv_relu_meta(x, weight, bias, stride, padding, dilation, groups)


def _register_cudnn_meta_kernels() -> bool:
    """Teach fake tensors ATen's own fused cuDNN ops, which ship without meta kernels, so
    that compiled code can call them directly; False if this torch cannot."""
    aten = torch.ops.aten
    ops = {"cudnn_convolution_relu": _cudnn_conv_relu_meta,
           "cudnn_convolution_add_relu": _cudnn_conv_add_relu_meta}
    if not all(hasattr(aten, name) for name in ops):
        return False
    lib = torch.library.Library("aten", "IMPL")
    for name, meta in ops.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            lib.impl(name, meta, "Meta")
    _KEEP_ALIVE.append(lib)
    return True


def inductor_lowers_as_mm(weight: Tensor, stride: Sequence[int], padding: Sequence[int],
                          dilation: Sequence[int]) -> bool:
    """Whether Inductor, as configured now, lowers this convolution as a matrix product.

    With ``conv_1x1_as_mm`` (a user's Inductor option, or implied by max-autotune on
    channels-last convolutions) Inductor turns a 1x1, stride-1, unpadded convolution into
    ``mm`` on the channels-last activations; a fused conv op kept as one cuDNN call would
    take that choice away, so it decomposes instead. The backend does not set the option:
    on an H100 it made resnet50 / mobilenet_v3 1.20x / 1.10x slower on the GPU than cuDNN's
    fused kernels (bench/RESULTS.md, "Session 3"). Read at decomposition time, inside
    Inductor's config.
    """
    from torch._inductor import config

    return (bool(getattr(config, "conv_1x1_as_mm", False)) and all(k == 1 for k in weight.shape[2:])
            and all(s == 1 for s in stride) and not any(padding) and all(d == 1 for d in dilation))


_KEEP_ALIVE: list[torch.library.Library] = []  # a Library's registrations die with it


def _register_inductor_decompositions() -> None:
    """Inductor sees through the fused ops: each decomposes into plain ops it fuses itself,
    except a convolution that cuDNN's fused kernel takes whole (see the module docstring).

    That one decomposes into ATen's ``cudnn_convolution_relu`` / ``_add_relu`` rather than
    staying an ``fxopt`` op, so Inductor's generated code calls the cuDNN op straight
    through the dispatcher: kept whole, every call would go through the fxopt op's Python
    CUDA implementation, 45.5 us of CPU per call against 32.5 us for the ATen op on an
    H100 host, at ~50 convolutions per forward (bench/RESULTS.md, "Session 2").
    Grouped (depthwise) convolutions are left to Inductor: cuDNN picks a slow direct kernel
    for them when fused. So are pointwise (1x1) convolutions whenever Inductor is set to
    lower those as matrix products: see :func:`inductor_lowers_as_mm`.
    """
    try:
        from torch._inductor.decomposition import register_decomposition
    except ImportError:  # an Inductor-less build: nothing to teach
        return
    cudnn_ops_callable = _register_cudnn_meta_kernels()
    aten = torch.ops.aten

    def keep_cudnn(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int, *rest: Tensor) -> bool:
        return (_KEEP_CUDNN_IN_INDUCTOR and cudnn_ops_callable and groups == 1 and x.is_cuda
                and _cudnn_applies(x, weight, bias, *rest))

    @register_decomposition(torch.ops.fxopt.add_relu.default)
    def _add_relu(a: Tensor, b: Tensor) -> Tensor:
        return add_relu_reference(a, b)

    @register_decomposition(torch.ops.fxopt.linear_relu.default)
    def _linear_relu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return linear_relu_reference(x, weight, bias)

    @register_decomposition(torch.ops.fxopt.conv_bias_relu.default)
    def _conv_bias_relu(x, weight, bias, stride, padding, dilation, groups):  # noqa: ANN001, ANN202
        if keep_cudnn(x, weight, bias, groups) and not inductor_lowers_as_mm(weight, stride, padding, dilation):
            return aten.cudnn_convolution_relu.default(x, weight, bias, stride, padding, dilation, groups)
        return conv_bias_relu_reference(x, weight, bias, stride, padding, dilation, groups)

    @register_decomposition(torch.ops.fxopt.conv_bias_add_relu.default)
    def _conv_bias_add_relu(x, weight, bias, z, alpha, stride, padding, dilation, groups):  # noqa: ANN001, ANN202
        if (keep_cudnn(x, weight, bias, groups, z)
                and not inductor_lowers_as_mm(weight, stride, padding, dilation)
                and tuple(z.shape) == conv_bias_relu_fake_shape(x, weight, stride, padding, dilation)):
            return aten.cudnn_convolution_add_relu.default(x, weight, z, alpha, bias, stride, padding,
                                                           dilation, groups)
        return conv_bias_add_relu_reference(x, weight, bias, z, alpha, stride, padding, dilation, groups)

    # Inductor caches a copy of its decomposition table the first time it compiles
    # (``fast_random_decomps``): if anything was compiled before fxopt was imported, that
    # copy lacks the entries above, the fused ops reach lowering whole and Inductor
    # asserts ("both a fallback and a decomp"). Drop the stale copy.
    from torch._inductor import decomposition

    stale = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(stale, "cache_clear"):
        stale.cache_clear()


# Importing Inductor costs seconds, and most fxopt runs never compile: teach it the
# decompositions when it is imported, by whom ever, rather than importing it here.
after_import("torch._inductor.decomposition", _register_inductor_decompositions)
