"""Matching a compiled pattern at one anchor node, and the soundness checks of a match.

Matching walks the pattern backwards from its last output over canonical forms
(:mod:`fxopt.patterns.canon`), so it costs the pattern's size per candidate anchor, not
the graph's. Commutative ops try both operand orders (the given order first, so
overlaps resolve the same way every run). A structural match is then checked:

- interior nodes (matched, not returned by the pattern) have no users outside the match,
  so the rewrite can remove them;
- an in-place spelling is accepted only where its write is invisible: it writes into an
  interior node, or into a fresh tensor used by nothing else;
- no in-place write outside the match falls between the matched nodes (the replacement
  reads its inputs at the anchor, later than the original did);
- extra outputs have no users before the anchor (the replacement is inserted at the
  anchor; nodes are never reordered, so a rewrite can never create a cycle);
- the rule's constraints hold.

Every failure is phrased for :func:`fxopt.patterns.explain`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from fxopt.patterns.canon import COMMUTATIVE, Canon, ParamRef, canonicalize
from fxopt.patterns.pattern import ANY, CompiledPattern

from fxopt.analysis.alias import storages_of
from fxopt.analysis.ops import is_barrier

if TYPE_CHECKING:
    from fxopt.patterns.rules import Rule

State = tuple[dict[fx.Node, fx.Node], dict[str, Any]]

#: canonical ops that always return a new tensor (never a view of an input)
FRESH_OPS = frozenset({"relu", "hardtanh", "add", "sub", "mul", "convolution", "batch_norm",
                       "linear", "add_relu", "conv_bias_relu", "conv_bias_add_relu", "linear_relu"})


@dataclass
class Match:
    """One occurrence of a rule's pattern: matched nodes and argument bindings.

    Constraints receive it: ``m["x"]`` is what argument ``x`` bound to (a node, a
    :class:`~fxopt.patterns.canon.ParamRef` or a literal), ``m.value("x")`` its tensor
    (``meta['val']`` for nodes, the tensor itself for parameters) or literal,
    ``m.node("x")`` the node, ``m.nodes`` pattern node -> graph node.
    """

    gm: fx.GraphModule
    pattern: CompiledPattern
    nodes: dict[fx.Node, fx.Node]
    bindings: dict[str, Any]

    @property
    def anchor(self) -> fx.Node:
        return self.nodes[self.pattern.anchor]

    @property
    def outputs(self) -> list[fx.Node]:
        return [self.nodes[o] for o in self.pattern.outputs]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def node(self, name: str) -> fx.Node | None:
        value = self.bindings[name]
        return value if isinstance(value, fx.Node) else None

    def value(self, name: str) -> Any:
        """The bound tensor (fake for graph nodes, real for module parameters) or literal;
        a node without ``meta['val']`` is returned as the node itself."""
        return value_of(self.gm, self.bindings[name])


def value_of(gm: fx.GraphModule, bound: Any) -> Any:
    if isinstance(bound, ParamRef):
        return gm.get_parameter(bound.target) if _is_param(gm, bound.target) else gm.get_buffer(bound.target)
    if isinstance(bound, fx.Node):
        return bound.meta.get("val", bound)
    return bound


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    module, _, attr = target.rpartition(".")
    return attr in gm.get_submodule(module)._parameters


def _literal_eq(p: Any, t: Any) -> bool:
    if isinstance(t, (fx.Node, ParamRef)):
        return False
    if isinstance(p, (list, tuple)) and isinstance(t, (list, tuple)):
        return len(p) == len(t) and all(_literal_eq(a, b) for a, b in zip(p, t))
    if isinstance(p, bool) != isinstance(t, bool):
        return False
    try:
        return bool(type(p) is type(t) or isinstance(p, (int, float)) and isinstance(t, (int, float))) and p == t
    except Exception:
        return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (fx.Node, ParamRef)) or isinstance(b, (fx.Node, ParamRef)):
        return a == b if isinstance(a, ParamRef) and isinstance(b, ParamRef) else a is b
    return _literal_eq(a, b)


def _describe(value: Any) -> str:
    if isinstance(value, fx.Node):
        return f"node {value.name!r}"
    if isinstance(value, ParamRef):
        return f"module attribute {value.target!r}"
    return f"literal {value!r}"


@dataclass
class Failure:
    """Why a candidate did not match: the deepest point the matcher reached."""

    depth: int = -1
    reason: str = ""

    def note(self, depth: int, reason: str) -> None:
        if depth > self.depth:
            self.depth, self.reason = depth, reason


@dataclass
class StructuralMatcher:
    """Backtracking matcher over canonical forms, with a per-sweep canonical-form cache."""

    pattern: CompiledPattern
    cache: dict[fx.Node, Canon | None]
    failure: Failure = field(default_factory=Failure)

    def canon(self, node: fx.Node) -> Canon | None:
        try:
            return self.cache[node]
        except KeyError:
            form = self.cache[node] = canonicalize(node)
            return form

    def match(self, anchor: fx.Node) -> State | None:
        self.failure = Failure()
        return next(self._node(self.pattern.anchor, anchor, ({}, {})), None)

    def _node(self, p: fx.Node, g: Any, state: State) -> Iterator[State]:
        nodes, binds = state
        if p.op == "placeholder":
            name = p.target
            if name in binds and not _same(binds[name], g):
                self.failure.note(len(nodes), f"argument {name!r} is bound to {_describe(binds[name])} "
                                              f"but here it would be {_describe(g)}")
                return
            yield nodes, {**binds, name: g}
            return
        want = self.pattern.canon[p]
        if not isinstance(g, fx.Node):
            self.failure.note(len(nodes), f"pattern node {p.name!r} ({want.op}) met {_describe(g)}")
            return
        if p in nodes:
            if nodes[p] is g:
                yield state
            else:
                self.failure.note(len(nodes), f"pattern node {p.name!r} is already {nodes[p].name!r}, not {g.name!r}")
            return
        if any(v is g for v in nodes.values()):
            self.failure.note(len(nodes), f"node {g.name!r} is already matched to another pattern node")
            return
        have = self.canon(g)
        if have is None or have.op != want.op:
            self.failure.note(len(nodes), f"pattern node {p.name!r} expects `{want.op}`, node {g.name!r} is "
                                          f"`{have.op if have else g.op + ' ' + str(g.target)}`")
            return
        if len(have.args) != len(want.args):
            self.failure.note(len(nodes), f"node {g.name!r}: {len(have.args)} arguments, pattern has {len(want.args)}")
            return
        nodes = {**nodes, p: g}
        orders = [have.args]
        if want.op in COMMUTATIVE and len(have.args) >= 2:
            orders.append((have.args[1], have.args[0], *have.args[2:]))
        for args in orders:
            yield from self._args(want.args, args, 0, (nodes, binds), g)

    def _args(self, want: tuple, have: tuple, i: int, state: State, g: fx.Node) -> Iterator[State]:
        nodes, binds = state
        # holes, literals and wildcards bind deterministically: a loop, not a generator each
        while i < len(want):
            p, t = want[i], have[i]
            if isinstance(p, fx.Node):
                if p.op != "placeholder":
                    break
                if p.target in binds:
                    if not _same(binds[p.target], t):
                        self.failure.note(len(nodes), f"argument {p.target!r} is bound to "
                                                      f"{_describe(binds[p.target])} but here it would be {_describe(t)}")
                        return
                else:
                    binds = {**binds, p.target: t}
            elif isinstance(p, (list, tuple)) and any(isinstance(x, fx.Node) for x in p):
                break
            elif p is not ANY and not _literal_eq(p, t):
                self.failure.note(len(nodes), f"node {g.name!r} argument {i}: pattern literal {p!r} "
                                              f"does not match {_describe(t)}")
                return
            i += 1
        if i == len(want):
            yield nodes, binds
            return
        p = want[i]
        inner = (self._node(p, have[i], (nodes, binds)) if isinstance(p, fx.Node)
                 else self._arg(p, have[i], (nodes, binds), g, i))
        for next_state in inner:
            yield from self._args(want, have, i + 1, next_state, g)

    def _arg(self, p: Any, t: Any, state: State, g: fx.Node, i: int) -> Iterator[State]:
        if isinstance(p, fx.Node):
            yield from self._node(p, t, state)
        elif p is ANY:
            yield state
        elif isinstance(p, (list, tuple)) and any(isinstance(x, fx.Node) for x in p):
            if isinstance(t, (list, tuple)) and len(t) == len(p):
                yield from self._args(tuple(p), tuple(t), 0, state, g)
            else:
                self.failure.note(len(state[0]), f"node {g.name!r} argument {i}: expected a list of {len(p)}, got {t!r}")
        elif _literal_eq(p, t):
            yield state
        else:
            self.failure.note(len(state[0]), f"node {g.name!r} argument {i}: pattern literal {p!r} "
                                             f"does not match {_describe(t)}")


# --- soundness ------------------------------------------------------------------------

def _is_fresh(node: fx.Node, canon: Canon | None) -> bool:
    """Whether ``node`` holds a tensor no other value aliases (it was computed, not viewed)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        mine = storages_of(val)
        return not any(mine & storages_of(i.meta.get("val")) for i in node.all_input_nodes)
    return canon is not None and canon.op in FRESH_OPS and not canon.inplace


