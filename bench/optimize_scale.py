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

Each size is ``--repeats`` runs in this process (min and median), as wall time and as the
process's CPU time; on a shared, loaded machine the CPU time and the ratio to a same-run
baseline are the steadier figures.

    python bench/optimize_scale.py                               # 1k, 10k, 50k nodes
    python bench/optimize_scale.py --sizes 3000,12000 --repeats 3 --no-export
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

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


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[tuple[float, float]], Any]:
    """(wall, process CPU) seconds of each run, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times, out


def summary(times: list[tuple[float, float]], nodes: int) -> dict[str, float]:
    """Wall and CPU seconds (min and median); ms per node of the fastest wall time, and of
    the least CPU (the steadier figure on a shared machine)."""
    wall, cpu = [w for w, _ in times], [c for _, c in times]
    return {"min_s": round(min(wall), 3), "median_s": round(statistics.median(wall), 3),
            "cpu_min_s": round(min(cpu), 3), "ms_per_node": round(1e3 * min(wall) / nodes, 4),
            "cpu_ms_per_node": round(1e3 * min(cpu) / nodes, 4)}


class PeakRss:
    """The process's peak resident memory above its level at the start, sampled every 5 ms
    (the model's tensors are allocated outside Python's allocator: tracemalloc misses them)."""

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

    def __exit__(self, *exc: Any) -> None:
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
    copy_times, _ = timed(lambda: copy_sharing_tensors(gm), repeats)

    def validate() -> None:
        check_example_inputs(gm, PassContext(gm, inputs, meta_values=True))

    validate_times, _ = timed(validate, repeats)
    total, out = timed(lambda: fxopt.optimize(gm, example_inputs=inputs), repeats)
    passes = {r.name: round(1e3 * r.seconds / n, 4) for r in fxopt.report_of(out).records}
    return {"capture": "symbolic_trace", "nodes": n, "default pipeline": summary(total, n),
            "fixed: copy": summary(copy_times, n), "fixed: validate inputs + shapes": summary(validate_times, n),
            "passes ms/node (last run)": passes}


def exported(nodes: int, d: int, repeats: int) -> dict[str, Any]:
    model, inputs = model_of(nodes, d)
    ep = torch.export.export(model, inputs)
    n = len(ep.graph_module.graph.nodes)

    def baseline() -> fx.GraphModule:
        gm = ep.module()
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    base, _ = timed(baseline, repeats)
    dce, _ = timed(lambda: fxopt.optimize(ep, passes=["dce"]), repeats)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakRss() as rss:
        default, _ = timed(lambda: fxopt.optimize(ep), 1)
    return {"capture": "torch.export", "nodes": n,
            "dce": summary(dce, n), "baseline: ep.module() + eliminate_dead_code": summary(base, n),
            "dce / baseline (min wall)": round(min(w for w, _ in dce) / min(w for w, _ in base), 2),
            "dce / baseline (min CPU)": round(min(c for _, c in dce) / min(c for _, c in base), 2),
            "default pipeline": summary(default, n),
            "model MB": round(model_bytes / 2**20, 1),
            "peak RSS above start, MB": round((rss.peak - rss.base) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,50000", help="approximate node counts")
    parser.add_argument("--d", type=int, default=32, help="model width")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-export", action="store_true", help="symbolic_trace graphs only")
    parser.add_argument("--no-symbolic", action="store_true", help="exported graphs only")
    args = parser.parse_args()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        if not args.no_symbolic:
            results.append(symbolic(size, args.d, args.repeats))
            print(json.dumps(results[-1]), flush=True)
        if not args.no_export:
            results.append(exported(size, args.d, args.repeats))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
