"""fxopt's quantization ops, registered with ``torch.library`` under ``torch.ops.fxopt_quant``.

Why our own ops: torch 2.13 keeps only the per-tensor ops of ``quantized_decomposed``,
and the qint8/quint8 tensor dtypes are deprecated. Every op here works on plain ``int8``
tensors with explicit scales, so a quantized graph is an ordinary graph that
``torch.export``, ``make_fx`` and ``torch.compile(fullgraph=True)`` all accept.

Three kinds of op:

- *Decomposing* ops (``quantize``, ``dequantize``, ``dynamic_scale``,
  ``int8_dynamic_linear``, ``int8_linear``) are registered as ``CompositeImplicitAutograd``: their Python
  body is their decomposition. Tracing (Dynamo, AOT, make_fx) inlines them into aten ops,
  so Inductor fuses the rounding, clamping and scaling into neighbouring kernels. They need no fake impl:
  the decomposition runs on fake tensors.
- ``quantize_per_token`` and ``int8_scaled_mm`` (the int8 GEMM with its dequantizing
  epilogue), behind ``int8_dynamic_linear``, are *opaque*: on CUDA Triton kernels,
  elsewhere their aten definitions (``torch._int_mm`` and the scaling). Opaque because
  Inductor's freezing passes rewrite a visible ``_int_mm -> mul -> mul`` into CPU-only
  oneDNN ops, and its fused per-token reduction is slow on wide rows (``fxopt.quant.int8_mm``).
- ``int8_weight_only_linear``, ``int8_weight_only_swiglu`` and ``int4_weight_only_linear``
  are *opaque* too (``torch.library.custom_op``): their CUDA implementation picks a kernel
  at run time on the real row count (:mod:`fxopt.quant.routes`), so a graph compiled for a
  dynamic M holds no guard on M and is never recompiled as M changes. (Until 2026-11 they
  were ``triton_op``s that Inductor inlined; the kernel choice then happened while tracing,
  guarded on M's bucket, and each new bucket recompiled the model: 3.4-6.5 s per new M on
  an H200, and two callers meeting six sizes hit Dynamo's recompile limit.) Elsewhere they
  compute their reference definition, e.g. ``F.linear(x, w.to(x.dtype)) * scale``;
  ``torch.export`` keeps them whole. Gradients flow to the activation and the bias.

Scales and zero points are stored already shaped to broadcast against the tensor they
describe (``[]`` per tensor, ``[N, 1]`` per output channel of a ``[N, K]`` weight), so one
pair of quantize/dequantize ops covers per-tensor, per-channel and per-token schemes.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.ops import declare_op
from fxopt.quant import int8_configs
from fxopt.quant.formats import INT8_SYMMETRIC_MAX, unpack_int4
from fxopt.quant.reference import (
    int4_weight_only_linear_reference,
    int8_weight_only_linear_reference,
    int8_weight_only_swiglu_reference,
)

_LIB = torch.library.Library("fxopt_quant", "DEF")


def _define_composite(schema: str, fn) -> None:
    """Define an op whose Python body is its decomposition (see the module docstring)."""
    _LIB.define(schema)
    _LIB.impl(schema.split("(", 1)[0], fn, "CompositeImplicitAutograd")
    declare_op(f"fxopt_quant::{schema.split('(', 1)[0]}", pure=True)


def _define_kernel(schema: str, cpu, cuda, fake) -> None:
    """Define an op Inductor keeps whole: a CPU reference, a CUDA kernel and a fake impl."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, cpu, "CPU")
    _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"fxopt_quant::{name}")(fake)
    declare_op(f"fxopt_quant::{name}", pure=True)


@functools.cache
def _triton_installed() -> bool:
    """Whether triton can be imported: asked once (a path search), not on every op call."""
    return importlib.util.find_spec("triton") is not None