def _write_is_invisible(written: Any, matched: set[fx.Node], outputs: set[fx.Node],
                        matcher: StructuralMatcher) -> bool:
    """Whether an in-place write into ``written`` can be seen only inside the match: the
    tensor is fresh (no view of anything) and only the match reads it. An in-place result
    inside the match (``relu_`` of ``y += z``) is the storage of the tensor *it* wrote
    into, so the check follows the chain of writes down to the tensor that owns it."""
    while isinstance(written, fx.Node):
        if not (written in matched and written not in outputs or len(written.users) == 1):
            return False
        form = matcher.canon(written)
        if written not in matched or form is None or not form.inplace:
            return _is_fresh(written, form)
        written = form.args[0]
    return False


@dataclass
class SweepState:
    """Facts about the graph for one sweep: node positions (new nodes get fractions below
    their anchor's) and, computed only if a match spans many nodes, where the barriers are."""

    positions: dict[fx.Node, float]
    barriers: list[float] | None = None

    #: matches spanning at most this many nodes are checked by walking the span
    WALK_LIMIT = 64

    def barrier_between(self, gm: fx.GraphModule, first: fx.Node, anchor: fx.Node,
                        matched: set[fx.Node]) -> bool:
        """Whether a node outside ``matched`` that nothing may move across (an in-place
        write, a collective, an unknown op: :func:`fxopt.analysis.ops.is_barrier`) runs
        between ``first`` and ``anchor``: the rewrite computes the match at the anchor."""
        node, steps = first.next, 0
        while node is not anchor and steps < self.WALK_LIMIT:
            if node not in matched and is_barrier(node):
                return True
            node, steps = node.next, steps + 1
        if node is anchor:
            return False
        if self.barriers is None:  # a long span: index the barriers once for this sweep
            self.barriers = sorted(self.positions[n] for n in gm.graph.nodes
                                   if n in self.positions and is_barrier(n))
        lo = bisect.bisect_right(self.barriers, self.positions[first])
        hi = bisect.bisect_left(self.barriers, self.positions[anchor])
        inside = {self.positions[g] for g in matched if g in self.positions}
        return any(w not in inside for w in self.barriers[lo:hi])


