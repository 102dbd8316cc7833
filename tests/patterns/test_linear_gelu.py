"""``fuse_linear_gelu`` and ``fxopt::linear_gelu`` on CPU: the rule fires on every spelling
of linear + exact GELU in graphs whose values are fake CUDA fp16/bf16 tensors (FakeTensorMode
makes those without a GPU), and on nothing else; the op computes what eager does; Inductor's
decomposition table leaves it whole. The Triton kernel: test_gemm_gelu_interpreter.py
(Triton's interpreter) and test_gemm_gelu_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxopt
import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.linear_gelu
from fxopt.compile import gemm_gelu

from .conftest import dynamo_graph

# the manager's snapshots read storage pointers, which fake tensors warn about
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")


class Mlp(nn.Module):
    """Linear then GELU, the GELU spelled as ``how`` says."""

    def __init__(self, how: str, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(8, 16, bias=bias)
        self.act = nn.GELU(approximate="tanh" if how == "tanh_module" else "none")
        self.how = how

    def forward(self, x):
        y = self.fc(x)
        if self.how in ("module", "tanh_module"):
            return self.act(y)
        if self.how == "functional":
            return F.gelu(y)
        if self.how == "c_nn":  # how Dynamo records F.gelu
            return torch._C._nn.gelu(y)
        if self.how == "functional_linear":
            return F.gelu(F.linear(x, self.fc.weight, self.fc.bias))
        if self.how == "tanh":
            return F.gelu(y, approximate="tanh")
        raise ValueError(self.how)


def _fake_cuda(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """``model`` with every parameter replaced by a fake CUDA tensor of ``dtype``, and a fake
    CUDA input: the values a CUDA graph's nodes get, on a machine without a GPU."""
    mode = FakeTensorMode()
    with mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(torch.empty(p.shape, device="cuda", dtype=dtype),
                                                            requires_grad=False)
        x = torch.empty(shape, device="cuda", dtype=dtype)
    return model, x


def _traced_fake_cuda(how: str, dtype: torch.dtype, bias: bool = True) -> fx.GraphModule:
    model, x = _fake_cuda(Mlp(how, bias).eval(), (2, 5, 8), dtype)
    gm = fx.symbolic_trace(model)
    (placeholder,) = (n for n in gm.graph.nodes if n.op == "placeholder")
    placeholder.meta["val"] = x
    return gm


def _dynamo_fake_cuda(how: str, dtype: torch.dtype) -> fx.GraphModule:
    """Dynamo's graph of the model (captured on CPU: the parameters are placeholders, the
    GELU ``torch._C._nn.gelu(y, approximate='none')``), its inputs' values made fake CUDA."""
    gm, _ = dynamo_graph(Mlp(how).eval(), (torch.randn(2, 5, 8),))
    mode = FakeTensorMode()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            with mode:
                node.meta["val"] = torch.empty(node.meta["example_value"].shape, device="cuda", dtype=dtype)
    return gm.eval()  # a Dynamo GraphModule is left in training mode; the backend says inference


def _calls(gm: fx.GraphModule) -> list[str]:
    return [str(n.target).removesuffix(".default") if n.op == "call_function" else n.op
            for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]


def _fuse(gm: fx.GraphModule) -> fx.GraphModule:
    return fxopt.optimize(gm, passes=["fuse_linear_gelu", "dce"], instrument=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["module", "functional", "c_nn", "functional_linear", "dynamo_module",
                                 "dynamo_functional", "no_bias"])
def test_rule_fuses_every_spelling_on_cuda_half(how: str, dtype: torch.dtype) -> None:
    if how.startswith("dynamo_"):
        gm = _dynamo_fake_cuda(how.removeprefix("dynamo_"), dtype)
    else:
        gm = _traced_fake_cuda("module" if how == "no_bias" else how, dtype, bias=how != "no_bias")
    out = _fuse(gm)
    calls = _calls(out)
    assert calls == ["fxopt.linear_gelu"], calls
    (fused,) = (n for n in out.graph.nodes if n.op == "call_function")
    x, weight, bias = fused.args
    assert x.op == "placeholder" and weight.op in ("get_attr", "placeholder")
    assert (bias is None) == (how == "no_bias")
    assert fused.meta["val"].dtype == dtype and fused.meta["val"].shape == (2, 5, 16)


