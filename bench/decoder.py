"""A real decoder, quantized: tokens/s, prefill time and greedy agreement with bf16 (issue 36 item 5).

    python3 bench/decoder.py --out $OUT                # one H200: every variant, one process
    python3 bench/decoder.py --out $OUT --fresh        # each variant in a fresh process
    python3 bench/decoder.py --smoke                   # CPU, tiny shapes: checks the script's logic (CI)

Model: examples/llama_decoder.py at full size (1.10B parameters: d 2048, 16 layers, GQA 32/8
heads of 64, SwiGLU 8192, vocab 32000), random weights, bf16, static KV cache. Per variant:

- **decode tokens/s** at batch 1 and 8: a prompt of ``PROMPT`` tokens prefilled (the
  variant's model uncompiled: prefill shapes vary, decode ones do not), then ``--rounds``
  rounds of ``--steps`` greedy decode steps through the compiled model, issued back to back
  (the harness's ``loop_ms``: CUDA events around the round); the median round. The cache holds ``CACHE_LEN`` positions; every step attends over
  all of them under a mask (fixed shapes: one compile per batch size, whatever the position).
- **prefill ms** at 512 and 2048 tokens, batch 1, compiled, the median of ``--prefill-reps``
  calls (``loop_ms`` of one call each).
- **first_call_s**: the first compiled call of each of those four shapes (compile included,
  Inductor's caches as the machine has them); **peak_reserved_MB**: the allocator's peak
  from before the variant's first call to its end (the harness's ``DeviceMemory``; the bf16
  model, 2.2 GB, is resident throughout); **agreement**: the greedy tokens of ``AGREE_STEPS`` decode steps at each
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
(``--out``: a file, or a folder to put ``decoder.json`` in; default
``bench/results/<gpu>/decoder.json``) is rewritten after every variant, one row per variant;
``--budget-s`` skips the variants left once it is spent; ``--fresh`` runs each variant in a
process of its own (the harness's ``fresh_process``). ``--smoke``: CPU, fp32, tiny config and shapes, few steps; every compiled
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
import importlib.util
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_zoo import make_variant
from harness import (
    DeviceMemory,
    Record,
    cli,
    cpu_threads,
    fresh_process,
    frozen_summary,
    loop_ms,
    markdown_table,
    wall_ms,
)
from quant_serving import kept_globals, torchao_model
from torch._dynamo.utils import counters


def _load_example() -> Any:
    """examples/llama_decoder.py, loaded by its path (examples/ is no package; its dataclass
    looks its module up in ``sys.modules``)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "llama_decoder.py"
    spec = importlib.util.spec_from_file_location("llama_decoder", path)
    module = sys.modules.setdefault("llama_decoder", importlib.util.module_from_spec(spec))
    if not hasattr(module, "Decoder"):
        spec.loader.exec_module(module)
    return module


llama = _load_example()
Decoder = llama.Decoder

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

    def __init__(self, args: argparse.Namespace) -> None:
        smoke = args.smoke
        self.config = llama.TINY if smoke else llama.Config()
        self.device, self.dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
        self.batches = (1, 2) if smoke else (1, 8)
        self.prefill = (16, 32) if smoke else (512, 2048)
        self.prompt = 8 if smoke else 128  # PROMPT
        self.agree_steps = 8 if smoke else 64  # AGREE_STEPS
        self.cache_len = 32 if smoke else 256  # CACHE_LEN: prompt + agree_steps fit
        self.steps, self.rounds, self.prefill_reps = (4, 2, 2) if smoke else (args.steps, args.rounds, args.prefill_reps)
        if self.prompt + max(self.agree_steps, self.steps) > self.cache_len:
            raise SystemExit(f"--steps {self.steps}: the prompt and the steps exceed the cache ({self.cache_len})")

    def record(self) -> dict[str, Any]:
        """What the record's meta says about the shapes."""
        return {"parameters": self.config.parameters(), "batches": list(self.batches), "prefill": list(self.prefill),
                "prompt": self.prompt, "cache_len": self.cache_len, "decode_steps": self.steps,
                "rounds": self.rounds, "agree_steps": self.agree_steps}


# --- the measured quantities ----------------------------------------------------------

