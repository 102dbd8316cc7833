"""One training step through fxopt's backend vs Inductor's modes, each variant in a process of its own.

The step is a whole compiled function: forward, cross-entropy, backward, optimizer update,
``zero_grad``. Workloads (``--workload``): ``resnet50`` (torchvision, bf16, channels-last,
batch 32, SGD with momentum) and ``transformer`` (a GPT-2-shaped decoder written here: 12
layers, d 768, 12 heads, sequence 1024, batch 8, vocabulary 32768, bf16, AdamW, attention by
``F.scaled_dot_product_attention``). ``--smoke`` shrinks both to run in seconds on the CPU.

Variants (``--variants``): ``eager``; ``inductor`` (default), ``inductor-ro`` (reduce-overhead),
``inductor-amb<f>`` (torch's ``activation_memory_budget=f``); ``fxopt`` (default options),
``fxopt-plain`` (``cuda_graphs=False``), ``fxopt-replay`` (``training_cuda_graphs=True``),
``fxopt-budget<f>`` (``memory_budget=f``).

Why a process per variant: memory counts what the device reserves from before the first
call (compilation's transients, CUDA-graph pools, the caching allocator's segments), and a
variant run after another would inherit the segments the other reserved. Each child resets
the peak statistics at its start, builds the model, compiles and runs; it reports the peaks
over its whole run and over its timed steps, the step time (min and median of ``--repeats``
loops of ``--steps`` steps, synchronized at the loops' ends only, as a training loop runs),
the first call's time (compilation included) and every step's loss. Every variant starts
from the same weights (seed 0) and sees the same batches. The parent prints a table with
ratios against Inductor's default and against the faster of Inductor's default and
reduce-overhead. ``--rounds N`` runs the whole list N times, alternating fresh processes (a
host-bound step's speed moves between processes by several percent): the ratios then use
each variant's best process, and every process has its row.

``--memory-history`` (CUDA only) asks what holds the reserved memory: the caching allocator's
history is recorded over the first call and the warm-up steps, and at the point where the
reservation peaked, the allocations made since the recording began that are still live are
grouped by the first fxopt frame that made them (else by the nearest Python frames); the
variant's JSON gets them under ``memory_history``. Recording costs host time: that run's
``first_call_s`` includes it. ``--profile`` adds, per step, the host's time to issue a step
(``host_ms_per_step``) and the wall time to its end.

The record goes to ``--out`` (a file, or a folder to put ``training_<workload>.json`` in;
default ``bench/results/<gpu>/training_<workload>.json``).

    python bench/training.py --workload resnet50 --out $OUT
    python bench/training.py --workload transformer --variants inductor,inductor-amb0.5,fxopt-budget0.5
    python bench/training.py --workload resnet50 --variants inductor,inductor-ro,fxopt --warmup 5 --memory-history --profile
    python bench/training.py --smoke --workload resnet50 --variants eager,fxopt-budget0.5   # CPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import DeviceMemory, Record, cli, fresh_process

VARIANTS = ("eager,inductor,inductor-ro,inductor-amb0.3,inductor-amb0.5,inductor-amb0.7,"
            "fxopt,fxopt-plain,fxopt-replay,fxopt-budget0.3,fxopt-budget0.5,fxopt-budget0.7")


# --- workloads ---------------------------------------------------------------------------

class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (1x1 narrow, 3x3, 1x1 widen, residual): the smoke model."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4 * width, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


class DecoderBlock(nn.Module):
    """A pre-norm GPT-2 block: causal self-attention, then a GELU MLP of 4x the width."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[DecoderBlock(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln(self.blocks(h)))


