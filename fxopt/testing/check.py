"""``check_pass``: run passes on a graph and assert that the result is equivalent.

On failure, with an artifacts directory, it leaves what a person needs to debug the
rewrite: a runnable repro of the *minimized* failing graph, that graph's code, the
unified diff of the graph before and after the passes (and an SVG of it when
``fxopt.visualize.render_diff`` is available), and the error message.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.fx as fx
import torch.nn as nn

from fxopt.errors import EquivalenceError, FxoptError
from fxopt.numerics import exact_mismatch, is_low_precision
from fxopt.testing.equivalence import _run_float64, _tensors, _widen, assert_equivalent, to_float64
from fxopt.testing.inputs import random_inputs
from fxopt.testing.minimize import minimize, node_count, pass_breaks
from fxopt.testing.repro import write_repro
from fxopt.testing.zoo import CaseInstance


def check_pass(passes: Any, model: CaseInstance | fx.GraphModule | nn.Module,
               inputs: Sequence[Any] | None = None, *, rtol: float | None = None,
               atol: float | None = None, seed: int = 0, artifacts: str | Path | None = None,
               minimize_seconds: float = 60.0, name: str | None = None) -> fx.GraphModule:
    """Run ``passes`` (anything ``fxopt.optimize`` accepts) on a copy of ``model`` and
    assert the result computes the same function; return the optimized GraphModule.

    ``model`` may be a zoo case instance (the ``fx_case`` fixture: its inputs and
    tolerances are used unless given), a GraphModule or an ``nn.Module`` (traced).
    ``inputs`` default to random ones drawn from the graph's placeholders; the result is
    also compared on a second, fresh draw that the passes never saw. With
    ``artifacts`` set, a failure writes ``repro.py``, ``minimized_graph.py``,
    ``diff.txt`` (and ``diff.svg``) and ``error.txt`` under ``artifacts/<name>/``.
    """
    from fxopt.optimize import as_graph_module, optimize

    if isinstance(model, CaseInstance):
        inputs = model.inputs if inputs is None else inputs
        override = model.case.tolerances.get(model.dtype)  # else the dtype's own rules apply
        if override is not None:
            rtol = override[0] if rtol is None else rtol
            atol = override[1] if atol is None else atol
        name = name or model.name
        gm = model.gm
    else:
        gm = as_graph_module(model)
    if inputs is None:
        inputs = random_inputs(gm, seed=seed)
    inputs = tuple(inputs)
    optimized = optimize(gm, passes=passes, example_inputs=inputs)
    try:
        assert_equivalent(gm, optimized, inputs, rtol=rtol, atol=atol, seed=seed)
        fresh = _fresh_inputs(gm, seed + 1)
        if fresh is not None:  # inputs the passes never saw: catches baked-in example values
            assert_equivalent(gm, optimized, fresh, rtol=rtol, atol=atol, seed=seed)
        if rtol is None and atol is None:
            _check_in_float64(gm, passes, inputs, seed)
    except EquivalenceError as exc:
        if artifacts is not None:
            where = write_artifacts(Path(artifacts) / _safe(name or "check_pass"), gm, optimized,
                                    inputs, passes, exc, rtol=rtol, atol=atol,
                                    minimize_seconds=minimize_seconds)
            exc.args = (f"{exc.args[0]}\nartifacts (repro.py, minimized graph, diff): {where}",)
        raise
    return optimized


def _check_in_float64(gm: fx.GraphModule, passes: Any, inputs: tuple[Any, ...], seed: int) -> None:
    """For a half-precision graph: the same passes over its float64 twin must compute the
    original's float64 function to float32 precision. Folded constants are then computed
    exactly, so this also judges the passes that create constants, which the half-precision
    comparison can only judge to within rounding. Skipped where the passes or the graph do
    not run in float64."""
    from fxopt.optimize import optimize

    if not any(is_low_precision(t.dtype) for t in [*_tensors(inputs), *_tensors(gm)]):
        return
    wide = to_float64(gm)
    wide_inputs = tuple(_widen(x) for x in inputs)
    reference, pure = _run_float64(wide, wide_inputs, seed)
    if reference is None or not pure:
        return
    try:
        wide_optimized = optimize(wide, passes=passes, example_inputs=wide_inputs)
    except FxoptError:
        return
    rewritten, pure = _run_float64(wide_optimized, wide_inputs, seed)
    mismatch = exact_mismatch(reference, rewritten) if rewritten is not None and pure else None
    if mismatch is not None:
        raise EquivalenceError(f"the passes change the function of the graph's float64 twin: {mismatch}",
                               mismatch=mismatch)


def _fresh_inputs(gm: fx.GraphModule, seed: int) -> tuple[Any, ...] | None:
    try:
        return random_inputs(gm, seed=seed)
    except FxoptError:  # placeholders without shapes: only the given inputs can be used
        return None


def _names(passes: Any) -> str:
    items = passes if isinstance(passes, (list, tuple)) else [passes]
    return ", ".join(getattr(p, "__name__", None) or getattr(p, "name", None) or str(p) for p in items)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "case"


def write_artifacts(directory: Path, before: fx.GraphModule, after: fx.GraphModule,
                    inputs: Sequence[Any], passes: Any, error: BaseException, *,
                    rtol: float | None = None, atol: float | None = None,
                    minimize_seconds: float = 60.0) -> Path:
    """Write the debugging artifacts of a failed check into ``directory``."""
    from fxopt.optimize import optimize

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "error.txt").write_text(f"{type(error).__name__}: {error}\n")
    small, small_inputs = before, tuple(inputs)
    try:
        small = minimize(before, pass_breaks(passes, rtol=rtol, atol=atol),
                         example_inputs=inputs, time_limit=minimize_seconds)
        small_inputs = random_inputs(small)
    except Exception as exc:  # the full graph still makes a repro
        (directory / "error.txt").open("a").write(f"\nnot minimized: {type(exc).__name__}: {exc}\n")
    title = (f"fxopt repro: passes {_names(passes)} break this graph "
             f"({node_count(small)} nodes, minimized from {node_count(before)})")
    write_repro(directory / "repro.py", small, small_inputs, passes, rtol=rtol, atol=atol, title=title)
    (directory / "minimized_graph.py").write_text(f"# {title}\n{small.code}")
    try:
        small_after = optimize(small, passes=passes, example_inputs=small_inputs)
    except Exception:
        small, small_after = before, after
    diff = difflib.unified_diff(small.code.splitlines(), small_after.code.splitlines(),
                                "before.py", "after.py", lineterm="")
    (directory / "diff.txt").write_text("\n".join(diff) + "\n")
    _render_diff(directory / "diff.svg", small, small_after)
    return directory


def _render_diff(path: Path, before: fx.GraphModule, after: fx.GraphModule) -> None:
    """An SVG of the diff, when fxopt.visualize is installed and ``dot`` runs."""
    try:
        from fxopt.visualize import render_diff
        render_diff(before, after, path)
    except Exception:  # no renderer: the textual diff is there
        return
