"""The weight-only ops on a CUDA GPU (skipped elsewhere): every route the ops take
(:mod:`fxopt.quant.routes`: two int8 terms on the int8 tensor cores, dequantize + cuBLAS, the
mixed-input Triton kernels) eagerly and compiled, against float32 references, and one
compiled graph for every M."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt  # noqa: F401 - registers backend="fxopt"
import fxopt.quant as fq
from fxopt.quant.accuracy import sqnr
from fxopt.quant.formats import pack_int4, unpack_int4
from fxopt.quant.ops import ops

pytestmark = pytest.mark.gpu



def _int8(rows: int, k: int):
    w = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device="cuda")
    s = torch.rand(rows, device="cuda") / 500
    return w, s, w.float() * s[:, None]


#: a serving order of row counts, decode first, crossing every route's edges
SERVING_ORDER = (1, 2, 5, 16, 17, 40, 300, 1030, 1536, 1537, 3000, 7)


def _compiled_once(fn):
    """``fn`` compiled with fullgraph, and the list of the graphs Dynamo handed to Inductor."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, backend=inductor, fullgraph=True), graphs


def _unbacked(x):
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_compiles_once_for_every_m(gated, dtype):
    """One Inductor graph across the serving order (the op picks its route at run time),
    every result within 35 dB of the float32 product of the dequantized weight."""
    n, k = 96, 512
    w, s, wf = _int8(2 * n if gated else n, k)
    bias = torch.randn(w.shape[0], device="cuda", dtype=dtype)
    op = ops.int8_weight_only_swiglu if gated else ops.int8_weight_only_linear

    def reference(x):
        out = F.linear(x.float(), wf, bias.float())
        return F.silu(out[:, :n]) * out[:, n:] if gated else out

    compiled, graphs = _compiled_once(lambda x: op(x, w, s, bias))
    with torch.no_grad():
        for m in SERVING_ORDER:
            x = _unbacked(torch.randn(m, k, device="cuda", dtype=dtype))
            expected = reference(x)
            assert sqnr(expected, op(x, w, s, bias)) > 35, m
            assert sqnr(expected, compiled(x)) > 35, m
    assert len(graphs) == 1


#: one M per route and bucket and their edges, 1 .. 4096
EVERY_M = (1, 2, 3, 16, 17, 32, 64, 100, 128, 256, 257, 512, 1024, 1536, 1537, 2048, 4096)


@pytest.mark.parametrize("gated", [False, True])
def test_int8_numerics_at_every_m_bucket_by_default(gated):
    """The default route at every M (two int8 terms up to the crossover, dequantize + cuBLAS
    above) against float32 math: >= 35 dB against the dequantized
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


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("route", ["two_term", "reference", "weight_only"])
def test_each_route_on_ragged_shapes(route, gated):
    """Each route forced (whatever the crossover says) on M, N and K that are multiples of
    no tile, with a bias, bf16: the same numbers as float32 math on the dequantized weight."""
    from fxopt.quant import routes

    n, k = 200, 1000
    w, s, wf = _int8(2 * n if gated else n, k)
    bias = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes, "int8_route", lambda x2d, w: route)
        for m in (1, 13, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = F.linear(x.float(), wf, bias.float())
            expected = F.silu(out[:, :n]) * out[:, n:] if gated else out
            got = routes.int8_linear(x, w, s, bias, gated)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            assert sqnr(expected, got) > 35, (route, m)


def test_the_crossover_sends_large_m_to_cublas():
    """Up to the GPU's crossover the two-term route, above it the dequantized weight (the
    table's value for a GPU it names, the default elsewhere)."""
    from fxopt.quant import routes

    w = torch.zeros(64, 256, dtype=torch.int8, device="cuda")
    limit = routes.two_term_max_m(torch.device("cuda"))
    assert routes.int8_route(torch.zeros(limit, 256, device="cuda", dtype=torch.bfloat16), w) == "two_term"
    assert routes.int8_route(torch.zeros(limit + 1, 256, device="cuda", dtype=torch.bfloat16), w) == "reference"
    assert routes.int8_route(torch.zeros(3, 256, device="cuda"), w) == "weight_only"  # fp32


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
    compiled, graphs = _compiled_once(lambda x: ops.int4_weight_only_linear(x, packed, scales, 128, None))
    with torch.no_grad():
        for m in (1, 7, 64, 200, 300):
            x = _unbacked(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            expected = x.float() @ wf.t()
            assert sqnr(expected, ops.int4_weight_only_linear(x, packed, scales, 128, None)) > 35, m
            assert sqnr(expected, compiled(x)) > 35, m
    assert len(graphs) == 1


def test_quantized_mlp_through_the_fxopt_backend_and_plain_compile():
    """Both routes users compile a quantized model with, the token dim marked unbacked: one
    Dynamo frame each across the serving order, the results the eager quantized model's."""
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).to("cuda", torch.bfloat16).eval()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    for mode in ("int8_weight_only", "int4_weight_only"):
        q = fq.quantize_model(model, (x,), mode)
        assert fq.summary_of(q).coverage == 1.0
        for backend in ("inductor", "fxopt"):
            torch._dynamo.reset()
            counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
            fn = torch.compile(q, backend=counter)
            with torch.no_grad():
                for m in SERVING_ORDER:
                    xm = _unbacked(torch.randn(m, 256, device="cuda", dtype=torch.bfloat16))
                    assert sqnr(q(xm), fn(xm)) > 35, (mode, backend, m)
                    assert sqnr(model(xm), fn(xm)) > (25 if mode == "int8_weight_only" else 12), (mode, m)
            assert counter.frame_count == 1, (mode, backend)


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
