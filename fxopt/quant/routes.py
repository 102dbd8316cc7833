"""Which kernel computes an int8 linear, chosen inside the op at run time on the real row
count: never by a Dynamo guard, so one compiled graph serves every M.

The routes, measured per layer of the Llama MLP (N x K = 22016 x 4096 and 4096 x 11008,
bf16) on an H200 (``bench/lowbit_probe.py``):

- ``"two_term"`` (:func:`fxopt.quant.int8_mm.two_term_linear`): the activation as two int8
  terms (its per-token quantization and that rounding's residual), the int8 weight read
  once, int8 tensor cores (twice bf16's rate on Hopper). As exact as weight-only (the
  activation's two terms are finer than bf16), and it never stages a converted weight
  through shared memory, which is what held fxopt's mixed-input Triton GEMMs to 0.5-0.7x
  cuBLAS bf16 between 64 and 256 rows. From 2 to 16 rows it ran 1.4-1.55x bf16 (merged
  gate/up: 30.6 vs 47.3 us at M = 8). Above ~100 rows no route that keeps weight-only's
  accuracy can beat bf16: the GEMM is bound by tensor-core time there, and two int8 terms
  cost as many MMAs as bf16 (int8 runs at twice bf16's rate); one-term int8 activations
  would run 1.5-1.7x bf16 but cost 7 dB of SQNR on that stack (``mode="int8_dynamic"``).
- ``"reference"``: the weight dequantized by one pointwise kernel, then cuBLAS bf16: above
  :data:`TWO_TERM_MAX_M` rows, where a GEMM is bound by tensor-core time and the two
  terms' doubled MMAs cost more than dequantizing the weight once per call.
- ``"weight_only"``: fxopt's mixed-input Triton kernels (:mod:`fxopt.quant.triton_kernels`),
  for fp32 activations (two int8 terms carry ~16 bits, short of fp32's 24) and for rows
  wider than the quantizer holds in registers.

The thresholds are per GPU, from measurements (:data:`TWO_TERM_MAX_M`), with the default
for any GPU not measured.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

#: the GPUs whose crossover was measured, by ``torch.cuda.get_device_name``; the largest M
#: at which the two-term int8 product beat dequantizing + cuBLAS on both MLP shapes
TWO_TERM_MAX_M = {"NVIDIA H200": 512}
#: any other GPU
DEFAULT_TWO_TERM_MAX_M = 512
#: the largest row count served as decoding (see :func:`int8_route`)
DECODE_M = 16
#: the widest activation row the two-term quantizer keeps in registers
MAX_TWO_TERM_K = 32768


@functools.cache
def two_term_max_m(device: torch.device) -> int:
    """The crossover on the CUDA ``device`` (looked up once per process and device)."""
    return TWO_TERM_MAX_M.get(torch.cuda.get_device_name(device), DEFAULT_TWO_TERM_MAX_M)


#: output channels below which a tile of 64 makes too few programs to keep a GPU's loads in
#: flight (an H200 has 132 SMs): there, at decode sizes, the weight-only kernels' split K wins
NARROW_N = 128 * 64


def int8_route(x2d: Tensor, w: Tensor) -> str:
    """The route for a CUDA ``x2d`` ``[M, K]`` and an int8 weight ``w`` ``[N, K]`` with unit
    stride along K (the op checked both): see the module doc. At one row, and at decode
    sizes of a narrow layer, the weight-only kernels (a GEMV, split K) read the weight
    faster than the two-term product's tiles (H200, M = 1: 35 vs 38 us on the merged
    gate/up weight, 19 vs 42 us on the down projection)."""
    m, k = x2d.shape
    if x2d.dtype not in (torch.bfloat16, torch.float16) or k > MAX_TWO_TERM_K:
        return "weight_only"
    if m == 1 or (m <= DECODE_M and w.shape[0] < NARROW_N):
        return "weight_only"
    if m > two_term_max_m(x2d.device):
        return "reference"
    return "two_term"


def int8_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None, gated: bool) -> Tensor:
    """``x @ (w * w_scale).T + bias`` (``gated``: ``silu(gate) * up``) by :func:`int8_route`."""
    from fxopt.quant import int8_mm, triton_kernels  # import triton only where CUDA runs

    lead, k = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, k)
    route = int8_route(x2d, w)
    if route == "weight_only" or x2d.shape[0] == 0:
        linear = triton_kernels.int8_weight_only_swiglu if gated else triton_kernels.int8_weight_only_linear
        return linear(x, w, w_scale, bias)
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    scale = w_scale.to(torch.float32).reshape(-1).contiguous()
    compute = int8_mm.dequantized_linear if route == "reference" else int8_mm.two_term_linear
    y = compute(x2d, w, scale, bias, gated)
    return y.reshape(*lead, y.shape[-1])
