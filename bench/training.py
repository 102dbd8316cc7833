"""One training step through fxopt's backend vs Inductor's modes, side by side in one run.

The step is a whole compiled function: forward, cross-entropy, backward, SGD with momentum,
``zero_grad``. Each variant starts from the same weights and sees the same batches; per
variant: step time (best of ``--repeats`` loops of ``--steps`` steps, synchronized at the
ends only, as a training loop runs), peak memory (``torch.cuda.max_memory_allocated``, reset
after the warm-up steps: parameters, gradients, optimizer state and activations), the
first call's time (compile included) and the losses of every step against Inductor's.

Variants: ``eager``; ``inductor`` (default), ``inductor-freezing``, ``inductor-ro``
(reduce-overhead), ``inductor-ro-freezing``; ``inductor-amb<f>`` / ``inductor-ro-amb<f>``
(torch's ``activation_memory_budget=f``); ``fxopt`` (default options), ``fxopt-replay``
(``training_cuda_graphs=True``), ``fxopt-plain`` (``cuda_graphs=False``), ``fxopt-budget<f>`` (``memory_budget=f``). ``--profile`` adds a
torch.profiler summary per variant (host time, GPU busy time, kernel count, top kernels),
``--fxopt-profile`` runs ``fxopt.profile_compiled`` on the step, ``--rng-check`` compares
dropout draws replayed and plain.

    python bench/training.py --variants inductor,inductor-ro,fxopt --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fxopt


def resnet50_workload(batch: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(torch.bfloat16, memory_format=torch.channels_last)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(batch, 3, 224, 224, device="cuda", generator=gen, dtype=torch.bfloat16)
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 1000, (batch,), device="cuda", generator=gen)) for _ in range(4)]
    return model, batches


def make_step(model: torch.nn.Module, lr: float = 0.01) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # momentum buffers made up front (zeros: with dampening 0 the first step is the same):
    # created inside the first compiled step, Inductor's reduce-overhead leaves them in its
    # CUDA-graph pool, and the second step fails reading them (torch 2.11)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@contextlib.contextmanager
def _patched(module: Any, **values: Any):
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def compiled(variant: str, step: Callable, reports: list) -> tuple[Callable, contextlib.AbstractContextManager]:
    """The step compiled as ``variant`` and the config it must run (and compile) under."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    name = variant
    if "-amb" in name:
        name, budget = name.split("-amb")
        ctx = _patched(functorch_config, activation_memory_budget=float(budget))
    if name.endswith("-freezing"):
        name = name[: -len("-freezing")]
        ctx = _patched(inductor_config, freezing=True)
    if name == "eager":
        return step, ctx
    if name == "inductor":
        return torch.compile(step), ctx
    if name == "inductor-ro":
        return torch.compile(step, mode="reduce-overhead"), ctx
    if name == "fxopt":
        return fxopt.compile(step, options={"reports": reports}), ctx
    if name == "fxopt-replay":
        return fxopt.compile(step, options={"reports": reports, "training_cuda_graphs": True}), ctx
    if name == "fxopt-plain":
        return fxopt.compile(step, options={"reports": reports, "cuda_graphs": False}), ctx
    if name.startswith("fxopt-budget"):
        budget = float(name[len("fxopt-budget"):])
        return fxopt.compile(step, options={"reports": reports, "memory_budget": budget}), ctx
    raise SystemExit(f"unknown variant {variant!r}")


