"""Triton kernels for weight-only linear layers: ``y = (x @ w.T) * scale + bias``, with ``w``
int8 per channel, or int4 in groups along K (two per byte; ``int4_weight_only_linear``).

The weight stays int8 in memory and is converted to the activation dtype in registers,
so the bytes read are half of a bf16 GEMM's and no dequantized weight is ever written.
That is what makes batch-1 decoding (a GEMV, bound by memory bandwidth) up to 2x faster.

Two int8 kernels; :func:`tuned_config` picks one and its configuration per shape:

- ``_gemv``: for M <= GEMV_MAX_M. Each program owns BLOCK_N output channels and a slice
  of K, multiplying and summing in fp32 on CUDA cores (a tensor-core tile would waste
  >90% of its rows at M = 1).
- ``_gemm``: for any M, in two orientations (``SWAP_AB``). Swap-AB computes
  ``y.T = w @ x.T``: the converted int8 weight tile is the left operand, which Hopper's
  wgmma takes from registers, and small M becomes the tile's narrow side, so M = 16
  wastes nothing. Triton 3.6 keeps several of those wgmma in flight while the next tile
  converts. The normal orientation ``y = x @ w.T`` (the activation the left operand, as in
  a bf16 GEMM, the output stored row by row) must write the converted tile to shared
  memory, and Triton then waits for each wgmma before the next conversion (compiled for
  sm90: ``wgmma.wait_group 0`` in the loop): it is a candidate for the tuner above 16 rows,
  never the choice by shape. (Swap-AB at large M ran at 250-380 TFLOP/s on an H100 against
  cuBLAS bf16's 600-700, bench/RESULTS.md.) Above 16 rows the weight-only reference
  (dequantize, then cuBLAS) is a candidate too (:func:`launch`), so a shape where cuBLAS
  wins keeps it.

Both may split K over SPLIT_K programs (fp32 partial sums, then ``_splitk_reduce``
applies the scale and bias): a layer with few output channels and a long K (Llama's
down projection: N = 4096, K = 11008) otherwise has too few programs to keep enough
loads in flight on every SM. The int8 -> float conversion may use the magic-number trick
(``_int8_to_f32``): an integer add and a float subtract instead of the int-to-float
converter, whose throughput on Hopper is a quarter of the FMA pipe's. A GEMV at M = 1
converts one weight per FMA, and with the trick it ran 1.5x faster on an H100 (Llama's
down projection, 21.6 vs 32.1 us); the GEMM was as fast either way, so both are
candidates. The configurations (tile, warps, stages, split, conversion) and the choice among
them live in :mod:`fxopt.quant.int8_configs`: by default the first call of a shape times
nothing (the on-disk cache, shipped defaults per GPU family, or a choice by shape); with
``FXOPT_INT8_TUNE=1`` it times every candidate once per (M bucket, N, K, dtype) and machine.

``int8_weight_only_swiglu`` runs the same kernels with GATED: each program reads the
gate's and the up projection's rows of one ``[2N, K]`` weight and stores
``silu(gate) * up`` (fxopt.quant.merge's ``fuse_swiglu`` emits it).

int4 (``int4_weight_only_linear``): a GEMV at M = 1 that reads several groups of K per
iteration (one scale each), and the swap-AB GEMM with one group per iteration above.

The ops that call these functions (:mod:`fxopt.quant.ops`) are opaque custom ops: every
launch happens on real tensors with a concrete M, and :mod:`fxopt.quant.routes` sends a
bf16/fp16 activation of up to a few thousand rows to the int8 tensor cores instead
(:func:`fxopt.quant.int8_mm.two_term_linear`): these kernels serve fp32 activations, int4
weights, and the tuner's comparisons.

This module imports triton: it is loaded only by the CUDA implementations of the weight-only
ops (and by tests in Triton's interpreter).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from fxopt.quant import int8_configs
from fxopt.quant.int8_configs import GEMV_MAX_M, Candidate, Config, candidates
from fxopt.quant.reference import (
    int8_weight_only_linear_reference,
    int8_weight_only_swiglu_reference,
)

#: the largest M at which the int4 kernels run their GEMV (one program per row and block of
#: channels, so it reads the weight once per row; picked by M alone, not tuned)
INT4_GEMV_MAX_M = 1


@triton.jit
def grouped_tile(pid, grid_major, grid_minor, GROUP: tl.constexpr):
    """The (major, minor) tile of program ``pid`` in grouped launch order: programs that
    run together walk ``GROUP`` major tiles side by side, so they share the minor
    operand's tiles in L2 (the order of Triton's matmul tutorial)."""
    per_group = GROUP * grid_minor
    first = (pid // per_group) * GROUP
    group_size = min(grid_major - first, GROUP)
    return first + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _int8_to_f32(w, FAST_CVT: tl.constexpr):
    """int8 -> fp32, exactly. FAST_CVT: 2**23 + 128 + w as an integer has the bits of the
    float 8388736.0 + w (w + 128 fits the low mantissa bits), so an integer add and a
    float subtract replace the int-to-float converter (I2F)."""
    if FAST_CVT:
        return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _to_operand(w, dtype: tl.constexpr, FAST_CVT: tl.constexpr):
    """An int8 weight tile as a tensor-core operand of ``dtype``, exactly."""
    if FAST_CVT:
        wf = _int8_to_f32(w, FAST_CVT)
        if dtype == tl.bfloat16:
            # an integer of at most 8 significant bits: its bf16 is the fp32's upper half
            return (wf.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return wf.to(dtype)
    return w.to(dtype)


@triton.jit
def _scaled(acc, rn, s_ptr, b_ptr, N, HAS_BIAS: tl.constexpr):
    """``acc * scale[rn] + bias[rn]`` in fp32 (``rn`` broadcast to ``acc``'s shape)."""
    acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _finish(acc, acc_up, rm, rn, pid_k, s_ptr, b_ptr, y_ptr, p_ptr, M, N, stride_ym,
            HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr):
    """Scale, bias and store ``acc`` (row ``rm``, channel ``rn`` per element, broadcast to
    its shape), or store it unscaled as partial sum ``pid_k`` when K is split. GATED:
    ``acc`` is the gate and ``acc_up`` the up projection of channels ``rn`` (whose weight
    rows are ``rn + N``): store ``silu(gate) * up``."""
    mask = (rm < M) & (rn < N)
    if GATED:
        gate = _scaled(acc, rn, s_ptr, b_ptr, N * 2, HAS_BIAS)
        up = _scaled(acc_up, rn + N, s_ptr, b_ptr, N * 2, HAS_BIAS)
        out = gate * tl.sigmoid(gate) * up
        tl.store(y_ptr + rm * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=mask)
    elif SPLIT_K == 1:
        out = _scaled(acc, rn, s_ptr, b_ptr, N, HAS_BIAS)
        tl.store(y_ptr + rm * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + (pid_k * M + rm) * N + rn, acc, mask=mask)


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FAST_CVT: tl.constexpr, GATED: tl.constexpr):
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    # the K slices of the splits are whole blocks, so only K's own end needs a mask
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K) if GATED else (1, 1, 1), dtype=tl.float32)
    for k0 in tl.range(pid_k * k_per, (pid_k + 1) * k_per, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        # the scale is applied once, after the K reduction
        acc += x[:, None, :] * _int8_to_f32(w, FAST_CVT)[None, :, :]
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=n_mask[:, None] & k_mask[None, :], other=0)
            acc_up += x[:, None, :] * _int8_to_f32(w_up, FAST_CVT)[None, :, :]
    _finish(tl.sum(acc, axis=2), tl.sum(acc_up, axis=2), rm[:, None], rn[None, :], pid_k, s_ptr, b_ptr,
            y_ptr, p_ptr, M, N, stride_ym, HAS_BIAS, SPLIT_K, GATED)


