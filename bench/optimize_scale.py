"""What ``fxopt.optimize`` costs per node on LLM-sized graphs (issue 39).

The workload is a stack of small transformer blocks (layer norm, q/k/v/o linears, SDPA, a
GELU MLP; 12 nodes per block under ``symbolic_trace``), captured two ways:

- ``symbolic_trace``: the default pipeline with ``example_inputs``; per-pass ms per node (from
  the report) and the fixed costs outside the passes, each timed on its own: the copy of the
  module (``copy_sharing_tensors``) and the validation of the example inputs (which is also
  the shapes analysis the passes read);
- ``torch.export``: ``optimize(ep, passes=["dce"])`` against the same-run baseline
  ``ep.module()`` plus torch.fx's ``eliminate_dead_code``, and the default pipeline on the
  exported graph, with the process's peak resident memory above its level before the run
  set against the bytes of the model's parameters.

Each size is ``--rounds`` runs in this process (min and median), as wall time and as the
process's CPU time (the harness's ``clocked``); on a shared, loaded machine the CPU time and
the ratio to a same-run baseline are the steadier figures. One row per capture and size.

    python bench/optimize_scale.py                               # 1k, 10k, 50k nodes
    python bench/optimize_scale.py --sizes 3000,12000 --repeats 3 --no-export
    python bench/optimize_scale.py --smoke                       # 100 nodes, one run each (CI)
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from harness import Clocked, Record, cli, clocked

import fxopt
from fxopt.context import PassContext
from fxopt.manager import check_example_inputs
from fxopt.models import transformer_stack
from fxopt.optimize import copy_sharing_tensors

NODES_PER_BLOCK = 12


def model_of(nodes: int, d: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    blocks = max(1, round(nodes / NODES_PER_BLOCK))
    torch.manual_seed(0)
    return transformer_stack(blocks, d), (torch.randn(2, 8, d),)


def runs(fn: Callable[[], Any], repeats: int) -> list[Clocked]:
    return [clocked(fn) for _ in range(repeats)]


def summary(times: list[Clocked], nodes: int) -> dict[str, float]:
    """Wall and CPU seconds (min and median); ms per node of the fastest wall time, and of
    the least CPU (the steadier figure on a shared machine)."""
    wall, cpu = [t.wall_s for t in times], [t.cpu_s for t in times]
    return {"min_s": round(min(wall), 3), "median_s": round(statistics.median(wall), 3),
            "cpu_min_s": round(min(cpu), 3), "ms_per_node": round(1e3 * min(wall) / nodes, 4),
            "cpu_ms_per_node": round(1e3 * min(cpu) / nodes, 4)}


class PeakRss:
    """The process's peak resident memory above its level at the start, sampled every 5 ms
    (the model's tensors are allocated outside Python's allocator: tracemalloc misses them;
    the harness's ``DeviceMemory`` counts a GPU's)."""

    def __init__(self) -> None:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def symbolic(nodes: int, d: int, repeats: int) -> dict[str, Any]:
    model, inputs = model_of(nodes, d)
    gm = fx.symbolic_trace(model)
    n = len(gm.graph.nodes)
    copies = runs(lambda: copy_sharing_tensors(gm), repeats)
    validations = runs(lambda: check_example_inputs(gm, PassContext(gm, inputs, meta_values=True)), repeats)
    total = runs(lambda: fxopt.optimize(gm, example_inputs=inputs), repeats)
    passes = {r.name: round(1e3 * r.seconds / n, 4) for r in fxopt.report_of(total[-1].value).records}
    return {"capture": "symbolic_trace", "nodes": n, "default_pipeline": summary(total, n),
            "fixed_copy": summary(copies, n), "fixed_validate_inputs_and_shapes": summary(validations, n),
            "passes_ms_per_node_last_run": passes}


def exported(nodes: int, d: int, repeats: int) -> dict[str, Any]:
    model, inputs = model_of(nodes, d)
    ep = torch.export.export(model, inputs)
    n = len(ep.graph_module.graph.nodes)

    def baseline() -> fx.GraphModule:
        gm = ep.module()
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    base = runs(baseline, repeats)
    dce = runs(lambda: fxopt.optimize(ep, passes=["dce"]), repeats)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakRss() as rss:
        default = runs(lambda: fxopt.optimize(ep), 1)
    return {"capture": "torch.export", "nodes": n,
            "dce": summary(dce, n), "baseline_module_and_eliminate_dead_code": summary(base, n),
            "dce_vs_baseline_wall": round(min(t.wall_s for t in dce) / min(t.wall_s for t in base), 2),
            "dce_vs_baseline_cpu": round(min(t.cpu_s for t in dce) / min(t.cpu_s for t in base), 2),
            "default_pipeline": summary(default, n),
            "model_MB": round(model_bytes / 2**20, 1),
            "peak_rss_above_start_MB": round((rss.peak - rss.base) / 2**20, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=2)
    parser.add_argument("--sizes", default="1000,10000,50000", help="approximate node counts")
    parser.add_argument("--d", type=int, default=32, help="model width")
    parser.add_argument("--repeats", dest="rounds", type=int, help="the old name of --rounds")
    parser.add_argument("--no-export", action="store_true", help="symbolic_trace graphs only")
    parser.add_argument("--no-symbolic", action="store_true", help="exported graphs only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.d, args.rounds = "100", 8, 1
    record = Record("optimize_scale", args, "cpu", threads=torch.get_num_threads())
    captures = [c for c, off in ((symbolic, args.no_symbolic), (exported, args.no_export)) if not off]
    for size in (int(s) for s in args.sizes.split(",")):
        for capture in captures:
            row = record.add(capture(size, args.d, args.rounds))
            print(f"{row['capture']:14s} {row['nodes']:6d} nodes: default pipeline "
                  f"{row['default_pipeline']['cpu_ms_per_node']:.4f} ms/node CPU "
                  f"({row['default_pipeline']['ms_per_node']:.4f} wall)"
                  + (f"; dce {row['dce_vs_baseline_cpu']:.2f}x the baseline (CPU)" if "dce" in row else ""),
                  flush=True)
    return record.data


if __name__ == "__main__":
    main()
