"""Which int8 schemes keep the Llama MLP stack's SQNR >= 26 dB (issue 30, item 3): on CPU.

    python3 bench/w8a8_sqnr.py [--tokens 32] [--out FILE]

Weight-only int8 has the accuracy (27.3 dB on an H100) but at large M a bf16 tensor-core
GEMM's speed at best; int8 activations would use the int8 tensor cores (twice bf16's rate)
but per-token scales measured 20.6 dB. This script measures, before any kernel is written,
which activation scheme keeps >= 26 dB: fake quantization in float32 (round to the int8 grid,
scale back) of bench/quant_serving.py's model (8 blocks, d 4096, hidden 11008, weights
N(0, 0.02), as it initializes them), against the float32 model, on Gaussian
inputs. Weights: int8 per output channel everywhere. Activations:

- ``weight-only``: float (the shipped default);
- ``per-token``: int8 per row, every linear (``int8_dynamic``);
- ``per-token, gate/up only``: int8 rows into gate/up, float into down;
- ``per-token group 128``: int8 per row and group of 128 along K (a scale per K block: the
  GEMM rescales its int32 partial sums each block, as DeepGEMM does for fp8);
- ``per-token group 128, gate/up only``, ``per-token group 32``: the same, narrower;
- ``per-token + smoothing``: SmoothQuant's migration (alpha 0.5) from a calibration batch,
  then per-token int8.

bf16 rounding is left out (every scheme's error is the quantization's alone). Measured on
the 2-core development machine, 32 tokens (5 min, most of it waiting for the cores):
weight-only 27.80 dB (an H100 in bf16: 27.3), per-token 20.76 (H100: 20.6), per-token on
gate/up only 25.71, per-token group 128 24.62, group 128 on gate/up only 26.51, group 32
25.84, per-token + smoothing 18.92. Only group-128 scales on gate/up alone clear 26 dB here,
by 0.5 dB in float32 (bf16 cost weight-only 0.5 dB on the H100): no int8 activation scheme
holds 26 dB with margin on this stack, so large M stays weight-only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_serving import D, MLPStack  # noqa: E402

from fxopt.quant.accuracy import sqnr  # noqa: E402


def fake_int8(t: torch.Tensor, dim: int = -1, group: int | None = None) -> torch.Tensor:
    """``t`` rounded to symmetric int8 with one scale per slice along ``dim`` (per row of a
    weight or of an activation), or per ``group`` values along the last dim."""
    if group is not None:
        g = t.reshape(*t.shape[:-1], -1, group)
        return fake_int8(g, -1).reshape(t.shape)
    scale = t.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(t / scale).clamp(-127, 127) * scale


def run(model: MLPStack, x: torch.Tensor, act, weights: dict, smooth: dict | None = None) -> torch.Tensor:
    """The stack with quantized weights ``weights[name]`` and ``act(name, input)`` applied to
    each linear's input; ``smooth[name]``: per-K factors divided out of the input (already
    multiplied into the weight)."""
    for i in range(len(model.blocks)):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

        def linear(name, inp, i=i):
            key = f"{i}.{name}"
            if smooth is not None:
                inp = inp / smooth[key]
            return F.linear(act(name, inp), weights[key])

        x = x + linear("down", F.silu(linear("gate", h)) * linear("up", h))
    return x


def smoothing(model: MLPStack, calib: torch.Tensor, alpha: float = 0.5) -> dict:
    """SmoothQuant's factors per linear: max|X_k|^alpha / max|W_k|^(1 - alpha), from the
    float model's activations on ``calib``."""
    factors = {}
    x = calib
    for i, block in enumerate(model.blocks):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        mid = F.silu(block.gate(h)) * block.up(h)
        for name, inp in (("gate", h), ("up", h), ("down", mid)):
            w = getattr(block, name).weight
            factors[f"{i}.{name}"] = (inp.abs().amax(0).clamp(min=1e-5) ** alpha
                                      / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha))
        x = x + block.down(mid)
    return factors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MLPStack().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(args.tokens, D)
    calib = torch.randn(args.tokens, D)
    results = {}
    with torch.no_grad():
        ref = model(x)
        names = [(i, n) for i in range(len(model.blocks)) for n in ("gate", "up", "down")]
        wq = {f"{i}.{n}": fake_int8(getattr(model.blocks[i], n).weight) for i, n in names}
        schemes = {
            "weight-only": lambda name, t: t,
            "per-token": lambda name, t: fake_int8(t),
            "per-token, gate/up only": lambda name, t: t if name == "down" else fake_int8(t),
            "per-token group 128": lambda name, t: fake_int8(t, group=128),
            "per-token group 128, gate/up only": lambda name, t: t if name == "down" else fake_int8(t, group=128),
            "per-token group 32": lambda name, t: fake_int8(t, group=32),
        }
        for scheme, act in schemes.items():
            results[scheme] = round(sqnr(ref, run(model, x, act, wq)), 2)
            print(f"{scheme:28} {results[scheme]:6.2f} dB", flush=True)
        factors = smoothing(model, calib)
        ws = {f"{i}.{n}": fake_int8(getattr(model.blocks[i], n).weight * factors[f"{i}.{n}"]) for i, n in names}
        results["per-token + smoothing"] = round(sqnr(ref, run(model, x, lambda name, t: fake_int8(t), ws, factors)), 2)
        print(f"{'per-token + smoothing':28} {results['per-token + smoothing']:6.2f} dB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "sqnr_vs_fp32_db": results}, f, indent=1)


if __name__ == "__main__":
    main()
