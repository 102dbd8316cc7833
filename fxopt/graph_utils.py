"""Small GraphModule helpers that several passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
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


def drop_unused_attributes(gm: fx.GraphModule) -> list[str]:
    """Erase the get_attr nodes nothing uses, then delete from ``gm`` every parameter,
    buffer, tensor attribute and submodule that no get_attr or call_module node names;
    return the qualified names deleted.

    Why: a rewrite that folds or fuses weights leaves the originals behind (a folded
    BatchNorm's four tensors, a fused conv's module). Kept, they make the model carry
    each weight twice, show up in ``state_dict`` and as dead nodes in every diff.
    Anything named by a node is kept with all it contains (a called submodule keeps all
    its parameters). Only the module tree of ``gm`` loses entries: the tensors themselves
    are never written, so a copy made by ``fxopt.optimize`` (which shares tensors with
    the user's model) can drop them without touching the user's model. Like the passes,
    it does not recompile ``gm``.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    # what each node's dotted target walks through: (holder, member) pairs, by object,
    # so a module reachable under two names keeps what either name needs
    needed: set[tuple[int, str]] = set()
    whole: set[int] = set()  # modules named by a node: kept with everything inside
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        obj: Any = gm
        for part in str(node.target).split("."):
            needed.add((id(obj), part))
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.Module):
            whole.update(id(m) for m in obj.modules())
    deleted: list[str] = []
    visited: set[int] = set()

    def visit(module: torch.nn.Module, prefix: str) -> None:
        if id(module) in whole or id(module) in visited:
            return
        visited.add(id(module))
        members = [*(k for k, v in module._parameters.items() if v is not None),
                   *(k for k, v in module._buffers.items() if v is not None),
                   *(k for k, v in module._modules.items() if v is not None),
                   *(k for k, v in vars(module).items() if isinstance(v, torch.Tensor))]
        for name in members:
            if (id(module), name) not in needed:
                delattr(module, name)
                deleted.append(prefix + name)
            elif isinstance(child := getattr(module, name), torch.nn.Module):
                visit(child, prefix + name + ".")

    visit(gm, "")
    return deleted
