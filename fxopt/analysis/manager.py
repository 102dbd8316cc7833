"""Lazily computed, cached analyses with explicit invalidation.

An analysis is a function ``(gm, ctx) -> result`` registered under a name. Passes list
the analyses they need in ``Pass.requires`` and read them with ``ctx.analysis(name)``;
each is computed at most once until a pass that changed the graph invalidates it. A
pass keeps an analysis alive by listing it in ``Pass.preserves`` (a promise the pass
makes: preserving ``shapes`` means every node it created carries ``meta['val']``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.fx as fx

# imported for their registrations: the manager sits above the analyses it runs
from fxopt.analysis import alias, liveness, shapes, structure  # noqa: F401
from fxopt.analysis.registry import analysis_function, analysis_names, register_analysis
from fxopt.errors import AnalysisError

__all__ = ["AnalysisManager", "register_analysis", "registered_analyses"]


def registered_analyses() -> list[str]:
    """The names of every registered analysis (the built-in ones included)."""
    return analysis_names()


class AnalysisManager:
    """Caches analysis results for one GraphModule during one PassManager run."""

    def __init__(self, gm: fx.GraphModule, ctx: Any):
        self.gm = gm
        self.ctx = ctx
        self._cache: dict[str, Any] = {}
        #: how many times each analysis was computed (tests and reports read this)
        self.compute_counts: dict[str, int] = {}

    def get(self, name: str) -> Any:
        if name not in self._cache:
            fn = analysis_function(name)
            if fn is None:
                raise AnalysisError(name, f"unknown analysis (known: {', '.join(analysis_names())})")
            self._cache[name] = fn(self.gm, self.ctx)
            self.compute_counts[name] = self.compute_counts.get(name, 0) + 1
        return self._cache[name]

    def invalidate(self, preserved: Iterable[str] = ()) -> None:
        """Drop every cached result except those in ``preserved`` ("*" keeps all)."""
        keep = set(preserved)
        if "*" in keep:
            return
        self._cache = {k: v for k, v in self._cache.items() if k in keep}
