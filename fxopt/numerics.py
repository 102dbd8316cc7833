"""Comparing outputs of two graphs: per-dtype tolerances and nested structures.

Used by the PassManager's verify-each mode and by ``fxopt.testing``. Tolerances follow
torch's own model-level checks: loose enough for reassociation (a fused kernel sums in
another order), tight enough to catch a wrong epsilon or a dropped bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: (rtol, atol) per dtype, close to what torch's model-level tests use
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-7, 1e-7),
}


def tolerance_for(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))  # integers and bools: exact
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


@dataclass
class Mismatch:
    """Where and how two outputs differ; ``path`` is like ``out[1]['logits']``."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def compare(expected: Any, actual: Any, rtol: float | None = None, atol: float | None = None,
            path: str = "out") -> Mismatch | None:
    """The first difference between two (nested) outputs, or None if they match.

    NaNs in the same positions match. Structure (types, lengths, dict keys) must match.
    """
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return Mismatch(path, f"expected {type(expected).__name__}, got {type(actual).__name__}")
        return _compare_tensors(expected, actual, rtol, atol, path)
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(expected) != list(actual):
            keys = list(actual) if isinstance(actual, dict) else type(actual).__name__
            return Mismatch(path, f"expected dict with keys {list(expected)}, got {keys}")
        for key in expected:
            found = compare(expected[key], actual[key], rtol, atol, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            got = f"{type(actual).__name__} of length {len(actual)}" if isinstance(actual, (list, tuple)) else type(actual).__name__
            return Mismatch(path, f"expected {type(expected).__name__} of length {len(expected)}, got {got}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            found = compare(e, a, rtol, atol, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float) and isinstance(actual, float):
        r, a = tolerance_for(torch.float64, rtol, atol)
        ok = (expected != expected and actual != actual) or abs(expected - actual) <= a + r * abs(expected)
        return None if ok else Mismatch(path, f"expected {expected}, got {actual}")
    if expected != actual:
        return Mismatch(path, f"expected {expected!r}, got {actual!r}")
    return None


def _compare_tensors(expected: torch.Tensor, actual: torch.Tensor, rtol: float | None,
                     atol: float | None, path: str) -> Mismatch | None:
    if expected.shape != actual.shape:
        return Mismatch(path, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if expected.dtype != actual.dtype:
        return Mismatch(path, f"dtype {actual.dtype} != expected {expected.dtype}")
    r, a = tolerance_for(expected.dtype, rtol, atol)
    e, x = expected.detach().cpu(), actual.detach().cpu()
    if e.is_floating_point() or e.is_complex():
        if torch.allclose(x, e, rtol=r, atol=a, equal_nan=True):
            return None
        bad = ~torch.isclose(x, e, rtol=r, atol=a, equal_nan=True)
        diff = (x.to(torch.float64) - e.to(torch.float64)).abs().nan_to_num(float("inf"))
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        return Mismatch(path, f"{int(bad.sum())}/{e.numel()} elements differ (rtol={r}, atol={a}); "
                              f"max abs diff {diff.max().item():.3g}; first at index {index}: "
                              f"expected {e[index].item():.6g}, got {x[index].item():.6g}")
    if torch.equal(x, e):
        return None
    index = tuple(int(i) for i in torch.nonzero(x != e)[0])
    return Mismatch(path, f"values differ; first at index {index}: expected {e[index].item()}, got {x[index].item()}")
