"""Runs whose shapes come from fxopt's shape rules (meta values) against the same runs
with FakeTensor propagation (``shape_rules=False``): the default pipeline must rewrite
every graph the same way, record the same tensor metadata on every node, and compute what
the eager model computes on fresh inputs. Where the rules cannot be used (an op without
a rule, a pass that needs FakeTensors, a hook of the user's) the run must fall back on
FakeTensors for the whole graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import fxopt
from fxopt.analysis.shapes import META_VALUES_DEVICE
from fxopt.models import ZOO, demo_model, example_inputs


class TorchvisionBlock(nn.Module):
    """torchvision's BasicBlock spelling: in-place ReLU modules and ``out += identity``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        out = self.pool(self.relu(out))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(20, 64), nn.Linear(64, 64), nn.Linear(64, 3)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.gelu(self.fc1(x.view(x.size(0), -1))))
        x = torch.relu(self.fc2(x)) + x
        return self.fc3(x).sigmoid() * 2.0


def _models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    demo, inputs = demo_model()
    generator = torch.Generator().manual_seed(1)
    block = fxopt.models.randomize_norms(fxopt.models.reseeded(TorchvisionBlock())).eval()
    return {
        "demo": (demo, inputs),
        "torchvision_block": (block, (torch.randn(2, 8, 9, 9, generator=generator),)),
        "mlp": (fxopt.models.reseeded(MLP()).eval(), (torch.randn(4, 4, 5, generator=generator),)),
        **{name: (ZOO[name](), example_inputs(name)) for name in ("resnet18", "mobilenet_v2", "densenet", "unet")},
    }


MODELS = _models()


def _tensors(gm: fx.GraphModule) -> list[Any]:
    """The tensor values of ``gm``'s nodes (``size()`` gives ints; a check ``inplace`` adds, none)."""
    values = [n.meta.get("val") for n in gm.graph.nodes]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _all_meta(gm: fx.GraphModule) -> bool:
    return all(type(v) is torch.Tensor and v.is_meta for v in _tensors(gm))


def _all_fake(gm: fx.GraphModule) -> bool:
    return all(isinstance(v, FakeTensor) for v in _tensors(gm))


def _structure(gm: fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.op, type(gm.get_submodule(n.target)).__name__ if n.op == "call_module" else str(n.target))
            for n in gm.graph.nodes]


def _tensor_meta(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("tensor_meta") for n in gm.graph.nodes]


def _stats(gm: fx.GraphModule) -> list[tuple[str, bool, dict]]:
    return [(r.name, r.changed, r.stats) for r in fxopt.report_of(gm).records]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_pipeline_is_the_same_with_shape_rules_as_with_fake_tensors(name: str) -> None:
    model, inputs = MODELS[name]
    ruled = fxopt.optimize(model, example_inputs=inputs)
    faked = fxopt.optimize(model, example_inputs=inputs, shape_rules=False)
    # the rules did the work on one side, FakeTensors on the other
    assert ruled.meta[META_VALUES_DEVICE] == torch.device("cpu")
    assert _all_meta(ruled)
    assert META_VALUES_DEVICE not in faked.meta
    assert _all_fake(faked)
    assert _structure(ruled) == _structure(faked)
    assert _tensor_meta(ruled) == _tensor_meta(faked)
    assert _stats(ruled) == _stats(faked)
    assert any(changed for _, changed, _ in _stats(ruled))
    fresh = tuple(torch.randn(x.shape, generator=torch.Generator().manual_seed(7)) for x in inputs)
    with torch.no_grad():
        fxopt.testing.assert_equivalent(model, ruled, fresh)


def test_a_graph_with_an_op_without_a_rule_falls_back_on_fake_tensors_for_every_node() -> None:
    class WithGroupNorm(nn.Module):  # group norm has no rule
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(6, 6), nn.GroupNorm(2, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.norm(self.fc(x)))

    model = WithGroupNorm().eval()
    gm = fxopt.optimize(model, example_inputs=(torch.randn(3, 6),))
    assert META_VALUES_DEVICE not in gm.meta
    assert _all_fake(gm) and len(_tensors(gm)) == len(gm.graph.nodes)  # every node, not only the norm


