"""The ``fxopt`` command: ``fxopt passes``, ``fxopt optimize``, ``fxopt demo``, ``fxopt profile``.

Exit codes: 0 done; 1 a pass failed (or fxopt itself did); 2 a mistake in what was asked
(a bad option, a model that cannot be loaded, inputs that do not fit). Errors are one line
on stderr; ``--debug`` adds the traceback. Documented in docs/cli.md.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
import tempfile
import textwrap
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

import fxopt
from fxopt.errors import FxoptError, InputError, PassError
from fxopt.factory import load_factory
from fxopt.profiling import cli as profiling_cli
from fxopt.progress import set_progress

#: what --dtype accepts, and how to make a random example input of it
DTYPES: dict[str, tuple[torch.dtype, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]]] = {
    **{name: (getattr(torch, name), lambda shape, dt: torch.randn(shape, dtype=dt))
       for name in ("float32", "float16", "bfloat16", "float64")},
    **{name: (getattr(torch, name), lambda shape, dt: torch.randint(0, 10, shape, dtype=dt))
       for name in ("int64", "int32")},
}

WIDTH = 100


def _width() -> int:
    """Columns for tables: the terminal's, at most 100 (and 100 when not a terminal)."""
    return min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


# --- fxopt passes ---------------------------------------------------------------------

def pass_table(width: int = WIDTH) -> str:
    """Every registered pass with its one-line description and its options, wrapped."""
    passes = fxopt.registered_passes()
    col = max(map(len, passes)) + 2
    lines = []
    for name, cls in passes.items():
        text = _plain(cls.description()) + (" [inference only]" if cls.inference_only else "")
        lines += textwrap.wrap(text, width, initial_indent=name.ljust(col),
                               subsequent_indent=" " * col) or [name]
        for key, opt in cls.options.items():
            kind = "|".join(map(str, opt.choices)) if opt.choices else opt.type.__name__
            head = f"{key}=<{kind}> (default {opt.default!r})"
            lines += textwrap.wrap(f"{head}: {_plain(opt.doc)}" if opt.doc else head, width,
                                   initial_indent=" " * (col + 2), subsequent_indent=" " * (col + 6))
    return "\n".join(lines)


def _plain(text: str) -> str:
    """Docstring markup (``code``, :func:`name`) as plain text for a terminal."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", text)


def _cmd_passes(args: argparse.Namespace) -> int:
    print(pass_table(_width()))
    return 0


# --- fxopt optimize -------------------------------------------------------------------

def _shape(text: str) -> tuple[int, ...]:
    parts = text.replace("x", ",").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected sizes like 1,3,224,224")
    return dims


def _example_inputs(args: argparse.Namespace, model: Any) -> tuple[Any, ...]:
    if args.input_shape:
        dtype, make = DTYPES[args.dtype]
        return tuple(make(shape, dtype) for shape in args.input_shape)
    recorded = getattr(model, "example_inputs", None)  # an ExportedProgram keeps its own
    if isinstance(model, torch.export.ExportedProgram) and recorded and not recorded[1]:
        return tuple(recorded[0])
    raise InputError("give the model's example input shapes: --input-shape 1,3,224,224 "
                     "(once per input)")


def _for_inference(model: Any) -> Any:
    """Eval mode for what the factory built (this command optimizes for inference). A
    ``torch.export`` module cannot switch: it keeps the mode it was exported in."""
    if isinstance(model, torch.nn.Module):
        try:
            model.eval()
        except NotImplementedError:
            pass
    return model


def _cmd_optimize(args: argparse.Namespace) -> int:
    from fxopt.factory import build_model

    model = _for_inference(build_model(args.target))
    inputs = _example_inputs(args, model)
    gm = fxopt.optimize(model, passes=args.passes or None, example_inputs=inputs, verify=args.verify)
    _print_table(args, gm)
    if args.report:
        _write_report(args, gm, args.report)
    if args.save:
        from fxopt.saving import save_program

        where, kind = save_program(gm, args.save, inputs, format=args.save_format)
        how = ("torch.export program: torch.export.load" if kind == "pt2"
               else "torch.fx code and weights: fxopt.saving.load_program")
        _say(args, f"saved {where} ({how})")
    return 0


def _print_table(args: argparse.Namespace, gm: Any) -> None:
    if not args.quiet:
        print(fxopt.report_of(gm).table(width=_width()))


def _write_report(args: argparse.Namespace, gm: Any, path: str) -> None:
    from fxopt.visualize import write_report

    write_report(gm, path)
    _say(args, f"report written to {path}")


def _say(args: argparse.Namespace, line: str) -> None:
    if not args.quiet:
        print(line)


# --- fxopt demo -----------------------------------------------------------------------

def _cmd_demo(args: argparse.Namespace) -> int:
    from fxopt.models import demo_model

    model, inputs = demo_model()
    # memory planning only records a plan: it adds the memory chart to the report
    passes = [*fxopt.DEFAULT_PIPELINE, "plan_memory"]
    _say(args, textwrap.fill(f"fxopt demo: {type(model).__name__} traced with torch.fx.symbolic_trace, "
                             f"passes {', '.join(passes)}, verify=True", _width()) + "\n")
    gm = fxopt.optimize(model, passes=passes, example_inputs=inputs, verify=True)
    _print_table(args, gm)
    if not args.no_report:
        report = args.report or str(Path(tempfile.mkdtemp(prefix="fxopt-demo-")) / "report.html")
        _write_report(args, gm, report)
    error = (gm(*inputs) - model(*inputs)).abs().max().item()
    _say(args, f"\nmax |optimized - original| on the example input: {error:.2e}")
    return 0


# --- the parser -----------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line (``fxopt optimize: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_FORMAT = argparse.RawDescriptionHelpFormatter

_OPTIMIZE_HELP = """\
Build a model with a factory, run a pass pipeline over it and print the per-pass table.

