"""Comparing outputs of two graphs: per-dtype tolerances and nested structures.

Used by the PassManager's verify-each mode and by ``fxopt.testing``. Tolerances follow
torch's own model-level checks: loose enough for reassociation (a fused kernel sums in
another order), tight enough to catch a wrong epsilon or a dropped bias.

Half precision (float16, bfloat16) cannot be judged by fixed tolerances: its rounding
error (``2**-8`` relative in bfloat16) is larger than many real changes of the function
(relu against ``leaky_relu(0.001)``, exact against tanh-approximated gelu, a LayerNorm
epsilon). There, given a *reference* (the original graph run in float64), an output is
judged element by element against the error the original itself makes in that dtype:
``|actual - reference| <= K * (|expected - reference| + rms(expected - reference)) +
eps * |reference|`` with ``K =`` :data:`LOW_PRECISION_ERROR_FACTOR` and ``eps`` the
dtype's machine epsilon. ``fxopt.testing`` adds a second, exact-arithmetic check
(:func:`exact_mismatch`: the rewrite run in float64 against the original in float64).

Other dtypes, or explicit ``rtol``/``atol``, use fixed tolerances; where those are
missed, a rewrite no farther from the float64 truth than the original (root-mean-square
error within :data:`REFERENCE_ERROR_FACTOR`) still passes, as in torch's accuracy checks.
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


#: how much farther from the float64 reference (RMSE) a rewrite may be than the original
REFERENCE_ERROR_FACTOR = 3.0

#: half precision: how many times the original's own error (per element, plus its
#: root-mean-square over the tensor) a rewrite's error may reach. Identity-preserving
#: passes over the zoo reach at most 4.2 (fp16 and bf16, default pipeline and fusions;
#: tests/testing/test_low_precision.py); a dropped or changed op goes far above.
LOW_PRECISION_ERROR_FACTOR = 8.0

#: float64 runs of an exact rewrite and of its original agree to within this, relative
#: to ``|reference| + rms(reference)`` (float32-level, so kernels that compute float64
#: in float32 internally still pass)
EXACT_RTOL = 1e-5


def is_low_precision(dtype: torch.dtype) -> bool:
    """Floating dtypes coarser than float32 (float16, bfloat16, float8 formats)."""
    return dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def tolerance_for(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))  # integers and bools: exact
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


@dataclass
class Mismatch:
    """Where and how two outputs differ; ``path`` is like ``out[1]['logits']``."""

    path: str
    message: str
    #: True when types, lengths, keys, shapes or dtypes differ (rather than values)
    structural: bool = False
    #: True when only a comparison against the float64 reference shows the difference
    against_reference: bool = False

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def compare(expected: Any, actual: Any, rtol: float | None = None, atol: float | None = None,
            path: str = "out", reference: Any = None) -> Mismatch | None:
    """The first difference between two (nested) outputs, or None if they match.

    NaNs in the same positions match. Structure (types, lengths, dict keys) must match.
    ``reference``, when given, is ``expected`` computed in higher precision (same
    structure); floating tensors that miss the tolerance still match if ``actual`` is
    about as close to it as ``expected`` is.
    """
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return Mismatch(path, f"expected {type(expected).__name__}, got {type(actual).__name__}", True)
        ref = reference if isinstance(reference, torch.Tensor) else None
        return _compare_tensors(expected, actual, rtol, atol, path, ref)
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(expected) != list(actual):
            keys = list(actual) if isinstance(actual, dict) else type(actual).__name__
            return Mismatch(path, f"expected dict with keys {list(expected)}, got {keys}", True)
        for key in expected:
            sub = reference[key] if isinstance(reference, dict) and key in reference else None
            found = compare(expected[key], actual[key], rtol, atol, f"{path}[{key!r}]", sub)
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            got = f"{type(actual).__name__} of length {len(actual)}" if isinstance(actual, (list, tuple)) else type(actual).__name__
            return Mismatch(path, f"expected {type(expected).__name__} of length {len(expected)}, got {got}", True)
        refs = reference if isinstance(reference, (list, tuple)) and len(reference) == len(expected) else [None] * len(expected)
        for i, (e, a, r) in enumerate(zip(expected, actual, refs)):
            found = compare(e, a, rtol, atol, f"{path}[{i}]", r)
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
                     atol: float | None, path: str, reference: torch.Tensor | None = None) -> Mismatch | None:
    if expected.shape != actual.shape:
        return Mismatch(path, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}", True)
    if expected.dtype != actual.dtype:
        return Mismatch(path, f"dtype {actual.dtype} != expected {expected.dtype}", True)
    r, a = tolerance_for(expected.dtype, rtol, atol)
    e, x = expected.detach().cpu(), actual.detach().cpu()
    if (is_low_precision(e.dtype) and rtol is None and atol is None and reference is not None
            and reference.shape == e.shape):
        return _low_precision_mismatch(e, x, reference.detach().cpu(), path)
    if e.is_floating_point() or e.is_complex():
        if torch.allclose(x, e, rtol=r, atol=a, equal_nan=True):
            return None
        if reference is not None and reference.shape == e.shape and _as_close_to_reference(e, x, reference):
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


def _as_close_to_reference(expected: torch.Tensor, actual: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``actual`` is about as close to the high-precision ``reference`` as
    ``expected`` is: same non-finite positions and values, and a root-mean-square error
    at most :data:`REFERENCE_ERROR_FACTOR` times the original's (plus one rounding step)."""
    ref = reference.detach().cpu().to(torch.complex128 if reference.is_complex() else torch.float64)
    e, x = expected.to(ref.dtype), actual.to(ref.dtype)
    finite = e.isfinite()
    if not torch.equal(finite, x.isfinite()) or not torch.equal(e[~finite].nan_to_num(), x[~finite].nan_to_num()):
        return False
    finite &= ref.isfinite()
    if not finite.any():
        return True
    rms_ref = ref[finite].abs().pow(2).mean().sqrt()
    rms_e = (e - ref)[finite].abs().pow(2).mean().sqrt()
    rms_x = (x - ref)[finite].abs().pow(2).mean().sqrt()
    eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else torch.finfo(torch.float32).eps
    return bool(rms_x <= REFERENCE_ERROR_FACTOR * rms_e + eps * rms_ref)


