"""``gelu(x @ w.T + b)`` with exact (erf) GELU as one Triton GEMM, chosen per shape by timing.

Why: under ``torch.compile`` Inductor runs a linear on cuBLAS (an external kernel it cannot
fuse into) and the GELU after it as a separate Triton kernel that reads and writes the whole
``[M, N]`` activation once more. cuBLASLt's GELU epilogue is the tanh approximation, so it
cannot stand in for ``F.gelu`` (exact). In ConvNeXt's MLPs (K = C, N = 4C, M = batch * H * W)
that extra pass cost ~20% of the GPU time of a forward on an H100 (issue #30). Here the GEMM
applies bias and GELU to its fp32 accumulator before the one store.

The kernel: tiles ``BLOCK_M x BLOCK_N`` of the output, walked in groups of ``GROUP_M`` rows
of tiles so that neighbouring programs share the weight's and the activation's tiles in L2;
both operands are loaded in the activation's dtype and fed to ``tl.dot`` (wgmma on Hopper,
pipelined over ``num_stages`` shared-memory buffers); fp32 accumulation and epilogue
(bias, ``0.5 * v * (1 + erf(v / sqrt(2)))``), stored in the activation's dtype. Strides
are arguments, so a weight used transposed or an activation that is not contiguous in
its rows costs no copy. Rows and columns past the edge are clamped for loads (``rm % M``)
and masked on the store; ``EVEN_K`` drops the K mask where BLOCK_K divides K.

Whether it beats cuBLAS + a GELU kernel depends on the shape: a skinny K (ConvNeXt's first
stages, K = 96..192) is bound by memory traffic, where saving the extra pass wins; a large
square GEMM is bound by tensor-core throughput, where cuBLAS may be faster. So
:func:`linear_gelu` *measures*: on the first call of each (M bucket, N, K, dtype, bias,
layout, device) it times a few configurations and the reference (``F.linear`` then GELU)
and keeps the fastest, so it is never slower than what it replaces, as measured there.
During CUDA-graph capture nothing is timed: the cached choice, else the reference.

Triton is imported on the first CUDA use only (``_kernel``), never by ``import fxopt``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fxopt.compile.timing import time_ms

#: the activation dtypes the kernel takes; others run the reference
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Config:
    """One launch configuration of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}"
                f"/w{self.num_warps}/s{self.num_stages}")


#: what a choice can be: a kernel configuration, or the unfused reference
Choice = Config | Literal["reference"]


@dataclass(frozen=True)
class Decision:
    """The choice for one key and every candidate's median time in ms (None: it could not
    run here, e.g. out of shared memory)."""

    choice: Choice
    timings: dict[str, float | None]


def reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``gelu(linear(x, weight, bias))``, exact GELU, the GELU in place on the GEMM's fresh
    output (cuBLAS with its bias epilogue, then one pointwise kernel on CUDA)."""
    return torch.ops.aten.gelu_(F.linear(x, weight, bias))


def candidate_configs(n: int, k: int) -> list[Config]:
    """The configurations timed for an ``[M, K] x [K, N]`` product (3 to 5).

    BLOCK_K divides K where 32 or 64 does (the unmasked ``EVEN_K`` loop; ConvNeXt's K = 96
    takes 32). The 128x256 tile (8 warps, 3 stages: 48 KiB of shared memory a stage)
    only where 256 divides N, so that no tile is half empty; 64x128 for the small M of
    late stages, where 128-row tiles leave SMs idle.
    """
    bk = 64 if k % 64 == 0 else 32
    configs = [Config(128, 128, bk, 4, 4), Config(128, 128, bk, 8, 3), Config(64, 128, bk, 4, 4),
               Config(128, 64, bk, 4, 4)]
    if n % 256 == 0:
        configs.insert(0, Config(128, 256, bk, 8, 3))
    return configs


def m_bucket(m: int) -> int:
    """The next power of two at or above ``m`` (at least 16): a varying batch or sequence
    length shares one decision per bucket."""
    return max(16, 1 << (max(m, 1) - 1).bit_length())


def kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """The kernel's preconditions: fp16/bf16 throughout, one device, ``weight [N, K]`` with
    ``K == x.shape[-1]``, a dense bias of ``[N]``, and nothing empty. Anything else runs the
    reference, which raises torch's own error for what does not fit at all."""
    if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or weight.dim() != 2 or x.dim() < 1:
        return False
    n, k = weight.shape
    if x.shape[-1] != k or x.device != weight.device or x.numel() == 0 or n == 0 or k == 0:
        return False
    # the kernel reads the bias as a dense vector
    return bias is None or (bias.dtype == x.dtype and bias.shape == (n,) and bias.device == x.device
                            and bias.stride(0) == 1)