@pytest.mark.parametrize("case", ["tanh", "tanh_module", "fp32_cuda", "bf16_cpu", "fp32_cpu"])
def test_rule_leaves_tanh_fp32_and_cpu_graphs_alone(case: str) -> None:
    if case.startswith("tanh"):
        gm = _traced_fake_cuda(case, torch.bfloat16)
    elif case == "fp32_cuda":
        gm = _traced_fake_cuda("module", torch.float32)
    else:
        dtype = torch.bfloat16 if case == "bf16_cpu" else torch.float32
        model, x = Mlp("module").eval().to(dtype), torch.randn(2, 5, 8, dtype=dtype)
        gm = fxopt.optimize(fx.symbolic_trace(model), passes=["fuse_linear_gelu"], example_inputs=(x,))
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
        assert "fxopt.linear_gelu" not in _calls(gm)
        return
    before = gm.code
    out = _fuse(gm)
    assert out.code == before and "fxopt.linear_gelu" not in _calls(out)


def test_rule_is_in_the_default_pipeline_next_to_linear_relu() -> None:
    pipeline = fxopt.DEFAULT_PIPELINE
    assert pipeline.index("fuse_linear_gelu") == pipeline.index("fuse_linear_relu") + 1


def test_rule_skips_training_graphs() -> None:
    gm = _traced_fake_cuda("module", torch.bfloat16)
    gm.train()
    out = fxopt.optimize(gm, passes=["fuse_linear_gelu"])
    assert "fxopt.linear_gelu" not in _calls(out)
    assert fxopt.report_of(out).find("fuse_linear_gelu")[0].skipped


@pytest.mark.parametrize("shape,bias,dtype", [((3, 7), True, torch.float32), ((2, 4, 7), False, torch.float32),
                                              ((7,), True, torch.float64), ((5, 7), True, torch.bfloat16)])
def test_linear_gelu_op_matches_eager(shape, bias, dtype) -> None:
    x, w = torch.randn(shape, dtype=dtype), torch.randn(11, 7, dtype=dtype)
    b = torch.randn(11, dtype=dtype) if bias else None
    expected = F.gelu(F.linear(x, w, b))
    # bf16: the op and eager round the same GEMM output once, then GELU once
    torch.testing.assert_close(torch.ops.fxopt.linear_gelu(x, w, b), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gemm_gelu.linear_gelu(x, w, b), expected, rtol=1e-5, atol=1e-6)
    assert not any(key[-1] == x.device for key in gemm_gelu.decisions())  # CPU: nothing timed


def test_linear_gelu_op_raises_torchs_error_on_bad_shapes() -> None:
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        torch.ops.fxopt.linear_gelu(torch.randn(3, 7), torch.randn(11, 6), None)


def test_inductor_keeps_linear_gelu_whole() -> None:
    """No decomposition in Inductor's table: compiled code calls the op as one external
    kernel (on CUDA, the measured Triton GEMM), unlike linear_relu which Inductor sees through."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b):
        return torch.ops.fxopt.linear_relu(torch.ops.fxopt.linear_gelu(x, w, b), w.t().contiguous(), None)

    args = (torch.randn(4, 6), torch.randn(6, 6), torch.randn(6))
    traced = make_fx(f, decomposition_table=select_decomp_table())(*args)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert "fxopt.linear_gelu.default" in targets and "fxopt.linear_relu.default" not in targets, targets
    torch.testing.assert_close(traced(*args), f(*args))


def test_decision_keys_share_an_m_bucket() -> None:
    w = torch.randn(16, 8)
    key = gemm_gelu.decision_key
    assert key(torch.randn(300, 8), w, None) == key(torch.randn(3, 170, 8), w, None)  # both bucket 512
    assert key(torch.randn(300, 8), w, None) != key(torch.randn(600, 8), w, None)
    assert key(torch.randn(300, 8), w, None) != key(torch.randn(300, 8), w.t().contiguous().t(), None)


def test_kernel_applies_only_where_it_reads_correctly() -> None:
    """What the kernel would misread goes to the reference: a strided bias (read as dense),
    mixed or full-precision dtypes, a weight that does not fit."""
    half = torch.bfloat16
    x, w, b = torch.randn(6, 8, dtype=half), torch.randn(4, 8, dtype=half), torch.randn(4, dtype=half)
    assert gemm_gelu.kernel_applies(x, w, b) and gemm_gelu.kernel_applies(x, w.t().contiguous().t(), None)
    assert gemm_gelu.kernel_applies(x.t().contiguous().t(), w, b)  # strided rows and columns
    assert not gemm_gelu.kernel_applies(x, w, torch.randn(8, dtype=half)[::2])
    assert not gemm_gelu.kernel_applies(x.float(), w.float(), b.float())
    assert not gemm_gelu.kernel_applies(x, w.half(), b)
    assert not gemm_gelu.kernel_applies(x, w, b.float())
    assert not gemm_gelu.kernel_applies(x[:, :6], w, b)
    assert not gemm_gelu.kernel_applies(x[:0], w, b)
