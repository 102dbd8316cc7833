"""Matching a compiled pattern at one anchor node, and the soundness checks of a match.

Matching walks the pattern backwards from its last output over canonical forms
(:mod:`fxopt.patterns.canon`), so it costs the pattern's size per candidate anchor, not
the graph's. Commutative ops try both operand orders (the given order first, so
overlaps resolve the same way every run). A structural match is then checked:

- interior nodes (matched, not returned by the pattern) have no users outside the match,
  so the rewrite can remove them;
- an in-place spelling is accepted only where its write is invisible: it writes into an
  interior node, or into a fresh tensor used by nothing else;
- an in-place pattern (``t.add_(1)``) matches only in-place spellings, and the
  replacement writes into what the matched code wrote into, nothing more, unless that
  tensor is invisible outside the match (never a graph input, parameter or anything
  the caller can see);
- the replacement is inserted right after its latest input, unless a node that writes,
  draws random numbers or is unknown lies between there and the last matched node; then
  it is inserted before the last matched node, no in-place write may fall between the
  matched nodes and no output may be used before that node (nodes are never reordered,
  so a rewrite can never create a cycle);
- interior nodes have no users outside the match but reads of their metadata that a
  same-shaped output can answer (``assert x.ndim == 4`` on a conv output that a folded
  conv replaces);
- the rule's constraints and its per-match callback accept it.

Every failure is phrased for :func:`fxopt.patterns.explain`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from fxopt.patterns.canon import Canon, ParamRef, canonicalize
from fxopt.patterns.pattern import ANY, CompiledPattern, CompiledReplacement

from fxopt.analysis.alias import storages_of
from fxopt.analysis.ops import (
    is_barrier,
    is_commutative,
    is_pure,
    is_random,
    mutated_inputs,
    only_checks,
    output_aliases,
    reads_only_metadata,
)

State = tuple[dict[fx.Node, fx.Node], dict[str, Any]]


class RuleChecks(Protocol):
    """What :func:`check_match` asks of a rule (:class:`fxopt.patterns.rules.Rule` is one).
    Declared here, not imported: rules.py builds on this module, so naming ``Rule`` here
    (even for types) closed an import loop."""

    constraints: dict[str, Any]
    where: tuple[Callable[[Match], bool], ...]
    callback: Callable[[Match], bool | None] | None

    def check_constraints(self, m: Match) -> str | None: ...

    def replacement_of(self, m: Match) -> CompiledReplacement | None: ...

@dataclass(slots=True)
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
    #: the last matched node in graph order: the replacement is inserted before it
    insert_at: fx.Node | None = None
    #: what replaces it (set once the match is accepted)
    replacement: Any = None
    #: an interior node has outside users that read only its metadata (found by the
    #: checks; the rewrite points them at the output with the same metadata)
    reads_metadata: bool = False
    #: the matched computation (what the rewrite removes), without the ``get_attr`` nodes
    #: a pattern's attributes matched; every check and the rewrite read it
    body: list[fx.Node] = field(init=False)
    #: the graph nodes the pattern's outputs matched, in the pattern's order
    outputs: list[fx.Node] = field(init=False)

    def __post_init__(self) -> None:
        canon, nodes = self.pattern.canon, self.nodes
        # no attribute matched (the usual pattern): the body is every matched node
        self.body = list(nodes.values()) if len(nodes) == len(canon) else [
            g for p, g in nodes.items() if p in canon]
        self.outputs = list(map(nodes.__getitem__, self.pattern.outputs))

    @property
    def anchor(self) -> fx.Node:
        return self.nodes[self.pattern.anchor]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def node(self, name: str) -> fx.Node | None:
        value = self.bindings[name]
        return value if isinstance(value, fx.Node) else None

    def module(self, name: str) -> torch.nn.Module | None:
        """The module that the graph node matched to pattern node ``name`` calls (an
        ``nn.GELU()`` in the pattern met ``self.act``), or None."""
        for p, g in self.nodes.items():
            if p.name == name and g.op == "call_module":
                return self.gm.get_submodule(g.target)
        return None

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


#: literal types compared by ``==`` alone (the usual literal: ``alpha=1``, ``dim=-1``)
_SCALARS = frozenset({int, float, bool, str, type(None)})


def _literal_eq(p: Any, t: Any) -> bool:
    if type(p) is type(t) and type(p) in _SCALARS:
        return p == t
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


#: the canonical-form cache has no entry for a node (None is a form: "no canonical form")
_UNSEEN = object()


@dataclass(slots=True)
class Failure:
    """Why a candidate did not match: the deepest point the matcher reached."""

    depth: int = -1
    reason: str = ""

    def note(self, depth: int, reason: str) -> None:
        if depth > self.depth:
            self.depth, self.reason = depth, reason


#: how the matcher reads one argument of a pattern op node
_HOLE, _SUB, _LIST, _ANY, _LITERAL = range(5)


def _kind(p: Any) -> int:
    """A pattern argument's kind: a hole binds, a sub-pattern (an op or attribute node, or
    a list holding pattern nodes) opens a branch, a literal must be equal, ANY matches."""
    if isinstance(p, fx.Node):
        return _HOLE if p.op == "placeholder" else _SUB
    if isinstance(p, (list, tuple)) and any(isinstance(x, fx.Node) for x in p):
        return _LIST
    return _ANY if p is ANY else _LITERAL


@dataclass(frozen=True, slots=True)
class _Want:
    """A pattern op node as the matcher reads it, worked out once per pattern rather than
    per candidate: its canonical form, the kind of each argument, and whether its first
    two operands may come in either order."""

    form: Canon
    kinds: tuple[int, ...]
    commutative: bool


@dataclass
class StructuralMatcher:
    """Backtracking matcher over canonical forms, with a per-sweep canonical-form cache.

    A step of the search returns the states it leads to: a tuple (none or one) where the
    step is decided on the spot (a hole, a literal, an attribute), a generator only where
    alternatives remain open (the operand orders of a commutative op, a sub-pattern
    inside an argument list), so a match costs a generator per branch point, not per node.
    A pattern op node is checked and its leading leaf arguments bound in one call: the
    matcher runs for every candidate anchor, and its cost is mostly calls.
    """

    pattern: CompiledPattern
    cache: dict[fx.Node, Canon | None]
    failure: Failure = field(default_factory=Failure)
    #: pattern op node -> how it matches
    wants: dict[fx.Node, _Want] = field(init=False)

    def __post_init__(self) -> None:
        self.wants = {p: _Want(form, tuple(map(_kind, form.args)),
                               is_commutative(form.op) and len(form.args) >= 2)
                      for p, form in self.pattern.canon.items()}

    def canon(self, node: fx.Node) -> Canon | None:
        # a sentinel, not KeyError: in a fresh sweep most lookups miss, and raising costs more
        form = self.cache.get(node, _UNSEEN)
        if form is _UNSEEN:
            form = self.cache[node] = canonicalize(node)
        return form

    def match(self, anchor: fx.Node) -> State | None:
        self.failure = Failure()
        states = self._call(self.pattern.anchor, anchor, ({}, {}))  # the anchor is an op node
        for output, known in self.pattern.extras:
            states = self._extra(output, known, states)
        for state in states:  # the first state, without next(iter(...))'s two calls
            return state
        return None

    def _extra(self, output: fx.Node, known: fx.Node, states: Iterable[State]) -> Iterator[State]:
        """Extend each state with a match of ``output``, searched among the users of
        what its input ``known`` matched."""
        for nodes, binds in states:
            if output in nodes:
                yield nodes, binds
                continue
            image = binds.get(known.target) if known.op == "placeholder" else nodes.get(known)
            if not isinstance(image, fx.Node):
                self.failure.note(len(nodes), f"output {output.name!r}: its input {known.name!r} "
                                              f"matched {_describe(image)}, which has no users to search")
                continue
            for user in list(image.users):
                yield from self._node(output, user, (nodes, binds))

    def _node(self, p: fx.Node, g: Any, state: State) -> Iterable[State]:
        if p.op == "placeholder":
            return self._hole(p.target, g, state)
        if p.op == "get_attr":  # a pattern module's tensor attribute: any attribute
            if isinstance(g, fx.Node) and g.op == "get_attr":
                return ({**state[0], p: g}, state[1]),
            self.failure.note(len(state[0]), f"pattern attribute {p.target!r} met {_describe(g)}")
            return ()
        return self._call(p, g, state)

    def _hole(self, name: str, g: Any, state: State) -> tuple[State, ...]:
        nodes, binds = state
        if name not in binds:
            return (nodes, {**binds, name: g}),
        if _same(binds[name], g):
            return state,
        self.failure.note(len(nodes), f"argument {name!r} is bound to {_describe(binds[name])} "
                                      f"but here it would be {_describe(g)}")
        return ()

    def _call(self, p: fx.Node, g: Any, state: State) -> Iterable[State]:
        """Pattern op node ``p`` at graph node ``g``: same canonical op, in place where the
        pattern is, as many arguments; then its arguments (both operand orders for a
        commutative op, the given order first)."""
        nodes, binds = state
        want = self.wants[p]
        form, depth = want.form, len(nodes)
        if not isinstance(g, fx.Node):
            self.failure.note(depth, f"pattern node {p.name!r} ({form.op}) met {_describe(g)}")
            return ()
        if p in nodes:
            if nodes[p] is g:  # reached again along another path of the pattern
                return state,
            self.failure.note(depth, f"pattern node {p.name!r} is already {nodes[p].name!r}, not {g.name!r}")
            return ()
        if g in nodes.values():  # nodes compare by identity
            self.failure.note(depth, f"node {g.name!r} is already matched to another pattern node")
            return ()
        have = self.cache.get(g, _UNSEEN)
        if have is _UNSEEN:
            have = self.cache[g] = canonicalize(g)
        if have is None or have.op != form.op:
            self.failure.note(depth, f"pattern node {p.name!r} expects `{form.op}`, node {g.name!r} is "
                                     f"`{have.op if have else g.op + ' ' + str(g.target)}`")
            return ()
        if form.inplace and not have.inplace:
            self.failure.note(depth, f"pattern node {p.name!r} writes in place, node {g.name!r} does not")
            return ()
        if len(have.args) != len(form.args):
            self.failure.note(depth, f"node {g.name!r}: {len(have.args)} arguments, pattern has {len(form.args)}")
            return ()
        state = {**nodes, p: g}, binds
        if want.commutative:
            return self._orders(want, have.args, state, g)
        return self._args(form.args, want.kinds, have.args, 0, state, g)

    def _orders(self, want: _Want, have: tuple, state: State, g: fx.Node) -> Iterator[State]:
        args, kinds = want.form.args, want.kinds
        yield from self._args(args, kinds, have, 0, state, g)
        yield from self._args(args, kinds, (have[1], have[0], *have[2:]), 0, state, g)

    def _args(self, want: tuple, kinds: tuple[int, ...], have: tuple, i: int, state: State,
              g: fx.Node) -> Iterable[State]:
        """States matching ``have[i:]`` to ``want[i:]``: the leading holes, literals and
        wildcards bind on the spot; the first sub-pattern opens a branch."""
        nodes, binds = state
        n = len(want)
        copied = False  # the caller's bindings stay as they were (other branches share them)
        while i < n:
            kind = kinds[i]
            if kind == _HOLE:
                name, t = want[i].target, have[i]
                if name not in binds:
                    if not copied:  # one copy for all the holes of this list, not one per hole
                        binds, copied = dict(binds), True
                    binds[name] = t
                elif not _same(binds[name], t):
                    self.failure.note(len(nodes), f"argument {name!r} is bound to {_describe(binds[name])} "
                                                  f"but here it would be {_describe(t)}")
                    return ()
            elif kind == _LITERAL:
                if not _literal_eq(want[i], have[i]):
                    self.failure.note(len(nodes), f"node {g.name!r} argument {i}: pattern literal {want[i]!r} "
                                                  f"does not match {_describe(have[i])}")
                    return ()
            elif kind != _ANY:  # a sub-pattern
                break
            i += 1
        state = nodes, binds
        if i == n:
            return state,
        if i + 1 == n:  # the last argument (``relu(add(x, y))``): its states are the list's
            return self._arg(want[i], kinds[i], have[i], state, g, i)
        return self._then(want, kinds, have, i, state, g)

    def _then(self, want: tuple, kinds: tuple[int, ...], have: tuple, i: int, state: State,
              g: fx.Node) -> Iterator[State]:
        for next_state in self._arg(want[i], kinds[i], have[i], state, g, i):
            yield from self._args(want, kinds, have, i + 1, next_state, g)

    def _arg(self, p: Any, kind: int, t: Any, state: State, g: fx.Node, i: int) -> Iterable[State]:
        """A sub-pattern argument: a pattern node, or a list holding pattern nodes."""
        if kind == _SUB:
            return self._node(p, t, state)
        if isinstance(t, (list, tuple)) and len(t) == len(p):
            p = tuple(p)
            return self._args(p, tuple(map(_kind, p)), tuple(t), 0, state, g)
        self.failure.note(len(state[0]), f"node {g.name!r} argument {i}: expected a list of {len(p)}, got {t!r}")
        return ()


# --- soundness ------------------------------------------------------------------------

def _is_fresh(node: fx.Node) -> bool:
    """Whether ``node`` holds a tensor no other value aliases (it was computed, not viewed):
    by storage where fake values exist, else by the op facts (an unknown op may return
    any of its inputs)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        mine = storages_of(val)
        return not any(mine & storages_of(i.meta.get("val")) for i in node.all_input_nodes)
    return not output_aliases(node) and not mutated_inputs(node)


