"""fxopt.compile.depthwise's Triton kernel run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1 pytest tests/compile/test_depthwise_interpreter.py``): window sizes,
strides and paddings, ragged pixel and channel counts, with and without bias, input in
either layout, every configuration.

Run in a child process by tests/test_triton_interpreter.py (see tests/triton_interpreter.py);
test_depthwise.py runs the kernel on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..triton_interpreter import use_interpreter

use_interpreter()  # before anything imports triton
from fxopt.compile.depthwise import CONFIGS, Config, run_config  # noqa: E402

#: small tiles, so that several programs and ragged edges occur at small sizes
SMALL = Config(16, 8, 1)


def _check(x, w, b, stride, padding, config):
    y = run_config(x, w, b, stride, padding, config)
    expected = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding, 1, x.shape[1])
    assert y.dtype == x.dtype and y.shape == expected.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    # fp32 accumulation over at most 25 taps, one rounding to the output dtype
    tol = 1e-5 if x.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("k,stride,padding", [(3, 1, 1), (3, 2, 1), (5, 1, 2), (5, 2, 2), (3, 1, 0), ((3, 5), (2, 1), (1, 2))])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_float64_reference(k, stride, padding, bias, dtype):
    kh, kw = (k, k) if isinstance(k, int) else k
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    x = torch.randn(2, 13, 9, 7, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(13, 1, kh, kw) / kh).to(dtype)
    b = torch.randn(13, dtype=dtype) if bias else None
    _check(x, w, b, pair(stride), pair(padding), SMALL)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_configuration_and_an_input_in_either_layout(config):
    """Each configuration the pass may choose, on a contiguous (NCHW) input, a channels-last
    one, and a weight stored channels-last: strides are kernel arguments."""
    x = torch.randn(3, 40, 11, 10, dtype=torch.float16)
    w = (torch.randn(40, 1, 3, 3) / 3).to(torch.float16)
    b = torch.randn(40, dtype=torch.float16)
    for x_in in (x, x.contiguous(memory_format=torch.channels_last)):
        _check(x_in, w.contiguous(memory_format=torch.channels_last), b, [2, 2], [1, 1], config)
