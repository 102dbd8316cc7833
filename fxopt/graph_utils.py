"""Small GraphModule helpers that several passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.fx as fx


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target (a dotted path such as ``"layer1.0.weight"``) names."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def fresh_attr_name(gm: fx.GraphModule, base: str) -> str:
    """``base`` (dots made underscores), or ``base_N`` if ``gm`` already has that attribute."""
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _reach(nodes: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [m for n in nodes for m in step(n)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def upstream(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node the given nodes depend on, transitively (the nodes themselves excluded
    unless one depends on another)."""
    return _reach(nodes, lambda n: n.all_input_nodes)


def downstream(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node that depends on the given nodes, transitively (the nodes themselves
    excluded unless one depends on another)."""
    return _reach(nodes, lambda n: n.users)