def _write_is_invisible(written: Any, matched: set[fx.Node], outputs: set[fx.Node],
                        matcher: StructuralMatcher) -> bool:
    """Whether an in-place write into ``written`` can be seen only inside the match: the
    tensor is fresh (no view of anything) and only the match reads it. An in-place result
    inside the match (``relu_`` of ``y += z``) is the storage of the tensor *it* wrote
    into, so the check follows the chain of writes down to the tensor that owns it."""
    while isinstance(written, fx.Node):
        if not (written in matched and written not in outputs or set(written.users) <= matched):
            return False
        form = matcher.canon(written) if written in matched else None
        if form is None or not form.inplace:
            return _is_fresh(written)
        written = form.args[0]
    return False


def _blocks_move(node: fx.Node) -> bool:
    """Computation may not move across ``node``: it writes, is unknown, a collective,
    stateful, or draws random numbers (a random replacement would change the stream); a
    check (``torch._assert``) only raises, which moving pure code across cannot change."""
    return (is_barrier(node) or is_random(node)) and not only_checks(node)


@dataclass
class SweepState:
    """Facts about the graph for one sweep: node positions (new nodes get fractions below
    their insertion point's) and, computed only if a match spans many nodes, where the
    nodes that block a rewrite are."""

    positions: dict[fx.Node, float]
    blockers: dict[Callable[[fx.Node], bool], list[float]] = field(default_factory=dict)

    #: spans of at most this many nodes are checked by walking them
    WALK_LIMIT = 64

    def blocked(self, gm: fx.GraphModule, start: fx.Node, stop: fx.Node, matched: set[fx.Node],
                blocks: Callable[[fx.Node], bool]) -> bool:
        """Whether a node outside ``matched``, from ``start`` up to ``stop`` (excluded),
        is one that ``blocks``."""
        node, steps = start, 0
        while node is not stop and steps < self.WALK_LIMIT:
            if node not in matched and blocks(node):
                return True
            node, steps = node.next, steps + 1
        if node is stop:
            return False
        if blocks not in self.blockers:  # a long span: index the blockers once for this sweep
            self.blockers[blocks] = sorted(self.positions[n] for n in gm.graph.nodes
                                           if n in self.positions and blocks(n))
        index = self.blockers[blocks]
        lo = bisect.bisect_left(index, self.positions[start])
        hi = bisect.bisect_left(index, self.positions[stop])
        inside = {self.positions[g] for g in matched if g in self.positions}
        return any(w not in inside for w in index[lo:hi])


