"""fxopt.quant on CPU: observer math, QDQ numerics, coverage of every matmul spelling,
skip reasons, accuracy thresholds, dtypes, and bad input."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.quant as fq
from fxopt.quant.ops import ops

torch.manual_seed(0)


# ---------------------------------------------------------------- observers

def test_minmax_affine_matches_reference_formula():
    x = torch.randn(1000) * 3 + 1
    obs = fq.MinMaxObserver(symmetric=False)
    obs(x[:500])
    obs(x[500:])
    scale, zp = obs.qparams()
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    assert scale.item() == pytest.approx((hi - lo) / 255, rel=1e-6)
    assert zp.item() == -128 - round(lo / ((hi - lo) / 255))


def test_per_channel_symmetric_matches_reference_formula():
    w = torch.randn(8, 5, 3)
    obs = fq.MinMaxObserver(symmetric=True, ch_axis=1)
    obs(w)
    scale, zp = obs.qparams()
    expected = w.abs().amax(dim=(0, 2)) / 127
    assert scale.shape == (1, 5, 1)
    torch.testing.assert_close(scale.flatten(), expected)
    assert torch.all(zp == 0)


def test_moving_average_follows_ema():
    obs = fq.MovingAverageObserver(averaging_constant=0.5)
    obs(torch.tensor([-1.0, 1.0]))
    obs(torch.tensor([-3.0, 5.0]))
    lo, hi = obs.range()
    assert (lo.item(), hi.item()) == (-2.0, 3.0)


def test_histogram_percentile_matches_numpy():
    x = torch.randn(200_000)
    obs = fq.HistogramObserver(percentile=99.0)
    obs(x[:100_000] * 0.5)  # a narrower first batch forces a re-binning
    obs(x[100_000:])
    data = torch.cat([x[:100_000] * 0.5, x[100_000:]]).numpy()
    lo, hi = obs.range()
    width = (data.max() - data.min()) / obs.bins
    assert abs(lo.item() - np.percentile(data, 1.0)) < 3 * width
    assert abs(hi.item() - np.percentile(data, 99.0)) < 3 * width


def test_observer_without_data_raises():
    with pytest.raises(fxopt.FxoptError, match="seen no data"):
        fq.MinMaxObserver().qparams()


# ---------------------------------------------------------------- QDQ numerics

def test_quantize_dequantize_round_trip_error_is_half_a_step():
    x = torch.randn(64, 32)
    obs = fq.MinMaxObserver()
    obs(x)
    scale, zp = obs.qparams()
    q = ops.quantize(x, scale, zp, -128, 127)
    assert q.dtype == torch.int8
    back = ops.dequantize(q, scale, zp, torch.float32)
    assert (back - x).abs().max().item() <= scale.item() / 2 + 1e-6
    assert ops.dequantize(ops.quantize(torch.zeros(3), scale, zp, -128, 127), scale, zp, torch.float32).abs().max() == 0


def test_dynamic_linear_matches_quantized_reference():
    x, w = torch.randn(5, 64), torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s, b = torch.rand(16) / 100, torch.randn(16)
    xs = x.abs().amax(-1, keepdim=True) / 127
    xq = torch.clamp(torch.round(x / xs), -127, 127)
    expected = (xq @ w.float().t()) * xs * s + b
    torch.testing.assert_close(ops.int8_dynamic_linear(x, w, s, b), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- spellings and coverage

class Spellings(nn.Module):
    """One of each matmul spelling, all with constant weights, plus a dynamic matmul."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 48)
        self.w_mm = nn.Parameter(torch.randn(48, 40) / 7)
        self.w_lin = nn.Parameter(torch.randn(40, 40) / 7)
        self.b = nn.Parameter(torch.randn(40))
        self.w_bmm = nn.Parameter(torch.randn(2, 20, 20) / 5)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.w_conv = nn.Parameter(torch.randn(4, 8, 1, 1) / 3)

    def forward(self, x, img):
        h = self.lin(x)
        h = h @ self.w_mm
        h = torch.mm(h, self.w_lin.t())
        h = torch.addmm(self.b, h, self.w_lin)
        h = F.linear(h, self.w_lin)
        h = torch.matmul(h, self.w_lin)
        g = torch.bmm(h.reshape(2, -1, 20), self.w_bmm).reshape(h.shape)
        att = g @ g.t()  # no constant operand: not a site
        c = F.conv2d(self.conv(img), self.w_conv)
        return att.sum(-1, keepdim=True) + g + c.mean()