def workload(name: str, smoke: bool, device: str) -> tuple[nn.Module, list, Callable[..., torch.optim.Optimizer], str]:
    """The model (seed 0), four batches, the optimizer's factory and a description."""
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(1)
    if name == "resnet50":
        if smoke:
            model: nn.Module = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                             nn.MaxPool2d(3, 2, 1), *[Bottleneck(16) for _ in range(2)],
                                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
            batch, size, classes = 4, 32, 10
        else:
            import torchvision

            model, batch, size, classes = torchvision.models.resnet50(), 32, 224, 1000
        model = model.to(device, dtype, memory_format=torch.channels_last)
        batches = [(torch.randn(batch, 3, size, size, device=device, generator=gen, dtype=dtype)
                    .contiguous(memory_format=torch.channels_last),
                    torch.randint(0, classes, (batch,), device=device, generator=gen)) for _ in range(4)]
        return model, batches, lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9), \
            f"resnet50{' (smoke: 2 bottlenecks)' if smoke else ''} {dtype} channels-last batch {batch}, SGD momentum"
    if name == "transformer":
        vocab, d, heads, layers, seq, batch = (256, 64, 4, 2, 64, 2) if smoke else (32768, 768, 12, 12, 1024, 8)
        model = Decoder(vocab, d, heads, layers, seq).to(device, dtype)
        batches = [(torch.randint(0, vocab, (batch, seq), device=device, generator=gen),
                    torch.randint(0, vocab, (batch, seq), device=device, generator=gen)) for _ in range(4)]
        return model, batches, lambda params: torch.optim.AdamW(params, lr=1e-4), \
            f"decoder {layers} layers d {d} {heads} heads seq {seq} batch {batch} vocab {vocab} {dtype}, AdamW"
    raise SystemExit(f"unknown workload {name!r}")


def make_step(model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer]) -> Callable:
    opt = optimizer(model.parameters())
    # optimizer state made up front: created inside the first compiled step, Inductor's
    # reduce-overhead leaves it in its CUDA-graph pool, and the second step fails reading it
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# --- one variant (the child process) -----------------------------------------------------

def compiled(variant: str, step: Callable, reports: list) -> tuple[Callable, contextlib.AbstractContextManager]:
    """The step compiled as ``variant`` and the config it must compile and run under."""
    import dataclasses

    import torch._functorch.config as functorch_config

    import fxopt
    from fxopt.compile.options import BackendOptions

    if variant == "eager":
        return step, contextlib.nullcontext()
    if variant == "inductor":
        return torch.compile(step), contextlib.nullcontext()
    if variant == "inductor-ro":
        return torch.compile(step, mode="reduce-overhead"), contextlib.nullcontext()
    if variant.startswith("inductor-amb"):
        budget = float(variant[len("inductor-amb"):])
        return torch.compile(step), functorch_config.patch(activation_memory_budget=budget)
    options: dict[str, Any] = {"reports": reports}
    if variant == "fxopt-plain":
        options["cuda_graphs"] = False
    elif variant == "fxopt-replay":
        if "training_cuda_graphs" not in {f.name for f in dataclasses.fields(BackendOptions)}:
            raise SystemExit("this fxopt has no option training_cuda_graphs")
        options["training_cuda_graphs"] = True
    elif variant.startswith("fxopt-budget"):
        options["memory_budget"] = float(variant[len("fxopt-budget"):])
    elif variant != "fxopt":
        raise SystemExit(f"unknown variant {variant!r}")
    return fxopt.compile(step, options=options), contextlib.nullcontext()


