"""Training benchmark for a BERT-base encoder at varying sequence lengths (bf16, one GPU).

A masked-language-model training step (encoder, a linear head over the vocabulary, cross
entropy, backward, AdamW) on BERT-base (Hugging Face ``BertModel`` from a randomly
initialized ``BertConfig()`` with ``attn_implementation="sdpa"`` where ``transformers`` is
installed, else :class:`Encoder`, plain torch modules of the same shape), batch 8, with a
padding mask (each sequence keeps a random 50-100% of its tokens), called at lengths 128,
384, 256 in that order, each its real size. Each length runs three steps before timing
(compile, recompile with a symbolic length, CUDA-graph recording); then each length is
timed over interleaved rounds (median of ``--steps`` synchronized steps per round).

Attention dropout is 0 by default (``--attention-dropout``; the rest of BERT's dropout stays
0.1): fxopt's ``defer_sdpa_choice`` leaves an SDPA call with dropout to the compiler, since
its op's backward recomputes the forward and could not draw the same dropout mask again.
Run with ``--attention-dropout 0.1`` to measure BERT's own configuration.

Variants: fxopt (default options) and every Inductor mode (default, reduce-overhead,
max-autotune-no-cudagraphs, max-autotune), each compiled afresh after
``torch._dynamo.reset()`` on a fresh copy of the same initial weights, through Dynamo's
automatic dynamic shapes (``dynamic=None``, what users get) or ``--dynamic true``. Per length:
ms per step, fxopt against the best Inductor mode; per variant: peak reserved memory, the
losses of the warm-up steps, and for fxopt how many training graphs call
``torch.ops.fxopt.sdpa`` and what fell back.

    python bench/varlen_training.py --out $OUT/varlen_training.json
    python bench/varlen_training.py --variants fxopt,inductor,inductor-ro --out $OUT/vt.json
    python bench/varlen_training.py --smoke            # CPU, tiny encoder: checks the logic

The JSON is rewritten after every variant; a variant that fails is a row saying why, and one
that would end past ``--budget-s`` is skipped (run the rest in another command).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("fxopt", "fxopt-torch-attention", "inductor", "inductor-ro", "inductor-max-autotune-no-cudagraphs", "inductor-max-autotune")
MODES = {"inductor": None, "inductor-ro": "reduce-overhead",
         "inductor-max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs", "inductor-max-autotune": "max-autotune"}
#: BERT-base: hidden size, heads, MLP width, layers, vocabulary, positions
BERT_BASE = {"d": 768, "heads": 12, "ff": 3072, "layers": 12, "vocab": 30522, "positions": 512}
TINY = {"d": 32, "heads": 2, "ff": 64, "layers": 1, "vocab": 100, "positions": 512}


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


def compiled(variant: str, step: Callable, reports: list, dynamic: bool | None) -> Callable:
    if variant in ("fxopt", "fxopt-torch-attention"):  # the second: training graphs keep torch's SDPA
        import fxopt

        options = {"reports": reports, "sdpa_in_training": variant == "fxopt"}
        return fxopt.compile(step, options=options, dynamic=dynamic)
    if variant not in MODES:
        raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    return torch.compile(step, mode=MODES[variant], dynamic=dynamic)


def batch(length: int, vocab: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Tokens, a padding mask keeping each sequence's first 50-100% of tokens, and labels."""
    ids = torch.randint(0, vocab, (args.batch, length), device=args.device)
    kept = torch.randint(length // 2, length + 1, (args.batch, 1), device=args.device)
    keep = torch.arange(length, device=args.device) < kept
    return ids, keep, torch.randint(0, vocab, (args.batch, length), device=args.device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_one(variant: str, base: nn.Module, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``variant`` afresh, warm it up in length order, time every length."""
    torch._dynamo.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(base)
    reports: list = []
    fn = compiled(variant, make_step(model), reports, args.dynamic)
    entry: dict[str, Any] = {"losses": []}
    batches = {length: batch(length, vocab, args) for length in args.lengths}
    for length in args.lengths:  # compile, recompile with a symbolic length, record CUDA graphs
        for _ in range(3):
            sync(args.device)
            began = time.perf_counter()
            entry["losses"].append(fn(*batches[length]).item())  # .item(): RO overwrites its output
            entry.setdefault(f"warmup_s_{length}", []).append(time.perf_counter() - began)
    samples: dict[int, list[float]] = {length: [] for length in args.lengths}
    for _ in range(args.rounds):
        for length in args.lengths:
            sync(args.device)
            began = time.perf_counter()
            for _ in range(args.steps):
                fn(*batches[length])
            sync(args.device)
            samples[length].append((time.perf_counter() - began) / args.steps * 1e3)
    for length in args.lengths:
        entry[f"ms_{length}"] = statistics.median(samples[length])
        entry[f"ms_{length}_samples"] = samples[length]
    if args.device == "cuda":
        entry["peak_reserved_MB"] = torch.cuda.max_memory_reserved() / 1e6
    if variant == "fxopt":
        training = [r for r in reports if r.training]
        entry["training_graphs"] = len(training)
        entry["training_graphs_with_fxopt_sdpa"] = sum("torch.ops.fxopt.sdpa.default" in r.code for r in training)
        entry["fallbacks"] = [r.fallback for r in reports if r.fallback]
        entry["no_replay"] = [r.no_replay for r in reports if r.no_replay]
    return entry


def summarize(row: dict[str, Any], lengths: list[int]) -> None:
    """fxopt against the best Inductor mode that ran, per length."""
    for length in lengths:
        modes = {v: row[v][f"ms_{length}"] for v in MODES if f"ms_{length}" in row.get(v, {})}
        if modes and f"ms_{length}" in row.get("fxopt", {}):
            best = min(modes, key=modes.get)
            row[f"best_inductor_{length}"] = best
            row[f"speedup_{length}"] = modes[best] / row["fxopt"][f"ms_{length}"]


def table(row: dict[str, Any], lengths: list[int]) -> str:
    lines = ["| variant | " + " | ".join(f"ms at {n}" for n in lengths) + " | peak reserved MB |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for variant in VARIANTS:
        entry = row.get(variant)
        if entry is None:
            continue
        if "error" in entry:
            lines.append(f"| {variant} | {entry['error'][:120]} |")
            continue
        times = " | ".join(f"{entry[f'ms_{n}']:.2f}" for n in lengths)
        lines.append(f"| {variant} | {times} | {entry.get('peak_reserved_MB', float('nan')):.0f} |")
    ratios = [f"{n}: {row[f'speedup_{n}']:.3f}x vs {row[f'best_inductor_{n}']}" for n in lengths
              if f"speedup_{n}" in row]
    return "\n".join(lines) + ("\n\nfxopt against the best Inductor mode: " + ", ".join(ratios) if ratios else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=None, help="sequence lengths, in order (default 128,384,256)")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (2 with --smoke)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)} "
                                                         "(default all; fxopt,inductor with --smoke)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--dynamic", choices=("auto", "true"), default="auto",
                        help="auto: Dynamo's automatic dynamic shapes (dynamic=None); true: dynamic=True")
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip a variant when it would end past this many seconds, by the mean variant so far "
                             "(default 270; none with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny encoder: check the script's logic")
    parser.add_argument("--out", default=os.path.join(os.environ["OUT"], "varlen_training.json")
                        if os.environ.get("OUT") else None)
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.lengths = [int(n) for n in (args.lengths or ("16,48,32" if args.smoke else "128,384,256")).split(",")]
    args.batch = args.batch or (2 if args.smoke else 8)
    if args.budget_s is None:
        args.budget_s = float("inf") if args.smoke else 270.0
    if args.smoke:
        args.rounds, args.steps = min(args.rounds, 2), min(args.steps, 2)
    variants = (args.variants or ("fxopt,inductor" if args.smoke else ",".join(VARIANTS))).split(",")
    args.dynamic = None if args.dynamic == "auto" else True
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, vocab, what = build(args.smoke, args.attention_dropout)
    model = model.to(args.device, torch.float32 if args.smoke else torch.bfloat16)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "model": what, "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))}}
    started = time.perf_counter()
    row: dict[str, Any] = {"model": "bert_base_mlm", "batch": args.batch, "lengths": args.lengths}
    durations: list[float] = []
    for variant in variants:
        began = time.perf_counter()
        expected = statistics.mean(durations) if durations else 0.0
        if began - started + expected > args.budget_s:
            row[variant] = {"error": f"skipped: {began - started:.0f}s spent, a variant takes ~{expected:.0f}s, "
                                     f"budget {args.budget_s:.0f}s"}
        else:
            try:
                row[variant] = train_one(variant, model, vocab, args)
            except Exception as exc:  # one broken variant must not lose the other numbers
                row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            durations.append(time.perf_counter() - began)
            row[variant]["variant_s"] = durations[-1]
        print(f"{variant}: {json.dumps(row[variant])}", flush=True)
        summarize(row, args.lengths)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "row": row, "elapsed_s": time.perf_counter() - started}, f, indent=1)
    print(f"\n{meta}  total {time.perf_counter() - started:.0f}s\n")
    print(table(row, args.lengths))


if __name__ == "__main__":
    main()
