"""CPU cost of one call of each convolution spelling the compiled code can make (CUDA).

Tiny tensors (batch 1, 8x8, 64 channels, bf16, channels-last) keep the GPU idle, so the
time per call is the CPU's: Python, dispatcher and cuDNN's plan-cache lookup.

    python3 bench/conv_call_cost.py
"""

import time

import torch

import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.* and the cuDNN meta kernels


def main() -> None:
    cl = torch.channels_last
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(1, 64, 8, 8, **kw).to(memory_format=cl)
    w = torch.randn(64, 64, 3, 3, **kw).to(memory_format=cl)
    b = torch.randn(64, **kw)
    z = torch.randn(1, 64, 8, 8, **kw).to(memory_format=cl)
    aten, one, pad = torch.ops.aten, [1, 1], [1, 1]
    calls = {
        "aten.convolution": lambda: aten.convolution.default(x, w, b, one, pad, one, False, [0, 0], 1),
        "aten.cudnn_convolution_relu": lambda: aten.cudnn_convolution_relu.default(x, w, b, one, pad, one, 1),
        "aten.cudnn_convolution_add_relu": lambda: aten.cudnn_convolution_add_relu.default(
            x, w, z, 1.0, b, one, pad, one, 1),
        "fxopt.conv_bias_relu (Python CUDA impl)": lambda: torch.ops.fxopt.conv_bias_relu.default(
            x, w, b, one, pad, one, 1),
        "aten.relu": lambda: aten.relu.default(x),
    }
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            per_call = (time.perf_counter() - start) / 2000 * 1e6
            torch.cuda.synchronize()
            print(f"{name:40s} {per_call:7.1f} us/call (CPU)", flush=True)


if __name__ == "__main__":
    main()
