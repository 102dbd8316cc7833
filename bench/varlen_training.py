"""Training benchmark for a BERT-base encoder at varying sequence lengths (bf16, one GPU).

A masked-language-model training step (encoder, a linear head over the vocabulary, cross
entropy, backward, AdamW) on BERT-base (Hugging Face ``BertModel`` from a randomly
initialized ``BertConfig()`` with ``attn_implementation="sdpa"`` where ``transformers`` is
installed, else :class:`Encoder`, plain torch modules of the same shape), batch 8, with a
padding mask (each sequence keeps a random 50-100% of its tokens), called at lengths 128,
384, 256 in that order, each its real size. Each length runs three steps before timing
(compile, recompile with a symbolic length, CUDA-graph recording; each timed on the harness's
``wall_ms``); then the lengths are timed over interleaved rounds (the harness's
``alternate``: per round and length, ``loop_ms`` of ``--steps`` steps back to back).

Attention dropout is 0 by default (``--attention-dropout``; the rest of BERT's dropout stays
0.1): fxopt's ``defer_sdpa_choice`` leaves an SDPA call with dropout to the compiler, since
its op's backward recomputes the forward and could not draw the same dropout mask again.
Run with ``--attention-dropout 0.1`` to measure BERT's own configuration.

Variants: fxopt (default options) and every Inductor mode a training step can use: the
harness's ``INDUCTOR_MODES`` without freezing (default, ``reduce_overhead``; Inductor
freezes inference graphs only, so with grad on the freezing modes are these two again) and
the max-autotune modes (``max_autotune_no_cudagraphs``, ``max_autotune``), each compiled
afresh after ``torch._dynamo.reset()`` on a fresh copy of the same initial weights, through
Dynamo's automatic dynamic shapes (``dynamic=None``, what users get) or ``--dynamic true``;
on request ``eager`` (the step uncompiled) and ``fxopt_sdpa_training`` (fxopt with
``sdpa_in_training=True``, the lever that default leaves off). One row per variant: ms per step at each length, peak reserved and allocated memory from
before the weights are copied (the harness's ``DeviceMemory``), the losses of the warm-up
steps, and for fxopt how many training graphs call ``torch.ops.fxopt.sdpa`` and what fell
back; per length, fxopt against the best Inductor mode (``speedup``).

    python bench/varlen_training.py --out $OUT/varlen_training.json
    python bench/varlen_training.py --variants fxopt,inductor,reduce_overhead --out $OUT/vt.json
    python bench/varlen_training.py --smoke            # CPU, tiny encoder, eager: checks the logic (CI)
    python bench/varlen_training.py --smoke --variants fxopt,inductor   # the compiled path too (a minute)

The record is rewritten after every variant; a variant that fails is a row saying why, and one
that would end past ``--budget-s`` is skipped (run the rest in another command).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import (
    INDUCTOR_MODES,
    DeviceMemory,
    Record,
    alternate,
    cli,
    inductor_variant,
    loop_ms,
    markdown_table,
    median,
    observed_inductor,
    wall_ms,
)

import fxopt

#: torch.compile's max-autotune modes, by variant name
AUTOTUNE = {"max_autotune_no_cudagraphs": "max-autotune-no-cudagraphs", "max_autotune": "max-autotune"}
#: the Inductor modes of a training step: freezing only changes inference graphs
MODES = (*(m for m in INDUCTOR_MODES if "freezing" not in m), *AUTOTUNE)
#: the default variants; on request, ``eager`` (the step uncompiled; alone under --smoke) and
#: ``fxopt_sdpa_training`` (``sdpa_in_training=True``: fxopt.sdpa in the training graphs)
VARIANTS = ("fxopt", *MODES)
EXTRA = ("eager", "fxopt_sdpa_training")
#: BERT-base: hidden size, heads, MLP width, layers, vocabulary, positions
BERT_BASE = {"d": 768, "heads": 12, "ff": 3072, "layers": 12, "vocab": 30522, "positions": 512}
TINY = {"d": 32, "heads": 2, "ff": 64, "layers": 1, "vocab": 100, "positions": 512}
#: steps per length before timing: compile, recompile with a symbolic length, CUDA-graph recording
WARMUP_STEPS = 3


class EncoderLayer(nn.Module):
    """A BERT layer: masked self-attention (SDPA), then the exact-GELU MLP, each post-norm
    residual with dropout."""

    def __init__(self, d: int, heads: int, ff: int, attention_dropout: float):
        super().__init__()
        self.heads, self.attention_dropout = heads, attention_dropout
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.attention_dropout if self.training else 0.0)
        x = self.ln1(x + self.dropout(self.proj(attended.transpose(1, 2).reshape(b, s, d))))
        return self.ln2(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


class Encoder(nn.Module):
    """BERT's shape in plain torch modules, for machines without ``transformers``; the padding
    mask is broadcast over the queries, as Hugging Face's is."""

    def __init__(self, d: int, heads: int, ff: int, layers: int, vocab: int, positions: int,
                 attention_dropout: float):
        super().__init__()
        self.words, self.positions = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.norm = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ff, attention_dropout) for _ in range(layers))

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        mask = keep.view(b, 1, 1, s).expand(b, 1, s, s)
        x = self.norm(self.words(ids) + self.positions(torch.arange(s, device=ids.device)))
        for layer in self.layers:
            x = layer(x, mask)
        return x


