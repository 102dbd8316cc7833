"""Concrete inputs for a graph, read off its placeholders' ``meta['val']``.

Graphs from ``torch.export``, ``make_fx``, Dynamo, fxopt's shape analysis and
``fxopt.testing.strategies.fx_graphs`` carry a (fake) value on every placeholder; that
is all it takes to draw fresh inputs. Values are finite and of moderate size (standard
normal floats, small non-negative integers, which are safe as indices into small
dimensions), so a graph that is valid on its example inputs is valid on these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxopt.errors import InputError


@dataclass(frozen=True)
class InputSpec:
    """What one placeholder takes: a tensor of ``shape`` and ``dtype``, or a fixed constant."""

    name: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    constant: Any = None

    def make(self, generator: torch.Generator, scale: float = 1.0) -> Any:
        if self.dtype is None:
            return self.constant
        if self.dtype.is_floating_point or self.dtype.is_complex:
            value = torch.randn(self.shape, generator=generator, dtype=_wide(self.dtype)) * scale
            return value.to(self.dtype)
        if self.dtype is torch.bool:
            return torch.randint(0, 2, self.shape, generator=generator).bool()
        return torch.randint(0, 4, self.shape, generator=generator).to(self.dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128 if dtype == torch.complex128 else torch.complex64
    return torch.float64 if dtype == torch.float64 else torch.float32


def input_specs(gm: fx.GraphModule) -> list[InputSpec]:
    """One :class:`InputSpec` per placeholder, or InputError naming the placeholder that
    says nothing about what it takes."""
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(val, torch.Tensor):
            try:
                shape = tuple(int(d) for d in val.shape)
            except (TypeError, ValueError, RuntimeError):
                raise InputError(f"cannot generate inputs: placeholder {node.name!r} has a symbolic "
                                 f"shape {tuple(val.shape)} without a size hint; pass inputs=(...)") from None
            specs.append(InputSpec(node.name, shape, val.dtype))
        elif isinstance(val, (bool, int, float, str)) or val is None and node.args:
            specs.append(InputSpec(node.name, constant=val if val is not None else node.args[0]))
        else:
            what = "no meta['val']" if val is None else f"a meta['val'] of type {type(val).__name__}"
            raise InputError(
                f"cannot generate inputs: placeholder {node.name!r} has {what}; pass inputs=(...), "
                "or propagate shapes first (fxopt.optimize(..., example_inputs=...) does)")
    return specs


def random_inputs(gm: fx.GraphModule, seed: int = 0, scale: float = 1.0) -> tuple[Any, ...]:
    """Fresh inputs for ``gm``, reproducible from ``seed``."""
    specs = input_specs(gm)
    generator = torch.Generator().manual_seed(seed)
    return tuple(spec.make(generator, scale) for spec in specs)
