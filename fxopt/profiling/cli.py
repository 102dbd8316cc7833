"""``fxopt profile MODULE:FACTORY``: the hotspot table, a trace and an HTML heat map.

The factory returns a model, or a ``(model, example_inputs)`` pair. Inputs come from
``--input-shape``; without it, from the pair, or else from the model's first layer (an
image batch of one for a convolution, one row for a linear layer, 128 token ids for an
embedding), so ``fxopt profile torchvision.models:resnet18`` runs as written.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from fxopt.errors import InputError


def add_subcommand(sub: Any, parse_shape: Any, load_factory: Any, parents: list[Any]) -> None:
    """Register ``profile`` on the ``fxopt`` parser's subparsers (``fxopt.cli``)."""
    cmd = sub.add_parser("profile", parents=parents,
                         help="profile MODULE:FACTORY node by node (time, memory, FLOPs)")
    cmd.add_argument("target", help="package.module:factory or file.py:factory returning an nn.Module "
                     "or a (model, example_inputs) pair")
    cmd.add_argument("--input-shape", action="append", type=parse_shape, default=[],
                     help="shape of one example input, e.g. 1,3,224,224 (repeat per input); default: "
                     "the factory's inputs, or one input guessed from the first layer")
    cmd.add_argument("--dtype", default="float32", help="dtype of the example inputs")
    cmd.add_argument("--device", default="cpu", help="where to run it: cpu (default) or cuda")
    cmd.add_argument("--top", type=int, default=20, help="rows of the hotspot table (default 20)")
    cmd.add_argument("--warmup", type=int, default=2, help="unprofiled runs first (default 2)")
    cmd.add_argument("--repeat", type=int, default=5, help="profiled runs (default 5)")
    cmd.add_argument("--trace", metavar="JSON", help="write a Chrome/Perfetto trace (slices named fxopt::<node>)")
    cmd.add_argument("--report", metavar="HTML", help="write the heat map and memory curve page here")
    cmd.add_argument("--csv", metavar="CSV", help="write the per-node rows here")
    cmd.set_defaults(fn=lambda args: run(args, load_factory))


def run(args: argparse.Namespace, load_factory: Any) -> int:
    from fxopt.profiling.run import profile

    made = load_factory(args.target)()
    model, inputs = made if isinstance(made, tuple) else (made, None)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if args.input_shape:
        dtype = getattr(torch, args.dtype)
        inputs = tuple(torch.randn(shape).to(dtype) for shape in args.input_shape)
    elif inputs is None:
        inputs = (guess_input(model),)
        print(f"input guessed from the first layer: {_describe(inputs[0])} (set it with --input-shape)")
    model = model.eval()
    with torch.no_grad():
        result = profile(model, inputs, device=args.device, warmup=args.warmup, repeat=args.repeat)
    print(result.table(top=args.top))
    if args.trace:
        result.export_chrome_trace(args.trace)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.csv:
        result.to_csv(args.csv)
        print(f"rows written to {args.csv}")
    if args.report:
        from pathlib import Path

        from fxopt.visualize.profile import profile_html

        Path(args.report).write_text(profile_html(result, title=f"fxopt profile: {args.target}"),
                                     encoding="utf-8")
        print(f"report written to {args.report}")
    return 0


def guess_input(model: torch.nn.Module) -> torch.Tensor:
    """An example input for ``model`` from its first registered convolution, linear or
    embedding layer (the first layer it runs, in most models)."""
    nn = torch.nn
    convs = ((nn.Conv1d, (1024,)), (nn.Conv2d, (224, 224)), (nn.Conv3d, (16, 112, 112)))
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return torch.randint(0, module.num_embeddings, (1, 128))
        for conv, spatial in convs:
            if isinstance(module, conv):
                return torch.randn(1, module.in_channels, *spatial)
        if isinstance(module, nn.Linear):
            return torch.randn(1, module.in_features)
    raise InputError(f"cannot guess an input for {type(model).__name__}; give --input-shape")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]"
