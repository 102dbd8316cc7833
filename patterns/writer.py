"""Inlining a replacement at a checked match: the graph edits of a rewrite, and the
bookkeeping that keeps the rest of a sweep valid while the graph changes under it.

Kept apart from :mod:`fxopt.patterns.rules` (which decides *what* to rewrite) because
this is where the cost of a rewrite is: every node created, rerouted and erased here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.canon import Canon, ParamRef
from fxopt.patterns.matcher import Match, SweepState, dead_uses
from fxopt.patterns.meta import propagate_meta
from fxopt.patterns.pattern import CompiledReplacement, lookup_attr

from fxopt.provenance import record_replacement


class NamedRule(Protocol):
    """What the writer reads of a rule (:class:`fxopt.patterns.rules.Rule`): its name, and
    its identity for ``made_by``. A protocol, since ``rules`` imports this module."""

    name: str

@dataclass
class Rewrite:
    """One rewrite: the rule, the match it rewrote (pattern node -> graph node, bindings)
    and the nodes the replacement added, in graph order."""

    rule: str
    match: Match
    replacements: list[fx.Node]

    def summary(self) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """(rule, matched node names, new node names): what a report keeps."""
        return (self.rule, tuple(n.name for n in self.match.body),
                tuple(n.name for n in self.replacements))


class Writer:
    """Inlines replacements into one graph: keeps the sweep's positions and canonical-form
    cache current, installs the attributes replacements use, records rewrites."""

    def __init__(self, gm: fx.GraphModule, pass_name: str | None, records: list[Rewrite] | None,
                 keep_existing_attrs: bool):
        self.gm, self.pass_name, self.records = gm, pass_name, records
        #: torch.fx's rule: an attribute the module already has wins over the replacement's
        self.keep_existing_attrs = keep_existing_attrs
        self.cache: dict[fx.Node, Canon | None] = {}
        self.made_by: dict[fx.Node, NamedRule] = {}
        self.erased: set[fx.Node] = set()
        self.getters: dict[str, fx.Node] = {}  # ParamRef target -> its get_attr node
        self.installed: dict[tuple[int, str], str] = {}  # (replacement root, target) -> name in gm
        self.added: set[str] = set()  # attributes copied in from replacements
        self.released: set[str] = set()  # targets of erased get_attr / call_module nodes
        self.sweep = SweepState({})
        #: whether a node may carry ``meta['val']``; while none does, new nodes need no
        #: fake values and the rewrite skips computing them (set again by any that does)
        self.carries_values = False

    def start_sweep(self, nodes: list[fx.Node]) -> None:
        self.sweep = SweepState({n: float(i) for i, n in enumerate(nodes)})
        self.carries_values = any("val" in n.meta for n in nodes)
        self.cache.clear()
        self.erased.clear()
        self.getters.clear()

    def rewrite(self, m: Match, r: NamedRule) -> list[fx.Node]:
        """Inline ``r``'s replacement before the last matched node, reroute the outputs'
        users, erase the matched nodes; return the created nodes."""
        graph, at, rep, bindings = self.gm.graph, m.insert_at, m.replacement, m.bindings
        env: dict[fx.Node, Any] = {}
        created: list[fx.Node] = []
        for rn, name in rep.binding.items():
            bound = bindings[name]
            if isinstance(bound, ParamRef) or isinstance(bound, fx.Node) and bound.op == "get_attr":
                bound = self._attribute_at(bound, at, created)
            env[rn] = bound
        lookup = env.__getitem__
        annotated = False
        for rn in rep.body:
            op = rn.op
            target = self._install(rep, rn.target) if op == "get_attr" or op == "call_module" else rn.target
            kwargs = rn.kwargs
            new = env[rn] = insert_node(graph, at, op, target, fx.map_arg(rn.args, lookup),
                                        fx.map_arg(kwargs, lookup) if kwargs else {}, rn.name)
            if "val" in rn.meta:  # annotated on a replacement graph: kept if still valid
                new.meta["val"] = rn.meta["val"]
                annotated = True
            created.append(new)
        new_outputs = [lookup(o) if isinstance(o, fx.Node) else o for o in rep.returned]
        if self.carries_values or annotated:
            propagate_meta(self.gm, created)
            self.carries_values = True
        positions, made_by, cache, body = self.sweep.positions, self.made_by, self.cache, m.body
        position, origin = positions[at] - 0.5, self.pass_name or r.name
        for new in created:
            positions[new] = position
            made_by[new] = r
            if new.op != "get_attr":
                record_replacement(new, body, origin)
        for old, new in zip(m.outputs, new_outputs):
            for user in old.users:
                cache.pop(user, None)
            old.replace_all_uses_with(new)
        if m.reads_metadata:
            _reroute_metadata_reads(m, new_outputs)
        self._erase(m)
        if self.records is not None:
            self.records.append(Rewrite(r.name, m, created))
        return created

    def _attribute_at(self, bound: fx.Node | ParamRef, at: fx.Node, created: list[fx.Node]) -> fx.Node:
        """What a replacement argument bound to an attribute stands for at ``at``: a module
        parameter, or an attribute read later than ``at``, becomes a get_attr node there
        (one per sweep and target while it stays early enough)."""
        if isinstance(bound, fx.Node):
            if self.sweep.positions.get(bound, 0.0) < self.sweep.positions[at]:
                return bound
            bound = ParamRef(bound.target)
        getter = self.getters.get(bound.target)
        if getter is None or self.sweep.positions[getter] >= self.sweep.positions[at]:
            getter = self.getters[bound.target] = self.gm.graph.get_attr(bound.target)
            at.prepend(getter)
            created.append(getter)
            self.sweep.positions[getter] = self.sweep.positions[at] - 0.5
        return getter

    def _install(self, rep: CompiledReplacement, target: str) -> str:
        """The name under which the replacement's attribute ``target`` lives in the module:
        copied in once, under its own name when free, else a numbered variant (or, the
        torch.fx way, the module's own attribute of that name is used)."""
        key = (id(rep.root), target)
        if key in self.installed:
            return self.installed[key]
        value = None if rep.root is None else lookup_attr(rep.root, target)
        existing = lookup_attr(self.gm, target)
        if value is None:  # a raw graph's attribute, or one the module provides (torch.fx's rule)
            return target
        name = target
        if existing is None or (existing is not value and not self.keep_existing_attrs):
            name = _free_name(self.gm, target) if existing is not None else target
            _set_attr(self.gm, name, copy.deepcopy(value))
            self.added.add(name)
        self.installed[key] = name
        return name

    def _erase(self, m: Match) -> None:
        """Erase the matched nodes and the nodes that belong to them (``interior``: the
        pieces of a canonical form, e.g. a module's parameter reads), each once it has no
        users; nodes still used outside the match (an output, a shared attribute) stay."""
        graph, cache, erased = self.gm.graph, self.cache, self.erased
        pending = list(m.nodes.values())
        progress = True
        while pending and progress:
            progress, left = False, []
            for g in pending:  # grows while it runs: a node's interior follows it
                if g in erased:
                    continue
                if g.users:
                    left.append(g)
                    continue
                form = cache.pop(g, None)
                if g.op == "get_attr" or g.op == "call_module":  # its attribute may now be unused
                    self.released.add(g.target)
                graph.erase_node(g)
                erased.add(g)
                progress = True
                if form is not None and form.interior:
                    for extra in form.interior:
                        pending.append(extra)
                        pending.extend(dead_uses(extra, g) or ())
            pending = left

    def remove_dead_attributes(self) -> None:
        """Delete attributes a rewrite added, and submodules matched nodes called, that no
        node uses any more."""
        candidates = (self.added | {t for t in self.released if isinstance(lookup_attr(self.gm, t), nn.Module)})
        if not candidates:
            return
        used = {n.target for n in self.gm.graph.nodes if n.op in ("get_attr", "call_module")}
        for target in candidates - used:
            if not any(u.startswith(target + ".") for u in used):
                _del_attr(self.gm, target)


def insert_node(graph: fx.Graph, at: fx.Node, op: str, target: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any], name: str) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name)`` placed before ``at``, at half
    the cost: ``create_node`` scans the arguments for raw SymInts (a pytree walk, about half
    of a rewrite's node creation), which these arguments, taken from nodes already in the
    graph and from a traced replacement, cannot introduce; the arguments are set the way
    ``Node.__init__`` sets them. A module with node-creation hooks (export's metadata
    hook reads the arguments) gets the node from ``create_node`` whole."""
    if getattr(graph.owning_module, "_create_node_hooks", None):
        with graph.inserting_before(at):
            return graph.create_node(op, target, tuple(args), dict(kwargs), name)
    new = graph.create_node(op, target, None, None, name)
    at.prepend(new)
    new._update_args_kwargs(args, kwargs)
    return new


def _reroute_metadata_reads(m: Match, new_outputs: list[Any]) -> None:
    """Point the metadata reads of removed interior nodes (the only outside users the
    checks let them keep) at the new output with the same metadata."""
    matched = m.nodes.values()
    new_of = dict(zip(m.pattern.outputs, new_outputs))
    for p, out in m.pattern.meta_twins.items():
        m.nodes[p].replace_all_uses_with(new_of[out], lambda user: user not in matched)


def _free_name(gm: nn.Module, target: str) -> str:
    i = 1
    while lookup_attr(gm, f"{target}_{i}") is not None:
        i += 1
    return f"{target}_{i}"


def _set_attr(root: nn.Module, target: str, value: Any) -> None:
    *path, attr = target.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, nn.Module):
        owner.add_module(attr, value)
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(attr, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(attr, value)
    else:
        setattr(owner, attr, value)


def _del_attr(root: nn.Module, target: str) -> None:
    module_path, _, attr = target.rpartition(".")
    owner = lookup_attr(root, module_path) if module_path else root
    if isinstance(owner, nn.Module) and lookup_attr(owner, attr) is not None:
        delattr(owner, attr)
