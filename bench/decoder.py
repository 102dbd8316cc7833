"""A real decoder, quantized: tokens/s, prefill time and greedy agreement with bf16 (issue 36 item 5).

    python3 bench/decoder.py --out $OUT                # one H200: every variant, one process
    python3 bench/decoder.py --out $OUT --fresh        # each variant in a fresh process
    python3 bench/decoder.py --smoke --out /tmp/dec    # CPU, tiny shapes: checks the script's logic

Model: examples/llama_decoder.py at full size (1.10B parameters: d 2048, 16 layers, GQA 32/8
heads of 64, SwiGLU 8192, vocab 32000), random weights, bf16, static KV cache. Per variant:

- **decode tokens/s** at batch 1 and 8: a prompt of ``PROMPT`` tokens prefilled (the
  variant's model uncompiled: prefill shapes vary, decode ones do not), then ``--rounds``
  rounds of ``--steps`` greedy decode steps through the compiled model, timed between CUDA
  events; the median round. The cache holds ``CACHE_LEN`` positions; every step attends over
  all of them under a mask (fixed shapes: one compile per batch size, whatever the position).
- **prefill ms** at 512 and 2048 tokens, batch 1, compiled, the median of ``--prefill-reps``.
- **first_call_s**: the first compiled call of each of those four shapes (compile included,
  Inductor's caches as the machine has them); **peak_reserved_gb**: the allocator's peak
  from before the variant's first call to its end (the bf16 model, 2.2 GB, is resident
  throughout); **agreement**: the greedy tokens of ``AGREE_STEPS`` decode steps at each
  batch size against the bf16 model's, uncompiled (``prefix``: the fraction of positions
  before the first divergence, averaged over sequences; ``overall``: the fraction equal).
  With random weights the top two logits are close and a sequence that diverges once
  continues differently, so ``prefix`` is the stricter figure.

Variants (``--variants``, comma-separated names of :data:`VARIANTS`):

- ``bf16 <mode>``: every Inductor mode a user could pick, built by bench/gpu_zoo.py's
  ``make_variant`` (default, freezing, reduce-overhead, reduce-overhead + freezing; the
  freezing ones under the global flag while they compile and run, and checked to be
  frozen); speedups are against the best of them per figure;
- ``fxopt bf16``: ``torch.compile(model, backend="fxopt")``;
- ``fxopt int8`` / ``fxopt int4``: the model quantized by ``llama_decoder.quantize``, which
  swaps each layer's linear parts (``wqkv``, ``wo``, the SwiGLU MLP) and the output head for
  what ``fxopt.quant.quantize_model`` makes of each (``int8_weight_only``: gate/up merged and
  SwiGLU fused; ``int4_weight_only``: default group size), then ``torch.compile(q)``;
  ``... backend``: ``backend="fxopt"``; ``... reduce-overhead`` (not in the default list):
  ``mode="reduce-overhead"``. ``quantize_model`` takes the whole decoder too (it traces
  the cache writes; tests/examples/test_llama_decoder.py checks it computes the same), but
  returns a GraphModule bound to the cache it saw: the bench sets a cache per batch size;
- ``torchao int8`` / ``torchao int4``: ``Int8WeightOnlyConfig()`` /
  ``Int4WeightOnlyConfig(group_size=128)`` on every ``nn.Linear`` (the output head
  included, as fxopt's default does), bench/quant_serving.py's ``torchao_model``, then
  ``torch.compile(mode=--torchao-mode)``: reduce-overhead by default, as torchao's own
  Llama generate script decodes (with the Inductor options its ``quantize_`` sets, put
  back afterwards). Where torchao does not import, the row says why.

Every compile is ``dynamic=False``: one static graph per shape (4 per variant; ``graphs``
counts Dynamo's, ``cudagraph_skips`` the graphs Inductor ran without the CUDA graphs it was
asked for; ``fxopt_graphs``: what the fxopt backend did with each graph: ``no_replay`` why
it launches it plainly, ``replay`` its own replay's log. A graph that writes buffers in
place, as every call of this decoder writes its KV cache, takes the backend's route for
state updates: Inductor's CUDA-graph trees (both fields None, skips counted above)). The JSON
(``decoder.json``) is rewritten after every variant; ``--budget-s`` skips the variants left
once it is spent. ``--smoke``: CPU, fp32, tiny config and shapes, few steps; every compiled
variant is traced by Dynamo with ``fullgraph=True`` and run by its eager backend (no
graph break in the model; Inductor compiles nothing, as one Inductor compile of even the
tiny decoder takes a minute on a CPU); torchao variants are skipped (CUDA only here).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_zoo import frozen_summary, make_variant  # noqa: E402

from examples.llama_decoder import TINY, Config, Decoder, generate, quantize  # noqa: E402

#: name -> (weights: bf16 / int8 / int4 / torchao8 / torchao4, gpu_zoo variant or torchao), in
#: the order they run: a run cut short by --budget-s keeps the likely best bf16 modes (decode:
#: reduce-overhead; prefill: freezing), fxopt's quantized routes and torchao's first
VARIANTS = {
    "bf16 reduce-overhead": ("bf16", "reduce_overhead"),
    "bf16 freezing": ("bf16", "inductor_freezing"),
    "fxopt int8 backend": ("int8", "fxopt"),
    "fxopt int4 backend": ("int4", "fxopt"),
    "torchao int8": ("torchao8", "torchao"),
    "torchao int4": ("torchao4", "torchao"),
    "fxopt bf16": ("bf16", "fxopt"),
    "bf16 reduce-overhead freezing": ("bf16", "reduce_overhead_freezing"),
    "bf16 default": ("bf16", "inductor"),
    "fxopt int8": ("int8", "inductor"),
    "fxopt int4": ("int4", "inductor"),
    "fxopt int8 reduce-overhead": ("int8", "reduce_overhead"),
    "fxopt int4 reduce-overhead": ("int4", "reduce_overhead"),
}
DEFAULT = [v for v in VARIANTS if not v.endswith(("int8 reduce-overhead", "int4 reduce-overhead"))]


class Shapes:
    """What is measured: full size on CUDA, or ``--smoke``'s tiny shapes on a CPU."""

    def __init__(self, smoke: bool, args: argparse.Namespace) -> None:
        self.config = TINY if smoke else Config()
        self.device, self.dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
        self.batches = (1, 2) if smoke else (1, 8)
        self.prefill = (16, 32) if smoke else (512, 2048)
        self.prompt = 8 if smoke else 128  # PROMPT
        self.agree_steps = 8 if smoke else 64  # AGREE_STEPS
        self.cache_len = 32 if smoke else 256  # CACHE_LEN: prompt + agree_steps fit
        self.steps, self.rounds, self.prefill_reps = (4, 2, 2) if smoke else (args.steps, args.rounds, args.prefill_reps)
        if self.prompt + max(self.agree_steps, self.steps) > self.cache_len:
            raise SystemExit(f"--steps {self.steps}: the prompt and the steps exceed the cache ({self.cache_len})")


