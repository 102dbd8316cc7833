"""Shrink a graph that makes a check fail down to a few nodes, and write it as a repro.

The reduction is delta debugging over graph surgery, greedy and in the order that
removes the most per attempt:

1. *re-root*: make a single node the graph's output (earliest first), dropping
   everything after it and everything it does not depend on;
2. *inline*: replace a node computing a plain number (``x.shape[1] // 4``) by that number;
3. *cut*: turn a node into a fresh graph input of the same shape and dtype, dropping
   everything it depended on;
4. *bypass*: replace a node by one of its inputs of the same shape and dtype;
5. *delete*: remove an unused node that is kept only for its side effect.

After each surgery, unused pure nodes go (in-place writes stay unless deleted in 5).

A candidate is kept only if the check still fails on it; the loop repeats until no
candidate is kept or the time is up. Candidates are built on copies, so the caller's
graph is never touched. Shapes come from ``meta['val']``, which every candidate keeps,
so the check can draw fresh inputs with :func:`fxopt.testing.inputs.random_inputs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx

from fxopt.analysis.ops import is_pure
from fxopt.errors import EquivalenceError, InputError, ReferenceFailureError
from fxopt.progress import progress as progress_bar
from fxopt.testing.equivalence import assert_equivalent
from fxopt.testing.inputs import random_inputs

Check = Callable[[fx.GraphModule], bool]


def node_count(gm: fx.GraphModule) -> int:
    """Nodes that compute or feed something: every node but the output."""
    return sum(1 for n in gm.graph.nodes if n.op != "output")


def pass_breaks(passes: Any, *, rtol: float | None = None, atol: float | None = None,
                seed: int = 0) -> Check:
    """A check for :func:`minimize`: true when running ``passes`` on a graph makes it
    compute something else (fresh inputs from ``meta['val']``, :func:`assert_equivalent`).

    The rewrite is compared on the inputs the passes saw and on a second draw they did
    not see (a pass may bake its example inputs in). A graph the reference cannot run,
    or that the pass rejects with an error, does not count as reproducing: minimizing
    must keep the *same* failure, not find another.
    """
    from fxopt.optimize import optimize  # lazily: fxopt.optimize imports this package

    def check(gm: fx.GraphModule) -> bool:
        try:
            inputs = random_inputs(gm, seed=seed)
            rewritten = optimize(gm, passes=passes, example_inputs=inputs)
        except Exception:
            return False
        for trial in (inputs, random_inputs(gm, seed=seed + 1)):
            try:
                assert_equivalent(gm, rewritten, trial, rtol=rtol, atol=atol, seed=seed, localize=False)
            except EquivalenceError:
                return True
            except ReferenceFailureError:
                return False
        return False

    return check


def minimize(gm: fx.GraphModule, still_fails: Check, *, example_inputs: Iterable[Any] | None = None,
             time_limit: float = 60.0, progress: bool | None = None) -> fx.GraphModule:
    """The smallest graph found within ``time_limit`` seconds on which ``still_fails``
    is true. ``gm`` itself must fail; its placeholders need ``meta['val']`` unless
    ``example_inputs`` are given to record it. A progress bar (the graph's size as it
    shrinks) appears after two seconds where stderr is a terminal; ``progress=False``
    hides it, ``True`` forces it (:mod:`fxopt.progress`)."""
    current = _copy(gm)
    if example_inputs is not None:
        from fxopt.optimize import optimize

        optimize(current, passes=[], example_inputs=tuple(example_inputs), inplace=True)
    if not still_fails(current):
        raise InputError("minimize: the check does not fail on the graph given; nothing to minimize")
    deadline = time.monotonic() + time_limit
    changed = True
    with progress_bar(desc="minimizing", unit="try", enabled=progress, delay=2.0) as bar:
        bar.set_postfix(nodes=node_count(current))
        while changed and time.monotonic() < deadline:
            changed = False
            for surgery, name, args in _plan(current):
                if time.monotonic() >= deadline:
                    break
                candidate = _attempt(current, surgery, name, *args)
                bar.update()
                if candidate is not None and node_count(candidate) < node_count(current) \
                        and still_fails(candidate):
                    current, changed = candidate, True
                    bar.set_postfix(nodes=node_count(current))
    current.recompile()
    return current


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy with its own graph and module tree, sharing tensors (never written)."""
    from fxopt.optimize import copy_sharing_tensors

    return copy_sharing_tensors(gm)


