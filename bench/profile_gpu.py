"""fxopt.profile on a GPU (or the CPU): do the per-node figures add up to what torch measures?

Checks, each printed and written to ``--out`` (default ``bench/results/<gpu>/profile_gpu.json``;
the command line's report lands next to it):

1. time: the sum of the nodes' times (GPU kernel time; CPU range time on the CPU) vs the
   end-to-end time of a plain ``gm(*inputs)`` call (CUDA-synchronized wall time, median of
   5), measured right after each of 5 profiles; the median ratio is reported. Models: an
   MLP, torchvision's resnet18, fxopt's transformer encoder and, where ``transformers`` is
   installed, a 4-layer BERT (exported with torch.export);
2. memory: the peak of the measured live-memory curve vs ``torch.cuda.max_memory_allocated``
   over one plain call (both relative to the memory allocated before the call); on the CPU
   vs the peak of the CPU profiler's allocator events over one plain call;
3. the hotspot ranking of torchvision's resnet18 and the before/after of the default
   pipeline (``fxopt.optimize(..., profile=fxopt.profile)``);
4. Inductor kernels attributed to FX nodes for a model compiled with ``backend="fxopt"``;
5. the command line as the issue writes it (``fxopt profile torchvision.models:resnet18
   --device cuda --top 10 --trace ... --report ...``, no input shape);
6. overhead: what profiling adds per node (a chain of 256 tiny ops), and the wall time of
   one default ``profile()`` call per model.

Run: ``python3 bench/profile_gpu.py [--out FILE]`` on a CUDA machine; ``--device cpu`` on
the CPU; ``--smoke`` (once ``--small``) runs every check but the compiled one on the CPU with
tiny models and two rounds (fxopt.models.ResNet18 where torchvision is missing; CI).
"""

from __future__ import annotations

import json
import time
import traceback

import torch
import torch.fx as fx
import torch.nn as nn
from harness import Record, cli, wall_ms

import fxopt
from fxopt.profiling import profile, profile_compiled


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


def plain_time(gm: nn.Module, inputs: tuple, repeat: int = 20, warm: int = 3) -> float:
    """Seconds of a plain, synchronized call (median)."""
    return wall_ms(lambda: gm(*inputs), inputs[0].device.type, reps=repeat, warmup=warm) / 1e3


