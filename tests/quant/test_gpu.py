"""The weight-only ops on a CUDA GPU (skipped elsewhere): their Triton kernels eagerly and
compiled into Inductor's code, for static and dynamic M, against the dequantized reference."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt  # noqa: F401 - registers backend="fxopt"
import fxopt.quant as fq
from fxopt.quant.accuracy import sqnr
from fxopt.quant.formats import pack_int4, unpack_int4
from fxopt.quant.ops import ops

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch._inductor.utils import run_and_get_code  # noqa: E402


def _int8(rows: int, k: int):
    w = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device="cuda")
    s = torch.rand(rows, device="cuda") / 500
    return w, s, w.float() * s[:, None]


#: bf16 through every M bucket; the other dtypes through two (each bucket is one compile)
CASES = [(gated, torch.bfloat16, (1, 2, 5, 16, 40, 300, 1030)) for gated in (False, True)] + [
    (gated, dtype, (5, 40)) for gated in (False, True) for dtype in (torch.float16, torch.float32)]


@pytest.mark.parametrize("gated,dtype,ms", CASES)
def test_int8_weight_only_compiles_into_inductor_code_for_every_m(gated, dtype, ms):
    n, k = 96, 512
    w, s, wf = _int8(2 * n if gated else n, k)
    bias = torch.randn(w.shape[0], device="cuda", dtype=dtype)
    op = ops.int8_weight_only_swiglu if gated else ops.int8_weight_only_linear

    def reference(x):
        out = F.linear(x.float(), wf, bias.float())
        return F.silu(out[:, :n]) * out[:, n:] if gated else out

    compiled = torch.compile(lambda x: op(x, w, s, bias), fullgraph=True, dynamic=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, torch.randn(3, k, device="cuda", dtype=dtype))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            expected = reference(x)
            assert sqnr(expected, op(x, w, s, bias)) > 35, m
            assert sqnr(expected, compiled(x)) > 35, m
    code = "\n".join(codes)
    assert not re.search(r"fxopt_quant\.\w+\(", code)  # no Python op call left
    assert "_gemv" in code or "_gemm" in code  # fxopt's kernels, compiled into the wrapper
    assert "clone" not in code  # the weight is read where it is, never copied


def test_above_256_rows_the_op_is_dequantize_then_cublas():
    """M > 256: the reference (one pointwise dequantization, then cuBLAS), not the Triton GEMM."""
    w, s, wf = _int8(96, 512)
    compiled = torch.compile(lambda x: ops.int8_weight_only_linear(x, w, s, None), fullgraph=True)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
    code = "\n".join(codes)
    assert "extern_kernels.mm" in code and "_gemm" not in code and "_gemv" not in code
    assert sqnr(x.float() @ wf.t(), out) > 35


def test_int4_weight_only_eager_and_compiled():
    n, k = 80, 384  # groups of 128 on K = 384
    packed, scales = pack_int4(torch.randn(n, k, device="cuda"), 128)
    wf = unpack_int4(packed, scales, 128)
    compiled = torch.compile(lambda x: ops.int4_weight_only_linear(x, packed, scales, 128, None),
                             fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (1, 7, 64, 200):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = x.float() @ wf.t()
            assert sqnr(expected, ops.int4_weight_only_linear(x, packed, scales, 128, None)) > 35, m
            assert sqnr(expected, compiled(x)) > 35, m


def test_quantized_mlp_through_the_fxopt_backend_and_plain_compile():
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).to("cuda", torch.bfloat16).eval()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    for mode in ("int8_weight_only", "int4_weight_only"):
        q = fq.quantize_model(model, (x,), mode)
        assert fq.summary_of(q).coverage == 1.0
        for fn in (torch.compile(q), torch.compile(q, backend="fxopt")):
            with torch.no_grad():
                for m in (1, 4, 33):
                    xm = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
                    assert sqnr(q(xm), fn(xm)) > 35, (mode, m)
                    assert sqnr(model(xm), fn(xm)) > (25 if mode == "int8_weight_only" else 12), (mode, m)


def test_gradients_on_cuda():
    n, k = 64, 256
    w, s, wf = _int8(n, k)
    bias = torch.randn(n, device="cuda", requires_grad=True)
    x = torch.randn(5, k, device="cuda", requires_grad=True)
    grad = torch.randn(5, n, device="cuda")
    torch.compile(lambda x: ops.int8_weight_only_linear(x, w, s, bias))(x).backward(grad)
    gx, gb = x.grad, bias.grad
    x.grad = bias.grad = None
    F.linear(x, wf, bias).backward(grad)
    torch.testing.assert_close(gx, x.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gb, bias.grad, rtol=1e-3, atol=1e-3)
