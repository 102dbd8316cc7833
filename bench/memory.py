"""Memory benchmark: in-place coverage, planned arena vs lower bound, measured peaks.

    python bench/memory.py                       # zoo on CPU (+ CUDA peaks if a GPU is there)
    python bench/memory.py --extra               # + torchvision resnet50 and HF BERT-base
    python bench/memory.py --minimalloc 60       # + the 11 MiniMalloc instances, 60 s each
    python bench/memory.py --smoke               # one zoo model on the CPU (CI)

The record goes to ``--out`` (default ``bench/results/<gpu>/memory.json``).

Per model it prints the in-place conversions (fxopt vs torch.fx.passes.reinplace on the
same symbolic_trace graph), naive / lower bound / arena bytes before in-place
conversion, after it, and with concat-aware placement, the planning time, and the
peak memory of one inference run as (a) the nn.Module in eager mode, (b) the FX graph
after in-place conversion, unplanned, (c) the planned graph in its arena
(``ArenaRunner``). Peaks are measured above the parameters and inputs already
resident: on CUDA with ``torch.cuda.max_memory_allocated``, on CPU by sampling glibc's
``mallinfo2`` after every ATen op (a TorchDispatchMode), which sees every tensor an op
returns but not temporaries freed inside one op.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import json
import os
import time
from pathlib import Path

import torch
import torch.fx as fx
from harness import Record, cli, markdown_table

import fxopt
from fxopt.memory.executor import ArenaRunner
from fxopt.memory.measure import cpu_peak, cuda_peak
from fxopt.memory.problem import Buffer, lower_bound, verify_placement
from fxopt.memory.solver import _orders, greedy, solve
from fxopt.models import ZOO, example_inputs
from fxopt.progress import progress

MINIMALLOC = Path(__file__).resolve().parents[1] / "tests" / "data" / "minimalloc"


def reinplace_count(gm: fx.GraphModule, inputs) -> str:
    """What torch's own reinplace pass converts on the same symbolic_trace graph."""
    from torch.fx.passes.reinplace import reinplace

    graph = copy.deepcopy(gm)
    before = {n.target for n in graph.graph.nodes}
    try:
        reinplace(graph, *inputs)
    except Exception as exc:  # it does not model get_attr / call_module graphs
        return f"error ({type(exc).__name__})"
    after = [n for n in graph.graph.nodes if n.target not in before]
    return str(len(after))


def plan(gm: fx.GraphModule, inputs, passes: list[str]):
    out = fxopt.optimize(gm, passes=passes, example_inputs=inputs)
    return out, out.meta["fxopt.memory_plan"]


def bench_model(name: str, model: torch.nn.Module, inputs, device: str, trace=fx.symbolic_trace) -> dict:
    row: dict = {"model": name, "device": device}
    gm = trace(model)
    row["reinplace"] = reinplace_count(gm, inputs)
    _, before = plan(gm, inputs, ["plan_memory{concat=false}"])
    inplace_gm, after_inplace = plan(gm, inputs, ["inplace", "plan_memory{concat=false}"])
    row["converted"] = fxopt.report_of(inplace_gm).find("inplace")[0].stats["converted"]
    final_gm, final = plan(gm, inputs, ["inplace", "plan_memory"])
    for p in (before, after_inplace, final):
        p.verify()
    row.update({
        "naive_MB": before.naive_bytes / 1e6,
        "bound_MB": before.lower_bound_bytes / 1e6,
        "bound_inplace_MB": after_inplace.lower_bound_bytes / 1e6,
        "bound_concat_MB": final.lower_bound_bytes / 1e6,
        "arena_MB": final.arena_bytes / 1e6,
        "arena/bound": final.ratio,
        "plan_ms": min(plan(gm, inputs, ["plan_memory"])[1].seconds for _ in range(3)) * 1e3,
    })
    runner, everything = ArenaRunner(final_gm), ArenaRunner(final_gm, keep_all=True)
    row["arena_run_MB"] = runner.arena_bytes / 1e6
    row["arena_all_MB"] = everything.arena_bytes / 1e6
    row["unplanned_nodes"] = len(runner.unplanned)
    outside = runner.outside()
    row["outside_nodes"] = sum(outside.values())
    row["outside_ops"] = ", ".join(f"{op} x{count}" for op, count in outside.items())
    row["planned_nodes"] = len(runner.planned)
    row["planned_all_nodes"] = len(everything.planned)
    row.update({f"arena_{k}": v for k, v in compare(model, runner, inputs).items()})
    row.update({f"all_{k}": v for k, v in compare(model, everything, inputs).items()})
    row["predicted_peak_MB"] = runner.predicted_peak / 1e6
    row["predicted_unplanned_peak_MB"] = runner.predicted_unplanned_peak / 1e6
    row["predicted_all_MB"] = everything.predicted_peak / 1e6
    measure = cuda_peak if device == "cuda" else cpu_peak
    bound = final.lower_bound_bytes
    for label, fn, arena in (("eager", lambda: model(*inputs), 0), ("fx", lambda: inplace_gm(*inputs), 0),
                             ("planned", lambda: runner(*inputs), runner.arena_bytes),
                             ("planned_all", lambda: everything(*inputs), everything.arena_bytes)):
        if device == "cuda":
            torch.cuda.empty_cache()
        # the arena was allocated before the run: it is part of the planned peak
        peak = measure(fn) + arena
        row[f"peak_{label}_MB"] = peak / 1e6
        row[f"peak_{label}/bound"] = peak / bound if bound else float("nan")
    return row


