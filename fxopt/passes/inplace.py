"""The ``inplace`` pass: turn out-of-place ops into in-place ones where that is sound.

``b = op(a, ...)`` becomes ``op_(a, ...)`` only if every rule R1-R16 of
``docs/inplace-rules.md`` holds; each rule is one function below
(``RULES``), and the report counts, per rule, the candidates it rejected. Aliasing is
decided by *storage*: the FakeTensor run gives each value its storage (views, chunks,
reshapes that did not copy and ``contiguous()`` of a contiguous tensor share their
base's), and every conversion merges the result's storage into ``self``'s, so later
decisions see the lifetimes the conversion created (R15).

It works on torch-level graphs (``operator.add`` -> ``operator.iadd``, ``torch.relu`` ->
``torch.relu_``, ``F.silu(x)`` -> ``F.silu(x, inplace=True)``, ``nn.ReLU`` -> a copy with
``inplace=True``, ``x.mul(y)`` -> ``x.mul_(y)``) and on ATen graphs (a pointwise
``OpOverload`` whose ``<name>_`` overload has the same schema). For commutative ops
(``a + b``, ``a * b``) either operand may become ``self``.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxopt.analysis.alias import AliasInfo, storages_of
from fxopt.analysis.ops import Variant, inplace_variant, is_collective, output_aliases
from fxopt.analysis.shapes import record_value
from fxopt.compile.guards import add_dtype_guard
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

# R11: which ops have an in-place form, and how to spell it, is an op fact
# (:func:`fxopt.analysis.ops.inplace_variant`).


def _self_choices(node: fx.Node, variant: Variant) -> list[fx.Node]:
    """The arguments that may become ``self``: the first, or either of a commutative pair."""
    if node.kwargs.get("out") is not None or not node.args:
        return []
    choices = [node.args[0]]
    if variant.commutative and len(node.args) == 2:
        choices.append(node.args[1])
    return [c for c in choices if isinstance(c, fx.Node)]


# ---------------------------------------------------------------------------------------
# storage classes: union-find over storages, merged as conversions make results aliases
# ---------------------------------------------------------------------------------------


class StorageClasses:
    """Groups of storages that are one buffer at run time, and the nodes living in each."""

    def __init__(self, alias: AliasInfo):
        self.parent: dict[StorageWeakRef, StorageWeakRef] = {}
        self.members: dict[StorageWeakRef, list[fx.Node]] = {}
        #: root -> every storage of its class, so that a membership test costs the size of
        #: the node's classes, not of the set asked about (all parameters, say)
        self.held: dict[StorageWeakRef, set[StorageWeakRef]] = {}
        self.storages = alias.storages
        for node, found in alias.storages.items():
            for s in found:
                self.members.setdefault(self.find(s), []).append(node)

    def find(self, s: StorageWeakRef) -> StorageWeakRef:
        root = self.parent.get(s)
        if root is None:
            self.parent[s] = s
            self.held[s] = {s}
            return s
        while root != self.parent[root]:
            root = self.parent[root]
        self.parent[s] = root
        return root

    def roots(self, node: fx.Node) -> set[StorageWeakRef]:
        return {self.find(s) for s in self.storages.get(node, ())}

    def nodes(self, node: fx.Node) -> list[fx.Node]:
        """Every node living (partly) in the same buffer as ``node``."""
        out: dict[fx.Node, None] = {}
        for r in self.roots(node):
            out.update(dict.fromkeys(self.members.get(r, ())))
        return list(out)

    def contains_any(self, node: fx.Node, storages: set[StorageWeakRef]) -> bool:
        return any(not self.held[r].isdisjoint(storages) for r in self.roots(node))

    def merge(self, node: fx.Node, into: fx.Node) -> None:
        """R15: after ``node`` became an in-place op on ``into`` they are one buffer."""
        targets = list(self.roots(into))
        if not targets:
            return
        keep = targets[0]
        for r in self.roots(node) | set(targets[1:]):
            if r != keep:
                self.parent[r] = keep
                self.members.setdefault(keep, []).extend(self.members.pop(r, []))
                self.held[keep] |= self.held.pop(r)
        self.storages[node] = set(self.storages.get(node, ())) | {keep}

    def rename(self, old: fx.Node, new: fx.Node) -> None:
        """``new`` lives where ``old`` lived (``old`` leaves the graph)."""
        for r in self.roots(old):  # the only member lists ``old`` is in
            members = self.members.get(r, [])
            for i, m in enumerate(members):
                if m is old:
                    members[i] = new
        self.storages[new] = self.storages.pop(old, set())


# ---------------------------------------------------------------------------------------
# the rules: each returns None when it holds, or why the candidate is rejected
# ---------------------------------------------------------------------------------------


@dataclass
class Candidate:
    node: fx.Node
    self_arg: fx.Node
    variant: Variant


@dataclass
class Facts:
    """What the rules consult; ``classes`` is updated after every conversion."""

    gm: fx.GraphModule
    order: dict[fx.Node, int]
    alias: AliasInfo
    classes: StorageClasses
    #: (node, leaf) -> the nodes that save that tensor's storage for backward; None:
    #: unknown (the fake run failed)
    saved: dict[tuple[fx.Node, int], set[fx.Node]] | None
    autograd_safe: bool
    inference_storages: set[StorageWeakRef] = field(default_factory=set)
    #: node -> the leaf positions of its value that ``saved`` has entries for, and the sets
    #: of savers it is in (kept with ``saved`` as nodes are replaced, without scanning it)
    saved_leaves: dict[fx.Node, list[int]] = field(default_factory=dict)
    savers_of: dict[fx.Node, list[set[fx.Node]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (node, position), savers in (self.saved or {}).items():
            self.saved_leaves.setdefault(node, []).append(position)
            for saver in savers:
                self.savers_of.setdefault(saver, []).append(savers)
    #: (collective's position, its wait's position, storages it reads and fills) (R16)
    in_flight: list[tuple[int, float, set[StorageWeakRef]]] = field(default_factory=list)


def _val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def r1_graph_inputs(c: Candidate, f: Facts) -> str | None:
    if f.classes.contains_any(c.self_arg, f.alias.inputs):
        return "self shares storage with a graph input"
    return None


def r2_parameters_and_constants(c: Candidate, f: Facts) -> str | None:
    if f.classes.contains_any(c.self_arg, f.alias.constants):
        return "self shares storage with a parameter, buffer or constant"
    return None


def _later_readers(c: Candidate, f: Facts) -> list[fx.Node]:
    """Users, after ``c.node``, of any alias of self that exists before ``c.node``."""
    here = f.order[c.node]
    readers = []
    for alias in f.classes.nodes(c.self_arg):
        if f.order.get(alias, here) < here:
            readers += [u for u in alias.users if u is not c.node and f.order[u] > here]
    return readers


def r3_later_alias_reads(c: Candidate, f: Facts) -> str | None:
    readers = [u for u in _later_readers(c, f) if u.op != "output"]
    if readers:
        return f"self (or an alias of its storage) is read later by {readers[0].name!r}"
    return None


def r4_graph_outputs(c: Candidate, f: Facts) -> str | None:
    if any(u.op == "output" for u in _later_readers(c, f)):
        return "self (or an alias of its storage) is a graph output"
    return None


def r5_same_shape(c: Candidate, f: Facts) -> str | None:
    out, this = _val(c.node), _val(c.self_arg)
    if out is None or this is None:
        return "no shape information"
    # imported here: symbolic_shapes pulls in sympy (~0.7 s), and `import fxopt` must stay cheap
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if out.dim() != this.dim() or not all(
        statically_known_true(a == b) for a, b in zip(out.shape, this.shape)
    ):
        return f"result shape {tuple(out.shape)} differs from self's {tuple(this.shape)} (broadcast)"
    return None


def r6_self_read_through_other_argument(c: Candidate, f: Facts) -> str | None:
    mine = f.classes.roots(c.self_arg)
    others = [a for a in c.node.all_input_nodes if a is not c.self_arg]
    args_self = [a for a in (*c.node.args, *c.node.kwargs.values()) if a is c.self_arg]
    if len(args_self) > 1 or any(f.classes.roots(o) & mine for o in others):
        return "another argument shares self's storage"
    return None


def r7_internal_overlap(c: Candidate, f: Facts) -> str | None:
    this = _val(c.self_arg)
    if this is None or torch._debug_has_internal_overlap(this) != 0:
        return "self may overlap itself (expanded or stride-0)"
    return None


def r8_same_dtype(c: Candidate, f: Facts) -> str | None:
    out, this = _val(c.node), _val(c.self_arg)
    if out is None or this is None:
        return "no dtype information"
    if out.dtype != this.dtype or out.device != this.device or out.layout != this.layout:
        return f"result dtype {out.dtype} differs from self's {this.dtype} (type promotion)"
    return None


def r9_autograd(c: Candidate, f: Facts) -> str | None:
    if not f.autograd_safe:
        return None
    if f.saved is None:
        return "could not tell which tensors autograd saves"
    # the converted op itself is fine: every in-place variant saves what its own
    # derivative needs (its result), so only other savers of self's buffer matter
    roots = f.classes.roots(c.self_arg)
    for alias in f.classes.nodes(c.self_arg):
        for position, leaf in enumerate(tree_leaves(alias.meta.get("val"))):
            if not isinstance(leaf, torch.Tensor):
                continue
            if f.classes.find(StorageWeakRef(leaf.untyped_storage())) not in roots:
                continue  # another output of a multi-output node (max's indices)
            savers = f.saved.get((alias, position), set()) - {c.node}
            if savers:
                return (f"autograd saves {alias.name!r} (self's buffer) for the backward of "
                        f"{min(s.name for s in savers)!r}")
    return None


def r10_inference_tensors(c: Candidate, f: Facts) -> str | None:
    if f.classes.contains_any(c.self_arg, f.inference_storages):
        return "self is an inference tensor"
    return None


def r11_inplace_variant(c: Candidate, f: Facts) -> str | None:
    # candidates exist only for ops find_variant knows; this guards direct construction
    return None if c.variant is not None else "the op has no in-place variant"


def _multi_output_producer(node: fx.Node) -> fx.Node | None:
    if node.op == "call_function" and node.target is operator.getitem:
        producer = node.args[0]
        if isinstance(producer, fx.Node) and isinstance(producer.meta.get("val"), (tuple, list)):
            return producer
    return None


def r12_multi_output_views(c: Candidate, f: Facts) -> str | None:
    producer = _multi_output_producer(c.self_arg)
    if producer is None:
        return None
    outputs = producer.meta["val"]
    if f.autograd_safe and len(outputs) > 1 and len(storages_of(outputs)) == 1:
        return "self is one view of a multi-output view op (autograd forbids writing it)"
    return None


def r13_result_used(c: Candidate, f: Facts) -> str | None:
    if not c.node.users:
        return "the result is unused: dead code, converting it would only add a write"
    return None


def r14_elementwise(c: Candidate, f: Facts) -> str | None:
    v = c.variant
    if v.kind == "overload" and torch.Tag.pointwise not in c.node.target.tags:
        return "not an elementwise op (reads and writes may not map one to one)"
    return None


def r16_collective_in_flight(c: Candidate, f: Facts) -> str | None:
    """A collective reads its input (and fills its result) asynchronously until its
    ``wait_tensor``: nothing may write those buffers in between."""
    here = f.order[c.node]
    for start, end, storages in f.in_flight:
        if start < here < end and f.classes.contains_any(c.self_arg, storages):
            return "self's buffer is in use by a collective that has not been waited for"
    return None


RULES: tuple[Callable[[Candidate, Facts], str | None], ...] = (
    r1_graph_inputs, r2_parameters_and_constants, r3_later_alias_reads, r4_graph_outputs,
    r5_same_shape, r6_self_read_through_other_argument, r7_internal_overlap, r8_same_dtype,
    r9_autograd, r10_inference_tensors, r11_inplace_variant, r12_multi_output_views,
    r13_result_used, r14_elementwise, r16_collective_in_flight,
)
# R15 (lifetimes merge) is StorageClasses.merge, applied after every conversion, and the
# plan_memory pass declares after=("inplace",) so it plans on the merged lifetimes.


def check(c: Candidate, f: Facts) -> tuple[str, str] | None:
    """The first rule that rejects ``c`` (its short name and reason), or None if all hold."""
    for rule in RULES:
        reason = rule(c, f)
        if reason is not None:
            return rule.__name__.split("_")[0].upper(), reason
    return None


# ---------------------------------------------------------------------------------------
# rewriting
# ---------------------------------------------------------------------------------------


def _swap_first(args: tuple, self_arg: fx.Node) -> tuple:
    return args if args[0] is self_arg else (args[1], args[0], *args[2:])


def _flag_call(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fn(*args, **kwargs)`` with ``inplace=True``, whether the flag was positional or not."""
    names = list(inspect.signature(fn).parameters)
    position = names.index("inplace")
    return tuple(args[:position]), {**kwargs, "inplace": True}