def _inputs():
    return torch.randn(8, 32), torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("mode", fq.INT8_MODES)
def test_every_torch_spelling_is_quantized(mode):
    model, inputs = Spellings().eval(), _inputs()
    data = [_inputs() for _ in range(4)] + [inputs]
    q = fq.quantize_model(model, inputs, mode, calibration_data=data)
    summary = fq.summary_of(q)
    kinds = {r.kind for r in summary.sites if r.mode}
    assert kinds == {"linear", "matmul", "addmm", "bmm", "conv"}
    assert summary.coverage == 1.0
    assert summary.skipped == {"matmul_2": "the weight is not a constant (it is computed or a graph input)"}
    # w_lin is used by four spellings, two as [N, K] and two as [K, N]: one int8 copy per
    # orientation (the per-channel axis differs), each shared by two sites
    int8 = [n for n, b in q.named_buffers() if b.dtype == torch.int8]
    assert sum("w_lin" in n for n in int8) == 2
    assert sum(r.shared_with is not None for r in summary.sites) == 2
    assert not any(n.op == "call_module" for n in q.graph.nodes)
    report = fq.accuracy_report(model, q, inputs)
    assert report.min_layer_sqnr >= 30 and report.end_to_end.sqnr >= 30


def test_aten_level_graph_from_export():
    model, inputs = Spellings().eval(), _inputs()
    gm = torch.export.export(model, inputs).module()
    q = fq.quantize_model(gm, inputs, "int8_dynamic")
    summary = fq.summary_of(q)
    assert summary.coverage == 1.0
    assert {r.kind for r in summary.sites if r.mode} >= {"linear", "matmul", "bmm", "conv"}
    assert fq.sqnr(model(*inputs), q(*inputs)) >= 30


def test_skip_list_keep_first_last_and_overrides_are_reported():
    model, inputs = Spellings().eval(), _inputs()
    q = fq.quantize_model(model, inputs, "int8_weight_only", keep_first_last=True,
                          skip="addmm", overrides="bmm=int8_dynamic;linear=float")
    by_name = {r.name: r for r in fq.summary_of(q).sites}
    assert by_name["lin"].reason == "kept in float: first layer (keep_first_last)"
    assert by_name["conv2d"].reason == "kept in float: last layer (keep_first_last)"
    assert by_name["addmm"].reason == "in the skip list ('addmm')"
    assert by_name["linear"].reason == "kept in float by override 'linear=float'"
    assert by_name["bmm"].mode == "int8_dynamic" and by_name["matmul"].mode == "int8_weight_only"
    assert isinstance(q.get_submodule("lin"), nn.Linear)  # still float


def test_unsupported_dtype_is_skipped_with_reason():
    class IntMatmul(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randint(0, 3, (4, 4)))
            self.lin = nn.Linear(4, 4)

        def forward(self, x, i):
            return self.lin(x), i @ self.w

    q = fq.quantize_model(IntMatmul().eval(), (torch.randn(2, 4), torch.randint(0, 3, (2, 4))))
    assert fq.summary_of(q).skipped == {"matmul": "weight dtype torch.int64 is not float32/float16/bfloat16"}


# ---------------------------------------------------------------- accuracy targets

def _mlp(dtype=torch.float32):
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10)).to(dtype).eval()


