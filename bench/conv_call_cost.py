"""CPU cost of one call of each convolution spelling the compiled code can make (CUDA).

Tiny tensors (batch 1, 8x8, 64 channels, bf16, channels-last) keep the GPU idle, so the
time per call is the CPU's: Python, dispatcher and cuDNN's plan-cache lookup.

    python3 bench/conv_call_cost.py                 # bench/results/<gpu>/conv_call_cost.json
    python3 bench/conv_call_cost.py --smoke         # CPU, fp32: the spellings that run there (CI)

A spelling the device lacks (the cuDNN fusions off CUDA) is a row saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from harness import Record, cli, loop_ms, markdown_table

import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.* and the cuDNN meta kernels


def spellings(device: str, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """One call of each spelling, on tiny channels-last tensors."""
    cl = torch.channels_last
    kw = {"device": device, "dtype": dtype}
    x = torch.randn(1, 64, 8, 8, **kw).to(memory_format=cl)
    w = torch.randn(64, 64, 3, 3, **kw).to(memory_format=cl)
    b = torch.randn(64, **kw)
    z = torch.randn(1, 64, 8, 8, **kw).to(memory_format=cl)
    aten, one, pad = torch.ops.aten, [1, 1], [1, 1]
    return {
        "aten.convolution": lambda: aten.convolution.default(x, w, b, one, pad, one, False, [0, 0], 1),
        "aten.cudnn_convolution_relu": lambda: aten.cudnn_convolution_relu.default(x, w, b, one, pad, one, 1),
        "aten.cudnn_convolution_add_relu": lambda: aten.cudnn_convolution_add_relu.default(
            x, w, z, 1.0, b, one, pad, one, 1),
        "fxopt.conv_bias_relu (Python CUDA impl)": lambda: torch.ops.fxopt.conv_bias_relu.default(
            x, w, b, one, pad, one, 1),
        "aten.relu": lambda: aten.relu.default(x),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    args = parser.parse_args(argv)
    device = cli.device_for(args)
    calls = 20 if args.smoke else args.calls
    record = Record("conv_call_cost", args, device)
    with torch.no_grad():
        for name, fn in spellings(device, torch.float32 if args.smoke else torch.bfloat16).items():
            try:
                us = loop_ms(fn, device, iters=calls, reps=args.rounds, warmup=50, host=True) * 1e3
                record.add({"spelling": name, "cpu_us_per_call": us})
            except (RuntimeError, NotImplementedError) as exc:  # not on this device
                record.add({"spelling": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    print(markdown_table(record.rows, ["spelling", "cpu_us_per_call", "error"], digits=1))
    return record.data


if __name__ == "__main__":
    main()
