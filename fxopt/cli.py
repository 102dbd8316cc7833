"""The ``fxopt`` command line: ``fxopt passes``, ``fxopt optimize``, ``fxopt demo``, ``fxopt profile``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxopt.errors import FxoptError
from fxopt.optimize import DEFAULT_PIPELINE, optimize, report_of
from fxopt.profiling import cli as profiling_cli
from fxopt.registry import registered_passes


def _cmd_passes(args: argparse.Namespace) -> int:
    for name, cls in registered_passes().items():
        flags = " [inference-only]" if cls.inference_only else ""
        print(f"{name:22s} {cls.description()}{flags}")
        for key, opt in cls.options.items():
            choices = f" one of {list(opt.choices)}" if opt.choices else ""
            print(f"{'':22s}   {key}: {opt.type.__name__} = {opt.default!r}{choices}  {opt.doc}")
    return 0


def _load_factory(spec: str) -> Any:
    """``package.module:factory`` or ``path/to/file.py:factory``."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"fxopt: expected MODULE:FACTORY, got {spec!r}")
    if module_name.endswith(".py") or Path(module_name).exists():
        loaded = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if loaded is None or loaded.loader is None:
            raise SystemExit(f"fxopt: cannot load {module_name!r}")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"fxopt: {module_name!r} has no attribute {attr!r}") from None


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}; expected e.g. 1,3,224,224") from None


def _run(model: torch.nn.Module, inputs: tuple[Any, ...], passes: str | None, verify: bool,
         report_path: str | None) -> fx.GraphModule:
    gm = optimize(model, passes=passes or None, example_inputs=inputs, verify=verify)
    print(report_of(gm).table())
    if report_path:
        from fxopt.visualize import write_report

        write_report(gm, report_path)
        print(f"report written to {report_path}")
    return gm


def _cmd_optimize(args: argparse.Namespace) -> int:
    factory = _load_factory(args.target)
    model = factory()
    dtype = getattr(torch, args.dtype)
    inputs = tuple(torch.randn(shape).to(dtype) for shape in args.input_shape)
    if not inputs:
        raise SystemExit("fxopt: give at least one --input-shape")
    _run(model.eval(), inputs, args.passes, args.verify, args.report)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from fxopt.models import demo_model

    model, inputs = demo_model()
    # memory planning only records a plan: it adds the memory chart to the report
    passes = [*DEFAULT_PIPELINE, *(["plan_memory"] if "plan_memory" in registered_passes() else [])]
    print(f"fxopt demo: {type(model).__name__} traced with torch.fx.symbolic_trace, "
          f"passes {', '.join(passes)}, verify=True\n")
    report = args.report or str(Path(tempfile.mkdtemp(prefix="fxopt-demo-")) / "report.html")
    gm = _run(model, inputs, ",".join(passes), True, None if args.no_report else report)
    error = (gm(*inputs) - model(*inputs)).abs().max().item()
    print(f"\nmax |optimized - original| on the example input: {error:.2e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("passes", help="list registered passes and their options").set_defaults(fn=_cmd_passes)
    opt = sub.add_parser("optimize", help="trace MODULE:FACTORY and run a pipeline over it")
    opt.add_argument("target", help="package.module:factory or file.py:factory returning an nn.Module")
    opt.add_argument("--input-shape", action="append", type=_parse_shape, default=[],
                     help="shape of one example input, e.g. 1,3,224,224 (repeat per input)")
    opt.add_argument("--dtype", default="float32", help="dtype of the example inputs")
    opt.add_argument("--passes", help='textual pipeline, e.g. "cse,dce" (default: the default pipeline)')
    opt.add_argument("--verify", action="store_true", help="check equivalence after each pass")
    opt.add_argument("--report", metavar="HTML", help="write the per-pass HTML report here")
    opt.set_defaults(fn=_cmd_optimize)
    demo = sub.add_parser("demo", help="optimize the bundled demo model and print the per-pass table")
    demo.add_argument("--report", metavar="HTML",
                      help="where to write the per-pass HTML report (default: a new temporary folder)")
    demo.add_argument("--no-report", action="store_true", help="do not write the HTML report")
    demo.set_defaults(fn=_cmd_demo)
    profiling_cli.add_subcommand(sub, _parse_shape, _load_factory)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except FxoptError as exc:
        print(f"fxopt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
