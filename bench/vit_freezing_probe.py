"""Diagnostic: where does ViT lose under the fxopt backend (CUDA-graph timing)?

Times vit_b_16 (bf16, batch 32) under Inductor's own freezing and under the fxopt backend
with subsets of the default pipeline (none at all, without ``constant_fold``, without
``eliminate_identity``, all), launch-bound and as CUDA-graph replays.

    python3 bench/vit_freezing_probe.py             # bench/results/<gpu>/vit_freezing_probe.json
    python3 bench/vit_freezing_probe.py --smoke     # CPU, one small encoder layer (CI)
"""

from __future__ import annotations

from typing import Any

import gpu_zoo as zoo
import torch
from harness import (
    Record,
    call_ms,
    cli,
    frozen_summary,
    inductor_variant,
    markdown_table,
    not_frozen,
)

import fxopt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = cli.parser(__doc__.split("\n\n")[0], rounds=1).parse_args(argv)
    device = cli.device_for(args)
    record = Record("vit_freezing_probe", args, device)
    if args.smoke:  # one small encoder layer: five compiles in seconds
        from fxopt.models import TransformerEncoderNet

        model, x = TransformerEncoderNet(d_model=32, heads=2, ff=64, layers=1).eval(), torch.randn(2, 8, 32)
    else:
        model, (x,) = zoo.build("vit_b_16", False)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model, x = model.to(device, dtype), x.to(device, dtype)
    full = list(fxopt.DEFAULT_PIPELINE)
    pipelines = {"fxopt_none": [], "fxopt_no_constant_fold": [p for p in full if p != "constant_fold"],
                 "fxopt_no_identity": [p for p in full if p != "eliminate_identity"], "fxopt": full}
    stats: dict[str, Any] = {}
    variants = {"inductor_freezing": inductor_variant("inductor_freezing", model, stats)}
    variants.update({label: (torch.compile(model, backend="fxopt", options={"passes": passes}),
                             variants["inductor_freezing"][1]) for label, passes in pipelines.items()})
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            for label, (fn, context) in variants.items():
                with context():
                    fn(x)
                    row = {"variant": label, "launch_ms": call_ms(lambda: fn(x), device)}  # noqa: B023
                    if device == "cuda":
                        row["graph_ms"] = call_ms(lambda: fn(x), device, graph=True)  # noqa: B023
                if label == "inductor_freezing":
                    row.update(frozen_summary(label, stats), problem=not_frozen(label, frozen_summary(label, stats)))
                record.add(row)
    finally:
        torch._dynamo.reset()
    print(markdown_table(record.rows, ["variant", "launch_ms", "graph_ms", "frozen"]))
    return record.data


if __name__ == "__main__":
    main()