def run_variant(args: argparse.Namespace) -> dict:
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"
    run_memory = DeviceMemory(device).start()  # before anything: the peaks are the whole run's
    if cuda:
        torch.backends.cudnn.benchmark = True  # this child process's own setting

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model, batches, optimizer, description = workload(args.workload, args.smoke, device)
    reports: list = []
    fn, ctx = compiled(args.child, make_step(model, optimizer), reports)
    row: dict[str, Any] = {"variant": args.child, "workload": description}
    with ctx:
        sync()
        if args.memory_history:
            history = {"base_reserved_MB": torch.cuda.memory_reserved() / 1e6}
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
        began = time.perf_counter()
        # each loss cloned out: under reduce-overhead the returned tensor is overwritten by
        # the next step (reading a kept one raises); the clone costs every variant the same
        losses = [fn(*batches[0]).clone()]
        sync()
        row["first_call_s"] = time.perf_counter() - began
        if args.memory_history:
            history["first_call_peak_reserved_MB"] = torch.cuda.max_memory_reserved() / 1e6
        for i in range(1, args.warmup):
            losses.append(fn(*batches[i % len(batches)]).clone())
        sync()
        if args.memory_history:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            history.update(peak_live_allocations(snapshot, fxopt_roots()))
            history["peak_reserved_MB"] = history["base_reserved_MB"] + history["peak_reserved_since_start_MB"]
            # a full ring buffer has dropped the oldest events: the counts then start mid-run
            history["history_full"] = history["events"] >= HISTORY_ENTRIES
            row["memory_history"] = history
        # the peaks of compilation and warm-up (CUDA-graph recordings included), read before
        # the reset that starts the timed steps' own
        run = run_memory.stop()
        if cuda:
            row["run_peak_allocated_MB"], row["run_peak_reserved_MB"] = run["peak_allocated_MB"], run["peak_reserved_MB"]
        step_memory = DeviceMemory(device).start()
        times = []
        for _ in range(args.repeats):
            sync()
            began = time.perf_counter()
            for i in range(args.steps):
                losses.append(fn(*batches[i % len(batches)]).clone())
            sync()
            times.append((time.perf_counter() - began) / args.steps)
        if args.profile:
            row["profile"] = profile_steps(fn, batches, cuda)
    row["step_ms"] = min(times) * 1e3
    row["step_ms_median"] = statistics.median(times) * 1e3
    steps = step_memory.stop()
    if cuda:
        row["step_peak_allocated_MB"], row["step_peak_reserved_MB"] = steps["peak_allocated_MB"], steps["peak_reserved_MB"]
        for key in ("allocated", "reserved"):
            row[f"run_peak_{key}_MB"] = max(row[f"run_peak_{key}_MB"], row[f"step_peak_{key}_MB"])
        row["device"] = torch.cuda.get_device_name()
    row["torch"] = torch.__version__
    row["losses"] = [float(x) for x in losses]
    row["graphs"] = [{"name": r.name, "training": r.training, "no_replay": r.no_replay, "fallback": r.fallback,
                      "warnings": r.report.warnings if r.report else [],
                      "memory": [vars(d) for d in r.memory]} for r in reports]
    return row


