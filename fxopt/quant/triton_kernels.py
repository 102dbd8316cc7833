"""Triton kernels for weight-only linear layers: ``y = (x @ w.T) * scale + bias``, with ``w``
int8 per channel, or int4 in groups along K (two per byte; ``int4_weight_only_linear``).

The weight stays int8 in memory and is converted to the activation dtype in registers,
so the bytes read are half of a bf16 GEMM's and no dequantized weight is ever written.
That is what makes batch-1 decoding (a GEMV, bound by memory bandwidth) up to 2x faster.

Two kernels, picked by the number of rows M of ``x``:

- ``_gemv``: for M <= GEMV_MAX_M. Each program owns BLOCK_N output channels and walks K,
  multiplying and summing in fp32 on CUDA cores (a tensor-core tile would waste >90% of
  its rows at M = 1).
- ``_gemm``: for larger M. It computes ``y.T = w @ x.T`` ("swap AB"): the converted int8
  weight tile is the left operand, which Hopper's wgmma may take from registers, and
  small M becomes the tile's narrow side, so M = 16 wastes nothing.

Both are autotuned per (M bucket, N, K). This module imports triton: it is loaded only
by the CUDA implementation of ``torch.ops.fxopt_quant.int8_weight_only_linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: rows of x up to which the CUDA-core GEMV beats the tensor-core tile (measured on an
#: H100: at M = 4 and 8 the GEMM kernel was 1.3x and 2.4x faster, see bench/RESULTS.md)
GEMV_MAX_M = 2


def _gemv_configs() -> list[triton.Config]:
    tiles = [(8, 256, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (8, 512, 4), (32, 128, 4),
             (64, 128, 8), (16, 1024, 8), (4, 1024, 4), (8, 1024, 8), (32, 512, 8), (64, 256, 8)]
    # deeper load pipelines keep more bytes in flight per SM, which a GEMV lives on
    deep = [(16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3)]
    return ([triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in tiles]
            + [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
               for bn, bk, w, st in deep])


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2) * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _gemm_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "GROUP_N": 8},
                          num_warps=w, num_stages=s)
            for bn, bm, bk, w, s in [
                (64, 16, 128, 4, 4), (128, 16, 128, 4, 4), (64, 32, 128, 4, 4),
                (128, 32, 128, 4, 4), (128, 64, 64, 4, 4), (128, 64, 128, 8, 3),
                (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                (256, 128, 64, 8, 3)]]


@triton.jit
def _gemm(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
          M_BUCKET, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    # grouped launch order: programs that run together share weight tiles in L2
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    grid_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_N * grid_m
    first_n = (pid // per_group) * GROUP_N
    group_size = min(grid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_m = (pid % per_group) // group_size
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_mask[None, :], other=0)
        xt = tl.load(x_ptrs, mask=(rm[None, :] < M) & k_mask[:, None], other=0.0)
        acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    n_mask = rn < N
    acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[None, :] < M) & n_mask[:, None])


@triton.jit
def _gemv_int4(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
               stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP: tl.constexpr):
    # w is [N, K/2] uint8: byte j holds element j (low nibble) and j + K/2 (high), each + 8;
    # one block of K is one group, so each nibble half needs one scale per row
    half = K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUP), dtype=tl.float32)
    for k0 in tl.range(0, half, GROUP):
        rk = k0 + tl.arange(0, GROUP)
        p = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_mask[:, None], other=0)
        s_lo = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=n_mask, other=0.0)
        s_hi = tl.load(s_ptr + rn * stride_sn + (half + k0) // GROUP, mask=n_mask, other=0.0)
        lo = ((p & 15).to(tl.float32) - 8.0) * s_lo[:, None]
        hi = ((p >> 4).to(tl.float32) - 8.0) * s_hi[:, None]
        x_lo = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_ptr + rm[:, None] * stride_xm + half + rk[None, :], mask=m_mask[:, None],
                       other=0.0)
        acc += x_lo.to(tl.float32)[:, None, :] * lo[None, :, :]
        acc += x_hi.to(tl.float32)[:, None, :] * hi[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm_int4(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
               stride_ym, M_BUCKET, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    # y.T = w @ x.T as in _gemm; each K block is one group of both nibble halves
    half = K // 2
    pid_n = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, half, GROUP):
        rk = k0 + tl.arange(0, GROUP)
        p = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_mask[:, None], other=0)
        s_lo = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=n_mask, other=0.0)
        s_hi = tl.load(s_ptr + rn * stride_sn + (half + k0) // GROUP, mask=n_mask, other=0.0)
        xt_lo = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=m_mask[None, :], other=0.0)
        xt_hi = tl.load(x_ptr + rm[None, :] * stride_xm + half + rk[:, None], mask=m_mask[None, :],
                        other=0.0)
        # nibble -> activation dtype (exact), times the scale in that dtype: one rounding
        dt = xt_lo.dtype
        lo = ((p & 15).to(tl.int8) - 8).to(dt) * s_lo[:, None].to(dt)
        hi = ((p >> 4).to(tl.int8) - 8).to(dt) * s_hi[:, None].to(dt)
        acc = tl.dot(lo, xt_lo, acc, input_precision=PRECISION)
        acc = tl.dot(hi, xt_hi, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[None, :] & n_mask[:, None])


def _int4_gemv_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": bn}, num_warps=w) for bn, w in [(8, 4), (16, 4), (32, 4), (16, 8)]]


def _int4_gemm_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm}, num_warps=w, num_stages=st)
            for bn, bm, w, st in [(64, 16, 4, 3), (128, 16, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]]


_gemv_tuned = triton.autotune(configs=_gemv_configs(), key=["BLOCK_M", "N", "K"])(_gemv)
_gemm_tuned = triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K"])(_gemm)
_gemv_int4_tuned = triton.autotune(configs=_int4_gemv_configs(), key=["BLOCK_M", "N", "K"])(_gemv_int4)
_gemm_int4_tuned = triton.autotune(configs=_int4_gemm_configs(), key=["M_BUCKET", "N", "K"])(_gemm_int4)


def _launch(tuned, kernel, configs, x: Tensor, grid, *args, **kwargs) -> None:
    """Autotuned launch on a GPU; on CPU tensors (TRITON_INTERPRET=1, used by the tests of
    this module) the first config, since the autotuner needs a GPU driver to time."""
    if x.is_cuda:
        tuned[grid](*args, **kwargs)
    else:
        config = configs[0]
        kernel[grid(config.kwargs)](*args, **kwargs, **config.kwargs)


def int8_weight_only_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                            kernel: str | None = None) -> Tensor:
    """``F.linear(x, w.to(x.dtype)) * w_scale + bias`` without materializing ``w.to(x.dtype)``.

    ``x``: ``[..., K]`` fp32/bf16/fp16; ``w``: ``[N, K]`` int8 with unit stride along K;
    ``w_scale``: ``[N]`` float32; ``bias``: ``[N]`` or None. ``kernel`` forces "gemv" or
    "gemm" (benchmarks compare them); by default M picks (see GEMV_MAX_M).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m = x2d.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    scale = w_scale.to(torch.float32).contiguous()
    b = bias.contiguous() if bias is not None else scale  # dummy pointer when HAS_BIAS=False
    args = (x2d, w, scale, b, y, m, n, k, x2d.stride(0), w.stride(0), y.stride(0))
    if kernel == "gemv" or (kernel is None and m <= GEMV_MAX_M):
        block_m = triton.next_power_of_2(m)
        _launch(_gemv_tuned, _gemv, _gemv_configs(), x,
                lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),),
                *args, HAS_BIAS=bias is not None, BLOCK_M=block_m)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _launch(_gemm_tuned, _gemm, _gemm_configs(), x,
                lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),),
                *args, triton.next_power_of_2(m), HAS_BIAS=bias is not None, PRECISION=precision)
    return y.reshape(*lead, n)


def int4_weight_only_linear(x: Tensor, w: Tensor, scales: Tensor, group_size: int,
                            bias: Tensor | None, kernel: str | None = None) -> Tensor:
    """``x @ dequant(w).T + bias`` for int4 weights in groups of ``group_size`` along K.

    ``w``: ``[N, K/2]`` uint8 packed as :func:`fxopt.quant.ops.pack_int4` does;
    ``scales``: ``[N, K/group_size]`` float32. Dequantization happens in registers.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    w, scales = w.contiguous(), scales.to(torch.float32).contiguous()
    b = bias.contiguous() if bias is not None else scales
    args = (x2d, w, scales, b, y, m, n, k, x2d.stride(0), w.stride(0), scales.stride(0), y.stride(0))
    if kernel == "gemv" or (kernel is None and m <= GEMV_MAX_M):
        _launch(_gemv_int4_tuned, _gemv_int4, _int4_gemv_configs(), x,
                lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),),
                *args, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), GROUP=group_size)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _launch(_gemm_int4_tuned, _gemm_int4, _int4_gemm_configs(), x,
                lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),),
                *args, triton.next_power_of_2(m), HAS_BIAS=bias is not None, PRECISION=precision,
                GROUP=group_size)
    return y.reshape(*lead, n)
