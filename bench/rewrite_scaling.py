"""Scaling of the add+ReLU rewrite: fxopt.patterns vs torch.fx replace_pattern vs a hand loop.

Graphs of 4k and 20k nodes (``--sizes`` for others), two shapes: a *chain*
(x = relu(x + y_i)) and a *ladder* (two chains that feed each other: a = relu(a + b); b = relu(b + a)).
``fxopt.patterns.replace``, the hand loop and 50 rules (49 that never fire, a third of them
anchored at ReLU too, against the one rule) run on fresh copies of the same graph in
alternating rounds (the harness's ``alternate``), and every result is checked to compute
the same function. ``replace_pattern`` is quadratic (one graph walk per match in its cycle
check), so it runs once, on a graph of its own, stopped after ``--cap`` CPU seconds (``--cap
0``: not run); an over-cap run is reported as a lower bound, the cap. Times are CPU
seconds of the process (the harness's ``clocked``, best of ``--rounds``), so a busy shared
machine inflates them less; each includes ``gm.recompile()``. One row per shape and size.

    .venv/bin/python bench/rewrite_scaling.py [--sizes 4000,20000] [--cap 120] [--repeat 3]
    .venv/bin/python bench/rewrite_scaling.py --smoke      # 400 nodes, one round (CI)
"""

from __future__ import annotations

import contextlib
import copy
import operator
import signal
from collections.abc import Callable, Iterator
from typing import Any

import fxopt.patterns as fp
import torch
import torch.fx as fx
from harness import Record, alternate, cli, clocked, markdown_table

import fxopt.compile.fused_ops  # noqa: F401 - torch.ops.fxopt.add_relu


