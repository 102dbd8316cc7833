"""A small transformer trained on several GPUs of one host through fxopt's backend vs Inductor.

Launched with torchrun, one process per GPU:

    torchrun --nproc_per_node 2 bench/distributed.py --out $OUT

Wrappings: ``ddp`` (DistributedDataParallel; Dynamo's DDPOptimizer splits each graph at the
gradient buckets), ``fsdp-block`` (FSDP2 ``fully_shard`` on every block, then the root) and
``fsdp-model`` (``fully_shard`` on the whole model). The model is compiled (Dynamo graph-breaks
at FSDP2's hooks, which run eagerly); the loss, backward and AdamW step run as written. Per
wrapping and compiler: step time (best of ``--repeats`` loops of ``--steps`` steps), peak memory
(``torch.cuda.max_memory_allocated``, the larger of the ranks, reset after the first call;
reserved: ``max_memory_reserved`` from before the model is built, compilation included), first
call, the losses (every rank sees its own batch; the mean over ranks is compared), and what the
backend did with each graph. ``--device cpu`` runs the same with gloo on the CPU;
``--smoke`` also shrinks the model to run in seconds (CI); without torchrun, one process is a
group of one. Rank 0 writes the record to ``--out`` (a file, or a folder to put
``distributed.json`` in; default ``bench/results/<gpu>x<n>/distributed.json``).

    python bench/distributed.py --smoke --compilers eager,fxopt-plain     # CPU, one process
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import DeviceMemory, Record, cli, sync

# bench/ is on sys.path when run as a script (torchrun runs it so): the block training.py measures
from training import DecoderBlock

import fxopt


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def wrap(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    if how == "fsdp-block":
        for block in model.blocks:
            fully_shard(block)
    elif how != "fsdp-model":
        raise SystemExit(f"unknown wrapping {how!r}")
    return fully_shard(model)


def compile_with(compiler: str, model: nn.Module, reports: list) -> nn.Module:
    if compiler == "eager":
        return model
    if compiler == "inductor":
        return torch.compile(model)
    if compiler == "inductor-ro":
        return torch.compile(model, mode="reduce-overhead")
    if compiler == "fxopt":
        return fxopt.compile(model, options={"reports": reports})
    if compiler == "fxopt-plain":
        return fxopt.compile(model, options={"reports": reports, "cuda_graphs": False})
    raise SystemExit(f"unknown compiler {compiler!r}")


def run(how: str, compiler: str, base: nn.Module, batches: list, device: torch.device,
        args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    compile_memory = DeviceMemory(device).start()  # the variant's reserved peak counts from here
    model = wrap(copy.deepcopy(base).to(device), how, device)
    reports: list = []
    fn = compile_with(compiler, model, reports)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = fn(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    row: dict[str, Any] = {"wrapping": how, "compiler": compiler}
    sync(device)
    began = time.perf_counter()
    losses = [step(*batches[0]).clone()]
    sync(device)
    row["first_call_s"] = time.perf_counter() - began
    # after compiling, before any CUDA-graph recording (see training.py)
    compiled_peaks = compile_memory.stop()
    step_memory = DeviceMemory(device).start()
    for i in range(1, args.warmup):
        losses.append(step(*batches[i % len(batches)]).clone())
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        sync(device)
        began = time.perf_counter()
        for i in range(args.steps):
            losses.append(step(*batches[i % len(batches)]).clone())
        sync(device)
        times.append((time.perf_counter() - began) / args.steps)
    # the slowest rank sets the step; the fullest sets the memory
    step_peaks = step_memory.stop()
    stats = torch.tensor([min(times), statistics.median(times), step_peaks.get("peak_allocated_MB", 0.0),
                          max(compiled_peaks.get("peak_reserved_MB", 0.0), step_peaks.get("peak_reserved_MB", 0.0))],
                         device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    mean_losses = torch.stack(losses[: args.warmup + args.steps]).float()
    dist.all_reduce(mean_losses)
    row.update({"step_ms": float(stats[0]) * 1e3, "step_ms_median": float(stats[1]) * 1e3,
                "peak_MB": float(stats[2]), "reserved_MB": float(stats[3]), "losses": (mean_losses / dist.get_world_size()).tolist()})
    row["graphs"] = [{"name": r.name, "training": r.training, "no_replay": r.no_replay,
                      "fallback": r.fallback} for r in reports]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--wrappings", default="ddp,fsdp-block,fsdp-model")
    parser.add_argument("--compilers", default="inductor,inductor-ro,fxopt,fxopt-plain")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(layers=1, dim=32, heads=2, vocab=64, batch=2, seq=8, steps=2, repeats=1, warmup=1)
    args.device = cli.device_for(args)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    alone = {} if "RANK" in os.environ else {"init_method": f"tcp://127.0.0.1:{_free_port()}", "rank": 0,
                                             "world_size": 1}  # no torchrun: a group of one
    if args.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        # a variant that fails on one rank only must not hang the others for NCCL's 10 minutes
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120), **alone)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300), **alone)
    try:
        return measure(args, device)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every wrapping x compiler on this rank; rank 0 records and prints."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Transformer(args.vocab, args.dim, args.layers, args.heads)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [tuple(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
                     for _ in range(2)) for _ in range(4)]
    record = Record("distributed", args, device.type, gpus=dist.get_world_size() if device.type == "cuda" else 1,
                    ranks=dist.get_world_size(),
                    workload=f"transformer {args.layers} layers d{args.dim} batch {args.batch}/rank "
                             f"seq {args.seq} vocab {args.vocab}, AdamW, {'bf16 autocast' if args.bf16 else 'fp32'}")
    for how in args.wrappings.split(","):
        for compiler in args.compilers.split(","):
            try:
                row = run(how, compiler, base, batches, device, args)
            except Exception as exc:  # noqa: BLE001 - a failed variant is a row saying why
                row = {"wrapping": how, "compiler": compiler, "error": f"{type(exc).__name__}: {exc}"[:500]}
            record.add(row, save=rank == 0)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "graphs")}), flush=True)
    if rank == 0:
        print(f"\n{record.meta['ranks']} x {record.meta['device']}, torch {record.meta['torch']}, "
              f"{record.meta['workload']}")
        print(table(record.rows, args.wrappings.split(",")))
    return record.data


def table(rows: list[dict[str, Any]], wrappings: list[str]) -> str:
    """Per wrapping: each compiler's step, its ratio to the best Inductor mode, memory, losses."""
    lines = [f"{'wrapping':11} {'compiler':12} {'step ms':>8} {'vs best Ind.':>12} {'peak MB':>8} {'resv MB':>8} "
             f"{'first s':>8} {'max |dloss|':>11}  graphs"]
    for how in wrappings:
        mine = [r for r in rows if r["wrapping"] == how]
        best = min((r["step_ms"] for r in mine if "step_ms" in r and r["compiler"].startswith("inductor")),
                   default=float("nan"))
        ref = next((r["losses"] for r in mine if r["compiler"] == "inductor" and "losses" in r), None)
        for r in mine:
            if "step_ms" not in r:
                lines.append(f"{how:11} {r['compiler']:12} error: {r['error']}")
                continue
            dloss = max(abs(a - b) for a, b in zip(r["losses"], ref)) if ref else float("nan")
            graphs = "; ".join(f"{g['name']}: {g['no_replay'] or 'replayed'}"
                               + (f" FALLBACK {g['fallback']}" if g["fallback"] else "") for g in r["graphs"])
            lines.append(f"{how:11} {r['compiler']:12} {r['step_ms']:8.2f} {best / r['step_ms']:11.2f}x "
                         f"{r['peak_MB']:8.0f} {r['reserved_MB']:8.0f} {r['first_call_s']:8.1f} {dloss:11.2e}  "
                         f"{graphs[:300]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
