"""``defer_sdpa_choice``: attention with symbolic sizes calls SDPA at run time (fxopt.sdpa)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.compile import attention  # registers torch.ops.fxopt.sdpa


class Attention(nn.Module):
    """Self-attention over [batch, length, 32] with 4 heads and an optional padding mask,
    the way encoder models call SDPA."""

    def __init__(self, masked: bool = True, dropout_p: float = 0.0):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.masked, self.dropout_p = masked, dropout_p

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = (torch.arange(s, device=x.device) >= 0).view(1, 1, 1, s).expand(b, 1, s, s) if self.masked else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p, scale=0.3)
        return self.out(y.transpose(1, 2).reshape(b, s, 32))


def _compile(model, training_too: bool = True, **kwargs):
    reports = []
    options = {"reports": reports, "sdpa_in_training": training_too}
    return torch.compile(model, backend="fxopt", options=options, **kwargs), reports


def _replaced(reports):
    return [r.stats["replaced"] for rep in reports if rep.report is not None
            for _, r in rep.report.walk() if r.name == "defer_sdpa_choice" and r.changed]


@pytest.mark.parametrize("masked", [True, False])
def test_symbolic_attention_runs_sdpa_at_run_time_with_eager_results(masked):
    model = Attention(masked).eval()
    compiled, reports = _compile(model, dynamic=True)
    with torch.no_grad():
        for length in (5, 12, 7):
            x = torch.randn(3, length, 32)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert _replaced(reports) == [1]
    assert all("torch.ops.fxopt.sdpa.default" in r.code and "scaled_dot_product_attention(" not in r.code
               for r in reports)


def test_static_sizes_and_dropout_keep_torch_sdpa():
    with torch.no_grad():  # static sizes: Inductor's choice is eager's
        compiled, reports = _compile(Attention().eval(), dynamic=False)
        compiled(torch.randn(2, 6, 32))
        assert reports and not _replaced(reports)
        torch._dynamo.reset()
        compiled, reports = _compile(Attention(dropout_p=0.25).eval(), dynamic=True)
        compiled(torch.randn(2, 6, 32))  # a random draw stays in the graph
        assert reports and not _replaced(reports)
    torch._dynamo.reset()
    model = Attention(dropout_p=0.25)  # training: the op's backward could not draw the same mask
    compiled, reports = _compile(model, dynamic=True)
    compiled(torch.randn(2, 6, 32)).sum().backward()
    assert reports and not _replaced(reports)
    assert model.qkv.weight.grad is not None


CASES = {
    "4-d, bool mask broadcast over heads": dict(q=(2, 4, 9, 16), k=(2, 4, 11, 16), v=(2, 4, 11, 8),
                                                 mask=lambda: torch.rand(2, 1, 9, 11) > 0.3),
    "4-d, float mask, scale": dict(q=(2, 3, 5, 8), k=(2, 3, 5, 8), v=(2, 3, 5, 8),
                                   mask=lambda: torch.randn(5, 5), scale=0.5),
    "4-d, causal": dict(q=(1, 2, 7, 8), k=(1, 2, 7, 8), v=(1, 2, 7, 8), is_causal=True),
    "4-d, grouped-query": dict(q=(2, 8, 6, 8), k=(2, 2, 6, 8), v=(2, 2, 6, 8), enable_gqa=True),
    "3-d": dict(q=(3, 6, 8), k=(3, 10, 8), v=(3, 10, 4)),
}


@pytest.mark.parametrize("case", CASES)
def test_op_matches_sdpa_and_its_fake_declares_the_real_layout(case):
    spec = CASES[case]
    q, k, v = (torch.randn(spec[n]) for n in "qkv")
    mask = spec["mask"]() if "mask" in spec else None
    args = (q, k, v, mask, 0.0, spec.get("is_causal", False), spec.get("scale"), spec.get("enable_gqa", False))
    out = torch.ops.fxopt.sdpa(*args)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=args[5], scale=args[6],
                                              enable_gqa=args[7])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with FakeTensorMode() as mode:
        fake = torch.ops.fxopt.sdpa(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == out.shape and fake.dtype == out.dtype
    assert _strides(fake) == _strides(out)
    if q.dim() == 3:  # no fused kernel takes 3-d inputs: SDPA's math path, on every device
        assert _strides(fake) == _strides(expected)


def _strides(t):
    """Strides of the dimensions longer than 1 (a size-1 dimension's stride addresses nothing)."""
    return [s for n, s in zip(t.shape, t.stride()) if n > 1]


#: (q, k, v) [B, H, L, E] shapes where every fused CUDA kernel applies
FUSED = [((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16)), ((1, 2, 7, 8), (1, 2, 7, 8), (1, 2, 7, 8))]


def _as_projections(shape, make):
    """A [B, H, L, E] tensor laid out as a transformer's projections make it: a view of
    [B, L, H, E] memory."""
    b, h, length, e = shape
    return make((b, length, h, e)).transpose(1, 2)


@pytest.mark.parametrize("shapes", FUSED)
def test_the_fixed_layout_is_what_the_fused_cuda_kernels_declare(shapes):
    """The op's fake strides against torch's own declarations (meta kernels) of what flash,
    memory-efficient and cuDNN attention write on CUDA, for projection-laid inputs; runs on a
    CPU (fake CUDA tensors: nothing is launched). A wrong fixed layout costs a copy per call."""
    mode = FakeTensorMode()

    def fake_cuda(shape):
        meta = torch.empty(shape, dtype=torch.float16, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cuda", 0))

    with mode:
        q, k, v = (_as_projections(shape, fake_cuda) for shape in shapes)
        ours = torch.ops.fxopt.sdpa(q, k, v, None, 0.0, False, None, False)
        kernels = {"flash": torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0],
                   "efficient": torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0],
                   "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0]}
    for name, out in kernels.items():
        assert _strides(ours) == _strides(out), name


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", FUSED)
def test_the_fixed_layout_is_what_sdpa_writes_on_cuda(shapes):
    """The same against the kernels themselves: SDPA's output on the GPU, half precision,
    projection-laid inputs, is returned as it is (no copy)."""
    q, k, v = (_as_projections(shape, lambda s: torch.randn(s, device="cuda", dtype=torch.float16))
               for shape in shapes)
    expected = F.scaled_dot_product_attention(q, k, v)
    with FakeTensorMode() as mode:
        fake = torch.ops.fxopt.sdpa(*(mode.from_tensor(t) for t in (q, k, v)), None, 0.0, False, None, False)
    assert _strides(fake) == _strides(expected)


def test_graph_without_recorded_values_is_left_alone():
    gm = torch.fx.symbolic_trace(Attention(masked=False).eval())
    before = gm.code
    out = fxopt.optimize(gm, passes=["defer_sdpa_choice{symbolic_only=false}"])
    assert out.code == before


class _SdpaMasks(TorchDispatchMode):
    """Records the mask of every fused or math SDPA kernel called below autograd."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.startswith(("_scaled_dot_product", "_safe_softmax")):
            schema = [a.name for a in func._schema.arguments]
            bound = dict(zip(schema, args)) | kwargs
            self.masks.append((func.__name__, bound.get("attn_mask", bound.get("attn_bias"))))
        return func(*args, **kwargs)


ROW_MASKS = {  # constant along the key axis: per query row, every key or none
    "bool, rows with no key": lambda: (torch.rand(2, 1, 6, 1) > 0.4).expand(2, 1, 6, 6),
    "bool, one key column": lambda: torch.rand(2, 1, 6, 1) > 0.4,
    "float, finite rows and rows with no key": lambda: torch.tensor(
        [0.0, float("-inf"), 3.0, -7.5, -2.0, float("-inf")], dtype=torch.double).view(1, 1, 6, 1).expand(2, 4, 6, 6),
}


@pytest.mark.parametrize("case", ROW_MASKS)
def test_a_mask_constant_along_keys_runs_with_no_mask_and_gives_the_math_paths_result(case):
    """No fused kernel takes a mask with key stride 0, and on CUDA the memory-efficient one
    gives a row with no key other values than the math path's zeros: the op runs no mask and
    applies the rows itself. Values and gradients equal the math path's, NaNs included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.double, requires_grad=True) for _ in range(3))
    mask = ROW_MASKS[case]()
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = torch.ops.fxopt.sdpa(q, k, v, mask, 0.0, False, 0.4, False)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    with _SdpaMasks() as seen:  # the op's implementations, called directly: a mode sees inside them
        attention.sdpa(q, k, v, mask, 0.0, False, 0.4, False)
        attention.sdpa_backward(grad, q, k, v, mask, 0.0, False, 0.4, False, [True, True, True, False])
    assert seen.masks and all(m is None for _, m in seen.masks), seen.masks
    torch.testing.assert_close(got, want, equal_nan=True)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_a_float_row_of_inf_or_nan_gives_nan_as_the_math_path_does():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.tensor([0.0, float("inf"), float("nan"), 1.0]).view(1, 1, 4, 1).expand(1, 2, 4, 4)
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = torch.ops.fxopt.sdpa(q, k, v, mask, 0.0, False, None, False)
    assert got[:, :, 1:3].isnan().all() and not got[:, :, ::3].isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_other_masks_reach_the_kernel_with_a_dense_key_axis():
    """A mask broadcast over heads stays a view (the kernels take it); a float mask along the
    keys whose own gradient is wanted takes the general path, and gets eager's gradient."""
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.double, requires_grad=True) for _ in range(3))
    heads = torch.rand(2, 1, 6, 6).expand(2, 4, 6, 6) > 0.3
    heads[..., 0] = True
    with _SdpaMasks() as seen:
        attention.sdpa(q, k, v, heads, 0.0, False, None, False)
    assert [m.stride() for _, m in seen.masks] == [heads.stride()]
    bias = torch.randn(2, 1, 6, 1, dtype=torch.double, requires_grad=True)
    expanded = bias.expand(2, 1, 6, 6)
    out = torch.ops.fxopt.sdpa(q, k, v, expanded, 0.0, False, None, False)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, bias), grad)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=expanded), (q, bias), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


