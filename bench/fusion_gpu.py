"""Do the fused ops run faster? Eager and Inductor, with and without fxopt's fusions.

1. eager add+ReLU on a >=64M-element bf16 tensor: ``torch.relu(a + b)`` vs
   ``torch.ops.fxopt.add_relu`` (one Triton kernel);
2. eager torchvision resnet50 / mobilenet_v3_large, batch 32, bf16, channels_last: the
   model as is vs ``fxopt.optimize`` (default pipeline: BN folded, conv+ReLU and
   conv+add+ReLU on cuDNN's fused kernels, add+ReLU fused);
3. Inductor: ``torch.compile(model)``, the same with ``freezing=True``, and
   ``torch.compile`` of the fxopt-optimized graph, with the fused conv ops decomposed for
   Inductor and kept whole as cuDNN calls (fxopt's default on CUDA).

All variants of a model run in one process, side by side; times are medians of CUDA-event
timed loops (the harness's ``loop_ms``), and the freezing baseline is checked frozen. Results
go to ``--out`` (default ``bench/results/<gpu>/fusion_gpu.json``; written after every
measurement, so a timeout keeps what was done) and a table is printed last.

    python bench/fusion_gpu.py                       # on the GPU machine
    python bench/fusion_gpu.py --smoke               # checks the logic on CPU, tiny shapes (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from harness import Record, cli, frozen_summary, inductor_variant, loop_ms, not_frozen

import fxopt
from fxopt.compile import fused_ops


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics, so folding changes the weights."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
    return model


def models(smoke: bool) -> dict[str, Callable[[], nn.Module]]:
    """torchvision's models; under ``--smoke`` fxopt's demo net (convs, BN, residual ReLU):
    one model whose four Inductor compiles take seconds on a CPU."""
    if smoke:
        from fxopt.models import demo_model
        return {"demo(zoo)": lambda: demo_model()[0]}
    try:
        import torchvision.models as tvm
    except ImportError:  # the CPU check without torchvision: fxopt's own zoo
        from fxopt.models import mobilenet_v2, resnet18
        return {"resnet18(zoo)": resnet18, "mobilenet_v2(zoo)": mobilenet_v2}
    return {"resnet50": lambda: tvm.resnet50(), "mobilenet_v3_large": lambda: tvm.mobilenet_v3_large()}


def add(results: Record, **row: Any) -> None:
    """A row of the run, printed as it comes."""
    results.add(row)
    print(json.dumps(row, default=str), flush=True)


def bench_add_relu(args: argparse.Namespace, measure: Callable, results: Record) -> None:
    numel = 1 << 26 if not args.smoke else 1 << 16  # 64M elements
    shape = (numel // 4096, 4096)
    a = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
    fused = torch.ops.fxopt.add_relu(a, b)
    exact = torch.equal(fused, torch.relu(a + b))
    t_unfused = measure(lambda: torch.relu(a + b))
    t_fused = measure(lambda: torch.ops.fxopt.add_relu(a, b))
    gbytes = 3 * a.numel() * a.element_size() / 1e9
    add(results, part="add_relu", numel=a.numel(), dtype="bfloat16", unfused_ms=t_unfused,
                fused_ms=t_fused, speedup=t_unfused / t_fused, fused_gbps=gbytes / (t_fused / 1e3),
                bitwise_equal=exact, triton=fused_ops._triton_applies(a, b))


def bench_model(name: str, make: Callable[[], nn.Module], args: argparse.Namespace, measure: Callable,
                results: Record) -> None:
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    batch, size = (32, 224) if not args.smoke else (2, 64)
    torch.manual_seed(0)
    model = randomize_bn(make()).eval().to(device=device, dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        reference = model(x)
    t0 = time.perf_counter()
    gm = fxopt.optimize(fx.symbolic_trace(model), example_inputs=(x,))
    optimize_s = time.perf_counter() - t0
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if "fxopt" in str(node.target):
            key = str(node.target).split(".")[-1]
            counts[key] = counts.get(key, 0) + 1
    with torch.inference_mode():
        out = gm(x)
    scale = reference.float().abs().max().item()
    error = (out.float() - reference.float()).abs().max().item() / max(scale, 1e-6)
    row = dict(part="model", model=name, batch=batch, dtype=str(dtype), optimize_s=optimize_s,
               fused_ops=counts, rel_err_vs_eager=error)

    def timed(label: str, fn: Callable[[], Any], context: Callable = contextlib.nullcontext) -> None:
        try:
            with torch.inference_mode(), context():
                row[label] = measure(fn)
        except Exception as exc:  # one failing variant must not lose the others
            row[label] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        add(results, **row, stage=label)

    timed("eager_ms", lambda: model(x))
    timed("eager_fxopt_ms", lambda: gm(x))
    if args.skip_compile:
        return

    def compiled(target: nn.Module, freezing: bool = False, keep_cudnn: bool = False) -> tuple[Callable, Callable]:
        """The harness's Inductor mode (checked frozen where it freezes) of ``target``."""
        torch._dynamo.reset()
        fused_ops.set_inductor_keeps_cudnn_fusions(keep_cudnn)
        variant, key, stats = ("inductor_freezing" if freezing else "inductor"), f"{freezing=},{keep_cudnn=}", {}
        fn, context = inductor_variant(variant, target, stats)
        with context(), torch.inference_mode():
            t = time.perf_counter()
            out = fn(x)  # compiles here, under the config
            row.setdefault("compile_s", {})[key] = round(time.perf_counter() - t, 1)
            err = (out.float() - reference.float()).abs().max().item() / max(scale, 1e-6)
            row.setdefault("compiled_rel_err", {})[key] = err
        summary = frozen_summary(variant, stats)
        row.setdefault("frozen", {})[key] = summary["frozen"]
        if target is model and not_frozen(variant, summary):
            row.setdefault("harness_problems", []).append(not_frozen(variant, summary))
        return lambda: fn(x), context

    default_keep = fused_ops._KEEP_CUDNN_IN_INDUCTOR
    try:
        for label, target, kwargs in (
            ("inductor_ms", model, {}),
            ("inductor_freezing_ms", model, {"freezing": True}),
            ("fxopt_inductor_ms", gm, {}),
            ("fxopt_inductor_cudnn_ms", gm, {"keep_cudnn": True}),
        ):
            try:
                fn, context = compiled(target, **kwargs)
            except Exception as exc:
                row[label] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
                add(results, **row, stage=label)
                continue
            timed(label, fn, context)
    finally:
        fused_ops.set_inductor_keeps_cudnn_fusions(default_keep)
        torch._dynamo.reset()


