"""Serving benchmark for a transformer encoder at varying sequence lengths (bf16, one GPU).

The workload a text server sees without padding: a BERT-base-shaped encoder (Hugging Face
``BertModel`` from a randomly initialized ``BertConfig()`` where ``transformers`` is
installed, else :class:`Encoder`, plain torch modules of the same shape), batch 8, called
at sequence lengths 128, 384, 256 in that order, each length its real size (no padding to a
bucket), each called twice before timing (what compiles, recompiles and captures). Then
each length is timed (``triton.testing.do_bench`` median of the Python call, over
interleaved rounds).

Routes to the varying length: ``automatic`` (``dynamic=None``, what users get: Dynamo
recompiles with a symbolic length at the second length) and ``static`` (``dynamic=False``:
one graph per length). Variants: every Inductor mode a user could pick (default, freezing,
``mode="reduce-overhead"``, reduce-overhead with freezing) and fxopt (default options: the
per-shape CUDA-graph replay with plain-call semantics), each compiled afresh after
``torch._dynamo.reset()`` (automatic dynamic shapes are remembered per code object).
Per length: ms, fxopt against the best Inductor mode of the route, the first and second
call's time at each new length, max abs error and relative L2 against eager bf16 on tokens
the variant has not seen; per variant: whether it was frozen, how many graphs it compiled,
whether an earlier output survives later calls, and fxopt's replay log.

    python bench/serving_seq.py --out $OUT/serving_seq.json                  # automatic route
    python bench/serving_seq.py --routes automatic,static --profile-length 384 --out $OUT/serving_seq.json
    python bench/serving_seq.py --smoke                                      # CPU, small encoder: checks the logic (CI)

Timing, baselines and memory are the bench harness's (``call_ms`` over the lengths in
interleaved rounds, ``wall_ms`` for the first and second calls, bench/gpu_zoo.py's
``make_variant`` for the modes, ``DeviceMemory`` from before a variant's first call). One
Inductor cache serves every variant (kernels compiled for one serve another); the record
(``--out``, default ``bench/results/<gpu>/serving_seq.json``) is rewritten after every
variant, and a variant that fails is a row saying why.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpu_zoo import HiddenStates, make_variant, profile_kernels, profile_text, rel_l2
from harness import (
    INDUCTOR_MODES,
    DeviceMemory,
    Record,
    alternate,
    call_ms,
    cli,
    cpu_threads,
    frozen_summary,
    median,
    wall_ms,
)
from serving import earlier_output_kept, fxopt_graphs, summarize

ROUTES = {"automatic": None, "static": False}
#: fxopt and the modes likeliest to be best first: a budget that runs out skips the slowest
VARIANTS = ("fxopt", "reduce_overhead_freezing", "reduce_overhead", "inductor_freezing", "inductor")
#: BERT-base: hidden size, heads, MLP width, layers, vocabulary, positions
BERT_BASE = {"d": 768, "heads": 12, "ff": 3072, "layers": 12, "vocab": 30522, "positions": 512}
TINY = {"d": 64, "heads": 4, "ff": 256, "layers": 1, "vocab": 1000, "positions": 512}


class EncoderLayer(nn.Module):
    """A BERT layer: self-attention (SDPA), then the exact-GELU MLP, each post-norm residual."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.proj(attended))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class Encoder(nn.Module):
    """BERT's shape in plain torch modules (word + position embeddings, layer norm, layers),
    for machines without ``transformers``."""

    def __init__(self, d: int, heads: int, ff: int, layers: int, vocab: int, positions: int):
        super().__init__()
        self.words, self.positions = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.norm = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ff) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.words(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)))
        for layer in self.layers:
            x = layer(x)
        return x


def build_encoder(tiny: bool) -> tuple[nn.Module, int, str]:
    """The encoder (fp32, eval), its vocabulary size, and what it is."""
    torch.manual_seed(0)
    shape = TINY if tiny else BERT_BASE
    try:
        import transformers
    except ImportError:
        return Encoder(**shape).eval(), shape["vocab"], "fxopt bench Encoder (torch.nn, BERT's shape)"
    config = transformers.BertConfig(
        hidden_size=shape["d"], num_attention_heads=shape["heads"], intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], vocab_size=shape["vocab"], max_position_embeddings=shape["positions"])
    return (HiddenStates(transformers.BertModel(config)).eval(), shape["vocab"],
            f"transformers {transformers.__version__} BertModel")