def _low_precision_mismatch(expected: torch.Tensor, actual: torch.Tensor, reference: torch.Tensor,
                            path: str) -> Mismatch | None:
    """Judge a half-precision output by the original's own error against float64 (see the
    module doc); non-finite values must match the original's exactly."""
    ref = reference.to(torch.float64)
    e, x = expected.to(torch.float64), actual.to(torch.float64)
    finite = e.isfinite()
    if not torch.equal(finite, x.isfinite()) or not torch.equal(e[~finite].nan_to_num(), x[~finite].nan_to_num()):
        bad = (finite != x.isfinite()) | (~finite & (e.nan_to_num() != x.nan_to_num()))
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        return Mismatch(path, f"non-finite values differ; first at index {index}: expected "
                              f"{e[index].item():.6g}, got {x[index].item():.6g}")
    finite &= ref.isfinite()
    own = (e - ref).abs().where(finite, 0.0)
    error = (x - ref).abs().where(finite, 0.0)
    scale = own.pow(2).sum().div(max(int(finite.sum()), 1)).sqrt()
    eps = torch.finfo(expected.dtype).eps
    allowed = LOW_PRECISION_ERROR_FACTOR * (own + scale) + eps * ref.abs().where(finite, 0.0)
    bad = error > allowed
    if not bad.any():
        return None
    index = tuple(int(i) for i in torch.nonzero(bad)[0])
    return Mismatch(path, f"{int(bad.sum())}/{e.numel()} elements are farther from the float64 "
                          f"result than {LOW_PRECISION_ERROR_FACTOR:g}x the original's own {expected.dtype} "
                          f"error allows; first at index {index}: float64 {ref[index].item():.6g}, "
                          f"original {e[index].item():.6g}, rewrite {x[index].item():.6g}",
                    against_reference=not bool((~torch.isclose(x, e, *tolerance_for(expected.dtype))).any()))


def exact_mismatch(reference: Any, rewritten: Any, path: str = "out") -> Mismatch | None:
    """The first float64 output of a rewrite that differs from the original's float64
    output by more than :data:`EXACT_RTOL` (relative to ``|reference| + rms(reference)``):
    with rounding out of the way, an exact rewrite agrees to float32 precision or better."""
    refs = torch.utils._pytree.tree_leaves(reference)
    outs = torch.utils._pytree.tree_leaves(rewritten)
    if len(refs) != len(outs):
        return None  # structure is compared elsewhere
    for i, (r, x) in enumerate(zip(refs, outs)):
        if not (isinstance(r, torch.Tensor) and isinstance(x, torch.Tensor) and r.dtype == x.dtype
                == torch.float64 and r.shape == x.shape):
            continue
        r, x = r.detach().cpu(), x.detach().cpu()
        finite = r.isfinite() & x.isfinite()
        if not finite.any():
            continue
        scale = r[finite].pow(2).mean().sqrt()
        diff = (x - r).abs().where(finite, 0.0)
        bad = diff > EXACT_RTOL * (r.abs().where(finite, 0.0) + scale)
        if bad.any():
            index = tuple(int(j) for j in torch.nonzero(bad)[0])
            return Mismatch(f"{path}-leaf[{i}]" if len(refs) > 1 else path,
                            f"run in float64, the rewrite differs from the original by up to "
                            f"{diff.max().item():.3g} ({int(bad.sum())}/{r.numel()} elements beyond "
                            f"{EXACT_RTOL:g} relative; first at index {index}: original "
                            f"{r[index].item():.9g}, rewrite {x[index].item():.9g}): it does not compute "
                            "the same function, though in low precision rounding may hide it",
                            against_reference=True)
    return None