def table(results: Record) -> None:
    rows = results.rows
    print("\n## fusion_gpu results:", json.dumps(results.meta))
    for row in rows:
        if row["part"] == "error":
            print("ERROR:", row["error"])
        if row["part"] == "add_relu":
            print(f"add_relu {row['numel']} bf16: unfused {row['unfused_ms']:.4f} ms, fused {row['fused_ms']:.4f} ms "
                  f"-> {row['speedup']:.2f}x ({row['fused_gbps']:.0f} GB/s, exact={row['bitwise_equal']}, "
                  f"triton={row['triton']})")
    finals: dict[str, dict] = {}
    for row in rows:
        if row["part"] == "model":
            finals[row["model"]] = row
    keys = ("eager_ms", "eager_fxopt_ms", "inductor_ms", "inductor_freezing_ms", "fxopt_inductor_ms",
            "fxopt_inductor_cudnn_ms")
    print("model | " + " | ".join(keys) + " | eager speedup | fxopt+inductor vs best inductor")
    gains = []
    for name, row in finals.items():
        vals = [row.get(k) for k in keys]
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v)[:40] for v in vals]
        eager = row["eager_ms"] / row["eager_fxopt_ms"] if all(
            isinstance(row.get(k), float) for k in ("eager_ms", "eager_fxopt_ms")) else float("nan")
        base = [row.get(k) for k in ("inductor_ms", "inductor_freezing_ms") if isinstance(row.get(k), float)]
        mine = [row.get(k) for k in ("fxopt_inductor_ms", "fxopt_inductor_cudnn_ms") if isinstance(row.get(k), float)]
        gain = min(base) / min(mine) if base and mine else float("nan")
        gains.append(gain)
        print(f"{name} | " + " | ".join(cells) + f" | {eager:.2f}x | {gain:.3f}x  fused={row['fused_ops']} "
              f"err={row['rel_err_vs_eager']:.2e}")
    valid = [g for g in gains if not math.isnan(g)]
    if valid:
        print(f"geomean fxopt+inductor vs best of inductor/freezing: "
              f"{math.exp(sum(map(math.log, valid)) / len(valid)):.3f}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", dest="smoke", action="store_true", help="the old name of --smoke")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.device = cli.device_for(args)
    results = Record("fusion_gpu", args, args.device)
    iters, reps = (2, 1) if args.smoke else (args.iters, args.reps)

    def measure(fn: Callable[[], Any]) -> float:
        return loop_ms(fn, args.device, iters=iters, reps=reps)

    parts = [lambda: bench_add_relu(args, measure, results)]
    for name, make in models(args.smoke).items():
        if not args.only or name in args.only.split(","):
            parts.append(lambda name=name, make=make: bench_model(name, make, args, measure, results))
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        for part in parts:
            try:
                part()
            except Exception as exc:  # report and go on: one call of the GPU machine is precious
                traceback.print_exc()
                add(results, part="error", error=f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        torch.backends.cudnn.benchmark = benchmark
    table(results)
    return results.data


if __name__ == "__main__":
    main()
