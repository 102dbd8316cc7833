"""The Triton weight-only kernels, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1 pytest tests/quant/test_triton_kernels.py``).

Run in a child process by tests/test_triton_interpreter.py (see tests/triton_interpreter.py),
wherever triton is installed. The interpreter of triton 3.6 fails under numpy >= 2.3 and computes bf16 ``tl.dot`` wrongly, so those cases
are left out here; the GPU benchmark checks the kernels against a dequantized reference
on the real hardware before it times them.
"""

from __future__ import annotations

import pytest
import torch

from fxopt.quant.formats import pack_int4, unpack_int4

from ..triton_interpreter import use_interpreter

use_interpreter()  # before anything imports triton
from fxopt.quant import triton_kernels  # noqa: E402

CASES = [(1, 40, 256, torch.float32, True, "gemv"), (2, 24, 512, torch.bfloat16, False, "gemv"),
         (5, 72, 256, torch.float16, True, "gemm"), (17, 33, 512, torch.float32, False, "gemm")]

Config = triton_kernels.Config
#: (M, N, K, dtype, bias, kernel, config): K not a multiple of the split slices, split K
#: with and without bias, both int8 conversions, and tiles wider than N
CONFIG_CASES = [
    (1, 40, 320, torch.bfloat16, True, "gemv", Config(16, 64, 4, 1, split_k=2)),
    (2, 24, 320, torch.float32, False, "gemv", Config(8, 64, 4, 1, split_k=3, fast_cvt=0)),
    (3, 48, 256, torch.float16, True, "gemv", Config(32, 128, 4, 1, split_k=1)),
    (5, 72, 320, torch.float16, True, "gemm", Config(32, 32, 4, 2, split_k=3)),
    (16, 40, 256, torch.float32, False, "gemm", Config(64, 64, 4, 2, split_k=2, fast_cvt=0)),
    (17, 33, 96, torch.float32, True, "gemm", Config(32, 32, 4, 2, split_k=1, block_m=32)),
    # the normal orientation (y = x @ w.T): M over several row tiles, K and N ragged, K split
    (70, 40, 200, torch.float32, True, "gemm", Config(32, 64, 4, 2, block_m=32, swap_ab=0)),
    (33, 72, 320, torch.float16, False, "gemm", Config(64, 32, 4, 2, split_k=3, block_m=16, fast_cvt=0, swap_ab=0)),
    (5, 24, 96, torch.float16, True, "gemm", Config(16, 32, 4, 3, block_m=64, swap_ab=0)),
]


def _int8_case(m, n, k, dtype, bias):
    x = torch.randn(m, k, dtype=dtype)
    # the full int8 range, -128 included: the fast conversion must be exact on every value
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) / 100
    b = torch.randn(n, dtype=dtype) if bias else None
    expected = (x.double() @ w.double().t()) * s.double() + (b.double() if bias else 0)
    return x, w, s, b, expected


def _assert_matches(y, expected, dtype):
    assert y.dtype == dtype and not y.isnan().any()
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel", CASES)
def test_int8_kernels_match_dequantized_reference(m, n, k, dtype, bias, kernel):
    x, w, s, b, expected = _int8_case(m, n, k, dtype, bias)
    y = triton_kernels.int8_weight_only_linear(x, w, s, b, kernel=kernel)
    _assert_matches(y, expected, dtype)


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel,config", CONFIG_CASES)
def test_int8_configs_match_dequantized_reference(m, n, k, dtype, bias, kernel, config):
    x, w, s, b, expected = _int8_case(m, n, k, dtype, bias)
    y = triton_kernels.int8_weight_only_linear(x, w, s, b, kernel=kernel, config=config)
    _assert_matches(y, expected, dtype)


