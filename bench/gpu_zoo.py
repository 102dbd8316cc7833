"""Model-zoo benchmark of the fxopt torch.compile backend: bf16 inference on one GPU.

For each model, side by side in one process: eager, Inductor, Inductor with
``freezing=True``, and fxopt + Inductor (``backend="fxopt"``, default inference pipeline).
Measured: median latency (``triton.testing.do_bench``), compile time (first call, each
compiled variant with its own fresh Inductor cache directory), time spent in fxopt's
passes, and numerics (relative L2 error of every variant against an fp32 eager run).

    python bench/gpu_zoo.py --models resnet50,mobilenet_v3_large --out $OUT/zoo_a.json
    python bench/gpu_zoo.py --tiny          # CPU, stand-in models: checks the script's logic

The table is printed last; the JSON holds every number. Models are built from code
(torchvision ``weights=None``; Hugging Face configs, randomly initialized): no downloads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.progress import progress

CONV_NETS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny")
ALL_MODELS = (*CONV_NETS, "vit_b_16", "bert_base", "gpt2", "llama_mlp")
VARIANTS = ("eager", "inductor", "inductor_freezing", "fxopt")


class GatedMLPStack(nn.Module):
    """Llama-shaped MLP blocks: x + down(silu(gate(x)) * up(x)), no attention."""

    def __init__(self, blocks: int = 8, d: int = 4096, hidden: int = 11008):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"gate": nn.Linear(d, hidden, bias=False), "up": nn.Linear(d, hidden, bias=False),
                           "down": nn.Linear(hidden, d, bias=False)})
            for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["down"](F.silu(b["gate"](x)) * b["up"](x))
        return x


class HiddenStates(nn.Module):
    """A Hugging Face encoder/decoder returning its last hidden state as a plain tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def build(name: str, tiny: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (fp32, eval) and its example inputs (on CPU, fp32/int64)."""
    torch.manual_seed(0)
    if tiny:
        return _build_tiny(name)
    if name in (*CONV_NETS, "vit_b_16"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None)
        if name == "vit_b_16":  # torchvision zero-initializes this head: outputs would all be 0
            nn.init.normal_(model.heads.head.weight, std=0.02)
        return model.eval(), (torch.randn(32, 3, 224, 224),)
    if name in ("bert_base", "gpt2"):
        import transformers

        if name == "bert_base":
            model = transformers.BertModel(transformers.BertConfig())
        else:
            model = transformers.GPT2Model(transformers.GPT2Config())
        return HiddenStates(model).eval(), (torch.randint(0, 30000, (16, 256)),)
    if name == "llama_mlp":
        return GatedMLPStack().eval(), (torch.randn(4, 512, 4096) * 0.5,)
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(ALL_MODELS)}")


def _build_tiny(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Small stand-ins with the same kinds of layers, for checking the script on a CPU."""
    from fxopt import models

    if name in CONV_NETS:
        return models.resnet18().eval(), (torch.randn(2, 3, 32, 32),)
    if name in ("vit_b_16", "bert_base", "gpt2"):
        return models.transformer_encoder().eval(), models.example_inputs("transformer_encoder", batch=2)
    return GatedMLPStack(blocks=2, d=32, hidden=64).eval(), (torch.randn(2, 8, 32),)


# --- variants ------------------------------------------------------------------------

def make_variant(variant: str, model: nn.Module, stats: dict[str, Any]) -> tuple[Callable, Callable]:
    """The callable and the context it runs in.

    Inductor's freezing needs the *global* flag: Dynamo reads it while tracing to make
    parameters graph attributes; ``torch.compile(options={"freezing": True})`` only patches
    Inductor and, with parameters inlined as graph inputs, freezes nothing. (The option is
    given too: it keeps this variant's Dynamo cache entry apart from plain Inductor's.)
    """
    if variant == "eager":
        return model, contextlib.nullcontext
    if variant == "inductor":
        return torch.compile(model), contextlib.nullcontext
    if variant == "inductor_freezing":
        return (torch.compile(model, options={"freezing": True}),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant in ("fxopt", "fxopt_cudnn"):
        stats["reports"] = []
        compiled = torch.compile(model, backend="fxopt", options={"reports": stats["reports"]})
        return compiled, (_cudnn_fusions if variant == "fxopt_cudnn" else contextlib.nullcontext)
    raise ValueError(variant)


@contextlib.contextmanager
def _cudnn_fusions():
    """fxopt's fused conv ops stay whole in Inductor (one cuDNN conv+bias(+add)+ReLU call)
    instead of being decomposed for Inductor to fuse the pointwise parts itself."""
    from fxopt import fused_ops

    before = fused_ops._KEEP_CUDNN_IN_INDUCTOR  # whatever fxopt's default is, put it back
    fused_ops.set_inductor_keeps_cudnn_fusions(True)
    try:
        yield
    finally:
        fused_ops.set_inductor_keeps_cudnn_fusions(before)


def fresh_cache_dir(root: str, label: str) -> None:
    """Each compiled variant compiles cold: kernels of one never serve another."""
    path = os.path.join(root, label)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def bench_ms(fn: Callable, inputs: tuple, device: str, graph: bool = False) -> float:
    """Median ms of one call: launched from Python as usual, or (``graph``) replayed as a
    CUDA graph, which takes the CPU's launch overhead out and leaves the GPU's work."""
    if device == "cuda":
        from triton.testing import do_bench

        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(*inputs)
            return do_bench(g.replay, warmup=25, rep=150, return_mode="median")
        return do_bench(lambda: fn(*inputs), warmup=25, rep=150, return_mode="median")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


@contextlib.contextmanager
def _no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def run_model(name: str, args: argparse.Namespace, cache_root: str) -> dict[str, Any]:
    device, dtype = args.device, args.dtype
    model, inputs = build(name, args.tiny)
    with torch.no_grad(), _no_tf32():
        reference = model.to(device)(*[x.to(device) for x in inputs]).float()  # fp32 eager
    model = model.to(dtype)
    inputs = tuple(x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in inputs)
    row: dict[str, Any] = {"model": name, "input_shapes": [list(x.shape) for x in inputs]}
    extra = ("fxopt_cudnn",) if args.cudnn_fusions and name in CONV_NETS else ()
    torch._dynamo.reset()
    compiled: dict[str, tuple[Callable, Callable]] = {}
    for variant in (*VARIANTS, *extra):
        stats: dict[str, Any] = {}
        try:
            fresh_cache_dir(cache_root, f"{name}-{variant}")
            fn, context = make_variant(variant, model, stats)
            with torch.no_grad(), context():
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn(*inputs)
                if device == "cuda":
                    torch.cuda.synchronize()
                first_call_s = time.perf_counter() - start
        except Exception as exc:  # one broken variant must not lose the other numbers
            row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"[{name}] {variant} FAILED: {row[variant]['error']}", flush=True)
            continue
        compiled[variant] = fn, context
        entry: dict[str, Any] = {}
        if variant != "eager":
            entry["compile_s"] = first_call_s
        if variant.startswith("fxopt"):
            reports = stats["reports"]
            entry["graphs"] = len(reports)
            entry["fallbacks"] = [g.fallback for g in reports if g.fallback]
            entry["pass_s"] = sum(g.report.total_seconds for g in reports if g.report)
            entry["frozen_inputs"] = sum(len(g.frozen) for g in reports)
            entry["changed_passes"] = sorted({r.name for g in reports if g.report
                                              for _, r in g.report.walk() if r.changed and not r.children})
        row[variant] = entry
    # timed in interleaved rounds: a drift of the machine hits every variant alike
    samples: dict[str, list[float]] = {v: [] for v in compiled}
    graph_samples: dict[str, list[float]] = {v: [] for v in compiled}
    for _ in progress(range(args.rounds), desc=f"{name} rounds", unit="round"):
        for variant, (fn, context) in compiled.items():
            with torch.no_grad(), context():
                samples[variant].append(bench_ms(fn, inputs, device))
                if args.cuda_graphs and device == "cuda":
                    graph_samples[variant].append(bench_ms(fn, inputs, device, graph=True))
    for variant, (fn, context) in compiled.items():
        with torch.no_grad(), context():
            out = fn(*inputs)  # after the timed runs: a stale or racy result would show
        times = sorted(samples[variant])
        row[variant].update(ms=times[len(times) // 2], ms_samples=times,
                            rel_l2_vs_fp32=rel_l2(out.float(), reference))
        if graph_samples[variant]:
            times = sorted(graph_samples[variant])
            row[variant].update(graph_ms=times[len(times) // 2], graph_ms_samples=times)
        print(f"[{name}] {variant}: {json.dumps(row[variant])}", flush=True)
    summarize(row)
    return row


def summarize(row: dict[str, Any]) -> None:
    """Ratios and verdicts: fxopt against the better Inductor variant, numerics against eager."""
    fx, ind, frz, eager = (row.get(v, {}) for v in ("fxopt", "inductor", "inductor_freezing", "eager"))
    best = min((v["ms"] for v in (ind, frz) if "ms" in v), default=None)
    if "ms" in fx and best is not None:
        row["speedup_vs_best_inductor"] = best / fx["ms"]
    best_graph = min((v["graph_ms"] for v in (ind, frz) if "graph_ms" in v), default=None)
    if "graph_ms" in fx and best_graph is not None:
        row["graph_speedup_vs_best_inductor"] = best_graph / fx["graph_ms"]
    if "ms" in row.get("fxopt_cudnn", {}) and best is not None:
        row["cudnn_speedup_vs_best_inductor"] = best / row["fxopt_cudnn"]["ms"]
    if "pass_s" in fx and "compile_s" in ind:
        row["pass_time_vs_inductor_compile"] = fx["pass_s"] / ind["compile_s"]
    if "rel_l2_vs_fp32" in fx and "rel_l2_vs_fp32" in eager:
        # "within bf16 tolerance of eager": no more than twice eager-bf16's own error against
        # fp32 (plus one bf16 rounding step), which Inductor's reassociation also needs
        bound = 2 * eager["rel_l2_vs_fp32"] + 2 ** -8
        row["numerics_bound"] = bound
        row["numerics_ok"] = fx["rel_l2_vs_fp32"] <= bound


def table(rows: list[dict[str, Any]]) -> str:
    def ms(row: dict[str, Any], v: str) -> str:
        if "ms" not in row.get(v, {}):
            return "ERR"
        lo, hi = row[v]["ms_samples"][0], row[v]["ms_samples"][-1]
        return f"{row[v]['ms']:.3f} ({lo:.2f}-{hi:.2f})"

    def cs(row: dict[str, Any], v: str) -> str:
        return f"{row[v]['compile_s']:.1f}" if "compile_s" in row.get(v, {}) else "-"

    lines = ["| model | eager ms | inductor ms | ind+freezing ms | fxopt ms | fxopt vs best | "
             "compile s ind / frz / fxopt | fxopt pass s (% of ind compile) | rel L2 vs fp32 eager / ind / fxopt | numerics |",
             "|" + "---|" * 10, "(ms: median of the rounds' medians, and the rounds' range)"]
    for r in rows:
        err = "/".join(f"{r[v]['rel_l2_vs_fp32']:.2e}" if "rel_l2_vs_fp32" in r.get(v, {}) else "ERR"
                       for v in ("eager", "inductor", "fxopt"))
        speed = f"{r['speedup_vs_best_inductor']:.3f}x" if "speedup_vs_best_inductor" in r else "-"
        share = (f"{r['fxopt']['pass_s']:.2f} ({100 * r['pass_time_vs_inductor_compile']:.1f}%)"
                 if "pass_time_vs_inductor_compile" in r else "-")
        ok = {True: "ok", False: "OUT"}.get(r.get("numerics_ok"), "-")
        lines.append(f"| {r['model']} | {ms(r, 'eager')} | {ms(r, 'inductor')} | {ms(r, 'inductor_freezing')} | "
                     f"{ms(r, 'fxopt')} | {speed} | {cs(r, 'inductor')} / {cs(r, 'inductor_freezing')} / "
                     f"{cs(r, 'fxopt')} | {share} | {err} | {ok} |")
    if any("graph_speedup_vs_best_inductor" in r for r in rows):
        lines += ["", "CUDA-graph replays (no launch overhead), ms: eager / inductor / ind+freezing / fxopt, "
                  "fxopt vs best"]
        for r in rows:
            each = " / ".join(f"{r[v]['graph_ms']:.3f}" if "graph_ms" in r.get(v, {}) else "-"
                              for v in ("eager", "inductor", "inductor_freezing", "fxopt"))
            speed = r.get("graph_speedup_vs_best_inductor")
            lines.append(f"| {r['model']} | {each} | {f'{speed:.3f}x' if speed else '-'} |")
    for key, label in (("speedup_vs_best_inductor", "fxopt"),
                       ("graph_speedup_vs_best_inductor", "fxopt, CUDA-graph replays"),
                       ("cudnn_speedup_vs_best_inductor", "fxopt, cuDNN fusions kept")):
        conv = [r[key] for r in rows if r["model"] in CONV_NETS and key in r]
        if conv:
            each = ", ".join(f"{r['model']} {r[key]:.3f}x" for r in rows if key in r and r["model"] in CONV_NETS)
            lines.append(f"conv-net geomean, {label} vs best Inductor: "
                         f"{math.exp(sum(map(math.log, conv)) / len(conv)):.3f}x ({each})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--tiny", action="store_true", help="CPU stand-ins: check the script's logic")
    parser.add_argument("--out", default=None, help="JSON file for all numbers")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--cudnn-fusions", action="store_true",
                        help="also time conv nets with fxopt's fused cuDNN conv ops kept whole")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time every variant as CUDA-graph replays (the GPU's work alone)")
    parser.add_argument("--budget-s", type=float, default=540, help="skip models once this is spent")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": str(args.dtype)}
    cache_root = tempfile.mkdtemp(prefix="fxopt_zoo_")
    for name in args.models.split(","):
        if time.perf_counter() - started > args.budget_s:
            print(f"[{name}] skipped: time budget of {args.budget_s:.0f}s spent", flush=True)
            continue
        rows.append(run_model(name, args, cache_root))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table(rows))


if __name__ == "__main__":
    main()
