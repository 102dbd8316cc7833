"""The ``plan_memory`` pass: one arena, an offset for every intermediate storage.

Buffers are *storages*, not nodes (R15): views and in-place results share their base's
storage and so its buffer, whose lifetime runs from the storage's first definition to
the last use of any alias (the ``liveness`` analysis). Storages of inputs, parameters
and constants are not the graph's to place; neither are storages the graph returns (the
caller keeps them) nor ones whose size is symbolic (dynamic shapes): each is listed in
``MemoryPlan.unplanned`` with the reason.

*Concat-aware placement* lowers the bound itself: a ``cat`` input whose storage can be
the very slice of the ``cat`` output it is copied to is placed there, so the producer
writes straight into the output and the copy disappears. A merge is kept only if the
lower bound does not go up, and only where no in-place write could make the two views
of that memory disagree.

The plan (a :class:`MemoryPlan`) is in the pass's stats under ``"plan"`` and at
``gm.meta["fxopt.memory_plan"]``; :mod:`fxopt.memory.executor` runs a graph in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxopt.analysis.alias import AliasInfo
from fxopt.analysis.liveness import Liveness
from fxopt.memory.problem import Buffer, arena_size, lower_bound, verify_placement
from fxopt.memory.solver import solve
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.registry import register_pass

PLAN_KEY = "fxopt.memory_plan"


@dataclass
class Slot:
    """Where one planned storage lives: ``offset`` bytes into the arena, ``size`` bytes.

    ``owner`` is true for the node that creates the storage; the others are its views
    and the in-place ops that write it.
    """

    offset: int
    size: int
    owner: bool = True
    #: the storage lives inside a ``cat`` output's buffer (concat-aware placement)
    hosted: bool = False
    #: index into ``MemoryPlan.buffers`` of the buffer holding this storage
    buffer: int = -1


@dataclass
class MemoryPlan:
    """A placement of a graph's intermediate storages in one arena.

    ``buffers`` is the timeline (name, start, end, offset, size per buffer; times are
    node indices in graph order); ``slots`` maps each planned node to the bytes of its
    storage. ``naive_bytes`` is what one allocation per buffer would need.
    """

    buffers: list[Buffer]
    arena_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    #: the lower bound before concat-aware placement (equal when nothing was merged)
    lower_bound_before_concat: int
    slots: dict[str, Slot] = field(default_factory=dict)
    #: node name -> why its storage is not in the arena
    unplanned: dict[str, str] = field(default_factory=dict)
    #: the storages the graph returns, never placed (the caller keeps them): their sizes and
    #: lifetimes, which a run holds on top of whatever else is live then
    outputs: list[Buffer] = field(default_factory=list)
    #: cat node -> its inputs that are written straight into their slice of its output
    concat_merged: dict[str, list[str]] = field(default_factory=dict)
    #: cat nodes whose output is a view of a larger buffer: no memory, no copy
    concat_elided: list[str] = field(default_factory=list)
    method: str = "greedy"
    seconds: float = 0.0
    alignment: int = 64

    @property
    def ratio(self) -> float:
        """Arena over lower bound (1.0 is optimal)."""
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def verify(self) -> None:
        """Raise :class:`fxopt.memory.problem.PlacementError` if two live buffers overlap."""
        verify_placement(self.buffers, self.arena_bytes)

    def summary(self) -> str:
        return (f"arena {self.arena_bytes / 2**20:.2f} MiB, lower bound "
                f"{self.lower_bound_bytes / 2**20:.2f} MiB (ratio {self.ratio:.3f}), naive "
                f"{self.naive_bytes / 2**20:.2f} MiB, {len(self.buffers)} buffers, "
                f"{len(self.unplanned)} unplanned")


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass
class _Group:
    """One storage to place: its nodes, bytes, lifetime and (if merged) parent slice."""

    storage: StorageWeakRef
    nodes: list[fx.Node]
    nbytes: int
    start: int
    end: int
    parent: _Group | None = None
    parent_offset: int = 0


def _storage_groups(gm: fx.GraphModule, alias: AliasInfo, live: Liveness,
                    order: dict[fx.Node, int]) -> tuple[list[_Group], dict[str, str], list[Buffer]]:
    """The storages to place; why each other storage is not placed; and the returned ones as
    unplaced buffers with their lifetimes (a run holds them on top of everything else)."""
    unplanned: dict[str, str] = {}
    outputs: list[Buffer] = []
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {s for n in output.all_input_nodes for s in alias.storages.get(n, ())}
    groups: list[_Group] = []
    for storage, nodes in alias.nodes_of.items():
        if storage in alias.external:
            continue
        nodes = sorted(nodes, key=order.__getitem__)
        owner = nodes[0]
        nbytes = _storage_nbytes(owner, storage)
        if not isinstance(nbytes, int):
            unplanned[owner.name] = f"dynamic shape: its size is {nbytes} bytes, not a number"
            continue
        interval = live.storages[storage]
        if storage in returned:
            unplanned[owner.name] = "returned by the graph: the caller owns it"
            outputs.append(Buffer(owner.name, interval.start, interval.end, nbytes))
            continue
        groups.append(_Group(storage, nodes, nbytes, interval.start, interval.end))
    return groups, unplanned, outputs


def _storage_nbytes(node: fx.Node, storage: StorageWeakRef) -> Any:
    for t in torch.utils._pytree.tree_leaves(node.meta.get("val")):
        if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) == storage:
            nbytes = t.untyped_storage().nbytes()
            if isinstance(nbytes, torch.SymInt):
                # imported here: symbolic_shapes pulls in sympy (~0.7 s); only SymInts need it
                from torch.fx.experimental.symbolic_shapes import is_concrete_int

                # never int() it: that would specialize the graph to today's shape
                return nbytes if not is_concrete_int(nbytes) else int(nbytes)
            return int(nbytes)
    return 0


def _is_cat(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default)


def _cat_slices(cat: fx.Node) -> list[tuple[fx.Node, int]] | None:
    """(input, byte offset in the output) for each input, if every slice is contiguous."""
    out = cat.meta.get("val")
    inputs = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(out, torch.Tensor) or not out.is_contiguous() or not isinstance(inputs, (list, tuple)):
        return None
    dim = dim % out.dim()
    if any(int(s) != 1 for s in out.shape[:dim]):
        return None  # a slice along dim is strided unless the dims before it are 1
    row = out.element_size()
    for s in out.shape[dim + 1:]:
        row *= int(s)
    slices, offset = [], 0
    for x in inputs:
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        slices.append((x, offset))
        offset += int(val.shape[dim]) * row
    return slices


def _root(g: _Group) -> tuple[_Group, int]:
    """The top-level group holding ``g`` and ``g``'s byte offset inside it."""
    offset = 0
    while g.parent is not None:
        offset += g.parent_offset
        g = g.parent
    return g, offset


