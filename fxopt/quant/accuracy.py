"""Accuracy of a quantized graph against its float original, per layer and end to end.

Per layer, each quantized matmul is measured *in isolation*: the quantized graph runs
with every original (non-quantized) node's value forced to the float graph's value, so a
layer's error is its own and not the sum of every layer before it. End to end, both
graphs simply run on the same inputs.

Metrics: SQNR in dB (``10 log10(|ref|^2 / |ref - out|^2)``; 40 dB means the error's
energy is 1/10000 of the signal's), cosine similarity, max absolute error, and for the
end-to-end output the top-1 agreement of the last dimension's argmax (logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate
from torch.utils._pytree import tree_leaves, tree_map

from fxopt.optimize import as_graph_module
from fxopt.quant.passes import SITE_KEY


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical)."""
    ref, out = ref.detach().to(torch.float64), out.detach().to(torch.float64)
    noise = (ref - out).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().to(torch.float64).flatten(), out.detach().to(torch.float64).flatten()
    return torch.nn.functional.cosine_similarity(ref, out, dim=0, eps=1e-30).item()


def max_abs(ref: torch.Tensor, out: torch.Tensor) -> float:
    return (ref.detach().to(torch.float64) - out.detach().to(torch.float64)).abs().max().item()


@dataclass
class Row:
    name: str
    sqnr: float
    cosine: float
    max_abs: float
    top1: float | None = None


@dataclass
class AccuracyReport:
    """``layers``: one row per quantized matmul (isolated); ``end_to_end``: the output."""

    layers: list[Row] = field(default_factory=list)
    end_to_end: Row | None = None

    @property
    def min_layer_sqnr(self) -> float:
        return min((r.sqnr for r in self.layers), default=math.inf)

    def __str__(self) -> str:
        rows = [(r.name, r.sqnr, r.cosine, r.max_abs, "" if r.top1 is None else r.top1)
                for r in [*self.layers, *([self.end_to_end] if self.end_to_end else [])]]
        return tabulate(rows, headers=["layer", "SQNR dB", "cosine", "max abs", "top-1"],
                        floatfmt=("", ".1f", ".6f", ".3g", ".4f"))


def _row(name: str, ref: Any, out: Any, top1: bool = False) -> Row:
    refs = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    r = torch.cat([t.detach().flatten().to(torch.float64) for t in refs])
    o = torch.cat([t.detach().flatten().to(torch.float64) for t in outs])
    agree = None
    if top1 and refs and refs[0].dim() >= 1 and refs[0].shape[-1] > 1:
        agree = (refs[0].argmax(-1) == outs[0].argmax(-1)).to(torch.float64).mean().item()
    return Row(name, sqnr(r, o), cosine(r, o), max_abs(r, o), agree)


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value by name.

    Values are kept as copies taken when the node ran: a later in-place op (``relu_``
    after a linear) would otherwise overwrite the recorded output, and a forced value
    handed to the other graph would be written by that graph's in-place ops.
    """

    def __init__(self, gm: fx.GraphModule, forced: dict[str, Any] | None = None):
        super().__init__(gm)
        self.forced = forced or {}
        self.values: dict[str, Any] = {}

    def run_node(self, node: fx.Node) -> Any:
        if node.op == "get_attr":  # weights: not compared, and too large to copy
            value = self.values[node.name] = super().run_node(node)
            return value
        if node.name in self.forced and node.op not in ("placeholder", "output"):
            value = tree_map(_copy, self.forced[node.name])
        else:
            value = super().run_node(node)
        self.values[node.name] = tree_map(_copy, value)
        return value


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def accuracy_report(float_model: torch.nn.Module, quant_gm: fx.GraphModule, inputs: tuple) -> AccuracyReport:
    """Compare ``quant_gm`` (from the ``quantize`` pass) with the float model it came from.

    ``float_model`` is the float GraphModule (or a module traced the same way) whose node
    names ``quant_gm`` kept; ``inputs`` is a tuple of positional inputs.
    """
    float_gm = as_graph_module(float_model)
    sites = {n.meta[SITE_KEY]: n.name for n in quant_gm.graph.nodes if SITE_KEY in n.meta}
    with torch.no_grad():
        ref = _Recorder(float_gm)
        expected = ref.run(*inputs)
        kept = {n.name for n in float_gm.graph.nodes} - set(sites)
        forced = _Recorder(quant_gm, {k: v for k, v in ref.values.items() if k in kept})
        forced.run(*inputs)
        actual = quant_gm(*inputs)
    report = AccuracyReport()
    for site, out_name in sites.items():
        report.layers.append(_row(site, ref.values[site], forced.values[out_name]))
    report.end_to_end = _row("end to end", expected, actual, top1=True)
    return report