TARGET is package.module:factory or path/to/file.py:factory. The factory takes no
arguments and returns an nn.Module, a torch.fx GraphModule, a torch.export
ExportedProgram or its .module(); modules are put in eval mode (the passes are for
inference) and traced with torch.fx.symbolic_trace."""

_OPTIMIZE_EPILOG = """\
examples:
  fxopt optimize mypkg.models:make_model --input-shape 1,3,224,224 --verify
  fxopt optimize model.py:build --input-shape 8,128 --dtype int64 --passes "cse,dce"
  fxopt optimize model.py:build --input-shape 1,16 --save out.pt2 --report out.html

--save writes OUT.pt2 (torch.export.save) when torch.export captures the optimized
program, else the folder OUT/ (GraphModule.to_folder: module.py with the code,
state_dict.pt with the weights; the folder may be moved); it prints which. Read
either back with fxopt.saving.load_program(path). Loading the folder runs its
Python (module.py, pickled submodules): load only folders you trust. Details:
docs/cli.md."""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="print nothing but errors; no progress bars")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    parser = _Parser(
        prog="fxopt", parents=[common], formatter_class=_FORMAT,
        description="Composable, verifiable optimization passes over torch.fx GraphModules.",
        epilog="examples:\n  fxopt demo\n  fxopt passes\n"
               "  fxopt optimize model.py:build --input-shape 1,3,224,224 --verify\n\n"
               "Run `fxopt COMMAND --help` for a command's options; docs/cli.md has the details.")
    parser.add_argument("--version", action="version",
                        version=f"fxopt {fxopt.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("passes", parents=[common], help="list the registered passes and their options",
                   description="List every registered pass: its one-line description, whether "
                               "it is inference-only, and its options with types and defaults."
                   ).set_defaults(fn=_cmd_passes)

    opt = sub.add_parser("optimize", parents=[common], formatter_class=_FORMAT,
                         help="optimize a model built by MODULE:FACTORY",
                         description=_OPTIMIZE_HELP, epilog=_OPTIMIZE_EPILOG)
    opt.add_argument("target", metavar="TARGET", help="package.module:factory or file.py:factory")
    opt.add_argument("-i", "--input-shape", action="append", type=_shape, default=[], metavar="SHAPE",
                     help="shape of one example input, e.g. 1,3,224,224; repeat for each input "
                          "(an ExportedProgram's own example inputs are used if none is given)")
    opt.add_argument("--dtype", default="float32", choices=DTYPES, metavar="DTYPE",
                     help=f"dtype of the example inputs: {', '.join(DTYPES)} (default float32; "
                          "integer inputs are drawn from 0..9)")
    opt.add_argument("-p", "--passes", metavar="PIPELINE",
                     help='textual pipeline, e.g. "cse,dce" or "quantize{mode=int8_dynamic}" '
                          "(default: fxopt.DEFAULT_PIPELINE; `fxopt passes` lists them)")
    opt.add_argument("--verify", action="store_true",
                     help="after each pass, lint the graph and compare it with the one before")
    opt.add_argument("--report", metavar="HTML", help="write the per-pass HTML report here")
    opt.add_argument("--save", metavar="PATH",
                     help="write the optimized program: PATH.pt2, or the folder PATH (see below)")
    opt.add_argument("--save-format", choices=("auto", "pt2", "code"), default="auto",
                     help="auto (default): .pt2 when torch.export can, else code; pt2 or code: only that")
    opt.set_defaults(fn=_cmd_optimize)

    demo = sub.add_parser("demo", parents=[common], help="optimize the bundled demo model",
                          description="Optimize the bundled demo model (conv, BN, residual, "
                                      "dropout, linear) with the default pipeline and memory "
                                      "planning, verified after each pass; print the table and "
                                      "write the HTML report.")
    demo.add_argument("--report", metavar="HTML",
                      help="where to write the HTML report (default: a new temporary folder)")
    demo.add_argument("--no-report", action="store_true", help="do not write the HTML report")
    demo.set_defaults(fn=_cmd_demo)

    profiling_cli.add_subcommand(sub, _shape, load_factory, parents=[common])
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.quiet = getattr(args, "quiet", False)
    debug = getattr(args, "debug", False)
    torch_log = logging.getLogger("torch")
    log_level = torch_log.level
    with warnings.catch_warnings():  # all settings here are undone on return (in-process use)
        if not debug:  # torch's deprecation chatter and logged tracebacks are not the user's business
            torch_log.setLevel(logging.CRITICAL)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
        if args.quiet:
            set_progress(False)
        try:
            return args.fn(args)
        except FxoptError as exc:
            if debug:
                traceback.print_exc()
            print(f"fxopt: error: {_one_line(exc)}", file=sys.stderr)
            return 1 if isinstance(exc, PassError) else 2
        except KeyboardInterrupt:
            return 130
        except Exception as exc:
            if debug:
                raise
            print(f"fxopt: internal error: {type(exc).__name__}: {_one_line(exc)} "
                  "(run again with --debug for the traceback)", file=sys.stderr)
            return 1
        finally:
            torch_log.setLevel(log_level)
            set_progress(None)


if __name__ == "__main__":
    sys.exit(main())