# --- training: the op's backward -------------------------------------------------------


class Block(nn.Module):
    """Two BERT-like layers over [batch, length, 32], 4 heads, sharing one mask: a padding
    mask broadcast along the queries (as Hugging Face builds it), one broadcast along the keys
    (``mask[..., None].expand``), or a learned additive bias (a float mask that needs grad)."""

    def __init__(self, mask: str):
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(2))
        self.mask = mask
        self.bias = nn.Parameter(torch.randn(4, 16, 16) * 0.5)

    def forward(self, x, keep):
        b, s, _ = x.shape
        if self.mask == "padding":
            mask = keep.view(b, 1, 1, s).expand(b, 1, s, s)
        elif self.mask == "key broadcast":
            mask = keep.view(b, 1, s, 1).expand(b, 1, s, s)
        else:
            mask = self.bias[:, :s, :s]
        for layer in self.layers:
            q, k, v = layer.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
            x = torch.tanh(x + layer.out(y.transpose(1, 2).reshape(b, s, 32)))
        return x


def _grads(model, x, keep):
    x = x.clone().requires_grad_()
    loss = (model(x, keep) * torch.linspace(-1, 1, x.shape[-1], device=x.device, dtype=x.dtype)).sum()
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), x.grad, grads


def test_training_graphs_keep_torchs_attention_by_default_and_the_option_runs_the_op():
    """Off by default (a BERT-base training step ran slower with the op on an H200)."""
    for options, rewritten in (({}, False), ({"sdpa_in_training": True}, True)):
        torch._dynamo.reset()
        reports = []
        compiled = torch.compile(Block("padding"), backend="fxopt", options={"reports": reports, **options},
                                 dynamic=True)
        for length in (5, 12):
            x = torch.randn(3, length, 32)
            _grads(compiled, x, torch.ones(3, length, dtype=torch.bool))
        training = [r for r in reports if r.training]
        assert training and all(("torch.ops.fxopt.sdpa.default" in r.code) == rewritten for r in training)


