"""Quantization for fxopt: observers, calibration, the ``insert_observers`` and ``quantize``
passes, quantization-aware training (``prepare_qat``/``convert_qat``), int8 ops that lower through Inductor (Triton weight-only GEMV/GEMM on CUDA), and
an accuracy report. See README section "Quantization". ``set_int8_tuning(True)`` (or
``FXOPT_INT8_TUNE=1``) times the int8 kernels per shape instead of using their defaults."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxopt.quant import ops  # noqa: F401  (registers torch.ops.fxopt_quant)
from fxopt.quant.accuracy import AccuracyReport, accuracy_report, cosine, max_abs, sqnr
from fxopt.quant.calibrate import calibrate
from fxopt.quant.fake_quant import ActivationFakeQuant, DynamicFakeQuant, WeightFakeQuant
from fxopt.quant.int8_configs import set_int8_tuning
from fxopt.quant.observers import (
    OBSERVERS,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageObserver,
    Observer,
)
from fxopt.quant.passes import (
    INT8_MODES,
    MODES,
    SUMMARY_KEY,
    InsertObservers,
    Quantize,
    QuantSummary,
    SiteRecord,
)
from fxopt.quant.qat import PrepareQAT, QATModel, convert_qat, prepare_qat
from fxopt.quant.sites import SPELLINGS, Site, find_sites

__all__ = [
    "INT8_MODES", "MODES", "OBSERVERS", "SPELLINGS", "AccuracyReport", "ActivationFakeQuant",
    "DynamicFakeQuant", "HistogramObserver", "InsertObservers", "MinMaxObserver",
    "MovingAverageObserver", "Observer", "PrepareQAT", "QATModel", "QuantSummary", "Quantize",
    "Site", "SiteRecord", "WeightFakeQuant", "accuracy_report", "calibrate", "convert_qat",
    "cosine", "find_sites", "max_abs", "prepare_qat", "quantize_model", "set_int8_tuning", "sqnr",
    "summary_of",
]


def summary_of(gm: fx.GraphModule) -> QuantSummary:
    """The coverage summary (every site, its mode or skip reason) of the last quantize run."""
    try:
        return gm.meta[SUMMARY_KEY]
    except KeyError:
        raise KeyError("this GraphModule has not been through the quantize pass") from None


def quantize_model(model: torch.nn.Module | fx.GraphModule, example_inputs: Sequence[Any],
                   mode: str = "int8_weight_only", *, calibration_data: Iterable[Any] | None = None,
                   observer: str = "minmax", progress: bool | None = None,
                   **options: Any) -> fx.GraphModule:
    """Quantize ``model`` in one call; returns a new GraphModule (the model is untouched).

    ``options`` go to both passes (``skip``, ``keep_first_last``, ``overrides``, and
    ``per_channel``/``dynamic_min_tokens`` for quantize). ``int8_static`` needs
    ``calibration_data`` (an iterable of input tuples or tensors).
    """
    selection = {k: options.pop(k) for k in ("skip", "keep_first_last", "overrides") if k in options}
    gm = model
    if mode == "int8_static" or "int8_static" in selection.get("overrides", ""):
        gm = _run(model, InsertObservers(mode=mode, observer=observer, **selection), example_inputs)
        calibrate(gm, [] if calibration_data is None else calibration_data, progress=progress)
    return _run(gm, Quantize(mode=mode, **selection, **options), example_inputs)


def _run(model: Any, pass_: Any, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """``fxopt.optimize`` with one pass; a pass skipped for a training-mode model is an error
    here (the caller asked for quantization, not for a report line)."""
    from fxopt.errors import InputError
    from fxopt.optimize import optimize, report_of

    result = optimize(model, [pass_], example_inputs=example_inputs)
    skipped = report_of(result).records[-1].skipped
    if skipped:
        raise InputError(f"quantize_model: {pass_.name} was skipped ({skipped}); "
                         "call model.eval() first")
    return result