class MaskedLM(nn.Module):
    """An encoder and a linear head over the vocabulary."""

    def __init__(self, encoder: nn.Module, d: int, vocab: int, hugging_face: bool):
        super().__init__()
        self.encoder, self.head, self.hugging_face = encoder, nn.Linear(d, vocab), hugging_face

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.hugging_face:
            return self.head(self.encoder(input_ids=ids, attention_mask=keep.long()).last_hidden_state)
        return self.head(self.encoder(ids, keep))


def build(smoke: bool, attention_dropout: float) -> tuple[nn.Module, int, str]:
    """The model (fp32, training mode, seed 0), its vocabulary size, and what it is."""
    torch.manual_seed(0)
    shape = TINY if smoke else BERT_BASE
    try:
        import transformers
    except ImportError:
        encoder = Encoder(**shape, attention_dropout=attention_dropout)
        return MaskedLM(encoder, shape["d"], shape["vocab"], False).train(), shape["vocab"], \
            "fxopt bench Encoder (torch.nn, BERT's shape)"
    config = transformers.BertConfig(
        hidden_size=shape["d"], num_attention_heads=shape["heads"], intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], vocab_size=shape["vocab"], max_position_embeddings=shape["positions"],
        attention_probs_dropout_prob=attention_dropout, attn_implementation="sdpa")
    encoder = transformers.BertModel(config, add_pooling_layer=False)
    return MaskedLM(encoder, shape["d"], shape["vocab"], True).train(), shape["vocab"], \
        f"transformers {transformers.__version__} BertModel"


