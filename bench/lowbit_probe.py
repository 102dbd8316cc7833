# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
"""Every low-bit GEMM route available on this GPU, per Llama MLP shape and M, against cuBLAS bf16.

    python3 bench/lowbit_probe.py --out DIR [--ms 1,2,4,...] [--no-gemlite]

Which kernel should serve which M is a measurement, per GPU: this script times, for the
merged gate/up weight (N = 22016, K = 4096) and the down projection (N = 4096, K = 11008):

- ``bf16``: ``F.linear`` on a bf16 weight (cuBLAS), the baseline;
- ``wo_triton``: fxopt's int8 weight-only Triton kernels (GEMV / swap-AB GEMM);
- ``two_term``: the int8 ops' route up to the crossover (``fxopt.quant.int8_mm.two_term_linear``);
- ``dequant_cublas``: their route above it (``int8_mm.dequantized_linear``: one dequantizing
  pass, then cuBLAS); ``wo_reference``: the eager reference definition (three fp32 passes);
- ``w8a8`` / ``w8a8_2term``: per-token int8 activations (one term, or the activation and
  its rounding residual as two int8 rows each, so the product is as exact as weight-only's),
  ``torch._int_mm`` (cuBLASLt int8 tensor cores) and the rescale; also the parts alone;
- ``fp8_rowwise``: ``torch._scaled_mm`` with e4m3 operands and row-wise scales;
- ``int4_tinygemm``: ``aten._weight_int4pack_mm`` (group 128), ``int4_fxopt``: fxopt's int4;
- ``gemlite_a16w8``: gemlite's int8 weight-only Triton kernels (where gemlite imports).

Each time is a CUDA-graph replay (``triton.testing.do_bench_cudagraph``) of calls over
enough distinct weights that none is found in L2, divided by their count.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
import triton

import fxopt.quant  # noqa: F401  (registers torch.ops.fxopt_quant)
from fxopt.quant import int8_mm

D, HIDDEN = 4096, 11008
SHAPES = {"gate+up": (2 * HIDDEN, D), "down": (D, HIDDEN)}
L2_BYTES = 60 * 2**20


def time_us(fn, copies: int) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1000 / copies


def per_token(x):
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 127
    q = torch.round(x.float() / s).clamp(-127, 127)
    return q.to(torch.int8), s, (x.float() - q * s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--no-gemlite", action="store_true")
    p.add_argument("--only", default="", help="comma-separated labels to time (default: all)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ops = torch.ops.fxopt_quant
    gemlite = None
    if not args.no_gemlite:
        try:
            from gemlite.helper import A16W8_INT8
            gemlite = A16W8_INT8
        except Exception as exc:  # noqa: BLE001
            print("gemlite does not import:", exc)
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, math.ceil(3 * L2_BYTES / (n * k)))
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        ws = [(w.float().abs().amax(1) / 127).clamp(min=1e-12) for w in w16]
        w8 = [torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8) for w, s in zip(w16, ws)]
        w8t = [w.t() for w in w8]  # [K, N] views: _int_mm's second operand, column-major
        w8f = [w.to(torch.float8_e4m3fn) for w in w8]  # stand-in fp8 weights (timing only)
        w4 = [torch._convert_weight_to_int4pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev), 8)
              for _ in range(copies)]
        sz4 = torch.rand(k // 128, n, 2, device=dev, dtype=torch.bfloat16)
        fx4 = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev) for _ in range(copies)]
        fx4s = torch.rand(n, k // 128, device=dev) / 100
        gl = None
        if gemlite is not None:
            try:
                gl = [gemlite(device="cuda:0", dtype=torch.bfloat16).from_weights(w8[i], scales=ws[i][:, None].to(torch.bfloat16))
                      for i in range(copies)]
            except Exception as exc:  # noqa: BLE001
                print("gemlite pack failed:", exc)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "N": n, "K": k, "M": m, "copies": copies}

            def run(label, fn):
                if args.only and label not in args.only.split(","):
                    return
                try:
                    row[label] = round(time_us(fn, copies), 2)
                except Exception as exc:  # noqa: BLE001
                    row[label] = None
                    row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

            run("bf16", lambda: [F.linear(x, w) for w in w16])
            run("two_term", lambda: [int8_mm.two_term_linear(x, w, s, None) for w, s in zip(w8, ws)])
            run("dequant_cublas", lambda: [int8_mm.dequantized_linear(x, w, s, None) for w, s in zip(w8, ws)])
            run("wo_triton", lambda: [ops.int8_weight_only_linear(x, w, s, None) for w, s in zip(w8, ws)])
            run("wo_reference", lambda: [F.linear(x, (w.to(torch.bfloat16) * s[:, None].to(torch.bfloat16))) for w, s in zip(w8, ws)])
            if m > 16:
                xq, xs, res = per_token(x)
                rs = (res.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127)
                rq = torch.round(res / rs).clamp(-127, 127).to(torch.int8)
                x2 = torch.cat([xq, rq])
                run("int_mm", lambda: [torch._int_mm(xq, w) for w in w8t])
                run("int_mm_2m", lambda: [torch._int_mm(x2, w) for w in w8t])
                acc = torch._int_mm(xq, w8t[0])
                run("rescale", lambda: [(acc.float() * xs * s).to(torch.bfloat16) for s in ws])
                run("quant_rows", lambda: [ops.quantize_per_token(x) for _ in range(copies)])
                run("w8a8_triton", lambda: [ops.int8_scaled_mm(xq, w, xs, s, None, torch.bfloat16) for w, s in zip(w8, ws)])
                run("w8a8_triton_2m", lambda: [ops.int8_scaled_mm(x2, w, torch.cat([xs, rs]), s, None, torch.bfloat16) for w, s in zip(w8, ws)])
            if m % 16 == 0 or m > 16:
                xf = x.to(torch.float8_e4m3fn)
                one_m = torch.ones(m, 1, device=dev)
                one_n = torch.ones(1, n, device=dev)
                run("fp8_rowwise", lambda: [torch._scaled_mm(xf, w.t(), one_m, one_n, out_dtype=torch.bfloat16) for w in w8f])
            run("int4_tinygemm", lambda: [torch._weight_int4pack_mm(x, w, 128, sz4) for w in w4])
            run("int4_fxopt", lambda: [ops.int4_weight_only_linear(x, w, fx4s, 128, None) for w in fx4])
            if gl is not None:
                run("gemlite_a16w8", lambda: [g(x) for g in gl])
            print(json.dumps(row), flush=True)
            rows.append(row)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "lowbit_probe.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
