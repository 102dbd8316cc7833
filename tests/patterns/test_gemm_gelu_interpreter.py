"""fxopt.compile.gemm_gelu's Triton kernel run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1 pytest tests/patterns/test_gemm_gelu_interpreter.py``): ragged M, N
and K, with and without bias, strided activations and weights, several tile shapes.

Run in a child process by tests/test_triton_interpreter.py (see tests/triton_interpreter.py),
wherever triton is installed (test_gemm_gelu_gpu.py also runs the kernel on a GPU). The interpreter computes bf16 ``tl.dot`` wrongly, so the kernel
is checked in fp16 and fp32 here; bf16 on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..triton_interpreter import use_interpreter

use_interpreter()  # before anything imports triton
from fxopt.compile.gemm_gelu import Config, kernel_applies, run_config  # noqa: E402

#: small tiles, so that several tiles, a partial group and ragged edges occur at small sizes
TILES = [Config(16, 32, 32, 4, 1, group_m=2), Config(32, 16, 16, 4, 1, group_m=3)]


def _expected(x, w, b):
    return F.gelu(F.linear(x.double(), w.double(), None if b is None else b.double()))


def _check(y, x, w, b):
    expected = _expected(x, w, b)
    assert y.dtype == x.dtype and y.shape == expected.shape
    # fp16 output: one rounding (2^-11 relative) on top of fp32 accumulation over K <= 200
    tol = 1e-5 if x.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("config", TILES, ids=str)
@pytest.mark.parametrize("m,n,k,bias", [(37, 48, 40, True), (64, 64, 64, False), (5, 17, 96, True),
                                        (70, 33, 200, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_matches_float64_reference(m, n, k, bias, dtype, config):
    x = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    _check(run_config(x, w, b, config), x, w, b)


@pytest.mark.parametrize("bias", [True, False])
def test_kernel_takes_strided_operands(bias):
    """An NHWC view of a channels-last activation, a column-sliced activation, and a weight
    stored transposed: strides are kernel arguments, nothing is copied."""
    nchw = torch.randn(2, 24, 5, 3, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    nhwc = nchw.permute(0, 2, 3, 1)
    sliced = torch.randn(30, 40, dtype=torch.float16)[:, 8:32]  # rows 40 apart
    w_t = (torch.randn(24, 20) / 5).to(torch.float16).t()       # [20, 24], stride (1, 20)
    b = torch.randn(20, dtype=torch.float16) if bias else None
    for x in (nhwc, sliced):
        assert kernel_applies(x, w_t, b) and x.reshape(-1, 24).data_ptr() == x.data_ptr()
        _check(run_config(x, w_t, b, TILES[0]), x, w_t, b)


def test_decision_keeps_the_fastest_and_skips_what_cannot_build():
    """The choice logic with scripted times (each candidate still runs once, so a broken
    launch would fail here): the fastest wins, a tie keeps the reference, and a
    configuration Triton cannot build is recorded as None."""
    import triton

    from fxopt.compile.gemm_gelu import _decide, candidate_configs

    x, w = torch.randn(20, 64, dtype=torch.float16), (torch.randn(40, 64) / 8).to(torch.float16)
    configs = [str(c) for c in candidate_configs(40, 64)]

    def scripted(times):
        def timer(launch, device, reps):
            name = next(iter(times))
            value = times.pop(name)
            if value is None:
                raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
            _check(launch(), x, w, None)
            return value
        return timer

    fastest = {"reference": 3.0, configs[0]: None, configs[1]: 1.0, **{c: 2.0 for c in configs[2:]}}
    decision = _decide(x, w, None, timer=scripted(dict(fastest)))
    assert str(decision.choice) == configs[1] and decision.timings == fastest
    tie = {"reference": 1.0, **{c: 1.0 for c in configs}}
    assert _decide(x, w, None, timer=scripted(dict(tie))).choice == "reference"
