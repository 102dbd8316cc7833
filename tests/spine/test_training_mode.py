"""Which graphs count as training graphs: ``torch.no_grad()`` regions in an eval-mode
export (``wrap_with_set_grad_enabled``) say nothing about the mode; training-mode ops do."""

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.context import infer_training


class Rotary(nn.Module):
    """Llama's rotary embedding: the cos/sin tables are computed under no_grad."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x):
        with torch.no_grad():
            t = torch.arange(x.shape[1], dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class TinyLlamaBlock(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.rotary = Rotary(dim)
        self.q, self.k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(0.2)
        self.up, self.out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        cos, sin = self.rotary(x)
        q = self.q(x) * cos + self.k(x) * sin
        h = self.norm(q.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.relu(self.up(self.drop(h))))


def _export(training: bool):
    torch.manual_seed(0)
    model = TinyLlamaBlock().train(training)
    x = torch.randn(2, 6, 16)
    gm = torch.export.export(model, (x,)).module()
    assert any("wrap_with_set_grad_enabled" in str(n.target) for n in gm.graph.nodes)
    return model, gm, x


def test_an_eval_mode_export_with_no_grad_regions_is_an_inference_graph():
    model, gm, x = _export(training=False)
    assert infer_training(gm) is False
    optimized = fxopt.optimize(gm, ["fuse_linear_relu", "constant_fold", "cse", "dce"], example_inputs=(x,))
    report = fxopt.report_of(optimized)
    assert not [r.name for r in report.records if r.skipped]
    assert report.find("fuse_linear_relu")[0].changed
    torch.testing.assert_close(optimized(x), model(x), rtol=1e-5, atol=1e-5)


def test_quantizing_an_eval_mode_export_with_no_grad_regions_works():
    model, gm, x = _export(training=False)
    quantized = fxopt.quant.quantize_model(gm, (x,), mode="int8_weight_only")
    assert fxopt.quant.summary_of(quantized)
    out = quantized(x)
    assert fxopt.quant.sqnr(model(x), out) > 20


def test_a_training_mode_export_stays_a_training_graph():
    model, gm, x = _export(training=True)
    assert infer_training(gm) is True
    report = fxopt.report_of(fxopt.optimize(gm, ["fuse_linear_relu", "dce"], example_inputs=(x,)))
    assert report.find("fuse_linear_relu")[0].skipped


@pytest.mark.parametrize("training", [False, True])
def test_symbolic_trace_follows_the_modules_flag(training):
    model = TinyLlamaBlock().train(training)
    assert infer_training(torch.fx.symbolic_trace(model)) is training
