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
timed loops. Results go to ``$OUT/fusion_gpu.json`` (written after every measurement, so
a timeout keeps what was done) and a table is printed last.

    python bench/fusion_gpu.py                       # on the GPU machine
    python bench/fusion_gpu.py --device cpu --small  # checks the logic on CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.compile import fused_ops


def timer(device: str, iters: int, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds per call of ``fn`` (after warm-up)."""

    def measure(fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e3 / iters)
        return statistics.median(samples)

    return measure


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics, so folding changes the weights."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
    return model


def models(small: bool) -> dict[str, Callable[[], nn.Module]]:
    try:
        import torchvision.models as tvm
    except ImportError:  # the CPU check without torchvision: fxopt's own zoo
        from fxopt.models import mobilenet_v2, resnet18
        return {"resnet18(zoo)": resnet18, "mobilenet_v2(zoo)": mobilenet_v2}
    if small:
        return {"resnet18": lambda: tvm.resnet18(), "mobilenet_v3_small": lambda: tvm.mobilenet_v3_small()}
    return {"resnet50": lambda: tvm.resnet50(), "mobilenet_v3_large": lambda: tvm.mobilenet_v3_large()}


class Results:
    def __init__(self, path: str | None, header: dict[str, Any]):
        self.path, self.data = path, {"header": header, "rows": []}

    def add(self, **row: Any) -> None:
        self.data["rows"].append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def bench_add_relu(args: argparse.Namespace, measure: Callable, results: Results) -> None:
    numel = 1 << 26 if not args.small else 1 << 16  # 64M elements
    shape = (numel // 4096, 4096)
    a = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
    fused = torch.ops.fxopt.add_relu(a, b)
    exact = torch.equal(fused, torch.relu(a + b))
    t_unfused = measure(lambda: torch.relu(a + b))
    t_fused = measure(lambda: torch.ops.fxopt.add_relu(a, b))
    gbytes = 3 * a.numel() * a.element_size() / 1e9
    results.add(part="add_relu", numel=a.numel(), dtype="bfloat16", unfused_ms=t_unfused,
                fused_ms=t_fused, speedup=t_unfused / t_fused, fused_gbps=gbytes / (t_fused / 1e3),
                bitwise_equal=exact, triton=fused_ops._triton_applies(a, b))


def bench_model(name: str, make: Callable[[], nn.Module], args: argparse.Namespace, measure: Callable,
                results: Results) -> None:
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    batch, size = (32, 224) if not args.small else (2, 64)
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

    def timed(label: str, fn: Callable[[], Any]) -> None:
        try:
            with torch.inference_mode():
                row[label] = measure(fn)
        except Exception as exc:  # one failing variant must not lose the others
            row[label] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        results.add(**row, stage=label)

    timed("eager_ms", lambda: model(x))
    timed("eager_fxopt_ms", lambda: gm(x))
    if args.skip_compile:
        return

    def compiled(target: nn.Module, freezing: bool = False, keep_cudnn: bool = False) -> Callable[[], Any]:
        torch._dynamo.reset()
        fused_ops.set_inductor_keeps_cudnn_fusions(keep_cudnn)
        fn = torch.compile(target)
        with torch._inductor.config.patch(freezing=freezing), torch.inference_mode():
            t = time.perf_counter()
            out = fn(x)  # compiles here, under the config
            row.setdefault("compile_s", {})[f"{freezing=},{keep_cudnn=}"] = round(time.perf_counter() - t, 1)
            err = (out.float() - reference.float()).abs().max().item() / max(scale, 1e-6)
            row.setdefault("compiled_rel_err", {})[f"{freezing=},{keep_cudnn=}"] = err
        return lambda: fn(x)

    default_keep = fused_ops._KEEP_CUDNN_IN_INDUCTOR
    for label, target, kwargs in (
        ("inductor_ms", model, {}),
        ("inductor_freezing_ms", model, {"freezing": True}),
        ("fxopt_inductor_ms", gm, {}),
        ("fxopt_inductor_cudnn_ms", gm, {"keep_cudnn": True}),
    ):
        try:
            fn = compiled(target, **kwargs)
        except Exception as exc:
            row[label] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
            results.add(**row, stage=label)
            continue
        timed(label, fn)
    fused_ops.set_inductor_keeps_cudnn_fusions(default_keep)


def table(results: Results) -> None:
    rows = results.data["rows"]
    print("\n## fusion_gpu results:", json.dumps(results.data["header"]))
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a logic check")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    header = {"machine": platform.node(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "cudnn": torch.backends.cudnn.version() if args.device == "cuda" else None}
    out = os.environ.get("OUT")
    results = Results(os.path.join(out, "fusion_gpu.json") if out else None, header)
    measure = timer(args.device, args.iters, args.reps)
    torch.backends.cudnn.benchmark = True
    parts = [lambda: bench_add_relu(args, measure, results)]
    for name, make in models(args.small).items():
        if not args.only or name in args.only.split(","):
            parts.append(lambda name=name, make=make: bench_model(name, make, args, measure, results))
    for part in parts:
        try:
            part()
        except Exception as exc:  # report and go on: one call of the GPU machine is precious
            traceback.print_exc()
            results.add(part="error", error=f"{type(exc).__name__}: {str(exc)[:500]}")
    table(results)


if __name__ == "__main__":
    main()