def run_config(x: Tensor, weight: Tensor, bias: Tensor | None, config: Config) -> Tensor:
    """``gelu(linear(x, weight, bias))`` by the kernel with ``config``; requires
    :func:`kernel_applies`. Also runs in Triton's interpreter on CPU tensors (tests)."""
    import triton

    k = x.shape[-1]
    x2d = x.reshape(-1, k)  # a view where the leading dims merge (NHWC from channels-last)
    m, n = x2d.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _kernel()[grid](
        x2d, weight, bias if bias is not None else y, y, m, n, k,
        x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return y.view(*x.shape[:-1], n)


def run_choice(x: Tensor, weight: Tensor, bias: Tensor | None, choice: Choice) -> Tensor:
    """Run one choice: a kernel configuration or ``"reference"``."""
    if choice == "reference":
        return reference(x, weight, bias)
    return run_config(x, weight, bias, choice)


# --- the measured choice -------------------------------------------------------------------

_DECISIONS: dict[tuple, Decision] = {}
_LOCK = threading.Lock()


def decisions() -> dict[tuple, Decision]:
    """Every decision made in this process, by key ``(M bucket, N, K, dtype, has_bias,
    K-contiguous operands, device)``: a copy, for reports and tests."""
    with _LOCK:
        return dict(_DECISIONS)


def decision_key(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple:
    """The key a decision is kept under; the layout flag separates the strided cases, which
    load differently."""
    k = x.shape[-1]
    m = x.numel() // k
    k_major = (x.stride(-1) == 1 or x.shape[-1] == 1) and weight.stride(1) == 1
    return (m_bucket(m), weight.shape[0], k, x.dtype, bias is not None, k_major, x.device)


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``gelu(linear(x, weight, bias))`` on CUDA by the fastest of the kernel's
    configurations and the reference, as timed on this key's first call (see the module
    docstring); the reference where the kernel does not apply or Triton is missing."""
    if not x.is_cuda or not kernel_applies(x, weight, bias) or _kernel() is None:
        return reference(x, weight, bias)
    key = decision_key(x, weight, bias)
    with _LOCK:
        decision = _DECISIONS.get(key)
    if decision is None:
        if torch.cuda.is_current_stream_capturing():  # timing would break the capture
            return reference(x, weight, bias)
        decision = _decide(x, weight, bias)
        with _LOCK:
            decision = _DECISIONS.setdefault(key, decision)  # a racing thread's stands
    return run_choice(x, weight, bias, decision.choice)


def _decide(x: Tensor, weight: Tensor, bias: Tensor | None, reps: int = 7,
            timer: Callable[[Callable[[], Any], torch.device, int], float] | None = None) -> Decision:
    """Time the reference and every candidate on the call's own operands with ``timer``
    (default :func:`time_ms`); keep the fastest (the reference on a tie: it is timed first
    and only a strictly faster one replaces it). A configuration Triton cannot build here
    (out of shared memory, an unsupported dot) is recorded as None and skipped."""
    import triton

    timer = timer or time_ms
    unrunnable = (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError)
    choices: list[Choice] = ["reference", *candidate_configs(weight.shape[0], x.shape[-1])]
    timings: dict[str, float | None] = {}
    best, best_ms = "reference", float("inf")
    for choice in choices:
        try:
            ms = timer(lambda choice=choice: run_choice(x, weight, bias, choice), x.device, reps)
        except unrunnable:
            timings[str(choice)] = None
            continue
        timings[str(choice)] = ms
        if ms < best_ms:
            best, best_ms = choice, ms
    return Decision(best, timings)


# --- the kernel ----------------------------------------------------------------------------

@functools.cache
def _kernel():  # noqa: ANN202 - a triton JITFunction, or None without triton
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def linear_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           stride_ym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # grouped order: GROUP_M rows of tiles are walked column by column, so the programs
        # running together read GROUP_M activation tiles and a few weight tiles from L2
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        group_size = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_size
        pid_n = (pid % width) // group_size

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # rows and columns past the edge load a valid row again (masked on the store)
        ram = (rm % M).to(tl.int64)
        rbn = (rn % N).to(tl.int64)
        x_ptrs = x_ptr + ram[:, None] * stride_xm + rk[None, :] * stride_xk
        w_ptrs = w_ptr + rk[:, None] * stride_wk + rbn[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                left = K - kk * BLOCK_K
                a = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0)
                b = tl.load(w_ptrs, mask=rk[:, None] < left, other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        if HAS_BIAS:
            acc += tl.load(b_ptr + rbn).to(tl.float32)[None, :]
        out = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))  # erf(v / sqrt(2))
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return linear_gelu_kernel
