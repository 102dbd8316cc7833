"""What the weight-only ops compute, in plain torch: their definitions, the reference path
for shapes the kernels cannot take, the CPU implementations, and a tuning candidate at large
M (the weight dequantized, then cuBLAS). A module of its own, with no Triton, so that the
kernels (:mod:`fxopt.quant.triton_kernels`) and the ops that call them
(:mod:`fxopt.quant.ops`) both import it and neither imports the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxopt.quant.formats import unpack_int4

__all__ = ["int4_weight_only_linear_reference", "int8_weight_only_linear_reference",
           "int8_weight_only_swiglu_reference"]


def int8_weight_only_linear_reference(x: Tensor, w: Tensor, w_scale: Tensor,
                                      bias: Tensor | None) -> Tensor:
    """The definition of the weight-only op: ``F.linear(x, dequantized w, bias)``, the weight
    dequantized in float32 (``w * scale`` per output channel) before the cast to ``x``'s
    dtype: scaling the product instead would keep it unscaled in ``x``'s dtype, and in
    float16 a product that the scale would bring back into range overflows to inf."""
    weight = (w.to(torch.float32) * w_scale.to(torch.float32).reshape(-1, 1)).to(x.dtype)
    return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)


def int4_weight_only_linear_reference(x: Tensor, w: Tensor, scales: Tensor, group_size: int,
                                      bias: Tensor | None) -> Tensor:
    """The definition of the int4 op: ``F.linear(x, unpack_int4(w, scales).to(x.dtype), bias)``."""
    return F.linear(x, unpack_int4(w, scales, group_size).to(x.dtype),
                    bias.to(x.dtype) if bias is not None else None)


def int8_weight_only_swiglu_reference(x: Tensor, w: Tensor, w_scale: Tensor,
                                      bias: Tensor | None) -> Tensor:
    """The definition of the gated op: ``silu(gate) * up``, where ``[gate, up]`` is the
    weight-only linear of ``x`` with the ``[2N, K]`` weight ``w`` (the gate's rows first).
    On CUDA one kernel computes it (fxopt.quant.merge emits it for Llama's MLP)."""
    gate, up = int8_weight_only_linear_reference(x, w, w_scale, bias).chunk(2, dim=-1)
    return F.silu(gate) * up
