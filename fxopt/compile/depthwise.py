"""``torch.ops.fxopt.depthwise_conv2d``: a depthwise 2-d convolution (one channel per group)
as one Triton kernel over channels-last memory.

Why: a depthwise convolution does ``K*K`` multiply-adds per element it reads, so it is bound
by memory traffic, and the least it can cost is one read of its input and one write of its
output. cuDNN's depthwise kernel on an H200 (``conv2d_c1_k1_nhwc_specialized``, efficientnet_b0,
bf16, batch 32, channels-last) took 294 us per model call, under fxopt and every Inductor mode
alike (Inductor calls cuDNN for every convolution): 23% of the call, for about 390 MB of
traffic, which the GPU's bandwidth moves in about 100 us.

The kernel: each program computes ``BLOCK_P`` output pixels (batch, row and column flattened)
times ``BLOCK_C`` channels. For every tap of the window it loads the input pixels that tap
reads, ``BLOCK_C`` consecutive channels each (contiguous in channels-last memory, so the
loads coalesce; the windows of neighbouring pixels overlap, and those re-reads hit the
cache), and multiplies them by the tap's weight per channel, accumulating in fp32. The
bias is added to the accumulator and the result stored once, in the input's dtype, in
channels-last layout. Zero padding is a masked load. Any strides are accepted; the
configuration (tile sizes and warps) is an argument, chosen by timing in the pass that
emits the op (:mod:`fxopt.passes.depthwise`).

Off CUDA, or without Triton, the op runs ``F.conv2d``: the same function.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.ops import declare_op


class Config(NamedTuple):
    block_p: int
    block_c: int
    warps: int


#: the configurations timed per shape: wide in pixels for few channels, wide in channels for
#: many, one with more warps for the large early layers
CONFIGS = (Config(64, 64, 4), Config(128, 32, 4), Config(32, 128, 4), Config(128, 64, 8))


def output_shape(x: Tensor | torch.Size, weight: Tensor, stride: list[int], padding: list[int]) -> tuple:
    n, c, h, w = x.shape
    k_h, k_w = weight.shape[2:]
    return (n, c, (h + 2 * padding[0] - k_h) // stride[0] + 1, (w + 2 * padding[1] - k_w) // stride[1] + 1)


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JITFunction, or None without triton
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def depthwise_kernel(x_ptr, w_ptr, b_ptr, y_ptr, P, C, H, W, OH, OW,
                         sx_n, sx_c, sx_h, sx_w, sw_c, sw_h, sw_w,
                         STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                         PAD_W: tl.constexpr, K_H: tl.constexpr, K_W: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        p_in = p < P
        c_in = c < C
        ow = p % OW
        oh = (p // OW) % OH
        n = (p // OW) // OH
        base = n.to(tl.int64) * sx_n
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(K_H):
            ih = oh * STRIDE_H - PAD_H + kh
            row_in = p_in & (ih >= 0) & (ih < H)
            for kw in tl.static_range(K_W):
                iw = ow * STRIDE_W - PAD_W + kw
                pixel_in = row_in & (iw >= 0) & (iw < W)
                offsets = (base + ih * sx_h + iw * sx_w)[:, None] + (c * sx_c)[None, :]
                xv = tl.load(x_ptr + offsets, mask=pixel_in[:, None] & c_in[None, :], other=0.0)
                wv = tl.load(w_ptr + c * sw_c + kh * sw_h + kw * sw_w, mask=c_in, other=0.0)
                acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
        # channels-last output: pixel p's channels are contiguous, pixels C apart
        out = p.to(tl.int64)[:, None] * C + c[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=p_in[:, None] & c_in[None, :])

    return depthwise_kernel


def kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """A CUDA depthwise convolution with one floating dtype throughout, and Triton here."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    return (x.is_cuda and x.dim() == 4 and weight.dim() == 4 and weight.shape[1] == 1
            and weight.shape[0] == x.shape[1] and x.dtype.is_floating_point
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors) and _kernel() is not None)


def run_config(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
               config: Config) -> Tensor:
    """The convolution by the kernel, with one configuration."""
    shape = output_shape(x, weight, stride, padding)
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    n, c, oh, ow = shape
    p = n * oh * ow
    if p == 0 or c == 0:
        return y
    grid = (-(-p // config.block_p), -(-c // config.block_c))
    _kernel()[grid](x, weight, bias if bias is not None else x, y, p, c, x.shape[2], x.shape[3], oh, ow,
                    *x.stride(), weight.stride(0), weight.stride(2), weight.stride(3),
                    STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=padding[0], PAD_W=padding[1],
                    K_H=weight.shape[2], K_W=weight.shape[3], HAS_BIAS=bias is not None,
                    BLOCK_P=config.block_p, BLOCK_C=config.block_c, num_warps=config.warps)
    return y


def reference(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int]) -> Tensor:
    """What the op computes: ``F.conv2d`` with one group per channel, channels-last."""
    y = F.conv2d(x, weight, bias, stride, padding, 1, x.shape[1])
    return y.contiguous(memory_format=torch.channels_last)


def depthwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                     config: int) -> Tensor:
    """The op: ``CONFIGS[config]`` by the kernel where it applies, else :func:`reference`."""
    if kernel_applies(x, weight, bias):
        return run_config(x, weight, bias, stride, padding, CONFIGS[config])
    return reference(x, weight, bias, stride, padding)


def _fake(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
          config: int) -> Tensor:
    return torch.empty(output_shape(x, weight, stride, padding), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last)


_LIB = torch.library.Library("fxopt", "FRAGMENT")
_LIB.define("depthwise_conv2d(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
            "int config) -> Tensor")
_LIB.impl("depthwise_conv2d", depthwise_conv2d, "CompositeExplicitAutograd")
torch.library.register_fake("fxopt::depthwise_conv2d", _fake, lib=_LIB)
declare_op("fxopt::depthwise_conv2d", pure=True)  # the same declaration users make for their ops
