"""Where regnet's grouped convolutions spend their time, and which layout would spend less.

A kernel profile of regnet_y_1_6gf (bf16, batch 32, channels-last) on an H200 put 47% of a
call's GPU time in cuDNN's ``tensorTransformGeneric`` (75 launches, ~24 us each) around its
grouped 3x3 convolutions (group width 24), under fxopt and every Inductor mode alike. This
probe times each distinct grouped conv of the model (shapes read from the model with forward
hooks), counted as often as the model calls it, in the forms a graph rewrite could give it:

- ``channels_last``: as the model runs it (input and weight NHWC);
- ``nchw``: input and weight contiguous (an NCHW graph);
- ``nchw_with_copies``: NHWC in and out, NCHW inside (what a per-conv layout lever pays);
- ``padded_32``: each group's channels zero-padded from 24 to 32, NHWC (the input as the
  previous 1x1 conv could produce it: the pad's own cost is not timed);
- ``cudnn_benchmark``: NHWC with ``torch.backends.cudnn.benchmark`` on (cuDNN times its
  algorithms once per shape).

    python bench/grouped_conv_probe.py --out $OUT/grouped_conv_probe.json
    python bench/grouped_conv_probe.py --smoke          # CPU, synthetic shapes (CI)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import Record, call_ms, cli, markdown_table

#: (batch, channels, height, width, groups, stride) of the grouped convs when torchvision is missing
SYNTHETIC = [(2, 48, 8, 8, 2, 1), (2, 48, 8, 8, 2, 2)]
VARIANTS = ("channels_last", "nchw", "nchw_with_copies", "padded_32", "cudnn_benchmark")


def grouped_convs(batch: int) -> Counter:
    """How often regnet_y_1_6gf calls each grouped conv, by (input shape, groups, stride)."""
    from torchvision.models import regnet_y_1_6gf

    model, seen = regnet_y_1_6gf().eval(), Counter()

    def hook(module: nn.Conv2d, inputs: tuple) -> None:
        seen[(*inputs[0].shape, module.groups, module.stride[0])] += 1

    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.groups > 1:
            m.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(torch.randn(batch, 3, 224, 224))
    return seen


def _pad_groups(t: torch.Tensor, groups: int, width: int, dim: int) -> torch.Tensor:
    """``t`` with each group's slice of ``dim`` zero-padded to ``width`` channels."""
    parts = t.chunk(groups, dim)
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, width - parts[0].shape[dim]]
    return torch.cat([F.pad(p, pad) for p in parts], dim)


def forms(shape: tuple, device: str, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The conv in each variant's form, as zero-argument calls."""
    n, c, h, w, groups, stride = shape
    cl = torch.channels_last
    x = torch.randn(n, c, h, w, device=device, dtype=dtype).to(memory_format=cl)
    weight = (torch.randn(c, c // groups, 3, 3, device=device, dtype=dtype) * 0.1).to(memory_format=cl)
    x_nchw, w_nchw = x.contiguous(), weight.contiguous()
    x_pad = _pad_groups(x, groups, 32, 1).contiguous(memory_format=cl)
    w_pad = _pad_groups(_pad_groups(weight, groups, 32, 0), 1, 32, 1).contiguous(memory_format=cl)

    def benchmarked() -> torch.Tensor:
        with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
            return F.conv2d(x, weight, None, stride, 1, 1, groups)

    return {
        "channels_last": lambda: F.conv2d(x, weight, None, stride, 1, 1, groups),
        "nchw": lambda: F.conv2d(x_nchw, w_nchw, None, stride, 1, 1, groups),
        "nchw_with_copies": lambda: F.conv2d(x.contiguous(), w_nchw, None, stride, 1, 1,
                                             groups).contiguous(memory_format=cl),
        "padded_32": lambda: F.conv2d(x_pad, w_pad, None, stride, 1, 1, groups),
        "cudnn_benchmark": benchmarked,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    device = cli.device_for(args)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    record = Record("grouped_conv_probe", args, device, dtype=str(dtype))
    try:
        shapes = grouped_convs(args.batch)
        source = "torchvision regnet_y_1_6gf"
    except ImportError:
        shapes, source = Counter(SYNTHETIC), "synthetic shapes (no torchvision)"
    record.extra["source"] = source
    totals = dict.fromkeys(VARIANTS, 0.0)
    for shape, count in sorted(shapes.items()):
        calls = forms(shape, device, dtype)
        row = {"shape": list(shape[:4]), "groups": shape[4], "stride": shape[5], "count": count}
        for name in VARIANTS:
            row[name] = call_ms(calls[name], device)
            totals[name] += row[name] * count
        record.add(row)
    record.extra["total_ms"] = totals
    record.save()
    print(markdown_table(record.rows, ["shape", "groups", "stride", "count", *VARIANTS]))
    print("per model call, ms:", {k: round(v, 3) for k, v in totals.items()})
    return record.data


if __name__ == "__main__":
    main()