def check(name: str, gm: fx.GraphModule, inputs: tuple, results: dict, top: int = 5,
          rounds: int = 5) -> None:
    """``rounds`` times: profile (3 runs), then time the plain call right after it; the
    ratio is taken per round and its median reported, so a load swing on a shared machine
    hits both sides of a ratio alike."""
    ratios, profiles, plains = [], [], []
    with torch.no_grad():
        for _ in range(rounds):
            p = profile(gm, inputs, warmup=1, repeat=3)
            eager = plain_time(gm, inputs, repeat=5, warm=1)
            ratios.append(p.node_time_s / eager)
            profiles.append(p)
            plains.append(eager)
        peak = plain_peak(gm, inputs)
    i = sorted(range(rounds), key=ratios.__getitem__)[rounds // 2]  # the median round
    p = profiles[i]
    row = {
        "nodes": len(p.nodes), "node_time_ms": p.node_time_s * 1e3, "plain_ms": plains[i] * 1e3,
        "profiled_run_ms": p.total_s * 1e3, "time_ratio": ratios[i],
        "time_ratios": [round(r, 3) for r in ratios],
        "curve_peak_bytes": p.peak_bytes, "allocator_peak_bytes": peak,
        "memory_ratio": p.peak_bytes / peak if peak else None,
        "top": [(r["node"], r["kind"], round(r["time_ms"], 4), round(100 * r["share"], 1))
                for r in p.hotspots(top)],
        "kinds": [(r["kind"], round(r["time_ms"], 4)) for r in p.by_kind()],
    }
    results[name] = row
    if name.startswith("mlp"):  # which kinds of raw events the profiler gave (diagnostics)
        kinds: dict[str, int] = {}
        for e in p.profiler.profiler.kineto_results.events():
            key = f"{e.device_type()}/user={e.is_user_annotation()}/linked={e.linked_correlation_id() != 0}"
            kinds[key] = kinds.get(key, 0) + 1
        row["event_kinds"] = kinds
        row["kernels_attributed"] = sum(len(n.kernels) for n in p.nodes)
    print(f"\n== {name}\n{p.table(top)}")
    print(f"-> node time sum / plain end-to-end = {row['time_ratio']:.3f} (median of {ratios}); "
          f"curve peak / allocator peak = {row['memory_ratio']}")


class Chain(nn.Module):
    """``length`` tiny pointwise ops: what profiling adds per node, with no work to hide it."""

    def __init__(self, length: int = 256):
        super().__init__()
        self.length = length

    def forward(self, x):
        for _ in range(self.length):
            x = x * 1.0001
        return x


def overhead(dev: torch.device, results: dict) -> None:
    """Profiling overhead: per node (on a chain of tiny ops) and for a whole profile() call."""
    length = 256
    gm = fx.symbolic_trace(Chain(length))
    x = torch.randn(16, device=dev)
    with torch.no_grad():
        p = profile(gm, (x,), warmup=2, repeat=10)
        plain = plain_time(gm, (x,), repeat=50)
    nodes = len(p.nodes)
    per_node_us = (p.total_s - plain) / nodes * 1e6
    results["overhead_chain"] = {
        "nodes": nodes, "plain_ms": plain * 1e3, "profiled_run_ms": p.total_s * 1e3,
        "overhead_per_node_us": per_node_us, "plain_per_node_us": plain / nodes * 1e6,
    }
    print(f"\n== overhead: {nodes} tiny nodes, plain {plain * 1e3:.3f} ms, profiled run "
          f"{p.total_s * 1e3:.3f} ms -> {per_node_us:.1f} us per node added")


class MLP(nn.Module):
    def __init__(self, width: int = 4096, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def bert(dev: torch.device, batch: int, seq: int) -> tuple[fx.GraphModule, tuple]:
    """A transformers BERT encoder (4 layers, random weights), exported once: symbolic_trace
    cannot follow it, so ``profile(model, ...)`` would export it on every call."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(num_hidden_layers=4)).to(dev).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev)
    return torch.export.export(model, (ids,), strict=False).module(), (ids,)


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", dest="smoke", action="store_true", help="the old name of --smoke")
    args = parser.parse_args(argv)
    dev = torch.device(cli.device_for(args))
    record = Record("profile_gpu", args, dev.type)
    results: dict = record.extra.setdefault("checks", {})  # one entry per check, by name
    folder = record.path.parent  # the command line's report goes next to the record
    rounds = 2 if args.smoke else args.rounds
    width, rows, batch, seq, size = (64, 16, 2, 16, 32) if args.smoke else (4096, 8192, 64, 256, 224)
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
                                        (torch.randn(batch, 3, size, size, device=dev),))),
        (f"transformer_encoder_b{batch // 2}", lambda: (
            fx.symbolic_trace(TransformerEncoderNet(d_model=512, heads=8, ff=2048, layers=4).to(dev).eval()),
            (torch.randn(batch // 2, seq, 512, device=dev),))),
        (f"bert_4layers_b{batch // 2}", lambda: bert(dev, batch // 2, seq)),
    ]
    if args.smoke:  # the CLI and the before/after still profile resnet18
        steps = [s for s in steps if not s[0].startswith("resnet18")]
    for name, build in steps:
        try:
            gm, inputs = build()
            check(name, gm, inputs, results, rounds=rounds)
            start = time.perf_counter()  # what one default profile() call costs in all
            with torch.no_grad():
                profile(gm, inputs)
            results[name]["profile_call_s"] = time.perf_counter() - start
        except ImportError as exc:
            results[name] = f"skipped: {exc}"
        except Exception:
            results[name] = traceback.format_exc()
            print(results[name])
        record.save()
    try:  # the command line, no input shape given: trace and report written
        from fxopt.cli import main as fxopt_cli

        out = folder
        out.mkdir(parents=True, exist_ok=True)
        factory = "torchvision.models:resnet18" if "torchvision" in resnet18.__module__ else "fxopt.models:ResNet18"
        code = fxopt_cli(["profile", factory, "--device", dev.type, "--top", "10",
                    "--trace", str(out / "resnet18_trace.json"), "--report", str(out / "resnet18_profile.html")])
        trace = json.loads((out / "resnet18_trace.json").read_text())
        slices = sum(1 for e in trace["traceEvents"] if e.get("name", "").startswith("fxopt::"))
        results["cli"] = {"exit": code, "node_slices": slices,
                          "report_bytes": (out / "resnet18_profile.html").stat().st_size}
        (out / "resnet18_trace.json").unlink()  # large; the slice count is the check
    except Exception:
        results["cli"] = traceback.format_exc()
        print(results["cli"])
    record.save()
    try:
        overhead(dev, results)
    except Exception:
        results["overhead_chain"] = traceback.format_exc()
        print(results["overhead_chain"])
    record.save()
    try:  # before/after of the default pipeline on resnet18
        model = resnet18().to(dev).eval()
        x = torch.randn(batch, 3, size, size, device=dev)
        with torch.no_grad():
            gm = fxopt.optimize(model, example_inputs=(x,), profile=fxopt.profile)
        diff = fxopt.report_of(gm).profile
        print("\n== resnet18 default pipeline, before/after\n" + diff.table())
        results["resnet18_diff"] = diff.rows()
    except Exception:
        results["resnet18_diff"] = traceback.format_exc()
        print(results["resnet18_diff"])
    record.save()
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
    record.save()
    return record.data


if __name__ == "__main__":
    main()
