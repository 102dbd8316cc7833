"""Passes that fold or fuse weights leave no dead get_attr nodes and no orphaned
parameters behind (``fxopt.graph_utils.drop_unused_attributes``), and never take
anything from the user's model or from an attribute something still reads."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.graph_utils import drop_unused_attributes
from fxopt.models import randomize_norms


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(y))


def dead_get_attrs(gm: fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and not n.users]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_fold_conv_bn_leaves_no_dead_get_attr_and_drops_the_bn_parameters() -> None:
    model = randomize_norms(ConvBN()).eval()
    kept = snapshot(model)
    gm = fxopt.optimize(model, passes=["fold_conv_bn"], example_inputs=(torch.randn(2, 3, 10, 10),))
    assert dead_get_attrs(gm) == []
    names = set(gm.state_dict())
    assert not any(k.startswith(("bn1.", "bn2.", "conv1.", "conv2.")) for k in names), names
    assert not hasattr(gm, "bn1") and not hasattr(gm, "conv2")
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert names == read  # exactly the folded weights and biases the graph reads
    assert_untouched(model, kept)
    assert isinstance(model.bn1, nn.BatchNorm2d) and model.bn1.weight is not None
    for seed in range(3):
        x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(100 + seed))
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


class ReadsBnWeightToo(ConvBN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # read straight by ops on x: nothing to fold, so both stay read
        return super().forward(x).mean((2, 3)) * self.bn2.weight + self.conv1.bias


def test_an_attribute_still_read_elsewhere_is_kept() -> None:
    model = randomize_norms(ReadsBnWeightToo()).eval()
    kept = snapshot(model)
    gm = fxopt.optimize(model, passes=["fold_conv_bn"], example_inputs=(torch.randn(2, 3, 10, 10),))
    assert dead_get_attrs(gm) == []
    names = set(gm.state_dict())
    assert {"bn2.weight", "conv1.bias"} <= names
    assert not {"bn2.bias", "bn2.running_mean", "bn1.weight", "conv1.weight"} & names
    assert gm.bn2.weight is model.bn2.weight  # shared with the user's model, not copied
    assert_untouched(model, kept)
    x = torch.randn(3, 3, 10, 10)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_exported_graph_drops_its_lifted_parameters() -> None:
    model = randomize_norms(ConvBN()).eval()
    x = torch.randn(2, 3, 10, 10)
    exported = torch.export.export(model, (x,)).module()
    kept = snapshot(exported)
    gm = fxopt.optimize(exported, passes=["fold_conv_bn", "cse"], example_inputs=(x,))
    assert dead_get_attrs(gm) == []
    assert not any("bn" in k for k in gm.state_dict())
    assert_untouched(exported, kept)
    assert any("bn" in k for k in exported.state_dict())
    y = torch.randn(2, 3, 10, 10)  # export specialized the batch size
    torch.testing.assert_close(gm(y), model(y), rtol=1e-5, atol=1e-5)


def test_constant_fold_drops_the_tensors_it_folded_away() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.s = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (self.w * self.s)

    model = Scaled()
    gm = fxopt.optimize(model, passes=["constant_fold"])
    assert dead_get_attrs(gm) == [] and not hasattr(gm, "w") and not hasattr(gm, "s")
    assert fxopt.report_of(gm).records[0].stats["dropped"] == 2
    assert isinstance(model.w, nn.Parameter)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_a_module_reachable_under_two_names_keeps_what_either_name_reads() -> None:
    shared = nn.Module()
    for name in ("a", "b", "c"):
        shared.register_buffer(name, torch.randn(3))
    root = nn.Module()
    root.first, root.second = shared, shared
    root.unused = nn.Linear(2, 2)
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.get_attr("first.a")
    b = graph.get_attr("second.b")
    graph.get_attr("first.c")  # read by nothing
    graph.output(graph.call_function(torch.add, (graph.call_function(torch.add, (x, a)), b)))
    gm = fx.GraphModule(root, graph)
    gm.unused = nn.Linear(2, 2)  # fx.GraphModule copies only what the graph names
    assert sorted(drop_unused_attributes(gm)) == ["first.c", "unused"]
    assert dead_get_attrs(gm) == []
    gm.recompile()
    assert hasattr(gm.second, "b") and hasattr(gm.first, "a") and not hasattr(gm.second, "c")
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x + shared.a + shared.b)


def test_a_called_submodule_keeps_every_parameter() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = fx.symbolic_trace(model)
    assert drop_unused_attributes(gm) == []
    assert set(gm.state_dict()) == {"0.weight", "0.bias"}
