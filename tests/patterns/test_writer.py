"""The rewrite step's graph edits (:mod:`fxopt.patterns.writer`): nodes created without
``create_node``'s argument scan must be indistinguishable from ones it creates."""

from __future__ import annotations

import operator

import fxopt.patterns as fp
import torch
import torch.fx as fx
from fxopt.patterns.writer import insert_node


def _chain(steps: int) -> fx.GraphModule:
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    for _ in range(steps):
        x = graph.call_function(torch.relu, (graph.call_function(operator.add, (x, y)),))
    graph.output(x)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_insert_node_matches_create_node() -> None:
    """Placed before ``at``, with the same name, arguments, immutable containers and users
    as ``create_node`` under ``inserting_before``."""
    ours, theirs = _chain(1), _chain(1)
    for gm, make in ((ours, insert_node), (theirs, None)):
        graph = gm.graph
        x, y, add, relu = (n for n in graph.nodes if n.op != "output")
        args, kwargs = (x, [y, 2]), {"k": (y,)}
        if make is None:
            with graph.inserting_before(relu):
                graph.create_node("call_function", torch.cat, args, kwargs, "cat")
        else:
            make(graph, relu, "call_function", torch.cat, args, kwargs, "cat")
        graph.lint()
    new, old = (next(n for n in gm.graph.nodes if n.name == "cat") for gm in (ours, theirs))
    assert (new.prev.name, new.next.name) == (old.prev.name, old.next.name) == ("add", "relu")
    assert type(new.args[1]) is type(old.args[1]) and type(new.kwargs) is type(old.kwargs)
    assert new.format_node() == old.format_node()
    assert [u.name for u in new.all_input_nodes] == [u.name for u in old.all_input_nodes]
    assert [n.name for n in ours.graph.find_nodes(op="call_function", target=torch.cat)] == ["cat"]
    assert ours.code == theirs.code


def test_create_node_hooks_see_the_arguments() -> None:
    """A module with creation hooks (export's metadata hook reads the new node's
    arguments) gets nodes from ``create_node`` whole."""
    gm = _chain(3)
    seen: list[tuple] = []
    gm._register_create_node_hook(lambda node: seen.append((node.name, node.args)))
    assert fp.replace(gm, lambda x, y: torch.relu(x + y), lambda x, y: torch.ops.fxopt.add_relu(x, y)) == 3
    assert [name for name, _ in seen] == ["add_relu", "add_relu_1", "add_relu_2"]
    assert all(len(args) == 2 for _, args in seen)
    gm.graph.lint()
