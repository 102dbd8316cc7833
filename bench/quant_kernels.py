"""The int8 weight-only kernels per linear shape of the Llama MLP stack, against cuBLAS bf16.

Run on a CUDA machine::

    python bench/quant_kernels.py --out /tmp/quant_kernels --ms 1,2,4,8,16

For each shape (gate or up: N=11008, K=4096; gate and up merged: N=22016, K=4096; the
same weight computing silu(gate) * up in the kernel; down: N=4096, K=11008) and each M: the kernel and configuration that ``tuned_config`` picks by tuning (on here),
its time and achieved bandwidth (weight bytes / time; the H100's copy bandwidth is about
3 TB/s), the same configuration with Triton's plain int8 cast instead of the magic-number
conversion, the best configuration of the other kernel, and ``F.linear`` on a bf16
weight (for "swiglu": the plain merged product). Each time is a CUDA-graph replay of 8 calls on 8 different weights (so no call
finds its weight in L2), divided by 8. Every kernel is checked against a dequantized
fp32 reference first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxopt.quant as fq  # noqa: E402
from bench.quant_gpu import HIDDEN, D, bench  # noqa: E402
from fxopt.progress import progress  # noqa: E402
from fxopt.quant import triton_kernels as tk  # noqa: E402
from fxopt.quant.int8_configs import m_bucket  # noqa: E402

#: the Llama stack's linear shapes (weight rows, K, name, gated): "swiglu" is the merged
#: gate and up weight computing silu(gate) * up (output N = HIDDEN)
SHAPES = [(HIDDEN, D, "gate|up", False), (2 * HIDDEN, D, "gate+up merged", False),
          (2 * HIDDEN, D, "swiglu", True), (D, HIDDEN, "down", False)]
ROTATE = 8


def shape_rows(n: int, k: int, name: str, gated: bool, ms: list[int], log) -> list[dict]:
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda") for _ in range(ROTATE)]
    s = torch.rand(n, device="cuda") / 1000
    w16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(ROTATE)]
    rows = [m_row(name, m, w8, s, w16, gated) for m in ms]
    for row in rows:
        log(f"{name:15s} M={row['M']:2d} {row['kind']} {row['config']}: int8 {row['int8_us']:.1f} us "
            f"({row['int8_TBps']:.2f} TB/s; plain cast {row['int8_plain_cvt_us']:.1f} us), "
            f"bf16 {row['bf16_us']:.1f} us ({row['bf16_TBps']:.2f} TB/s)"
            + "".join(f", best {kd} {row[f'best_{kd}_us']:.1f} us" for kd in ("gemv", "gemm")
                      if f"best_{kd}_us" in row))
    return rows


def m_row(name: str, m: int, w8: list, s: torch.Tensor, w16: list, gated: bool) -> dict:
    rows, k = w8[0].shape
    n = rows // 2 if gated else rows
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def per_call(launch) -> float:
        """Microseconds per call of ``launch(i)``, cycling through the 8 weights."""
        return 1e3 * bench(lambda: [launch(i) for i in range(ROTATE)], graph=True) / ROTATE

    def int8_us(kind: str, config: tk.Config | None) -> float:
        return per_call(lambda i: tk.launch((kind, config), x, w8[i], s, None, y, gated))

    ref = F.linear(x.float(), w8[0].float() * s[:, None])
    if gated:
        ref = F.silu(ref[:, :n]) * ref[:, n:]
    kind, config = tk.tuned_config(x, w8[0], s, None, y, gated=gated)
    op = tk.int8_weight_only_swiglu if gated else tk.int8_weight_only_linear
    quality = fq.sqnr(ref, op(x, w8[0], s, None))
    assert quality >= 35, (name, m, quality)
    row = {"shape": name, "N": rows, "K": k, "M": m, "kind": kind, "config": str(config),
           "sqnr_vs_dequant": quality, "bf16_us": per_call(lambda i: F.linear(x, w16[i])),
           "int8_us": int8_us(kind, config),
           # the reference candidate (large M) has no conversion to switch
           "int8_plain_cvt_us": int8_us(kind, config and dataclasses.replace(config, fast_cvt=0))}
    times = tk.TUNING_TIMES.get((m_bucket(m), rows, k, x.dtype, False, None, gated), {})
    for other in {kd for kd, _ in times} - {kind}:
        best = min((c for kd, c in times if kd == other), key=lambda c: times[(other, c)])
        row[f"best_{other}"] = str(best)
        row[f"best_{other}_us"] = int8_us(other, best)
    row["int8_TBps"] = rows * k / row["int8_us"] / 1e6
    row["bf16_TBps"] = 2 * rows * k / row["bf16_us"] / 1e6
    row["tuning_top8"] = sorted((round(t * 1e3, 1), kd, str(c)) for (kd, c), t in times.items())[:8]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/quant_kernels"))
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=",".join(name for _, _, name, _ in SHAPES),
                        help="comma-separated names of SHAPES to run")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    # the tuned picks are what this reports; they also land in the tuning cache
    # ($FXOPT_CACHE_DIR), which bench/int8_defaults_from_cache.py turns into shipped defaults
    fq.set_int8_tuning(True)
    torch.manual_seed(0)

    def log(msg):
        print(msg, flush=True)

    rows = []
    chosen = [shape for shape in SHAPES if shape[2] in args.shapes.split(",")]
    for n, k, name, gated in progress(chosen, desc="shapes", unit="shape"):
        rows += shape_rows(n, k, name, gated, ms, log)
        with open(os.path.join(args.out, "quant_kernels.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)
    print("\n| shape | M | kernel | config | int8 us | TB/s | plain cast us | bf16 us | bf16 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['M']} | {r['kind']} | {r['config'].replace('Config', '')} | {r['int8_us']:.1f} | "
              f"{r['int8_TBps']:.2f} | {r['int8_plain_cvt_us']:.1f} | {r['bf16_us']:.1f} | {r['bf16_TBps']:.2f} |")


if __name__ == "__main__":
    main()