def _plan(gm: fx.GraphModule) -> list[tuple[Callable[..., bool], str, tuple[int, ...]]]:
    """The surgeries to try, biggest expected reduction first. Planned by node name, so
    a plan stays meaningful while earlier steps shrink the graph (gone names are skipped)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    plan: list[tuple[Callable[..., bool], str, tuple[int, ...]]] = []
    plan += [(_reroot, n.name, ()) for n in nodes]  # earliest root first: smallest graphs
    plan += [(_inline, n.name, ()) for n in nodes]
    plan += [(_cut, n.name, ()) for n in reversed(nodes)]  # cutting late nodes drops the most
    plan += [(_bypass, n.name, (i,)) for n in reversed(nodes) for i in range(len(n.all_input_nodes))]
    plan += [(_delete, n.name, ()) for n in nodes]
    return plan


def _attempt(gm: fx.GraphModule, surgery: Callable[..., bool], name: str, *args: Any) -> fx.GraphModule | None:
    """A copy of ``gm`` with ``surgery`` applied at node ``name``, or None if it does not apply."""
    if not any(n.name == name for n in gm.graph.nodes):
        return None
    candidate = _copy(gm)
    try:
        if not surgery(candidate.graph, _find(candidate, name), *args):
            return None
        _drop_dead(candidate)
        candidate.recompile()
    except Exception:
        return None
    return candidate


def _find(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _reroot(graph: fx.Graph, node: fx.Node) -> bool:
    if _tensor_val(node) is None:
        return False
    output = next(n for n in graph.nodes if n.op == "output")
    if output.args == (node,):
        return False
    output.args = (node,)
    graph._codegen = fx.graph.CodeGen()  # a plain single output: no pytree output spec
    return True


def _cut(graph: fx.Graph, node: fx.Node) -> bool:
    val = _tensor_val(node)
    if val is None or node.op == "placeholder":
        return False
    with graph.inserting_before(_first_non_placeholder(graph)):
        placeholder = graph.placeholder(f"cut_{node.name}")
    placeholder.meta["val"] = val
    node.replace_all_uses_with(placeholder)
    graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()
    return True


def _first_non_placeholder(graph: fx.Graph) -> fx.Node | None:
    return next((n for n in graph.nodes if n.op != "placeholder"), None)


_NUMBERS = (bool, int, float)


def _inline(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace a node whose value is a plain number (or a size) by the number itself."""
    val = node.meta.get("val")
    if isinstance(val, torch.Size):
        val = tuple(val)
    numbers = isinstance(val, _NUMBERS) or (isinstance(val, tuple) and all(isinstance(v, _NUMBERS) for v in val))
    if not numbers or not node.users or node.op == "placeholder":
        return False
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda n: val if n is node else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: val if n is node else n)
    graph.erase_node(node)
    return True


def _delete(graph: fx.Graph, node: fx.Node) -> bool:
    if node.users:
        return False
    graph.erase_node(node)
    return True


def _bypass(graph: fx.Graph, node: fx.Node, index: int) -> bool:
    val, source = _tensor_val(node), node.all_input_nodes[index]
    source_val = _tensor_val(source)
    if val is None or source_val is None or source_val.shape != val.shape or source_val.dtype != val.dtype:
        return False
    node.replace_all_uses_with(source)
    graph.erase_node(node)
    return True


def _drop_dead(gm: fx.GraphModule) -> None:
    """Remove unused pure nodes (repeatedly) and unused inputs; nodes kept for their
    side effects (in-place writes) stay: they may be what the bug is about."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if not node.users and (is_pure(node) or node.op == "placeholder"):
            graph.erase_node(node)
    used = {n.target.split(".")[0] for n in graph.nodes if n.op in ("call_module", "get_attr")}
    for name, _ in list(gm.named_children()):
        if name not in used:
            delattr(gm, name)

