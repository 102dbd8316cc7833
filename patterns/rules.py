"""Rules (pattern + replacement + constraints), applying them, and turning them into passes.

Applying rules is one forward sweep over the graph per round: each node's canonical op
is looked up in an index of the rules anchored at that op (so 50 rules cost a dict
lookup per node, not 50 match attempts), candidates are matched and checked
(:mod:`fxopt.patterns.matcher`), and a sound match is rewritten on the spot. Rules
anchored at the same op are tried largest pattern first, then in the order given;
nodes are visited in graph order: that is the whole overlap policy, and it is
deterministic. Rounds repeat until nothing changes (bounded), so a rewrite's result can
anchor a later rewrite.

The replacement is inlined at the anchor (:mod:`fxopt.patterns.writer`). New nodes get
``meta['val']`` / ``meta['tensor_meta']`` computed for the real shapes (by running them on
the matched inputs' fake values) and record the nodes they replace (:mod:`fxopt.provenance`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from fxopt.patterns.canon import AnchorOps, quick_op
from fxopt.patterns.matcher import Match, StructuralMatcher, SweepState, check_match
from fxopt.patterns.pattern import (
    CompiledPattern,
    CompiledReplacement,
    PatternSource,
    compile_pattern,
    compile_replacement,
    per_match,
)
from fxopt.patterns.writer import Rewrite, Writer

from fxopt.errors import AnalysisError, PatternError, RuleError
from fxopt.graph_utils import drop_unused_attributes
from fxopt.pass_protocol import Pass, PassResult
from fxopt.pipeline import Conditional, SequencePass
from fxopt.registry import register_pass
from fxopt.snapshot import GraphSnapshot, ModuleState

Constraint = Callable[[Any], bool]


@dataclass
class Rule:
    """A pattern, its replacement and the constraints a match must meet.

    ``constraints`` map a pattern argument to a predicate over its value
    (:meth:`Match.value`: a tensor, fake for graph nodes, or a literal); ``where``
    predicates receive the whole :class:`Match`; ``callback`` sees every structurally
    sound match (its nodes, captured literals and modules: ``m.nodes``, ``m["arg"]``,
    ``m.module("arg")``) and vetoes it by returning False.
    """

    pattern: CompiledPattern
    replacement: CompiledReplacement | None
    name: str
    constraints: dict[str, Constraint] = field(default_factory=dict)
    where: tuple[Callable[[Match], bool], ...] = ()
    callback: Callable[[Match], bool | None] | None = None
    #: a replacement chosen per match (``rule(..., replacement_callback=...)``, torch.fx's
    #: ``replacement_callback``); wins over ``replacement``
    replacement_for: Callable[[Match], CompiledReplacement] | None = None

    def replacement_of(self, m: Match) -> CompiledReplacement:
        """The replacement for ``m``, once it passed the constraints."""
        if self.replacement_for is None:
            return self.replacement
        try:
            return self.replacement_for(m)
        except PatternError:
            raise
        except Exception as exc:
            raise RuleError(self.name, f"replacement callback raised {type(exc).__name__}: {exc}") from exc

    @property
    def anchor_op(self) -> str:
        return self.pattern.canon[self.pattern.anchor].op

    def check_constraints(self, m: Match) -> str | None:
        """Why the constraints or the callback refuse ``m`` (None if they accept it). A
        predicate that raises is the rule's error, reported with the rule and argument."""
        for name, predicate in self.constraints.items():
            value = m.value(name)
            if not self._ask(predicate, value, f"constraint {_name(predicate)} on argument {name!r}"):
                shown = "a node without meta['val'] (no shapes: pass example_inputs)" if isinstance(
                    value, fx.Node) else _short(value)
                return f"constraint {_name(predicate)} on argument {name!r} failed for {shown}"
        for predicate in self.where:
            if not self._ask(predicate, m, f"constraint {_name(predicate)}"):
                return f"constraint {_name(predicate)} failed"
        if self.callback is not None and self._ask(self.callback, m, "callback") is False:
            return f"callback {_name(self.callback)} vetoed the match"
        return None

    def _ask(self, predicate: Callable[[Any], Any], value: Any, what: str) -> Any:
        try:
            return predicate(value)
        except Exception as exc:
            raise RuleError(self.name, f"{what} raised {type(exc).__name__}: {exc}") from exc


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return repr(value)


