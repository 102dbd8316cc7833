"""Fake quantization for quantization-aware training: quantize-dequantize in the forward
pass, a straight-through estimator in the backward pass.

Each module rounds its input to the grid the post-training lowering will use (same
integer ranges, same scale formulas as :mod:`fxopt.quant.observers` and the ``quantize``
pass), with ``torch.fake_quantize_per_tensor_affine`` / ``_per_channel_affine``: their
gradient is 1 inside the clamping range and 0 outside it. With ``learnable=True`` the
scale (and an activation's zero point) is an ``nn.Parameter`` trained by LSQ
(``torch._fake_quantize_learnable_*``) once observation is frozen; until then it follows
the observed range.

State lives in buffers and parameters, so ``state_dict`` saves it, and the forward pass
has no data-dependent Python branches, so ``torch.compile`` traces it in one graph. The
only Python flag, ``observing``, is flipped by the schedule (one recompilation).

The op-facts model knows them by declaration (:func:`fxopt.declare_op`): the weight and
activation fake quantizers update their own scale and range buffers (stateful: a pass
never drops, merges or moves them), the dynamic one is a pure function of its input.

- :class:`WeightFakeQuant`: symmetric int8 per tensor / per output channel, or int4 per
  group of K; the scale is ``absmax / qmax`` of the current weight until frozen.
- :class:`ActivationFakeQuant`: int8 per tensor, affine or symmetric, with a moving
  average of each batch's min and max (as PyTorch's QAT). It is an :class:`Observer`, so
  the ``quantize`` pass reads its range exactly as it reads a calibrated observer's.
- :class:`DynamicFakeQuant`: int8 with the scale computed from the batch itself, per
  token (linear-like sites) or per tensor, as the ``int8_dynamic`` lowering does.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from fxopt.analysis.ops import declare_op
from fxopt.quant.formats import INT4_SYMMETRIC_MAX, INT8_SYMMETRIC_MAX
from fxopt.quant.observers import Observer, qparams_from_range, qrange

_EPS = torch.finfo(torch.float32).eps


def _fake_quantize_rows(m: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int,
                        learnable: bool) -> Tensor:
    """Fake-quantize the 2-D ``m`` with one (scale, zero point) per row, in float32; the
    result has ``m``'s dtype. One row is per-tensor quantization."""
    m32 = m.to(torch.float32)
    if learnable:
        grad_factor = 1.0 / math.sqrt(m.shape[1] * qmax)
        out = torch._fake_quantize_learnable_per_channel_affine(
            m32, scale, zero_point, 0, qmin, qmax, grad_factor)
    else:
        out = torch.fake_quantize_per_channel_affine(m32, scale, zero_point.to(torch.int32), 0, qmin, qmax)
    return out.to(m.dtype)


class _Scale(nn.Module):
    """A scale that follows observation and, when ``learnable``, is trained afterwards."""

    def _init_scale(self, value: Tensor, learnable: bool) -> None:
        self.learnable = learnable
        self.observing = True
        if learnable:
            self.scale = nn.Parameter(value.clone())
        else:
            self.register_buffer("scale", value.clone())

    def _set_scale(self, value: Tensor) -> None:
        with torch.no_grad():
            self.scale.copy_(value.reshape(self.scale.shape))


@declare_op(stateful=True)
class WeightFakeQuant(_Scale):
    """Symmetric fake quantization of a stored weight, in the layout its lowering uses.

    ``contracted``: the weight axes a matmul sums over (``Site.stored_contracted()``); the
    others are output channels. The weight is viewed as ``[C, K]`` (channels first, in
    order) and quantized per tensor (``granularity="tensor"``), per row (``"channel"``)
    or per group of ``group_size`` values of a row (``"group"``, int4).
    """

    def __init__(self, weight: Tensor, contracted: tuple[int, ...], bits: int = 8,
                 granularity: str = "channel", group_size: int = 128, learnable: bool = False):
        super().__init__()
        nd = weight.dim()
        channels = tuple(a for a in range(nd) if a not in contracted)
        self.contracted = tuple(contracted)
        self.perm = (*channels, *contracted)
        self.inverse = tuple(self.perm.index(a) for a in range(nd))
        self.rows = math.prod(weight.shape[a] for a in channels)
        self.cols = math.prod(weight.shape[a] for a in contracted)
        self.qmax = INT4_SYMMETRIC_MAX if bits == 4 else INT8_SYMMETRIC_MAX
        self.bits, self.granularity, self.group_size = bits, granularity, group_size
        self.register_buffer("zero_point", torch.zeros(self._count()))
        self._init_scale(self._observe(weight.detach()), learnable)

    def _count(self) -> int:
        """How many scales: one per group, per row, or one."""
        if self.granularity == "group":
            return self.rows * self.cols // self.group_size
        return self.rows if self.granularity == "channel" else 1

    def _matrix(self, w: Tensor) -> Tensor:
        """``w`` as the 2-D matrix whose rows get one scale each (one row: per tensor)."""
        m = w.permute(self.perm).reshape(self.rows, self.cols)
        if self.granularity == "group":
            return m.reshape(-1, self.group_size)
        return m.reshape(1, -1) if self.granularity == "tensor" else m

    def _observe(self, w: Tensor) -> Tensor:
        absmax = self._matrix(w.detach().to(torch.float32)).abs().amax(dim=1)
        return torch.clamp(absmax / self.qmax, min=_EPS)

    def forward(self, w: Tensor) -> Tensor:
        if self.training and self.observing:
            self._set_scale(self._observe(w))
        out = _fake_quantize_rows(self._matrix(w), self.scale, self.zero_point, -self.qmax,
                                  self.qmax, self.learnable)
        shape = [w.shape[a] for a in self.perm]
        return out.reshape(shape).permute(self.inverse)

    def lowering_scale(self) -> Tensor:
        """The scale as the ``quantize`` pass takes it (see ``Quantize``'s ``weight_scales``)."""
        scale = torch.clamp(self.scale.detach().abs(), min=_EPS).to(torch.float32)
        return scale.reshape(self.rows, -1) if self.granularity == "group" else scale.clone()

    def extra_repr(self) -> str:
        kind = f"int{self.bits} {self.granularity}" + (f"({self.group_size})" if self.granularity == "group" else "")
        return f"{kind}, learnable={self.learnable}, observing={self.observing}"


