"""Observers: record the range of a tensor and turn it into int8 scale and zero point.

An observer is an ``nn.Module`` whose forward returns its input unchanged and updates
running statistics; ``insert_observers`` puts one in front of every activation that
``quantize`` will quantize, calibration runs data through, and ``quantize`` reads
:meth:`Observer.qparams`. Weights use the same classes on the weight tensor itself.

Granularity: ``ch_axis=None`` is per tensor; ``ch_axis=a`` keeps one range per index
of axis ``a`` (statistics reduce every other axis). Scheme: symmetric (zero point 0,
range -127..127, the usual choice for weights) or affine (range -128..127 with a zero
point, the usual choice for activations after ReLU/GELU).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fxopt.errors import InputError

QMIN, QMAX = -128, 127
SYMMETRIC_QMAX = 127


def qparams_from_range(lo: Tensor, hi: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """int8 (scale, zero_point) covering ``[lo, hi]``; the range is widened to include 0
    so that zero (padding, ReLU outputs) is represented exactly."""
    lo = torch.clamp(lo.to(torch.float32), max=0.0)
    hi = torch.clamp(hi.to(torch.float32), min=0.0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        scale = torch.clamp(torch.maximum(-lo, hi) / SYMMETRIC_QMAX, min=eps)
        return scale, torch.zeros_like(scale)
    scale = torch.clamp((hi - lo) / (QMAX - QMIN), min=eps)
    zero_point = torch.clamp(QMIN - torch.round(lo / scale), QMIN, QMAX)
    return scale, zero_point


def qrange(symmetric: bool) -> tuple[int, int]:
    """The integer range a scheme quantizes to."""
    return (-SYMMETRIC_QMAX, SYMMETRIC_QMAX) if symmetric else (QMIN, QMAX)


class Observer(nn.Module):
    """Base class: subclasses implement :meth:`update` and :meth:`range`."""

    def __init__(self, symmetric: bool = False, ch_axis: int | None = None):
        super().__init__()
        self.symmetric = symmetric
        self.ch_axis = ch_axis
        self.batches = 0

    def forward(self, x: Tensor) -> Tensor:
        # shape propagation runs graphs on FakeTensors: those carry no values to record
        if isinstance(x, Tensor) and not is_fake(x) and x.is_floating_point() and x.numel():
            with torch.no_grad():
                self.update(x.detach().to(torch.float32))
            self.batches += 1
        return x

    def _reduce(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Min and max of ``x``: scalars per tensor, shaped ``[C, 1, ...]``-style per channel."""
        if self.ch_axis is None:
            return x.amin(), x.amax()
        axis = self.ch_axis % x.dim()
        dims = [d for d in range(x.dim()) if d != axis]
        return x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)

    def update(self, x: Tensor) -> None:
        raise NotImplementedError

    def range(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def qparams(self) -> tuple[Tensor, Tensor]:
        """(scale, zero_point), float32, shaped to broadcast against the observed tensor."""
        if not self.batches:
            raise InputError(f"{type(self).__name__} has seen no data: run fxopt.quant.calibrate "
                             "on the observed model before quantize")
        return qparams_from_range(*self.range(), self.symmetric)

    def extra_repr(self) -> str:
        granularity = "per_tensor" if self.ch_axis is None else f"per_channel(axis={self.ch_axis})"
        return f"{'symmetric' if self.symmetric else 'affine'}, {granularity}, batches={self.batches}"


class MinMaxObserver(Observer):
    """The running minimum and maximum over every batch seen."""

    def __init__(self, symmetric: bool = False, ch_axis: int | None = None):
        super().__init__(symmetric, ch_axis)
        self.lo: Tensor | None = None
        self.hi: Tensor | None = None

    def update(self, x: Tensor) -> None:
        lo, hi = self._reduce(x)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def range(self) -> tuple[Tensor, Tensor]:
        return self.lo, self.hi


class MovingAverageObserver(MinMaxObserver):
    """An exponential moving average of each batch's min and max: robust to rare outliers."""

    def __init__(self, symmetric: bool = False, ch_axis: int | None = None,
                 averaging_constant: float = 0.01):
        super().__init__(symmetric, ch_axis)
        self.averaging_constant = averaging_constant

    def update(self, x: Tensor) -> None:
        lo, hi = self._reduce(x)
        if self.lo is None:
            self.lo, self.hi = lo, hi
        else:
            c = self.averaging_constant
            self.lo = self.lo + c * (lo - self.lo)
            self.hi = self.hi + c * (hi - self.hi)


class HistogramObserver(Observer):
    """A histogram of values; the range clips at the ``percentile``-th percentile on each side.

    Clipping the far tail trades a little error on rare values for a finer step on all
    the others. The histogram spans the running min..max; when a batch widens the range,
    the old counts are re-binned into the new bins (assuming uniform density in a bin).
    Per tensor only.
    """

    def __init__(self, symmetric: bool = False, ch_axis: int | None = None,
                 bins: int = 2048, percentile: float = 99.99):
        if ch_axis is not None:
            raise InputError("HistogramObserver is per tensor only; use ch_axis=None")
        if not 50.0 < percentile <= 100.0:
            raise InputError(f"HistogramObserver: percentile must be in (50, 100], got {percentile}")
        super().__init__(symmetric, None)
        self.bins = bins
        self.percentile = percentile
        self.hist = torch.zeros(bins, dtype=torch.float64)
        self.lo = self.hi = None

    def update(self, x: Tensor) -> None:
        lo, hi = x.amin().item(), x.amax().item()
        if self.lo is None:
            self.lo, self.hi = lo, max(hi, lo + 1e-12)
        elif lo < self.lo or hi > self.hi:
            new_lo, new_hi = min(lo, self.lo), max(hi, self.hi)
            self.hist = self._rebin(new_lo, new_hi)
            self.lo, self.hi = new_lo, new_hi
        self.hist += torch.histc(x.to(torch.float64), self.bins, self.lo, self.hi)

    def _rebin(self, lo: float, hi: float) -> Tensor:
        """Old counts spread over the new, wider bins in proportion to overlap."""
        old_edges = torch.linspace(self.lo, self.hi, self.bins + 1, dtype=torch.float64)
        new_edges = torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)
        cdf = torch.cat([torch.zeros(1, dtype=torch.float64), self.hist.cumsum(0)])
        mass_below = torch.from_numpy(np.interp(new_edges.numpy(), old_edges.numpy(), cdf.numpy()))
        return mass_below.diff()

    def range(self) -> tuple[Tensor, Tensor]:
        edges = torch.linspace(self.lo, self.hi, self.bins + 1, dtype=torch.float64)
        cdf = torch.cat([torch.zeros(1, dtype=torch.float64), self.hist.cumsum(0)])
        total = cdf[-1]
        tail = total * (1.0 - self.percentile / 100.0)
        lo = np.interp(tail.item(), cdf.numpy(), edges.numpy())
        hi = np.interp((total - tail).item(), cdf.numpy(), edges.numpy())
        return torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)


OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "moving_average": MovingAverageObserver,
    "histogram": HistogramObserver,
}
