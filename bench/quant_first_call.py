"""int8 weight-only decode: first-call time untuned, tuning, and from the on-disk tuning cache, and
plain-launch (no CUDA graph) speed against bf16 + freezing, side by side in one process.

    python3 bench/quant_first_call.py --ms 1,16,256          # needs a CUDA GPU

Model: bench/quant_gpu.py's Llama-shaped MLP stack (8 blocks, d 4096, hidden 11008, bf16),
quantized int8 weight-only with gate/up merged and SwiGLU fused. The first call (Triton
compilation included) is timed in three fresh subprocesses: "default" with an empty cache
and tuning off (shipped defaults or the choice by shape: what a user gets), "cold_cache"
with ``FXOPT_INT8_TUNE=1`` (it tunes every shape) and "warm_cache" sharing its cache
directory (it should find every shape cached). That directory is ``$FXOPT_CACHE_DIR`` when
set (start it empty: its ``int8_tuning.json`` then holds this GPU's winners, which
bench/int8_defaults_from_cache.py merges into the shipped defaults), else a temporary one. Then,
in this process, each variant is timed with plain launches and as a CUDA-graph replay:
bf16 and int8 compiled by Inductor (``freezing`` set globally, ``dynamic=True``), the
int8 GraphModule run directly (no compile), and bf16 and int8 through the fxopt backend
(static shapes, one compile per M: the backend replays each as a CUDA graph, fxopt.compile.replay).
Inductor's own CUDA graphs (``mode="reduce-overhead"``, bf16) are timed as a reference.
``--no-first-call`` skips the three subprocesses; ``--dynamic-min-tokens 17`` quantizes
with int8 dynamic (int8 tensor cores) from 17 rows on, the route for prefill-sized M.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.fx as fx
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quant_gpu import D, MLPStack, bench  # noqa: E402

import fxopt  # noqa: E402
import fxopt.quant as fq  # noqa: E402


def build(dynamic_min_tokens: int = 0) -> tuple[nn.Module, fx.GraphModule, fx.GraphModule]:
    torch.manual_seed(0)
    model = MLPStack().to("cuda", torch.bfloat16).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    x1 = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    gm = fx.symbolic_trace(model)
    wo = fq.quantize_model(gm, (x1,), "int8_weight_only", dynamic_min_tokens=dynamic_min_tokens)
    return model, gm, fxopt.optimize(wo, ["merge_sibling_linears", "fuse_swiglu"], example_inputs=(x1,))


def first_call(ms: list[int]) -> None:
    """Child process: seconds of the first call of the int8 GraphModule at each M."""
    _, _, q = build()
    out = {}
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            start = time.perf_counter()
            q(x)
            torch.cuda.synchronize()
            out[m] = time.perf_counter() - start
    print("FIRST_CALL " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,256")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--no-first-call", action="store_true")
    parser.add_argument("--dynamic-min-tokens", type=int, default=0,
                        help="int8 dynamic (int8 tensor cores) from this many rows; 0: weight-only at every M")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.child:
        return first_call(ms)
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                    "triton": __import__("triton").__version__}
    cache_dir = os.environ.get("FXOPT_CACHE_DIR") or tempfile.mkdtemp(prefix="fxopt_tuning_")
    untuned = {**os.environ, "FXOPT_CACHE_DIR": tempfile.mkdtemp(prefix="fxopt_untuned_"),
               "FXOPT_INT8_TUNE": "0"}
    tuned = {**os.environ, "FXOPT_CACHE_DIR": cache_dir, "FXOPT_INT8_TUNE": "1"}
    runs = {"default": untuned, "cold_cache": tuned, "warm_cache": tuned}
    for run, env in () if args.no_first_call else runs.items():
        done = subprocess.run([sys.executable, __file__, "--child", "--ms", args.ms], env=env,
                              capture_output=True, text=True, timeout=400)
        line = [x for x in done.stdout.splitlines() if x.startswith("FIRST_CALL ")]
        result[f"first_call_s_{run}"] = json.loads(line[0][11:]) if line else done.stderr[-800:]
        print(run, result[f"first_call_s_{run}"], flush=True)

    # the timings below use the kernels the cold run tuned, as earlier runs of this script did
    os.environ["FXOPT_CACHE_DIR"] = cache_dir
    model, gm, q = build(args.dynamic_min_tokens)
    result["dynamic_min_tokens"] = args.dynamic_min_tokens
    torch._inductor.config.freezing = True  # global: Dynamo then freezes the weights too
    torch._dynamo.config.cache_size_limit = 64
    reports: list = []  # what the fxopt backend did with each graph
    variants = {"bf16_inductor_freezing": torch.compile(gm, dynamic=True),
                "int8_inductor_freezing": torch.compile(q, dynamic=True), "int8_graphmodule": q,
                "bf16_reduce_overhead": torch.compile(gm, dynamic=False, mode="reduce-overhead"),
                "bf16_fxopt": torch.compile(gm, backend="fxopt", dynamic=False, options={"reports": reports}),
                "int8_fxopt": torch.compile(q, backend="fxopt", dynamic=False, options={"reports": reports})}
    #: variants that capture CUDA graphs themselves: no CUDA graph of their call is timed
    self_graphed = ("bf16_reduce_overhead",)
    rows = []
    with torch.no_grad():
        xs = torch.randn(64, D, device="cuda", dtype=torch.bfloat16)
        result["sqnr_int8_vs_fp32_M64"] = fq.sqnr(copy.deepcopy(model).float()(xs.float()), q(xs))
        for m in ms:
            x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
            row = {"M": m}
            fresh = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
            for name, f in variants.items():
                row[f"{name}_plain_ms"] = bench(lambda f=f, x=x: f(x), graph=False)
                if name not in self_graphed:
                    row[f"{name}_graph_ms"] = bench(lambda f=f, x=x: f(x), graph=True)
                # after the timed calls, on an input none has seen: a stale replay would show
                row[f"{name}_sqnr_vs_eager_bf16"] = fq.sqnr(model(fresh).float(), f(fresh).float())
            for mode in ("plain", "graph"):
                best = min(row[f"int8_{v}_{mode}_ms"] for v in ("inductor_freezing", "graphmodule", "fxopt"))
                row[f"speedup_{mode}"] = row[f"bf16_inductor_freezing_{mode}_ms"] / best
            row["speedup_plain_vs_bf16_reduce_overhead"] = (row["bf16_reduce_overhead_plain_ms"]
                                                            / row["int8_fxopt_plain_ms"])
            row["speedup_plain_vs_bf16_fxopt"] = row["bf16_fxopt_plain_ms"] / row["int8_fxopt_plain_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result["rows"] = rows
    result["fxopt_graphs_not_replayed"] = [r.no_replay for r in reports if r.no_replay]
    result["fxopt_fallbacks"] = [r.fallback for r in reports if r.fallback]
    print("fxopt backend: graphs", len(reports), "not replayed", result["fxopt_graphs_not_replayed"],
          "fallbacks", result["fxopt_fallbacks"])
    with open(os.path.join(args.out, "quant_first_call.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}; "
          f"SQNR int8 vs fp32 (8 blocks, M=64) {result['sqnr_int8_vs_fp32_M64']:.1f} dB")
    if not args.no_first_call:
        print("first call s (default, untuned / tuning, cold cache / warm cache):",
              result["first_call_s_default"], "/", result["first_call_s_cold_cache"], "/",
              result["first_call_s_warm_cache"])
    print("| M | bf16 frz plain / graph | bf16 reduce-overhead | bf16 fxopt plain / graph "
          "| int8 compiled plain / graph | int8 GraphModule plain / graph | int8 fxopt plain / graph "
          "| best int8 / bf16 frz, plain | graph | int8 fxopt / bf16 reduce-overhead, plain |")
    for r in rows:
        print(f"| {r['M']} | {r['bf16_inductor_freezing_plain_ms']:.3f} / {r['bf16_inductor_freezing_graph_ms']:.3f} | "
              f"{r['bf16_reduce_overhead_plain_ms']:.3f} | "
              f"{r['bf16_fxopt_plain_ms']:.3f} / {r['bf16_fxopt_graph_ms']:.3f} | "
              f"{r['int8_inductor_freezing_plain_ms']:.3f} / {r['int8_inductor_freezing_graph_ms']:.3f} | "
              f"{r['int8_graphmodule_plain_ms']:.3f} / {r['int8_graphmodule_graph_ms']:.3f} | "
              f"{r['int8_fxopt_plain_ms']:.3f} / {r['int8_fxopt_graph_ms']:.3f} | "
              f"{r['speedup_plain']:.2f}x | {r['speedup_graph']:.2f}x | "
              f"{r['speedup_plain_vs_bf16_reduce_overhead']:.2f}x |")


if __name__ == "__main__":
    main()
