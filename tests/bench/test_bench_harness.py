"""The bench harness's baselines and bench/gpu_zoo.py measure what their columns claim.

Session 6's zoo reported a "reduce-overhead + freezing" column that ran unfrozen code, and
the issue-30 figures had to call the resulting ratios upper bounds. The harness now records,
per compiled graph, whether the weights were constants; these tests check that record
against what Dynamo really handed Inductor, on CPU, and that the profile sorts real H100
kernel names into the kinds it reports.
"""

from types import SimpleNamespace

import harness
import pytest
import torch
from harness.baselines import ObservedInductor, global_freezing


@pytest.fixture(scope="module")
def zoo(bench_script):
    return bench_script("gpu_zoo")


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))
        self.b = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.relu(x * self.w + self.b)


def test_each_inductor_variant_compiles_its_own_graph_frozen_as_named(zoo):
    """In one Dynamo state, as the zoo runs them: reduce-overhead + freezing compiles a graph
    of its own (it once reused reduce-overhead's) with no parameter among its inputs."""
    model, x = Affine().eval(), torch.randn(4, 16)
    torch._dynamo.reset()
    seen = {}
    try:
        for variant in ("inductor", "reduce_overhead", "reduce_overhead_freezing", "inductor_freezing"):
            stats = {}
            fn, context = zoo.make_variant(variant, model, stats)
            with torch.no_grad(), context():
                torch.testing.assert_close(fn(x), model(x))
            seen[variant] = zoo.frozen_summary(variant, stats)
    finally:
        torch._dynamo.reset()
    for variant in ("inductor", "reduce_overhead"):
        assert seen[variant]["graphs"] == 1
        assert (seen[variant]["frozen"], seen[variant]["param_inputs"]) == (False, 2)
    for variant in ("reduce_overhead_freezing", "inductor_freezing"):
        assert seen[variant]["graphs"] == 1
        assert (seen[variant]["frozen"], seen[variant]["param_inputs"]) == (True, 0)


def test_the_freezing_option_alone_is_reported_unfrozen(zoo):
    """``options={"freezing": True}`` without the global flag while Dynamo traces leaves the
    parameters as graph inputs: the record must say so rather than trust the option."""
    model, x = Affine().eval(), torch.randn(4, 16)
    torch._dynamo.reset()
    stats = {}
    try:
        fn, _ = harness.observed_inductor(model, stats, options={"freezing": True})
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model(x))
    finally:
        torch._dynamo.reset()
    summary = harness.frozen_summary("inductor_freezing", stats)
    assert summary["frozen"] is False
    assert "was not frozen" in harness.not_frozen("inductor_freezing", summary)
    assert stats["graphs"][0]["param_inputs"] == 2
    assert stats["graphs"][0]["freezing_option"] is True


def test_two_variants_with_equal_options_each_compile_and_record_their_own_graph():
    """torch.compile's wrappers compare equal when their options do, and Dynamo then serves
    one the other's cache entry: the observed backend compares by identity, so a second
    variant with the same options compiles (and records) a graph of its own."""
    model, x = Affine().eval(), torch.randn(4, 16)
    torch._dynamo.reset()
    first, second = {}, {}
    try:
        fn1, _ = harness.inductor_variant("inductor", model, first)
        fn2, _ = harness.inductor_variant("inductor", model, second)
        with torch.no_grad():
            torch.testing.assert_close(fn1(x), model(x))
            torch.testing.assert_close(fn2(x), model(x))
    finally:
        torch._dynamo.reset()
    assert len(first["graphs"]) == len(second["graphs"]) == 1


def test_a_graph_with_parameters_among_its_inputs_is_not_frozen_whatever_the_flags(monkeypatch):
    """The record's verdict on one graph, Inductor itself left out (its compile replaced by
    the graph): the global flag and the option set, grad off, yet a parameter handed over
    as an input is a graph that was not frozen."""
    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", lambda self, gm, inputs, **kw: gm)
    gm = torch.fx.symbolic_trace(lambda x, w: x * w)
    graphs = []
    backend = ObservedInductor(None, {"freezing": True}, None, graphs)
    with torch.no_grad(), global_freezing():
        backend(gm, [torch.randn(3), torch.nn.Parameter(torch.randn(3))])
        backend(gm, [torch.randn(3), torch.randn(3)])
    assert [(g["param_inputs"], g["freezing_flag_at_trace"], g["frozen"]) for g in graphs] == \
        [(1, True, False), (0, True, True)]


def _graph(training=False, frozen=True, fallback=None):
    return SimpleNamespace(training=training, frozen=frozen, fallback=fallback)