def check_match(m: Match, rule: Rule, matcher: StructuralMatcher, sweep: SweepState) -> str | None:
    """The reason ``m`` must not be rewritten, or None if it is sound."""
    forms = matcher.cache  # every matched node was canonicalized while matching
    anchor = m.anchor
    outputs = set(m.outputs)
    matched = set(m.nodes.values())
    for g in list(matched):
        for extra in forms[g].interior:
            live = [u for u in extra.users if u is not g and u.users]
            if live:
                return f"node {extra.name!r} (part of {g.name!r}) is also used by {live[0].name!r}"
            matched.add(extra)
    first = anchor
    positions = sweep.positions
    for p, g in m.nodes.items():
        if positions[g] < positions[first]:
            first = g
        if g not in outputs:
            for u in g.users:
                if u not in matched:
                    return (f"node {g.name!r} (pattern {p.name!r}) is also used by {u.name!r} outside the "
                            "match; the rewrite would have to keep it (return it from the pattern to allow that)")
        form = forms[g]
        if form.inplace and not _write_is_invisible(form.args[0], matched, outputs, matcher):
            return (f"node {g.name!r} writes in place into {_describe(form.args[0])}, which is visible "
                    "outside the match; replacing it with an out-of-place computation would change the program")
    if first is not anchor and sweep.barrier_between(m.gm, first, anchor, matched):
        return ("an in-place write, collective or unknown op outside the match runs between the "
                "matched nodes; the rewrite would move computation across it")
    anchor_pos = positions[anchor]
    for out in outputs - {anchor}:
        early = [u for u in out.users if u not in matched and positions.get(u, anchor_pos + 1) < anchor_pos]
        if early:
            return (f"output {out.name!r} is used by {early[0].name!r} before the anchor {anchor.name!r}; "
                    "fxopt does not reorder nodes (that is what keeps rewrites acyclic)")
    return rule.check_constraints(m) if rule.constraints or rule.where else None
