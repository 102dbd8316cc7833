"""The host time fxopt's backend adds to each call of a compiled training step (issue 29).

Why. A compiled training step at a small batch is host-bound: the GPU waits on Python,
the dispatcher and kernel launches, so every microsecond fxopt spends around Inductor's
compiled forward and backward is a microsecond of step time. This script measures that
cost apart from the GPU: a model small enough that its kernels take almost nothing (an
8-layer MLP of width 64 at batch 8 by default, or a small conv net), trained with SGD with
momentum, compiled the same way with ``backend="inductor"`` and with fxopt's backend with
its replay off (``cuda_graphs=False``), in two modes (``--variants`` adds others:
``fxopt-wrap``, Inductor inside the wrapper of fxopt's replayed training graphs, without
CUDA graphs, so that the replay path's own cost shows on a CPU; on CUDA ``inductor-ro``
and ``fxopt`` with its replay on):

- ``whole``: the whole step compiled (forward, loss, backward, optimizer update,
  ``zero_grad``), as ``bench/training.py`` compiles it;
- ``model``: only the model compiled; loss, backward and the optimizer run eagerly;
- ``eval`` (not run by default): the compiled model called under ``no_grad``, the inference
  call path (fxopt freezes the weights and checks their version counters on each call;
  the compiled code differs from Inductor's, so only the profile's fxopt frames compare).

Every variant starts from the same weights and sees the same batches (the first step's
losses are printed side by side, a check that both compiled the same function). Time per
step: ``--rounds`` rounds of ``--steps`` steps, the variants interleaved within each round
(their order alternating), so a load spike on a shared machine hits all of them; min and
median over rounds, in microseconds per step, and fxopt minus Inductor. On CUDA the device
is synchronized at each round's end only, as a training loop runs.

``--profile``: the same steps under cProfile, per variant: Python calls per step, and the
functions fxopt's step calls more often than Inductor's (fxopt's own frames, and anything
it makes torch do in addition), with calls and own time per step. Call counts do not
depend on the machine's load, so they show a removed cost even where the timings are noisy.

    python bench/host_cost.py                                   # CPU, MLP, both modes
    python bench/host_cost.py --model conv --profile
    python bench/host_cost.py --variants inductor,fxopt-wrap --layers 80   # the replay path's wrapper
    python bench/host_cost.py --device cuda --variants inductor,fxopt-plain,inductor-ro,fxopt
    python bench/host_cost.py --device cuda --model resnet50 --modes whole --rounds 3 --steps 10 --warmup 3
    python bench/host_cost.py --smoke                           # 2 rounds of 5 steps, every mode (CI)

The record goes to ``--out`` (or its old name ``--json``; default ``bench/results/<gpu>/host_cost.json``).
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import Record, alternate, cli, sync

#: variant -> how the step (or the model) is compiled
VARIANTS: dict[str, Callable[[Callable], Callable]] = {}


def _variant(name: str) -> Callable[[Callable[[Callable], Callable]], Callable[[Callable], Callable]]:
    def register(make: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        VARIANTS[name] = make
        return make
    return register


@_variant("inductor")
def _inductor(fn: Callable) -> Callable:
    return torch.compile(fn)


@_variant("inductor-ro")
def _inductor_ro(fn: Callable) -> Callable:
    return torch.compile(fn, mode="reduce-overhead")


@_variant("fxopt-plain")
def _fxopt_plain(fn: Callable) -> Callable:
    import fxopt

    return fxopt.compile(fn, options={"cuda_graphs": False})


@_variant("fxopt")
def _fxopt(fn: Callable) -> Callable:
    import fxopt

    return fxopt.compile(fn)


@_variant("fxopt-wrap")
def _fxopt_wrap(fn: Callable) -> Callable:
    """Inductor's code inside the wrapper fxopt puts around a replayed training graph
    (fxopt.compile.training.PlainOutputs), without CUDA graphs: the replay path's own host cost,
    measurable on any device. Inference graphs (an optimizer update) are left plain."""
    from torch._inductor.compile_fx import compile_fx

    from fxopt.compile.backend import is_training
    from fxopt.compile.freezing import work_copy
    from fxopt.compile.training import PlainOutputs, fresh_outputs

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = compile_fx(gm, example_inputs)
        return PlainOutputs(compiled, fresh_outputs(work_copy(gm))) if is_training(example_inputs) else compiled

    return torch.compile(fn, backend=backend)


def build(kind: str, layers: int, width: int, batch: int, device: str) -> tuple[nn.Module, list]:
    """The model (seed 0) and four batches (seed 1)."""
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(1)
    if kind == "mlp":
        body: list[nn.Module] = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*body, nn.Linear(width, 10))
        shape: tuple[int, ...] = (batch, width)
    elif kind == "conv":
        body = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(layers - 1):
            body += [nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        model = nn.Sequential(*body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
        shape = (batch, 3, 8, 8)
    elif kind == "resnet50":  # the real workload of bench/training.py: bf16, channels-last, batch 32
        sys.path.insert(0, str(Path(__file__).parent))
        from training import workload

        model, batches, _, _ = workload("resnet50", smoke=False, device=device)
        return model, batches
    else:
        raise SystemExit(f"unknown model {kind!r} (mlp, conv, resnet50)")
    model = model.to(device)
    batches = [(torch.randn(*shape, device=device, generator=gen),
                torch.randint(0, 10, (batch,), device=device, generator=gen)) for _ in range(4)]
    return model, batches


def make_step(model: nn.Module, mode: str, compile_with: Callable[[Callable], Callable]) -> Callable:
    """One training step over its own copy of ``model`` and its own optimizer, compiled
    whole or model-only; or (``eval``) one call of the compiled model under ``no_grad``."""
    model = copy.deepcopy(model)
    if mode == "eval":
        compiled = compile_with(model.eval())

        def evaluate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return F.cross_entropy(compiled(x), y)

        return evaluate
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():  # optimizer state made before compiling, as bench/training.py does
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    forward = compile_with(model) if mode == "model" else model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return compile_with(step) if mode == "whole" else step


def time_steps(steps: dict[str, Callable], batches: list, rounds: int, count: int, device: str) -> dict[str, list[float]]:
    """Microseconds per step of each variant, one figure per round, the variants interleaved
    in alternating order; the device synchronized at each round's end only, as a training
    loop runs."""
    def per_step_us(fn: Callable) -> float:
        sync(device)
        began = time.perf_counter()
        for i in range(count):
            fn(*batches[i % len(batches)])
        sync(device)
        return (time.perf_counter() - began) / count * 1e6

    return alternate(steps, rounds, per_step_us, reverse_odd=True)


def profile(fn: Callable, batches: list, count: int) -> dict[tuple[str, int, str], tuple[float, float]]:
    """(calls per step, own seconds per step) of every function ``fn``'s steps call."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(count):
        fn(*batches[i % len(batches)])
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return {key: (value[1] / count, value[2] / count) for key, value in stats.items()}


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    parts = Path(path).parts
    for anchor in ("fxopt", "patterns", "visualize", "torch"):
        if anchor in parts:
            path = "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1:])
            break
    return f"{path}:{line}({name})"