def rewrite(c: Candidate, gm: fx.GraphModule, module_copies: dict[str, str], pass_name: str) -> fx.Node:
    """Insert the in-place form of ``c.node`` before it, move its uses over, erase it."""
    node, v, graph = c.node, c.variant, c.node.graph
    args, kwargs = _swap_first(node.args, c.self_arg), dict(node.kwargs)
    with graph.inserting_before(node):
        if v.kind in ("function", "overload"):
            new = graph.call_function(v.target, args, kwargs)
        elif v.kind == "method":
            new = graph.call_method(v.target, args, kwargs)
        elif v.kind == "flag":
            new = graph.call_function(v.target, *_flag_call(v.target, args, kwargs))
        else:  # a copy of the module, so other call sites (and the user's model) keep theirs
            name = module_copies.get(node.target)
            if name is None:
                name = _free_name(gm, node.target.replace(".", "_") + "_inplace")
                clone = copy.deepcopy(v.target)
                clone.inplace = True
                gm.add_submodule(name, clone)
                module_copies[node.target] = name
            new = graph.call_module(name, args, kwargs)
    new.meta.update(node.meta)
    new.meta["fxopt.inplace"] = True  # R13: impure now; its result is threaded to all uses
    node.replace_all_uses_with(new)
    record_replacement(new, [node], pass_name)
    graph.erase_node(node)
    return new