def run_variant(variant: str, base: torch.nn.Module, batches: list, args: argparse.Namespace) -> dict:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    model = copy.deepcopy(base)
    reports: list = []
    fn, ctx = compiled(variant, make_step(model), reports)
    row: dict[str, Any] = {"variant": variant}
    with ctx:
        torch.cuda.synchronize()
        began = time.perf_counter()
        # each loss cloned out: under reduce-overhead the returned tensor is overwritten by
        # the next step (reading a kept one raises); the clone costs every variant the same
        losses = [fn(*batches[0]).clone()]
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - began
        # reset after the first call (compilation's own allocations), before the CUDA-graph
        # recordings of the warm-up steps: a replay allocates nothing, so a reset after them
        # would miss the memory of the graphs' pools
        torch.cuda.reset_peak_memory_stats()
        for i in range(1, args.warmup):
            losses.append(fn(*batches[i % len(batches)]).clone())
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            for i in range(args.steps):
                losses.append(fn(*batches[i % len(batches)]).clone())
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) / args.steps)
        row["step_ms"] = min(times) * 1e3
        row["step_ms_median"] = statistics.median(times) * 1e3
        row["peak_MB"] = torch.cuda.max_memory_allocated() / 1e6
        row["reserved_MB"] = torch.cuda.max_memory_reserved() / 1e6
        row["losses"] = [float(x) for x in losses[: args.warmup + args.steps]]
        if args.profile:
            row["profile"] = profile_steps(fn, batches)
    row["graphs"] = [{"name": r.name, "training": r.training, "no_replay": r.no_replay, "fallback": r.fallback,
                      "memory": [vars(d) for d in r.memory]} for r in reports]
    del fn, model
    return row


def profile_steps(fn: Callable, batches: list, steps: int = 3) -> dict:
    """Where a step's time goes: host time per step, GPU busy time, kernels, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for i in range(steps):
            fn(*batches[i % len(batches)])
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time)
    busy = sum(sum(v) for v in kernels.values()) / 1e3 / steps
    top = sorted(((sum(v) / 1e3 / steps, len(v) // steps, k[:90]) for k, v in kernels.items()), reverse=True)[:15]
    cpu_top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return {"host_ms_per_step": host * 1e3 / steps, "wall_ms_per_step": wall * 1e3 / steps,
            "gpu_busy_ms_per_step": busy, "kernels_per_step": sum(len(v) for v in kernels.values()) // steps,
            "top_kernels": top, "cpu_table": cpu_top}


def rng_check() -> dict:
    """Dropout under replay: do Inductor's replayed draws equal its plain ones?"""
    out = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Dropout(0.5), torch.nn.Linear(256, 8)).cuda()
        step = make_step(model)
        fn = torch.compile(step, mode=mode)
        x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 8, (64,), device="cuda")
        torch.manual_seed(123)
        try:
            out[mode] = [float(fn(x, y)) for _ in range(6)]
        except Exception as exc:  # noqa: BLE001 - report, and go on to the workloads
            out[mode] = f"{type(exc).__name__}: {exc}"[:300]
    out["equal"] = out["default"] == out["reduce-overhead"]
    return out


