"""The weight-only ops as opaque custom ops, on CPU: their fake impls under symbolic M,
``torch.compile(fullgraph=True)`` keeping them whole and compiling once for every M (the
kernel is chosen inside the op, so no guard on M is left), ``torch.export`` keeping them
whole, and their gradients for the activation and bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt.quant  # noqa: F401  (registers the ops)
from fxopt.quant.formats import pack_int4, unpack_int4
from fxopt.quant.ops import ops


def _operands(op: str, n: int = 24, k: int = 64, bias: bool = True):
    """The op's arguments after x, and its float reference as a function of (x, bias)."""
    b = torch.randn(n, requires_grad=True) if bias else None
    if op == "int4_weight_only_linear":
        packed, scales = pack_int4(torch.randn(n, k), 32)
        w = unpack_int4(packed, scales, 32)
        return (packed, scales, 32, b), lambda x, b: F.linear(x, w, b)
    rows = 2 * n if op == "int8_weight_only_swiglu" else n
    w = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    s = torch.rand(rows) / 100
    wf = w.float() * s[:, None]
    if bias and rows != n:
        b = torch.randn(rows, requires_grad=True)
    if op == "int8_weight_only_swiglu":
        def reference(x, b):
            gate, up = F.linear(x, wf, b).chunk(2, dim=-1)
            return F.silu(gate) * up
        return (w, s, b), reference
    return (w, s, b), lambda x, b: F.linear(x, wf, b)


OPS = ["int8_weight_only_linear", "int8_weight_only_swiglu", "int4_weight_only_linear"]


@pytest.mark.parametrize("op", OPS)
def test_fake_impl_gives_symbolic_rows(op):
    args, reference = _operands(op)
    fn = getattr(ops, op)

    tensors = [a for a in args if isinstance(a, torch.Tensor)]

    def call(x, *given):
        given = iter(given)
        return fn(x, *(next(given) if isinstance(a, torch.Tensor) else a for a in args))

    gm = make_fx(call, tracing_mode="symbolic")(torch.randn(5, 64), *tensors)
    calls = [n for n in gm.graph.nodes if n.target is fn.default]
    assert len(calls) == 1  # make_fx without functionalization keeps the op whole
    rows, cols = calls[0].meta["val"].shape
    assert isinstance(rows, torch.SymInt) and cols == reference(torch.randn(1, 64), args[-1]).shape[1]


#: a serving order of 12 row counts, decode first: each would have been a new M bucket or a
#: new size for a graph that guards on M
SERVING_ORDER = (1, 16, 32, 64, 256, 1024, 4096, 3, 7, 100, 513, 2000)


@pytest.mark.parametrize("op", OPS)
def test_compile_keeps_the_op_whole_and_compiles_once_for_every_row_count(op):
    """The token dim marked unbacked (as a server marks it; no 0/1 specialization): one
    Dynamo frame and one Inductor graph for all 12 sizes, M = 1 included, the op called
    as a whole in Inductor's code (it picks its kernel at run time), results equal to the
    float reference at every M."""
    args, reference = _operands(op)
    fn = getattr(ops, op)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fn(x, *args), backend=inductor, fullgraph=True)
    codes = []
    with torch.no_grad():
        for m in SERVING_ORDER:
            x = torch.randn(m, 64)
            torch._dynamo.decorators.mark_unbacked(x, 0)
            if not codes:
                out, codes = run_and_get_code(compiled, x)
            else:
                out = compiled(x)
            torch.testing.assert_close(out, reference(x, args[-1]), rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1
    assert f"fxopt_quant.{op}" in "".join(codes)


@pytest.mark.parametrize("op", OPS)
def test_export_keeps_the_op(op):
    args, _ = _operands(op, bias=False)
    fn = getattr(ops, op)

    class Model(torch.nn.Module):
        def forward(self, x):
            return fn(x, *args)

    m = torch.export.Dim("m", min=2)
    ep = torch.export.export(Model(), (torch.randn(4, 64),), dynamic_shapes={"x": {0: m}})
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"] == [fn.default]
    x = torch.randn(9, 64)
    torch.testing.assert_close(ep.module()(x), fn(x, *args))


@pytest.mark.parametrize("op", OPS)
def test_gradients_for_activation_and_bias(op):
    args, reference = _operands(op)
    fn = getattr(ops, op)
    x = torch.randn(2, 3, 64, requires_grad=True)
    grad = torch.randn_like(reference(x, args[-1]))
    fn(x, *args).backward(grad)
    got = x.grad, args[-1].grad
    x.grad, args[-1].grad = None, None
    reference(x, args[-1]).backward(grad)
    torch.testing.assert_close(got[0], x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], args[-1].grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", OPS)
def test_fake_impl_and_registrations_agree_with_the_real_op(op):
    """``torch.library.opcheck``: the fake impl's output (shape, dtype, strides) is the CPU
    impl's on a 3-d activation, the schema is honest, the autograd registration is used and
    AOT dispatch with dynamic shapes works."""
    args, _ = _operands(op)
    x = torch.randn(2, 3, 64, requires_grad=True)
    torch.library.opcheck(getattr(ops, op).default, (x, *args))


@pytest.mark.parametrize("op", OPS)
def test_gradients_in_bfloat16(op):
    """The backward casts the dequantized weight to the gradient's dtype: bf16 activations
    get bf16 gradients, within bf16's rounding of the float32 reference's: relative error in
    norm at most 2e-2, five of bf16's steps (2**-8; the gated op recomputes its gate and up
    projection in bf16 too)."""
    args, reference = _operands(op)
    fn = getattr(ops, op)
    x = torch.randn(5, 64)
    grad = torch.randn(5, reference(x, args[-1]).shape[-1])
    xb = x.to(torch.bfloat16).requires_grad_()
    bias = args[-1].detach().to(torch.bfloat16).requires_grad_()
    fn(xb, *args[:-1], bias).backward(grad.to(torch.bfloat16))
    assert xb.grad.dtype == bias.grad.dtype == torch.bfloat16
    xf = xb.detach().float().requires_grad_()
    bf = bias.detach().float().requires_grad_()
    reference(xf, bf).backward(grad)
    for got, want in ((xb.grad, xf.grad), (bias.grad, bf.grad)):
        assert (got.float() - want).norm() <= 2e-2 * want.norm()