def profile_steps(fn: Callable, batches: list, cuda: bool, steps: int = 5) -> dict:
    """Where a step's time goes, per step: GPU kernels (count, summed time) against the
    host's time to issue the steps and the wall time to their end, and the host ops that
    took the most of it (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for i in range(steps):
            fn(*batches[i % len(batches)]).clone()
        issued = time.perf_counter() - began
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return {"host_ms_per_step": issued * 1e3 / steps, "wall_ms_per_step": wall * 1e3 / steps,
            "kernels_per_step": len(kernels) / steps,
            "kernel_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / steps,
            "host_top": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)}


# --- what holds the reserved memory (--memory-history) ------------------------------------

#: allocator events the history keeps: a ring buffer, the oldest dropped beyond this
HISTORY_ENTRIES = 2_000_000

#: the trace's actions that change the reservation (segment_map/unmap: expandable segments)
_RESERVING = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}

_realpath = functools.lru_cache(maxsize=None)(os.path.realpath)


def fxopt_roots() -> tuple[str, ...]:
    """The folders fxopt's code runs from: the core and the packages installed from
    ``patterns/`` and ``visualize/`` (an editable install maps them elsewhere)."""
    roots = []
    for name in ("fxopt", "fxopt.patterns", "fxopt.visualize"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.join(_realpath(folder), ""))
    return tuple(roots)


def _walk(trace: list[dict]) -> Iterator[tuple[int, int, dict[int, dict]]]:
    """The allocator after each event of ``trace``, counted from the recording's start:
    bytes reserved, bytes allocated, the live allocations by address (one dict, updated)."""
    reserved = allocated = 0
    live: dict[int, dict] = {}
    for event in trace:
        action = event["action"]
        if action in _RESERVING:
            reserved += _RESERVING[action] * event["size"]
        elif action == "alloc":
            live[event["addr"]] = event
            allocated += event["size"]
        elif action == "free_completed" and event["addr"] in live:
            allocated -= live.pop(event["addr"])["size"]
        yield reserved, allocated, live


def _maker(frames: list[dict], roots: tuple[str, ...]) -> str:
    """Who made an allocation: its innermost frame in fxopt's code (``file:line function``),
    else its three innermost Python frames."""
    for frame in frames:  # a relative name ("<eval_with_key>.3") is no file of fxopt's
        if os.path.isabs(frame["filename"]) and _realpath(frame["filename"]).startswith(roots):
            return f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}"
    nearest = [f"{os.path.basename(f['filename'])}:{f['line']}" for f in frames if f["filename"].endswith(".py")]
    return " < ".join(nearest[:3]) or "(no Python frame)"


def peak_live_allocations(snapshot: dict, roots: tuple[str, ...], device: int = 0, top: int = 14) -> dict:
    """At the first event where the reservation peaked in ``torch.cuda.memory._snapshot()``'s
    history of ``device``, the allocations made since the recording began that are still
    live, summed by who made them (:func:`_maker`), largest first: what holds the memory a
    variant reserves beyond another's. Allocations older than the recording are not in it."""
    trace = snapshot["device_traces"][device]
    peak, at = 0, -1
    for i, (reserved, _, _) in enumerate(_walk(trace)):
        if reserved > peak:
            peak, at = reserved, i
    groups: collections.Counter[str] = collections.Counter()
    allocated = 0
    if at >= 0:
        _, allocated, live = next(itertools.islice(_walk(trace), at, None))
        for event in live.values():
            groups[_maker(event.get("frames", []), roots)] += event["size"]
    return {"events": len(trace), "peak_reserved_since_start_MB": peak / 1e6,
            "allocated_since_start_at_peak_MB": allocated / 1e6,
            "top": [[maker, round(size / 1e6, 1)] for maker, size in groups.most_common(top)]}


def history_lines(history: dict) -> list[str]:
    """``memory_history`` as the parent prints it."""
    lines = [f"memory history: {history['base_reserved_MB']:.0f} MB reserved before the first call, peak "
             f"{history['peak_reserved_MB']:.0f} MB (first call's {history['first_call_peak_reserved_MB']:.0f}); of the "
             f"{history['peak_reserved_since_start_MB']:.0f} MB reserved since, "
             f"{history['allocated_since_start_at_peak_MB']:.0f} MB live at the peak, made by"
             + (" (history full: the oldest events were dropped)" if history["history_full"] else "")]
    lines += [f"  {size:9.1f} MB  {maker}" for maker, size in history["top"]]
    return lines


# --- the parent ----------------------------------------------------------------------------

def run_child(variant: str, args: argparse.Namespace) -> dict:
    """One variant in a fresh process (see the module's docstring for why)."""
    row = fresh_process(__file__, ["--child", variant, "--workload", args.workload, "--steps", str(args.steps),
                                   "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                                   *(["--smoke"] if args.smoke else []), *(["--profile"] if args.profile else []),
                                   *(["--memory-history"] if args.memory_history else [])], args.timeout)
    return row if "error" not in row else {"variant": variant, **row}


def warm_caches(args: argparse.Namespace, out: Path) -> None:
    """Every variant compiled in a process of its own, all at once, one step each."""
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    children = [subprocess.Popen([sys.executable, __file__, "--child", variant, "--workload", args.workload,
                                  "--steps", "1", "--repeats", "1", "--warmup", "1",
                                  "--out", str(out / f"{variant}.json"), *(["--smoke"] if args.smoke else [])],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for variant in args.variants.split(",")]
    for child in children:
        try:
            child.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - began)))
        except subprocess.TimeoutExpired:
            child.kill()
    print(f"caches warmed in {time.perf_counter() - began:.0f} s", flush=True)


