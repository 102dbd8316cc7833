"""Transactions see every route a pass can write by: ``.data``, ``p.data = ...``,
``.numpy()`` views and ``gm.meta``; a pass that writes the user's tensors is rolled back
and named, whether it raised or not, and verification runs leave buffers as they were."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.models import demo_model


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_values(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for key, value in module.state_dict().items():
        assert torch.equal(value, expected[key]), key


def _through_data(gm):
    gm.head.weight.data.mul_(2)


def _assign_data(gm):
    gm.head.weight.data = torch.zeros_like(gm.head.weight)


def _through_numpy(gm):
    gm.head.weight.detach().numpy()[0, 0] += 1.0


def _through_buffer_numpy(gm):
    bn = next(m for m in gm.modules() if isinstance(m, nn.BatchNorm2d))
    bn.running_var.numpy()[...] = 7.0


WRITES = [_through_data, _assign_data, _through_numpy, _through_buffer_numpy]


def _then(write, failure):
    def pass_(gm):
        write(gm)
        gm.meta["written_by"] = write.__name__
        if failure == "raise":
            raise RuntimeError("boom")
        if failure == "break":  # a wrong graph: verification fails
            out = next(n for n in gm.graph.nodes if n.op == "output")
            with gm.graph.inserting_before(out):
                out.args = (gm.graph.call_function(torch.neg, (out.args[0],)),)
    pass_.__name__ = f"{write.__name__}_then_{failure}"
    return pass_


@pytest.mark.parametrize("failure", ["raise", "break"])
@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__)
def test_a_failing_pass_is_rolled_back_whatever_route_it_wrote_by(write, failure):
    model, inputs = demo_model()
    gm = fx.symbolic_trace(model)
    gm.meta["mine"] = 1
    values, meta, ptr = _values(gm), dict(gm.meta), gm.head.weight.data_ptr()
    expected = gm(*inputs)
    with pytest.raises(fxopt.PassError) as info:
        fxopt.PassManager(["cse", _then(write, failure)], verify=True).run(gm, inputs)
    assert info.value.pass_name == f"{write.__name__}_then_{failure}"
    _assert_values(gm, values)
    assert gm.head.weight.data_ptr() == ptr and isinstance(gm.head.weight, nn.Parameter)
    assert gm.meta == meta
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__)
def test_a_succeeding_pass_that_writes_the_users_model_is_a_contract_error(write):
    model, inputs = demo_model()
    values = _values(model)
    with pytest.raises(fxopt.PassContractError) as info:
        fxopt.optimize(model, ["dce", write], example_inputs=inputs)
    assert info.value.pass_name == write.__name__
    assert "in place" in str(info.value)
    _assert_values(model, values)


def test_tensors_a_pass_created_are_guarded_for_the_passes_after_it():
    model, inputs = demo_model()
    gm = fxopt.optimize(model, ["fold_conv_bn"], example_inputs=inputs)  # new, folded weights
    folded = {k: v.clone() for k, v in gm.state_dict().items()}

    def corrupt_folded(g):
        for p in g.parameters():
            p.data.add_(1)

    with pytest.raises(fxopt.PassContractError, match="corrupt_folded"):
        fxopt.PassManager([corrupt_folded]).run(gm)
    _assert_values(gm, folded)


def test_verification_leaves_training_running_statistics_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    stats = _values(model)
    x = torch.randn(2, 3, 8, 8)
    gm = fxopt.optimize(model, ["cse", "dce", "eliminate_identity"], example_inputs=(x,), verify=True)
    _assert_values(model, stats)
    gm(x)  # the optimized model still updates its (shared) statistics when it runs
    assert not torch.equal(model[1].running_mean, stats["1.running_mean"])


def test_passes_that_leave_tensors_alone_pass_the_guard():
    model, inputs = demo_model()
    values = _values(model)
    gm = fxopt.optimize(model, example_inputs=inputs, verify=True)
    _assert_values(model, values)
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