# --- timing: small and local, so a shared harness can replace it -------------------------

class Timer:
    """Milliseconds of the work issued inside ``with timer:`` (CUDA events on the GPU, the
    wall clock on a CPU); ``ms`` after the block."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self) -> Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def first_call_s(fn: Callable, args: tuple, device: str) -> float:
    """Seconds of one call, to the end of its GPU work (a first call: compile included)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return round(time.perf_counter() - start, 3)


# --- the measured quantities ----------------------------------------------------------

def prompt_for(shapes: Shapes, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(shapes.config.vocab_size, (batch, shapes.prompt), generator=g).to(shapes.device)


def decode_rounds(model: Decoder, fn: Callable, prompt: torch.Tensor, shapes: Shapes) -> float:
    """Median ms of ``shapes.steps`` greedy decode steps through ``fn``, each round after an
    uncompiled prefill of ``prompt`` (the steps' argmax is timed too: a step needs it)."""
    times = []
    for _ in range(shapes.rounds):
        pos = torch.arange(prompt.shape[1], device=prompt.device)
        token = model(prompt, pos)[:, -1].argmax(-1, keepdim=True)
        pos = pos[-1:] + 1
        with Timer(shapes.device) as timer:
            for _ in range(shapes.steps):
                token = fn(token, pos)[:, -1].argmax(-1, keepdim=True)
                pos = pos + 1
        times.append(timer.ms)
    return statistics.median(times)


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """``prefix``: mean over sequences of the fraction of positions before the first
    divergence; ``overall``: the fraction of positions equal."""
    equal = (tokens == reference).cpu()
    steps = equal.shape[1]
    first_diff = [int((~row).nonzero()[0]) if not row.all() else steps for row in equal]
    return {"prefix": round(sum(first_diff) / (len(first_diff) * steps), 4),
            "overall": round(float(equal.float().mean()), 4)}


def references(base: Decoder, shapes: Shapes) -> dict[int, torch.Tensor]:
    """The bf16 model's greedy tokens, uncompiled, per batch size."""
    out = {}
    for batch in shapes.batches:
        base.setup_cache(batch, shapes.cache_len)
        out[batch] = generate(base, prompt_for(shapes, batch), shapes.agree_steps)
    return out


def measure(model: Decoder, fn: Callable, context: Callable, shapes: Shapes,
            reference: dict[int, torch.Tensor], row: dict[str, Any]) -> None:
    """Every figure of one variant into ``row``: first calls, agreement, decode, prefill."""
    first, agree, tps, prefill = (row.setdefault(k, {}) for k in ("first_call_s", "agreement", "tokens_per_s", "prefill_ms"))
    with context():
        for batch in shapes.batches:
            model.setup_cache(batch, shapes.cache_len)
            prompt = prompt_for(shapes, batch)
            pos = torch.arange(shapes.prompt, device=shapes.device)
            token = model(prompt, pos)[:, -1:].argmax(-1)
            first[f"decode_b{batch}"] = first_call_s(fn, (token, pos[-1:] + 1), shapes.device)
            agree[f"b{batch}"] = agreement(generate(model, prompt, shapes.agree_steps, fn), reference[batch])
            tps[f"b{batch}"] = round(batch * shapes.steps / decode_rounds(model, fn, prompt, shapes) * 1e3, 1)
        model.setup_cache(1, max(shapes.prefill))
        for n in shapes.prefill:
            g = torch.Generator().manual_seed(n)
            tokens = torch.randint(shapes.config.vocab_size, (1, n), generator=g).to(shapes.device)
            pos = torch.arange(n, device=shapes.device)
            first[f"prefill_{n}"] = first_call_s(fn, (tokens, pos), shapes.device)
            fn(tokens, pos)  # reduce-overhead: the first call warms up, the second records
            times = []
            for _ in range(shapes.prefill_reps):
                with Timer(shapes.device) as timer:
                    fn(tokens, pos)
                times.append(timer.ms)
            prefill[str(n)] = round(statistics.median(times), 3)


# --- variants -------------------------------------------------------------------------

def base_model(shapes: Shapes) -> Decoder:
    with torch.device(shapes.device):  # built and drawn where it runs: seconds less per process
        return Decoder(shapes.config).to(shapes.dtype).init_weights().eval()


def torchao_model(model: Decoder, bits: int, shapes: Shapes) -> tuple[Decoder | None, str]:
    """bench/quant_serving.py's torchao weight-only model, or why there is none."""
    if shapes.device != "cuda":
        return None, "skipped: torchao runs on CUDA only in this bench (its int4 kernel needs CUDA)"
    from quant_serving import torchao_model as build

    return build(model, bits)


def weights(kind: str, base: Decoder, shapes: Shapes, row: dict[str, Any]) -> Decoder | None:
    """The variant's model (``None``: it cannot be built, ``row["error"]`` says why)."""
    if kind == "bf16":
        return base
    if kind in ("int8", "int4"):
        import fxopt.quant as fq

        start = time.perf_counter()
        model = quantize(copy.deepcopy(base), f"{kind}_weight_only")
        row["quantize_s"] = round(time.perf_counter() - start, 3)
        parts = [fq.summary_of(gm) for gm in model.modules() if isinstance(gm, torch.fx.GraphModule)]
        row["quantized"] = {"parts": len(parts), "sites": sum(len(p.sites) for p in parts),
                            "min_coverage": min(p.coverage for p in parts)}
        return model
    model, why = torchao_model(base, 8 if kind == "torchao8" else 4, shapes)
    row["torchao"] = why
    if model is None:
        row["error"] = why
    return model


def compiled(route: str, model: Decoder, stats: dict[str, Any], args: argparse.Namespace,
             smoke: bool) -> tuple[Callable, Callable]:
    """The compiled model and the context its calls run in (gpu_zoo's make_variant: the
    global freezing flag for the freezing modes)."""
    if smoke:
        return torch.compile(model, backend="eager", fullgraph=True, dynamic=False), contextlib.nullcontext
    if route == "torchao":
        return torch.compile(model, mode=args.torchao_mode, dynamic=False), contextlib.nullcontext
    return make_variant(route, model, stats, dynamic=False)


def run_variant(name: str, base: Decoder, shapes: Shapes, reference: dict[int, torch.Tensor],
                args: argparse.Namespace) -> dict[str, Any]:
    """One variant's row: its figures, or the error (traceback) that stopped it."""
    kind, route = VARIANTS[name]
    row: dict[str, Any] = {}
    cuda = shapes.device == "cuda"
    inductor_config, matmul_precision = torch._inductor.config.save_config(), torch.get_float32_matmul_precision()
    try:
        torch._dynamo.reset()
        model = weights(kind, base, shapes, row)
        if model is None:
            return row
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["reserved_before_gb"] = round(torch.cuda.memory_reserved() / 2**30, 3)
        stats: dict[str, Any] = {}
        fn, context = compiled(route, model, stats, args, args.smoke)
        counters.clear()
        with torch.no_grad():
            measure(model, fn, context, shapes, reference, row)
        # one graph per measured shape, else something recompiles; CUDA graphs that Inductor
        # gave up (reduce-overhead; its log says why) leave launch-bound decode steps
        row["graphs"] = counters["stats"]["unique_graphs"]
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        if "reports" in stats:  # the fxopt backend: whether each graph was replayed as CUDA graphs, and why
            row["fxopt_graphs"] = [{"no_replay": g.no_replay, "replay": None if g.replay is None else str(g.replay),
                                    "fallback": g.fallback} for g in stats["reports"]]
        if cuda:
            row["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        row["frozen"] = frozen_summary(route, stats)
    except Exception:  # noqa: BLE001 - a variant that fails is a finding, reported whole
        row["error"] = traceback.format_exc()[-4000:]
    finally:
        torch._dynamo.reset()
        # torchao's quantize_ sets Inductor's options its way (coordinate-descent tuning, ...)
        # and the float32 matmul precision: the next variant finds them as they were
        torch._inductor.config.load_config(inductor_config)
        torch.set_float32_matmul_precision(matmul_precision)
    return row


def child(name: str, args: argparse.Namespace) -> None:
    """``--fresh``: one variant in this process, its row printed as ``ROW <json>``."""
    shapes = Shapes(args.smoke, args)
    base = base_model(shapes)
    with torch.no_grad():
        reference = references(base, shapes)
    print("ROW " + json.dumps(run_variant(name, base, shapes, reference, args)), flush=True)


def fresh_row(name: str, timeout_s: float) -> dict[str, Any]:
    argv = [a for a in sys.argv[1:] if a != "--fresh"]
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", name],
                              capture_output=True, text=True, timeout=None if timeout_s == float("inf") else timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {timeout_s:.0f} s (the budget left)"}
    rows = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if rows:
        return json.loads(rows[-1][4:])
    return {"error": f"no result (exit {proc.returncode}): {proc.stderr[-3000:]}"}


# --- output -------------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    try:  # the version without importing torchao, whose import is the variants' business
        env["torchao"] = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        env["torchao"] = None
    return env


def speedups(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant against the best bf16 Inductor mode, per figure (tokens/s: higher is
    better; prefill ms: lower)."""
    bf16 = [row for name, row in variants.items() if name.startswith("bf16 ") and "error" not in row]
    out = {}
    for name, row in variants.items():
        if "error" in row or not bf16:
            continue
        ratios = {}
        for key, value in row.get("tokens_per_s", {}).items():
            ratios[f"decode_{key}"] = round(value / max(r["tokens_per_s"][key] for r in bf16), 3)
        for key, value in row.get("prefill_ms", {}).items():
            ratios[f"prefill_{key}"] = round(min(r["prefill_ms"][key] for r in bf16) / value, 3)
        out[name] = ratios
    return out


def table(result: dict[str, Any]) -> str:
    (b1, b8), (p1, p2) = result["batches"], result["prefill"]
    head = ["variant", f"tok/s b{b1}", f"tok/s b{b8}", f"prefill {p1} ms", f"prefill {p2} ms",
            f"x best bf16 (b{b1}, b{b8}, {p1}, {p2})", f"agree b{b1} prefix/overall", "first call s (max)", "peak GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["variants"].items():
        if "error" in row:
            lines.append(f"| {name} | " + row["error"].strip().splitlines()[-1][:120] + " |" + " |" * (len(head) - 2))
            continue
        tps, pre, agree = row["tokens_per_s"], row["prefill_ms"], row["agreement"]
        ratio = ", ".join(f"{v:.2f}" for v in result["speedups"].get(name, {}).values())
        lines.append(f"| {name} | {tps[f'b{b1}']} | {tps[f'b{b8}']} | {pre[str(p1)]} | {pre[str(p2)]} | {ratio} | "
                     f"{agree[f'b{b1}']['prefix']}/{agree[f'b{b1}']['overall']} | {max(row['first_call_s'].values()):.1f} | "
                     f"{row.get('peak_reserved_gb', '-')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--variants", default=",".join(DEFAULT), help=f"from: {', '.join(VARIANTS)}")
    parser.add_argument("--fresh", action="store_true", help="each variant in its own process")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Dynamo's eager backend")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-reps", type=int, default=5)
    parser.add_argument("--torchao-mode", default="reduce-overhead", help="torch.compile mode of the torchao variants")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="skip the variants left once this many seconds have passed")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        torch.set_num_threads(1)  # tiny matrices: threads cost more than they save
    if args.child:
        child(args.child, args)
        return
    began = time.perf_counter()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    shapes = Shapes(args.smoke, args)
    result: dict[str, Any] = {
        "env": environment(shapes.device), "parameters": shapes.config.parameters(), "fresh": args.fresh,
        "batches": list(shapes.batches), "prefill": list(shapes.prefill), "prompt": shapes.prompt,
        "cache_len": shapes.cache_len, "decode_steps": shapes.steps, "rounds": shapes.rounds,
        "agree_steps": shapes.agree_steps, "variants": {}}
    base = reference = None
    if not args.fresh:
        base = base_model(shapes)
        with torch.no_grad():
            reference = references(base, shapes)
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        spent = time.perf_counter() - began
        if spent > args.budget_s:
            row = {"error": f"skipped: the budget of {args.budget_s:.0f} s was spent"}
        elif args.fresh:
            row = fresh_row(name, args.budget_s - spent)
        else:
            row = run_variant(name, base, shapes, reference, args)
        result["variants"][name] = row
        print(f"{name}: {json.dumps(row)[:1500]}", flush=True)
        result["speedups"] = speedups(result["variants"])
        with open(os.path.join(args.out, "decoder.json"), "w") as f:
            json.dump(result, f, indent=1)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    with open(os.path.join(args.out, "decoder.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
