"""``memory_budget``: recompute saved activations in the backward until a training graph fits.

Why. A training step's memory peak is the activations the forward saves for the backward,
all live at the turn from forward to backward. AOTAutograd's min-cut partitioner already
recomputes what is cheap to recompute (pointwise and norm-apply chains, which Inductor fuses
into the backward's kernels), so what it saves are mostly outputs of convolutions and matrix
products, which it never recomputes. Cutting the peak further means recomputing some of
those, and which ones decides the price: a 1x1 convolution that widens 64 channels to 256
writes 4 bytes per 64 multiply-adds, a 3x3 one of 512 channels 1 byte per 4,608.

What the budget means. ``memory_budget=b`` asks that the activations the backward takes from
the forward (the tensors autograd saves: what ``saved_tensors_hooks`` sees, parameters and
the batch left out) be at most ``b`` times those of the stock min-cut partition (torch's
``activation_memory_budget`` budgets the same bytes, though its solver maps a budget to them
differently). It is measurable without this module (tests/memory/test_budget_training.py sums the
bytes the pack hook sees).

How. :class:`BudgetPartitioner` is an Inductor custom partitioner (``custom_partitioner_fn``).
It partitions the joint graph with the stock min-cut and predicts the memory of the
forward-then-backward schedule with fxopt's ``alias``/``liveness`` analyses (each storage
live from its definition to its last use; saved activations from the forward's step that
makes them to their last reader in the backward). In rounds, it tags saved activations
``MUST_RECOMPUTE`` (the tag activation checkpointing uses; the min-cut then recomputes them
in the backward, just before their first reader, from what it saves instead) and partitions
again, taking candidates from the partition of the round before (the min-cut may save other
tensors in their place). The order: first what is live at the predicted peak and freed there
(recomputed after the peak's step), then the rest; within each, cheapest estimated
recomputation per byte. The estimate is the chain's time in bytes moved: FLOPs at the
H100's ratio of bf16 matrix rate to memory bandwidth (``FLOPS_PER_BYTE``), or bytes read and
written where that is more, summed over the node and the unsaved values it is recomputed
from; a pointwise or norm-apply chain thus costs its tensors' bytes, a convolution its FLOPs.
A round whose partition saves no fewer bytes, or that the min-cut cannot honour, is undone
and tried again with its cheaper half; a single pick refused so is not tried again.

Only ops the op-facts model calls pure are recomputed: never a random draw (dropout keeps
its mask, so the draws are those of the untouched step), a collective, a write, a stateful or
an unknown op; nor a part of a tuple whose op the min-cut will not recompute (a max-pool's
output: its indices cannot be saved alone, and the min-cut raises). It stops at the budget,
when the recomputation's estimated cost would pass ``max_recompute`` of the joint graph's, or
after ``ROUNDS`` partitions; the decision (saved bytes, predicted peaks, what is recomputed,
why it stopped short) goes to ``reports``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
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
#: partitions tried at most per graph after the stock one (a refused round of several picks
#: is tried again with its cheaper half)
ROUNDS = 8


@dataclass
class BudgetDecision:
    """What the partitioner did with one joint graph (predicted bytes, not measured)."""

    budget: float
    #: predicted activation peak of the forward-then-backward schedule, before and after
    peak_before: int
    peak_after: int
    #: bytes of the activations the backward takes from the forward, before and after
    saved_before: int
    saved_after: int
    #: joint-graph nodes tagged for recomputation, in the order they were chosen
    recomputed: list[str] = field(default_factory=list)
    #: estimated cost of recomputing ``recomputed`` over the joint graph's (see FLOPS_PER_BYTE)
    recompute_share: float = 0.0
    #: why it stopped above the budget, or None when it met it
    short: str | None = None


@dataclass
class _Partition:
    """One partition and what the prediction says about it."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: int
    peak: int
    #: the peak's place: ("fw" or "bw", step)
    at: tuple[str, int]