@pytest.mark.parametrize("mask", ["padding", "key broadcast", "learned bias"])
def test_training_with_a_symbolic_length_runs_the_op_and_its_gradients_are_eager_sdpa(mask):
    model = Block(mask)
    compiled, reports = _compile(model, training_too=True, dynamic=True)
    for length in (5, 12, 7):
        x = torch.randn(3, length, 32)
        keep = torch.rand(3, length) > 0.3
        keep[:, 0] = True  # no row without a key to attend to
        loss, dx, grads = _grads(compiled, x, keep)
        want_loss, want_dx, want = _grads(model, x, keep)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, want_dx, rtol=1e-4, atol=1e-5)
        assert grads.keys() == want.keys() and ("bias" in want) == (mask == "learned bias")
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    training = [r for r in reports if r.training]
    assert training and all(r.code.count("torch.ops.fxopt.sdpa.default") == 2 and
                            "scaled_dot_product_attention(" not in r.code for r in training)
    # a mask broadcast along the keys reaches the op as it is: no dense copy
    assert all(".contiguous()" not in r.code for r in training)


def test_a_mask_written_in_place_or_replaced_between_calls_is_read_anew():
    model = Block("key broadcast").eval()
    compiled, _ = _compile(model, dynamic=True)
    x = torch.randn(2, 6, 32)
    keep = torch.rand(2, 6) > 0.5
    keep[:, 0] = True
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x, keep), model(x, keep), rtol=1e-5, atol=1e-5)
            keep[:, 1:] = ~keep[:, 1:]  # in place: the same tensor, other values
        other = torch.ones(2, 6, dtype=torch.bool)
        torch.testing.assert_close(compiled(x, other), model(x, other), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_op_backward_is_sdpa_backward(case):
    spec = CASES[case]
    inputs = [torch.randn(spec[n], dtype=torch.double, requires_grad=True) for n in "qkv"]
    mask = spec["mask"]() if "mask" in spec else None
    if mask is not None and mask.is_floating_point():
        mask = mask.double().requires_grad_()
        inputs.append(mask)
    options = (0.0, spec.get("is_causal", False), spec.get("scale"), spec.get("enable_gqa", False))
    args = (*inputs[:3], mask, *options)
    torch.library.opcheck(torch.ops.fxopt.sdpa.default, args)
    out = torch.ops.fxopt.sdpa(*args)
    grad = torch.randn_like(out)
    expected = F.scaled_dot_product_attention(*inputs[:3], attn_mask=mask, is_causal=options[1], scale=options[2],
                                              enable_gqa=options[3])
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad),
                         strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_op_backward_returns_the_layout_its_fake_declares():
    q, k, v = (torch.randn(2, 7, 4, 8).transpose(1, 2).requires_grad_() for _ in range(3))  # [B, L, H, E] memory
    mask = torch.randn(2, 1, 7, 1).expand(2, 1, 7, 7).requires_grad_()
    args = (q, k, v, mask, 0.0, False, None, False, [True, True, True, True])
    grads = torch.ops.fxopt.sdpa_backward(torch.randn(2, 4, 7, 8), *args)
    with FakeTensorMode() as mode:
        fakes = torch.ops.fxopt.sdpa_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                for a in (torch.randn(2, 4, 7, 8), *args)))
    assert [(g.shape, g.stride()) for g in grads] == [(f.shape, f.stride()) for f in fakes]
    assert grads[0].stride() == q.stride() and grads[3].is_contiguous()


