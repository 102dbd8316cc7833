"""Before/after: which passes made a graph faster or slower, and on which nodes.

Nodes of the two profiles are tied together by provenance (``node.meta["fxopt.replaces"]``,
written by :func:`fxopt.record_replacement`): an *after* node that stands for original
nodes is joined to them, and the connected groups are the units of change. Each group is
credited to the passes that touched it: the pass that created its new nodes
(``meta["fxopt.created_by"]``) and, when the optimize report is at hand, the passes that
removed its original nodes (read from each pass's before-snapshot). Nodes present on both
sides and never rewritten are "unchanged"; their difference is the measurement noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from tabulate import tabulate

from fxopt.provenance import PROVENANCE_KEY
from fxopt.snapshot import _FIELDS, GraphSnapshot

if TYPE_CHECKING:
    import torch.fx as fx

UNCHANGED = "(unchanged nodes)"
#: new nodes that name no pass (no fxopt.created_by) when no optimize report is at hand
NO_PROVENANCE = "(new nodes, pass unknown)"
_MIB = 1 << 20


class NodeCost(Protocol):
    """What the diff reads of a profiled node (:class:`fxopt.profiling.NodeProfile` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def time_s(self) -> float: ...
    @property
    def allocated_bytes(self) -> int: ...


class Profiled(Protocol):
    """What the diff reads of a profile (:class:`fxopt.profiling.Profile` is one).

    Declared here, not imported: ``Profile.diff`` calls this module, so profiles sit above
    it, and naming ``Profile`` here (even for types) closed an import loop."""

    @property
    def nodes(self) -> Sequence[NodeCost]: ...
    @property
    def graph_module(self) -> fx.GraphModule | None: ...
    @property
    def node_time_s(self) -> float: ...
    @property
    def eager_s(self) -> float: ...
    @property
    def peak_bytes(self) -> int: ...


#: the profiles a diff compares (``ProfileDiff[Profile]`` from ``Profile.diff``)
P = TypeVar("P", bound=Profiled)


@dataclass
class PassChange:
    """The measured effect of one pass (or a chain of passes on the same nodes)."""

    passes: str
    nodes_before: list[str] = field(default_factory=list)
    nodes_after: list[str] = field(default_factory=list)
    time_before_s: float = 0.0
    time_after_s: float = 0.0
    allocated_before: int = 0
    allocated_after: int = 0
    #: module -> (time before, time after) of the nodes in it
    modules: dict[str, list[float]] = field(default_factory=dict)

    @property
    def delta_s(self) -> float:
        return self.time_after_s - self.time_before_s

    def relative(self, total_before_s: float) -> float:
        """The change as a fraction of the whole graph's time before."""
        return self.delta_s / total_before_s if total_before_s else 0.0

    def where(self, top: int = 3) -> str:
        """The modules with the largest change, e.g. ``layer3 -1.20 ms, layer4 -0.80 ms``."""
        ranked = sorted(self.modules.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]), reverse=True)
        return ", ".join(f"{m or '(top level)'} {(a - b) * 1e3:+.2f} ms" for m, (b, a) in ranked[:top])

    def summary(self, total_before_s: float) -> str:
        own = (self.delta_s / self.time_before_s) if self.time_before_s else 0.0
        return (f"{self.passes}: {100 * self.relative(total_before_s):+.1f}% of total time "
                f"({100 * own:+.0f}% on its nodes; {self.where()}), "
                f"{len(self.nodes_before)} nodes -> {len(self.nodes_after)}")

    def row(self, total_before_s: float) -> dict[str, Any]:
        return {"passes": self.passes, "nodes_before": len(self.nodes_before),
                "nodes_after": len(self.nodes_after), "time_before_ms": self.time_before_s * 1e3,
                "time_after_ms": self.time_after_s * 1e3, "delta_ms": self.delta_s * 1e3,
                "delta_of_total": self.relative(total_before_s),
                "allocated_before": self.allocated_before, "allocated_after": self.allocated_after,
                "where": self.where()}


@dataclass
class ProfileDiff(Generic[P]):
    """Profile before vs after, per pass; ``str()`` prints the table."""

    before: P
    after: P
    changes: list[PassChange]

    @property
    def time_before_s(self) -> float:
        return self.before.node_time_s

    @property
    def time_after_s(self) -> float:
        return self.after.node_time_s

    def rows(self) -> list[dict[str, Any]]:
        return [c.row(self.time_before_s) for c in self.changes]

    def summary(self) -> list[str]:
        """One line per pass, largest change first."""
        return [c.summary(self.time_before_s) for c in self.changes if c.passes != UNCHANGED]

    def table(self) -> str:
        b, a = self.before, self.after
        head = (f"time {b.node_time_s * 1e3:.3f} -> {a.node_time_s * 1e3:.3f} ms "
                f"({_percent(a.node_time_s, b.node_time_s)}), end to end {b.eager_s * 1e3:.3f} -> "
                f"{a.eager_s * 1e3:.3f} ms, peak memory {b.peak_bytes / _MIB:.1f} -> "
                f"{a.peak_bytes / _MIB:.1f} MiB ({_percent(a.peak_bytes, b.peak_bytes)}), "
                f"nodes {len(b.nodes)} -> {len(a.nodes)}")
        rows = [[c.passes[:34], f"{len(c.nodes_before)} -> {len(c.nodes_after)}",
                 f"{c.time_before_s * 1e3:.3f}", f"{c.time_after_s * 1e3:.3f}",
                 f"{100 * c.relative(self.time_before_s):+.1f}",
                 f"{(c.allocated_after - c.allocated_before) / _MIB:+.1f}"] for c in self.changes]
        table = tabulate(rows, headers=["passes", "nodes", "ms before", "ms after", "% total",
                                        "alloc MiB"], disable_numparse=True)
        return "\n".join([head, "", table, "", *self.summary()])

    def __str__(self) -> str:
        return self.table()