def _writes_before(storage: StorageWeakRef, node: fx.Node | None, alias: AliasInfo,
                   order: dict[fx.Node, int]) -> bool:
    """Whether every in-place write into ``storage`` comes before ``node`` (None: no writes)."""
    limit = -1 if node is None else order[node]
    return all(order[w] < limit for w, written in alias.writes.items() if storage in written)


def _fits(x: fx.Node, cat: fx.Node) -> bool:
    """Whether ``x``'s whole storage is exactly its (contiguous) value, in ``cat``'s dtype."""
    val, out = x.meta.get("val"), cat.meta.get("val")
    return (val.dtype == out.dtype and val.is_contiguous() and val.storage_offset() == 0
            and val.untyped_storage().nbytes() == val.numel() * val.element_size())


class _Merger:
    """Concat-aware placement, decided cat by cat from the last one backwards.

    Going backwards lets the largest ``cat`` (a dense block's final one) host its inputs
    first; an earlier ``cat`` whose inputs then all sit side by side in that buffer is
    itself just a view of it (*elided*: it needs no memory and no copy).
    """

    def __init__(self, groups: list[_Group], alias: AliasInfo, order: dict[fx.Node, int]):
        self.groups, self.alias, self.order = groups, alias, order
        self.by_storage = {g.storage: g for g in groups}
        self.hosted: dict[str, list[str]] = {}
        self.elided: list[str] = []

    def group_of(self, node: fx.Node) -> _Group | None:
        storages = self.alias.storages.get(node, ())
        return self.by_storage.get(next(iter(storages))) if len(storages) == 1 else None

    def attach(self, child: _Group, parent: _Group, offset: int) -> None:
        """Make ``child`` live at ``offset`` in ``parent``, extending the top buffer's lifetime."""
        root, _ = _root(parent)
        child.parent, child.parent_offset = parent, offset
        root.start, root.end = min(root.start, child.start), max(root.end, child.end)

    def _bound(self) -> int:
        return lower_bound(_top_level(self.groups))

    def run(self, gm: fx.GraphModule) -> None:
        """Each cat, last first: host its inputs and elide the cats that become views.

        That is one transaction, kept only if the lower bound does not go up: hosting a
        dense block's inputs alone lengthens the big buffer's life, and pays off only
        together with the elided cats. If the transaction is refused, each input is
        tried on its own.
        """
        cats = [n for n in reversed(gm.graph.nodes) if _is_cat(n)]
        for index, cat in enumerate(cats):
            if cat.name in self.elided:
                continue
            cat_group, slices = self.group_of(cat), _cat_slices(cat)
            if cat_group is None or slices is None or not _writes_before(
                    cat_group.storage, None, self.alias, self.order):
                continue
            before = self._bound()
            saved = [(g.parent, g.parent_offset, g.start, g.end) for g in self.groups]
            hosted = [x for x, offset in slices if self._host(x, offset, cat, cat_group)]
            elided = [c.name for c in cats[index + 1:] if self._elide(c)]
            if self._bound() <= before:
                if hosted:
                    self.hosted[cat.name] = [x.name for x in hosted]
                self.elided += elided
                continue
            for g, (parent, offset, start, end) in zip(self.groups, saved):
                g.parent, g.parent_offset, g.start, g.end = parent, offset, start, end
            for x, offset in slices:  # one by one, each kept only if the bound holds
                bound = self._bound()
                state = [(g.parent, g.parent_offset, g.start, g.end) for g in self.groups]
                if not self._host(x, offset, cat, cat_group):
                    continue
                if self._bound() > bound:
                    for g, (parent, off, start, end) in zip(self.groups, state):
                        g.parent, g.parent_offset, g.start, g.end = parent, off, start, end
                else:
                    self.hosted.setdefault(cat.name, []).append(x.name)

    def _host(self, x: fx.Node, offset: int, cat: fx.Node, cat_group: _Group) -> bool:
        group = self.group_of(x)
        if (group is None or group.parent is not None or group is cat_group
                or _root(cat_group)[0] is group or not _fits(x, cat)
                or not _writes_before(group.storage, cat, self.alias, self.order)):
            return False
        self.attach(group, cat_group, offset)
        return True

    def _elide(self, cat: fx.Node) -> bool:
        """If all inputs already lie side by side in one buffer, the cat is a view of it."""
        cat_group, slices = self.group_of(cat), _cat_slices(cat)
        if cat_group is None or slices is None or cat_group.parent is not None or not _writes_before(
                cat_group.storage, None, self.alias, self.order):
            return False
        places = []
        for x, _ in slices:
            group = self.group_of(x)
            if group is None or group.parent is None or not _fits(x, cat):
                return False
            places.append(_root(group))
        base = places[0][1]
        if len({id(r) for r, _ in places}) != 1 or any(
                off - base != want for (_, off), (_, want) in zip(places, slices)):
            return False
        root = places[0][0]
        if root is cat_group or base + cat.meta["val"].untyped_storage().nbytes() > root.nbytes:
            return False
        self.attach(cat_group, root, base)
        return True


