"""Model-zoo benchmark of the fxopt torch.compile backend: bf16 inference on one GPU.

For each model, side by side in one process: eager, every Inductor mode a user could pick
(default, freezing, ``mode="reduce-overhead"``, reduce-overhead with freezing), and fxopt +
Inductor (``backend="fxopt"``, default options); optionally more variants (``--variants``).
Every Inductor variant records, per graph Dynamo hands it, whether it was really frozen
(``frozen``: Dynamo made the parameters graph constants, which needs the global freezing
flag while it traces, and Inductor compiled with freezing on); a freezing variant that was
not frozen is reported as a broken harness, not as a figure.
Measured, in interleaved rounds so that a drift of the machine hits every variant alike:
median latency with plain launches (``triton.testing.do_bench`` on the Python call) and,
with ``--cuda-graphs``, as CUDA-graph replays; the CPU time of one call with the GPU idle;
compile time (first call); time spent in fxopt's passes; numerics (relative L2 error of
every variant against an fp32 eager run, and against bf16 eager on inputs no variant has
seen). ``--profile MODELS`` also writes, for fxopt and the best Inductor variant of each
named model, the GPU kernels of one call grouped by kind (conv, depthwise conv, GEMM,
attention, GELU/pointwise, layer norm, copies, other) with time per call
(``profile_<model>[_<layout>].txt`` / ``.json`` next to ``--out``).

    python bench/gpu_zoo.py --out $OUT/zoo.json          # the six headline models, within --budget-s (400 s)
    python bench/gpu_zoo.py --models convnext_tiny,vit_b_16 --profile convnext_tiny,vit_b_16 --out $OUT/zoo.json
    python bench/gpu_zoo.py --smoke --models resnet50    # CPU, stand-in models: checks the script's logic (CI)

Inductor's default cache serves every variant (kernels compiled for one serve another, and
later runs on the machine: compile_s is then no cold compile; ``--cold-cache`` gives each
variant a fresh one, for compile-time figures). Timing, the Inductor baselines and the record
are the bench harness's (``bench/harness``); the JSON (default
``bench/results/<gpu>/gpu_zoo.json``) is rewritten after every variant, so a run cut short keeps what it measured; a variant that
fails is a row saying why. The table is printed last. Models are built from code
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
from harness import (
    INDUCTOR_MODES,
    SELF_GRAPHED,
    Record,
    alternate,
    call_ms,
    cli,
    frozen_summary,
    host_ms,
    inductor_variant,
    not_frozen,
    observed_inductor,
)

CONV_NETS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_1_6gf", "convnext_tiny")
#: the models of the headline table (issue 30), what a run without --models measures: the two
#: that lose first, so that a run cut short by its budget still has them
HEADLINE_MODELS = ("convnext_tiny", "vit_b_16", "resnet50", "mobilenet_v3_large", "efficientnet_b0",
                   "regnet_y_1_6gf")
ALL_MODELS = (*HEADLINE_MODELS, "bert_base", "gpt2", "llama_decoder", "llama_mlp")
VARIANTS = ("eager", "inductor", "inductor_freezing", "reduce_overhead", "reduce_overhead_freezing", "fxopt")
#: more variants, by request: see make_variant
EXTRA_VARIANTS = ("fxopt_global_freezing", "fxopt_global_freezing_unfixed", "fxopt_1x1_mm",
                  "inductor_freezing_1x1_mm", "max_autotune", "fxopt_cudnn", "fxopt_cpp_wrapper",
                  "inductor_freezing_cpp_wrapper", "fxopt_no_replay", "fxopt_autotune_gemm",
                  "fxopt_sdpa_cudnn_first")


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
    """The callable and the context it runs in (``dynamic`` goes to ``torch.compile``): the
    harness's Inductor modes, this bench's probes of them, and fxopt's variants."""
    if variant == "eager":
        return model, contextlib.nullcontext
    if variant in INDUCTOR_MODES:
        return inductor_variant(variant, model, stats, dynamic)
    if variant == "inductor_freezing_1x1_mm":  # Inductor freezing with the flag fxopt sets
        return inductor_variant("inductor_freezing", model, stats, dynamic, options={"conv_1x1_as_mm": True})
    if variant == "inductor_freezing_cpp_wrapper":  # Inductor's C++ wrapper: less host time per launch
        return inductor_variant("inductor_freezing", model, stats, dynamic, options={"cpp_wrapper": True})
    if variant == "max_autotune":  # Inductor's best, without its CUDA graphs: timed both ways here
        return observed_inductor(model, stats, dynamic, mode="max-autotune-no-cudagraphs",
                                 options={"freezing": True}, freezing=True)
    if variant.startswith("fxopt"):
        stats["reports"] = []
        options: dict[str, Any] = {"reports": stats["reports"]}
        if variant == "fxopt_1x1_mm":  # pointwise convs as matrix products (measured slower)
            options["inductor"] = {"conv_1x1_as_mm": True}
        if variant == "fxopt_cpp_wrapper":
            options["inductor"] = {"cpp_wrapper": True}
        if variant == "fxopt_no_replay":  # the backend's kernels launched one by one
            options["cuda_graphs"] = False
        if variant == "fxopt_autotune_gemm":  # probe: Triton GEMM templates, which can hold an
            options["inductor"] = {"max_autotune_gemm": True}  # exact-GELU epilogue (cuBLAS's is tanh)
        compiled = torch.compile(model, backend="fxopt", options=options, dynamic=dynamic)
        if variant == "fxopt_cudnn":
            return compiled, _cudnn_fusions
        if variant == "fxopt_global_freezing":
            return compiled, lambda: torch._inductor.config.patch(freezing=True)
        if variant == "fxopt_global_freezing_unfixed":
            return compiled, _global_freezing_unfixed
        if variant == "fxopt_sdpa_cudnn_first":  # probe: cuDNN's attention first where it applies
            return compiled, _cudnn_attention_first
        return compiled, contextlib.nullcontext
    raise ValueError(variant)


