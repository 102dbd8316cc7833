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


def _ladder(steps: int) -> fx.GraphModule:
    """Two chains feeding each other: every match binds the previous rewrite's output."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for _ in range(steps):
        a = graph.call_function(torch.relu, (graph.call_function(operator.add, (a, b)),))
        b = graph.call_function(torch.relu, (graph.call_function(operator.add, (b, a)),))
    graph.output(graph.call_function(operator.add, (a, b)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _by_hand(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.target is torch.relu and node.args[0].target is operator.add:
            add = node.args[0]
            with gm.graph.inserting_before(add):
                fused = gm.graph.call_function(torch.ops.fxopt.add_relu, add.args)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(add)
    gm.recompile()


def test_rewrites_feeding_rewrites_give_the_hand_written_graph() -> None:
    """Each rewrite of the ladder binds the node the one before created: the result is the
    graph a hand-written loop makes, node for node, and records what each node replaced."""
    ours, theirs = _ladder(4), _ladder(4)
    assert fp.replace(ours, lambda x, y: torch.relu(x + y), lambda x, y: torch.ops.fxopt.add_relu(x, y)) == 8
    _by_hand(theirs)
    ours.graph.lint()
    assert ours.code == theirs.code
    fused = [n for n in ours.graph.nodes if n.op == "call_function" and n.target is torch.ops.fxopt.add_relu]
    assert fused[1].args == (ours.graph.find_nodes(op="placeholder")[1], fused[0])
    assert [n.meta["fxopt.replaces"] for n in fused[:2]] == [["relu", "add"], ["relu_1", "add_1"]]
    a, b = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(ours(a, b), _ladder(4)(a, b))