def test_weight_only_meets_sqnr_targets_and_matches_dequantized_reference():
    model, x = _mlp(), torch.randn(64, 128)
    q = fq.quantize_model(model, (x,), "int8_weight_only")
    report = fq.accuracy_report(model, q, (x,))
    assert report.min_layer_sqnr >= 40 and report.end_to_end.sqnr >= 35
    assert report.end_to_end.top1 >= 0.95
    # the same network with every weight quantized by the test itself: symmetric int8 per
    # output channel (absmax / 127), rounded, clamped to -127..127, dequantized
    ref = copy.deepcopy(model)
    for i in (0, 2, 4):
        w = model[i].weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        ref[i].weight = nn.Parameter(torch.clamp(torch.round(w / scale), -127, 127) * scale)
    fresh = torch.randn(16, 128)
    torch.testing.assert_close(q(fresh), ref(fresh), rtol=1e-5, atol=1e-5)


def test_static_and_dynamic_meet_30db_on_a_conv_net():
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2),
                        nn.ReLU(), nn.Flatten(), nn.Linear(32 * 7 * 7, 10)).eval()
    x = torch.randn(8, 3, 16, 16)
    calib = [torch.randn(8, 3, 16, 16) for _ in range(8)]
    for mode, observer in (("int8_static", "minmax"), ("int8_static", "histogram"), ("int8_dynamic", "minmax")):
        q = fq.quantize_model(net, (x,), mode, calibration_data=calib, observer=observer)
        assert fq.accuracy_report(net, q, (x,)).end_to_end.sqnr >= 30, (mode, observer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", fq.INT8_MODES)
def test_half_precision_models(dtype, mode):
    model, x = _mlp(dtype), torch.randn(16, 128, dtype=dtype)
    q = fq.quantize_model(model, (x,), mode, calibration_data=[(x,)])
    out = q(x)
    assert out.dtype == dtype
    assert fq.sqnr(model.float()(x.float()), out.float()) >= 25  # bf16 itself is ~40 dB


def test_dynamic_min_tokens_routes_by_rows():
    model, x = _mlp(), torch.randn(32, 128)
    q = fq.quantize_model(model, (x,), "int8_weight_only", dynamic_min_tokens=16)
    assert any(n.target is ops.int8_linear.default for n in q.graph.nodes)
    wo = fq.quantize_model(model, (x,), "int8_weight_only")
    dyn = fq.quantize_model(model, (x,), "int8_dynamic")
    torch.testing.assert_close(q(x[:4]), wo(x[:4]))
    torch.testing.assert_close(q(x), dyn(x))


def test_compile_fullgraph_cpu():
    model, x = _mlp(), torch.randn(4, 128)
    for mode in ("int8_weight_only", "int8_dynamic"):
        q = fq.quantize_model(model, (x,), mode)
        torch.testing.assert_close(torch.compile(q, fullgraph=True, backend="aot_eager")(x), q(x))


# ---------------------------------------------------------------- bad input

def test_calibrating_with_no_data_is_a_clear_error():
    gm = fxopt.optimize(_mlp(), ["insert_observers"], example_inputs=(torch.randn(2, 128),))
    with pytest.raises(fxopt.InputError, match="no calibration data"):
        fq.calibrate(gm, [])
    with pytest.raises(fxopt.InputError, match="no calibration data"):
        fq.quantize_model(_mlp(), (torch.randn(2, 128),), "int8_static")


def test_static_without_observers_is_a_clear_error_and_leaves_graph_untouched():
    gm = fx.symbolic_trace(_mlp())
    before = gm.code
    with pytest.raises(fxopt.PassError, match="insert_observers"):
        fxopt.optimize(gm, ["quantize{mode=int8_static}"], example_inputs=(torch.randn(2, 128),),
                       inplace=True)
    assert gm.code == before


def test_missing_example_inputs_names_the_placeholder():
    gm = fx.symbolic_trace(_mlp())
    with pytest.raises(fxopt.FxoptError, match="input"):
        fxopt.optimize(gm, ["quantize"])


def test_textual_pipeline_and_observer_counts():
    model = Spellings().eval()
    gm = fxopt.optimize(model, ["insert_observers{observer=moving_average}"], example_inputs=_inputs())
    observers = [m for m in gm.modules() if isinstance(m, fq.Observer)]
    assert len(observers) == 9  # one per constant-weight site, each with its own activation
    data = [_inputs() for _ in range(3)]
    n = fq.calibrate(gm, data, progress=False)
    assert n == 3 and all(o.batches == 3 for o in observers)
    q = fxopt.optimize(gm, ["quantize{mode=int8_static}"], example_inputs=_inputs())
    assert not any(isinstance(m, fq.Observer) for m in q.modules())
    # evaluated on calibrated data: static ranges clip whatever calibration never saw
    assert fq.accuracy_report(model, q, data[0]).end_to_end.sqnr >= 20  # 9 chained static layers
    assert math.isfinite(fq.accuracy_report(model, q, data[0]).end_to_end.cosine)


def test_aten_graph_from_make_fx_addmm_and_mm_of_transposed_weights():
    from torch.fx.experimental.proxy_tensor import make_fx

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8, bias=False)).eval()
    x = torch.randn(4, 32)
    gm = make_fx(model)(x)
    assert {torch.ops.aten.addmm.default, torch.ops.aten.mm.default} <= {n.target for n in gm.graph.nodes}
    q = fq.quantize_model(gm, (x,), "int8_weight_only")
    assert [r.mode for r in fq.summary_of(q).sites] == ["int8_weight_only"] * 2
    assert not any(n.target in (torch.ops.aten.t.default, torch.ops.aten.mm.default) for n in q.graph.nodes)
    fresh = torch.randn(4, 32)
    assert fq.sqnr(model(fresh), q(fresh)) >= 35


