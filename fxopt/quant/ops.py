"""fxopt's quantization ops, registered with ``torch.library`` under ``torch.ops.fxopt_quant``.

Why our own ops: torch 2.13 keeps only the per-tensor ops of ``quantized_decomposed``,
and the qint8/quint8 tensor dtypes are deprecated. Every op here works on plain ``int8``
tensors with explicit scales, so a quantized graph is an ordinary graph that
``torch.export``, ``make_fx`` and ``torch.compile(fullgraph=True)`` all accept.

Two kinds of op:

- *Decomposing* ops (``quantize``, ``dequantize``, ``dynamic_scale``,
  ``int8_dynamic_linear``, ``int8_linear``) are registered as ``CompositeImplicitAutograd``: their Python
  body is their decomposition. Tracing (Dynamo, AOT, make_fx) inlines them into aten ops,
  so Inductor fuses the rounding, clamping and scaling into neighbouring kernels, and
  ``torch._int_mm`` reaches Inductor's int8 GEMM lowering. They need no fake impl:
  the decomposition runs on fake tensors.
- ``int8_weight_only_linear`` and ``int4_weight_only_linear`` are *opaque*: on CUDA they
  run Triton kernels that read the int8 (int4) weight and dequantize it in registers (no
  dequantized weight is ever written), elsewhere their reference definition, e.g.
  ``F.linear(x, w.to(x.dtype)) * scale``. Fake impls let graphs holding them compile with
  ``fullgraph=True``.

Scales and zero points are stored already shaped to broadcast against the tensor they
describe (``[]`` per tensor, ``[N, 1]`` per output channel of a ``[N, K]`` weight), so one
pair of quantize/dequantize ops covers per-tensor, per-channel and per-token schemes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_LIB = torch.library.Library("fxopt_quant", "DEF")

#: ranges of the symmetric schemes: -127..127 (-7..7) keeps zero exactly representable
#: and the range symmetric, so a per-channel (per-group) scale is just absmax / 127 (/ 7)
INT8_SYMMETRIC_MAX = 127
INT4_SYMMETRIC_MAX = 7


def _define_composite(schema: str, fn) -> None:
    """Define an op whose Python body is its decomposition (see the module docstring)."""
    _LIB.define(schema)
    _LIB.impl(schema.split("(", 1)[0], fn, "CompositeImplicitAutograd")


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


def int_mm_allowed(x2d: Tensor, w: Tensor) -> bool:
    """Whether ``torch._int_mm`` accepts these operands on CUDA: M > 16, K and N % 8 == 0."""
    m, k = x2d.shape
    return x2d.is_cuda and m > 16 and k % 8 == 0 and w.shape[0] % 8 == 0


def int8_dynamic_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ w.T`` with ``x`` quantized per token at run time and ``w`` int8 per channel.

    ``w`` is ``[N, K]`` int8 (symmetric), ``w_scale`` is ``[N]`` float32. Uses
    ``torch._int_mm`` (int8 tensor cores, int32 accumulation) where it is allowed and
    otherwise the weight-only kernel on the int8-valued activations (exact products,
    fp32 accumulation), so small M never errors.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, k)
    x_scale = dynamic_scale(x2d, [-1], INT8_SYMMETRIC_MAX)
    xq = quantize(x2d, x_scale, torch.zeros((), device=x.device), -INT8_SYMMETRIC_MAX,
                  INT8_SYMMETRIC_MAX)
    if int_mm_allowed(x2d, w):
        acc = torch._int_mm(xq, w.t()).to(torch.float32) * w_scale
    else:
        # int8 values are exact in bf16 (and fp32 on CPU), and the weight-only kernel
        # accumulates in fp32 without writing a converted weight; fp16 would overflow
        exact = torch.bfloat16 if x.is_cuda else torch.float32
        acc = torch.ops.fxopt_quant.int8_weight_only_linear(xq.to(exact), w, w_scale, None)
        acc = acc.to(torch.float32)
    out = acc * x_scale
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*lead, w.shape[0])


def int8_weight_only_linear_reference(x: Tensor, w: Tensor, w_scale: Tensor,
                                      bias: Tensor | None) -> Tensor:
    """The definition of the weight-only op: ``F.linear(x, w.to(x.dtype)) * scale + bias``."""
    out = F.linear(x, w.to(x.dtype)) * w_scale.to(x.dtype)
    return out + bias.to(x.dtype) if bias is not None else out


def pack_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric int4 (-7..7) per group of ``group_size`` along K of a ``[N, K]`` weight.

    Returns ``(packed, scales)``: ``packed`` is ``[N, K/2]`` uint8 whose byte ``j`` holds
    element ``j`` in its low nibble and element ``j + K/2`` in its high nibble, each offset
    by 8 (this "split halves" layout lets a kernel unpack with a mask and a shift, no
    interleaving); ``scales`` is ``[N, K/group_size]`` float32. K must be a multiple of
    ``2 * group_size``.
    """
    n, k = w.shape
    groups = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    scales = torch.clamp(groups.abs().amax(-1) / INT4_SYMMETRIC_MAX, min=torch.finfo(torch.float32).eps)
    q = torch.clamp(torch.round(groups / scales[..., None]), -INT4_SYMMETRIC_MAX, INT4_SYMMETRIC_MAX)
    u = (q.reshape(n, k) + 8).to(torch.uint8)
    return (u[:, : k // 2] | (u[:, k // 2:] << 4)).contiguous(), scales


def unpack_int4(packed: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """The float32 ``[N, K]`` weight that ``pack_int4`` encoded."""
    u = torch.cat([packed & 15, packed >> 4], dim=-1).to(torch.float32) - 8
    return u * scales.repeat_interleave(group_size, dim=-1)


def int4_weight_only_linear_reference(x: Tensor, w: Tensor, scales: Tensor, group_size: int,
                                      bias: Tensor | None) -> Tensor:
    """The definition of the int4 op: ``F.linear(x, unpack_int4(w, scales).to(x.dtype), bias)``."""
    return F.linear(x, unpack_int4(w, scales, group_size).to(x.dtype),
                    bias.to(x.dtype) if bias is not None else None)


def _int4_cuda(x: Tensor, w: Tensor, scales: Tensor, group_size: int, bias: Tensor | None) -> Tensor:
    from fxopt.quant import triton_kernels

    return triton_kernels.int4_weight_only_linear(x, w, scales, group_size, bias)


def _int4_fake(x: Tensor, w: Tensor, scales: Tensor, group_size: int, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _weight_only_cuda(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    from fxopt.quant import triton_kernels  # triton is imported only where CUDA runs

    return triton_kernels.int8_weight_only_linear(x, w, w_scale, bias)


def _weight_only_fake(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


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
_define_composite("int8_dynamic_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor",
                  int8_dynamic_linear)
_LIB.define("int8_weight_only_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor")
_LIB.impl("int8_weight_only_linear", int8_weight_only_linear_reference, "CPU")
_LIB.impl("int8_weight_only_linear", _weight_only_cuda, "CUDA")
torch.library.register_fake("fxopt_quant::int8_weight_only_linear")(_weight_only_fake)
_LIB.define("int4_weight_only_linear(Tensor x, Tensor w, Tensor scales, int group_size, "
            "Tensor? bias) -> Tensor")
_LIB.impl("int4_weight_only_linear", int4_weight_only_linear_reference, "CPU")
_LIB.impl("int4_weight_only_linear", _int4_cuda, "CUDA")
torch.library.register_fake("fxopt_quant::int4_weight_only_linear")(_int4_fake)
_define_composite("int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, "
                  "int dynamic_min_tokens) -> Tensor", int8_linear)

ops = torch.ops.fxopt_quant
