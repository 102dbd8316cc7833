"""Run-time guards that passes put in a graph when they specialize it to its example inputs.

A pass such as ``inplace`` decides from the example inputs' dtypes (``y = x * 2 + b`` may
write ``x * 2`` in place only if no type promotion happens); called later with inputs of
another dtype, the specialized graph would silently return another dtype than eager.
The guard makes that a typed error instead. Under ``torch.compile`` the guard runs once
at trace time on fake tensors and leaves no node behind (Dynamo guards dtypes itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxopt.errors import InputError


def check_input_dtypes(*inputs: Any, expected: Sequence[torch.dtype | None], names: Sequence[str],
                       pass_name: str) -> None:
    """Raise :class:`InputError` when a tensor input's dtype is not the one the graph was
    specialized for."""
    for value, want, name in zip(inputs, expected, names):
        if want is not None and isinstance(value, torch.Tensor) and value.dtype != want:
            raise InputError(
                f"input {name!r} is {value.dtype}, but pass {pass_name!r} specialized this graph "
                f"for {want}: run fxopt.optimize again with example inputs of this dtype")


def add_dtype_guard(gm: fx.GraphModule, pass_name: str) -> None:
    """Insert (once) a guard on the dtypes the placeholders had during optimization."""
    graph = gm.graph
    if any(n.target is check_input_dtypes for n in graph.nodes):
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    expected = tuple(n.meta["val"].dtype if isinstance(n.meta.get("val"), torch.Tensor) else None
                     for n in placeholders)
    if not any(expected):
        return
    anchor = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(None):
        graph.call_function(check_input_dtypes, tuple(placeholders),
                            {"expected": expected, "names": tuple(n.name for n in placeholders),
                             "pass_name": pass_name})