def make_step(model: nn.Module) -> Callable:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # optimizer state made up front: made inside the first compiled step, reduce-overhead
    # leaves it in its CUDA-graph pool
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def step(ids: torch.Tensor, keep: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(ids, keep).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def compiled(variant: str, step: Callable, stats: dict[str, Any], dynamic: bool | None
             ) -> tuple[Callable, Callable[[], contextlib.AbstractContextManager]]:
    """``step`` compiled as ``variant``, and the context its calls run in; what it compiles
    goes to ``stats`` (``graphs``: Inductor's, ``reports``: fxopt's)."""
    if variant == "eager":
        return step, contextlib.nullcontext
    if variant in ("fxopt", "fxopt_sdpa_training"):
        options = {"reports": stats.setdefault("reports", []), "sdpa_in_training": variant == "fxopt_sdpa_training"}
        return fxopt.compile(step, options=options, dynamic=dynamic), contextlib.nullcontext
    if variant in AUTOTUNE:
        return observed_inductor(step, stats, dynamic, mode=AUTOTUNE[variant])
    return inductor_variant(variant, step, stats, dynamic)


def batch(length: int, vocab: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Tokens, a padding mask keeping each sequence's first 50-100% of tokens, and labels."""
    ids = torch.randint(0, vocab, (args.batch, length), device=args.device)
    kept = torch.randint(length // 2, length + 1, (args.batch, 1), device=args.device)
    keep = torch.arange(length, device=args.device) < kept
    return ids, keep, torch.randint(0, vocab, (args.batch, length), device=args.device)


def warm_up(fn: Callable, inputs: tuple[torch.Tensor, ...], device: str) -> tuple[list[float], list[float]]:
    """Seconds and losses of the first steps at one length (``.item()``: reduce-overhead
    overwrites its output at the next step)."""
    losses: list[float] = []
    seconds = [wall_ms(lambda: losses.append(fn(*inputs).item()), device, reps=1, warmup=0) / 1e3
               for _ in range(WARMUP_STEPS)]
    return seconds, losses


def fxopt_graphs(reports: list) -> dict[str, Any]:
    """What fxopt's backend did with the training graphs: SDPA's run-time choice, fallbacks."""
    training = [r for r in reports if r.training]
    return {"training_graphs": len(training),
            "training_graphs_with_fxopt_sdpa": sum("torch.ops.fxopt.sdpa.default" in r.code for r in training),
            "fallbacks": [r.fallback for r in reports if r.fallback],
            "no_replay": [r.no_replay for r in reports if r.no_replay]}


def train_one(variant: str, base: nn.Module, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``variant`` afresh, warm it up in length order, time every length."""
    torch._dynamo.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    memory = DeviceMemory(args.device).start()
    model = copy.deepcopy(base)
    stats: dict[str, Any] = {}
    fn, context = compiled(variant, make_step(model), stats, args.dynamic)
    batches = {length: batch(length, vocab, args) for length in args.lengths}
    row: dict[str, Any] = {"variant": variant, "losses": []}
    with context():
        for length in args.lengths:
            row[f"warmup_s_{length}"], losses = warm_up(fn, batches[length], args.device)
            row["losses"] += losses
        samples = alternate({length: functools.partial(fn, *batches[length]) for length in args.lengths},
                            args.rounds, lambda call: loop_ms(call, args.device, iters=args.steps, reps=1, warmup=0))
    row.update(memory.stop())
    for length in args.lengths:
        row[f"ms_{length}"] = median(samples[length])
        row[f"ms_{length}_samples"] = samples[length]
    row["graphs"] = len(stats.get("graphs", stats.get("reports", [])))  # recompiles included
    if variant == "fxopt":
        row.update(fxopt_graphs(stats["reports"]))
    return row


def speedups(rows: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """fxopt against the best Inductor mode that ran, per length."""
    by_variant = {r["variant"]: r for r in rows}
    out = {}
    for length in lengths:
        key = f"ms_{length}"
        modes = {v: by_variant[v][key] for v in MODES if key in by_variant.get(v, {})}
        if modes and key in by_variant.get("fxopt", {}):
            best = min(modes, key=modes.get)
            out[str(length)] = {"best_inductor": best, "speedup": modes[best] / by_variant["fxopt"][key],
                                "modes_measured": sorted(modes)}
    return out


def run_variants(variants: list[str], model: nn.Module, vocab: int, args: argparse.Namespace,
                 record: Record) -> None:
    """Each variant a row of ``record`` (saved after each), skipped when it would end past
    ``--budget-s`` by the mean variant so far."""
    durations: list[float] = []
    for variant in variants:
        began = time.perf_counter()
        expected = statistics.mean(durations) if durations else 0.0
        spent = began - record.started
        if spent + expected > args.budget_s:
            row = {"variant": variant, "error": f"skipped: {spent:.0f}s spent, a variant takes ~{expected:.0f}s, "
                                                f"budget {args.budget_s:.0f}s"}
        else:
            try:
                row = train_one(variant, model, vocab, args)
            except Exception as exc:  # one broken variant must not lose the other numbers
                row = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            durations.append(time.perf_counter() - began)
            row["variant_s"] = durations[-1]
        record.rows.append(row)
        record.extra["speedup"] = speedups(record.rows, args.lengths)
        record.save()
        print(f"{variant}: {row.get('error') or {k: row[k] for k in row if k.startswith('ms_') and 'samples' not in k}}",
              flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=5)
    parser.add_argument("--lengths", default=None, help="sequence lengths, in order (default 128,384,256)")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (2 with --smoke)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)} and eager "
                                                         "(default all but eager; eager with --smoke)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--dynamic", choices=("auto", "true"), default="auto",
                        help="auto: Dynamo's automatic dynamic shapes (dynamic=None); true: dynamic=True")
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip a variant when it would end past this many seconds, by the mean variant so far "
                             "(default 270; none with --smoke)")
    args = parser.parse_args(argv)
    args.device = cli.device_for(args)
    args.lengths = [int(n) for n in (args.lengths or ("16,48,32" if args.smoke else "128,384,256")).split(",")]
    args.batch = args.batch or (2 if args.smoke else 8)
    if args.budget_s is None:
        args.budget_s = float("inf") if args.smoke else 270.0
    if args.smoke:
        args.rounds, args.steps = min(args.rounds, 2), min(args.steps, 2)
    variants = (args.variants or ("eager" if args.smoke else ",".join(VARIANTS))).split(",")
    unknown = [v for v in variants if v not in (*VARIANTS, *EXTRA)]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join((*VARIANTS, *EXTRA))}")
    args.dynamic = None if args.dynamic == "auto" else True
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, vocab, what = build(args.smoke, args.attention_dropout)
    model = model.to(args.device, torch.float32 if args.smoke else torch.bfloat16)
    record = Record("varlen_training", args, args.device, model=what, workload="bert_base_mlm", lengths=args.lengths)
    run_variants(variants, model, vocab, args, record)
    print(f"\n{record.meta['device']}, torch {record.meta['torch']}, {what}; total {record.data['elapsed_s']:.0f}s\n")
    print(markdown_table(record.rows, ["variant", *(f"ms_{n}" for n in args.lengths), "peak_reserved_MB", "error"], digits=2))
    ratios = [f"{n}: {s['speedup']:.3f}x vs {s['best_inductor']}" for n, s in record.extra["speedup"].items()]
    if ratios:
        print("\nfxopt against the best Inductor mode: " + ", ".join(ratios))
    return record.data


if __name__ == "__main__":
    main()
