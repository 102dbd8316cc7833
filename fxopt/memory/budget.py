"""``memory_budget``: recompute saved activations in the backward until a training graph fits.

Why. A training step's memory peak is the activations the forward saves for the backward,
all live at the turn from forward to backward. AOTAutograd's min-cut partitioner already
recomputes what is cheap to recompute (pointwise and norm-apply chains, which Inductor fuses
into the backward's kernels), so what it saves are mostly outputs of convolutions and matrix
products, which it never recomputes. Cutting the peak further means recomputing some of
those, and which ones decides the price: a 1x1 convolution that widens 64 channels to 256
writes 4 bytes per 64 multiply-adds, a 3x3 one of 512 channels 1 byte per 4,608.

How. :class:`BudgetPartitioner` is an Inductor custom partitioner (``custom_partitioner_fn``).
It partitions the joint graph with the stock min-cut, then predicts the activation peak of the
forward-then-backward schedule with fxopt's ``alias``/``liveness`` analyses (each storage live
from its definition to its last use; saved activations from the forward's step that makes
them to their last reader in the backward). While that peak is above ``budget`` times the
first one, it tags more saved activations ``MUST_RECOMPUTE`` (the tag activation
checkpointing uses; the min-cut then recomputes them in the backward from what it saves
instead) and partitions again: cheapest first by estimated time per byte freed (FLOPs at the
H100's ratio of matrix rate to memory bandwidth, bytes moved for the rest). Only ops the
op-facts model calls pure are recomputed: never a random draw (dropout keeps its mask, so the
draws are those of the untouched step), a collective, a write, or an unknown op. It stops
at the budget, when the recomputation's estimated cost would pass ``max_recompute`` of the
graph's, or after a few rounds; the decision (peaks, what is recomputed) goes to ``reports``.

The budget is relative to each graph's own predicted activation peak; parameters, gradients
and optimizer state are not the partitioner's to cut, so the step's measured peak falls by
less than the activations' (bench/training.py measures both).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from fxopt.analysis import ops
from fxopt.analysis.shapes import VALUES_CURRENT
from fxopt.context import PassContext

try:  # torch >= 2.8
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
except ImportError:  # pragma: no cover - no custom partitioners: the option is refused at parse time
    CustomPartitionerFn = object  # type: ignore[assignment,misc]

__all__ = ["BudgetDecision", "BudgetPartitioner", "activation_peak"]

#: FLOPs that take as long as moving one byte (H100: ~800 TFLOP/s bf16 over ~3 TB/s)
FLOPS_PER_BYTE = 250.0
#: partitions tried at most per graph (each round tags a larger prefix of the candidates)
ROUNDS = 4


@dataclass
class BudgetDecision:
    """What the partitioner did with one joint graph (predicted bytes, not measured)."""

    budget: float
    peak_before: int
    peak_after: int
    saved_before: int
    saved_after: int
    #: joint-graph nodes tagged for recomputation, cheapest first
    recomputed: list[str] = field(default_factory=list)
    #: estimated cost of the recomputation over the joint graph's (see FLOPS_PER_BYTE)
    recompute_share: float = 0.0
    #: why it stopped above the budget, or None when it met it
    short: str | None = None


class BudgetPartitioner(CustomPartitionerFn):
    """Partition joint graphs so that each one's activation peak is at most ``budget``
    (a fraction in (0, 1]) of the stock min-cut's, recomputing at most ``max_recompute`` of
    the graph's estimated cost. ``reports`` (a list) receives one :class:`BudgetDecision`
    per graph."""

    def __init__(self, budget: float, *, max_recompute: float = 0.05,
                 reports: list[BudgetDecision] | None = None):
        self.budget, self.max_recompute, self.reports = budget, max_recompute, reports

    def uuid(self) -> str:
        digest = hashlib.sha256(Path(__file__).read_bytes())
        digest.update(repr((self.budget, self.max_recompute)).encode())
        return digest.hexdigest()

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any],
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        def partition(tagged: Sequence[str]) -> tuple[fx.GraphModule, fx.GraphModule]:
            return _partition(gm, joint_inputs, tagged, kwargs)

        fw, bw = partition(())
        peak = peak_before = activation_peak(fw, bw)
        saved_before = _saved_bytes(bw)
        target = self.budget * peak_before
        saved = _saved_names(bw)
        candidates = _candidates(gm, saved)
        total = sum(_cost(n) for n in gm.graph.nodes if n.op == "call_function") or 1.0
        chosen: list[str] = []
        spent = 0.0
        short = None
        best, best_chosen = (fw, bw), []
        for _ in range(ROUNDS):
            if peak <= target:
                break
            need, added = peak - target, 0
            priced = [(node, freed, _recompute_cost(node, saved, set(chosen))) for node, freed in candidates]
            priced = sorted((c for c in priced if c[2] is not None), key=lambda c: c[2] / c[1])
            for node, freed, cost in priced:
                if added >= need:
                    break
                if (spent + cost) / total > self.max_recompute or _recompute_cost(node, saved, set(chosen)) is None:
                    continue
                chosen.append(node.name)
                spent += cost
                added += freed
            candidates = [c for c in candidates if c[0].name not in chosen]
            if not added:
                short = (f"no further saved activation can be recomputed within {self.max_recompute:.0%} "
                         "of the graph's estimated time")
                break
            fw, bw = partition(chosen)
            new_peak = activation_peak(fw, bw)
            if new_peak < peak:
                best, best_chosen, peak = (fw, bw), list(chosen), new_peak
        else:
            if peak > target:
                short = f"still above the budget after {ROUNDS} rounds"
        if self.reports is not None:
            self.reports.append(BudgetDecision(
                self.budget, peak_before, peak, saved_before, _saved_bytes(best[1]), best_chosen,
                spent / total, short if peak > target else None))
        return best


def _partition(gm: fx.GraphModule, joint_inputs: Sequence[Any], tagged: Sequence[str],
               kwargs: dict[str, Any]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The stock min-cut on a copy of ``gm`` whose ``tagged`` nodes must be recomputed."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    work = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    names = set(tagged)
    for node in work.graph.nodes:
        if node.name in names:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return min_cut_rematerialization_partition(work, joint_inputs, **{"compiler": "inductor", **kwargs})


def _saved_names(bw: fx.GraphModule) -> set[str]:
    """The activations the backward takes from the forward: its placeholders that are
    neither tangents nor graph inputs (``primals``: parameters and the batch, which
    live as long without the backward)."""
    return {n.name for n in bw.graph.find_nodes(op="placeholder")
            if not n.name.startswith(("tangents", "primals"))}


def _nbytes(value: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _saved_bytes(bw: fx.GraphModule) -> int:
    names = _saved_names(bw)
    return sum(_nbytes(n.meta.get("val")) for n in bw.graph.find_nodes(op="placeholder") if n.name in names)


def activation_peak(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Predicted peak bytes of the forward then the backward, graph inputs (parameters,
    the batch) left out: each storage the graphs make is live from its definition to its
    last use; what the forward saves stays live into the backward until its last reader."""
    fw_live = _timeline(fw, inputs_live=False)
    bw_live = _timeline(bw, inputs_live=True)
    return max([0, *fw_live, *bw_live])


