"""fxopt.profile on a GPU (or the CPU): do the per-node figures add up to what torch measures?

Checks, each printed and written to ``$OUT/profile_gpu.json`` (or ``--out``):

1. time: the sum of the nodes' GPU kernel time vs the end-to-end time of a plain
   ``gm(*inputs)`` call (CUDA-synchronized wall time, median), on GPU-bound models;
2. memory: the peak of the measured live-memory curve vs ``torch.cuda.max_memory_allocated``
   over one plain call (both relative to the memory allocated before the call); on the CPU
   vs the peak of the CPU profiler's allocator events over one plain call;
3. the hotspot ranking of torchvision's resnet18 and the before/after of the default
   pipeline (``fxopt.optimize(..., profile=True)``);
4. Inductor kernels attributed to FX nodes for a model compiled with ``backend="fxopt"``.

Run: ``python3 bench/profile_gpu.py [--out DIR]`` on a CUDA machine; ``--device cpu
--small`` runs checks 1-3 on the CPU with smaller models (fxopt.models.ResNet18 where
torchvision is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.profiling import profile, profile_compiled


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def plain_peak(gm: nn.Module, inputs: tuple) -> int:
    if inputs[0].device.type == "cpu":
        from torch.profiler import ProfilerActivity

        with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = gm(*inputs)
            del out
        live = peak = 0
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        return peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = gm(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def plain_time(gm: nn.Module, inputs: tuple, repeat: int = 20) -> float:
    for _ in range(3):
        gm(*inputs)
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        gm(*inputs)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(name: str, gm: fx.GraphModule, inputs: tuple, results: dict, top: int = 5) -> None:
    with torch.no_grad():
        p = profile(gm, inputs, warmup=3, repeat=10 if inputs[0].is_cuda else 5)
        eager = plain_time(gm, inputs)
        peak = plain_peak(gm, inputs)
    row = {
        "nodes": len(p.nodes), "node_kernel_ms": p.node_time_s * 1e3, "plain_ms": eager * 1e3,
        "profiled_run_ms": p.total_s * 1e3, "time_ratio": p.node_time_s / eager,
        "curve_peak_bytes": p.peak_bytes, "max_memory_allocated_bytes": peak,
        "memory_ratio": p.peak_bytes / peak if peak else None,
        "top": [(r["node"], r["kind"], round(r["time_ms"], 4), round(100 * r["share"], 1))
                for r in p.hotspots(top)],
        "kinds": [(r["kind"], round(r["time_ms"], 4)) for r in p.by_kind()],
    }
    results[name] = row
    print(f"\n== {name}\n{p.table(top)}")
    print(f"-> node kernel sum / plain end-to-end = {row['time_ratio']:.3f}; "
          f"curve peak / max_memory_allocated = {row['memory_ratio']}")


class MLP(nn.Module):
    def __init__(self, width: int = 4096, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="smaller models and batches (CPU)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu, {os.cpu_count()} cores"
    results: dict = {"torch": torch.__version__, "device": name}
    width, rows, batch, seq = (768, 256, 4, 64) if args.small else (4096, 8192, 64, 256)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    try:
        from torchvision.models import resnet18
    except ImportError:
        from fxopt.models import ResNet18 as resnet18
    from fxopt.models import TransformerEncoderNet

    steps = [
        (f"mlp_{width}x8", lambda: (fx.symbolic_trace(MLP(width).to(dev, dtype).eval()),
                                    (torch.randn(rows, width, device=dev, dtype=dtype),))),
        (f"resnet18_b{batch}", lambda: (fx.symbolic_trace(resnet18().to(dev).eval()),
                                        (torch.randn(batch, 3, 224, 224, device=dev),))),
        (f"transformer_encoder_b{batch // 2}", lambda: (
            fx.symbolic_trace(TransformerEncoderNet(d_model=512, heads=8, ff=2048, layers=4).to(dev).eval()),
            (torch.randn(batch // 2, seq, 512, device=dev),))),
    ]
    for name, build in steps:
        try:
            gm, inputs = build()
            check(name, gm, inputs, results)
        except Exception:
            results[name] = traceback.format_exc()
            print(results[name])
    try:  # before/after of the default pipeline on resnet18
        model = resnet18().to(dev).eval()
        x = torch.randn(batch, 3, 224, 224, device=dev)
        with torch.no_grad():
            gm = fxopt.optimize(model, example_inputs=(x,), profile=True)
        diff = fxopt.report_of(gm).profile
        print("\n== resnet18 default pipeline, before/after\n" + diff.table())
        results["resnet18_diff"] = diff.rows()
    except Exception:
        results["resnet18_diff"] = traceback.format_exc()
        print(results["resnet18_diff"])
    try:  # Inductor kernels -> FX nodes
        if dev.type != "cuda":
            raise RuntimeError("compiled check skipped off the GPU (tests/profiling covers the CPU)")
        model = TransformerEncoderNet(d_model=256, heads=4, ff=1024, layers=2).cuda().eval()
        with torch.no_grad():
            compiled = profile_compiled(model, (torch.randn(16, 128, 256, device="cuda"),), repeat=5)
        print("\n== compiled transformer encoder\n" + compiled.table(15))
        results["compiled"] = {"rows": compiled.rows(), "warnings": compiled.warnings}
    except Exception:
        results["compiled"] = traceback.format_exc()
        print(results["compiled"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile_gpu.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