def weight_only_route(x: Tensor, w: Tensor, group_size: int | None = None,
                      scales: Tensor | None = None) -> str | None:
    """Why a weight-only op on ``x`` and the weight ``w`` computes its reference definition
    instead of launching its Triton kernels, or None where it launches them. ``group_size``
    and ``scales``: the int4 op's. The kernels take:

    - CUDA tensors, with triton installed;
    - a weight with unit stride along K (int4: its scales too; any row stride): a weight of
      other strides would need a copy per call, and the reference reads it where it is;
    - int4: K a multiple of ``group_size``, a power of two of at least 32 (the kernels read
      whole groups, half a group per ``tl.dot`` operand), and at most 256 rows of ``x``:
      above them a GEMM is bound by compute, where dequantizing the weight once and cuBLAS
      win. The int8 ops take every M: :mod:`fxopt.quant.routes` picks their kernel from the
      real row count, inside the op.
    """
    if w.stride(-1) != 1:
        return f"weight strides {tuple(w.stride())}: the kernels read K with unit stride"
    k = x.shape[-1]
    if group_size is not None:
        if scales is not None and scales.stride(-1) != 1:
            return f"scale strides {tuple(scales.stride())}: the kernels read groups with unit stride"
        if group_size < 32 or group_size & (group_size - 1) or k % group_size:
            return f"group size {group_size} with K = {k}: the kernels take powers of two >= 32 dividing K"
    if x.device.type != "cuda":
        return f"{x.device.type} tensors (the Triton kernels run on CUDA)"
    if not _triton_installed():
        return "triton is not installed"
    if group_size is not None and int8_configs.m_bucket(x.numel() // max(k, 1)) == int8_configs.LARGE_M:
        return f"above {int8_configs.M_BUCKETS[-1]} rows the int4 op dequantizes and calls cuBLAS"
    return None


def _opaque_op(name: str, schema: str, fake):
    """Define ``fxopt_quant::name`` as a ``torch.library.custom_op`` with ``fake`` as its fake
    impl: ``torch.compile`` keeps the call whole and the decorated function, run on real
    tensors, chooses its kernel from the real shapes (the module doc says why)."""

    def define(fn):
        op = torch.library.custom_op(f"fxopt_quant::{name}", fn, mutates_args=(), schema=schema)
        op.register_fake(fake)
        declare_op(f"fxopt_quant::{name}", pure=True)
        return op

    return define


def _linear_fake(x: Tensor, w: Tensor, *rest) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _swiglu_fake(x: Tensor, w: Tensor, *rest) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0] // 2))