GATED_CASES = [
    (1, 40, 320, torch.float32, True, "gemv", None),
    (2, 24, 256, torch.bfloat16, False, "gemv", Config(8, 64, 4, 1, fast_cvt=0)),
    (5, 72, 256, torch.float16, True, "gemm", None),
    (16, 40, 320, torch.float32, False, "gemm", Config(32, 64, 4, 2, fast_cvt=0)),
    (40, 24, 320, torch.float16, True, "gemm", Config(16, 64, 4, 2, block_m=32, swap_ab=0)),
    (70, 40, 256, torch.float32, False, "gemm", Config(32, 64, 4, 2, block_m=64, fast_cvt=0, swap_ab=0)),
    (40, 24, 256, torch.float32, True, "reference", None),
]


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel,config", GATED_CASES)
def test_int8_swiglu_matches_dequantized_reference(m, n, k, dtype, bias, kernel, config):
    x, w, s, b, both = _int8_case(m, 2 * n, k, dtype, bias)
    expected = torch.nn.functional.silu(both[:, :n]) * both[:, n:]
    y = triton_kernels.int8_weight_only_swiglu(x, w, s, b, kernel=kernel, config=config)
    assert y.shape == (m, n)
    _assert_matches(y, expected, dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_every_large_m_candidate_matches_the_reference(gated):
    """Each candidate of the bucket above 256 rows (both GEMM orientations, both
    conversions, the reference) on one ragged shape: what the tuner may pick computes the
    same function. float32: the interpreter's bf16 ``tl.dot`` is wrong (module doc)."""
    n = 24
    x, w, s, b, full = _int8_case(300, 2 * n if gated else n, 80, torch.float32, True)
    expected = torch.nn.functional.silu(full[:, :n]) * full[:, n:] if gated else full
    op = triton_kernels.int8_weight_only_swiglu if gated else triton_kernels.int8_weight_only_linear
    found = triton_kernels.candidates(triton_kernels.int8_configs.LARGE_M, gated=gated)
    assert {c.swap_ab for kind, c in found if kind == "gemm"} == {0, 1}
    assert ("reference", None) in found
    for kernel, config in found:
        _assert_matches(op(x, w, s, b, kernel=kernel, config=config), expected, torch.float32)


def test_gated_kernels_refuse_a_k_split():
    x, w, s, _, _ = _int8_case(1, 16, 64, torch.float32, False)
    with pytest.raises(ValueError, match="no K split"):
        triton_kernels.int8_weight_only_swiglu(x, w, s, None, kernel="gemv", config=Config(8, 64, 4, 1, split_k=2))


def test_int8_fast_conversion_is_exact():
    """One input channel at a time: the GEMV's output is then the converted weight itself."""
    w = torch.arange(-128, 128, dtype=torch.int8).reshape(256, 1).repeat(1, 64)
    x = torch.zeros(1, 64)
    x[0, 5] = 1.0
    y = triton_kernels.int8_weight_only_linear(x, w, torch.ones(256), None, kernel="gemv",
                                               config=Config(16, 64, 4, 1, fast_cvt=1))
    assert torch.equal(y[0], torch.arange(-128, 128, dtype=torch.float32))


INT4_CASES = [(m, n, k, dtype, bias, kernel, group) for (m, n, k, dtype, bias, kernel), group
              in zip(CASES, (64, 128, 32, 64))] + [(3, 16, 96, torch.float32, True, "gemm", 32)]


@pytest.mark.parametrize("m,n,k,dtype,bias,kernel,group", INT4_CASES)
def test_int4_kernels_match_dequantized_reference(m, n, k, dtype, bias, kernel, group):
    """Group sizes 32-128, K an odd multiple of the group (96 = 3 x 32)."""
    x = torch.randn(m, k, dtype=dtype)
    packed, scales = pack_int4(torch.randn(n, k), group)
    b = torch.randn(n, dtype=dtype) if bias else None
    y = triton_kernels.int4_weight_only_linear(x, packed, scales, group, b, kernel=kernel)
    expected = x.float() @ unpack_int4(packed, scales, group).t() + (b.float() if bias else 0)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_first_call_on_a_gpu_times_nothing_unless_tuning_is_on(tmp_path, monkeypatch):
    """tuned_config's CUDA path, with the GPU faked: untuned by default (timing raises), and
    with FXOPT_INT8_TUNE=1 the candidates are timed and the winner is cached on disk."""
    from types import SimpleNamespace

    from fxopt.quant import int8_configs, tuning_cache

    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(int8_configs.TUNE_ENV, raising=False)
    monkeypatch.setattr(int8_configs, "_tuning", None)
    monkeypatch.setattr(triton_kernels, "_TUNED", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def no_timing(launch, device, reps):
        raise AssertionError("timed a candidate although tuning is off")

    monkeypatch.setattr(triton_kernels, "_time_ms", no_timing)
    x = SimpleNamespace(shape=(3, 64), dtype=torch.bfloat16, is_cuda=True, device="cuda:0")
    w, s = torch.zeros(48, 64, dtype=torch.int8), torch.ones(48)
    found = triton_kernels.candidates(16)
    untuned = triton_kernels.tuned_config(x, w, s, None, None)
    assert untuned in found and not tuning_cache.cache_path().exists()

    fastest = found[-1]
    assert fastest != untuned
    monkeypatch.setattr(triton_kernels, "launch", lambda candidate, *args: candidate)
    monkeypatch.setattr(triton_kernels, "_time_ms",
                        lambda launch, device, reps: 1.0 if launch() == fastest else 2.0)
    monkeypatch.setenv(int8_configs.TUNE_ENV, "1")
    assert triton_kernels.tuned_config(x, w, s, None, None) == fastest  # not the untuned memo
    assert tuning_cache.lookup(tuning_cache.entry_key(
        f"NVIDIA H100 80GB HBM3|triton {triton_kernels.triton.__version__}|torch {torch.__version__}",
        (16, 48, 64, torch.bfloat16, False, None, False)))[0] == fastest[0]
