"""The registry of named passes.

Built-in passes register themselves with :func:`register_pass` when their module is
imported; the modules are imported lazily on the first lookup so that ``import fxopt``
stays cheap. Users register their own passes with the same decorator.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import TypeVar

from fxopt.errors import UnknownPassError
from fxopt.pass_protocol import Pass

#: modules whose import registers the stock passes (each calls ``register_pass``)
BUILTIN_PASS_MODULES: tuple[str, ...] = (
    "fxopt.passes.cleanup",
    "fxopt.patterns.stock",
    "fxopt.passes.inplace",
    "fxopt.passes.layout",
    "fxopt.memory.plan",
    "fxopt.quant.passes",
    "fxopt.quant.merge",
)

_REGISTRY: dict[str, type[Pass]] = {}
_loaded = False

P = TypeVar("P", bound=type[Pass])


def register_pass(cls: P | None = None, *, name: str | None = None, replace: bool = False) -> P | Callable[[P], P]:
    """Class decorator: make a :class:`Pass` subclass available by name.

    Registering a second, different class under a taken name is an error unless
    ``replace=True``: silently shadowing a stock pass would be a debugging nightmare.
    """

    def decorate(klass: P) -> P:
        key = name or klass.name
        if not key:
            raise ValueError(f"{klass.__name__} has no name; set the class attribute `name`")
        klass.name = key
        existing = _REGISTRY.get(key)
        if existing is not None and existing is not klass and not replace and (
            existing.__qualname__ != klass.__qualname__ or existing.__module__ != klass.__module__
        ):
            raise ValueError(f"a pass named {key!r} is already registered ({existing.__qualname__})")
        _REGISTRY[key] = klass
        return klass

    return decorate(cls) if cls is not None else decorate


def _ensure_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_PASS_MODULES:
            importlib.import_module(module)


def get_pass_class(name: str) -> type[Pass]:
    """The registered class for ``name``; unknown names list the closest registered ones."""
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPassError(name, difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.5)) from None


def registered_passes() -> dict[str, type[Pass]]:
    """All registered passes by name, sorted."""
    _ensure_builtins()
    return dict(sorted(_REGISTRY.items()))
