"""Models named on the command line: ``package.module:factory`` or ``path/to/file.py:factory``.

The factory is called with no arguments and returns what :func:`fxopt.optimize` takes: an
``nn.Module``, a ``GraphModule`` (``symbolic_trace``, ``make_fx``, an ``ExportedProgram``'s
``.module()``) or an ``ExportedProgram``. Every way this can go wrong is a
:class:`fxopt.errors.FactoryError` that says which; the exception behind it, if any, is
its ``__cause__``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from fxopt.errors import FactoryError

Model = nn.Module | torch.export.ExportedProgram


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``spec`` (``MODULE:NAME`` or ``FILE.py:NAME``), not yet called."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise FactoryError(f"expected MODULE:FACTORY or FILE.py:FACTORY, got {spec!r}")
    module = _import_file(where) if where.endswith(".py") or "/" in where else _import_module(where)
    try:
        factory = getattr(module, name)
    except AttributeError:
        raise FactoryError(f"{where!r} has no attribute {name!r}") from None
    if not callable(factory):
        raise FactoryError(f"{spec} is not callable (it is of type {type(factory).__name__}); "
                           "name a function or class that returns a model")
    return factory


def build_model(spec: str) -> Model:
    """Call the factory named by ``spec``; its model, checked to be one fxopt takes."""
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as exc:
        raise FactoryError(f"{spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, (nn.Module, torch.export.ExportedProgram)):
        raise FactoryError(f"{spec} returned a {type(model).__name__}; expected an nn.Module, "
                           "a GraphModule or a torch.export ExportedProgram")
    return model


def _import_file(path: str) -> ModuleType:
    file = Path(path)
    if not file.is_file():
        raise FactoryError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None:
        raise FactoryError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise FactoryError(f"importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str) -> ModuleType:
    try:
        _import_top_level_from_cwd(name.partition(".")[0])
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name + ".").startswith(exc.name + "."):  # it, not a dependency
            raise FactoryError(f"no module named {name!r} (run from the folder that holds it, "
                               "or give FILE.py:FACTORY)") from exc
        raise FactoryError(f"importing {name} raised ModuleNotFoundError: {exc}") from exc
    except Exception as exc:
        raise FactoryError(f"importing {name} raised {type(exc).__name__}: {exc}") from exc


def _import_top_level_from_cwd(top: str) -> None:
    """``python -m`` semantics: a module or package in the current folder comes first, as
    if the folder led ``sys.path``; found and imported without adding the folder to
    ``sys.path``, which every later import of the process (in any thread) would see."""
    if top in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(top, [str(Path.cwd())])
    if spec is None or spec.loader is None:
        return  # not in the current folder: an ordinary import finds it, or says it is missing
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[top]
        raise