def serve_one(variant: str, route: str, model: nn.Module, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``variant`` afresh, warm it up in serving order, time and check every length."""
    device, lengths = args.device, args.lengths

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (args.batch, length), device=device)

    torch._dynamo.reset()
    stats: dict[str, Any] = {}
    fn, context = make_variant(variant, model, stats, dynamic=ROUTES[route])
    entry: dict[str, Any] = {}
    with torch.no_grad(), context():
        memory = DeviceMemory(device).start()
        for length in lengths:  # serving order; the first call compiles, the second captures
            for call in ("first", "second"):
                ids = tokens(length)
                entry[f"{call}_call_s_{length}"] = wall_ms(lambda ids=ids: fn(ids), device, reps=1, warmup=0) / 1e3
        timed = {length: tokens(length) for length in lengths}
        samples = alternate(timed, args.rounds, lambda ids: call_ms(lambda: fn(ids), device))
        entry.update(memory.stop())
        for length, times in samples.items():
            entry[f"ms_{length}"], entry[f"ms_{length}_samples"] = median(times), times
            fresh = tokens(length)
            out = fn(fresh).float().clone()  # reduce-overhead's next call overwrites its output
            ref = model(fresh).float()
            entry[f"max_abs_{length}_vs_eager"] = (out - ref).abs().max().item()
            entry[f"rel_l2_{length}_vs_eager"] = rel_l2(out, ref)
        if args.profile_length in lengths and device == "cuda":
            entry["profile"] = profile_kernels(fn, (timed[args.profile_length],))
        entry["earlier_output_kept"] = earlier_output_kept(fn, tokens, lengths)
    entry.update(frozen_summary(variant, stats), **(fxopt_graphs(stats) if variant == "fxopt" else {}))
    return entry


def table(rows: list[dict[str, Any]], lengths: list[int]) -> str:
    lines = [f"ms per call (median of rounds) at sequence lengths {lengths} in serving order, after each was "
             "called twice; first = first call at that length (s); kept = an earlier output survives later calls"]
    for r in rows:
        lines.append(f"\n{r['model']} [{r['route']}]  fxopt vs best Inductor mode: " + ", ".join(
            f"s{n} {r[f'speedup_{n}']:.3f}x ({r[f'best_inductor_{n}']}"
            + (f"; upper bound: {len(r[f'modes_measured_{n}'])} of {len(INDUCTOR_MODES)} modes measured"
               if len(r[f"modes_measured_{n}"]) < len(INDUCTOR_MODES) else "") + ")"
            for n in lengths if f"speedup_{n}" in r))
        for variant in VARIANTS:
            v = r.get(variant)
            if not v:  # not in --variants
                continue
            if "error" in v:
                lines.append(f"  {variant:26s} ERROR {v['error'][:200]}")
                continue
            cells = [f"s{n} {v[f'ms_{n}']:.3f}" for n in lengths if f"ms_{n}" in v]
            cells.append("first " + "/".join(f"{v[f'first_call_s_{n}']:.1f}" for n in lengths
                                             if f"first_call_s_{n}" in v))
            cells.append("max abs " + "/".join(f"{v[f'max_abs_{n}_vs_eager']:.1e}" for n in lengths
                                               if f"max_abs_{n}_vs_eager" in v))
            cells.append(f"frozen {v.get('frozen', '-')}, graphs {v.get('graphs', '-')}")
            cells.append(f"kept {v.get('earlier_output_kept', '-')[:60]}")
            lines.append(f"  {variant:26s} " + " | ".join(cells))
    ratios = [r[f"speedup_{n}"] for r in rows for n in lengths if f"speedup_{n}" in r]
    if ratios:
        lines.append(f"\nall routes and lengths: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x, "
                     f"min {min(ratios):.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--routes", default="automatic", help=f"comma-separated: {', '.join(ROUTES)}")
    parser.add_argument("--lengths", default="128,384,256", help="sequence lengths, in serving order")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile-length", type=int, default=None,
                        help="profile every variant's kernels at this length (fxopt and the best mode are printed)")
    parser.add_argument("--tiny", dest="smoke", action="store_true", help="the old name of --smoke")
    parser.add_argument("--budget-s", type=float, default=300,
                        help="skip a variant when it would end past this many seconds (by the mean variant so far)")
    args = parser.parse_args(argv)
    args.device = cli.device_for(args)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    unknown = [r for r in args.routes.split(",") if r not in ROUTES]
    if unknown:
        parser.error(f"unknown route(s) {', '.join(unknown)}; known: {', '.join(ROUTES)}")
    model, vocab, what = build_encoder(args.smoke)
    model = model.to(args.device, torch.float32 if args.smoke else torch.bfloat16)
    record = Record("serving_seq", args, args.device, model=what)
    started = time.perf_counter()
    durations: list[float] = []
    # every variant and length is one more cache entry on the encoder's forward (static route)
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)), \
            cpu_threads(1 if args.smoke else None):  # tiny matrices: threads cost more than they save
        for route in args.routes.split(","):
            row = record.add({"model": "bert_base", "route": route, "batch": args.batch, "lengths": args.lengths})
            for variant in args.variants.split(","):
                elapsed = time.perf_counter() - started
                expected = sum(durations) / len(durations) if durations else 0.0
                if elapsed + expected > args.budget_s:
                    row[variant] = {"error": f"skipped: {elapsed:.0f}s spent, a variant takes ~{expected:.0f}s, "
                                             f"budget {args.budget_s:.0f}s"}
                else:
                    try:
                        row[variant] = serve_one(variant, route, model, vocab, args)
                    except Exception as exc:  # one broken variant must not lose the other numbers
                        row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                    durations.append(time.perf_counter() - started - elapsed)
                    row[variant]["variant_s"] = durations[-1]
                print(f"[{route}] {variant}: {json.dumps({k: v for k, v in row[variant].items() if k != 'profile'})}",
                      flush=True)
                summarize(row, args.lengths)
                record.save()
            if args.profile_length is not None and f"best_inductor_{args.profile_length}" in row:
                chosen = ("fxopt", row[f"best_inductor_{args.profile_length}"])
                print(profile_text(f"bert_base [{route}] s{args.profile_length}",
                                   {v: row[v]["profile"] for v in chosen if "profile" in row[v]}), flush=True)
    print(f"\n{record.meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table(record.rows, args.lengths))
    return record.data


if __name__ == "__main__":
    main()
