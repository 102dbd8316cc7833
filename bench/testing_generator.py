"""Throughput and validity of ``fxopt.testing.strategies.fx_graphs``.

Measures, at 20-50 ops per graph:

* graphs/s through hypothesis (``@given(fx_graphs(20, 50))``, generate phase only: what
  a property test pays per example), and for the deterministic core ``build_graph``;
* validity: the share of graphs that run on inputs from ``inputs_for`` with the output
  shapes recorded in ``meta['val']``, and the share whose outputs are all finite, per dtype;
* shrinking: the node count hypothesis shrinks a counterexample to, for properties
  that fail on one op kind.

Run: ``python bench/testing_generator.py [--graphs N]`` (pin cores with ``taskset -c 0,1``);
``--smoke``: 5 graphs, one shrink per property (CI). One intra-op thread, for the measurement only.
"""

from __future__ import annotations

import operator
import os
import random
import time
from typing import Any

import torch
import torch.fx as fx
from harness import Record, cli, markdown_table
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from fxopt.progress import progress
from fxopt.testing.minimize import node_count
from fxopt.testing.strategies import OP_KINDS, build_graph, fx_graphs, inputs_for


def hypothesis_rate(count: int) -> tuple[float, float]:
    """Graphs per wall-clock second and per CPU second drawn through hypothesis, as a
    property test draws them (CPU time is what an idle core would take on a shared box)."""
    drawn = []

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fx_graphs(20, 50))
    def draw(gm: fx.GraphModule) -> None:
        drawn.append(node_count(gm))

    start, cpu = time.perf_counter(), time.process_time()
    draw()
    return len(drawn) / (time.perf_counter() - start), len(drawn) / (time.process_time() - cpu)


def core_rate(count: int) -> tuple[float, float]:
    rng = random.Random(0)
    start, cpu = time.perf_counter(), time.process_time()
    for seed in progress(range(count), desc="build_graph", unit="graph"):
        build_graph(rng.randbytes(16 * rng.randint(21, 51)), seed)
    return count / (time.perf_counter() - start), count / (time.process_time() - cpu)


def validity(count: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(graphs, valid, finite) over ``count`` hypothesis-drawn graphs of ``dtype``."""
    tally = [0, 0, 0]

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data: st.DataObject) -> None:
        gm = data.draw(fx_graphs(20, 50, dtype=dtype))
        inputs = data.draw(inputs_for(gm))
        tally[0] += 1
        try:
            outputs = gm(*inputs)
        except Exception:
            return
        nodes = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if all(o.shape == n.meta["val"].shape for o, n in zip(outputs, nodes)):
            tally[1] += 1
            tally[2] += all(bool(torch.isfinite(o).all()) for o in outputs)

    check()
    return tally[0], tally[1], tally[2]


def shrunk_sizes(targets: set, trials: int = 3, examples: int = 5000, derandomize: bool = False) -> list[int]:
    """Nodes in the smallest graph hypothesis shrinks to, containing one of ``targets``
    (``trials`` independent searches: shrinking is randomized). ``derandomize``: the same
    search every run (the smoke test's few examples could otherwise miss an op now and then)."""
    def has(gm: fx.GraphModule) -> bool:
        return any(n.target in targets for n in gm.graph.nodes)

    chosen = settings(database=None, max_examples=examples, derandomize=derandomize)
    return [node_count(find(fx_graphs(1, 50), has, settings=chosen)) for _ in range(trials)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=int, default=300)
    args = parser.parse_args(argv)
    graphs, trials, examples = (5, 1, 200) if args.smoke else (args.graphs, 3, 5000)
    record = Record("testing_generator", args, "cpu", op_kinds=len(OP_KINDS), load=os.getloadavg()[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measure(record, graphs, trials, examples, derandomize=args.smoke)
    finally:
        torch.set_num_threads(threads)
    print(f"machine: {record.meta['cpu']}, {record.meta['cores']} cores, torch {record.meta['torch']}, "
          f"load average {record.meta['load']:.1f}; op kinds: {len(OP_KINDS)}")
    print(markdown_table(record.rows, ["measure", "value"]))
    return record.data


def measure(record: Record, graphs: int, trials: int, examples: int, derandomize: bool = False) -> None:
    hypothesis_rate(min(graphs, 20))  # warm-up
    for label, (wall, cpu) in [("fx_graphs(20, 50) via hypothesis", hypothesis_rate(graphs)),
                               ("build_graph core, 20-50 ops", core_rate(graphs))]:
        record.add({"measure": label, "graphs_per_s": wall, "graphs_per_cpu_s": cpu,
                    "value": f"{wall:.1f} graphs/s wall, {cpu:.1f} graphs per CPU-second"})
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        total, valid, finite = validity(graphs, dtype)
        record.add({"measure": f"valid / finite, {dtype}", "graphs": total, "valid": valid, "finite": finite,
                    "value": f"{valid}/{total} valid ({100 * valid / total:.1f}%), "
                             f"{finite}/{total} finite ({100 * finite / total:.1f}%)"})
    for name, targets in [("sub", {operator.sub, torch.sub, "sub"}),
                          ("conv", {torch.nn.functional.conv1d, torch.nn.functional.conv2d}),
                          ("cat", {torch.cat}), ("layer_norm", {torch.nn.functional.layer_norm})]:
        sizes = shrunk_sizes(targets, trials, examples, derandomize)
        record.add({"measure": f"shrunk counterexample, has {name}", "nodes": sizes,
                    "value": f"{sizes} nodes ({trials} searches)"})


if __name__ == "__main__":
    main()