class BudgetPartitioner(CustomPartitionerFn):
    """Partition joint graphs so that the activations each one saves for its backward are
    at most ``budget`` (a fraction in (0, 1]) of the stock min-cut's, recomputing at most
    ``max_recompute`` of the joint graph's estimated cost. ``reports`` (a list) receives one
    :class:`BudgetDecision` per graph."""

    def __init__(self, budget: float, *, max_recompute: float = 0.3,
                 reports: list[BudgetDecision] | None = None):
        self.budget, self.max_recompute, self.reports = budget, max_recompute, reports

    def uuid(self) -> str:
        digest = hashlib.sha256(Path(__file__).read_bytes())
        digest.update(repr((self.budget, self.max_recompute)).encode())
        return digest.hexdigest()

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any],
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        def partition(tagged: Sequence[str]) -> _Partition:
            return _predict(*_partition(gm, joint_inputs, tagged, kwargs))

        first = current = partition(())
        target = self.budget * first.saved
        total = sum(_cost(n) for n in gm.graph.nodes if n.op == "call_function") or 1.0
        allowance = self.max_recompute * total
        chosen: dict[str, float] = {}   # name -> estimated cost of its recomputation
        refused: set[str] = set()
        pending: list[tuple[list[str], float]] = []
        short = None
        for _ in range(ROUNDS):
            if current.saved <= target:
                break
            groups = pending or _pick(gm, current, chosen, refused, need=current.saved - target,
                                      allowance=allowance - sum(chosen.values()))
            pending = []
            if not groups:
                short = short or (f"no further saved activation can be recomputed within {self.max_recompute:.0%} "
                                  "of the graph's estimated time")
                break
            names = [name for group, _ in groups for name in group]
            try:
                trial = partition([*chosen, *names])
            except (RuntimeError, nx.NetworkXException) as exc:  # the min-cut cannot honour these tags
                # (torch 2.13 raises "failed to partition"; older ones networkx's unbounded flow)
                trial = None
                short = f"the min-cut refused tags ({str(exc).splitlines()[0][:120]})"
            if trial is not None and trial.saved < current.saved:
                chosen.update((name, cost / len(group)) for group, cost in groups for name in group)
                current = trial
            elif len(groups) == 1:  # it saved the inputs instead (nothing freed), or raised
                refused.update(names)
            else:  # try the cheaper half on its own
                pending = groups[: len(groups) // 2]
        else:
            short = short or f"still above the budget after {ROUNDS} partitions"
        if self.reports is not None:
            self.reports.append(BudgetDecision(
                self.budget, first.peak, current.peak, first.saved, current.saved, list(chosen),
                sum(chosen.values()) / total, short if current.saved > target else None))
        return current.fw, current.bw


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


def _predict(fw: fx.GraphModule, bw: fx.GraphModule) -> _Partition:
    fw_live = _timeline(fw, inputs_live=False)
    bw_live = _timeline(bw, inputs_live=True)
    peak = max([0, *fw_live, *bw_live])
    at = ("bw", bw_live.index(peak)) if peak in bw_live else ("fw", fw_live.index(peak) if peak in fw_live else 0)
    return _Partition(fw, bw, sum(size for size, _ in _saved_storages(fw, bw).values()), peak, at)


def _pick(gm: fx.GraphModule, current: _Partition, chosen: dict[str, float], refused: set[str], *,
          need: float, allowance: float) -> list[tuple[list[str], float]]:
    """This round's picks as (saved values, estimated cost of recomputing them). The unit is
    a saved storage: the saved values that share it (views of one tensor: q, k and v of one
    projection) free it only together. Storages freed at the predicted peak first, then the
    others, cheapest per byte first, until ``need`` bytes or the ``allowance`` of cost is
    spent. No pick is recomputed from another of the round: the min-cut may answer such a
    chain by saving something else, and one round's measurement could not tell which pick
    paid (a later round may take it, reading the first one recomputed)."""
    groups = _saved_storages(current.fw, current.bw)
    saved = {name for _, names in groups.values() for name in names}
    by_name = {n.name: n for n in gm.graph.nodes}
    at_peak = _freed_at_peak(current)
    available = saved | set(chosen)
    priced = []
    for size, names in groups.values():
        nodes = [by_name.get(name) for name in names]
        if refused & set(names) or not size or any(
                n is None or n.op != "call_function" or not _recomputable(n) for n in nodes):
            continue
        walk = _recompute_cost(nodes, available - set(names))
        if walk is not None:
            priced.append((not at_peak & set(names), walk[0] / size, sorted(names), size, walk))
    picks: list[tuple[list[str], float]] = []
    taken: set[str] = set()
    read: set[str] = set()
    freed = 0
    for _, _, names, size, (cost, reads) in sorted(priced):
        if freed >= need:
            break
        if cost > allowance or reads & taken or read & set(names):
            continue
        picks.append((names, cost))
        taken.update(names)
        read |= reads
        freed += size
        allowance -= cost
    return picks


def _freed_at_peak(current: _Partition) -> set[str]:
    """Saved activations that would not be live at the predicted peak if recomputed:
    with the peak in the backward, those first read after it (the min-cut recomputes a value
    just before its first reader); with it in the forward, those already dead there but for
    being saved."""
    part, step = current.at
    if part == "bw":
        order = {n: i for i, n in enumerate(current.bw.graph.nodes)}
        return {n.name for n in current.bw.graph.find_nodes(op="placeholder")
                if n.users and min(order[u] for u in n.users) > step}
    order = {n: i for i, n in enumerate(current.fw.graph.nodes)}
    out = set()
    for node in current.fw.graph.nodes:
        if node.op != "call_function" or order[node] > step:
            continue
        readers = [order[u] for u in node.users if u.op != "output"]
        if max(readers, default=order[node]) < step:
            out.add(node.name)
    return out


def _saved_names(bw: fx.GraphModule) -> set[str]:
    """The activations the backward takes from the forward: its placeholders that are
    neither tangents nor graph inputs (``primals``: parameters and the batch, which
    live as long without the backward)."""
    return {n.name for n in bw.graph.find_nodes(op="placeholder")
            if not n.name.startswith(("tangents", "primals"))}


def _nbytes(value: Any) -> int:
    total = 0
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            size = t.untyped_storage().nbytes()
            total += int(size) if not isinstance(size, torch.SymInt) else 0
    return total


def _saved_storages(fw: fx.GraphModule, bw: fx.GraphModule) -> dict[Any, tuple[int, list[str]]]:
    """The storages of the activations the backward takes from the forward, each with its
    bytes and the saved values that share it; storages of graph inputs (a transposed
    weight is a view of the parameter) are no activation and are left out."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storages(node: fx.Node) -> list[tuple[Any, int]]:
        return [(StorageWeakRef(t.untyped_storage()), _nbytes(t)) for t in tree_leaves(node.meta.get("val"))
                if isinstance(t, torch.Tensor)]

    inputs = {ref for n in fw.graph.find_nodes(op="placeholder") for ref, _ in storages(n)}
    names = _saved_names(bw)
    out: dict[Any, tuple[int, list[str]]] = {}
    for node in bw.graph.find_nodes(op="placeholder"):
        if node.name not in names:
            continue
        for ref, size in storages(node):
            if ref not in inputs:
                out.setdefault(ref, (size, []))[1].append(node.name)
    return out


def activation_peak(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Predicted peak bytes of the forward then the backward, graph inputs (parameters,
    the batch) left out: each storage the graphs make is live from its definition to its
    last use; what the forward saves stays live into the backward until its last reader."""
    return _predict(fw, bw).peak


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
                return _nbytes(t)
    return 0


def _recompute_cost(nodes: Sequence[fx.Node], available: set[str],
                    limit: int = 64) -> tuple[float, set[str]] | None:
    """The estimated cost of recomputing ``nodes`` in the backward and the ``available``
    values that reads (None: they cannot be recomputed). Walking up their inputs through
    values the backward does not have (recomputed on the way, once for all of ``nodes``),
    every path must end at a graph input or an ``available`` value: one saved, or one
    tagged for recomputation (recomputed once, whoever reads it first)."""
    seen: set[fx.Node] = set()
    reads: set[str] = set()
    cost = sum(_cost(n) for n in nodes)
    todo = [i for n in nodes for i in n.all_input_nodes if i not in nodes]
    while todo:
        current = todo.pop()
        if current in seen or current.op in ("placeholder", "get_attr"):
            continue
        seen.add(current)
        if current.name in available:
            reads.add(current.name)
            continue
        if len(seen) > limit or not _recomputable(current) or not _min_cut_recomputes(current):
            return None
        cost += _cost(current)
        todo.extend(current.all_input_nodes)
    return cost, reads


def _recomputable(node: fx.Node) -> bool:
    facts = ops.facts(node)
    return not (facts.writes or facts.random or facts.collective or facts.stateful or facts.unknown)


def _min_cut_recomputes(node: fx.Node) -> bool:
    """Whether the min-cut can recompute ``node`` on the way to a tagged one. A tensor it
    will not recompute it saves instead (which frees less than predicted, and the round's
    measurement sees that); a tuple it can neither save nor, outside its list of
    recomputable ops, recompute: tagging a value behind one makes it raise."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return True
    from torch._functorch.partitioners import get_default_op_list

    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet in get_default_op_list().recomputable_ops


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
