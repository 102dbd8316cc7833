"""Scaling of the add+ReLU rewrite: fxopt.patterns vs torch.fx replace_pattern vs a hand loop.

Graphs of 4k and 20k nodes (``--sizes`` for others), two shapes: a *chain*
(x = relu(x + y_i)) and a *ladder* (two chains that feed each other: a = relu(a + b); b = relu(b + a)). All three
methods run on fresh copies of the same graph, side by side in one run, and every result
is checked to compute the same function. ``replace_pattern`` is quadratic (one graph
walk per match in its cycle check), so it runs under a time cap and an over-cap run is
reported as a lower bound (its wall-clock time at the cap). The last column times 50
rules (49 that never fire, a third of them anchored at ReLU too) against the one rule.
Times are CPU seconds of this process (``time.process_time``, best of ``--repeat``), so a
busy shared machine inflates them less; each includes ``gm.recompile()``.

    .venv/bin/python bench/rewrite_scaling.py [--sizes 4000,20000] [--cap 120]
"""

from __future__ import annotations

import argparse
import copy
import gc
import multiprocessing as mp
import operator
import platform
import time

import fxopt.patterns as fp
import torch
import torch.fx as fx

import fxopt.compile.fused_ops  # noqa: F401 - torch.ops.fxopt.add_relu
from fxopt.progress import progress


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


def _replace_pattern_worker(kind: str, nodes: int, queue: mp.Queue) -> None:
    gm = build(kind, nodes)
    start = time.process_time()
    count = len(fx.subgraph_rewriter.replace_pattern(gm, pattern, replacement))
    queue.put((time.process_time() - start, count))


def time_replace_pattern(kind: str, nodes: int, cap: float) -> tuple[float, int | None, bool]:
    """(seconds, rewrites, finished); killed at ``cap`` seconds."""
    queue: mp.Queue = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=_replace_pattern_worker, args=(kind, nodes, queue))
    start = time.perf_counter()
    proc.start()
    proc.join(cap)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return time.perf_counter() - start, None, False
    seconds, count = queue.get()
    return seconds, count, True


def timed(fn, gm: fx.GraphModule) -> tuple[float, int]:
    gc.collect()
    start = time.process_time()
    count = fn(gm)
    return time.process_time() - start, count


def check_same(reference: fx.GraphModule, *graphs: fx.GraphModule) -> None:
    inputs = [torch.randn(8) for n in reference.graph.nodes if n.op == "placeholder"]
    expected = reference(*inputs)
    for gm in graphs:
        torch.testing.assert_close(gm(*inputs), expected)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4000,20000")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds allowed to replace_pattern")
    parser.add_argument("--repeat", type=int, default=3, help="best of N for fxopt and the hand loop")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}")
    one = fp.rule(pattern, replacement, name="add_relu")
    many = [one, *other_rules(49)]
    rows = []
    for kind in ("chain", "ladder"):
        for nodes in progress(sizes, desc=f"{kind} graphs", unit="size"):
            base = build(kind, nodes)
            n_nodes = len(base.graph.nodes)
            fx_times, hand_times, many_times = [], [], []
            for _ in range(args.repeat):
                g_fx, g_hand, g_many = (copy.deepcopy(base) for _ in range(3))
                fx_times.append(timed(lambda g: fp.replace(g, pattern, replacement), g_fx))
                hand_times.append(timed(hand_loop, g_hand))
                many_times.append(timed(lambda g: _apply(g, many), g_many))
            check_same(base, g_fx, g_hand, g_many)
            assert fx_times[0][1] == hand_times[0][1] == many_times[0][1], (fx_times, hand_times, many_times)
            t_fx, t_hand, t_many = (min(t for t, _ in ts) for ts in (fx_times, hand_times, many_times))
            rp = time_replace_pattern(kind, nodes, args.cap) if nodes == max(sizes) or args.cap > 0 else None
            rows.append((kind, n_nodes, fx_times[0][1], t_fx, t_hand, t_many, rp))
            _print_row(rows[-1])


def _apply(gm: fx.GraphModule, rules: list[fp.Rule]) -> int:
    count = sum(fp.apply_rules(gm, rules).values())
    gm.recompile()
    return count


def _print_row(row) -> None:
    kind, n_nodes, count, t_fx, t_hand, t_many, rp = row
    rp_s, rp_count, done = rp
    rp_text = f"{rp_s:8.2f}" if done else f">{rp_s:7.1f}"
    speedup = f"{rp_s / t_fx:6.0f}x" if done else f">{rp_s / t_fx:5.0f}x"
    print(f"{kind:7s} nodes={n_nodes:6d} rewrites={count:6d} | fxopt {t_fx:6.3f}s  hand {t_hand:6.3f}s "
          f"({t_fx / t_hand:4.2f}x hand) | replace_pattern {rp_text}s (fxopt {speedup} faster"
          f"{', matched ' + str(rp_count) if done else ', capped'}) | 50 rules {t_many:6.3f}s "
          f"({t_many / t_fx:4.2f}x one rule)", flush=True)


if __name__ == "__main__":
    main()