def quantize(x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    """``clamp(round(x / scale) + zero_point, qmin, qmax)`` as int8; math in float32."""
    q = torch.round(x.to(torch.float32) / scale) + zero_point
    return torch.clamp(q, qmin, qmax).to(torch.int8)


def dequantize(q: Tensor, scale: Tensor, zero_point: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(q - zero_point) * scale`` in float32, returned as ``out_dtype``."""
    return ((q.to(torch.float32) - zero_point) * scale).to(out_dtype)


def dynamic_scale(x: Tensor, dims: list[int], qmax: int) -> Tensor:
    """Symmetric scale ``absmax / qmax`` over ``dims`` (kept as size-1 dims), in float32.

    Per-token activations reduce the last dim; per-tensor reduces all of them.
    """
    amax = x.detach().abs().to(torch.float32).amax(dim=dims, keepdim=True)
    return torch.clamp(amax, min=1e-12) / qmax


#: the widest row Inductor reduces in registers (its persistent-reduction limit for inner
#: reductions); wider rows go through a loop that reads them twice
PERSISTENT_ROW = 1024


def quantize_per_token_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """The definition of ``quantize_per_token``: symmetric int8 per row of a 2-D ``x``,
    returned as ``(xq [M, K] int8, scale [M, 1] float32)``."""
    scale = dynamic_scale(x, [-1], INT8_SYMMETRIC_MAX)
    zero = torch.zeros((), device=x.device)
    return quantize(x, scale, zero, -INT8_SYMMETRIC_MAX, INT8_SYMMETRIC_MAX), scale


def _quantize_per_token_cuda(x: Tensor) -> tuple[Tensor, Tensor]:
    from fxopt.quant import int8_mm

    if x.shape[-1] > int8_mm.MAX_ROW:  # a row too wide to keep in registers
        return quantize_per_token_reference(x)
    return int8_mm.quantize_per_token(x)


def _quantize_per_token_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def int8_scaled_mm_reference(xq: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor,
                             bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """The definition of ``int8_scaled_mm``: ``(xq @ w.T) * x_scale * w_scale + bias``.

    ``xq`` ``[M, K]`` and ``w`` ``[N, K]`` are int8, multiplied exactly with int32
    accumulation (``torch._int_mm``); ``x_scale`` holds M float32 values, ``w_scale`` N.
    """
    acc = torch._int_mm(xq, w.t()).to(torch.float32)
    out = acc * x_scale.reshape(-1, 1).to(torch.float32) * w_scale.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _scaled_mm_cuda(xq: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Tensor | None,
                    out_dtype: torch.dtype) -> Tensor:
    from fxopt.quant import int8_mm  # triton is imported only where CUDA runs

    return int8_mm.int8_scaled_mm(xq, w, x_scale, w_scale, bias, out_dtype)


def _scaled_mm_fake(xq: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Tensor | None,
                    out_dtype: torch.dtype) -> Tensor:
    return xq.new_empty((xq.shape[0], w.shape[0]), dtype=out_dtype)


def int8_dynamic_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ w.T`` with ``x`` quantized per token at run time and ``w`` int8 per channel.

    ``w`` is ``[N, K]`` int8 (symmetric), ``w_scale`` is ``[N]`` float32. The GEMM is the
    opaque ``int8_scaled_mm`` (int8 tensor cores, dequantizing epilogue; see
    ``fxopt.quant.int8_mm`` for why it is opaque). Rows of up to ``PERSISTENT_ROW`` values
    are quantized by the aten decomposition, which Inductor keeps in registers and fuses
    into the kernel producing ``x`` (a LayerNorm); wider rows by the one-pass
    ``quantize_per_token`` kernel, where Inductor's fusion would loop over each row twice
    (H100, ``[6304, K]`` bf16: 13 vs 18 us at K = 768, 70 vs 37 us at K = 3072).
    Both compute the same values. Every M works, so small M needs no fallback.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, k)
    if k <= PERSISTENT_ROW:
        xq, x_scale = quantize_per_token_reference(x2d)
    else:
        xq, x_scale = torch.ops.fxopt_quant.quantize_per_token(x2d)
    out = torch.ops.fxopt_quant.int8_scaled_mm(xq, w, x_scale, w_scale, bias, x.dtype)
    return out.reshape(*lead, w.shape[0])


def int8_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                dynamic_min_tokens: int) -> Tensor:
    """The route per shape: weight-only below ``dynamic_min_tokens`` rows of ``x`` (memory
    bound: int8 weight bytes win), int8 dynamic at or above it (compute bound: int8
    tensor cores win). Under ``torch.compile`` the branch is taken at trace time."""
    tokens = x.numel() // max(x.shape[-1], 1)
    if tokens >= dynamic_min_tokens:
        return int8_dynamic_linear(x, w, w_scale, bias)
    return torch.ops.fxopt_quant.int8_weight_only_linear(x, w, w_scale, bias)


_define_composite("quantize(Tensor x, Tensor scale, Tensor zero_point, int qmin, int qmax) -> Tensor",
                  quantize)
_define_composite("dequantize(Tensor q, Tensor scale, Tensor zero_point, ScalarType out_dtype) -> Tensor",
                  dequantize)
_define_composite("dynamic_scale(Tensor x, int[] dims, int qmax) -> Tensor", dynamic_scale)
_define_kernel("quantize_per_token(Tensor x) -> (Tensor, Tensor)",
               quantize_per_token_reference, _quantize_per_token_cuda, _quantize_per_token_fake)
_define_kernel("int8_scaled_mm(Tensor xq, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, "
               "ScalarType out_dtype) -> Tensor", int8_scaled_mm_reference, _scaled_mm_cuda, _scaled_mm_fake)
_define_composite("int8_dynamic_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor",
                  int8_dynamic_linear)
_WEIGHT_ONLY_SCHEMA = "(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor"


@_opaque_op("int8_weight_only_linear", _WEIGHT_ONLY_SCHEMA, _linear_fake)
def _int8_weight_only_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    if weight_only_route(x, w) is not None:
        return int8_weight_only_linear_reference(x, w, w_scale, bias)
    from fxopt.quant import routes

    return routes.int8_linear(x, w, w_scale, bias, gated=False)


@_opaque_op("int8_weight_only_swiglu", _WEIGHT_ONLY_SCHEMA, _swiglu_fake)
def _int8_weight_only_swiglu(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    if weight_only_route(x, w) is not None:
        return int8_weight_only_swiglu_reference(x, w, w_scale, bias)
    from fxopt.quant import routes

    return routes.int8_linear(x, w, w_scale, bias, gated=True)


@_opaque_op("int4_weight_only_linear",
            "(Tensor x, Tensor w, Tensor scales, int group_size, Tensor? bias) -> Tensor", _linear_fake)
def _int4_weight_only_linear(x: Tensor, w: Tensor, scales: Tensor, group_size: int,
                             bias: Tensor | None) -> Tensor:
    if weight_only_route(x, w, group_size, scales) is not None:
        return int4_weight_only_linear_reference(x, w, scales, group_size, bias)
    from fxopt.quant import triton_kernels

    return triton_kernels.int4_weight_only_linear(x, w, scales, group_size, bias)


def _int8_weight(w: Tensor, w_scale: Tensor) -> Tensor:
    return w.to(torch.float32) * w_scale.to(torch.float32).reshape(-1, 1)


def _register_weight_only_autograd(op, weight, gated: bool = False) -> None:
    """Gradients of a weight-only op for its activation and bias (the quantized weight is a
    constant): ``grad_x = grad_out @ W``, with ``W = weight(*op's weight arguments)`` the
    dequantized weight; ``gated`` ops recompute their gate and up projection first. So a
    quantized model compiles and runs where inputs or biases require grad (``torch.compile``
    outside ``no_grad``, adapters trained on a quantized base)."""

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*(a for a in inputs if isinstance(a, Tensor)))
        ctx.layout = [isinstance(a, Tensor) for a in inputs]
        ctx.constants = [a for a in inputs if not isinstance(a, Tensor)]

    def backward(ctx, grad: Tensor):
        tensors, constants = iter(ctx.saved_tensors), iter(ctx.constants)
        inputs = [next(tensors) if is_tensor else next(constants) for is_tensor in ctx.layout]
        x, bias = inputs[0], inputs[-1]
        w = weight(*inputs[1:-1]).to(grad.dtype)
        if gated:
            gate, up = F.linear(x, w, None if bias is None else bias.to(x.dtype)).chunk(2, dim=-1)
            sig = torch.sigmoid(gate)
            grad = torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], dim=-1)
        grad_x = grad @ w
        grad_bias = None if bias is None else grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, *([None] * (len(inputs) - 2)), grad_bias

    op.register_autograd(backward, setup_context=setup_context)


_register_weight_only_autograd(_int8_weight_only_linear, _int8_weight)
_register_weight_only_autograd(_int8_weight_only_swiglu, _int8_weight, gated=True)
_register_weight_only_autograd(_int4_weight_only_linear, unpack_int4)

_define_composite("int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, "
                  "int dynamic_min_tokens) -> Tensor", int8_linear)

ops = torch.ops.fxopt_quant
