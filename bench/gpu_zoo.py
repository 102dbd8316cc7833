"""Model-zoo benchmark of the fxopt torch.compile backend: bf16 inference on one GPU.

For each model, side by side in one process: eager, every Inductor mode a user could pick
(default, ``freezing=True``, ``mode="reduce-overhead"``, reduce-overhead with freezing), and
fxopt + Inductor (``backend="fxopt"``, default inference pipeline); optionally more
variants (``--variants``): the fxopt backend under the *global* freezing
flag (as a harness that sets it process-wide runs it), and Inductor's max-autotune.
Measured, in interleaved rounds so that a drift of the machine hits every variant alike:
median latency with plain launches (``triton.testing.do_bench`` on the Python call) and,
with ``--cuda-graphs``, as CUDA-graph replays; each under ``cudnn.benchmark`` off and
(``--cudnn-benchmark``) on; the CPU time of one call with the GPU idle; compile time (first
call, each compiled variant with its own fresh Inductor cache directory); time spent in
fxopt's passes; numerics (relative L2 error of every variant against an fp32 eager run);
with ``--profile``, the kernels one call launches (torch.profiler).

    python bench/gpu_zoo.py --models resnet50,mobilenet_v3_large --out $OUT/zoo_a.json
    python bench/gpu_zoo.py --layouts channels_last,nchw --cuda-graphs --profile $OUT/prof.txt
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

CONV_NETS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_1_6gf")
ALL_MODELS = (*CONV_NETS, "vit_b_16", "bert_base", "gpt2", "llama_decoder", "llama_mlp")
VARIANTS = ("eager", "inductor", "inductor_freezing", "reduce_overhead", "reduce_overhead_freezing", "fxopt")
#: the Inductor modes fxopt is compared with: the best of them, per model
INDUCTOR_MODES = ("inductor", "inductor_freezing", "reduce_overhead", "reduce_overhead_freezing")
#: more variants, by request: see make_variant
EXTRA_VARIANTS = ("fxopt_global_freezing", "fxopt_global_freezing_unfixed", "fxopt_1x1_mm",
                  "inductor_freezing_1x1_mm", "max_autotune", "fxopt_cudnn", "fxopt_cpp_wrapper",
                  "inductor_freezing_cpp_wrapper", "fxopt_no_replay")
#: variants that capture CUDA graphs themselves: the harness's own capture is not timed
SELF_GRAPHED = ("reduce_overhead", "reduce_overhead_freezing")


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
    if name in ("bert_base", "gpt2", "llama_decoder"):
        import transformers

        if name == "bert_base":
            model = transformers.BertModel(transformers.BertConfig())
        elif name == "gpt2":
            model = transformers.GPT2Model(transformers.GPT2Config())
        else:  # Llama-shaped: RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP
            model = transformers.LlamaModel(transformers.LlamaConfig(
                hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024))
        return HiddenStates(model).eval(), (torch.randint(0, 30000, (16, 256)),)
    if name == "llama_mlp":
        return GatedMLPStack().eval(), (torch.randn(4, 512, 4096) * 0.5,)
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(ALL_MODELS)}")


def _build_tiny(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Small stand-ins with the same kinds of layers, for checking the script on a CPU."""
    from fxopt import models

    if name in CONV_NETS:
        return models.resnet18().eval(), (torch.randn(2, 3, 32, 32),)
    if name in ("vit_b_16", "bert_base", "gpt2", "llama_decoder"):
        return models.transformer_encoder().eval(), models.example_inputs("transformer_encoder", batch=2)
    return GatedMLPStack(blocks=2, d=32, hidden=64).eval(), (torch.randn(2, 8, 32),)


# --- variants ------------------------------------------------------------------------