def rule(pattern: PatternSource, replacement: PatternSource | None = None, *, name: str | None = None,
         where: Callable[[Match], bool] | Sequence[Callable[[Match], bool]] = (),
         callback: Callable[[Match], bool | None] | None = None,
         replacement_callback: Callable[[Match], PatternSource] | None = None,
         **constraints: Constraint) -> Rule:
    """Create a rule: the pattern and a fixed replacement are traced and checked now, once.

    Instead of a fixed ``replacement``, ``replacement_callback(match)`` may return the
    replacement (function, module or graph) for each match that passed the constraints;
    it is checked against the pattern like a fixed one, when it is returned.

    Raises :class:`fxopt.errors.PatternError` for an untraceable function, unused
    pattern arguments or dead code, a replacement that does not fit the pattern (or
    neither or both of ``replacement`` and ``replacement_callback``), or a constraint on
    an argument the pattern does not have.
    """
    compiled = compile_pattern(pattern)
    if (replacement is None) == (replacement_callback is None):
        raise PatternError(f"rule for pattern {compiled.signature}: give a replacement or a "
                           "replacement_callback (one of them)")
    fixed = None if replacement is None else compile_replacement(replacement, compiled)
    chosen = None if replacement_callback is None else per_match(replacement_callback, compiled)
    holes = {h.target for h in compiled.holes}
    for key in constraints:
        if key not in holes:
            raise PatternError(f"constraint on {key!r}: pattern {compiled.signature} has no such argument")
    where_tuple = (where,) if callable(where) else tuple(where)
    return Rule(compiled, fixed, name or getattr(pattern, "__name__", "rule"),
                dict(constraints), where_tuple, callback, chosen)


# --- applying rules ----------------------------------------------------------------------

def apply_rules(gm: fx.GraphModule, rules: Sequence[Rule], pass_name: str | None = None,
                max_rounds: int = 8, records: list[Rewrite] | None = None, *,
                keep_existing_attrs: bool = False) -> dict[str, int]:
    """Rewrite every sound match of ``rules`` in ``gm``; return the number of rewrites per
    rule, and append a :class:`Rewrite` per rewrite to ``records`` if given. Does not
    recompile ``gm`` (the PassManager does; :func:`replace` does)."""
    index: dict[str, list[Rule]] = {}
    for r in sorted(rules, key=lambda r: -len(r.pattern)):  # stable: ties keep the given order
        index.setdefault(r.anchor_op, []).append(r)
    counts = dict.fromkeys((r.name for r in rules), 0)
    writer = Writer(gm, pass_name, records, keep_existing_attrs)
    anchor_op = AnchorOps(index)
    # one matcher per rule for the whole application: they share the writer's form cache,
    # which each sweep empties
    matchers = {id(r): StructuralMatcher(r.pattern, writer.cache) for r in rules}
    for _ in range(max_rounds):
        if not _sweep(gm, index, anchor_op, matchers, counts, writer):
            break
    writer.remove_dead_attributes()
    return counts


def _sweep(gm: fx.GraphModule, index: dict[str, list[Rule]], anchor_op: AnchorOps,
           matchers: dict[int, StructuralMatcher], counts: dict[str, int], writer: Writer) -> bool:
    """One forward pass over the graph; True if another could find more (a rewrite created
    a node some rule anchors at, or a match was refused before a later rewrite, which may
    have removed the reason)."""
    nodes = list(gm.graph.nodes)
    writer.start_sweep(nodes)
    erased, made_by, sweep = writer.erased, writer.made_by, writer.sweep
    refused = again = False
    for node in nodes:
        if node in erased:
            continue
        candidates = index.get(anchor_op(node))
        if not candidates:
            continue
        for r in candidates:
            if made_by.get(node) is r:  # a rule never anchors at its own output (no loops)
                continue
            matcher = matchers[id(r)]
            state = matcher.match(node)
            if state is None:
                continue
            m = Match(gm, r.pattern, *state)
            if check_match(m, r, matcher, sweep) is not None:
                refused = True
                continue
            created = writer.rewrite(m, r)
            counts[r.name] += 1
            if not again:
                again = refused or _anchors_any(created, index, anchor_op)
            break
    return again


def _anchors_any(created: list[fx.Node], index: dict[str, list[Rule]], anchor_op: AnchorOps) -> bool:
    """Whether some rule anchors at a node a rewrite created (then another sweep may find
    more); a plain loop: ``any()`` of a generator costs a generator per rewrite."""
    for new in created:  # noqa: SIM110
        if anchor_op(new) in index:
            return True
    return False


# --- one-shot use, explanations, passes --------------------------------------------------

def _as_rule(pattern: Callable | Rule, replacement: PatternSource | None, where: Any,
             constraints: dict[str, Constraint],
             replacement_callback: Callable[[Match], PatternSource] | None = None) -> Rule:
    if isinstance(pattern, Rule):
        given = [name for name, value in (("replacement", replacement), ("where", where),
                                          ("replacement_callback", replacement_callback)) if value]
        if given or constraints:
            raise PatternError(f"replace: {', '.join(given + sorted(constraints))} given with a Rule, "
                               "which has its own: pass them to fxopt.patterns.rule instead")
        return pattern
    return rule(pattern, replacement, where=where, replacement_callback=replacement_callback, **constraints)


