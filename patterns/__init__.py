"""fxopt.patterns: rewrite rules written as plain Python functions.

A *pattern* and its *replacement* are functions, traced once when the rule is created.
A pattern written with any spelling of an op matches every spelling of it
(:mod:`fxopt.patterns.canon`), at torch level and ATen level::

    import fxopt.patterns as fp

    def pattern(x, y):
        return torch.relu(x + y)

    def replacement(x, y):
        return torch.ops.fxopt.add_relu(x, y)

    fp.replace(gm, pattern, replacement)                  # one shot: number of rewrites
    fp.register_rules("my_fusion", [fp.rule(pattern, replacement)], "what it does")
    fxopt.optimize(gm, passes=["my_fusion"])              # or as a registered pass

Constraints: ``fp.rule(pattern, replacement, x=fp.dtype_in(torch.half), where=...)``;
a per-match veto: ``fp.rule(..., callback=lambda m: ...)``; a replacement chosen per match:
``fp.rule(pattern, replacement_callback=lambda m: ...)``.
Why something did not match: ``print(fp.explain(gm, pattern, "relu_3"))``.
Porting a ``torch.fx`` script: ``fp.replace_pattern`` and ``fp.replace_pattern_with_filters``
have its signatures and return types.
"""

from fxopt.patterns.canon import Canon, ParamRef, canonicalize
from fxopt.patterns.compat import replace_pattern, replace_pattern_with_filters
from fxopt.patterns.constraints import (
    dtype_in,
    equals,
    is_tensor,
    only_used_by_match,
    rank,
    single_use,
)
from fxopt.patterns.matcher import Match
from fxopt.patterns.pattern import ANY
from fxopt.patterns.rules import (
    Rewrite,
    Rule,
    RulePass,
    apply_rules,
    explain,
    find_matches,
    register_rules,
    replace,
    rule,
)

import fxopt.compile.fused_ops  # noqa: F401 - the torch.ops.fxopt.* ops replacements call

__all__ = [
    "ANY", "Canon", "Match", "ParamRef", "Rewrite", "Rule", "RulePass", "apply_rules",
    "canonicalize", "dtype_in", "equals", "explain", "find_matches", "is_tensor",
    "only_used_by_match", "rank", "register_rules", "replace", "replace_pattern",
    "replace_pattern_with_filters", "rule", "single_use",
]
