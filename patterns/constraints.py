"""Ready-made constraints for rules.

Per-argument constraints receive :meth:`Match.value`: a tensor (fake for graph nodes,
real for module parameters), a literal, or, for a node the shape analysis has not
reached, the node itself; the tensor predicates are false for such a node (they cannot
know), which :func:`fxopt.patterns.explain` reports as "no shapes". Whole-match
constraints (``where=``) receive the :class:`~fxopt.patterns.matcher.Match`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from fxopt.patterns.matcher import Match

#: calls that yield Python numbers or shapes, not tensors
_SCALAR_CALLS = frozenset({"size", "dim", "numel", "item", "tolist", "__len__", "stride", "getattr",
                           "sym_size", "sym_numel", "sym_stride", "len"})


def is_tensor(value: Any) -> bool:
    """A tensor: known from meta, or (without meta) a node that does not call something
    known to produce a Python number (``x.size(0)``, ``x.shape``, ``len(x)``...)."""
    if isinstance(value, fx.Node):
        name = value.target if isinstance(value.target, str) else getattr(value.target, "__name__", "")
        if value.op == "call_function" and getattr(value.target, "__name__", "") == "getitem":
            return is_tensor(value.args[0])
        return not (value.op in ("call_method", "call_function") and name.split(".")[-1] in _SCALAR_CALLS)
    return isinstance(value, torch.Tensor)


def dtype_in(*dtypes: torch.dtype) -> Callable[[Any], bool]:
    """The tensor's dtype is one of ``dtypes``."""

    def dtype_in(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dtype in dtypes

    return dtype_in


def rank(n: int) -> Callable[[Any], bool]:
    """The tensor has ``n`` dimensions."""

    def rank(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == n

    rank.__name__ = f"rank({n})"
    return rank


def equals(expected: Any) -> Callable[[Any], bool]:
    """The literal equals ``expected`` (for captured literals)."""

    def equals(value: Any) -> bool:
        return not isinstance(value, (torch.Tensor, fx.Node)) and value == expected

    equals.__name__ = f"equals({expected!r})"
    return equals


def single_use(*names: str) -> Callable[[Match], bool]:
    """Each named argument is a node with exactly one user (the match)."""

    def single_use(m: Match) -> bool:
        return all(isinstance(m[n], fx.Node) and len(m[n].users) == 1 for n in names)

    single_use.__name__ = f"single_use({', '.join(names)})"
    return single_use


def only_used_by_match(*names: str) -> Callable[[Match], bool]:
    """Each named argument's node is used by matched nodes only."""

    def only_used_by_match(m: Match) -> bool:
        matched = set(m.nodes.values())
        return all(isinstance(m[n], fx.Node) and set(m[n].users) <= matched for n in names)

    only_used_by_match.__name__ = f"only_used_by_match({', '.join(names)})"
    return only_used_by_match
