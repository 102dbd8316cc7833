"""int8 dynamic linear on CPU: the int8 GEMM op's definition, and the regression for
Inductor's freezing pass that rewrote a visible ``_int_mm -> mul -> mul`` into oneDNN's
``qlinear`` (CPU-only: on CUDA the compile failed; on CPU, torch 2.13, the compiled model
returned wrong numbers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import fxopt.quant as fq
from fxopt.quant.ops import ops


@pytest.mark.parametrize("m,bias,dtype", [(1, True, torch.float32), (17, False, torch.bfloat16),
                                          (40, True, torch.float16)])
def test_int8_scaled_mm_is_exact_int_product_then_scales(m, bias, dtype):
    k, n = 96, 24
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    xs, ws = torch.rand(m, 1) / 50, torch.rand(n) / 50
    b = torch.randn(n, dtype=dtype) if bias else None
    y = ops.int8_scaled_mm(xq, w, xs, ws, b, dtype)
    exact = (xq.double() @ w.double().t()) * xs.double() * ws.double() + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    # exact up to the rounding to fp32 and then to dtype: one unit in the last place
    torch.testing.assert_close(y.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_dynamic_linear_any_leading_shape_and_rows_below_int_mm_minimum():
    x = torch.randn(2, 3, 64)  # 6 rows: torch._int_mm on CUDA would refuse M <= 16
    w, s = torch.randint(-127, 128, (16, 64), dtype=torch.int8), torch.rand(16) / 100
    xs = x.abs().amax(-1, keepdim=True) / 127
    expected = (torch.clamp(torch.round(x / xs), -127, 127) @ w.float().t()) * xs * s
    torch.testing.assert_close(ops.int8_dynamic_linear(x, w, s, None), expected, rtol=1e-5, atol=1e-5)


def _per_token_product(x, w, s, bias):
    """Independent of fxopt: x quantized symmetrically per row to int8, the exact product with
    the int8 weight, both scales, the bias."""
    xs = x.abs().amax(-1, keepdim=True) / 127
    return (torch.clamp(torch.round(x / xs), -127, 127) @ w.float().t()) * xs * s + bias


def test_int8_linear_quantizes_the_activation_from_dynamic_min_tokens_rows_on():
    """``int8_linear``'s threshold counts the rows over every leading dim, and a call of
    exactly ``dynamic_min_tokens`` rows takes the dynamic route: the activation quantized per
    token (about 1/254 of each row's largest value off weight-only, far above the tolerance)."""
    w, s, bias = torch.randint(-127, 128, (16, 64), dtype=torch.int8), torch.rand(16) / 100, torch.randn(16)
    for lead in ((12,), (3, 4)):  # 12 rows
        x = torch.randn(*lead, 64)
        torch.testing.assert_close(ops.int8_linear(x, w, s, bias, 12), _per_token_product(x, w, s, bias),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ops.int8_linear(x, w, s, bias, 13), F.linear(x, w.float() * s[:, None], bias),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.allclose(_per_token_product(x, w, s, bias), F.linear(x, w.float() * s[:, None], bias),
                                  rtol=1e-3, atol=1e-3)  # the two routes tell apart at this tolerance


def test_the_opaque_int8_ops_fake_impls_and_registrations_agree_with_the_real_ones():
    """``torch.library.opcheck``: the fake impl's outputs (shapes, dtypes, strides) are the
    CPU impl's, the schema is honest about mutation and aliasing, and AOT dispatch with
    dynamic shapes works; rows wider than ``PERSISTENT_ROW`` and a bias included."""
    x = torch.randn(5, 2048)
    torch.library.opcheck(ops.quantize_per_token.default, (x,))
    xq = torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    for bias, dtype in ((torch.randn(24), torch.float32), (None, torch.bfloat16)):
        torch.library.opcheck(ops.int8_scaled_mm.default, (xq, w, torch.rand(5, 1), torch.rand(24), bias, dtype))


class _MLP(nn.Module):
    """fc1's rows (128) are quantized by the aten decomposition, fc2's (2048, wider than
    ``PERSISTENT_ROW``) by the ``quantize_per_token`` op."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 2048), nn.Linear(2048, 64)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_dynamic_route_compiles_with_global_freezing_and_matches():
    model = _MLP().eval()
    x = torch.randn(32, 128)
    dyn = fq.quantize_model(model, (x,), "int8_dynamic")
    route = fq.quantize_model(model, (x,), "int8_weight_only", dynamic_min_tokens=17)
    torch._dynamo.reset()
    # the *global* flag is what makes Dynamo lift parameters as frozen constants
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        for q in (dyn, route):
            fresh = torch.randn(32, 128)
            y, code = run_and_get_code(torch.compile(q, fullgraph=True), fresh)
            code = "\n".join(code)
            assert "qlinear" not in code and code.count("torch.ops.fxopt_quant.int8_scaled_mm.default(") == 2
            assert code.count("torch.ops.fxopt_quant.quantize_per_token.default(") == 1
            torch.testing.assert_close(y, q(fresh), rtol=1e-4, atol=1e-4)
            assert fq.sqnr(model(fresh), y) >= 30
    torch._dynamo.reset()