def report_profile(base: dict, other: dict, base_name: str, other_name: str, top: int) -> list[str]:
    """Functions ``other`` calls more often per step than ``base`` (or only ``other`` calls)."""
    calls = {name: sum(c for c, _ in prof.values()) for name, prof in ((base_name, base), (other_name, other))}
    lines = [f"  Python calls per step: {base_name} {calls[base_name]:.0f}, {other_name} {calls[other_name]:.0f} "
             f"({calls[other_name] - calls[base_name]:+.0f})"]
    extra = []
    for key, (count, own) in other.items():
        more = count - base.get(key, (0.0, 0.0))[0]
        if more > 0.5 or "fxopt" in Path(key[0]).parts:
            extra.append((more, count, own, key))
    extra.sort(key=lambda e: (-e[0], -e[2]))
    lines.append(f"  functions {other_name} calls more per step (extra calls, calls, own us per step):")
    lines += [f"    {more:+7.1f} {count:7.1f} {own * 1e6:8.2f}  {_where(key)}" for more, count, own, key in extra[:top]]
    if not extra:
        lines.append("    none")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="mlp", choices=("mlp", "conv", "resnet50"),
                        help="resnet50: bench/training.py's (torchvision, bf16, channels-last, batch 32; "
                             "--layers/--width/--batch do not apply)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", default="whole,model")
    parser.add_argument("--variants", default="inductor,fxopt-plain", help=", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", dest="out", help="the old name of --out")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.rounds, args.steps, args.warmup, args.profile_steps = 2, 2, 5, 2, 5
    args.device = cli.device_for(args)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    record = Record("host_cost", args, args.device)
    model, batches = build(args.model, args.layers, args.width, args.batch, args.device)
    print(f"torch {torch.__version__}, {args.device}, {args.model} {args.layers} layers width {args.width} "
          f"batch {args.batch}, SGD momentum; {args.rounds} rounds x {args.steps} steps", flush=True)
    for mode in args.modes.split(","):
        steps = {name: make_step(model, mode, VARIANTS[name]) for name in names}
        first = {}
        for name, fn in steps.items():  # compile, then warm up
            first[name] = fn(*batches[0]).item()
            for i in range(args.warmup):
                fn(*batches[i % len(batches)])
        sync(args.device)
        seen = time_steps(steps, batches, args.rounds, args.steps, args.device)
        base = names[0]
        print(f"\n[{mode}] first step's loss: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items()))
        print(f"[{mode}] us per step  (min / median over rounds; difference against {base})")
        rows = {}
        for name in names:
            low, mid = min(seen[name]), statistics.median(seen[name])
            rows[name] = record.add({"mode": mode, "variant": name, "min_us": low, "median_us": mid,
                                     "rounds_us": seen[name], "first_loss": first[name]})
            delta = "" if name == base else \
                f"   {low - rows[base]['min_us']:+8.1f} / {mid - rows[base]['median_us']:+8.1f}" \
                f"  ({mid / rows[base]['median_us']:.3f}x median)"
            print(f"  {name:12s} {low:9.1f} / {mid:9.1f}{delta}", flush=True)
        if args.profile:
            profiles = {name: profile(steps[name], batches, args.profile_steps) for name in names}
            for name in names[1:]:
                print(f"[{mode}] cProfile, {name} against {base}:")
                print("\n".join(report_profile(profiles[base], profiles[name], base, name, args.top)), flush=True)
            rows_calls = {name: sum(c for c, _ in prof.values()) for name, prof in profiles.items()}
            for name in names:
                rows[name]["python_calls_per_step"] = rows_calls[name]
        record.save()
        torch._dynamo.reset()
    return record.data


if __name__ == "__main__":
    main()