def test_the_frozen_verdict_needs_every_inference_graph_frozen_and_at_least_one():
    """Inductor variants: no graph compiled is no evidence of freezing. fxopt: every
    inference graph frozen and none fallen back to plain Inductor (whose code is not
    fxopt's); its training graphs are never frozen and do not count. Only the variants that
    claim freezing (fxopt's among them) are called broken when not frozen."""
    assert harness.frozen_summary("inductor_freezing", {"graphs": []})["frozen"] is False
    verdict = {name: harness.frozen_summary("fxopt", {"reports": reports})["frozen"] for name, reports in {
        "frozen": [_graph()], "with training": [_graph(), _graph(training=True, frozen=False)],
        "fallen back": [_graph(fallback="InductorError: ...")], "not frozen": [_graph(frozen=False)],
        "training only": [_graph(training=True, frozen=False)], "none": []}.items()}
    assert verdict == {"frozen": True, "with training": True, "fallen back": False, "not frozen": False,
                       "training only": False, "none": False}
    assert "fxopt was not frozen" in harness.not_frozen("fxopt", {"frozen": False})
    assert harness.not_frozen("fxopt", {"frozen": True}) is None
    assert harness.not_frozen("inductor", {"frozen": False}) is None  # claims nothing


@pytest.mark.parametrize(("name", "kind"), [
    ("conv2d_c1_k1_nhwc_specialized_kernel", "depthwise conv"),  # cuDNN's depthwise (convnext's 7x7)
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "conv"),
    ("triton_poi_fused_convolution_relu_3", "gelu/pointwise fused"),  # a conv's epilogue, not a conv
    ("triton_tem_fused_convolution_0", "conv"),
    ("triton_tem_fused_addmm_gelu_0", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4> >", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("triton_per_fused_add_native_layer_norm_5", "layernorm"),
    ("triton_poi_fused_gelu_view_4", "gelu/pointwise fused"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "gelu/pointwise fused"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_red_fused_mean_5", "other"),
])
def test_kernel_kinds(zoo, name, kind):
    assert zoo.kernel_kind(name) == kind


def test_ratio_is_against_the_fastest_mode_and_flags_a_missing_one(zoo):
    """fxopt's ratio divides the fastest Inductor mode's time by fxopt's; with a mode that
    failed, the row says which were timed and the table calls the ratio an upper bound."""
    row = {"model": "m", "layout": "-", "fxopt": {"ms": 1.6, "ms_samples": [1.6]},
           "inductor": {"ms": 3.0, "ms_samples": [3.0]}, "inductor_freezing": {"ms": 2.4, "ms_samples": [2.4]},
           "reduce_overhead": {"ms": 2.0, "ms_samples": [2.0]},
           "reduce_overhead_freezing": {"error": "RuntimeError: capture failed"}}
    zoo.summarize(row)
    assert row["speedup_vs_best_inductor"] == pytest.approx(2.0 / 1.6)
    assert row["best_inductor_ms"] == "reduce_overhead"
    assert row["modes_timed"] == ["inductor", "inductor_freezing", "reduce_overhead"]
    assert "UPPER BOUND" in zoo.table([row])
    row["reduce_overhead_freezing"] = {"ms": 1.8, "ms_samples": [1.8]}
    zoo.summarize(row)
    assert row["speedup_vs_best_inductor"] == pytest.approx(1.8 / 1.6)
    assert "UPPER BOUND" not in zoo.table([row])


@pytest.fixture
def serving_seq(zoo, bench_script, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gpu_zoo", zoo)  # its `from gpu_zoo import ...`
    return bench_script("serving_seq")


def test_sequence_serving_ratio_per_length_names_the_modes_it_beat(serving_seq):
    row = {"fxopt": {"ms_128": 0.5, "ms_384": 1.2},
           "reduce_overhead_freezing": {"ms_128": 0.55, "ms_384": 1.1},
           "inductor": {"ms_128": 0.9, "ms_384": 1.5},
           "inductor_freezing": {"error": "skipped: budget"}}
    serving_seq.summarize(row, [128, 384])
    assert row["speedup_128"] == pytest.approx(0.55 / 0.5)
    assert row["speedup_384"] == pytest.approx(1.1 / 1.2)
    assert row["best_inductor_384"] == "reduce_overhead_freezing"
    assert row["modes_measured_128"] == ["inductor", "reduce_overhead_freezing"]


def test_sequence_encoder_without_transformers_has_berts_layout(serving_seq):
    """The fallback encoder (no ``transformers``): one hidden state per token, each layer's
    output layer-normed (post-norm, as BERT), any sequence length up to its positions."""
    torch.manual_seed(0)
    encoder = serving_seq.Encoder(**serving_seq.TINY).eval()
    for length in (5, 17):
        ids = torch.randint(0, serving_seq.TINY["vocab"], (2, length))
        with torch.no_grad():
            out = encoder(ids)
        assert out.shape == (2, length, serving_seq.TINY["d"])
        torch.testing.assert_close(out.mean(-1), torch.zeros(2, length), atol=1e-5, rtol=0)