def table(rows: list[dict]) -> str:
    times: dict[str, float] = {}  # each variant's best process (--rounds runs each several times)
    for r in rows:
        if "step_ms" in r:
            times[r["variant"]] = min(r["step_ms"], times.get(r["variant"], float("inf")))
    default = times.get("inductor")
    best = min((times[v] for v in ("inductor", "inductor-ro") if v in times), default=None)
    reference = next((r["losses"] for r in rows if r["variant"] == "inductor" and "losses" in r), None)
    lines = [f"{'variant':18} {'step ms':>8} {'median':>8} {'vs ind.':>8} {'vs best':>8} {'step alloc MB':>13} "
             f"{'run alloc MB':>12} {'run resv MB':>11} {'first s':>8} {'max |dloss|':>11}"]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"{r['variant']:18} error: {r['error']}")
            continue
        dloss = max(abs(a - b) for a, b in zip(r["losses"], reference)) if reference else float("nan")
        lines.append(f"{r['variant']:18} {r['step_ms']:8.2f} {r['step_ms_median']:8.2f} {_ratio(default, r)} "
                     f"{_ratio(best, r)} {_mb(r, 'step_peak_allocated_MB'):>13} {_mb(r, 'run_peak_allocated_MB'):>12} "
                     f"{_mb(r, 'run_peak_reserved_MB'):>11} {r['first_call_s']:8.1f} {dloss:11.2e}")
        for g in r["graphs"]:
            notes = [f"fallback: {g['fallback']}"] if g["fallback"] else []
            notes += [f"{d['saved_before'] / 1e6:.0f} -> {d['saved_after'] / 1e6:.0f} MB saved, "
                      f"{len(d['recomputed'])} recomputed, est. {d['recompute_share']:.1%}"
                      + (f", short: {d['short']}" if d["short"] else "") for d in g["memory"]]
            if notes:
                lines.append(f"    graph {g['name']}: {'; '.join(notes)}")
    return "\n".join(lines)


def _ratio(base: float | None, row: dict) -> str:
    return f"{base / row['step_ms']:7.2f}x" if base else "       -"


def _mb(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else "-"


def main(argv: list[str] | None = None) -> dict | None:
    parser = cli.parser(__doc__, rounds=1)
    parser.add_argument("--workload", choices=("resnet50", "transformer"), default="resnet50")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    parser.add_argument("--profile", action="store_true", help="also profile 5 steps: kernels, GPU time, host ops")
    parser.add_argument("--memory-history", action="store_true",
                        help="record the CUDA allocator's history over the first call and the warm-up steps; "
                             "the allocations live at the peak reservation, grouped by the fxopt frame that "
                             "made them, go into the variant's JSON")
    parser.add_argument("--warm-caches", action="store_true",
                        help="first compile every variant at once, one step each, results dropped: the timed "
                             "runs then meet warm Inductor caches (first_call_s is a warm-cache figure)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_history and args.smoke:
        parser.error("--memory-history reads the CUDA caching allocator's history: it needs a GPU, not --smoke")
    if args.child:  # --out: the file the parent reads back
        Path(args.out).write_text(json.dumps(run_variant(args)))
        return None
    record = Record(f"training_{args.workload}", args, "cpu" if args.smoke else "cuda")
    if args.warm_caches:
        warm_caches(args, record.path.parent / "warm")
    rows = record.rows
    for variant in args.variants.split(",") * args.rounds:
        record.add(run_child(variant, args))
        printable = {k: v for k, v in rows[-1].items() if k not in ("losses", "graphs", "profile", "memory_history")}
        print(json.dumps(printable), flush=True)
        if "memory_history" in rows[-1]:
            print(*history_lines(rows[-1]["memory_history"]), sep="\n", flush=True)
        if "profile" in rows[-1]:
            profile = rows[-1]["profile"]
            print(profile["host_top"], json.dumps({k: v for k, v in profile.items() if k != "host_top"}), sep="\n", flush=True)
    record.extra["table"] = summary = table(rows)
    record.save()
    print(f"\n{summary}", flush=True)
    return record.data


if __name__ == "__main__":
    main()
