"""Triton kernels for the int8 dynamic linear: ``y = (xq @ w.T) * x_scale * w_scale + bias``,
and the per-token quantization that produces ``xq`` and ``x_scale``.

``xq`` is ``[M, K]`` int8 (quantized per token at run time), ``w`` ``[N, K]`` int8 (per
output channel). The product runs on the int8 tensor cores with int32 accumulation, and
the whole dequantization (per-token x per-channel scale, bias, cast to the output dtype)
happens in the epilogue, in registers: the int32 accumulator never reaches memory.

Why our own kernel rather than ``torch._int_mm`` followed by a pointwise epilogue:

- ``torch._int_mm`` on an H100 (torch 2.11) runs a cuBLASLt/CUTLASS *sm80* kernel (no
  Hopper wgmma) and writes an int32 ``[M, N]`` result that the epilogue reads back: twice
  the bytes of a bf16 output, and the bytes a memory-bound shape lives on.
- The ``_int_mm -> convert -> mul -> mul`` graph is exactly what Inductor's freezing pass
  ``_register_smooth_quant_int_mm_pattern`` (torch/_inductor/fx_passes/quantization.py)
  rewrites into oneDNN's ``qlinear_prepack``/``qlinear_pointwise``: CPU-only ops, so with
  ``torch._inductor.config.freezing = True`` a CUDA model fails to compile (torch 2.11) and
  a CPU model computes wrong results (torch 2.13). Behind the opaque op
  ``torch.ops.fxopt_quant.int8_scaled_mm`` no ``_int_mm`` is left for the pattern to match.

Block sizes are autotuned per (M bucket, N, K). Small M is memory bound (weight bytes):
narrow tiles and deep pipelines keep enough CTAs streaming the weight; large M is compute
bound: 128x128 .. 256x128 tiles with K blocks of 128 bytes suit Hopper's int8 wgmma (both
operands K-major, which is how ``xq`` and ``w`` are laid out).

The per-token quantization (``quantize_per_token``) is one program per row: the row is loaded once into registers, reduced to its absmax, scaled, rounded and
stored as int8 with its float32 scale. Inductor's own fusion of that reduction into the
producing kernel re-reads the row in a second loop once it is wider than its persistent
limit (1024): measured on an H100, GELU + quantize of a ``[6304, 3072]`` bf16 tensor took
98 us per call, three times its byte time.

This module imports triton: it is loaded only by the CUDA implementations of the ops
(and by their interpreter-mode tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxopt.quant.formats import INT8_SYMMETRIC_MAX
from fxopt.quant.triton_kernels import grouped_tile

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_SMALL_M = [(16, 64, 256, 4, 4), (32, 64, 256, 4, 4), (64, 64, 256, 4, 4), (16, 128, 128, 4, 5),
            (32, 128, 128, 4, 5), (64, 128, 128, 4, 4), (32, 32, 512, 4, 3)]
_LARGE_M = [(128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 128, 8, 3),
            (256, 128, 128, 8, 3), (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4),
            (128, 128, 256, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 4), (128, 256, 64, 8, 4)]


def _configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in _SMALL_M + _LARGE_M]


def _prune(configs, named_args, **kwargs):
    """Tiles at most twice as tall as M (padding rows cost tensor-core time and, with
    few rows, CTAs), and for large M no tile shorter than 64 rows."""
    bucket = named_args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(2 * bucket, 16)
            and (bucket <= 128 or c.kwargs["BLOCK_M"] >= 64)]
    return kept or configs[:1]


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # a new row count never compiles a new variant
def _int8_scaled_mm(x_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                    stride_ym, M_BUCKET, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                    TWO_TERM: tl.constexpr = False):
    # TWO_TERM: x holds 2M rows, each activation row's int8 value then its rounding
    # residual's (quantize_two_term); both multiply the same weight tile, so the weight is
    # read once and the product is as exact as a weight-only one (module doc)
    # grouped launch order: programs that run together share x and w tiles in L2
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows/columns past the edge re-read row/column 0 (wrapped) instead of being masked:
    # the main loop stays mask-free along M and N; the store masks them out
    rm_in = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rn_in = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]  # the [BLOCK_K, BLOCK_N] tile of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    acc_lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk < K - k0
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0)
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)
        if TWO_TERM:
            if EVEN_K:
                r = tl.load(x_ptrs + M * stride_xm)
            else:
                r = tl.load(x_ptrs + M * stride_xm, mask=k_ok[None, :], other=0)
            acc_lo = tl.dot(r, w, acc_lo, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    m_ok = rm < M
    n_ok = rn < N
    out = acc.to(tl.float32) * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    if TWO_TERM:
        out += acc_lo.to(tl.float32) * tl.load(xs_ptr + M + rm, mask=m_ok, other=0.0)[:, None]
    out = out * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"],
                         prune_configs_by={"early_config_prune": _prune})(_int8_scaled_mm)


def int8_scaled_mm(xq: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Tensor | None,
                   out_dtype: torch.dtype, config: dict | None = None) -> Tensor:
    """``(xq @ w.T) * x_scale * w_scale + bias`` as ``out_dtype``, int32 accumulation.

    ``xq``: ``[M, K]`` int8; ``w``: ``[N, K]`` int8; ``x_scale``: ``M`` float32 values
    (``[M, 1]`` or ``[M]``); ``w_scale``: ``[N]`` float32; ``bias``: ``[N]`` or None.
    ``config`` forces one block configuration (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` and
    optionally ``num_warps``/``num_stages``) instead of autotuning: the interpreter-mode
    tests need that, since the autotuner times on a GPU.
    """
    m, k = xq.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    xs = x_scale.to(torch.float32).reshape(m).contiguous()
    ws = w_scale.to(torch.float32).reshape(n).contiguous()
    b = bias.contiguous() if bias is not None else ws  # dummy pointer when HAS_BIAS=False
    args = (xq, w, xs, ws, b, y, m, n, k, xq.stride(0), w.stride(0), y.stride(0),
            triton.next_power_of_2(m))
    if config is None:
        _tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](
            *args, HAS_BIAS=bias is not None)
    else:
        meta = {"GROUP_M": 8, **config}
        grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _int8_scaled_mm[grid](*args, HAS_BIAS=bias is not None, **meta)
    return y


#: the widest row kept whole in registers (32 fp32 values per thread at 32 warps)
MAX_ROW = 32768


@triton.jit
def _round_rows(x, QMAX: tl.constexpr):
    """Each row of the fp32 tile ``x`` as symmetric int8 values (still fp32) and its scale."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / QMAX
    # IEEE division and round-half-to-even (adding and subtracting 1.5 * 2**23 rounds an
    # fp32 |v| < 2**22 to an integer in the default rounding mode): bit-identical to the
    # aten decomposition
    q = (tl.math.div_rn(x, scale[:, None]) + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(q, -QMAX), QMAX), scale


@triton.jit(do_not_specialize=["M"])
def _quantize_rows(x_ptr, q_ptr, s_ptr, M, K, stride_xm, QMAX: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, TWO_TERM: tl.constexpr = False):
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _round_rows(x, QMAX)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], q.to(tl.int8), mask=mask)
    tl.store(s_ptr + rm, scale, mask=rm < M)
    if TWO_TERM:  # the rounding residual, quantized the same way, in rows M .. 2M - 1
        r, r_scale = _round_rows(x - q * scale[:, None], QMAX)
        tl.store(q_ptr + (M + rm[:, None]) * K + rk[None, :], r.to(tl.int8), mask=mask)
        tl.store(s_ptr + M + rm, r_scale, mask=rm < M)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a 2-D ``x``: ``(xq [M, K] int8, scale [M, 1] float32)``,
    ``scale = max(absmax, 1e-12) / 127``, ``xq = clamp(round(x / scale), -127, 127)``."""
    m, k = x.shape
    block_k = triton.next_power_of_2(k)
    assert block_k <= MAX_ROW, "the caller falls back to the aten ops for wider rows"
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    # one row per program, 16 elements per thread: the fastest of the (rows, warps) tried on
    # an H100 at [6304, 768] (15.3 us; 4 rows x 8 warps 18.3 us) and [6304, 3072] (37.2 us)
    rows = 1
    warps = min(32, max(4, block_k // 512))
    _quantize_rows[(triton.cdiv(m, rows),)](x, q, scale, m, k, x.stride(0), QMAX=INT8_SYMMETRIC_MAX,
                                            ROWS=rows, BLOCK_K=block_k, num_warps=warps)
    return q, scale


def quantize_two_term(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of a 2-D ``x`` as two int8 rows: ``(q [2M, K] int8, scale [2M] float32)``,
    rows ``0 .. M-1`` the per-token quantization of :func:`quantize_per_token`, rows
    ``M .. 2M-1`` its rounding residual ``x - q * scale`` quantized the same way. Their sum
    differs from ``x`` by at most a 1/64516 of the row's absmax: finer than bf16 itself."""
    m, k = x.shape
    block_k = triton.next_power_of_2(k)
    assert block_k <= MAX_ROW, "the caller takes the weight-only route for wider rows"
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((2 * m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((2 * m,), dtype=torch.float32, device=x.device)
    _quantize_rows[(m,)](x, q, scale, m, k, x.stride(0), QMAX=INT8_SYMMETRIC_MAX, ROWS=1,
                         BLOCK_K=block_k, TWO_TERM=True, num_warps=min(32, max(4, block_k // 512)))
    return q, scale


def two_term_config(m: int, n: int) -> dict[str, int]:
    """The tile for :func:`two_term_linear` at ``m`` rows and ``n`` output channels, from the
    shape alone (no timing, so no first call waits on a tuner): tiles no taller than M's
    power of two (at least 16, the smallest int8 MMA), and narrow enough along N to give
    every SM a program where few rows make few tiles. Each program holds two int32
    accumulators and, per pipeline stage, two activation tiles and a weight tile: K blocks
    of 256 up to 32 rows, 128 above, and three stages keep that within shared memory
    (64 x 256 x 4 stages measured 46 us where 16 rows took 33, on an H200)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = 64 if -(-n // 64) * -(-m // block_m) >= 128 else 32
    if block_m >= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 256 if block_m <= 32 else 128,
            "num_warps": 4, "num_stages": 3}


@triton.jit(do_not_specialize=["M"])
def _silu_mul(y_ptr, out_ptr, M, N, stride_ym, BLOCK: tl.constexpr):
    """``out[m, n] = silu(y[m, n]) * y[m, N + n]`` for the ``[M, 2N]`` gate|up product."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    gate = tl.load(y_ptr + m * stride_ym + rn, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + m * stride_ym + N + rn, mask=ok, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + m * N + rn, out.to(out_ptr.dtype.element_ty), mask=ok)


def two_term_linear(x2d: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                    gated: bool = False) -> Tensor:
    """``x2d @ (w * w_scale).T + bias`` on the int8 tensor cores, with ``x2d`` (bf16/fp16,
    ``[M, K]``) as two int8 terms (:func:`quantize_two_term`): the weight's int8 bytes are
    read once, the int8 MMAs (twice bf16's rate on Hopper) run twice, and the error is
    the weight's quantization alone, as in weight-only. ``gated``: ``w`` holds the gate's N
    rows then the up projection's, and the result is ``silu(gate) * up`` (``[M, N]``)."""
    m, k = x2d.shape
    rows = w.shape[0]
    xq, xs = quantize_two_term(x2d)
    y = torch.empty((m, rows), dtype=x2d.dtype, device=x2d.device)
    meta = {"GROUP_M": 8, **two_term_config(m, rows)}
    b = bias.contiguous() if bias is not None else w_scale
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(rows, meta["BLOCK_N"]),)
    _int8_scaled_mm[grid](xq, w, xs, w_scale, b, y, m, rows, k, xq.stride(0), w.stride(0), y.stride(0),
                          triton.next_power_of_2(m), HAS_BIAS=bias is not None, TWO_TERM=True, **meta)
    return _silu_mul_of(y) if gated else y


@triton.jit
def _dequantize_rows(w_ptr, s_ptr, out_ptr, K, stride_wn, BLOCK: tl.constexpr):
    """``out[n, k] = w[n, k] * scale[n]`` in fp32, stored in ``out``'s dtype: one pass."""
    n = tl.program_id(0)
    rk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rk < K
    w = tl.load(w_ptr + n * stride_wn + rk, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + n * K + rk, (w * tl.load(s_ptr + n)).to(out_ptr.dtype.element_ty), mask=ok)


def dequantized_linear(x2d: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                       gated: bool = False) -> Tensor:
    """:func:`two_term_linear`'s result through cuBLAS: the weight dequantized to ``x2d``'s
    dtype by one kernel (one read of the int8 bytes, one write: the eager reference's three
    fp32 passes took 6x as long), then ``F.linear``. For large M, where the GEMM is bound by
    tensor-core time and this costs one extra pass over the weight."""
    rows, k = w.shape
    weight = torch.empty((rows, k), dtype=x2d.dtype, device=x2d.device)
    _dequantize_rows[(rows, triton.cdiv(k, 2048))](w, w_scale, weight, k, w.stride(0), BLOCK=2048)
    y = torch.nn.functional.linear(x2d, weight, bias.to(x2d.dtype) if bias is not None else None)
    return _silu_mul_of(y) if gated else y


def _silu_mul_of(y: Tensor) -> Tensor:
    """``silu(gate) * up`` of a ``[M, 2N]`` gate|up product, in one kernel."""
    m, n = y.shape[0], y.shape[1] // 2
    out = torch.empty((m, n), dtype=y.dtype, device=y.device)
    _silu_mul[(m, triton.cdiv(n, 1024))](y, out, m, n, y.stride(0), BLOCK=1024)
    return out