def make_variant(variant: str, model: nn.Module, stats: dict[str, Any],
                 dynamic: bool | None = None) -> tuple[Callable, Callable]:
    """The callable and the context it runs in (``dynamic`` goes to ``torch.compile``).

    Inductor's freezing needs the *global* flag: Dynamo reads it while tracing to make
    parameters graph attributes; ``torch.compile(options={"freezing": True})`` only patches
    Inductor and, with parameters inlined as graph inputs, freezes nothing. (The option is
    given too: it keeps this variant's Dynamo cache entry apart from plain Inductor's.)
    """
    if variant == "eager":
        return model, contextlib.nullcontext
    if variant == "inductor":
        return torch.compile(model, dynamic=dynamic), contextlib.nullcontext
    if variant == "inductor_freezing":
        return (torch.compile(model, options={"freezing": True}, dynamic=dynamic),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant == "inductor_freezing_1x1_mm":  # Inductor freezing with the flag fxopt sets
        return (torch.compile(model, options={"freezing": True, "conv_1x1_as_mm": True}),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant == "inductor_freezing_cpp_wrapper":  # Inductor's C++ wrapper: less host time per launch
        return (torch.compile(model, options={"freezing": True, "cpp_wrapper": True}),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant == "reduce_overhead":  # Inductor's own CUDA graphs (outputs live in its pool)
        return torch.compile(model, mode="reduce-overhead", dynamic=dynamic), contextlib.nullcontext
    if variant == "reduce_overhead_freezing":
        # the mode as options (mode and options are exclusive), with "freezing" to keep the
        # Dynamo cache entry apart: given mode="reduce-overhead" it reused reduce_overhead's
        # unfrozen code (compile 0.0 s in session 6's runs)
        options = {**torch._inductor.list_mode_options("reduce-overhead"), "freezing": True}
        return (torch.compile(model, options=options, dynamic=dynamic),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant == "max_autotune":  # Inductor's best, without its CUDA graphs: timed both ways here
        options = {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "freezing": True}
        return (torch.compile(model, options=options),
                lambda: torch._inductor.config.patch(freezing=True))
    if variant.startswith("fxopt"):
        stats["reports"] = []
        options: dict[str, Any] = {"reports": stats["reports"]}
        if variant == "fxopt_1x1_mm":  # pointwise convs as matrix products (measured slower)
            options["inductor"] = {"conv_1x1_as_mm": True}
        if variant == "fxopt_cpp_wrapper":
            options["inductor"] = {"cpp_wrapper": True}
        if variant == "fxopt_no_replay":  # the backend's kernels launched one by one
            options["cuda_graphs"] = False
        compiled = torch.compile(model, backend="fxopt", options=options, dynamic=dynamic)
        if variant == "fxopt_cudnn":
            return compiled, _cudnn_fusions
        if variant == "fxopt_global_freezing":
            return compiled, lambda: torch._inductor.config.patch(freezing=True)
        if variant == "fxopt_global_freezing_unfixed":
            return compiled, _global_freezing_unfixed
        return compiled, contextlib.nullcontext
    raise ValueError(variant)


@contextlib.contextmanager
def _global_freezing_unfixed():
    """The global freezing flag with the backend as it was before it noticed weights Dynamo
    had already frozen: no layout passes (diagnostic of the harness disagreement)."""
    import fxopt.backend as backend

    saved = backend._traced_frozen
    backend._traced_frozen = lambda *args: False
    try:
        with torch._inductor.config.patch(freezing=True):
            yield
    finally:
        backend._traced_frozen = saved


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
            return do_bench(g.replay, warmup=25, rep=100, return_mode="median")
        return do_bench(lambda: fn(*inputs), warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def cpu_call_ms(fn: Callable, inputs: tuple) -> float:
    """Median host time of one call started on an idle GPU: the CPU's cost of launching
    it (Python, guards, dispatch, launches), which plain launches pay when it exceeds the
    GPU's work."""
    times = []
    for _ in range(15):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def profile_kernels(fn: Callable, inputs: tuple, label: str, sink: str | None) -> dict[str, Any]:
    """Kernels of one call (torch.profiler): how many, how many are Triton, cuDNN/cuBLAS or
    layout transposes, and the top ones by GPU time (appended to the text file ``sink``)."""
    from torch.profiler import ProfilerActivity, profile

    calls = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    def count(*keys: str) -> float:
        return sum(any(k in e.name.lower() for k in keys) for e in kernels) / calls
    stats = {"kernels": len(kernels) / calls, "triton": count("triton"),
             "layout_transposes": count("nchwtonhwc", "nhwctonchw", "transpose", "convertlayout"),
             "copies": count("copy", "elementwise_kernel_with_index"),
             "gpu_us": sum(e.device_time_total for e in kernels) / calls if hasattr(kernels[0], "device_time_total")
             else sum(e.cuda_time_total for e in kernels) / calls} if kernels else {"kernels": 0}
    if sink:
        with open(sink, "a") as f:
            f.write(f"\n===== {label}: {json.dumps(stats)}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return stats


@contextlib.contextmanager
def _cudnn_benchmark(on: bool):
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


@contextlib.contextmanager
def _no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _fresh_like(x: torch.Tensor) -> torch.Tensor:
    """New values of ``x``'s shape, dtype and layout (token ids stay in range)."""
    if x.is_floating_point():
        return torch.randn_like(x)
    return torch.randint_like(x, int(x.max()) + 1)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def run_model(name: str, args: argparse.Namespace, cache_root: str, layout: str) -> dict[str, Any]:
    device, dtype = args.device, args.dtype
    model, inputs = build(name, args.tiny)
    with torch.no_grad(), _no_tf32():
        reference = model.to(device)(*[x.to(device) for x in inputs]).float()  # fp32 eager
    model = model.to(dtype)
    inputs = tuple(x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in inputs)
    if layout == "channels_last":  # model and 4-d inputs, as vision inference usually runs
        model = model.to(memory_format=torch.channels_last)
        inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
    row: dict[str, Any] = {"model": name, "layout": layout, "input_shapes": [list(x.shape) for x in inputs]}
    wanted = [v for v in args.variants.split(",") if v] if args.variants else []
    extra = [v for v in wanted if v in EXTRA_VARIANTS and (name in CONV_NETS or not v.startswith(("fxopt_cudnn", "fxopt_global_freezing_unfixed")))]
    if args.autotune_models and name in args.autotune_models.split(",") and "max_autotune" not in extra:
        extra.append("max_autotune")
    if args.cudnn_fusions and name in CONV_NETS:
        extra.append("fxopt_cudnn")
    torch._dynamo.reset()
    compiled: dict[str, tuple[Callable, Callable]] = {}
    for variant in (*VARIANTS, *extra):
        stats: dict[str, Any] = {}
        try:
            fresh_cache_dir(cache_root, "shared" if args.shared_cache else f"{name}-{layout}-{variant}")
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
            entry["replayed"] = sum(g.no_replay is None for g in reports if not g.fallback)
            entry["no_replay"] = sorted({g.no_replay for g in reports if g.no_replay})
            entry["replay_logs"] = [str(g.replay) for g in reports if g.replay is not None]
            entry["pass_s"] = sum(g.report.total_seconds for g in reports if g.report)
            entry["frozen_inputs"] = sum(len(g.frozen) for g in reports)
            entry["changed_passes"] = sorted({r.name for g in reports if g.report
                                              for _, r in g.report.walk() if r.changed and not r.children})
        row[variant] = entry
    # timed in interleaved rounds: a drift of the machine hits every variant alike
    cuda = device == "cuda"
    settings = [("", False)] + ([("bench_", True)] if args.cudnn_benchmark and cuda else [])
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in progress(range(args.rounds), desc=f"{name} rounds", unit="round"):
        for variant, (fn, context) in compiled.items():
            for prefix, flag in settings:
                with torch.no_grad(), context(), _cudnn_benchmark(flag):
                    samples.setdefault((variant, prefix + "ms"), []).append(bench_ms(fn, inputs, device))
                    if args.cuda_graphs and cuda and variant not in SELF_GRAPHED:
                        samples.setdefault((variant, prefix + "graph_ms"), []).append(
                            bench_ms(fn, inputs, device, graph=True))
    fresh = tuple(_fresh_like(x) for x in inputs)
    with torch.no_grad():
        fresh_reference = model(*fresh).float()  # bf16 eager on inputs no variant has seen
    for variant, (fn, context) in compiled.items():
        with torch.no_grad(), context():
            out = fn(*inputs)  # after the timed runs: a stale or racy result would show
            # a replay that read stale inputs would still match on the timed inputs
            row[variant]["rel_l2_fresh_vs_eager"] = rel_l2(fn(*fresh).float(), fresh_reference)
            if cuda:
                row[variant]["cpu_ms"] = cpu_call_ms(fn, inputs)
                if args.profile:
                    row[variant]["profile"] = profile_kernels(fn, inputs, f"{name} {layout} {variant}", args.profile)
        row[variant]["rel_l2_vs_fp32"] = rel_l2(out.float(), reference)
        for (v, key), times in samples.items():
            if v == variant:
                times = sorted(times)
                row[variant].update({key: times[len(times) // 2], f"{key}_samples": times})
        print(f"[{name} {layout}] {variant}: {json.dumps(row[variant])}", flush=True)
    summarize(row)
    return row


def summarize(row: dict[str, Any]) -> None:
    """Ratios and verdicts: fxopt against the best Inductor mode (per column: the modes
    that capture their own CUDA graphs have no separate graph column), numerics against eager."""
    fx, ind, eager = (row.get(v, {}) for v in ("fxopt", "inductor", "eager"))
    modes = [row[v] for v in INDUCTOR_MODES if isinstance(row.get(v), dict)]
    for key in ("ms", "graph_ms", "bench_ms", "bench_graph_ms"):
        timed = [(v[key], name) for name, v in zip(INDUCTOR_MODES, modes) if key in v]
        if key in fx and timed:
            best, name = min(timed)
            row[f"{key.replace('ms', 'speedup')}_vs_best_inductor"] = best / fx[key]
            row[f"best_inductor_{key}"] = name
        if key in fx and key in row.get("max_autotune", {}):
            row[f"{key.replace('ms', 'speedup')}_vs_max_autotune"] = row["max_autotune"][key] / fx[key]
    best = min((v["ms"] for v in modes if "ms" in v), default=None)
    if "ms" in row.get("fxopt_no_replay", {}) and best is not None:  # what replay adds
        row["no_replay_speedup_vs_best_inductor"] = best / row["fxopt_no_replay"]["ms"]
    for mode in ("reduce_overhead", "reduce_overhead_freezing"):  # against Inductor's own CUDA graphs
        if "ms" in row.get(mode, {}) and "ms" in fx:
            row[f"speedup_vs_{mode}"] = row[mode]["ms"] / fx["ms"]
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
    """Per model and layout: each variant's median ms (the rounds' range) with plain launches,
    as CUDA-graph replays, and with cudnn.benchmark on; one call's CPU ms and kernel count."""
    lines = ["ms: median of the rounds' medians (range over rounds); graph = CUDA-graph replay; "
             "bench = cudnn.benchmark on; cpu = host ms of one call on an idle GPU; k = kernels per call"]
    for r in rows:
        lines.append(f"\n{r['model']} [{r['layout']}]  fxopt vs best Inductor: plain "
                     + ", ".join(f"{label} {r[key]:.3f}x" for key, label in (
                         ("speedup_vs_best_inductor", "launch"), ("graph_speedup_vs_best_inductor", "graph"),
                         ("bench_speedup_vs_best_inductor", "launch+bench"),
                         ("bench_graph_speedup_vs_best_inductor", "graph+bench"),
                         ("speedup_vs_max_autotune", "launch vs max-autotune"),
                         ("graph_speedup_vs_max_autotune", "graph vs max-autotune"),
                         ("no_replay_speedup_vs_best_inductor", "launch without replay"),
                         ("speedup_vs_reduce_overhead", "launch vs reduce-overhead"),
                         ("speedup_vs_reduce_overhead_freezing", "launch vs reduce-overhead+freezing"))
                     if key in r)
                     + f" (best Inductor mode: {r.get('best_inductor_ms', '-')})"
                     + f"; numerics {({True: 'ok', False: 'OUT'}).get(r.get('numerics_ok'), '-')}")
        for variant, v in r.items():
            if not isinstance(v, dict) or variant == "profile":
                continue
            if "error" in v:
                lines.append(f"  {variant:32s} ERROR {v['error'][:200]}")
                continue
            cells = []
            for key in ("ms", "graph_ms", "bench_ms", "bench_graph_ms"):
                if key in v:
                    lo, hi = v[f"{key}_samples"][0], v[f"{key}_samples"][-1]
                    cells.append(f"{key[:-3] or 'plain'} {v[key]:.3f} ({lo:.3f}-{hi:.3f})")
            if "cpu_ms" in v:
                cells.append(f"cpu {v['cpu_ms']:.3f}")
            if "profile" in v:
                cells.append(f"k {v['profile'].get('kernels', 0):.0f} (triton {v['profile'].get('triton', 0):.0f}, "
                             f"transposes {v['profile'].get('layout_transposes', 0):.0f})")
            if "compile_s" in v:
                cells.append(f"compile {v['compile_s']:.1f}s")
            if "pass_s" in v:
                cells.append(f"passes {v['pass_s']:.2f}s")
            if "rel_l2_vs_fp32" in v:
                cells.append(f"relL2 {v['rel_l2_vs_fp32']:.1e}")
            if "rel_l2_fresh_vs_eager" in v:
                cells.append(f"fresh input relL2 vs eager {v['rel_l2_fresh_vs_eager']:.1e}")
            if v.get("no_replay"):
                cells.append(f"not replayed: {'; '.join(v['no_replay'])[:200]}")
            lines.append(f"  {variant:32s} " + " | ".join(cells))
    for layout in sorted({r["layout"] for r in rows}):
        for key, label in (("speedup_vs_best_inductor", "plain launches"),
                           ("no_replay_speedup_vs_best_inductor", "plain launches, cuda_graphs=False"),
                           ("speedup_vs_reduce_overhead", "plain launches vs Inductor reduce-overhead"),
                           ("speedup_vs_reduce_overhead_freezing", "plain launches vs reduce-overhead+freezing"),
                           ("graph_speedup_vs_best_inductor", "CUDA-graph replays"),
                           ("bench_speedup_vs_best_inductor", "plain launches, cudnn.benchmark"),
                           ("bench_graph_speedup_vs_best_inductor", "CUDA graphs, cudnn.benchmark")):
            conv = [r for r in rows if r["model"] in CONV_NETS and key in r and r["layout"] == layout]
            if conv and key == "speedup_vs_best_inductor":  # the headline also names the rest
                rest = [r for r in rows if r["model"] not in CONV_NETS and key in r]
                lines.append("every model, fxopt vs best Inductor mode, plain launches: " + ", ".join(
                    f"{r['model']} {r[key]:.3f}x ({r.get('best_inductor_ms')})" for r in [*conv, *rest]))
            if conv:
                each = ", ".join(f"{r['model']} {r[key]:.3f}x" for r in conv)
                geo = math.exp(sum(math.log(r[key]) for r in conv) / len(conv))
                lines.append(f"conv geomean [{layout}], fxopt vs best Inductor, {label}: {geo:.3f}x ({each})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--tiny", action="store_true", help="CPU stand-ins: check the script's logic")
    parser.add_argument("--out", default=None, help="JSON file for all numbers")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--layouts", default="channels_last",
                        help="comma-separated memory formats of conv-net models and inputs: channels_last, nchw")
    parser.add_argument("--variants", default="", help=f"extra variants: {', '.join(EXTRA_VARIANTS)}")
    parser.add_argument("--autotune-models", default="", help="models that also get mode=max-autotune")
    parser.add_argument("--cudnn-fusions", action="store_true",
                        help="also time conv nets with fxopt's fused cuDNN conv ops kept whole")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time every variant as CUDA-graph replays (the GPU's work alone)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="also time every variant with torch.backends.cudnn.benchmark on")
    parser.add_argument("--profile", default=None, help="text file for torch.profiler tables of one call each")
    parser.add_argument("--shared-cache", action="store_true",
                        help="one Inductor cache for every variant (faster; compile_s then is no cold compile)")
    parser.add_argument("--budget-s", type=float, default=540, help="skip models once this is spent")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": str(args.dtype),
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))}}
    if args.device == "cuda":
        meta.update(cudnn=torch.backends.cudnn.version(), triton=__import__("triton").__version__)
    cache_root = tempfile.mkdtemp(prefix="fxopt_zoo_")
    for name in args.models.split(","):
        for layout in (args.layouts.split(",") if name in CONV_NETS else ["-"]):
            if time.perf_counter() - started > args.budget_s:
                print(f"[{name} {layout}] skipped: time budget of {args.budget_s:.0f}s spent", flush=True)
                continue
            rows.append(run_model(name, args, cache_root, layout))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table(rows))


if __name__ == "__main__":
    main()