def compare(model: torch.nn.Module, runner: ArenaRunner, inputs) -> dict:
    """How the arena run's outputs compare with eager's: bitwise, relative L2 and max error."""
    with torch.no_grad():
        reference = torch.utils._pytree.tree_leaves(model(*inputs))
        got = torch.utils._pytree.tree_leaves(runner(*inputs))
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(reference, got)),
            "rel_l2": max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, reference)),
            "max_err": max(float((a.float() - b.float()).abs().max()) for a, b in zip(reference, got))}


def guarded(name: str, *args, **kwargs) -> dict:
    """``bench_model(name, *args)``, or a row saying why it failed."""
    try:
        return bench_model(name, *args, **kwargs)
    except Exception as exc:
        return {"model": name, "error": f"{type(exc).__name__}: {exc}"[:300]}


def zoo_rows(device: str, memory_format: torch.memory_format = torch.contiguous_format,
             names: list[str] | None = None) -> list[dict]:
    rows = []
    suffix = " (channels-last)" if memory_format == torch.channels_last else ""
    zoo = {name: factory for name, factory in ZOO.items() if names is None or name in names}
    for name, factory in progress(zoo.items(), desc=f"zoo on {device}{suffix}", unit="model"):
        model = factory().to(device, memory_format=memory_format)
        inputs = tuple(x.to(device, memory_format=memory_format if x.dim() == 4 else torch.preserve_format)
                       for x in example_inputs(name))
        rows.append(guarded(name + suffix, model, inputs, device))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def extra_rows(device: str) -> list[dict]:
    rows = []
    try:
        import torchvision

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        batch = 32 if device == "cuda" else 1
        model = torchvision.models.resnet50().eval().to(device, dtype)
        inputs = (torch.randn(batch, 3, 224, 224, device=device, dtype=dtype),)
        rows.append(guarded(f"resnet50 {dtype} b{batch}", model, inputs, device))
    except Exception as exc:
        rows.append({"model": "resnet50", "error": f"{type(exc).__name__}: {exc}"[:300]})
    print(json.dumps(rows[-1]), flush=True)
    try:
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        model = BertModel(BertConfig()).eval().to(device)
        ids = torch.randint(0, 30522, (1, 128), device=device)
        mask = torch.ones(1, 128, dtype=torch.long, device=device)
        # HF models do not symbolic_trace (control flow); torch.export captures them
        rows.append(guarded("bert-base b1 s128 (export)", model, (ids, mask), device,
                            trace=lambda m: torch.export.export(m, (ids, mask), strict=False).module()))
    except Exception as exc:
        rows.append({"model": "bert-base", "error": f"{type(exc).__name__}: {exc}"[:300]})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def scaling_row() -> dict:
    """10k buffers with graph-like lifetimes: planning time and arena / bound."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 20000, (10000,), generator=gen).tolist()
    spans = (torch.rand(10000, generator=gen) ** 4 * 400).long().tolist()
    sizes = (torch.randint(1, 4096, (10000,), generator=gen) * 64).tolist()
    buffers = [Buffer(str(i), s, s + d, z) for i, (s, d, z) in enumerate(zip(starts, spans, sizes))]
    began = time.perf_counter()
    solution = solve(buffers, time_limit=0.3)
    seconds = time.perf_counter() - began
    for b, o in zip(buffers, solution.offsets):
        b.offset = o
    verify_placement(buffers)
    return {"buffers": 10000, "seconds": seconds, "arena/bound": solution.arena / lower_bound(buffers)}


def minimalloc_rows(seconds: float) -> list[dict]:
    rows = []
    for path in progress(sorted(MINIMALLOC.glob("*.csv")), desc="MiniMalloc instances", unit="instance"):
        with open(path) as f:
            buffers = [Buffer(r["id"], int(r["lower"]), int(r["upper"]) - 1, int(r["size"]))
                       for r in csv.DictReader(f)]
        import numpy as np

        starts = np.array([b.start for b in buffers])
        ends = np.array([b.end for b in buffers])
        sizes = np.array([b.size for b in buffers])
        by_size = greedy(starts, ends, sizes, _orders(starts, ends, sizes, many=False)[0])
        began = time.perf_counter()
        solution = solve(buffers, capacity=1048576, time_limit=seconds)
        took = time.perf_counter() - began
        for b, o in zip(buffers, solution.offsets):
            b.offset = o
        verify_placement(buffers)
        rows.append({"instance": path.name.split(".")[0], "buffers": len(buffers),
                     "greedy_by_size": float((by_size + sizes).max()) / 1048576,
                     "fxopt": solution.arena / 1048576, "method": solution.method,
                     "search_nodes": solution.nodes, "seconds": round(took, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--extra", action="store_true", help="also torchvision resnet50 and HF BERT-base")
    parser.add_argument("--minimalloc", type=float, default=0, help="seconds per MiniMalloc instance (0: skip)")
    parser.add_argument("--devices", default="cpu,cuda", help="comma-separated: cpu, cuda")
    parser.add_argument("--channels-last", action="store_true",
                        help="also the zoo in channels-last (where CPU convolutions have an in-place path)")
    args = parser.parse_args(argv)
    devices = ["cpu"] if args.smoke else [d for d in args.devices.split(",") if d == "cpu" or torch.cuda.is_available()]
    record = Record("memory", args, "cuda" if "cuda" in devices else "cpu")
    names = ["resnet18"] if args.smoke else None
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    try:
        for device in devices:
            for row in zoo_rows(device, names=names) + (
                    zoo_rows(device, torch.channels_last, names) if args.channels_last else []) + (
                    extra_rows(device) if args.extra else []):
                record.add(row)
        record.extra["scaling"] = scaling_row()
        if args.minimalloc:
            record.extra["minimalloc"] = minimalloc_rows(args.minimalloc)
    finally:
        torch.set_num_threads(threads)
    record.save()
    rows = record.rows
    print(f"\n{record.meta['device']}, torch {record.meta['torch']}")
    print(markdown_table(rows, ["model", "device", "converted", "reinplace", "naive_MB", "bound_MB",
                                "bound_inplace_MB", "bound_concat_MB", "arena/bound", "plan_ms"]))
    print(markdown_table(rows, ["model", "device", "planned_nodes", "outside_nodes", "outside_ops",
                                "planned_all_nodes", "arena_all_MB", "predicted_all_MB", "peak_planned_all_MB",
                                "all_bitwise", "all_rel_l2"]))
    print(markdown_table(rows, ["model", "device", "arena_run_MB", "unplanned_nodes", "arena_bitwise",
                                "arena_rel_l2", "predicted_peak_MB", "predicted_unplanned_peak_MB", "peak_eager/bound",
                                "peak_fx/bound", "peak_planned/bound", "peak_eager_MB", "peak_fx_MB",
                                "peak_planned_MB", "error"]))
    print(json.dumps(record.extra["scaling"]))
    if args.minimalloc:
        print(markdown_table(record.extra["minimalloc"], ["instance", "buffers", "greedy_by_size", "fxopt", "method",
                                                          "search_nodes", "seconds"]))
    return record.data


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
