"""Run code when a module is imported, without importing it: keeps ``import fxopt`` cheap.

fxopt teaches heavy subsystems about its ops (Inductor's decomposition table, for one),
but importing Inductor costs seconds and most runs never compile. :func:`after_import`
defers such set-up to the moment the module is imported, by fxopt or by anyone else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once ``module`` is imported: now if it already is, else just
    after its code has run (the first ``import`` of it then sees the set-up done)."""
    if module in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _Hook(module, callback))


class _Hook(importlib.abc.MetaPathFinder):
    """A finder that answers for one module only: it lets the other finders find it, and
    wraps the loader so that ``callback`` runs right after the module executes."""

    def __init__(self, module: str, callback: Callable[[], None]):
        self.module, self.callback = module, callback

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_call(module: ModuleType) -> None:
                exec_module(module)
                self.callback()

            spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec
