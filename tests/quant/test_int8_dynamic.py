"""int8 dynamic linear on CPU: the int8 GEMM op's definition, and the regression for
Inductor's freezing pass that rewrote a visible ``_int_mm -> mul -> mul`` into oneDNN's
``qlinear`` (CPU-only: on CUDA the compile failed; on CPU, torch 2.13, the compiled model
returned wrong numbers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import fxopt
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


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 256), nn.Linear(256, 64)

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
            assert code.count("torch.ops.fxopt_quant.quantize_per_token.default(") == 2
            torch.testing.assert_close(y, q(fresh), rtol=1e-4, atol=1e-4)
            assert fq.sqnr(model(fresh), y) >= 30
    torch._dynamo.reset()


class _Activations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 48), nn.Linear(48, 48), nn.Linear(48, 48)
        self.d, self.e, self.f = nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 16)
        self.gelu = nn.GELU()

    def forward(self, x):
        h = self.gelu(self.a(x))                                      # module: fused
        h = torch.relu(self.b(h))                                     # function: fused
        h = torch.nn.functional.silu(self.c(h))                       # fused
        h = torch.nn.functional.gelu(self.d(h), approximate="tanh")   # tanh GELU: kept
        y = self.e(h)
        h = torch.nn.functional.gelu(y) + y                           # two users: kept
        return self.f(h)


def test_activations_fuse_into_the_dynamic_linear_epilogue():
    model, x = _Activations().eval(), torch.randn(24, 32)
    q = fq.quantize_model(model, (x,), "int8_dynamic")
    linears = [n for n in q.graph.nodes if n.target is ops.int8_dynamic_linear.default]
    assert [n.args[4] if len(n.args) > 4 else None for n in linears] == ["gelu", "relu", "silu", None, None, None]
    calls = [n.target for n in q.graph.nodes if n.op in ("call_function", "call_module")]
    assert "gelu" not in calls and torch.relu not in calls and torch.nn.functional.silu not in calls
    assert calls.count(torch.nn.functional.gelu) == 2
    unfused = fxopt.optimize(model, [fq.Quantize(mode="int8_dynamic")], example_inputs=(x,))
    fresh = torch.randn(24, 32)
    torch.testing.assert_close(q(fresh), unfused(fresh), rtol=1e-5, atol=1e-5)
    report = fq.accuracy_report(model, q, (fresh,))
    assert report.min_layer_sqnr >= 30 and report.end_to_end.sqnr >= 30


def test_activation_of_a_linear_with_siblings_is_left_for_merging():
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    q = fq.quantize_model(Gated().eval(), (torch.randn(4, 32),), "int8_dynamic")
    assert all(len(n.args) == 4 for n in q.graph.nodes if n.target is ops.int8_dynamic_linear.default)
    assert any(n.target is torch.nn.functional.silu for n in q.graph.nodes)