@declare_op(stateful=True)
class ActivationFakeQuant(Observer, _Scale):
    """int8 per-tensor fake quantization of an activation with a moving-average range."""

    def __init__(self, symmetric: bool = False, averaging_constant: float = 0.01,
                 learnable: bool = False):
        Observer.__init__(self, symmetric, None)
        self.averaging_constant = averaging_constant
        self.qmin, self.qmax = qrange(symmetric)
        self.register_buffer("lo", torch.zeros(()))
        self.register_buffer("hi", torch.zeros(()))
        self.register_buffer("observed", torch.zeros((), dtype=torch.int64))
        self._init_scale(torch.ones(1), learnable)
        zero_point = torch.zeros(1)
        if learnable:
            self.zero_point = nn.Parameter(zero_point)
        else:
            self.register_buffer("zero_point", zero_point)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.observing:
            with torch.no_grad():
                x32 = x.detach().to(torch.float32)
                first = self.observed == 0
                c = self.averaging_constant
                self.lo.copy_(torch.where(first, x32.amin(), self.lo + c * (x32.amin() - self.lo)))
                self.hi.copy_(torch.where(first, x32.amax(), self.hi + c * (x32.amax() - self.hi)))
                self.observed.add_(1)
                scale, zero_point = qparams_from_range(self.lo, self.hi, self.symmetric)
                self.scale.copy_(scale.reshape(1))
                self.zero_point.copy_(zero_point.reshape(1))
        x32 = x.to(torch.float32)
        if self.learnable:
            grad_factor = 1.0 / math.sqrt(x.numel() * self.qmax)
            out = torch._fake_quantize_learnable_per_tensor_affine(
                x32, self.scale, self.zero_point, self.qmin, self.qmax, grad_factor)
        else:
            out = torch.fake_quantize_per_tensor_affine(
                x32, self.scale, self.zero_point.to(torch.int32), self.qmin, self.qmax)
        return out.to(x.dtype)

    def qparams(self) -> tuple[Tensor, Tensor]:
        """(scale, zero_point) the training ended with, as 0-d float32 tensors (a learned
        zero point is rounded and clamped to the integer range)."""
        scale = torch.clamp(self.scale.detach().abs(), min=_EPS).reshape(()).to(torch.float32)
        zero_point = torch.clamp(self.zero_point.detach().round(), self.qmin, self.qmax).reshape(())
        return scale.clone(), zero_point.to(torch.float32)

    def extra_repr(self) -> str:
        return (f"{'symmetric' if self.symmetric else 'affine'}, learnable={self.learnable}, "
                f"observing={self.observing}")


@declare_op(pure=True)
class DynamicFakeQuant(nn.Module):
    """Symmetric int8 with a scale from the batch: per row of the last dim (per token) or
    per tensor, as ``int8_dynamic`` quantizes at run time."""

    def __init__(self, per_token: bool):
        super().__init__()
        self.per_token = per_token

    def forward(self, x: Tensor) -> Tensor:
        m = x.reshape(-1, x.shape[-1]) if self.per_token else x.reshape(1, -1)
        scale = torch.clamp(m.detach().abs().amax(dim=1).to(torch.float32) / INT8_SYMMETRIC_MAX, min=1e-12)
        q = INT8_SYMMETRIC_MAX
        return _fake_quantize_rows(m, scale, torch.zeros_like(scale), -q, q, False).reshape(x.shape)

    def extra_repr(self) -> str:
        return "per_token" if self.per_token else "per_tensor"
