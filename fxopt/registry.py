"""The registry of named passes.

Built-in passes register themselves with :func:`register_pass` when their module is
imported; a module is imported on the first lookup of one of its passes
(:data:`BUILTIN_PASSES`), so that ``import fxopt`` and a lookup stay cheap. Users register
their own passes with the same decorator.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import TypeVar

from fxopt.errors import UnknownPassError
from fxopt.pass_protocol import Pass

#: where each stock pass is defined (its module registers it with ``register_pass`` when
#: imported): a lookup by name imports only the module it needs, so that asking for "dce"
#: does not load quantization, patterns and memory planning. tests/spine/test_registry_lazy.py
#: checks this table against what the modules register.
BUILTIN_PASSES: dict[str, str] = {
    "remove_dropout": "fxopt.passes.cleanup",
    "eliminate_identity": "fxopt.passes.cleanup",
    "constant_fold": "fxopt.passes.cleanup",
    "cse": "fxopt.passes.cleanup",
    "dce": "fxopt.passes.cleanup",
    "fold_conv_bn": "fxopt.patterns.stock",
    "fuse_conv_bn_relu": "fxopt.patterns.stock",
    "fuse_add_relu": "fxopt.patterns.stock",
    "fuse_linear_relu": "fxopt.patterns.stock",
    "fuse_linear_gelu": "fxopt.patterns.stock",
    "inplace": "fxopt.passes.inplace",
    "channels_last_weights": "fxopt.passes.layout",
    "pad_conv_channels": "fxopt.passes.layout",
    "pad_group_width": "fxopt.passes.group_width",
    "defer_sdpa_choice": "fxopt.compile.attention",
    "plan_memory": "fxopt.memory.plan",
    "insert_observers": "fxopt.quant.passes",
    "quantize": "fxopt.quant.passes",
    "fuse_swiglu": "fxopt.quant.merge",
    "merge_sibling_linears": "fxopt.quant.merge",
}

_REGISTRY: dict[str, type[Pass]] = {}

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
        home = BUILTIN_PASSES.get(key)
        if home is not None and klass.__module__ != home:
            importlib.import_module(home)  # the stock pass first: replacing it is then explicit
        existing = _REGISTRY.get(key)
        if existing is not None and existing is not klass and not replace and (
            existing.__qualname__ != klass.__qualname__ or existing.__module__ != klass.__module__
        ):
            raise ValueError(f"a pass named {key!r} is already registered ({existing.__qualname__})")
        _REGISTRY[key] = klass
        return klass

    return decorate(cls) if cls is not None else decorate


def get_pass_class(name: str) -> type[Pass]:
    """The registered class for ``name``; unknown names list the closest registered ones."""
    if name not in _REGISTRY and name in BUILTIN_PASSES:
        importlib.import_module(BUILTIN_PASSES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        known = {*_REGISTRY, *BUILTIN_PASSES}
        raise UnknownPassError(name, difflib.get_close_matches(name, known, n=3, cutoff=0.5)) from None


def registered_passes() -> dict[str, type[Pass]]:
    """All registered passes by name, sorted (imports every stock pass module)."""
    for module in dict.fromkeys(BUILTIN_PASSES.values()):
        importlib.import_module(module)
    return dict(sorted(_REGISTRY.items()))
