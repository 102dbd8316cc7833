"""Serving benchmark: one compiled model called at varying batch sizes (bf16 inference, one GPU).

The workload a server sees: batches 32, 8 and 16, each called twice (what compiles and
captures), then each batch timed (``triton.testing.do_bench`` median of the Python call,
in interleaved rounds). Routes to a symbolic batch size: ``automatic`` (Dynamo recompiles
with a dynamic batch at the second size), ``dynamic`` (``torch.compile(dynamic=True)``),
``mark_dynamic`` (``torch._dynamo.mark_dynamic(x, 0)`` on every input). Variants: every
Inductor mode a user could pick (default, freezing, reduce-overhead, reduce-overhead with
freezing) and fxopt, each compiled afresh after ``torch._dynamo.reset()`` (automatic
dynamic shapes are remembered per code object, so variants sharing one Dynamo state would
not take the same route). Also recorded: each variant's error against eager bf16 on inputs
it has not seen, whether a call at another batch size and a second call at the first one
leave an earlier output intact (plain-call semantics; reduce-overhead's outputs live in its
pool), and, for fxopt, what its replay did per shape (``CompiledGraph.replay``).

Timing is the bench harness's (``call_ms``; the batches of a variant in interleaved rounds,
``alternate``), and so are the baselines (bench/gpu_zoo.py's ``make_variant``: the
harness's ``inductor_variant``; each freezing mode checked frozen) and the device memory of
each variant, from before its first call (``peak_reserved_MB``). The record (``--out``,
default ``bench/results/<gpu>/serving.json``) is rewritten after every variant.

    python bench/serving.py --models resnet50 --out $OUT/serving.json
    python bench/serving.py --smoke     # CPU, stand-in model: checks the script's logic (CI)

One Inductor cache is shared by every variant (kernels compiled for one serve another):
compile times are not compared here (bench/gpu_zoo.py does, with a cold cache each).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_zoo import build, make_variant, rel_l2
from harness import (
    INDUCTOR_MODES,
    DeviceMemory,
    Record,
    alternate,
    call_ms,
    cli,
    cpu_threads,
    frozen_summary,
    median,
    wall_ms,
)

ROUTES = ("automatic", "dynamic", "mark_dynamic")
VARIANTS = (*INDUCTOR_MODES, "fxopt")


def batch_input(example: torch.Tensor, batch: int) -> torch.Tensor:
    """Fresh random input of ``example``'s kind at ``batch``, in its memory format."""
    x = torch.randn(batch, *example.shape[1:], device=example.device, dtype=example.dtype)
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def serve_one(variant: str, route: str, model: torch.nn.Module, example: torch.Tensor,
              args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``variant`` afresh, warm it up on the serving sequence, time every batch."""
    batches = [int(b) for b in args.batches.split(",")]
    torch._dynamo.reset()
    stats: dict[str, Any] = {}
    fn, context = make_variant(variant, model, stats, dynamic=True if route == "dynamic" else None)

    def call(x: torch.Tensor) -> torch.Tensor:
        if route == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        return fn(x)

    entry: dict[str, Any] = {}
    with torch.no_grad(), context():
        memory = DeviceMemory(args.device).start()
        entry["warm_up_s"] = wall_ms(lambda: [call(batch_input(example, b)) for b in batches for _ in range(2)],
                                     args.device, reps=1, warmup=0) / 1e3
        timed = {b: batch_input(example, b) for b in batches}
        samples = alternate(timed, args.rounds, lambda x: call_ms(lambda: call(x), args.device))
        entry.update(memory.stop())
        for b, times in samples.items():
            entry[f"ms_{b}"], entry[f"ms_{b}_samples"] = median(times), times
            fresh = batch_input(example, b)
            entry[f"rel_l2_{b}_vs_eager"] = rel_l2(call(fresh).float(), model(fresh).float())
        entry["earlier_output_kept"] = earlier_output_kept(call, lambda b: batch_input(example, b), batches)
    entry.update(frozen_summary(variant, stats), **(fxopt_graphs(stats) if variant == "fxopt" else {}))
    return entry


def fxopt_graphs(stats: dict[str, Any]) -> dict[str, Any]:
    """What the fxopt backend did with each graph it compiled (its ``reports``): fallbacks,
    why a graph is not replayed, and each replay's log per call shape; serving_seq.py's too."""
    reports = stats["reports"]
    return {"graphs": len(reports), "fallbacks": [g.fallback for g in reports if g.fallback],
            "no_replay": [g.no_replay for g in reports if g.no_replay],
            "replay_logs": [str(g.replay) for g in reports if g.replay is not None]}


def earlier_output_kept(call: Callable[[torch.Tensor], torch.Tensor], make_input: Callable[[int], torch.Tensor],
                        sizes: list[int]) -> str:
    """Whether an output survives a call at another size and a second call at its own
    (plain-call semantics; serving_seq.py asks it too)."""
    try:
        out = call(make_input(sizes[0]))
        kept = out.clone()
        call(make_input(sizes[-1]))
        call(make_input(sizes[0]))
        return "yes" if torch.equal(out, kept) else "no: overwritten by a later call"
    except RuntimeError as exc:  # reduce-overhead refuses to read an overwritten output
        return f"no: {str(exc).splitlines()[0][:160]}"


def summarize(row: dict[str, Any], sizes: list[int]) -> None:
    """Per size: fxopt against the best Inductor mode of this route (an upper bound where
    a mode was not measured: ``modes_measured_<size>`` says which were); serving_seq.py's too."""
    fx = row.get("fxopt", {})
    for size in sizes:
        key = f"ms_{size}"
        timed = [(row[v][key], v) for v in INDUCTOR_MODES if key in row.get(v, {})]
        row[f"modes_measured_{size}"] = [v for _, v in timed]
        if timed and key in fx:
            best, name = min(timed)
            row[f"speedup_{size}"] = best / fx[key]
            row[f"best_inductor_{size}"] = name


def table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    """The printed summary: per model and route, fxopt against the best mode, then each variant."""
    lines = [f"ms per call (median of rounds) at batches {batches}, after each was called twice; "
             "kept = an earlier output survives later calls"]
    for r in rows:
        lines.append(f"\n{r['model']} [{r['route']}]  fxopt vs best Inductor mode: " + ", ".join(
            f"b{b} {r[f'speedup_{b}']:.3f}x ({r[f'best_inductor_{b}']})" for b in batches if f"speedup_{b}" in r))
        for variant in VARIANTS:
            v = r.get(variant)
            if not v:  # not in --variants
                continue
            if "error" in v:
                lines.append(f"  {variant:26s} ERROR {v['error'][:200]}")
                continue
            cells = [f"b{b} {v[f'ms_{b}']:.3f}" for b in batches if f"ms_{b}" in v]
            cells.append(f"warm-up {v.get('warm_up_s', 0):.1f}s")
            cells.append("relL2 " + "/".join(f"{v[f'rel_l2_{b}_vs_eager']:.1e}" for b in batches
                                             if f"rel_l2_{b}_vs_eager" in v))
            cells.append(f"kept {v.get('earlier_output_kept', '-')[:60]}")
            lines.append(f"  {variant:26s} " + " | ".join(cells))
    ratios = [r[f"speedup_{b}"] for r in rows for b in batches if f"speedup_{b}" in r]
    if ratios:
        lines.append(f"\nall routes and batches: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x, "
                     f"min {min(ratios):.3f}x")
    return "\n".join(lines)


def serve_model(name: str, args: argparse.Namespace, record: Record, started: float) -> None:
    """Every route and variant of model ``name``: a record row per route, saved after each
    variant; the variants left once ``--budget-s`` is spent say so."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    model, inputs = build(name, args.smoke)
    model = model.to(args.device, dtype)
    example = inputs[0].to(args.device, dtype)
    if example.dim() == 4:
        model = model.to(memory_format=torch.channels_last)
    for route in args.routes.split(","):
        row = record.add({"model": name, "route": route, "batches": batches})
        for variant in args.variants.split(","):
            if time.perf_counter() - started > args.budget_s:
                row[variant] = {"error": f"skipped: time budget of {args.budget_s:.0f}s spent"}
                continue
            try:
                row[variant] = serve_one(variant, route, model, example, args)
            except Exception as exc:  # one broken variant must not lose the other numbers
                row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"[{name} {route}] {variant}: {json.dumps(row[variant])}", flush=True)
            summarize(row, batches)
            record.save()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--batches", default="32,8,16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tiny", dest="smoke", action="store_true", help="the old name of --smoke")
    parser.add_argument("--budget-s", type=float, default=480, help="skip what is left once this is spent")
    args = parser.parse_args(argv)
    args.device = cli.device_for(args)
    record = Record("serving", args, args.device)
    started = time.perf_counter()
    with cpu_threads(1 if args.smoke else None):  # tiny matrices: threads cost more than they save
        for name in args.models.split(","):
            serve_model(name, args, record, started)
    print(f"\n{record.meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table(record.rows, [int(b) for b in args.batches.split(",")]))
    return record.data


if __name__ == "__main__":
    main()