@triton.jit
def _gemm(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
          HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
          SPLIT_K: tl.constexpr, FAST_CVT: tl.constexpr, GATED: tl.constexpr, SWAP_AB: tl.constexpr):
    # grouped launch order: programs that run together share weight tiles in L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = grouped_tile(pid, tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP_N)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(pid_k * k_per, (pid_k + 1) * k_per, BLOCK_K):
        k_mask = (k0 + rk) < K
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :]
        w_mask = (rn[:, None] < N) & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0)
        if SWAP_AB:
            # y.T = w @ x.T: the converted weight is the left operand (from registers)
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + rk)[:, None],
                         mask=(rm[None, :] < M) & k_mask[:, None], other=0.0)
            acc = tl.dot(_to_operand(w, xt.dtype, FAST_CVT), xt, acc, input_precision=PRECISION)
            if GATED:
                acc_up = tl.dot(_to_operand(w_up, xt.dtype, FAST_CVT), xt, acc_up, input_precision=PRECISION)
        else:
            # y = x @ w.T: the activation tile is the left operand, the converted weight the right
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                        mask=(rm[:, None] < M) & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(_to_operand(w, x.dtype, FAST_CVT)), acc, input_precision=PRECISION)
            if GATED:
                acc_up = tl.dot(x, tl.trans(_to_operand(w_up, x.dtype, FAST_CVT)), acc_up,
                                input_precision=PRECISION)
    if SWAP_AB:
        _finish(acc, acc_up, rm[None, :], rn[:, None], pid_k, s_ptr, b_ptr, y_ptr, p_ptr, M, N, stride_ym,
                HAS_BIAS, SPLIT_K, GATED)
    else:
        _finish(acc, acc_up, rm[:, None], rn[None, :], pid_k, s_ptr, b_ptr, y_ptr, p_ptr, M, N, stride_ym,
                HAS_BIAS, SPLIT_K, GATED)


