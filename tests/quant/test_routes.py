"""The run-time choice of route of the int8 ops (:func:`fxopt.quant.routes.int8_route`),
on CPU tensors with the GPU's crossover given: the route is a function of dtype, K and the
real row count alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fxopt.quant
from fxopt.quant import routes


@pytest.fixture
def crossover(monkeypatch):
    monkeypatch.setattr(routes, "two_term_max_m", lambda device: 100)


def _route(m: int, k: int = 64, dtype=torch.bfloat16, n: int = routes.NARROW_N) -> str:
    return routes.int8_route(torch.zeros(m, k, dtype=dtype), torch.zeros(n, k, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_takes_two_int8_terms_up_to_the_crossover_then_cublas(crossover, dtype):
    assert [_route(m, dtype=dtype) for m in (2, 16, 17, 99, 100)] == ["two_term"] * 5
    assert [_route(m, dtype=dtype) for m in (101, 4096)] == ["reference"] * 2


def test_decoding_one_row_or_a_narrow_layer_takes_the_weight_only_kernels(crossover):
    assert _route(1) == "weight_only"
    narrow = routes.NARROW_N - 1
    assert [_route(m, n=narrow) for m in (1, 2, routes.DECODE_M)] == ["weight_only"] * 3
    assert [_route(m, n=narrow) for m in (routes.DECODE_M + 1, 100)] == ["two_term"] * 2
    assert _route(101, n=narrow) == "reference"


def test_fp32_and_rows_too_wide_for_the_quantizer_take_the_weight_only_kernels(crossover):
    assert _route(5, dtype=torch.float32) == "weight_only"
    assert _route(5, k=routes.MAX_TWO_TERM_K + 8) == "weight_only"
    assert _route(5, k=routes.MAX_TWO_TERM_K) == "two_term"


def test_an_unmeasured_gpu_gets_the_default_crossover(monkeypatch):
    # a measured crossover apart from the default (the H200's is the default today), so that
    # a lookup that always gave the default would show
    monkeypatch.setitem(routes.TWO_TERM_MAX_M, "A measured GPU", routes.DEFAULT_TWO_TERM_MAX_M // 2)
    routes.two_term_max_m.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU nobody measured")
    try:
        assert routes.two_term_max_m(torch.device("cuda", 0)) == routes.DEFAULT_TWO_TERM_MAX_M
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
        assert routes.two_term_max_m(torch.device("cuda", 1)) == routes.TWO_TERM_MAX_M["NVIDIA H200"]
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "A measured GPU")
        assert routes.two_term_max_m(torch.device("cuda", 2)) == routes.DEFAULT_TWO_TERM_MAX_M // 2
    finally:
        routes.two_term_max_m.cache_clear()


@pytest.mark.parametrize("gated", [False, True])
def test_each_route_runs_its_kernel_and_keeps_the_leading_dims(crossover, monkeypatch, gated):
    """``int8_linear`` with the CUDA kernels replaced by their float definitions, each noting
    that it ran (the kernels themselves: tests/quant/test_gpu.py): the kernel of each route,
    gated or not, and the result shaped ``[*lead, N]``. A batch of no rows never reaches the
    int8 tensor-core kernels, whatever the route says."""
    ran = []

    def definition(x2d, w, w_scale, bias):
        out = F.linear(x2d.float(), w.float() * w_scale.float().reshape(-1, 1), bias)
        if gated:
            gate, up = out.chunk(2, dim=-1)
            out = F.silu(gate) * up
        return out.to(x2d.dtype)

    def two_d(name):
        def kernel(x2d, w, w_scale, bias, is_gated):
            assert x2d.dim() == 2 and is_gated == gated
            ran.append(name)
            return definition(x2d, w, w_scale, bias)
        return kernel

    def weight_only(name):
        def kernel(x, w, w_scale, bias):
            ran.append(name)
            out = definition(x.reshape(-1, x.shape[-1]), w, w_scale, bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return kernel

    swiglu, linear = weight_only("weight_only_swiglu"), weight_only("weight_only_linear")
    monkeypatch.setattr(fxopt.quant, "int8_mm", SimpleNamespace(
        two_term_linear=two_d("two_term"), dequantized_linear=two_d("reference")), raising=False)
    monkeypatch.setattr(fxopt.quant, "triton_kernels", SimpleNamespace(
        int8_weight_only_linear=linear, int8_weight_only_swiglu=swiglu), raising=False)
    k, n = 64, 24
    cases = [((3, 7), torch.bfloat16, n, "two_term"), ((2, 60), torch.float16, n, "reference"),
             ((1, 1), torch.bfloat16, n, "weight_only"), ((4, 10), torch.float32, n, "weight_only"),
             ((0, 5), torch.bfloat16, routes.NARROW_N, "weight_only")]  # two_term by int8_route
    for lead, dtype, rows, route in cases:
        w = torch.randint(-127, 128, (2 * rows if gated else rows, k), dtype=torch.int8)
        s, bias = torch.rand(w.shape[0]) / 100, torch.randn(w.shape[0])
        x = torch.randn(*lead, k, dtype=dtype)
        ran.clear()
        out = routes.int8_linear(x, w, s, bias, gated)
        want = route if route != "weight_only" else ("weight_only_swiglu" if gated else "weight_only_linear")
        assert ran == [want], (lead, dtype)
        assert out.shape == (*lead, rows) and out.dtype == dtype
        expected = definition(x.reshape(-1, k), w, s, bias).reshape(*lead, rows)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
