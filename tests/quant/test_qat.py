"""Quantization-aware training: fake quantization numerics, straight-through gradients,
the BatchNorm and observer schedules, conversion to the post-training lowering, both
capture paths, checkpoints, torch.compile, and bad input. Tiny models, synthetic data."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from fxopt.patterns import canonicalize

import fxopt
import fxopt.quant as fq
from fxopt.analysis.ops import facts
from fxopt.quant.formats import pack_int4, unpack_int4
from fxopt.quant.ops import ops


class Net(nn.Module):
    """conv + BN (folded in QAT), then several matmul spellings on constant weights."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 64)
        self.w = nn.Parameter(torch.randn(32, 64) / 8)   # used as F.linear(h, w)
        self.v = nn.Parameter(torch.randn(32, 16) / 6)   # used as h @ v (K x N)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1)
        h = F.relu(self.fc(h))
        h = F.relu(F.linear(h, self.w))
        return self.head(F.relu(h @ self.v))


_TEACHER = torch.randn(3 * 8 * 8, 10, generator=torch.Generator().manual_seed(123))


def _data(n=32, seed=0):
    """Images and the labels a fixed linear teacher gives them (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return x, (x.flatten(1) @ _TEACHER).argmax(-1)


def _train(model, steps, lr=0.01, seed=0):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        x, y = _data(seed=seed + i % 4)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _capture(model, how):
    x, _ = _data()
    return fx.symbolic_trace(model) if how == "symbolic_trace" else torch.export.export(model, (x,))


def _fxopt_ops(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("fxopt_quant"))


# ---------------------------------------------------------------- fake quantization numerics

def test_weight_fake_quant_matches_the_lowerings_quantize_dequantize():
    w = torch.randn(24, 64)
    per_channel = fq.WeightFakeQuant(w, (1,), bits=8, granularity="channel")
    scale = w.abs().amax(1, keepdim=True) / 127
    zero = torch.zeros(())
    reference = ops.dequantize(ops.quantize(w, scale, zero, -127, 127), scale, zero, torch.float32)
    torch.testing.assert_close(per_channel(w), reference, rtol=0, atol=1e-6)
    # a [K, N] weight (``x @ v``) gets one scale per output column
    v = torch.randn(64, 24)
    column = fq.WeightFakeQuant(v, (0,), bits=8, granularity="channel")
    torch.testing.assert_close(column(v), column(v.t().contiguous().t()))
    torch.testing.assert_close(column(v).t(), per_channel(v.t()))
    int4 = fq.WeightFakeQuant(w, (1,), bits=4, granularity="group", group_size=32)
    torch.testing.assert_close(int4(w), unpack_int4(*pack_int4(w, 32), 32), rtol=0, atol=1e-6)
    per_tensor = fq.WeightFakeQuant(w, (1,), bits=8, granularity="tensor")
    s = w.abs().max() / 127
    torch.testing.assert_close(per_tensor(w), torch.clamp(torch.round(w / s), -127, 127) * s, rtol=0, atol=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_activation_fake_quant_matches_observer_qdq_and_has_a_clipped_ste(symmetric):
    x = (torch.randn(16, 40) * 2 + 0.5).requires_grad_()
    act = fq.ActivationFakeQuant(symmetric=symmetric).train()
    out = act(x)
    scale, zp = fq.observers.qparams_from_range(x.min().detach(), x.max().detach(), symmetric)
    qmin, qmax = fq.observers.qrange(symmetric)
    reference = ops.dequantize(ops.quantize(x.detach(), scale, zp, qmin, qmax), scale, zp, torch.float32)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(act.qparams()[0], scale)
    # straight-through: gradient 1 inside the range, 0 where the input is clipped
    act.observing = False
    wide = torch.tensor([-100.0, 0.1, 100.0], requires_grad=True)
    act(wide).sum().backward()
    assert wide.grad.tolist() == [0.0, 1.0, 0.0]


def test_dynamic_fake_quant_matches_per_token_quantization():
    x = torch.randn(6, 32)
    out = fq.DynamicFakeQuant(per_token=True)(x)
    scale = x.abs().amax(-1, keepdim=True) / 127
    torch.testing.assert_close(out, torch.round(x / scale) * scale, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- training

@pytest.mark.parametrize("how", ["symbolic_trace", "export"])
def test_gradients_reach_the_float_weights_and_loss_decreases(how):
    # ranges follow quickly here: this trains from scratch, where activations grow
    qat = fq.prepare_qat(_capture(Net().train(), how), (_data()[0],), "int8_static",
                         averaging_constant=0.5)
    losses = _train(qat, 1)
    grads = {n: p.grad for n, p in qat.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), grads.keys()
    assert {"gm.conv.weight", "gm.bn.weight", "gm.fc.weight", "gm.w", "gm.v"} <= set(grads)
    losses += _train(qat, 30)
    assert sum(losses[-4:]) / 4 < 0.9 * losses[0]


def test_fake_quant_sits_on_every_site_the_post_training_path_quantizes():
    model = Net().train()
    qat = fq.prepare_qat(model, (_data()[0],), "int8_dynamic")
    ptq = fq.quantize_model(copy.deepcopy(model).eval(), (_data()[0],), "int8_dynamic")
    quantized = [r for r in fq.summary_of(ptq).sites if r.mode]
    weights = [m for m in qat.gm.modules() if isinstance(m, fq.WeightFakeQuant)]
    dynamic = [m for m in qat.gm.modules() if isinstance(m, fq.DynamicFakeQuant)]
    assert len(weights) == len(dynamic) == len(quantized) == 5


def test_batch_norm_folds_and_freezes_on_schedule():
    torch.manual_seed(0)
    qat = fq.prepare_qat(Net().train(), (_data()[0],), "int8_static", freeze_bn_after=3,
                         freeze_observers_after=5)
    bn = qat.gm.get_submodule("bn")
    means = []
    for _ in range(6):
        means.append(bn.running_mean.clone())
        _train(qat, 1)
    means.append(bn.running_mean.clone())
    moved = [not torch.equal(a, b) for a, b in zip(means, means[1:])]
    assert moved == [True, True, True, False, False, False]
    assert qat.bn_frozen and qat.observers_frozen and qat.steps == 6
    # a frozen BatchNorm uses its running statistics in training too: train == eval
    x = _data(seed=9)[0]
    with torch.no_grad():
        assert torch.equal(qat.train()(x), qat.eval()(x))


def test_folded_training_forward_is_the_float_forward_up_to_quantization():
    model = Net().train()
    qat = fq.prepare_qat(model, (_data()[0],), "int8_weight_only")
    x = _data(seed=3)[0]
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
        got = qat(x)
    assert fq.sqnr(expected, got) > 30


def test_observers_freeze_and_learnable_scales_then_train():
    qat = fq.prepare_qat(Net().train(), (_data()[0],), "int8_static", learnable=True,
                         freeze_observers_after=2)
    act = next(m for m in qat.gm.modules() if isinstance(m, fq.ActivationFakeQuant))
    weight = qat.gm.get_submodule("fc_weight_fake_quant")
    _train(qat, 2)
    frozen_act, frozen_weight = act.scale.detach().clone(), weight.scale.detach().clone()
    assert act.observed.item() == 2
    _train(qat, 4, lr=0.05)
    assert act.observed.item() == 2  # no more observation ...
    assert not torch.equal(act.scale, frozen_act)  # ... but the learnable scales train
    assert not torch.equal(weight.scale, frozen_weight)
    converted = fq.convert_qat(qat)
    torch.testing.assert_close(converted.fc_weight_scale, weight.lowering_scale())


@pytest.mark.parametrize("how", ["symbolic_trace", "export"])
def test_evaluation_mid_training_updates_no_statistics_range_or_step(how):
    model = nn.Sequential(Net(), nn.Dropout(0.5)).train()
    qat = fq.prepare_qat(_capture(model, how), (_data()[0],), "int8_static")
    _train(qat, 2)
    before = copy.deepcopy(qat.state_dict())
    x = _data(seed=8)[0] * 5  # far outside the observed range
    with torch.no_grad():
        assert torch.equal(qat.eval()(x), qat(x))  # no dropout in eval
    assert _unchanged(qat, before) and qat.steps == 2
    _train(qat.train(), 1)  # back in training, BatchNorm and observers update again
    changed = {k for k, v in qat.state_dict().items() if isinstance(v, torch.Tensor)
               and not torch.equal(v, before[k])}
    assert any("running_mean" in k for k in changed) and any(k.endswith(".lo") for k in changed)


def test_op_facts_know_the_fake_quantizers():
    qat = fq.prepare_qat(Net().train(), (_data()[0],), "int8_static")
    kinds = {}
    for node in qat.gm.graph.nodes:
        if node.op == "call_module":
            kinds.setdefault(type(qat.gm.get_submodule(node.target)), []).append(facts(node))
    for kind in (fq.WeightFakeQuant, fq.ActivationFakeQuant):  # they update their own buffers
        assert kinds[kind] and all(f.stateful and not f.unknown for f in kinds[kind])
    dynamic = fq.prepare_qat(Net().train(), (_data()[0],), "int8_dynamic")
    assert all(facts(n).pure for n in dynamic.gm.graph.nodes if n.op == "call_module"
               and isinstance(dynamic.gm.get_submodule(n.target), fq.DynamicFakeQuant))

    def straight_through(x, s, z):  # the ATen ops the fake quantizers run
        a = torch.fake_quantize_per_tensor_affine(x, s, z.to(torch.int32), -128, 127)
        return torch._fake_quantize_learnable_per_tensor_affine(a, s, z, -128, 127, 1.0)

    graph = fx.symbolic_trace(straight_through).graph
    assert all(facts(n).pure for n in graph.nodes if n.op == "call_function")


# ---------------------------------------------------------------- convert

@pytest.mark.parametrize("how", ["symbolic_trace", "export"])
@pytest.mark.parametrize("mode", fq.MODES)
def test_convert_gives_the_post_training_lowering_and_the_qat_numerics(mode, how):
    model = Net().train()
    options = {"group_size": 32} if mode == "int4_weight_only" else {}
    qat = fq.prepare_qat(_capture(model, how), (_data()[0],), mode, freeze_bn_after=4, **options)
    _train(qat, 6)
    qat.eval()
    converted = fq.convert_qat(qat)
    fake_quants = (fq.WeightFakeQuant, fq.ActivationFakeQuant, fq.DynamicFakeQuant)
    assert not any(isinstance(m, fake_quants) for m in converted.modules())
    # the BatchNorm is folded where its conv is quantized (int4 covers linear-like sites only)
    batch_norms = [n for n in converted.graph.nodes if getattr(canonicalize(n), "op", None) == "batch_norm"]
    assert bool(batch_norms) == (mode == "int4_weight_only")
    x = _data(seed=7)[0]
    with torch.no_grad():
        torch.testing.assert_close(converted(x), qat(x), rtol=1e-4, atol=1e-4)
    # the post-training path on the same (trained) float weights, BatchNorm folded first
    trained = copy.deepcopy(qat.gm)
    float_model = _float_twin(model, qat)
    folded = fxopt.optimize(float_model, ["fold_conv_bn"], example_inputs=(x,))
    ptq = fq.quantize_model(folded, (x,), mode, calibration_data=[(x,)], **options)
    assert _fxopt_ops(converted) == _fxopt_ops(ptq)
    assert [(r.name, r.mode) for r in fq.summary_of(converted).sites if r.mode] != []
    assert fq.summary_of(converted).coverage == pytest.approx(fq.summary_of(ptq).coverage)
    assert trained.graph.python_code("self").src == qat.gm.graph.python_code("self").src  # qat untouched


def _float_twin(model, qat):
    """The user's float model with the QAT model's trained weights and statistics."""
    twin = copy.deepcopy(model).eval()
    twin.load_state_dict(qat.float_state_dict())
    return twin


def test_accuracy_report_against_the_float_model():
    model = Net().train()
    qat = fq.prepare_qat(model, (_data()[0],), "int8_static", freeze_bn_after=6,
                         averaging_constant=0.5)  # from scratch: ranges must follow fast
    _train(qat, 8)
    converted = fq.convert_qat(qat)
    float_model = _float_twin(model, qat)
    report = fq.accuracy_report(float_model, converted, (_data(seed=5)[0],))
    assert {r.name for r in report.layers} == {"bn", "fc", "linear", "matmul", "head"}
    assert report.min_layer_sqnr > 30 and report.end_to_end.sqnr > 25


def test_convert_before_training_warns():
    qat = fq.prepare_qat(Net().train(), (_data()[0],), "int8_static")
    with pytest.warns(UserWarning, match="never saw data"):
        fq.convert_qat(qat)
    _train(qat, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*never saw data.*")
        fq.convert_qat(qat)


# ---------------------------------------------------------------- checkpoints and compile

def test_state_dict_round_trip_restores_weights_ranges_and_schedule():
    model = Net().train()
    qat = fq.prepare_qat(model, (_data()[0],), "int8_static", freeze_bn_after=2, freeze_observers_after=3)
    _train(qat, 4)
    fresh = fq.prepare_qat(model, (_data()[0],), "int8_static", freeze_bn_after=2, freeze_observers_after=3)
    fresh.load_state_dict(qat.state_dict())
    assert (fresh.steps, fresh.bn_frozen, fresh.observers_frozen) == (4, True, True)
    x = _data(seed=11)[0]
    with torch.no_grad():
        assert torch.equal(fresh.train()(x), qat.train()(x))  # frozen BN: no batch statistics
        assert torch.equal(fq.convert_qat(fresh)(x), fq.convert_qat(qat)(x))


def test_compiled_training_steps_match_eager():
    torch.manual_seed(0)

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    eager = fq.prepare_qat(Small().train(), (x,), "int8_static", freeze_observers_after=1)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    for model in (eager, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert compiled_model.steps == 2 and compiled_model.observers_frozen
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- bad input

def _unchanged(model, before):
    after = model.state_dict()
    same = [torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
            for k in before]
    return before.keys() == after.keys() and all(same)


def test_eval_mode_model_or_graph_is_rejected_and_left_untouched():
    model = Net().eval()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(fxopt.InputError, match="eval mode"):
        fq.prepare_qat(model, (_data()[0],))
    assert not model.training and _unchanged(model, before)
    exported = torch.export.export(Net().eval(), (_data()[0],))
    with pytest.raises(fxopt.InputError, match="batch_norm"):
        fq.prepare_qat(exported, (_data()[0],))


def test_no_quantizable_site_is_a_typed_error_naming_the_reasons():
    class NoMatmul(nn.Module):
        def forward(self, x):
            return F.relu(x) * 2

    with pytest.raises(fxopt.FxoptError, match="no quantizable site.*no matmul"):
        fq.prepare_qat(NoMatmul().train(), (torch.randn(2, 3),))
    model = Net().double().train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(fxopt.FxoptError, match="no quantizable site.*float64"):
        fq.prepare_qat(model, (_data()[0].double(),))
    assert _unchanged(model, before)


def test_what_is_not_a_model_or_a_qat_model_is_a_typed_error():
    with pytest.raises(fxopt.InputError, match="prepare_qat takes .* got str"):
        fq.prepare_qat("model.pt", (_data()[0],))
    with pytest.raises(fxopt.InputError, match="convert_qat takes .* got Net"):
        fq.convert_qat(Net().train())


@pytest.mark.parametrize("options, option", [
    ({"mode": "int4_static"}, "mode"),
    ({"mode": "int8_static", "symmetric_weights": False}, "symmetric_weights"),
    ({"mode": "int4_weight_only", "group_size": 48}, "group_size"),
])
def test_unsupported_bit_width_combinations_are_option_errors(options, option):
    model = Net().train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(fxopt.PassOptionError, match=option) as info:
        fq.prepare_qat(model, (_data()[0],), **options)
    assert info.value.option == option and info.value.pass_name == "prepare_qat"
    assert _unchanged(model, before)


def test_int4_qat_takes_the_post_training_group_sizes():
    """K = 64, 96, 48 with the default group size: QAT fakes groups of 64 and 32 where the
    quantize pass packs them (the same rule), and leaves K = 48 in float as it does."""
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48), nn.ReLU(), nn.Linear(48, 8)).train()
    x = torch.randn(8, 64)
    qat = fq.prepare_qat(model, (x,), "int4_weight_only")
    groups = sorted(m.group_size for m in qat.modules() if isinstance(m, fq.WeightFakeQuant))
    assert groups == [32, 64]
    qat.eval()
    converted = fq.convert_qat(qat)
    sites = {r.name: r.group_size for r in fq.summary_of(converted).sites}
    assert sites == {"_0": 64, "_2": 32, "_4": None}
    with torch.no_grad():
        torch.testing.assert_close(converted(x), qat(x), rtol=1e-4, atol=1e-4)
