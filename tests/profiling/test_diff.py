"""Before/after: the change is credited to the passes and the nodes they rewrote."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.profiling import profile
from fxopt.profiling.diff import UNCHANGED


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x)))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = Block(), Block()

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum()


def test_optimize_profile_credits_passes_by_provenance():
    model, x = Net().eval(), torch.randn(2, 8, 16, 16)
    gm = fxopt.optimize(model, example_inputs=(x,), profile=fxopt.profile)
    diff = fxopt.report_of(gm).profile
    assert diff is not None
    original = {n.name for n in fx.symbolic_trace(model).graph.nodes}
    assert {n.name for n in diff.before.nodes} == original
    assert {n.name for n in diff.after.nodes} == {n.name for n in gm.graph.nodes}
    by_label = {c.passes: c for c in diff.changes}
    # every node on each side is in exactly one group
    assert sorted(n for c in diff.changes for n in c.nodes_before) == sorted(original)
    assert sorted(n for c in diff.changes for n in c.nodes_after) == sorted(n.name for n in gm.graph.nodes)
    # the fused conv-bn-relu nodes stand for the conv, bn and relu of both layers
    fused = next(c for label, c in by_label.items() if "fuse_conv_bn_relu" in label)
    for layer in ("layer1", "layer2"):
        assert {f"{layer}_conv", f"{layer}_bn", "relu" if layer == "layer1" else "relu_1"} <= set(fused.nodes_before)
    assert set(fused.modules) == {"layer1", "layer2"}
    assert len(fused.nodes_after) < len(fused.nodes_before)
    dropout = next(c for label, c in by_label.items() if "remove_dropout" in label)
    assert {"layer1_drop", "layer2_drop"} <= set(dropout.nodes_before)
    assert UNCHANGED in by_label and "x" in by_label[UNCHANGED].nodes_before
    text = str(diff)
    assert "fuse_conv_bn_relu" in text and "nodes ->" in text


def test_diff_without_a_report_uses_provenance_alone():
    model, x = Net().eval(), torch.randn(2, 8, 16, 16)
    before = profile(model, (x,), warmup=0, repeat=1)
    gm = fxopt.optimize(model, passes=["fuse_conv_bn_relu"], example_inputs=(x,))
    diff = before.diff(profile(gm, (x,), warmup=0, repeat=1))
    # the pass folds the weights with constant_fold's helper, which names itself as creator
    fused = next(c for c in diff.changes if c.passes == "constant_fold + fuse_conv_bn_relu")
    assert {"layer1_conv", "layer1_bn", "relu"} <= set(fused.nodes_before)
    assert diff.rows()[0].keys() >= {"passes", "nodes_before", "nodes_after", "delta_ms"}


def test_optimize_profile_needs_inputs_and_leaves_the_report_alone_otherwise():
    model = Net().eval()
    with pytest.raises(fxopt.InputError, match="profile needs example_inputs"):
        fxopt.optimize(model, profile=fxopt.profile)
    with pytest.raises(fxopt.InputError, match="profile=fxopt.profile.*not True"):
        fxopt.optimize(model, example_inputs=(torch.randn(1, 8, 4, 4),), profile=True)
    for off in ({}, {"profile": None}, {"profile": False}):  # False, like None, is no profiling
        gm = fxopt.optimize(model, example_inputs=(torch.randn(1, 8, 4, 4),), **off)
        assert fxopt.report_of(gm).profile is None and fxopt.report_of(gm).records, off
    assert fxopt.report_of(fxopt.optimize(model, profile=False)).profile is None  # needs no inputs