def _top_level(groups: list[_Group]) -> list[Buffer]:
    return [Buffer(g.nodes[0].name, g.start, g.end, g.nbytes) for g in groups if g.parent is None]


def build_plan(gm: fx.GraphModule, alias: AliasInfo, live: Liveness, order: dict[fx.Node, int], *,
               alignment: int = 64, concat: bool = True, time_limit: float = 1.0) -> MemoryPlan:
    """Plan ``gm``'s intermediate storages (see the module doc)."""
    began = time.perf_counter()
    groups, unplanned, outputs = _storage_groups(gm, alias, live, order)
    for b in outputs:
        b.size = _align(b.size, alignment)
    for g in groups:
        g.nbytes = _align(g.nbytes, alignment)
    bound_before = lower_bound(_top_level(groups))
    merger = _Merger(groups, alias, order)
    if concat:
        merger.run(gm)
    top = [g for g in groups if g.parent is None]
    buffers = [Buffer("+".join(n.name for n in g.nodes[:3]) + ("+..." if len(g.nodes) > 3 else ""),
                      g.start, g.end, g.nbytes) for g in top]
    solution = solve(buffers, time_limit=time_limit)
    for b, offset in zip(buffers, solution.offsets):
        b.offset = offset
    offset_of = {id(g): b.offset for g, b in zip(top, buffers)}
    index_of = {id(g): i for i, g in enumerate(top)}
    slots: dict[str, Slot] = {}
    for g in groups:
        root, inside = _root(g)
        for n in g.nodes:
            slots[n.name] = Slot(offset_of[id(root)] + inside, g.nbytes, owner=n is g.nodes[0],
                                 hosted=g.parent is not None, buffer=index_of[id(root)])
    plan = MemoryPlan(
        buffers=buffers, arena_bytes=arena_size(buffers), lower_bound_bytes=lower_bound(buffers),
        naive_bytes=sum(g.nbytes for g in groups), lower_bound_before_concat=bound_before,
        slots=slots, unplanned=unplanned, outputs=outputs, concat_merged=merger.hosted,
        concat_elided=merger.elided,
        method=solution.method, alignment=alignment,
    )
    plan.seconds = time.perf_counter() - began
    return plan


@register_pass
class PlanMemory(Pass):
    """Place every intermediate storage in one arena (liveness by storage, concat-aware)."""

    name = "plan_memory"
    requires = ("shapes", "alias", "liveness", "topo")
    preserves = ("*",)
    after = ("inplace",)  # R15: plan on the lifetimes in-place conversion produced
    options: ClassVar = {
        "alignment": Option(int, 64, "round every buffer up to this many bytes", minimum=1),
        "concat": Option(bool, True, "let cat inputs live in their slice of the output"),
        "time_limit": Option(float, 1.0, "seconds the exact search may spend beyond greedy", minimum=0.0),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        plan = build_plan(gm, ctx.analysis("alias"), ctx.analysis("liveness"), ctx.analysis("topo"),
                          alignment=self.options["alignment"], concat=self.options["concat"],
                          time_limit=self.options["time_limit"])
        gm.meta[PLAN_KEY] = plan
        return PassResult(False, {
            "plan": plan, "arena_bytes": plan.arena_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
            "naive_bytes": plan.naive_bytes, "unplanned": len(plan.unplanned),
            "concat_merged": sum(len(v) for v in plan.concat_merged.values()),
            "concat_elided": len(plan.concat_elided),
        })
