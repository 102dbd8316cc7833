"""``replace_pattern`` and ``replace_pattern_with_filters`` with torch.fx's signatures,
semantics and return types.

A script written against ``torch.fx.subgraph_rewriter`` ports by changing one import::

    from fxopt.patterns import replace_pattern_with_filters   # was: from torch.fx.subgraph_rewriter ...

    matches = replace_pattern_with_filters(gm, pattern, replacement, match_filters=[...])

Patterns and replacements may be functions, ``nn.Module`` s, ``GraphModule`` s or
``fx.Graph`` s; replacement arguments pair with pattern arguments by position; filters and
``replacement_callback`` receive torch's ``InternalMatch``, the graph and the pattern
graph; attributes (submodules, parameters, buffers, constants) a replacement uses are
copied into ``gm`` unless ``gm`` already has one of that name, and unused submodules are
deleted afterwards. ``replace_pattern`` returns torch's ``Match`` list,
``replace_pattern_with_filters`` its ``ReplacedPatterns`` list. What differs (every
spelling of an op matches, linear time, soundness refusals, ``meta['val']`` on new nodes)
is in ``docs/replace_pattern.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.matcher import Match
from fxopt.patterns.pattern import (
    PatternSource,
    compile_pattern,
    compile_replacement,
    describe,
    per_match,
)
from fxopt.patterns.rules import Rewrite, Rule, apply_once
from torch.fx.passes.utils.matcher_utils import InternalMatch
from torch.fx.subgraph_rewriter import Match as TorchMatch
from torch.fx.subgraph_rewriter import ReplacedPatterns

from fxopt.errors import PatternError

MatchFilter = Callable[[InternalMatch, fx.Graph, fx.Graph], bool]


def internal_match(m: Match) -> InternalMatch:
    """``m`` as torch.fx's ``InternalMatch``: pattern node -> graph node (a pattern
    argument -> what it bound, a node or a literal), in pattern order."""
    pattern = m.pattern
    nodes_map: dict[fx.Node, Any] = {}
    for node in pattern.graph.nodes:
        if node.op == "placeholder":
            nodes_map[node] = m.bindings[node.target]
        elif node in m.nodes:
            nodes_map[node] = m.nodes[node]
    return InternalMatch(anchors=[m.anchor], nodes_map=nodes_map,
                         placeholder_nodes=[m.bindings[h.target] for h in pattern.holes],
                         returning_nodes=m.outputs)


def replace_pattern(gm: fx.GraphModule, pattern: PatternSource,
                    replacement: PatternSource | None = None) -> list[TorchMatch]:
    """Replace every sound, non-overlapping match of ``pattern`` in ``gm`` (torch.fx's
    ``replace_pattern``); returns one torch ``Match`` (anchor, nodes_map) per rewrite, in
    graph order, and recompiles ``gm``. Errors as :func:`replace_pattern_with_filters`."""
    return [TorchMatch(r.anchor, r.nodes_map) for r in replace_pattern_with_filters(gm, pattern, replacement)]


def replace_pattern_with_filters(
        gm: fx.GraphModule, pattern: PatternSource, replacement: PatternSource | None = None,
        match_filters: Sequence[MatchFilter] | None = None, ignore_literals: bool = False,
        replacement_callback: Callable[[InternalMatch, fx.Graph, fx.Graph], fx.Graph] | None = None,
) -> list[ReplacedPatterns]:
    """Replace every sound, non-overlapping match of ``pattern`` in ``gm`` that all
    ``match_filters`` accept (torch.fx's ``replace_pattern_with_filters``), with
    ``replacement`` or, per match, the graph ``replacement_callback`` returns; returns one
    ``ReplacedPatterns`` (anchor, nodes_map, replacements) per rewrite, in graph order,
    and recompiles ``gm``.

    Raises :class:`fxopt.errors.PatternError` for an untraceable pattern or replacement,
    or one whose arguments do not pair with the pattern's (the graph is untouched), and
    :class:`fxopt.errors.RuleError` if a filter or the callback raises.
    """
    compiled = compile_pattern(pattern, ignore_literals=ignore_literals)
    if replacement is None and replacement_callback is None:
        raise PatternError(f"replace_pattern({describe(pattern)}): give a replacement or a "
                           "replacement_callback")
    fixed = None if replacement is None else compile_replacement(replacement, compiled, positional=True)
    filters = list(match_filters or ())

    def accept(m: Match) -> bool:
        internal = internal_match(m)
        return all(f(internal, gm.graph, compiled.graph) for f in filters)

    r = Rule(compiled, fixed, f"replace_pattern({describe(pattern)})",
             callback=accept if filters else None,
             replacement_for=None if replacement_callback is None else per_match(
                 lambda m: replacement_callback(internal_match(m), gm.graph, compiled.graph), compiled,
                 positional=True))
    records: list[Rewrite] = []
    apply_once(gm, [r], pass_name="replace_pattern", max_rounds=1, records=records,
               keep_existing_attrs=True)
    gm.recompile()
    if isinstance(replacement, nn.Module):
        gm.delete_all_unused_submodules()
    return [ReplacedPatterns(rec.match.anchor, internal_match(rec.match).nodes_map, rec.replacements)
            for rec in records]

