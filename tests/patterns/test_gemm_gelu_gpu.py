"""fxopt.compile.gemm_gelu on a CUDA GPU (skipped elsewhere): every configuration against an fp32
reference at the shapes it is for, the measured choice and its cache, CUDA-graph capture,
and ``torch.compile(backend="fxopt")`` calling the op as one external kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt  # noqa: F401 - registers backend="fxopt"
import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.linear_gelu
from fxopt.compile import gemm_gelu

pytestmark = pytest.mark.gpu

#: (M, K, N): ConvNeXt-T's four MLP fc1 at batch 32, ViT-B/16's at batch 32, BERT-base's at
#: batch 8 and sequence 128/256/384
SHAPES = [(100352, 96, 384), (25088, 192, 768), (6272, 384, 1536), (1568, 768, 3072), (6304, 768, 3072),
          (1024, 768, 3072), (2048, 768, 3072), (3072, 768, 3072)]


def _operands(m, k, n, dtype=torch.bfloat16, bias=True):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    return x, w, b


def _check(y, x, w, b):
    """Against the fp32 computation on the same half-precision operands: the kernel's own
    error is fp32 accumulation order plus one rounding of the output (bf16: 2^-8 relative)."""
    expected = F.gelu(F.linear(x.float(), w.float(), None if b is None else b.float()))
    assert y.dtype == x.dtype and y.shape == expected.shape
    torch.testing.assert_close(y.float(), expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("m,k,n", SHAPES, ids=lambda v: str(v))
def test_every_config_and_the_choice_match_fp32(m, k, n):
    x, w, b = _operands(m, k, n)
    for config in gemm_gelu.candidate_configs(n, k):
        _check(gemm_gelu.run_config(x, w, b, config), x, w, b)
    _check(torch.ops.fxopt.linear_gelu(x, w, b), x, w, b)
    x2, w2, b2 = _operands(m, k, n)  # fresh inputs through the cached choice
    _check(torch.ops.fxopt.linear_gelu(x2, w2, b2), x2, w2, b2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_fp16_no_bias(dtype):
    """ConvNeXt's activation (a channels-last map permuted to NHWC) and a transposed weight."""
    nchw = torch.randn(4, 96, 14, 14, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    x = nchw.permute(0, 2, 3, 1)
    w = (torch.randn(96, 384, device="cuda") / 10).to(dtype).t()
    for config in gemm_gelu.candidate_configs(384, 96):
        _check(gemm_gelu.run_config(x, w, None, config), x, w, None)
    _check(torch.ops.fxopt.linear_gelu(x, w, None), x, w, None)


def test_choice_is_the_fastest_and_cached_per_m_bucket():
    n, k = 320, 128  # a shape no other test uses: its keys are this test's
    x, w, b = _operands(3000, k, n)
    torch.ops.fxopt.linear_gelu(x, w, b)
    key = gemm_gelu.decision_key(x, w, b)
    decision = gemm_gelu.decisions()[key]
    assert "reference" in decision.timings and len(decision.timings) >= 4
    ran = {name: ms for name, ms in decision.timings.items() if ms is not None}
    assert str(decision.choice) == min(ran, key=lambda name: (ran[name], name != "reference"))
    before = len(gemm_gelu.decisions())
    torch.ops.fxopt.linear_gelu(*_operands(4000, k, n))  # the same bucket (4096): no new timing
    assert len(gemm_gelu.decisions()) == before
    x5, w5, b5 = _operands(5000, k, n)
    _check(torch.ops.fxopt.linear_gelu(x5, w5, b5), x5, w5, b5)
    assert gemm_gelu.decision_key(x5, w5, b5) in gemm_gelu.decisions()  # bucket 8192: timed anew


@pytest.mark.parametrize("seen", [True, False])
def test_cuda_graph_capture_replays_correctly(seen):
    """A call captured after a plain call replays the cached choice; a key first met during
    capture runs the reference and times nothing (timing would break the capture)."""
    m = 2500 if seen else 9000  # distinct buckets per case and from the other tests
    x, w, b = _operands(m, 256, 512)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if seen:
            torch.ops.fxopt.linear_gelu(x, w, b)
        F.gelu(F.linear(x, w, b))  # cuBLAS's warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    known = dict(gemm_gelu.decisions())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.fxopt.linear_gelu(x, w, b)
    assert gemm_gelu.decisions().keys() == known.keys()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, x, w, b)


def test_compiled_model_calls_the_fused_op():
    from torch._inductor.utils import run_and_get_code

    model = nn.Sequential(nn.Linear(192, 768), nn.GELU(), nn.Linear(768, 192)).cuda().to(torch.bfloat16).eval()
    x = torch.randn(8, 28, 28, 192, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="fxopt")
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
        expected = F.linear(F.gelu(F.linear(x.float(), model[0].weight.float(), model[0].bias.float())),
                            model[2].weight.float(), model[2].bias.float())
    assert any("fxopt.linear_gelu" in code for code in codes)
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)