def _timeline(gm: fx.GraphModule, *, inputs_live: bool) -> list[int]:
    """Live bytes at each node of ``gm``: storages from first to last use (what the graph
    returns, to its end). With ``inputs_live``, the graph's inputs count too, until their
    last use (the backward's saved activations, freed as it goes)."""
    gm.meta[VALUES_CURRENT] = True
    ctx = PassContext(gm)
    alias, live = ctx.analysis("alias"), ctx.analysis("liveness")
    steps = len(gm.graph.nodes)
    delta = [0] * (steps + 1)
    primals = set().union(set(), *(alias.storages.get(n, set()) for n in gm.graph.find_nodes(op="placeholder")
                                  if n.name.startswith("primals")))
    for storage, nodes in alias.nodes_of.items():
        if storage in alias.constants or storage in primals or (storage in alias.inputs and not inputs_live):
            continue
        intervals = [live.nodes[n] for n in nodes if n in live.nodes]
        if not intervals:
            continue
        start, end = min(i.start for i in intervals), max(i.end for i in intervals)
        size = _storage_size(nodes, storage)
        delta[start] += size
        delta[end + 1] -= size
    out, running = [], 0
    for d in delta[:steps]:
        running += d
        out.append(running)
    return out


def _storage_size(nodes: Sequence[fx.Node], storage: Any) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    for node in nodes:
        for t in tree_leaves(node.meta.get("val")):
            if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) == storage:
                size = t.untyped_storage().nbytes()
                return int(size) if not isinstance(size, torch.SymInt) else 0
    return 0


def _candidates(gm: fx.GraphModule, saved: set[str]) -> list[tuple[fx.Node, int]]:
    """Saved activations that could be recomputed instead, as (joint node, bytes freed),
    largest first; tensors under a thousandth of the saved bytes are not worth a round."""
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[name] for name in saved if name in by_name]
    floor = sum(_nbytes(n.meta.get("val")) for n in nodes) / 1000
    out = [(n, _nbytes(n.meta.get("val"))) for n in nodes if n.op == "call_function" and _recomputable(n)]
    return sorted((c for c in out if c[1] >= floor), key=lambda c: -c[1])


def _recompute_cost(node: fx.Node, saved: set[str], chosen: set[str], limit: int = 64) -> float | None:
    """The estimated cost of recomputing ``node`` from what stays saved (None: it cannot
    be): walking up its inputs through values the forward does not save (recomputed on the
    way), every path must end at a graph input or a saved value, never at one already
    chosen for recomputation (that one's own inputs would then have to be saved instead,
    and nothing would be freed)."""
    seen: set[fx.Node] = set()
    cost = _cost(node)
    todo = list(node.all_input_nodes)
    while todo:
        current = todo.pop()
        if current in seen or current.op in ("placeholder", "get_attr"):
            continue
        seen.add(current)
        if current.name in chosen:
            return None
        if current.name in saved:
            continue
        if len(seen) > limit or not _recomputable(current):
            return None
        cost += _cost(current)
        todo.extend(current.all_input_nodes)
    return cost


def _recomputable(node: fx.Node) -> bool:
    facts = ops.facts(node)
    return not (facts.writes or facts.random or facts.collective or facts.stateful or facts.unknown)


def _cost(node: fx.Node) -> float:
    """Estimated time of ``node`` in bytes moved: its FLOPs at FLOPS_PER_BYTE, or the bytes
    it reads and writes, whichever is larger."""
    moved = _nbytes(node.meta.get("val")) + sum(_nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    return max(_flops(node) / FLOPS_PER_BYTE, float(moved))


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    target = getattr(node.target, "overloadpacket", None)
    formula: Callable[..., int] | None = flop_registry.get(target)
    if formula is None:
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments: count none
        return 0.0
