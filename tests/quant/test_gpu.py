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


#: one M per bucket and its edges, 1 .. 4096 (int8_configs.m_bucket)
EVERY_M = (1, 2, 3, 16, 17, 32, 64, 100, 128, 256, 257, 512, 1024, 2048, 4096)


@pytest.mark.parametrize("gated", [False, True])
def test_int8_numerics_at_every_m_bucket_by_default(gated):
    """The default route at every M (decode GEMV, swap-AB GEMM, above 256 rows the GEMM or
    whatever the shipped table picks) against float32 math: >= 35 dB against the dequantized
    weight (the kernels are exact up to bf16 rounding), >= 26 dB against the unquantized
    Gaussian weight (the issue's accuracy floor)."""
    n, k = 352, 1024  # N not a multiple of the wide tiles
    weight = torch.randn(2 * n if gated else n, k, device="cuda") / k ** 0.5
    s = weight.abs().amax(dim=1) / 127
    w = torch.round(weight / s[:, None]).clamp(-127, 127).to(torch.int8)
    op = ops.int8_weight_only_swiglu if gated else ops.int8_weight_only_linear

    def reference(x, wf):
        out = x.float() @ wf.t()
        return F.silu(out[:, :n]) * out[:, n:] if gated else out

    with torch.no_grad():
        for m in EVERY_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = op(x, w, s, None)
            assert out.shape == (m, n) and out.dtype == torch.bfloat16
            assert sqnr(reference(x, w.float() * s[:, None]), out) > 35, m
            assert sqnr(reference(x, weight), out) >= 26, m


@pytest.mark.parametrize("gated", [False, True])
def test_every_large_m_candidate_on_the_gpu(gated):
    """Each configuration the tuner may pick above 256 rows (both orientations, both int8
    conversions, the reference), bf16 on the tensor cores (what the interpreter cannot check),
    on a ragged shape: M, N and K not multiples of any tile."""
    from fxopt.quant import int8_configs, triton_kernels

    n, k, m = 200, 1000, 300
    w, s, wf = _int8(2 * n if gated else n, k)
    bias = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = F.linear(x.float(), wf, bias.float())
    expected = F.silu(out[:, :n]) * out[:, n:] if gated else out
    fn = triton_kernels.int8_weight_only_swiglu if gated else triton_kernels.int8_weight_only_linear
    for kernel, config in int8_configs.candidates(int8_configs.LARGE_M, gated=gated):
        assert sqnr(expected, fn(x, w, s, bias, kernel=kernel, config=config)) > 35, (kernel, config)


@pytest.mark.parametrize("by_shape", ["gemm", "reference"])
def test_above_256_rows_the_choice_by_shape_reaches_inductors_code(by_shape, monkeypatch):
    """M > 256 on a shape without a table entry: fxopt's mixed-input GEMM compiled into
    Inductor's code (no weight-sized dequantization, no cuBLAS), or with the switch set to
    the reference, no fxopt kernel at all (the dequantized product is Inductor's to lower:
    on an H100 it did not call ``extern_kernels.mm`` for this small N); the same numbers
    either way."""
    from fxopt.quant import int8_configs, triton_kernels

    monkeypatch.setattr(int8_configs, "LARGE_M_BY_SHAPE", by_shape)
    monkeypatch.setattr(triton_kernels, "_TUNED", {})
    w, s, wf = _int8(80, 512)
    compiled = torch.compile(lambda x: ops.int8_weight_only_linear(x, w, s, None), fullgraph=True)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
    code = "\n".join(codes)
    if by_shape == "gemm":
        assert "_gemm" in code and "extern_kernels.mm" not in code
    else:
        assert "_gemm" not in code and "_gemv" not in code
    assert sqnr(x.float() @ wf.t(), out) > 35


def test_shapes_the_kernels_cannot_take_compute_the_reference():
    """A weight strided along K, int4 groups the kernels cannot read: the op computes its
    reference (bit for bit: the same aten calls), and weight_only_route says why. Odd row
    strides of x and w are the kernels' (they take any row stride)."""
    from fxopt.quant.ops import (
        int4_weight_only_linear_reference,
        int8_weight_only_linear_reference,
        weight_only_route,
    )

    x = torch.randn(40, 96, device="cuda", dtype=torch.bfloat16)
    wt = torch.randint(-127, 128, (96, 64), dtype=torch.int8, device="cuda").t()  # [64, 96], K stride 64
    s = torch.rand(64, device="cuda") / 500
    assert "weight strides" in weight_only_route(x, wt)
    assert torch.equal(ops.int8_weight_only_linear(x, wt, s, None), int8_weight_only_linear_reference(x, wt, s, None))
    wide = torch.randint(-127, 128, (64, 101), dtype=torch.int8, device="cuda")[:, :96]  # row stride 101
    xs = torch.randn(40, 99, device="cuda", dtype=torch.bfloat16)[:, :96]  # row stride 99
    assert weight_only_route(xs, wide) is None
    assert sqnr(xs.float() @ (wide.float() * s[:, None]).t(), ops.int8_weight_only_linear(xs, wide, s, None)) > 35
    packed, scales = pack_int4(torch.randn(64, 96, device="cuda"), 48)  # 48: not a power of two
    assert "group size 48" in weight_only_route(x, packed, 48, scales)
    assert torch.equal(ops.int4_weight_only_linear(x, packed, scales, 48, None),
                       int4_weight_only_linear_reference(x, packed, scales, 48, None))


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
