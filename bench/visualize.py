"""Time diff renders: focus mode against the full picture, on graphs of 1,000-10,000 nodes.

The graph is a ladder of elementwise ops (with shapes from ShapeProp, so labels carry
shapes and dtypes), where about 1% of the nodes are duplicate computations; the real
``cse`` and ``dce`` passes remove them, and the diff is taken between the manager's
before-snapshot and the result — the same path the HTML report takes. Each timing is the
whole call: classification, DOT generation and the Graphviz renderer (SVG), wall clock.

    .venv/bin/python bench/visualize.py                  # 1k, 2k and 10k nodes
    .venv/bin/python bench/visualize.py --sizes 1000 --full-cpu-limit 60
    .venv/bin/python bench/visualize.py --smoke          # 300 nodes (CI)

Wall and CPU seconds are both printed: on a shared machine the CPU time is what an idle
one would take in wall time (the renderer is single-threaded).
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from typing import Any

import torch
import torch.fx as fx
from fxopt.visualize import diff_graphs, diff_to_dot, find_renderer, render_diff
from harness import Record, cli, markdown_table
from torch.fx.passes.shape_prop import ShapeProp

import fxopt
from fxopt.progress import progress

HEADER = ("nodes", "changes", "classify ms", "focus s wall / cpu", "full s wall / cpu", "full/focus (cpu)")

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


def cpu_seconds() -> float:
    """CPU time of this process and of the renderer processes it waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn) -> tuple[float, float]:
    """(wall, cpu) seconds of one call. On a shared machine the wall clock includes the
    time other processes held the cores; the CPU time is what the call itself used."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def full_render(diff, cpu_limit: int) -> tuple[float, float] | None:
    """(wall, cpu) of drawing everything, or None when the renderer used up ``cpu_limit``
    CPU seconds (a wall-clock limit would measure the machine's load, not the render)."""
    def draw() -> None:
        source = diff_to_dot(diff, focus=None)
        limit = lambda: resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit))  # noqa: E731
        done = subprocess.run([find_renderer(), "-Tsvg", "-q"], input=source.encode(), capture_output=True,
                              preexec_fn=limit, check=False)
        if done.returncode != 0:
            raise TimeoutError
    try:
        return timed(draw)
    except TimeoutError:
        return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 10000])
    parser.add_argument("--full-cpu-limit", type=int, default=300,
                        help="CPU seconds the renderer may spend on one full picture")
    parser.add_argument("--hops", type=int, default=2)
    args = parser.parse_args(argv)
    sizes, repeat = ([300], 1) if args.smoke else (args.sizes, 3)
    record = Record("visualize", args, "cpu", renderer=find_renderer(), load=os.getloadavg()[0])
    print(f"renderer: {record.meta['renderer']}; {record.meta['cpu']}, {record.meta['cores']} cores, "
          f"load average {record.meta['load']:.1f}, torch {record.meta['torch']}")
    for n in progress(sizes, desc="graph sizes", unit="size"):
        gm = ladder(n)
        optimized = fxopt.optimize(gm, passes=["cse", "dce"])
        report = next(r for r in fxopt.report_of(optimized).records if r.before is not None)
        before = report.before.build()
        diff = diff_graphs(before, optimized)
        counts = diff.summary()
        touched = counts["added"] + counts["removed"] + counts["changed"] + counts["edges_rewired"]
        classify = min(timed(lambda: diff_graphs(before, optimized)) for _ in range(repeat))  # noqa: B023
        focus = min(timed(lambda: render_diff(before, optimized, "svg", focus=args.hops))  # noqa: B023
                    for _ in range(repeat))
        full = full_render(diff, args.full_cpu_limit)
        if full is None:
            full_text, ratio = f"> {args.full_cpu_limit} cpu (stopped)", f"> {args.full_cpu_limit / focus[1]:.0f}x"
        else:
            full_text, ratio = f"{full[0]:.1f} / {full[1]:.1f}", f"{full[1] / focus[1]:.0f}x"
        row = record.add(dict(zip(HEADER, (len(before.nodes), touched, f"{classify[0] * 1e3:.0f}",
                                           f"{focus[0]:.2f} / {focus[1]:.2f}", full_text, ratio))))
        row.update(focus_wall_s=focus[0], focus_cpu_s=focus[1], full_cpu_s=full[1] if full else None)
        print(f"  {row}", flush=True)
    record.save()
    print(markdown_table(record.rows, HEADER))
    return record.data


if __name__ == "__main__":
    main()
