"""Rules (pattern + replacement + constraints), applying them, and turning them into passes.

Applying rules is one forward sweep over the graph per round: each node's canonical op
is looked up in an index of the rules anchored at that op (so 50 rules cost a dict
lookup per node, not 50 match attempts), candidates are matched and checked
(:mod:`fxopt.patterns.matcher`), and a sound match is rewritten on the spot. Rules
anchored at the same op are tried largest pattern first, then in the order given;
nodes are visited in graph order: that is the whole overlap policy, and it is
deterministic. Rounds repeat until nothing changes (bounded), so a rewrite's result can
anchor a later rewrite.

The replacement is inlined at the anchor. New nodes get ``meta['val']`` /
``meta['tensor_meta']`` computed for the real shapes (by running them on the matched
inputs' fake values) and record the nodes they replace (:mod:`fxopt.provenance`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from fxopt.patterns.canon import Canon, ParamRef, quick_op
from fxopt.patterns.matcher import Match, StructuralMatcher, SweepState, check_match, value_of
from fxopt.patterns.pattern import (
    CompiledPattern,
    CompiledReplacement,
    compile_pattern,
    compile_replacement,
)
from torch._subclasses.fake_tensor import FakeTensor

from fxopt.analysis.shapes import record_value
from fxopt.errors import AnalysisError, PatternError
from fxopt.graph_utils import drop_unused_attributes
from fxopt.pass_protocol import Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

Constraint = Callable[[Any], bool]


@dataclass
class Rule:
    """A pattern, its replacement and the constraints a match must meet.

    ``constraints`` map a pattern argument to a predicate over its value
    (:meth:`Match.value`: a tensor, fake for graph nodes, or a literal); ``where``
    predicates receive the whole :class:`Match`.
    """

    pattern: CompiledPattern
    replacement: CompiledReplacement
    name: str
    constraints: dict[str, Constraint] = field(default_factory=dict)
    where: tuple[Callable[[Match], bool], ...] = ()

    @property
    def anchor_op(self) -> str:
        return self.pattern.canon[self.pattern.anchor].op

    def check_constraints(self, m: Match) -> str | None:
        for name, predicate in self.constraints.items():
            value = m.value(name)
            if not predicate(value):
                shown = "a node without meta['val'] (no shapes: pass example_inputs)" if isinstance(
                    value, fx.Node) else _short(value)
                return f"constraint {_name(predicate)} on argument {name!r} failed for {shown}"
        for predicate in self.where:
            if not predicate(m):
                return f"constraint {_name(predicate)} failed"
        return None


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return repr(value)


def rule(pattern: Callable, replacement: Callable, *, name: str | None = None,
         where: Callable[[Match], bool] | Sequence[Callable[[Match], bool]] = (),
         **constraints: Constraint) -> Rule:
    """Create a rule: both functions are traced and checked now, once.

    Raises :class:`fxopt.errors.PatternError` for an untraceable function, unused
    pattern arguments or dead code, a replacement that does not fit the pattern, or a
    constraint on an argument the pattern does not have.
    """
    compiled = compile_pattern(pattern)
    replacement_graph = compile_replacement(replacement, compiled)
    holes = {h.target for h in compiled.holes}
    for key in constraints:
        if key not in holes:
            raise PatternError(f"constraint on {key!r}: pattern {compiled.signature} has no such argument")
    where_tuple = (where,) if callable(where) else tuple(where)
    return Rule(compiled, replacement_graph, name or getattr(pattern, "__name__", "rule"),
                dict(constraints), where_tuple)


# --- applying rules ----------------------------------------------------------------------

def apply_rules(gm: fx.GraphModule, rules: Sequence[Rule], pass_name: str | None = None,
                max_rounds: int = 8) -> dict[str, int]:
    """Rewrite every sound match of ``rules`` in ``gm``; return the number of rewrites per
    rule. Does not recompile ``gm`` (the PassManager does; :func:`replace` does)."""
    index: dict[str, list[Rule]] = {}
    for r in sorted(rules, key=lambda r: -len(r.pattern)):  # stable: ties keep the given order
        index.setdefault(r.anchor_op, []).append(r)
    counts = dict.fromkeys((r.name for r in rules), 0)
    # a rewrite allocates a few objects per node but frees no cycles: the collector's full
    # passes over a large graph would otherwise cost more than the matching itself
    collecting = gc.isenabled()
    gc.disable()
    made_by: dict[fx.Node, Rule] = {}  # a rule never anchors at its own output (no loops)
    try:
        for _ in range(max_rounds):
            if not _sweep(gm, index, counts, pass_name, made_by):
                break
    finally:
        if collecting:
            gc.enable()
    return counts


def _sweep(gm: fx.GraphModule, index: dict[str, list[Rule]], counts: dict[str, int],
           pass_name: str | None, made_by: dict[fx.Node, Rule]) -> bool:
    """One forward pass over the graph; True if another could find more (a rewrite created
    a node some rule anchors at, or a match was refused before a later rewrite, which may
    have removed the reason)."""
    nodes = list(gm.graph.nodes)
    sweep = SweepState({n: float(i) for i, n in enumerate(nodes)})
    cache: dict[fx.Node, Canon | None] = {}
    matchers = {id(r): StructuralMatcher(r.pattern, cache) for rules in index.values() for r in rules}
    erased: set[fx.Node] = set()
    attrs: dict[str, fx.Node] = {}
    refused = again = False
    for node in nodes:
        if node in erased:
            continue
        candidates = index.get(quick_op(node))
        if not candidates:
            continue
        for r in candidates:
            if made_by.get(node) is r:
                continue
            matcher = matchers[id(r)]
            state = matcher.match(node)
            if state is None:
                continue
            m = Match(gm, r.pattern, *state)
            if check_match(m, r, matcher, sweep) is not None:
                refused = True
                continue
            created, gone = rewrite(m, r, sweep, cache, attrs, pass_name or r.name)
            erased |= gone
            counts[r.name] += 1
            for new in created:
                made_by[new] = r
            again = again or refused or any(quick_op(n) in index for n in created)
            break
    return again


def rewrite(m: Match, r: Rule, sweep: SweepState, cache: dict[fx.Node, Canon | None],
            attrs: dict[str, fx.Node], pass_name: str) -> tuple[list[fx.Node], set[fx.Node]]:
    """Inline ``r``'s replacement at the anchor of ``m``, reroute the outputs' users, erase
    the matched nodes; return the created and the erased nodes."""
    graph = m.anchor.graph
    anchor = m.anchor
    env: dict[fx.Node, Any] = {}
    created: list[fx.Node] = []
    outputs: Any = None
    lookup = env.__getitem__
    with graph.inserting_before(anchor):
        for rn in r.replacement.holes:
            bound = m.bindings[rn.target]
            if isinstance(bound, ParamRef):
                getter = attrs.get(bound.target)
                if getter is None:
                    getter = attrs[bound.target] = graph.get_attr(bound.target)
                    created.append(getter)
                bound = getter
            env[rn] = bound
        for rn in r.replacement.body:
            # plain tuple/dict: fx's immutable containers send create_node down a slow path
            args = tuple(fx.map_arg(rn.args, lookup))
            kwargs = dict(fx.map_arg(rn.kwargs, lookup)) if rn.kwargs else {}
            new = env[rn] = graph.create_node(rn.op, rn.target, args, kwargs, rn.name)
            created.append(new)
    outputs = fx.map_arg(r.replacement.output, lookup)
    new_outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    replaced = list(m.nodes.values())
    if "val" in anchor.meta:
        _propagate_meta(m.gm, created)
    for new in created:
        sweep.positions[new] = sweep.positions[anchor] - 0.5
        if new.op != "get_attr":
            record_replacement(new, replaced, pass_name)
    for old, new in zip(m.outputs, new_outputs):
        for user in old.users:
            cache.pop(user, None)
        old.replace_all_uses_with(new)
    erased: set[fx.Node] = set()
    positions = sweep.positions
    for g in sorted(replaced, key=positions.__getitem__, reverse=True):
        extras = list(cache[g].interior) if cache.get(g) else []
        if not g.users:
            graph.erase_node(g)
            erased.add(g)
        for extra in extras:
            for dead in [u for u in extra.users if not u.users]:
                graph.erase_node(dead)
                erased.add(dead)
            if not extra.users:
                graph.erase_node(extra)
                erased.add(extra)
        cache.pop(g, None)
    return created, erased


def _propagate_meta(gm: fx.GraphModule, created: list[fx.Node]) -> None:
    """Give new nodes ``meta['val']`` for the real shapes: run them on the fake values of
    their inputs (skipped when the graph carries no fake values)."""
    inputs = [i for n in created for i in n.all_input_nodes if i not in created]
    vals = [i.meta.get("val") for i in inputs]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None:
        return
    try:
        with mode, torch.no_grad():
            for node in created:
                if node.op == "get_attr":
                    record_value(node, mode.from_tensor(value_of(gm, ParamRef(node.target)), static_shapes=True))
                    continue
                args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
                if node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    value = node.target(*args, **kwargs)
                record_value(node, value)
    except Exception:  # an input without meta, an op fake tensors cannot run: leave it unknown
        for node in created:
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)


# --- one-shot use, explanations, passes --------------------------------------------------

def _as_rule(pattern: Callable | Rule, replacement: Callable | None, where: Any,
             constraints: dict[str, Constraint]) -> Rule:
    if isinstance(pattern, Rule):
        return pattern
    if replacement is None:
        raise PatternError("replace() needs a replacement function (or pass a Rule)")
    return rule(pattern, replacement, where=where, **constraints)


def replace(gm: fx.GraphModule, pattern: Callable | Rule, replacement: Callable | None = None, *,
            where: Callable[[Match], bool] | Sequence[Callable[[Match], bool]] = (),
            **constraints: Constraint) -> int:
    """One-shot rewrite, like ``torch.fx.subgraph_rewriter.replace_pattern`` but matching
    every spelling: returns the number of rewrites and recompiles ``gm``."""
    r = _as_rule(pattern, replacement, where, constraints)
    count = sum(apply_rules(gm, [r]).values())
    if count:
        gm.recompile()
    return count


def find_matches(gm: fx.GraphModule, pattern: Callable | Rule, **constraints: Constraint) -> list[Match]:
    """Every sound, non-overlapping match of ``pattern`` in ``gm``, without rewriting."""
    r = pattern if isinstance(pattern, Rule) else rule(pattern, pattern, **constraints)
    nodes = list(gm.graph.nodes)
    sweep = SweepState({n: float(i) for i, n in enumerate(nodes)})
    matcher = StructuralMatcher(r.pattern, {})
    taken: set[fx.Node] = set()
    found = []
    for node in nodes:
        if quick_op(node) != r.anchor_op:
            continue
        state = matcher.match(node)
        if state is None or taken & set(state[0].values()):
            continue
        m = Match(gm, r.pattern, *state)
        if check_match(m, r, matcher, sweep) is None:
            found.append(m)
            taken |= set(state[0].values())
    return found


def explain(gm: fx.GraphModule, pattern: Callable | Rule, node: fx.Node | str | None = None,
            **constraints: Constraint) -> str:
    """Why ``pattern`` does (not) match at ``node`` (a node or its name), or at every
    candidate anchor when no node is given: the sub-node, argument or constraint that
    failed, one line per candidate."""
    r = pattern if isinstance(pattern, Rule) else rule(pattern, pattern, **constraints)
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    if isinstance(node, str):
        if node not in by_name:
            raise KeyError(f"no node named {node!r} in the graph")
        node = by_name[node]
    sweep = SweepState({n: float(i) for i, n in enumerate(nodes)})
    matcher = StructuralMatcher(r.pattern, {})
    candidates = [node] if node is not None else [n for n in nodes if quick_op(n) == r.anchor_op]
    if not candidates:
        return (f"no node computes `{r.anchor_op}`, the op the pattern {r.pattern.signature} returns; "
                "nothing can match")
    lines = []
    for cand in candidates:
        op = quick_op(cand)
        if op != r.anchor_op:
            lines.append(f"{cand.name}: is `{op or cand.op}`, but the pattern's output is `{r.anchor_op}`; "
                         "pass the node that should become the pattern's output")
            continue
        state = matcher.match(cand)
        if state is None:
            lines.append(f"{cand.name}: no match: {matcher.failure.reason}")
            continue
        why = check_match(Match(gm, r.pattern, *state), r, matcher, sweep)
        lines.append(f"{cand.name}: " + ("matches" if why is None else f"matches structurally, but {why}"))
    return "\n".join(lines)


class RulePass(Pass):
    """A pass that applies a fixed list of rules (see :func:`register_rules`)."""

    rules: ClassVar[tuple[Rule, ...]] = ()
    #: evaluate, after rewriting, what now depends only on constants (folded weights)
    fold_constants: ClassVar[bool] = False

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        try:
            ctx.analysis("shapes")  # constraints on dtype/shape read meta['val']
        except AnalysisError:
            pass  # rules whose constraints need shapes simply do not fire
        counts = apply_rules(gm, self.rules, self.name)
        total = sum(counts.values())
        stats = {"rewrites": total, **{k: v for k, v in counts.items() if v}}
        if total and self.fold_constants:
            from fxopt.passes.cleanup import ConstantFold

            stats["constants_folded"] = ConstantFold().run(gm, ctx).stats.get("folded", 0)
        if total:
            drop_unused_attributes(gm)  # the replaced weights and modules nothing reads
        return PassResult(total > 0, stats)


def register_rules(name: str, rules: Iterable[Rule], description: str, *,
                   inference_only: bool = False, fold_constants: bool = False,
                   after: tuple[str, ...] = (), before: tuple[str, ...] = (),
                   replace: bool = False) -> type[RulePass]:
    """Register a pass called ``name`` that applies ``rules``; usable by name in
    ``fxopt.optimize(passes=[...])``, textual pipelines and the PassManager."""
    klass = type(_class_name(name), (RulePass,), {
        "name": name, "__doc__": description, "rules": tuple(rules),
        "inference_only": inference_only, "fold_constants": fold_constants,
        "after": after, "before": before,
        "__module__": _caller_module(),
    })
    return register_pass(klass, replace=replace)


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Pass"


def _caller_module() -> str:
    import sys

    return sys._getframe(2).f_globals.get("__name__", __name__)