def _earliest_point(bindings: dict[str, Any], first: fx.Node, first_at: float,
                    positions: dict[fx.Node, float]) -> fx.Node:
    """The earliest node before which the replacement can run: right after its latest
    input (attributes excepted: they are read again where needed), or before the first
    matched node (at ``first_at``)."""
    latest, latest_at = None, first_at
    for b in bindings.values():  # one loop, no list: this runs for every candidate
        if isinstance(b, fx.Node) and b.op != "get_attr":
            at = positions[b]
            if latest is None or at > latest_at:
                latest, latest_at = b, at
    if latest is None or latest_at < first_at:
        return first
    return latest.next


def dead_uses(node: fx.Node, keep: fx.Node, limit: int = 8) -> list[fx.Node] | None:
    """The nodes that use ``node``, directly or not, other than ``keep``, when all of them
    are pure and nothing uses their results in the end (the unused statistics a decomposed
    ``native_group_norm`` returns, and their ``detach``); None when one is live."""
    found: list[fx.Node] = []
    stack = [u for u in node.users if u is not keep]
    while stack:
        u = stack.pop()
        if len(found) == limit or not is_pure(u):
            return None
        found.append(u)
        stack.extend(u.users)
    return found


def check_match(m: Match, rule: RuleChecks, matcher: StructuralMatcher, sweep: SweepState) -> str | None:
    """The reason ``m`` must not be rewritten, or None if it is sound. Sets
    ``m.insert_at``: as early as the inputs allow when nothing that blocks a move lies in
    between (then no user of an output can come before it), else the last matched node.
    Runs for every structural match: what only in-place spellings, metadata reads or
    outside users can fail is looked at only where they occur."""
    forms = matcher.cache  # every matched node was canonicalized while matching
    body = m.body
    matched = set(body)
    positions = sweep.positions
    first = last = body[0]  # one loop for both ends (same ties as min and max: the first wins)
    first_at = last_at = positions[first]
    writes = False  # some matched node is an in-place spelling
    for g in body:
        form = forms[g]
        if form.interior:
            why = _claim_interior(g, form.interior, matched)
            if why:
                return why
        writes = writes or form.inplace
        at = positions[g]
        if at < first_at:
            first, first_at = g, at
        elif at > last_at:
            last, last_at = g, at
    early = _earliest_point(m.bindings, first, first_at, positions)
    if early is not last and not sweep.blocked(m.gm, early, last, matched, _blocks_move):
        m.insert_at = early
        why = None
    else:
        m.insert_at = last
        why = _early_users(set(m.outputs), matched, last, positions)
        if not why and first is not last and sweep.blocked(m.gm, first.next, last, matched, _blocks_move):
            why = ("an in-place write, collective, random or unknown op outside the match runs between "
                   "the matched nodes; the rewrite would move computation across it")
    why = why or _outside_users(m, matched, positions) or (writes and _written_outside(m, matched, matcher))
    if why:
        return why
    if rule.constraints or rule.where or rule.callback:
        why = rule.check_constraints(m)
        if why:
            return why
    m.replacement = rule.replacement if rule.replacement_for is None else rule.replacement_of(m)
    if m.pattern.writes or m.replacement.writes:
        return _replacement_writes(m, matched, matcher)
    return None


