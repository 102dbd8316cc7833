"""The run-time choice of route of the int8 ops (:func:`fxopt.quant.routes.int8_route`),
on CPU tensors with the GPU's crossover given: the route is a function of dtype, K and the
real row count alone."""

from __future__ import annotations

import pytest
import torch

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
    routes.two_term_max_m.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU nobody measured")
    try:
        assert routes.two_term_max_m(torch.device("cuda", 0)) == routes.DEFAULT_TWO_TERM_MAX_M
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
        assert routes.two_term_max_m(torch.device("cuda", 1)) == routes.TWO_TERM_MAX_M["NVIDIA H200"]
    finally:
        routes.two_term_max_m.cache_clear()