@triton.jit
def _splitk_reduce(p_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * M * N + offs, mask=mask, other=0.0)
    _finish(acc, acc, offs // N, offs % N, 0, s_ptr, b_ptr, y_ptr, p_ptr, M, N, stride_ym, HAS_BIAS, 1,
            False)


def run_int8(kind: str, config: Config, x2d: Tensor, w: Tensor, scale: Tensor, bias: Tensor | None,
             y: Tensor, gated: bool = False) -> None:
    """Launch ``kind`` with ``config``: ``y[M, N] = (x2d @ w.T) * scale + bias``, or with
    ``gated`` (``w``: the gate's N rows, then the up projection's) ``y[M, N] = silu(gate) * up``.
    M may be symbolic (a graph compiled for dynamic M): it enters only the grid and the
    kernels' runtime arguments; the GEMV's rows come from M's bucket."""
    m, k = x2d.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    split = config.split_k
    if gated and split != 1:
        raise ValueError("the gated kernels take no K split")
    # distinct dummies where nothing is stored or read: Inductor's mutation analysis then sees
    # y (or the partial sums) as the only tensor written
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2d.device) if split > 1 else scale
    b = bias if bias is not None else scale
    args = (x2d, w, scale, b, y, part, m, n, k, x2d.stride(0), w.stride(0), y.stride(0))
    meta = {"HAS_BIAS": bias is not None, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
            "SPLIT_K": split, "FAST_CVT": config.fast_cvt, "GATED": gated,
            "num_warps": config.num_warps, "num_stages": config.num_stages}
    grid_n = triton.cdiv(n, config.block_n)
    if kind == "gemv":
        _gemv[(grid_n, split)](*args, BLOCK_M=int8_configs.m_bucket(m), **meta)
    else:
        precision = "ieee" if x2d.dtype == torch.float32 else "tf32"
        _gemm[(grid_n * triton.cdiv(m, config.block_m), split)](
            *args, PRECISION=precision, BLOCK_M=config.block_m, GROUP_N=8, SWAP_AB=config.swap_ab, **meta)
    if split > 1:
        _splitk_reduce[(triton.cdiv(m * n, 1024),)](part, scale, b, y, m, n, y.stride(0), split,
                                                             HAS_BIAS=bias is not None, BLOCK=1024)


#: the choice per (tuning key, tuning on): one look-up per shape and process
_TUNED: dict[tuple, Candidate] = {}
#: every candidate's time (ms) per tuning key: what the benchmark reports
TUNING_TIMES: dict[tuple, dict[tuple[str, Config], float]] = {}
_EVICT: dict[torch.device, Tensor] = {}