def prompt_for(shapes: Shapes, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(shapes.config.vocab_size, (batch, shapes.prompt), generator=g).to(shapes.device)


class DecodeStep:
    """A call is one greedy decode step through ``fn``: the state a timed loop of steps carries."""

    def __init__(self, fn: Callable, token: torch.Tensor, pos: torch.Tensor) -> None:
        self.fn, self.token, self.pos = fn, token, pos

    def __call__(self) -> None:
        self.token = self.fn(self.token, self.pos)[:, -1].argmax(-1, keepdim=True)
        self.pos = self.pos + 1


def decode_rounds(model: Decoder, fn: Callable, prompt: torch.Tensor, shapes: Shapes) -> float:
    """Median ms of ``shapes.steps`` greedy decode steps through ``fn``, each round after an
    uncompiled prefill of ``prompt`` (the steps' argmax is timed too: a step needs it)."""
    times = []
    for _ in range(shapes.rounds):
        pos = torch.arange(prompt.shape[1], device=prompt.device)
        step = DecodeStep(fn, model(prompt, pos)[:, -1].argmax(-1, keepdim=True), pos[-1:] + 1)
        times.append(shapes.steps * loop_ms(step, shapes.device, iters=shapes.steps, reps=1, warmup=0))
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
        out[batch] = llama.generate(base, prompt_for(shapes, batch), shapes.agree_steps)
    return out


def first_call_s(fn: Callable, args: tuple, device: str) -> float:
    """Seconds of one call, to the end of its device work (a first call: compile included)."""
    return round(wall_ms(lambda: fn(*args), device, reps=1, warmup=0) / 1e3, 3)


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
            agree[f"b{batch}"] = agreement(llama.generate(model, prompt, shapes.agree_steps, fn), reference[batch])
            tps[f"b{batch}"] = round(batch * shapes.steps / decode_rounds(model, fn, prompt, shapes) * 1e3, 1)
        model.setup_cache(1, max(shapes.prefill))
        for n in shapes.prefill:
            g = torch.Generator().manual_seed(n)
            tokens = torch.randint(shapes.config.vocab_size, (1, n), generator=g).to(shapes.device)
            pos = torch.arange(n, device=shapes.device)
            first[f"prefill_{n}"] = first_call_s(fn, (tokens, pos), shapes.device)
            # warm-up 1: reduce-overhead's first call warms up, the second records
            prefill[str(n)] = round(loop_ms(lambda t=tokens, p=pos: fn(t, p), shapes.device, iters=1,
                                            reps=shapes.prefill_reps, warmup=1), 3)


# --- variants -------------------------------------------------------------------------

def base_model(shapes: Shapes) -> Decoder:
    with torch.device(shapes.device):  # built and drawn where it runs: seconds less per process
        return Decoder(shapes.config).to(shapes.dtype).init_weights().eval()


def weights(kind: str, base: Decoder, shapes: Shapes, row: dict[str, Any]) -> Decoder | None:
    """The variant's model (``None``: it cannot be built, ``row["error"]`` says why)."""
    if kind == "bf16":
        return base
    if kind in ("int8", "int4"):
        import fxopt.quant as fq

        start = time.perf_counter()
        model = llama.quantize(copy.deepcopy(base), f"{kind}_weight_only")
        row["quantize_s"] = round(time.perf_counter() - start, 3)
        parts = [fq.summary_of(gm) for gm in model.modules() if isinstance(gm, torch.fx.GraphModule)]
        row["quantized"] = {"parts": len(parts), "sites": sum(len(p.sites) for p in parts),
                            "min_coverage": min(p.coverage for p in parts)}
        return model
    if shapes.device != "cuda":
        model, why = None, "skipped: torchao runs on CUDA only in this bench (its int4 kernel needs CUDA)"
    else:
        model, why = torchao_model(base, 8 if kind == "torchao8" else 4)
    row["torchao"] = why
    if model is None:
        row["error"] = why
    return model


def compiled(route: str, model: Decoder, stats: dict[str, Any], args: argparse.Namespace) -> tuple[Callable, Callable]:
    """The compiled model and the context its calls run in (gpu_zoo's make_variant: the
    global freezing flag for the freezing modes)."""
    if args.smoke:
        return torch.compile(model, backend="eager", fullgraph=True, dynamic=False), contextlib.nullcontext
    if route == "torchao":
        return torch.compile(model, mode=args.torchao_mode, dynamic=False), contextlib.nullcontext
    return make_variant(route, model, stats, dynamic=False)


def run_variant(name: str, base: Decoder, shapes: Shapes, reference: dict[int, torch.Tensor],
                args: argparse.Namespace) -> dict[str, Any]:
    """One variant's row: its figures, or the error (traceback) that stopped it."""
    kind, route = VARIANTS[name]
    row: dict[str, Any] = {"variant": name}
    cuda = shapes.device == "cuda"
    try:
        # torchao's quantize_ sets Inductor's options its way: the next variant finds them as they were
        with kept_globals():
            torch._dynamo.reset()
            model = weights(kind, base, shapes, row)
            if model is None:
                return row
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
            memory = DeviceMemory(shapes.device).start()
            stats: dict[str, Any] = {}
            fn, context = compiled(route, model, stats, args)
            counters.clear()
            with torch.no_grad():
                measure(model, fn, context, shapes, reference, row)
            row.update(memory.stop())
        # one graph per measured shape, else something recompiles; CUDA graphs that Inductor
        # gave up (reduce-overhead; its log says why) leave launch-bound decode steps
        row["graphs"] = counters["stats"]["unique_graphs"]
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        if "reports" in stats:  # the fxopt backend: whether each graph was replayed as CUDA graphs, and why
            row["fxopt_graphs"] = [{"no_replay": g.no_replay, "replay": None if g.replay is None else str(g.replay),
                                    "fallback": g.fallback} for g in stats["reports"]]
        row["frozen"] = frozen_summary(route, stats)
    except Exception:  # noqa: BLE001 - a variant that fails is a finding, reported whole
        row["error"] = traceback.format_exc()[-4000:]
    finally:
        torch._dynamo.reset()
    return row


def child_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The arguments of ``--fresh``'s child process for variant ``name``."""
    return ["--child", name, "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--prefill-reps", str(args.prefill_reps), "--torchao-mode", args.torchao_mode,
            *(["--smoke"] if args.smoke else [])]


def fresh_row(name: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """``--fresh``: the variant's row from a process of its own (its ``--child`` run)."""
    child = fresh_process(__file__, child_argv(name, args), timeout_s)
    row = (child.get("rows") or [{"variant": name}])[0]
    return {**row, "error": child["error"]} if "error" in child else row


# --- output -------------------------------------------------------------------------

def torchao_version() -> str | None:
    """The version without importing torchao, whose import is the variants' business."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


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


def table(rows: list[dict[str, Any]], ratios: dict[str, dict[str, float]], shapes: Shapes) -> str:
    """The printed summary: a row per variant (its error's last line where it failed)."""
    (b1, b8), (p1, p2) = shapes.batches, shapes.prefill
    lines = []
    for row in rows:
        if "error" in row:
            lines.append({"variant": row["variant"], f"tok/s b{b1}": row["error"].strip().splitlines()[-1][:120]})
            continue
        tps, pre, agree = row["tokens_per_s"], row["prefill_ms"], row["agreement"][f"b{b1}"]
        lines.append({"variant": row["variant"], f"tok/s b{b1}": tps[f"b{b1}"], f"tok/s b{b8}": tps[f"b{b8}"],
                      f"prefill {p1} ms": pre[str(p1)], f"prefill {p2} ms": pre[str(p2)],
                      "x best bf16": ", ".join(f"{v:.2f}" for v in ratios.get(row["variant"], {}).values()),
                      f"agree b{b1} prefix/overall": f"{agree['prefix']}/{agree['overall']}",
                      "first call s (max)": max(row["first_call_s"].values()),
                      "peak MB": row.get("peak_reserved_MB")})
    columns = ["variant", f"tok/s b{b1}", f"tok/s b{b8}", f"prefill {p1} ms", f"prefill {p2} ms", "x best bf16",
               f"agree b{b1} prefix/overall", "first call s (max)", "peak MB"]
    return markdown_table(lines, columns, digits=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(DEFAULT), help=f"from: {', '.join(VARIANTS)}")
    parser.add_argument("--fresh", action="store_true", help="each variant in its own process")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed round")
    parser.add_argument("--prefill-reps", type=int, default=5)
    parser.add_argument("--torchao-mode", default="reduce-overhead", help="torch.compile mode of the torchao variants")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="skip the variants left once this many seconds have passed")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [args.child] if args.child else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    shapes = Shapes(args)
    record = Record("decoder", args, shapes.device, torchao=torchao_version(), **shapes.record())
    with cpu_threads(1 if args.smoke else None):  # tiny matrices: threads cost more than they save
        base = reference = None
        if not args.fresh:
            base = base_model(shapes)
            with torch.no_grad():
                reference = references(base, shapes)
        began = time.perf_counter()
        for name in names:
            spent = time.perf_counter() - began
            if spent > args.budget_s:
                row = {"variant": name, "error": f"skipped: the budget of {args.budget_s:.0f} s was spent"}
            elif args.fresh:
                row = fresh_row(name, args, args.budget_s - spent)
            else:
                row = run_variant(name, base, shapes, reference, args)
            record.add(row)
            record.extra["speedups"] = speedups({r["variant"]: r for r in record.rows})
            record.save()
            print(f"{name}: {str(row)[:1500]}", flush=True)
    if not args.child:
        print(table(record.rows, record.extra["speedups"], shapes))
    return record.data


if __name__ == "__main__":
    main()
