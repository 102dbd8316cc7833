"""The registry of analyses: names to functions ``(gm, ctx) -> result``.

A leaf module: analyses register themselves here and the
:class:`~fxopt.analysis.manager.AnalysisManager` looks them up, so the manager can import
the built-in analyses and they never import the manager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

#: ``fn(gm, ctx)``; ``ctx`` is the run's :class:`fxopt.context.PassContext`
AnalysisFn = Callable[[fx.GraphModule, Any], Any]
_ANALYSES: dict[str, AnalysisFn] = {}


def register_analysis(name: str) -> Callable[[AnalysisFn], AnalysisFn]:
    """Decorator: register ``fn(gm, ctx)`` as the analysis called ``name``."""

    def decorate(fn: AnalysisFn) -> AnalysisFn:
        _ANALYSES[name] = fn
        return fn

    return decorate


def analysis_function(name: str) -> AnalysisFn | None:
    """The function registered as ``name`` (None if there is none)."""
    return _ANALYSES.get(name)


def analysis_names() -> list[str]:
    """Every registered name, sorted."""
    return sorted(_ANALYSES)