def _claim_interior(g: fx.Node, interior: tuple[fx.Node, ...], matched: set[fx.Node]) -> str | None:
    """Add the pieces of ``g``'s canonical form (and their dead uses) to ``matched``, or
    say which of them is used elsewhere."""
    for extra in interior:
        dead = dead_uses(extra, g)
        if dead is None:
            live = next(u for u in extra.users if u is not g)
            return f"node {extra.name!r} (part of {g.name!r}) is also used by {live.name!r}"
        matched.add(extra)
        matched.update(dead)
    return None


def _outside_users(m: Match, matched: set[fx.Node], positions: dict[fx.Node, float]) -> str | None:
    """Interior nodes have no users outside the match, except reads of their metadata
    (``x.ndim``, ``x.shape[0]``) after the insertion point where an output has the same
    metadata (the rewrite points them at it)."""
    nodes = m.nodes
    for p in m.pattern.interior:
        g = nodes[p]
        for u in g.users:
            if u in matched:
                continue
            after = positions[m.insert_at]
            if not (p in m.pattern.meta_twins and reads_only_metadata(u)
                    and u.args[:1] == (g,) and positions.get(u, after) > after):
                return (f"node {g.name!r} (pattern {p.name!r}) is also used by {u.name!r} outside the "
                        "match; the rewrite would have to keep it (return it from the pattern to allow that)")
            m.reads_metadata = True
    return None


