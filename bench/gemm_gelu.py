"""Linear + exact GELU on the GPU: cuBLAS + a GELU kernel, Inductor, and fxopt.compile.gemm_gelu.

For each shape of issue #30 (ConvNeXt-T's four MLP fc1 at batch 32, ViT-B/16's at batch 32,
BERT-base's at batch 8 x 128/256/384 tokens; bf16, with bias), in ms:

- ``eager``: ``F.gelu(F.linear(x, w, b))``, cuBLAS with its bias epilogue, then a GELU kernel;
- ``inductor``: ``torch.compile`` of that function, default mode (an extern mm, then one
  Triton kernel for bias + GELU);
- each Triton configuration of ``gemm_gelu.candidate_configs``;
- ``op``: ``torch.ops.fxopt.linear_gelu``, the measured choice (named in ``choice``).

Every figure is the median GPU time of one call, timed as the op times its candidates
(``timing.time_ms``: the stream sleeps while the host enqueues, so host launch costs are
not counted); ``op_loop`` and ``inductor_loop`` are back-to-back loops of calls, host
included. ``err`` is each kernel's largest deviation from the fp32 computation on the same
operands. Prints a table; the JSON goes to ``--out`` (default ``bench/results/<gpu>/gemm_gelu.json``).

    python bench/gemm_gelu.py --out gemm_gelu.json          # on the GPU machine, < 90 s
    python bench/gemm_gelu.py --smoke                       # CPU, one tiny shape, no Triton configs (CI)
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from harness import Record, call_ms, cli, loop_ms

import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.linear_gelu
from fxopt.compile import gemm_gelu, timing

#: name -> (M, K, N)
SHAPES = {
    "convnext_s1": (32 * 56 * 56, 96, 384),
    "convnext_s2": (32 * 28 * 28, 192, 768),
    "convnext_s3": (32 * 14 * 14, 384, 1536),
    "convnext_s4": (32 * 7 * 7, 768, 3072),
    "vit_b16": (32 * 197, 768, 3072),
    "bert_128": (8 * 128, 768, 3072),
    "bert_256": (8 * 256, 768, 3072),
    "bert_384": (8 * 384, 768, 3072),
}
#: ``--smoke``: the same code paths on a CPU
SMOKE_SHAPE = ("tiny", (64, 32, 128))


def max_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return (y.float() - expected).abs().max().item()


def measure(name: str, m: int, k: int, n: int, dtype: torch.dtype, reps: int, device: torch.device) -> dict[str, Any]:
    """One shape's row. On a GPU every figure is timed as the op times its candidates
    (``timing.time_ms``), so the op's choice and the table agree; on a CPU (``--smoke``)
    by the harness, and the Triton configurations are not tried."""
    cuda = device.type == "cuda"
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device, dtype=dtype)
    expected = F.gelu(F.linear(x.float(), w.float(), b.float()))
    gpu = (lambda fn: timing.time_ms(fn, device, reps)) if cuda else (lambda fn: call_ms(fn, "cpu"))  # noqa: E731
    row: dict[str, Any] = {"shape": name, "M": m, "K": k, "N": n, "dtype": str(dtype).removeprefix("torch.")}

    row["eager"] = gpu(lambda: gemm_gelu.reference(x, w, b))
    torch._dynamo.reset()  # one code object compiled per shape: stay clear of Dynamo's recompile limit
    compiled = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    t0 = time.perf_counter()
    row["inductor_err"] = max_error(compiled(x, w, b), expected)
    row["inductor_compile_s"] = time.perf_counter() - t0
    row["inductor"] = gpu(lambda: compiled(x, w, b))
    row["inductor_loop"] = loop_ms(lambda: compiled(x, w, b), device.type, reps=1)

    row["configs"] = {}
    for config in gemm_gelu.candidate_configs(n, k) if cuda else ():
        try:
            err = max_error(gemm_gelu.run_config(x, w, b, config), expected)
            row["configs"][str(config)] = {"ms": gpu(lambda c=config: gemm_gelu.run_config(x, w, b, c)), "err": err}
        except Exception as exc:  # a configuration this GPU cannot run: recorded, not fatal
            row["configs"][str(config)] = {"ms": None, "error": f"{type(exc).__name__}: {exc}"[:200]}

    op = torch.ops.fxopt.linear_gelu
    row["op_err"] = max_error(op(x, w, b), expected)  # the first call decides
    decision = gemm_gelu.decisions().get(gemm_gelu.decision_key(x, w, b))  # none where the kernel does not apply
    row["choice"] = str(decision.choice) if decision else "reference (no kernel here)"
    row["decision_timings"] = decision.timings if decision else {}
    row["op"] = gpu(lambda: op(x, w, b))
    row["op_loop"] = loop_ms(lambda: op(x, w, b), device.type, reps=1)
    best_ours = min([c["ms"] for c in row["configs"].values() if c["ms"] is not None], default=float("inf"))
    row["best_config_vs_inductor"] = row["inductor"] / best_ours if row["configs"] else None
    row["op_vs_inductor"] = row["inductor"] / row["op"]
    row["op_vs_eager"] = row["eager"] / row["op"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':<12} {'M':>6} {'K':>4} {'N':>5} {'eager':>7} {'induct':>7} {'best cfg':>8} "
             f"{'op':>7} {'op/ind':>6} {'op loop':>7} {'ind loop':>8}  choice"]
    for r in rows:
        best = min((c["ms"] for c in r["configs"].values() if c["ms"] is not None), default=float("nan"))
        lines.append(f"{r['shape']:<12} {r['M']:>6} {r['K']:>4} {r['N']:>5} {r['eager']:>7.4f} "
                     f"{r['inductor']:>7.4f} {best:>8.4f} {r['op']:>7.4f} {r['op_vs_inductor']:>5.2f}x "
                     f"{r['op_loop']:>7.4f} {r['inductor_loop']:>8.4f}  {r['choice']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of: " + ", ".join(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=15, help="timed runs per figure (median)")
    args = parser.parse_args(argv)
    device = torch.device(cli.device_for(args))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(1, "bench/gemm_gelu.py needs a CUDA GPU (or --smoke)\n")
    shapes = dict([SMOKE_SHAPE]) if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    record = Record("gemm_gelu", args, device.type,
                    note="ms: median GPU time per call (fxopt.compile.timing.time_ms); *_loop: back-to-back loops, host included")
    t0 = time.perf_counter()
    for name, (m, k, n) in shapes.items():
        record.add(measure(name, m, k, n, dtype, args.reps, device))
        print(f"{name}: done at {time.perf_counter() - t0:.1f} s", flush=True)
    print(table(record.rows))
    geo = statistics.geometric_mean([r["op_vs_inductor"] for r in record.rows])
    print(f"op vs inductor, geometric mean: {geo:.3f}x; total {time.perf_counter() - t0:.1f} s")
    return record.data


if __name__ == "__main__":
    main()