def _time_ms(launch, device: torch.device, reps: int) -> float:
    """Median device time of ``launch()``, each run after *reading* a buffer twice the size
    of L2: the weight then comes from HBM, as in a stack of layers too large for L2, and
    no dirty cache lines are written back while the timed kernel reads. (Timed with
    ``triton.testing.do_bench``, which flushes L2 by writing, the down projection's best
    GEMV and GEMM at M = 1 were within 2% of each other on an H100, where CUDA-graph
    replays of the same kernels were 13% apart: see bench/RESULTS.md.)"""
    if device not in _EVICT:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        _EVICT[device] = torch.ones(2 * l2 // 4, dtype=torch.int32, device=device)
    launch()  # compiles
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _EVICT[device].sum()
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _timing_operands(m: Any, bucket: int, w: Tensor, k: int, dtype: torch.dtype, has_bias: bool,
                     gated: bool) -> tuple[Tensor, ...]:
    """Real random operands of the shape being tuned, ``(x2d, w, scale, bias, y)``. The
    op's own operands may be fake (tuning while ``torch.compile`` traces): these are made
    outside every dispatch mode, with M the concrete row count where it is one, else the
    bucket's."""
    rows = m if isinstance(m, int) else bucket
    n = w.shape[0] // 2 if gated else w.shape[0]
    device = w.device
    with _disable_current_modes():
        x = torch.randn(rows, k, dtype=dtype, device=device)
        wq = torch.randint(-127, 128, tuple(w.shape), dtype=torch.int8, device=device)
        scale = torch.rand(w.shape[0], dtype=torch.float32, device=device) / 127
        bias = torch.randn(w.shape[0], dtype=dtype, device=device) if has_bias else None
        return x, wq, scale, bias, torch.empty(rows, n, dtype=dtype, device=device)


def tuned_config(x2d: Tensor, w: Tensor, scale: Tensor, bias: Tensor | None, y: Tensor,
                 kind: str | None = None, gated: bool = False) -> Candidate:
    """The kernel and configuration for this (M bucket, N, K, dtypes, kernel choice), chosen
    on the first call with these operands by :func:`fxopt.quant.int8_configs.choose`: from
    the on-disk cache, by timing every candidate (:func:`_time_ms`, on random operands of
    the same shape) only where tuning is on, else from the shipped defaults for this GPU
    family or by shape. A first call that tunes must not be inside a CUDA graph capture.
    The operands may be fake and M symbolic (``torch.compile`` tracing the op): the choice
    then guards the compiled graph on M's bucket. On CPU tensors (Triton's interpreter, in
    tests) nothing is timed or read from disk: the choice by shape."""
    m, k = x2d.shape
    bucket = int8_configs.m_bucket(m)
    # the weight's shape is concrete to choose by (int() specializes a symbolic one)
    key = (bucket, int(w.shape[0]), int(k), x2d.dtype, bias is not None, kind, gated)
    # tuning switched on later must not be answered by an untuned pick of this process
    memo_key = (key, int8_configs.tuning_enabled())
    if memo_key not in _TUNED:
        found = candidates(bucket, kind, gated)
        if not x2d.is_cuda:
            _TUNED[memo_key] = int8_configs.choose(key, found, None, None, None)
            return _TUNED[memo_key]
        machine = (f"{torch.cuda.get_device_name(x2d.device)}|triton {triton.__version__}"
                   f"|torch {torch.__version__}")
        family = int8_configs.gpu_family(torch.cuda.get_device_capability(x2d.device))

        def timed(candidate: Candidate, reps: int) -> float | None:
            operands = _timing_operands(m, bucket, w, k, x2d.dtype, bias is not None, gated)
            try:
                with _disable_current_modes():
                    t = _time_ms(lambda: launch(candidate, *operands, gated), x2d.device, reps)
            except triton.runtime.errors.OutOfResources:
                return None
            TUNING_TIMES.setdefault(key, {})[candidate] = t
            return t

        _TUNED[memo_key] = int8_configs.choose(key, found, machine, family, timed)
    return _TUNED[memo_key]


@triton.jit
def _int4_to(p, dtype: tl.constexpr):
    """The two int4 values of each packed byte of ``p`` (low nibble, high nibble; each
    stored + 8) as ``dtype``, exactly: the nibble or'ed into the mantissa of 2**23 is the
    float 8388608 + nibble, so an integer and, an or and a float subtract replace the
    int-to-float converter (as ``_int8_to_f32``)."""
    u = p.to(tl.int32)
    lo = ((u & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = ((u >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo.to(dtype), hi.to(dtype)


@triton.jit
def _gemv_int4(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
               stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
               GROUPS: tl.constexpr):
    # w is [N, K/2] uint8: within each group of GROUP values, byte j holds element j (low
    # nibble) and element j + GROUP/2 (high). Program (n block, row) reads GROUPS groups
    # per iteration (enough bytes in flight per thread) with one scale each.
    HALF: tl.constexpr = GROUP // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    rg = tl.arange(0, GROUPS)
    rj = tl.arange(0, HALF)
    n_mask = rn < N
    n_groups = K // GROUP
    acc = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float32)
    for g0 in tl.range(0, n_groups, GROUPS):
        g = g0 + rg
        g_ok = g < n_groups
        p = tl.load(w_ptr + rn[:, None, None] * stride_wn + (g * HALF)[None, :, None] + rj[None, None, :],
                    mask=n_mask[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=n_mask[:, None] & g_ok[None, :], other=0.0)
        lo, hi = _int4_to(p, tl.float32)
        x_ptrs = x_ptr + row * stride_xm + (g * GROUP)[:, None] + rj[None, :]
        x_lo = tl.load(x_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptrs + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
        acc += (lo * x_lo[None, :, :] + hi * x_hi[None, :, :]) * s[:, :, None]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_int4(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
               stride_ym, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    # y.T = w @ x.T as in _gemm; one iteration is one group: its two halves, one scale
    HALF: tl.constexpr = GROUP // 2
    pid_n = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, HALF)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in tl.range(0, K // GROUP):
        p = tl.load(w_ptr + rn[:, None] * stride_wn + g * HALF + rk[None, :], mask=n_mask[:, None], other=0)
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0)
        xt_ptrs = x_ptr + rm[None, :] * stride_xm + g * GROUP + rk[:, None]
        xt_lo = tl.load(xt_ptrs, mask=m_mask[None, :], other=0.0)
        xt_hi = tl.load(xt_ptrs + HALF, mask=m_mask[None, :], other=0.0)
        # nibble -> activation dtype (exact), times the scale in that dtype: one rounding
        dt = xt_lo.dtype
        lo, hi = _int4_to(p, dt)
        acc = tl.dot(lo * s[:, None].to(dt), xt_lo, acc, input_precision=PRECISION)
        acc = tl.dot(hi * s[:, None].to(dt), xt_hi, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[None, :] & n_mask[:, None])


def int4_config(bucket: int, kernel: str | None = None) -> tuple[str, dict[str, int]]:
    """The int4 kernel and its launch configuration for M bucket ``bucket`` (by shape, not
    timed): the GEMV up to :data:`INT4_GEMV_MAX_M` rows, the swap-AB GEMM above, with
    tiles as tall as the bucket up to 128 rows."""
    kernel = kernel or ("gemv" if bucket <= INT4_GEMV_MAX_M else "gemm")
    if kernel == "gemv":
        return kernel, dict(INT4_GEMV_CONFIG)
    block_m = min(max(bucket, 16), 128)
    return kernel, {"BLOCK_N": 64 if block_m <= 64 else 128, "BLOCK_M": block_m,
                    "num_warps": 4 if block_m <= 64 else 8, "num_stages": 3}


#: the int4 GEMV's launch configuration: BLOCK_N output channels per program, GROUPS groups
#: of K per iteration. The fastest of bench/quant_serving.py's sweep over the Llama MLP's
#: layers on an H100 (11008x4096: 19.4 us, 4096x11008: 20.6 us at M = 1, against cuBLAS
#: bf16's 36.1 and 36.9 us; bench/RESULTS.md)
INT4_GEMV_CONFIG = {"BLOCK_N": 4, "GROUPS": 8, "num_warps": 4, "num_stages": 1}


def int8_weight_only_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                            kernel: str | None = None, config: Config | None = None) -> Tensor:
    """``F.linear(x, w.to(x.dtype)) * w_scale + bias`` without materializing ``w.to(x.dtype)``.

    ``x``: ``[..., K]`` fp32/bf16/fp16; ``w``: ``[N, K]`` int8 with unit stride along K;
    ``w_scale``: ``[N]`` float32; ``bias``: ``[N]`` or None. ``kernel`` ("gemv" or "gemm")
    and ``config`` force a kernel and its configuration (benchmarks compare them); by
    default :func:`tuned_config` picks both.
    """
    return _linear(x, w, w_scale, bias, kernel, config, gated=False)


def int8_weight_only_swiglu(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                            kernel: str | None = None, config: Config | None = None) -> Tensor:
    """``silu(gate) * up`` where ``[gate, up]`` is the weight-only linear of ``x`` with the
    ``[2N, K]`` weight ``w`` (the gate's N rows first): one kernel, no ``[.., 2N]`` output.

    Arguments as :func:`int8_weight_only_linear`; the result is ``[..., N]``.
    """
    return _linear(x, w, w_scale, bias, kernel, config, gated=True)


def _linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None, kernel: str | None,
            config: Config | None, gated: bool) -> Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m = x2d.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    scale = w_scale.to(torch.float32).contiguous()
    bias = bias.contiguous() if bias is not None else None
    if config is None:
        kernel, config = tuned_config(x2d, w, scale, bias, y, kernel, gated)
    y = launch((kernel or ("gemv" if m <= GEMV_MAX_M else "gemm"), config), x2d, w, scale, bias, y, gated)
    return y.reshape(*lead, n)


def launch(candidate: Candidate, x2d: Tensor, w: Tensor, scale: Tensor, bias: Tensor | None, y: Tensor,
           gated: bool) -> Tensor:
    """Run ``candidate`` and return its ``[M, N]`` result: a Triton kernel writes ``y``; the
    ``"reference"`` candidate (the weight dequantized by one pointwise kernel, then cuBLAS)
    returns a new tensor. The reference is a candidate because at large M a GEMM is bound by
    the tensor cores, where cuBLAS may beat the mixed-input Triton GEMM: the tuner times it
    like the kernels, and the shipped table may pick it per M bucket."""
    kind, config = candidate
    if kind == int8_configs.REFERENCE:
        reference = int8_weight_only_swiglu_reference if gated else int8_weight_only_linear_reference
        return reference(x2d, w, scale, bias)
    run_int8(kind, config, x2d, w, scale, bias, y, gated)
    return y


def int4_weight_only_linear(x: Tensor, w: Tensor, scales: Tensor, group_size: int,
                            bias: Tensor | None, kernel: str | None = None,
                            config: dict[str, int] | None = None) -> Tensor:
    """``x @ dequant(w).T + bias`` for int4 weights in groups of ``group_size`` along K.

    ``w``: ``[N, K/2]`` uint8 packed as :func:`fxopt.quant.formats.pack_int4` does;
    ``scales``: ``[N, K/group_size]`` float32. Dequantization happens in registers.
    ``kernel``/``config`` force a kernel and its launch configuration (benchmarks sweep
    them); by default :func:`int4_config` picks them from M's bucket.
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
    bucket = int8_configs.m_bucket(m)
    kernel, default = int4_config(bucket, kernel)
    meta = config or default
    args = (x2d, w, scales, b, y, m, n, k, x2d.stride(0), w.stride(0), scales.stride(0), y.stride(0))
    if kernel == "gemv":
        _gemv_int4[(triton.cdiv(n, meta["BLOCK_N"]), m)](
            *args, HAS_BIAS=bias is not None, GROUP=group_size, **meta)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _gemm_int4[(triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),)](
            *args, HAS_BIAS=bias is not None, PRECISION=precision, GROUP=group_size, **meta)
    return y.reshape(*lead, n)