def _percent(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.1f}%" if old else "n/a"


class _Groups:
    """Union-find over ('b', name) / ('a', name) keys."""

    def __init__(self) -> None:
        self.parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(self, key: tuple[str, str]) -> tuple[str, str]:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: tuple[str, str], b: tuple[str, str]) -> None:
        self.parent[self.find(a)] = self.find(b)


def diff_profiles(before: P, after: P, report: Any = None) -> ProfileDiff[P]:
    """See :meth:`Profile.diff`. ``report`` (the optimize run's) names removing passes."""
    b_names = {n.name for n in before.nodes}
    a_nodes = {n.name: n for n in (after.graph_module.graph.nodes if after.graph_module else ())}
    removed_by, added_by, order = _pass_effects(report, after)
    groups = _Groups()
    changed: set[tuple[str, str]] = set()
    # new nodes rarely carry nn_module_stack: they sit in the module of what they replace
    module_of = {("b", n.name): n.module for n in before.nodes}
    for name in b_names:
        groups.find(("b", name))
    for p in after.nodes:
        node = a_nodes.get(p.name)
        origins = list(node.meta.get(PROVENANCE_KEY, ())) if node is not None else []
        key = ("a", p.name)
        groups.find(key)
        module_of[key] = p.module or next(
            (module_of[("b", o)] for o in origins if ("b", o) in module_of), "")
        if p.name in b_names and (not origins or origins == [p.name]):
            groups.union(key, ("b", p.name))  # the same node on both sides
            continue
        changed.add(key)
        for origin in origins:
            if origin in b_names:
                groups.union(key, ("b", origin))
    a_names = {p.name for p in after.nodes}
    changed |= {("b", n) for n in b_names if n not in a_names}
    changed_roots = {groups.find(k) for k in changed}
    index = {("b", n.name): n for n in before.nodes} | {("a", n.name): n for n in after.nodes}
    creators = {p.name: _creator(a_nodes.get(p.name), added_by) for p in after.nodes}
    buckets: dict[str, PassChange] = {}
    members: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key in groups.parent:
        members.setdefault(groups.find(key), []).append(key)
    for root, keys in members.items():
        if root in changed_roots:
            passes = {creators[n] for side, n in keys if side == "a"} | \
                     {removed_by.get(n) for side, n in keys if side == "b" and n not in a_names}
            passes.discard(None)
            label = " + ".join(sorted(passes, key=lambda p: (order.get(p, len(order)), p))) or NO_PROVENANCE
        else:
            label = UNCHANGED
        change = buckets.setdefault(label, PassChange(label))
        _add(change, keys, index, module_of)
    changes = sorted(buckets.values(), key=lambda c: (c.passes == UNCHANGED, c.delta_s))
    return ProfileDiff(before, after, changes)


def _add(change: PassChange, keys: Iterable[tuple[str, str]], index: dict[tuple[str, str], Any],
         module_of: dict[tuple[str, str], str]) -> None:
    for side, name in keys:
        node = index[(side, name)]
        slot = change.modules.setdefault(module_of[(side, name)].split(".")[0], [0.0, 0.0])
        if side == "b":
            change.nodes_before.append(name)
            change.time_before_s += node.time_s
            change.allocated_before += node.allocated_bytes
            slot[0] += node.time_s
        else:
            change.nodes_after.append(name)
            change.time_after_s += node.time_s
            change.allocated_after += node.allocated_bytes
            slot[1] += node.time_s


def _creator(node: Any, added_by: dict[str, str]) -> str | None:
    if node is None:
        return None
    return added_by.get(node.name) or node.meta.get("fxopt.created_by")


def _pass_effects(report: Any, after: Profiled) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """From an optimize report: original node -> the pass that removed it, new node -> the
    pass that added it, and the order passes ran in."""
    removed_by: dict[str, str] = {}
    added_by: dict[str, str] = {}
    order: dict[str, int] = {}
    if report is None:
        return removed_by, added_by, order
    leaves = [r for _, r in report.walk() if r.before is not None and not r.children]
    final = [n.name for n in after.nodes]
    for i, record in enumerate(leaves):
        order.setdefault(record.name, i)
        names_before = set(_snapshot_names(record.before))
        names_after = set(_snapshot_names(leaves[i + 1].before) if i + 1 < len(leaves) else final)
        for name in names_before - names_after:
            removed_by.setdefault(name, record.name)
        for name in names_after - names_before:
            added_by[name] = record.name
    return removed_by, added_by, order


def _snapshot_names(snapshot: GraphSnapshot) -> list[str]:
    return list(snapshot.columns[_FIELDS.index("name")])
