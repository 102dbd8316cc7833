"""The PassManager's own overhead on a 20,000-node graph.

A pipeline of 10 cheap passes (the five cleanups, twice) runs three ways over fresh
copies of the same graph, interleaved so that machine noise hits all three alike:

- by hand: ``p.run(gm, ctx)`` for each pass, ``gm.recompile()`` after each change;
- PassManager with instrumentation off (transactions only);
- PassManager with instrumentation on (timing, node counts, snapshots kept for diffs).

Verification is off in all three. Target: instrumented ≤ 1.10× by hand. Times are this
process's CPU time (``time.process_time``), which other load on the machine disturbs far
less than wall time.

    python bench/pass_manager.py [--nodes 20000] [--trials 7]
"""

from __future__ import annotations

import argparse
import copy
import operator
import platform
import statistics
import time

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.context import PassContext
from fxopt.pipeline import resolve
from fxopt.progress import progress

PIPELINE = ["remove_dropout", "eliminate_identity", "constant_fold", "cse", "dce"] * 2


def build_graph(nodes: int) -> fx.GraphModule:
    """A long elementwise chain with work for every pass: disabled dropout, duplicated
    subexpressions, dead branches and a parameter-only subexpression per segment."""
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(16))
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("w")
    while len(graph.nodes) < nodes:
        a = graph.call_function(operator.mul, (x, 1.5))
        b = graph.call_function(operator.mul, (x, 1.5))  # CSE twin of a
        c = graph.call_function(F.dropout, (a,), {"p": 0.1, "training": False})
        s = graph.call_function(torch.sigmoid, (w,))  # foldable
        d = graph.call_function(operator.add, (c, b))
        graph.call_function(torch.tanh, (d,))  # dead
        x = graph.call_function(operator.mul, (d, s))
    graph.output(x)
    gm = fx.GraphModule(root, graph)
    return gm.eval()


def by_hand(gm: fx.GraphModule) -> None:
    ctx = PassContext(gm)
    for p in resolve(PIPELINE):
        result = p.run(gm, ctx)
        if result.changed:
            gm.recompile()
            ctx.analyses.invalidate(p.preserves)


def with_manager(instrument: bool):
    def run(gm: fx.GraphModule) -> None:
        fxopt.PassManager(PIPELINE, instrument=instrument).run(gm)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    template = build_graph(args.nodes)
    fxopt.registered_passes()  # import every pass module once, outside the timed region
    variants = {"by hand": by_hand, "PassManager, instrumentation off": with_manager(False),
                "PassManager, instrumentation on": with_manager(True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    for _ in progress(range(args.trials), desc="trials", unit="trial"):
        for name, fn in variants.items():
            gm = copy.deepcopy(template)
            start = time.process_time()
            fn(gm)
            times[name].append(time.process_time() - start)
            results[name] = len(gm.graph.nodes)
    assert len(set(results.values())) == 1, f"variants disagree on the result: {results}"
    base = statistics.median(times["by hand"])
    print(f"graph: {len(template.graph.nodes)} nodes -> {results['by hand']} after the pipeline; "
          f"{len(PIPELINE)} passes; {args.trials} trials, median; torch {torch.__version__}; "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"{'variant':36s} {'median CPU s':>12s} {'vs by hand':>10s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:36s} {median:12.3f} {median / base:9.3f}x")


if __name__ == "__main__":
    main()
