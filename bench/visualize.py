"""Time diff renders: focus mode against the full picture, on graphs of 1,000-10,000 nodes.

The graph is a ladder of elementwise ops (with shapes from ShapeProp, so labels carry
shapes and dtypes), where about 1% of the nodes are duplicate computations; the real
``cse`` and ``dce`` passes remove them, and the diff is taken between the manager's
before-snapshot and the result — the same path the HTML report takes. Each timing is the
whole call: classification, DOT generation and the Graphviz renderer (SVG), wall clock.

    .venv/bin/python bench/visualize.py                    # focus at 1k/10k, full at 1k/2k/10k
    .venv/bin/python bench/visualize.py --sizes 1000 --full-limit 60
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.fx as fx
from fxopt.visualize import diff_graphs, find_renderer, render_diff
from torch.fx.passes.shape_prop import ShapeProp

import fxopt
from fxopt.errors import RenderError

_OPS = (torch.add, torch.mul, torch.sub, torch.maximum)


def ladder(n: int, changed_fraction: float = 0.01) -> fx.GraphModule:
    """A graph of about ``n`` nodes where ``changed_fraction`` of them are duplicate
    computations (each read by an output), so that cse + dce touch that many nodes."""
    graph = fx.Graph()
    a, b = graph.placeholder("x"), graph.placeholder("y")
    outs = []
    every = max(int(1 / changed_fraction / 2), 1)  # a ladder step adds about 2 nodes
    step = 0
    while len(graph.nodes) < n - 1:
        op = _OPS[step % len(_OPS)]
        c = graph.call_function(op, (a, b))
        if step % every == every - 1:
            twin = graph.call_function(op, (a, b))  # CSE merges it into c
            outs.append(graph.call_function(torch.neg, (twin,)))  # and rewires its user
        a, b = b, graph.call_function(torch.relu, (c,))
        step += 1
    graph.output(tuple(outs) + (b,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    ShapeProp(gm).propagate(torch.randn(4, 8), torch.randn(4, 8))
    return gm


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 10000])
    parser.add_argument("--full-limit", type=float, default=300, help="seconds a full render may take")
    parser.add_argument("--hops", type=int, default=2)
    args = parser.parse_args()
    print(f"renderer: {find_renderer()}; {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}")
    rows = []
    for n in args.sizes:
        gm = ladder(n)
        optimized = fxopt.optimize(gm, passes=["cse", "dce"])
        record = next(r for r in fxopt.report_of(optimized).records if r.before is not None)
        before = record.before.build()
        diff = diff_graphs(before, optimized)
        counts = diff.summary()
        touched = counts["added"] + counts["removed"] + counts["changed"] + counts["edges_rewired"]
        classify = min(timed(lambda: diff_graphs(before, optimized)) for _ in range(3))  # noqa: B023
        focus = min(timed(lambda: render_diff(before, optimized, "svg", focus=args.hops)) for _ in range(3))  # noqa: B023
        try:
            full = timed(lambda: render_diff(before, optimized, "svg", focus=None, timeout=args.full_limit))  # noqa: B023
            full_text = f"{full:.2f}"
        except RenderError:
            full, full_text = None, f">{args.full_limit:.0f} (stopped)"
        ratio = f"{full / focus:.0f}x" if full else f">{args.full_limit / focus:.0f}x"
        rows.append((len(before.nodes), touched, f"{classify * 1e3:.0f}", f"{focus:.2f}", full_text, ratio))
        print(f"  {rows[-1]}", flush=True)
    header = ("nodes", "changes", "classify ms", f"focus={args.hops} s", "full s", "full/focus")
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