def _written_outside(m: Match, matched: set[fx.Node], matcher: StructuralMatcher) -> str | None:
    """A graph node that writes in place where the pattern does not must write invisibly."""
    outputs = set(m.outputs)
    for p, want in m.pattern.canon.items():
        g = m.nodes[p]
        form = matcher.cache.get(g)
        if form is not None and form.inplace and not want.inplace and \
                not _write_is_invisible(form.args[0], matched, outputs, matcher):
            return (f"node {g.name!r} writes in place into {_describe(form.args[0])}, which is visible "
                    "outside the match; replacing it with an out-of-place computation would change the program")
    return None


def _replacement_writes(m: Match, matched: set[fx.Node], matcher: StructuralMatcher) -> str | None:
    """What the replacement writes in place must be what the pattern writes, or invisible."""
    pattern_writes, replacement_writes = m.pattern.writes, m.replacement.writes
    outputs = set(m.outputs)
    for name in pattern_writes ^ replacement_writes:
        bound = m.bindings.get(name)
        if not _write_is_invisible(bound, matched, outputs, matcher):
            verb = "would write into" if name in replacement_writes else "drops the write into"
            return (f"the replacement {verb} argument {name!r} ({_describe(bound)}), which is visible "
                    "outside the match (a graph input, a parameter or a value used elsewhere)")
    return None


def _early_users(outputs: set[fx.Node], matched: set[fx.Node], last: fx.Node,
                 positions: dict[fx.Node, float]) -> str | None:
    last_pos = positions[last]
    for out in outputs - {last}:
        early = [u for u in out.users if u not in matched and positions.get(u, last_pos + 1) < last_pos]
        if early:
            return (f"output {out.name!r} is used by {early[0].name!r} before the last matched node "
                    f"{last.name!r}; fxopt does not reorder nodes (that is what keeps rewrites acyclic)")
    return None
