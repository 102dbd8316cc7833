"""Which int8 schemes keep the Llama MLP stack's SQNR >= 26 dB (issue 30, item 3): on CPU.

    python3 bench/w8a8_sqnr.py [--tokens 32] [--out FILE]
    python3 bench/w8a8_sqnr.py --smoke          # a 2-block stack of width 128, 8 tokens (CI)

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

from typing import Any

import torch
import torch.nn.functional as F
from harness import Record, cli, markdown_table
from quant_serving import MLPStack

from fxopt.quant.accuracy import sqnr

#: ``--smoke``: every scheme on a small stack (K a multiple of the 128-wide groups)
SMOKE = {"blocks": 2, "d": 128, "hidden": 256}
SMOKE_TOKENS = 8


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


def schemes() -> dict[str, Any]:
    """Each activation scheme without smoothing: ``act(linear's name, its input)``."""
    return {
        "weight-only": lambda name, t: t,
        "per-token": lambda name, t: fake_int8(t),
        "per-token, gate/up only": lambda name, t: t if name == "down" else fake_int8(t),
        "per-token group 128": lambda name, t: fake_int8(t, group=128),
        "per-token group 128, gate/up only": lambda name, t: t if name == "down" else fake_int8(t, group=128),
        "per-token group 32": lambda name, t: fake_int8(t, group=32),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    tokens = SMOKE_TOKENS if args.smoke else args.tokens
    record = Record("w8a8_sqnr", args, cli.device_for(args, default="cpu"), tokens=tokens)
    torch.manual_seed(0)
    model = MLPStack(**(SMOKE if args.smoke else {})).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    d = model.blocks[0].gate.in_features
    x, calib = torch.randn(tokens, d), torch.randn(tokens, d)
    names = [(i, n) for i in range(len(model.blocks)) for n in ("gate", "up", "down")]
    with torch.no_grad():
        ref = model(x)
        wq = {f"{i}.{n}": fake_int8(getattr(model.blocks[i], n).weight) for i, n in names}
        for scheme, act in schemes().items():
            record.add({"scheme": scheme, "sqnr_db": round(sqnr(ref, run(model, x, act, wq)), 2)})
        factors = smoothing(model, calib)
        ws = {f"{i}.{n}": fake_int8(getattr(model.blocks[i], n).weight * factors[f"{i}.{n}"]) for i, n in names}
        smoothed = run(model, x, lambda name, t: fake_int8(t), ws, factors)
        record.add({"scheme": "per-token + smoothing", "sqnr_db": round(sqnr(ref, smoothed), 2)})
    print(markdown_table(record.rows, ["scheme", "sqnr_db"], digits=2))
    return record.data


if __name__ == "__main__":
    main()