def test_leaf_module_with_hidden_matmuls_is_reported_and_training_model_rejected():
    class WithAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(self.att(x, x, x, need_weights=False)[0])

    x = torch.randn(2, 5, 16)
    q = fq.quantize_model(WithAttention().eval(), (x,))
    assert "torch.export" in fq.summary_of(q).skipped["att"]
    with pytest.raises(fxopt.InputError, match=r"model\.eval\(\)"):
        fq.quantize_model(WithAttention(), (x,))


def test_users_model_and_graph_are_left_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU())).eval()
    x = torch.randn(2, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    structure = repr(model)
    gm = fx.symbolic_trace(model)
    code, modules = gm.code, repr(gm)
    for mode in fq.MODES:
        fq.quantize_model(model, (x,), mode, calibration_data=[(x,)])
        fq.quantize_model(gm, (x,), mode, calibration_data=[(x,)])
    assert repr(model) == structure
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert gm.code == code and repr(gm) == modules
    assert not any(isinstance(m, fq.Observer) for m in model.modules())


def test_shared_activation_gets_one_observer_and_one_qdq():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model, x = TwoHeads().eval(), torch.randn(4, 16)
    calib = [(torch.randn(64, 16),) for _ in range(4)]
    q = fq.quantize_model(model, (x,), "int8_static", calibration_data=calib)
    quantizes = [n for n in q.graph.nodes if n.target is ops.quantize.default]
    assert len(quantizes) == 1 and len(quantizes[0].users) == 1
    assert fq.accuracy_report(model, q, (x,)).end_to_end.sqnr >= 30


def test_calibration_shows_a_progress_bar(capsys):
    gm = fxopt.optimize(_mlp(), ["insert_observers"], example_inputs=(torch.randn(2, 128),))
    fq.calibrate(gm, [torch.randn(2, 128) for _ in range(3)], progress=True)
    assert "calibrating" in capsys.readouterr().err
    fq.calibrate(gm, [torch.randn(2, 128) for _ in range(3)])  # short runs: no bar by default
    assert "calibrating" not in capsys.readouterr().err


def test_keyword_arguments_and_dot_T_weights():
    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 32) / 5)
            self.v = nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x):
            h = x @ self.w.T
            h = torch.matmul(h, other=self.v)
            h = F.linear(input=h, weight=self.v.mT)
            return torch.mm(h, mat2=self.v)

    model, x = Keywords().eval(), torch.randn(4, 32)
    for mode in fq.INT8_MODES:
        # calibration data includes the evaluated batch: static ranges clip what they never saw
        q = fq.quantize_model(model, (x,), mode, calibration_data=[(x,), (torch.randn(64, 32),)])
        assert fq.summary_of(q).coverage == 1.0, mode
        assert fq.sqnr(model(x), q(x)) >= 30, mode