def replace(gm: fx.GraphModule, pattern: Callable | Rule, replacement: PatternSource | None = None, *,
            where: Callable[[Match], bool] | Sequence[Callable[[Match], bool]] = (),
            replacement_callback: Callable[[Match], PatternSource] | None = None,
            **constraints: Constraint) -> int:
    """One-shot rewrite, like ``torch.fx.subgraph_rewriter.replace_pattern`` but matching
    every spelling: returns the number of rewrites and recompiles ``gm``. The replacement
    may be chosen per match (``replacement_callback``, see :func:`rule`)."""
    r = _as_rule(pattern, replacement, where, constraints, replacement_callback)
    count = sum(apply_once(gm, [r]).values())
    if count:
        gm.recompile()
    return count


def apply_once(gm: fx.GraphModule, rules: Sequence[Rule], **options: Any) -> dict[str, int]:
    """:func:`apply_rules` outside a PassManager, all or nothing: if a rule's own code
    (a constraint, a callback) raises, the graph and module are put back as they were
    and the :class:`~fxopt.errors.RuleError` propagates. The snapshot is taken only
    for rules that run user code per match."""
    if not any(r.constraints or r.where or r.callback or r.replacement_for for r in rules):
        return apply_rules(gm, rules, **options)
    snapshot, state = GraphSnapshot.take(gm.graph), ModuleState(gm)
    try:
        return apply_rules(gm, rules, **options)
    except (RuleError, PatternError):
        state.restore()
        gm.graph = snapshot.build(gm)
        raise


def find_matches(gm: fx.GraphModule, pattern: Callable | Rule, **constraints: Constraint) -> list[Match]:
    """Every sound, non-overlapping match of ``pattern`` in ``gm``, without rewriting."""
    r = pattern if isinstance(pattern, Rule) else rule(pattern, pattern, **constraints)
    nodes = list(gm.graph.nodes)
    sweep = SweepState({n: float(i) for i, n in enumerate(nodes)})
    matcher = StructuralMatcher(r.pattern, {})
    taken: set[fx.Node] = set()
    found = []
    anchor_op = AnchorOps((r.anchor_op,))
    for node in nodes:
        if anchor_op(node) != r.anchor_op:
            continue
        state = matcher.match(node)
        if state is None:
            continue
        m = Match(gm, r.pattern, *state)
        if not taken & set(m.body) and check_match(m, r, matcher, sweep) is None:
            found.append(m)
            taken |= set(m.body)
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
    """A pass that applies a fixed list of rules (see :func:`register_rules`).

    Its stats hold the number of rewrites per rule and, under ``"matches"``, one
    ``(rule, matched node names, new node names)`` entry per rewrite."""

    rules: ClassVar[tuple[Rule, ...]] = ()

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.rewrote = False  # read by the constant folding that may follow (register_rules)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        try:
            ctx.analysis("shapes")  # constraints on dtype/shape read meta['val']
        except AnalysisError:
            pass  # rules whose constraints need shapes simply do not fire
        records: list[Rewrite] = []
        counts = apply_rules(gm, self.rules, self.name, records=records)
        total = sum(counts.values())
        self.rewrote = total > 0
        stats = {"rewrites": total, **{k: v for k, v in counts.items() if v},
                 "matches": [r.summary() for r in records]}
        if total:
            drop_unused_attributes(gm)  # the replaced weights and modules nothing reads
        return PassResult(total > 0, stats)


class _RulesThenFold(SequencePass):
    """The rules, then ``constant_fold`` if they rewrote something: evaluates ahead of time
    what now depends only on constants (folded weights). Both run through the manager,
    each recorded, transactional and verified like any pass."""

    rule_pass: ClassVar[type[RulePass]]

    def __init__(self) -> None:
        rules = self.rule_pass()

        def rules_rewrote(gm: fx.GraphModule, ctx: Any) -> bool:
            return rules.rewrote

        super().__init__([rules, Conditional(rules_rewrote, ["constant_fold"], name="fold constants",
                                             predicate_needs_fake_values=False)])


def register_rules(name: str, rules: Iterable[Rule], description: str, *,
                   inference_only: bool = False, fold_constants: bool = False,
                   after: tuple[str, ...] = (), before: tuple[str, ...] = (),
                   replace: bool = False, needs_fake_values: bool = True) -> type[Pass]:
    """Register a pass called ``name`` that applies ``rules``; usable by name in
    ``fxopt.optimize(passes=[...])``, textual pipelines and the PassManager. With
    ``fold_constants`` it is a sequence of the rules and ``constant_fold``.
    ``needs_fake_values=False`` declares that the rules' constraints read only shapes,
    dtypes and strides of ``meta['val']`` (``Pass.needs_fake_values``)."""
    attrs = {"name": name, "__doc__": description, "after": after, "before": before,
             "__module__": _caller_module(), "needs_fake_values": needs_fake_values}
    klass: type[Pass] = type(_class_name(name), (RulePass,), {
        **attrs, "rules": tuple(rules), "inference_only": inference_only})
    if fold_constants:
        klass = type(_class_name(name) + "Sequence", (_RulesThenFold,), {**attrs, "rule_pass": klass})
    return register_pass(klass, replace=replace)


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Pass"


def _caller_module() -> str:
    import sys

    return sys._getframe(2).f_globals.get("__name__", __name__)
