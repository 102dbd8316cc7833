"""Growth of every pass of the full pass list with graph size: is any pass super-linear?

A symbolic_trace'd eval-mode network of ``blocks`` blocks (conv+BN+ReLU, conv+BN plus a
residual add and ReLU, a constant subgraph to fold, twin expressions for cse, a no-op
``contiguous()``, dead code for dce, linear+ReLU), about 20 nodes a block, optimized with
the full pass list at sizes doubling up to ``--max-nodes`` (default 10k nodes). A pass's
seconds include the analyses it triggers (a composite's: its children's), best of
``--repeat`` fresh copies. The growth exponent
is the least-squares slope of log(seconds) against log(nodes); a pass above ``--flag``
(1.2) is flagged. CPU seconds of the process (``time.process_time``, per pass through an
instrumentation hook): steadier than wall time on a shared machine; still, take the best of
several runs.

    python bench/pass_growth.py [--max-nodes 10000] [--repeat 3]   # bench/results/cpu/pass_growth.json
    python bench/pass_growth.py --smoke                             # up to 400 nodes (CI)
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from harness import Record, cli

import fxopt

FULL = ["constant_fold", "cse", "dce", "eliminate_identity", "fold_conv_bn", "fuse_conv_bn_relu",
        "fuse_add_relu", "fuse_linear_relu", "inplace", "plan_memory"]


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.scale = nn.Parameter(torch.rand(channels, 1, 1) + 0.5)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + x)
        factor = self.scale * 2 + 1  # constant: folded
        gate = torch.sigmoid(y) + torch.sigmoid(y)  # twins: cse
        unused = torch.tanh(y)  # dead: dce
        del unused
        return (y * factor + gate).contiguous()  # contiguous of a contiguous tensor: identity


class Net(nn.Module):
    def __init__(self, blocks: int, channels: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels * 16, 8)

    def forward(self, x):
        return torch.relu(self.fc(self.blocks(x).flatten(1)))


class CpuClock(fxopt.Instrumentation):
    """The process's CPU seconds of every leaf pass, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def before_pass(self, pass_, gm, ctx) -> None:
        self.started = time.process_time()

    def after_pass(self, pass_, gm, ctx, record) -> None:
        self.seconds.append(time.process_time() - self.started)


def cpu_per_pass(records: list, seconds: list[float]) -> dict[str, float]:
    """CPU seconds per top-level pass (a composite's: the sum of its leaves')."""
    left = iter(seconds)

    def total(record) -> float:
        if record.children:
            return sum(total(c) for c in record.children)
        return 0.0 if record.skipped else next(left)

    return {r.name: total(r) for r in records}


def graph_of(blocks: int) -> tuple[fx.GraphModule, tuple]:
    torch.manual_seed(0)
    model = Net(blocks).eval()
    return fx.symbolic_trace(model), (torch.randn(2, 4, 4, 4),)


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--max-nodes", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=4, help="sizes: max, max/2, max/4, ...")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flag", type=float, default=1.2)
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_nodes, args.steps, args.repeat = 400, 2, 1
    record = Record("pass_growth", args, "cpu")
    print(f"# {record.meta['cpu']}, {record.meta['cores']} cores, torch {record.meta['torch']}")
    per_block = len(graph_of(2)[0].graph.nodes) - len(graph_of(1)[0].graph.nodes)
    sizes = [max(1, args.max_nodes // per_block // 2 ** k) for k in reversed(range(args.steps))]
    gm, inputs = graph_of(1)
    fxopt.optimize(gm, FULL, example_inputs=inputs)  # the process's first optimize, not timed
    nodes, rows, totals = [], {}, []
    for blocks in sizes:
        gm, inputs = graph_of(blocks)
        best: dict[str, float] = {}
        best_total = math.inf
        for _ in range(args.repeat):
            g, clock = copy.deepcopy(gm), CpuClock()
            start = time.process_time()
            out = fxopt.optimize(g, FULL, example_inputs=inputs, hooks=[clock])
            best_total = min(best_total, time.process_time() - start)
            for name, seconds in cpu_per_pass(fxopt.report_of(out).records, clock.seconds).items():
                best[name] = min(best.get(name, math.inf), seconds)
        nodes.append(len(gm.graph.nodes))
        totals.append(best_total)
        for name, seconds in best.items():
            rows.setdefault(name, []).append(seconds)
        record.add({"nodes": nodes[-1], "optimize_cpu_s": best_total, "passes_cpu_s": best})
        print(f"nodes={nodes[-1]:6d}  optimize {best_total:7.3f} s CPU  | "
              + "  ".join(f"{k} {v:.3f}" for k, v in best.items()), flush=True)
    print(f"\ngrowth exponent (slope of log seconds over log nodes, {nodes[0]}..{nodes[-1]} nodes; "
          f"last doubling in brackets):")
    for name, ys in [*rows.items(), ("optimize (total, CPU)", totals)]:
        k = slope(nodes, ys)
        last = math.log(ys[-1] / max(ys[-2], 1e-6)) / math.log(nodes[-1] / nodes[-2])
        flag = "  <-- SUPER-LINEAR" if k > args.flag else ""
        record.extra.setdefault("growth", {})[name] = {"exponent": k, "last_doubling": last,
                                                       "super_linear": k > args.flag}
        print(f"  {name:24s} {k:5.2f}  [{last:5.2f}]  {ys[-1]:7.3f} s at {nodes[-1]} nodes{flag}")
    record.save()
    return record.data


if __name__ == "__main__":
    main()
