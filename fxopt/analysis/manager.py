"""Lazily computed, cached analyses with explicit invalidation.

An analysis is a function ``(gm, ctx) -> result`` registered under a name. Passes list
the analyses they need in ``Pass.requires`` and read them with ``ctx.analysis(name)``;
each is computed at most once until a pass that changed the graph invalidates it. A
pass keeps an analysis alive by listing it in ``Pass.preserves`` (a promise the pass
makes: preserving ``shapes`` means every node it created carries ``meta['val']``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxopt.errors import AnalysisError

if TYPE_CHECKING:
    from fxopt.context import PassContext

AnalysisFn = Callable[[fx.GraphModule, "PassContext"], Any]
_ANALYSES: dict[str, AnalysisFn] = {}


def register_analysis(name: str) -> Callable[[AnalysisFn], AnalysisFn]:
    """Decorator: register ``fn(gm, ctx)`` as the analysis called ``name``."""

    def decorate(fn: AnalysisFn) -> AnalysisFn:
        _ANALYSES[name] = fn
        return fn

    return decorate


def registered_analyses() -> list[str]:
    _load_builtin_analyses()
    return sorted(_ANALYSES)


def _load_builtin_analyses() -> None:
    # imported for their registrations; local import avoids a cycle with this module
    from fxopt.analysis import alias, liveness, shapes, structure  # noqa: F401


class AnalysisManager:
    """Caches analysis results for one GraphModule during one PassManager run."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        _load_builtin_analyses()
        self.gm = gm
        self.ctx = ctx
        self._cache: dict[str, Any] = {}
        #: how many times each analysis was computed (tests and reports read this)
        self.compute_counts: dict[str, int] = {}

    def get(self, name: str) -> Any:
        if name not in self._cache:
            fn = _ANALYSES.get(name)
            if fn is None:
                raise AnalysisError(name, f"unknown analysis (known: {', '.join(sorted(_ANALYSES))})")
            self._cache[name] = fn(self.gm, self.ctx)
            self.compute_counts[name] = self.compute_counts.get(name, 0) + 1
        return self._cache[name]

    def invalidate(self, preserved: Iterable[str] = ()) -> None:
        """Drop every cached result except those in ``preserved`` ("*" keeps all)."""
        keep = set(preserved)
        if "*" in keep:
            return
        self._cache = {k: v for k, v in self._cache.items() if k in keep}
