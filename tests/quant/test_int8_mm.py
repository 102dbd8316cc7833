"""The Triton int8 GEMM of the dynamic route, run by Triton's interpreter on CPU tensors.

Run in a child process by tests/test_triton_interpreter.py (see tests/triton_interpreter.py),
wherever triton is installed; the GPU benchmark checks the kernel on the hardware before timing it.
Each case forces one block configuration (the autotuner times on a GPU) and covers edges:
M, N and K that are not multiples of the blocks, bias or none, every output dtype.
"""

from __future__ import annotations

import pytest
import torch

from ..triton_interpreter import use_interpreter

use_interpreter()  # before anything imports triton
from fxopt.quant import int8_mm  # noqa: E402

CASES = [(17, 40, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, True, torch.bfloat16),
         (70, 24, 200, {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64}, False, torch.float32),
         (5, 72, 128, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, True, torch.float16),
         (130, 48, 96, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}, True, torch.float32)]


@pytest.mark.parametrize("m,n,k,config,bias,dtype", CASES)
def test_int8_scaled_mm_matches_exact_product(m, n, k, config, bias, dtype):
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    xs, ws = torch.rand(m, 1) / 100, torch.rand(n) / 100
    b = torch.randn(n, dtype=dtype) if bias else None
    y = int8_mm.int8_scaled_mm(xq, w, xs, ws, b, dtype, config=config)
    exact = (xq.double() @ w.double().t()) * xs.double() * ws.double() + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    # int32 accumulation is exact; what remains is the output rounding (the interpreter
    # rounds to bf16 by truncation: up to 2 units)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y.double(), exact, rtol=2 * eps, atol=1e-6)


@pytest.mark.parametrize("m,k,dtype", [(1, 768, torch.bfloat16), (13, 3072, torch.float32),
                                       (5, 100, torch.float16), (3, 11008, torch.bfloat16)])
def test_quantize_per_token_is_bit_identical_to_the_aten_definition(m, k, dtype):
    from fxopt.quant.ops import quantize_per_token_reference

    x = torch.randn(m, k, dtype=dtype) * torch.rand(m, 1, dtype=dtype) * 10
    x[0, :] = 0  # an all-zero row: the scale's floor keeps it finite
    if m > 1:  # exact ties (scale 1.0): rounded half to even, as torch.round does
        x[1, :] = 0
        x[1, :6] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -2.5])
    q, s = int8_mm.quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_reference(x)
    assert q.dtype == torch.int8 and s.shape == (m, 1)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    if m > 1:
        assert q[1, :6].tolist() == [127, 0, 2, 2, 0, -2]


@pytest.mark.parametrize("m,k", [(1, 96), (13, 200), (3, 11008)])
def test_two_terms_reconstruct_the_activation_to_far_below_bf16(m, k):
    """Rows 0..M-1: the per-token quantization (bit-identical to quantize_per_token); rows
    M..2M-1: its residual; their sum within 1/60000 of each row's absmax (bf16: 1/256)."""
    x = (torch.randn(m, k) * torch.rand(m, 1) * 10).to(torch.bfloat16)
    q, s = int8_mm.quantize_two_term(x)
    hi, hi_scale = int8_mm.quantize_per_token(x)
    assert q.shape == (2 * m, k) and s.shape == (2 * m,)
    assert torch.equal(q[:m], hi) and torch.equal(s[:m], hi_scale.reshape(m))
    rebuilt = q[:m].double() * s[:m, None].double() + q[m:].double() * s[m:, None].double()
    error = (rebuilt - x.double()).abs().amax(dim=1)
    assert (error <= x.double().abs().amax(dim=1) / 60000).all()
    assert (error > 0).any() or m == 1  # the residual term is not a copy of the first


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (13, 72, 200), (70, 24, 256)])
def test_two_term_and_dequantized_linear_match_float_math(m, n, k, gated):
    """Both large-activation routes of the int8 ops, with a bias, on shapes that are
    multiples of no tile, against float64 math on the dequantized weight."""
    rows = 2 * n if gated else n
    w = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    s = torch.rand(rows) / 500
    b = torch.randn(rows, dtype=torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    out = x.double() @ (w.double() * s[:, None].double()).t() + b.double()
    expected = torch.nn.functional.silu(out[:, :n]) * out[:, n:] if gated else out
    for linear in (int8_mm.two_term_linear, int8_mm.dequantized_linear):
        got = linear(x, w, s, b, gated)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
