"""The Triton weight-only kernels, run by Triton's interpreter on CPU tensors.

Skipped where triton is not installed (CI's CPU torch has none). The interpreter of
triton 3.6 fails under numpy >= 2.3 and computes bf16 ``tl.dot`` wrongly, so those cases
are left out here; the GPU benchmark checks the kernels against a dequantized reference
on the real hardware before it times them.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

from fxopt.quant.ops import pack_int4, unpack_int4

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 3):
    pytest.skip("triton's interpreter needs numpy < 2.3", allow_module_level=True)
if "triton" in sys.modules:
    pytest.skip("triton was already imported in compiled mode in this process", allow_module_level=True)
# triton reads this when it is imported and when kernels launch; it stays set for this
# process (where triton is installed; CI's CPU torch has none)
os.environ["TRITON_INTERPRET"] = "1"
from fxopt.quant import triton_kernels  # noqa: E402

CASES = [(1, 40, 256, torch.float32, True, "gemv"), (2, 24, 512, torch.bfloat16, False, "gemv"),
         (5, 72, 256, torch.float16, True, "gemm"), (17, 33, 512, torch.float32, False, "gemm")]


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel", CASES)
def test_int8_kernels_match_dequantized_reference(m, n, k, dtype, bias, kernel):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) / 100
    b = torch.randn(n, dtype=dtype) if bias else None
    y = triton_kernels.int8_weight_only_linear(x, w, s, b, kernel=kernel)
    expected = (x.float() @ w.float().t()) * s + (b.float() if bias else 0)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel", CASES)
def test_int4_kernels_match_dequantized_reference(m, n, k, dtype, bias, kernel):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype)
    packed, scales = pack_int4(torch.randn(n, k), 64)
    b = torch.randn(n, dtype=dtype) if bias else None
    y = triton_kernels.int4_weight_only_linear(x, packed, scales, 64, b, kernel=kernel)
    expected = x.float() @ unpack_int4(packed, scales, 64).t() + (b.float() if bias else 0)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
