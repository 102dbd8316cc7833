"""Bad input gets a typed FxoptError naming the culprit: option bounds, ops without a fake
implementation (not the user's inputs' fault), and things that are not passes."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.registry import get_pass_class


def _chain():
    return fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))


@pytest.mark.parametrize("alignment", [0, -64])
def test_plan_memory_rejects_an_alignment_below_one(alignment):
    gm = _chain()
    code = gm.code
    with pytest.raises(fxopt.PassOptionError) as info:
        fxopt.optimize(gm, [f"plan_memory{{alignment={alignment}}}"], example_inputs=(torch.randn(2, 8),))
    assert info.value.pass_name == "plan_memory" and info.value.option == "alignment"
    assert str(alignment) in str(info.value)
    with pytest.raises(fxopt.PassOptionError, match="alignment"):
        get_pass_class("plan_memory")(alignment=alignment)
    assert gm.code == code


def test_plan_memory_accepts_an_alignment_of_one():
    """Alignment 1 packs 60-byte buffers back to back (the default rounds each to 64)."""
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5))
    x = torch.randn(3, 5)  # 3 x 5 float32: 60 bytes an activation
    gm = fxopt.optimize(fx.symbolic_trace(model), ["plan_memory{alignment=1}"], example_inputs=(x,))
    offsets = {b.offset for b in gm.meta["fxopt.memory_plan"].buffers}
    assert offsets == {0, 60}
    fresh = torch.randn(3, 5)
    torch.testing.assert_close(gm(fresh), model(fresh))


def test_fixpoint_rejects_zero_rounds():
    with pytest.raises(fxopt.PassOptionError, match="max_rounds"):
        fxopt.Fixpoint(["dce"], max_rounds=0)


@torch.library.custom_op("fxopt_test_bad_input::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_LIB = torch.library.Library("fxopt_test_bad_input", "FRAGMENT")
_LIB.define("cpu_only(Tensor x) -> Tensor")
_LIB.impl("cpu_only", lambda x: x * 3, "CPU")


@pytest.mark.parametrize("op", ["no_fake", "cpu_only"])
def test_an_op_without_a_fake_implementation_is_named_not_blamed_on_the_inputs(op):
    target = getattr(torch.ops.fxopt_test_bad_input, op)

    class M(nn.Module):
        def forward(self, x):
            return target(x.relu()) + 1

    gm = fx.symbolic_trace(M())
    with pytest.raises(fxopt.MissingFakeImplError) as info:
        fxopt.optimize(gm, ["cse"], example_inputs=(torch.randn(3),))
    assert not isinstance(info.value, fxopt.InputError)
    assert info.value.op == f"fxopt_test_bad_input::{op}" and info.value.node == op
    assert "register_fake" in str(info.value)
    assert all("val" not in n.meta for n in gm.graph.nodes)  # the user's graph is untouched


@pytest.mark.parametrize("passes", [42, 3.5, object()])
def test_something_that_is_not_a_pass_is_a_typed_error(passes):
    with pytest.raises(fxopt.NotAPassError) as info:
        fxopt.optimize(_chain(), passes)
    assert type(passes).__name__ in str(info.value)
    assert isinstance(info.value, fxopt.FxoptError) and isinstance(info.value, TypeError)
    with pytest.raises(fxopt.NotAPassError):
        fxopt.PassManager(["dce", passes])


@pytest.mark.parametrize("model", [42, "resnet18", [nn.Linear(2, 2)]])
def test_something_that_is_not_a_model_is_a_typed_error(model):
    with pytest.raises(fxopt.ModelTypeError, match=type(model).__name__) as info:
        fxopt.optimize(model)
    assert isinstance(info.value, TypeError)
    with pytest.raises(fxopt.ModelTypeError, match="GraphModule"):
        fxopt.PassManager(["dce"]).run(model)


def test_a_non_callable_in_a_pass_list_is_a_typed_error():
    with pytest.raises(fxopt.NotAPassError, match="not a pass"):
        fxopt.pass_protocol.as_pass(42)