# ---------------------------------------------------------------- int4 weight-only (stretch)

def test_int4_pack_round_trip_and_group_scales():
    from fxopt.quant.formats import pack_int4, unpack_int4

    w = torch.randn(6, 256)
    packed, scales = pack_int4(w, 64)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 128) and scales.shape == (6, 4)
    back = unpack_int4(packed, scales, 64)
    step = scales.repeat_interleave(64, dim=1)
    assert torch.all((back - w).abs() <= step / 2 + 1e-6)
    torch.testing.assert_close(scales, w.reshape(6, 4, 64).abs().amax(-1) / 7)


def test_int4_packing_is_the_layout_its_version_names(int4_by_hand):
    """Packing 2, byte by byte: in group g, byte j holds element j (low nibble) and
    element j + group/2 (high), each plus 8. Saved programs record this version: a change
    of layout must raise ``INT4_FORMAT_VERSION`` and teach ``convert_int4`` the old one."""
    from fxopt.quant.formats import INT4_FORMAT_VERSION, convert_int4, pack_int4

    w, group = torch.randn(3, 128), 32
    values, _ = int4_by_hand(w, group)
    nibbles = (values + 8).to(torch.int64)
    expected = torch.empty(3, 64, dtype=torch.int64)
    for g in range(128 // group):
        for j in range(group // 2):
            low, high = nibbles[:, g * group + j], nibbles[:, g * group + j + group // 2]
            expected[:, g * group // 2 + j] = low + 16 * high
    packed, _ = pack_int4(w, group)
    assert INT4_FORMAT_VERSION == 2 and torch.equal(packed.to(torch.int64), expected)
    # packing 1 paired element j of the row with element j + K/2
    rows = (nibbles[:, :64] + 16 * nibbles[:, 64:]).to(torch.uint8)
    assert torch.equal(convert_int4(rows, group, 1), packed)
    with pytest.raises(ValueError, match="no conversion from int4 packing version 3"):
        convert_int4(rows, group, 3)


def _with_int4_weights_by_hand(model: nn.Sequential, groups: dict[int, int], int4_by_hand) -> nn.Module:
    """A copy of ``model`` whose layers ``groups`` (index -> group size) have their weight
    quantized to int4 and dequantized by the test's own quantizer."""
    ref = copy.deepcopy(model)
    for i, group in groups.items():
        values, scales = int4_by_hand(model[i].weight, group)
        ref[i].weight = nn.Parameter(values * scales.repeat_interleave(group, dim=1))
    return ref


def test_int4_weight_only_mode_skips_what_it_cannot_pack(int4_by_hand):
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 96), nn.ReLU(),
                          nn.Linear(96, 10)).eval()
    x = torch.randn(8, 256)
    q = fq.quantize_model(model, (x,), "int4_weight_only", group_size=64)
    by_name = {r.name: r for r in fq.summary_of(q).sites}
    assert by_name["_0"].mode == by_name["_2"].mode == "int4_weight_only"
    assert by_name["_4"].reason == "int4_weight_only needs K a multiple of group_size=64, K=96"
    assert fq.accuracy_report(model, q, (x,)).min_layer_sqnr >= 20  # 4 bits: ~6 dB per bit
    # the graph equals the float network with int4 weights quantized apart from fxopt
    fresh = torch.randn(5, 256)
    ref = _with_int4_weights_by_hand(model, {0: 64, 2: 64}, int4_by_hand)
    torch.testing.assert_close(q(fresh), ref(fresh), rtol=1e-5, atol=1e-5)


def _k_64_96_48() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48), nn.ReLU(), nn.Linear(48, 8)).eval()