def build(kind: str, nodes: int) -> fx.GraphModule:
    """A GraphModule of about ``nodes`` nodes computing add+ReLU steps."""
    graph = fx.Graph()
    if kind == "chain":
        x = graph.placeholder("x")
        ys = [graph.placeholder(f"y{i}") for i in range(4)]
        for i in range(nodes // 2):
            x = graph.call_function(torch.relu, (graph.call_function(operator.add, (x, ys[i % 4])),))
        graph.output(x)
    else:
        a, b = graph.placeholder("a"), graph.placeholder("b")
        for _ in range(nodes // 4):
            a = graph.call_function(torch.relu, (graph.call_function(operator.add, (a, b)),))
            b = graph.call_function(torch.relu, (graph.call_function(operator.add, (b, a)),))
        graph.output(graph.call_function(operator.add, (a, b)))
    return fx.GraphModule(torch.nn.Module(), graph)


def pattern(x, y):
    return torch.relu(x + y)


def replacement(x, y):
    return torch.ops.fxopt.add_relu(x, y)


def hand_loop(gm: fx.GraphModule) -> int:
    """What one writes by hand for exactly this spelling: relu(operator.add) with a
    single-use add."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.relu:
            add = node.args[0]
            if isinstance(add, fx.Node) and add.target is operator.add and len(add.users) == 1:
                with gm.graph.inserting_before(node):
                    fused = gm.graph.call_function(torch.ops.fxopt.add_relu, add.args)
                node.replace_all_uses_with(fused)
                gm.graph.erase_node(node)
                gm.graph.erase_node(add)
                count += 1
    gm.recompile()
    return count


def check_same(reference: fx.GraphModule, *graphs: fx.GraphModule) -> None:
    inputs = [torch.randn(8) for n in reference.graph.nodes if n.op == "placeholder"]
    expected = reference(*inputs)
    for gm in graphs:
        torch.testing.assert_close(gm(*inputs), expected)


class CapReached(Exception):
    """replace_pattern ran out of its CPU seconds."""


@contextlib.contextmanager
def cpu_cap(seconds: float) -> Iterator[None]:
    """Raise :class:`CapReached` in the body once it has used ``seconds`` of this process's
    CPU time (a profiling timer: the clock the figures are in)."""
    def stop(signum: int, frame: Any) -> None:
        raise CapReached

    previous = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def replace_pattern_row(kind: str, nodes: int, cap: float) -> dict[str, Any]:
    """torch.fx's ``replace_pattern`` on a fresh graph, stopped after ``cap`` CPU seconds (it
    is quadratic): the ``replace_pattern_*`` fields of a row, its seconds the cap when capped."""
    if cap <= 0:
        return {}
    gm = build(kind, nodes)
    try:
        with cpu_cap(cap):
            run = clocked(lambda: len(fx.subgraph_rewriter.replace_pattern(gm, pattern, replacement)))
    except CapReached:  # the graph is left half rewritten: it was a copy of its own
        return {"replace_pattern_s": cap, "replace_pattern_capped": True}
    return {"replace_pattern_s": run.cpu_s, "replace_pattern_capped": False, "replace_pattern_rewrites": run.value}


def rewrites(kind: str, nodes: int, rounds: int, many: list[fp.Rule]) -> dict[str, Any]:
    """fxopt's one rule, the hand loop and fxopt's 50 rules on one graph: best CPU seconds of
    each over alternating rounds, checked to rewrite alike and to compute the same function."""
    base = build(kind, nodes)
    methods: dict[str, Callable[[fx.GraphModule], int]] = {
        "fxopt_s": lambda g: fp.replace(g, pattern, replacement), "hand_s": hand_loop,
        "rules50_s": lambda g: _apply(g, many)}
    done: dict[str, tuple[fx.GraphModule, int]] = {}

    def cpu_s(name: str) -> float:
        g = copy.deepcopy(base)
        run = clocked(lambda: methods[name](g))
        done[name] = g, run.value
        return run.cpu_s

    times = alternate({name: name for name in methods}, rounds, cpu_s)
    check_same(base, *(g for g, _ in done.values()))
    counts = {name: count for name, (_, count) in done.items()}
    assert len(set(counts.values())) == 1, f"the methods rewrote differently: {counts}"
    best = {name: min(samples) for name, samples in times.items()}
    return {"kind": kind, "nodes": len(base.graph.nodes), "rewrites": counts["fxopt_s"], **best,
            "fxopt_vs_hand": best["fxopt_s"] / best["hand_s"], "rules50_vs_one": best["rules50_s"] / best["fxopt_s"]}


def other_rules(count: int) -> list[fp.Rule]:
    """``count`` rules that do not fire on these graphs: other activations over other
    binary ops, and ReLU over other binary ops (same anchor op, different inner op)."""
    acts = [torch.relu, torch.sigmoid, torch.tanh, torch.nn.functional.gelu, torch.nn.functional.silu,
            torch.exp, torch.abs, torch.neg, torch.sqrt]
    binops = [torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum, torch.atan2]
    rules = []
    for act in acts:
        for op in binops:
            rules.append(_swap_rule(act, op))
            if len(rules) == count:
                return rules
    return rules


def _swap_rule(act, op) -> fp.Rule:
    def pat(x, y):
        return act(op(x, y))

    def rep(x, y):
        return act(op(y, x))

    return fp.rule(pat, rep, name=f"{act.__name__}_{op.__name__}")


def _apply(gm: fx.GraphModule, rules: list[fp.Rule]) -> int:
    count = sum(fp.apply_rules(gm, rules).values())
    gm.recompile()
    return count


def describe(row: dict[str, Any]) -> str:
    if "replace_pattern_s" in row:
        bound = ">" if row["replace_pattern_capped"] else ""
        rp = (f"replace_pattern {bound}{row['replace_pattern_s']:.2f}s (fxopt {bound}"
              f"{row['replace_pattern_s'] / row['fxopt_s']:.0f}x faster"
              + (", capped)" if bound else f", matched {row['replace_pattern_rewrites']})"))
    else:
        rp = "replace_pattern not run"
    return (f"{row['kind']:7s} nodes={row['nodes']:6d} rewrites={row['rewrites']:6d} | fxopt {row['fxopt_s']:6.3f}s "
            f"hand {row['hand_s']:6.3f}s ({row['fxopt_vs_hand']:4.2f}x hand) | {rp} | 50 rules "
            f"{row['rules50_s']:6.3f}s ({row['rules50_vs_one']:4.2f}x one rule)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4000,20000")
    parser.add_argument("--cap", type=float, default=120.0, help="CPU seconds allowed to replace_pattern (0: not run)")
    parser.add_argument("--repeat", dest="rounds", type=int, help="the old name of --rounds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.cap, args.rounds = "400", 30.0, 1
    record = Record("rewrite_scaling", args, "cpu")
    many = [fp.rule(pattern, replacement, name="add_relu"), *other_rules(49)]
    for kind in ("chain", "ladder"):
        for nodes in (int(s) for s in args.sizes.split(",")):
            row = record.add({**rewrites(kind, nodes, args.rounds, many), **replace_pattern_row(kind, nodes, args.cap)})
            print(describe(row), flush=True)
    print(markdown_table(record.rows, ["kind", "nodes", "rewrites", "fxopt_s", "hand_s", "fxopt_vs_hand",
                                       "replace_pattern_s", "rules50_s", "rules50_vs_one"]))
    return record.data


if __name__ == "__main__":
    main()