class _Bottleneck(torch.nn.Module):
    """torchvision's ResNet bottleneck (1x1 narrow, 3x3, 1x1 widen, residual)."""

    def __init__(self, width: int):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(4 * width, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


def cpu_memory(budget: float, torch_budget: float) -> list[dict]:
    """One training step on the CPU: its peak (malloc'd bytes above the start, sampled after
    every ATen op, backward included) and what the budget's partitioner decided, for
    ResNet-50's first stage (three bottlenecks of width 64 on 56x56, batch 8, float32),
    plain Inductor launches for every variant."""
    import torch._functorch.config as functorch_config

    from fxopt.memory.measure import _PeakSampler, malloc_in_use

    nn = torch.nn
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 256, 1), *[_Bottleneck(64) for _ in range(3)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    x, y = torch.randn(8, 3, 56, 56), torch.randint(0, 10, (8,))
    rows = []
    variants = [("inductor", {}, None), (f"inductor-amb{torch_budget}", {}, torch_budget),
                ("fxopt-plain", {"cuda_graphs": False}, None),
                (f"fxopt-plain-budget{budget}", {"cuda_graphs": False, "memory_budget": budget}, None)]
    for name, options, amb in variants:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        reports: list = []
        ctx = _patched(functorch_config, activation_memory_budget=amb) if amb else contextlib.nullcontext()
        fn = torch.compile(model) if name.startswith("inductor") else fxopt.compile(
            model, options={**options, "reports": reports})

        def step(fn: Callable = fn) -> torch.Tensor:
            loss = F.cross_entropy(fn(x), y)
            loss.backward()
            return loss.detach()

        with ctx:
            step()
            model.zero_grad(set_to_none=True)
            start = malloc_in_use()
            with _PeakSampler() as sampler:
                loss = step()
            peak = sampler.peak - start
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            for _ in range(3):
                step()
            seconds = (time.perf_counter() - began) / 3
        rows.append({"variant": name, "peak_MB": peak / 1e6, "step_ms": seconds * 1e3,
                     "loss": float(loss),
                     "memory": [vars(d) for r in reports for d in r.memory]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "memory"}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="inductor,inductor-ro,fxopt,fxopt-replay,fxopt-budget0.7")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--fxopt-profile", action="store_true")
    parser.add_argument("--rng-check", action="store_true")
    parser.add_argument("--cpu-memory", action="store_true",
                        help="only the CPU peak of a ResNet-50 stage with and without the budgets")
    parser.add_argument("--budget", type=float, default=0.7, help="memory_budget for --cpu-memory")
    parser.add_argument("--torch-budget", type=float, default=0.5,
                        help="activation_memory_budget for --cpu-memory")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_memory:
        rows = cpu_memory(args.budget, args.torch_budget)
        (out / "training_cpu_memory.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
        return
    torch.backends.cudnn.benchmark = True
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "workload": f"resnet50 bf16 channels-last batch {args.batch}, SGD momentum",
                              "rows": []}
    if args.rng_check:
        result["rng_check"] = rng_check()
        print("rng check", json.dumps(result["rng_check"]), flush=True)
    base, batches = resnet50_workload(args.batch)
    for variant in args.variants.split(","):
        try:
            row = run_variant(variant, base, batches, args)
        except Exception as exc:  # noqa: BLE001 - a failed variant is a row saying why
            row = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"[:500]}
        result["rows"].append(row)
        printable = {k: v for k, v in row.items() if k not in ("losses", "profile", "graphs")}
        print(json.dumps(printable), flush=True)
        (out / "training.json").write_text(json.dumps(result, indent=1))
    if args.fxopt_profile:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        profiled = fxopt.profile_compiled(make_step(model), batches[0], options={"cuda_graphs": False}, repeat=3)
        result["fxopt_profile"] = profiled.table(top=25)
        print(result["fxopt_profile"], flush=True)
    reference = next((r["losses"] for r in result["rows"] if r["variant"] == "inductor" and "losses" in r), None)
    fastest = {r["variant"]: r["step_ms"] for r in result["rows"] if "step_ms" in r}
    best_inductor = min((v for k, v in fastest.items() if k.startswith("inductor") and "-amb" not in k),
                        default=None)
    print(f"\n{result['device']}, torch {result['torch']}, {result['workload']}")
    print(f"{'variant':24} {'step ms':>8} {'vs best Inductor':>16} {'peak MB':>8} {'first s':>8} {'max |dloss|':>11}")
    for r in result["rows"]:
        if "step_ms" not in r:
            print(f"{r['variant']:24} error: {r['error']}")
            continue
        ratio = best_inductor / r["step_ms"] if best_inductor else float("nan")
        dloss = max(abs(a - b) for a, b in zip(r["losses"], reference)) if reference else float("nan")
        print(f"{r['variant']:24} {r['step_ms']:8.2f} {ratio:15.2f}x {r['peak_MB']:8.0f} "
              f"{r['first_call_s']:8.1f} {dloss:11.2e}")
        for g in r["graphs"]:
            print(f"    graph {g['name']}: training={g['training']} no_replay={g['no_replay']} "
                  f"fallback={g['fallback']} memory={[(round(d['peak_before'] / 1e6), round(d['peak_after'] / 1e6), len(d['recomputed'])) for d in g['memory']]}")
    (out / "training.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