def test_int4_group_size_adapts_to_k_and_is_reported(int4_by_hand):
    """K = 64, 96, 48: the largest of 128, 64, 32 dividing K (64, 32), and a reason where
    none does; the numbers are those of the float network with its weights quantized in
    groups of that size by the test's own quantizer (another group size rounds otherwise)."""
    from fxopt.optimize import optimize, report_of

    model, x = _k_64_96_48(), torch.randn(8, 64)
    q = optimize(model, ["quantize{mode=int4_weight_only}"], example_inputs=(x,))
    by_name = {r.name: r for r in fq.summary_of(q).sites}
    assert (by_name["_0"].group_size, by_name["_2"].group_size) == (64, 32)
    assert by_name["_4"].mode is None and by_name["_4"].group_size is None
    assert by_name["_4"].reason == "int4_weight_only needs K a multiple of one of 128, 64, 32, K=48"
    assert report_of(q).records[-1].stats["int4_group_sizes"] == {"_0": 64, "_2": 32}
    assert 0 < fq.summary_of(q).coverage < 1
    fresh = torch.randn(5, 64)
    ref = _with_int4_weights_by_hand(model, {0: 64, 2: 32}, int4_by_hand)
    torch.testing.assert_close(q(fresh), ref(fresh), rtol=1e-5, atol=1e-5)
    coarser = _with_int4_weights_by_hand(model, {0: 64, 2: 96}, int4_by_hand)
    assert not torch.allclose(q(fresh), coarser(fresh), rtol=1e-3, atol=1e-3)  # the check can tell


def test_quantizing_nothing_warns_after_training_as_it_raises_before_qat():
    """One rule in both flows: the same message, a warning for quantize, an error for prepare_qat."""
    model, x = nn.Sequential(nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(4, 48)
    with pytest.warns(UserWarning, match="no quantizable site") as caught:
        q = fq.quantize_model(model, (x,), "int4_weight_only", group_size=64)
    assert fq.summary_of(q).coverage == 0.0
    assert fxopt.report_of(q).warnings == [str(caught[0].message)]  # in the run's report too
    torch.testing.assert_close(q(x), model(x))
    with pytest.raises(fxopt.FxoptError) as raised:
        fq.prepare_qat(model.train(), (x,), "int4_weight_only", group_size=64)
    warned = str(caught[0].message)
    assert warned.startswith("quantize: ")
    assert "_0: int4_weight_only needs K a multiple of group_size=64, K=48" in warned
    assert "prepare_qat: " + warned.removeprefix("quantize: ") in str(raised.value)
    # a model with something to quantize does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fq.quantize_model(_k_64_96_48(), (torch.randn(2, 64),), "int4_weight_only")


def test_per_layer_sqnr_is_measured_before_an_in_place_activation_overwrites_the_output():
    """relu_/hardtanh_ after a layer must not change that layer's measured error."""
    def make(inplace):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=inplace), nn.Linear(64, 64),
                             nn.Hardtanh(inplace=inplace), nn.Linear(64, 8)).eval()

    x = torch.randn(16, 32)
    reports = {}
    for inplace in (False, True):
        gm = torch.fx.symbolic_trace(make(inplace))
        reports[inplace] = fq.accuracy_report(gm, fq.quantize_model(gm, (x,), "int8_dynamic"), (x,))
    plain, inplace = reports[False], reports[True]
    assert [r.name for r in inplace.layers] == [r.name for r in plain.layers] and len(plain.layers) == 3
    for a, b in zip(plain.layers, inplace.layers):
        assert a.sqnr > 30
        assert b.sqnr == pytest.approx(a.sqnr, rel=1e-6), a.name
        assert b.max_abs == pytest.approx(a.max_abs, rel=1e-6), a.name


def test_the_weight_only_reference_stays_finite_in_float16_where_the_product_would_not():
    """The reference dequantizes the weight before the product: an unscaled int8 product in
    float16 overflows where the scaled one is in range (the route above 256 rows on CUDA)."""
    from fxopt.quant.ops import int8_weight_only_linear_reference

    w = torch.full((8, 4096), 127, dtype=torch.int8)
    scale = torch.full((8,), 1e-3)
    x = torch.full((300, 4096), 8.0)
    out = int8_weight_only_linear_reference(x.half(), w, scale, None)
    expected = x.double() @ (w.double() * scale.double()[:, None]).t()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=0)
