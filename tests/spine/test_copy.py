"""Optimized models deep-copy, re-optimize, pickle and ``torch.save`` like any GraphModule:
the report's before-snapshots are plain data once copied."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import fxopt


class Deep(nn.Module):
    """A deep chain (400+ nodes): the depth that made copying recurse through old nodes."""

    def __init__(self, depth: int = 80):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x))) + 0.5 * x
        return x


class Block(nn.Module):
    """Swin-like nesting: norm, attention over windows, MLP, residuals, several levels."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        windows = x.reshape(b * 2, n // 2, c)
        h = self.norm1(windows)
        h = self.attn(h, h, h, need_weights=False)[0]
        x = x + h.reshape(b, n, c)
        return x + self.mlp(self.norm2(x))


class Nested(nn.Module):
    def __init__(self, dim: int = 16, stages: int = 3, depth: int = 3):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(*(Block(dim) for _ in range(depth))) for _ in range(stages))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean(1))


CASES = {
    "deep": (lambda: Deep(), lambda: (torch.randn(2, 16),)),
    "nested": (lambda: Nested(), lambda: (torch.randn(2, 8, 16),)),
}


@pytest.fixture(params=sorted(CASES))
def optimized(request):
    make_model, make_inputs = CASES[request.param]
    torch.manual_seed(0)
    model = make_model().eval()
    inputs = make_inputs()
    gm = fxopt.optimize(model, example_inputs=inputs)
    assert len(gm.graph.nodes) > 150
    assert any(r.before is not None for _, r in fxopt.report_of(gm).walk())  # snapshots are kept
    return model, gm, make_inputs()


def test_deepcopy_then_optimize_again_computes_the_same(optimized):
    model, gm, inputs = optimized
    twin = copy.deepcopy(gm)
    assert twin.graph is not gm.graph
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.parameters(), gm.parameters()))
    again = fxopt.optimize(twin, ["cse", "dce", "constant_fold"], example_inputs=inputs, verify=True)
    expected = model(*inputs)
    torch.testing.assert_close(twin(*inputs), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again(*inputs), expected, rtol=1e-5, atol=1e-5)
    # the copied report still renders its before-graphs (over the run's input: the result
    # no longer holds what the passes removed, such as the dropout module)
    for _, record in fxopt.report_of(twin).walk():
        if record.before is not None:
            rebuilt = record.before.to_graph_module(model)
            rebuilt.graph.lint()


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_pickle_and_torch_save_round_trip(optimized, save):
    model, gm, inputs = optimized
    if save == "pickle":
        loaded = pickle.loads(pickle.dumps(gm))
    else:
        buffer = io.BytesIO()
        torch.save(gm, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    # torch rebuilds a GraphModule from its code and drops gm.meta; the report itself pickles
    report = pickle.loads(pickle.dumps(fxopt.report_of(gm), protocol=2))
    assert [r.name for r in report.records] == [r.name for r in fxopt.report_of(gm).records]
    befores = [r.before for _, r in report.walk() if r.before is not None]
    assert befores
    for before in befores:
        before.build().lint()