@contextlib.contextmanager
def _global_freezing_unfixed():
    """The global freezing flag with the backend as it was before it noticed weights Dynamo
    had already frozen: no layout passes (diagnostic of the harness disagreement)."""
    from fxopt.compile import backend

    saved = backend.traced_frozen
    backend.traced_frozen = lambda *args: False
    try:
        with torch._inductor.config.patch(freezing=True):
            yield
    finally:
        backend.traced_frozen = saved


def _cudnn_attention_first() -> contextlib.AbstractContextManager:
    """SDPA backends in the order cuDNN, flash, memory-efficient, math: the backend is picked
    while the graph is traced, so the first call decides what the compiled code runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


@contextlib.contextmanager
def _cudnn_fusions():
    """fxopt's fused conv ops stay whole in Inductor (one cuDNN conv+bias(+add)+ReLU call)
    instead of being decomposed for Inductor to fuse the pointwise parts itself."""
    from fxopt.compile import fused_ops

    before = fused_ops._KEEP_CUDNN_IN_INDUCTOR  # whatever fxopt's default is, put it back
    fused_ops.set_inductor_keeps_cudnn_fusions(True)
    try:
        yield
    finally:
        fused_ops.set_inductor_keeps_cudnn_fusions(before)


def fresh_cache_dir(root: str, label: str) -> None:
    """``--cold-cache``: each compiled variant compiles cold, kernels of one never serve another.
    (Without it Inductor's default cache serves every variant, and later runs on the machine.)"""
    path = os.path.join(root, label)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def bench_ms(fn: Callable, inputs: tuple, device: str, graph: bool = False) -> float:
    """Median ms of one call of ``fn(*inputs)`` (:func:`harness.call_ms`)."""
    return call_ms(lambda: fn(*inputs), device, graph=graph)


#: kernel kinds of ``--profile``, in the order a kernel name is tested against them
KERNEL_KINDS = ("attention", "depthwise conv", "conv", "gemm", "layernorm", "gelu/pointwise fused",
                "copy", "other")


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name.

    Inductor names its Triton kernels by what they fuse (``triton_poi_fused_convolution_relu_3``
    is the pointwise epilogue of a convolution, not a convolution), so they are told apart by
    their prefix first: ``triton_tem`` templates are GEMMs or convs, ``triton_poi/red/per``
    layer norms or pointwise work. Vendor kernels (cuDNN, cuBLAS, CUTLASS, flash attention)
    by the words in their names.
    """
    n = name.lower()
    if n.startswith("triton_tem"):
        return "conv" if "conv" in n else "gemm"
    if n.startswith(("triton_poi", "triton_red", "triton_per")):
        if "layer_norm" in n or "rms_norm" in n:
            return "layernorm"
        return "gelu/pointwise fused" if n.startswith("triton_poi") or "gelu" in n else "other"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "attn")):
        return "attention"
    if any(k in n for k in ("conv2d_c1_k1", "depthwise", "dwconv", "dgrad2d_c1_k1")):
        return "depthwise conv"
    if any(k in n for k in ("conv", "fprop", "implicit_gemm", "nchwtonhwc", "nhwctonchw")):
        return "conv"
    if any(k in n for k in ("gemm", "nvjet", "gemv", "cublas", "cutlass", "matmul", "_mm_", "splitk")):
        return "gemm"
    if "layer_norm" in n or "layernorm" in n:
        return "layernorm"
    if any(k in n for k in ("memcpy", "memset", "copy")):
        return "copy"
    if any(k in n for k in ("gelu", "elementwise", "pointwise")):
        return "gelu/pointwise fused"
    return "other"


def profile_kernels(fn: Callable, inputs: tuple, calls: int = 5, top: int = 25) -> dict[str, Any]:
    """The GPU kernels of ``calls`` calls (torch.profiler, after the timed runs): per call,
    the time and launches of each kind and of the ``top`` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel.setdefault(e.name, []).append(e.time_range.elapsed_us())
    kinds = {kind: {"us": 0.0, "launches": 0.0} for kind in KERNEL_KINDS}
    kernels = []
    for name, times in per_kernel.items():
        kind = kernel_kind(name)
        kinds[kind]["us"] += sum(times) / calls
        kinds[kind]["launches"] += len(times) / calls
        kernels.append({"name": name, "kind": kind, "us_per_call": sum(times) / calls,
                        "launches_per_call": len(times) / calls, "us_per_launch": sum(times) / len(times)})
    kernels.sort(key=lambda k: -k["us_per_call"])
    return {"calls": calls, "gpu_us_per_call": sum(k["us"] for k in kinds.values()),
            "launches_per_call": sum(k["launches"] for k in kinds.values()),
            "kinds": kinds, "top": kernels[:top]}


def profile_text(model: str, profiles: dict[str, dict[str, Any]]) -> str:
    """Kinds side by side (us per call, launches per call; with two variants, the first's
    time minus the second's: where the first loses), then each variant's top kernels."""
    names = list(profiles)
    lines = [f"{model}: GPU time per call by kernel kind, us (launches per call)",
             f"  {'kind':22s}" + "".join(f"{n:>30s}" for n in names)
             + (f"{names[0] + ' - ' + names[1]:>40s}" if len(names) == 2 else "")]
    for kind in (*KERNEL_KINDS, "total"):
        cells, times = [], []
        for n in names:
            p = profiles[n]
            us, launches = ((p["gpu_us_per_call"], p["launches_per_call"]) if kind == "total"
                            else (p["kinds"][kind]["us"], p["kinds"][kind]["launches"]))
            cells.append(f"{us:20.1f} ({launches:5.1f})")
            times.append(us)
        diff = f"{times[0] - times[1]:+40.1f}" if len(names) == 2 else ""
        lines.append(f"  {kind:22s}" + "".join(f"{c:>30s}" for c in cells) + diff)
    for n in names:
        lines.append(f"\n{model} {n}: top kernels (us per call, launches per call, us per launch, kind)")
        for k in profiles[n]["top"]:
            lines.append(f"  {k['us_per_call']:9.1f} {k['launches_per_call']:5.1f} {k['us_per_launch']:8.1f}  "
                         f"{k['kind']:22s} {k['name'][:120]}")
    return "\n".join(lines)


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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def _timer(fn: Callable, inputs: tuple, device: str, context: Callable, cudnn_benchmark: bool,
           graph: bool = False) -> Callable[[], float]:
    """One timing of ``fn`` as the rounds take it: in its context, cudnn.benchmark as asked."""
    def measure() -> float:
        with torch.no_grad(), context(), _cudnn_benchmark(cudnn_benchmark):
            return bench_ms(fn, inputs, device, graph=graph)
    return measure


def run_model(row: dict[str, Any], args: argparse.Namespace, cache_root: str, save: Callable[[], None]) -> None:
    """Fill ``row`` (its ``model`` and ``layout`` set) with every variant's figures; ``save``
    writes the JSON and is called after each step, so a run cut short keeps its numbers."""
    name, layout, device, dtype = row["model"], row["layout"], args.device, args.dtype
    model, inputs = build(name, args.smoke)
    with torch.no_grad(), _no_tf32():
        reference = model.to(device)(*[x.to(device) for x in inputs]).float()  # fp32 eager
    model = model.to(dtype)
    inputs = tuple(x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in inputs)
    if layout == "channels_last":  # model and 4-d inputs, as vision inference usually runs
        model = model.to(memory_format=torch.channels_last)
        inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
    row["input_shapes"] = [list(x.shape) for x in inputs]
    wanted = [v for v in args.variants.split(",") if v] if args.variants else []
    extra = [v for v in wanted if v in EXTRA_VARIANTS and (name in CONV_NETS or not v.startswith(("fxopt_cudnn", "fxopt_global_freezing_unfixed")))]
    if args.autotune_models and name in args.autotune_models.split(",") and "max_autotune" not in extra:
        extra.append("max_autotune")
    if args.cudnn_fusions and name in CONV_NETS:
        extra.append("fxopt_cudnn")
    torch._dynamo.reset()
    compiled: dict[str, tuple[Callable, Callable]] = {}
    reports: dict[str, list[Any]] = {}  # fxopt variants: the backend's CompiledGraph list
    for variant in (*VARIANTS, *extra):
        stats: dict[str, Any] = {}
        try:
            if args.cold_cache:
                fresh_cache_dir(cache_root, f"{name}-{layout}-{variant}")
            fn, context = make_variant(variant, model, stats)
            with torch.no_grad(), context():
                _sync(device)
                start = time.perf_counter()
                fn(*inputs)
                _sync(device)
                first_call_s = time.perf_counter() - start
        except Exception as exc:  # one broken variant must not lose the other numbers
            row[variant] = {"error": _error(exc)}
            print(f"[{name}] {variant} FAILED: {row[variant]['error']}", flush=True)
            save()
            continue
        compiled[variant] = fn, context
        entry: dict[str, Any] = frozen_summary(variant, stats)
        if variant != "eager":
            entry["compile_s"] = first_call_s
        if variant.startswith("fxopt"):
            graphs = reports[variant] = stats["reports"]
            entry["graphs"] = len(graphs)
            entry["fallbacks"] = [g.fallback for g in graphs if g.fallback]
            entry["replayed"] = sum(g.no_replay is None for g in graphs if not g.fallback)
            entry["no_replay"] = sorted({g.no_replay for g in graphs if g.no_replay})
            entry["pass_s"] = sum(g.report.total_seconds for g in graphs if g.report)
            entry["frozen_inputs"] = sum(len(g.frozen) for g in graphs)
            entry["changed_passes"] = sorted({r.name for g in graphs if g.report
                                              for _, r in g.report.walk() if r.changed and not r.children})
            # what each of them did (the convolutions a timed choice widened, say): a run that
            # decided otherwise than the last shows here, not only in its time
            # (its counts: the lists of matches and names are the report's, not the row's)
            entry["pass_stats"] = {r.name: {k: v for k, v in r.stats.items() if isinstance(v, int | float | str)}
                                   for g in graphs if g.report
                                   for _, r in g.report.walk() if r.changed and not r.children}
        problem = not_frozen(variant, entry)
        if problem:
            row.setdefault("harness_problems", []).append(problem)
            print(f"[{name}] WARNING: {variant} was not frozen: its figures are not what it claims", flush=True)
        row[variant] = entry
        print(f"[{name} {layout}] {variant}: compiled in {first_call_s:.1f}s, frozen={entry.get('frozen')}", flush=True)
        save()
    # timed in interleaved rounds: a drift of the machine hits every variant alike
    cuda = device == "cuda"
    settings = [("", False)] + ([("bench_", True)] if args.cudnn_benchmark and cuda else [])
    timers: dict[tuple[str, str], Callable[[], float]] = {}
    for variant, (fn, context) in compiled.items():
        for prefix, flag in settings:
            timers[variant, prefix + "ms"] = _timer(fn, inputs, device, context, flag)
            if args.cuda_graphs and cuda and variant not in SELF_GRAPHED:
                timers[variant, prefix + "graph_ms"] = _timer(fn, inputs, device, context, flag, graph=True)

    def failed(key: tuple[str, str], exc: BaseException) -> None:  # e.g. a capture that fails
        row[key[0]]["error"] = f"while timing: {_error(exc)}"
        compiled.pop(key[0], None)  # the variant leaves the race

    samples = alternate(timers, args.rounds, lambda timer: timer(), on_error=failed)
    fresh = tuple(_fresh_like(x) for x in inputs)
    with torch.no_grad():
        fresh_reference = model(*fresh).float()  # bf16 eager on inputs no variant has seen
    for variant, (fn, context) in compiled.items():
        try:
            with torch.no_grad(), context():
                # after the timed runs: a stale or racy result would show; copied at once,
                # as reduce-overhead's next call overwrites its outputs
                out = fn(*inputs).float().clone()
                # a replay that read stale inputs would still match on the timed inputs
                row[variant]["rel_l2_fresh_vs_eager"] = rel_l2(fn(*fresh).float(), fresh_reference)
                if cuda:
                    row[variant]["cpu_ms"] = host_ms(lambda: fn(*inputs), device)  # noqa: B023
            row[variant]["rel_l2_vs_fp32"] = rel_l2(out, reference)
        except Exception as exc:
            row[variant]["check_error"] = _error(exc)
        if variant in reports:  # what the replay did per call shape, after the timed calls
            row[variant]["replay_logs"] = [str(g.replay) for g in reports[variant] if g.replay is not None]
        for (v, key), times in samples.items():
            if v == variant:
                row[variant].update({key: times[len(times) // 2], f"{key}_samples": times})
        print(f"[{name} {layout}] {variant}: {json.dumps(row[variant])}", flush=True)
    summarize(row)
    save()
    if cuda and name in args.profile_models:
        profile_model(row, compiled, inputs, args)
        save()


def profile_model(row: dict[str, Any], compiled: dict[str, tuple[Callable, Callable]], inputs: tuple,
                  args: argparse.Namespace) -> None:
    """Kernels of fxopt and of the fastest Inductor mode (plain launches) side by side:
    into ``row["profile"]`` and ``profile_<model>[_<layout>].{txt,json}`` in ``args.profile_dir``."""
    timed = sorted((row[v]["ms"], v) for v in INDUCTOR_MODES if v in compiled and "ms" in row.get(v, {}))
    chosen = [v for v in ("fxopt",) if v in compiled] + [v for _, v in timed[:1]]
    profiles: dict[str, dict[str, Any]] = {}
    for variant in chosen:
        fn, context = compiled[variant]
        try:
            with torch.no_grad(), context():
                profiles[variant] = profile_kernels(fn, inputs)
        except Exception as exc:
            row.setdefault("profile_errors", {})[variant] = _error(exc)
    row["profile"] = profiles
    layout = "" if row["layout"] == "-" else f"_{row['layout']}"
    stem = os.path.join(args.profile_dir, f"profile_{row['model']}{layout}")
    text = profile_text(row["model"], profiles)
    print(text, flush=True)
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(profiles, f, indent=1)


def summarize(row: dict[str, Any]) -> None:
    """Ratios and verdicts: fxopt against the best Inductor mode (per column: the modes
    that capture their own CUDA graphs have no separate graph column; with a mode missing,
    ``modes_timed`` says so and the ratio is an upper bound), numerics against eager."""
    fx, ind, eager = (row.get(v, {}) for v in ("fxopt", "inductor", "eager"))
    named = {name: row[name] for name in INDUCTOR_MODES if isinstance(row.get(name), dict)}
    modes = list(named.values())
    row["modes_timed"] = [name for name, v in named.items() if "ms" in v]
    for key in ("ms", "graph_ms", "bench_ms", "bench_graph_ms"):
        timed = [(v[key], name) for name, v in named.items() if key in v]
        if key in fx and timed:
            best, name = min(timed)
            row[f"{key.replace('ms', 'speedup')}_vs_best_inductor"] = best / fx[key]
            row[f"best_inductor_{key}"] = name
        if key in fx and key in row.get("max_autotune", {}):
            row[f"{key.replace('ms', 'speedup')}_vs_max_autotune"] = row["max_autotune"][key] / fx[key]
    best = min((v["ms"] for v in modes if "ms" in v), default=None)
    if best is not None:  # every fxopt variant, probes included, against the same best mode
        row["fxopt_variants_vs_best_inductor"] = {
            name: best / v["ms"] for name, v in row.items() if name.startswith("fxopt") and isinstance(v, dict) and "ms" in v}
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
    as CUDA-graph replays, and with cudnn.benchmark on; one call's CPU ms; whether it froze."""
    lines = ["ms: median of the rounds' medians (range over rounds); graph = CUDA-graph replay; "
             "bench = cudnn.benchmark on; cpu = host ms of one call on an idle GPU; "
             "frozen = weights were constants in every graph compiled"]
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
                     + f" (best Inductor mode: {r.get('best_inductor_ms', '-')}"
                     + ("" if len(r.get("modes_timed", ())) == len(INDUCTOR_MODES) else
                        f"; UPPER BOUND, modes timed: {', '.join(r.get('modes_timed', ())) or 'none'}") + ")"
                     + f"; numerics {({True: 'ok', False: 'OUT'}).get(r.get('numerics_ok'), '-')}")
        lines.extend(f"  HARNESS PROBLEM: {p[:200]}" for p in r.get("harness_problems", []))
        if len(r.get("fxopt_variants_vs_best_inductor", {})) > 1:
            lines.append("  fxopt variants vs best Inductor, plain: " + ", ".join(
                f"{name} {ratio:.3f}x" for name, ratio in r["fxopt_variants_vs_best_inductor"].items()))
        for variant, v in r.items():
            if not isinstance(v, dict) or variant in ("profile", "profile_errors", "fxopt_variants_vs_best_inductor"):
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
            if "frozen" in v:
                cells.append(f"frozen {v['frozen']}")
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(HEADLINE_MODELS), help=f"known: {', '.join(ALL_MODELS)}")
    parser.add_argument("--tiny", dest="smoke", action="store_true", help="the old name of --smoke")
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
    parser.add_argument("--profile", default="", help="comma-separated models whose kernels are profiled "
                        "(fxopt and the best Inductor mode), or 'all'")
    parser.add_argument("--profile-dir", default=None, help="where profile_<model>[_<layout>].{txt,json} go "
                        "(default: the folder of --out)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="an Inductor cache of its own per variant: compile_s is a cold compile (slower; "
                        "without it every variant, and later runs, share Inductor's default cache)")
    parser.add_argument("--budget-s", type=float, default=400,
                        help="skip a model when it would end past this many seconds (by the mean model so far)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models + [p for p in args.profile.split(",") if p and p != "all"] if m not in ALL_MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ALL_MODELS)}")
    args.profile_models = models if args.profile == "all" else [p for p in args.profile.split(",") if p]
    args.device = cli.device_for(args)
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    record = Record("gpu_zoo", args, args.device, dtype=str(args.dtype))
    args.profile_dir = args.profile_dir or str(record.path.parent)
    # every variant is one more cache entry on the model's forward: stay clear of Dynamo's limit,
    # past which it would run the model eagerly without a word (scoped: the process keeps its own)
    started = time.perf_counter()
    rows, save = record.rows, record.save
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)):
        cache_root = tempfile.mkdtemp(prefix="fxopt_zoo_")
        durations: list[float] = []
        for name in models:
            for layout in (args.layouts.split(",") if name in CONV_NETS else ["-"]):
                elapsed = time.perf_counter() - started
                expected = sum(durations) / len(durations) if durations else 0.0
                if elapsed + expected > args.budget_s:
                    rows.append({"model": name, "layout": layout, "skipped": f"time budget: {elapsed:.0f}s spent, "
                                 f"a model takes ~{expected:.0f}s, budget {args.budget_s:.0f}s"})
                    print(f"[{name} {layout}] skipped: {rows[-1]['skipped']}", flush=True)
                    save()
                    continue
                rows.append({"model": name, "layout": layout})
                try:
                    run_model(rows[-1], args, cache_root, save)
                except Exception as exc:  # e.g. the model does not build here: the next one still runs
                    rows[-1]["error"] = _error(exc)
                    print(f"[{name} {layout}] FAILED: {rows[-1]['error']}", flush=True)
                durations.append(time.perf_counter() - started - elapsed)
                rows[-1]["model_s"] = durations[-1]
                save()
    print(f"\n{record.meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table([r for r in rows if "skipped" not in r and "error" not in r]))
    return record.data


if __name__ == "__main__":
    main()