def test_op_refuses_a_backward_with_dropout():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="dropout"):
        torch.ops.fxopt.sdpa(q, k, v, None, 0.1, False, None, False)
    with torch.no_grad():  # no backward: nothing to refuse
        assert torch.ops.fxopt.sdpa(q, k, v, None, 0.1, False, None, False).shape == (1, 2, 4, 8)


def _errors(got, want):
    """Relative L2 error of each gradient (``x`` and the parameters') in ``got`` against ``want``."""
    (_, dx, grads), (_, want_dx, wanted) = got, want
    pairs = {"x": (dx, want_dx), **{n: (grads[n], wanted[n]) for n in wanted}}
    return {n: ((g.float() - w).norm() / w.norm()).item() for n, (g, w) in pairs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["padding", "key broadcast", "learned bias"])
def test_gpu_bf16_training_gradients_are_as_close_to_fp32_as_eager_bf16(mask):
    """On CUDA the op runs the fused kernels in bf16; its gradients must be as close to an
    fp32 reference as eager bf16 SDPA's are (within 2x their error, plus a floor)."""
    torch.manual_seed(0)
    reference = Block(mask).cuda()
    model = Block(mask).cuda().to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    compiled, reports = _compile(model, training_too=True, dynamic=True)
    for length in (16, 13, 9):
        x = torch.randn(4, length, 32, device="cuda")
        keep = torch.rand(4, length, device="cuda") > 0.3
        keep[:, 0] = True
        want = _grads(reference, x, keep)
        ours, eager = (_errors(_grads(fn, x.bfloat16(), keep), want) for fn in (compiled, model))
        for name, err in eager.items():
            assert ours[name] <= 2 * err + 1e-2, (length, name, ours[name], err)
    assert any(r.training and "torch.ops.fxopt.sdpa.default" in r.code for r in reports)