@pytest.mark.parametrize("why", ["pass", "hook", "option"])
def test_runs_that_need_fake_tensors_get_them(why: str) -> None:
    model, inputs = MODELS["demo"]
    if why == "pass":  # inplace reads the fake mode (and alias facts by FakeTensor storages)
        gm = fxopt.optimize(model, [*fxopt.DEFAULT_PIPELINE, "inplace"], example_inputs=inputs)
    elif why == "hook":
        gm = fxopt.optimize(model, example_inputs=inputs, hooks=[fxopt.Instrumentation()])
    else:
        gm = fxopt.optimize(model, example_inputs=inputs, shape_rules=False)
    assert _all_fake(gm)
    assert META_VALUES_DEVICE not in gm.meta


def test_a_later_run_without_inputs_makes_fake_tensors_on_the_device_the_meta_values_stand_for() -> None:
    model, inputs = MODELS["torchvision_block"]
    ruled = fxopt.optimize(model, example_inputs=inputs)
    again = fxopt.optimize(ruled, ["inplace"])  # no example inputs: the placeholders' values
    x = next(n for n in again.graph.nodes if n.op == "placeholder").meta["val"]
    assert isinstance(x, FakeTensor) and x.device == torch.device("cpu")
    assert tuple(x.shape) == tuple(inputs[0].shape) and x.stride() == inputs[0].stride()
    with torch.no_grad():
        torch.testing.assert_close(again(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    # and a later run of rules-only passes keeps meta values, from the placeholders alone
    cheap_again = fxopt.optimize(ruled, ["cse", "dce"])
    assert cheap_again.meta[META_VALUES_DEVICE] == torch.device("cpu")


def test_bad_example_inputs_are_still_rejected_by_name() -> None:
    model, inputs = MODELS["demo"]
    wrong = (torch.randn(2, 4, 32, 32),)  # 4 channels where the stem takes 3
    with pytest.raises(fxopt.InputError, match="do not fit"):
        fxopt.optimize(model, example_inputs=wrong)


def test_inputs_sharing_a_storage_are_not_given_separate_meta_values() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(a) + b

    base = torch.randn(4, 4)
    gm = fxopt.optimize(Two(), example_inputs=(base, base.view(4, 4)))
    assert _all_fake(gm)  # FakeTensors show the sharing


def test_value_device_is_the_real_device_a_meta_value_stands_for():
    from fxopt.analysis.shapes import META_VALUES_DEVICE, value_device

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 3))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["val"] = torch.empty(2, 3, device="meta")
    assert value_device(node) == torch.device("meta")  # no record of a real device: the value's own
    gm.meta[META_VALUES_DEVICE] = torch.device("cuda", 1)
    assert value_device(node) == torch.device("cuda", 1)
    node.meta["val"] = torch.empty(2, 3)  # a real (or fake) value answers for itself
    assert value_device(node) == torch.device("cpu")


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _layouts(gm: fx.GraphModule) -> list[Any]:
    return [(n.name, tuple(v.shape), v.stride(), v.dtype) if isinstance(v := n.meta.get("val"), torch.Tensor)
            else (n.name, v) for n in gm.graph.nodes]


def test_a_repropagation_evaluates_only_what_a_change_reaches() -> None:
    """Nodes upstream of a rewritten one keep their very values; the rewritten one and
    everything downstream get new ones, equal to a full propagation's; a module swapped
    under the same name is seen."""
    from fxopt.analysis.shapes import propagate_meta_values

    gm = fx.symbolic_trace(_Chain().eval())
    x = torch.randn(3, 6)
    first = propagate_meta_values(gm, (x,))
    assert first is not None
    nodes = list(gm.graph.nodes)
    middle = next(n for n in nodes if n.op == "call_module" and n.target == "layers.4")
    with gm.graph.inserting_after(middle):
        widened = gm.graph.call_function(torch.cat, ((middle, middle), 1))  # (3, 6) -> (3, 12)
    middle.replace_all_uses_with(widened, delete_user_cb=lambda user: user is not widened)
    setattr(gm.get_submodule("layers"), "5", nn.Linear(12, 6))  # the next layer takes the wider input
    old = {n: n.meta["val"] for n in nodes}
    second = propagate_meta_values(gm, (x,), first)
    assert second is not None
    position = nodes.index(middle)
    assert all(n.meta["val"] is old[n] for n in nodes[:position + 1])
    assert all(n.meta["val"] is not old[n] for n in nodes[position + 1:])
    fresh = fx.GraphModule(gm, gm.graph)  # the same graph, propagated from nothing
    for n in fresh.graph.nodes:
        n.meta.pop("val", None)
    assert propagate_meta_values(fresh, (x,)) is not None
    assert _layouts(gm) == _layouts(fresh)
    assert tuple(widened.meta["val"].shape) == (3, 12)
    gm.recompile()
    assert gm(x).shape == nodes[-1].meta["val"].shape