def _free_name(gm: fx.GraphModule, name: str) -> str:
    candidate, i = name, 1
    while hasattr(gm, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate


@register_pass
class InPlace(Pass):
    """Turn out-of-place elementwise ops into in-place ones where every rule R1-R15 holds."""

    name = "inplace"
    requires = ("shapes", "alias", "topo")
    options: ClassVar = {
        "autograd_safe": Option(bool, True, "keep the graph differentiable: never write a tensor "
                                            "autograd saves for backward (R9); turn off for graphs "
                                            "run only under no_grad / inference_mode"),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        alias: AliasInfo = ctx.analysis("alias")
        saved = ctx.analysis("saved_for_backward") if self.options["autograd_safe"] else {}
        facts = Facts(
            gm=gm, order=dict(ctx.analysis("topo")), alias=alias, classes=StorageClasses(alias),
            saved=None if saved is None else {k: set(v) for k, v in saved.items()},
            autograd_safe=self.options["autograd_safe"],
            inference_storages=_inference_storages(gm, ctx),
        )
        facts.in_flight = _collectives_in_flight(gm, facts)
        converted: list[str] = []
        rejected: dict[str, int] = {}
        module_copies: dict[str, str] = {}
        for node in list(gm.graph.nodes):
            variant = inplace_variant(node, gm)
            if variant is None:
                continue
            chosen = None
            for self_arg in _self_choices(node, variant):
                candidate = Candidate(node, self_arg, variant)
                verdict = check(candidate, facts)
                if verdict is None:
                    chosen = candidate
                    break
                rejected[verdict[0]] = rejected.get(verdict[0], 0) + 1
            if chosen is None:
                continue
            new = rewrite(chosen, gm, module_copies, self.name)
            _adopt_facts(facts, node, new, chosen.self_arg)
            converted.append(new.name)
        if converted:
            # R8 decided on the example inputs' dtypes: other dtypes must not run silently
            add_dtype_guard(gm, self.name)
        # rejected_by_rule counts (candidate, self) pairs: a commutative op whose first
        # operand is rejected may still convert with the second
        return PassResult(bool(converted), {"converted": len(converted), "nodes": converted,
                                            "rejected_by_rule": dict(sorted(rejected.items()))})


def _collectives_in_flight(gm: fx.GraphModule, f: Facts) -> list[tuple[int, float, set]]:
    """For each collective, the span of positions until its first wait (or the graph's end)."""
    spans = []
    for node in gm.graph.nodes:
        if not is_collective(node) or output_aliases(node):
            continue  # a wait (it hands back its input's buffer) closes a span, opens none
        waits = [f.order[u] for u in node.users if is_collective(u) and u in f.order]
        storages = set().union(set(), *(f.alias.storages.get(n, set())
                                        for n in (node, *node.all_input_nodes)))
        spans.append((f.order[node], min(waits, default=float("inf")), storages))
    return spans


def _adopt_facts(f: Facts, old: fx.Node, new: fx.Node, self_arg: fx.Node) -> None:
    """Give ``new`` the facts ``old`` had, then merge its storage into self's (R15)."""
    f.order[new] = f.order.pop(old)
    f.classes.rename(old, new)
    if f.saved is not None:
        positions = f.saved_leaves.pop(old, [])
        for position in positions:
            f.saved[(new, position)] = f.saved.pop((old, position))
        f.saved_leaves[new] = positions
        sets = f.savers_of.pop(old, [])
        for savers in sets:
            savers.discard(old)
            savers.add(new)
        f.savers_of[new] = sets
    f.classes.merge(new, self_arg)
    if "val" in old.meta:
        record_value(new, old.meta["val"])


def _inference_storages(gm: fx.GraphModule, ctx: Any) -> set[StorageWeakRef]:
    """Fake storages of inputs, parameters and buffers that are inference tensors (R10)."""
    mode = ctx.analysis("shapes")
    found: set[StorageWeakRef] = set()
    for tensor in (*gm.parameters(), *gm.buffers()):
        if tensor.is_inference():
            found |= storages_of(mode.from_tensor(tensor, static_shapes=True))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for p, value in zip(placeholders, ctx.example_inputs or ()):
        if isinstance(value, torch.Tensor) and value.is_inference():
            found |= storages_of(p.meta.get("val"))
    return found
