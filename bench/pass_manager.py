"""The PassManager's own overhead on a 20,000-node graph.

A pipeline of 10 cheap passes (the five cleanups, twice) runs three ways over fresh
copies of the same graph, interleaved so that machine noise hits all three alike:

- by hand: ``p.run(gm, ctx)`` for each pass, ``gm.recompile()`` after each change;
- PassManager with instrumentation off (transactions only);
- PassManager with instrumentation on (timing, node counts, snapshots kept for diffs).

Verification is off in all three. Target: instrumented ≤ 1.10× by hand. Times are this
process's CPU time (``time.process_time``), which other load on the machine disturbs far
less than wall time.

    python bench/pass_manager.py [--nodes 20000] [--trials 7]    # bench/results/cpu/pass_manager.json
    python bench/pass_manager.py --smoke                          # 500 nodes, 2 trials (CI)
"""

from __future__ import annotations

import copy
import operator
import time
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from harness import Record, alternate, cli, markdown_table, median

import fxopt
from fxopt.context import PassContext
from fxopt.pipeline import resolve

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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=7)
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--trials", dest="rounds", type=int, help="the old name of --rounds")
    args = parser.parse_args(argv)
    nodes, rounds = (500, 2) if args.smoke else (args.nodes, args.rounds)
    record = Record("pass_manager", args, "cpu")
    template = build_graph(nodes)
    fxopt.registered_passes()  # import every pass module once, outside the timed region
    variants = {"by hand": by_hand, "PassManager, instrumentation off": with_manager(False),
                "PassManager, instrumentation on": with_manager(True)}
    results = {}

    def cpu_seconds(name: str) -> float:
        gm = copy.deepcopy(template)
        start = time.process_time()
        variants[name](gm)
        seconds = time.process_time() - start
        results[name] = len(gm.graph.nodes)
        return seconds

    # alternate() hands measure the variant: here its name, so the result can be checked
    times = alternate({name: name for name in variants}, rounds, cpu_seconds)
    assert len(set(results.values())) == 1, f"variants disagree on the result: {results}"
    base = median(times["by hand"])
    record.extra["graph"] = {"nodes": len(template.graph.nodes), "after": results["by hand"], "passes": len(PIPELINE)}
    for name, samples in times.items():
        record.add({"variant": name, "cpu_s": median(samples), "vs_by_hand": median(samples) / base,
                    "samples": samples}, save=False)
    record.save()
    print(f"graph: {len(template.graph.nodes)} nodes -> {results['by hand']} after the pipeline; "
          f"{len(PIPELINE)} passes; {rounds} trials, median; {record.meta['torch']}, {record.meta['cpu']}")
    print(markdown_table(record.rows, ["variant", "cpu_s", "vs_by_hand"]))
    return record.data


if __name__ == "__main__":
    main()