@pytest.mark.gpu
def test_gpu_training_with_a_symbolic_length_runs_fused_attention_forward_and_backward():
    """The point of the op: at run time, forward and backward are fused SDPA kernels (flash,
    memory-efficient or cuDNN), not the math decomposition's matrix products."""
    model = Block("padding").cuda().to(torch.bfloat16)
    # plain launches: a replayed CUDA graph would run no ATen op for the profiler to see
    compiled = torch.compile(model, backend="fxopt", options={"cuda_graphs": False, "sdpa_in_training": True},
                             dynamic=True)
    for length in (24, 40):  # the second length runs the symbolic graph compiled at the first
        x = torch.randn(2, length, 32, device="cuda", dtype=torch.bfloat16)
        keep = torch.rand(2, length, device="cuda") > 0.2
        keep[:, 0] = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _grads(compiled, x, keep)
    names = {e.key for e in prof.key_averages()}
    fused = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention")
    assert any(n in names for n in fused), sorted(names)
    assert any(f"{n}_backward" in names for n in fused), sorted(names)


def test_an_output_already_in_the_fixed_layout_is_returned_without_a_copy(monkeypatch):
    """SDPA's own output is returned where its strides are the fixed layout's (3-d inputs:
    contiguous), and only there (4-d: a copy where the CPU kernel wrote [B, H, L, E] memory,
    as torch 2.13's does)."""
    made = []

    def spy(*args, **kwargs):
        made.append(sdpa(*args, **kwargs))
        return made[-1]

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(3, 6, 8), torch.randn(3, 10, 8), torch.randn(3, 10, 4)
    assert torch.ops.fxopt.sdpa(q, k, v, None, 0.0, False, None, False) is made[-1]
    q, k, v = (torch.randn(2, 4, n, 8) for n in (9, 11, 11))
    out = torch.ops.fxopt.sdpa(q, k, v, None, 0.0, False, None, False)
    assert (out is made[-1]) == (_strides(made[-1]) == _strides(out)) and torch.equal(out, made[-1])


def test_backward_fake_returns_the_gradients_asked_for_and_nothing_else():
    """The fake of ``sdpa_backward`` must declare exactly the gradients the real op returns
    (q, k, v, and the mask only where ``needs`` asks for it): a bool mask has none."""
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    for needs in ([True, True, True, False], [False, True, False, False]):
        args = (torch.randn(2, 3, 5, 8), q, k, v, mask, 0.0, False, None, False, needs)
        real = torch.ops.fxopt.sdpa_backward(*args)
        with FakeTensorMode() as mode:
            fake = torch.ops.fxopt.sdpa_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                   for a in args))
        assert len(real) == len(fake) == sum(needs)
        assert [(g.shape, g.stride()) for g in real] == [(f.shape, f.stride()) for f in fake]


def test_one_symbolic_input_is_enough_static_queries_over_a_symbolic_memory():
    """Cross-attention: the queries' sizes are static, the keys' and values' length symbolic
    (an encoder memory of varying length): the graph still falls back to the math path, so
    the call is replaced."""
    def cross(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    compiled, reports = _compile(cross)
    with torch.no_grad():
        for length in (5, 12, 7):
            q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, length, 8), torch.randn(2, 4, length, 8)
            torch._dynamo.mark_static(q)
            torch._dynamo.mark_dynamic(k, 2)
            torch._dynamo.mark_dynamic(v, 2)
            torch.testing.assert_close(compiled(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert _replaced(reports) == [1]


def test_the_new_node_records_the_ops_value_in_its_fixed_layout():
    """Passes after this one (and the backend's checks) read ``meta['val']``: the op's node
    carries the fake implementation's value, shape and strides, symbolic sizes included."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)

    q, k, v = (torch.randn(3, 4, 7, 8) for _ in range(3))
    torch.compile(attend, backend=capture, dynamic=True)(q, k, v, torch.rand(3, 1, 7, 7) > 0.3)
    (gm,) = graphs
    old = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    want = old.meta["example_value"]
    out = fxopt.optimize(gm, passes=["defer_sdpa_choice"])
    (new,) = [n for n in out.graph.nodes if n.target is torch.ops.fxopt.sdpa.default]
    value = new.meta["val"]
    shape, strides = attention._output_layout(want, want)
    assert tuple(value.shape) == tuple(want.shape) == tuple(shape)
    assert tuple(value.stride()) == tuple(strides)
    assert any(not isinstance(n, int) for n in value.shape)  # the symbolic length kept
